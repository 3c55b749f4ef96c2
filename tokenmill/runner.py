"""One shard, end to end: read, validate, tokenize, bucket, run, reorder, write.

Plain Python, so tests and other orchestrators can call it without Prefect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Sequence

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

from tokenmill import progress
from tokenmill.bucketing import PaddingStats, fixed_batches, padding_stats, plan_batches, restore_order
from tokenmill.engines import Engine, discard_engine, engine_died, get_engine, run_engine
from tokenmill.models import load_tokenizer, model_input_limit, resolve_model
from tokenmill.outputs import OutputStore, rejects_table
from tokenmill.schema import validate_rows
from tokenmill.shards import ROW_NUMBER, ShardSpec, read_shard
from tokenmill.spec import JobSpec
from tokenmill.storage import describe_error

log = logging.getLogger(__name__)

OUTPUT_FORMAT_VERSION = 1


class ShardResult(BaseModel):
    shard_id: str
    fingerprint: str
    uri: str
    output: str
    rows_in: int
    rows_out: int
    rows_rejected: int
    rows_truncated: int
    input_tokens: int
    output_tokens: int
    batches: int
    real_tokens: int  # tokens the engine saw (= input_tokens)
    padded_slots: int  # rows x longest row, over our length-bucketed batches
    baseline_padded_slots: int  # the same, over fixed-size batches in input order
    engine_seconds: float
    seconds: float
    format_version: int = OUTPUT_FORMAT_VERSION
    worker: str = ""  # the flow run that wrote this result: a fleet's throughput per worker

    @property
    def padding_fraction(self) -> float:
        return PaddingStats(self.real_tokens, self.padded_slots).padding_fraction

    @property
    def baseline_padding_fraction(self) -> float:
        return PaddingStats(self.real_tokens, self.baseline_padded_slots).padding_fraction


class EncodedRows(BaseModel):
    token_ids: list[list[int]]
    truncated: list[bool]
    overlong: list[tuple[int, str]]  # (position, reason): rows refused under overlong=reject


def run_shard(shard: ShardSpec, spec: JobSpec, engine: Engine | None = None) -> ShardResult:
    started = time.perf_counter()
    model_path = resolve_model(spec.model_name)
    store = OutputStore(spec.output, spec.storage_options)

    table, unreadable = read_shard(shard, [spec.id_column, spec.text_column], spec.storage_options)
    rows_in = table.num_rows + len(unreadable)
    validated = validate_rows(table, shard.uri, spec.id_column, spec.text_column)
    rejects = [(row, None, reason) for row, reason in unreadable] + validated.rejects
    valid = validated.valid

    encoded = encode_rows(valid.column(spec.text_column).to_pylist(), spec, model_path)
    if encoded.overlong:
        row_numbers = valid.column(ROW_NUMBER).to_pylist()
        ids = valid.column(spec.id_column).to_pylist()
        rejects += [(row_numbers[i], ids[i], reason) for i, reason in encoded.overlong]
        keep = sorted(set(range(valid.num_rows)) - {i for i, _ in encoded.overlong})
        valid = valid.take(pa.array(keep, pa.int64()))
        encoded = EncodedRows(
            token_ids=[encoded.token_ids[i] for i in keep],
            truncated=[encoded.truncated[i] for i in keep],
            overlong=[],
        )

    lengths = [len(ids) for ids in encoded.token_ids]
    batches = plan_batches(
        lengths, spec.batching.token_budget, spec.batching.max_batch_size, spec.batching.length_tolerance
    )
    progress.emit("shard_started", shard_id=shard.shard_id, rows=valid.num_rows)
    engine_seconds = 0.0
    results_by_batch: list = []
    if batches:
        try:
            results_by_batch, engine_seconds = run_batches(engine or get_engine(model_path, spec), batches,
                                                           encoded.token_ids, spec, shard.shard_id)
        except Exception as exc:
            if not engine_died(exc):
                raise
            # A killed or crashed engine process, not a bad row: start a new engine once and redo this
            # shard's batches. A second death fails the shard.
            log.warning("engine died during shard %s (%s); restarting it once and retrying the shard",
                        shard.shard_id, describe_error(exc))
            progress.emit("shard_restarted", shard_id=shard.shard_id)
            discard_engine(model_path, spec)
            results_by_batch, engine_seconds = run_batches(get_engine(model_path, spec), batches,
                                                           encoded.token_ids, spec, shard.shard_id)
    results = restore_order(batches, results_by_batch)

    output = build_output(valid, spec, results, lengths, encoded.truncated)
    store.delete(store.shard_duplicates(shard.shard_id))  # the new output has every row; the audit re-decides
    store.write_table(store.shard_output(shard.shard_id), output)
    store.write_table(
        store.shard_rejects(shard.shard_id),
        rejects_table(shard.shard_id, shard.uri, sorted(rejects, key=lambda r: r[0]), shard.format == "jsonl"),
    )
    ours = padding_stats(lengths, batches)
    baseline = padding_stats(lengths, fixed_batches(len(lengths), spec.batching.baseline_batch_size))
    result = ShardResult(
        shard_id=shard.shard_id,
        fingerprint=shard.fingerprint,
        uri=shard.uri,
        output=store.shard_output(shard.shard_id),
        rows_in=rows_in,
        rows_out=output.num_rows,
        rows_rejected=len(rejects),
        rows_truncated=sum(encoded.truncated),
        input_tokens=sum(lengths),
        output_tokens=int(pa.compute.sum(output.column("output_tokens")).as_py() or 0),
        batches=len(batches),
        real_tokens=ours.real_tokens,
        padded_slots=ours.padded_slots,
        baseline_padded_slots=baseline.padded_slots,
        engine_seconds=engine_seconds,
        seconds=time.perf_counter() - started,
    )
    if result.rows_in != result.rows_out + result.rows_rejected:  # the one invariant we never break
        raise AssertionError(f"shard {shard.shard_id}: {rows_in} rows in, {output.num_rows} out, {len(rejects)} rejected")
    store.write_json(store.shard_record(shard.shard_id), result.model_dump())
    progress.emit("shard_done", shard_id=shard.shard_id, result=result)
    return result


def run_batches(engine: Engine, batches: list[list[int]], token_ids: list[list[int]], spec: JobSpec,
                shard_id: str) -> tuple[list, float]:
    """Each batch through the engine, as cut. Returns (results per batch, seconds in the engine)."""
    results_by_batch = []
    engine_seconds = 0.0
    for batch in batches:
        batch_ids = [token_ids[i] for i in batch]
        batch_started = time.perf_counter()
        results_by_batch.append(run_engine(engine, batch_ids, spec))
        engine_seconds += time.perf_counter() - batch_started
        progress.emit("rows_done", shard_id=shard_id, rows=len(batch))
    return results_by_batch, engine_seconds


def shard_cache_key(shard: ShardSpec, spec: JobSpec) -> str:
    """What a shard's output depends on, and nothing else.

    Not the code's source text (a comment edit must not redo a ten-hour job) and not
    the batching settings (they change speed, not results). The output location is
    in, so one job's finished shards never stand in for another's.
    """
    identity = {
        "fingerprint": shard.fingerprint,
        "mode": spec.mode,
        "model": spec.model_name,
        "model_spec": spec.model.model_dump(mode="json", exclude={"name"}),
        "generation": spec.generation.model_dump(mode="json") if spec.mode == "generate" else None,
        "columns": [spec.id_column, spec.text_column],
        "overlong": spec.overlong,
        "output": spec.output.rstrip("/"),
        "format_version": OUTPUT_FORMAT_VERSION,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return f"{shard.shard_id}-{digest}"


def encode_rows(texts: Sequence[str], spec: JobSpec, model_path: str) -> EncodedRows:
    """Token ids per row, under the model's input limit, with the overlong policy applied."""
    tokenizer = load_tokenizer(model_path)
    limit = input_token_limit(spec, model_path)
    if spec.mode == "embed":
        return _encode_for_embedding(list(texts), tokenizer, limit, spec.overlong)
    return _encode_for_generation(list(texts), tokenizer, limit, spec)


