"""What a run cost, from measured seconds and counted tokens. No estimates here."""

from __future__ import annotations

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

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def gpu_hours(self) -> float:
        return self.wall_seconds / 3600.0 * self.gpu_count

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
        values = {k: v for k, v in asdict(self).items() if not k.startswith("usd_per_gpu") and k != "gpu_count"}
        values.update({name: getattr(self, name) for name in names})
        return {k: float(v) for k, v in values.items()}


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _per_million(usd: float, tokens: int) -> float:
    return usd / tokens * 1_000_000 if tokens > 0 else 0.0
