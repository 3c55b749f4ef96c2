"""Prefect tasks over the core. They take specs and ids, never data, so their inputs hash cheaply."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE, CachePolicy
from prefect.filesystems import RemoteFileSystem, WritableFileSystem
from prefect.tasks import exponential_backoff

from tokenmill.errors import TokenmillError
from tokenmill.manifest import build_manifest
from tokenmill.outputs import MANIFEST, STATE_DIR, OutputStore
from tokenmill.runner import ShardResult, run_shard, shard_cache_key
from tokenmill.shards import ShardSpec, discover_shards
from tokenmill.spec import JobSpec


@task(name="discover-shards", retries=2, retry_delay_seconds=[2, 10], cache_policy=NONE)
def discover_shards_task(spec: JobSpec) -> list[ShardSpec]:
    return discover_shards(
        spec.input,
        fmt=spec.format,
        max_shard_rows=spec.batching.max_shard_rows,
        max_shard_bytes=spec.batching.max_shard_bytes,
        storage_options=spec.storage_options,
    )


@dataclass
class ShardCachePolicy(CachePolicy):
    """A finished shard is found again by any later run of the same job, on any machine."""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str:
        return shard_cache_key(inputs["shard"], inputs["spec"])


def is_transient(task, task_run, state) -> bool:
    """Retry I/O hiccups (S3 5xx, throttling, resets); never a data or config error."""
    try:
        state.result()
    except (TokenmillError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
        return False  # the same call would fail the same way
    except (OSError, ConnectionError, TimeoutError):
        return True
    except Exception as exc:  # botocore/aiohttp errors arrive wrapped in many types
        return type(exc).__module__.split(".")[0] in {"botocore", "aiobotocore", "aiohttp", "urllib3", "s3fs"}
    return False


@task(
    name="process-shard",
    task_run_name="shard {shard.shard_id}",
    cache_policy=ShardCachePolicy(),
    persist_result=True,
    result_serializer="json",
    retries=4,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=is_transient,
)
def process_shard_task(shard: ShardSpec, spec: JobSpec) -> ShardResult:
    return run_shard(shard, spec)


def state_storage(spec: JobSpec) -> Path | WritableFileSystem:
    """Where Prefect persists shard results: beside the outputs, so a new machine pointed
    at the same output finds them.

    Prefect takes a local path as is; remote storage must be a saved block. Its name
    derives from the output URI, so every run of the job finds the same block.
    Credentials stay in the environment: only the fsspec options are saved.
    """
    store = OutputStore(spec.output, spec.storage_options)
    if store.local:
        return Path(store.path(STATE_DIR))
    basepath = f"{spec.output.rstrip('/')}/{STATE_DIR}"
    block = RemoteFileSystem(basepath=basepath, settings=spec.storage_options)
    block.save(f"tokenmill-state-{hashlib.sha256(basepath.encode()).hexdigest()[:16]}", overwrite=True)
    return block


@task(name="write-manifest", retries=2, retry_delay_seconds=[1, 5], cache_policy=NONE)
def write_manifest_task(spec: JobSpec, results: list[ShardResult], shards_total: int) -> str:
    store = OutputStore(spec.output, spec.storage_options)
    path = store.path(MANIFEST)
    store.write_json(path, build_manifest(spec, results, shards_total))
    return path
