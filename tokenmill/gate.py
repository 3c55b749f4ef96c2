"""The eval gate: a cheaper candidate model runs the corpus only if it matches the reference.

Both models run the same deterministic sample. Embeddings are compared vector by vector
(cosine) and by retrieval (top-10 neighbours within the sample); generations by greedy
exact match, by how far the token streams agree before they first diverge, and by the
cosine of the two texts' embeddings. Each metric has a threshold; the report says, for
each, the value against its threshold.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from tokenmill import timeline
from tokenmill.bucketing import plan_batches, restore_order
from tokenmill.call_costs import CallCost
from tokenmill.economics import RunCost
from tokenmill.encoding import encode_rows
from tokenmill.digest import stable_digest
from tokenmill.json_store import read_json, rewrite_json
from tokenmill.device import device_label
from tokenmill.engine_choice import TRIAL_LIBRARIES, cache_dir, class_rates, length_class
from tokenmill.engine_protocol import Engine, token_budget
from tokenmill.engines import discard_engine, engine_key, get_engine
from tokenmill.errors import ConfigError
from tokenmill.generation import OutputChecker, check_response_format, parsed_agreement
from tokenmill.models import resolve_model
from tokenmill.resolution import resolve_job
from tokenmill.resolved_job import ResolvedJob
from tokenmill.row_cache import keep_sample_rows
from tokenmill.runner import run_batches
from tokenmill.sampling import corpus_sample
from tokenmill.spec import GateSpec, JobSpec, ModelSpec
from tokenmill.versions import library_versions

log = logging.getLogger(__name__)

# What a sound quantization (or the same model on another engine or dtype) passes and a
# damaged model fails. On 128 rows of the sample corpus, MiniLM with int8 per-channel weights
# scored cosine_mean 0.9993, cosine_p5 0.9989, top10_overlap 0.981; bf16 1.0000/0.9999/0.997;
# naive int4 weights 0.854/0.771/0.693; weights with 5% gaussian noise 0.986/0.981/0.917
# (tests/test_gate.py checks the int8/int4 pair, the vLLM/transformers pair and SmolLM2).
# On 256 rows, ONNX Runtime's dynamic int8 (weights and activations) 0.9926/0.9883/0.897 and int8-partial
# 0.9962/0.9940/0.926; int4 weight blocks 0.965 cosine (tests/test_cheap_tier.py). top10_overlap 0.90: a
# model whose nearest neighbours differ from the reference's one time in ten changes what a search returns.
DEFAULT_THRESHOLDS = {
    "embed": {"cosine_mean": 0.99, "cosine_p5": 0.97, "top10_overlap": 0.90},
    "generate": {"exact_match": 0.60, "prefix_agreement": 0.70, "similarity_mean": 0.90},
}
# With a response format, generations are also compared by their parsed values, field by field
# (tokenmill.generation.parsed_agreement).
PARSED_AGREEMENT_THRESHOLD = 0.80
SIMILARITY_MODEL = "all-MiniLM-L6-v2"
# Candidates that pass and cost within this share of the cheapest count as equally cheap: the one the job
# lists first runs. Sample timings move by a few percent run to run (more on a shared machine).
COST_TIE_MARGIN = 0.10  # gate.min_saving's default is the same margin against the reference


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
    # embedding calls timed one at a time: {length class: [mean tokens a row, tokens/s]} (engine_choice.class_rates)
    rates_by_length: dict[str, list[float]] = {}
    untimed_seconds: float = 0.0  # embedding: the sample's untimed pass before its timed one (run_sample)


class CandidateVerdict(BaseModel):
    """One rung of the ladder: the candidate's cost on the sample, its metrics, and whether it passed."""
    cost: ModelCost
    metrics: list[GateMetric]
    passed: bool
    skipped: str = ""  # why it was not run (it could not be the cheapest); empty: it ran

    def failures(self) -> str:
        return ", ".join(f"{m.name} {m.value:.4f} < {m.threshold:.4f}" for m in self.metrics if not m.passed)


