"""How a batch shares a server with live traffic, as plain functions: the in-flight cap from the live SLO,
the AIMD window that backs off as live load rises, and the server's load read from its Prometheus text.

A leaf: tokenmill.server_engine measures and sends; this module only decides, so tests run it without a
server.

The cap: a batch tenant of b items holds one server step for about o + b*c (o: per-call overhead, c:
per-item cost). A live request that arrives behind that step waits for it, so b is capped where
o + b*c <= share * SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# vLLM's Prometheus names (vllm/v1/metrics/loggers.py)
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
TTFT = "vllm:time_to_first_token_seconds"
TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")  # counters: tokens prefilled, generated


@dataclass(frozen=True)
class CallCost:
    """o and c fitted from probe rounds: seconds for a round of b concurrent items ~= overhead + b * per_item."""

    overhead_s: float
    per_item_s: float
    points: tuple[tuple[int, float], ...] = ()  # (items at once, seconds) as measured


def fit_call_cost(points: list[tuple[int, float]]) -> CallCost:
    """Least squares of seconds on items over the probe's rounds (at least two sizes), o never below 0.

    A flat or falling fit (a probe on a server busy with other tenants: bigger rounds came out no slower)
    says nothing about c, and reading it as c = 0 would open the cap to its ceiling exactly when live traffic
    is there. Then each item is charged the whole of its round: o = 0 and c = the smallest seconds per item
    any round took (o >= 0 makes that an upper bound of c, so the cap errs towards the live traffic)."""
    sizes = {b for b, _ in points}
    if len(sizes) < 2:
        raise ValueError(f"a cost fit needs rounds of at least two sizes, got {sorted(sizes)}")
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / spread
    if slope <= 0:
        return CallCost(0.0, min(t / b for b, t in points), tuple(points))
    overhead = max(mean_t - slope * mean_b, 0.0)
    return CallCost(overhead, slope, tuple(points))


def cap_from_slo(cost: CallCost, slo_ms: float, share: float, ceiling: int) -> int:
    """The largest b with o + b*c <= share * slo_ms, within [1, ceiling]. One item at least: a batch that
    may send nothing never finishes (the record shows when even one item is over the budget)."""
    budget_s = share * slo_ms / 1000.0
    if cost.per_item_s <= 0:
        return ceiling
    room = (budget_s - cost.overhead_s) / cost.per_item_s
    return max(1, min(ceiling, math.floor(room + 1e-9)))


@dataclass(frozen=True)
class ServerLoad:
    """One read of the server's /metrics: requests waiting and running (every tenant's), the time to
    first token histogram's running sum and count (seconds, requests), and the tokens the server has
    prefilled and generated so far (every tenant's)."""

    waiting: float
    running: float
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tokens: float = 0.0


def parse_load(text: str) -> ServerLoad:
    """The load figures from a Prometheus text exposition (summed over engines and models)."""
    totals = {WAITING: 0.0, RUNNING: 0.0, f"{TTFT}_sum": 0.0, f"{TTFT}_count": 0.0, **dict.fromkeys(TOKENS, 0.0)}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            try:
                totals[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return ServerLoad(totals[WAITING], totals[RUNNING], totals[f"{TTFT}_sum"], totals[f"{TTFT}_count"],
                      sum(totals[name] for name in TOKENS))


def recent_ttft(before: ServerLoad | None, now: ServerLoad) -> float | None:
    """Mean time to first token of the requests that got their first token between two reads (None: none did)."""
    if before is None:
        return None
    count = now.ttft_count - before.ttft_count
    if count <= 0:
        return None
    return (now.ttft_sum - before.ttft_sum) / count


@dataclass
class Aimd:
    """The batch's in-flight window: +1 per quiet read, times `decrease` under pressure, within [0, cap].

    Pressure: live requests on the server (running + waiting beyond the batch's own in flight) and either
    requests queued at two reads in a row (one read catches requests that arrived between two steps) or
    the mean time to first token over (1 + share) x SLO, what the cap was sized to allow (the server's
    histogram holds the batch's own requests too, which wait behind every live one). The cap keeps a
    live request's added wait within share x SLO; the window answers live load beyond what the cap was
    sized for. At 0 the batch sends nothing until the load falls."""

    cap: int
    slo_s: float  # the live requests' time-to-first-token objective
    share: float = 0.4  # of slo_s, the wait one batch step may add
    decrease: float = 0.5
    window: float = field(default=-1.0)
    yielded_s: float = 0.0  # seconds spent below the cap
    decreases: int = 0
    queued: bool = False  # requests were waiting at the last read

    def __post_init__(self) -> None:
        if self.window < 0:
            self.window = float(self.cap)

    @property
    def limit(self) -> int:
        return int(self.window)

    def pressure(self, load: ServerLoad, ours: int, ttft: float | None) -> bool:
        live = load.running + load.waiting - ours
        queued, self.queued = self.queued, load.waiting > 0
        return live > 0 and ((queued and load.waiting > 0) or (ttft is not None and ttft > (1 + self.share) * self.slo_s))

    def update(self, load: ServerLoad, ours: int, ttft: float | None, elapsed_s: float) -> int:
        """The window after one read of the load, `elapsed_s` after the last (time below the cap is yielded)."""
        if self.window < self.cap:
            self.yielded_s += elapsed_s
        if self.pressure(load, ours, ttft):
            self.window = math.floor(self.window * self.decrease)
            self.decreases += 1
        else:
            self.window = min(float(self.cap), self.window + 1.0)
        return self.limit
