"""tokenmill.prediction: one prediction of a job, from parts measured here, the same from plan, calibrate
and run; never from another job's figures; a part never measured named as a default. No timing asserted."""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import TEXTS, assert_clean_exit, write_parquet


def tokenmill(*args, cwd, cache):
    env = dict(os.environ, PREFECT_HOME=str(cwd / ".prefect"), TOKENMILL_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert_clean_exit(done, f"tokenmill {args[0]}")
    return done.stdout


def prediction_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("predicted wall")]
    assert len(lines) == 1, stdout
    return lines[0]


@pytest.fixture(scope="module")
def job_a(tmp_path_factory):
    """An embed job on transformers (no vLLM start): calibrated, planned, then run, each a process."""
    root = tmp_path_factory.mktemp("prediction")
    cache = root / "cache"
    (root / "in").mkdir()
    write_parquet(root / "in" / "docs.parquet", [f"d{i}" for i in range(48)], [TEXTS[i % len(TEXTS)] for i in range(48)])
    job = {"input": str(root / "in"), "output": str(root / "out"), "mode": "embed",
           "model": {"name": "all-MiniLM-L6-v2", "engine": "transformers"},
           "tracking": {"mlflow_tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "tests"}}
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    config = ("--config", str(root / "job.yaml"))
    lines = {
        "calibrate": prediction_line(tokenmill("calibrate", *config, "--sizes", "4,8", "--sample-rows", "16",
                                               "--out", str(root / "calibration"), cwd=root, cache=cache)),
        "plan": prediction_line(tokenmill("plan", *config, "--window", "1h", "--tokens-per-s", "1000",
                                          cwd=root, cache=cache)),
    }
    run = tokenmill("run", *config, "--no-progress", cwd=root, cache=cache)
    lines["run"] = prediction_line(run)
    return {"root": root, "cache": cache, "lines": lines, "job": job, "run": run}


def test_plan_calibrate_and_run_print_one_prediction_for_one_job(job_a):
    lines = job_a["lines"]
    assert lines["plan"] == lines["calibrate"] == lines["run"]
    # the first command (calibrate) probed the model for the three and stored it; none predicts the probe's
    # seconds for the run, which did not probe
    from tokenmill.prediction import MODEL_PROBE
    stored = json.loads((job_a["cache"] / "run-parts.json").read_text())
    assert [v[MODEL_PROBE] for k, v in stored.items() if k.endswith("|machine") and MODEL_PROBE in v][0][0] > 0
    assert not any("model probe" in line for line in lines.values())
    # on a machine (cache) nothing has measured yet, every fixed part says it is a default, and which
    assert "python imports" in lines["run"] and "default: never measured here" in lines["run"]
    assert re.search(r"engine start [\d.]+ s \(transformers: default: never measured here", lines["run"])


def test_the_run_record_holds_prediction_beside_measurement(job_a):
    import mlflow

    mlflow.set_tracking_uri(job_a["job"]["tracking"]["mlflow_tracking_uri"])
    (run,) = [r for r in mlflow.search_runs(experiment_names=["tests"], output_format="list")
              if "tokenmill.stage" not in r.data.tags]  # the job's run (plan and calibrate are stage runs)
    metrics = run.data.metrics
    for name in ("predicted_wall_seconds", "measured_wall_seconds", "predicted_engine_seconds",
                 "measured_engine_seconds", "predicted_fixed_seconds_to_record", "measured_fixed_seconds",
                 "wall_prediction_error"):
        assert name in metrics, name
    assert metrics["predicted_wall_seconds"] == pytest.approx(float(
        re.match(r"predicted wall ([\d,.]+) s", job_a["lines"]["run"]).group(1).replace(",", "")), abs=0.5)
    summary = mlflow.MlflowClient().download_artifacts(run.info.run_id, "summary.md", str(job_a["root"]))
    assert "predicted against measured, to the record" in open(summary).read()


def test_the_run_measured_its_parts_and_the_next_prediction_reads_them(job_a, monkeypatch):
    from tokenmill import prediction
    from tokenmill.tasks.job import PrefectJob

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(job_a["cache"]))
    stored = json.loads((job_a["cache"] / "run-parts.json").read_text())
    key = prediction.fixed_key(PrefectJob.model_validate(job_a["job"]), "transformers")
    assert {"python imports", "orchestrator API", prediction.MAIN, "flow start", "shard overhead per 1,000 rows",
            "finish", "exit"} <= set(stored[key])
    # the prediction's reading of the sample, apart from the rest of the main thread: beside the tokens it read
    reading = stored[prediction.reading_key("embed")]
    assert len(reading[prediction.READING]) == len(reading[prediction.READ_TOKENS]) == 1
    assert reading[prediction.READ_TOKENS][0] > 48  # 48 rows, every one sampled for both samples
    # the same job into a new output (the finished one's rerun starts no engine)
    again = prediction.predict_job(PrefectJob.model_validate({**job_a["job"], "output": str(job_a["root"] / "again")}))
    for name in ("python imports", "engine start", "finish", "exit"):
        assert again.part(name).source.startswith(("measured here", "transformers: measured here")), name
    assert not again.part("orchestration start").is_default  # each of its parts measured by the run
    assert again.part("orchestration start").source.count("measured here") == 4  # API, main thread, store, flow
    assert "reading the sample" in again.part("orchestration start").source
    assert f"{prediction.TRACKING_OPENED} " in again.part("orchestration start").source
    rerun = prediction.predict_job(PrefectJob.model_validate(job_a["job"]))
    assert rerun.rows == 0 and rerun.part("engine start").seconds == 0
    assert "every shard finished" in rerun.part("engine start").source
    # no engine to close: its exit is not the engine's, which A's run measured
    assert rerun.part("exit").source.startswith("no engine to close (transformers): default")


def test_a_prediction_never_reads_another_jobs_figures(job_a, monkeypatch, tmp_path):
    """Job B (generation, another model) after job A ran here: none of A's measured figures in B's parts."""
    from tokenmill import prediction
    from tokenmill.tasks.job import PrefectJob

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(job_a["cache"]))
    stored = json.loads((job_a["cache"] / "run-parts.json").read_text())
    # every figure A's run stored; not the machine's speed (a command's interpreter probe, by device: it scales B's
    # defaults as it scales any job's here, and B's parts say so)
    # (as stored, to the ms: a part read from one equals it exactly, where a default scaled by the machine's
    # speed can round to one, as 1 s x 0.9092 did to A's exit of 0.909 s)
    a_figures = {v for key, entry in stored.items() if not key.endswith("|machine")
                 for name, values in entry.items() if not name.startswith("_") for v in values}
    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "docs.parquet", ["q1", "q2", "q3"], TEXTS[:3])
    job_b = PrefectJob.model_validate({
        "input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "mode": "generate",
        "model": {"name": "SmolLM2-135M-Instruct", "engine": "transformers"}, "generation": {"max_tokens": 16}})
    b = prediction.predict_job(job_b)
    assert b.engine == "transformers" and b.rows == 3
    for part in b.parts:
        assert part.seconds not in a_figures or part.seconds == 0, part  # 0: no figure
        assert part.is_default or part.name == "engine start" and "default" in part.source, part
    assert "default: transformers never measured here for this job" in b.part("engine").source
    assert "this machine's speed" in b.part("python imports").source
    # generation counts output tokens: with no trial, 0.9 of max_tokens a row
    assert b.tokens > 3 * 0.9 * 16


def test_a_rerun_with_every_shard_finished_is_predicted_without_an_engine_and_recorded(job_a, monkeypatch):
    """`tokenmill run` again on the finished job: no engine starts in its prediction, and its record holds
    prediction beside measurement, as a computing run's does; its main thread is stored as one with no engine
    starting beside it."""
    import mlflow

    from tokenmill import prediction

    stdout = tokenmill("run", "--config", str(job_a["root"] / "job.yaml"), "--no-progress", cwd=job_a["root"],
                       cache=job_a["cache"])
    line = prediction_line(stdout)
    assert "for 0 rows" in line and not re.search(r"; engine start [\d.]+ s \(", line)  # 0 s: not printed
    # its finished shards' tasks, each reading its result back: a part of their own, never measured here yet
    assert re.search(r"finished shards [\d.]+ s \([\d.]+ s a shard, its task reading the result kept \(default: "
                     r"never measured here, 0.06 s", line)
    # its MLflow store opened with no engine started before it: the first such opening here, predicted from the
    # one after an engine's start
    assert f"{prediction.TRACKING_ALONE} " in line and prediction.TRACKING_CREATED not in line
    assert "default: never opened here with no engine started before it" in line
    mlflow.set_tracking_uri(job_a["job"]["tracking"]["mlflow_tracking_uri"])
    runs = [r for r in mlflow.search_runs(experiment_names=["tests"], output_format="list", order_by=["start_time DESC"])
            if "tokenmill.stage" not in r.data.tags]
    assert len(runs) == 2
    metrics = runs[0].data.metrics
    assert metrics["measured_engine_seconds"] == 0 and metrics["measured_wall_seconds"] > 0
    assert "wall_prediction_error" in metrics
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(job_a["cache"]))
    stored = json.loads((job_a["cache"] / "run-parts.json").read_text())
    from tokenmill.tasks.job import PrefectJob

    assert len(stored[prediction.fixed_key(PrefectJob.model_validate(job_a["job"]), "transformers")][
        prediction.MAIN_ALONE]) == 1
    # plan's and calibrate's don't store; stored by mode, the rerun's opening apart (no engine before it)
    assert len(stored[prediction.machine_key()][f"{prediction.TRACKING_OPENED}@embed"]) >= 1
    assert len(stored[prediction.machine_key()][f"{prediction.TRACKING_ALONE}@embed"]) == 1
    # under each prediction, how the machine's last runs came out against theirs: the first run had none to tell;
    # this one tells the first's, as its record holds it; after it, both are kept (plan and calibrate keep none)
    assert "On this machine no run has been held against its prediction yet." in job_a["run"].splitlines()
    first = runs[1].data.metrics
    ratio = first["measured_wall_seconds"] / first["predicted_wall_seconds_to_record"]
    kept = stored[prediction.machine_key()][prediction.TRACK]
    told = f"On this machine the last run ran {abs(kept[0] - 1):.0%} {'over' if kept[0] > 1 else 'under'} its prediction"
    assert any(line.startswith(told) for line in stdout.splitlines()), stdout
    assert kept == pytest.approx([ratio, metrics["measured_wall_seconds"] / metrics["predicted_wall_seconds_to_record"]],
                                 abs=1e-3)
    # ...and its finished shards' tasks, measured apart: the next rerun's (any job's here) read them
    assert len(stored[prediction.machine_key()][prediction.FINISHED_SHARD]) == 1


