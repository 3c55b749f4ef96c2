"""Prefect tasks over the core. They take specs and ids, never data, so their inputs hash cheaply."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from tokenmill.manifest import build_manifest
from tokenmill.outputs import MANIFEST, OutputStore
from tokenmill.runner import ShardResult, run_shard
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


@task(name="process-shard", task_run_name="shard {shard.shard_id}", cache_policy=NONE)
def process_shard_task(shard: ShardSpec, spec: JobSpec) -> ShardResult:
    return run_shard(shard, spec)


@task(name="write-manifest", retries=2, retry_delay_seconds=[1, 5], cache_policy=NONE)
def write_manifest_task(spec: JobSpec, results: list[ShardResult], shards_total: int) -> str:
    store = OutputStore(spec.output, spec.storage_options)
    path = store.path(MANIFEST)
    store.write_json(path, build_manifest(spec, results, shards_total))
    return path
