"""Generation jobs with the real vLLM engine on CPU (SmolLM2-135M-Instruct): structured outputs
(JSON schema, choice, regex), prompts from several columns, a messages column, passthrough, n > 1,
stop, logprobs, per-row sampling, the prefix cache, and the gate's parsed-value agreement.
One engine for the whole module (the spec of tests/test_engine_generate.py); max_tokens small."""

import json

import pyarrow.parquet as pq
import pytest
from jsonschema import Draft202012Validator

from conftest import TEST_GENERATE_MODEL, write_parquet
from tokenmill.encoding import encode_rows
from tokenmill.engine_protocol import Engine, Generation
from tokenmill.engines import get_engine
from tokenmill.gate import evaluate
from tokenmill.manifest import build_manifest
from tokenmill.models import load_tokenizer, resolve_model
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec
from tokenmill.report import run_metrics
from tokenmill.resolution import resolve_job

pytestmark = pytest.mark.engine

LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                   "confidence": {"type": "number"}},
    "required": ["label", "confidence"],
    "additionalProperties": False,
}
TICKETS = [
    "The app crashes every time I open it.", "Thanks, the new dashboard is great!", "How do I change my email?",
    "Billing charged me twice this month.", "Support answered in minutes, lovely.", "The export is slow but works.",
    "I cannot log in since the update.", "Where can I download my invoices?", "Best tool we have bought this year.",
    "The search gives wrong results.",
]
PRODUCTS = ["Mill", "Ledger", "Atlas"]
LABEL_MESSAGES = [
    {"role": "system", "content": "You label support tickets about {product}. Answer in JSON."},
    {"role": "user", "content": "Ticket: Nothing works."},
    {"role": "assistant", "content": '{"label": "negative", "confidence": 0.9}'},
    {"role": "user", "content": "Product: {product}\nTicket: {text}"},
]


@pytest.fixture(scope="module")
def spec():
    return JobSpec(mode="generate", model=TEST_GENERATE_MODEL,
                   generation={"max_tokens": 24, "messages": [{"role": "user", "content": "{text}"}]})


@pytest.fixture(scope="module")
def engine(spec):
    return get_engine(resolve_model(spec.model_name), spec)


def tickets_file(path, rows):
    ids = list(range(rows))
    write_parquet(path, ids, [TICKETS[i % len(TICKETS)] for i in ids],
                  product=[PRODUCTS[i % len(PRODUCTS)] for i in ids], lang=["en"] * rows)
    return path


def run_job(tmp_path, spec, path, name="out", **generation):
    job = spec.model_copy(update={
        "input": str(path), "output": str(tmp_path / name),
        "generation": spec.generation.model_validate({**spec.generation.model_dump(), **generation})})
    (shard,) = discover_shards(job.input)
    result = run_shard(shard, resolve_job(job))
    return job, result, pq.read_table(tmp_path / name).to_pylist()


def test_a_json_schema_job_on_100_rows_parses_or_marks_every_row(tmp_path, spec, engine):
    path = tickets_file(tmp_path / "tickets.parquet", 100)
    job, result, rows = run_job(tmp_path, spec, path, max_tokens=32, messages=LABEL_MESSAGES,
                                response_format={"json_schema": LABEL_SCHEMA})
    validator = Draft202012Validator(LABEL_SCHEMA)
    assert [r["id"] for r in rows] == list(range(100))
    assert result.rows_in == result.rows_out == 100
    for row in rows:
        if row["structured_error"] is None:
            assert not list(validator.iter_errors(json.loads(row["parsed"])))
        else:
            assert row["parsed"] is None and row["structured_error"]
    invalid = sum(r["structured_error"] is not None for r in rows)
    assert result.structured_invalid_rows == invalid
    assert invalid < 12  # the grammar holds; the rare row that runs out of tokens is marked, not passed
    manifest = build_manifest(job, [result], 1)
    assert manifest["totals"]["structured_invalid_rows"] == invalid
    metrics = run_metrics([result], result.seconds, job)
    assert metrics["structured_invalid_rows"] == invalid
    assert result.prompt_cached_tokens is not None and 0 <= metrics["prefix_cache_hit_rate"] <= 1

    _, cut, cut_rows = run_job(tmp_path, spec, tickets_file(tmp_path / "few.parquet", 8), name="cut", max_tokens=3,
                               messages=LABEL_MESSAGES, response_format={"json_schema": LABEL_SCHEMA})
    assert cut.structured_invalid_rows == 8 and cut.rows_out == 8
    assert all("hit max_tokens" in r["structured_error"] and r["parsed"] is None for r in cut_rows)