def test_a_rerun_that_starts_no_engine_names_its_device_without_importing_the_engines_library():
    """A rerun with every shard finished imports neither torch nor vLLM: the record names its device from NVML
    (none here: the CPU), not by importing torch (1.1-1.4 s of a 6-8 s rerun here, and its exit 2.6 s against
    0.7). Once the library is imported (an engine ran), the engine's own account names it."""
    import subprocess
    import sys

    from tokenmill.device import engine_device

    script = ("import sys; from tokenmill.device import engine_device; "
              "print(engine_device('transformers'), engine_device('vllm'), 'torch' in sys.modules, 'vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["cpu", "cpu", "False", "False"]
    import torch  # noqa: F401 - as after an engine ran in this process

    assert engine_device("transformers") == "cpu"


def test_a_first_runs_one_time_costs_are_parts_of_their_own_predicted_where_they_happen(tmp_path, monkeypatch):
    """A machine's first run creates the orchestrator's database and MLflow's store, and the demo's first run
    writes its corpus: each is measured apart from the API's start and the main thread's work, and predicted
    only where it will happen (the store not there; the database created by this process's API start)."""
    from tokenmill import prediction, timeline
    from tokenmill.prediction import API_CREATED, MAIN, MAIN_ALONE, READING, TRACKING_CREATED, TRACKING_OPENED

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    store = tmp_path / "mlflow.db"
    spec = _gated_job(tmp_path)
    spec = spec.model_copy(update={"model": spec.gate.reference, "tracking": spec.tracking.model_copy(
        update={"mlflow_tracking_uri": f"sqlite:///{store}"})})
    t0 = 1000.0
    marks = {"process": t0, "cli_ready": t0 + 3, "api_start": t0 + 3, "api_store_created": t0 + 3,
             "sample_corpus_start": t0 + 3.2, "sample_corpus_written": t0 + 4.2, "tracking_open_start": t0 + 5,
             "tracking_created": t0 + 7.5, "tracking_warm": t0 + 8, "api_ready": t0 + 10, "flow_called": t0 + 10.5,
             "gate_start": t0 + 11, "gate_verdict_kept": t0 + 11.1, "shards_start": t0 + 11.2,
             "shards_done": t0 + 11.6}  # every shard finished: no engine call
    monkeypatch.setattr(timeline, "marks", lambda: dict(marks))
    monkeypatch.setattr(timeline, "process_started", lambda: t0)
    monkeypatch.setattr(timeline, "measures_process", lambda: True)
    parts = prediction.measured_parts(spec, "transformers", {}, 0, False)
    # the machine's first run, its main thread alone: apart from a later run's (MAIN_FIRST_ALONE)
    assert parts[prediction.fixed_key(spec, "transformers")] == {
        "python imports": pytest.approx(3.0), prediction.MAIN_FIRST_ALONE: pytest.approx(5.0 - 1.0 - 2.5)}
    machine = parts[prediction.machine_key()]
    assert machine[TRACKING_CREATED] == pytest.approx(2.5) and machine[API_CREATED] == pytest.approx(7.0)
    assert prediction.API_FIRST_REST not in machine  # its server's process marked no startup: not measured apart
    marks.update(api_startup_start=t0 + 5.5, api_startup_done=t0 + 9.8)  # as tasks/api_process.py marks them
    first = prediction.measured_parts(spec, "transformers", {}, 0, False)[prediction.machine_key()]
    # the start but its startup (where it created the database), of the same run
    assert first[prediction.API_FIRST_REST] == pytest.approx(7.0 - 4.3) and prediction.API_STARTUP not in first
    del marks["api_store_created"]  # a later start: its startup, the database there
    later = prediction.measured_parts(spec, "transformers", {}, 0, False)[prediction.machine_key()]
    assert later[prediction.API_STARTUP] == pytest.approx(4.3)
    assert API_CREATED not in later and prediction.API_FIRST_REST not in later
    marks["api_store_created"] = t0 + 3
    del marks["api_startup_start"], marks["api_startup_done"]
    assert parts[prediction.gate_key(spec)] == {prediction.GATE_KEPT: pytest.approx(0.1)}
    assert prediction.FINISHED_SHARD not in machine  # no count of finished shards given: nothing to divide by
    finished = prediction.measured_parts(spec, "transformers", {}, 0, False, shards_finished=4)[prediction.machine_key()]
    assert finished[prediction.FINISHED_SHARD] == pytest.approx(0.1)  # 0.4 s over the four shards' tasks
    # the store there: opened, with no engine started before it in the process (a gated job's), stored apart;
    # after an engine's early start, as any run's opening
    marks["tracking_opened"] = marks.pop("tracking_created")
    opened = prediction.measured_parts(spec, "transformers", {}, 0, False)[prediction.machine_key()]
    assert opened[f"{prediction.TRACKING_ALONE}@embed"] == pytest.approx(2.5) and TRACKING_CREATED not in opened
    marks["early_engine_start"], marks["early_engine_ready"] = t0 + 4.0, t0 + 4.5
    opened = prediction.measured_parts(spec, "transformers", {}, 0, False)[prediction.machine_key()]
    assert opened[f"{TRACKING_OPENED}@embed"] == pytest.approx(2.5) and f"{prediction.TRACKING_ALONE}@embed" not in opened
    del marks["early_engine_start"], marks["early_engine_ready"]
    marks["tracking_created"] = marks.pop("tracking_opened")

    key = prediction.fixed_key(spec, "transformers")
    stored = {prediction.machine_key(): {TRACKING_OPENED: [1.0], TRACKING_CREATED: [2.5], API_CREATED: [7.0]},
              key: {"orchestrator API": [3.0], MAIN: [0.5], "flow start": [0.2]}}
    assert prediction.tracking_part(spec, stored)[:2] == (TRACKING_CREATED, 2.5)
    store.write_bytes(b"")  # there now: the next run opens it
    # never opened here yet: its creation here, less what creating adds at the defaults
    del stored[prediction.machine_key()][TRACKING_OPENED]
    created_extra = (prediction.DEFAULT_TRACKING[TRACKING_CREATED] - prediction.DEFAULT_TRACKING[TRACKING_OPENED])
    factor = prediction.machine_speed()[0]
    stored[prediction.machine_key()][TRACKING_CREATED] = [2.0 * factor]
    name, seconds, source = prediction.tracking_part(spec, stored)
    assert (name, seconds) == (TRACKING_OPENED, pytest.approx((2.0 - created_extra) * factor))
    assert source.startswith(f"its creation here, {2.0 * factor:.1f} s")
    # a creation slowed by the first run's work beside it: no later opening is put over its default here
    stored[prediction.machine_key()][TRACKING_CREATED] = [10.6]
    name, seconds, source = prediction.tracking_part(spec, stored)
    default = prediction.DEFAULT_TRACKING[TRACKING_OPENED] * prediction.machine_speed()[0]
    assert (name, seconds) == (TRACKING_OPENED, pytest.approx(default))
    assert source.startswith("default: never measured here") and "under its creation here, 10.6 s" in source
    stored[prediction.machine_key()][TRACKING_CREATED] = [2.5]
    stored[prediction.machine_key()][TRACKING_OPENED] = [1.0]
    assert prediction.tracking_part(spec, stored)[:2] == (TRACKING_OPENED, 1.0)
    # opened in another mode's runs (3.0) and before it was stored by mode (1.0): their median, and it says so;
    # once this mode's runs opened it, theirs alone
    stored[prediction.machine_key()][f"{TRACKING_OPENED}@generate"] = [3.0]
    assert prediction.tracking_part(spec, stored)[1:] == (2.0, "measured here in other modes' runs, never in "
                                                           "embed's, median of 2")
    stored[prediction.machine_key()][f"{TRACKING_OPENED}@embed"] = [1.5, 1.7]
    assert prediction.tracking_part(spec, stored)[:2] == (TRACKING_OPENED, 1.6)
    # with no engine started before it (a gated job's, a rerun's): as such openings here, else the opening after
    # an engine's start + the stated extra at this machine's speed; an engine's run never reads those
    name, seconds, source = prediction.tracking_part(spec, stored, alone=True)
    assert (name, seconds) == (prediction.TRACKING_ALONE, pytest.approx(
        1.6 + prediction.DEFAULT_TRACKING_ALONE_EXTRA * prediction.machine_speed()[0]))
    assert "default: never opened here with no engine started before it" in source
    stored[prediction.machine_key()][f"{prediction.TRACKING_ALONE}@embed"] = [2.1]
    assert prediction.tracking_part(spec, stored, alone=True)[:2] == (prediction.TRACKING_ALONE, 2.1)
    assert prediction.tracking_part(spec, stored)[:2] == (TRACKING_OPENED, 1.6)
    first = prediction.orchestration_part(stored, key, 0.0, api_created=True)
    assert first.seconds == pytest.approx(7.0 + 0.2) and "creating its database" in first.source
    assert prediction.orchestration_part(stored, key, 0.0).seconds == pytest.approx(3.0 + 0.2)
    # the API's later starts never measured yet: its first start here, less its database's creation at the default
    del stored[key]["orchestrator API"]
    factor = prediction.machine_speed()[0]
    stored[prediction.machine_key()][API_CREATED] = [6.0 * factor]
    later = prediction.orchestration_part(stored, key, 0.0)
    extra = (prediction.DEFAULT_API_CREATED - prediction.DEFAULT_SECONDS["orchestrator API"]) * factor
    assert later.seconds == pytest.approx(6.0 * factor - extra + 0.2) and "which created its database" in later.source
    # a first start slowed by the first run's work beside it: no later start is put over its default here
    stored[prediction.machine_key()][API_CREATED] = [21.8 * factor]
    later = prediction.orchestration_part(stored, key, 0.0)
    assert later.seconds == pytest.approx(prediction.DEFAULT_SECONDS["orchestrator API"] * factor + 0.2)
    assert "default: never measured here" in later.source and "under its first start here" in later.source
    # ...where that first start's startup (its creating) was measured apart: the rest of that start, + a later
    # startup (its default until a later start measured one), however slow the first was
    stored[prediction.machine_key()][prediction.API_FIRST_REST] = [8.8]
    later = prediction.orchestration_part(stored, key, 0.0)
    assert later.seconds == pytest.approx(8.8 + prediction.DEFAULT_API_STARTUP * factor + 0.2)
    assert "its first start here but its startup, where it created its database, 8.8 s (measured here" in later.source
    stored[prediction.machine_key()][prediction.API_STARTUP] = [0.3]
    assert prediction.orchestration_part(stored, key, 0.0).seconds == pytest.approx(8.8 + 0.3 + 0.2)
    for name in (prediction.API_FIRST_REST, prediction.API_STARTUP):
        del stored[prediction.machine_key()][name]
    stored[prediction.machine_key()][API_CREATED] = [7.0]
    sample = prediction.JobSample(rows=0, shards=0, lengths=[10])  # the corpus this process wrote: measured
    apart = prediction.main_thread_parts(spec, sample, stored)
    assert [name for name, _, _ in apart] == [READING, TRACKING_OPENED, "writing the sample corpus"]
    assert apart[2][1] == pytest.approx(1.0)


def test_engine_seconds_follow_the_rate_curve_over_length():
    from tokenmill.prediction import rate_at

    points = [(16, 1000.0), (256, 4000.0)]
    assert rate_at(points, 8) == 1000.0 and rate_at(points, 1024) == 4000.0  # flat beyond what was measured
    assert rate_at(points, 64) == pytest.approx(2000.0)  # log-log between: halfway in log length
    # a job whose tokens are mostly in rows beyond every length measured here says that their rate is read flat
    from tokenmill.prediction import flat_beyond

    assert flat_beyond([(20.0, 10_000.0)], [250, 256, 240, 12], 0.0).startswith(
        "; 98% of its tokens in rows of ~250 input tokens, longer than any measured here")
    # the tokens' side and their length, not the rows': 90 short rows, 10 long ones holding most of the tokens
    said = flat_beyond([(100.0, 10_000.0)], [10] * 90 + [1000] * 10, 0.0)
    assert said.startswith("; 92% of its tokens in rows of ~1,000 input tokens, longer than")
    assert flat_beyond([(256.0, 4_000.0)], [10, 12, 16, 300], 0.0) == ""  # 300 within 2x: most tokens
    assert "shorter than any" in flat_beyond([(256.0, 4_000.0)], [10, 12, 16], 0.0)
    assert flat_beyond([(60.0, 200.0)], [20, 24], 32.0) == ""  # generation: its answers count in its rows' length
    assert flat_beyond(points, [8, 40, 250, 500], 0.0) == ""  # within 2x of the lengths measured
    assert flat_beyond([(20.0, 10_000.0)], [18, 22, 30, 50], 0.0) == ""  # most of its tokens within


def test_the_engine_part_says_when_the_rows_rate_is_read_beyond_the_lengths_measured(tmp_path, monkeypatch):
    """A long corpus's first run, its engine's rate measured here only on short rows (runs at ~20 tokens a row):
    its prediction reads that rate and says so; once a run measured its length, it reads that and says nothing."""
    from tokenmill import prediction
    from tokenmill.engine_choice import rates_key

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    spec = _gated_job(tmp_path).model_copy(update={"gate": None})
    parts = {rates_key(spec, "transformers"): {"tokens_per_s@4": [10_000.0], "mean_tokens@4": [20.0]}}
    sample = prediction.JobSample(rows=100, shards=1, lengths=[250] * 100)
    part, tokens = prediction.engine_part(spec, "transformers", sample, [], parts)
    assert part.seconds == pytest.approx(25_000 / 10_000.0) and tokens == 25_000
    assert "100% of its tokens in rows of ~250 input tokens, longer than any measured here" in part.source
    parts[rates_key(spec, "transformers")].update({"tokens_per_s@8": [8_000.0], "mean_tokens@8": [250.0]})
    part, _ = prediction.engine_part(spec, "transformers", sample, [], parts)
    assert part.seconds == pytest.approx(25_000 / 8_000.0) and "longer than any" not in part.source


def test_rows_of_jsonl_shards_are_counted_and_empty_ones_count_none(tmp_path):
    """Each JSONL shard's rows are its non-blank lines, counted (bad lines too: they are rows, rejected), in
    files whose rows differ in length; a corpus whose JSONL files are all empty counts 0 rows for them instead
    of failing the flow before it starts."""
    from tokenmill.planning import counted_rows, rows_per_shard
    from tokenmill.shards import discover_shards_for
    from tokenmill.spec import JobSpec

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": f"a{i}", "text": "x" * 20}) + "\n"
                                              for i in range(10)))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "text": "y" * 400}) + "\n\n"
                                              for i in range(7)) + "not json")
    (tmp_path / "none.jsonl").write_bytes(b"")
    write_parquet(tmp_path / "b.parquet", ["b0", "b1"], ["first", "second"])
    spec = JobSpec(input=str(tmp_path))
    shards = sorted(discover_shards_for(spec), key=lambda s: s.uri)
    assert counted_rows(spec, shards) == ([10, 2, 8, 0], True)
    (tmp_path / "a.jsonl").unlink()
    (tmp_path / "c.jsonl").unlink()
    shards = sorted(discover_shards_for(spec), key=lambda s: s.uri)
    assert rows_per_shard(spec, shards) == [2, 0]


def test_a_jsonl_shards_lines_are_read_once_a_process_until_its_file_changes(tmp_path, monkeypatch):
    """A run counts its corpus for its prediction, its record and its engine's choice: a shard's bytes are read
    for the first; a file rewritten (another size or version: another fingerprint) is counted again."""
    from tokenmill import planning
    from tokenmill.shards import discover_shards_for
    from tokenmill.spec import JobSpec

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"id": f"a{i}", "text": "x"}) + "\n" for i in range(5)))
    spec = JobSpec(input=str(tmp_path))
    reads = []
    read = planning.read_shard_bytes
    monkeypatch.setattr(planning, "read_shard_bytes", lambda shard, options: reads.append(shard) or read(shard, options))
    assert planning.rows_per_shard(spec, discover_shards_for(spec)) == [5]
    assert planning.rows_per_shard(spec, discover_shards_for(spec)) == [5]
    assert len(reads) == 1
    path.write_text("".join(json.dumps({"id": f"a{i}", "text": "x"}) + "\n" for i in range(7)))
    assert planning.rows_per_shard(spec, discover_shards_for(spec)) == [7] and len(reads) == 2


def test_rows_beyond_the_bytes_counted_are_estimated_at_the_counted_shards_bytes_a_row(tmp_path, monkeypatch):
    """Past ROWS_COUNTED_BYTES, a JSONL shard's rows are its bytes at the counted shards' bytes a row, and
    the corpus's estimate says its rows are estimated."""
    from tokenmill import planning
    from tokenmill.shards import discover_shards_for
    from tokenmill.spec import JobSpec

    for name in "pqrs":
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"id": f"{name}{i}", "text": "z" * 50}) + "\n"
                                                        for i in range(20)))
    spec = JobSpec(input=str(tmp_path))
    shards = sorted(discover_shards_for(spec), key=lambda s: s.uri)
    monkeypatch.setattr(planning, "ROWS_COUNTED_BYTES", 2 * shards[0].byte_end)
    assert planning.counted_rows(spec, shards) == ([20, 20, 20, 20], False)


def test_identical_inputs_count_once_in_the_engines_rows(tmp_path, monkeypatch):
    """The run computes an identical input once (row cache and collapse): the prediction's rows are the
    corpus's distinct inputs, and it says so; with both off, every row."""
    from tokenmill import prediction
    from tokenmill.spec import JobSpec

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    texts = [TEXTS[i % 3] for i in range(30)]  # 3 distinct inputs, each 10 times
    write_parquet(tmp_path / "in" / "a.parquet", [f"a{i}" for i in range(20)], texts[:20])
    write_parquet(tmp_path / "in" / "b.parquet", [f"b{i}" for i in range(10)], texts[20:])
    job = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "mode": "embed",
           "model": {"name": "all-MiniLM-L6-v2", "engine": "transformers"}}
    collapsed = prediction.predict_job(JobSpec.model_validate(job))
    assert collapsed.rows == 3
    assert "3 distinct of 30 rows (across shards)" in collapsed.part("engine").source
    within = prediction.predict_job(JobSpec.model_validate({**job, "cache": {"enabled": False}}))
    assert within.rows == 6 and "(within each shard)" in within.part("engine").source  # 3 in each file
    every = prediction.predict_job(JobSpec.model_validate(
        {**job, "cache": {"enabled": False, "collapse_duplicates": False}}))
    assert every.rows == 30 and "distinct" not in every.part("engine").source
    assert every.tokens == pytest.approx(10 * collapsed.tokens)


def test_inputs_repeated_across_the_corpus_weigh_as_one_in_the_sample_lengths(tmp_path, monkeypatch):
    """A corpus whose short rows come twice and whose long rows once: the sample (2,048 of 4,000 rows) holds
    most short inputs once, so its distinct rows alone put them at 1,143 of 1,655 where they are 1,500 of 2,500
    and the tokens 20% under. Each row weighed by its input's copies in the corpus: the tokens the engine
    computes, within a few percent."""
    from tokenmill import prediction
    from tokenmill.encoding import encode_rows
    from tokenmill.models import resolve_model
    from tokenmill.spec import JobSpec

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    short = [f"note {i}" for i in range(1500)]
    long = [f"entry {i}: " + "the quick brown fox jumps over the lazy dog " * 12 for i in range(1000)]
    texts = short + short + long
    order = sorted(range(len(texts)), key=lambda i: (i * 7919) % len(texts))  # copies apart, not in a run
    write_parquet(tmp_path / "in" / "a.parquet", [f"r{i}" for i in range(len(texts))], [texts[i] for i in order])
    spec = JobSpec.model_validate({"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "mode": "embed",
                                   "model": {"name": "all-MiniLM-L6-v2", "engine": "transformers"}})
    distinct = short + long
    truth = sum(len(ids) for ids in encode_rows(distinct, spec, resolve_model(spec.model_name)).token_ids)
    predicted = prediction.predict_job(spec)
    assert predicted.rows == 2500
    assert predicted.tokens == pytest.approx(truth, rel=0.05)
    # the sample's text, what its reading and the shard overhead grow with: the characters of the rows it read
    mean_chars = sum(map(len, texts)) / len(texts)
    assert predicted.chars_per_row == pytest.approx(mean_chars, rel=0.1)
    assert predicted.read_chars > predicted.read_tokens  # several characters a token
    assert "characters" in predicted.part("shard overhead").source


