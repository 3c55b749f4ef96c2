"""The cheap tier: quantized embedders made once and cached, run by ONNX Runtime, judged by the gate as a ladder.

Real parts only: MiniLM exported to ONNX and quantized by ONNX Runtime here, sentence-transformers as the
reference's own library, a real Prefect flow and MLflow store. No vLLM engine starts in this module.
"""

import mlflow
import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from conftest import TEXTS, flow_run_artifacts
from tokenmill import onnx_models
from tokenmill.models import resolve_model
from tokenmill.onnx_models import RECIPES, int8_isa, onnx_model, recipe
from tokenmill.spec import ONNX_QUANTIZATIONS, JobSpec

MINILM = "all-MiniLM-L6-v2"
REFERENCE = {"name": MINILM, "engine": "transformers"}
INT8 = {"name": MINILM, "engine": "onnxruntime", "quantization": "int8"}
INT4 = {"name": MINILM, "engine": "onnxruntime", "quantization": "int4"}
# int8 with the FFN output projections kept in float32: clear of the top-10 threshold on this corpus (full
# int8 lands at 0.89-0.90 on its 128 rows, so which side it falls on moved with the batches' padding)
INT8_PARTIAL = {**INT8, "quantization": "int8-partial"}


# --- fast: the spec and the recipes ---------------------------------------------------------------

def test_the_spec_names_the_same_methods_the_recipes_make():
    assert set(ONNX_QUANTIZATIONS) == set(RECIPES)


def test_quantizations_are_checked_against_the_engine_that_makes_them():
    assert JobSpec(model=INT8).model.engine == "onnxruntime"
    assert JobSpec(model={"quantization": "int8"}).model.engine == "auto"  # auto: onnxruntime is the only one
    with pytest.raises(ValidationError, match="quantization 'fp8' is vLLM's"):
        JobSpec(model={"engine": "onnxruntime", "quantization": "fp8"})
    with pytest.raises(ValidationError, match="set engine: onnxruntime"):
        JobSpec(model={"engine": "vllm", "quantization": "int8"})
    with pytest.raises(ValidationError, match="onnxruntime engine .* embeds"):
        JobSpec(mode="generate", model={"engine": "onnxruntime"})
    with pytest.raises(ValidationError, match="candidate .* or candidates .*, not both"):
        JobSpec(gate={"reference": REFERENCE, "candidate": INT8, "candidates": [INT4]})


def test_int8_reduces_its_range_where_the_cpu_has_no_vnni():
    assert int8_isa({"avx2", "avx512f", "avx512_vnni"}) == "vnni" and int8_isa({"avx2", "avx_vnni"}) == "vnni"
    assert int8_isa({"avx2", "fma"}) == "no-vnni"
    assert recipe("int8", "no-vnni")["reduce_range"] is True and recipe("int8", "vnni")["reduce_range"] is False
    assert "isa" not in recipe("int4")  # weights only: no u8 x s8 products


# --- the quantized models, made once ------------------------------------------------------------------

@pytest.fixture(scope="module")
def models_home(tmp_path_factory, monkeypatch_module):
    home = tmp_path_factory.mktemp("tokenmill-home")
    monkeypatch_module.setenv("TOKENMILL_HOME", str(home))
    return home / "models" / "onnx"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_each_model_is_made_once_and_its_folder_says_how(models_home, monkeypatch):
    path = resolve_model(MINILM)
    int8 = onnx_model(path, "int8", MINILM)
    made = {p.name for p in models_home.iterdir()}
    assert any(name.startswith(f"{MINILM}.fp32.") for name in made)
    assert int8.parent.name.startswith(f"{MINILM}.int8-{int8_isa()}.")
    assert '"reduce_range"' in (int8.parent / "made.json").read_text()

    def refuse(*_):
        raise AssertionError("made again")

    monkeypatch.setattr(onnx_models, "_export", refuse)
    monkeypatch.setattr(onnx_models, "_quantize", refuse)
    assert onnx_model(path, "int8", MINILM) == int8  # cached: nothing made
    # another instruction set is another recipe, so another file (made only there)
    other = "no-vnni" if int8_isa() == "vnni" else "vnni"
    monkeypatch.setattr(onnx_models, "int8_isa", lambda: other)
    with pytest.raises(AssertionError, match="made again"):
        onnx_model(path, "int8", MINILM)


def test_int8_quantizes_every_weight_matmul_and_int8_partial_keeps_the_ffn_outputs(models_home):
    path = resolve_model(MINILM)
    exported = onnx.load(str(onnx_model(path, None, MINILM)))
    ffn = onnx_models._ffn_output_matmuls(exported)
    assert len(ffn) == 6 and all("/output/dense/" in name and "attention" not in name for name in ffn)

    def ops(quantization):
        return [node.op_type for node in onnx.load(str(onnx_model(path, quantization, MINILM))).graph.node]

    int8, partial, int4 = ops("int8"), ops("int8-partial"), ops("int4")
    assert int8.count("MatMulInteger") == 36 and "MatMul" in int8  # 6 layers x 6 weights; attention stays fp32
    assert partial.count("MatMulInteger") == 30
    assert int4.count("MatMulNBits") == 36 and "MatMulInteger" not in int4


