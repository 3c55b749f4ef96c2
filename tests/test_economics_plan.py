"""Calibration fits, plateau and cliff detection, and the fleet plan's arithmetic."""

import pytest

from tokenmill.calibrate import find_cliff, find_plateau, fit_call_time
from tokenmill.planning import FleetPlan


def test_the_fit_recovers_known_overhead_and_per_item_cost():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    overhead, per_item = 0.012, 0.0009
    wobble = [1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99]  # measurement noise, +-2%
    times = [(overhead + per_item * b) * w for b, w in zip(sizes, wobble)]
    fit = fit_call_time(sizes, times)
    assert fit.overhead == pytest.approx(overhead, rel=0.1)
    assert fit.per_item == pytest.approx(per_item, rel=0.03)
    assert fit.r2 > 0.99
    # the overhead is recovered even when large batches' times dwarf it
    spread = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    skewed = fit_call_time(spread, [(0.004 + 0.012 * b) * (1.03 if b % 2 else 0.99) for b in spread])
    assert skewed.overhead == pytest.approx(0.004, rel=0.35) and skewed.per_item == pytest.approx(0.012, rel=0.03)
    exact = fit_call_time([1, 4, 16], [overhead + per_item * b for b in (1, 4, 16)])
    assert (exact.overhead, exact.per_item, exact.r2) == pytest.approx((overhead, per_item, 1.0))


def test_plateau_is_the_smallest_size_beyond_which_doubling_gains_under_5_percent():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # items/s = b / (o + c b) with o = 0.01, c = 0.001, saturating towards 1000/s:
    # 64 -> 128 gains 7.2%, 128 -> 256 gains 3.7%
    rates = [b / (0.01 + 0.001 * b) for b in sizes]
    assert find_plateau(sizes, rates) == 128
    assert find_plateau([1, 2, 4], [10, 20, 40]) == 4  # still growing: the largest measured
    # measured on CPU (vLLM, MiniLM): a flat step at 8 -> 16 is noise; 32 is where it levels off
    cpu = {1: 4741, 2: 5531, 4: 6349, 8: 6968, 16: 6940, 32: 7348, 64: 7391, 128: 7255, 256: 6911}
    assert find_plateau(list(cpu), list(cpu.values())) == 32


def test_cliff_is_where_memory_runs_out_or_throughput_falls():
    sizes = [1, 2, 4, 8, 16]
    assert find_cliff(sizes, [10, 19, 30, 31, 20]) == (16, "throughput falls to 20 tokens/s from 31")
    assert find_cliff(sizes[:4], [10, 19, 30, 31], {16: "CUDA out of memory"}) == (
        16, "out of memory or failed: CUDA out of memory")
    assert find_cliff(sizes, [10, 19, 30, 31, 31.5]) == (None, "")


def test_plan_for_a_billion_documents_in_twelve_hours():
    """The seed case, worked by hand.

    Corpus: 1e9 documents x 250 tokens = 2.5e11 tokens. One GPU does 50,000 tokens/s.
    Shards of 5,000 rows: 1.25e6 tokens, 1.25e6 / 5e4 = 25 s = 0.0069444 h on one GPU.
    Preemption: 0.05 per GPU-hour, each losing half a shard (0.0034722 h) plus an engine
    start of 60 s (0.0166667 h) = 0.0201389 h. Share of time lost: 0.05 x 0.0201389 =
    0.00100694, so the effective rate is 50,000 x 0.99899306 = 49,949.65 tokens/s.
    Work: 2.5e11 / 49,949.65 / 3600 = 1,390.2899 GPU-hours.
    Usable window: 12 h / 1.1 (10% straggler margin) - 0.0069444 h (the last shard's
    tail) = 10.9021465 h. GPUs: 1,390.2899 / 10.9021465 = 127.52 -> 128.
    Finish: 1,390.2899 / 128 + 0.0069444 = 10.8685 h.
    Spot at $0.30/GPU-hour: 128 x 10.8685 x 0.30 = $417.35, or $0.0016694 per 1M tokens.
    On-demand at $0.80, no preemptions: (2.5e11 / 5e4 / 3600 / 128 + 0.0069444) x 128 x 0.80
    = (10.850694 + 0.006944) x 102.4 = $1,111.82.
    Expected preemptions: 0.05 x 128 x 10.8685 = 69.56, costing 69.56 x 0.0201389 = 1.4008
    GPU-hours of re-work.
    """
    plan = FleetPlan(total_tokens=2.5e11, tokens_per_s_per_gpu=50_000, window_hours=12, straggler_margin=0.1,
                     preemptions_per_gpu_hour=0.05, largest_shard_tokens=1.25e6, engine_start_seconds=60,
                     usd_per_gpu_hour_spot=0.30, usd_per_gpu_hour_on_demand=0.80)
    assert plan.shard_hours == pytest.approx(0.0069444, rel=1e-4)
    assert plan.effective_tokens_per_s_per_gpu == pytest.approx(49_949.65, rel=1e-6)
    assert plan.gpu_hours_of_work == pytest.approx(1_390.2899, rel=1e-5)
    assert plan.usable_hours == pytest.approx(10.9021465, rel=1e-6)
    assert plan.gpus == 128
    assert plan.finish_hours() == pytest.approx(10.8685, rel=1e-4)
    assert plan.usd_spot() == pytest.approx(417.35, rel=1e-4)
    assert plan.usd_per_1m_tokens() == pytest.approx(0.0016694, rel=1e-3)
    assert plan.usd_on_demand() == pytest.approx(1_111.82, rel=1e-4)
    assert plan.expected_preemptions == pytest.approx(69.56, rel=1e-3)
    assert plan.rework_gpu_hours == pytest.approx(1.4008, rel=1e-3)

    rows = {row["gpus"]: row for row in plan.alternatives()}
    assert rows[127]["misses_window_by_hours"] == 0 and rows[64]["misses_window_by_hours"] > 9
    assert rows[64]["finish_hours"] == pytest.approx(1_390.2899 / 64 + 0.0069444, rel=1e-4)
    assert rows[160]["idle_gpu_hours"] > rows[128]["idle_gpu_hours"] and rows[160]["usd_vs_plan"] > 0
