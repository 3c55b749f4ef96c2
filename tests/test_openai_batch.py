"""OpenAI Batch JSONL in and out, read back with the `openai` package's own types.

The format tests run a shard with a stand-in engine (no vLLM). The engine tests (marked `engine`)
run the real job (the job the CLI makes of its arguments, on the session's SmolLM2 engine), then the same input
file through vLLM's own `python -m vllm.entrypoints.openai.run_batch`, and compare the answers line by line; the
job's rerun, every shard cached, runs as the command.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from openai.types import Batch, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from conftest import ENGINE_STARTED, TEST_EMBED_MODEL, TEST_GENERATE_MODEL, assert_clean_exit
from tokenmill.engine_protocol import Engine, Generation
from tokenmill.errors import InputError
from tokenmill.models import resolve_model
from tokenmill.openai_batch import OPENAI_DIR, run_openai_batch_shard, sampling_kwargs, write_batch_files
from tokenmill.openai_wire import ChatBody, parse_lines
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec
from tokenmill.resolution import resolve_job

ROOT = Path(__file__).resolve().parents[1]
ENGINE_LOCK = "/tmp/tokenmill-engine.lock"
QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "Write one sentence about the sea.", "What is 2 + 2?",
    "Say hello in Spanish.", "What is the opposite of hot?", "Name a fruit that is yellow.",
    "How many days are in a week?", "What do bees make?", "Name a planet.", "What color is the sky?",
    "Give a synonym for happy.", "What is water made of?", "Name a big animal.", "What is 10 minus 3?",
    "Which season comes after winter?", "What do you call a baby cat?", "Name a musical instrument.",
    "What is the freezing point of water in Celsius?", "Name a language spoken in Canada.",
    "What do plants need to grow?", "Name something you wear on your feet.", "What is the largest ocean?",
    "Spell the word cat backwards.", "What is a word that rhymes with moon?", "Name a shape with three sides.",
    "What is the plural of mouse?", "Name a breakfast food.", "How many legs does a spider have?",
    "Name a vegetable that is orange.", "What does a thermometer measure?", "Name a month with 31 days.",
]


def chat_line(custom_id: str, question: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
                     "max_tokens": 12, "temperature": 0, **body}}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- a stand-in engine: the format, without vLLM ----------------------------------------------------

class StandInEngine(Engine):
    """Answers like an engine: texts that name the prompt's length and the sampling asked for."""

    name = "vllm"

    def __init__(self):
        self.overrides: list[dict] = []

    def embed(self, batch):
        return [np.full(8, 1 / np.sqrt(8), np.float32) * (1 if len(ids) % 2 else -1) for ids in batch]

    def generate(self, batch, params, overrides=None):
        self.overrides += list(overrides)
        out = []
        for ids, row in zip(batch, overrides):
            logprobs = None
            if row.get("logprobs") is not None:
                logprobs = [{"token_id": 1, "token": "Hi", "logprob": -0.5,
                             "top_logprobs": [{"token_id": 1, "token": "Hi", "logprob": -0.5},
                                              {"token_id": 2, "token": "Yo", "logprob": float("-inf")}]}]
            samples = [Generation(f"answer {len(ids)}/{i}", 2, "length" if i else "stop", logprobs)
                       for i in range(row.get("n", 1))]
            first = samples[0]
            out.append(Generation(first.text, 2 * len(samples), first.finish_reason, first.logprobs,
                                  tuple(samples) if len(samples) > 1 else ()))
        return out

    def close(self):
        pass


def generate_job(tmp_path, path, **fields) -> JobSpec:
    return JobSpec(input=str(path), output=str(tmp_path / "out"), mode="generate", model=TEST_GENERATE_MODEL,
                   **fields)