def test_shard_overhead_at_an_unmeasured_length_scales_from_the_nearest_length_measured_here():
    """Reading and tokenizing grow with the rows' length: rows of ~64 tokens read at the overhead measured
    at ~256 tokens a row divided by 4 (not the median over every length, which long rows dominate)."""
    from tokenmill import prediction
    from tokenmill.prediction import DEFAULT_SECONDS, OVERHEAD, overhead_part

    parts = {"here|transformers|embed": {OVERHEAD: [0.05, 1.2, 1.2], f"{OVERHEAD}@4": [0.05], f"{OVERHEAD}@8": [1.2]}}
    at_8 = overhead_part(parts, "here|transformers|embed", 8, 2000)
    assert at_8.seconds == pytest.approx(2.4) and "at this length" in at_8.source
    at_7 = overhead_part(parts, "here|transformers|embed", 7, 2000)
    assert at_7.seconds == pytest.approx(1.2) and "~256 tokens a row" in at_7.source
    at_6 = overhead_part(parts, "here|transformers|embed", 6, 2000)  # as far from 4 as from 8: both, scaled
    assert at_6.seconds == pytest.approx((0.05 * 4 + 1.2 / 4) / 2 * 2)
    assert "~16 tokens a row and ~256 tokens a row" in at_6.source
    unmeasured = overhead_part({}, "here|transformers|embed", 6, 2000)
    assert "default: never measured here" in unmeasured.source
    # 3 classes from any measured: not the median at other lengths (0.05 s of short rows would stand for rows
    # 8x their length), the default scaled to the rows' length
    far = overhead_part(parts, "here|transformers|embed", 11, 2000)
    factor, _ = prediction.machine_speed()
    assert far.seconds == pytest.approx(DEFAULT_SECONDS[OVERHEAD] * factor * 8 * 2)
    assert "default" in far.source and "measured here only at ~256 tokens a row" in far.source


def test_shard_overhead_grows_with_the_text_each_row_is_read_from_not_the_tokens_kept():
    """Documents truncated to the model's 256 tokens are read and tokenized whole: 1,500 docstrings of 3,347
    characters a row took 2.59 s per 1,000 rows where rows of ~1,180 characters and the same tokens took 0.5.
    The overhead measured at a length is scaled by the job's characters a row against the measuring runs';
    the default, stated at OVERHEAD_DEFAULT_CHARS, by the job's."""
    from tokenmill import prediction
    from tokenmill.prediction import OVERHEAD, OVERHEAD_CHARS, OVERHEAD_DEFAULT_CHARS, overhead_part

    key = "here|transformers|embed"
    parts = {key: {f"{OVERHEAD}@8": [0.5], f"{OVERHEAD_CHARS}@8": [1180.0], f"{OVERHEAD}@4": [0.05]}}
    long = overhead_part(parts, key, 8, 1500, chars=3347)
    assert long.seconds == pytest.approx(0.5 * 3347 / 1180 * 1.5)
    assert "3,347 characters a row against 1,180" in long.source
    assert overhead_part(parts, key, 8, 1500, chars=0).seconds == pytest.approx(0.75)  # none counted: as measured
    # a length class away, scaled by the text, not by 2^(classes)
    assert overhead_part(parts, key, 7, 1000, chars=590).seconds == pytest.approx(0.25)
    # @4 stored before its characters were: by the class, as before
    assert overhead_part(parts, key, 5, 1000, chars=150).seconds == pytest.approx(0.1)
    # never measured here: the default, at its characters a row
    factor, _ = prediction.machine_speed()
    default = overhead_part({}, key, 6, 20_000, chars=518)
    assert default.seconds == pytest.approx(prediction.DEFAULT_SECONDS[OVERHEAD] * factor * 518 / OVERHEAD_DEFAULT_CHARS * 20)
    assert f"~{OVERHEAD_DEFAULT_CHARS:,} characters a row" in default.source
    # on another engine of this device and mode only: read from it with its characters
    other = overhead_part(parts, "here|openvino|embed", 8, 1000, chars=2360)
    assert other.seconds == pytest.approx(1.0) and "measured here on transformers" in other.source


def test_shard_overhead_of_several_runs_is_their_lower_quartile_not_one_stall_carried_to_a_larger_job():
    """A run's overhead outside the engine is its rows' work plus the host's stalls, which do not grow with the
    rows: two 1,000-row jobs read 0.2 and 0.5 s per 1,000 rows (run 53) and their median put an 8,000-row job
    at 2.9 s where it took 0.8. The lowest of 2-4 figures, the second lowest of 5, stands for the rows'."""
    from tokenmill.prediction import OVERHEAD, overhead_part

    key = "here|transformers|embed"
    parts = {key: {f"{OVERHEAD}@4": [0.2, 0.5]}}
    at_4 = overhead_part(parts, key, 4, 8000)
    assert at_4.seconds == pytest.approx(0.2 * 8) and "lower quartile of 2 runs" in at_4.source
    five = overhead_part({key: {f"{OVERHEAD}@4": [0.5, 0.1, 0.3, 0.2, 0.9]}}, key, 4, 1000)
    assert five.seconds == pytest.approx(0.2)
    one = overhead_part({key: {f"{OVERHEAD}@4": [0.5]}}, key, 4, 1000)
    assert one.seconds == pytest.approx(0.5) and "median of 1 run" in one.source
    # scaled from the nearest length measured: its lower quartile too
    near = overhead_part(parts, key, 5, 1000)
    assert near.seconds == pytest.approx(0.4) and "lower quartile of 2 runs" in near.source


def test_the_machines_track_record_is_told_beside_a_prediction_and_never_read_into_one(tmp_path, monkeypatch):
    """Under every prediction, how the machine's last runs came out against theirs (any job's: told, so that a
    fleet's plan knows how far predictions held here, never a factor on this job's figures)."""
    from tokenmill import prediction
    from tokenmill.prediction import JobSample, TRACK, TRACK_KEEP, machine_key, predict, remember_track, track_record
    from tokenmill.spec import JobSpec

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    assert track_record() == "On this machine no run has been held against its prediction yet."
    remember_track({"predicted_wall_seconds_to_record": 20.0, "measured_wall_seconds": 23.0})
    assert track_record().startswith("On this machine the last run ran 15% over its prediction")
    remember_track({"predicted_wall_seconds": 20.0})  # a record with nothing measured (a library call's): none
    for measured in (18.0, 20.4, 25.0):
        remember_track({"predicted_wall_seconds_to_record": 20.0, "measured_wall_seconds": measured})
    assert track_record().startswith("On this machine the last 4 runs ran from 10% under to 25% over their "
                                     "predictions (2 of 4 within 10%, median |error| 12%")
    for _ in range(TRACK_KEEP + 3):
        remember_track({"predicted_wall_seconds_to_record": 10.0, "measured_wall_seconds": 10.0})
    assert prediction.read_parts()[machine_key()][TRACK] == [1.0] * TRACK_KEEP
    # predictions read none of it: the same job predicts the same seconds with any record kept
    spec = JobSpec.model_validate({"input": "in", "mode": "embed", "model": {"name": "all-MiniLM-L6-v2",
                                                                             "engine": "transformers"}})
    sample = JobSample(rows=1000, shards=1, lengths=[40] * 64)
    kept = prediction.read_parts()
    wild = {**kept, machine_key(): {**kept[machine_key()], TRACK: [3.0] * TRACK_KEEP}}
    assert predict(spec, sample, kept, []).seconds == predict(spec, sample, wild, []).seconds


def test_orchestration_start_is_what_the_engines_start_does_not_hide():
    """Prefect's API starts beside the main thread and the engine's start: figures measured beside vLLM's
    long start predict transformers' short one, and the reverse."""
    from tokenmill.prediction import orchestration_part

    from tokenmill.prediction import MAIN

    parts = {"here|vllm|embed": {"orchestrator API": [10.0], MAIN: [3.0], "flow start": [1.0]}}
    assert orchestration_part(parts, "here|vllm|embed", 40.0).seconds == pytest.approx(3.0 + 1.0)
    assert orchestration_part(parts, "here|transformers|embed", 0.2).seconds == pytest.approx(10.0 - 0.2 + 1.0)
    assert "measured here on vllm" in orchestration_part(parts, "here|transformers|embed", 0.2).source


def test_a_first_vllm_start_of_a_model_here_pays_its_compile_and_later_starts_load(tmp_path, monkeypatch):
    """vLLM compiles a model on its first start on a machine and keeps the graphs: a start never measured here
    is predicted with the compile; once a start of this model and mode ran here (trial or run, compiling or
    not), none is added, and a start that compiled is never taken for the starts that load."""
    import vllm.envs  # noqa: F401 - its cache root is read from the environment on each access

    from tokenmill import prediction
    from tokenmill.engine_choice import EngineTrial
    from tokenmill.prediction import COMPILING_START, JobSample, engine_key, engine_start_part, first_compile, trials_part
    from tokenmill.spec import JobSpec
    from tokenmill.vllm_engine import compiled_graphs

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    spec = JobSpec.model_validate({"input": "in", "mode": "embed", "model": {"name": "all-MiniLM-L6-v2", "engine": "vllm"}})
    sample = JobSample(rows=100, shards=1, lengths=[20] * 32)
    compile_s, why = first_compile(spec, "vllm", {}, [])
    assert compile_s == pytest.approx(prediction.DEFAULT_VLLM_COMPILE["embed"]) and "first start here compiles" in why
    assert first_compile(spec, "transformers", {}, []) == (0.0, "")
    part = engine_start_part(spec, "vllm", sample, {}, [])
    assert part.seconds == pytest.approx(prediction.default_start("vllm", "embed") + compile_s) and "compiles" in part.source
    trial = trials_part(spec, sample, {}, ["vllm"], [])
    assert f"vllm {prediction.default_start('vllm', 'embed') + compile_s:.1f} s start (default; its first start" in trial.source
    # a run whose start compiled: the next start loads (a default load, no compile), its 80 s not read as a load
    compiled_run = {engine_key(spec, "vllm"): {COMPILING_START: [80.0]}}
    assert first_compile(spec, "vllm", compiled_run, []) == (0.0, "")
    assert engine_start_part(spec, "vllm", sample, compiled_run, []).seconds == pytest.approx(
        prediction.default_start("vllm", "embed"))
    # a trial whose start compiled: neither its trials' part nor the run's start reads its 80 s as a load
    compiled_trial = EngineTrial(engine="vllm", start_seconds=80.0, tokens_per_s=5000.0, rows=32, tokens=640,
                                 seconds=0.1, compiled=True)
    assert prediction.measured_start(spec, "vllm", {}, [(20.0, compiled_trial)]) == (None, "")
    assert first_compile(spec, "vllm", {}, [(20.0, compiled_trial)]) == (0.0, "")
    assert engine_start_part(spec, "vllm", sample, {}, [(20.0, compiled_trial)]).seconds == pytest.approx(
        prediction.default_start("vllm", "embed"))
    loaded = compiled_trial.model_copy(update={"start_seconds": 30.0, "compiled": False})
    assert engine_start_part(spec, "vllm", sample, {}, [(20.0, compiled_trial), (20.0, loaded)]).seconds == 30.0
    # the transformers engine's first run starts in 0.9 of its trial's start (the trial read it from a cold cache);
    # where that trial was the engine's first start here, weighed with its default at this machine's speed
    hf = JobSpec.model_validate({**spec.model_dump(), "model": {"name": "all-MiniLM-L6-v2", "engine": "transformers"}})
    hf_trial = loaded.model_copy(update={"engine": "transformers", "start_seconds": 10.0})
    part = engine_start_part(hf, "transformers", sample, {}, [(20.0, hf_trial)])
    default_here = prediction.default_start("transformers", "embed") * prediction.machine_speed()[0]
    assert part.seconds == pytest.approx((9.0 * default_here) ** 0.5)
    assert "geometric mean of its trial's start x 0.9, 9.0 s" in part.source and "first start here" in part.source
    # a run here started it before (another model): the library is read from memory, the trial's start stands
    other_model = {f"{engine_key(hf, 'transformers').rsplit('|', 2)[0]}|SmolLM2-135M-Instruct|generate":
                   {"engine start": [0.5]}}
    part = engine_start_part(hf, "transformers", sample, other_model, [(20.0, hf_trial)])
    assert part.seconds == pytest.approx(9.0) and part.source.startswith("transformers: its trial's start x 0.9")
    # what tells them apart: a start that adds a folder to vLLM's torch.compile cache compiled
    assert compiled_graphs() == set()
    (tmp_path / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "0a1b").mkdir(parents=True)
    assert compiled_graphs() == {"torch_aot_compile/0a1b"}
    # with vLLM's AOT compile off (a CPU's: keep_compiles_loadable), torch's inductor cache keeps the graphs
    (tmp_path / "inductor" / "fxgraph" / "d5" / "fd5w").mkdir(parents=True)
    (tmp_path / "inductor" / "5u").mkdir()  # a kernel's folder, not a graph
    assert compiled_graphs() == {"torch_aot_compile/0a1b", "inductor/fxgraph/d5/fd5w"}
    (tmp_path / "inductor" / "fxgraph" / "d5" / "fd5w").rmdir()
    # vLLM's cache keeps, beside the graphs, which model's start compiled them: with tokenmill's cache emptied
    # and vLLM's kept, the next start loads them, and the prediction adds no compile
    from tokenmill.models import resolve_model
    from tokenmill.vllm_engine import _index_graphs, graphs_kept

    model_path = resolve_model(spec.model_name)
    assert not graphs_kept(model_path, "embed")
    _index_graphs(model_path, "embed", {"torch_aot_compile/0a1b"})
    assert graphs_kept(model_path, "embed") and not graphs_kept(model_path, "generate")
    compile_s, why = first_compile(spec, "vllm", {}, [])
    assert compile_s == 0 and "holds the graphs" in why
    assert engine_start_part(spec, "vllm", sample, {}, []).seconds == pytest.approx(prediction.default_start("vllm", "embed"))
    (tmp_path / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "0a1b").rmdir()  # vLLM's cache cleared
    assert not graphs_kept(model_path, "embed") and first_compile(spec, "vllm", {}, [])[0] > 0


