"""Know the cost before and after: `tokenmill calibrate` and `tokenmill plan` as Prefect flows."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from tokenmill.calibrate import (
    DEFAULT_BATCH_SIZES,
    Calibration,
    calibrate,
    plot_calibration,
)
from tokenmill.engines import engine_scope
from tokenmill.errors import TokenmillError
from tokenmill.flows.results import CalibrationRecord, PlanRecord
from tokenmill.index import plan_index
from tokenmill.planning import (
    CorpusEstimate,
    estimate_corpus,
    make_plan,
    plan_markdown,
    plan_metrics,
)
from tokenmill.prediction import predict_job
from tokenmill.tasks.engine import choose_engine_task
from tokenmill.tasks.job import PrefectJob
from tokenmill.tasks.logs import with_core_logs
from tokenmill.tasks.shards import discover_shards_task
from tokenmill.tasks.storage import with_storage_secrets
from tokenmill.tracking import log_stage_run, tracking_client


@task(name="calibrate", cache_policy=NONE)
@with_core_logs
def calibrate_task(spec: PrefectJob, batch_sizes: list[int], sample_rows: int) -> Calibration:
    return calibrate(with_storage_secrets(spec), tuple(batch_sizes), sample_rows)


@task(name="estimate-corpus", cache_policy=NONE)
@with_core_logs
def estimate_corpus_task(spec: PrefectJob, sample_rows: int) -> CorpusEstimate:
    return estimate_corpus(with_storage_secrets(spec), sample_rows)


@flow(name="tokenmill-calibrate")
def calibrate_flow(spec: PrefectJob, batch_sizes: list[int] = list(DEFAULT_BATCH_SIZES), sample_rows: int = 512,
                   out_dir: str = "calibration") -> CalibrationRecord:
    """Sweep batch sizes on a sample; write calibration.json, calibration.png and batching.yaml to out_dir."""
    logger = get_run_logger()
    with engine_scope():  # the engine ends with the sweep
        result = calibrate_task(spec, batch_sizes, sample_rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(result.model_dump_json(indent=2))
    (out / "batching.yaml").write_text(result.snippet())
    plot = plot_calibration(result, out / "calibration.png")
    tracking_client(spec)  # the stage run's store, created here if this is its first command: the run opens it
    local = predict_job(spec)  # the job on this machine, as `tokenmill plan` and `tokenmill run` predict it
    logger.info("%s\nRecommended (paste into the job file):\n%s\n%s", result.summary(), result.snippet(),
                local.describe())
    create_markdown_artifact(f"```\n{result.summary()}\n```\n\nRecommended:\n\n```yaml\n{result.snippet()}```\n",
                             key="tokenmill-calibration", description="batch-size calibration")
    run_id = log_stage_run(spec, "calibrate", {f"calibrate_{k}": v for k, v in {
        "overhead_s": result.overhead_s, "per_item_s": result.per_item_s, "fit_r2": result.fit_r2,
        "plateau_batch_size": result.plateau_batch_size, "plateau_tokens_per_s": result.plateau_tokens_per_s,
    }.items()}, {"model": result.model, "engine": result.engine, "mode": result.mode,
                 "cliff": f"{result.cliff_batch_size} ({result.cliff_reason})" if result.cliff_batch_size else "none"},
        files=[out / "calibration.json", out / "batching.yaml", plot],
        steps=[(p.batch_size, {"tokens_per_s": p.tokens_per_s, "usd_per_1m_tokens": p.usd_per_1m_tokens,
                               "seconds_per_call": p.seconds_per_call, "peak_memory_gib": p.peak_memory_gib})
               for p in result.points if p.error is None])
    return CalibrationRecord(calibration=result, plot=str(plot), snippet=result.snippet(), mlflow_run_id=run_id,
                             prediction=local.describe())


@flow(name="tokenmill-plan")
def plan_flow(spec: PrefectJob, window_hours: float, tokens_per_s_per_gpu: float | None = None,
              calibration_file: str | None = None, straggler_margin: float = 0.1,
              preemptions_per_gpu_hour: float = 0.05, engine_start_seconds: float = 60.0,
              sample_rows: int = 512) -> PlanRecord:
    """GPUs, finish time and dollars for the corpus inside a window; a markdown artifact and an MLflow run."""
    estimate = estimate_corpus_task(spec, sample_rows)
    choice = None
    if spec.model.engine == "auto" and tokens_per_s_per_gpu is None and not calibration_file:
        with engine_scope():  # engines a first trial starts end with it
            choice = choose_engine_task(spec, discover_shards_task(spec))
    tracking_client(spec)  # the stage run's store, created here if this is its first command: the run opens it
    local = predict_job(spec)  # this machine, one process: the same prediction `tokenmill run` makes
    local_measured = not local.part("engine").is_default
    if tokens_per_s_per_gpu is None:
        if calibration_file:
            calibration = Calibration.model_validate(json.loads(Path(calibration_file).read_text()))
            tokens_per_s_per_gpu = calibration.plateau_tokens_per_s
            source = f"calibrated at batch size {calibration.plateau_batch_size}, {calibration_file}"
        elif local.engine_seconds > 0:  # measured here, else a stated default (a gate's candidate before its verdict)
            tokens_per_s_per_gpu = local.tokens / local.engine_seconds
            source = (f"{local.engine} on this machine"
                      f"{'' if local_measured else ', a default (never measured here: calibrate to measure it)'}: "
                      f"{local.part('engine').source}")
            engine_start_seconds = local.part("engine start").seconds
        else:  # every shard's output is here already: this machine's run would compute nothing to read a rate from
            raise TokenmillError(f"every shard of this job is done here (its outputs under {spec.output}): this "
                                 "machine's prediction computes nothing to read a rate from; give --tokens-per-s, "
                                 "or --calibration from tokenmill calibrate")
    else:
        source = "given"
    plan = make_plan(spec, estimate, tokens_per_s_per_gpu, window_hours, straggler_margin,
                     preemptions_per_gpu_hour, engine_start_seconds)
    text = plan_markdown(plan, estimate, source)
    text += f"\n## On this machine, one process\n\n{local.describe()}\n"
    if choice is not None:
        text += f"\n- engine: {choice.reason}\n"
    index_metrics: dict[str, float] = {}
    if spec.index is not None:  # built after the shards: it adds to the finish
        index_text, index_metrics = plan_index(spec, estimate.rows, plan.finish_hours(), window_hours)
        text += index_text
    get_run_logger().info("\n%s", text)
    create_markdown_artifact(text, key="tokenmill-plan", description="fleet plan")
    metrics = {**plan_metrics(plan, estimate), **index_metrics}
    metrics.update(plan_local_wall_seconds=local.seconds, plan_local_fixed_seconds=local.fixed_seconds,
                   plan_local_engine_seconds=local.engine_seconds)
    run_id = log_stage_run(spec, "plan", metrics, {"window_hours": window_hours, "rate_source": source,
                                                   "straggler_margin": straggler_margin,
                                                   "preemptions_per_gpu_hour": preemptions_per_gpu_hour},
                           texts={"plan.md": text})
    return PlanRecord(plan=text, metrics=metrics, mlflow_run_id=run_id)