BAD_LINES = [
    "this is not json",
    "[1, 2, 3]",
    {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
    {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}},
    {"custom_id": "files", "method": "POST", "url": "/v1/files", "body": {}},
    chat_line("extra-field", "Hi", tools=[{"type": "function"}]),
    {"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": 3}},
    chat_line("streaming", "Hi", stream=True),
    chat_line("other-model", "Hi", model="gpt-4o"),
    chat_line("top-without-logprobs", "Hi", top_logprobs=3),
]
BAD_CODES = {None: "invalid_json", "get": "invalid_method", "files": "invalid_url", "extra-field": "invalid_request",
             "no-messages": "invalid_request", "streaming": "invalid_request", "other-model": "model_not_found",
             "top-without-logprobs": "invalid_request", "q0": "duplicate_custom_id"}


def test_bad_lines_get_error_lines_and_the_rest_run(tmp_path):
    good = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS[:6])]
    lines = good[:3] + BAD_LINES + good[3:] + [chat_line("q0", "again")]  # q0 repeated last
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    spec = generate_job(tmp_path, path)
    (shard,) = discover_shards(str(path))
    assert shard.format == "openai-batch"  # auto-detected from the lines
    result = run_openai_batch_shard(shard, resolve_job(spec), StandInEngine())
    assert (result.rows_in, result.rows_out, result.rows_rejected) == (len(lines), 6, len(lines) - 6)

    batch = write_batch_files(spec, [result])
    out = tmp_path / "out" / OPENAI_DIR
    results, errors = read_jsonl(out / "output.jsonl"), read_jsonl(out / "errors.jsonl")
    assert [r["custom_id"] for r in results] == [f"q{i}" for i in range(6)]
    assert len(results) + len(errors) == len(lines)  # rows in = results + errors
    codes = {}
    for line in errors:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["error"]) == {"code", "message"} and line["error"]["message"]
        assert line["response"]["status_code"] == 400
        codes.setdefault(line["custom_id"], line["error"]["code"])
    assert codes == BAD_CODES
    for line in results:
        assert line["error"] is None and line["response"]["status_code"] == 200
        ChatCompletion.model_validate(line["response"]["body"])
    parsed = Batch.model_validate(batch)
    assert parsed == Batch.model_validate_json((out / "batch.json").read_text())
    assert (parsed.request_counts.total, parsed.request_counts.completed, parsed.request_counts.failed) == \
        (len(lines), 6, len(lines) - 6)
    assert parsed.status == "completed" and parsed.output_file_id and parsed.error_file_id
    assert parsed.created_at <= parsed.finalizing_at <= parsed.completed_at
    # the Parquet output and rejects as for any job: rows in = rows out + rows rejected
    assert pq.read_table(tmp_path / "out" / f"{shard.shard_id}.parquet").column("id").to_pylist() == \
        [f"q{i}" for i in range(6)]
    rejects = pq.read_table(tmp_path / "out" / "_rejects" / f"{shard.shard_id}.parquet").to_pylist()
    assert len(rejects) == len(lines) - 6 and all(r["byte_offset"] is not None for r in rejects)


