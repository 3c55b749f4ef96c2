"""What a generation's engine call costs, from the calls measured here: the engine seconds of a job to come.

Generating, an engine call's seconds are not its tokens over one rate. A call runs its prompts once
(prefill) and then one step a generated token for as many steps as its longest answer; each step costs
a fixed part (the weights read once) and a part per row. Measured here on a 2-core CPU with SmolLM2 on
transformers: a call of 1 row spent ~0.1 s a step, one of 11 rows ~0.19 s a step, so the same rows
cost about half as much in calls of 11 as in calls of 1 or 2 (an engine trial's 12 rows make calls of
1 to 2; a job's 48 make calls of up to 11), and a cap of 64 costs more than twice a cap of 32 once
rows run to it. One tokens/s figure carried from the trial to the job missed by +47%, and from a cap of
32 to a cap of 64 by -22% (bench/PREDICTION.md, 2026-11-25).

A step's part per row is a line only where the engine's matrix products are: on MKL's sgemm a 2-core AMD
EPYC decoded a step of 2 or 3 rows slower than one of 4 to 8, and the bench's 61 calls ran at 0.82x this
fit with 1 row, 1.13x with 2 and 1.36x with 3 (a job of many calls of 1 to 3 rows missed by -10.7%, run
25a). On oneDNN, which the transformers engine uses on a CPU since (tokenmill.hf_engine), 0.96-1.07x at
every width (run 26b).

So every generation call is stored with its shape, and a job's engine seconds are its calls' seconds:

    seconds = a x input slots + b x steps + c x output slots + d + e x input slots x steps

input slots: rows x the longest prompt on an engine that pads its calls (transformers), the prompts'
real tokens on one that does not (vLLM); steps: the call's longest answer; output slots: rows x steps
on an engine that pads (a finished row keeps its place until the call ends), the answers' real tokens
on one that does not; input slots x steps: each step reads every prompt slot's cached keys and values
(transformers' cache grows by a copy a step, and its grouped-query attention repeats them for every head).
a..e >= 0 are fit by least squares to the calls of this job's family on this
engine and device: the engine trial's (its calls, and one call of all its rows at once, so the fit
sees calls of more than one width) and every run's since.

A job's calls are planned as the runner plans them (runner.plan_feed), on a shard of its sample's
lengths, and each call's steps are the expected longest of its rows' answers, each drawn from the answers
measured for this corpus (its trials', its probe's, its last run's or calibration's; an answer cut at a
lower cap taken to run to the job's), weighted by how near their prompts' lengths are to the row's
(AnswerDraws: long prompts get long answers, and run few to a call).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel

from tokenmill.json_store import read_json, rewrite_json


KEEP_CALLS = 400  # a family's last measured calls, per engine and device
MIN_CALLS = 4  # a fit needs at least this many calls, of at least two widths
STEPS = 1  # the steps' term in CallCost.features
INPUT, OUTPUT = 0, 2  # the input slots' term, the output slots' (a row's step)
INPUT_STEPS = 4  # the input slots' steps' term
KEEP_ANSWERS = 512  # a corpus's last measured answers (their lengths), per model and prompt
MAX_SHARD_ROWS = 20_000  # a longer shard is planned at this many rows and scaled: its calls repeat


class CallCost(BaseModel):
    """One measured engine call: its shape (see the module docstring) and its seconds."""
    rows: int
    input_slots: float
    steps: float
    output_slots: float
    seconds: float

    def features(self) -> list[float]:
        return [self.input_slots, self.steps, self.output_slots, 1.0, self.input_slots * self.steps]


def call_shape(pads: bool, lengths: Sequence[int], longest_answer: float, answers_total: float, concurrency: int,
               seconds: float = 0.0) -> CallCost:
    """One generation call of rows of `lengths` tokens whose answers' longest and total are given. Its steps:
    its longest answer; on an engine that does not pad (vLLM) and runs at most `concurrency` rows at once
    (max_num_seqs: batching.max_batch_size), at least its answers' tokens over that."""
    rows = len(lengths)
    if pads:
        return CallCost(rows=rows, input_slots=rows * max(lengths, default=0), steps=longest_answer,
                        output_slots=rows * longest_answer, seconds=seconds)
    steps = max(longest_answer, math.ceil(answers_total / max(concurrency, 1)))
    return CallCost(rows=rows, input_slots=sum(lengths), steps=steps, output_slots=answers_total, seconds=seconds)


