"""A generation job's answers, measured before its run is predicted, where nothing here has generated its
corpus with its prompt: how long its answers run is most of what its engine's seconds depend on, and only
generating tells. Before this, such a run was predicted with every answer to the job's cap, an upper bound
(held-out README summaries at a cap of 64: answers of 32 tokens a row, predicted +8.6% and +10.8%; on an
engine that does not pad, a cap of 512 over answers of 50 would be predicted several times over).

`tokenmill run` (tokenmill.prediction.predict_job, probe=True), once it has read the job's sample: on an
engine given by name (vllm, transformers), or left to `auto` where its trials are cached here (it chooses
without running one), it starts that engine as it would ahead of the flow anyway (timed as tasks/warm.py's
early start is), generates PROBE_ROWS of the corpus's rows (the engine trial's sample and as many more, by a
hash of their id) at the job's own cap and sampling, and stores their answers' lengths as a calibration's
are stored (call_costs.remember_answers, source "probe"): the prediction that follows plans its calls with
them, and `plan` and `calibrate` read them from then on. Its engine calls are stored as a run's are
(call_costs.remember_calls): the fit of a call's seconds then sees calls of this corpus at this cap (README
paragraphs at a cap of 64, where every call measured before ran to 32: engine 75.6 s predicted against 113.3
measured without them, run 21b). The probe's seconds are a part of that prediction,
measured (it is done), apart from the main thread's other work. Its rows' outputs go to the job's row cache
(the row cache's share of the corpus estimated before, without them): the run does not compute them again,
and the prediction counts them out (JobSample.probe_kept).

For `engine: auto` where its trials will run (after the prediction, at a cap of their own: TRIAL_MAX_TOKENS),
on the engine the trials start first (engine_choice.trial_order: transformers, a few seconds' start), within
the probe's seconds: it stays open, and its trial reuses it with its start as measured here, so the probe
adds its rows' generation to the run, not a start (issue 30's 192 summaries, a first run on auto at a cap of
64: answers of 41 tokens a row planned at 58). Its rows are kept under that engine, which the prediction
counts out only where it predicts that engine for the job; since auto may choose the other, the probe takes
the trial's sample alone (16 rows: a mean, which an engine that does not pad needs, more than a tail).

Not for n > 1 (the trials' output tokens a row stand in), nor a gated job (the gate may change the model, and
predict_job predicts it apart), nor an OpenAI Batch input (each request carries its own sampling)."""

from __future__ import annotations

import logging

from tokenmill import timeline
from tokenmill.bucketing import restore_order
from tokenmill.call_costs import CallCost, remember_answers, remember_calls
from tokenmill.engine_choice import (TRIAL_ROWS, answers_at_cap, answers_key, cache_dir, choose_engine,
                                     engine_trials, prefill_call, rates_key, runnable_engines, sample_rows,
                                     trial_order, trials_cached, with_engine)
from tokenmill.engines import get_engine
from tokenmill.planning import estimate_rows
from tokenmill.resolution import input_format_of, resolve_job
from tokenmill.row_cache import keep_sample_rows
from tokenmill.runner import plan_feed, run_batches
from tokenmill.shards import discover_shards_for
from tokenmill.spec import JobSpec

log = logging.getLogger(__name__)

# The generation trial's sample (engine_choice.TRIAL_ROWS, 16) and as many more, by the same hash. An engine
# that pads (transformers) runs a call until its longest answer ends, so the answers' tail at the cap sets its
# seconds: the held-out README summaries (91 answers, 14% at a cap of 64) came out 58 steps a call where 16 of
# their rows planned 43 (engine -28%); drawing 16 of those answers put the calls' mean steps >10% off in 26% of
# 2,000 draws, 32 in 8%, 48 in 1%. Their outputs are kept (the run does not compute them again), so more rows
# move work earlier rather than add it.
PROBE_ROWS = 32
PROBED_ENGINES = ("vllm", "transformers")


def fit_calls(engine, rows: list[list[int]], costs: list[CallCost], job: JobSpec) -> list[CallCost]:
    """The probe's calls as the fit of a call's seconds gets them: with one more call, its longest prompts whole
    for one token (engine_choice.prefill_call: what a token of prompt costs, apart from a step's and a row's).
    A named engine's first generation here has no trial: the probe's calls alone, of 1 to 13 rows of prompts up
    to 405 tokens, were fit at 4.7 ms an input slot and no cost a row's step, and put a docstring corpus's
    calls of prompts up to 972 tokens at 106 s against 87.8 (a 1-row call of 972: 6.0 s against 3.5). Its
    first call stays in, though it pays the engine's allocations (a trial warms up first): so does a run's on
    a fresh engine, and without it the bench's warm SmolLM2 generation was planned at 21.0 s against 24.4."""
    return costs + prefill_call(engine, rows, job)


