"""The batch job: discover shards, run each as a task, record what it cost."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.record import record_run_task
from tasks.shards import discover_shards_task, process_shard_task, write_manifest_task
from tokenmill import progress
from tokenmill.spec import JobSpec


@flow(name="tokenmill-batch")
def batch_flow(spec: JobSpec = JobSpec()) -> dict[str, Any]:
    """Embed or generate over a corpus of Parquet or JSONL files, shard by shard."""
    logger = get_run_logger()
    started = time.perf_counter()
    shards = discover_shards_task(spec)
    expected = [s.expected_rows for s in shards]
    logger.info("%d shards from %s", len(shards), spec.input)
    progress.emit("job_started", shards=len(shards), rows=None if None in expected else sum(expected))
    progress_id = create_progress_artifact(0.0, key="tokenmill-progress", description="shards finished")

    results = []
    for done, shard in enumerate(shards, start=1):
        result = process_shard_task(shard, spec)
        results.append(result)
        write_manifest_task(spec, results, len(shards))
        update_progress_artifact(progress_id, 100.0 * done / len(shards))
        logger.info("shard %s: %d rows out, %d rejected (%d/%d shards)",
                    shard.shard_id, result.rows_out, result.rows_rejected, done, len(shards))

    record = record_run_task(spec, results, time.perf_counter() - started)
    logger.info("\n%s", record["summary"])
    return record
