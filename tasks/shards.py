"""Prefect tasks over the core. They take specs and ids, never data, so their inputs hash cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NONE, CachePolicy
from prefect.filesystems import WritableFileSystem
from prefect.runtime import flow_run as runtime_flow_run
from prefect.utilities.callables import get_call_parameters

from tokenmill.audit import reject_cross_shard_duplicates
from tokenmill.digest import stable_digest
from tokenmill.dispatch import read_shard_list, write_shard_list
from tokenmill.engine_choice import chosen_engine, expect_rows
from tokenmill.engines import engine_scope
from tokenmill.errors import InputError
from tokenmill.manifest import build_manifest
from tokenmill.openai_batch import write_batch_files
from tokenmill.outputs import (
    MANIFEST,
    STATE_DIR,
    OutputStore,
    move_stale_outputs,
    remove_leftover_temporaries,
)
from tokenmill.planning import estimate_rows
from tokenmill.prompts import check_job_inputs
from tokenmill.resolution import resolve_job
from tokenmill.results import ShardResult, shard_cache_key
from tokenmill.runner import run_shard
from tokenmill.shards import ShardSpec, discover_shards_for
from tokenmill.spec import JobSpec
from tokenmill.tasks.logs import with_core_logs
from tokenmill.tasks.server import stop_by_passed, stopped_by_deadline, with_server_key
from tokenmill.tasks.storage import StateStorage, with_storage_secrets


@task(name="discover-shards", cache_policy=NONE)
@with_core_logs
def discover_shards_task(spec: JobSpec) -> list[ShardSpec]:
    spec = with_storage_secrets(spec)
    shards = discover_shards_for(spec)
    check_job_inputs(spec, shards)  # a misspelled column fails here, before any engine starts
    empty = sorted({s.uri for s in shards if s.is_empty})
    if len(empty) == len({s.uri for s in shards}):
        raise InputError(spec.input, f"every input file is empty ({', '.join(empty[:5])}"
                                     f"{', ...' if len(empty) > 5 else ''}): there is nothing to run")
    if spec.output_format == "openai-batch" and not any(s.format == "openai-batch" for s in shards):
        raise InputError(spec.input, "output_format: openai-batch answers OpenAI Batch request files, and no input "
                                     "file is one (lines with custom_id, method, url, body)")
    logger = get_run_logger()
    for uri in empty:
        logger.warning("%s has no rows: it is in the manifest with 0 rows and adds nothing", uri)
    return shards


@task(name="load-shard-list", cache_policy=NONE)
@with_core_logs
def load_shard_list_task(spec: JobSpec, uri: str) -> list[ShardSpec]:
    spec = with_storage_secrets(spec)
    return read_shard_list(OutputStore(spec.output, spec.storage_options), uri)


@task(name="write-shard-list", cache_policy=NONE)
@with_core_logs
def write_shard_list_task(spec: JobSpec, shards: list[ShardSpec]) -> str:
    spec = with_storage_secrets(spec)
    return write_shard_list(OutputStore(spec.output, spec.storage_options), shards)


@dataclass
class ShardCachePolicy(CachePolicy):
    """A finished shard is found again by any later run of the same job, on any machine."""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str:
        return shard_cache_key(inputs["shard"], inputs["spec"])


class ResumableShardTask(Task):
    """A shard task that finds its resume storage itself.

    Where a finished shard's result persists depends on the job (beside its outputs, so a
    new machine pointed at the same output finds it), so it cannot be fixed when the task
    is defined. Each call, submit or map attaches it from the `spec` argument; a caller
    that sets `result_storage` with `with_options` keeps theirs.
    """

    def _resumable(self, args: tuple, kwargs: dict[str, Any]) -> Task:
        if self.result_storage is not None:
            return self
        own = {k: v for k, v in kwargs.items() if k in ("shard", "spec")}  # not return_state, wait_for, ...
        spec = get_call_parameters(self.fn, args, own)["spec"]
        spec = getattr(spec, "value", spec)  # unmapped(spec) in a map
        return self.with_options(result_storage=state_storage(spec))

    def __call__(self, *args: Any, **kwargs: Any):
        return Task.__call__(self._resumable(args, kwargs), *args, **kwargs)

    def submit(self, *args: Any, **kwargs: Any):
        return Task.submit(self._resumable(args, kwargs), *args, **kwargs)

    def map(self, *args: Any, **kwargs: Any):
        return Task.map(self._resumable(args, kwargs), *args, **kwargs)


@with_core_logs
def process_shard(shard: ShardSpec, spec: JobSpec) -> ShardResult:
    """Read, validate, tokenize, run and write one shard; its result persists beside the outputs.
    The job is resolved here, before the shard moves (`engine: auto` chosen; once per process: the
    resolution is kept). The task takes the spec as written: the shard's cache key is the spec's."""
    result = run_shard(shard, resolve_job(with_server_key(with_storage_secrets(spec))))
    return result.model_copy(update={"worker": runtime_flow_run.name or ""})


process_shard_task: ResumableShardTask = ResumableShardTask(
    fn=process_shard,
    name="process-shard",
    task_run_name="shard {shard.shard_id}",
    cache_policy=ShardCachePolicy(),
    persist_result=True,
    result_serializer="json",
)


@dataclass
class ShardRuns:
    """What a loop over shards did: results in shard order, ids served from cache, failures."""

    results: list[ShardResult] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # shard id -> why


def run_shards(spec: JobSpec, shards: list[ShardSpec], keep_going: bool = False,
               on_shard_done: Callable[[ShardResult, bool], None] | None = None) -> ShardRuns:
    """Each shard as the resumable process-shard task, in order, on this process's engine.

    keep_going=False raises the first shard's error (a local run fails fast); True runs the
    rest and reports the failures (a fleet worker: its other shards still count).
    on_shard_done(result, from_cache) runs after each finished shard.
    """
    logger = get_run_logger()
    runs = ShardRuns()
    if spec.model.engine == "auto" and shards and chosen_engine(spec) is None:
        # chosen as the first shard that computes asks for its engine (none if every shard is cached), weighed
        # by these shards' rows, as the flows choose (tasks/warm.py, the shard worker's choose-engine task)
        try:
            expect_rows(spec, estimate_rows(with_storage_secrets(spec), shards))
        except Exception as exc:  # noqa: BLE001 - the shards meet and report what is wrong with the input
            logger.warning("engine auto: rows of these shards not counted (%s): steady throughput decides", exc)
    with engine_scope():  # the engine ends with the loop, unless the caller holds an outer scope
        for shard in shards:
            if stop_by_passed(spec):  # the trough is over: the next run resumes from the finished shards
                logger.warning("stop_by %s passed: %d shards left for the next run", spec.stop_by,
                               len(shards) - len(runs.results) - len(runs.failed))
                break
            state = process_shard_task(shard, spec, return_state=True)
            if not state.is_completed():
                if stopped_by_deadline(state):  # drained before stop_by: a clean stop, not a failure
                    logger.warning("stop_by %s: shard %s drained and left for the next run", spec.stop_by,
                                   shard.shard_id)
                    break
                if not keep_going:
                    state.result()  # raises the shard's error
                runs.failed[shard.shard_id] = state.message or state.name
                logger.error("shard %s: %s", shard.shard_id, runs.failed[shard.shard_id])
                continue
            result = state.result()
            from_cache = state.name == "Cached"
            runs.results.append(result)
            if from_cache:
                runs.cached.append(result.shard_id)
            if on_shard_done is not None:
                on_shard_done(result, from_cache)
            logger.info("shard %s%s: %d rows out, %d rejected (%d/%d shards)", shard.shard_id,
                        " (cached)" if from_cache else "", result.rows_out, result.rows_rejected,
                        len(runs.results) + len(runs.failed), len(shards))
    return runs


def state_storage(spec: JobSpec) -> Path | WritableFileSystem:
    """Where Prefect persists shard results: beside the outputs, so a new machine pointed
    at the same output finds them.

    Prefect takes a local path as is; remote storage must be a saved block. Its name
    derives from the output URI, so every run of the job finds the same block.
    Credentials stay in the environment or the job's storage block: only the fsspec options
    and the block's name are saved.
    """
    if "://" not in spec.output or spec.output.startswith("file://"):
        return Path(OutputStore(spec.output).path(STATE_DIR))
    basepath = f"{spec.output.rstrip('/')}/{STATE_DIR}"
    # saved on every call (one API call per shard): a block saved once per process would go
    # stale when the process talks to another Prefect API
    block = StateStorage(basepath=basepath, settings=spec.storage_options, storage_block=getattr(spec, "storage_block", None))
    block.save(f"tokenmill-state-{stable_digest(basepath, 16)}", overwrite=True)
    return block


@task(name="write-manifest", cache_policy=NONE)
@with_core_logs
def write_manifest_task(spec: JobSpec, results: list[ShardResult], shards_total: int, final: bool = True) -> str:
    """final: the end of the run. Before the manifest says so, the output root is made to
    hold only this run's files: temporaries of killed writes removed, files of shards that
    are not this run's moved under _stale/."""
    spec = with_storage_secrets(spec)
    store = OutputStore(spec.output, spec.storage_options)
    if final:
        remove_leftover_temporaries(store)
        shard_ids = {r.shard_id for r in results}
        if len(shard_ids) == shards_total:
            move_stale_outputs(store, shard_ids, keep=[r.uri for r in results])
        else:  # without every shard's id, an unfinished shard's earlier output would look stale
            get_run_logger().warning("%d of %d shards finished: files of other shards stay where they are",
                                     len(shard_ids), shards_total)
    path = store.path(MANIFEST)
    store.write_json(path, build_manifest(spec, results, shards_total, final))
    if final:  # OpenAI Batch input: the job's result and error files and batch object, from the shards'
        write_batch_files(spec, results)
    return path


@task(name="reject-cross-shard-duplicates", cache_policy=NONE)
@with_core_logs
def reject_duplicates_task(spec: JobSpec, shards: list[ShardSpec], results: list[ShardResult]) -> list[ShardResult]:
    return reject_cross_shard_duplicates(with_storage_secrets(spec), shards, results)
