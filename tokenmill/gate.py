"""The eval gate: a cheaper candidate model runs the corpus only if it matches the reference.

Both models run the same deterministic sample. Embeddings are compared vector by vector
(cosine) and by retrieval (top-10 neighbours within the sample); generations by greedy
exact match, by how far the token streams agree before they first diverge, and by the
cosine of the two texts' embeddings. Each metric has a threshold; the report says, for
each, the value against its threshold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel

from tokenmill.bucketing import plan_batches, restore_order
from tokenmill.economics import RunCost
from tokenmill.encoding import encode_rows
from tokenmill.engine_choice import resolve
from tokenmill.engine_protocol import Engine, token_budget
from tokenmill.engines import discard_engine, engine_key, get_engine
from tokenmill.errors import ConfigError
from tokenmill.generation import OutputChecker, check_response_format, parsed_agreement
from tokenmill.models import resolve_model
from tokenmill.runner import run_batches
from tokenmill.sampling import corpus_sample
from tokenmill.spec import GateSpec, JobSpec, ModelSpec

# What a sound quantization (or the same model on another engine or dtype) passes and a
# damaged model fails. On 128 rows of the sample corpus, MiniLM with int8 per-channel weights
# scored cosine_mean 0.9993, cosine_p5 0.9989, top10_overlap 0.981; bf16 1.0000/0.9999/0.997;
# naive int4 weights 0.854/0.771/0.693; weights with 5% gaussian noise 0.986/0.981/0.917
# (tests/test_gate.py checks the int8/int4 pair, the vLLM/transformers pair and SmolLM2).
DEFAULT_THRESHOLDS = {
    "embed": {"cosine_mean": 0.99, "cosine_p5": 0.97, "top10_overlap": 0.80},
    "generate": {"exact_match": 0.60, "prefix_agreement": 0.70, "similarity_mean": 0.90},
}
# With a response format, generations are also compared by their parsed values, field by field
# (tokenmill.generation.parsed_agreement).
PARSED_AGREEMENT_THRESHOLD = 0.80
SIMILARITY_MODEL = "all-MiniLM-L6-v2"


class GateMetric(BaseModel):
    name: str
    value: float
    threshold: float
    passed: bool


class ModelCost(BaseModel):
    model: str
    engine: str
    seconds: float
    tokens: int
    tokens_per_s: float
    usd_per_1m_tokens: float


class GateReport(BaseModel):
    mode: str
    sample_rows: int
    sample_source: str
    passed: bool
    metrics: list[GateMetric]
    reference: ModelCost
    candidate: ModelCost
    action: str  # "candidate" | "reference" | "fail"

    def message(self) -> str:
        lines = [f"eval gate {'passed' if self.passed else 'FAILED'} on {self.sample_rows} rows "
                 f"({self.sample_source}), candidate {self.candidate.model} ({self.candidate.engine}) "
                 f"against reference {self.reference.model} ({self.reference.engine}):"]
        for m in self.metrics:
            lines.append(f"  {m.name} = {m.value:.4f} {'>=' if m.passed else '<'} {m.threshold:.4f} "
                         f"{'pass' if m.passed else 'FAIL'}")
        saving = 1 - self.candidate.usd_per_1m_tokens / self.reference.usd_per_1m_tokens \
            if self.reference.usd_per_1m_tokens else 0.0
        verdict = f"the candidate saves {saving:.0%}" if saving >= 0 else f"the candidate costs {-saving:.0%} more"
        lines.append(f"  throughput: candidate {self.candidate.tokens_per_s:,.0f} tokens/s "
                     f"(${self.candidate.usd_per_1m_tokens:.4f}/1M), reference {self.reference.tokens_per_s:,.0f} "
                     f"tokens/s (${self.reference.usd_per_1m_tokens:.4f}/1M): {verdict}")
        return "\n".join(lines)

    def mlflow_metrics(self) -> dict[str, float]:
        values = {f"gate_{m.name}": m.value for m in self.metrics}
        values.update({f"gate_{m.name}_threshold": m.threshold for m in self.metrics})
        values["gate_passed"] = float(self.passed)
        values["gate_sample_rows"] = float(self.sample_rows)
        for role, cost in (("reference", self.reference), ("candidate", self.candidate)):
            values[f"gate_{role}_tokens_per_s"] = cost.tokens_per_s
            values[f"gate_{role}_usd_per_1m_tokens"] = cost.usd_per_1m_tokens
        return values

    def table(self) -> list[dict[str, Any]]:
        return [{"metric": m.name, "value": round(m.value, 4), "threshold": m.threshold,
                 "result": "pass" if m.passed else "FAIL"} for m in self.metrics]


def thresholds_for(spec: JobSpec) -> dict[str, float]:
    gate = _gate(spec)
    defaults = dict(DEFAULT_THRESHOLDS[spec.mode])
    if spec.mode == "generate" and spec.generation.response_format is not None:
        defaults["parsed_agreement"] = PARSED_AGREEMENT_THRESHOLD
    unknown = set(gate.thresholds) - set(defaults)
    if unknown:
        raise ConfigError(f"gate.thresholds: unknown metric(s) {sorted(unknown)} for mode {spec.mode}; "
                          f"known: {sorted(defaults)}")
    return {**defaults, **gate.thresholds}


def job_for(spec: JobSpec, model: ModelSpec) -> JobSpec:
    """The job run with another model (reference or candidate)."""
    return spec.model_copy(update={"model": model})


def candidate_model(spec: JobSpec) -> ModelSpec:
    gate = _gate(spec)
    return gate.candidate if gate.candidate is not None else spec.model


def sample_texts(spec: JobSpec) -> tuple[list[str], str]:
    """The gate's rows: its eval file's, or a deterministic corpus sample (see tokenmill.sampling)."""
    gate = _gate(spec)
    if spec.mode == "generate":
        check_response_format(spec.generation)  # before any engine starts
    return corpus_sample(spec, gate.sample_rows, gate.sample_seed, gate.eval_file)


@dataclass
class SampleRun:
    outputs: list  # vectors (embed) or Generation (generate), in sample order
    token_ids: list[list[int]]
    seconds: float
    tokens: int


def run_sample(job: JobSpec, texts: list[str], engine: Engine | None = None) -> SampleRun:
    model_path = resolve_model(job.model_name)
    encoded = encode_rows(texts, job, model_path)
    lengths = [len(ids) for ids in encoded.token_ids]
    engine = engine or get_engine(model_path, job)
    batches = plan_batches(lengths, token_budget(job, engine), job.batching.max_batch_size,
                           job.batching.length_tolerance)
    started = time.perf_counter()
    results, _ = run_batches(engine, batches, encoded.token_ids, job, "gate")
    seconds = time.perf_counter() - started
    outputs = restore_order(batches, results)
    tokens = sum(lengths) + (sum(g.output_tokens for g in outputs) if job.mode == "generate" else 0)
    return SampleRun(outputs, encoded.token_ids, seconds, tokens)


def evaluate(spec: JobSpec, texts: list[str], source: str) -> GateReport:
    gate = _gate(spec)
    thresholds = thresholds_for(spec)
    reference_job = job_for(spec, gate.reference)
    candidate_job = job_for(spec, candidate_model(spec))
    if spec.mode == "generate":  # greedy, so exact match means something
        greedy = spec.generation.model_copy(update={"temperature": 0.0, "max_tokens": gate.max_tokens, "n": 1,
                                                    "logprobs": None, "min_tokens": 0})
        reference_job = reference_job.model_copy(update={"generation": greedy})
        candidate_job = candidate_job.model_copy(update={"generation": greedy})
    same_engine = engine_key(reference_job) == engine_key(candidate_job)
    # `engine: auto` is resolved just before each side runs (its trials start engines too), so the
    # report names the engine that ran
    reference_job = resolve(reference_job)
    reference = run_sample(reference_job, texts)
    # On one GPU the candidate may not fit beside the reference: the reference's engine goes
    # before the candidate's starts (unless they are one engine). The candidate's stays: it
    # is the engine that runs the corpus when the gate passes.
    if not same_engine:
        discard_engine(resolve_model(reference_job.model_name), reference_job)
    candidate_job = resolve(candidate_job)
    candidate = run_sample(candidate_job, texts)
    if spec.mode == "embed":
        values = embedding_agreement(np.stack(reference.outputs), np.stack(candidate.outputs))
    else:
        values = generation_agreement(reference.outputs, candidate.outputs, resolve_model(reference_job.model_name))
        if spec.generation.response_format is not None:
            checker = OutputChecker(spec.generation.response_format)
            values["parsed_agreement"] = parsed_agreement(
                [checker.check(g.text).parsed for g in reference.outputs],
                [checker.check(g.text).parsed for g in candidate.outputs])
    metrics = [GateMetric(name=name, value=values[name], threshold=limit, passed=values[name] >= limit)
               for name, limit in thresholds.items()]
    passed = all(m.passed for m in metrics)
    return GateReport(
        mode=spec.mode, sample_rows=len(texts), sample_source=source, passed=passed, metrics=metrics,
        reference=_cost(reference_job, reference, spec), candidate=_cost(candidate_job, candidate, spec),
        action="candidate" if passed else ("reference" if gate.on_fail == "use_reference" else "fail"),
    )


def embedding_agreement(reference: np.ndarray, candidate: np.ndarray, k: int = 10) -> dict[str, float]:
    ref = _unit(reference)
    cand = _unit(candidate)
    cosine = (ref * cand).sum(axis=1)
    return {
        "cosine_mean": float(cosine.mean()),
        "cosine_p5": float(np.percentile(cosine, 5)),
        "top10_overlap": neighbour_overlap(ref, cand, k),
    }


def neighbour_overlap(reference: np.ndarray, candidate: np.ndarray, k: int = 10) -> float:
    """Mean share of each row's k nearest neighbours (within the sample, itself excluded)
    that the two models agree on: retrieval agreement."""
    n = len(reference)
    k = min(k, n - 1)
    if k < 1:
        return 1.0
    overlaps = []
    ref_sim = _unit(reference) @ _unit(reference).T
    cand_sim = _unit(candidate) @ _unit(candidate).T
    np.fill_diagonal(ref_sim, -np.inf)
    np.fill_diagonal(cand_sim, -np.inf)
    ref_top = np.argpartition(-ref_sim, k, axis=1)[:, :k]
    cand_top = np.argpartition(-cand_sim, k, axis=1)[:, :k]
    for a, b in zip(ref_top, cand_top):
        overlaps.append(len(set(a.tolist()) & set(b.tolist())) / k)
    return float(np.mean(overlaps))


def generation_agreement(reference: list, candidate: list, tokenizer_path: str) -> dict[str, float]:
    """Texts compared in the reference model's tokens."""
    from tokenmill.models import load_tokenizer

    exact = [r.text.strip() == c.text.strip() for r, c in zip(reference, candidate)]
    tokenizer = load_tokenizer(tokenizer_path)
    shares = []
    for r, c in zip(reference, candidate):
        ref_ids = tokenizer(r.text, add_special_tokens=False)["input_ids"]
        cand_ids = tokenizer(c.text, add_special_tokens=False)["input_ids"]
        longest = max(len(ref_ids), len(cand_ids))
        if longest == 0:
            shares.append(1.0)
            continue
        agree = 0
        for x, y in zip(ref_ids, cand_ids):
            if x != y:
                break
            agree += 1
        shares.append(agree / longest)
    similarity = text_similarity([r.text for r in reference], [c.text for c in candidate])
    return {
        "exact_match": float(np.mean(exact)),
        "prefix_agreement": float(np.mean(shares)),
        "similarity_mean": float(np.mean(similarity)),
    }