def test_each_line_brings_its_own_sampling(tmp_path):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    lines = [
        chat_line("plain", "Hi"),
        chat_line("sampled", "Hi", temperature=0.7, top_p=0.9, seed=7, n=3, stop=["\n"], max_tokens=None,
                  max_completion_tokens=5),
        chat_line("logprobs", "Hi", logprobs=True, top_logprobs=2),
        chat_line("json", "Hi", response_format={"type": "json_schema",
                                                 "json_schema": {"name": "a", "schema": schema}}),
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon", "max_tokens": 4, "logprobs": 1}},
    ]
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    spec = generate_job(tmp_path, path, openai_batch={"mixed_endpoints": True})
    (shard,) = discover_shards(str(path))
    engine = StandInEngine()
    run_openai_batch_shard(shard, resolve_job(spec), engine)
    asked = {line["custom_id"]: row for line, row in zip(lines, engine.overrides)}
    assert asked["plain"]["max_tokens"] == 12 and asked["plain"]["temperature"] == 0
    assert asked["plain"]["logprobs"] is None and asked["plain"]["n"] == 1
    assert {k: asked["sampled"][k] for k in ("temperature", "top_p", "seed", "n", "stop", "max_tokens")} == \
        {"temperature": 0.7, "top_p": 0.9, "seed": 7, "n": 3, "stop": ["\n"], "max_tokens": 5}
    assert asked["logprobs"]["logprobs"] == 2
    assert asked["json"]["structured_outputs"] == {"json": schema}
    assert asked["completion"]["logprobs"] == 1 and asked["completion"]["max_tokens"] == 4

    results = {r["custom_id"]: r["response"]["body"]
               for r in read_jsonl(tmp_path / "out" / OPENAI_DIR / "shards" / f"{shard.shard_id}.output.jsonl")}
    sampled = ChatCompletion.model_validate(results["sampled"])
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert sampled.usage.completion_tokens == 6
    with_logprobs = ChatCompletion.model_validate(results["logprobs"])
    token = with_logprobs.choices[0].logprobs.content[0]
    assert token.token == "Hi" and [t.token for t in token.top_logprobs] == ["Hi", "Yo"]
    assert token.top_logprobs[1].logprob == -9999.0  # JSON has no -inf
    completion = Completion.model_validate(results["completion"])
    assert completion.object == "text_completion" and completion.choices[0].logprobs.tokens == ["Hi"]


def test_embeddings_in_and_out(tmp_path):
    lines = [
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "all-MiniLM-L6-v2", "input": "A sentence."}},
        {"custom_id": "two", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "text-embedding-3-small", "input": ["First.", "Second one, longer."]}},
        {"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "Packed.", "encoding_format": "base64"}},
        {"custom_id": "dims", "method": "POST", "url": "/v1/embeddings", "body": {"input": "Cut.", "dimensions": 4}},
        {"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}},
    ]
    path = write_jsonl(tmp_path / "emb.jsonl", lines)
    spec = JobSpec(input=str(path), output=str(tmp_path / "out"), mode="embed", model=TEST_EMBED_MODEL,
                   openai_batch={"model_aliases": {"text-embedding-3-small": "all-MiniLM-L6-v2"}})
    (shard,) = discover_shards(str(path))
    result = run_openai_batch_shard(shard, resolve_job(spec), StandInEngine())
    assert (result.rows_out, result.rows_rejected) == (3, 2)
    batch = Batch.model_validate(write_batch_files(spec, [result]))
    assert batch.endpoint == "/v1/embeddings" and batch.request_counts.completed == 3
    out = tmp_path / "out" / OPENAI_DIR
    raw = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out / "output.jsonl")}
    packed = raw["b64"]["data"][0]["embedding"]  # base64 float32, as OpenAI sends it; the SDK decodes it so:
    raw["b64"]["data"][0]["embedding"] = np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist()
    bodies = {cid: CreateEmbeddingResponse.model_validate(body) for cid, body in raw.items()}
    assert [d.index for d in bodies["two"].data] == [0, 1] and len(bodies["one"].data[0].embedding) == 8
    assert len(bodies["b64"].data[0].embedding) == 8
    assert bodies["two"].model == "text-embedding-3-small"  # answered under the name asked for
    assert bodies["one"].usage.prompt_tokens > 0
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(out / "errors.jsonl")}
    assert "matryoshka" in errors["dims"]["message"] and errors["empty"]["code"] == "invalid_request"


