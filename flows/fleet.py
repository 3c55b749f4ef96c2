"""dispatch: pool. The batch flow fans its unfinished shards out to the shard-worker
deployment, one balanced work list per GPU worker, and waits on the runs.

Prefect does the fleet's work: `run_deployment` launches, the work pool's workers place the
runs on machines, the API says how each ended, a global concurrency limit caps the GPUs,
and the persisted shard results say what is done. This module only reads states and
launches again what `tokenmill.dispatch.DispatchLedger` says to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_client, get_run_logger
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterName,
)
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.filesystems import LocalFileSystem, WritableFileSystem
from prefect.results import ResultStore
from prefect.runtime import flow_run as runtime_flow_run
from prefect.states import Cancelled, Cancelling

from tokenmill.dispatch import (
    DispatchLedger,
    Launch,
    WorkerRun,
    describe_runs,
    estimated_tokens,
    fleet_metrics,
    worker_rows,
)
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.results import ShardResult, shard_cache_key
from tokenmill.shards import ShardSpec
from tokenmill.tasks.job import FleetSpec, PrefectJob
from tokenmill.tasks.shards import write_shard_list_task


class FleetIncomplete(TokenmillError):
    """Shards were still unfinished when the dispatch rounds ran out."""


@dataclass
class FleetOutcome:
    results: list[ShardResult]
    cached: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    workers: list[dict[str, Any]] = field(default_factory=list)


def dispatch_to_pool(spec: PrefectJob, shards: list[ShardSpec], storage: Path | WritableFileSystem) -> FleetOutcome:
    """Run every unfinished shard on the fleet; return every shard's persisted result."""
    logger = get_run_logger()
    fleet = spec.fleet
    store = result_store(storage)
    keys = {s.shard_id: shard_cache_key(s, spec) for s in shards}
    already = {sid for sid, key in keys.items() if store.exists(key)}
    pending = [s for s in shards if s.shard_id not in already]
    ledger = DispatchLedger({s.shard_id: max(estimated_tokens(s), 1.0) for s in pending}, fleet.workers,
                            fleet.max_rounds, fleet.straggler_seconds, fleet.straggler_factor,
                            fleet.start_timeout_seconds)
    logger.info("%d shards already finished; %d to dispatch to %s", len(already), len(pending), fleet.deployment)
    if pending:
        shard_list = write_shard_list_task(spec, shards)
        with get_client(sync_client=True) as client:
            try:
                client.read_deployment_by_name(fleet.deployment)
            except ObjectNotFound:
                raise ConfigError(f"fleet.deployment {fleet.deployment!r} is not deployed on the Prefect API at "
                                  f"{client.api_url}: run `prefect deploy --all --prefect-file "
                                  f"deployments/prefect.yaml` there (README, Fleet)") from None
            ensure_concurrency_limit(client, fleet)
            _run_fleet(spec, ledger, store, keys, shard_list, client, logger)
    if not ledger.done:
        raise FleetIncomplete(
            f"{len(ledger.missing())} shards unfinished after {ledger.rounds} dispatch rounds "
            f"(max_rounds={fleet.max_rounds}): {', '.join(ledger.missing()[:5])}"
            f"{', ...' if len(ledger.missing()) > 5 else ''}. Worker runs: "
            f"{describe_runs([r for r in ledger.runs.values() if r.state != 'COMPLETED'])}")
    results = [store.read(keys[s.shard_id]).result for s in shards]
    rows = worker_rows(list(ledger.runs.values()), results, set(ledger.weights))
    return FleetOutcome(results, sorted(already), fleet_metrics(ledger, rows) if ledger.runs else {}, rows)


