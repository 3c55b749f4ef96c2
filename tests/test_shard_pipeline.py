"""The one shard skeleton (tokenmill.shard_pipeline): rows and OpenAI Batch requests both go through it,
and an engine whose process dies mid-shard is started again once and the shard run again, for either.
Stand-in engines (no model starts): fast."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import write_parquet
from tokenmill import engines
from tokenmill.engine_protocol import Engine
from tokenmill.resolution import resolve_job
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec

MINILM = {"name": "all-MiniLM-L6-v2", "engine": "transformers"}


class EngineDied(RuntimeError):
    """Named as engines.engine_died recognises a dead engine's error."""


class DyingEngine(Engine):
    """Embeds; the first one started dies on its first call."""

    name = "transformers"
    started = 0

    def __init__(self):
        DyingEngine.started += 1
        self.dies = DyingEngine.started == 1
        self.rows = 0

    def embed(self, batch):
        if self.dies:
            raise EngineDied("engine core process gone")
        self.rows += len(batch)
        return [np.full(8, 0.5, np.float32) for _ in batch]

    def close(self):
        pass


@pytest.fixture
def dying(monkeypatch):
    """Stand-ins for the engines the tests' jobs start, forgotten after (an outer scope may hold engines)."""
    DyingEngine.started = 0
    monkeypatch.setattr(engines, "start_engine", lambda model_path, spec: DyingEngine())
    jobs = []
    yield jobs
    for job in jobs:
        engines.discard_engine(job.model_path, job.spec)


def test_rows_are_run_again_on_a_restarted_engine(tmp_path, dying):
    path = write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(5)], [f"text {i}" for i in range(5)])
    job = resolve_job(JobSpec(input=str(path), output=str(tmp_path / "out"), model=MINILM))
    dying.append(job)
    assert (job.pipeline, job.engine, job.input_format) == ("rows", "transformers", "parquet")
    (shard,) = discover_shards(job.spec.input)
    result = run_shard(shard, job)
    assert DyingEngine.started == 2 and (result.rows_in, result.rows_out, result.engine) == (5, 5, "transformers")
    assert pq.read_table(tmp_path / "out").column("id").to_pylist() == [f"r{i}" for i in range(5)]


def test_openai_batch_requests_take_the_same_skeleton_and_restart(tmp_path, dying):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                                        "body": {"input": f"text {i}"}}) + "\n" for i in range(3)) + "not json\n")
    job = resolve_job(JobSpec(input=str(path), output=str(tmp_path / "out"), model=MINILM))
    dying.append(job)
    assert (job.pipeline, job.input_format) == ("openai-batch", "openai-batch")
    (shard,) = discover_shards(job.spec.input)
    result = run_shard(shard, job)
    assert (result.rows_in, result.rows_out, result.rows_rejected) == (4, 3, 1), result
    assert DyingEngine.started == 2
    lines = (tmp_path / "out" / "_openai" / "shards" / f"{shard.shard_id}.output.jsonl").read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == ["c0", "c1", "c2"]


def test_openai_batch_generation_is_resolved_to_vllm_and_refuses_transformers(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "Hi"}}) + "\n")
    job = resolve_job(JobSpec(input=str(path), output=str(tmp_path / "out"), mode="generate",
                              model={"name": "SmolLM2-135M-Instruct", "engine": "vllm"}))
    assert (job.engine, job.pipeline, job.input_format) == ("vllm", "openai-batch", "openai-batch")
    with pytest.raises(Exception, match="needs model.engine: vllm"):
        resolve_job(JobSpec(input=str(path), output=str(tmp_path / "out"), mode="generate",
                            model={"name": "SmolLM2-135M-Instruct", "engine": "transformers"}))