def test_rows_sharing_a_long_prefix_hit_the_prefix_cache(tmp_path, spec, engine):
    # vLLM caches whole KV blocks (128 tokens on CPU): each task's system prompt and few-shot turns
    # take a few blocks; rows of three tasks, interleaved in the input, are submitted task by task
    path = tmp_path / "tasks.parquet"
    write_parquet(path, list(range(24)), [TICKETS[i % len(TICKETS)] for i in range(24)],
                  task=[["billing", "login", "search"][i % 3] for i in range(24)])
    shots = [m for t in TICKETS for m in ({"role": "user", "content": f"Ticket: {t}"},
                                          {"role": "assistant", "content": '{"label": "neutral"}'})]
    messages = [{"role": "system", "content": "You sort tickets about {task}. " * 8}, *shots,
                {"role": "user", "content": "Ticket: {text}"}]
    job, result, rows = run_job(tmp_path, spec, path, max_tokens=2, messages=messages)
    assert [r["id"] for r in rows] == list(range(24))
    assert result.input_tokens > 24 * 300
    assert result.prompt_cached_tokens > 0.3 * result.input_tokens
    assert run_metrics([result], result.seconds, job)["prefix_cache_hit_rate"] > 0.3


def test_choice_and_regex(tmp_path, spec, engine):
    path = tickets_file(tmp_path / "t.parquet", 6)
    _, _, rows = run_job(tmp_path, spec, path, name="choice", messages=[
        {"role": "user", "content": "Is this ticket positive or negative? {text}"}],
        response_format={"choice": ["positive", "negative"]})
    assert all(r["parsed"] in ("positive", "negative") and r["output_text"] == r["parsed"] for r in rows)
    _, _, rows = run_job(tmp_path, spec, path, name="regex", max_tokens=8, messages=[
        {"role": "user", "content": "Rate this ticket from 1 to 5: {text}"}], response_format={"regex": "[1-5]"})
    assert all(r["parsed"] in list("12345") and r["structured_error"] is None for r in rows)


def test_two_columns_with_a_system_prompt_and_a_few_shot_turn_and_passthrough(tmp_path, spec, engine):
    path = tickets_file(tmp_path / "t.parquet", 6)
    job, _, rows = run_job(tmp_path, spec, path, messages=LABEL_MESSAGES, max_tokens=12)
    prompt = load_tokenizer(resolve_model(job.model_name)).decode(
        encode_rows([{"text": TICKETS[1], "product": "Ledger"}], job, resolve_model(job.model_name)).token_ids[0])
    assert "about Ledger" in prompt and f"Product: Ledger\nTicket: {TICKETS[1]}" in prompt
    assert '{"label": "negative", "confidence": 0.9}' in prompt  # the few-shot turn, braces intact
    assert all(r["output_text"] for r in rows)
    named = job.model_copy(update={"passthrough_columns": ["product", "lang"], "output": str(tmp_path / "named")})
    run_shard(discover_shards(job.input)[0], resolve_job(named))
    table = pq.read_table(tmp_path / "named")
    assert table.column_names[-2:] == ["product", "lang"] and table.column_names[:2] == ["id", "output_text"]
    assert table.column("product").to_pylist() == [PRODUCTS[i % 3] for i in range(6)]
    every = job.model_copy(update={"passthrough_columns": "all", "output": str(tmp_path / "all")})
    run_shard(discover_shards(job.input)[0], resolve_job(every))
    assert pq.read_table(tmp_path / "all").column_names[-3:] == ["text", "product", "lang"]