class GateReport(BaseModel):
    mode: str
    sample_rows: int
    sample_source: str
    passed: bool  # some candidate passed
    metrics: list[GateMetric]  # the chosen candidate's (the first candidate's when none passed)
    reference: ModelCost
    candidate: ModelCost  # the chosen candidate (the first when none passed)
    action: str  # "candidate" | "reference" | "fail"
    candidates: list[CandidateVerdict] = []  # every rung, in the order the job lists them
    chosen: int | None = None  # which rung runs the corpus (action "candidate")
    cached: bool = False  # this machine's earlier verdict on the same sample, models and thresholds
    declined: str = ""  # why the cheapest passing candidate does not run (it saves less than gate.min_saving)

    @classmethod
    def judge(cls, spec: JobSpec, source: str, sample_rows: int, reference: ModelCost,
              verdicts: list[CandidateVerdict]) -> "GateReport":
        """The cheapest candidate by measured $/1M among those that pass and save at least gate.min_saving of
        the reference's $/1M runs the corpus. When candidates pass but none saves that much, the reference
        runs it (a candidate that saves nothing on this machine, or less than the sample's timing noise,
        would trade quality for nothing), and `declined` says why."""
        passing = [i for i, v in enumerate(verdicts) if v.passed]
        floor = _gate(spec).min_saving
        chosen = pick_cheapest({i: verdicts[i].cost.usd_per_1m_tokens for i in passing},
                               {i: _saving(reference, verdicts[i].cost) for i in passing}, floor)
        declined, best = "", 0
        if chosen is None and passing:
            best = min(passing, key=lambda i: verdicts[i].cost.usd_per_1m_tokens)
            saving = _saving(reference, verdicts[best].cost)
            declined = (f"{verdicts[best].cost.model} ({verdicts[best].cost.engine}) passed but "
                        + (f"saves only {saving:.1%}" if saving >= 0 else f"costs {-saving:.1%} more")
                        + f" against the reference on this machine (${verdicts[best].cost.usd_per_1m_tokens:.4f}"
                        f" against ${reference.usd_per_1m_tokens:.4f}/1M; gate.min_saving {floor:g})")
        shown = verdicts[chosen if chosen is not None else best]  # the declined one, when one was
        action = "reference" if declined else _action(spec, bool(passing))
        return cls(mode=spec.mode, sample_rows=sample_rows, sample_source=source, passed=bool(passing),
                   metrics=shown.metrics, reference=reference, candidate=shown.cost, action=action,
                   candidates=verdicts, chosen=chosen, declined=declined)

    def verdict(self, job_tokens: float | None = None) -> str:
        """One line: which model ran the corpus, and what that saved against the reference."""
        if self.action != "candidate":
            return ((f"{self.declined}: " if self.declined else "no candidate passed the eval gate; ")
                    + f"the corpus ran on the reference {self.reference.model} ({self.reference.engine})")
        line = (f"the eval gate chose {self.candidate.model} ({self.candidate.engine}): "
                f"${self.candidate.usd_per_1m_tokens:.4f}/1M tokens against the reference's "
                f"${self.reference.usd_per_1m_tokens:.4f} ({self.saving():+.0%} saved)")
        if job_tokens:
            line += f", ${self.usd_saved(job_tokens):.4f} on this job's {job_tokens:,.0f} tokens"
        return line

    def usd_saved(self, tokens: float) -> float:
        """What running `tokens` on the chosen model saved against the reference, at the gate's measured rates."""
        if self.action != "candidate":
            return 0.0
        return tokens / 1e6 * (self.reference.usd_per_1m_tokens - self.candidate.usd_per_1m_tokens)

    def saving(self) -> float:
        """The share of the reference's $/1M tokens that the chosen model saves (negative: it costs more)."""
        return _saving(self.reference, self.candidate)

    def message(self) -> str:
        rungs = self.candidates or [CandidateVerdict(cost=self.candidate, metrics=self.metrics, passed=self.passed)]
        lines = [f"eval gate {'passed' if self.passed else 'FAILED'} on {self.sample_rows} rows "
                 f"({self.sample_source}{'; verdict cached: same sample, models and thresholds' if self.cached else ''})"
                 f", {len(rungs)} candidate(s) against reference {self.reference.model} "
                 f"({self.reference.engine}): {self.reference.tokens_per_s:,.0f} tokens/s "
                 f"(${self.reference.usd_per_1m_tokens:.4f}/1M)"]
        for index, rung in enumerate(rungs):
            verdict = "pass" if rung.passed else (rung.skipped or "FAIL")
            if index == self.chosen:
                verdict += ", runs the corpus"
            elif rung.passed and self.declined:
                verdict += ", saves too little to run the corpus"
            lines.append(f"candidate {rung.cost.model} ({rung.cost.engine}): {verdict}; "
                         f"{rung.cost.tokens_per_s:,.0f} tokens/s (${rung.cost.usd_per_1m_tokens:.4f}/1M)")
            for m in rung.metrics:
                lines.append(f"  {m.name} = {m.value:.4f} {'>=' if m.passed else '<'} {m.threshold:.4f} "
                             f"{'pass' if m.passed else 'FAIL'}")
        if self.action == "candidate":
            saving = self.saving()
            lines.append(f"the corpus runs on {self.candidate.model} ({self.candidate.engine}): "
                         + (f"it saves {saving:.0%} of the reference's $/1M" if saving >= 0
                            else f"it costs {-saving:.0%} more than the reference"))
        elif self.declined:
            lines.append(f"{self.declined}: the corpus runs on the reference")
        else:
            lines.append("no candidate passed: " + ("the corpus runs on the reference" if self.action == "reference"
                                                    else "the job stops (gate.on_fail: fail)"))
        return "\n".join(lines)

    def mlflow_metrics(self) -> dict[str, float]:
        values = {f"gate_{m.name}": m.value for m in self.metrics}
        values.update({f"gate_{m.name}_threshold": m.threshold for m in self.metrics})
        values["gate_passed"] = float(self.passed)
        values["gate_sample_rows"] = float(self.sample_rows)
        for role, cost in (("reference", self.reference), ("candidate", self.candidate)):
            values[f"gate_{role}_tokens_per_s"] = cost.tokens_per_s
            values[f"gate_{role}_usd_per_1m_tokens"] = cost.usd_per_1m_tokens
        values["gate_usd_per_1m_saved_fraction"] = self.saving() if self.action == "candidate" else 0.0
        for index, rung in enumerate(self.candidates):
            values.update({f"gate_candidate{index}_{m.name}": m.value for m in rung.metrics})
            values[f"gate_candidate{index}_passed"] = float(rung.passed)
            values[f"gate_candidate{index}_tokens_per_s"] = rung.cost.tokens_per_s
            values[f"gate_candidate{index}_usd_per_1m_tokens"] = rung.cost.usd_per_1m_tokens
        return values

    def params(self) -> dict[str, str]:
        values = {"gate_reference": self.reference.model, "gate_reference_engine": self.reference.engine,
                  "gate_candidate": self.candidate.model, "gate_candidate_engine": self.candidate.engine,
                  "gate_sample": self.sample_source, "gate_action": self.action}
        for index, rung in enumerate(self.candidates):
            values[f"gate_candidate{index}"] = f"{rung.cost.model} ({rung.cost.engine})"
        return values

    def table(self) -> list[dict[str, Any]]:
        """A row for the reference and one per candidate: what a person compares at a glance."""
        rungs = self.candidates or [CandidateVerdict(cost=self.candidate, metrics=self.metrics, passed=self.passed)]
        rows = [{"model": self.reference.model, "engine": self.reference.engine, "role": "reference",
                 "tokens_per_s": round(self.reference.tokens_per_s), "usd_per_1m_tokens":
                 round(self.reference.usd_per_1m_tokens, 4), **{m.name: "" for m in self.metrics}, "verdict": ""}]
        for index, rung in enumerate(rungs):
            verdict = ("pass, runs the corpus" if index == self.chosen else
                       "pass, saves too little to run the corpus" if self.declined else "pass") if rung.passed \
                else (rung.skipped or f"FAIL ({rung.failures()})")
            rows.append({"model": rung.cost.model, "engine": rung.cost.engine, "role": f"candidate {index + 1}",
                         "tokens_per_s": round(rung.cost.tokens_per_s),
                         "usd_per_1m_tokens": round(rung.cost.usd_per_1m_tokens, 4),
                         **{m.name: round(m.value, 4) for m in rung.metrics}, "verdict": verdict})
        return rows


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


