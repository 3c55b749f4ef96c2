"""Fanning shards out to a fleet: work lists balanced by tokens, and the ledger that says
what to launch again when a worker run is preempted or straggles.

Plain Python with an injected clock. The orchestration layer does the launching, the waiting and the
slot-keeping (flows/fleet.py); this module only decides. A shard is finished when its
result is persisted, whoever wrote it: outputs are idempotent, so two copies of one shard
write the same file and the first to finish wins.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from tokenmill.digest import stable_digest
from tokenmill.errors import ConfigError
from tokenmill.outputs import STATE_DIR
from tokenmill.shards import ShardSpec

# What a billion-row corpus cannot do without: a token estimate before tokenizing.
# The factor is one per corpus, so it scales the estimate and leaves the balance alone.
BYTES_PER_TOKEN = 4.0


def estimated_tokens(shard: ShardSpec) -> float:
    return shard.data_bytes / BYTES_PER_TOKEN


def balance_by_tokens(weights: dict[str, float], workers: int) -> list[list[str]]:
    """One work list per worker: longest shard first onto the least loaded worker (LPT,
    within 4/3 of the best possible makespan). Empty lists are dropped."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    loads = [(0.0, index) for index in range(workers)]
    lists: list[list[str]] = [[] for _ in range(workers)]
    for shard_id in sorted(weights, key=lambda s: (-weights[s], s)):
        load, index = heapq.heappop(loads)
        lists[index].append(shard_id)
        heapq.heappush(loads, (load + weights[shard_id], index))
    return [work for work in lists if work]


@dataclass
class WorkerRun:
    """One launch of a shard worker."""

    run_id: str
    name: str
    shard_ids: list[str]
    round: int
    speculative: bool = False
    launched_at: float = 0.0
    started_at: float | None = None  # when it was first seen Running
    working_at: float | None = None  # when its first shard began: it holds a GPU slot
    ended_at: float | None = None
    state: str = "SCHEDULED"
    message: str = ""
    seconds: float | None = None  # the API's total run time, once it ended

    @property
    def live(self) -> bool:
        return self.ended_at is None


@dataclass
class Launch:
    """A work list to launch: a re-dispatch (round > 1) or a speculative copy."""

    shard_ids: list[str]
    round: int
    speculative: bool = False
    replaces: str | None = None  # the run it re-dispatches or shadows


@dataclass
class DispatchLedger:
    weights: dict[str, float]
    workers: int
    max_rounds: int = 3
    straggler_seconds: float | None = None
    straggler_factor: float = 1.5
    start_timeout: float | None = None
    runs: dict[str, WorkerRun] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    copied: set[str] = field(default_factory=set)  # shards already given a speculative copy
    given_up: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)  # runs stopped because others did their work
    abandoned: set[str] = field(default_factory=set)  # runs stopped because they never started

    def first_launches(self) -> list[Launch]:
        return [Launch(work, round=1) for work in balance_by_tokens(self.weights, self.workers)]

    def launched(self, launch: Launch, run_id: str, name: str, now: float) -> WorkerRun:
        run = WorkerRun(run_id, name, list(launch.shard_ids), launch.round, launch.speculative, launched_at=now)
        self.runs[run_id] = run
        return run

    def mark_finished(self, shard_ids: Iterable[str]) -> None:
        self.finished.update(s for s in shard_ids if s in self.weights)

    def unfinished(self, run: WorkerRun) -> list[str]:
        return [s for s in run.shard_ids if s not in self.finished]

    def seen_running(self, run_id: str, now: float) -> None:
        run = self.runs[run_id]
        if run.started_at is None:
            run.started_at = now

    def seen_working(self, run_id: str, now: float) -> None:
        run = self.runs[run_id]
        self.seen_running(run_id, now)
        if run.working_at is None:
            run.working_at = now

    def run_ended(self, run_id: str, state: str, now: float, message: str = "") -> list[Launch]:
        """Record a run's end (after `mark_finished` with what it persisted). A run that did not
        complete has its unfinished shards launched again, unless a live run still covers them
        or the rounds are spent."""
        run = self.runs[run_id]
        run.ended_at, run.state, run.message = now, state, message
        if run.started_at is None:
            run.started_at = now
        covered = {s for r in self.live_runs for s in r.shard_ids}
        left = [s for s in self.unfinished(run) if s not in covered]
        if not left:
            return []
        if run.round >= self.max_rounds:
            self.given_up.update(left)
            return []
        return [Launch(left, round=run.round + 1, replaces=run_id)]

    def straggler_deadline(self) -> float | None:
        if self.straggler_seconds is not None:
            return self.straggler_seconds
        done = [r.ended_at - (r.working_at if r.working_at is not None else r.started_at)
                for r in self.runs.values()
                if r.state == "COMPLETED" and r.ended_at is not None and r.started_at is not None]
        return self.straggler_factor * statistics.median(done) if done else None

    def stragglers(self, now: float) -> list[WorkerRun]:
        """Live runs working on shards for longer than the deadline that still hold uncopied,
        unfinished shards. The clock starts at the first shard, not at Running: time spent
        waiting for a GPU slot under the cap on GPUs is queueing, not straggling."""
        deadline = self.straggler_deadline()
        if deadline is None:
            return []
        return [r for r in self.runs.values()
                if r.live and r.working_at is not None and now - r.working_at > deadline and not r.speculative
                and any(s not in self.copied for s in self.unfinished(r))]

    def never_started(self, now: float) -> list[WorkerRun]:
        """Live runs still waiting for a machine past the start timeout."""
        if self.start_timeout is None:
            return []
        return [r for r in self.runs.values() if r.live and r.started_at is None
                and now - r.launched_at > self.start_timeout and r.run_id not in self.abandoned]

    def speculative_copy(self, run: WorkerRun) -> Launch | None:
        """The straggler's unfinished shards, in reverse: the copy starts where the original
        will get to last, so the two meet in the middle instead of racing on the same shard."""
        left = [s for s in self.unfinished(run) if s not in self.copied]
        if not left:
            return None
        self.copied.update(left)
        return Launch(list(reversed(left)), round=run.round, speculative=True, replaces=run.run_id)

    def redundant(self) -> list[WorkerRun]:
        """Live runs with nothing left to do: every shard they hold finished elsewhere."""
        return [r for r in self.runs.values() if r.live and not self.unfinished(r) and r.run_id not in self.cancelled]

    @property
    def done(self) -> bool:
        return self.finished >= set(self.weights)

    @property
    def live_runs(self) -> list[WorkerRun]:
        return [r for r in self.runs.values() if r.live]

    @property
    def rounds(self) -> int:
        return max((r.round for r in self.runs.values()), default=0)

    @property
    def speculative_copies(self) -> int:
        return sum(r.speculative for r in self.runs.values())

    def missing(self) -> list[str]:
        return sorted(set(self.weights) - self.finished)