def test_mixed_endpoints_need_the_jobs_permission(tmp_path):
    lines = [chat_line("chat", "Hi"), {"custom_id": "text", "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": "Once", "max_tokens": 3}}]
    path = write_jsonl(tmp_path / "mixed.jsonl", lines)
    (shard,) = discover_shards(str(path))
    with pytest.raises(InputError, match="mixes endpoints"):
        run_openai_batch_shard(shard, resolve_job(generate_job(tmp_path, path)), StandInEngine())
    result = run_openai_batch_shard(shard, resolve_job(generate_job(tmp_path, path, openai_batch={"mixed_endpoints": True})),
                                    StandInEngine())
    assert result.rows_out == 2
    # a file of embeddings requests in a generate job is the job's error, not one line's
    emb = write_jsonl(tmp_path / "emb.jsonl", [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                                                "body": {"input": "x"}}])
    (shard,) = discover_shards(str(emb))
    with pytest.raises(InputError, match="needs mode: embed"):
        run_openai_batch_shard(shard, resolve_job(generate_job(tmp_path, emb)), StandInEngine())


def test_a_custom_id_held_by_an_earlier_shard_becomes_an_error_line(tmp_path):
    from tokenmill.audit import reject_cross_shard_duplicates

    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [chat_line("a1", "Hi"), chat_line("dup", "Hi")])
    write_jsonl(folder / "b.jsonl", [chat_line("dup", "Hello"), chat_line("b1", "Hello")])
    spec = generate_job(tmp_path, folder)
    shards = discover_shards(str(folder))
    results = [run_openai_batch_shard(shard, resolve_job(spec), StandInEngine()) for shard in shards]
    results = reject_cross_shard_duplicates(spec, shards, results)
    batch = Batch.model_validate(write_batch_files(spec, results))
    out = tmp_path / "out" / OPENAI_DIR
    assert [r["custom_id"] for r in read_jsonl(out / "output.jsonl")] == ["a1", "dup", "b1"]
    (error,) = read_jsonl(out / "errors.jsonl")
    assert error["custom_id"] == "dup" and error["error"]["code"] == "duplicate_custom_id"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)


def test_a_file_with_no_valid_line_fails_the_job(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES[2:])
    spec = generate_job(tmp_path, path, format="openai-batch")
    (shard,) = discover_shards(str(path), fmt="openai-batch")
    result = run_openai_batch_shard(shard, resolve_job(spec), StandInEngine())
    assert result.rows_out == 0
    with pytest.raises(InputError, match="no line is a valid request"):
        write_batch_files(spec, [result])
    batch = Batch.model_validate_json((tmp_path / "out" / OPENAI_DIR / "batch.json").read_text())
    assert batch.status == "failed" and batch.request_counts.failed == len(BAD_LINES) - 2


def test_sampling_takes_the_jobs_settings_where_the_body_has_none(tmp_path):
    (line,) = parse_lines(json.dumps(chat_line("a", "Hi", max_tokens=None, temperature=None)).encode()).lines
    assert isinstance(line.body, ChatBody)
    spec = JobSpec(mode="generate", generation={"max_tokens": 20, "temperature": 0.3, "seed": 5})
    kwargs = sampling_kwargs(line, spec, prompt_tokens=10, context=1024)
    assert (kwargs["max_tokens"], kwargs["temperature"], kwargs["seed"]) == (20, 0.3, 5)
    assert sampling_kwargs(line, spec, prompt_tokens=1020, context=1024)["max_tokens"] == 4  # fits the context
    refused = sampling_kwargs(line, spec.model_copy(update={"overlong": "reject"}), prompt_tokens=1020, context=1024)
    assert refused.code == "context_length_exceeded"


def test_plain_jsonl_stays_plain_and_the_cli_takes_the_mode_from_the_file(tmp_path):
    from tokenmill.cli import build_parser, spec_from_args

    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": 1, "text": "hello"}])
    assert discover_shards(str(plain))[0].format == "jsonl"
    batch = write_jsonl(tmp_path / "batch.jsonl", [chat_line("a", "Hi")])
    args = build_parser().parse_args(["run", "--input", str(batch), "--output", str(tmp_path / "o")])
    assert spec_from_args(args).mode == "generate"
    args = build_parser().parse_args(["run", "--input", str(plain), "--output", str(tmp_path / "o")])
    assert spec_from_args(args).mode == "embed"


# --- the real engine, against vLLM's own batch runner ----------------------------------------------

