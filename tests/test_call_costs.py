"""tokenmill.call_costs: a generation job's engine seconds as its calls' seconds, fit to calls measured here."""

import pytest

from tokenmill import call_costs
from tokenmill.call_costs import AnswerDraws, CallCost, answer_lengths, fit, job_seconds
from tokenmill.runner import plan_feed
from tokenmill.spec import JobSpec

# what calls cost on a 2-core CPU, SmolLM2 on transformers (call_costs' docstring): 0.1 s a step, 8 ms a row's step
STEP, ROW_STEP, SLOT = 0.1, 0.008, 0.0002


def measured(rows, longest, steps):
    return CallCost(rows=rows, input_slots=rows * longest, steps=steps, output_slots=rows * steps,
                    seconds=SLOT * rows * longest + STEP * steps + ROW_STEP * rows * steps)


def shaped(shapes):
    """Calls measured here, as (rows, input slots, steps, seconds): every row generated every step."""
    return [CallCost(rows=r, input_slots=slots, steps=steps, output_slots=r * steps, seconds=s)
            for r, slots, steps, s in shapes]


def planned(coefficients, calls):
    """The seconds a fit puts on `calls`."""
    return sum(k * f for c in calls for k, f in zip(coefficients, c.features()))


def test_the_fit_finds_a_steps_cost_apart_from_its_cost_per_row_only_from_calls_of_two_widths():
    narrow = [measured(1, 480, 32), measured(1, 128, 21), measured(2, 93, 32), measured(2, 49, 12)]
    assert fit(narrow + [measured(1, 55, 7)]) is not None
    assert fit([measured(1, n, 32) for n in (40, 60, 80, 100)]) is None  # one width: the per-row cost is unseen
    assert fit(narrow[:3]) is None  # too few
    a, b, c, d, e = fit(narrow + [measured(12, 40, 32)])
    assert (a, b, c, d, e) == pytest.approx((SLOT, STEP, ROW_STEP, 0.0, 0.0), abs=1e-6)


def test_a_step_reads_every_prompt_slot_again_and_the_fit_prices_it():
    """A user's commit messages on SmolLM2 (transformers, the 2-core EPYC, session 27): the answers' probe's calls
    at the job's cap of 40 and the trial's at 32 (prefill calls among them: 1 step), then the run's 9 calls of 4
    to 14 rows of prompts up to 257 tokens, 29.4 s. A fit without a term for the input slots' steps put a slot
    at its prefill's cost and the run at -15%; with it, within 5%."""
    measured_first = shaped([(2, 470, 40, 1.88), (2, 408, 40, 1.80), (1, 181, 25, 0.92), (2, 308, 40, 1.61),
                            (4, 524, 40, 1.89), (3, 336, 40, 1.62), (2, 200, 36, 1.36), (2, 470, 1, 0.35),
                            (1, 286, 40, 1.49), (2, 408, 32, 1.42), (1, 181, 25, 0.89), (1, 144, 32, 1.06),
                            (3, 387, 32, 1.43), (3, 336, 32, 1.37), (2, 200, 32, 1.23), (12, 1104, 32, 2.38),
                            (2, 408, 1, 0.29)])
    run = shaped([(5, 1285, 40, 3.40), (7, 1582, 40, 3.61), (8, 1568, 40, 3.41), (13, 2132, 40, 4.60),
                 (5, 730, 40, 2.30), (13, 1703, 40, 3.66), (10, 1160, 40, 2.84), (14, 1456, 40, 3.65),
                 (4, 368, 40, 1.96)])
    coefficients = fit(measured_first)
    assert coefficients[4] > 0  # the input slots' steps
    assert planned(coefficients, run) == pytest.approx(sum(c.seconds for c in run), rel=0.05)


