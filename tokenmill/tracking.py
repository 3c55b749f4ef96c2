"""The run record: one MLflow run per job, with the figures DESIGN.md names."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from tokenmill.bucketing import PaddingStats
from tokenmill.calibrate import Calibration
from tokenmill.economics import RunCost
from tokenmill.runner import ShardResult
from tokenmill.spec import JobSpec


def job_params(spec: JobSpec, engine: str, model_path: str, device: str) -> dict[str, Any]:
    """What we log as params. storage_options are left out: they may hold credentials."""
    return {
        "mode": spec.mode,
        "model": spec.model_name,
        "model_path": model_path,
        "engine": engine,
        "device": device,
        "dtype": spec.model.dtype,
        "quantization": spec.model.quantization or "none",
        "engine_kwargs": json.dumps(spec.model.engine_kwargs, sort_keys=True),
        "input": spec.input,
        "output": spec.output,
        "overlong": spec.overlong,
        "token_budget": spec.batching.token_budget,
        "max_batch_size": spec.batching.max_batch_size,
        "length_tolerance": spec.batching.length_tolerance,
        "max_shard_rows": spec.batching.max_shard_rows,
        "baseline_batch_size": spec.batching.baseline_batch_size,
        "usd_per_gpu_hour_spot": spec.pricing.usd_per_gpu_hour_spot,
        "usd_per_gpu_hour_on_demand": spec.pricing.usd_per_gpu_hour_on_demand,
        "gpu_count": spec.pricing.gpu_count,
        **({"max_tokens": spec.generation.max_tokens, "temperature": spec.generation.temperature}
           if spec.mode == "generate" else {}),
    }


def run_metrics(results: Iterable[ShardResult], wall_seconds: float, spec: JobSpec,
                cached_shard_ids: set[str] = frozenset(), fleet: dict[str, float] | None = None) -> dict[str, float]:
    """Rows and padding over the whole job; speed and cost over the shards this run
    computed (cached shards were paid for by an earlier run). With a fleet, the GPUs are
    paid for the worker runs' time, not the orchestrator's."""
    results = list(results)
    fresh = [r for r in results if r.shard_id not in cached_shard_ids]
    cost = RunCost(
        rows=sum(r.rows_out for r in fresh),
        input_tokens=sum(r.input_tokens for r in fresh),
        output_tokens=sum(r.output_tokens for r in fresh),
        wall_seconds=wall_seconds,
        engine_seconds=sum(r.engine_seconds for r in fresh),
        gpu_count=spec.pricing.gpu_count,
        usd_per_gpu_hour_spot=spec.pricing.usd_per_gpu_hour_spot,
        usd_per_gpu_hour_on_demand=spec.pricing.usd_per_gpu_hour_on_demand,
        gpu_seconds=fleet["worker_seconds"] if fleet else None,
    )
    real = sum(r.real_tokens for r in results)
    padded = sum(r.padded_slots for r in results)
    baseline = sum(r.baseline_padded_slots for r in results)
    metrics = cost.metrics()
    metrics.update(padding_waste_avoided(fresh, cost))
    metrics.update(predicted_against_measured(spec, cost))
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
    metrics.update(fleet or {})
    return {k: float(v) for k, v in metrics.items()}


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


def predicted_against_measured(spec: JobSpec, cost: RunCost) -> dict[str, float]:
    """With a calibration: the tokens/s it predicts at the job's batch size, and the $ that
    implies for the tokens this run processed, beside what was measured."""
    if not spec.calibration:
        return {}
    calibration = Calibration.model_validate_json(Path(spec.calibration).read_text())
    predicted = calibration.tokens_per_s_at(spec.batching.max_batch_size)
    predicted_hours = cost.total_tokens / predicted / 3600 * cost.gpu_count if predicted else 0.0
    return {
        "predicted_tokens_per_s": predicted,
        "measured_tokens_per_s": cost.tokens_per_s,
        "measured_vs_predicted_tokens_per_s": cost.tokens_per_s / predicted if predicted else 0.0,
        "predicted_usd_spot": predicted_hours * cost.usd_per_gpu_hour_spot,
        "measured_usd_spot": cost.usd_spot,
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
    if "dispatch_rounds" in m:
        lines.append(f"- fleet: {m['worker_runs']:.0f} worker runs over {m['dispatch_rounds']:.0f} dispatch rounds "
                     f"({m['worker_runs_lost']:.0f} lost, {m['speculative_copies']:.0f} speculative copies), "
                     f"{m['worker_seconds']:.0f} worker-seconds")
    if "predicted_tokens_per_s" in m:
        lines.append(f"- predicted by calibration: {m['predicted_tokens_per_s']:.0f} tokens/s, "
                     f"${m['predicted_usd_spot']:.4f}; measured: {m['measured_tokens_per_s']:.0f} tokens/s "
                     f"({m['measured_vs_predicted_tokens_per_s']:.2f}x), ${m['measured_usd_spot']:.4f}")
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
        }
        for r in results
    ]


@contextmanager
def mlflow_run(spec: JobSpec, run_name: str | None, tags: dict[str, str] | None = None) -> Iterator[Any]:
    """An MLflow run in the job's tracking store and experiment; yields the active run."""
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    mlflow.set_experiment(spec.tracking.experiment)
    with mlflow.start_run(run_name=run_name, tags=tags) as run:
        yield run


def log_run(spec: JobSpec, params: dict[str, Any], metrics: dict[str, float], results: list[ShardResult],
            manifest: dict[str, Any], tags: dict[str, str] | None = None, gate_report=None,
            workers: list[dict[str, Any]] | None = None) -> str:
    """Write one MLflow run; returns its id."""
    import mlflow

    with mlflow_run(spec, spec.tracking.run_name, tags) as run:
        mlflow.log_params(params)
        mlflow.log_metrics(metrics)
        mlflow.log_text(summary_markdown(spec, metrics, results), "summary.md")
        if gate_report is not None:
            mlflow.log_params(gate_params(gate_report))
            mlflow.log_metrics(gate_report.mlflow_metrics())
            mlflow.log_text(gate_report.message(), "gate.txt")
        mlflow.log_dict(manifest, "manifest.json")
        if workers:
            mlflow.log_table(data={k: [row[k] for row in workers] for k in workers[0]}, artifact_file="workers.json")
        mlflow.log_table(data={k: [row[k] for row in shard_rows(results)] for k in shard_rows(results)[0]}
                         if results else {"shard": []}, artifact_file="shards.json")
        with tempfile.TemporaryDirectory() as scratch:
            plot = _length_plot(results, Path(scratch) / "padding.png", metrics)
            if plot:
                mlflow.log_artifact(str(plot))
        return run.info.run_id


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
                  steps: Iterable[tuple[int, dict[str, float]]] = ()) -> str:
    """An MLflow run for a stage other than the batch job (gate, calibrate, plan), tagged
    `tokenmill.stage`; `steps` are metrics logged against a step (a batch size). Returns its id."""
    import mlflow

    with mlflow_run(spec, run_name or stage, {"tokenmill.stage": stage}) as run:
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
    return log_stage_run(spec, "gate", report.mlflow_metrics(), gate_params(report),
                         run_name=spec.tracking.run_name or "gate", texts={"gate.txt": report.message()})


def gate_params(report) -> dict[str, Any]:
    return {"gate_reference": report.reference.model, "gate_reference_engine": report.reference.engine,
            "gate_candidate": report.candidate.model, "gate_candidate_engine": report.candidate.engine,
            "gate_sample": report.sample_source, "gate_action": report.action}
