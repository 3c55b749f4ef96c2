"""One shard, end to end: read, validate, tokenize, bucket, run, reorder, write (the rows' steps of the
shard skeleton in tokenmill.shard_pipeline; OpenAI Batch requests take theirs from tokenmill.openai_batch).

Plain Python, so tests and other orchestrators can call it without Prefect.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import pyarrow as pa

from tokenmill import progress
from tokenmill.bucketing import (
    PaddingStats,
    fixed_batches,
    padding_stats,
    plan_batches,
    restore_order,
)
from tokenmill.call_costs import CallCost, call_cost, embed_call, observe, observe_embedding, output_tokens
from tokenmill.encoding import EncodedRows, encode_rows
from tokenmill.engine_protocol import Engine, run_engine, token_budget
from tokenmill.memory import HeapGuard
from tokenmill.openai_batch import OPENAI_BATCH_STEPS
from tokenmill.outputs import OutputStore, build_output, structured_invalid_rows, write_shard_tables
from tokenmill.prompts import prefix_order, prompt_inputs, read_job_rows
from tokenmill.resolved_job import ResolvedJob
from tokenmill.results import ShardResult
from tokenmill.row_cache import RowReuse, reuse_rows
from tokenmill.shard_pipeline import ShardSteps, run_shard_steps
from tokenmill.shards import ROW_NUMBER, ShardSpec
from tokenmill.spec import JobSpec

log = logging.getLogger(__name__)

# Engines that schedule rows themselves and never pad a batch (vLLM: continuous batching under its own
# max_num_seqs / max_num_batched_tokens). Length buckets buy them nothing, and each blocking call drains
# the scheduler: the tail of every call decodes a handful of sequences. Generating, they get a shard's rows in one
# call, in input order, cut only every FEED_CHUNK_ROWS rows to bound memory (a shard of a huge JSONL
# byte range); progress is emitted per call. Engines that pad (transformers) keep the length buckets.
UNPADDED_ENGINES = frozenset({"vllm", "openai-server"})  # openai-server: a server that batches for itself
FEED_CHUNK_ROWS = 4096
# Modes fed whole to an unpadded engine. Generation only: embedding has no decode tail to keep full, and
# measured on CPU (vLLM 0.32, all-MiniLM-L6-v2, 400 sample-corpus docs, 33k tokens) one call per shard
# took 46.6 s and 42.3 s against 37.5 s and 41.5 s for the length buckets (two rounds): no gain, so
# embeddings keep the buckets.
WHOLE_FEED_MODES = frozenset({"generate"})


def engine_pads(engine_name: str) -> bool:
    return engine_name not in UNPADDED_ENGINES


def plan_feed(lengths: list[int], spec: JobSpec, engine_name: str, engine: Engine | None = None) -> list[list[int]]:
    """The engine calls for one shard's rows, as lists of row indices (`engine`, when running, sets the
    token budget the job leaves to it).

    An engine that pads gets length buckets (plan_batches). One that does not (vLLM) gets the rows in
    input order, FEED_CHUNK_ROWS at most per call, so its scheduler always has work: one call per shard
    for any shard of up to FEED_CHUNK_ROWS rows. restore_order puts results back either way.
    """
    if not lengths:
        return []
    if engine_pads(engine_name) or spec.mode not in WHOLE_FEED_MODES:
        batching = spec.batching
        return plan_batches(lengths, token_budget(spec, engine), batching.max_batch_size, batching.length_tolerance)
    return fixed_batches(len(lengths), FEED_CHUNK_ROWS)


def feed_padding(lengths: list[int], calls: list[list[int]], engine_name: str) -> PaddingStats:
    """Token slots the engine computed: rows x longest row per call for an engine that pads; the real
    tokens alone for one that does not (it spends nothing on padding)."""
    if engine_pads(engine_name):
        return padding_stats(lengths, calls)
    real = sum(lengths)
    return PaddingStats(real, real)


def run_shard(shard: ShardSpec, job: ResolvedJob, engine: Engine | None = None) -> ShardResult:
    """One shard of the resolved job (tokenmill.resolution.resolve_job), on `engine`, or on the process's
    engine for the job when there are rows to run: its rows, or its OpenAI Batch requests (each with
    its own parameters), through the one shard skeleton (tokenmill.shard_pipeline)."""
    steps = OPENAI_BATCH_STEPS if job.pipeline_of(shard.format) == "openai-batch" else ROW_STEPS
    return run_shard_steps(shard, job, engine, steps)


@dataclass
class RowsWork:
    """A shard's rows, read, validated and encoded: what the engine computes of them (token_ids: the rows
    neither the row cache nor a duplicate in the shard answers) and how every row's output is made."""

    rows_in: int
    valid: pa.Table
    encoded: EncodedRows
    rejects: list
    reuse: RowReuse
    token_ids: list[list[int]]

    @property
    def rows(self) -> int:
        return self.valid.num_rows

    @property
    def to_run(self) -> int:
        return len(self.token_ids)


