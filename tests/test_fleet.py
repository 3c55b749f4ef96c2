"""The fleet, for real, on loopback: a Prefect server, work pools created from infra/, the
deployments of deployments/prefect.yaml, process workers, and the batch flow with
dispatch: pool. One worker's flow-run process is SIGKILLed mid-run, as a spot reclaim
would; the job must still finish with every input id exactly once.

Everything started here listens on 127.0.0.1 and is stopped at the end; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import write_parquet

REPO = Path(__file__).resolve().parents[1]
INFRA_TEMPLATES = {"k8s-gpu-spot.json": "kubernetes", "process-pool.json": "process"}
WORDS = ("spot gpu shard batch token embed corpus parquet engine worker fleet preempt retry lease slot "
         "bucket padding manifest rows output").split()

pytestmark = pytest.mark.fleet


class Fleet:
    """A Prefect server and the workers started against it."""

    def __init__(self, home: Path, ui: bool = False):
        self.home = home
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.processes: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(
            PREFECT_HOME=str(home / "prefect"),
            PREFECT_API_URL=self.api_url,
            PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="true" if ui else "false",
            # 3, not 1: on this SQLite server, workers polling every second made ~2 writes a second collide
            # ("database is locked", ~1,000 tracebacks a module run) and 2-4 times a run froze the server for
            # 60 s, its busy_timeout (py-spy: the event loop stopped mid-line, an aiosqlite thread waiting on the
            # lock): 8-10 minutes a module run at 1 s, 5 at 3 s, with no freeze (2026-12-07)
            PREFECT_WORKER_QUERY_SECONDS="3",
            PREFECT_WORKER_HEARTBEAT_SECONDS="5",
            PREFECT_LOGGING_LEVEL="INFO",
            TOKENMILL_CODE_DIR=str(REPO),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )

    def start(self, *args: str, log: str) -> subprocess.Popen:
        handle = open(self.home / log, "w")
        process = subprocess.Popen([sys.executable, "-m", "prefect", *args], env=self.env, cwd=REPO,
                                   stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def cli(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def wait_healthy(self, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.processes[0].poll() is not None:
                break
            time.sleep(1)
        raise AssertionError(f"Prefect server did not start:\n{(self.home / 'server.log').read_text()[-3000:]}")

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url)

    def stop(self) -> None:
        """SIGTERM to all, 10 s for all of them together, then SIGKILL: a Prefect 3.7 worker can hang in its
        own shutdown (NoEventLoopError in its log), and a wait of 20 s each cost the suite a minute."""
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in reversed(self.processes):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in sorted(self.home.glob("*.log")))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        fleet.start("server", "start", "--host", "127.0.0.1", "--port", str(fleet.port), log="server.log")
        fleet.wait_healthy()
        yield fleet
    finally:
        fleet.stop()


def test_the_server_accepts_every_work_pool_template_in_infra(fleet, tmp_path):
    for name, pool_type in INFRA_TEMPLATES.items():
        template = REPO / "infra" / name
        fleet.cli("work-pool", "create", f"check-{pool_type}", "--type", pool_type,
                  "--base-job-template", str(template))
        with fleet.client() as client:
            stored = client.read_work_pool(f"check-{pool_type}").base_job_template
        assert stored == json.loads(template.read_text())

    # The server does validate: a placeholder without a variable is refused.
    broken = json.loads((REPO / "infra" / "k8s-gpu-spot.json").read_text())
    broken["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "{{ priority }}"
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    refused = fleet.cli("work-pool", "create", "check-broken", "--type", "kubernetes",
                        "--base-job-template", str(tmp_path / "broken.json"), check=False)
    assert refused.returncode != 0 and "undeclared variable" in refused.stdout + refused.stderr


def _corpus(directory: Path, files: int, rows: int) -> list[str]:
    random.seed(7)
    directory.mkdir()
    ids = []
    for f in range(files):
        file_ids = [f"doc-{f}-{i:05d}" for i in range(rows)]
        texts = [" ".join(random.choice(WORDS) for _ in range(random.randint(10, 60))) for _ in file_ids]
        write_parquet(directory / f"part-{f}.parquet", file_ids, texts, row_group_size=rows // 4)
        ids += file_ids
    return ids


def _job(tmp_path: Path, name: str, **fleet_fields) -> dict:
    return {
        "input": str(tmp_path / "in"),
        "output": str(tmp_path / "out"),
        "mode": "embed",
        # transformers: two engines share this 2-core machine; vLLM's start would dominate the test
        "model": {"name": "all-MiniLM-L6-v2", "engine": "transformers"},
        "batching": {"max_shard_rows": 150},
        "dispatch": "pool",
        "fleet": {"workers": 2, "poll_seconds": 1, "concurrency_limit": f"gpu-{name}", "concurrency_slots": 2,
                  "slot_lease_seconds": 60, **fleet_fields},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": name},
    }


def _ids_written(out: Path) -> list[str]:
    ids = []
    for path in sorted(out.glob("*.parquet")) + sorted((out / "_rejects").glob("*.parquet")):
        ids += pq.read_table(path, columns=["id"]).column("id").to_pylist()
    return ids


def _wait_for(client, flow_run_id, timeout: float, fleet: Fleet, on_poll=None, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        if on_poll is not None:
            on_poll()
        time.sleep(every)
    raise AssertionError(f"flow run {flow_run_id} did not finish in {timeout} s\n{fleet.logs()}")


def _worker_runs(client, parent_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(
        any_=[parent_id])))


def deploy(fleet: Fleet):
    """Pools from infra/ and the deployments of deployments/prefect.yaml; returns tokenmill-batch/on-demand."""
    for pool in ("tokenmill-cpu", "tokenmill-gpu-spot"):
        fleet.cli("work-pool", "create", pool, "--type", "process",
                  "--base-job-template", str(REPO / "infra" / "process-pool.json"))
    fleet.cli("deploy", "--all", "--prefect-file", "deployments/prefect.yaml", timeout=300)
    with fleet.client() as client:
        nightly = client.read_deployment_by_name("tokenmill-batch/nightly")
        assert nightly.work_pool_name == "tokenmill-cpu"
        assert nightly.schedules[0].schedule.cron == "0 2 * * *"
        assert nightly.parameters["spec"]["dispatch"] == "pool"
        on_demand = client.read_deployment_by_name("tokenmill-batch/on-demand")
        assert "spec" in on_demand.parameter_openapi_schema["properties"]  # the UI's JobSpec form
        worker = client.read_deployment_by_name("tokenmill-shard-worker/gpu-spot")
        assert worker.work_pool_name == "tokenmill-gpu-spot"
        _scheduled_runs_appear(fleet, client, nightly)
        for name in ("nightly", "backfill"):  # a suite run at 02:00 or 22:00 UTC must not start them
            client.pause_deployment(client.read_deployment_by_name(f"tokenmill-batch/{name}").id)
    return on_demand


def _scheduled_runs_appear(fleet: Fleet, client, deployment, timeout: float = 90) -> None:
    """The server's scheduler makes the nightly's runs from its cron (SQLAlchemy 2.1 broke its bulk insert
    under Prefect 3.7: the schedule stood and no run was ever made)."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED]))))
        if runs:
            starts = [r.expected_start_time.astimezone(timezone.utc) for r in runs]
            assert all((t.hour, t.minute) == (2, 0) for t in starts), starts  # cron "0 2 * * *", UTC
            return
        time.sleep(2)
    raise AssertionError(f"no scheduled run of {deployment.name} within {timeout} s:\n{fleet.logs()}")


