"""OpenAI Batch JSONL, in and out: the files teams already have for the OpenAI Batch API (and `vllm
run-batch`), run on the job's own engine, answered in OpenAI's own output schema.

Input: one request a line, `{"custom_id", "method": "POST", "url", "body"}` for /v1/chat/completions,
/v1/completions or /v1/embeddings. The body is that row's request: its messages or prompt, its sampling
(max_tokens, temperature, top_p, stop, n, seed, logprobs, response_format), its embedding input and
dimensions. Fields a body leaves out take the job's `generation` settings. A line that cannot run (not
JSON, no custom_id, a custom_id seen before, an unknown endpoint or method, a body the endpoint does not
take, another model) becomes an error line with OpenAI's error shape and the rest run.

Output, per shard (written with the shard, so resume, retries and the fleet need nothing new):
    <shard_id>.parquet                       the output dataset as for any job (id = custom_id; the first
                                             choice's text, or the first input's vector)
    _openai/shards/<shard_id>.output.jsonl   result lines: {id, custom_id, response: {status_code,
                                             request_id, body}, error: null}
    _openai/shards/<shard_id>.errors.jsonl   error lines, same schema, error: {code, message}
    _openai/shards/<shard_id>.json           the shard's counts and times
and at the end of the job (write_batch_files):
    _openai/output.jsonl, _openai/errors.jsonl, _openai/batch.json (shaped like OpenAI's Batch object).
Rows in = result lines + error lines. The lines' own schema, both ways, is tokenmill.openai_wire.
"""

from __future__ import annotations

import datetime as dt
import json
import posixpath
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tokenmill import progress
from tokenmill.bucketing import plan_batches, restore_order
from tokenmill.digest import stable_digest
from tokenmill.engine_protocol import token_budget
from tokenmill.errors import InputError
from tokenmill.models import load_tokenizer
from tokenmill.openai_wire import (
    CHAT,
    COMPLETIONS,
    ENDPOINT_MODES,
    BatchLine,
    ChatBody,
    LineError,
    ParsedLines,
    choices_of,
    embedding_body,
    error_line,
    file_mode,
    finish_reason,
    generation_body,
    jsonl_bytes,
    parse_lines,
    result_line,
    sniff_openai_batch,
)
from tokenmill.outputs import OutputStore, _embedding_array, write_shard_tables
from tokenmill.resolved_job import ResolvedJob
from tokenmill.results import ShardResult
from tokenmill.shard_pipeline import ShardSteps, run_shard_steps
from tokenmill.shards import JSONL_SUFFIXES, first_line, list_input_files, read_first_line, read_shard_bytes
from tokenmill.spec import JobSpec

OPENAI_DIR = "_openai"
OUTPUT_FILE = "output.jsonl"
ERRORS_FILE = "errors.jsonl"
BATCH_FILE = "batch.json"
# OpenAI's Batch object names a completion window; tokenmill has none (plan for yours: `tokenmill plan`).
COMPLETION_WINDOW = "none"
NEEDS_VLLM = ("OpenAI Batch generation runs each request with its own sampling parameters, which needs "
              "model.engine: vllm (or openai-server)")
PER_REQUEST_SAMPLING = frozenset({"vllm", "openai-server"})  # engines that take each row's own sampling


# --- models ----------------------------------------------------------------------------------------

def accepted_models(spec: JobSpec, model_path: str) -> set[str]:
    """The `model` values a body may name: the job's model (its name, or its path, or the path's last
    part), and any alias in openai_batch.model_aliases that maps to one of those."""
    own = {spec.model_name, str(model_path), posixpath.basename(str(model_path).rstrip("/")),
           posixpath.basename(spec.model_name.rstrip("/"))}
    aliases = {alias for alias, target in spec.openai_batch.model_aliases.items() if target in own}
    return own | aliases


def check_models(parsed: ParsedLines, spec: JobSpec, model_path: str) -> None:
    accepted = accepted_models(spec, model_path)
    kept = []
    for line in parsed.lines:
        if line.body.model is not None and line.body.model not in accepted:
            parsed.errors.append(LineError(
                line.offset, line.custom_id, "model_not_found",
                f"model {line.body.model!r} is not this job's model ({spec.model_name}); map it with "
                f"openai_batch.model_aliases: {{{line.body.model!r}: {spec.model_name!r}}} to run it there"))
        else:
            kept.append(line)
    parsed.lines = kept


