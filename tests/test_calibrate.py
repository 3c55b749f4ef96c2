"""Calibration on CPU with the real MiniLM, the plan from the CLI, and the batch run's honest accounting."""

import json

import mlflow
import pytest
import yaml

from tokenmill.sample_corpus import write_sample_corpus

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", autouse=True)
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate") / "corpus"
    write_sample_corpus(root, documents=600, files=2, row_group_size=100)
    return root


def test_calibrate_plan_and_the_run_record_predicted_against_measured(tmp_path, corpus, embed_spec):
    from tokenmill.cli import main
    from tokenmill.flows.batch import batch_flow
    from tokenmill.flows.calibrate import calibrate_flow

    spec = embed_spec(corpus, batching={"max_shard_rows": 300})
    out = tmp_path / "calibration"
    result = calibrate_flow(spec, [1, 4, 16, 64], sample_rows=128, out_dir=str(out))

    calibration = json.loads((out / "calibration.json").read_text())
    assert [p["batch_size"] for p in calibration["points"]] == [1, 4, 16, 64]
    assert all(p["tokens_per_s"] > 0 and p["peak_memory_gib"] > 0 and p["calls"] >= 2 for p in calibration["points"])
    assert calibration["per_item_s"] > 0 and calibration["plateau_batch_size"] in (1, 4, 16, 64)
    snippet = yaml.safe_load((out / "batching.yaml").read_text())
    assert set(snippet["batching"]) == {"max_batch_size", "token_budget"}
    assert snippet["batching"]["max_batch_size"] == calibration["plateau_batch_size"]
    assert (out / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    run = mlflow.get_run(result.mlflow_run_id)
    assert run.data.metrics["calibrate_plateau_batch_size"] == calibration["plateau_batch_size"]
    assert {"calibration.png", "batching.yaml", "calibration.json"} <= {
        a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}

    # the plan from the command line, on the calibrated throughput
    code = main(["plan", "--input", str(corpus), "--window", "2h", "--calibration", str(out / "calibration.json"),
                 "--tracking-uri", spec.tracking.mlflow_tracking_uri, "--experiment", "tests",
                 "--max-shard-rows", "300", "--sample-rows", "100"])
    assert code == 0
    (plan_run,) = mlflow.search_runs(experiment_names=["tests"], filter_string="tags.`tokenmill.stage` = 'plan'",
                                     output_format="list")
    metrics = plan_run.data.metrics
    assert metrics["plan_gpus"] == 1 and metrics["plan_finish_hours"] < 2
    assert metrics["plan_tokens_low"] < metrics["plan_tokens"] < metrics["plan_tokens_high"]
    assert metrics["plan_tokens_per_s_per_gpu"] == pytest.approx(calibration["plateau_tokens_per_s"])
    plan_text = open(mlflow.MlflowClient().download_artifacts(plan_run.info.run_id, "plan.md", str(tmp_path))).read()
    assert "**1 GPUs** finish in" in plan_text and "95% interval" in plan_text and "Largest shard" in plan_text

    # a batch run with the calibration records the one prediction (tokenmill.prediction) beside what it
    # measured, and the padding it avoided
    record = batch_flow(spec.model_copy(update={"calibration": str(out / "calibration.json")}))
    metrics = mlflow.get_run(record.mlflow_run_id).data.metrics
    assert metrics["predicted_wall_seconds"] > 0 and metrics["predicted_engine_seconds"] > 0
    assert metrics["measured_engine_seconds"] == pytest.approx(metrics["engine_seconds"])
    assert metrics["padding_slots_avoided"] > 0 and metrics["usd_padding_avoided"] > 0
    assert metrics["padding_slots_naive"] - metrics["padding_slots_paid"] == metrics["padding_slots_avoided"]