def test_vllm_on_a_cpu_compiles_into_a_cache_its_next_start_can_load(monkeypatch):
    """vLLM 0.32's AOT-compiled model cannot be loaded back on a CPU (each later start compiled again, 30 s of
    SmolLM2's): on a CPU its AOT compile is turned off unless the user chose; elsewhere left as vLLM sets it."""
    from tokenmill.vllm_engine import keep_compiles_loadable

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    keep_compiles_loadable(False)
    assert "VLLM_USE_AOT_COMPILE" not in os.environ
    keep_compiles_loadable(True)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the user's choice stands
    keep_compiles_loadable(True)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


def test_first_run_trials_are_each_engine_from_its_measured_parts(monkeypatch):
    """A trial at a new length is each engine's start as measured here plus this sample's trial tokens at
    the engine's measured rate, plus the trials' overhead measured besides the engines; an engine never
    measured is at its stated defaults, and the part says which figures are defaults."""
    from tokenmill import prediction
    from tokenmill.engine_choice import EngineTrial
    from tokenmill.prediction import JobSample, engine_key, trial_tokens, trials_key, trials_part
    from tokenmill.spec import JobSpec

    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    spec = JobSpec.model_validate({"input": "in", "mode": "embed", "model": {"name": "all-MiniLM-L6-v2"}})
    sample = JobSample(rows=1000, shards=1, lengths=[200] * 64)
    short = EngineTrial(engine="vllm", start_seconds=30.0, tokens_per_s=5000.0, rows=64, tokens=1280, seconds=0.3)
    parts = {engine_key(spec, "vllm"): {"engine start": [20.0, 22.0]},
             trials_key(spec): {"trial overhead": [2.0]},
             prediction.rates_key(spec, "vllm"): {"tokens_per_s@8": [8000.0], "mean_tokens@8": [200.0]}}
    part = trials_part(spec, sample, parts, ["transformers", "vllm"], [(20.0, short)], kept=True)
    vllm = 22.0 + trial_tokens(spec, sample.lengths, "vllm") / 8000.0  # median of 30, 20, 22
    transformers = (prediction.default_start("transformers", "embed")
                    + trial_tokens(spec, sample.lengths, "transformers") / prediction.default_rate_here("transformers", "embed"))  # the probed compute
    assert part.seconds == pytest.approx(vllm + transformers + 2.0)
    assert "vllm 22.0 s start (measured here, median of 3)" in part.source and "(2 default figures)" in part.source
    assert not part.is_default
    # nothing measured: every figure a default, and the trials' overhead too (the last engine closed)
    none = trials_part(spec, sample, {}, ["transformers", "vllm"], [], kept=False)
    assert none.is_default and none.seconds > transformers + prediction.default_start("vllm", "embed")


def test_auto_is_predicted_as_it_weighs_the_engines_after_this_runs_trials(monkeypatch):
    """Where this run's trials run (a new length), the last engine they start stays open and auto weighs it
    without its start, and the one closed before it at its start again (engine_choice.restart_seconds), as
    engine_choice.choose_engine does; where the trials are kept (none run), every engine at its trial's start."""
    from tokenmill import prediction
    from tokenmill.engine_choice import EngineTrial
    from tokenmill.prediction import JobSample, predicted_engine
    from tokenmill.spec import JobSpec

    monkeypatch.setattr(prediction, "runnable_engines", lambda spec: (["transformers", "vllm"], []))
    spec = JobSpec.model_validate({"input": "in", "mode": "embed", "model": {"name": "all-MiniLM-L6-v2"}})
    sample = JobSample(rows=500, shards=1, lengths=[200] * 64, trial_lengths=[200] * 16)
    trials = [(20.0, EngineTrial(engine="transformers", start_seconds=4.0, tokens_per_s=7000.0, rows=64,
                                 tokens=1280, seconds=0.2)),
              (20.0, EngineTrial(engine="vllm", start_seconds=30.0, tokens_per_s=7500.0, rows=64, tokens=1280,
                                 seconds=0.2))]
    monkeypatch.setattr(prediction, "trials_cached", lambda spec, mean=None: False)  # 200 tokens: never tried
    # 100,000 tokens: 13.3 s against 14.3 and transformers' start again after its trial (0.05 s), not its 4 s
    assert predicted_engine(spec, sample, trials) == ("vllm", "auto, by the trials' starts and rates, vllm open "
                                                              "from its trial")
    monkeypatch.setattr(prediction, "trials_cached", lambda spec, mean=None: True)
    assert predicted_engine(spec, sample, trials) == ("transformers", "auto, by the trials' starts and rates")


def test_a_run_that_ran_its_trials_before_it_predicted_reads_them_measured(tmp_path, monkeypatch):
    """`tokenmill run` of an embedding job on auto with no trials here at its length runs them before it predicts
    (tasks/warm.py: choose_engine_first, once the API answered): the prediction holds the process to their end as
    measured (its imports, its start to the trials, the trials), not each engine at its defaults, then the main
    thread's work after them, and the engine they chose, kept open (the trials' last) or started again; plan and
    calibrate, whose processes ran no trial before a run's prediction, predict the trials. Only an ungated
    embedding job on auto that runs here with no trials kept at its length measures first."""
    from tokenmill import engine_choice, prediction, timeline
    from tokenmill.engine_choice import EngineChoice, EngineTrial
    from tokenmill.prediction import JobSample, predict
    from tokenmill.spec import JobSpec
    from tokenmill.tasks.warm import trials_first

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "docs.parquet", [f"d{i}" for i in range(40)], [TEXTS[i % len(TEXTS)] for i in range(40)])
    job = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    spec = JobSpec.model_validate({**job, "mode": "embed", "model": {"name": "all-MiniLM-L6-v2"}})
    assert trials_first(spec)  # auto, embedding, no trials kept here (an empty cache)
    # not a job on a named engine, a generation job (its answers' probe opens the trials' first engine), a gated
    # job (a gate may change the model)
    for other in ({"model": {"name": "all-MiniLM-L6-v2", "engine": "transformers"}},
                  {"mode": "generate", "model": {"name": "SmolLM2-135M-Instruct"}},
                  {"model": {"name": "all-MiniLM-L6-v2"}, "gate": {"reference": {"name": "all-MiniLM-L6-v2"}}}):
        assert not trials_first(JobSpec.model_validate({**job, **other})), other

    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    monkeypatch.setattr(prediction, "runnable_engines", lambda spec: (["transformers", "vllm"], []))
    monkeypatch.setattr(prediction, "trials_cached", lambda spec, mean=None: False)  # none kept at this length
    sample = JobSample(rows=500, shards=1, lengths=[200] * 64, trial_lengths=[200] * 16)
    trials = [(200.0, EngineTrial(engine=e, start_seconds=s, tokens_per_s=r, rows=16, tokens=3200, seconds=0.5))
              for e, s, r in (("transformers", 4.0, 7000.0), ("vllm", 30.0, 7500.0))]
    before = predict(spec, sample, {}, trials)  # a plan's, or a run's before it ran them: predicted
    assert before.part("engine trials").source.startswith("each engine from its parts")
    t0 = 1000.0
    marks = {"cli_ready": t0 + 2, "api_wait": t0 + 5, "engine_choice_start": t0 + 12, "engine_choice_done": t0 + 60.5}
    monkeypatch.setattr(timeline, "marks", lambda: dict(marks))
    monkeypatch.setattr(timeline, "process_started", lambda: t0)
    monkeypatch.setattr(timeline, "measures_process", lambda: True)
    for chosen, start in (("vllm", "vllm: kept open from its trial"), ("transformers", "transformers: started again")):
        choice = EngineChoice(engine=chosen, reason=f"{chosen} by its trial", trials=[t for _, t in trials],
                              cached=False, cache_key="k", device="cpu-test")
        monkeypatch.setitem(engine_choice._chosen, engine_choice._process_key(spec), choice)
        run = predict(spec, sample, {}, trials)
        assert run.engine == chosen  # the trials' choice, whatever the figures would weigh
        assert run.part("python imports").seconds == pytest.approx(2.0)
        assert run.part("engine trials").seconds == pytest.approx(48.5)
        assert run.part("engine trials").source.startswith("48.5 s before this prediction")
        orchestration = run.part("orchestration start")
        assert orchestration.source.startswith("10.0 s to the trials") and orchestration.seconds > 10.0
        assert run.part("engine start").source.startswith(start)
        assert (run.part("engine start").seconds == 0.0) == (chosen == "vllm")
        assert run.seconds > 2.0 + 10.0 + 48.5 + run.part("engine").seconds
    # the same choice made in a process that did not measure from its start (a library call, a later job), or
    # before the command's start (a plan's own choice): no trials before its prediction, and its engine weighed
    # by the trials' figures as a run weighs them, every start counted (transformers: 4 s against vllm's 30)
    monkeypatch.setattr(timeline, "measures_process", lambda: False)
    monkeypatch.setattr(prediction, "trials_cached", lambda spec, mean=None: True)
    plan = predict(spec, sample, {}, trials)
    assert plan.part("engine trials") is None and plan.engine == "transformers"
    assert plan.part("python imports").source != "this process, measured"


def test_the_samples_reading_follows_the_tokens_it_reads_from_runs_here():
    """The prediction reads the job's sample on the main thread: what that takes grows with the tokens read
    (long rows, a larger sample), so it is its own part, read off the runs here by the tokens each read."""
    from tokenmill import prediction
    from tokenmill.prediction import (DEFAULT_READING_PER_CHAR, MAIN, READ_CHARS, READ_TOKENS, READING,
                                      orchestration_part, reading_key, reading_part)

    key = reading_key("embed")
    one = {key: {READING: [0.2], READ_TOKENS: [20_000.0]}}
    seconds, source = reading_part(one, "embed", 200_000)  # one run: its seconds, the rest at the default rate
    factor, _ = prediction.machine_speed()
    assert seconds == pytest.approx(0.2 + 180_000 * prediction.DEFAULT_READING_PER_TOKEN * factor)
    assert "a run here read 20,000" in source and "default" in source
    two = {key: {READING: [0.2, 0.6], READ_TOKENS: [20_000.0, 220_000.0]}}
    seconds, source = reading_part(two, "embed", 120_000)  # two runs far apart: the line through them
    assert seconds == pytest.approx(0.4) and "line through 2 runs" in source
    assert reading_part({}, "generate", 1_000)[1].startswith("default: never measured here")
    # by the characters read, where the sample counted them and runs here stored theirs: truncation keeps 256
    # tokens of a long document, its reading and tokenizing cost by the whole text
    by_text = {key: {READING: [0.2, 0.9, 4.0], READ_TOKENS: [30_000.0, 200_000.0, 450_000.0],
                     READ_CHARS: [1_000_000.0, 6_000_000.0]}}  # the first run stored no characters
    chars_seconds, chars_source = reading_part(by_text, "embed", 450_000, 3_500_000)
    assert chars_seconds == pytest.approx(0.9 + (4.0 - 0.9) / 5_000_000 * 2_500_000)
    assert "3,500,000 characters on the line through 2 runs" in chars_source
    # none counted: by the tokens; their line through those runs would start below 0 s (the long text's tokens
    # cost more each), so the nearest run's
    assert "450,000 tokens: a run here read 450,000 in 4.00 s" in reading_part(by_text, "embed", 450_000)[1]
    assert "tokens" in reading_part(two, "embed", 120_000, 500_000)[1]  # no run here stored its characters
    default, source_default = reading_part({}, "embed", 1_000, 50_000)
    assert default == pytest.approx((prediction.DEFAULT_READING["embed"] + 50_000 * DEFAULT_READING_PER_CHAR) * factor)
    assert "us a character" in source_default
    parts = {"here|transformers|embed": {"orchestrator API": [1.0], MAIN: [2.0], "flow start": [0.0]}}
    part = orchestration_part(parts, "here|transformers|embed", 0.0, [(READING, seconds, source)])
    assert part.seconds == pytest.approx(2.4) and "reading the sample 0.4 s" in part.source


def test_embedding_calls_give_each_length_their_own_rate_for_runs_and_gates(tmp_path):
    """A corpus of short and long rows: the rate at each length its calls spent time on, not one rate at a mean
    length no row has; a class of a few calls (under LENGTH_CLASS_SHARE of the seconds) gives none. The gate's
    models' samples are priced the same way, each model at its rates by length."""
    from tokenmill.engine_choice import class_rates
    from tokenmill.gate import CandidateVerdict, GateReport, ModelCost
    from tokenmill.prediction import _add_rate_parts, gate_samples_seconds, rates_key
    from tokenmill.tasks.job import PrefectJob

    from tokenmill.call_costs import embed_call

    calls = [embed_call([16] * 1000, 0.6), embed_call([17] * 1000, 0.6), embed_call([256] * 1000, 8.0),
             embed_call([64] * 10, 0.05)]
    rates = class_rates(calls)
    assert set(rates) == {4, 8}  # 64 tokens a row: 0.05 s of 9.25, under the share
    assert rates[4] == pytest.approx((33_000 / 2000, 33_000 / 1.2)) and rates[8] == pytest.approx((256.0, 32_000.0))
    spec = PrefectJob.model_validate({"input": str(tmp_path), "output": str(tmp_path / "out"), "mode": "embed",
                                      "model": {"name": "all-MiniLM-L6-v2", "engine": "openvino"}})
    out: dict = {}
    _add_rate_parts(out, spec, "openvino", {"engine_seconds": 9.25, "engine_tokens": 289_640.0}, 2010, calls)
    stored = out[rates_key(spec, "openvino")]
    assert set(stored) == {"tokens_per_s@4", "mean_tokens@4", "tokens_per_s@8", "mean_tokens@8"}
    single: dict = {}  # calls not timed apart (streams at once): the run's one rate at its mean length
    _add_rate_parts(single, spec, "openvino", {"engine_seconds": 9.25, "engine_tokens": 289_640.0}, 2010)
    assert set(single[rates_key(spec, "openvino")]) == {"tokens_per_s@7", "mean_tokens@7"}

    def cost(rate, by_length=None):
        return ModelCost(model="m", engine="openvino", seconds=1.0, tokens=1000, tokens_per_s=rate,
                         usd_per_1m_tokens=1.0, rates_by_length=by_length or {})

    verdict = GateReport(mode="embed", sample_rows=256, sample_source="s", passed=True, metrics=[],
                         reference=cost(30_000.0, {"4": [16.0, 40_000.0], "8": [256.0, 20_000.0]}),
                         candidate=cost(50_000.0), action="candidate",
                         candidates=[CandidateVerdict(cost=cost(50_000.0), metrics=[], passed=True)], chosen=0)
    seconds = gate_samples_seconds(verdict, [256] * 10, 100)  # a corpus of long rows
    assert seconds == pytest.approx(100 * 256 / 20_000.0 + 100 * 256 / 50_000.0)
    # the untimed pass before each timed one (gate.run_sample), as long over the timed pass as it measured
    cold = cost(50_000.0).model_copy(update={"untimed_seconds": 1.6})
    verdict = verdict.model_copy(update={"candidates": [CandidateVerdict(cost=cold, metrics=[], passed=True)]})
    seconds = gate_samples_seconds(verdict, [256] * 10, 100)
    assert seconds == pytest.approx(100 * 256 / 20_000.0 + 2.6 * 100 * 256 / 50_000.0)


