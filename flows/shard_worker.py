"""The shard worker: the flow deployed onto GPU pools. It runs a list of a job's shards on
this machine's one engine, each as the same cached task the batch flow runs, so a shard a
preempted worker finished is never run again and one it did not finish is run whole.

It holds a slot of the fleet's global concurrency limit while it works: the cap on GPU
workers at once. The slot is leased; a worker that vanishes frees it when the lease ends.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.concurrency.sync import concurrency
from prefect.runtime import flow_run as runtime_flow_run

from tokenmill.dispatch import select_shards
from tokenmill.engines import engine_scope
from tokenmill.errors import TokenmillError
from tokenmill.flows.results import WorkerRecord
from tokenmill.tasks.engine import choose_engine_task
from tokenmill.tasks.job import PrefectJob
from tokenmill.tasks.shards import (
    discover_shards_task,
    load_shard_list_task,
    run_shards,
)


class ShardsFailed(TokenmillError):
    """Some shards of a worker's list failed; the rest were run."""


@flow(name="tokenmill-shard-worker")
def shard_worker_flow(spec: PrefectJob, shard_ids: list[str] | None = None,
                      shard_list: str | None = None) -> WorkerRecord:
    """Run these shards of the job, in this order, on one engine.

    shard_list: the orchestrator's shard list (`<output>/_state/shards-*.json`); without it
    the worker lists the corpus itself. No shard_ids: every shard of the job.
    """
    logger = get_run_logger()
    if shard_list:
        shards = load_shard_list_task(spec, shard_list)
        source = shard_list
    else:
        shards = discover_shards_task(spec)
        source = spec.input
    work = select_shards(shards, shard_ids, source) if shard_ids is not None else shards
    logger.info("%d shards to run (of %d in %s)", len(work), len(shards), source)

    # the engine ends with the slot: the next flow run on this worker may need the GPU
    with concurrency(spec.fleet.concurrency_limit, occupy=1, lease_duration=spec.fleet.slot_lease_seconds), \
            engine_scope():
        logger.info("holding a slot of concurrency limit %r", spec.fleet.concurrency_limit)
        if spec.model.engine == "auto" and work:  # trials on this device, before the first shard task starts
            choose_engine_task(spec, work)       # the straggler clock (a worker measuring is not late)
        runs = run_shards(spec, work, keep_going=True)
    if runs.failed:
        raise ShardsFailed(f"{len(runs.failed)} of {len(work)} shards failed: " +
                           "; ".join(f"{k}: {v}" for k, v in list(runs.failed.items())[:5]))
    return WorkerRecord(worker=runtime_flow_run.name, shards=[r.shard_id for r in runs.results], cached=runs.cached)
