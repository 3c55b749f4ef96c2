"""The job as the Prefect flows take it: the core JobSpec, plus where it runs on Prefect.

The core's JobSpec says what to compute; orchestration (which deployment the shards fan out
to, the global concurrency limit that caps GPUs, the Secret block holding storage
credentials) lives here, in the Prefect layer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from tokenmill.spec import JobSpec, _Spec


class FleetSpec(_Spec):
    """dispatch: pool. Shards fan out to the shard-worker deployment on a GPU work pool."""

    model_config = ConfigDict(title="Fleet (pool dispatch)")

    deployment: str = Field(
        "tokenmill-shard-worker/gpu-spot",
        description="The shard-worker deployment, as flow-name/deployment-name (deployments/prefect.yaml).")
    workers: int = Field(4, ge=1, description="Work lists per dispatch: one per GPU worker run.")
    max_rounds: int = Field(
        3, ge=1, description="Dispatch rounds: the first, plus re-dispatches of the unfinished shards of "
        "runs that ended Crashed, Failed or Cancelled (a preemption).")
    straggler_seconds: float | None = Field(
        None, gt=0, description="A worker run still going this long after it started gets a speculative "
        "copy of its unfinished shards. Empty: straggler_factor x the median finished run.")
    straggler_factor: float = Field(1.5, ge=1.0, description="See straggler_seconds.")
    concurrency_limit: str = Field(
        "tokenmill-gpu", description="Prefect global concurrency limit every shard-worker run holds a slot "
        "of while its engine is up: the cap on GPU workers at once, across jobs.")
    concurrency_slots: int = Field(
        8, ge=1, description="The limit's size, used only when the limit does not exist yet.")
    slot_lease_seconds: float = Field(
        300, ge=60, description="A slot of a worker that vanished (SIGKILL, lost node) frees after this long.")
    start_timeout_seconds: float | None = Field(
        3600, gt=0, description="A worker run not started this long after its launch (no worker, no capacity) "
        "is cancelled and counts as lost: its shards go to the next round. Empty: wait for ever.")
    poll_seconds: float = Field(5.0, gt=0, description="How often the orchestrator reads its worker runs' states.")
    job_variables: dict[str, Any] = Field(
        default_factory=dict, description="Work-pool job variables for the worker runs (image, env, ...).")


class PrefectJob(JobSpec):
    """One batch job, with how Prefect runs it."""

    model_config = ConfigDict(title="Batch job")

    storage_block: str | None = Field(
        None,
        description="Name of a Prefect Secret block whose value is a JSON object of fsspec options "
        "(key, secret, token, endpoint_url, ...), merged in when storage is opened.",
    )
    server_key_block: str | None = Field(
        None, description="engine openai-server: a Prefect Secret block holding the server's API key (a string), "
        "read into the shard-running process's environment only; never logged nor recorded.")
    dispatch: Literal["local", "pool"] = Field(
        "local", description="local: every shard in this process. pool: shards fan out to GPU worker runs "
        "of the fleet's deployment; see fleet.")
    fleet: FleetSpec = Field(
        default_factory=FleetSpec, description="The GPU workers shards fan out to; used by dispatch=pool only.")

    @model_validator(mode="before")
    @classmethod
    def _from_core_spec(cls, data: Any) -> Any:
        # a plain JobSpec (a library user's) runs as a job with Prefect's defaults
        if isinstance(data, JobSpec) and not isinstance(data, cls):
            return data.model_dump()
        return data