def test_the_main_thread_of_a_run_with_trials_stands_in_until_a_warm_run_measures_it():
    """A first run's main thread (generation's includes transformers' import for the chat template, 6-15 s)
    is stored apart from a warm run's, and read only where no warm run measured it."""
    from tokenmill.prediction import MAIN, MAIN_BESIDE_TRIAL, MAIN_FROM_TRIAL, orchestration_part

    first = {"here|vllm|generate": {"orchestrator API": [3.0], MAIN_BESIDE_TRIAL: [12.0], "flow start": [0.5]}}
    part = orchestration_part(first, "here|transformers|generate", 0.5)
    assert part.seconds == pytest.approx(12.0 * MAIN_FROM_TRIAL + 0.5) and "in runs with trials" in part.source
    warm = {"here|transformers|generate": {MAIN: [9.0]}, **first}
    assert orchestration_part(warm, "here|transformers|generate", 0.5).seconds == pytest.approx(9.0 + 0.5)


def test_a_main_thread_with_no_engine_starting_beside_it_is_read_apart():
    """A gated job starts no engine beside the API: its main thread imports alone what an engine's import shares
    with MLflow's. Read from such runs here; never measured, the other runs' figure and a stated extra."""
    from tokenmill import prediction
    from tokenmill.prediction import MAIN, MAIN_ALONE, orchestration_part

    parts = {"here|openvino|embed": {"orchestrator API": [1.0], MAIN: [2.0], "flow start": [0.0]}}
    with_engine = orchestration_part(parts, "here|openvino|embed", 0.0)
    alone = orchestration_part(parts, "here|openvino|embed", 0.0, alone=True)
    factor, _ = prediction.machine_speed()
    assert with_engine.seconds == pytest.approx(2.0)
    assert alone.seconds == pytest.approx(2.0 + prediction.DEFAULT_ALONE_EXTRA * factor) and alone.is_default
    # measured only in the machine's first run (`make run` on a new machine): a later run's share of it
    parts["here|openvino|embed"].update({prediction.MAIN_FIRST_ALONE: [1.4], "orchestrator API": [0.5]})
    after_first = orchestration_part(parts, "here|openvino|embed", 0.0, alone=True)
    assert after_first.seconds == pytest.approx(1.4 * prediction.MAIN_FROM_TRIAL) and not after_first.is_default
    assert "in the machine's first run: 1.4 s x 0.7" in after_first.source
    parts["here|openvino|embed"][MAIN_ALONE] = [2.7]
    measured = orchestration_part(parts, "here|openvino|embed", 0.0, alone=True)
    assert measured.seconds == pytest.approx(2.7) and not measured.is_default


def test_defaults_scale_by_the_machines_speed_stored_once_for_every_command(tmp_path, monkeypatch):
    """A default is a quiet reference machine's figure: scaled by this machine's speed (the first command's
    interpreter probe here against the reference's), seconds up and tokens/s down; once stored, every command reads
    the same figure, until runs probed here: then their lower quartile. A library call that never measured it leaves the defaults as stated."""
    from tokenmill import prediction

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    assert prediction.machine_speed() == (1.0, "")
    assert prediction.stored({}, "cpu-test|vllm|embed", "exit", 3.5)[0] == 3.5
    prediction.remember_parts({"cpu-test|machine": {prediction.INTERPRETER: 2 * prediction.DEFAULT_INTERPRETER_MS}})
    assert prediction.machine_speed()[0] == pytest.approx(2.0)
    seconds, source = prediction.stored({}, "cpu-test|vllm|embed", "exit", 3.5)
    assert seconds == pytest.approx(7.0) and "x 2.00 (this machine's speed" in source
    # tokens/s are the compute's, not the interpreter's: a CPU's probe (test below), the interpreter's figure on a GPU
    monkeypatch.setattr(prediction, "device_label", lambda: "gpu-test")
    prediction.remember_parts({"gpu-test|machine": {prediction.INTERPRETER: 2 * prediction.DEFAULT_INTERPRETER_MS}})
    assert prediction.default_rate_here("vllm", "embed") == pytest.approx(prediction.default_rate("vllm", "embed") / 2)
    assert prediction.compute_speed("embed")[1].startswith(" / 2.00 (this machine's speed")
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    measured = {"cpu-test|vllm|embed": {"exit": [1.0]}}
    assert prediction.stored(measured, "cpu-test|vllm|embed", "exit", 3.5)[0] == 1.0  # a measured part: as measured
    # each run adds its command's probe (any job): their lower quartile, not one process's figure
    for probed in (24.0, 20.0, 90.0):  # 90: one loaded run
        prediction.remember_parts({"cpu-test|machine": {prediction.INTERPRETER: probed}})
    prediction.remember_parts({"other-device|machine": {prediction.INTERPRETER: 200.0}})  # another device's
    factor, why = prediction.machine_speed()
    lowest = 20.0  # the lower quartile of 4: the lowest: 2x the default (21.4), 24, 20, 90
    assert factor == pytest.approx(lowest / prediction.DEFAULT_INTERPRETER_MS)
    assert f"the lower quartile of 4 commands' interpreter probes here, {lowest:.1f} ms" in why
    # with the commands' imports' wall seconds stored beside the probe: the two factors' geometric mean
    by_probe = lowest / prediction.DEFAULT_INTERPRETER_MS
    prediction.remember_parts({"cpu-test|machine": {prediction.IMPORTS: 4 * prediction.DEFAULT_SECONDS["python imports"]}})
    factor, why = prediction.machine_speed()
    assert factor == pytest.approx(math.sqrt(by_probe * 4.0))
    assert why.startswith(f" x {factor:.2f} (this machine's speed: the geometric mean of {by_probe:.2f} (the lower "
                          f"quartile of 4 commands' interpreter probes here, {lowest:.1f} ms, against ")
    assert why.endswith(" ms) and 4.00 (a command's imports here, 5.6 s, against 1.4 s))")
    seconds, source = prediction.stored({}, "cpu-test|vllm|embed", "exit", 3.5)
    assert seconds == pytest.approx(3.5 * factor) and "geometric mean" in source
    prediction.remember_parts({"gpu-test|machine": {prediction.IMPORTS: 2 * prediction.DEFAULT_SECONDS["python imports"]}})
    monkeypatch.setattr(prediction, "device_label", lambda: "gpu-test")
    assert prediction.machine_speed()[0] == pytest.approx(2.0)  # sqrt(2 x 2)
    # generation's default rates stay on the interpreter's figure alone (small products a step, no imports)
    assert prediction.compute_speed("generate")[0] == pytest.approx(2.0)


def test_a_process_start_is_read_on_the_clock_its_ticks_count_on():
    """A run's imports and wall count from its process's start: read against the boot clock, it lies between the
    parent's spawn and the child's first line (/proc/stat's whole-second boot time put it up to 1 s off, the
    same for every process of a boot)."""
    import subprocess
    import sys
    import time as clock

    code = "import time; from tokenmill import timeline; print(time.time() - timeline.process_started())"
    for _ in range(3):
        spawned = clock.time()
        since_start = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)
        bracket = clock.time() - spawned
        assert -0.02 <= since_start <= bracket + 0.02  # a clock tick (10 ms) either side


def test_a_command_probes_the_interpreter_once_a_process_and_nothing_else_does(monkeypatch):
    """The machine's speed is a command's: the first job of a process the CLI started probes the interpreter in a
    fresh one (tokenmill.device.interpreter_ms, a real run here), once a process however often it is asked; a
    later job of the process, or a library call that no command started, probes nothing, and a probe that
    cannot run leaves the defaults as stated."""
    from tokenmill import device, prediction, timeline

    probed = device.interpreter_ms()
    assert 0 < probed < 10_000  # milliseconds of a fresh interpreter's rounds, parsed from its output
    calls = []
    monkeypatch.setattr(prediction, "interpreter_ms", lambda: calls.append(1) or 12.345)
    monkeypatch.setattr(prediction, "_interpreter_probed", None)
    kept = dict(timeline._marks), timeline._first_job  # this process's, put back after
    try:
        timeline.reset()
        timeline._first_job = True
        assert prediction.command_interpreter_ms() is None  # no command marked: a library call
        assert prediction.command_imports_seconds() is None
        timeline.mark("command_ready")
        assert prediction.command_interpreter_ms() == 12.35 and prediction.command_interpreter_ms() == 12.35
        assert prediction.command_imports_seconds() is None  # main() called in this (pytest's) process
        timeline.mark("command_process")  # as cli.command marks it in a process started as the command
        since_start = time.time() - timeline.process_started()  # this process's start to now: the imports' bound
        assert 0 < prediction.command_imports_seconds() <= since_start + 0.01
        assert len(calls) == 1  # once a process
        timeline._first_job = False
        assert prediction.command_interpreter_ms() is None  # a later job of the process: not the command's
        assert prediction.command_imports_seconds() is None
        timeline._first_job = True
        monkeypatch.setattr(prediction, "_interpreter_probed", None)
        monkeypatch.setattr(prediction, "interpreter_ms", lambda: 1 / 0)
        assert prediction.command_interpreter_ms() is None
        # the readings the command started as it was ready (tokenmill.cli), where it started them: their fastest
        started = device.InterpreterProbes(readings=2, gap=30)  # asked before the second: the first's
        monkeypatch.setattr(device, "_command_probes", started)
        monkeypatch.setattr(prediction, "_interpreter_probed", None)
        assert prediction.command_interpreter_ms() == round(started.readings[0], 2) > 0
        assert device.take_interpreter_probes() is None and started._process.poll() is not None  # taken, ended
    finally:
        timeline.reset()
        timeline._marks.update(kept[0])
        timeline._first_job = kept[1]


def test_a_commands_interpreter_probes_read_seconds_apart_and_end_with_it(monkeypatch, tmp_path):
    """tokenmill.device.InterpreterProbes, real: a fresh interpreter prints its readings the gap apart, best() is
    the fastest so far and ends the readings not yet taken (a first command asks seconds in, not after all of
    them); a command that reads them starts them as it is ready, once a process (a run always, a plan only where
    no figure is stored here), and none outlives the command, even one that fails before anything read them."""
    from tokenmill import cli, device, prediction, timeline

    probes = device.InterpreterProbes(readings=3, gap=0.3)
    deadline = time.monotonic() + 60
    while len(probes.readings) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(probes.readings) == 3 and all(0 < ms < 10_000 for ms in probes.readings)
    probes._reader.join(timeout=10)  # its readings done, it exited: reaped, not a zombie child of the command
    assert probes._process.returncode is not None  # set by a wait, not by best() or stop() (not called yet)
    assert probes.best() == min(probes.readings[:3]) and probes._process.poll() is not None

    waiting = device.InterpreterProbes(readings=4, gap=30)
    asked = time.monotonic()
    first = waiting.best()
    assert first == waiting.readings[0] > 0 and len(waiting.readings) == 1  # not the 90 s of the others
    assert time.monotonic() - asked < 25 and waiting._process.poll() is not None

    started = []

    class Recorded(device.InterpreterProbes):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(device, "InterpreterProbes", Recorded)
    monkeypatch.setattr(prediction, "_interpreter_probed", None)
    stored = {prediction.machine_key(): {prediction.INTERPRETER: [19.5]}}
    monkeypatch.setattr(prediction, "read_parts", lambda: stored)
    kept = dict(timeline._marks), timeline._first_job  # this process's, put back after
    try:
        for command in (["search", "--index", str(tmp_path / "none"), "a query"],  # predicts nothing
                        ["plan", "--config", str(tmp_path / "missing.yaml"), "--window", "1h"]):  # a figure stored
            monkeypatch.setattr(device, "_probes_started", False)
            timeline._first_job = True
            assert cli.main(command) == 2 and not started
        stored.clear()  # none stored: a plan reads the command's; and a run's record stores it
        for command in ("plan", "run"):
            monkeypatch.setattr(device, "_probes_started", False)
            timeline._first_job = True
            argv = [command, "--config", str(tmp_path / "missing.yaml"), *(["--window", "1h"] * (command == "plan"))]
            assert cli.main(argv) == 2  # fails before any prediction read them
            assert started and started[-1]._process.poll() is not None and device._command_probes is None
            assert cli.main(argv) == 2 and len(started) == 1 + (command == "run")  # once a process
        assert len(started) == 2
    finally:
        timeline.reset()
        timeline._marks.update(kept[0])
        timeline._first_job = kept[1]


def test_a_cpus_default_rates_follow_its_probed_compute_stored_once_not_its_interpreter_nor_int8_runs(tmp_path, monkeypatch):
    """Before any run here, a CPU's default embedding tokens/s are divided by the defaults' machine's matrix-product rate
    over this one's (one core's probe times the cores), probed by the first command and stored, so every later
    command divides alike; a machine whose interpreter is slow but whose cores are fast computes fast. Once a
    run measured an engine against its default, that measurement rules."""
    from tokenmill import device, prediction

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    monkeypatch.setattr(prediction, "usable_cores", lambda: 2)
    probes = []
    monkeypatch.setattr(prediction, "command_model_probe", lambda: None)  # a library call's: no model probe
    monkeypatch.setattr(prediction, "core_gflops", lambda: probes.append(1) or prediction.DEFAULT_GFLOPS)
    prediction.remember_parts({"cpu-test|machine": {prediction.INTERPRETER: 3 * prediction.DEFAULT_INTERPRETER_MS}})
    factor, why = prediction.compute_speed("embed")
    assert factor == pytest.approx(0.5) and "x 2 cores" in why and why.startswith(" / 0.50")
    assert prediction.default_rate_here("transformers", "embed") == pytest.approx(2 * prediction.default_rate("transformers", "embed"))
    assert prediction.compute_speed("embed")[0] == pytest.approx(0.5) and len(probes) == 1  # stored: probed once
    assert prediction.machine_speed()[0] == pytest.approx(3.0)  # seconds still scale by the interpreter's figure
    # generation (small products a step: the interpreter's pace) by the interpreter's figure, dividing
    factor, why = prediction.compute_speed("generate")
    assert factor == pytest.approx(3.0) and why.startswith(" / 3.00 (this machine's speed")
    # an int8 run (make run's gate) measures its quantization's speedup as much as the machine: not float32's rates
    int8 = prediction.default_rate("openvino", "embed", "int8")
    prediction.remember_parts({"cpu-test|machine": {prediction.compute_key("embed", "int8", "openvino"): int8 / 0.3}})
    assert prediction.compute_speed("embed")[0] == pytest.approx(0.5)
    assert prediction.compute_speed("embed", "int8")[0] == pytest.approx(0.3, rel=1e-4)
    vllm = prediction.default_rate("vllm", "embed")
    prediction.remember_parts({"cpu-test|machine": {prediction.compute_key("embed", None, "vllm"): vllm / 1.25}})
    assert prediction.compute_speed("embed")[0] == pytest.approx(1.25, rel=1e-4)  # a run's measurement rules its mode
    assert prediction.compute_speed("embed", "int8")[0] == pytest.approx(0.3, rel=1e-4)
    assert prediction.compute_speed("embed", "int4")[0] == pytest.approx(1.25, rel=1e-4)  # none measured: float32's
    assert prediction.compute_speed("generate")[0] == pytest.approx(3.0)
    # each engine's runs against its own default, and against today's: a default changed since the runs moves
    # the factor with it, not every later prediction by the change
    transformers = prediction.default_rate("transformers", "embed")
    for factor in (1.5, 1.75):
        prediction.remember_parts({"cpu-test|machine": {prediction.compute_key("embed", None, "transformers"):
                                                        transformers / factor}})
    assert prediction.compute_speed("embed")[0] == pytest.approx(1.5, rel=1e-4)  # median of 1.25, 1.5, 1.75
    monkeypatch.setitem(prediction.DEFAULT_TOKENS_PER_S_BY_MODE, "embed", 2 * prediction.DEFAULT_TOKENS_PER_S_BY_MODE["embed"])
    assert prediction.compute_speed("embed")[0] == pytest.approx(3.0, rel=1e-4)  # median of 1.25, 3.0, 3.5
    gflops = device.core_gflops()  # the real probe: one core's float32 products, a positive finite rate
    assert 0.1 < gflops < 10_000