def output_tokens(result: Any) -> int:
    """An engine result's generated tokens (0 for an embedding, or a result that does not count them)."""
    return int(getattr(result, "output_tokens", 0) or 0)


def call_cost(pads: bool, lengths: Sequence[int], outputs: Sequence[Any], seconds: float,
              concurrency: int) -> CallCost:
    """The measured shape of one generation call whose results are `outputs`."""
    answers = [output_tokens(g) for g in outputs]
    return call_shape(pads, lengths, max(answers, default=0), sum(answers), concurrency, seconds)


# ---- the run's calls, stored for the next prediction ----------------------------------------------------

_lock = threading.Lock()
_run_calls: dict[str, list[CallCost]] = {}
_run_answers: dict[str, list[tuple[int, int]]] = {}  # (answer, its prompt's length), in tokens
# embedding calls, summed by their rows' mean length in tokens: {mean: their sum} (observe_embedding)
_run_lengths: dict[str, dict[int, CallCost]] = {}


def _runs_on(spec, engine: str) -> str:
    """Which engine and model a call ran on (a gate's candidate is another model on the same engine)."""
    return json.dumps([engine, spec.mode, spec.model.model_dump(mode="json", exclude={"engine"})], sort_keys=True)


def observe(spec, engine: str, calls: Sequence[CallCost], answers: Sequence[int] = (),
            inputs: Sequence[int] = ()) -> None:
    """A shard's generation calls and its rows' answers in tokens, beside their prompts' lengths (`inputs`, in
    the same order; runner): kept until the run of this model on this engine stores them (take, take_answers)."""
    with _lock:
        if calls:
            kept = _run_calls.setdefault(_runs_on(spec, engine), [])
            kept.extend(calls)
            del kept[:-KEEP_CALLS]  # a process that runs without predicting keeps no more than it would store
        if answers:
            held = _run_answers.setdefault(_runs_on(spec, engine), [])
            prompts = list(inputs) if len(inputs) == len(answers) else [0] * len(answers)
            held.extend((int(n), int(p)) for n, p in zip(answers, prompts))
            if len(held) > 8 * KEEP_ANSWERS:  # a long run: every other answer, so early shards keep their share
                held[:] = held[::2]


def embed_call(lengths: Sequence[int], seconds: float) -> CallCost:
    """One embedding call of rows of `lengths` tokens: its rows and tokens (no steps: nothing is generated)."""
    return CallCost(rows=len(lengths), input_slots=sum(lengths), steps=0.0, output_slots=0.0, seconds=seconds)


def observe_embedding(spec, engine: str, calls: Sequence[CallCost]) -> None:
    """A shard's embedding calls (embed_call): summed by their rows' mean length, so a run's rows of each
    length give their own rate (take_lengths), however many calls it makes."""
    with _lock:
        kept = _run_lengths.setdefault(_runs_on(spec, engine), {})
        for call in calls:
            if call.rows:
                mean = round(call.input_slots / call.rows)
                held = kept.get(mean)
                kept[mean] = call if held is None else embed_sum(held, call)


def take_lengths(spec, engine: str) -> list[CallCost]:
    """This run's embedding calls, summed by their rows' mean length (observe_embedding)."""
    with _lock:
        return [call for _, call in sorted(_run_lengths.pop(_runs_on(spec, engine), {}).items())]


def embed_sum(a: CallCost, b: CallCost) -> CallCost:
    """Two embedding calls' rows, tokens and seconds as one call's."""
    return CallCost(rows=a.rows + b.rows, input_slots=a.input_slots + b.input_slots, steps=0.0, output_slots=0.0,
                    seconds=a.seconds + b.seconds)