def test_the_onnx_engine_matches_sentence_transformers_in_float32_and_int8_stays_close(models_home):
    from sentence_transformers import SentenceTransformer

    from tokenmill.engines import start_engine
    from tokenmill.models import load_tokenizer

    path = resolve_model(MINILM)
    expected = SentenceTransformer(path, device="cpu").encode(TEXTS)
    tokenizer = load_tokenizer(path)
    batch = [tokenizer(text)["input_ids"] for text in TEXTS]
    for quantization, floor in ((None, 0.99999), ("int8", 0.97)):
        engine = start_engine(path, JobSpec(model={**INT8, "quantization": quantization}))
        vectors = np.stack(engine.embed(batch))
        assert vectors.dtype == np.float32 and vectors.shape == expected.shape
        assert (vectors * expected).sum(1).min() > floor, quantization
        engine.close()


# --- the gate as a ladder, in a real flow ---------------------------------------------------------

@pytest.fixture(scope="module")
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


@pytest.fixture
def corpus(tmp_path):
    from tokenmill.sample_corpus import write_sample_corpus

    write_sample_corpus(tmp_path / "corpus", documents=160, files=1, row_group_size=80)
    return tmp_path / "corpus"


def test_the_ladder_runs_the_cheapest_candidate_that_passes_and_records_every_rung(
        prefect_server, models_home, tmp_path, corpus, embed_spec):
    from tokenmill.flows.batch import batch_flow

    spec = embed_spec(corpus, model=REFERENCE, gate={"reference": REFERENCE, "sample_rows": 128,  # whatever it
                                                     "candidates": [INT4, INT8_PARTIAL], "min_saving": None})  # costs
    state = batch_flow(spec, return_state=True)
    record = state.result()
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    run = mlflow.get_run(record.mlflow_run_id)
    params, metrics = run.data.params, run.data.metrics
    assert params["gate_action"] == "candidate" and params["engine"] == "onnxruntime"
    assert params["quantization"] == "int8-partial"
    assert metrics["gate_candidate0_passed"] == 0.0 and metrics["gate_candidate0_cosine_mean"] < 0.99  # int4
    assert metrics["gate_candidate1_passed"] == 1.0 and metrics["gate_candidate1_cosine_mean"] >= 0.99
    for index in (0, 1):
        assert metrics[f"gate_candidate{index}_usd_per_1m_tokens"] > 0
    assert "[int4] (onnxruntime): FAIL" in record.summary and "runs the corpus" in record.summary
    assert pq.read_table(tmp_path / "out").num_rows == 160
    assert "tokenmill-gate" in flow_run_artifacts(state.state_details.flow_run_id)


def test_a_quantization_that_loses_quality_fails_the_gate_with_its_reason_and_never_runs(
        prefect_server, models_home, tmp_path, corpus, embed_spec):
    from tokenmill.flows.batch import batch_flow
    from tokenmill.flows.gate import GateFailed

    spec = embed_spec(corpus, model=REFERENCE, gate={"reference": REFERENCE, "sample_rows": 128,
                                                     "candidates": [INT4]})
    with pytest.raises(GateFailed) as failure:
        batch_flow(spec)
    assert "candidate all-MiniLM-L6-v2 [int4] (onnxruntime): FAIL" in str(failure.value)
    assert "cosine_mean = 0." in str(failure.value) and "< 0.9900 FAIL" in str(failure.value)
    assert "the job stops" in str(failure.value)
    assert not list(tmp_path.glob("out/*.parquet"))  # the corpus never ran


def test_a_rung_this_machine_measured_too_slow_to_be_chosen_is_not_run(models_home, tmp_path, corpus, monkeypatch):
    from tokenmill import gate
    from tokenmill.gate import evaluate, sample_texts

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    partial = {**INT8, "quantization": "int8-partial"}
    spec = JobSpec(input=str(corpus), model=REFERENCE, gate={  # min_saving null: chosen whatever int8 saves here
        "reference": REFERENCE, "sample_rows": 64, "candidates": [INT8, partial], "thresholds": {"top10_overlap": 0.5},
        "min_saving": None})
    texts, source = sample_texts(spec)

    def seed_rate(tokens_per_s):  # as an earlier ladder on this machine would have noted it, at every length
        slow = {str(c): tokens_per_s for c in range(12)}
        gate._update_verdicts(lambda cache: cache.setdefault("rates", {}).update(
            {gate._rate_key(gate._gate_job(spec, JobSpec(model=partial).model)): slow}))

    seed_rate(1.0)
    report = evaluate(spec, texts, source)
    assert report.chosen == 0 and report.candidates[1].skipped.startswith("not run")
    assert report.candidates[1].metrics == [] and "not run: this machine measured it at 1 tokens/s" in report.message()
    seed_rate(1e9)  # a rung that might be the cheapest runs, and its measured rate replaces the seeded one
    report = evaluate(spec, texts, source, refresh=True)
    assert not report.candidates[1].skipped and report.candidates[1].metrics
