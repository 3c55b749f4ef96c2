"""The OpenVINO engine: MiniLM's ONNX export quantized to static int8 by NNCF on the job's own rows, made once,
judged by the gate against float32 and run by a real flow.

Real parts only: the export, NNCF's calibration and OpenVINO's CPU plugin here, sentence-transformers as
the reference's own library, a real Prefect flow and MLflow store. No vLLM engine starts in this module.
"""

import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from conftest import TEXTS
from tokenmill import openvino_models
from tokenmill.device import engine_device
from tokenmill.engine_choice import runnable_engines
from tokenmill.engines import start_engine
from tokenmill.models import load_tokenizer, resolve_model
from tokenmill.onnx_models import int8_isa
from tokenmill.openvino_engine import (CALIBRATION_ROWS, CALIBRATION_TOKENS, MIN_CALIBRATION_ROWS, calibration,
                                       calibration_rows)
from tokenmill.spec import OPENVINO_QUANTIZATIONS, JobSpec

MINILM = "all-MiniLM-L6-v2"
REFERENCE = {"name": MINILM, "engine": "transformers"}
OV_INT8 = {"name": MINILM, "engine": "openvino", "quantization": "int8"}


def test_the_spec_takes_openvino_int8_for_embeddings_only_and_auto_never_picks_it():
    assert set(OPENVINO_QUANTIZATIONS) == set(openvino_models.RECIPES)
    assert JobSpec(model=OV_INT8).model.engine == "openvino"
    with pytest.raises(ValidationError, match="the openvino engine makes int8"):
        JobSpec(model={"engine": "openvino", "quantization": "int4"})
    with pytest.raises(ValidationError, match="openvino engine .* embeds"):
        JobSpec(mode="generate", model={"engine": "openvino"})
    # int8 with engine auto stays ONNX Runtime's: a precision OpenVINO makes is a gate candidate, never a swap
    assert runnable_engines(JobSpec(model={"quantization": "int8"}))[0] == ["onnxruntime"]
    assert "openvino" not in runnable_engines(JobSpec())[0]
    assert engine_device("openvino") == "cpu"


@pytest.fixture(scope="module")
def models_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("tokenmill-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_HOME", str(home))
        yield home / "models" / "openvino"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tokenmill.sample_corpus import write_sample_corpus

    folder = tmp_path_factory.mktemp("corpus")
    write_sample_corpus(folder, documents=160, files=1, row_group_size=80)
    return folder


def test_calibration_takes_rows_until_its_token_budget_and_never_too_few():
    long, short = [[1] * 256] * 300, [[1] * 20] * 300
    assert len(calibration_rows(long)) == MIN_CALIBRATION_ROWS == CALIBRATION_TOKENS // 256  # ~16k tokens
    assert len(calibration_rows([[1] * 1000] * 300)) == MIN_CALIBRATION_ROWS  # the floor, over the budget
    assert len(calibration_rows(short[:CALIBRATION_ROWS])) == CALIBRATION_ROWS  # short rows: the whole sample
    assert calibration_rows(long[:10]) == long[:10]


