"""`engine: auto` as a task: the engine chosen before the shards run, with its reason in the run's log."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from tokenmill.engine_choice import EngineChoice, choose_engine
from tokenmill.planning import estimate_rows
from tokenmill.shards import ShardSpec
from tokenmill.spec import JobSpec
from tokenmill.tasks.logs import with_core_logs
from tokenmill.tasks.storage import with_storage_secrets


@task(name="choose-engine", cache_policy=NONE)
@with_core_logs
def choose_engine_task(spec: JobSpec, shards: list[ShardSpec]) -> EngineChoice:
    """Which engine runs this job here: timed trials on its sample (cached per model, mode and
    device), weighed by the job's size. Call it before the shards, in the process that runs them."""
    spec = with_storage_secrets(spec)
    choice = choose_engine(spec, job_rows=estimate_rows(spec, shards))
    get_run_logger().info("engine auto -> %s", choice.reason)
    return choice