def _run_fleet(spec: PrefectJob, ledger: DispatchLedger, store: ResultStore, keys: dict[str, str],
               shard_list: str, client, logger) -> None:
    fleet = spec.fleet
    parent = runtime_flow_run.name or "tokenmill"
    attempt = f"{runtime_flow_run.id}:{runtime_flow_run.run_count}"  # a retried parent launches anew

    def launch(item: Launch) -> WorkerRun:
        name = f"{parent}-r{item.round}-w{len(ledger.runs)}{'-copy' if item.speculative else ''}"
        # Prefect's client sends a create again when the API does not answer in time (a SQLite server
        # holding its write lock for a minute did: two worker runs of one name ran the same shards); with
        # this key the server hands back the run the first request made instead of making a second
        flow_run = run_deployment(
            fleet.deployment,
            parameters={"spec": spec.model_dump(mode="json"), "shard_ids": item.shard_ids,
                        "shard_list": shard_list},
            flow_run_name=name, timeout=0, job_variables=fleet.job_variables or None,
            tags=["tokenmill", "shard-worker"], as_subflow=True, idempotency_key=f"{attempt}:{name}",
        )
        run = ledger.launched(item, str(flow_run.id), name, time.monotonic())
        tokens = sum(ledger.weights[s] for s in item.shard_ids)
        logger.info("launched %s: %d shards, ~%.0f tokens%s", name, len(item.shard_ids), tokens,
                    f" (speculative copy of {ledger.runs[item.replaces].name})" if item.speculative else
                    f" (re-dispatch of {ledger.runs[item.replaces].name})" if item.replaces else "")
        return run

    def finished(shard_ids: list[str]) -> list[str]:
        return [s for s in shard_ids if store.exists(keys[s])]

    for item in ledger.first_launches():
        launch(item)
    while not ledger.done and ledger.live_runs:
        time.sleep(fleet.poll_seconds)
        now = time.monotonic()
        for run in ledger.live_runs:
            flow_run = client.read_flow_run(run.run_id)
            state = flow_run.state
            if state is None:
                continue
            if state.is_running():
                ledger.seen_running(run.run_id, now)
                if run.working_at is None and _has_begun_a_shard(client, run.run_id):
                    ledger.seen_working(run.run_id, now)
            if not state.is_final():
                continue
            ledger.mark_finished(finished(run.shard_ids))
            run.seconds = flow_run.total_run_time.total_seconds()
            again = ledger.run_ended(run.run_id, state.type.value, now, state.message or "")
            if state.type.value != "COMPLETED" and run.run_id not in ledger.cancelled:
                logger.warning("%s ended %s (%s): %d of its %d shards unfinished", run.name, state.name,
                               state.message or "no message", len(ledger.unfinished(run)), len(run.shard_ids))
            for item in again:
                launch(item)
        for run in ledger.stragglers(now):
            ledger.mark_finished(finished(ledger.unfinished(run)))
            copy = ledger.speculative_copy(run)
            if copy is not None:
                logger.warning("%s is past the straggler deadline (%.0f s): copying its %d unfinished shards",
                               run.name, ledger.straggler_deadline() or 0, len(copy.shard_ids))
                launch(copy)
        for run in ledger.redundant():
            cancel_run(client, run, ledger, "every shard it holds finished in another run")
        for run in ledger.never_started(now):
            logger.warning("%s has not started %.0f s after its launch: cancelling it, its shards go to the "
                           "next round", run.name, now - run.launched_at)
            cancel_run(client, run, ledger, "it never started", redundant=False)
    for run in ledger.live_runs:  # copies still racing on shards already written
        cancel_run(client, run, ledger, "the job's shards are all finished")


def _has_begun_a_shard(client, flow_run_id: str) -> bool:
    """Whether the worker run holds its GPU slot: its shard tasks start only inside it."""
    tasks = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="shard ")), limit=1)
    return bool(tasks)


def cancel_run(client, run: WorkerRun, ledger: DispatchLedger, reason: str, redundant: bool = True) -> None:
    """Stop a run. A redundant one is not counted lost; one that never started is, and its
    shards are launched again when the orchestrator sees it Cancelled."""
    if run.run_id in ledger.cancelled or run.run_id in ledger.abandoned:
        return
    (ledger.cancelled if redundant else ledger.abandoned).add(run.run_id)
    state = client.read_flow_run(run.run_id).state
    if state is None or state.is_final():
        return
    # A run not yet on a machine has nothing to stop; a running one is stopped by its worker.
    message = f"{'redundant' if redundant else 'abandoned'}: {reason}"
    new_state = Cancelling(message=message) if state.is_running() else Cancelled(message=message)
    client.set_flow_run_state(run.run_id, new_state, force=True)
    get_run_logger().info("cancelling %s: %s", run.name, reason)


def ensure_concurrency_limit(client, fleet: FleetSpec) -> None:
    """The fleet's cap exists before any worker asks for a slot (an existing one is left as set)."""
    try:
        client.read_global_concurrency_limit_by_name(fleet.concurrency_limit)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=fleet.concurrency_limit, limit=fleet.concurrency_slots))
            get_run_logger().info("created global concurrency limit %r with %d slots", fleet.concurrency_limit,
                                  fleet.concurrency_slots)
        except ObjectAlreadyExists:
            pass


def result_store(storage: Path | WritableFileSystem) -> ResultStore:
    block = LocalFileSystem(basepath=str(storage)) if isinstance(storage, Path) else storage
    return ResultStore(result_storage=block)
