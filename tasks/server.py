"""Prefect's side of engine openai-server and of stop_by: the server's key from a Secret block, the server
checked before any shard starts, stop_by fixed to one moment for the whole run, and the clean stop there.

The key never enters a spec, a parameter, a log or the run record: the block's value goes into this
process's environment under a variable of its own, and the spec only names that variable.
"""

from __future__ import annotations

import os
import re
from datetime import datetime, timezone

from prefect import get_run_logger, task
from prefect.blocks.system import Secret
from prefect.cache_policies import NONE

from tokenmill.engines import get_engine
from tokenmill.errors import ConfigError
from tokenmill.models import resolve_model
from tokenmill.server_engine import StopByReached
from tokenmill.server_spec import stop_by_deadline
from tokenmill.spec import JobSpec
from tokenmill.tasks.logs import with_core_logs

def key_variable(block: str) -> str:
    return "TOKENMILL_SERVER_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", block).upper()


def with_server_key(spec: JobSpec) -> JobSpec:
    """The spec whose server.api_key_env names a variable holding the key of its server_key_block."""
    block = getattr(spec, "server_key_block", None)
    if not block or spec.server is None:
        return spec
    variable = key_variable(block)
    if variable not in os.environ:
        try:
            value = Secret.load(block, _sync=True).get()
        except ValueError as exc:
            raise ConfigError(f"server_key_block {block!r}: no such Prefect Secret block ({exc})") from exc
        os.environ[variable] = value if isinstance(value, str) else str(value.get("api_key", ""))
    return spec.model_copy(update={"server": spec.server.model_copy(update={"api_key_env": variable})})


def with_fixed_stop_by(spec: JobSpec) -> JobSpec:
    """stop_by as one moment (HH:MM means the next one after now: fixed here, when the run starts)."""
    deadline = stop_by_deadline(spec.stop_by)
    return spec if deadline is None else spec.model_copy(update={"stop_by": deadline.isoformat()})


def stop_by_passed(spec: JobSpec) -> bool:
    deadline = stop_by_deadline(spec.stop_by)
    return deadline is not None and datetime.now(timezone.utc) >= deadline


def stopped_by_deadline(state) -> bool:
    """Whether a shard task's failed state is the engine's clean stop at stop_by."""
    return isinstance(state.result(raise_on_failure=False), StopByReached)


@task(name="prepare-server-job", cache_policy=NONE)
@with_core_logs
def prepare_server_job(spec: JobSpec) -> JobSpec:
    """Before any shard: stop_by fixed; for openai-server, the key loaded and the server checked (it answers,
    takes the key, serves the model: else one line naming the URL or the model). The engine checked stays
    open for the shards."""
    spec = with_fixed_stop_by(spec)
    if spec.model.engine == "openai-server":
        get_engine(resolve_model(spec.model_name), with_server_key(spec)).begin_job()
        get_run_logger().info("server %s serves %s", spec.server.url, spec.server.model or spec.model_name)
    return spec
