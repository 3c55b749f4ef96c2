"""The job's MLflow run from the Prefect side: opened when the flow starts, tagged with its
flow run, ended by the record at the end or by the flow's failure hooks."""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from pydantic import BaseModel

from tokenmill import prediction, timeline
from tokenmill.engine_choice import ran_as
from tokenmill.engines import describe_engine, running_streams
from tokenmill.manifest import build_manifest
from tokenmill.models import resolve_model
from tokenmill.report import run_metrics, summary_markdown
from tokenmill.results import ShardResult
from tokenmill.server_record import sharing_record
from tokenmill.spec import JobSpec
from tokenmill.tasks.logs import with_core_logs
from tokenmill.tasks.storage import with_storage_secrets
from tokenmill.tracking import (
    end_job_run,
    job_params,
    log_run,
    open_job_run,
    resolve_tracking_uri,
    spec_params,
)

# Prefect flow-run id -> (job spec, its open MLflow run): what the failure hooks end.
_open_runs: dict[str, tuple[JobSpec, str]] = {}



class JobRecord(BaseModel):
    """tokenmill-batch: the job's MLflow run, where it went, its figures and its summary."""

    mlflow_run_id: str
    mlflow_tracking_uri: str
    metrics: dict[str, float]
    summary: str
    gate_verdict: str = ""  # with an eval gate: which model ran the corpus, and what it saved


def prefect_api_configured() -> bool:
    """A Prefect API someone runs (a server or Prefect Cloud, named by PREFECT_API_URL), as
    opposed to the ephemeral API a bare `tokenmill run` starts for itself and stops."""
    from prefect.settings import PREFECT_API_URL

    from tokenmill.tasks.warm import temporary_api_url

    url = PREFECT_API_URL.value()
    return bool(url) and url != temporary_api_url()


def prefect_tags() -> dict[str, str]:
    """The flow run that ran the job: its id always (the ephemeral API keeps it in the local
    Prefect database that `prefect server start` serves), its UI URL only with a configured API."""
    from prefect.runtime import flow_run

    if not flow_run.id:
        return {}
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": flow_run.name}
    if prefect_api_configured() and flow_run.ui_url:
        tags["prefect.flow_run_url"] = flow_run.ui_url
    return tags



def orchestration_params(spec: JobSpec) -> dict[str, Any]:
    """How Prefect ran the job: dispatch, worker lists and the workers' deployment."""
    dispatch = getattr(spec, "dispatch", "local")
    params: dict[str, Any] = {"dispatch": dispatch, "workers": spec.fleet.workers if dispatch == "pool" else 1}
    if dispatch == "pool":
        params["fleet_deployment"] = spec.fleet.deployment
    return params


@task(name="open-run", retries=2, retry_delay_seconds=[2, 10], cache_policy=NONE)
def open_run_task(spec: JobSpec) -> str:
    """The job's MLflow run, RUNNING from now on; closes runs of this job that a killed
    process left RUNNING. With an eval gate the model's params wait for its verdict."""
    from prefect.runtime import flow_run

    params = {**spec_params(spec, with_model=spec.gate is None), **orchestration_params(spec)}
    run_id = open_job_run(spec, prefect_tags(), params, run_name=spec.tracking.run_name or flow_run.name)
    if flow_run.id:
        _open_runs[str(flow_run.id)] = (spec, run_id)
    get_run_logger().info("MLflow run %s in experiment %s at %s", run_id, spec.tracking.experiment,
                          resolve_tracking_uri(spec))
    return run_id


@task(name="predict", cache_policy=NONE)
@with_core_logs
def predict_task(spec: JobSpec) -> None:
    """The job's prediction where a library call (not `tokenmill run`) starts the flow: a task, so what its
    corpus sample logs (a storage retry, a bad file) reaches the run's log as the shards' reads do; it reads
    the corpus with the job's storage block, as they do."""
    get_run_logger().info("%s", prediction.predict_job(with_storage_secrets(spec)).describe())


def end_run_hook(flow, flow_run, state) -> None:
    """on_failure, on_crashed and on_cancellation of the batch flow: its open run ends FAILED
    (the job raised) or KILLED (crashed or cancelled)."""
    opened = _open_runs.pop(str(flow_run.id), None)
    if opened is None:
        return
    spec, run_id = opened
    end_job_run(spec, run_id, "FAILED" if state.is_failed() else "KILLED",
                f"{state.name}: {state.message or 'no message'}")


def engine_tokens(metrics: dict[str, float]) -> float:
    """The tokens the engine computed: the output's, less those the row cache answered or collapse copied."""
    delivered = metrics.get("input_tokens", 0) + metrics.get("output_tokens", 0)
    return metrics.get("engine_tokens", delivered)


def fixed_and_steady(metrics: dict[str, float]) -> dict[str, float]:
    """This process's fixed seconds (to its first engine call, in parts) and the steady tokens/s
    after it, apart: a short job is decided by the first, a long one by the second."""
    now = time.time()
    costs = timeline.fixed_costs(now)
    first_call = timeline.marks().get("first_engine_call")
    if first_call is not None and now > first_call:
        costs["steady_tokens_per_s"] = engine_tokens(metrics) / (now - first_call)
    return costs