def test_a_steps_rows_are_priced_by_their_count_or_by_their_slots_as_the_held_out_error_prefers():
    """The same commit messages a round later (session 28): the probe's and trial's 17 calls, then the run's 9.
    With a row's step forced in beside the prefill call, the fit left out the input slots' steps and put the
    run's calls of more slots than any measured one (1,285-1,582 against 1,104) at 0.85-0.88x; the slots'
    steps in place of a row's step put them within 5%. (The run's 13-row call of 2,132 slots ran at twice
    its neighbours' pace a step, 7.07 s: no fit of these calls foresees it, so it is left out here.)"""
    measured_first = shaped([(2, 408, 32, 1.52), (1, 181, 25, 0.97), (1, 144, 32, 1.13), (3, 387, 32, 1.61),
                            (3, 336, 32, 1.50), (2, 200, 32, 1.35), (12, 1104, 32, 2.42), (2, 408, 1, 0.33),
                            (2, 470, 40, 1.86), (2, 408, 40, 1.75), (1, 181, 25, 0.92), (2, 308, 40, 1.70),
                            (4, 524, 40, 2.08), (3, 336, 40, 1.90), (2, 200, 36, 1.62), (2, 470, 1, 0.39),
                            (1, 286, 40, 1.49)])
    run = shaped([(5, 1285, 40, 3.04), (7, 1582, 40, 3.35), (8, 1568, 40, 3.39), (5, 730, 40, 2.19),
                 (13, 1703, 40, 3.71), (10, 1160, 40, 2.70), (14, 1456, 40, 3.34), (4, 368, 40, 1.77)])
    coefficients = fit(measured_first)
    assert coefficients[4] > 0 and coefficients[0] > 0  # the input slots' steps, and a prompt's prefill
    for call in run[:3]:  # the most slots
        assert planned(coefficients, [call]) == pytest.approx(call.seconds, rel=0.05)
    assert planned(coefficients, run) == pytest.approx(sum(c.seconds for c in run), rel=0.05)


def test_a_call_that_stalled_is_left_out_of_the_fit():
    """Session 28's round of the commit messages: the probe's and trial's 17 calls and the run's 9, stored for the
    next prediction. One of the run's calls, 13 rows of 2,132 slots, ran 7.07 s (176.7 ms a step where its
    neighbours ran 84-93): kept in, least squares put session 27's run of the same job (29.43 s) at 31.6 s; left
    out (STALLED), at what the calls without it fit."""
    measured_first = shaped([(2, 408, 32, 1.52), (1, 181, 25, 0.97), (1, 144, 32, 1.13), (3, 387, 32, 1.61),
                            (3, 336, 32, 1.50), (2, 200, 32, 1.35), (12, 1104, 32, 2.42), (2, 408, 1, 0.33),
                            (2, 470, 40, 1.86), (2, 408, 40, 1.75), (1, 181, 25, 0.92), (2, 308, 40, 1.70),
                            (4, 524, 40, 2.08), (3, 336, 40, 1.90), (2, 200, 36, 1.62), (2, 470, 1, 0.39),
                            (1, 286, 40, 1.49)])
    stalled = shaped([(13, 2132, 40, 7.07)])
    run = shaped([(5, 1285, 40, 3.04), (7, 1582, 40, 3.35), (8, 1568, 40, 3.39), (5, 730, 40, 2.19),
                 (13, 1703, 40, 3.71), (10, 1160, 40, 2.70), (14, 1456, 40, 3.34), (4, 368, 40, 1.77)])
    earlier_run = shaped([(5, 1285, 40, 3.40), (7, 1582, 40, 3.61), (8, 1568, 40, 3.41), (13, 2132, 40, 4.60),
                         (5, 730, 40, 2.30), (13, 1703, 40, 3.66), (10, 1160, 40, 2.84), (14, 1456, 40, 3.65),
                         (4, 368, 40, 1.96)])
    coefficients, left_out = call_costs.fit_stalled(measured_first + run + stalled)
    assert left_out == 1
    assert coefficients == pytest.approx(fit(measured_first + run))
    assert planned(coefficients, earlier_run) == pytest.approx(sum(c.seconds for c in earlier_run), rel=0.07)
    assert planned(coefficients, stalled) < stalled[0].seconds / call_costs.STALLED
    # calls that did not stall stay, the slowest of them (a probe's on MKL, at 1.43x) too
    probe = shaped([(1, 314, 48, 2.27), (1, 240, 48, 2.18), (2, 364, 48, 3.6), (1, 115, 35, 1.53), (1, 102, 45, 1.91),
                    (4, 320, 48, 3.34), (7, 490, 40, 3.99), (13, 806, 48, 4.74), (1, 55, 8, 0.45), (2, 810, 1, 1.12)])
    assert fit(probe) == call_costs._fit(probe)
    assert fit(measured_first + run) == call_costs._fit(measured_first + run)