def probe_engine(spec: JobSpec, mean_tokens: float | None = None) -> str | None:
    """The engine the probe runs on, where the job needs one: a generation job whose corpus's answers nothing
    here has measured (prediction.job_answers would plan every answer to the cap). The engine as written;
    "auto" where auto chooses from its trials cached here (mean_tokens: the trial sample's, where read); where
    its trials will run, the one they start first. None where the job needs no probe."""
    if spec.mode != "generate" or spec.generation.n != 1:
        return None
    if spec.model.engine not in (*PROBED_ENGINES, "auto") or input_format_of(spec) == "openai-batch":
        return None  # an OpenAI Batch input: each request carries its own sampling
    if answers_at_cap(spec, [t for _, t in engine_trials(spec)]) is not None:
        return None
    if spec.model.engine != "auto" or trials_cached(spec, mean_tokens):
        return spec.model.engine
    return trial_order(runnable_engines(spec)[0])[0]


def probe_answers(spec: JobSpec, mean_tokens: float | None = None) -> tuple[str, int]:
    """Where the job needs one (probe_engine), the probe: the engine it ran on and the rows it kept in that
    engine's row cache. ("", 0) where it needs none, or where it failed (the prediction plans every answer to
    the cap, and the flow meets the failure and reports it). Its seconds are its marks' span
    (answer_probe_start to answer_probe_done)."""
    try:
        engine = probe_engine(spec, mean_tokens)
        if engine is None:
            return "", 0
        return _probe(spec, engine)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot start: the flow reports it
        log.warning("measuring the corpus's answers before the prediction failed: %s", exc)
        log.debug("answers' probe", exc_info=True)
        return "", 0


def _probe(spec: JobSpec, engine_name: str) -> tuple[str, int]:
    """Start the probe's engine (auto's choice made first, from its cached trials, as tasks/warm.py makes it)
    and generate the corpus's PROBE_ROWS sample rows at the job's cap; their answers stored, their outputs
    kept. The job's own engine's start is timed as an early start is; the trials' first engine's, within the
    probe's span."""
    if engine_name == "auto":
        choose_engine(spec, job_rows=estimate_rows(spec, discover_shards_for(spec)))  # cached: no trial runs
    job = resolve_job(spec if engine_name == "auto" else with_engine(spec, engine_name))
    trials_next = spec.model.engine == "auto" and engine_name != "auto"  # not the job's engine, maybe
    timeline.mark("answer_probe_start" if trials_next else "early_engine_start")
    engine = get_engine(job.model_path, job.spec)
    if not trials_next:  # tokenmill.prediction: the engine's start, as when it starts early
        timeline.mark("early_engine_ready")
        timeline.mark("answer_probe_start")
    # before auto's trials, the trial's own sample: auto may choose an engine its rows are not kept under
    (rows,) = sample_rows(job.spec, job.model_path, [TRIAL_ROWS["generate"] if trials_next else PROBE_ROWS])
    calls = plan_feed([len(r) for r in rows], job.spec, job.engine, engine)
    costs: list[CallCost] = []
    results, seconds = run_batches(engine, calls, rows, job.spec, None, costs)
    outputs = restore_order(calls, results)
    answers = [g.output_tokens for g in outputs]
    remember_answers(cache_dir(), answers_key(spec), answers, spec.generation.max_tokens, "probe",
                     [len(r) for r in rows])
    # its calls too, as a run's are stored: the prediction's fit then sees this corpus's calls at the job's cap
    remember_calls(cache_dir(), rates_key(spec, job.engine), fit_calls(engine, rows, costs, job.spec))
    kept = keep_sample_rows(job.spec, job.model_path, job.engine, rows, outputs, seconds)
    timeline.mark("answer_probe_done")
    log.info("answers' probe: %d of the corpus's rows on %s, answers of %.0f tokens a row at a cap of %d; %d kept "
             "in the row cache", len(rows), job.engine, sum(answers) / max(len(answers), 1),
             spec.generation.max_tokens, kept)
    return job.engine, kept