@pytest.fixture(scope="module")
def deployed(fleet):
    """deploy(), and workers: one on the CPU pool for the orchestrator, two on the GPU pool, one flow
    run at a time each (one GPU each)."""
    on_demand = deploy(fleet)
    fleet.start("worker", "start", "--pool", "tokenmill-cpu", "--type", "process", "--name", "cpu-1",
                "--limit", "1", log="worker-cpu.log")
    for n in (1, 2):
        fleet.start("worker", "start", "--pool", "tokenmill-gpu-spot", "--type", "process", "--name", f"gpu-{n}",
                    "--limit", "1", log=f"worker-gpu-{n}.log")
    return on_demand


def _mlflow_metrics(tmp_path: Path, experiment: str) -> dict[str, float]:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = mlflow.search_runs(experiment_names=[experiment], output_format="list")
    return run.data.metrics


def _mlflow_table(tmp_path: Path, experiment: str, name: str) -> dict[str, list]:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = mlflow.search_runs(experiment_names=[experiment], output_format="list")
    table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/{name}")  # {"columns": [...], "data": [rows]}
    return {column: [row[i] for row in table["data"]] for i, column in enumerate(table["columns"])}


def test_pool_dispatch_finishes_the_job_when_a_worker_is_killed_mid_run(fleet, deployed, tmp_path):
    ids = _corpus(tmp_path / "in", files=2, rows=600)  # 8 shards of 150 rows
    out = tmp_path / "out"
    killed: dict[str, str] = {}

    with fleet.client() as client:
        parent = client.create_flow_run_from_deployment(deployed.id, parameters={"spec": _job(tmp_path, "kill")})

        def kill_one_mid_run():
            if killed:
                return
            for run in _worker_runs(client, parent.id):
                if run.state is None or not run.state.is_running() or not run.infrastructure_pid:
                    continue
                written = [s for s in run.parameters["shard_ids"] if (out / f"{s}.parquet").exists()]
                if 1 <= len(written) < len(run.parameters["shard_ids"]):
                    os.kill(int(str(run.infrastructure_pid).rsplit(":", 1)[-1]), signal.SIGKILL)
                    killed.update(name=run.name, id=str(run.id))
                    return

        # a worker run's window between its first and last shard is a few seconds (~1 s a 150-row shard):
        # polled every 0.5 s, one CI run's polls all fell outside it; the poll's own API reads take ~0.1-0.3 s
        final = _wait_for(client, parent.id, 480, fleet, on_poll=kill_one_mid_run, every=0.1)
        assert final.state.is_completed(), f"{final.state}\n{fleet.logs()}"
        assert killed, "no worker run was caught between its first and its last shard"
        victim = client.read_flow_run(killed["id"])
        assert victim.state.type.value == "CRASHED", victim.state
        runs = _worker_runs(client, parent.id)
        limit = client.read_global_concurrency_limit_by_name("gpu-kill")
    assert limit.limit == 2
    assert any(r.name.startswith(final.name + "-r2-") for r in runs), [r.name for r in runs]

    written = _ids_written(out)
    assert sorted(written) == sorted(ids)  # every id exactly once across outputs and rejects
    manifest = json.loads((out / "_manifest.json").read_text())
    totals = manifest["totals"]
    assert manifest["complete"] and totals["rows_in"] == len(ids) == totals["rows_out"] + totals["rows_rejected"]

    metrics = _mlflow_metrics(tmp_path, "kill")
    assert metrics["dispatch_rounds"] >= 2 and metrics["worker_runs_lost"] >= 1
    assert "speculative_copies" in metrics and metrics["worker_runs"] == len(runs)
    assert not [k for k in metrics if k.startswith("worker/")]  # no metric name per worker run
    assert 0 < metrics["worker_tokens_per_s_min"] <= metrics["worker_tokens_per_s_median"] \
        <= metrics["worker_tokens_per_s_max"]
    workers = _mlflow_table(tmp_path, "kill", "workers.json")  # per worker run: a table
    assert sorted(workers["worker"]) == sorted(r.name for r in runs)
    assert metrics["rows_out"] == len(ids)