def test_answers_cut_at_the_trials_cap_run_to_the_jobs_and_a_wider_call_waits_for_its_longest():
    assert answer_lengths([7, 20, 32, 32], trial_cap=32, job_cap=64) == [7, 20, 64, 64]
    assert answer_lengths([7, 20, 32], trial_cap=32, job_cap=16) == [7, 16, 16]
    answers = AnswerDraws([8, 16, 32, 64])  # drawn alike for every row: no prompts' lengths kept

    def expected_longest(rows: int) -> float:
        return answers.longest([1] * rows)

    assert expected_longest(1) == pytest.approx(30.0)  # one row: the mean answer
    assert expected_longest(2) < expected_longest(8) < 64
    assert expected_longest(200) == pytest.approx(64.0)


def test_a_prefill_call_keeps_the_prompts_cost_in_the_fit():
    """A probe's calls on a docstring corpus (SmolLM2 on transformers, the 2-core EPYC, session 23): nine calls
    of 1 to 13 rows and its prefill call (2 rows of 405 tokens, one token each). The nine alone put a row's
    step's cost on the prompts' tokens (4.5 ms a slot, nothing a row's step), and a call of one 972-token
    prompt, 48 steps (3.47 s run), at 5.8 s; with the prefill call both terms are in, as measured."""
    probe = [(1, 314, 48, 2.27), (1, 240, 48, 2.18), (2, 364, 48, 3.6), (1, 115, 35, 1.53), (1, 102, 45, 1.91),
             (4, 320, 48, 3.34), (7, 490, 40, 3.99), (13, 806, 48, 4.74), (1, 55, 8, 0.45)]
    calls = shaped(probe)
    prefill = CallCost(rows=2, input_slots=810, steps=1, output_slots=2, seconds=1.12)
    long_prompt = CallCost(rows=1, input_slots=972, steps=48, output_slots=48, seconds=3.47)

    without = fit(calls)
    assert without[2] == 0.0 and planned(without, [long_prompt]) > 5.0
    kept = fit(calls + [prefill])
    assert kept[0] > 0.001 and kept[2] > 0.001 and abs(planned(kept, [long_prompt]) - long_prompt.seconds) < 0.35
    assert abs(planned(kept, [prefill]) - prefill.seconds) < 0.25


def test_a_rows_answer_is_drawn_from_the_answers_of_prompts_of_its_length():
    """The held-out README paragraphs' shape (bench/PREDICTION.md, run 23): short prompts answered short, the
    longest ran to the cap, and the longest prompts run one to a call. Drawn blind, a one-row call of a long
    prompt is planned at the mean answer; drawn by length, near the cap."""
    inputs = [50, 55, 60, 65, 70, 80, 90, 100, 400, 450, 600, 900]
    answers = [10, 20, 12, 18, 25, 15, 22, 30, 64, 64, 64, 64]
    blind, by_length = AnswerDraws(answers), AnswerDraws(answers, inputs)
    assert blind.longest([700]) == pytest.approx(sum(answers) / len(answers))
    ordered = sorted(answers)  # the expected maximum of 5 draws with replacement, in closed form
    closed = sum(v * (((i + 1) / 12) ** 5 - (i / 12) ** 5) for i, v in enumerate(ordered))
    assert blind.longest([1] * 5) == pytest.approx(closed)
    assert by_length.longest([700]) > 60 and by_length.mean(700) > 60
    assert by_length.longest([60]) < 25 and by_length.mean(60) < 25
    assert by_length.longest([60, 700]) > by_length.longest([700]) - 1e-9  # a wider call waits for its longest
    assert 0 < by_length.mean(10 ** 9) <= 64 and 0 < by_length.mean(1) <= 64  # far from every prompt: the nearest
    assert AnswerDraws(answers, inputs[:-1]).longest([700]) == pytest.approx(blind.longest([700]))  # not paired
    spec = JobSpec.model_validate({"input": "x", "mode": "generate", "model": {"name": "SmolLM2-135M-Instruct"},
                                   "generation": {"max_tokens": 64}})
    coefficients = [SLOT, STEP, ROW_STEP, 0.0]

    def plan(shard):
        return plan_feed(shard, spec, "transformers")

    calls = plan(inputs)  # these rows themselves: each call's steps are its rows' longest answer
    exact = sum(max(answers[i] for i in call) for call in calls) / len(calls)
    _, _, blind_steps = job_seconds(coefficients, plan, inputs, 12, 1, True, answers, 256)
    _, planned_calls, steps = job_seconds(coefficients, plan, inputs, 12, 1, True, answers, 256, inputs)
    assert planned_calls == len(calls) and abs(steps - exact) < 0.5 * abs(blind_steps - exact)


