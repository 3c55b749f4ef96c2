"""The core (tokenmill/, less the CLI that starts the flows) is plain Python: it neither imports
Prefect nor speaks of Prefect's concepts; those live in tokenmill.tasks and tokenmill.flows."""

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "tokenmill"
PREFECT_CONCEPTS = re.compile(
    r"import prefect|from prefect|deployment|concurrency limit|secret block|storage_block|\bflow[ _-]run|work[ -]pool",
    re.IGNORECASE)


def test_the_core_neither_imports_prefect_nor_names_its_concepts():
    offenders = [f"{path.name}:{number}: {line.strip()}"
                 for path in sorted(CORE.glob("*.py")) if path.name != "cli.py"
                 for number, line in enumerate(path.read_text().splitlines(), start=1)
                 if PREFECT_CONCEPTS.search(line)]
    assert not offenders, "\n".join(offenders)


def test_the_job_spec_carries_no_orchestration_fields():
    from tokenmill.spec import JobSpec
    from tokenmill.tasks.job import PrefectJob

    orchestration = {"dispatch", "fleet", "storage_block"}
    assert not orchestration & set(JobSpec.model_fields)
    assert orchestration <= set(PrefectJob.model_fields)
