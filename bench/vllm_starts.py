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
"""

from __future__ import annotations

import argparse
import json
import os
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


def start_once(mode: str, name: str, caches: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(caches / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, name], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM start of {name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="loading starts per model after its compiling one")
    args = parser.parse_args(argv)
    from tokenmill.device import core_gflops, usable_cores
    from tokenmill.prediction import DEFAULT_ENGINE_START, DEFAULT_GFLOPS, DEFAULT_VLLM_COMPILE, machine_speed

    info, speed = machine(), machine_speed()[0]
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
                             f"{result['start_s']:.1f}", "yes" if result["compiled"] else "no"])
                print(rows[-1], flush=True)
            loads = [s["start_s"] for s in starts[1:] if not s["compiled"]]
            first = starts[0]["start_s"]
            if loads:
                summary.append(f"- {name} ({mode}): compiling start {first:.1f} s, loading starts "
                               f"{min(loads):.1f}-{max(loads):.1f} s: the compile {first - statistics.median(loads):.1f} s "
                               f"(tokenmill's defaults at this machine's speed: load "
                               f"{DEFAULT_ENGINE_START[('vllm', mode)] * speed:.1f} s, compile "
                               f"{DEFAULT_VLLM_COMPILE[mode] * speed:.1f} s)")
    cores = usable_cores()
    lines = header("vLLM's starts: compiling against loading", "python -m bench.vllm_starts", info, notes=[
        f"- **Compute probe** (tokenmill.device.core_gflops, one core's float32 products, 5 probes): "
        f"{min(probes):.0f}-{max(probes):.0f} GFLOP/s a core x {cores} cores; the defaults' machine: "
        f"{DEFAULT_GFLOPS:.0f} GFLOP/s (tokenmill.prediction.DEFAULT_GFLOPS)"])
    lines += ["", *table(["model", "mode", "start", "seconds (construction to ready)", "compiled"], rows), "",
              *summary, ""]
    REPORT.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