def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "TOKENIZERS_PARALLELISM": "false"}


@contextlib.contextmanager
def engine_lock():
    """One vLLM engine on the machine at a time: hold /tmp/tokenmill-engine.lock (what `flock` takes)
    around the engine commands, unless a process this test runs under holds it already."""
    with open(ENGINE_LOCK, "a") as handle:
        if _held_by_an_ancestor(ENGINE_LOCK):
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _held_by_an_ancestor(path: str) -> bool:
    inode = os.stat(path).st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[5].split(":")[-1] == str(inode):
            holders.add(int(parts[4]))
    pid = os.getpid()
    while pid > 1:
        if pid in holders:
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return False


def _tokenmill(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tokenmill.cli", "run", "--no-progress",
           "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--experiment", "tests", *args]
    done = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert_clean_exit(done, "tokenmill run")
    return done


@pytest.mark.engine
def test_same_answers_as_vllm_run_batch(tmp_path, prefect_api):
    """The same file through tokenmill (the CLI's job, several shards) and through vLLM's run_batch, greedy.
    Ours runs in this process, on the session's SmolLM2 engine (the job's model is TEST_GENERATE_MODEL, as the
    CLI makes it of these arguments): a `tokenmill run` of its own cost a third vLLM start here (~70 s of CI).
    A `tokenmill run` on vLLM runs to its end, exit checked, in tests/test_engine_lifecycle.py; the rerun below
    is the command's, on this job's output."""
    from tokenmill.cli import build_parser, spec_from_args
    from tokenmill.engines import engine_key
    from tokenmill.flows.batch import batch_flow

    lines = [chat_line(f"request-{i}", q) for i, q in enumerate(QUESTIONS)]
    path = write_jsonl(tmp_path / "requests.jsonl", lines)
    model_dir = str(resolve_model("SmolLM2-135M-Instruct"))

    kwargs = ", ".join(f"{k}: {json.dumps(v)}" for k, v in TEST_GENERATE_MODEL.engine_kwargs.items())
    job = ["--input", str(path), "--output", str(tmp_path / "out"), "--model", TEST_GENERATE_MODEL.name,
           "--engine", "vllm", "--set", "batching.max_shard_bytes=2048", "--set", f"model.engine_kwargs={{{kwargs}}}"]
    tracking = ["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--experiment", "tests"]  # as _tokenmill's
    spec = spec_from_args(build_parser().parse_args(["run", *job, *tracking]))
    shared = engine_key(JobSpec(mode="generate", model=TEST_GENERATE_MODEL))[1:]  # as tests/conftest.py keys it
    assert spec.mode == "generate" and engine_key(spec)[1:] == shared  # the session's engine runs it
    with engine_lock():  # both engines back to back, none of another test's between
        ours_seconds = time.perf_counter()
        record = batch_flow(spec)
        ours_seconds = time.perf_counter() - ours_seconds
        vllm_out = tmp_path / "vllm-output.jsonl"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(path),
               "-o", str(vllm_out), "--model", model_dir, "--served-model-name", "SmolLM2-135M-Instruct",
               "--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
               "--enforce-eager"]
        theirs_seconds = time.perf_counter()
        done = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
        theirs_seconds = time.perf_counter() - theirs_seconds
    assert done.returncode == 0, done.stderr[-5000:]
    print(f"\ntokenmill's job (Prefect, MLflow; its engine open): {ours_seconds:.0f} s; vLLM run_batch: {theirs_seconds:.0f} s")
    out = tmp_path / "out" / OPENAI_DIR
    ours = {r["custom_id"]: ChatCompletion.model_validate(r["response"]["body"]) for r in read_jsonl(out / "output.jsonl")}
    batch = Batch.model_validate_json((out / "batch.json").read_text())
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["shards_total"] > 1  # byte-range shards of one file
    assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0
    assert read_jsonl(out / "errors.jsonl") == []
    metrics = record.metrics  # the run record's counts
    assert (metrics["rows_in"], metrics["rows_out"], metrics["rows_rejected"]) == (len(lines), len(lines), 0)

    theirs = {}
    for line in read_jsonl(vllm_out):
        assert line["error"] is None, line
        theirs[line["custom_id"]] = ChatCompletion.model_validate(line["response"]["body"])

    assert set(ours) == set(theirs) == {line["custom_id"] for line in lines}
    same = [cid for cid in ours if ours[cid].choices[0].message.content == theirs[cid].choices[0].message.content]
    agreement = len(same) / len(ours)
    print(f"\nrun_batch agreement: {len(same)}/{len(ours)} identical texts ({agreement:.1%})")
    for cid in sorted(set(ours) - set(same)):
        print(f"  {cid}: ours {ours[cid].choices[0].message.content!r} vs run_batch "
              f"{theirs[cid].choices[0].message.content!r}")
    assert agreement >= 0.95
    prompt_tokens = {cid: (ours[cid].usage.prompt_tokens, theirs[cid].usage.prompt_tokens) for cid in ours}
    assert all(a == b for a, b in prompt_tokens.values()), prompt_tokens

    # resume: a second run computes nothing and writes the same results
    first = (out / "output.jsonl").read_text()
    again = _tokenmill(tmp_path, *job)  # the command, every shard cached: no engine starts
    assert "Cached" in again.stdout + again.stderr
    assert f"{len(lines)} in = {len(lines)} out + 0 rejected" in again.stdout
    assert not [line for line in ENGINE_STARTED if line in again.stdout + again.stderr], again.stdout[-2000:]
    assert (out / "output.jsonl").read_text() == first, again.stdout[-2000:]


