"""Calibration: the job's model on a sample of the corpus at a sweep of batch sizes.

At each size b the sample's rows (sorted by length, as our buckets would cut them) go
through the engine in calls of b rows. We measure seconds per call, tokens/s and peak
memory, fit t(b) = o + c*b, find the plateau (the smallest b beyond which doubling gains
less than 5%) and the cliff (where memory runs out or throughput falls), and recommend
batch settings for the JobSpec.

For vLLM, b is both max_num_seqs and the rows per call, and the token budget follows
from b and the sample's long rows; for the transformers engine b is the batch size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tokenmill.call_costs import remember_answers
from tokenmill.economics import RunCost
from tokenmill.encoding import encode_rows
from tokenmill.engine_choice import answers_key, cache_dir
from tokenmill.engine_protocol import run_engine
from tokenmill.engines import get_engine
from tokenmill.memory import PeakMemory
from tokenmill.resolution import resolve_job
from tokenmill.sampling import corpus_sample
from tokenmill.spec import JobSpec

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CalibrationPoint(BaseModel):
    batch_size: int
    calls: int
    seconds_per_call: float  # mean over the calls: total seconds / calls
    tokens_per_s: float
    items_per_s: float
    peak_memory_gib: float
    usd_per_1m_tokens: float
    error: str | None = None


class Calibration(BaseModel):
    model: str
    engine: str
    mode: str
    sample_rows: int
    sample_tokens: int
    points: list[CalibrationPoint]
    overhead_s: float
    per_item_s: float
    fit_r2: float
    plateau_batch_size: int
    plateau_tokens_per_s: float
    cliff_batch_size: int | None
    cliff_reason: str
    recommended: dict[str, Any]

    @property
    def fit(self) -> LinearFit:
        return LinearFit(self.overhead_s, self.per_item_s, self.fit_r2)

    def tokens_per_s_at(self, batch_size: int) -> float:
        """Measured throughput at the largest calibrated size not above `batch_size`
        (the smallest size when all are above it)."""
        good = [p for p in self.points if p.error is None]
        at_or_below = [p for p in good if p.batch_size <= batch_size] or good[:1]
        return max(at_or_below, key=lambda p: p.batch_size).tokens_per_s

    def snippet(self) -> str:
        """The recommended settings, as YAML to paste into a job file."""
        return yaml.safe_dump({"batching": self.recommended}, sort_keys=False)

    def summary(self) -> str:
        lines = [f"Calibrated {self.model} ({self.engine}, {self.mode}) on {self.sample_rows} rows, "
                 f"{self.sample_tokens:,} tokens:",
                 "  batch  s/call   tokens/s   items/s  peak GiB  $/1M tokens"]
        for p in self.points:
            if p.error:
                lines.append(f"  {p.batch_size:>5}  failed: {p.error}")
            else:
                lines.append(f"  {p.batch_size:>5}  {p.seconds_per_call:6.3f}  {p.tokens_per_s:9,.0f}  "
                             f"{p.items_per_s:8,.1f}  {p.peak_memory_gib:8.2f}  {p.usd_per_1m_tokens:.4f}")
        lines.append(f"  fit: t(b) = {self.overhead_s * 1000:.1f} ms + {self.per_item_s * 1000:.2f} ms x b "
                     f"(R^2 {self.fit_r2:.3f})")
        lines.append(f"  plateau: b = {self.plateau_batch_size} ({self.plateau_tokens_per_s:,.0f} tokens/s); "
                     + (f"cliff: b = {self.cliff_batch_size} ({self.cliff_reason})" if self.cliff_batch_size
                        else "no cliff in range"))
        return "\n".join(lines)


def calibrate(spec: JobSpec, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, sample_rows: int = 512,
              min_calls: int = 2) -> Calibration:
    resolved = resolve_job(spec)  # engine: auto calibrates the engine its trial picks
    spec, model_path = resolved.spec, resolved.model_path
    texts, _ = corpus_sample(spec, sample_rows)
    encoded = encode_rows(texts, spec, model_path)
    rows = sorted(encoded.token_ids, key=len)  # as length buckets would group them
    lengths = [len(r) for r in rows]
    sizes = [b for b in sorted(set(batch_sizes)) if b * min_calls <= len(rows)] or [1]
    # the engine must admit the largest batch (vLLM's max_num_seqs); a larger cap changes nothing else
    job = spec.model_copy(update={"batching": spec.batching.model_copy(
        update={"max_batch_size": max(spec.batching.max_batch_size, max(sizes))})})
    engine = get_engine(model_path, job)
    _call(engine, rows[: sizes[0]], job)  # warm-up

    points: list[CalibrationPoint] = []
    failed: dict[int, str] = {}
    answers: list[int] = []  # generate: the sample's answers (their lengths), as the first size's calls gave them
    for size in sizes:
        calls = [rows[i: i + size] for i in range(0, len(rows) - size + 1, size)]  # whole calls only
        tokens = sum(len(r) for call in calls for r in call)
        try:
            _call(engine, calls[0], job)  # warm-up at this shape
            with PeakMemory() as memory:
                started = time.perf_counter()
                answered = [_call(engine, call, job) for call in calls]
                seconds = time.perf_counter() - started
            produced = sum(sum(a) for a in answered)
            answers = answers or [n for a in answered for n in a]
        except Exception as exc:  # noqa: BLE001 - out of memory and friends mark the cliff
            failed[size] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            points.append(CalibrationPoint(batch_size=size, calls=len(calls), seconds_per_call=0, tokens_per_s=0,
                                           items_per_s=0, peak_memory_gib=0, usd_per_1m_tokens=0,
                                           error=failed[size]))
            break
        cost = RunCost.for_job(spec, rows=size * len(calls), input_tokens=tokens, output_tokens=produced,
                               wall_seconds=seconds, engine_seconds=seconds, gpu_count=1)
        points.append(CalibrationPoint(batch_size=size, calls=len(calls), seconds_per_call=seconds / len(calls),
                                       tokens_per_s=cost.tokens_per_s, items_per_s=cost.items_per_s,
                                       peak_memory_gib=memory.peak_gib, usd_per_1m_tokens=cost.usd_per_1m_tokens))

    if answers and spec.generation.n == 1:  # the plan and run of this job read them (engine_choice.corpus_answers)
        # beside their prompts' lengths: the first size's whole calls are the sorted rows' first len(answers)
        remember_answers(cache_dir(), answers_key(spec), answers, spec.generation.max_tokens, "calibration",
                         lengths[: len(answers)])
    good = [p for p in points if p.error is None]
    fit = fit_call_time([p.batch_size for p in good], [p.seconds_per_call for p in good]) if len(good) >= 2 else None
    plateau = find_plateau([p.batch_size for p in good], [p.tokens_per_s for p in good])
    cliff, reason = find_cliff([p.batch_size for p in good], [p.tokens_per_s for p in good], failed)
    if cliff is not None and plateau >= cliff:
        plateau = max(p.batch_size for p in good if p.batch_size < cliff)
    long_row = lengths[int(0.95 * (len(lengths) - 1))]
    recommended = {"max_batch_size": plateau, "token_budget": int(plateau * max(long_row, 1))}
    return Calibration(
        model=spec.model_name, engine=spec.model.engine, mode=spec.mode, sample_rows=len(rows),
        sample_tokens=sum(lengths), points=points,
        overhead_s=fit.overhead if fit else 0.0, per_item_s=fit.per_item if fit else 0.0, fit_r2=fit.r2 if fit else 0.0,
        plateau_batch_size=plateau, plateau_tokens_per_s=next(p.tokens_per_s for p in good if p.batch_size == plateau),
        cliff_batch_size=cliff, cliff_reason=reason, recommended=recommended,
    )


def _call(engine, batch: list[list[int]], job: JobSpec) -> list[int]:
    """One engine call; returns its rows' answers in tokens (none embedding)."""
    outputs = run_engine(engine, batch, job)
    return [g.output_tokens for g in outputs] if job.mode == "generate" else []


