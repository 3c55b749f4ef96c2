"""What a run cost (from measured seconds and counted tokens), how throughput grows with
batch size (calibration fits), and what a corpus will cost on a fleet (plans)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenmill.spec import JobSpec


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

    @classmethod
    def for_job(cls, spec: JobSpec, *, rows: int, input_tokens: int, output_tokens: int, wall_seconds: float,
                engine_seconds: float, gpu_count: int | None = None, gpu_seconds: float | None = None) -> "RunCost":
        """Work done for this job, priced at its GPUs' rates (gpu_count: the job's, unless given)."""
        return cls(rows=rows, input_tokens=input_tokens, output_tokens=output_tokens, wall_seconds=wall_seconds,
                   engine_seconds=engine_seconds,
                   gpu_count=spec.pricing.gpu_count if gpu_count is None else gpu_count,
                   usd_per_gpu_hour_spot=spec.pricing.usd_per_gpu_hour_spot,
                   usd_per_gpu_hour_on_demand=spec.pricing.usd_per_gpu_hour_on_demand, gpu_seconds=gpu_seconds)

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
        return rate_per_s(self.total_tokens, self.wall_seconds)

    @property
    def items_per_s(self) -> float:
        return rate_per_s(self.rows, self.wall_seconds)

    @property
    def engine_tokens_per_s(self) -> float:
        return rate_per_s(self.total_tokens, self.engine_seconds)

    @property
    def usd_per_1m_tokens(self) -> float:
        """On spot prices: the tier a resumable batch job is built to run on."""
        return per_million(self.usd_spot, self.total_tokens)

    @property
    def usd_per_1m_tokens_on_demand(self) -> float:
        return per_million(self.usd_on_demand, self.total_tokens)

    def metrics(self) -> dict[str, float]:
        names = ("total_tokens", "gpu_hours", "usd_spot", "usd_on_demand", "tokens_per_s",
                 "items_per_s", "engine_tokens_per_s", "usd_per_1m_tokens", "usd_per_1m_tokens_on_demand")
        values = {k: v for k, v in asdict(self).items()
                  if not k.startswith("usd_per_gpu") and k != "gpu_count" and v is not None}
        values.update({name: getattr(self, name) for name in names})
        return {k: float(v) for k, v in values.items()}


def rate_per_s(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def per_million(usd: float, tokens: int) -> float:
    return usd / tokens * 1_000_000 if tokens > 0 else 0.0





