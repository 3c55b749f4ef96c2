"""vLLM's start on this machine: a first start of a model, which compiles it, against later starts, which load
the graphs the first kept; and this machine's compute probe. The figures behind tokenmill/prediction.py's
DEFAULT_ENGINE_START, DEFAULT_VLLM_COMPILE and DEFAULT_GFLOPS.

    python -m bench.vllm_starts             # ~6 minutes on 2 cores; writes bench/VLLM_STARTS.md
    python -m bench.vllm_starts --rounds 1  # one compiling and one loading start per model

Each start is a fresh process (as a run's is) that starts tokenmill's vLLM engine (tokenmill.vllm_engine:
the job's engine arguments) and exits; timed from the engine's construction to ready, vLLM's import
included. Per model, vLLM's and torch's compile caches (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR) are
emptied before the first start, so it is a new machine's first; the next ones find what it kept. The
column `compiled` is the engine's own account (tokenmill.vllm_engine.compiled_graphs: whether its start
added a compiled graph to vLLM's cache), the signal tokenmill's prediction stores starts apart by.

Where a first start's extra seconds go, from each start's own vLLM log and the caches it left: the model
inspection (vLLM resolves the architecture in a subprocess and keeps the answer in VLLM_CACHE_ROOT/modelinfos:
the seconds between its "non-default args" and "Resolved architecture" lines), the warm-up (its "init engine
(profile, create kv cache, warmup model) took" line, where torch.compile traces and builds the graph), and of that,
the C++ kernels inductor wrote to TORCHINDUCTOR_CACHE_DIR, compiled again afterwards with inductor's own command
line for this machine's vector ISA (torch._inductor.cpp_builder), in a fresh process: gcc's share of the compile.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import header, machine, table

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "VLLM_STARTS.md"
MODELS = (("embed", "all-MiniLM-L6-v2"), ("generate", "SmolLM2-135M-Instruct"))

CHILD = r"""
import json, sys, time
started = time.perf_counter()
from tokenmill.engines import start_engine
from tokenmill.models import resolve_model
from tokenmill.spec import JobSpec
mode, name = sys.argv[1], sys.argv[2]
spec = JobSpec.model_validate({"input": "unused", "mode": mode, "model": {"name": name, "engine": "vllm"}})
path = resolve_model(spec.model.name)
ready = time.perf_counter()
engine = start_engine(str(path), spec)
done = time.perf_counter()
print(json.dumps({"start_s": done - ready, "imports_s": ready - started, "compiled": engine.compiled}))
engine.close()
"""


# Compiles each C++ kernel inductor wrote (argv[1]: its cache folder) with inductor's command line for this
# machine's vector ISA, as its first build did, into a scratch folder; prints the kernels, their lines and seconds.
GCC = r"""
import json, subprocess, sys, tempfile, time
from pathlib import Path
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
from torch._inductor.cpu_vec_isa import pick_vec_isa
isa = pick_vec_isa()
option = CppTorchDeviceOptions(vec_isa=isa, device_type="cpu", compile_only=True)
kernels = sorted(Path(sys.argv[1]).rglob("*.main.cpp"))
seconds, lines = 0.0, 0
with tempfile.TemporaryDirectory() as out:
    for index, source in enumerate(kernels):
        command = CppBuilder(name=f"{out}/k{index}", sources=str(source), BuildOption=option).get_command_line()
        started = time.perf_counter()
        subprocess.run(command, shell=True, check=True, capture_output=True)
        seconds += time.perf_counter() - started
        lines += len(source.read_text().splitlines())
print(json.dumps({"isa": str(isa), "kernels": len(kernels), "lines": lines, "gcc_s": seconds}))
"""
STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def log_seconds(log: str) -> dict:
    """The model inspection's and the warm-up's seconds in a start's vLLM log (None where a line is missing)."""
    def stamp(marker: str) -> dt.datetime | None:
        line = next((line for line in log.splitlines() if marker in line), "")
        found = STAMP.search(line)
        return dt.datetime.strptime(found.group(1), "%m-%d %H:%M:%S") if found else None
    asked, resolved = stamp("non-default args"), stamp("Resolved architecture")
    warm = re.search(r"warmup model\) took ([0-9.]+) s", log)
    # stamps carry no year: a start across midnight is still its seconds
    return {"inspect_s": (resolved - asked).total_seconds() % 86400 if asked and resolved else None,
            "warmup_s": float(warm.group(1)) if warm else None}