def input_token_limit(spec: JobSpec, model_path: str) -> int:
    limit = spec.model.max_input_tokens or model_input_limit(model_path)
    if spec.model.engine_kwargs.get("max_model_len"):
        limit = min(limit, int(spec.model.engine_kwargs["max_model_len"]))
    if spec.mode == "generate":
        limit -= spec.generation.max_tokens  # room for the answer inside the context
        if limit < 1:
            raise ValueError(f"generation.max_tokens={spec.generation.max_tokens} leaves no room for input")
    return limit


def _encode_for_embedding(texts: list[str], tokenizer, limit: int, policy: str) -> EncodedRows:
    token_ids = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
    truncated = [False] * len(texts)
    overlong = []
    long_rows = [i for i, ids in enumerate(token_ids) if len(ids) > limit]
    if long_rows and policy == "reject":
        overlong = [(i, f"input has {len(token_ids[i])} tokens; the model takes at most {limit}") for i in long_rows]
    elif long_rows:
        cut = tokenizer([texts[i] for i in long_rows], add_special_tokens=True, truncation=True, max_length=limit)
        for i, ids in zip(long_rows, cut["input_ids"]):
            token_ids[i] = ids
            truncated[i] = True
    return EncodedRows(token_ids=token_ids, truncated=truncated, overlong=overlong)