def plot_calibration(calibration: Calibration, path: Path) -> Path:
    """tokens/s and $/1M tokens against batch size, with the fit and the plateau marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [p for p in calibration.points if p.error is None]
    sizes = [p.batch_size for p in good]
    tokens_per_row = calibration.sample_tokens / max(calibration.sample_rows, 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sizes, [p.tokens_per_s for p in good], "o-", label="measured tokens/s")
    if calibration.per_item_s > 0:
        dense = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 50) for i in range(51)]
        fitted = [calibration.fit.items_per_s(b) * tokens_per_row for b in dense]
        ax.plot(dense, fitted, "--", color="grey",
                label=f"fit t(b) = {calibration.overhead_s * 1000:.1f} ms + {calibration.per_item_s * 1000:.2f} ms·b")
    ax.axvline(calibration.plateau_batch_size, color="green", linestyle=":",
               label=f"plateau b = {calibration.plateau_batch_size}")
    if calibration.cliff_batch_size:
        ax.axvline(calibration.cliff_batch_size, color="red", linestyle=":",
                   label=f"cliff b = {calibration.cliff_batch_size}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows per call)")
    ax.set_ylabel("tokens/s")
    cost_axis = ax.twinx()
    cost_axis.plot(sizes, [p.usd_per_1m_tokens for p in good], "s-", color="darkorange", label="$ per 1M tokens")
    cost_axis.set_ylabel("$ per 1M tokens (spot)")
    lines, labels = ax.get_legend_handles_labels()
    more_lines, more_labels = cost_axis.get_legend_handles_labels()
    ax.legend(lines + more_lines, labels + more_labels, fontsize=7, loc="center right")
    ax.set_title(f"{calibration.model} ({calibration.engine}): throughput and cost by batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- fits: how throughput grows with batch size ---

@dataclass(frozen=True)
class LinearFit:
    """Seconds per engine call t(b) = overhead + per_item * b."""

    overhead: float
    per_item: float
    r2: float

    def seconds(self, batch_size: float) -> float:
        return self.overhead + self.per_item * batch_size

    def items_per_s(self, batch_size: float) -> float:
        return batch_size / self.seconds(batch_size)


def fit_call_time(batch_sizes: list[float], seconds_per_call: list[float]) -> LinearFit:
    """Fit t(b) = o + c*b by least squares on relative error (weights 1/t^2).

    Call times span orders of magnitude across a sweep; plain least squares would let the
    largest batches decide the intercept alone, and the overhead shows only at small ones."""
    n = len(batch_sizes)
    if n < 2:
        raise ValueError("a fit needs at least two batch sizes")
    if len(set(batch_sizes)) < 2:
        raise ValueError("a fit needs at least two different batch sizes")
    weights = [1.0 / t**2 if t > 0 else 1.0 for t in seconds_per_call]
    total_w = sum(weights)
    mean_b = sum(w * b for w, b in zip(weights, batch_sizes)) / total_w
    mean_t = sum(w * t for w, t in zip(weights, seconds_per_call)) / total_w
    sxx = sum(w * (b - mean_b) ** 2 for w, b in zip(weights, batch_sizes))
    sxy = sum(w * (b - mean_b) * (t - mean_t) for w, b, t in zip(weights, batch_sizes, seconds_per_call))
    per_item = sxy / sxx
    overhead = mean_t - per_item * mean_b
    total = sum(w * (t - mean_t) ** 2 for w, t in zip(weights, seconds_per_call))
    residual = sum(w * (t - (overhead + per_item * b)) ** 2 for w, b, t in zip(weights, batch_sizes, seconds_per_call))
    return LinearFit(overhead=overhead, per_item=per_item, r2=1 - residual / total if total > 0 else 1.0)


def find_plateau(batch_sizes: list[int], tokens_per_s: list[float], gain: float = 0.05) -> int:
    """The smallest batch size beyond which doubling gains less than `gain` (5%): no larger
    size measured beats it by `gain` or more, so one flat step in noisy measurements does
    not end the search early. With no plateau in range, the largest size measured."""
    pairs = sorted(zip(batch_sizes, tokens_per_s))
    for index, (size, rate) in enumerate(pairs):
        later = [r for _, r in pairs[index + 1:]]
        if later and max(later) < rate * (1 + gain):
            return size
    return pairs[-1][0]


def find_cliff(batch_sizes: list[int], tokens_per_s: list[float], failed: dict[int, str] | None = None,
               drop: float = 0.05) -> tuple[int | None, str]:
    """The first batch size where memory ran out (the call failed) or throughput fell by more
    than `drop` against the best smaller size. (None, '') when there is none in range."""
    failures = sorted((failed or {}).items())
    best = 0.0
    for size, rate in sorted(zip(batch_sizes, tokens_per_s)):
        if failures and failures[0][0] < size:
            break
        if best and rate < best * (1 - drop):
            return size, f"throughput falls to {rate:,.0f} tokens/s from {best:,.0f}"
        best = max(best, rate)
    if failures:
        size, reason = failures[0]
        return size, f"out of memory or failed: {reason}"
    return None, ""