def take(spec, engine: str) -> list[CallCost]:
    with _lock:
        return _run_calls.pop(_runs_on(spec, engine), [])


def take_answers(spec, engine: str) -> tuple[list[int], list[int]]:
    """This run's answers and their prompts' lengths (observe)."""
    with _lock:
        held = _run_answers.pop(_runs_on(spec, engine), [])
    return [n for n, _ in held], [p for _, p in held]


def forget() -> None:
    """A job starts (flows/batch.py, beside timeline.begin_job): calls an earlier job of this process left
    unstored (a job that made no prediction, a failed one) are not this job's."""
    with _lock:
        _run_calls.clear()
        _run_answers.clear()
        _run_lengths.clear()


def _path(cache: Path) -> Path:
    return cache / "engine-calls.json"


def read_calls(cache: Path, key: str) -> list[CallCost]:
    """`key`'s stored calls in the cache directory `cache` (engine_choice.cache_dir)."""
    stored = read_json(_path(cache)).get(key)
    return [CallCost(**c) for c in stored if isinstance(c, dict)] if isinstance(stored, list) else []


def remember_calls(cache: Path, key: str, calls: Sequence[CallCost]) -> None:
    """Appended to `key`'s last KEEP_CALLS calls (key: prediction.rates_key, the engine, device and family)."""
    if not calls:
        return

    def add(stored: dict) -> None:
        stored[key] = (stored.get(key, []) + [c.model_dump() for c in calls])[-KEEP_CALLS:]

    rewrite_json(_path(cache), add)


# ---- a corpus's answers, as measured ----------------------------------------------------------------------

def _answers_path(cache: Path) -> Path:
    return cache / "generation-answers.json"


class Answers(BaseModel):
    """The answers' lengths in tokens that rows of one corpus and prompt got from one model (up to
    KEEP_ANSWERS), at the cap they ran to (an answer of `cap` tokens was cut there), and what measured them;
    beside each, its prompt's length in tokens (`inputs`: empty where stored before they were kept)."""
    answers: list[int]
    cap: int
    source: str  # "run" | "calibration" | "probe"
    inputs: list[int] = []


def read_answers(cache: Path, key: str) -> Answers | None:
    stored = read_json(_answers_path(cache)).get(key)
    try:
        return Answers(**stored) if isinstance(stored, dict) else None
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        return None


def remember_answers(cache: Path, key: str, answers: Sequence[int], cap: int, source: str,
                     inputs: Sequence[int] = ()) -> None:
    """A run's or a calibration's answers for `key` (engine_choice.answers_key: the model, corpus and prompt),
    with their prompts' lengths where given (`inputs`, in the same order). What was stored at a higher cap
    stays (its answers were cut less); at the same cap the newest replace it."""
    if not answers or cap <= 0:
        return
    step = max(1, math.ceil(len(answers) / KEEP_ANSWERS))  # evenly spaced over the run's shards
    prompts = [int(n) for n in inputs][::step] if len(inputs) == len(answers) and all(n > 0 for n in inputs) else []
    kept = Answers(answers=[int(n) for n in answers][::step], cap=cap, source=source, inputs=prompts).model_dump()

    def keep(stored: dict) -> None:
        held = stored.get(key)
        if not (isinstance(held, dict) and held.get("cap", 0) > cap):
            stored[key] = kept

    rewrite_json(_answers_path(cache), keep)


# ---- the fit ---------------------------------------------------------------------------------------------

