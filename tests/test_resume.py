"""Spot safety: a run killed mid-way resumes without redoing a finished shard."""

import os
import signal
import subprocess
import sys
import time

import mlflow
import pyarrow.parquet as pq
import pytest

from conftest import write_parquet
from tokenmill.runner import shard_cache_key
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec, ModelSpec

ENGINE_STARTED = "Initializing a V1 LLM engine"
SENTENCE = "Preemptible machines are cheap because the cloud can take them back at any moment. "


def test_cache_key_follows_what_the_output_depends_on(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["x"], ["y"])
    (shard,) = discover_shards(str(tmp_path))
    base = JobSpec(input=str(tmp_path), output="out/a")
    key = shard_cache_key(shard, base)
    assert key == shard_cache_key(shard, JobSpec(input=str(tmp_path), output="out/a/"))
    assert key == shard_cache_key(shard, base.model_copy(update={"batching": base.batching.model_copy(
        update={"token_budget": 1024})}))  # speed settings do not change results
    assert key != shard_cache_key(shard, base.model_copy(update={"output": "out/b"}))
    assert key != shard_cache_key(shard, base.model_copy(update={"model": ModelSpec(dtype="bfloat16")}))
    assert key != shard_cache_key(shard, base.model_copy(update={"overlong": "reject"}))
    assert key != shard_cache_key(shard.model_copy(update={"fingerprint": "other"}), base)


@pytest.mark.engine
def test_a_killed_run_resumes_with_finished_shards_cached(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    ids = [f"r{i:04d}" for i in range(1200)]
    texts = [SENTENCE * (1 + i % 6) for i in range(1200)]
    texts[7] = ""  # one bad row, so rejects are part of the count
    write_parquet(corpus / "docs.parquet", ids, texts, row_group_size=100)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "flows.cli", "run", "--input", str(corpus), "--output", str(out),
            "--max-shard-rows", "100", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--no-progress",
            "--set", "model.engine_kwargs={gpu_memory_utilization: 0.1}"]
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / ".prefect"))
    spec = JobSpec(input=str(corpus), output=str(out), model=ModelSpec(engine_kwargs={"gpu_memory_utilization": 0.1}))
    keys = {shard_cache_key(s, spec): s.shard_id for s in discover_shards(str(corpus), max_shard_rows=100)}
    assert len(keys) == 12

    first = subprocess.Popen(args, cwd=tmp_path, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finished: set[str] = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        stored = set(os.listdir(out / "_state")) if (out / "_state").exists() else set()
        finished = {keys[k] for k in stored if k in keys}
        if len(finished) >= 3:
            break
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)  # the engine's processes die with it, as on a preempted node
    first.wait(timeout=30)
    assert 3 <= len(finished) < 12, f"wanted a kill mid-run; {len(finished)} shards had finished"
    assert not (out / "_manifest.json").exists() or '"complete": false' in (out / "_manifest.json").read_text()

    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    cached = {line.split("shard ")[1].split(" (cached)")[0] for line in log.splitlines() if " (cached):" in line}
    assert finished <= cached

    outputs = pq.read_table(out).column("id").to_pylist()
    rejects = pq.read_table(out / "_rejects").column("id").to_pylist()
    assert sorted(outputs + rejects) == ids  # every input id exactly once
    run_id = second.stdout.split("MLflow:    run ")[1].split(":")[0]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    metrics = mlflow.get_run(run_id).data.metrics
    assert metrics["shards_cached"] == len(cached)
    # the engine saw only the rows of the shards that had not finished
    assert metrics["rows"] == sum(1 for i in outputs if keys_by_row(i) not in cached)

    third = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log3 = third.stdout + third.stderr
    assert third.returncode == 0 and log3.count(" (cached):") == 12
    # a finished job does no inference at all: the engine is never even started
    assert ENGINE_STARTED in log and ENGINE_STARTED not in log3


def keys_by_row(row_id: str) -> str:
    """The shard a row of this corpus lands in (100-row shards over one file)."""
    index = int(row_id[1:]) // 100 * 100
    return f"docs.parquet.r{index:09d}-{index + 100:09d}"
