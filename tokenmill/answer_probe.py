"""A generation job's answers, measured before its run is predicted, where nothing here has generated its
corpus with its prompt: how long its answers run is most of what its engine's seconds depend on, and only
generating tells. Before this, such a run was predicted with every answer to the job's cap, an upper bound
(held-out README summaries at a cap of 64: answers of 32 tokens a row, predicted +8.6% and +10.8%; on an
engine that does not pad, a cap of 512 over answers of 50 would be predicted several times over).

`tokenmill run` (tokenmill.prediction.predict_job, probe=True), once it has read the job's sample: on an
engine given by name (vllm, transformers), or left to `auto` where its trials are cached here (it chooses
without running one), it starts that engine as it would ahead of the flow anyway (timed as tasks/warm.py's
early start is), generates PROBE_ROWS of the corpus's rows (the engine trial's sample: the same rows by a
hash of their id) at the job's own cap and sampling, and stores their answers' lengths as a calibration's
are stored (call_costs.remember_answers, source "probe"): the prediction that follows plans its calls with
them, and `plan` and `calibrate` read them from then on. The probe's seconds are a part of that prediction,
measured (it is done), apart from the main thread's other work. Its rows' outputs go to the job's row cache
(the row cache's share of the corpus estimated before, without them): the run does not compute them again,
and the prediction counts them out (JobSample.probe_kept).

Not for `engine: auto` where a trial will run: the trials generate the corpus's sample after the prediction,
which plans them; nor for n > 1 (the trials' output tokens a row stand in), nor a gated job (the gate may
change the model, and predict_job predicts it apart)."""

from __future__ import annotations

import logging

from tokenmill import timeline
from tokenmill.bucketing import restore_order
from tokenmill.call_costs import remember_answers
from tokenmill.engine_choice import (answers_at_cap, answers_key, cache_dir, choose_engine, engine_trials, sample_rows,
                                     trials_cached)
from tokenmill.engines import get_engine
from tokenmill.planning import estimate_rows
from tokenmill.resolution import resolve_job
from tokenmill.row_cache import keep_sample_rows
from tokenmill.runner import plan_feed, run_batches
from tokenmill.shards import discover_shards_for
from tokenmill.spec import JobSpec

log = logging.getLogger(__name__)

PROBE_ROWS = 16  # the generation trial's sample (engine_choice.TRIAL_ROWS): the same rows
PROBED_ENGINES = ("vllm", "transformers")


def needs_probe(spec: JobSpec, mean_tokens: float | None = None) -> bool:
    """A generation job on an engine given by name, or left to auto with its trials cached here (mean_tokens:
    the trial sample's, where read), whose corpus's answers nothing here has measured
    (prediction.job_answers would plan every answer to the cap)."""
    if spec.mode != "generate" or spec.generation.n != 1:
        return False
    if spec.model.engine not in (*PROBED_ENGINES, "auto"):
        return False
    if answers_at_cap(spec, [t for _, t in engine_trials(spec)]) is not None:
        return False
    return spec.model.engine != "auto" or trials_cached(spec, mean_tokens)


def probe_answers(spec: JobSpec, mean_tokens: float | None = None) -> int:
    """Where the job needs one (needs_probe), the probe; the rows it kept in the row cache. 0 where it needs
    none, or where it failed (the prediction plans every answer to the cap, and the flow meets the failure
    and reports it). Its seconds are its marks' span (answer_probe_start to answer_probe_done)."""
    try:
        if not needs_probe(spec, mean_tokens):
            return 0
        return _probe(spec)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot start: the flow reports it
        log.warning("measuring the corpus's answers before the prediction failed: %s", exc)
        log.debug("answers' probe", exc_info=True)
        return 0


def _probe(spec: JobSpec) -> int:
    """Start the job's engine (auto's choice made first, from its cached trials, as tasks/warm.py makes it) and
    generate the corpus's PROBE_ROWS sample rows at the job's cap; their answers stored, their outputs kept.
    Nothing for an OpenAI Batch input (each request carries its own sampling): 0 rows kept."""
    if spec.model.engine == "auto":
        choose_engine(spec, job_rows=estimate_rows(spec, discover_shards_for(spec)))  # cached: no trial runs
    job = resolve_job(spec)
    if job.pipeline != "rows":
        return 0
    timeline.mark("early_engine_start")  # tokenmill.prediction: the engine's start, as when it starts early
    engine = get_engine(job.model_path, job.spec)
    timeline.mark("early_engine_ready")
    timeline.mark("answer_probe_start")
    (rows,) = sample_rows(job.spec, job.model_path, [PROBE_ROWS])
    calls = plan_feed([len(r) for r in rows], job.spec, job.engine, engine)
    results, seconds = run_batches(engine, calls, rows, job.spec, None)
    outputs = restore_order(calls, results)
    answers = [g.output_tokens for g in outputs]
    remember_answers(cache_dir(), answers_key(spec), answers, spec.generation.max_tokens, "probe")
    kept = keep_sample_rows(job.spec, job.model_path, job.engine, rows, outputs, seconds)
    timeline.mark("answer_probe_done")
    log.info("answers' probe: %d of the corpus's rows on %s, answers of %.0f tokens a row at a cap of %d; %d kept "
             "in the row cache", len(rows), job.engine, sum(answers) / max(len(answers), 1),
             spec.generation.max_tokens, kept)
    return kept
