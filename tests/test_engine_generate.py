"""The real vLLM engine on CPU, generating with SmolLM2-135M-Instruct."""

import json

import pyarrow.parquet as pq
import pytest

from conftest import TEST_GENERATE_MODEL
from tokenmill.encoding import encode_rows
from tokenmill.engines import get_engine
from tokenmill.models import resolve_model
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import ChatMessage, GenerationParams, JobSpec
from tokenmill.resolution import resolve_job

pytestmark = pytest.mark.engine

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
]


@pytest.fixture(scope="module")
def spec():
    return JobSpec(
        mode="generate",
        model=TEST_GENERATE_MODEL,
        generation=GenerationParams(max_tokens=24, messages=[ChatMessage(role="user", content="{text}")]),
    )


@pytest.fixture(scope="module")
def engine(spec):
    return get_engine(resolve_model(spec.model_name), spec)


def test_generates_answers_in_input_order(tmp_path, spec, engine):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": p}) + "\n" for i, p in enumerate(PROMPTS)))
    job = spec.model_copy(update={"input": str(path), "output": str(tmp_path / "out")})
    (shard,) = discover_shards(job.input)
    result = run_shard(shard, resolve_job(job))
    table = pq.read_table(tmp_path / "out").to_pylist()
    assert [row["id"] for row in table] == [0, 1, 2, 3]
    assert all(row["output_text"].strip() for row in table)
    assert all(0 < row["output_tokens"] <= 24 for row in table)
    assert "paris" in table[0]["output_text"].lower()
    assert result.output_tokens == sum(row["output_tokens"] for row in table)


def test_greedy_generation_is_deterministic(spec, engine):
    model_path = resolve_model(spec.model_name)
    ids = encode_rows(PROMPTS[:2], spec, model_path).token_ids
    first = [g.text for g in engine.generate(ids, spec.generation)]
    second = [g.text for g in engine.generate(list(reversed(ids)), spec.generation)]
    assert first == list(reversed(second))


def test_an_overlong_prompt_is_truncated_to_fit_the_context(spec, engine):
    model_path = resolve_model(spec.model_name)
    long_text = "The history of computing is long. " * 400  # ~3000 tokens, context is 1024
    encoded = encode_rows([long_text, "Hi"], spec, model_path)
    assert encoded.truncated == [True, False]
    assert len(encoded.token_ids[0]) <= 1024 - spec.generation.max_tokens
    # the chat template's generation prompt survives the cut
    tokenizer_tail = encoded.token_ids[0][-3:]
    assert tokenizer_tail == encoded.token_ids[1][-3:]
    outputs = engine.generate(encoded.token_ids, spec.generation)
    assert outputs[0].output_tokens > 0