def check_endpoints(parsed: ParsedLines, spec: JobSpec, uri: str, file_endpoint: str | None) -> None:
    """One endpoint per file unless the job allows mixing; lines for the other mode are line errors."""
    endpoints = {line.url for line in parsed.lines}
    if file_endpoint in ENDPOINT_MODES:
        endpoints.add(file_endpoint)
    if len(endpoints) > 1 and not spec.openai_batch.mixed_endpoints:
        raise InputError(uri, f"the file mixes endpoints ({', '.join(sorted(endpoints))}); run one endpoint per "
                              "file, or set openai_batch.mixed_endpoints: true to run them in one job")
    runnable = [line for line in parsed.lines if ENDPOINT_MODES[line.url] == spec.mode]
    if parsed.lines and not runnable and len(endpoints) == 1:
        (endpoint,) = endpoints
        raise InputError(uri, f"the file's requests are for {endpoint}, which needs mode: "
                              f"{ENDPOINT_MODES[endpoint]}; this job is mode: {spec.mode}")
    for line in parsed.lines:
        if ENDPOINT_MODES[line.url] != spec.mode:
            parsed.errors.append(LineError(
                line.offset, line.custom_id, "invalid_url",
                f"{line.url} needs a job of mode {ENDPOINT_MODES[line.url]}; this job is mode {spec.mode} with "
                f"model {spec.model_name}: run those lines as a job of their own"))
    parsed.lines = runnable


# --- prompts and sampling --------------------------------------------------------------------------