def candidate_models(spec: JobSpec) -> list[ModelSpec]:
    """The ladder: gate.candidates, or gate.candidate, or else the job's own model."""
    gate = _gate(spec)
    if gate.candidates:
        return list(gate.candidates)
    return [gate.candidate if gate.candidate is not None else spec.model]


def candidate_model(spec: JobSpec) -> ModelSpec:
    """The first (or only) candidate."""
    return candidate_models(spec)[0]


def chosen_model(spec: JobSpec, report: GateReport) -> ModelSpec:
    """The model the corpus runs on after the gate: the chosen candidate, or the reference."""
    if report.action == "candidate" and report.chosen is not None:
        return candidate_models(spec)[report.chosen]
    return _gate(spec).reference


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
    calls: list[CallCost] = field(default_factory=list)  # embedding: each call's rows, tokens and seconds
    untimed_seconds: float = 0.0  # embedding: the untimed pass before the timed one


def run_sample(resolved: ResolvedJob, texts: list[str], engine: Engine | None = None, keep: bool = False,
               timed: bool = True) -> SampleRun:
    """The sample through the job's engine, timed warm: a rate the corpus will see. Embedding: after an
    untimed pass of the same calls (UNTIMED_PASS_MODE); generation: after one warm-up call (first-call allocations
    and kernel choices), as the engine trial times it. keep: the texts are the corpus's own rows; their
    vectors go to the job's row cache (embed), so the corpus run does not compute them again on whichever
    side runs it. timed=False: the outputs alone, no untimed pass."""
    job = resolved.spec
    encoded = encode_rows(texts, job, resolved.model_path)
    lengths = [len(ids) for ids in encoded.token_ids]
    engine = engine or get_engine(resolved.model_path, job)
    batches = plan_batches(lengths, token_budget(job, engine), job.batching.max_batch_size,
                           job.batching.length_tolerance)
    full_pass = job.mode == UNTIMED_PASS_MODE and timed
    started = time.perf_counter()
    if batches and full_pass:
        run_batches(engine, batches, encoded.token_ids, job, None)
    elif batches:
        warm = batches[0][:WARM_UP_ROWS]
        run_batches(engine, [list(range(len(warm)))], [encoded.token_ids[i] for i in warm], job, None)
    untimed = time.perf_counter() - started if full_pass else 0.0
    started = time.perf_counter()
    calls: list[CallCost] = []
    results, _ = run_batches(engine, batches, encoded.token_ids, job, "gate", calls if job.mode == "embed" else None)
    seconds = time.perf_counter() - started
    outputs = restore_order(batches, results)
    tokens = sum(lengths) + (sum(g.output_tokens for g in outputs) if job.mode == "generate" else 0)
    if job.mode == "embed" and keep:  # the corpus's own rows, as its run computes them: not computed twice
        kept = keep_sample_rows(job, resolved.model_path, resolved.engine, encoded.token_ids, outputs, seconds)
        if kept:
            log.info("row cache: kept the gate's %d sample rows on %s for the corpus run", kept, model_label(job))
    return SampleRun(outputs, encoded.token_ids, seconds, tokens, calls, untimed)


