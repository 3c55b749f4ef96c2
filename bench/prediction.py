"""How close tokenmill's prediction of a job's wall time comes, on jobs of several shapes and sizes.

    python -m bench.prediction            # writes bench/PREDICTION.md (~10-20 minutes on 2 cores)
    python -m bench.prediction --quick    # tiny corpora: proves the path, not the figures

Each job runs as a whole process (`python -m tokenmill.cli run --config job.yaml`), timed from spawn
to exit. The prediction is the one the process printed before it started work (tokenmill/prediction.py:
the same one `tokenmill plan` and `tokenmill calibrate` print), read back from its MLflow run
(`predicted_wall_seconds`). The bench starts from empty cache directories (tokenmill's, and vLLM's and
torch's compiled graphs, Prefect's home and the MLflow store) and an empty models home but for SmolLM2 (as
`make install` converts it: no ONNX or OpenVINO model made yet), so its first job is a first run on a new machine
(every fixed part a stated default, the engine trials run, the orchestrator's database created), and each
later job is predicted from the parts the earlier ones measured: its engine's start, imports,
orchestration and per-row overhead, and the trials' tokens/s over length (a new length class runs,
or is judged from, trials of its own).

Sizes are 500 to 8,000 rows, not the issue's 20,000: the machine is a shared 2-core CPU and the
whole bench is kept under ~25 minutes. Two jobs are held out: a corpus of another kind
(the installed packages' README paragraphs, as JSONL) at a size, and for generation a cap
(max_tokens 64 against the trial's 32), that no job before them measured; the generation is then run
again, planned with the answers its first run measured. The last three run
`make run`'s eval gate (jobs/demo.yaml: OpenVINO, no engine any job before them ran): predicted with
the gate, then the corpus on the model the gate will pick (a verdict kept here, else the reference).
Beside the jobs, the interpreter probe reads the host's pace every 10 s (host_watch, ~2% of one core): each
row says what it read while that job ran, so a miss in one of the host's slow spells shows as one; and the
cores' steal while it ran (/proc/stat: time the hypervisor gave to other machines, which the probe, counting
its own thread's CPU clock, does not read).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from bench import corpora
from tokenmill.device import InterpreterProbes
from tokenmill.models import prepare_smollm2

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "PREDICTION.md"
WORK = ROOT / "data" / "bench" / "prediction"
ENV = {"HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
GOAL = 0.10
SUMMARY_MESSAGES = [{"role": "user", "content": "Summarize the following text in one sentence.\n\n{text}"}]


@dataclass
class Job:
    name: str
    corpus: str  # a folder name under WORK/corpora
    fields: dict  # the job file's fields besides input, output and tracking
    note: str = ""


def jobs(quick: bool) -> list[Job]:
    """In order: each job's prediction reads what the jobs before it measured on this machine."""
    n = (lambda rows: max(8, rows // 50)) if quick else (lambda rows: rows)
    embed, generate = {"mode": "embed"}, {"mode": "generate", "generation": {
        "max_tokens": 32, "messages": SUMMARY_MESSAGES}, "model": {"name": "SmolLM2-135M-Instruct"}}
    gated = {"mode": "embed", "gate": yaml.safe_load((ROOT / "jobs" / "demo.yaml").read_text())["gate"]}
    return [
        Job("embed short 1,000 (first on the machine)", f"short-{n(1000)}", embed, "empty cache: defaults, trials"),
        Job("embed short 1,000 (warm)", f"short-{n(1000)}", embed),
        Job("embed short 8,000 (first at this size)", f"short-{n(8000)}", embed),
        Job("embed long 500 (first)", f"long-{n(500)}", embed, "a new length class"),
        Job("embed long 500 (warm)", f"long-{n(500)}", embed),
        Job("embed mixed 3,000 (first)", f"mixed-{n(3000)}", embed),
        Job("embed mixed 3,000, calibrated", f"mixed-{n(3000)}", {**embed, "calibration": "CALIBRATION"},
            "--set calibration=<tokenmill calibrate's json>"),
        Job("generate SmolLM2 48 rows, max_tokens 32 (first)", f"gen-{n(48) if quick else 48}", generate,
            "new model and mode: defaults, trials"),
        Job("generate SmolLM2 48 rows, max_tokens 32 (warm)", f"gen-{n(48) if quick else 48}", generate),
        # held out: text, format, size and cap none of the jobs above has (bench/corpora.py's readme shape)
        Job("held out: embed 2,000 package READMEs (JSONL)", f"readme-{n(2000)}", embed, "held out"),
        Job("held out: generate 96 README paragraphs, max_tokens 64", f"readmegen-{n(96) if quick else 96}",
            {**generate, "generation": {**generate["generation"], "max_tokens": 64}}, "held out; a cap no trial ran"),
        Job("held out: generate 96 README paragraphs again (warm)", f"readmegen-{n(96) if quick else 96}",
            {**generate, "generation": {**generate["generation"], "max_tokens": 64}},
            "the answers its first run measured"),
        # `make run`'s eval gate (jobs/demo.yaml: OpenVINO float32 reference, two int8 candidates), on corpora
        # of its own: a first gate here, the same job with its verdict kept, then a second corpus's gate
        Job("gated: embed mixed 2,000, make run's gate (first gate here)", f"mixed-{n(2000)}", gated),
        Job("gated: embed mixed 2,000 again (verdict kept)", f"mixed-{n(2000)}", gated),
        Job("gated: embed long 1,000, a second corpus's gate", f"long-{n(1000)}", gated),
    ]


def write_corpus(name: str) -> Path:
    shape, rows = name.rsplit("-", 1)
    shape = {"gen": "mixed", "readmegen": "readme"}.get(shape, shape)
    folder = WORK / "corpora" / name
    if not folder.exists():
        folder.mkdir(parents=True)
        table = corpora.build(shape, int(rows))
        if shape in corpora.HELD_OUT_SHAPES:  # JSONL, the other input format
            with open(folder / "docs.jsonl", "w") as out:
                out.writelines(json.dumps(row) + "\n" for row in table.to_pylist())
        else:
            pq.write_table(table, folder / "docs.parquet")
    return folder


def job_file(job: Job, index: int, calibration: Path | None) -> Path:
    fields = json.loads(json.dumps(job.fields))
    if fields.get("calibration") == "CALIBRATION":
        fields["calibration"] = str(calibration)
    fields.update(input=str(write_corpus(job.corpus)), output=str(WORK / "out" / f"job-{index}"),
                  tracking={"mlflow_tracking_uri": f"sqlite:///{WORK / 'mlflow.db'}",
                            "experiment": "tokenmill-bench-prediction"})
    path = WORK / "jobs" / f"job-{index}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


def parts_now() -> dict:
    try:
        return json.loads((WORK / "cache" / "run-parts.json").read_text())
    except (OSError, ValueError):
        return {}


def parts_measured(before: dict, after: dict) -> str:
    """The parts a run stored (tokenmill.prediction.measured_parts): what its process measured, by name."""
    out = []
    for key, entry in after.items():
        for name, values in entry.items():
            if not name.startswith(("_", "mean_tokens")) and values != before.get(key, {}).get(name):
                out.append(f"{name} {values[-1]:,.1f}" + (f" ({key.split('|')[1]})" if name == "engine start" else ""))
    return "; ".join(out)


def host_watch() -> InterpreterProbes:
    """The host's pace through the whole bench: the interpreter probe that predictions read
    (tokenmill.device.InterpreterProbes), one reading (~0.2 s of one core) every WATCH_GAP seconds in a process
    of its own, each kept with its time. Each job's row gets the readings taken while it ran, so a miss can be
    told from the host's slow spells: on this shared 2-core host the probe read 20 ms and 30-45 ms by turns,
    seconds apart, with nothing of tokenmill's running (2026-12-03, both cores alike)."""
    return InterpreterProbes(readings=100_000, gap=WATCH_GAP)


WATCH_GAP = 10.0
_watch: InterpreterProbes | None = None
_bench_steal: float | None = None  # steal_share() from the bench's start to its end


def host_during(r: dict) -> str:
    """The host's readings while a job ran: their median and how many were slow (over SLOW x the bench's
    fastest reading)."""
    if _watch is None or not _watch.readings:
        return ""
    floor = min(_watch.readings)
    during = _watch.between(r["started"], r["started"] + r["wall"])
    if not during:
        return "none"
    slow = sum(ms > SLOW * floor for ms in during)
    steal = r.get("steal")
    return (f"{statistics.median(during):.1f} ms, {slow} of {len(during)} slow"
            + (f", steal {steal:.0%}" if steal is not None else ""))


SLOW = 1.3


def cpu_times() -> list[int] | None:
    """The machine's CPU time so far, all cores (/proc/stat's "cpu" line, in clock ticks: user, nice, system,
    idle, iowait, irq, softirq, steal, ...); None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            return [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the cores' time between two cpu_times() that the hypervisor gave to other machines
    (steal): a slowness the interpreter probe does not read (it counts its own thread's CPU clock, which stops
    while its core is taken), where a job's engine, on both cores, waits for it."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])  # guest time (after steal) is counted in user's already
    return delta[7] / total if total > 0 else None


def run_job(path: Path, output: Path) -> dict:
    shutil.rmtree(output, ignore_errors=True)  # the whole job every time (its row cache lives in it too)
    before = parts_now()
    ticks = cpu_times()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run", "--config", str(path), "--no-progress"],
                          cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    steal = steal_share(ticks, cpu_times())
    if done.returncode != 0:
        raise RuntimeError(f"{path} exited {done.returncode}:\n{done.stderr[-3000:]}")
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("predicted wall")), "")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{WORK / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tokenmill-bench-prediction").experiment_id
    run = client.search_runs([experiment], order_by=["attributes.start_time DESC"], max_results=1)[0]
    return {"wall": wall, "started": started, "line": line, "metrics": dict(run.data.metrics),
            "engine": run.data.params.get("engine"), "measured": parts_measured(before, parts_now()),
            "steal": steal}


def calibrate(job: Job, index: int) -> tuple[Path, float, str]:
    """`tokenmill calibrate` on the job (its own process): the calibration file and the prediction it printed."""
    path = job_file(job, index, None)
    out = WORK / "calibration"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "calibrate", "--config", str(path), "--sizes",
                           "16,64,256", "--sample-rows", "256", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"calibrate exited {done.returncode}:\n{done.stderr[-3000:]}")
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("predicted wall")), "")
    return out / "calibration.json", time.perf_counter() - started, line


def table(results: list[tuple[Job, dict]]) -> list[str]:
    lines = ["| job | rows | engine | predicted wall s | measured wall s | error | predicted engine s | "
             "measured engine s | predicted fixed s | measured fixed s | default parts | host's probe while it ran |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for job, r in results:
        m = r["metrics"]
        predicted = m.get("predicted_wall_seconds", float("nan"))
        error = predicted / r["wall"] - 1
        exit_part = m.get("predicted_exit_seconds", 0.0)
        lines.append(f"| {job.name} | {m.get('rows_out', 0):,.0f} | {r['engine']} | {predicted:.1f} | "
                     f"{r['wall']:.1f} | {error:+.1%}{'' if abs(error) <= GOAL else ' **miss**'} | "
                     f"{m.get('predicted_engine_seconds', 0):.1f} | {m.get('engine_seconds', 0):.1f} | "
                     f"{m.get('predicted_fixed_seconds', 0):.1f} | {r['wall'] - m.get('engine_seconds', 0):.1f} | "
                     f"{m.get('predicted_default_parts', 0):.0f} | {host_during(r)} |")
        r["error"], r["exit"] = error, exit_part
    return lines


def host_summary() -> list[str]:
    if _watch is None or not _watch.readings:
        return []
    values = sorted(_watch.readings)
    slow = sum(ms > SLOW * values[0] for ms in values)
    return [f"The host's pace through the bench (host_watch: the interpreter probe every {WATCH_GAP:g} s beside the "
            f"jobs): {len(values)} readings, fastest {values[0]:.1f} ms, median {statistics.median(values):.1f} ms, "
            f"{slow} slow (over {SLOW:g}x the fastest). A job's column above counts its own{steal_line()}."]


def steal_line() -> str:
    return ("" if _bench_steal is None else f"; steal (the cores' time the hypervisor gave to other machines, which "
            f"the probe's own CPU clock does not count, /proc/stat) {_bench_steal:.1%} through the bench, each job's "
            "beside it")


def trial_lines() -> list[str]:
    try:
        cache = json.loads((WORK / "cache" / "engine-trials.json").read_text())
    except (OSError, ValueError):
        return ["- none"]
    return [f"- {entry.get('family', '')[:12]} at {entry.get('mean_tokens', 0):,.0f} tokens a row: {t['engine']} "
            f"start {t['start_seconds']:.1f} s, whole trial {t.get('wall_seconds', 0):.1f} s, "
            f"{t['tokens_per_s']:,.0f} tokens/s" for entry in cache.values() if isinstance(entry, dict)
            for t in entry.get("trials", [])]


def report(results: list[tuple[Job, dict]], calibration: tuple[float, str], seconds: float, quick: bool) -> str:
    rows = table(results)
    errors = [abs(r["error"]) for _, r in results]
    met = sum(e <= GOAL for e in errors)
    lines = ["# Predicted against measured wall time", "",
             f"{dt.date.today()}, {'--quick, ' if quick else ''}`python -m bench.prediction` ({seconds / 60:.1f} "
             f"minutes in all), on this machine: {os.cpu_count()} cores, shared with other work while it ran.", "",
             *(__doc__.split("\n\n", 2)[2].strip().splitlines()), "", *rows, "",
             f"|error|: median {statistics.median(errors):.1%}, mean {statistics.fmean(errors):.1%}, "
             f"max {max(errors):.1%}; **{met} of {len(errors)} within {GOAL:.0%}**.", "",
             *host_summary(), "",
             *[f"- {job.name}: the gate ran the corpus on another model than the prediction assumed; the prediction's "
               f"branch for it (made before the run, from the same figures) said "
               f"{r['metrics']['predicted_wall_seconds_as_gated']:.1f} s, {r['metrics']['predicted_wall_seconds_as_gated'] / r['wall'] - 1:+.1%}"
               f" (the error above is the prediction's, unchanged)" for job, r in results
               if "predicted_wall_seconds_as_gated" in r["metrics"]], "",
             "Fixed seconds measured = measured wall less the engine's seconds (the process's, from its record).",
             "", f"`tokenmill calibrate` on the mixed job took {calibration[0]:.0f} s and printed:", "",
             f"    {calibration[1]}", "", "The lines the runs printed before they started work:", ""]
    lines += [f"- {job.name}: `{r['line']}`" for job, r in results]
    lines += ["", "What each run measured and stored for the next predictions (seconds; tokens/s; per 1,000 rows "
              "where the name says so):", ""]
    lines += [f"- {job.name}: {r['measured']}" for job, r in results]
    lines += ["", "The engine trials the bench's runs paid for (engine-trials.json):", ""] + trial_lines()
    return "\n".join(lines) + "\n"


def new_models_home() -> None:
    """TOKENMILL_HOME as on a new machine after `make install`: SmolLM2 converted (linked from this machine's
    models home, converting it there if it is not yet), no model the gated jobs make (the ONNX export, ONNX
    Runtime's and OpenVINO's int8): the first gate makes them, as `make run` does on a new machine; and no
    digest of the models' files yet (the row cache's file-digests: the first runs hash them)."""
    smollm2 = prepare_smollm2()  # in the models home before this one: the machine's
    home = WORK / "home"
    shutil.rmtree(home, ignore_errors=True)
    (home / "models").mkdir(parents=True)
    (home / "models" / smollm2.name).symlink_to(smollm2.resolve(), target_is_directory=True)
    os.environ["TOKENMILL_HOME"] = str(home)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    shutil.rmtree(WORK / "cache", ignore_errors=True)  # a new machine, as far as tokenmill knows
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ["TOKENMILL_CACHE_DIR"] = str(WORK / "cache")
    # and as far as vLLM and torch know: a new machine's first vLLM start of a model compiles it; and Prefect's
    # and MLflow's: the first job's API creates its database, its run the MLflow store (tokenmill.prediction's
    # first-run parts)
    for folder, variable in (("vllm-cache", "VLLM_CACHE_ROOT"), ("inductor-cache", "TORCHINDUCTOR_CACHE_DIR"),
                             ("prefect", "PREFECT_HOME")):
        shutil.rmtree(WORK / folder, ignore_errors=True)
        os.environ[variable] = str(WORK / folder)
    (WORK / "mlflow.db").unlink(missing_ok=True)
    new_models_home()
    global _watch, _bench_steal
    _watch, ticks = host_watch(), cpu_times()
    results, calibration = [], (0.0, "")
    try:
        for index, job in enumerate(jobs(args.quick)):
            if "calibration" in job.fields and not calibration[1]:
                path, seconds, line = calibrate(job, index)
                calibration = (seconds, line)
            out = job_file(job, index, WORK / "calibration" / "calibration.json")
            result = run_job(out, WORK / "out" / f"job-{index}")
            print(f"{job.name}: measured {result['wall']:.1f} s; {result['line']}", flush=True)
            results.append((job, result))
    finally:
        _watch.stop()
        _bench_steal = steal_share(ticks, cpu_times())
    text = report(results, calibration, time.perf_counter() - started, args.quick)
    target = WORK / "PREDICTION-quick.md" if args.quick else REPORT
    target.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
