"""The run's report, pure: the job's metrics from its shard results (speed, cost, padding, the row
cache, predicted against measured), the markdown summary, the shard table and the padding plot.
tokenmill.tracking puts them on the MLflow run."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from tokenmill.bucketing import PaddingStats
from tokenmill.economics import RunCost, rate_per_s
from tokenmill.gate import model_label
from tokenmill.results import ShardResult
from tokenmill.spec import JobSpec


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
        if "predicted_wall_seconds_as_gated" in m:  # the gate picked another model than the prediction assumed
            lines.append(f"- the eval gate ran the corpus on {model_label(spec)} ({spec.model.engine}), "
                         f"not the model the prediction assumed: predicted for it before the run "
                         f"{m['predicted_wall_seconds_as_gated']:.1f} s, to the record "
                         f"{m['wall_prediction_error_as_gated']:+.1%} against the measured wall")
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


def length_plot(results: list[ShardResult], path: Path, metrics: dict[str, float]) -> Path | None:
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
