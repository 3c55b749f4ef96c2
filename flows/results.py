"""What the flows return: typed records, so callers read fields, not string keys."""

from __future__ import annotations

from pydantic import BaseModel

from tokenmill.calibrate import Calibration
from tokenmill.tasks.record import JobRecord

__all__ = ["CalibrationRecord", "JobRecord", "PlanRecord", "WorkerRecord"]


class WorkerRecord(BaseModel):
    """tokenmill-shard-worker: the shards this worker run finished, and which came from cache."""

    worker: str | None
    shards: list[str]
    cached: list[str]


class CalibrationRecord(BaseModel):
    """tokenmill-calibrate: the sweep, and where its plot and batching snippet went."""

    calibration: Calibration
    plot: str
    snippet: str
    mlflow_run_id: str
    prediction: str = ""  # the job on this machine, as `tokenmill plan` and `tokenmill run` predict it


class PlanRecord(BaseModel):
    """tokenmill-plan: the plan as markdown, its figures, and its MLflow run."""

    plan: str
    metrics: dict[str, float]
    mlflow_run_id: str