def test_a_commands_model_probe_rules_a_first_prediction_measured_as_its_own_part_and_a_library_call_never_runs_it(
        tmp_path, monkeypatch):
    """The first command that predicts an embedding job on a CPU no run measured probes a MiniLM-shaped encoder
    as the transformers engine runs it (tokenmill.device.model_tokens_per_s, a real run here), stores it, and
    divides the transformers default by it times the cores, the other engines' by their ratios to it; the
    probe's seconds are a part of the prediction and not the main thread's stored seconds; a later command
    reads the stored figure; a library call that no command started falls back to the products' probe and
    never runs a model; a run's measurement rules over both."""
    from tokenmill import device, prediction, timeline
    from tokenmill.spec import JobSpec

    job = JobSpec.model_validate({"input": "in", "mode": "embed", "model": {"name": "all-MiniLM-L6-v2"}})
    rate = device.model_tokens_per_s()
    assert rate is not None and 10 < rate < 10_000_000  # one core's tokens/s, parsed from a fresh interpreter
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    monkeypatch.setattr(prediction, "usable_cores", lambda: 2)
    monkeypatch.setattr(prediction, "core_gflops", lambda: prediction.DEFAULT_GFLOPS / 2)  # factor 1.0
    reference = prediction.default_rate("transformers", "embed")
    calls = []
    monkeypatch.setattr(prediction, "model_tokens_per_s", lambda: calls.append(1) or reference / 8)
    monkeypatch.setattr(prediction, "_model_probed", None)
    kept = dict(timeline._marks), timeline._first_job
    try:
        timeline.reset()
        timeline._first_job = True
        factor, why = prediction.compute_speed("embed")  # a library call: the products' probe, no model
        assert factor == pytest.approx(1.0) and "matrix products" in why and calls == []
        monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "fresh"))
        timeline.mark("command_ready")
        timeline.mark("cli_ready")  # a run's: a plan's probe predicts a run that will not probe
        factor, why = prediction.compute_speed("embed")
        assert factor == pytest.approx(4.0 / prediction.MODEL_PROBE_SCALE, rel=1e-4) and "MiniLM-shaped" in why and calls == [1]
        assert prediction.default_rate_here("openvino", "embed", "int8") == pytest.approx(
            reference / 4 * prediction.default_rate("openvino", "embed", "int8") / reference, rel=1e-4)
        marks = timeline.marks()
        assert {"model_probe_start", "model_probe_done"} <= set(marks)
        apart = prediction.main_thread_parts(job, prediction.JobSample(rows=24, shards=1, lengths=[10]), {})
        # `tokenmill run` probes before the API starts (no api_start yet): its seconds first, then the API's start
        (probed,) = [(sec, why) for name, sec, why in apart if name == prediction.MODEL_PROBE_BEFORE_API]
        assert prediction.MODEL_PROBE_PART not in [name for name, _, _ in apart] and "before the API" in probed[1]
        parts = {"k": {"orchestrator API": [9.0], prediction.MAIN: [1.0], "flow start": [0.5]}}
        alone = prediction.orchestration_part(parts, "k", 0.0, [])
        first = prediction.orchestration_part(parts, "k", 0.0, [(prediction.MODEL_PROBE_BEFORE_API, 3.0, "m")])
        beside = prediction.orchestration_part(parts, "k", 0.0, [(prediction.MODEL_PROBE_PART, 3.0, "m")])
        assert (alone.seconds, first.seconds, beside.seconds) == pytest.approx((9.5, 12.5, 9.5))
        timeline._marks["api_start"] = timeline._marks["model_probe_start"]  # a probe that ran beside the API
        assert [name for name, _, _ in prediction.main_thread_parts(
            job, prediction.JobSample(rows=24, shards=1, lengths=[10]), {})].count(prediction.MODEL_PROBE_PART) == 1
        timeline.reset()  # another command, the figure stored: read, not probed again
        timeline._first_job = True
        timeline.mark("command_ready")
        monkeypatch.setattr(prediction, "_model_probed", None)
        assert prediction.compute_speed("embed")[0] == pytest.approx(4.0, rel=1e-4) and calls == [1]
        assert prediction.MODEL_PROBE_PART not in [name for name, _, _ in prediction.main_thread_parts(
            job, prediction.JobSample(rows=24, shards=1, lengths=[10]), {})]
        transformers = prediction.default_rate("transformers", "embed")
        prediction.remember_parts({"cpu-test|machine": {prediction.compute_key("embed", None, "transformers"):
                                                        transformers / 1.5}})
        assert prediction.compute_speed("embed")[0] == pytest.approx(1.5, rel=1e-4)  # a run's measurement rules
        # a probe that cannot run here: stored as such, the products' probe read, and no later command tries again
        monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "no-torch"))
        monkeypatch.setattr(prediction, "model_tokens_per_s", lambda: calls.append(2) or None)
        monkeypatch.setattr(prediction, "_model_probed", None)
        factor, why = prediction.compute_speed("embed")
        assert factor == pytest.approx(1.0) and "matrix products" in why and calls == [1, 2]
        monkeypatch.setattr(prediction, "_model_probed", None)  # another command's process
        assert "matrix products" in prediction.compute_speed("embed")[1] and calls == [1, 2]
    finally:
        timeline.reset()
        timeline._marks.update(kept[0])
        timeline._first_job = kept[1]
    t0 = 1000.0  # the probe's seconds, on the main thread before the prediction: not the main thread's own
    spans = {"process": t0, "cli_ready": t0 + 3, "api_start": t0 + 3, "model_probe_start": t0 + 3.2,
             "model_probe_done": t0 + 6.2, "early_engine_start": t0 + 7, "early_engine_ready": t0 + 9,
             "tracking_warm": t0 + 10, "api_ready": t0 + 8, "flow_called": t0 + 10.5}
    assert prediction._process_parts(spans, False, 2.0)[prediction.MAIN] == pytest.approx(7 - 2 - 3)
    # `tokenmill run`'s order: the probe, then the API's start; the probe still out of the main thread's seconds,
    # and out of the API's
    first = {**spans, "api_start": t0 + 6.2}
    assert prediction._process_parts(first, False, 2.0)[prediction.MAIN] == pytest.approx(7 - 2 - 3)
    assert prediction._process_parts(first, False, 2.0)["orchestrator API"] == pytest.approx(8 - 6.2)
    assert prediction._model_probe({**spans, "model_probe_start": t0 + 11, "model_probe_done": t0 + 12}) == 0.0


def test_the_interpreter_probe_reads_its_lower_quartile_a_neighbours_slow_figures_left_out(tmp_path, monkeypatch):
    """What slows the interpreter probe only slows it: the machine's speed reads the lower quartile of the
    commands' last probes here (the second lowest of five), where the imports' figure stays their median."""
    from tokenmill import prediction

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    reference = prediction.DEFAULT_INTERPRETER_MS
    for ms in (2.1, 1.5, 2.2, 2.4, 1.4):
        prediction.remember_parts({"cpu-test|machine": {prediction.INTERPRETER: ms * reference}})
    factor, why = prediction.interpreter_speed()
    assert factor == pytest.approx(1.5) and why.startswith("the lower quartile of 5")
    assert prediction.lower_quartile([3.0]) == 3.0 and prediction.lower_quartile([4.0, 2.0, 3.0]) == 2.0
    for seconds in (2.0, 1.0, 3.0):
        prediction.remember_parts({"cpu-test|machine": {prediction.IMPORTS: seconds * prediction.DEFAULT_SECONDS["python imports"]}})
    assert prediction.imports_speed()[0] == pytest.approx(2.0)
    assert prediction.machine_speed()[0] == pytest.approx((1.5 * 2.0) ** 0.5)


def test_output_length_is_read_only_from_trials_of_the_same_corpus_and_prompt():
    """How long a generation's answers run belongs to its corpus and prompt: a trial of another corpus (same
    model, mode and length class) gives the job's default, 0.9 of its cap, not that corpus's answers."""
    from tokenmill.engine_choice import EngineTrial, output_identity, output_tokens_per_row
    from tokenmill.spec import JobSpec

    def job(input_, content="Summarize: {text}"):
        return JobSpec.model_validate({"input": input_, "mode": "generate", "model": {"name": "SmolLM2-135M-Instruct"},
                                       "generation": {"max_tokens": 64,
                                                      "messages": [{"role": "user", "content": content}]}})

    a, b, a_asked_otherwise = job("corpus-a"), job("corpus-b"), job("corpus-a", "Classify: {text}")
    trial = EngineTrial(engine="transformers", start_seconds=1.0, tokens_per_s=100.0, rows=12, tokens=1200,
                        seconds=12.0, output_tokens=12 * 18, corpus=output_identity(a))
    assert output_tokens_per_row(a, [trial]) == pytest.approx(18.0)
    assert output_tokens_per_row(b, [trial]) == pytest.approx(0.9 * 64)
    assert output_tokens_per_row(a_asked_otherwise, [trial]) == pytest.approx(0.9 * 64)
    assert output_identity(a) == output_identity(a.model_copy(update={"generation": a.generation.model_copy(
        update={"max_tokens": 16})}))  # the cap is not part of it: the trial runs at its own


def _gated_job(tmp_path, rows: int = 40):
    from tokenmill.tasks.job import PrefectJob

    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "docs.parquet", [f"d{i}" for i in range(rows)],
                  [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(rows)])
    return PrefectJob.model_validate({
        "input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "mode": "embed",
        "gate": {"reference": {"name": "all-MiniLM-L6-v2", "engine": "transformers"},
                 "candidates": [{"name": "all-MiniLM-L6-v2", "engine": "onnxruntime", "quantization": "int8"}],
                 "sample_rows": 16}})


def test_another_corpuss_verdict_picks_again_at_this_corpuss_lengths(tmp_path):
    """A verdict on another corpus's sample, judged again at this corpus's lengths: each model at its rate
    there by length (where it timed its calls by length), so the pick is the cheapest on rows like these."""
    from tokenmill import prediction
    from tokenmill.gate import CandidateVerdict, GateReport, ModelCost

    spec = _gated_job(tmp_path)

    def cost(model: str, rate: float, curve: dict | None = None) -> ModelCost:
        return ModelCost(model=model, engine="x", seconds=1.0, tokens=16 * 60, tokens_per_s=rate,
                         usd_per_1m_tokens=1e3 / rate, rates_by_length=curve or {})

    verdict = GateReport.judge(spec, "another corpus", 16, cost("ref", 8000.0, {"5": [33, 7000], "8": [240, 8000]}), [
        CandidateVerdict(cost=cost("by length", 15000.0, {"5": [33, 12000], "8": [240, 21000]}), metrics=[],
                         passed=True),
        CandidateVerdict(cost=cost("overall", 17000.0), metrics=[], passed=True)])
    assert verdict.chosen == 1  # over the other corpus's sample
    long_rows = prediction.judged_at(spec, verdict, [250] * 8)
    assert long_rows.chosen == 0 and long_rows.candidates[0].cost.tokens_per_s == pytest.approx(21000)
    assert long_rows.candidates[0].cost.tokens == 16 * 250  # its tokens as these rows': kept_rate's mean
    assert prediction.kept_rate(long_rows, "here")[:2] == (pytest.approx(250), pytest.approx(21000))
    assert prediction.judged_at(spec, verdict, [20] * 8).chosen == 1  # short rows: 12,000 against 17,000
    assert prediction.judged_at(spec, verdict, []).chosen == 1


