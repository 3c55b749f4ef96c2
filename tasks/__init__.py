"""Prefect tasks over tokenmill's core, to compose into your own flows.

They take specs, shards and ids, never data frames (Prefect hashes task inputs for cache
keys), and they route the core's log lines (retries, engine restarts) into the run's log.

- `discover_shards_task(spec)`: the job's shards (Parquet row groups, JSONL byte ranges).
- `process_shard_task(shard, spec)`: read, validate, tokenize, run, write one shard. Its
  result persists beside the job's outputs (`<output>/_state/`), so a later run on any
  machine finds it and skips the shard: resume comes with the task, also outside our flows.
- `run_shards(spec, shards)`: that task over a list of shards, in order, on one engine (`auto`: chosen
  for these shards' rows, as the first shard that computes asks for it).
- `reject_duplicates_task(spec, shards, results)`: ids held by several shards go to rejects.
- `write_manifest_task(spec, results, shards_total)`: `_manifest.json`; the final one also
  clears the output root of temporaries and stale shards.
- `open_run_task(spec)` / `record_run_task(spec, results, ...)`: the job's MLflow run.
- `gate_sample_task(spec)` / `gate_evaluate_task(spec, texts, source)`: the eval gate.
"""

from tokenmill.tasks.gate import gate_evaluate_task, gate_sample_task
from tokenmill.tasks.record import open_run_task, record_run_task
from tokenmill.tasks.shards import (
    ShardRuns,
    discover_shards_task,
    process_shard_task,
    reject_duplicates_task,
    run_shards,
    write_manifest_task,
)

__all__ = [
    "ShardRuns", "discover_shards_task", "gate_evaluate_task", "gate_sample_task", "open_run_task",
    "process_shard_task", "record_run_task", "reject_duplicates_task", "run_shards", "write_manifest_task",
]