def describe_runs(runs: Sequence[WorkerRun]) -> str:
    return "; ".join(f"{r.name} (round {r.round}{', copy' if r.speculative else ''}): {r.state}"
                     f"{' - ' + r.message if r.message else ''}" for r in runs)


def write_shard_list(store, shards: Sequence[ShardSpec]) -> str:
    """The orchestrator's view of the shards, for its workers to read instead of listing the
    corpus again. Named by its content, so concurrent jobs never overwrite each other's."""
    payload = [s.model_dump(mode="json") for s in shards]
    path = store.path(STATE_DIR, f"shards-{stable_digest(payload, 16)}.json")
    store.write_json(path, {"shards": payload})
    return path


def read_shard_list(store, uri: str) -> list[ShardSpec]:
    return [ShardSpec.model_validate(s) for s in store.read_json(uri)["shards"]]


def select_shards(shards: Sequence[ShardSpec], shard_ids: Sequence[str], source: str) -> list[ShardSpec]:
    """The shards named, in the order named; an unknown id is an error that lists them."""
    by_id = {s.shard_id: s for s in shards}
    unknown = [s for s in shard_ids if s not in by_id]
    if unknown:
        raise ConfigError(f"{len(unknown)} shard ids are not shards of {source}: {', '.join(unknown[:5])}"
                          f"{', ...' if len(unknown) > 5 else ''}")
    return [by_id[s] for s in shard_ids]


def worker_rows(runs: Sequence[WorkerRun], results: Sequence, dispatched: set[str]) -> list[dict]:
    """Per worker run: its fate, and the throughput of the shards whose persisted result it wrote."""
    by_worker: dict[str, list] = {}
    for result in results:
        if result.shard_id in dispatched:
            by_worker.setdefault(result.worker, []).append(result)
    rows = []
    for run in runs:
        mine = by_worker.get(run.name, [])
        tokens = sum(r.input_tokens + r.output_tokens for r in mine)
        seconds = sum(r.seconds for r in mine)
        rows.append({
            "worker": run.name, "state": run.state, "round": run.round, "speculative": run.speculative,
            "shards_assigned": len(run.shard_ids), "shards_written": len(mine),
            "rows": sum(r.rows_out for r in mine), "tokens": tokens,
            "shard_seconds": round(seconds, 2), "run_seconds": round(run_seconds(run), 2),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        })
    return rows


def run_seconds(run: WorkerRun) -> float:
    if run.seconds is not None:
        return run.seconds
    if run.ended_at is None or run.started_at is None:
        return 0.0
    return max(run.ended_at - run.started_at, 0.0)


def fleet_metrics(ledger: DispatchLedger, rows: Sequence[dict]) -> dict[str, float]:
    lost = [r for r in ledger.runs.values()
            if r.state in ("CRASHED", "FAILED", "CANCELLED") and r.run_id not in ledger.cancelled]
    return {
        "dispatch_rounds": float(ledger.rounds),
        "speculative_copies": float(ledger.speculative_copies),
        "worker_runs": float(len(ledger.runs)),
        "worker_runs_lost": float(len(lost)),
        "worker_seconds": float(sum(run_seconds(r) for r in ledger.runs.values())),
        **worker_summary_metrics(rows),
    }


def worker_summary_metrics(rows: Sequence[dict]) -> dict[str, float]:
    """Worker throughput under fixed metric names (min, median, max over the runs that wrote a
    shard); the per-run figures go to the workers table, not to a metric name per run."""
    rates = [float(row["tokens_per_s"]) for row in rows if row["shard_seconds"] > 0]
    if not rates:
        return {}
    return {"worker_tokens_per_s_min": min(rates), "worker_tokens_per_s_median": statistics.median(rates),
            "worker_tokens_per_s_max": max(rates)}

