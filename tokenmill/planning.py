"""Before renting the fleet: how many tokens the corpus holds, and what a window costs."""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tokenmill.economics import per_million
from tokenmill.encoding import encode_rows
from tokenmill.models import resolve_model
from tokenmill.prompts import prompt_inputs, read_job_rows
from tokenmill.row_cache import cached_token_share
from tokenmill.sampling import corpus_sample
from tokenmill.shards import discover_shards_for, read_shard_bytes
from tokenmill.spec import JobSpec


class CorpusEstimate(BaseModel):
    rows: int
    rows_exact: bool  # Parquet's rows from file metadata, JSONL's counted (rows_per_shard); else from bytes
    sample_rows: int
    tokens_per_row_mean: float
    tokens_per_row_p95: float
    tokens: float
    tokens_low: float  # 95% interval of the estimate
    tokens_high: float
    largest_shard_rows: int
    largest_shard_tokens: float
    shards: int
    row_cache_share: float = 0.0  # share of the tokens the row cache already holds (estimated on a sample)
    row_cache_note: str = ""  # how that share was estimated

    @property
    def tokens_to_compute(self) -> float:
        """The tokens the engine will compute: those the row cache does not hold."""
        return self.tokens * (1.0 - self.row_cache_share)

    def describe(self) -> str:
        spread = (self.tokens_high - self.tokens) / self.tokens if self.tokens else 0.0
        rows = f"{self.rows:,} rows" + ("" if self.rows_exact else " (estimated from bytes)")
        text = (f"{rows} in {self.shards} shards; {self.tokens:,.0f} tokens "
                f"(95% interval {self.tokens_low:,.0f} to {self.tokens_high:,.0f}, ±{spread:.1%}; "
                f"estimated from {self.sample_rows} sampled rows at {self.tokens_per_row_mean:.1f} tokens/row)")
        if self.row_cache_share:
            text += (f"; the row cache holds {self.row_cache_share:.1%} of them ({self.row_cache_note}): "
                     f"**{self.tokens_to_compute:,.0f} tokens still to compute**")
        return text


def estimate_corpus(spec: JobSpec, sample_rows: int = 512) -> CorpusEstimate:
    """Rows from the shards (Parquet metadata, JSONL lines counted: counted_rows), tokens from a
    sample tokenized with the job's model; the interval is the sample mean's 95% interval."""
    shards = discover_shards_for(spec)
    texts, _ = corpus_sample(spec, sample_rows)
    encoded = encode_rows(texts, spec, resolve_model(spec.model_name))
    lengths = sorted(len(ids) for ids in encoded.token_ids)
    mean = statistics.fmean(lengths)
    sd = statistics.stdev(lengths) if len(lengths) > 1 else 0.0
    p95 = lengths[int(0.95 * (len(lengths) - 1))]

    shard_rows, exact = counted_rows(spec, shards)
    rows = sum(shard_rows)
    half_width = 1.96 * sd / math.sqrt(len(lengths)) if len(lengths) > 1 else 0.0
    share, note = row_cache_share(spec, shards, shard_rows, sample_rows)
    return CorpusEstimate(
        rows=rows, rows_exact=exact, sample_rows=len(lengths), tokens_per_row_mean=mean, tokens_per_row_p95=p95,
        tokens=rows * mean, tokens_low=rows * max(mean - half_width, 0.0), tokens_high=rows * (mean + half_width),
        largest_shard_rows=max(shard_rows), largest_shard_tokens=max(shard_rows) * mean, shards=len(shards),
        row_cache_share=share, row_cache_note=note,
    )


ROW_CACHE_SAMPLE_SHARDS = 8


