"""The batch job: discover shards, run each as a task, record what it cost."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tokenmill import call_costs, prediction, progress, timeline
from tokenmill.engines import engine_scope
from tokenmill.flows.fleet import dispatch_to_pool
from tokenmill.flows.gate import GateFailed, as_measured_here, run_gate
from tokenmill.gate import chosen_model
from tokenmill.results import ShardResult
from tokenmill.shards import ShardSpec
from tokenmill.tasks.engine import choose_engine_task
from tokenmill.tasks.index import build_index_task
from tokenmill.tasks.job import PrefectJob
from tokenmill.tasks.record import JobRecord, end_run_hook, open_run_task, predict_task, record_run_task
from tokenmill.tasks.server import prepare_server_job
from tokenmill.tasks.shards import (
    discover_shards_task,
    reject_duplicates_task,
    run_shards,
    state_storage,
    write_manifest_task,
)
from tokenmill.tracking import log_gate_run, log_progress


# The job's MLflow run ends FAILED or KILLED with the flow; FINISHED in record_run_task.
@flow(name="tokenmill-batch", on_failure=[end_run_hook], on_crashed=[end_run_hook], on_cancellation=[end_run_hook])
def batch_flow(spec: PrefectJob) -> JobRecord:
    """Embed or generate over a corpus of Parquet or JSONL files, shard by shard."""
    with engine_scope():  # engines this flow starts end with it
        timeline.begin_job()
        call_costs.forget()  # calls an earlier job of this process left unstored are not this job's
        timeline.mark("flow_started")
        logger = get_run_logger()
        started = time.perf_counter()
        run_id = open_run_task(spec)  # RUNNING from now on, so the MLflow UI shows the live job
        if prediction.made_for(spec) is None and spec.dispatch == "local":
            # called as a library, not by `tokenmill run`: predicted here, once the run is open (bad input
            # found by the prediction's corpus sample then ends the run FAILED with its reason)
            predict_task(spec)
        gate_report = None
        if spec.gate is not None:
            timeline.mark("gate_start")  # tokenmill.prediction: the gate's seconds, apart from the flow's start
            gate_report = run_gate(spec, record=False)  # its tasks in this flow run, not a subflow's
            timeline.mark("gate_verdict_kept" if gate_report.cached else "gate_measured")
            gate_report = as_measured_here(gate_report)
            timeline.forget("engine_start", "engine_ready")  # the gate's engines'; the corpus's marks its own
            if gate_report.action == "fail":
                log_gate_run(spec, gate_report)
                raise GateFailed(gate_report.message())
            if gate_report.action == "reference":
                logger.warning("%s; running the corpus with the reference %s",
                               gate_report.declined or "no candidate passed the gate", gate_report.reference.model)
            spec = spec.model_copy(update={"model": chosen_model(spec, gate_report)})
        spec = prepare_server_job(spec)  # stop_by fixed; an openai-server checked before any shard
        shards = discover_shards_task(spec)
        engine_choice = None
        if spec.model.engine == "auto" and spec.dispatch == "local":  # a fleet's workers choose on their GPUs
            engine_choice = choose_engine_task(spec, shards)
        expected = [s.expected_rows for s in shards]
        logger.info("%d shards from %s", len(shards), spec.input)
        progress.emit("job_started", shards=len(shards), rows=None if None in expected else sum(expected))
        progress_id = create_progress_artifact(0.0, key="tokenmill-progress", description="shards finished")

        timeline.mark("shards_start")  # tokenmill.prediction: a finished shard's task, in a run with none to compute
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

        timeline.mark("shards_done")
        results = reject_duplicates_task(spec, shards, results)
        write_manifest_task(spec, results, len(shards))
        if spec.index is not None:  # into the job's run before the record ends it
            timeline.mark("index_start")
            index_report = build_index_task(spec, sum(r.seconds for r in results), run_id)
            timeline.mark("index_done")
            logger.info("\n%s", index_report.markdown())
        timeline.mark("record_started")
        # the job's wall, with its gate's where this run measured that before its prediction (gate.judge_first):
        # the gate is the job's, paid as when it runs in the flow
        wall = time.perf_counter() - started + prediction.gate_ran_first()
        record = record_run_task(spec, results, wall, cached, gate_report=gate_report,
                                 fleet_metrics=fleet.metrics if fleet else None,
                                 fleet_workers=fleet.workers if fleet else None, run_id=run_id,
                                 engine_choice=engine_choice)
        logger.info("\n%s", record.summary)
        timeline.reset()  # the process's next job measures its own fixed seconds
        return record


def _run_here(spec: PrefectJob, shards: list[ShardSpec], progress_id, run_id: str,
              started: float) -> tuple[list[ShardResult], list[str]]:
    """dispatch: local. Every shard in this process, in order, on one engine."""
    finished: list[ShardResult] = []
    cached: list[str] = []

    def shard_done(result: ShardResult, from_cache: bool) -> None:
        finished.append(result)
        if from_cache:
            cached.append(result.shard_id)
            progress.emit("shard_done", shard_id=result.shard_id, result=result, cached=True)
        write_manifest_task(spec, finished, len(shards), final=False)
        log_progress(spec, run_id, finished, cached, time.perf_counter() - started)
        update_progress_artifact(progress_id, 100.0 * len(finished) / len(shards))

    runs = run_shards(spec, shards, on_shard_done=shard_done)
    return runs.results, runs.cached