def test_a_job_of_more_rows_costs_less_a_row_where_its_calls_are_wider():
    """The miss this model is there for: a trial's 12 rows cut into calls of 1 or 2 rows, a job's 48 into
    calls of up to 11; a step costs much the same for 1 row as for 11, so a job's rows cost less each than
    the trial's, as measured (bench/PREDICTION.md: one tokens/s from the trial predicted +47%)."""
    spec = JobSpec.model_validate({"input": "x", "mode": "generate", "model": {"name": "SmolLM2-135M-Instruct"},
                                   "generation": {"max_tokens": 32}})
    lengths = [480, 371, 165, 128, 114, 93, 83, 73, 64, 57, 50, 44]
    coefficients = [SLOT, STEP, ROW_STEP, 0.0]

    def plan(shard):
        return plan_feed(shard, spec, "transformers")

    answers = [32] * 12
    small, small_calls, _ = job_seconds(coefficients, plan, lengths, 12, 1, True, answers, 256)
    large, large_calls, steps = job_seconds(coefficients, plan, lengths, 48, 1, True, answers, 256)
    assert steps == pytest.approx(32.0)
    assert large_calls < 4 * small_calls  # rows of near lengths share calls
    assert large / 48 < 0.8 * small / 12
    # two shards of 48 rows are two of the same
    two, calls, _ = job_seconds(coefficients, plan, lengths, 96, 2, True, answers, 256)
    assert two == pytest.approx(2 * large) and calls == 2 * large_calls
    # an engine that does not pad: one call of the shard's rows, their real tokens
    unpadded, calls, _ = job_seconds(coefficients, lambda shard: plan_feed(shard, spec, "vllm"), lengths, 48, 1,
                                     False, [10] * 12, 256)
    assert calls == 1
    assert unpadded == pytest.approx(SLOT * 4 * sum(lengths) + STEP * 10 + ROW_STEP * 48 * 10, rel=0.05)
    # ... which runs at most max_num_seqs rows at once: 48 rows of 10-token answers, 8 at a time, take 60 steps
    waves, _, steps = job_seconds(coefficients, lambda shard: plan_feed(shard, spec, "vllm"), lengths, 48, 1,
                                  False, [10] * 12, 8)
    assert steps == pytest.approx(60.0) and waves > unpadded
    assert call_costs.call_shape(False, [40] * 48, 10, 480, concurrency=8).steps == 60
    assert call_costs.call_shape(True, [40] * 48, 10, 480, concurrency=8).steps == 10


def test_a_runs_calls_are_kept_by_model_and_engine_and_stored_for_the_next_prediction(tmp_path):
    job = JobSpec.model_validate({"input": "x", "mode": "generate", "model": {"name": "SmolLM2-135M-Instruct"}})
    candidate = job.model_copy(update={"model": job.model.model_copy(update={"quantization": "int8"})})
    call_costs.observe(job, "transformers", [measured(1, 40, 8)])
    call_costs.observe(candidate, "transformers", [measured(2, 40, 8)])  # a gate's candidate: another model
    assert [c.rows for c in call_costs.take(job, "transformers")] == [1]
    assert call_costs.take(job, "transformers") == []
    assert [c.rows for c in call_costs.take(candidate, "transformers")] == [2]
    call_costs.observe(job, "transformers", [measured(1, 40, 8)])  # a job that never stored its calls
    call_costs.forget()  # the next job starts
    assert call_costs.take(job, "transformers") == []
    call_costs.remember_calls(tmp_path, "k", [measured(1, 40, 8)] * 3)
    call_costs.remember_calls(tmp_path, "k", [measured(3, 40, 8)] * (call_costs.KEEP_CALLS - 1))
    kept = call_costs.read_calls(tmp_path, "k")
    assert len(kept) == call_costs.KEEP_CALLS and kept[0].rows == 1 and kept[-1].rows == 3
    assert call_costs.read_calls(tmp_path, "other") == []