def _prepare_rows(shard: ShardSpec, job: ResolvedJob, engine_name: str) -> RowsWork:
    rows_in, valid, encoded, rejects = _read_validate_encode(shard, job.spec, job.model_path)
    # the row cache and duplicate collapse: the engine runs only the rows in reuse.compute
    reuse = reuse_rows(job.spec, job.model_path, engine_name, encoded.token_ids)
    return RowsWork(rows_in, valid, encoded, rejects, reuse, [encoded.token_ids[i] for i in reuse.compute])


def _run_rows(engine: Engine, work: RowsWork, job: ResolvedJob, shard_id: str) -> tuple[list, float, list[list[int]]]:
    """(results per engine call, seconds in the engine, the calls): how to feed depends on the engine."""
    batches = _feed(work.token_ids, job.spec, engine.name, engine)
    calls: list[CallCost] = []
    results_by_batch, engine_seconds = run_batches(engine, batches, work.token_ids, job.spec, shard_id, calls)
    generating = job.spec.mode == "generate" and job.spec.generation.n == 1
    answers = [output_tokens(g) for batch in results_by_batch for g in batch] if generating else []
    prompts = [len(work.token_ids[i]) for batch in batches for i in batch] if generating else []
    # for the next prediction's engine seconds and answers (tokenmill.call_costs), stored with the run's parts
    if job.spec.mode == "embed":
        observe_embedding(job.spec, engine.name, calls)
    else:
        observe(job.spec, engine.name, calls, answers, prompts)
    return results_by_batch, engine_seconds, batches


def _write_rows(store: OutputStore, shard: ShardSpec, job: ResolvedJob, work: RowsWork, ran, engine_name: str,
                started: float) -> ShardResult:
    """Every row's output in input order (computed, from the row cache, or a duplicate's), written with the
    rejects; the shard's result."""
    spec = job.spec
    results_by_batch, engine_seconds, batches = ran or ([], 0.0, [])
    computed = restore_order(batches, results_by_batch)
    results = work.reuse.outputs(computed, engine_seconds)  # every row, in input order; new entries stored
    if len(results) > len(computed):
        progress.emit("rows_done", shard_id=shard.shard_id, rows=len(results) - len(computed))
    lengths = [len(ids) for ids in work.encoded.token_ids]
    output = build_output(work.valid, spec, results, lengths, work.encoded.truncated)
    write_shard_tables(store, shard.shard_id, shard.uri, output, sorted(work.rejects, key=lambda r: r[0]),
                       shard.format == "jsonl")
    computed_lengths = [len(ids) for ids in work.token_ids]
    ours = feed_padding(computed_lengths, batches, engine_name)
    baseline = padding_stats(computed_lengths,
                             fixed_batches(len(computed_lengths), spec.batching.baseline_batch_size))
    return ShardResult(
        shard_id=shard.shard_id, fingerprint=shard.fingerprint, uri=shard.uri,
        output=store.shard_output(shard.shard_id), rows_in=work.rows_in, rows_out=output.num_rows,
        rows_rejected=len(work.rejects), rows_truncated=sum(work.encoded.truncated), input_tokens=sum(lengths),
        output_tokens=int(pa.compute.sum(output.column("output_tokens")).as_py() or 0), batches=len(batches),
        real_tokens=ours.real_tokens, padded_slots=ours.padded_slots, baseline_padded_slots=baseline.padded_slots,
        engine_seconds=engine_seconds, seconds=time.perf_counter() - started, engine=engine_name if batches else "",
        structured_invalid_rows=structured_invalid_rows(output),
        prompt_cached_tokens=sum(g.cached_prompt_tokens for g in computed)
        if spec.mode == "generate" and engine_name in UNPADDED_ENGINES else None,
        **work.reuse.record(),
    )


ROW_STEPS = ShardSteps(prepare=_prepare_rows, run=_run_rows, write=_write_rows)


