"""Deterministic samples of a corpus, for the eval gate, calibration and plans."""

from __future__ import annotations

import hashlib
from typing import Any

from tokenmill.digest import stable_digest
from tokenmill.errors import InputError
from tokenmill.prompts import prompt_inputs, read_job_rows
from tokenmill.shards import discover_shards_for
from tokenmill.spec import JobSpec


def corpus_sample(spec: JobSpec, rows: int, seed: int = 0, eval_file: str | None = None) -> tuple[list, str]:
    """Texts of `rows` rows (for generation from other columns too, what encode_rows takes: see
    tokenmill.prompts.prompt_inputs): an eval file's, or N of the corpus's first 4N valid rows, chosen by
    a hash of their id (the same corpus gives the same sample however it is sharded, without
    reading the whole corpus). Returns (texts, a description of where they came from)."""
    if eval_file is not None:
        pool = _pool(spec, eval_file, None)
        chosen = _choose(pool, rows, seed)
        return [pool[i][1] for i in chosen], f"eval file {eval_file}"
    (texts,), _ = corpus_samples(spec, [rows], seed)
    return texts, f"{len(texts)} corpus rows by id hash"


def corpus_samples(spec: JobSpec, sizes: list[int], seed: int = 0) -> tuple[list[list], list[list[int]]]:
    """corpus_sample's texts for each of `sizes`, from one read of the corpus (each N of its first 4N valid
    rows, chosen as corpus_sample chooses them), and each sample's rows as positions in what was read: a
    row in two samples is one position, so a caller encodes it once."""
    pool = _pool(spec, spec.input, 4 * max(sizes))
    picks = [_choose(pool[: 4 * n], n, seed) for n in sizes]
    return [[pool[i][1] for i in pick] for pick in picks], picks


# The pools this process read last, by what decides them (the files' identities and the job's fields that read
# them): a gated `tokenmill run` reads its gate's sample for the gate before its prediction
# (tokenmill.gate.judge_first), for the prediction (known_verdict) and in its flow's gate, three reads of the same
# rows where one does; a file rewritten since (its size, mtime or etag) is read again. Two kept (the gate's sample
# and the engine trials' and prediction's length sample, at most 4 x 2,048 rows).
_POOLS: dict[str, list[tuple[str, Any]]] = {}
POOLS_KEPT = 2
READ_BY = {"format", "openai_batch", "id_column", "text_column", "mode", "model", "generation", "overlong",
           "storage_options"}  # the job's fields its rows' reading and validation depend on (read_job_rows)


def _pool(spec: JobSpec, source: str, limit: int | None) -> list[tuple[str, Any]]:
    """(id, text) of the source's valid rows, in shard order: its first `limit` (all of them: None); from
    _POOLS where this process read the same files the same way."""
    shards = discover_shards_for(spec, source)
    key = stable_digest({"source": source, "limit": limit, "shards": [s.model_dump(mode="json") for s in shards],
                         "read": spec.model_dump(mode="json", include=READ_BY)})
    if key not in _POOLS:
        _POOLS[key] = _read_pool(spec, source, shards, limit)
        while len(_POOLS) > POOLS_KEPT:
            _POOLS.pop(next(iter(_POOLS)))
    return _POOLS[key]


def _read_pool(spec: JobSpec, source: str, shards: list, limit: int | None) -> list[tuple[str, Any]]:
    pool: list[tuple[str, Any]] = []
    # the columns prompts are made of; a row is its text, or a mapping for encode_rows (see prompt_inputs)
    job = spec.model_copy(update={"passthrough_columns": []})
    for shard in shards:
        valid = read_job_rows(shard, job)[0].valid
        pool += list(zip([str(i) for i in valid.column(spec.id_column).to_pylist()], prompt_inputs(valid, job)))
        if limit is not None and len(pool) >= limit:
            break
    if not pool:
        raise InputError(source, "no valid rows to sample")
    return pool if limit is None else pool[:limit]


def _choose(pool: list[tuple[str, Any]], rows: int, seed: int) -> list[int]:
    """The positions of `rows` rows of the pool, by a hash of their id."""
    def rank(i: int) -> str:
        return hashlib.sha256(f"{seed}:{pool[i][0]}".encode()).hexdigest()

    return sorted(range(len(pool)), key=rank)[:rows]