def test_a_messages_column_is_each_rows_own_chat(tmp_path, spec, engine):
    path = tmp_path / "chats.jsonl"
    chats = [[{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": q}]
             for q in ("What is the capital of France?", "What colour is the sky?")]
    path.write_text("".join(json.dumps({"id": f"c{i}", "chat": c, "topic": "quiz"}) + "\n"
                            for i, c in enumerate(chats)))
    job, _, rows = run_job(tmp_path, spec, path, messages_column="chat", max_tokens=8)
    job = job.model_copy(update={"passthrough_columns": ["topic"], "output": str(tmp_path / "pt")})
    run_shard(discover_shards(job.input)[0], resolve_job(job))
    assert [r["id"] for r in rows] == ["c0", "c1"] and "paris" in rows[0]["output_text"].lower()
    assert pq.read_table(tmp_path / "pt").column("topic").to_pylist() == ["quiz", "quiz"]


def test_n_2_stop_and_logprobs(tmp_path, spec, engine):
    path = tickets_file(tmp_path / "t.parquet", 3)
    _, result, rows = run_job(tmp_path, spec, path, n=2, temperature=0.9, seed=1, max_tokens=10,
                              messages=[{"role": "user", "content": "Reply to: {text}"}])
    assert all(len(r["output_text"]) == 2 and len(r["finish_reason"]) == 2 for r in rows)
    assert result.output_tokens == sum(r["output_tokens"] for r in rows) > 3 * 10 * 0.5

    _, _, rows = run_job(tmp_path, spec, path, name="stop", max_tokens=24, stop=[" "],
                         messages=[{"role": "user", "content": "Write a sentence about: {text}"}])
    assert all(" " not in r["output_text"].strip() for r in rows)
    assert any(r["finish_reason"] == "stop" for r in rows)

    _, _, rows = run_job(tmp_path, spec, path, name="lp", max_tokens=6, logprobs=2)
    for row in rows:
        assert len(row["logprobs"]) == row["output_tokens"]
        first = row["logprobs"][0]
        assert first["logprob"] <= 0 and 2 <= len(first["top_logprobs"]) <= 3
        assert "".join(t["token"] for t in row["logprobs"]) == row["output_text"]


def test_per_row_sampling_params(spec, engine):
    ids = encode_rows(["Count to twenty.", "Count to twenty."], spec, resolve_model(spec.model_name)).token_ids
    short, longer = engine.generate(ids, spec.generation, [{"max_tokens": 2}, {"max_tokens": 9, "min_tokens": 9}])
    assert short.output_tokens == 2 and longer.output_tokens == 9


class DamagedEngine(Engine):
    """The real engine, whose JSON answers come back with the label flipped: a candidate that disagrees."""

    name = "vllm"

    def __init__(self, engine):
        self.engine = engine

    def generate(self, batch, params, overrides=None):
        flip = {"positive": "negative", "negative": "positive", "neutral": "positive"}
        out = []
        for g in self.engine.generate(batch, params, overrides):
            try:
                value = json.loads(g.text)
                value["label"] = flip[value["label"]]
                out.append(Generation(json.dumps(value), g.output_tokens, g.finish_reason))
            except (ValueError, KeyError, TypeError):
                out.append(g)
        return out


def test_the_gate_compares_parsed_values_field_by_field(tmp_path, spec, engine, monkeypatch):
    path = tickets_file(tmp_path / "t.parquet", 12)
    job = JobSpec.model_validate({
        **spec.model_dump(), "input": str(path),
        "generation": {**spec.generation.model_dump(), "messages": LABEL_MESSAGES,
                       "response_format": {"json_schema": LABEL_SCHEMA}},
        "gate": {"reference": TEST_GENERATE_MODEL.model_dump(), "sample_rows": 12, "max_tokens": 24}})
    from tokenmill.gate import sample_texts

    texts, source = sample_texts(job)
    assert isinstance(texts[0], dict) and "product" in texts[0]  # the gate renders the same prompts
    same = evaluate(job, texts, source)
    metric = {m.name: m for m in same.metrics}["parsed_agreement"]
    assert metric.value == 1.0 and metric.passed and same.mlflow_metrics()["gate_parsed_agreement"] == 1.0

    from tokenmill import gate

    calls = []
    real_get_engine = gate.get_engine

    def candidate_damaged(model_path, job_spec):
        if job_spec.mode != "generate":  # the similarity metric's MiniLM
            return real_get_engine(model_path, job_spec)
        calls.append(job_spec)
        return engine if len(calls) == 1 else DamagedEngine(engine)  # the reference first, then the candidate

    monkeypatch.setattr(gate, "get_engine", candidate_damaged)
    damaged = evaluate(job, texts, source, refresh=True)  # measured again, not this sample's cached verdict
    metric = {m.name: m for m in damaged.metrics}["parsed_agreement"]
    assert metric.value <= 0.6 and not metric.passed and not damaged.passed


def test_the_transformers_engine_does_what_generate_does(spec):
    hf_job = JobSpec.model_validate({**spec.model_dump(), "model": {**TEST_GENERATE_MODEL.model_dump(),
                                                                    "engine": "transformers", "engine_kwargs": {}}})
    hf = get_engine(resolve_model(hf_job.model_name), hf_job)
    ids = encode_rows(TICKETS[:2], hf_job, resolve_model(hf_job.model_name)).token_ids
    params = hf_job.generation.model_copy(update={"n": 2, "temperature": 0.8, "top_k": 20, "min_p": 0.05,
                                                  "repetition_penalty": 1.1, "min_tokens": 2, "stop": ["."],
                                                  "max_tokens": 16})
    rows = hf.generate(ids, params)
    assert len(rows) == 2 and all(len(g.samples) == 2 for g in rows)
    for g in rows:
        assert g.output_tokens == sum(s.output_tokens for s in g.samples)
        assert all("." not in s.text and s.output_tokens >= 2 for s in g.samples)