WARM_UP_ROWS = 8
# An embedding sample is timed on its second pass: a model's calls at a shape it has not run yet ran slower, and
# by how much differs by runtime. The gate's 256 rows of a mixed corpus on a 2-core Xeon with AMX: OpenVINO's
# int8 at 15,500-16,600 tokens/s on the first pass (after one warm-up call), 22,600-26,100 on the next two;
# ONNX Runtime's int8 at 17,600-19,400, then 19,100-21,100. Timed on the first pass, the gate chose ONNX
# Runtime, and the corpus ran at 17,400 tokens/s where OpenVINO's int8 runs it at ~30,000 (bench/PREDICTION.md,
# run 31). A generation sample keeps the one warm-up call: a pass costs its steps again.
UNTIMED_PASS_MODE = "embed"


# the libraries a candidate's outputs and speed depend on (verdicts and rates are kept per their versions)
GATE_LIBRARIES = (*TRIAL_LIBRARIES, "onnxruntime", "openvino", "nncf")
GATE_CACHE_VERSION = 2  # bump when what the gate measures changes: older verdicts are not comparable


def evaluate(spec: JobSpec, texts: list[str], source: str, refresh: bool = False) -> GateReport:
    """The gate's verdict: measured now (measure()), or, when this machine already judged these
    models on this very sample with these thresholds, that verdict again (`cached` is then set and
    no engine starts). refresh: measure again."""
    key = verdict_key(spec, texts)
    if not refresh:
        known = _known(spec, key)
        if known is not None:
            return known
    report = measure(spec, texts, source)
    _write_verdict(key, report, judge_key(spec))
    return report


