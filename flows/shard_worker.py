"""The shard worker: the flow deployed onto GPU pools. It runs a list of a job's shards on
this machine's one engine, each as the same cached task the batch flow runs, so a shard a
preempted worker finished is never run again and one it did not finish is run whole.

It holds a slot of the fleet's global concurrency limit while it works: the cap on GPU
workers at once. The slot is leased; a worker that vanishes frees it when the lease ends.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.concurrency.sync import concurrency
from prefect.runtime import flow_run as runtime_flow_run

from tasks.shards import discover_shards_task, load_shard_list_task, process_shard_task, state_storage
from tokenmill.engines import engine_scope
from tokenmill.dispatch import select_shards
from tokenmill.errors import TokenmillError
from tokenmill.spec import JobSpec


class ShardsFailed(TokenmillError):
    """Some shards of a worker's list failed; the rest were run."""


@flow(name="tokenmill-shard-worker")
def shard_worker_flow(spec: JobSpec = JobSpec(), shard_ids: list[str] | None = None,
                      shard_list: str | None = None) -> dict[str, Any]:
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

    run_shard_task = process_shard_task.with_options(result_storage=state_storage(spec))
    done, cached, failed = [], [], {}
    # the engine ends with the slot: the next flow run on this worker may need the GPU
    with concurrency(spec.fleet.concurrency_limit, occupy=1, lease_duration=spec.fleet.slot_lease_seconds), \
            engine_scope():
        logger.info("holding a slot of concurrency limit %r", spec.fleet.concurrency_limit)
        for shard in work:
            state = run_shard_task(shard, spec, return_state=True)
            if not state.is_completed():
                failed[shard.shard_id] = state.message or state.name
                logger.error("shard %s: %s", shard.shard_id, failed[shard.shard_id])
                continue
            result = state.result()
            done.append(result.shard_id)
            if state.name == "Cached":
                cached.append(result.shard_id)
            logger.info("shard %s%s: %d rows out, %d rejected (%d/%d)", shard.shard_id,
                        " (cached)" if state.name == "Cached" else "", result.rows_out, result.rows_rejected,
                        len(done) + len(failed), len(work))
    if failed:
        raise ShardsFailed(f"{len(failed)} of {len(work)} shards failed: " +
                           "; ".join(f"{k}: {v}" for k, v in list(failed.items())[:5]))
    return {"worker": runtime_flow_run.name, "shards": done, "cached": cached}
