"""Spot safety: a run killed mid-way resumes without redoing a finished shard."""

import json
import os
import signal
import subprocess
import sys
import time

import mlflow
import pyarrow.parquet as pq
import pytest

from conftest import ENGINE_STARTED, assert_clean_exit, write_parquet
from tokenmill.cli import EARLY_START
from tokenmill.results import shard_cache_key
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec, ModelSpec

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


class LocalOutput:
    def __init__(self, tmp_path):
        self.uri = str(tmp_path / "out")
        self.options: dict = {}

    def table(self, name=""):
        return pq.read_table(os.path.join(self.uri, name) if name else self.uri)


class S3Output:
    def __init__(self, endpoint):
        import s3fs

        self.fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        self.fs.mkdir("resume-bucket")
        self.uri = "s3://resume-bucket/out"
        self.options = {"endpoint_url": endpoint}

    def listdir(self, name):
        path = f"resume-bucket/out/{name}"
        self.fs.invalidate_cache()
        return {p.rsplit("/", 1)[-1] for p in self.fs.ls(path)} if self.fs.exists(path) else set()

    def read(self, name):
        return self.fs.cat_file(f"resume-bucket/out/{name}").decode()

    def exists(self, name):
        self.fs.invalidate_cache()
        return self.fs.exists(f"resume-bucket/out/{name}")

    def table(self, name=""):
        self.fs.invalidate_cache()
        return pq.read_table(f"resume-bucket/out/{name}".rstrip("/"), filesystem=self.fs)


@pytest.fixture
def output(s3_server):
    # On S3, the storage a spot fleet writes to; both go through one fsspec path (tokenmill.storage). On a
    # local output the same resume is tests/test_fleet.py's killed worker (its shards finished by a second
    # round into the same output, every id once) and the second runs of tests/test_compose_example.py and
    # tests/test_openai_batch.py (every shard cached): a local parameter here cost ~2 minutes of CI for
    # what those already run (one real-engine test per behaviour).
    return S3Output(s3_server)


def write_corpus(tmp_path, rows):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    ids = [f"r{i:04d}" for i in range(rows)]
    texts = [SENTENCE * (1 + i % 6) for i in range(rows)]
    texts[7] = ""  # one bad row, so rejects are part of the count
    write_parquet(corpus / "docs.parquet", ids, texts, row_group_size=100)
    return corpus, ids


def cli_args(corpus, output, tracking_db):
    # on the transformers engine: what these check, the shards' resume, claims and writes, no engine touches. The
    # killed run was on `engine: auto` (auto's trials and two vLLM starts: ~100 s of its 180-235 s on the CI host);
    # auto's trials are tests/test_engine_choice.py's, vLLM's clean exits tests/test_openai_batch.py's and
    # tests/test_engine_lifecycle.py's, which also unlinks what killed engine processes leave in /dev/shm (on
    # processes killed as vLLM kills its own). Not tested any more: a rerun on vLLM after a kill mid-run.
    args = [sys.executable, "-m", "tokenmill.cli", "run", "--input", str(corpus), "--output", output.uri,
            "--max-shard-rows", "100", "--tracking-uri", f"sqlite:///{tracking_db}", "--no-progress",
            "--engine", "transformers"]
    if output.options:
        args += ["--set", f"storage_options={{endpoint_url: '{output.options['endpoint_url']}'}}"]
    return args


def test_a_killed_run_resumes_with_finished_shards_cached(tmp_path, output):
    corpus, ids = write_corpus(tmp_path, 1200)
    args = cli_args(corpus, output, tmp_path / "mlflow.db")
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / ".prefect"))
    spec = JobSpec(input=str(corpus), output=output.uri, storage_options=output.options,
                   model=ModelSpec(engine="transformers"))
    keys = {shard_cache_key(s, spec): s.shard_id for s in discover_shards(str(corpus), max_shard_rows=100)}
    assert len(keys) == 12

    first = subprocess.Popen(args, cwd=tmp_path, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finished: set[str] = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        finished = {keys[k] for k in output.listdir("_state") if k in keys}
        if len(finished) >= 3:
            break
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)  # the engine's processes die with it, as on a preempted node
    first.wait(timeout=30)
    assert 3 <= len(finished) < 12, f"wanted a kill mid-run; {len(finished)} shards had finished"
    assert not output.exists("_manifest.json") or '"complete": false' in output.read("_manifest.json")

    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert_clean_exit(second, "the resumed run")
    log = second.stdout + second.stderr
    cached = {line.split("shard ")[1].split(" (cached)")[0] for line in log.splitlines() if " (cached):" in line}
    assert finished <= cached

    outputs = output.table().column("id").to_pylist()
    rejects = output.table("_rejects").column("id").to_pylist()
    assert sorted(outputs + rejects) == ids  # every input id exactly once
    run_id = second.stdout.split("MLflow:    run ")[1].split(":")[0]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    metrics = mlflow.get_run(run_id).data.metrics
    assert metrics["shards_cached"] == len(cached)
    # the engine saw only the rows of the shards that had not finished
    assert metrics["rows"] == sum(1 for i in outputs if keys_by_row(i) not in cached)

    third = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log3 = third.stdout + third.stderr
    assert_clean_exit(third, "the run of a finished job")
    assert log3.count(" (cached):") == 12
    # a finished job does no inference at all: the engine is never even started
    assert EARLY_START in log, log[-3000:]
    assert not any(line in log3 for line in ENGINE_STARTED), log3[-3000:]


def test_two_runs_of_the_same_job_at_once_end_with_one_complete_output(tmp_path):
    corpus, ids = write_corpus(tmp_path, 600)
    output = LocalOutput(tmp_path)
    runs = []
    for name in ("one", "two"):  # two machines: each its own Prefect and MLflow, one shared output
        args = cli_args(corpus, output, tmp_path / f"mlflow-{name}.db")
        env = dict(os.environ, PREFECT_HOME=str(tmp_path / f".prefect-{name}"))
        runs.append(subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))
    logs = [run.communicate(timeout=600)[0] for run in runs]
    for name, run, log in zip(("one", "two"), runs, logs):
        assert_clean_exit(subprocess.CompletedProcess(run.args, run.returncode, log, ""), f"run {name} of two at once")

    out = tmp_path / "out"
    assert not list(out.rglob("*.tmp-*"))  # no temporary file left behind
    outputs = output.table().column("id").to_pylist()
    rejects = output.table("_rejects").column("id").to_pylist()
    assert sorted(outputs + rejects) == ids
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] and manifest["totals"]["rows_in"] == 600
    assert manifest["totals"]["rows_out"] == len(outputs) == 599
    for path in out.glob("*.parquet"):
        assert pq.read_metadata(path).num_rows == 100 - (path.name.startswith("docs.parquet.r000000000"))


def keys_by_row(row_id: str) -> str:
    """The shard a row of this corpus lands in (100-row shards over one file)."""
    index = int(row_id[1:]) // 100 * 100
    return f"docs.parquet.r{index:09d}-{index + 100:09d}"