GATE_FIRST = ("gate_first_start", "gate_first_done")  # timeline marks of a run's gate before its prediction


def judge_first(spec: JobSpec, say=log.info) -> GateReport | None:
    """`tokenmill run`'s eval gate before its prediction, where this machine has no verdict on an embedding
    job's sample yet: evaluate() measures every model and keeps the verdict, the prediction then reads which
    model the corpus runs on and that model's rate on the sample, and the job's own gate step finds the
    verdict kept (no engine started). Before it, a first gated run was
    predicted on the cheapest candidate as if it passed: on 2-core EPYCs without VNNI `make run`'s gate
    failed both int8 candidates on the demo's sample (top-10 overlap 0.893-0.898 against 0.90) in three
    sessions, and the corpus ran on the reference, 352 s against 227 s predicted and 388 s against 237
    (bench/USER_SESSION.md); the ladder's mixed corpus passed on ONNX Runtime's int8 on the same CPUs: only
    a gate on the corpus tells. Its span is marked (GATE_FIRST) and the engines' start marks of its models
    forgotten, as the flow's gate forgets them. None where it did not measure: a verdict kept, a generation
    gate (its models measured in the flow as before), or a failure (logged; the flow's gate meets it and
    reports it on the job's record). `say`: where its two lines go (the command prints them)."""
    if spec.gate is None or spec.mode != "embed":
        return None
    try:
        timeline.mark(GATE_FIRST[0])  # its sample's reading too, as the flow's gate counts it
        texts, source = sample_texts(spec)
        if _known(spec, verdict_key(spec, texts)) is not None:
            timeline.forget(GATE_FIRST[0])  # the flow's gate reads it kept, and is timed there
            return None
        say(f"Eval gate: no verdict here on this sample yet; measuring {1 + len(candidate_models(spec))} models on "
            f"{len(texts)} rows before the prediction")
        report = evaluate(spec, texts, source)
        timeline.mark(GATE_FIRST[1])
        say(report.message())
        timeline.forget("engine_start", "engine_ready")  # the gate's models'; the corpus's engine marks its own
        return report
    except Exception as exc:  # noqa: BLE001 - bad input or an engine that cannot start: the flow reports it
        log.warning("the eval gate before the prediction failed: %s", exc)
        log.debug("gate before the prediction", exc_info=True)
        timeline.forget(*GATE_FIRST, "engine_start", "engine_ready")  # the flow's gate measures again
        return None


