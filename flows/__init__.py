"""tokenmill's Prefect flows.

- `batch_flow(spec)` (`tokenmill-batch`): the whole job; returns a `JobRecord`.
- `shard_worker_flow(spec, shard_ids, shard_list)` (`tokenmill-shard-worker`): some shards
  on a GPU worker of a pool; returns a `WorkerRecord`.
- `gate_flow(spec)` (`tokenmill-gate`): the eval gate alone; returns a `GateReport`.
- `calibrate_flow(spec, ...)` / `plan_flow(spec, ...)`: batch-size sweep and fleet plan.
"""

from tokenmill.flows.batch import batch_flow
from tokenmill.flows.calibrate import calibrate_flow, plan_flow
from tokenmill.flows.gate import GateFailed, gate_flow
from tokenmill.flows.results import CalibrationRecord, PlanRecord, WorkerRecord
from tokenmill.flows.shard_worker import shard_worker_flow

__all__ = ["CalibrationRecord", "GateFailed", "PlanRecord", "WorkerRecord", "batch_flow", "calibrate_flow",
           "gate_flow", "plan_flow", "shard_worker_flow"]
