import pytest

from tokenmill.economics import RunCost


def test_cost_arithmetic_by_hand():
    """2 GPUs for 30 minutes = 1 GPU-hour; at $2/h spot and $5/h on demand that is $2 and $5.
    3.9M input + 0.1M output = 4M tokens, so $2 / 4M tokens = $0.50 per 1M tokens on spot."""
    cost = RunCost(rows=1000, input_tokens=3_900_000, output_tokens=100_000, wall_seconds=1800,
                   engine_seconds=1500, gpu_count=2, usd_per_gpu_hour_spot=2.0, usd_per_gpu_hour_on_demand=5.0)
    assert cost.gpu_hours == pytest.approx(1.0)
    assert cost.usd_spot == pytest.approx(2.0)
    assert cost.usd_on_demand == pytest.approx(5.0)
    assert cost.usd_per_1m_tokens == pytest.approx(0.5)
    assert cost.usd_per_1m_tokens_on_demand == pytest.approx(1.25)
    assert cost.tokens_per_s == pytest.approx(4_000_000 / 1800)
    assert cost.engine_tokens_per_s == pytest.approx(4_000_000 / 1500)
    assert cost.items_per_s == pytest.approx(1000 / 1800)
    metrics = cost.metrics()
    for name in ("gpu_hours", "usd_spot", "usd_on_demand", "usd_per_1m_tokens", "tokens_per_s", "items_per_s"):
        assert name in metrics


def test_no_tokens_costs_no_division_by_zero():
    cost = RunCost(rows=0, input_tokens=0, output_tokens=0, wall_seconds=0, engine_seconds=0,
                   gpu_count=1, usd_per_gpu_hour_spot=1, usd_per_gpu_hour_on_demand=2)
    assert cost.usd_per_1m_tokens == 0.0 and cost.tokens_per_s == 0.0