def fit(calls: Sequence[CallCost]) -> list[float] | None:
    """a, b, c, d >= 0 (see the module docstring) by least squares over `calls`. The steps' term is always in
    (a generated token is a step: without it a longer cap would cost nothing); which of the other three join
    it is chosen by leave-one-out error, among the subsets whose fit is non-negative: an engine trial's seven
    or so calls fit all four terms to their noise (a 0.7 s cost a call, 2.8 ms an input token, where a
    job's calls then ran 16% slower than predicted) and the held-out call says so. Where a call of one step
    measured what a prompt's tokens cost (a trial's or a probe's prefill call: engine_choice.prefill_call),
    the input slots' and a row's step's terms are in too: that one call weighs little in the held-out error
    of ten, and a probe's ten calls were fit without either, putting a docstring corpus's calls of prompts up
    to 972 tokens at 69.9 s against 83.5 (with them: 82.3; the bench's held-out generation, whose fit already
    kept them, moves from 70.8 to 71.4 s against 66.7). The input slots' steps are a term of their own: a prefill
    call prices a prompt's slot once, and a step reads it again (a user's commit messages on SmolLM2, prompts of
    92-257 tokens at a cap of 40: a fit without the term to the probe's and trial's 17 calls of 1-12 rows put the
    run's 9 calls of 4-14 rows at 0.74-0.95x, the longest prompts lowest, -15% in all; with it, 0.87-1.02x, -4%).
    With a prefill call, a step's work for its rows is priced by a row's step or by the input slots' steps,
    whichever the held-out error prefers (a step's rows cost by their count, their cached slots, or both):
    forcing a row's step in kept a later round of those commit messages' fit from the slots' steps, and
    put the run's calls of 1,285-1,582 slots, more than any measured call's 1,104, at 0.85-0.88x (-15%
    in all); the slots' steps without a row's step put them at 1.01-1.04x (-8%, of which one call's 4.6 s
    against 7.1 measured, twice its neighbours' pace). Calls that stalled (STALLED) are left out and the rest
    fit again. None with fewer than MIN_CALLS calls or all of one width, where the per-step and per-row costs
    cannot be told apart."""
    return fit_stalled(calls)[0]


def fit_stalled(calls: Sequence[CallCost]) -> tuple[list[float] | None, int]:
    """fit(calls), and how many of them it left out as stalled."""
    coefficients = _fit(calls)
    kept = _unstalled(calls, coefficients) if coefficients else calls
    refit = _fit(kept) if len(kept) < len(calls) else None
    return (refit, len(calls) - len(kept)) if refit else (coefficients, 0)


def _fit(calls: Sequence[CallCost]) -> list[float] | None:
    if len(calls) < MIN_CALLS or len({c.rows for c in calls}) < 2:
        return None
    a = np.array([c.features() for c in calls])
    y = np.array([c.seconds for c in calls])
    if not any(c.steps == 1 and c.input_slots > 0 for c in calls):
        return _best_fit(a, y, [{STEPS}])
    return _best_fit(a, y, [{STEPS, INPUT, OUTPUT}, {STEPS, INPUT, INPUT_STEPS}]) or _best_fit(a, y, [{STEPS}])


def _best_fit(a: np.ndarray, y: np.ndarray, needed: list[set[int]]) -> list[float] | None:
    """The fit of the least held-out error among the subsets of terms that hold one of `needed` and fit
    non-negative."""
    best: tuple[float, list[float]] | None = None
    for size in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), size):
            if not any(terms <= set(columns) for terms in needed):
                continue
            coefficients, *_ = np.linalg.lstsq(a[:, columns], y, rcond=None)
            if (coefficients < 0).any():
                continue
            held_out = 0.0
            for i in range(len(y)):
                others = np.arange(len(y)) != i
                without, *_ = np.linalg.lstsq(a[others][:, columns], y[others], rcond=None)
                held_out += float((a[i, columns] @ without - y[i]) ** 2)
            full = np.zeros(a.shape[1])
            full[list(columns)] = coefficients
            if best is None or held_out < best[0]:
                best = (held_out, [float(v) for v in full])
    return best[1] if best else None


