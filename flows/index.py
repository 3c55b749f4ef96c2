"""`tokenmill index`: the index stage alone, over an embed job's existing output."""

from __future__ import annotations

from prefect import flow, get_run_logger

from tokenmill.index import IndexBuildError, IndexReport
from tokenmill.spec import IndexSpec
from tokenmill.tasks.index import build_index_task
from tokenmill.tasks.job import PrefectJob


@flow(name="tokenmill-index")
def index_flow(spec: PrefectJob) -> IndexReport:
    """Build (or reuse) the ANN index under <output>/_index/; without an index section, its defaults."""
    if spec.mode != "embed":
        raise IndexBuildError(f"the job is mode={spec.mode}; an index is built over embeddings (mode: embed)")
    if spec.index is None:
        spec = spec.model_copy(update={"index": IndexSpec()})
    report = build_index_task(spec)
    get_run_logger().info("\n%s", report.markdown())
    return report