@pytest.mark.engine
def test_embeddings_on_the_real_engine(tmp_path):
    """/v1/embeddings lines on vLLM (all-MiniLM-L6-v2): each input's vector is the one the engine gives
    that text alone, a list input gets one per item, and the lines parse as CreateEmbeddingResponse."""
    from tokenmill.engines import get_engine
    from tokenmill.models import load_tokenizer

    texts = QUESTIONS[:24]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "all-MiniLM-L6-v2", "input": text}} for i, text in enumerate(texts)]
    lines.append({"custom_id": "pair", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "all-MiniLM-L6-v2", "input": texts[:2]}})
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"inputs": "typo"}})
    path = write_jsonl(tmp_path / "emb.jsonl", lines)
    spec = JobSpec(input=str(path), output=str(tmp_path / "out"), mode="embed", model=TEST_EMBED_MODEL)
    (shard,) = discover_shards(str(path))
    model_dir = resolve_model(spec.model_name)
    with engine_lock():
        engine = get_engine(model_dir, spec)  # the session's MiniLM engine (tests/conftest.py), not a start of its own
        result = run_openai_batch_shard(shard, resolve_job(spec), engine)
        plain = engine.embed(load_tokenizer(model_dir)(texts, add_special_tokens=True)["input_ids"])
    assert (result.rows_in, result.rows_out, result.rows_rejected) == (26, 25, 1)
    Batch.model_validate(write_batch_files(spec, [result]))
    bodies = {r["custom_id"]: CreateEmbeddingResponse.model_validate(r["response"]["body"])
              for r in read_jsonl(tmp_path / "out" / OPENAI_DIR / "output.jsonl")}
    for i in range(len(texts)):
        vector = np.asarray(bodies[f"e{i}"].data[0].embedding, np.float32)
        assert len(vector) == 384 and float(vector @ plain[i]) > 0.999
    pair = bodies["pair"]
    assert [d.index for d in pair.data] == [0, 1]
    assert float(np.asarray(pair.data[1].embedding, np.float32) @ plain[1]) > 0.999
    (error,) = read_jsonl(tmp_path / "out" / OPENAI_DIR / "errors.jsonl")
    assert error["custom_id"] == "bad" and "inputs" in error["error"]["message"]