# A call that ran this many times what the calls' least-absolute-error fit puts it at stalled: a neighbour held
# the CPU (2 cores) for part of it. Least squares follows a stalled call, the more so the wider it is: a trial's
# 12-row call that ran 143.6 ms a step, where the same call ran 56.7 a round before, put a job of 60 explanations
# at 28.0 s of engine against 14.5 measured (bench/PREDICTION.md, run 28's user rounds). The least absolute error
# follows the calls' majority: a user's commit messages' 26 calls of two rounds (tests/test_call_costs.py) ran at
# 0.90-1.17x of it but one, 13 rows at 176.7 ms a step where its neighbours ran 84-93, at 1.65x; a docstring
# probe's calls of 2 to 7 rows on MKL (whose sgemm ran 2 or 3 rows slow) at up to 1.43x.
STALLED = 1.5


def _unstalled(calls: Sequence[CallCost], coefficients: list[float]) -> list[CallCost]:
    """`calls` but those that stalled (STALLED), by the least absolute error fit of the terms `coefficients` hold
    (non-negative; linear programming). A call of one step (a prefill call) stays: it alone prices a prompt."""
    from scipy.optimize import linprog  # imported where a fit runs, not by every command

    columns = [i for i, k in enumerate(coefficients) if k > 0]
    a = np.array([[c.features()[i] for i in columns] for c in calls])
    y = np.array([c.seconds for c in calls])
    n, k = a.shape
    # minimise the sum of u + v where a x + u - v = y, with x, u, v >= 0
    solved = linprog(np.concatenate([np.zeros(k), np.ones(2 * n)]), A_eq=np.hstack([a, np.eye(n), -np.eye(n)]),
                     b_eq=y, bounds=(0, None), method="highs")
    if not solved.success:
        return list(calls)
    median = a @ solved.x[:k]
    return [c for c, m in zip(calls, median) if c.steps <= 1 or m <= 0 or c.seconds <= STALLED * m]


def describe_fit(coefficients: list[float]) -> str:
    a, b, c, d, e = coefficients
    return (f"{b * 1000:.1f} ms a step + {c * 1000:.2f} ms a row's step + {a * 1e6:.0f} us an input slot"
            + (f" + {e * 1e9:.0f} ns an input slot's step" if e else "") + f" + {d * 1000:.0f} ms a call")


# ---- a job's calls ---------------------------------------------------------------------------------------

def answer_lengths(trial_lengths: Sequence[int], trial_cap: int, job_cap: int) -> list[int]:
    """The answers a job's rows will have, from a trial's: those the trial cut at its cap run to the job's."""
    return [job_cap if n >= trial_cap else min(n, job_cap) for n in trial_lengths]


# How near two prompts' lengths must be for one's answer to stand for the other's: a Gaussian weight over the
# log of their ratio, of this width (x1.4 at one width). Answers follow their prompts' lengths: the held-out
# README paragraphs (bench/PREDICTION.md, run 23) answered 28 tokens a row below 130 prompt tokens and 59 above,
# every prompt of 398 or more ran to the cap of 64, and its longest prompts run one to a call. Drawn blind from
# all answers, those one-row calls were planned at the mean answer: 46.5 steps a call against 56.2 run (engine
# 63.3 s against 69.8 on the calls' real answers). Drawn by length, from the run's 96 answers: 55.2 steps,
# 70.0 s; from 32 of them (a probe's), 69.3 s on average over 20 draws (sd 3.0; blind 63.7). Narrower (0.2)
# follows a probe's few long prompts too closely; wider (0.8) is blind again (65.7 s).
ANSWER_WIDTH = 0.35


