"""`tokenmill run` starts Prefect's ephemeral API itself, ahead of the flow (tasks/warm.py).

The API's process starts as soon as the job is parsed (after a first command's model probe of
the machine, tokenmill.prediction.probe_machine), so its start overlaps the CLI's own imports
and the engine's start. These check what a user relies on: the flow run is recorded
by that API, the server ends with the command (also when the command is killed), and a
temporary server's URL is never recorded as the run's Prefect link.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import time

import mlflow
import psutil
import pytest

from conftest import TEXTS, write_parquet

SERVER_APP = "api_process.py"  # tasks/api_process.py: Prefect's app, served as Prefect serves it


def environment(tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / ".prefect"), PYTHONUNBUFFERED="1")
    env.pop("PREFECT_API_URL", None)
    return env


def command(tmp_path, corpus, out="emb"):
    return [sys.executable, "-m", "tokenmill.cli", "run", "--input", str(corpus), "--output", str(tmp_path / out),
            "--engine", "transformers", "--no-progress", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]


def api_servers(parent: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in parent.children(recursive=True):
        try:
            if SERVER_APP in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {seconds:.0f} s")


@pytest.fixture
def corpus(tmp_path):
    return write_parquet(tmp_path / "docs.parquet", [f"d{i}" for i in range(len(TEXTS))], TEXTS)


def test_the_run_is_recorded_by_the_api_started_ahead_and_the_server_ends_with_the_command(tmp_path, corpus,
                                                                                         monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))  # the parts this run measures, its own
    process = subprocess.Popen(command(tmp_path, corpus), cwd=tmp_path, env=environment(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(process.pid)
    servers = wait_for(lambda: api_servers(parent), 60, "the API's server process started by the CLI")
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "Rows:      {0} in = {0} out + 0 rejected".format(len(TEXTS)) in stdout
    for server in servers:  # stopped at exit, not left behind
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, server

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    assert "prefect.flow_run_url" not in run.data.tags  # the server is gone: no link to it
    # the same database `prefect server start` serves afterwards holds the flow run and its tasks
    with sqlite3.connect(tmp_path / ".prefect" / "prefect.db") as db:
        (state,) = db.execute("select state_type from flow_run where id = ?", (flow_run_id,)).fetchone()
        tasks = db.execute("select count(*) from task_run where flow_run_id = ?", (flow_run_id,)).fetchone()[0]
    assert state == "COMPLETED" and tasks >= 3
    # the server's process marked its startup, where it created the database (a new PREFECT_HOME): recorded, and
    # stored apart from the rest of its start for the next run's prediction (tokenmill.prediction.API_FIRST_REST)
    api, startup = (run.data.metrics[f"fixed/orchestrator_api{part}_seconds"] for part in ("", "_startup"))
    assert 0 < startup < api
    from tokenmill import prediction

    machine = prediction.read_parts()[prediction.machine_key()]
    assert machine[prediction.API_FIRST_REST] == [pytest.approx(api - startup, abs=2e-3)]
    assert machine[prediction.API_CREATED] == [pytest.approx(api, abs=1e-3)] and prediction.API_STARTUP not in machine


def test_the_server_dies_with_a_killed_command(tmp_path, corpus):
    process = subprocess.Popen(command(tmp_path, corpus, "killed"), cwd=tmp_path, env=environment(tmp_path),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(process.pid)
    (server,) = wait_for(lambda: api_servers(parent), 60, "the API's server process started by the CLI")
    process.send_signal(signal.SIGKILL)  # no atexit, no finally: only the kernel can end the server now
    process.wait(timeout=30)
    wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, 30,
             "the server process ending after its CLI was killed")


def warm_spec(tmp_path, tracking_uri):
    from tokenmill.spec import JobSpec

    return JobSpec.model_validate({"input": str(tmp_path / "docs.parquet"), "output": str(tmp_path / "out"),
                                   "tracking": {"mlflow_tracking_uri": tracking_uri}})


def test_the_tracking_store_opens_while_the_api_starts_and_the_flow_finds_it_open(tmp_path):
    import matplotlib

    from tokenmill import timeline
    from tokenmill.tasks.warm import warm_tracking
    from tokenmill.tracking import tracking_client

    spec = warm_spec(tmp_path, f"sqlite:///{tmp_path}/warm.db")
    warm_tracking(spec)
    assert (tmp_path / "warm.db").exists()  # the store was opened (its schema made) here, not in the flow
    # MLflow keeps the store per tracking URI: the flow's client gets the one opened ahead
    assert tracking_client(spec)._tracking_client.store is tracking_client(spec)._tracking_client.store
    assert "matplotlib.pyplot" in sys.modules and matplotlib.get_backend().lower() == "agg"
    assert "tracking_warm" in timeline.marks()


def test_a_tracking_store_that_cannot_open_is_left_for_the_flow_to_report(tmp_path):
    from tokenmill.tasks.warm import warm_tracking

    warm_tracking(warm_spec(tmp_path, "no-such-scheme://nowhere"))  # no error here: the flow meets it
