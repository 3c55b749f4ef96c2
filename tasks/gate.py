"""Prefect tasks for the eval gate."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from tokenmill.gate import GateReport, evaluate, sample_texts
from tokenmill.spec import JobSpec
from tokenmill.tasks.logs import with_core_logs
from tokenmill.tasks.storage import with_storage_secrets


@task(name="gate-sample", cache_policy=NONE)
@with_core_logs
def gate_sample_task(spec: JobSpec) -> tuple[list[str], str]:
    return sample_texts(with_storage_secrets(spec))


@task(name="gate-evaluate", cache_policy=NONE)
@with_core_logs
def gate_evaluate_task(spec: JobSpec, texts: list[str], source: str) -> GateReport:
    return evaluate(spec, texts, source)
