from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from tokenmill.engines import describe_engine
from tokenmill.manifest import build_manifest
from tokenmill.models import resolve_model
from tokenmill.runner import ShardResult
from tokenmill.spec import JobSpec
from tokenmill.tracking import job_params, log_run, run_metrics, shard_rows, summary_markdown


@task(name="record-run", retries=2, retry_delay_seconds=[2, 10], cache_policy=NONE)
def record_run_task(spec: JobSpec, results: list[ShardResult], wall_seconds: float,
                    cached_shard_ids: list[str] | None = None, tags: dict[str, str] | None = None,
                    gate_report=None, fleet_metrics: dict[str, float] | None = None,
                    fleet_workers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The MLflow run and the Prefect artifacts for one finished job; with a fleet, its
    dispatch rounds, speculative copies and per-worker throughput too."""
    metrics = run_metrics(results, wall_seconds, spec, set(cached_shard_ids or ()), fleet_metrics)
    engine, device = describe_engine(spec)
    params = job_params(spec, engine, resolve_model(spec.model_name), device)
    manifest = build_manifest(spec, results, len(results))
    run_id = log_run(spec, params, metrics, results, manifest, tags, gate_report, fleet_workers)
    summary = summary_markdown(spec, metrics, results)
    if gate_report is not None:
        summary += f"\n```\n{gate_report.message()}\n```\n"
    summary += f"\nMLflow run `{run_id}` in experiment `{spec.tracking.experiment}` at `{spec.tracking.mlflow_tracking_uri}`\n"
    create_markdown_artifact(summary, key="tokenmill-summary", description="tokenmill run summary")
    if results:
        create_table_artifact(shard_rows(results), key="tokenmill-shards", description="one row per shard")
    if fleet_workers:
        create_table_artifact(fleet_workers, key="tokenmill-workers", description="one row per worker run")
    return {"mlflow_run_id": run_id, "metrics": metrics, "summary": summary}
