"""The job files shipped in jobs/ are valid jobs, and say what the README says they do."""

from pathlib import Path

import pytest

from tokenmill.spec import JobSpec

JOBS = Path(__file__).resolve().parent.parent / "jobs"


@pytest.mark.parametrize("path", sorted(JOBS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_file_is_a_valid_job(path):
    spec = JobSpec.from_yaml(path)
    assert spec.gate is not None, f"{path.name}: the shipped jobs show the gate ladder"
    assert spec.gate.candidates, f"{path.name}: a ladder of candidates"
    for candidate in spec.gate.candidates:
        assert candidate.quantization, f"{path.name}: every rung is a quantized model, judged by the gate"


def test_the_gpu_job_judges_vllm_fp8_against_the_16_bit_model():
    spec = JobSpec.from_yaml(JOBS / "gpu-fp8.yaml")
    [candidate] = spec.gate.candidates
    assert (candidate.engine, candidate.quantization) == ("vllm", "fp8")
    assert spec.gate.reference.name == candidate.name and spec.gate.reference.quantization is None