def text_similarity(first: list[str], second: list[str]) -> np.ndarray:
    """Cosine of the two texts' MiniLM embeddings, row by row (an empty pair counts as equal)."""
    job = JobSpec(mode="embed", model=ModelSpec(name=SIMILARITY_MODEL, engine="transformers"))
    both = [t if t.strip() else "(empty)" for t in first + second]
    vectors = np.stack(run_sample(job, both).outputs)
    a, b = _unit(vectors[: len(first)]), _unit(vectors[len(first):])
    return (a * b).sum(axis=1)


def _cost(job: JobSpec, run: SampleRun, spec: JobSpec) -> ModelCost:
    cost = RunCost.for_job(spec, rows=len(run.outputs), input_tokens=run.tokens, output_tokens=0,
                           wall_seconds=run.seconds, engine_seconds=run.seconds)
    label = job.model_name + (f" [{job.model.quantization}]" if job.model.quantization else "") + \
        (f" [{job.model.dtype}]" if job.model.dtype != "auto" else "")
    return ModelCost(model=label, engine=job.model.engine, seconds=run.seconds, tokens=run.tokens,
                     tokens_per_s=cost.tokens_per_s, usd_per_1m_tokens=cost.usd_per_1m_tokens)


def _unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float64)
    return vectors / np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)


def _gate(spec: JobSpec) -> GateSpec:
    if spec.gate is None:
        raise ConfigError("the job has no gate section")
    return spec.gate


__all__ = ["GateReport", "evaluate", "sample_texts", "embedding_agreement", "generation_agreement",
           "thresholds_for", "candidate_model", "job_for", "DEFAULT_THRESHOLDS"]