def predicted_against_measured_wall(spec: JobSpec, engine: str, engine_choice, metrics: dict[str, float],
                                    results: list[ShardResult], cached: set[str], gate_report=None) -> dict[str, float]:
    """The prediction this process made before the job ran (tokenmill.prediction), beside what the run
    measured; then this run's measured parts are stored for the next prediction on this engine here."""
    predicted = prediction.made_for(spec)
    if predicted is None:
        return {}
    fresh = [r for r in results if r.shard_id not in cached]
    engine_rows = sum(r.rows_out - r.rows_from_cache - r.rows_collapsed for r in fresh)
    trials_ran = engine_choice is not None and not engine_choice.cached and bool(engine_choice.trials)
    rows_read = sum(r.rows_out + r.rows_rejected for r in fresh)  # what the shards read, tokenized and wrote
    trial_engine_seconds = sum(t.wall_seconds for t in engine_choice.trials) if trials_ran else 0.0
    gate_samples = None  # what a measuring gate's models spent on their samples: apart from its other seconds
    if gate_report is not None and not gate_report.cached:
        gate_samples = sum(c.seconds + c.untimed_seconds
                           for c in [gate_report.reference, *(v.cost for v in gate_report.candidates)])
    prediction.remember_run(spec, engine, metrics, engine_rows, trials_ran, rows_read, trial_engine_seconds,
                            shards_read=len(fresh), gate_samples=gate_samples,
                            shards_finished=len(results) - len(fresh))
    get_run_logger().info("%s", predicted.describe())
    compared = prediction.compare(predicted, metrics, ran=spec.model if gate_report is not None else None)
    prediction.remember_track(compared)
    return compared


def shard_table(spec: JobSpec, results: list[ShardResult], cached: set[str]) -> list[dict[str, Any]]:
    """The tokenmill-shards artifact: a row per shard as a person reads it in the Prefect UI, words for
    headers, padding in percent, throughput per shard (MLflow's shards.json keeps the raw figures)."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"shard": r.shard_id, "rows in": r.rows_in, "rows out": r.rows_out,
                               "rejected": r.rows_rejected, "truncated": r.rows_truncated}
        if spec.mode == "generate":
            row.update({"tokens in": r.input_tokens, "tokens out": r.output_tokens})
            if spec.generation.response_format is not None:
                row["invalid outputs"] = r.structured_invalid_rows
        else:
            row["tokens"] = r.input_tokens
        tokens = r.input_tokens + r.output_tokens
        row.update({"tokens/s": round(tokens / r.seconds) if r.seconds > 0 else 0, "seconds": round(r.seconds, 1),
                    "padding": f"{r.padding_fraction:.1%}", "cached": "yes" if r.shard_id in cached else "no"})
        rows.append(row)
    return rows


@task(name="record-run", retries=2, retry_delay_seconds=[2, 10], cache_policy=NONE)
def record_run_task(spec: JobSpec, results: list[ShardResult], wall_seconds: float,
                    cached_shard_ids: list[str] | None = None, tags: dict[str, str] | None = None,
                    gate_report=None, fleet_metrics: dict[str, float] | None = None,
                    fleet_workers: list[dict[str, Any]] | None = None, run_id: str | None = None,
                    engine_choice=None) -> JobRecord:
    """The job's totals into its MLflow run (`run_id` from open_run_task; without it, a new
    run), which ends FINISHED, and the Prefect artifacts; with a fleet, its dispatch rounds,
    speculative copies and a table of per-worker throughput too."""
    from prefect.runtime import flow_run

    metrics = run_metrics(results, wall_seconds, spec, set(cached_shard_ids or ()), fleet_metrics)
    ran = ran_as(spec)
    engine, device = describe_engine(ran)
    if spec.model.engine == "auto" and engine_choice is None:  # a fleet: each worker chose on its device
        engine = ",".join(sorted({r.engine for r in results if r.engine})) or engine
    params = {**job_params(spec, engine, resolve_model(spec.model_name), device), **orchestration_params(spec)}
    streams = running_streams(resolve_model(spec.model_name), ran) if ran is not None else None
    if streams is not None:  # what the engine ran at, whatever cpu_streams asked
        params["engine_streams"] = streams
    if engine_choice is not None:  # engine: auto, and why it ran on this engine
        params.update(engine_choice.params())
        metrics.update(engine_choice.metrics())
    server_params, server_metrics, server_lines = sharing_record(spec, metrics)  # openai-server; sunk GPUs
    params.update(server_params)
    metrics.update(server_metrics)
    metrics.update(fixed_and_steady(metrics))
    metrics.update(predicted_against_measured_wall(spec, engine, engine_choice, metrics, results,
                                                   set(cached_shard_ids or ()), gate_report))
    job_tokens = metrics.get("input_tokens", 0.0) + metrics.get("output_tokens", 0.0)
    if gate_report is not None:  # at the gate's measured rates, against running the corpus on the reference
        metrics["gate_usd_saved"] = gate_report.usd_saved(job_tokens)
    manifest = build_manifest(spec, results, len(results))
    run_id = log_run(spec, params, metrics, results, manifest, tags, gate_report, fleet_workers, run_id=run_id)
    if flow_run.id:
        _open_runs.pop(str(flow_run.id), None)
    uri = resolve_tracking_uri(spec)
    summary = summary_markdown(spec, metrics, results)
    summary += server_lines
    if engine_choice is not None:
        summary += f"- engine: auto chose {engine_choice.reason}\n"
    if gate_report is not None:
        summary += f"- {gate_report.verdict(job_tokens)}\n\n```\n{gate_report.message()}\n```\n"
    summary += f"\nMLflow run `{run_id}` in experiment `{spec.tracking.experiment}` at `{uri}`\n"
    create_markdown_artifact(summary, key="tokenmill-summary", description="tokenmill run summary")
    if results:
        create_table_artifact(shard_table(spec, results, set(cached_shard_ids or ())), key="tokenmill-shards",
                              description="one row per shard")
    if fleet_workers:
        create_table_artifact(fleet_workers, key="tokenmill-workers", description="one row per worker run")
    return JobRecord(mlflow_run_id=run_id, mlflow_tracking_uri=uri, metrics=metrics, summary=summary,
                     gate_verdict=gate_report.verdict(job_tokens) if gate_report is not None else "")
