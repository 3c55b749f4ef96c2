"""One shard's skeleton, for every kind of shard: read → validate → encode (prepare), run on the engine
(started again once, and run again whole, after the engine's process dies), write the outputs, record
the shard. What differs between rows (tokenmill.runner) and OpenAI Batch requests
(tokenmill.openai_batch) are the ShardSteps each gives it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Generic, Protocol, TypeVar

from tokenmill import progress, timeline
from tokenmill.engine_protocol import Engine
from tokenmill.engines import get_engine, with_one_restart
from tokenmill.memory import release_freed_heap
from tokenmill.outputs import OutputStore, record_shard
from tokenmill.resolved_job import ResolvedJob
from tokenmill.results import ShardResult
from tokenmill.shards import ShardSpec


class ShardWork(Protocol):
    """What a shard's prepare step leaves for the rest: rows it starts the engine's part with (progress),
    and how many of them the engine computes (0: no engine is started)."""

    rows: int
    to_run: int


W = TypeVar("W", bound=ShardWork)
R = TypeVar("R")


@dataclass(frozen=True)
class ShardSteps(Generic[W, R]):
    """prepare(shard, job, engine name): read, validate and encode the shard (the engine's name: what the
    row cache keys on), with its rejects so far. run(engine, work, job, shard_id): the engine calls, run
    whole again on a new engine after a death. write(store, shard, job, work, ran, engine name, started):
    the shard's output files and its ShardResult (ran None: the engine ran nothing)."""

    prepare: Callable[[ShardSpec, ResolvedJob, str], W]
    run: Callable[..., R]
    write: Callable[[OutputStore, ShardSpec, ResolvedJob, W, R | None, str, float], ShardResult]


def run_shard_steps(shard: ShardSpec, job: ResolvedJob, engine: Engine | None, steps: ShardSteps[Any, Any]) -> ShardResult:
    """One shard of the resolved job through `steps`, on `engine`, or on the process's engine for the job
    when there is anything to run."""
    started = time.perf_counter()
    timeline.mark("first_shard_started")
    store = OutputStore(job.spec.output, job.spec.storage_options)
    work = steps.prepare(shard, job, engine.name if engine is not None else job.engine)
    if engine is None and work.to_run:
        engine = get_engine(job.model_path, job.spec)  # the engine the job was resolved to
    progress.emit("shard_started", shard_id=shard.shard_id, rows=work.rows)
    ran = None
    if work.to_run:
        timeline.mark("first_engine_call")  # a job's shards only: a gate's sample runs through run_batches too
        ran = with_one_restart(partial(steps.run, work=work, job=job, shard_id=shard.shard_id),
                               engine, job.model_path, job.spec, shard.shard_id)
    result = steps.write(store, shard, job, work, ran, engine.name if engine is not None else job.engine, started)
    record_shard(store, result)
    del work, ran
    release_freed_heap()  # the shard's activations and tables: back to the system, not kept by the heap
    return result