def _encode_for_generation(texts: list[str], tokenizer, limit: int, spec: JobSpec) -> EncodedRows:
    overhead = len(_render_prompts([""], tokenizer, spec)[0])
    room = limit - overhead
    if room < 1:
        raise ValueError(f"the prompt template alone takes {overhead} tokens; the input limit is {limit}")
    text_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    truncated = [len(ids) > room for ids in text_ids]
    overlong = []
    if spec.overlong == "reject":
        overlong = [(i, f"input has {len(ids)} tokens; at most {room} fit beside the prompt and "
                        f"max_tokens={spec.generation.max_tokens}") for i, ids in enumerate(text_ids) if len(ids) > room]
        truncated = [False] * len(texts)
    else:
        # re-joining cut tokens can merge into slightly different tokens; keep a margin
        texts = [tokenizer.decode(ids[: max(room - 8, 1)]) if cut else text
                 for text, ids, cut in zip(texts, text_ids, truncated)]
    token_ids = _render_prompts(texts, tokenizer, spec) if texts else []
    return EncodedRows(token_ids=token_ids, truncated=truncated, overlong=overlong)


def _render_prompts(texts: list[str], tokenizer, spec: JobSpec) -> list[list[int]]:
    params = spec.generation
    if params.messages is None:
        prompts = [params.prompt_template.replace("{text}", text) for text in texts]
        return tokenizer(prompts, add_special_tokens=True)["input_ids"]
    conversations = [
        [{"role": m.role, "content": m.content.replace("{text}", text)} for m in params.messages] for text in texts
    ]
    rendered = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def build_output(valid: pa.Table, spec: JobSpec, results: list, lengths: list[int], truncated: list[bool]) -> pa.Table:
    columns: dict[str, pa.Array] = {"id": valid.column(spec.id_column).combine_chunks()}
    if spec.mode == "embed":
        columns["embedding"] = _embedding_array(results)
        output_tokens = [0] * len(results)
    else:
        columns["output_text"] = pa.array([g.text for g in results], pa.string())
        output_tokens = [g.output_tokens for g in results]
    columns["input_tokens"] = pa.array(lengths, pa.int32())
    columns["output_tokens"] = pa.array(output_tokens, pa.int32())
    columns["truncated"] = pa.array(truncated, pa.bool_())
    if spec.mode == "generate":
        columns["finish_reason"] = pa.array([g.finish_reason for g in results], pa.string())
    return pa.table(columns)


def _embedding_array(vectors: list[np.ndarray]) -> pa.Array:
    if not vectors:
        return pa.array([], pa.list_(pa.float32()))
    matrix = np.ascontiguousarray(np.stack(vectors), dtype=np.float32)
    offsets = pa.array(np.arange(0, matrix.size + 1, matrix.shape[1], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))
