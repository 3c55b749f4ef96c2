"""A new user's first session, predicted against measured: `make run` on a new machine, then jobs of their own.

    python -m bench.user_session          # writes bench/USER_SESSION.md (~10-12 minutes on 2 cores)

bench/prediction.py runs a fixed ladder of jobs on corpora built from the standard library. This bench runs what
the issue that asked for predictions did, as a user would, in order on one machine: the quickstart's `make run`
(jobs/demo.yaml, in a working directory of its own, as a fresh clone runs it: its sample corpus written, its eval
gate making its models) and its rerun, then three jobs on a corpus no bench or test builds: the docstrings of
the installed third-party packages (pandas, numpy, scipy, sklearn, ...), at the sizes the issue tried: 20,000
first lines (Parquet), 1,500 whole docstrings over 1,500 characters each (JSONL: documents the model truncates to
its 256 tokens), 192 summaries of docstrings with SmolLM2 at max_tokens 64; then the first and last of those
again, with nothing left to compute. Every job is left to `engine: auto`. Each runs as a whole process, timed
from spawn to exit, against the prediction it printed before it started work (its MLflow run's
`predicted_wall_seconds`). Caches, Prefect's home, vLLM's and torch's compiled graphs and the models home (but
for SmolLM2, as `make install` converts it) start empty, so the first job is a first run on a new machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from bench import harness
from bench import prediction as ladder

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "USER_SESSION.md"
WORK = ROOT / "data" / "bench" / "user_session"
PACKAGES = ("pandas", "numpy", "sklearn", "scipy", "sqlalchemy", "pydantic", "prefect", "mlflow", "fsspec", "boto3",
            "botocore", "jinja2", "click", "rich", "httpx")
EXPERIMENT = "tokenmill-bench-user-session"


@dataclass
class Job:
    name: str
    config: Path
    cwd: Path
    tracking: str  # the MLflow store the run records into
    experiment: str
    result: dict = field(default_factory=dict)


def package_docstrings() -> list[tuple[str, str]]:
    """(file:line, docstring) of every module, class and function of PACKAGES as installed, tests left out, in
    file order: text nobody wrote for tokenmill."""
    site = Path(sysconfig.get_paths()["purelib"])
    found: list[tuple[str, str]] = []
    for package in PACKAGES:
        for path in sorted((site / package).rglob("*.py")) if (site / package).is_dir() else []:
            if "tests" in path.parts:
                continue
            try:
                tree = ast.parse(path.read_text(errors="replace"))
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 20:
                        found.append((f"{path.relative_to(site)}:{getattr(node, 'lineno', 0)}", doc))
    return found


def write_corpora(folder: Path) -> dict[str, Path]:
    docs = package_docstrings()
    short = [(key, doc.strip().splitlines()[0]) for key, doc in docs if doc.strip()][:20_000]
    long = [(key, doc) for key, doc in docs if len(doc) > 1500][:1500]
    summaries = [(key, doc) for key, doc in docs if 200 < len(doc) < 1200][::7][:192]
    out = {}
    for name, rows, kind in (("short", short, "parquet"), ("long", long, "jsonl"), ("gen", summaries, "parquet")):
        target = folder / name
        target.mkdir(parents=True, exist_ok=True)
        if kind == "jsonl":
            with open(target / "docs.jsonl", "w") as lines:
                lines.writelines(json.dumps({"id": key, "text": text}) + "\n" for key, text in rows)
        else:
            pq.write_table(pa.table({"id": [k for k, _ in rows], "text": [t for _, t in rows]}), target / "docs.parquet")
        out[name] = target
    return out


def jobs() -> list[Job]:
    demo = WORK / "clone"  # a working directory as a fresh clone is: jobs/demo.yaml, no data/ or output/ yet
    (demo / "jobs").mkdir(parents=True)
    shutil.copy(ROOT / "jobs" / "demo.yaml", demo / "jobs" / "demo.yaml")
    corpora = write_corpora(WORK / "corpora")
    tracking = f"sqlite:///{WORK / 'mlflow.db'}"
    summary = [{"role": "user", "content": "Summarize the following text in one sentence.\n\n{text}"}]
    own = {
        "short": {"mode": "embed"},
        "long": {"mode": "embed"},
        "gen": {"mode": "generate", "model": {"name": "SmolLM2-135M-Instruct"},
                "generation": {"max_tokens": 64, "messages": summary}},
    }
    files = {}
    for name, fields in own.items():
        path = WORK / "jobs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({**fields, "input": str(corpora[name]), "output": str(WORK / "out" / name),
                                        "tracking": {"mlflow_tracking_uri": tracking, "experiment": EXPERIMENT}},
                                       sort_keys=False))
        files[name] = path
    made = f"sqlite:///{demo / 'mlflow.db'}"  # jobs/demo.yaml names no store: MLflow's default, in its cwd
    return [
        Job("`make run`: the demo on a new machine (gate, 20,000 rows)", Path("jobs/demo.yaml"), demo, made, "tokenmill"),
        Job("`make run` again (nothing left to compute)", Path("jobs/demo.yaml"), demo, made, "tokenmill"),
        Job("20,000 first lines of package docstrings (Parquet; auto's trials)", files["short"], ROOT, tracking,
            EXPERIMENT),
        Job("1,500 whole docstrings over 1,500 characters (JSONL, truncated to 256 tokens)", files["long"], ROOT,
            tracking, EXPERIMENT),
        Job("192 docstrings summarized by SmolLM2, max_tokens 64 (first generation here)", files["gen"], ROOT,
            tracking, EXPERIMENT),
        Job("the 20,000 again (nothing left to compute)", files["short"], ROOT, tracking, EXPERIMENT),
        Job("the 192 summaries again (nothing left to compute)", files["gen"], ROOT, tracking, EXPERIMENT),
    ]


def run(job: Job) -> dict:
    ticks = ladder.cpu_times()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run", "--config", str(job.config), "--no-progress"],
                          cwd=job.cwd, env={**os.environ, **ladder.ENV}, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    steal = ladder.steal_share(ticks, ladder.cpu_times())
    if done.returncode != 0:
        raise RuntimeError(f"{job.name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(job.tracking)
    experiment = client.get_experiment_by_name(job.experiment).experiment_id
    record = client.search_runs([experiment], order_by=["attributes.start_time DESC"], max_results=1)[0]
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("predicted wall")), "")
    track = next((ln for ln in done.stdout.splitlines() if ln.startswith("On this machine")), "")
    return {"wall": wall, "started": started, "steal": steal, "line": line, "track": track,
            "metrics": dict(record.data.metrics), "engine": record.data.params.get("engine", "")}


def report(done: list[Job], seconds: float) -> str:
    rows = ["| job | rows | engine | predicted wall s | measured wall s | error | predicted engine s | "
            "measured engine s | host's probe while it ran |", "|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for job in done:
        r, m = job.result, job.result["metrics"]
        predicted = m.get("predicted_wall_seconds", float("nan"))
        error = predicted / r["wall"] - 1
        errors.append(abs(error))
        rows.append(f"| {job.name} | {m.get('rows_out', 0):,.0f} | {r['engine']} | {predicted:.1f} | {r['wall']:.1f} | "
                    f"{error:+.1%}{'' if abs(error) <= ladder.GOAL else ' **miss**'} | "
                    f"{m.get('predicted_engine_seconds', 0):.1f} | {m.get('engine_seconds', 0):.1f} | "
                    f"{ladder.host_during(r)} |")
    met = sum(e <= ladder.GOAL for e in errors)
    lines = ["# A new user's first session: predicted against measured wall time", "",
             f"{harness.now()}, commit {harness.git_commit() or 'unknown'}, `python -m bench.user_session` ({seconds / 60:.1f} minutes "
             f"in all), on this machine: {os.cpu_count()} cores, shared with other work while it ran.", "",
             *(__doc__.split("\n\n", 2)[2].strip().splitlines()), "", *rows, "",
             f"|error|: median {statistics.median(errors):.1%}, max {max(errors):.1%}; **{met} of {len(errors)} "
             f"within {ladder.GOAL:.0%}**.", "", *ladder.host_summary(), "",
             "The lines the runs printed before they started work (the prediction, then this machine's track record "
             "as it stood: its earlier runs against their predictions):", ""]
    lines += [f"- {job.name}: `{job.result['line']}`" + (f"\n  `{job.result['track']}`" if job.result.get("track") else "")
              for job in done]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    started = time.perf_counter()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    os.environ["TOKENMILL_CACHE_DIR"] = str(WORK / "cache")
    for folder, variable in (("vllm-cache", "VLLM_CACHE_ROOT"), ("inductor-cache", "TORCHINDUCTOR_CACHE_DIR"),
                             ("prefect", "PREFECT_HOME")):
        os.environ[variable] = str(WORK / folder)
    ladder.WORK = WORK  # its models home (SmolLM2 linked, nothing else made) under this bench's folder
    ladder.new_models_home()
    session = jobs()
    ladder._watch, ticks = ladder.host_watch(), ladder.cpu_times()
    try:
        for job in session:
            job.result = run(job)
            print(f"{job.name}: measured {job.result['wall']:.1f} s; {job.result['line'][:160]}", flush=True)
    finally:
        ladder._watch.stop()
        ladder._bench_steal = ladder.steal_share(ticks, ladder.cpu_times())
    text = report(session, time.perf_counter() - started)
    REPORT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