def test_a_gated_job_is_predicted_with_its_gate_then_the_model_the_gate_will_pick(tmp_path, monkeypatch):
    """With an eval gate: before this machine judged the job's sample, its gate at each model's defaults and
    the corpus on the reference; once a verdict is kept, a gate that starts no engine and the corpus on the
    verdict's model at the rate its gate sample measured. One prediction per job, whichever model then ran."""
    from tokenmill import gate, prediction
    from tokenmill.gate import CandidateVerdict, GateReport, ModelCost, chosen_model

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))  # no model made here yet
    spec = _gated_job(tmp_path)
    first = prediction.predict_job(spec)
    # no verdict yet: the candidate the gate picks if it passes, the cheaper at the default rates (int8), and what
    # the reference would take instead
    assert first.engine == "onnxruntime"
    part = first.part("eval gate")
    assert part.is_default and "2 models each at its engine's default start and rate" in part.source
    assert "the corpus on all-MiniLM-L6-v2 (onnxruntime), the cheapest candidate at the engines' default rates" \
        in part.source and re.search(r"if none passes, the reference runs the corpus: \+[\d,]+ s", part.source)
    assert "kept open from the gate" in first.part("engine start").source
    # each model the gate may pick, from the same figures: the assumed one is the prediction; the record holds the
    # one that ran beside the measured wall, the prediction's own error left as it is
    reference, candidate = spec.gate.reference, gate.candidate_models(spec)[0]
    assert set(first.branches) == {prediction.branch_key(reference), prediction.branch_key(candidate)}
    assert first.branches[prediction.branch_key(candidate)][1] == pytest.approx(first.seconds)
    assert first.assumed == prediction.branch_key(candidate)  # the branch it is, named
    label, on_reference, reference_exit = first.branches[prediction.branch_key(reference)]
    assert label == "all-MiniLM-L6-v2 (transformers)" and on_reference > first.seconds
    said = float(re.search(r"if none passes, the reference runs the corpus: \+([\d,]+) s", part.source).group(1))
    assert said == pytest.approx(on_reference - first.seconds, abs=0.5)
    measured = {"process_seconds": 100.0}
    as_gated = prediction.compare(first, measured, ran=reference)
    assert as_gated["predicted_wall_seconds_as_gated"] == pytest.approx(on_reference)
    assert as_gated["wall_prediction_error_as_gated"] == pytest.approx((on_reference - reference_exit) / 100.0 - 1)
    assert as_gated["wall_prediction_error"] == prediction.compare(first, measured)["wall_prediction_error"]
    assert "predicted_wall_seconds_as_gated" not in prediction.compare(first, measured, ran=candidate)  # as assumed
    from tokenmill.report import run_metrics, summary_markdown
    from tokenmill.results import ShardResult

    result = ShardResult(shard_id="s", fingerprint="f", uri="u", output="o", rows_in=10, rows_out=10, rows_rejected=0,
                         rows_truncated=0, input_tokens=100, output_tokens=0, batches=1, real_tokens=20,
                         padded_slots=20, baseline_padded_slots=20, engine_seconds=1.0, seconds=2.0)
    ran = spec.model_copy(update={"model": reference})
    metrics = {**run_metrics([result], 3.0, ran), **as_gated}
    assert (f"the eval gate ran the corpus on all-MiniLM-L6-v2 (transformers), not the model the prediction assumed: "
            f"predicted for it before the run {on_reference:.1f} s") in summary_markdown(ran, metrics, [result])
    # a gate that lets no candidate save enough at the default rates: the reference
    strict = spec.model_copy(update={"gate": spec.gate.model_copy(update={"min_saving": 0.9})})
    assert prediction.predict_job(strict).engine == "transformers"
    assert "(transformers), the reference, as the gate runs it" in prediction.predict_job(strict).part("eval gate").source
    # the candidate's ONNX export and int8 copy are made in the gate, once per machine
    assert re.search(r"\+ [\d.]+ s making the models not made here yet: onnx all-MiniLM-L6-v2\.fp32 [\d.]+ s \(default: "
                     r"never made here.*; onnx all-MiniLM-L6-v2\.int8-[a-z-]+ [\d.]+ s", part.source), part.source
    # made after the reference ran on transformers, which imported torch: the export imports nothing more; with
    # the reference on OpenVINO (make run's gate), it imports torch and transformers first
    assert "importing torch" not in part.source
    on_openvino = spec.model_copy(update={"gate": spec.gate.model_copy(update={"reference": spec.gate.reference.model_copy(
        update={"engine": "openvino"})})})
    _, says = prediction.gate_making(on_openvino, [on_openvino.gate.reference, *gate.candidate_models(on_openvino)])
    assert says.startswith("onnx all-MiniLM-L6-v2.fp32") and says.count("importing torch") == 1, says
    made = prediction.models_to_make(prediction.job_for(on_openvino, on_openvino.gate.reference))
    assert prediction.making_part(made)[0] - prediction.making_part(made, torch_in=True)[0] == pytest.approx(
        prediction.TORCH_IMPORT_SECONDS * prediction.machine_speed()[0])
    # OpenVINO's int8 imports torch too (NNCF): charged where nothing made before it in the process did
    int8 = [("openvino", "all-MiniLM-L6-v2.int8-vnni")]
    assert "importing torch" in prediction.making_part(int8)[1]
    assert "importing torch" not in prediction.making_part(int8, torch_in=True)[1]
    # the gate computes its 16 sample rows (the corpus's own) and keeps them in the row cache: not computed again
    assert first.rows == 40 - 16 and "the gate's 16 sample rows" in first.part("engine").source
    assert "+ engine start 0.0 s" in first.part("orchestration start").source  # no engine starts beside the API
    assert "the gate's models: default" in first.part("exit").source  # its models close with the corpus's engine

    texts, source = gate.sample_texts(spec)
    tokens = 16 * 12
    verdict = GateReport.judge(
        spec, source, 16, ModelCost(model="ref", engine="transformers", seconds=1.0, tokens=tokens, tokens_per_s=1000.0,
                                    usd_per_1m_tokens=0.02),
        [CandidateVerdict(cost=ModelCost(model="int8", engine="onnxruntime", seconds=0.1, tokens=tokens,
                                         tokens_per_s=4000.0, usd_per_1m_tokens=0.005), metrics=[], passed=True)])
    # a verdict of the same models on another corpus: its pick, and each model at its rate there
    gate._write_verdict(gate.verdict_key(spec, ["another corpus"]), verdict, gate.judge_key(spec))
    elsewhere = prediction.predict_job(spec)
    assert elsewhere.engine == "onnxruntime"
    assert ("as this gate's last verdict here (another corpus), judged again at this corpus's lengths, picks "
            "(candidate)") in elsewhere.part("eval gate").source
    assert "(this gate's sample of another corpus)" in elsewhere.part("engine").source
    # the gate measures this corpus, and its last model, the pick, stays open for the corpus: no second start
    start = elsewhere.part("engine start")
    assert start.seconds == 0 and "kept open from the gate" in start.source
    prediction.remember_parts({prediction.gate_key(spec): {prediction.GATE_BESIDES: 30.0}})
    part = prediction.predict_job(spec).part("eval gate")
    sample_tokens = float(re.search(r"for ~([\d,]+) sample tokens", part.source).group(1).replace(",", ""))
    making = float(re.search(r"\+ ([\d.]+) s making", part.source).group(1))
    assert part.seconds == pytest.approx(30.0 + sample_tokens / 1000.0 + sample_tokens / 4000.0 + making, rel=0.01)
    # a verdict of another gate (other thresholds) is not this gate's
    other = spec.model_copy(update={"gate": spec.gate.model_copy(update={"thresholds": {"cosine_mean": 0.999}})})
    assert gate.judge_key(other) != gate.judge_key(spec) and gate.last_verdict_elsewhere(other) is None

    gate._write_verdict(gate.verdict_key(spec, texts), verdict, gate.judge_key(spec))
    kept = prediction.predict_job(spec)
    assert kept.engine == "onnxruntime" and "kept open" not in kept.part("engine start").source  # the gate starts none
    assert "the gate's models" not in kept.part("exit").source  # nor has models to close
    assert kept.rows == 40  # no gate sample computed this time: every row is the corpus run's
    assert "verdict on this sample kept (candidate)" in kept.part("eval gate").source
    assert "(its gate's sample)" in kept.part("engine").source
    # the run is held to this prediction: the flow asks for it with the model the gate picked
    ran = spec.model_copy(update={"model": chosen_model(spec, gate.known_verdict(spec))})
    assert prediction.made_for(ran) is kept

    # the job's own model as the implicit candidate: the gate's seconds stored under the key its prediction read,
    # though the run's spec then holds the reference as its model
    implicit = spec.model_copy(update={"model": spec.gate.candidates[0],
                                       "gate": spec.gate.model_copy(update={"candidates": []})})
    prediction.predict_job(implicit)
    on_reference = implicit.model_copy(update={"model": implicit.gate.reference})
    assert prediction.gate_key(on_reference) != prediction.gate_key(implicit)
    monkeypatch.setattr(prediction.timeline, "marks", lambda: {
        "process": 0.0, "cli_ready": 1.0, "tracking_warm": 2.0, "flow_called": 3.0, "gate_start": 3.5,
        "gate_measured": 9.5, "first_engine_call": 10.0})
    monkeypatch.setattr(prediction.timeline, "process_started", lambda: 0.0)
    monkeypatch.setattr(prediction.timeline, "measures_process", lambda: True)
    stored = prediction.measured_parts(on_reference, "transformers", {}, 0, False)
    assert stored[prediction.gate_key(implicit)] == {"gate": pytest.approx(6.0)}


def test_a_gated_runs_gate_is_its_own_part_not_the_flows_start_nor_the_engines(tmp_path, monkeypatch):
    """flows/batch.py marks the gate's span: the run stores the gate's seconds under the gate's key (apart for
    a verdict kept), and the flow's start without them."""
    from tokenmill import prediction, timeline

    spec = _gated_job(tmp_path)
    t0 = 1000.0
    marks = {"process": t0, "cli_ready": t0 + 3, "tracking_warm": t0 + 6, "flow_called": t0 + 7,
             "gate_start": t0 + 8, "gate_measured": t0 + 28, "first_shard_started": t0 + 29,
             "first_engine_call": t0 + 30, "shards_done": t0 + 40, "record_started": t0 + 41}
    monkeypatch.setattr(timeline, "marks", lambda: dict(marks))
    monkeypatch.setattr(timeline, "process_started", lambda: t0)
    monkeypatch.setattr(timeline, "measures_process", lambda: True)
    ran = spec.model_copy(update={"model": spec.gate.reference})
    parts = prediction.measured_parts(ran, "transformers", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40, False)
    assert parts[prediction.fixed_key(ran, "transformers")]["flow start"] == pytest.approx(30 - 7 - 1 - 20)
    assert parts[prediction.gate_key(ran)] == {"gate": pytest.approx(20.0)}
    parts = prediction.measured_parts(ran, "transformers", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40, False,
                                      gate_samples=6.0)  # what its models' samples took: the rest stored apart
    assert parts[prediction.gate_key(ran)] == {"gate": pytest.approx(20.0),
                                               prediction.GATE_BESIDES: pytest.approx(14.0)}
    # the corpus's engine started in the first shard (no early start before a gate): its start, not shard overhead
    overhead = parts[prediction.fixed_key(ran, "transformers")][prediction.OVERHEAD]
    marks.update(engine_start=t0 + 29.2, engine_ready=t0 + 29.7)
    parts = prediction.measured_parts(ran, "transformers", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40, False)
    assert parts[prediction.engine_key(ran, "transformers")] == {"engine start": pytest.approx(0.5)}
    fixed = parts[prediction.fixed_key(ran, "transformers")]
    assert fixed[prediction.OVERHEAD] == pytest.approx(overhead - 0.5 / 40 * 1000)
    assert fixed["flow start"] == pytest.approx(30 - 7 - 1 - 20)  # nor the flow's start's: counted once
    # no engine started beside the API: the main thread's seconds stored apart (MAIN_ALONE), not as MAIN
    assert fixed[prediction.MAIN_ALONE] == pytest.approx(3.0) and prediction.MAIN not in fixed
    # a model made once per machine inside the gate, or inside the engine's start: not stored as either's seconds
    monkeypatch.setattr("tokenmill.prediction.MADE_SPANS", [(t0 + 10, t0 + 14), (t0 + 20, t0 + 21)])
    parts = prediction.measured_parts(ran, "transformers", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40, False,
                                      gate_samples=6.0)
    assert parts[prediction.gate_key(ran)] == {"gate": pytest.approx(15.0), prediction.GATE_BESIDES: pytest.approx(9.0)}
    assert parts[prediction.engine_key(ran, "transformers")] == {"engine start": pytest.approx(0.5)}
    ungated = spec.model_copy(update={"gate": None, "model": spec.gate.candidates[0]})
    marks.pop("gate_start")
    marks.update(engine_start=t0 + 20, engine_ready=t0 + 27.5)
    parts = prediction.measured_parts(ungated, "onnxruntime", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40,
                                      False)
    assert parts[prediction.engine_key(ungated, "onnxruntime")] == {"engine start": pytest.approx(6.5)}
    # a kept verdict starts no engine in the gate: a model made for the corpus is the engine start's, not the gate's
    monkeypatch.setattr("tokenmill.prediction.MADE_SPANS", [(t0 + 29.5, t0 + 32.5)])
    marks.update(gate_start=t0 + 8, engine_start=t0 + 29.2, engine_ready=t0 + 33.0)
    marks.pop("gate_measured")
    marks["gate_verdict_kept"] = t0 + 8.5
    parts = prediction.measured_parts(ran, "transformers", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40, False)
    assert parts[prediction.gate_key(ran)] == {"gate, verdict kept": pytest.approx(0.5)}
    assert parts[prediction.engine_key(ran, "transformers")] == {"engine start": pytest.approx(0.8)}


def test_a_run_that_measured_its_gate_before_predicting_predicts_the_verdicts_model_with_those_seconds(
        tmp_path, monkeypatch):
    """`tokenmill run` measures an embedding gate with no verdict here before it predicts (gate.judge_first): the
    prediction reads the verdict (its model, its rate on the sample), the gate's seconds as measured, the
    flow's gate after them as a kept verdict's, the sample rows the gate kept, the exit with the gate's models
    open; the run stores that gate's seconds as a measuring gate's, apart from its main thread's. plan and
    calibrate, in processes that did not measure it, read the verdict kept alone."""
    from tokenmill import gate, prediction, timeline
    from tokenmill.gate import CandidateVerdict, GateReport, ModelCost

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    spec = _gated_job(tmp_path)
    spec = spec.model_copy(update={"gate": spec.gate.model_copy(update={"on_fail": "use_reference"})})
    texts, source = gate.sample_texts(spec)
    tokens = 16 * 12
    failed = GateReport.judge(  # the candidate fails: the reference runs the corpus
        spec, source, 16, ModelCost(model="ref", engine="transformers", seconds=1.0, tokens=tokens,
                                    tokens_per_s=1000.0, usd_per_1m_tokens=0.02),
        [CandidateVerdict(cost=ModelCost(model="int8", engine="onnxruntime", seconds=0.1, tokens=tokens,
                                         tokens_per_s=4000.0, usd_per_1m_tokens=0.005), metrics=[], passed=False)])
    gate._write_verdict(gate.verdict_key(spec, texts), failed, gate.judge_key(spec))
    kept = prediction.predict_job(spec)  # a plan's: no gate measured in its process
    assert kept.engine == "transformers" and "verdict on this sample kept (reference)" in kept.part("eval gate").source
    t0 = 1000.0
    marks = {"process": t0, "cli_ready": t0 + 2, prediction.GATE_FIRST[0]: t0 + 3, prediction.GATE_FIRST[1]: t0 + 23}
    monkeypatch.setattr(timeline, "marks", lambda: dict(marks))
    monkeypatch.setattr(timeline, "process_started", lambda: t0)
    monkeypatch.setattr(timeline, "measures_process", lambda: True)
    monkeypatch.setattr("tokenmill.prediction.MADE_SPANS", [(t0 + 5, t0 + 9)])
    run = prediction.predict_job(spec)
    part = run.part("eval gate")
    assert run.engine == "transformers" and not run.branches  # the model the verdict picked, no other assumed
    assert part.seconds == pytest.approx(20.0 + kept.part("eval gate").seconds)
    assert part.source.startswith("20.0 s before this prediction, no verdict here on this sample yet") \
        and "4.0 s of it making the models" in part.source and "verdict on this sample kept (reference)" in part.source
    assert "(its gate's sample)" in run.part("engine").source  # the reference's rate on the sample
    # the gate's sample rows it kept in the row cache are counted out by the row cache's share (job_sample reads
    # the cache after the gate), not once more: here the verdict was written by hand, and the cache holds none
    assert run.rows == 40 and kept.rows == 40
    assert "the gate's models" in run.part("exit").source and "the gate's models" not in kept.part("exit").source
    # what the run stores: that gate as a measuring gate's (without the making), the flow's as a kept verdict's, and
    # the main thread without it
    marks.update({"tracking_warm": t0 + 26, "flow_called": t0 + 27, "gate_start": t0 + 28,
                  "gate_verdict_kept": t0 + 28.2, "first_shard_started": t0 + 29, "first_engine_call": t0 + 30,
                  "shards_done": t0 + 40, "record_started": t0 + 41})
    ran = spec.model_copy(update={"model": spec.gate.reference})
    parts = prediction.measured_parts(ran, "transformers", {"engine_seconds": 8.0, "engine_tokens": 4000.0}, 40, False,
                                      gate_samples=6.0)
    assert parts[prediction.gate_key(ran)] == {prediction.GATE_MEASURED: pytest.approx(16.0),
                                               prediction.GATE_KEPT: pytest.approx(0.2),
                                               prediction.GATE_BESIDES: pytest.approx(10.0)}
    assert parts[prediction.fixed_key(ran, "transformers")][prediction.MAIN_ALONE] == pytest.approx(24 - 20)


