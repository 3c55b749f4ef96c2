"""How a shard's rows reach the engine: vLLM (no padding, its own scheduler) gets the shard in one call
in input order; an engine that pads gets length buckets. Results come back in input order either way."""

import json

import pyarrow.parquet as pq
import pytest

from conftest import TEST_GENERATE_MODEL
from tokenmill import runner
from tokenmill.engine_protocol import Engine, Generation
from tokenmill.engines import get_engine
from tokenmill.models import resolve_model
from tokenmill.runner import FEED_CHUNK_ROWS, feed_padding, plan_feed, run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import ChatMessage, GenerationParams, JobSpec
from tokenmill.resolution import resolve_job

# very different lengths, so length buckets would cut them into several calls
PROMPTS = [
    "What is 2 + 2?",
    "Describe the ocean. " * 120,
    "Name a color.",
    "Explain how a shard is retried after a worker dies. " * 40,
    "Say hello.",
    "List three fruits and say why people like them. " * 15,
    "What is the capital of Italy?",
    "Tell me about trains. " * 70,
    "Count to three.",
    "Why is the sky blue? " * 5,
]


class CountingEngine(Engine):
    """The real engine, with its calls counted."""

    def __init__(self, engine, name=None):
        self.engine = engine
        self.name = name or engine.name
        self.calls: list[int] = []

    def generate(self, batch, params):
        self.calls.append(len(batch))
        return self.engine.generate(batch, params)

    def embed(self, batch):
        self.calls.append(len(batch))
        return self.engine.embed(batch)

    def close(self):
        pass


class LengthEngine(Engine):
    """No model: answers each row with its own token count, so order mistakes show."""

    def __init__(self, name):
        self.name = name
        self.calls: list[int] = []

    def generate(self, batch, params):
        self.calls.append(len(batch))
        return [Generation(str(len(ids)), 1, "length") for ids in batch]

    def close(self):
        pass


def _spec(max_tokens):
    return JobSpec(
        mode="generate",
        model=TEST_GENERATE_MODEL,
        generation=GenerationParams(max_tokens=max_tokens, messages=[ChatMessage(role="user", content="{text}")]),
    )


def _shard_job(tmp_path, spec, prompts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": p}) + "\n" for i, p in enumerate(prompts)))
    job = spec.model_copy(update={"input": str(path), "output": str(tmp_path / "out")})
    (shard,) = discover_shards(job.input)
    return shard, job


def test_vllm_gets_the_shard_in_input_order_chunks_and_a_padding_engine_gets_buckets():
    spec = _spec(8)
    lengths = [5, 900, 7, 400, 6, 120, 8, 890]  # 900 and 890 share a bucket: 10 slots of padding
    assert plan_feed(lengths, spec, "vllm") == [list(range(len(lengths)))]
    buckets = plan_feed(lengths, spec, "transformers")
    assert len(buckets) > 1 and sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    many = [3] * (FEED_CHUNK_ROWS * 2 + 5)
    chunks = plan_feed(many, spec, "vllm")
    assert [len(c) for c in chunks] == [FEED_CHUNK_ROWS, FEED_CHUNK_ROWS, 5]
    assert [i for c in chunks for i in c] == list(range(len(many)))
    assert plan_feed([], spec, "vllm") == []
    # embeddings keep the buckets on vLLM too (one call per shard measured no faster)
    assert plan_feed(lengths, spec.model_copy(update={"mode": "embed"}), "vllm") == buckets
    # the record: vLLM spends no slot on padding; a padding engine spends rows x longest per bucket
    unpadded = feed_padding(lengths, [list(range(len(lengths)))], "vllm")
    assert unpadded.real_tokens == unpadded.padded_slots == sum(lengths)
    padded = feed_padding(lengths, buckets, "transformers")
    assert (padded.real_tokens, padded.padded_slots) == (sum(lengths), sum(lengths) + 10)


@pytest.mark.parametrize("engine_name, calls", [("vllm", 1), ("transformers", None)])
def test_rows_come_back_in_input_order_whatever_the_feed(tmp_path, engine_name, calls):
    shard, job = _shard_job(tmp_path, _spec(8), PROMPTS)
    engine = LengthEngine(engine_name)
    result = run_shard(shard, resolve_job(job), engine=engine)
    table = pq.read_table(tmp_path / "out").to_pylist()
    assert [row["id"] for row in table] == list(range(len(PROMPTS)))
    assert [row["output_text"] for row in table] == [str(row["input_tokens"]) for row in table]
    assert result.batches == len(engine.calls)
    if calls is not None:
        assert engine.calls == [len(PROMPTS)]
        assert result.padded_slots == result.real_tokens == result.input_tokens
    else:
        assert len(engine.calls) > 1  # length buckets
        assert result.padded_slots >= result.real_tokens


@pytest.mark.engine
def test_real_vllm_generates_a_shard_in_one_call_in_input_order(tmp_path, monkeypatch):
    spec = _spec(8)
    model_path = resolve_model(spec.model_name)
    engine = CountingEngine(get_engine(model_path, spec))
    shard, job = _shard_job(tmp_path, spec, PROMPTS)
    result = run_shard(shard, resolve_job(job), engine=engine)
    assert engine.calls == [len(PROMPTS)]
    assert result.batches == 1
    table = pq.read_table(tmp_path / "out").to_pylist()
    assert [row["id"] for row in table] == list(range(len(PROMPTS)))
    lengths = [row["input_tokens"] for row in table]
    assert max(lengths) > 10 * min(lengths)

    # each row alone through the same engine, greedy: the same answer at the same position
    encoded = runner.encode_rows(PROMPTS, spec, model_path).token_ids
    alone = [engine.engine.generate([ids], spec.generation)[0].text for ids in encoded]
    assert [row["output_text"] for row in table] == alone
