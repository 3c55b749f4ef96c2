"""The job's `server` section (engine openai-server: tokenmill as a client of an OpenAI-compatible server
someone else runs) and `stop_by` (the wall-clock time a backfill stops before).

A leaf: spec imports it. The engine that reads it is tokenmill.server_engine; the cap and the yield
it decides with are tokenmill.server_control.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# vLLM admits a smaller `priority` first (vllm/v1/core/sched/request_queue.py); live traffic sends none
# (0), so the batch's default is the largest value a 32-bit field holds: behind everything else.
LEAST_URGENT_PRIORITY = 2**31 - 1
TIME_OF_DAY = re.compile(r"^(\d{1,2}):(\d{2})$")


class ServerSpec(BaseModel):
    """engine openai-server: the OpenAI-compatible server the job's rows are sent to, how the job shares it
    with live traffic (priority, a cap from the live SLO, backing off as live load rises), and its retries."""

    model_config = ConfigDict(title="Server", extra="forbid", protected_namespaces=())

    url: str = Field(..., title="URL", description="The server's OpenAI API base URL, e.g. http://gpu-1:8000/v1 "
                     "(a URL without /v1 gets it). Its /metrics (vLLM's Prometheus) is read beside it.")
    model: str | None = Field(None, description="The model name the server serves (as its /v1/models lists "
                              "it). Empty: the job's model.name. The job tokenizes with model.name's tokenizer "
                              "(a local path or a built-in alias) and sends token ids.")
    api_key_env: str | None = Field(None, title="API Key Env", description="Environment variable holding the "
                                    "API key (run through Prefect, server_key_block can fill it). Empty: no key. "
                                    "The key is never logged nor recorded.")
    priority: Literal["auto", "on", "off"] = Field(
        "auto", description="vLLM's per-request `priority` (servers run with --scheduling-policy priority admit "
        "the smaller value first). auto: read the server's policy (/server_info) or try a request with it, and "
        "send it where the server takes it; on: always send it; off: never. The run record says which ran.")
    priority_value: int = Field(LEAST_URGENT_PRIORITY, description="The batch's priority: the least urgent "
                                "value by default, so every live request (priority 0) goes first.")
    slo_ms: float = Field(1000.0, gt=0, title="SLO (ms)", description="The live traffic's latency budget "
                          "(time to first token), in milliseconds.")
    share: float = Field(0.4, gt=0, le=1, description="The share of slo_ms one batch step may hold the server "
                         "for: the in-flight cap b is the largest with o + b*c <= share * slo_ms, o and c "
                         "measured by a short probe (a server step's fixed time, and its time per batch item in it).")
    max_in_flight: int | None = Field(None, ge=1, description="Most requests in flight, whatever the probe "
                                      "says. Empty: batching.max_batch_size.")
    probe: bool = Field(True, description="Measure o and c at the start (at most 124 short requests of the job's "
                        "first rows); false: the "
                        "cap is max_in_flight (or batching.max_batch_size).")
    metrics_poll_seconds: float = Field(
        1.0, gt=0, description="How often the server's /metrics is read (requests waiting and running, time "
        "to first token) to back off as live load rises (AIMD: +1 per quiet poll, halved while live requests "
        "stay queued or first tokens come later than (1 + share) x slo_ms). "
        "0 in-flight at worst: the batch yields entirely while live requests queue.")
    adapt: bool = Field(True, description="Back off and come back with live load (AIMD on /metrics); false: "
                        "hold the cap.")
    timeout_seconds: float = Field(600.0, gt=0, description="One request's limit.")
    max_retries: int = Field(6, ge=0, description="Retries of one request on 429, 503, a timeout or a refused "
                             "connection, with exponential backoff from 0.5 s, each logged; then the shard fails "
                             "(finished shards are kept; the next run resumes).")

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"server.url {value!r} must start with http:// or https://")
        return value if value.endswith("/v1") else f"{value}/v1"


def stop_by_deadline(stop_by: str | None, now: datetime | None = None) -> datetime | None:
    """The absolute time a job with `stop_by` must have stopped by: an ISO date-time (naive is UTC), or a
    time of day HH:MM (UTC), the next one after `now` (a nightly cron at 22:00 with stop_by 06:00 stops at
    the next morning's 06:00)."""
    if not stop_by:
        return None
    now = now or datetime.now(timezone.utc)
    match = TIME_OF_DAY.match(stop_by.strip())
    if match:
        hour, minute = int(match[1]), int(match[2])
        if hour > 23 or minute > 59:
            raise ValueError(f"stop_by {stop_by!r}: not a time of day (HH:MM, 00:00 to 23:59)")
        candidate = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        return candidate if candidate > now else candidate + timedelta(days=1)
    try:
        moment = datetime.fromisoformat(stop_by.strip())
    except ValueError:
        raise ValueError(f"stop_by {stop_by!r}: an ISO date-time (2026-11-26T06:00:00+00:00) or HH:MM (UTC)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def check_stop_by(value: str | None) -> str | None:
    """A job's stop_by, checked when the job is read (so a typo fails before any shard)."""
    if value is not None and value.strip():
        stop_by_deadline(value)
        return value.strip()
    return None
