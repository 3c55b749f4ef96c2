"""What a run cost (from measured seconds and counted tokens), how throughput grows with
batch size (calibration fits), and what a corpus will cost on a fleet (plans)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RunCost:
    rows: int
    input_tokens: int
    output_tokens: int
    wall_seconds: float  # the whole job, engine start included: what the GPUs are rented for
    engine_seconds: float  # time inside engine calls only
    gpu_count: int
    usd_per_gpu_hour_spot: float
    usd_per_gpu_hour_on_demand: float
    # A fleet rents GPUs for its worker runs' lifetimes, not for the orchestrator's wall time
    gpu_seconds: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def gpu_hours(self) -> float:
        rented = self.wall_seconds if self.gpu_seconds is None else self.gpu_seconds
        return rented / 3600.0 * self.gpu_count

    @property
    def usd_spot(self) -> float:
        return self.gpu_hours * self.usd_per_gpu_hour_spot

    @property
    def usd_on_demand(self) -> float:
        return self.gpu_hours * self.usd_per_gpu_hour_on_demand

    @property
    def tokens_per_s(self) -> float:
        return _rate(self.total_tokens, self.wall_seconds)

    @property
    def items_per_s(self) -> float:
        return _rate(self.rows, self.wall_seconds)

    @property
    def engine_tokens_per_s(self) -> float:
        return _rate(self.total_tokens, self.engine_seconds)

    @property
    def usd_per_1m_tokens(self) -> float:
        """On spot prices: the tier a resumable batch job is built to run on."""
        return _per_million(self.usd_spot, self.total_tokens)

    @property
    def usd_per_1m_tokens_on_demand(self) -> float:
        return _per_million(self.usd_on_demand, self.total_tokens)

    def metrics(self) -> dict[str, float]:
        names = ("total_tokens", "gpu_hours", "usd_spot", "usd_on_demand", "tokens_per_s",
                 "items_per_s", "engine_tokens_per_s", "usd_per_1m_tokens", "usd_per_1m_tokens_on_demand")
        values = {k: v for k, v in asdict(self).items()
                  if not k.startswith("usd_per_gpu") and k != "gpu_count" and v is not None}
        values.update({name: getattr(self, name) for name in names})
        return {k: float(v) for k, v in values.items()}


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _per_million(usd: float, tokens: int) -> float:
    return usd / tokens * 1_000_000 if tokens > 0 else 0.0


# --- calibration: how throughput grows with batch size ---------------------------------

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


# --- planning a fleet for a corpus ---------------------------------------------------------

@dataclass(frozen=True)
class FleetPlan:
    total_tokens: float
    tokens_per_s_per_gpu: float
    window_hours: float
    straggler_margin: float
    preemptions_per_gpu_hour: float
    largest_shard_tokens: float
    engine_start_seconds: float
    usd_per_gpu_hour_spot: float
    usd_per_gpu_hour_on_demand: float

    @property
    def shard_hours(self) -> float:
        """How long the largest shard takes on one GPU: the slowest straggler."""
        return self.largest_shard_tokens / self.tokens_per_s_per_gpu / 3600

    @property
    def rework_hours_per_preemption(self) -> float:
        """A preemption loses, on average, half a shard in flight plus an engine start."""
        return self.shard_hours / 2 + self.engine_start_seconds / 3600

    @property
    def effective_tokens_per_s_per_gpu(self) -> float:
        """Throughput after the re-work that preemptions cost (on spot)."""
        lost_share = self.preemptions_per_gpu_hour * self.rework_hours_per_preemption
        return self.tokens_per_s_per_gpu * (1 - lost_share)

    @property
    def gpu_hours_of_work(self) -> float:
        return self.total_tokens / self.effective_tokens_per_s_per_gpu / 3600

    @property
    def usable_hours(self) -> float:
        """The window minus the straggler margin and the last (largest) shard's tail."""
        return self.window_hours / (1 + self.straggler_margin) - self.shard_hours

    @property
    def gpus(self) -> int:
        if self.usable_hours <= 0:
            raise ValueError(f"the window ({self.window_hours} h) is shorter than one shard plus the margin; "
                             "use smaller shards or a longer window")
        return max(1, math.ceil(self.gpu_hours_of_work / self.usable_hours - 1e-9))

    def finish_hours(self, gpus: int | None = None) -> float:
        gpus = gpus or self.gpus
        return self.gpu_hours_of_work / gpus + self.shard_hours

    def usd_spot(self, gpus: int | None = None) -> float:
        gpus = gpus or self.gpus
        return gpus * self.finish_hours(gpus) * self.usd_per_gpu_hour_spot

    def usd_on_demand(self, gpus: int | None = None) -> float:
        """The same fleet on on-demand machines: no preemptions, so no re-work."""
        gpus = gpus or self.gpus
        hours = self.total_tokens / self.tokens_per_s_per_gpu / 3600 / gpus + self.shard_hours
        return gpus * hours * self.usd_per_gpu_hour_on_demand

    def usd_per_1m_tokens(self, gpus: int | None = None) -> float:
        return _per_million(self.usd_spot(gpus), int(self.total_tokens))

    @property
    def expected_preemptions(self) -> float:
        return self.preemptions_per_gpu_hour * self.gpus * self.finish_hours()

    @property
    def rework_gpu_hours(self) -> float:
        return self.expected_preemptions * self.rework_hours_per_preemption

    def idle_gpu_hours(self, gpus: int | None = None) -> float:
        """GPU-hours paid for but not working: the tail, while the last shards finish."""
        gpus = gpus or self.gpus
        return gpus * self.finish_hours(gpus) - self.gpu_hours_of_work

    def alternatives(self) -> list[dict[str, float]]:
        """Under-provisioning misses the window; over-provisioning pays for idle GPUs: each with its cost."""
        planned = self.gpus
        rows = []
        for gpus in sorted({max(1, planned // 2), max(1, planned - 1), planned, planned + max(1, planned // 4),
                            planned * 2}):
            finish = self.finish_hours(gpus)
            rows.append({"gpus": gpus, "finish_hours": finish, "usd_spot": self.usd_spot(gpus),
                         "usd_vs_plan": self.usd_spot(gpus) - self.usd_spot(planned),
                         "misses_window_by_hours": max(0.0, finish - self.window_hours),
                         "idle_gpu_hours": self.idle_gpu_hours(gpus)})
        return rows