class AnswerDraws:
    """A job's rows' answers, each drawn from the answers measured for its corpus (with replacement), weighted
    by how near their prompts' lengths are to the row's (ANSWER_WIDTH); drawn alike for every row where the
    prompts' lengths were not kept (`inputs` empty)."""

    def __init__(self, answers: Sequence[int], inputs: Sequence[int] = ()):
        self.answers = np.asarray(answers, dtype=float)
        self.values = np.unique(self.answers)  # ascending
        by_length = len(inputs) == len(answers) and len(answers) > 1 and min(inputs) > 0
        self.logs = np.log(np.asarray(inputs, dtype=float)) if by_length else None
        self._drawn: dict[int, tuple[np.ndarray, float]] = {}  # a prompt's length: (cdf, mean answer)

    def weights(self, length: int) -> np.ndarray:
        if self.logs is None:
            return np.full(len(self.answers), 1.0 / len(self.answers))
        z = -0.5 * ((self.logs - math.log(max(length, 1))) / ANSWER_WIDTH) ** 2
        w = np.exp(z - z.max())  # the nearest prompt weighs 1: no prompt is so far that every weight is 0
        return w / w.sum()

    def _draw(self, length: int) -> tuple[np.ndarray, float]:
        key = length if self.logs is not None else 0
        if key not in self._drawn:
            w = self.weights(length)
            self._drawn[key] = (np.array([w[self.answers <= v].sum() for v in self.values]), float(w @ self.answers))
        return self._drawn[key]

    def cdf(self, length: int) -> np.ndarray:
        """P(answer <= v) for each of self.values, for a row of a prompt of `length` tokens."""
        return self._draw(length)[0]

    def mean(self, length: int) -> float:
        """The mean answer of a row of a prompt of `length` tokens."""
        return self._draw(length)[1] if len(self.answers) else 0.0

    def longest(self, lengths: Sequence[int]) -> float:
        """The expected longest answer of rows of these prompts' lengths: the sum over the answers' values of
        the step to each times the chance some row's answer reaches it."""
        if not len(self.values) or not len(lengths):
            return 0.0
        below = np.prod([self.cdf(n) for n in lengths], axis=0)  # P(every row's answer <= v)
        reach = np.concatenate([[1.0], 1.0 - below[:-1]])  # P(the longest >= the value), value by value
        return float(np.diff(self.values, prepend=0.0) @ reach)


def shard_lengths(lengths: Sequence[int], rows: int) -> list[int]:
    """A shard of `rows` rows with the sample's length distribution: its quantiles, interpolated between the
    sample's rows (a sample's 16 lengths repeated make calls of equal rows that a corpus's lengths, all
    different, do not: 7 calls planned where a job's 47 rows ran 12)."""
    ordered = sorted(lengths) or [1]
    m = len(ordered)
    out = []
    for i in range(rows):
        q = min(max((i + 0.5) / rows * m - 0.5, 0.0), m - 1.0)
        low = math.floor(q)
        high = min(low + 1, m - 1)
        out.append(round(ordered[low] + (q - low) * (ordered[high] - ordered[low])))
    return out


def job_seconds(coefficients: list[float], plan, lengths: Sequence[int], rows: int, shards: int, pads: bool,
                answers: Sequence[int], concurrency: int, inputs: Sequence[int] = ()) -> tuple[float, int, float]:
    """(engine seconds, calls, mean steps a call) of `rows` rows in `shards` shards, each planned by
    `plan(shard lengths) -> list of calls (row indices)` as the runner plans them, each row's answer drawn
    from `answers` by its prompt's length (AnswerDraws; `inputs`: the answers' prompts' lengths)."""
    if rows <= 0:
        return 0.0, 0, 0.0
    shards = max(shards, 1)
    per_shard = max(1, math.ceil(rows / shards))
    planned = min(per_shard, MAX_SHARD_ROWS)
    shard = shard_lengths(lengths, planned)
    calls = plan(shard)
    seconds, steps_total = calls_seconds(coefficients, [[shard[i] for i in call] for call in calls], pads,
                                         AnswerDraws(answers, inputs), concurrency)
    scale = rows / planned
    return seconds * scale, round(len(calls) * scale), steps_total / len(calls) if calls else 0.0


def calls_seconds(coefficients: list[float], calls: Sequence[Sequence[int]], pads: bool, draws: AnswerDraws,
                  concurrency: int) -> tuple[float, float]:
    """(seconds, steps) of generation calls, each given as its prompts' lengths, their answers drawn."""
    seconds = steps = 0.0
    for prompts in calls:
        cost = call_shape(pads, prompts, draws.longest(prompts), sum(draws.mean(n) for n in prompts), concurrency)
        seconds += sum(k * f for k, f in zip(coefficients, cost.features()))
        steps += cost.steps
    return seconds, steps
