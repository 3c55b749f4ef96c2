"""The sharing maths of engine openai-server, without a server: the cost fit, the cap from the SLO, the AIMD
window, the Prometheus read, stop_by and the spec's checks."""

from datetime import datetime, timezone

import pytest

from tokenmill.server_control import Aimd, CallCost, ServerLoad, cap_from_slo, fit_call_cost, parse_load, recent_ttft
from tokenmill.server_engine import completion_body, metrics_url
from tokenmill.server_spec import ServerSpec, stop_by_deadline
from tokenmill.spec import JobSpec


def test_the_fit_recovers_overhead_and_per_item_cost():
    cost = fit_call_cost([(1, 0.030), (2, 0.040), (4, 0.060), (8, 0.100)])
    assert cost.overhead_s == pytest.approx(0.020)
    assert cost.per_item_s == pytest.approx(0.010)
    with pytest.raises(ValueError):
        fit_call_cost([(4, 0.1), (4, 0.2)])


def test_a_flat_or_falling_probe_charges_each_item_its_whole_round():
    # a probe on a busy server: bigger rounds no slower. c = 0 would open the cap to the ceiling
    cost = fit_call_cost([(1, 0.05), (2, 0.04), (4, 0.03)])
    assert cost.overhead_s == 0.0 and cost.per_item_s == pytest.approx(0.0075)  # 30 ms / 4 items
    assert cap_from_slo(cost, slo_ms=100, share=0.4, ceiling=256) == 5
    flat = fit_call_cost([(1, 0.09), (2, 0.09), (4, 0.09), (8, 0.09)])
    assert cap_from_slo(flat, slo_ms=500, share=0.4, ceiling=256) == 17  # 200 ms / (90 / 8 ms)


def test_the_cap_is_the_largest_batch_within_share_of_the_slo():
    cost = CallCost(overhead_s=0.020, per_item_s=0.010)
    # 0.4 x 1000 ms = 400 ms: 20 + b x 10 <= 400 -> b = 38
    assert cap_from_slo(cost, slo_ms=1000, share=0.4, ceiling=256) == 38
    assert 0.020 + 38 * 0.010 <= 0.4 and 0.020 + 39 * 0.010 > 0.4
    assert cap_from_slo(cost, slo_ms=1000, share=0.4, ceiling=16) == 16  # never above the ceiling
    assert cap_from_slo(CallCost(0.5, 0.01), slo_ms=1000, share=0.4, ceiling=256) == 1  # over budget: one at a time
    assert cap_from_slo(CallCost(0.01, 0.0), slo_ms=1000, share=0.4, ceiling=64) == 64


def test_aimd_halves_under_live_pressure_and_climbs_back_one_by_one():
    aimd = Aimd(cap=8, slo_s=1.0)
    busy = ServerLoad(waiting=3, running=10)  # 8 of ours running, live requests queue
    assert aimd.update(busy, ours=8, ttft=None, elapsed_s=1) == 8  # one read of a queue: between two steps
    assert aimd.update(busy, ours=8, ttft=None, elapsed_s=1) == 4  # still queued at the next read
    assert aimd.update(busy, ours=4, ttft=None, elapsed_s=1) == 2
    assert aimd.update(busy, ours=2, ttft=None, elapsed_s=1) == 1
    assert aimd.update(busy, ours=1, ttft=None, elapsed_s=1) == 0  # yields entirely
    quiet = ServerLoad(waiting=0, running=0)
    limits = [aimd.update(quiet, ours=0, ttft=None, elapsed_s=1) for _ in range(10)]
    assert limits == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8]  # never above the cap
    assert aimd.yielded_s == pytest.approx(11)  # seconds spent below the cap
    assert aimd.decreases == 4


def test_only_live_load_is_pressure():
    aimd = Aimd(cap=8, slo_s=0.5, share=0.4)
    # our own 8 running and 2 of ours waiting, twice: no live request, no pressure
    assert not aimd.pressure(ServerLoad(waiting=2, running=8), ours=10, ttft=None)
    assert not aimd.pressure(ServerLoad(waiting=2, running=8), ours=10, ttft=None)
    # live requests running, nothing queued, first tokens within the SLO and the wait the cap allows
    assert not aimd.pressure(ServerLoad(waiting=0, running=10), ours=8, ttft=0.69)
    # live requests, first tokens later than that
    assert aimd.pressure(ServerLoad(waiting=0, running=10), ours=8, ttft=0.71)


PROMETHEUS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2.5
vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_total{engine="0",model_name="m"} 30.0
"""


def test_the_load_is_read_from_prometheus_text():
    load = parse_load(PROMETHEUS)
    assert load == ServerLoad(waiting=2, running=3, ttft_sum=2.5, ttft_count=10, tokens=150)
    later = ServerLoad(waiting=0, running=0, ttft_sum=3.5, ttft_count=12)
    assert recent_ttft(load, later) == pytest.approx(0.5)
    assert recent_ttft(later, later) is None and recent_ttft(None, later) is None


def test_stop_by_is_a_moment_or_the_next_time_of_day():
    evening = datetime(2026, 11, 25, 22, 0, tzinfo=timezone.utc)
    assert stop_by_deadline("06:00", evening) == datetime(2026, 11, 26, 6, 0, tzinfo=timezone.utc)
    assert stop_by_deadline("23:30", evening) == datetime(2026, 11, 25, 23, 30, tzinfo=timezone.utc)
    assert stop_by_deadline("2026-11-26T05:00:00", evening) == datetime(2026, 11, 26, 5, tzinfo=timezone.utc)
    assert stop_by_deadline(None) is None
    with pytest.raises(ValueError, match="stop_by"):
        JobSpec(stop_by="25:00")


def test_the_server_spec():
    assert ServerSpec(url="http://h:8000/").url == "http://h:8000/v1"
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    with pytest.raises(ValueError, match="server section"):
        JobSpec(mode="generate", model={"engine": "openai-server"})
    with pytest.raises(ValueError, match="http"):
        ServerSpec(url="h:8000")


def test_sampling_goes_to_openai_fields_and_vllm_extras():
    body = completion_body([1, 2], {"max_tokens": 4, "temperature": 0.0, "top_k": 5, "seed": None, "logprobs": 2})
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 4 and body["logprobs"] == 2
    assert body["extra_body"] == {"top_k": 5, "return_tokens_as_token_ids": True}


def test_marginal_cost_when_the_gpus_are_sunk():
    from tokenmill.server_record import marginal_usd_per_1m

    metrics = {"input_tokens": 600_000.0, "output_tokens": 400_000.0, "wall_seconds": 7200.0}
    assert marginal_usd_per_1m(JobSpec(), metrics) is None  # rented: usd_per_1m_tokens is the marginal cost
    sunk = JobSpec(pricing={"sunk": True, "usd_per_gpu_hour_marginal": 0.05, "gpu_count": 2})
    assert marginal_usd_per_1m(sunk, metrics) == pytest.approx(2 * 2 * 0.05)  # 4 GPU-hours at $0.05 for 1M tokens
    assert marginal_usd_per_1m(JobSpec(pricing={"sunk": True}), metrics) == 0.0
