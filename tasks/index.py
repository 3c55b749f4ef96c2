"""The index stage of an embed job as a Prefect task: the core builds (or reuses) the index, the
task puts its figures on record and in the `tokenmill-index` artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from tokenmill.index import IndexReport, build_index, log_index
from tokenmill.spec import JobSpec
from tokenmill.tasks.logs import with_core_logs
from tokenmill.tasks.storage import with_storage_secrets


# No Prefect cache: the index's own key (the outputs it was built from, under <output>/_index/)
# finds a finished build again, from any machine that sees the output.
@task(name="build-index", cache_policy=NONE)
@with_core_logs
def build_index_task(spec: JobSpec, embed_seconds: float | None = None, run_id: str | None = None) -> IndexReport:
    """Build the job's index from its outputs, or reuse the one built from the same outputs; its
    figures go to the job's MLflow run (`run_id`) or an `index` stage run."""
    report = build_index(with_storage_secrets(spec), embed_seconds)
    log_index(spec, report, run_id)
    create_markdown_artifact(report.markdown(), key="tokenmill-index", description="ANN index: recall and cost")
    return report