def _read_validate_encode(shard: ShardSpec, spec: JobSpec, model_path: str) -> tuple[int, pa.Table, EncodedRows, list]:
    """The shard's first steps: read, validate, tokenize, and drop the rows over the model's input limit;
    (rows in, the valid rows, their token ids, the rejects so far)."""
    validated, unreadable, rows_in = read_job_rows(shard, spec)
    rejects = [(row, None, reason) for row, reason in unreadable] + validated.rejects
    encoded = encode_rows(prompt_inputs(validated.valid, spec), spec, model_path)
    valid, encoded, overlong = _drop_overlong(validated.valid, encoded, spec)
    return rows_in, valid, encoded, rejects + overlong


def _drop_overlong(valid: pa.Table, encoded: EncodedRows, spec: JobSpec) -> tuple[pa.Table, EncodedRows, list]:
    """The rows over the model's input limit (overlong: reject) out of the shard, as rejects with their reason."""
    if not encoded.overlong:
        return valid, encoded, []
    row_numbers = valid.column(ROW_NUMBER).to_pylist()
    ids = valid.column(spec.id_column).to_pylist()
    rejects = [(row_numbers[i], ids[i], reason) for i, reason in encoded.overlong]
    keep = sorted(set(range(valid.num_rows)) - {i for i, _ in encoded.overlong})
    kept = EncodedRows(
        token_ids=[encoded.token_ids[i] for i in keep],
        truncated=[encoded.truncated[i] for i in keep],
        overlong=[],
    )
    return valid.take(pa.array(keep, pa.int64())), kept, rejects


def _feed(token_ids: list[list[int]], spec: JobSpec, engine_name: str, engine: Engine | None) -> list[list[int]]:
    """The shard's engine calls (plan_feed); generating on an engine that does not pad, rows that share a
    prompt prefix go adjacent, for its prefix cache."""
    batches = plan_feed([len(ids) for ids in token_ids], spec, engine_name, engine)
    if spec.mode == "generate" and not engine_pads(engine_name):
        order = prefix_order(token_ids)
        batches = [[order[i] for i in batch] for batch in batches]
    return batches


def run_batches(engine: Engine, batches: list[list[int]], token_ids: list[list[int]], spec: JobSpec,
                shard_id: str | None, calls: list[CallCost] | None = None) -> tuple[list, float]:
    """Each batch through the engine, as cut (one engine call each; see plan_feed). Returns (results per
    batch, seconds in the engine). An engine with `streams` > 1 (transformers on CPU) gets that many calls
    at once, from as many threads; results keep the batches' order either way. shard_id None: no progress
    events (an engine trial's sample is not the job's rows). calls: where each call's shape and
    seconds go (tokenmill.call_costs), when given."""
    streams = max(1, engine.streams)  # >1 only for transformers embedding on a CPU
    heap = HeapGuard()  # an in-process engine's freed activations, given back when they stop being reused
    results_by_batch: list = [None] * len(batches)
    if streams == 1:
        engine_seconds = 0.0
        for index, batch in enumerate(batches):
            heap.before_call()
            batch_started = time.perf_counter()
            results_by_batch[index] = run_engine(engine, [token_ids[i] for i in batch], spec)
            seconds = time.perf_counter() - batch_started
            engine_seconds += seconds
            if calls is not None and spec.mode == "generate" and spec.generation.n == 1:  # n > 1: calls_part
                calls.append(call_cost(engine_pads(engine.name), [len(token_ids[i]) for i in batch],
                                       results_by_batch[index], seconds, spec.batching.max_batch_size))
            elif calls is not None and spec.mode == "embed":  # its rate at each length (prediction)
                calls.append(embed_call([len(token_ids[i]) for i in batch], seconds))
            if shard_id is not None:
                progress.emit("rows_done", shard_id=shard_id, rows=len(batch))
    else:
        started = time.perf_counter()
        with ThreadPoolExecutor(streams, thread_name_prefix="tokenmill-stream") as pool:
            running: dict[Future, int] = {}
            queue = iter(enumerate(batches))
            try:
                while True:
                    for index, batch in itertools.islice(queue, streams - len(running)):
                        heap.before_call()
                        running[pool.submit(run_engine, engine, [token_ids[i] for i in batch], spec)] = index
                    if not running:
                        break
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in done:
                        index = running.pop(future)
                        results_by_batch[index] = future.result()  # an engine's error is raised here, as is
                        if shard_id is not None:
                            progress.emit("rows_done", shard_id=shard_id, rows=len(batches[index]))
            finally:
                for future in running:
                    future.cancel()
        engine_seconds = time.perf_counter() - started  # the calls overlap: the section's wall time
    if heap.trims:
        log.debug("shard %s: heap trimmed %d times between engine calls", shard_id, heap.trims)
    return results_by_batch, engine_seconds
