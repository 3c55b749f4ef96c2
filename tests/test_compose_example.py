"""The README's "Compose your own flow" example, run as the README shows it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import TEXTS, seed_trials, write_parquet
from tokenmill.spec import JobSpec

README = Path(__file__).resolve().parents[1] / "README.md"


def compose_example() -> str:
    section = README.read_text().split("## Compose your own flow", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_example_uses_only_the_public_surface():
    code = compose_example()
    assert "from tokenmill.tasks import" in code and "tokenmill.tasks." not in code.replace("from tokenmill.tasks import", "")


@pytest.mark.engine
def test_the_compose_example_runs_and_resumes(tmp_path, monkeypatch):
    near_copy = "  " + TEXTS[0].upper()  # the same document ingested twice, under another id
    write_parquet(tmp_path / "docs.parquet", [f"d{i}" for i in range(len(TEXTS) + 1)], TEXTS + [near_copy])
    (tmp_path / "example.py").write_text(compose_example())
    # auto's engine trials as an earlier run on this machine kept them (tests/test_engine_choice.py runs them):
    # vLLM the faster once started, but run_shards weighs the starts by its shards' rows, so a corpus this
    # small runs on the engine that starts in a second and no vLLM starts (~60 s of the suite)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    seed_trials(JobSpec(input=str(tmp_path / "docs.parquet"), output=str(tmp_path / "emb")), [
        dict(engine="vllm", start_seconds=100.0, tokens_per_s=12_000.0, rows=48, tokens=800, seconds=0.07),
        dict(engine="transformers", start_seconds=1.0, tokens_per_s=10_000.0, rows=48, tokens=800, seconds=0.08),
    ])
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / ".prefect"), HF_HUB_OFFLINE="1")
    args = [sys.executable, "example.py", str(tmp_path / "docs.parquet"), str(tmp_path / "emb"), str(tmp_path / "keep.parquet")]
    for attempt in range(2):  # the second run resumes: every shard comes from the persisted results
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"kept {len(TEXTS)}" in done.stdout
        keep = pq.read_table(tmp_path / "keep.parquet").column("id").to_pylist()
        assert f"d{len(TEXTS)}" not in keep and len(keep) == len(TEXTS)  # the near copy of d0 is dropped
        assert pq.read_table(tmp_path / "emb").num_rows == len(TEXTS) + 1
        assert "Initializing a V1 LLM engine" not in done.stderr + done.stdout  # weighed by rows: transformers
    assert "Cached" in done.stderr + done.stdout
