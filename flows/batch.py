"""The batch job: discover shards, run each as a task, record what it cost."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.fleet import dispatch_to_pool
from flows.gate import GateFailed, gate_flow
from tasks.record import end_run_hook, open_run_task, record_run_task
from tasks.shards import (
    discover_shards_task,
    process_shard_task,
    reject_duplicates_task,
    state_storage,
    write_manifest_task,
)
from tokenmill import progress
from tokenmill.gate import candidate_model
from tokenmill.runner import ShardResult
from tokenmill.shards import ShardSpec
from tokenmill.engines import engine_scope
from tokenmill.spec import JobSpec
from tokenmill.tracking import log_gate_run, log_progress


# The job's MLflow run ends FAILED or KILLED with the flow; FINISHED in record_run_task.
@flow(name="tokenmill-batch", on_failure=[end_run_hook], on_crashed=[end_run_hook], on_cancellation=[end_run_hook])
def batch_flow(spec: JobSpec = JobSpec()) -> dict[str, Any]:
    """Embed or generate over a corpus of Parquet or JSONL files, shard by shard."""
    with engine_scope():  # engines this flow starts end with it
        logger = get_run_logger()
        started = time.perf_counter()
        run_id = open_run_task(spec)  # RUNNING from now on, so the MLflow UI shows the live job
        gate_report = None
        if spec.gate is not None:
            gate_report = gate_flow(spec, record=False)
            if gate_report.action == "fail":
                log_gate_run(spec, gate_report)
                raise GateFailed(gate_report.message())
            chosen = candidate_model(spec) if gate_report.action == "candidate" else spec.gate.reference
            if gate_report.action == "reference":
                logger.warning("the candidate failed the gate; running the corpus with the reference %s",
                               gate_report.reference.model)
            spec = spec.model_copy(update={"model": chosen})
        shards = discover_shards_task(spec)
        expected = [s.expected_rows for s in shards]
        logger.info("%d shards from %s", len(shards), spec.input)
        progress.emit("job_started", shards=len(shards), rows=None if None in expected else sum(expected))
        progress_id = create_progress_artifact(0.0, key="tokenmill-progress", description="shards finished")

        fleet = None
        if spec.dispatch == "pool":
            fleet = dispatch_to_pool(spec, shards, state_storage(spec))
            results, cached = fleet.results, fleet.cached
            for result in results:
                progress.emit("shard_done", shard_id=result.shard_id, result=result, cached=result.shard_id in cached)
            write_manifest_task(spec, results, len(shards), final=False)
            update_progress_artifact(progress_id, 100.0)
        else:
            results, cached = _run_here(spec, shards, progress_id, run_id, started)

        results = reject_duplicates_task(spec, shards, results)
        write_manifest_task(spec, results, len(shards))
        record = record_run_task(spec, results, time.perf_counter() - started, cached, gate_report=gate_report,
                                 fleet_metrics=fleet.metrics if fleet else None,
                                 fleet_workers=fleet.workers if fleet else None, run_id=run_id)
        logger.info("\n%s", record["summary"])
        return record


def _run_here(spec: JobSpec, shards: list[ShardSpec], progress_id, run_id: str,
              started: float) -> tuple[list[ShardResult], list[str]]:
    """dispatch: local. Every shard in this process, in order, on one engine."""
    logger = get_run_logger()
    run_shard_task = process_shard_task.with_options(result_storage=state_storage(spec))
    results, cached = [], []
    for done, shard in enumerate(shards, start=1):
        state = run_shard_task(shard, spec, return_state=True)
        result = state.result()  # raises the shard's error if it failed
        results.append(result)
        from_cache = state.name == "Cached"
        if from_cache:
            cached.append(result.shard_id)
            progress.emit("shard_done", shard_id=shard.shard_id, result=result, cached=True)
        write_manifest_task(spec, results, len(shards), final=False)
        log_progress(spec, run_id, results, cached, time.perf_counter() - started)
        update_progress_artifact(progress_id, 100.0 * done / len(shards))
        logger.info("shard %s%s: %d rows out, %d rejected (%d/%d shards)", shard.shard_id,
                    " (cached)" if from_cache else "", result.rows_out, result.rows_rejected,
                    done, len(shards))
    return results, cached