def known_verdict(spec: JobSpec) -> GateReport | None:
    """The verdict evaluate() would return without measuring, or None where it would measure: this machine's
    earlier verdict on this job's sample (read from the corpus), models and thresholds. No engine starts
    (tokenmill.prediction: which model a gated job's corpus will run on, and whether its gate measures)."""
    texts, _ = sample_texts(spec)
    return _known(spec, verdict_key(spec, texts))


def _known(spec: JobSpec, key: str) -> GateReport | None:
    known = _read_verdicts().get(key)
    return None if known is None else _rejudge(spec, known["report"])


def _rejudge(spec: JobSpec, kept: dict[str, Any]) -> GateReport:
    report = GateReport.model_validate(kept)  # judged again: on_fail or min_saving may differ
    rungs = report.candidates or [  # a verdict kept before ladders: its one candidate
        CandidateVerdict(cost=report.candidate, metrics=report.metrics, passed=report.passed)]
    return GateReport.judge(spec, report.sample_source, report.sample_rows, report.reference,
                            rungs).model_copy(update={"cached": True})


def verdict_key(spec: JobSpec, texts: list[str]) -> str:
    """What decides a verdict: the sample's texts, every model (and its files' sizes and times), the
    thresholds, the greedy generation settings, the device and the libraries' versions."""
    return stable_digest({**_judged_by(spec), "texts": stable_digest(texts)}, 24)


def judge_key(spec: JobSpec) -> str:
    """A verdict's identity but the sample: the same models, thresholds, device and libraries on any corpus."""
    return stable_digest(_judged_by(spec), 24)


def _judged_by(spec: JobSpec) -> dict[str, Any]:
    gate = _gate(spec)
    models = [gate.reference, *candidate_models(spec)]
    return {"version": GATE_CACHE_VERSION, "mode": spec.mode,
            "models": [[m.model_dump(mode="json"), _files_identity(resolve_model(job_for(spec, m).model_name))]
                       for m in models],
            "thresholds": thresholds_for(spec), "device": device_label(),
            "versions": library_versions(GATE_LIBRARIES),
            "generation": _gate_job(spec, spec.model).generation.model_dump(mode="json")
            if spec.mode == "generate" else None,
            "max_input_tokens": spec.model.max_input_tokens, "overlong": spec.overlong}


def last_verdict_elsewhere(spec: JobSpec) -> GateReport | None:
    """The latest verdict this machine measured for the same models and thresholds on another sample (another
    corpus), judged again with this job's gate settings; None if it never judged them (tokenmill.prediction:
    before a gate measures this corpus, the model it picked here last)."""
    judged = judge_key(spec)
    kept = [entry for key, entry in _read_verdicts().items()
            if key != "rates" and isinstance(entry, dict) and entry.get("judged_by") == judged]
    if not kept:
        return None
    return _rejudge(spec, max(kept, key=lambda entry: entry.get("measured_at", 0.0))["report"])


def _files_identity(model_path: str) -> list:
    root = Path(model_path)
    if not root.is_dir():
        return [model_path]
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in root.iterdir() if p.is_file())


def _read_verdicts() -> dict[str, Any]:
    return read_json(cache_dir() / "gate-verdicts.json")


def _write_verdict(key: str, report: GateReport, judged_by: str = "") -> None:
    _update_verdicts(lambda cache: cache.update({key: {"measured_at": time.time(), "judged_by": judged_by,
                                                       "report": report.model_dump(mode="json")}}))


def _update_verdicts(change) -> None:
    rewrite_json(cache_dir() / "gate-verdicts.json", change, indent=1)


