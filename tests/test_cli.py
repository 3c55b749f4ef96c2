"""`tokenmill` as a user runs it: a separate process, exit codes, what it prints."""

import os
import subprocess
import sys

import pyarrow.parquet as pq


def tokenmill(*args, cwd, timeout=600):
    env = dict(os.environ, PREFECT_HOME=str(cwd / ".prefect"))
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_print_spec_shows_the_resolved_job(tmp_path):
    done = tokenmill("run", "--print-spec", "--mode", "generate", "--set", "generation.temperature=0.5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "mode: generate" in done.stdout and "temperature: 0.5" in done.stdout


def test_a_missing_input_is_a_clear_error_without_a_traceback(tmp_path):
    done = tokenmill("run", "--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o"), "--no-progress",
                     cwd=tmp_path)
    assert done.returncode == 2
    assert "tokenmill: error:" in done.stderr and "nowhere: no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr.split("tokenmill: error:")[-1]


def test_sample_corpus_is_realistic(tmp_path):
    done = tokenmill("sample-corpus", str(tmp_path / "corpus"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = sorted((tmp_path / "corpus").glob("*.parquet"))
    assert len(files) >= 3 and all(pq.ParquetFile(f).metadata.num_row_groups >= 3 for f in files)
    texts = pq.read_table(tmp_path / "corpus").column("text").to_pylist()
    assert len(texts) >= 20_000
    words = sorted(len(t.split()) for t in texts)
    median, p99 = words[len(words) // 2], words[int(len(words) * 0.99)]
    assert median < 60 and p99 > 8 * median  # many short documents, a long tail
    assert len(set(texts)) > 0.75 * len(texts)
