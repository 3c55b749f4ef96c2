"""Deterministic samples of a corpus, for the eval gate, calibration and plans."""

from __future__ import annotations

import hashlib
from typing import Any

from tokenmill.errors import InputError
from tokenmill.prompts import prompt_inputs, read_columns, validate_job_rows
from tokenmill.shards import discover_shards_for, read_shard
from tokenmill.spec import JobSpec


def corpus_sample(spec: JobSpec, rows: int, seed: int = 0, eval_file: str | None = None) -> tuple[list, str]:
    """Texts of `rows` rows (for generation from other columns too, what encode_rows takes: see
    tokenmill.prompts.prompt_inputs): an eval file's, or N of the corpus's first 4N valid rows, chosen by
    a hash of their id (the same corpus gives the same sample however it is sharded, without
    reading the whole corpus). Returns (texts, a description of where they came from)."""
    source = eval_file or spec.input
    shards = discover_shards_for(spec, source)
    pool: list[tuple[str, Any]] = []
    # the columns prompts are made of; a row is its text, or a mapping for encode_rows (see prompt_inputs)
    job = spec.model_copy(update={"passthrough_columns": []})
    for shard in shards:
        table, _ = read_shard(shard, read_columns(job), spec.storage_options)
        valid = validate_job_rows(table, shard.uri, job).valid
        pool += list(zip([str(i) for i in valid.column(spec.id_column).to_pylist()], prompt_inputs(valid, job)))
        if eval_file is None and len(pool) >= 4 * rows:
            break
    if not pool:
        raise InputError(source, "no valid rows to sample")
    if eval_file is None:
        pool = pool[: 4 * rows]

    def rank(item: tuple[str, Any]) -> str:
        return hashlib.sha256(f"{seed}:{item[0]}".encode()).hexdigest()

    chosen = sorted(pool, key=rank)[:rows]
    label = f"eval file {eval_file}" if eval_file else f"{len(chosen)} corpus rows by id hash"
    return [text for _, text in chosen], label