def measure(spec: JobSpec, texts: list[str], source: str) -> GateReport:
    """The reference, then each candidate, on the same sample. One engine at a time: on one GPU a
    second model may not fit beside the first, so each engine is closed before the next starts
    (unless they are one engine); the last candidate's stays open, to run the corpus if it is chosen."""
    gate = _gate(spec)
    thresholds = thresholds_for(spec)
    jobs = [_gate_job(spec, model) for model in [gate.reference, *candidate_models(spec)]]
    # `engine: auto` is resolved just before each side runs (its trials start engines too), so the
    # report names the engine that ran
    reference_job = resolve_job(jobs[0])
    keep = gate.eval_file is None  # the sample is the corpus's own rows
    reference = run_sample(reference_job, texts, keep=keep)
    lengths = length_class(sum(map(len, reference.token_ids)) / max(len(reference.token_ids), 1))
    rates = _read_verdicts().get("rates", {})
    previous, verdicts = reference_job, []
    for job in jobs[1:]:
        known = rates.get(_rate_key(job), {}).get(str(lengths))
        fastest = max((v.cost.tokens_per_s for v in verdicts if v.passed), default=None)
        if known and fastest and known * (1 + COST_TIE_MARGIN) < fastest:  # it could not be chosen: spare it
            verdicts.append(_not_run(job, known, fastest, spec))
            continue
        if engine_key(previous.spec) != engine_key(job):
            discard_engine(previous.model_path, previous.spec)
        previous = resolve_job(job)
        candidate = run_sample(previous, texts, keep=keep)
        values = _agreement(spec, reference, candidate, reference_job.model_path)
        metrics = [GateMetric(name=name, value=values[name], threshold=limit, passed=values[name] >= limit)
                   for name, limit in thresholds.items()]
        verdicts.append(CandidateVerdict(cost=_cost(previous.spec, candidate, spec), metrics=metrics,
                                         passed=all(m.passed for m in metrics)))
        _note_rate(job, lengths, verdicts[-1].cost.tokens_per_s)
    return GateReport.judge(spec, source, len(texts), _cost(reference_job.spec, reference, spec), verdicts)


def _rate_key(job: JobSpec) -> str:
    """A candidate's identity for its measured rate: the model, its files, the device, the libraries."""
    return stable_digest([job.model.model_dump(mode="json"), job.mode, _files_identity(resolve_model(job.model_name)),
                          device_label(), library_versions(GATE_LIBRARIES), GATE_CACHE_VERSION], 24)


def _note_rate(job: JobSpec, lengths: int, tokens_per_s: float) -> None:
    """This machine's measured rate for the candidate at this length class, for later ladders (kept with the
    verdicts; written, like them, atomically)."""
    _update_verdicts(lambda cache: cache.setdefault("rates", {}).setdefault(_rate_key(job), {}).update(
        {str(lengths): tokens_per_s}))


def _not_run(job: JobSpec, known: float, fastest: float, spec: JobSpec) -> CandidateVerdict:
    cost = RunCost.for_job(spec, rows=1, input_tokens=1_000_000, output_tokens=0, wall_seconds=1e6 / known,
                           engine_seconds=1e6 / known)
    return CandidateVerdict(
        cost=ModelCost(model=model_label(job), engine=job.model.engine, seconds=0.0, tokens=0, tokens_per_s=known,
                       usd_per_1m_tokens=cost.usd_per_1m_tokens),
        metrics=[], passed=False,
        skipped=f"not run: this machine measured it at {known:,.0f} tokens/s on rows of this length, and a "
                f"candidate that passed runs at {fastest:,.0f}")


def _gate_job(spec: JobSpec, model: ModelSpec) -> JobSpec:
    """The job as one side of the gate runs it: generation greedy, so exact match means something."""
    job = job_for(spec, model)
    if spec.mode == "generate":
        greedy = spec.generation.model_copy(update={"temperature": 0.0, "max_tokens": _gate(spec).max_tokens, "n": 1,
                                                    "logprobs": None, "min_tokens": 0})
        job = job.model_copy(update={"generation": greedy})
    return job