def test_a_model_not_made_here_yet_is_predicted_with_its_making(tmp_path, monkeypatch):
    """ONNX Runtime and OpenVINO run models tokenmill makes once per machine (the export, a quantized copy):
    the engine's start is predicted with the making of those not made here yet, at the seconds a model of the
    same name took here before (its made.json), else a stated default; none once they are made."""
    from tokenmill import prediction
    from tokenmill.models import resolve_model
    from tokenmill.onnx_models import made_seconds, onnx_model
    from tokenmill.spec import JobSpec

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "docs.parquet", ["a", "b"], TEXTS[:2])
    spec = JobSpec.model_validate({"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "mode": "embed",
                                   "model": {"name": "all-MiniLM-L6-v2", "engine": "onnxruntime",
                                             "quantization": "int8"}})
    to_make = prediction.models_to_make(spec)
    assert [kind for kind, _ in to_make] == ["onnx", "onnx"] and to_make[0][1] == "all-MiniLM-L6-v2.fp32"
    start = prediction.predict_job(spec).part("engine start")
    assert "making onnx all-MiniLM-L6-v2.fp32" in start.source and "(default: never made here" in start.source
    # ONNX Runtime's start imports no torch: the export imports it (and transformers) first, once
    assert start.source.count("s importing torch, which nothing before it here imports") == 1, start.source

    path = resolve_model(spec.model_name)
    onnx_model(path, None, spec.model_name)  # the export, made for real
    assert prediction.models_to_make(spec) == to_make[1:]
    assert len(made_seconds("onnx", to_make[0][1])) == 1
    onnx_model(path, "int8", spec.model_name)
    assert prediction.models_to_make(spec) == []
    assert "making" not in prediction.predict_job(spec).part("engine start").source
    # the same model for other weights or libraries: not made here yet, predicted at what making its name took here
    auto = spec.model_copy(update={"model": spec.model.model_copy(update={"engine": "auto"})})  # int8: ONNX Runtime's
    assert prediction.engine_of(auto) == "onnxruntime" and prediction.models_to_make(auto) == []
    monkeypatch.setattr("tokenmill.onnx_models.library_versions", lambda names: {"onnxruntime": "another"})
    again = prediction.models_to_make(spec)
    assert again == to_make
    seconds, says = prediction.making_part(again[1:])
    assert seconds == pytest.approx(made_seconds("onnx", to_make[1][1])[0]) and "made here before, median of 1" in says


def _generation_job(root, rows: int, engine: str = "transformers") -> dict:
    (root / "in").mkdir()
    write_parquet(root / "in" / "docs.parquet", [f"g{i}" for i in range(rows)],
                  [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(rows)])
    return {"input": str(root / "in"), "output": str(root / "out"), "mode": "generate",
            "model": {"name": "SmolLM2-135M-Instruct", "engine": engine},
            "generation": {"max_tokens": 8, "messages": [{"role": "user", "content": "Summarize: {text}"}]},
            "tracking": {"mlflow_tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "tests"}}


def test_a_generation_run_on_a_corpus_never_generated_here_measures_its_answers_before_it_predicts(tmp_path):
    """`tokenmill run` of a generation job whose corpus's answers nothing here measured: its engine generates
    the corpus's sample at the job's cap first, and the prediction plans the calls with those answers (not
    every answer to the cap), counts the probe's seconds as measured, and leaves its rows (kept in the row
    cache) out of the engine's; the run still writes every row, and its answers replace the probe's."""
    from tokenmill import call_costs
    from tokenmill.answer_probe import PROBE_ROWS
    from tokenmill.engine_choice import PREFILL_ROWS, answers_key, rates_key
    from tokenmill.prediction import ANSWER_PROBE
    from tokenmill.spec import JobSpec

    rows = PROBE_ROWS + 8
    job = _generation_job(tmp_path, rows=rows)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cache = tmp_path / "cache"
    stdout = tokenmill("run", "--config", str(tmp_path / "job.yaml"), "--no-progress", cwd=tmp_path, cache=cache)
    line = prediction_line(stdout)
    assert f"{ANSWER_PROBE} " in line and "this corpus's last probe" in line and "every answer to the cap" not in line
    assert "each row's drawn from those of prompts of its length" in line  # the probe kept its prompts' lengths
    assert "for 8 rows" in line and f"probe's {PROBE_ROWS} rows, generated before this" in line
    assert f"Rows:      {rows} in = {rows} out + 0 rejected" in stdout
    import mlflow

    mlflow.set_tracking_uri(job["tracking"]["mlflow_tracking_uri"])
    (run,) = mlflow.search_runs(experiment_names=["tests"], output_format="list")
    assert run.data.metrics["rows_from_cache"] == PROBE_ROWS  # the probe's, kept: not computed again
    stored = call_costs.read_answers(cache, answers_key(JobSpec.model_validate(job)))
    assert stored.source == "run" and stored.cap == 8 and len(stored.inputs) == len(stored.answers) > 0
    # the probe's calls stored with the run's (the prediction's fit read them): every row's once, and one call
    # of the probe's longest prompts for one token
    calls = call_costs.read_calls(cache, rates_key(JobSpec.model_validate(job), "transformers"))
    prefill = [c for c in calls if c.steps == 1 and c.rows == PREFILL_ROWS]
    assert prefill and sum(c.rows for c in calls) - PREFILL_ROWS == rows
    parts = json.loads((cache / "run-parts.json").read_text())
    assert any(k.endswith("|transformers|SmolLM2-135M-Instruct|generate") and v.get("engine start")
               for k, v in parts.items())  # the engine's start, inside the probe, stored as a start


def test_only_a_generation_corpus_never_generated_here_is_probed_on_the_engine_it_will_meet(tmp_path, monkeypatch):
    """The probe runs where the prediction would plan every answer to the cap: on an engine given by name,
    auto's choice where no trial will run, else the engine auto's trials start first (its trial reuses it,
    open: the trials' part counts no start for it, and its kept rows count only where the job runs on it).
    Its span is the main thread's work apart (predicted as measured, never stored as the main thread's), the
    job's engine's start within it is stored as the engine's start, and its kept rows are out of the engine's."""
    from tokenmill import call_costs, prediction, timeline
    from tokenmill.answer_probe import probe_engine
    from tokenmill.engine_choice import answers_key, cache_dir
    from tokenmill.spec import JobSpec

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    spec = JobSpec.model_validate(_generation_job(tmp_path, rows=24))

    def job(**model):
        return spec.model_copy(update={"model": spec.model.model_copy(update=model)})

    assert (probe_engine(spec), probe_engine(job(engine="vllm"))) == ("transformers", "vllm")
    # auto's trials will run: the engine they start first, transformers (vLLM is installed here)
    assert probe_engine(job(engine="auto")) == "transformers"
    monkeypatch.setattr("tokenmill.answer_probe.trials_cached", lambda spec, mean_tokens: True)
    assert probe_engine(job(engine="auto")) == "auto"  # no trial will run: auto chooses from the cached ones
    assert probe_engine(spec.model_copy(update={"generation": spec.generation.model_copy(update={"n": 2})})) is None
    assert probe_engine(spec.model_copy(update={"mode": "embed", "model": spec.model.model_copy(
        update={"name": "all-MiniLM-L6-v2"})})) is None
    batch = tmp_path / "batch.jsonl"  # an OpenAI Batch input: each request carries its own sampling
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}}) + "\n")
    assert probe_engine(spec.model_copy(update={"input": str(batch)})) is None
    call_costs.remember_answers(cache_dir(), answers_key(spec), [3, 5, 8], 8, "calibration")
    assert probe_engine(spec) is None

    probed = prediction.JobSample(rows=24, shards=1, lengths=[10], trial_lengths=[10] * 16,
                                  probe_engine="transformers", probe_kept=16)
    trials = prediction.trials_part(job(engine="auto"), probed, {}, ["vllm", "transformers"], [], kept=True)
    assert "transformers 0.0 s start (opened by the answers' probe" in trials.source
    unprobed = prediction.trials_part(job(engine="auto"), probed.model_copy(update={"probe_engine": ""}), {},
                                      ["vllm", "transformers"], [], kept=True)
    assert trials.seconds < unprobed.seconds
    monkeypatch.setattr(prediction, "predicted_engine", lambda spec, sample, trials: ("vllm", "auto"))
    assert prediction.predict(job(engine="auto"), probed, {}, []).rows == 24  # kept under transformers
    assert prediction.predict(job(engine="vllm"), probed.model_copy(update={"probe_engine": "vllm"}),
                              {}, []).rows == 8

    t0 = 1000.0
    marks = {"process": t0, "cli_ready": t0 + 3, "api_start": t0 + 3, "early_engine_start": t0 + 3.5,
             "early_engine_ready": t0 + 7.5, "answer_probe_start": t0 + 7.5, "answer_probe_done": t0 + 10.5,
             "tracking_warm": t0 + 12, "api_ready": t0 + 9, "flow_called": t0 + 12.5, "first_shard_started": t0 + 13,
             "first_engine_call": t0 + 13.5, "shards_done": t0 + 20, "record_started": t0 + 20.5}
    monkeypatch.setattr(timeline, "marks", lambda: dict(marks))
    monkeypatch.setattr(timeline, "process_started", lambda: t0)
    monkeypatch.setattr(timeline, "measures_process", lambda: True)
    parts = prediction.measured_parts(spec, "transformers", {"engine_seconds": 6.0, "engine_tokens": 400.0}, 8, False)
    # 9 s on the main thread: 4 s the engine's start, 3 s generating and keeping its rows
    assert parts[prediction.fixed_key(spec, "transformers")][prediction.MAIN] == pytest.approx(9 - 4 - 3)
    assert parts[prediction.engine_key(spec, "transformers")] == {"engine start": pytest.approx(4.0)}
    apart = prediction.main_thread_parts(spec, prediction.JobSample(rows=24, shards=1, lengths=[10]), {})
    assert [(name, seconds) for name, seconds, _ in apart if name == prediction.ANSWER_PROBE] == [
        (prediction.ANSWER_PROBE, pytest.approx(3.0))]
    sample = prediction.JobSample(rows=24, shards=1, lengths=[10], probe_kept=16)
    assert sample.rows_to_compute(False) == 8


def test_a_run_that_opens_no_engine_stores_its_exit_apart_from_the_engines(tmp_path, monkeypatch):
    """A rerun with every shard finished closes no engine: its exit (the record's logging, the orchestrator's
    shutdown) is stored as the idle exit, not as the engine's, which a run that closes one reads. A run whose
    gate measured its models closes theirs too: its exit is stored apart as well."""
    from tokenmill import prediction, timeline
    from tokenmill.spec import JobSpec

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(prediction, "device_label", lambda: "cpu-test")
    monkeypatch.setattr(timeline, "measures_process", lambda: True)
    spec = JobSpec.model_validate({"input": "in", "mode": "embed", "model": {"name": "all-MiniLM-L6-v2",
                                                                           "engine": "transformers"}})
    key = prediction.fixed_key(spec, "transformers")
    for opened in ({}, {"early_engine_start": 2.0}, {"gate_start": 2.0, "gate_measured": 3.0}):
        monkeypatch.setattr(timeline, "marks", lambda: {"cli_ready": 1.0, "record_started": time.time() - 0.5,
                                                         **opened})
        prediction.remember_run(spec, "transformers", {}, 0, False)
        prediction.remember_exit()
    stored = prediction.read_parts()[key]
    assert len(stored[prediction.IDLE_EXIT]) == len(stored["exit"]) == len(stored[prediction.GATE_EXIT]) == 1
    assert 0.5 <= stored[prediction.IDLE_EXIT][0] < 60 and 0.5 <= stored["exit"][0] < 60
    # another engine's idle exit is its own (what its process imported is torn down with it): never read across
    other = prediction.fixed_key(spec, "openvino")
    assert prediction.stored(prediction.read_parts(), other, prediction.IDLE_EXIT, 0.8)[1].startswith("default")


def test_an_engines_default_rate_follows_the_cpus_class_as_measured(monkeypatch):
    """OpenVINO's float32 ran MiniLM at 1.2x transformers' rate (on oneDNN) without VNNI, twice it on an EPYC with VNNI
    and no AMX, 1.1x with AMX; its int8 at 1.1x, 5.0x and 2.9x (3.4x transformers' own on oneDNN there); vLLM at 0.44-0.47x transformers' but on the EPYC, where
    it ran at 0.95-1.08x; transformers itself on oneDNN at 1.65x there embedding, 1.5x generating, 0.85x with AMX
    embedding: the defaults a first run or gate is predicted from follow the class."""
    from tokenmill import prediction

    mkl = prediction.DEFAULT_TOKENS_PER_S_BY_MODE["embed"]  # transformers' float32 on MKL, where the others were timed
    for cpu, float32, int8, vllm, onednn in (("no-vnni", 1.2, 1.1, (0.4, 0.5), (1.0, 1.0)),
                                             ("vnni", 2.0, 5.0, (0.9, 1.1), (1.65, 1.5)),
                                             ("amx", 1.1, 2.9, (0.4, 0.5), (0.85, 1.0))):
        monkeypatch.setattr(prediction, "int8_class", lambda: cpu)
        assert prediction.default_rate("transformers", "embed") == pytest.approx(onednn[0] * mkl)
        assert prediction.default_rate("openvino", "embed") == pytest.approx(float32 * mkl)
        assert prediction.default_rate("openvino", "embed", "int8") == pytest.approx(int8 * mkl)
        assert vllm[0] * mkl <= prediction.default_rate("vllm", "embed") <= vllm[1] * mkl
        assert prediction.default_rate("transformers", "generate") == pytest.approx(
            onednn[1] * prediction.DEFAULT_TOKENS_PER_S[("transformers", "generate")])
        vllm_generate = prediction.default_rate("vllm", "generate") / prediction.DEFAULT_TOKENS_PER_S[("vllm", "generate")]
        assert vllm_generate == (1.4 if cpu == "vnni" else 1.0)  # vLLM's: 1.4x on the EPYC, as measured there


def test_an_engines_exit_never_measured_alone_reads_its_exit_after_a_measuring_gate():
    """A gated job's rerun with its verdict kept closes only the corpus's engine: where that exit was never
    measured alone but the gate's run measured the same engine's exit beside the gate's models, it is read from
    that measurement, said so, not from the default; a measured exit alone wins; neither falls to the default."""
    from tokenmill import prediction

    key = "cpu-test|openvino|embed"
    gated_only = {key: {prediction.GATE_EXIT: [0.9]}}
    part = prediction.exit_part(gated_only, key, "openvino", gate_makes=False, idle=False)
    assert part.seconds == pytest.approx(0.9) and not part.is_default
    assert "after a measuring gate" in part.source
    both = {key: {prediction.GATE_EXIT: [0.9], "exit": [0.6, 0.7, 0.8]}}
    assert prediction.exit_part(both, key, "openvino", gate_makes=False, idle=False).seconds == pytest.approx(0.7)
    assert prediction.exit_part(both, key, "openvino", gate_makes=True, idle=False).seconds == pytest.approx(0.9)
    neither = prediction.exit_part({}, key, "openvino", gate_makes=False, idle=False)
    assert neither.is_default and "never measured here" in neither.source
    # another engine's gate exit is not this one's
    assert prediction.exit_part(gated_only, "cpu-test|onnxruntime|embed", "onnxruntime", False, False).is_default
