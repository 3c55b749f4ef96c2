"""The eval gate as a flow: run alone (`tokenmill gate --config job.yaml`) or as the batch flow's first stage."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from tokenmill import prediction
from tokenmill.engines import engine_scope
from tokenmill.errors import TokenmillError
from tokenmill.gate import GateReport
from tokenmill.tasks.gate import gate_evaluate_task, gate_sample_task
from tokenmill.tasks.job import PrefectJob
from tokenmill.tracking import log_gate_run


class GateFailed(TokenmillError):
    """The candidate does not match the reference; the message gives each metric against its threshold."""


@flow(name="tokenmill-gate")
def gate_flow(spec: PrefectJob, record: bool = True) -> GateReport:
    """Candidate against reference on a deterministic sample. record=False leaves the MLflow
    record to the caller."""
    with engine_scope():  # engines this flow starts end with it
        return run_gate(spec, record)


def run_gate(spec: PrefectJob, record: bool = True) -> GateReport:
    """The gate's tasks, in the flow run that calls it: the `tokenmill-gate` flow's, or the batch flow's
    own first stage (record=False: the batch flow puts the gate's figures on the job's run). Not a
    subflow there: a subflow's run is created by a synchronous API call, which Prefect's SQLite API
    answered 503 ("database is locked", beside the events it was writing) in 4 of 11 runs of `make run`'s
    gate here, each costing the client's 2 s back-off, and the subflow's start and end cost ~1 s more."""
    logger = get_run_logger()
    texts, source = gate_sample_task(spec)
    report = gate_evaluate_task(spec, texts, source)
    shown = as_measured_here(report)
    create_table_artifact(shown.table(), key="tokenmill-gate", description=shown.message())
    (logger.info if report.action == "candidate" else logger.warning)("%s", shown.message())
    if record:
        log_gate_run(spec, report)
    if report.action == "fail" and record:
        raise GateFailed(report.message())
    return report


def as_measured_here(report: GateReport) -> GateReport:
    """The report as its reader should see it: a verdict this run measured before its prediction
    (tokenmill.gate.judge_first) is kept by the time the flow's gate reads it, and is shown (artifact, log, the
    job's record) as measured, not as "verdict cached", which a reader takes for an earlier run's."""
    return report.model_copy(update={"cached": False}) if report.cached and prediction.gate_ran_first() else report