def _agreement(spec: JobSpec, reference: SampleRun, candidate: SampleRun, tokenizer_path: str) -> dict[str, float]:
    if spec.mode == "embed":
        return embedding_agreement(np.stack(reference.outputs), np.stack(candidate.outputs))
    values = generation_agreement(reference.outputs, candidate.outputs, tokenizer_path)
    if spec.generation.response_format is not None:
        checker = OutputChecker(spec.generation.response_format)
        values["parsed_agreement"] = parsed_agreement(
            [checker.check(g.text).parsed for g in reference.outputs],
            [checker.check(g.text).parsed for g in candidate.outputs])
    return values


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
    vectors = np.stack(run_sample(resolve_job(job), both, timed=False).outputs)
    a, b = _unit(vectors[: len(first)]), _unit(vectors[len(first):])
    return (a * b).sum(axis=1)


def _cost(job: JobSpec, run: SampleRun, spec: JobSpec) -> ModelCost:
    cost = RunCost.for_job(spec, rows=len(run.outputs), input_tokens=run.tokens, output_tokens=0,
                           wall_seconds=run.seconds, engine_seconds=run.seconds)
    by_length = class_rates(run.calls)
    return ModelCost(model=model_label(job), engine=job.model.engine, seconds=run.seconds, tokens=run.tokens,
                     tokens_per_s=cost.tokens_per_s, usd_per_1m_tokens=cost.usd_per_1m_tokens,
                     rates_by_length={str(c): [mean, rate] for c, (mean, rate) in by_length.items()},
                     untimed_seconds=run.untimed_seconds)


def model_label(job: JobSpec) -> str:
    return job.model_name + (f" [{job.model.quantization}]" if job.model.quantization else "") + \
        (f" [{job.model.dtype}]" if job.model.dtype != "auto" else "")


def pick_cheapest(costs: dict[int, float], savings: dict[int, float], floor: float | None) -> int | None:
    """The candidate that runs the corpus, of those given (index: $/1M, and the share of the reference's
    $/1M it saves): the cheapest that saves at least `floor`, or the rung listed first within COST_TIE_MARGIN
    of it, so that a re-run's measurement noise does not flip the choice (the model is in the shards' cache
    keys); None where none saves that much. GateReport.judge on measured costs, and
    tokenmill.prediction.default_pick on the engines' default rates, before any verdict."""
    enough = [i for i in costs if floor is None or savings[i] >= floor]
    if not enough:
        return None
    cheapest = min(costs[i] for i in enough)
    return next(i for i in enough if costs[i] <= cheapest * (1 + COST_TIE_MARGIN))


def _saving(reference: ModelCost, candidate: ModelCost) -> float:
    """The share of the reference's $/1M tokens the candidate saves (negative: it costs more). Both run at
    the job's one price, so from their measured rates: a price of 0 still tells a faster model from a slower
    one. Rounded, so that a saving of exactly a stated share is not a hair under it."""
    if reference.tokens_per_s > 0 and candidate.tokens_per_s > 0:
        return round(1 - reference.tokens_per_s / candidate.tokens_per_s, 9)
    if reference.usd_per_1m_tokens:
        return round(1 - candidate.usd_per_1m_tokens / reference.usd_per_1m_tokens, 9)
    return 0.0


def _action(spec: JobSpec, passed: bool) -> str:
    return "candidate" if passed else ("reference" if _gate(spec).on_fail == "use_reference" else "fail")


def _unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float64)
    return vectors / np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)


def _gate(spec: JobSpec) -> GateSpec:
    if spec.gate is None:
        raise ConfigError("the job has no gate section")
    return spec.gate


__all__ = ["GateReport", "CandidateVerdict", "evaluate", "known_verdict", "last_verdict_elsewhere", "sample_texts",
           "embedding_agreement", "generation_agreement", "thresholds_for", "candidate_model", "candidate_models",
           "chosen_model", "job_for", "DEFAULT_THRESHOLDS"]