def test_a_straggler_gets_a_speculative_copy_and_nothing_is_written_twice(fleet, deployed, tmp_path):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    # 8 shards, all on one worker run: the copy needs the run still on its shards a poll after the deadline. At 4
    # shards and a 4 s deadline one CI run's shards all finished inside it (the test passed in isolation twice)
    ids = _corpus(tmp_path / "in", files=1, rows=1200)
    with fleet.client() as client:
        parent = client.create_flow_run_from_deployment(
            deployed.id, parameters={"spec": _job(tmp_path, "straggle", workers=1, straggler_seconds=2)})
        final = _wait_for(client, parent.id, 420, fleet)
        assert final.state.is_completed(), f"{final.state}\n{fleet.logs()}"
        runs = _worker_runs(client, parent.id)
        # the create request of a launch, sent again (as Prefect's client does when the API answers late):
        # the server hands back the run already launched, no second worker runs its shards
        keys = [r.idempotency_key for r in runs]
        assert all(keys) and len(set(keys)) == len(runs), keys
        again = client.create_flow_run_from_deployment(
            runs[0].deployment_id, parameters=runs[0].parameters, name=runs[0].name,
            idempotency_key=runs[0].idempotency_key)
        assert again.id == runs[0].id
        assert len(client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[runs[0].name])))) == 1
    assert any(r.name.endswith("-copy") for r in runs), [r.name for r in runs]
    assert sorted(_ids_written(tmp_path / "out")) == sorted(ids)
    metrics = _mlflow_metrics(tmp_path, "straggle")
    assert metrics["speculative_copies"] >= 1 and metrics["dispatch_rounds"] == 1
    assert metrics["worker_runs_lost"] == 0


def test_the_global_concurrency_limit_caps_gpu_workers_at_once(fleet, deployed, tmp_path):
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    ids = _corpus(tmp_path / "in", files=1, rows=600)  # 4 shards in two lists, but one slot
    with fleet.client() as client:
        parent = client.create_flow_run_from_deployment(
            deployed.id, parameters={"spec": _job(tmp_path, "cap", concurrency_slots=1, straggler_seconds=3600)})
        final = _wait_for(client, parent.id, 420, fleet)
        assert final.state.is_completed(), f"{final.state}\n{fleet.logs()}"
        # Prefect 3 records task runs from their events, which its server writes a moment after the parent ends
        # (one CI run read no worker runs at all right after it completed; a later one, on a host slow enough that
        # the suite took 62 minutes, read no shard task runs in 60 s): read until both are there, bounded
        spans, seen, deadline = [], {}, time.monotonic() + 180
        while len(spans) < 2 and time.monotonic() < deadline:
            spans, seen = [], {}
            for run in _worker_runs(client, parent.id):
                tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
                    flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
                seen[run.name] = sorted(f"{t.name}: {t.state_type}" for t in tasks)
                shard_tasks = [t for t in tasks if t.name.startswith("shard ") and t.start_time and t.end_time]
                if shard_tasks:
                    spans.append((min(t.start_time for t in shard_tasks), max(t.end_time for t in shard_tasks)))
            if len(spans) < 2:
                time.sleep(1)
        assert client.read_global_concurrency_limit_by_name("gpu-cap").limit == 1
    assert len(spans) == 2, f"worker runs and the task runs the API holds of each: {seen}"
    (first_start, first_end), (second_start, second_end) = sorted(spans)
    assert first_end <= second_start, f"two workers ran shards at once under a 1-slot limit: {spans}"
    assert sorted(_ids_written(tmp_path / "out")) == sorted(ids)