def row_cache_share(spec: JobSpec, shards, shard_rows: list[int], sample_rows: int) -> tuple[float, str]:
    """The share of the corpus's tokens the row cache already holds, and how it was estimated: rows of up to
    ROW_CACHE_SAMPLE_SHARDS shards spread over the corpus (the first and the last among them: appended rows
    land at the end), chosen by a hash of their id, looked up by key; each shard's share weighted by its
    tokens. Not the corpus sample's first rows, which a growing corpus has long had in its cache."""
    if not spec.cache.enabled or not shards:
        return 0.0, ""
    step = max(1, len(shards) // ROW_CACHE_SAMPLE_SHARDS)
    picked = sorted(set(range(0, len(shards), step)[:ROW_CACHE_SAMPLE_SHARDS - 1]) | {len(shards) - 1})
    per_shard = max(1, sample_rows // len(picked))
    model_path = resolve_model(spec.model_name)
    engines = ["vllm", "transformers", "onnxruntime"] if spec.model.engine == "auto" else [spec.model.engine]
    held = weight = 0.0
    sampled = 0
    found_engine = None
    for index in picked:
        valid = read_job_rows(shards[index], spec)[0].valid
        ids = [str(i) for i in valid.column(spec.id_column).to_pylist()]
        chosen = sorted(range(len(ids)), key=lambda i: hashlib.sha256(ids[i].encode()).hexdigest())[:per_shard]
        if not chosen:
            continue
        inputs = prompt_inputs(valid.take(chosen), spec)
        encoded = encode_rows(inputs, spec, model_path)
        dropped = {i for i, _ in encoded.overlong}
        token_ids = [ids_ for i, ids_ in enumerate(encoded.token_ids) if i not in dropped]
        if not token_ids:
            continue
        share, engine = cached_token_share(spec, model_path, engines, token_ids)
        shard_tokens = shard_rows[index] * statistics.fmean(len(t) for t in token_ids)
        held += share * shard_tokens
        weight += shard_tokens
        sampled += len(token_ids)
        found_engine = found_engine or engine
    if not weight or not held:
        return 0.0, ""
    return held / weight, (f"{sampled} rows of {len(picked)} shards looked up"
                           + (f", entries of the {found_engine} engine" if spec.model.engine == "auto" else ""))


def estimate_rows(spec: JobSpec, shards) -> int:
    """Rows in these shards: exact for Parquet (file metadata) and for JSONL counted here, else from bytes."""
    return sum(rows_per_shard(spec, shards))


# JSONL bytes whose lines are counted (each non-blank line is a row, kept or rejected) before a plan or a run's
# prediction: in shards spread over the corpus, the rest estimated at their bytes a row. Bytes a row from one
# shard put a 6,000-row JSONL corpus of two files at 5,544 rows (its second file's rows are longer), the
# prediction's tokens 9% low. Counting lines reads at ~1 GB/s locally: less than the JSON parse of one 64 MiB
# shard that the estimate from the first shard took.
ROWS_COUNTED_BYTES = 256 * 1024 * 1024


def rows_per_shard(spec: JobSpec, shards) -> list[int]:
    return counted_rows(spec, shards)[0]


def counted_rows(spec: JobSpec, shards) -> tuple[list[int], bool]:
    """Each shard's rows, and whether all are exact: Parquet's from its metadata; a JSONL shard's lines
    counted, up to ROWS_COUNTED_BYTES over shards in an order spread over the corpus (by a hash of their
    id), the rest at the counted shards' bytes a row. A corpus whose JSONL files are all empty counts 0."""
    rows: dict[int, int] = {i: s.expected_rows for i, s in enumerate(shards) if s.expected_rows is not None}
    jsonl = sorted((i for i, s in enumerate(shards) if s.expected_rows is None),
                   key=lambda i: hashlib.sha256(shards[i].shard_id.encode()).hexdigest())
    counted_bytes = counted = 0
    estimated = []
    for i in jsonl:
        size = shards[i].byte_end - shards[i].byte_start
        if counted_bytes and counted_bytes + size > ROWS_COUNTED_BYTES:
            estimated.append(i)
            continue
        rows[i] = _jsonl_lines(shards[i], spec.storage_options)
        counted_bytes, counted = counted_bytes + size, counted + rows[i]
    for i in estimated:
        rows[i] = round((shards[i].byte_end - shards[i].byte_start) * counted / max(counted_bytes, 1))
    return [rows[i] for i in range(len(shards))], not estimated


_lines_counted: dict[str, int] = {}  # by shard fingerprint: a run predicts, records and chooses on the same shards


def _jsonl_lines(shard, storage_options: dict[str, Any] | None) -> int:
    """A JSONL shard's non-blank lines, read once a process for a shard of this fingerprint (its file, the file's
    size and version, its byte range): `tokenmill run` counts a corpus for its prediction, its record and its
    engine's choice, `tokenmill plan` for its estimate and its prediction."""
    if shard.fingerprint and shard.fingerprint in _lines_counted:
        return _lines_counted[shard.fingerprint]
    lines = sum(1 for line in read_shard_bytes(shard, storage_options).split(b"\n") if line.strip())
    if shard.fingerprint:
        _lines_counted[shard.fingerprint] = lines
    return lines


def make_plan(spec: JobSpec, estimate: CorpusEstimate, tokens_per_s_per_gpu: float, window_hours: float,
              straggler_margin: float = 0.1, preemptions_per_gpu_hour: float = 0.05,
              engine_start_seconds: float = 60.0) -> FleetPlan:
    return FleetPlan(
        total_tokens=estimate.tokens_to_compute,  # the row cache's share is already paid for
        tokens_per_s_per_gpu=tokens_per_s_per_gpu, window_hours=window_hours,
        straggler_margin=straggler_margin, preemptions_per_gpu_hour=preemptions_per_gpu_hour,
        largest_shard_tokens=estimate.largest_shard_tokens, engine_start_seconds=engine_start_seconds,
        usd_per_gpu_hour_spot=spec.pricing.usd_per_gpu_hour_spot,
        usd_per_gpu_hour_on_demand=spec.pricing.usd_per_gpu_hour_on_demand,
    )


def plan_markdown(plan: FleetPlan, estimate: CorpusEstimate, rate_source: str) -> str:
    lines = [
        "# tokenmill plan",
        "",
        f"- **Corpus:** {estimate.describe()}",
        f"- **Throughput:** {plan.tokens_per_s_per_gpu:,.0f} tokens/s per GPU ({rate_source}); "
        f"{plan.effective_tokens_per_s_per_gpu:,.0f} after preemption re-work",
        f"- **Window:** {plan.window_hours:g} h with a {plan.straggler_margin:.0%} straggler margin",
        "",
        f"**{plan.gpus} GPUs** finish in **{plan.finish_hours():.2f} h** "
        f"({plan.gpu_hours_of_work:,.1f} GPU-hours of work).",
        "",
        "| | spot | on-demand |",
        "|---|---|---|",
        f"| total | ${plan.usd_spot():,.2f} | ${plan.usd_on_demand():,.2f} |",
        f"| per 1M tokens | ${plan.usd_per_1m_tokens():.4f} | "
        f"${plan.usd_on_demand() / plan.total_tokens * 1e6 if plan.total_tokens else 0:.4f} |",
        "",
        f"- **Largest shard:** {estimate.largest_shard_rows:,} rows, ~{plan.largest_shard_tokens:,.0f} tokens: "
        f"{plan.shard_hours * 3600:,.0f} s on one GPU, the slowest straggler.",
        f"- **Preemptions:** {plan.preemptions_per_gpu_hour:g} per GPU-hour, ~{plan.expected_preemptions:.1f} "
        f"expected; each re-does half a shard plus an engine start "
        f"({plan.rework_hours_per_preemption * 3600:,.0f} s), {plan.rework_gpu_hours:,.2f} GPU-hours in all.",
        "",
        "Under- and over-provisioning:",
        "",
        "| GPUs | finish (h) | misses window by (h) | idle GPU-hours | $ spot | vs plan |",
        "|---|---|---|---|---|---|",
    ]
    for row in plan.alternatives():
        lines.append(f"| {row['gpus']} | {row['finish_hours']:.2f} | {row['misses_window_by_hours']:.2f} | "
                     f"{row['idle_gpu_hours']:.2f} | ${row['usd_spot']:,.2f} | {row['usd_vs_plan']:+,.2f} |")
    return "\n".join(lines) + "\n"


def plan_metrics(plan: FleetPlan, estimate: CorpusEstimate) -> dict[str, Any]:
    return {"plan_gpus": plan.gpus, "plan_finish_hours": plan.finish_hours(), "plan_usd_spot": plan.usd_spot(),
            "plan_usd_on_demand": plan.usd_on_demand(), "plan_usd_per_1m_tokens": plan.usd_per_1m_tokens(),
            "plan_tokens": estimate.tokens, "plan_tokens_to_compute": estimate.tokens_to_compute,
            "plan_row_cache_share": estimate.row_cache_share, "plan_tokens_low": estimate.tokens_low,
            "plan_tokens_high": estimate.tokens_high, "plan_tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu,
            "plan_largest_shard_seconds": plan.shard_hours * 3600, "plan_rework_gpu_hours": plan.rework_gpu_hours}


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
        return per_million(self.usd_spot(gpus), int(self.total_tokens))

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
