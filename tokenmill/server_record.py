"""What a job that shared a server leaves on record: the mode that ran (priority or not), the in-flight cap
and its inputs (o, c, SLO, share), the time yielded to live traffic, the throughput harvested, and $ per 1M
tokens at the marginal cost of GPUs already paid for.

Record layer: it reads the openai-server engine the job ran on from the process's registry.
"""

from __future__ import annotations

from tokenmill.engines import open_engines
from tokenmill.server_engine import ServerEngine
from tokenmill.spec import JobSpec


def marginal_usd_per_1m(spec: JobSpec, metrics: dict[str, float]) -> float | None:
    """$ per 1M tokens at the marginal rate when the GPUs are sunk (None: they are not; usd_per_1m_tokens
    is then the marginal cost too)."""
    if not spec.pricing.sunk:
        return None
    tokens = metrics.get("input_tokens", 0.0) + metrics.get("output_tokens", 0.0)
    hours = metrics.get("wall_seconds", 0.0) / 3600.0 * spec.pricing.gpu_count
    return hours * spec.pricing.usd_per_gpu_hour_marginal / tokens * 1e6 if tokens else 0.0


def sharing_record(spec: JobSpec, metrics: dict[str, float]) -> tuple[dict[str, str], dict[str, float], str]:
    """(params, metrics, summary lines) for the run: the server's figures where the job ran on one, and
    the marginal $/1M where the pricing says the GPUs are sunk."""
    params: dict[str, str] = {}
    figures: dict[str, float] = {}
    lines = ""
    marginal = marginal_usd_per_1m(spec, metrics)
    if marginal is not None:
        figures["usd_per_1m_tokens_marginal"] = marginal
        lines += f"- $ per 1M tokens at marginal cost (GPUs sunk): ${marginal:.4f}\n"
    engines = [e for e in open_engines() if isinstance(e, ServerEngine)
               and spec.server is not None and e.url == spec.server.url]
    if not engines:
        return params, figures, lines
    engine = max(engines, key=lambda e: e.stats.requests)  # the one the shards ran on
    params, server = engine.figures()
    figures.update(server)
    tokens = metrics.get("input_tokens", 0.0) + metrics.get("output_tokens", 0.0)
    if server["server_busy_seconds"] > 0:
        figures["server_tokens_per_s_harvested"] = tokens / server["server_busy_seconds"]
    cost = (f"o = {server['server_overhead_ms']:.1f} ms, c = {server['server_item_ms']:.2f} ms per item"
            if "server_overhead_ms" in server else "no probe")
    lines += (f"- server {params['server_url']} ({params['server_model']}), scheduling {params['server_scheduling']}: "
              f"in-flight cap {server['server_cap']:.0f} ({cost}; share {params['server_share']} x SLO "
              f"{params['server_slo_ms']} ms), {server['server_seconds_yielded']:.1f} s yielded to live load, "
              f"{server['server_requests_cut_off']:.0f} requests cut off and resent, "
              f"{server['server_retries']:.0f} retries\n")
    return params, figures, lines
