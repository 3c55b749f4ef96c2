"""`engine: auto`: which engines may run a job, how the trial's figures decide, and a real
job that chooses, records why, and reuses its cached trial on the next run."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import TEXTS, seed_trials, write_parquet
from tokenmill import engine_choice
from tokenmill.engine_choice import choose_engine, runnable_engines, trial_key, trial_rows
from tokenmill.models import resolve_model
from tokenmill.spec import JobSpec


@pytest.fixture
def trial_cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(folder))
    monkeypatch.setattr(engine_choice, "_chosen", {})
    monkeypatch.setattr(engine_choice, "_chosen_rows", {})
    monkeypatch.setattr(engine_choice, "_expected_rows", {})
    return folder


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = TEXTS * 6
    write_parquet(folder / "docs.parquet", [f"d{i:03d}" for i in range(len(texts))], texts)
    return folder


def test_vllm_only_settings_leave_transformers_out():
    able, why_not = runnable_engines(JobSpec(model={"engine_kwargs": {"gpu_memory_utilization": 0.2}}))
    assert able == ["vllm"] and "gpu_memory_utilization" in " ".join(why_not)
    able, why_not = runnable_engines(JobSpec(model={"quantization": "fp8"}))
    assert able == ["vllm"] and "fp8" in " ".join(why_not)


def test_kwargs_vllm_does_not_take_leave_vllm_out():
    able, why_not = runnable_engines(JobSpec(model={"engine_kwargs": {"attn_implementation": "sdpa"}}))
    assert able == ["transformers"] and "attn_implementation" in " ".join(why_not)


def test_one_runnable_engine_is_chosen_without_a_trial(trial_cache, corpus):
    spec = JobSpec(input=str(corpus), model={"engine_kwargs": {"gpu_memory_utilization": 0.2}})
    choice = choose_engine(spec, job_rows=48)
    assert choice.engine == "vllm" and choice.trials == [] and "only engine" in choice.reason
    assert not (trial_cache / "engine-trials.json").exists()


def test_start_seconds_weigh_by_the_jobs_size(trial_cache, corpus):
    spec = JobSpec(input=str(corpus))
    seed_trials(spec, [
        dict(engine="vllm", start_seconds=100.0, tokens_per_s=10_000.0, rows=48, tokens=800, seconds=0.08),
        dict(engine="transformers", start_seconds=1.0, tokens_per_s=1_000.0, rows=48, tokens=800, seconds=0.8),
    ])
    small = choose_engine(spec, job_rows=48)  # ~800 tokens: vLLM's start is the whole cost
    assert small.cached and small.engine == "transformers"
    assert small.predicted_seconds["transformers"] < small.predicted_seconds["vllm"]
    large = choose_engine(spec, job_rows=10_000_000)  # steady throughput decides
    assert large.cached and large.engine == "vllm" and "finishes" in large.reason
    assert large.predicted_seconds["vllm"] == pytest.approx(
        100.0 + large.job_tokens / 10_000.0)


def test_a_choice_made_as_the_first_shard_asks_weighs_the_rows_the_caller_said_it_will_run(trial_cache, corpus):
    """tokenmill.tasks.run_shards says how many rows its shards hold (expect_rows); the engine is chosen when the
    first shard asks for it (resolve), none if every shard is cached, weighed by those rows."""
    spec = JobSpec(input=str(corpus))
    seed_trials(spec, [
        dict(engine="vllm", start_seconds=100.0, tokens_per_s=12_000.0, rows=48, tokens=800, seconds=0.07),
        dict(engine="transformers", start_seconds=1.0, tokens_per_s=10_000.0, rows=48, tokens=800, seconds=0.08),
    ])
    assert engine_choice.resolve(spec).model.engine == "vllm"  # rows unknown: steady throughput decides
    engine_choice._chosen.clear()
    engine_choice.expect_rows(spec, 48)
    assert engine_choice.resolve(spec).model.engine == "transformers"  # 48 rows: vLLM's 100 s start decides


def test_an_engine_closed_after_its_trial_in_this_process_is_charged_its_restart_not_its_first_start(corpus):
    """The trials close the cheap-to-start engine before the next one's (trial_order); where they ran in this
    process, starting it again for the job costs little (its library imported: MiniLM on transformers 0.04 s
    against 4.9), so auto weighs that, and the prediction puts that in its engine start; from cached trials
    (a later process), its whole start."""
    from tokenmill import prediction
    spec = JobSpec(input=str(corpus))
    path = resolve_model(spec.model_name)
    trials = [engine_choice.EngineTrial(engine="transformers", start_seconds=5.0, tokens_per_s=9_000.0, rows=10,
                                        tokens=100, seconds=0.1),
              engine_choice.EngineTrial(engine="vllm", start_seconds=40.0, tokens_per_s=5_000.0, rows=10,
                                        tokens=100, seconds=0.1)]
    fresh = engine_choice._predicted_seconds(spec, trials, path, 50_000.0, fresh=True)
    assert fresh["transformers"] == pytest.approx(engine_choice.RESTART_SECONDS["transformers"] + 50_000 / 9_000)
    assert min(fresh, key=fresh.get) == "transformers"
    cached = engine_choice._predicted_seconds(spec, trials, path, 50_000.0)
    assert cached["transformers"] == pytest.approx(5.0 + 50_000 / 9_000)
    part = prediction.restart_part(spec, "transformers")
    assert part.seconds < 0.5 and "started again after its trial" in part.source


def test_a_trial_that_fails_loses_with_its_reason(trial_cache, corpus):
    spec = JobSpec(input=str(corpus))
    seed_trials(spec, [
        dict(engine="vllm", start_seconds=0, tokens_per_s=0, rows=0, tokens=0, seconds=0, error="OutOfMemory: x"),
        dict(engine="transformers", start_seconds=1.0, tokens_per_s=1_000.0, rows=48, tokens=800, seconds=0.8),
    ])
    choice = choose_engine(spec)
    assert choice.engine == "transformers"


@pytest.mark.engine
def test_auto_runs_trials_records_why_and_reuses_them(trial_cache, corpus, embed_spec, tmp_path, monkeypatch):
    from tokenmill.flows.batch import batch_flow

    monkeypatch.setitem(engine_choice.TRIAL_ROWS, "embed", 32)
    spec = embed_spec(corpus, model={"name": "all-MiniLM-L6-v2", "engine": "auto"})
    first = batch_flow(spec)
    client = MlflowClient(first.mlflow_tracking_uri)
    run = client.get_run(first.mlflow_run_id)
    assert run.data.params["engine_requested"] == "auto"
    chosen = run.data.params["engine"]
    assert chosen in ("vllm", "transformers")
    assert run.data.params["engine_choice_cached"] == "false"
    assert run.data.params["engine_choice_reason"].startswith(chosen)
    for engine in ("vllm", "transformers"):  # both measured, on the job's own sample
        assert run.data.metrics[f"engine_trial/{engine}/tokens_per_s"] > 0
        assert run.data.metrics[f"engine_trial/{engine}/start_seconds"] > 0
    assert f"auto chose {chosen}" in first.summary
    streams = {k for k in run.data.metrics if k.startswith("engine_trial/transformers/tokens_per_s_streams_")}
    import torch

    from tokenmill.hf_engine import _process_threads

    if _process_threads(torch) >= 2:  # more than one core: transformers was timed at 2 and at 1
        assert {k.rsplit("_", 1)[1] for k in streams} == {"1", "2"}
    if chosen == "transformers":  # the streams it ran at are the record's, and the trial's choice
        trial = next(t for t in next(iter(json.loads((trial_cache / "engine-trials.json").read_text()).values()))[
            "trials"] if t["engine"] == "transformers")
        assert run.data.params["engine_streams"] == str(trial["streams"])
    assert run.data.metrics["fixed_seconds"] > 0 and run.data.metrics["steady_tokens_per_s"] > 0
    cached = json.loads((trial_cache / "engine-trials.json").read_text())
    assert len(cached) == 1 and {t["engine"] for t in next(iter(cached.values()))["trials"]} == {"vllm", "transformers"}
    out = pq.read_table(spec.output)
    assert out.column("id").to_pylist() == [f"d{i:03d}" for i in range(len(TEXTS) * 6)]  # input order kept

    monkeypatch.setattr(engine_choice, "_chosen", {})  # a new process: only the cache file remains
    try:
        again = batch_flow(spec.model_copy(update={"output": str(tmp_path / "out-again")}))
        run = client.get_run(again.mlflow_run_id)
        assert run.data.params["engine_choice_cached"] == "true" and run.data.params["engine"] == chosen
    finally:  # the session holds engines open across modules: leave none of these for later tests to find
        from tokenmill.engines import discard_engine

        for engine in ("vllm", "transformers"):
            discard_engine(resolve_model(spec.model_name), engine_choice.with_engine(spec, engine))


def test_a_runs_measured_parts_become_the_next_predictions_parts(trial_cache):
    from tokenmill import prediction

    parts = prediction.read_parts()
    assert prediction.stored(parts, "here|vllm|embed", "python imports", 8.0) == (
        8.0, "default: never measured here, 8 s")
    prediction.remember_parts({"here|vllm|embed": {"python imports": 3.0}})
    prediction.remember_parts({"here|vllm|embed": {"python imports": 5.0}})
    prediction.remember_parts({"here|vllm|embed": {"python imports": 4.0, "finish": 1.5, "exit": 6.5}})
    parts = prediction.read_parts()
    assert prediction.stored(parts, "here|vllm|embed", "python imports", 8.0) == (
        4.0, "measured here, median of 3 runs")
    assert prediction.stored(parts, "here|vllm|embed", "finish", 2.0)[0] == 1.5
    # never measured on transformers: this device and mode's runs on another engine, and it says so
    assert prediction.stored(parts, "here|transformers|embed", "finish", 2.0) == (
        1.5, "measured here on vllm, median of 1 run")
    # but not the exit, which holds the engine's own shutdown
    assert prediction.stored(parts, "here|transformers|embed", "exit", 2.0) == (2.0, "default: never measured here, 2 s")


def test_plan_without_a_rate_uses_the_engine_trial(trial_cache, corpus, tmp_path):
    import mlflow

    from tokenmill.cli import main

    spec = JobSpec(input=str(corpus))
    seed_trials(spec, [
        dict(engine="vllm", start_seconds=40.0, tokens_per_s=2_000.0, rows=48, tokens=800, seconds=0.4),
        dict(engine="transformers", start_seconds=1.0, tokens_per_s=1_000.0, rows=48, tokens=800, seconds=0.8),
    ])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert main(["plan", "--input", str(corpus), "--window", "2h", "--tracking-uri", uri, "--experiment", "plans"]) == 0
    mlflow.set_tracking_uri(uri)
    (plan_run,) = mlflow.search_runs(experiment_names=["plans"], output_format="list")
    metrics = plan_run.data.metrics
    assert metrics["plan_tokens_per_s_per_gpu"] == pytest.approx(1_000.0)  # 48 rows: transformers finishes first
    assert metrics["plan_local_wall_seconds"] == pytest.approx(
        metrics["plan_local_fixed_seconds"] + metrics["plan_local_engine_seconds"])
    plan_text = open(mlflow.MlflowClient().download_artifacts(plan_run.info.run_id, "plan.md", str(tmp_path))).read()
    assert "On this machine, one process" in plan_text and "from transformers measured here at" in plan_text
    assert "predicted wall" in plan_text and "on transformers" in plan_text


def test_plan_on_an_engine_never_measured_here_plans_on_its_stated_default_and_says_so(trial_cache, corpus, tmp_path):
    """No trial and no run measured the named engine here: the plan's rate is the one this machine's prediction
    states as a default (never an error asking for a figure), and its rate source says it is one."""
    import mlflow

    from tokenmill.cli import main

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert main(["plan", "--input", str(corpus), "--window", "2h", "--tracking-uri", uri, "--experiment", "plans",
                 "--set", "model.engine=transformers"]) == 0
    mlflow.set_tracking_uri(uri)
    (plan_run,) = mlflow.search_runs(experiment_names=["plans"], output_format="list")
    metrics, source = plan_run.data.metrics, plan_run.data.params["rate_source"]
    from tokenmill.prediction import predict_job

    local = predict_job(JobSpec(input=str(corpus), model={"engine": "transformers"}))  # what the plan read
    assert local.part("engine").is_default and local.engine_seconds > 0
    assert metrics["plan_tokens_per_s_per_gpu"] == pytest.approx(local.tokens / local.engine_seconds, rel=1e-3)
    assert source.startswith("transformers on this machine, a default (never measured here") and "default:" in source


def test_auto_keeps_the_shard_keys_of_jobs_that_never_named_an_engine(corpus):
    from tokenmill.results import shard_cache_key
    from tokenmill.shards import discover_shards_for

    auto = JobSpec(input=str(corpus))
    (shard,) = discover_shards_for(auto)
    assert shard_cache_key(shard, auto) == shard_cache_key(shard, with_engine_named(auto, "vllm"))
    assert shard_cache_key(shard, auto) != shard_cache_key(shard, with_engine_named(auto, "transformers"))


def with_engine_named(spec: JobSpec, engine: str) -> JobSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"engine": engine})})


def test_the_trial_keeps_the_faster_number_of_streams(trial_cache, corpus, monkeypatch):
    """transformers on CPU with cpu_streams auto is timed at two batches at once and at one; the faster
    is kept, on the engine and in the trial. Both settings really run; one of them reports 100 s, which
    decides the faster whatever else shares the machine (a delay did not: with the machine's load at 9 on
    2 cores, one stream's two torch threads ran 14x slower than two one-thread streams)."""
    import torch

    from tokenmill.engines import discard_engine, get_engine

    from tokenmill.hf_engine import _process_threads

    if _process_threads(torch) < 2:
        pytest.skip("one core: the engine runs one batch at a time")
    spec = JobSpec(input=str(corpus), model={"engine": "transformers"})
    model_path = resolve_model(spec.model_name)
    rows = trial_rows(spec, model_path)
    real_run_batches = engine_choice.run_batches
    for slow, expected in ((2, 1), (1, 2)):
        discard_engine(model_path, spec)
        engine = get_engine(model_path, spec)
        assert engine.streams == 2
        ran = []

        def run_batches(instance, *args, slow=slow, ran=ran):
            outputs, seconds = real_run_batches(instance, *args)
            ran.append(instance.streams)
            return outputs, (100.0 if instance.streams == slow else seconds)

        monkeypatch.setattr(engine_choice, "run_batches", run_batches)
        trial = engine_choice.run_trial(spec, "transformers", model_path, rows)
        assert trial.error is None, trial.error
        assert ran == [2, 1] and set(trial.tokens_per_s_by_streams) == {1, 2}
        assert trial.streams == expected and engine.streams == expected
        assert trial.tokens_per_s == pytest.approx(trial.tokens_per_s_by_streams[expected])
    discard_engine(model_path, spec)
    assert torch.get_num_threads() == _process_threads(torch)  # closing the engine gave torch its threads back


def test_a_cached_trials_streams_reach_the_jobs_engine(trial_cache, corpus):
    import torch

    from tokenmill.engines import discard_engine, get_engine

    from tokenmill.hf_engine import _process_threads

    if _process_threads(torch) < 2:
        pytest.skip("one core: the engine runs one batch at a time")
    spec = JobSpec(input=str(corpus))
    seed_trials(spec, [
        dict(engine="vllm", start_seconds=100.0, tokens_per_s=10_000.0, rows=48, tokens=800, seconds=0.08),
        dict(engine="transformers", start_seconds=1.0, tokens_per_s=1_000.0, rows=48, tokens=800, seconds=0.8,
             streams=1, tokens_per_s_by_streams={2: 900.0, 1: 1_000.0}),
    ])
    choice = choose_engine(spec, job_rows=48)
    assert choice.cached and choice.engine == "transformers" and "batches at once" not in choice.reason
    assert choice.metrics()["engine_trial/transformers/tokens_per_s_streams_2"] == 900.0
    resolved = engine_choice.resolve(spec)
    assert (resolved.model.engine, resolved.model.cpu_streams) == ("transformers", 1)
    model_path = resolve_model(spec.model_name)
    with pytest.raises(ValueError, match="auto.*resolve the job first"):  # the registry holds engines, not choices
        get_engine(model_path, spec)
    try:
        assert get_engine(model_path, resolved).streams == 1  # auto, resolved through the cached trial
        assert get_engine(model_path, spec.model_copy(update={"model": resolved.model.model_copy(
            update={"cpu_streams": 2})})).streams == 2  # the same engine, set as the next job asks
    finally:
        discard_engine(model_path, resolved)


def seed_family(spec: JobSpec, mean_tokens: float, rates: dict[str, float]) -> None:
    """This job's trial at another length, as an earlier run of another corpus shape would have cached it."""
    model_path = resolve_model(spec.model_name)
    device = engine_choice.device_label()
    trials = [engine_choice.EngineTrial(engine=e, start_seconds=40.0 if e == "vllm" else 1.0, tokens_per_s=rate,
                                        rows=100, tokens=1000, seconds=1.0) for e, rate in rates.items()]
    engine_choice._write_cache(trial_key(spec, model_path, device, mean_tokens), trials, device,
                               engine_choice.trial_family(spec, model_path, device), mean_tokens)


def test_a_new_length_is_judged_without_a_trial_when_other_lengths_were_decisive(trial_cache, corpus, monkeypatch):
    spec = JobSpec(input=str(corpus))

    def no_trial(*args, **kwargs):
        raise AssertionError("a trial ran")

    monkeypatch.setattr(engine_choice, "run_trial", no_trial)
    seed_family(spec, 30.0, {"vllm": 2_000.0, "transformers": 5_000.0})  # short rows: 2.5x
    seed_family(spec, 250.0, {"vllm": 1_900.0, "transformers": 4_500.0})  # long rows: 2.4x
    assert engine_choice.trials_cached(spec)
    choice = choose_engine(spec, job_rows=1_000)
    assert choice.engine == "transformers" and choice.cached
    assert "judged without a trial" in choice.reason
    assert all(t.estimated_from for t in choice.trials)


def test_a_close_or_changing_race_at_other_lengths_still_owes_a_trial(trial_cache, corpus, monkeypatch):
    spec = JobSpec(input=str(corpus))
    trials_run = []
    monkeypatch.setattr(engine_choice, "run_trial", lambda spec, engine, *a: trials_run.append(engine) or
                        engine_choice.EngineTrial(engine=engine, start_seconds=1.0, tokens_per_s=1000.0, rows=10,
                                                  tokens=100, seconds=0.1))
    monkeypatch.setattr(engine_choice, "_close_losers", lambda *a: None)
    monkeypatch.setattr("tokenmill.engines.discard_engine", lambda *a: None)
    seed_family(spec, 30.0, {"vllm": 2_000.0, "transformers": 5_000.0})  # decisive here ...
    seed_family(spec, 250.0, {"vllm": 4_000.0, "transformers": 4_500.0})  # ... not here
    assert not engine_choice.trials_cached(spec)
    choose_engine(spec, job_rows=1_000)
    assert sorted(trials_run) == ["transformers", "vllm"]