def encode_line(line: BatchLine, tokenizer) -> list[list[int]]:
    """Token ids of a request: one prompt (chat, completions), or one per embedding input."""
    body = line.body
    if line.url == CHAT:
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return [tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    if line.url == COMPLETIONS:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        text = prompt[0] if isinstance(prompt, list) else prompt
        return [tokenizer(text, add_special_tokens=True)["input_ids"]]
    inputs = body.input
    if isinstance(inputs, str):
        inputs = [inputs]
    if inputs and isinstance(inputs[0], int):
        return [list(inputs)]
    if inputs and isinstance(inputs[0], list):
        return [list(ids) for ids in inputs]
    return tokenizer(list(inputs), add_special_tokens=True)["input_ids"]


def sampling_kwargs(line: BatchLine, spec: JobSpec, prompt_tokens: int, context: int) -> dict[str, Any] | LineError:
    """One request's sampling over the job's (the engine's per-row overrides, vllm.SamplingParams names):
    the body's fields, the job's `generation` settings where the body has none; an error when the
    prompt leaves no room in the context."""
    body, defaults = line.body, spec.generation
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens or defaults.max_tokens
    room = context - prompt_tokens
    max_tokens = asked
    if asked > room:
        if room < 1 or spec.overlong == "reject":
            return LineError(line.offset, line.custom_id, "context_length_exceeded",
                             f"the prompt has {prompt_tokens} tokens and asks for {asked} more; the model's "
                             f"context is {context} tokens")
        max_tokens = room  # overlong: truncate shortens the answer, never the request
    kwargs: dict[str, Any] = {
        "logprobs": None, "response_format": None,  # only what the request asks for
        "max_tokens": max_tokens,
        "temperature": body.temperature if body.temperature is not None else defaults.temperature,
        "top_p": body.top_p if body.top_p is not None else defaults.top_p,
        "seed": body.seed if body.seed is not None else defaults.seed,
        "n": body.n,
    }
    if body.stop:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.presence_penalty is not None:
        kwargs["presence_penalty"] = body.presence_penalty
    if body.frequency_penalty is not None:
        kwargs["frequency_penalty"] = body.frequency_penalty
    if isinstance(body, ChatBody):
        if body.logprobs:
            kwargs["logprobs"] = body.top_logprobs or 0
        if body.response_format is not None and body.response_format.type == "json_schema":
            kwargs["structured_outputs"] = {"json": body.response_format.json_schema["schema"]}
        elif body.response_format is not None and body.response_format.type == "json_object":
            kwargs["structured_outputs"] = {"json_object": True}
    elif body.logprobs is not None:
        kwargs["logprobs"] = body.logprobs
    return kwargs


def matryoshka(model_path: str) -> bool:
    """Whether the model's embeddings may be cut to fewer dimensions (vLLM reads the same config keys)."""
    try:
        with open(posixpath.join(model_path, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return False
    return bool(config.get("matryoshka_dimensions") or config.get("is_matryoshka"))


def cut_dimensions(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Matryoshka: the first `dimensions` values, normalized again (what vLLM does)."""
    if dimensions is None or dimensions >= vector.shape[0]:
        return vector
    cut = vector[:dimensions]
    norm = float(np.linalg.norm(cut))
    return cut / norm if norm > 0 else cut


# --- one shard -------------------------------------------------------------------------------------

def shard_files(store, shard_id: str) -> dict[str, str]:
    folder = store.path(OPENAI_DIR, "shards")
    return {"output": posixpath.join(folder, f"{shard_id}.output.jsonl"),
            "errors": posixpath.join(folder, f"{shard_id}.errors.jsonl"),
            "record": posixpath.join(folder, f"{shard_id}.json")}


@dataclass
class RequestsWork:
    """A shard's requests, parsed, checked and encoded: those that run (line, token ids, sampling kwargs),
    the custom ids of the truncated ones, the lines' errors so far (in `parsed`)."""

    rows_in: int
    parsed: ParsedLines
    first_endpoint: str | None
    runnable: list
    truncated: dict[str, bool]
    started_at: int

    @property
    def rows(self) -> int:
        return len(self.runnable)

    @property
    def to_run(self) -> int:
        return len(self.runnable)


def _prepare_requests(shard, job: ResolvedJob, engine_name: str) -> RequestsWork:
    """Parse, check and encode the shard's lines; a line that cannot run becomes an error line."""
    started_at = int(time.time())
    spec = job.spec
    if spec.mode == "generate" and job.engine not in PER_REQUEST_SAMPLING:  # resolve_job moves it to vLLM;
        raise InputError(shard.uri, NEEDS_VLLM)            # this is a later file of an input that mixes formats
    parsed = parse_lines(read_shard_bytes(shard, spec.storage_options), shard.byte_start)
    rows_in = parsed.rows_in  # before the checks below move lines to errors
    first_endpoint = _first_endpoint(shard, spec)
    check_endpoints(parsed, spec, shard.uri, first_endpoint)
    check_models(parsed, spec, job.model_path)
    runnable, truncated = _encode_requests(parsed, job)
    return RequestsWork(rows_in, parsed, first_endpoint, runnable, truncated, started_at)


def _run_request_work(engine, work: RequestsWork, job: ResolvedJob, shard_id: str) -> tuple[list, float]:
    return _run_requests(engine, job.spec, work.runnable, shard_id)


def _write_requests(store: OutputStore, shard, job: ResolvedJob, work: RequestsWork, ran, engine_name: str,
                    started: float) -> ShardResult:
    """The Parquet output and rejects, the OpenAI result and error lines, the shard's record and result."""
    spec, runnable = job.spec, work.runnable
    outputs, engine_seconds = ran or ([], 0.0)
    results, rows, input_tokens, output_tokens = _answers(runnable, outputs, work.truncated, spec, shard.fingerprint)
    errors = sorted(work.parsed.errors, key=lambda e: e.offset)
    error_lines = [error_line(stable_digest([shard.fingerprint, e.offset], 24), e) for e in errors]
    files = shard_files(store, shard.shard_id)
    write_shard_tables(store, shard.shard_id, shard.uri, _output_table(rows, spec.mode),
                       [(e.offset, e.custom_id, f"{e.code}: {e.message}") for e in errors], True)
    store.write_bytes(files["output"], jsonl_bytes(results))
    store.write_bytes(files["errors"], jsonl_bytes(error_lines))
    endpoints = sorted({line.url for line, _, _ in runnable} | {
        e for e in (work.first_endpoint,) if e in ENDPOINT_MODES})
    store.write_json(files["record"], {"shard_id": shard.shard_id, "uri": shard.uri, "endpoints": endpoints,
                                       "completed": len(results), "failed": len(error_lines),
                                       "input_tokens": input_tokens, "output_tokens": output_tokens,
                                       "started_at": work.started_at, "finished_at": int(time.time())})
    lengths = [sum(len(ids) for ids in token_ids) for _, token_ids, _ in runnable]
    return ShardResult(
        shard_id=shard.shard_id, fingerprint=shard.fingerprint, uri=shard.uri,
        output=store.shard_output(shard.shard_id), rows_in=work.rows_in, rows_out=len(results),
        rows_rejected=len(error_lines), rows_truncated=sum(work.truncated.values()), input_tokens=input_tokens,
        output_tokens=output_tokens, batches=max(1, -(-len(runnable) // 4096)) if runnable else 0,
        real_tokens=sum(lengths), padded_slots=sum(lengths), baseline_padded_slots=sum(lengths),
        engine_seconds=engine_seconds, seconds=time.perf_counter() - started)


OPENAI_BATCH_STEPS = ShardSteps(prepare=_prepare_requests, run=_run_request_work, write=_write_requests)


def run_openai_batch_shard(shard, job: ResolvedJob, engine=None) -> ShardResult:
    """One shard of an OpenAI Batch file: parse, check, run each request with its own parameters,
    write the Parquet output, the rejects and the OpenAI result and error lines."""
    return run_shard_steps(shard, job, engine, OPENAI_BATCH_STEPS)


def _first_endpoint(shard, spec: JobSpec) -> str | None:
    """The endpoint of the file's first line, for a shard that starts further in (None for the first)."""
    first = read_first_line(shard, spec.storage_options) if shard.byte_start else b""
    if not first:
        return None
    try:
        return json.loads(first).get("url")
    except (ValueError, AttributeError):
        return None


def _encode_requests(parsed: ParsedLines, job: ResolvedJob):
    """(runnable requests as (line, token ids, sampling kwargs), custom ids of the truncated ones); a
    request that cannot run here becomes a line error in `parsed`."""
    spec, tokenizer, context = job.spec, load_tokenizer(job.model_path), job.context_limit
    can_cut = matryoshka(job.model_path) if spec.mode == "embed" else False
    runnable: list[tuple[BatchLine, list[list[int]], Any]] = []  # line, token ids, sampling kwargs
    truncated: dict[str, bool] = {}
    for line in parsed.lines:
        try:
            token_ids = encode_line(line, tokenizer)
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages: this line's error
            parsed.errors.append(LineError(line.offset, line.custom_id, "invalid_request",
                                           f"cannot render the request: {exc}"))
            continue
        if spec.mode == "generate":
            kwargs = sampling_kwargs(line, spec, len(token_ids[0]), context)
            if isinstance(kwargs, LineError):
                parsed.errors.append(kwargs)
                continue
            runnable.append((line, token_ids, kwargs))
            continue
        dimensions = line.body.dimensions
        if dimensions is not None and not can_cut:
            parsed.errors.append(LineError(line.offset, line.custom_id, "invalid_request",
                                           f"dimensions: {spec.model_name} does not support other output "
                                           "dimensions (not a matryoshka model)"))
            continue
        long_inputs = [i for i, ids in enumerate(token_ids) if len(ids) > context]
        if long_inputs and spec.overlong == "reject":
            parsed.errors.append(LineError(line.offset, line.custom_id, "context_length_exceeded",
                                           f"input {long_inputs[0]} has {len(token_ids[long_inputs[0]])} tokens; "
                                           f"the model takes at most {context}"))
            continue
        if long_inputs:  # keep the closing special token, as the tokenizer's own truncation does
            token_ids = [ids if len(ids) <= context else ids[: context - 1] + ids[-1:] for ids in token_ids]
            truncated[line.custom_id] = True
        runnable.append((line, token_ids, None))
    return runnable, truncated


def _answers(runnable, outputs: list, truncated: dict[str, bool], spec: JobSpec, fingerprint: str):
    """(result lines, output rows, input tokens, output tokens) of the requests that ran."""
    created = int(time.time())
    results, rows = [], []
    input_tokens = output_tokens = 0
    for (line, token_ids, _), output in zip(runnable, outputs):
        key = stable_digest([fingerprint, line.custom_id], 24)
        model = line.body.model or spec.model_name
        prompt_tokens = sum(len(ids) for ids in token_ids)
        if spec.mode == "generate":
            body = generation_body(line, output, prompt_tokens, model, key, created)
            first_choice = choices_of(output)[0]
            rows.append({"id": line.custom_id, "output_text": first_choice.text,
                         "input_tokens": prompt_tokens, "output_tokens": body["usage"]["completion_tokens"],
                         "truncated": False, "finish_reason": finish_reason(first_choice.finish_reason)})
            output_tokens += body["usage"]["completion_tokens"]
        else:
            vectors = [cut_dimensions(v, line.body.dimensions) for v in output]
            body = embedding_body(line, vectors, prompt_tokens, model)
            rows.append({"id": line.custom_id, "embedding": vectors[0], "input_tokens": prompt_tokens,
                         "output_tokens": 0, "truncated": truncated.get(line.custom_id, False)})
        input_tokens += prompt_tokens
        results.append(result_line(key, line.custom_id, body))
    return results, rows, input_tokens, output_tokens


FEED_CHUNK_REQUESTS = 4096  # as the runner's FEED_CHUNK_ROWS: bounds memory, keeps vLLM's scheduler full


def _run_requests(engine, spec: JobSpec, runnable, shard_id: str) -> tuple[list, float]:
    """Per request: its Generation (generate; every choice in `samples` when n > 1), or the list of its
    inputs' vectors (embed)."""
    seconds = 0.0
    if spec.mode == "generate":
        outputs = []
        for start in range(0, len(runnable), FEED_CHUNK_REQUESTS):
            chunk = runnable[start:start + FEED_CHUNK_REQUESTS]
            began = time.perf_counter()
            outputs += engine.generate([ids[0] for _, ids, _ in chunk], spec.generation,
                                       [kw for _, _, kw in chunk])
            seconds += time.perf_counter() - began
            progress.emit("rows_done", shard_id=shard_id, rows=len(chunk))
        return outputs, seconds
    flat = [ids for _, token_ids, _ in runnable for ids in token_ids]
    batching = spec.batching
    batches = plan_batches([len(ids) for ids in flat], token_budget(spec, engine), batching.max_batch_size,
                           batching.length_tolerance)
    by_batch = []
    for batch in batches:
        began = time.perf_counter()
        by_batch.append(engine.embed([flat[i] for i in batch]))
        seconds += time.perf_counter() - began
    vectors = restore_order(batches, by_batch)
    outputs, position = [], 0
    for _, token_ids, _ in runnable:
        outputs.append(vectors[position:position + len(token_ids)])
        position += len(token_ids)
    progress.emit("rows_done", shard_id=shard_id, rows=len(runnable))
    return outputs, seconds


def _output_table(rows: list[dict[str, Any]], mode: str) -> pa.Table:
    columns: dict[str, pa.Array] = {"id": pa.array([r["id"] for r in rows], pa.string())}
    if mode == "embed":
        columns["embedding"] = _embedding_array([r["embedding"] for r in rows])
    else:
        columns["output_text"] = pa.array([r["output_text"] for r in rows], pa.string())
    columns["input_tokens"] = pa.array([r["input_tokens"] for r in rows], pa.int32())
    columns["output_tokens"] = pa.array([r["output_tokens"] for r in rows], pa.int32())
    columns["truncated"] = pa.array([r["truncated"] for r in rows], pa.bool_())
    if mode == "generate":
        columns["finish_reason"] = pa.array([r["finish_reason"] for r in rows], pa.string())
    return pa.table(columns)


# --- the job's files -------------------------------------------------------------------------------

def write_batch_files(spec: JobSpec, results) -> dict[str, Any] | None:
    """_openai/output.jsonl, errors.jsonl and batch.json from the shards' lines, in shard order; None when
    no shard of the job is an OpenAI Batch shard. Lines whose custom_id an earlier shard holds (the
    cross-shard audit moved them to rejects) become error lines. A file none of whose lines ran fails
    the job, after the files are written."""
    if spec.output_format == "parquet":
        return None
    store = OutputStore(spec.output, spec.storage_options)
    ordered = sorted(results, key=lambda r: r.shard_id)
    records = {r.shard_id: store.read_json(shard_files(store, r.shard_id)["record"]) for r in ordered
               if store.exists(shard_files(store, r.shard_id)["record"])}
    if not records:
        return None
    finalizing_at = int(time.time())
    output, errors = bytearray(), bytearray()
    completed = failed = input_tokens = output_tokens = 0
    per_file: dict[str, list[int]] = {}
    endpoints: set[str] = set()
    for result in ordered:
        if result.shard_id not in records:
            continue
        files = shard_files(store, result.shard_id)
        duplicates = _duplicate_ids(store, result.shard_id)
        counts = per_file.setdefault(result.uri, [0, 0])
        endpoints.update(records[result.shard_id]["endpoints"])
        for raw in store.read_bytes(files["output"]).splitlines():
            line = json.loads(raw)
            if line["custom_id"] in duplicates:
                moved = LineError(0, line["custom_id"], "duplicate_custom_id",
                                  f"custom_id {line['custom_id']!r} is used by a line of an earlier shard")
                errors += jsonl_bytes([error_line(line["id"][len("batch_req_"):], moved)])
                failed += 1
                counts[1] += 1
                continue
            usage = line["response"]["body"]["usage"]
            input_tokens += usage["prompt_tokens"]
            output_tokens += usage.get("completion_tokens", 0)
            output += raw + b"\n"
            completed += 1
            counts[0] += 1
        error_bytes = store.read_bytes(files["errors"])
        failed_here = len(error_bytes.splitlines())
        errors += error_bytes
        failed += failed_here
        counts[1] += failed_here
    folder = store.path(OPENAI_DIR)
    store.write_bytes(posixpath.join(folder, OUTPUT_FILE), bytes(output))
    store.write_bytes(posixpath.join(folder, ERRORS_FILE), bytes(errors))
    dead = sorted(uri for uri, (done, bad) in per_file.items() if done == 0 and bad > 0)
    created_at = min(r["started_at"] for r in records.values())
    batch = _batch_object(spec, endpoints, dead, created_at=created_at, finalizing_at=finalizing_at,
                          completed_at=int(time.time()), completed=completed, failed=failed,
                          input_tokens=input_tokens, output_tokens=output_tokens)
    store.write_json(posixpath.join(folder, BATCH_FILE), batch)
    if dead:
        raise InputError(", ".join(dead), f"no line is a valid request ({failed} lines failed); the reasons are in "
                                          f"{posixpath.join(folder, ERRORS_FILE)}")
    return batch


def _batch_object(spec: JobSpec, endpoints: set[str], dead: list[str], *, created_at: int, finalizing_at: int,
                  completed_at: int, completed: int, failed: int, input_tokens: int, output_tokens: int) -> dict:
    """The job's batch.json, shaped like OpenAI's Batch object: failed when a file had no valid line."""
    return {
        "id": f"batch_{stable_digest([spec.input, spec.output, spec.model_name], 24)}",
        "object": "batch",
        "endpoint": next(iter(endpoints)) if len(endpoints) == 1 else ",".join(sorted(endpoints)),
        "errors": {"object": "list", "data": [
            {"code": "no_valid_lines", "message": f"{uri}: no line is a valid request", "param": None, "line": None}
            for uri in dead]} if dead else None,
        "input_file_id": spec.input,
        "completion_window": COMPLETION_WINDOW,
        "status": "failed" if dead else "completed",
        "output_file_id": posixpath.join(OPENAI_DIR, OUTPUT_FILE),
        "error_file_id": posixpath.join(OPENAI_DIR, ERRORS_FILE),
        "created_at": created_at,
        "in_progress_at": created_at,
        "expires_at": None,
        "finalizing_at": finalizing_at,
        "completed_at": None if dead else completed_at,
        "failed_at": completed_at if dead else None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input_tokens + output_tokens},
        "model": spec.model_name,
        "metadata": {"tokenmill_output": spec.output,
                     "finished": dt.datetime.fromtimestamp(completed_at, dt.UTC).isoformat()},
    }


def _duplicate_ids(store, shard_id: str) -> set[str]:
    path = store.shard_duplicates(shard_id)
    if not store.exists(path):
        return set()
    return {str(i) for i in store.read_table(path, columns=["id"]).column("id").to_pylist()}


def input_mode(spec: JobSpec) -> str | None:
    """The mode (embed or generate) the job's input asks for, when its first file is an OpenAI Batch
    file: the endpoint of that file's first line. None for any other input."""
    if spec.format not in ("auto", "openai-batch"):
        return None
    try:
        fs, _, files = list_input_files(spec.input, spec.storage_options)
        path = files[0]
        if spec.format == "auto" and not path.lower().endswith(JSONL_SUFFIXES):
            return None
        line = first_line(fs, path)
    except (InputError, OSError):
        return None  # the job reports what is wrong with its input
    if spec.format == "auto" and not sniff_openai_batch(line):
        return None
    return file_mode(line)