def test_int8_is_calibrated_on_the_jobs_rows_made_once_and_stays_close_to_sentence_transformers(
        models_home, corpus, monkeypatch):
    from sentence_transformers import SentenceTransformer

    path = resolve_model(MINILM)
    spec = JobSpec(input=str(corpus), model=OV_INT8)
    batches, digest = calibration(spec, path)
    rows = sum(len(b["input_ids"]) for b in batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    assert MIN_CALIBRATION_ROWS <= rows <= min(CALIBRATION_ROWS, 160)
    assert rows == min(CALIBRATION_ROWS, 160) or tokens <= CALIBRATION_TOKENS
    assert all(b["input_ids"].shape == b["attention_mask"].shape for b in batches)
    from tokenmill.prediction import models_to_make

    before = models_to_make(spec)  # the prediction's view: the int8 model for these calibration rows is not made yet
    assert ("openvino", f"{MINILM}.int8-{int8_isa()}") in before
    engine = start_engine(path, spec)
    assert models_to_make(spec) == []  # made now, as the prediction reads it
    folder = engine.model_file.parent
    assert folder.parent == models_home and folder.name.startswith(f"{MINILM}.int8-{int8_isa()}.")
    made = (folder / "made.json").read_text()
    assert digest in made and '"nncf"' in made and '"openvino"' in made and (folder / "model.bin").exists()

    tokenizer = load_tokenizer(path)
    expected = SentenceTransformer(path, device="cpu").encode(TEXTS)
    vectors = np.stack(engine.embed([tokenizer(text)["input_ids"] for text in TEXTS]))
    assert vectors.dtype == np.float32 and vectors.shape == expected.shape
    assert (vectors * expected).sum(1).min() > 0.97
    float32 = start_engine(path, JobSpec(input=str(corpus), model={**OV_INT8, "quantization": None}))
    assert (np.stack(float32.embed([tokenizer(text)["input_ids"] for text in TEXTS])) * expected).sum(1).min() > 0.9999

    def refuse(*_):
        raise AssertionError("quantized again")

    monkeypatch.setattr(openvino_models, "_quantize", refuse)
    assert start_engine(path, spec).model_file == engine.model_file  # the second call reuses the IR
    other = {**batches[0], "input_ids": batches[0]["input_ids"][:, ::-1].copy()}
    with pytest.raises(AssertionError, match="quantized again"):  # other calibration rows: another model
        openvino_models.openvino_model(path, "int8", MINILM, [other], "another corpus")


@pytest.fixture(scope="module")
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


def test_the_gate_passes_openvino_int8_against_float32_and_the_job_runs_it(
        prefect_server, models_home, corpus, tmp_path, embed_spec):
    from tokenmill.flows.batch import batch_flow

    spec = embed_spec(corpus, model=REFERENCE, gate={"reference": REFERENCE, "sample_rows": 128,  # whatever it
                                                     "candidates": [OV_INT8], "min_saving": None})  # costs here
    record = batch_flow(spec)
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    run = mlflow.get_run(record.mlflow_run_id)
    params, metrics = run.data.params, run.data.metrics
    assert params["gate_action"] == "candidate" and params["engine"] == "openvino"
    assert params["quantization"] == "int8" and params["device"] == "cpu"
    assert metrics["gate_candidate0_passed"] == 1.0
    assert metrics["gate_candidate0_cosine_mean"] >= 0.99 and metrics["gate_candidate0_top10_overlap"] >= 0.9
    assert metrics["gate_candidate0_usd_per_1m_tokens"] > 0
    assert "[int8] (openvino): pass, runs the corpus" in record.summary
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 160 and len(set(table.column("id").to_pylist())) == 160  # rows in = rows out
    # the gate's 128 sample rows, computed on the chosen candidate, are not computed again by the corpus run
    assert metrics["rows_from_cache"] == 128 and metrics["engine_tokens"] < metrics["input_tokens"]
    assert len(table.column("embedding")[0].as_py()) == 384
    # each model's sample calls, timed one at a time, give its rates by length (a later corpus's gate is
    # priced by them: prediction.gate_samples_seconds)
    from tokenmill.gate import known_verdict

    cost = known_verdict(spec).candidates[0].cost  # OpenVINO's calls run one at a time (transformers' may not)
    assert cost.rates_by_length and all(mean > 0 and rate > 0 for mean, rate in cost.rates_by_length.values())
    # timed on the sample's second pass (its first at each shape ran 1.5x slower): the first pass is kept apart
    assert cost.untimed_seconds > 0 and cost.seconds > 0


def test_the_row_cache_keys_openvino_int8_by_its_recipe_and_calibration_rows(corpus, tmp_path):
    from tokenmill.row_cache import cache_identity
    from tokenmill.sample_corpus import write_sample_corpus

    path = resolve_model(MINILM)
    spec = JobSpec(input=str(corpus), model=OV_INT8)
    here = cache_identity(spec, path, "openvino")
    assert here["openvino_recipe"]["calibration"] == calibration(spec, path)[1]
    assert here["openvino_recipe"]["kind"] == "static" and here["device"] == "cpu"
    write_sample_corpus(tmp_path / "other", documents=40, files=1, row_group_size=40)
    elsewhere = cache_identity(spec.model_copy(update={"input": str(tmp_path / "other")}), path, "openvino")
    assert elsewhere["openvino_recipe"]["calibration"] != here["openvino_recipe"]["calibration"]
    onnx_int8 = JobSpec(input=str(corpus), model={**OV_INT8, "engine": "onnxruntime"})
    assert "openvino_recipe" not in cache_identity(onnx_int8, path, "onnxruntime")
