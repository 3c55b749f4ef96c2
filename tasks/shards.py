"""Prefect tasks over the core. They take specs and ids, never data, so their inputs hash cheaply."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE, CachePolicy
from prefect.filesystems import WritableFileSystem
from prefect.runtime import flow_run as runtime_flow_run

from tasks.logs import with_core_logs
from tasks.storage import StateStorage, with_storage_secrets
from tokenmill.audit import reject_cross_shard_duplicates
from tokenmill.dispatch import read_shard_list, write_shard_list
from tokenmill.errors import InputError
from tokenmill.manifest import build_manifest
from tokenmill.outputs import MANIFEST, STATE_DIR, OutputStore, move_stale_outputs, remove_leftover_temporaries
from tokenmill.runner import ShardResult, run_shard, shard_cache_key
from tokenmill.shards import ShardSpec, discover_shards
from tokenmill.spec import JobSpec


@task(name="discover-shards", cache_policy=NONE)
@with_core_logs
def discover_shards_task(spec: JobSpec) -> list[ShardSpec]:
    spec = with_storage_secrets(spec)
    shards = discover_shards(
        spec.input,
        fmt=spec.format,
        max_shard_rows=spec.batching.max_shard_rows,
        max_shard_bytes=spec.batching.max_shard_bytes,
        storage_options=spec.storage_options,
    )
    empty = sorted({s.uri for s in shards if s.is_empty})
    if len(empty) == len({s.uri for s in shards}):
        raise InputError(spec.input, f"every input file is empty ({', '.join(empty[:5])}"
                                     f"{', ...' if len(empty) > 5 else ''}): there is nothing to run")
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


@task(
    name="process-shard",
    task_run_name="shard {shard.shard_id}",
    cache_policy=ShardCachePolicy(),
    persist_result=True,
    result_serializer="json",
)
@with_core_logs
def process_shard_task(shard: ShardSpec, spec: JobSpec) -> ShardResult:
    result = run_shard(shard, with_storage_secrets(spec))
    return result.model_copy(update={"worker": runtime_flow_run.name or ""})


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
    block = StateStorage(basepath=basepath, settings=spec.storage_options, storage_block=spec.storage_block)
    block.save(f"tokenmill-state-{hashlib.sha256(basepath.encode()).hexdigest()[:16]}", overwrite=True)
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
    return path


@task(name="reject-cross-shard-duplicates", cache_policy=NONE)
@with_core_logs
def reject_duplicates_task(spec: JobSpec, shards: list[ShardSpec], results: list[ShardResult]) -> list[ShardResult]:
    return reject_cross_shard_duplicates(with_storage_secrets(spec), shards, results)