def kernels_compiled(caches: Path) -> dict:
    """gcc's seconds for the kernels a first start had inductor write (GCC), in a fresh process."""
    done = subprocess.run([sys.executable, "-c", GCC, str(caches / "inductor")], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"compiling inductor's kernels again failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_once(mode: str, name: str, caches: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(caches / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, name], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM start of {name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return {**json.loads(lines[-1]), **log_seconds(done.stdout + done.stderr)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="loading starts per model after its compiling one")
    args = parser.parse_args(argv)
    from tokenmill.device import core_gflops, interpreter_ms, usable_cores
    from tokenmill.prediction import (DEFAULT_ENGINE_START, DEFAULT_GFLOPS, DEFAULT_INTERPRETER_MS,
                                      DEFAULT_VLLM_COMPILE, machine_speed)

    info, (speed, said) = machine(), machine_speed()
    if not said:  # nothing stored on this machine yet: the interpreter probe alone, as a first command's
        probe = min(interpreter_ms() for _ in range(5))
        speed, said = probe / DEFAULT_INTERPRETER_MS, (f" x {probe / DEFAULT_INTERPRETER_MS:.2f} (the interpreter "
                                                        f"probe here, {probe:.1f} ms, against {DEFAULT_INTERPRETER_MS:g})")
    probes = [core_gflops() for _ in range(5)]
    rows, summary = [], []
    with tempfile.TemporaryDirectory(prefix="vllm-starts-") as folder:
        for mode, name in MODELS:
            caches = Path(folder) / mode  # new and empty: this model's first start is a new machine's
            starts = []
            for index in range(1 + args.rounds):
                result = start_once(mode, name, caches)
                starts.append(result)
                rows.append([name, mode, "first (caches emptied)" if index == 0 else f"later {index}",
                             f"{result['start_s']:.1f}", "yes" if result["compiled"] else "no",
                             seconds(result["inspect_s"]), seconds(result["warmup_s"])])
                print(rows[-1], flush=True)
                if index == 0:
                    kernels = kernels_compiled(caches)
                    print(kernels, flush=True)
            defaults = (DEFAULT_ENGINE_START[("vllm", mode)] * speed, DEFAULT_VLLM_COMPILE[mode] * speed)
            summary += [compile_line(name, mode, starts, kernels, speed, defaults)]
    cores = usable_cores()
    lines = header("vLLM's starts: compiling against loading", "python -m bench.vllm_starts", info, notes=[
        f"- **Compute probe** (tokenmill.device.core_gflops, one core's float32 products, 5 probes): "
        f"{min(probes):.0f}-{max(probes):.0f} GFLOP/s a core x {cores} cores; the defaults' machine: "
        f"{DEFAULT_GFLOPS:.0f} GFLOP/s (tokenmill.prediction.DEFAULT_GFLOPS)",
        f"- **Machine speed** (tokenmill.prediction.machine_speed, which scales the defaults){said}"])
    lines += ["", *table(["model", "mode", "start", "seconds (construction to ready)", "compiled",
                          "model inspection s", "warm-up s"], rows), "",
              *summary, ""]
    REPORT.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def compile_line(name: str, mode: str, starts: list[dict], kernels: dict, speed: float,
                 defaults: tuple[float, float]) -> str:
    """What a model's first start spent beyond its loading starts' median, and where it went; `defaults`:
    tokenmill's load and compile seconds for it at this machine's speed."""
    first, later = starts[0], [s for s in starts[1:] if not s["compiled"]]
    if not later:
        return f"- {name} ({mode}): compiling start {first['start_s']:.1f} s; no loading start to set it against"
    extra = {key: first[key] - statistics.median(s[key] for s in later) if first[key] is not None
             and all(s[key] is not None for s in later) else None for key in ("start_s", "inspect_s", "warmup_s")}
    parts = [f"model inspection +{extra['inspect_s']:.0f} s" if extra["inspect_s"] is not None else "",
             f"warm-up +{extra['warmup_s']:.0f} s" if extra["warmup_s"] is not None else "",
             f"gcc {kernels['gcc_s']:.1f} s for its {kernels['kernels']} kernels ({kernels['lines']} lines of C++, "
             f"{kernels['isa']})"]
    loads = [s["start_s"] for s in later]
    return (f"- {name} ({mode}): compiling start {first['start_s']:.1f} s, loading starts {min(loads):.1f}-"
            f"{max(loads):.1f} s: the compile {extra['start_s']:.1f} s ({extra['start_s'] / speed:.1f} s at "
            f"speed 1), of it {', '.join(part for part in parts if part)} (tokenmill's defaults at this machine's "
            f"speed: load {defaults[0]:.1f} s, compile {defaults[1]:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
