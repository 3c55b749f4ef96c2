"""Where a run's fixed seconds go: process start to the first engine call, in parts.

A batch job's cost is its steady throughput plus what it pays once per process: the
interpreter and imports, the orchestrator's API, the engine's start, the first shard's read
and tokenize. On a short job the fixed part decides the result, so it is measured and
recorded per run (metrics `fixed/*`), and reported apart from the steady tokens/s.

Marks are wall-clock times (time.time()) kept per process; the first mark of a name wins.
"""

from __future__ import annotations

import os
import time

_marks: dict[str, float] = {}
_MODULE_IMPORTED = time.time()
_first_job = True  # later jobs of a long-lived process (a worker, a notebook) start at their flow


def mark(name: str) -> None:
    if name not in _marks:
        _marks[name] = time.time()


def mark_at(name: str, when: float) -> None:
    """A mark another process took (its time.time()): the orchestrator API's server marks its own start's steps."""
    _marks.setdefault(name, when)


def marks() -> dict[str, float]:
    return dict(_marks)


def forget(*names: str) -> None:
    """Drop marks a step set that are not the job's own: an eval gate's engines mark their starts first,
    and the corpus's engine (when it starts one) is the job's engine start."""
    for name in names:
        _marks.pop(name, None)


def begin_job() -> None:
    """A job starts: it measures from the process's start only if it is the process's first job and
    was launched as a command (the CLI marked its way here); otherwise from its flow's start, with no
    marks left over from earlier work in the process (other flows, a gate, a failed job)."""
    global _first_job
    if not (_first_job and "flow_called" in _marks):
        _marks.clear()
        _first_job = False


def reset() -> None:
    """Forget every mark: the next job of this process measures its own, from its flow's start."""
    global _first_job
    _marks.clear()
    _first_job = False


def process_started() -> float:
    """When this process started (Linux /proc), else when this module was imported. Its start in clock
    ticks since boot against the boot clock now (CLOCK_BOOTTIME, the clock those ticks count on), not
    /proc/stat's btime: that boot time is whole seconds, so start times read from it were late or early by
    the same fraction of a second for every process of one boot (0.68 s on one host: every run's imports
    and wall read 0.68 s long, and a prediction from them was that much over a wall timed outside)."""
    try:
        with open("/proc/self/stat") as stat_file:
            fields = stat_file.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat; fields[0] is field 3
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since
    except (OSError, ValueError, IndexError, AttributeError):
        return _MODULE_IMPORTED


def measures_process() -> bool:
    """Whether this job's fixed seconds count from the process's start (its first job)."""
    return _first_job


# (metric, from mark, to mark): the parts of the fixed seconds; they may overlap (the engine
# starts while the orchestrator's API does)
PARTS = (
    ("fixed/interpreter_and_imports_seconds", "process", "cli_ready"),
    ("fixed/orchestrator_api_seconds", "api_start", "api_ready"),  # Prefect's ephemeral API, in the background
    ("fixed/orchestrator_api_startup_seconds", "api_startup_start", "api_startup_done"),  # its database made/checked
    ("fixed/flow_start_seconds", "flow_called", "flow_started"),  # the orchestrator records the job as started
    ("fixed/engine_start_seconds", "engine_start", "engine_ready"),
    ("fixed/engine_choice_seconds", "engine_choice_start", "engine_choice_done"),
    ("fixed/first_shard_prepare_seconds", "first_shard_started", "first_engine_call"),
)


def fixed_costs(now: float | None = None) -> dict[str, float]:
    """Seconds from process start to the first engine call, and its parts (those measured), and with `now`
    the process's seconds to now. A job with no engine call (every shard finished before) has its parts and
    process seconds, no fixed seconds; empty before its flow started."""
    origin = process_started() if _first_job else _marks.get("flow_started")
    if origin is None or not {"first_engine_call", "flow_called", "flow_started"} & set(_marks):
        return {}
    stamps = {"process": origin, **_marks}
    costs = {"fixed_seconds": stamps["first_engine_call"] - stamps["process"]} if "first_engine_call" in stamps else {}
    for metric, start, end in PARTS:
        if start in stamps and end in stamps and stamps[end] >= stamps[start]:
            costs[metric] = stamps[end] - stamps[start]
    if now is not None:
        costs["process_seconds"] = now - stamps["process"]
    return costs
