"""The eval gate with real models on CPU: matching candidates pass, damaged ones fail, and
use_reference runs the corpus with the reference. Embed (MiniLM) and generate (SmolLM2)."""

import shutil

import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import TEST_EMBED_MODEL, TEST_GENERATE_MODEL, flow_run_artifacts, write_parquet
from tokenmill.engine_protocol import Generation
from tokenmill.errors import ConfigError
from tokenmill.gate import embedding_agreement, generation_agreement, neighbour_overlap, sample_texts, thresholds_for
from tokenmill.models import resolve_model
from tokenmill.spec import JobSpec

REFERENCE_EMBED = {"name": "all-MiniLM-L6-v2", "engine": "transformers"}
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "What does a batch job do?",
    "Why do spot GPUs cost less than on-demand ones?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Write one sentence about the sea.", "What is Parquet used for?",
]


# --- metrics, without models --------------------------------------------------

def test_identical_vectors_agree_fully_and_noise_lowers_every_metric():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(64, 32))
    same = embedding_agreement(vectors, vectors.copy())
    assert same == pytest.approx({"cosine_mean": 1.0, "cosine_p5": 1.0, "top10_overlap": 1.0})
    noisy = embedding_agreement(vectors, vectors + rng.normal(scale=1.0, size=vectors.shape))
    assert noisy["cosine_mean"] < 0.9 and noisy["cosine_p5"] < noisy["cosine_mean"] and noisy["top10_overlap"] < 0.6
    assert neighbour_overlap(vectors, rng.permutation(vectors)) < 0.4


def test_generation_agreement_counts_exact_matches_and_the_agreeing_prefix():
    tokenizer_path = resolve_model("all-MiniLM-L6-v2")  # any tokenizer will do for the arithmetic
    reference = [Generation("the cat sat on the mat", 6, "stop"), Generation("paris", 1, "stop")]
    candidate = [Generation("the cat sat on a hat", 6, "stop"), Generation("paris", 1, "stop")]
    values = generation_agreement(reference, candidate, tokenizer_path)
    assert values["exact_match"] == 0.5
    assert values["prefix_agreement"] == pytest.approx((4 / 6 + 1) / 2)
    assert 0.5 < values["similarity_mean"] < 1.0


def _rung(model, usd_per_1m, passed=True):
    from tokenmill.gate import CandidateVerdict, GateMetric, ModelCost

    cost = ModelCost(model=model, engine="openvino", seconds=1.0, tokens=1000, tokens_per_s=1.0 / usd_per_1m,
                     usd_per_1m_tokens=usd_per_1m)
    return CandidateVerdict(cost=cost, passed=passed,
                            metrics=[GateMetric(name="cosine_mean", value=0.999 if passed else 0.5, threshold=0.99,
                                                passed=passed)])


def test_the_prediction_picks_by_the_rule_the_verdict_picks_by(tmp_path, monkeypatch):
    """gate.pick_cheapest: the cheapest that saves gate.min_saving, else the first listed within COST_TIE_MARGIN
    of it; prediction.default_pick (before any verdict, at the default rates) and GateReport.judge (measured
    costs) both use it, so the model predicted is the one the gate picks when every rung passes."""
    from tokenmill import prediction
    from tokenmill.gate import GateReport, candidate_models, pick_cheapest

    assert pick_cheapest({0: 0.52, 1: 0.50}, {0: 0.48, 1: 0.50}, 0.1) == 0  # within the margin: listed first
    assert pick_cheapest({0: 0.60, 1: 0.50}, {0: 0.40, 1: 0.50}, 0.1) == 1
    assert pick_cheapest({0: 0.80, 1: 0.95}, {0: 0.20, 1: 0.05}, 0.2) == 0  # a saving of exactly the floor
    assert pick_cheapest({0: 0.95}, {0: 0.05}, 0.1) is None and pick_cheapest({0: 1.2}, {0: -0.2}, None) == 0
    assert pick_cheapest({}, {}, None) is None

    rates = {("openvino", None): 7000.0, ("onnxruntime", "int8"): 11200.0, ("openvino", "int8"): 5600.0}
    monkeypatch.setattr(prediction, "default_rate", lambda engine, mode, quantization=None: rates[engine, quantization])
    ladder = [{"name": "all-MiniLM-L6-v2", "engine": "openvino", "quantization": "int8"},
              {"name": "all-MiniLM-L6-v2", "engine": "onnxruntime", "quantization": "int8"}]
    reference = {"name": "all-MiniLM-L6-v2", "engine": "openvino"}
    for floor in (None, 0.1, 0.5):
        spec = JobSpec(input=str(tmp_path), gate={"reference": reference, "candidates": ladder, "min_saving": floor})
        costs = [1e6 / rates[m.engine, m.quantization] * 0.02 for m in [spec.gate.reference, *candidate_models(spec)]]
        report = GateReport.judge(spec, "sample", 128, _rung("reference", costs[0]).cost,
                                  [_rung(f"rung {i}", c) for i, c in enumerate(costs[1:])])
        picked = prediction.default_pick(spec)
        assert picked == (None if report.chosen is None else candidate_models(spec)[report.chosen]), floor
        assert (picked is None) == (floor == 0.5)  # ONNX Runtime int8 saves 37.5% at these rates


def test_a_candidate_that_passes_but_saves_nothing_leaves_the_corpus_to_the_reference(tmp_path, monkeypatch):
    from tokenmill import gate
    from tokenmill.gate import GateReport, chosen_model, evaluate, verdict_key

    reference = _rung("all-MiniLM-L6-v2", 0.0200).cost
    ladder = [{"name": "all-MiniLM-L6-v2", "engine": "openvino", "quantization": "int8"},
              {"name": "all-MiniLM-L6-v2", "engine": "onnxruntime", "quantization": "int8"}]

    def judged(rungs, **gate_fields):
        spec = JobSpec(input=str(tmp_path), gate={"reference": {"name": "all-MiniLM-L6-v2", "engine": "openvino"},
                                                  "candidates": ladder, **gate_fields})
        return spec, GateReport.judge(spec, "sample", 128, reference, rungs)

    # int8 on a CPU without VNNI: it passes, and costs 3% more than float32; the other rung fails
    spec, report = judged([_rung("int8 ov", 0.0205), _rung("int8 ort", 0.0100, passed=False)])
    assert report.passed and report.action == "reference" and report.chosen is None
    assert chosen_model(spec, report) == spec.gate.reference
    assert "int8 ov (openvino) passed but costs 2.5% more" in report.declined
    assert "the corpus ran on the reference" in report.verdict(1e6) and report.usd_saved(1e6) == 0.0
    assert report.mlflow_metrics()["gate_usd_per_1m_saved_fraction"] == 0.0
    assert "saves too little to run the corpus" in report.message() and "runs the corpus" not in \
        report.message().replace("saves too little to run the corpus", "")
    assert report.table()[1]["verdict"] == "pass, saves too little to run the corpus"
    # with on_fail: fail too: a candidate passed, so the reference runs; the job does not stop
    assert judged([_rung("int8 ov", 0.0205)], on_fail="fail")[1].action == "reference"
    # a saving runs the candidate; a saving under min_saving (default 0.1: more than timing noise) does not;
    # min_saving null runs any that passes
    assert judged([_rung("int8 ov", 0.0150)])[1].action == "candidate"
    noise = judged([_rung("int8 ov", 0.0199)])[1]  # `make run` here: $0.0262 against $0.0263
    assert noise.action == "reference" and "passed but saves only 0.5%" in noise.declined
    assert judged([_rung("int8 ov", 0.0199)], min_saving=0)[1].action == "candidate"
    assert judged([_rung("int8 ov", 0.0180)], min_saving=0.2)[1].action == "reference"
    assert judged([_rung("int8 ov", 0.0180)], min_saving=0.05)[1].chosen == 0
    assert judged([_rung("int8 ov", 0.0300)], min_saving=None)[1].action == "candidate"
    assert judged([_rung("int8 ov", 0.0210)], min_saving=-0.1)[1].action == "candidate"
    # the saving is judged on the rung that runs: a listed-first rung within the tie margin of the cheapest
    assert judged([_rung("int8 ov", 0.0195), _rung("int8 ort", 0.0180)], min_saving=0)[1].chosen == 0
    # only rungs that save enough are chosen from: the listed-first one saves 2.5%, the other 15%
    assert judged([_rung("int8 ov", 0.0195), _rung("int8 ort", 0.0170)])[1].chosen == 1
    declined = judged([_rung("int8 ov", 0.0195), _rung("int8 ort", 0.0190)])[1]  # 2.5% and 5%: under 0.1
    assert declined.action == "reference" and declined.declined.startswith("int8 ort (openvino) passed but "
                                                                           "saves only 5.0%")
    with pytest.raises(ValueError):
        JobSpec(gate={"reference": {}, "min_saving": 1.0})
    # a job priced at 0 still tells a faster candidate from a slower one (both run at its one price)
    free = [_rung("int8 ov", 0.0100).model_copy(update={"cost": _rung("int8 ov", 0.0100).cost.model_copy(
        update={"usd_per_1m_tokens": 0.0})})]
    priced_at_0 = GateReport.judge(judged(free)[0], "sample", 128, reference.model_copy(
        update={"usd_per_1m_tokens": 0.0}), free)
    assert priced_at_0.action == "candidate" and priced_at_0.saving() == pytest.approx(0.5)

    # a kept verdict is judged again under the job's min_saving: no engine starts
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    spec, report = judged([_rung("int8 ov", 0.0205), _rung("int8 ort", 0.0100, passed=False)])
    gate._write_verdict(verdict_key(spec, ["a", "b"]), report)
    again = evaluate(spec, ["a", "b"], "sample")
    assert again.cached and again.action == "reference" and again.declined == report.declined
    relaxed = spec.model_copy(update={"gate": spec.gate.model_copy(update={"min_saving": None})})
    assert verdict_key(relaxed, ["a", "b"]) == verdict_key(spec, ["a", "b"])
    assert evaluate(relaxed, ["a", "b"], "sample").action == "candidate"
    # a verdict kept before ladders (no rungs): its one candidate, judged again under min_saving too
    old = report.model_copy(update={"candidates": [], "candidate": _rung("int8 ov", 0.0205).cost,
                                    "metrics": _rung("int8 ov", 0.0205).metrics, "declined": ""})
    gate._write_verdict(verdict_key(spec, ["c"]), old)
    assert evaluate(spec, ["c"], "sample").action == "reference"


def test_the_sample_is_deterministic_whatever_the_sharding(tmp_path):
    write_parquet(tmp_path / "a.parquet", [f"a{i}" for i in range(300)], [f"text {i}" for i in range(300)],
                  row_group_size=50)
    gate = {"reference": {"name": "all-MiniLM-L6-v2"}, "sample_rows": 20}
    first, _ = sample_texts(JobSpec(input=str(tmp_path), gate=gate, batching={"max_shard_rows": 50}))
    second, _ = sample_texts(JobSpec(input=str(tmp_path), gate=gate, batching={"max_shard_rows": 5000}))
    assert len(first) == 20 and first == second
    other, _ = sample_texts(JobSpec(input=str(tmp_path), gate={**gate, "sample_seed": 1}))
    assert other != first


def test_unknown_threshold_names_are_refused():
    spec = JobSpec(gate={"reference": {}, "thresholds": {"cosine_mean": 0.9, "cosine_avg": 0.9}})
    with pytest.raises(ConfigError, match=r"unknown metric\(s\) \['cosine_avg'\]"):
        thresholds_for(spec)
    assert thresholds_for(JobSpec(gate={"reference": {}, "thresholds": {"cosine_mean": 0.5}}))["cosine_mean"] == 0.5


# --- real models ----------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


def modified_copy(model_name: str, target, change) -> str:
    """A copy of the model (config, tokenizer, sentence-transformers files) whose every weight
    matrix is replaced, in place, by change(matrix), saved in fp32."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    source = resolve_model(model_name)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
    loader = AutoModel if model_name == "all-MiniLM-L6-v2" else AutoModelForCausalLM
    model = loader.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                change(parameter)
    model.save_pretrained(target)
    return str(target)


def damaged_copy(model_name: str, target, scale: float) -> str:
    """The model with gaussian noise on every weight matrix: what a broken quantization does."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def add_noise(weights):
        weights.add_(torch.randn(weights.shape, generator=generator) * weights.std() * scale)

    return modified_copy(model_name, target, add_noise)


def quantized_copy(model_name: str, target, bits: int) -> str:
    """The model with its weight matrices rounded to `bits`-bit integers per output channel
    (absmax scaling), stored back in fp32: what a weight-only quantization does to the values."""
    import torch

    levels = 2 ** (bits - 1) - 1

    def quantize(weights):
        scale = weights.abs().amax(dim=1, keepdim=True) / levels
        weights.copy_(torch.round(weights / scale).clamp(-levels, levels) * scale)

    return modified_copy(model_name, target, quantize)


def test_embed_gate_passes_int8_weights_and_fails_naive_int4_weights(tmp_path):
    """The default thresholds against real quantizations of MiniLM (transformers engine, CPU)."""
    from tokenmill.gate import evaluate

    texts = list(QUESTIONS) + [f"{q} Explain briefly." for q in QUESTIONS] + \
        [f"A note on topic {i}: batching makes offline inference cheap." for i in range(48)]
    reports = {}
    for bits in (8, 4):
        spec = JobSpec(mode="embed", model={"name": quantized_copy("all-MiniLM-L6-v2", tmp_path / f"w{bits}", bits),
                                            "engine": "transformers"},
                       gate={"reference": REFERENCE_EMBED, "sample_rows": len(texts)})
        reports[bits] = evaluate(spec, texts, "test texts")
    assert reports[8].passed, reports[8].message()
    assert not reports[4].passed
    assert "cosine_mean = 0." in reports[4].message() and "< 0.9900 FAIL" in reports[4].message()


@pytest.fixture(scope="module")
def damaged_minilm(tmp_path_factory):
    return damaged_copy("all-MiniLM-L6-v2", tmp_path_factory.mktemp("damaged") / "minilm", scale=0.5)


@pytest.fixture(scope="module")
def damaged_smollm2(tmp_path_factory):
    return damaged_copy("SmolLM2-135M-Instruct", tmp_path_factory.mktemp("damaged") / "smollm2", scale=0.5)


@pytest.fixture
def embed_corpus(tmp_path):
    from tokenmill.sample_corpus import write_sample_corpus

    write_sample_corpus(tmp_path / "corpus", documents=120, files=1, row_group_size=60)
    return tmp_path / "corpus"


@pytest.mark.engine
def test_embed_gate_passes_a_matching_candidate_and_the_corpus_runs_with_it(tmp_path, embed_corpus, embed_spec):
    from tokenmill.flows.batch import batch_flow

    spec = embed_spec(embed_corpus, model=TEST_EMBED_MODEL,  # candidate: the same MiniLM on vLLM
                      # whatever it costs here: this test is about quality, the fast one above about cost
                      gate={"reference": REFERENCE_EMBED, "sample_rows": 64, "min_saving": None})
    state = batch_flow(spec, return_state=True)
    record = state.result()
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    run = mlflow.get_run(record.mlflow_run_id)
    assert run.data.params["gate_action"] == "candidate" and run.data.params["engine"] == "vllm"
    metrics = run.data.metrics
    assert metrics["gate_passed"] == 1.0 and metrics["gate_cosine_mean"] >= 0.999
    assert metrics["gate_top10_overlap"] >= 0.9
    for role in ("reference", "candidate"):
        assert metrics[f"gate_{role}_tokens_per_s"] > 0 and metrics[f"gate_{role}_usd_per_1m_tokens"] > 0
    assert pq.read_table(tmp_path / "out").num_rows == 120
    assert "tokenmill-gate" in flow_run_artifacts(state.state_details.flow_run_id)
    # predicted before the gate ran (no verdict yet: the candidate cheapest at the defaults), held to the run
    assert metrics["predicted_wall_seconds"] > 0 and "wall_prediction_error" in metrics


@pytest.mark.engine
def test_embed_gate_fails_a_damaged_candidate_with_each_metric_against_its_threshold(
        tmp_path, embed_corpus, embed_spec, damaged_minilm):
    from tokenmill.flows.batch import batch_flow
    from tokenmill.flows.gate import GateFailed

    spec = embed_spec(embed_corpus, model={"name": damaged_minilm, "engine": "transformers"},
                      gate={"reference": REFERENCE_EMBED, "sample_rows": 64})
    with pytest.raises(GateFailed) as failure:
        batch_flow(spec)
    message = str(failure.value)
    assert "eval gate FAILED on 64 rows" in message
    for name in ("cosine_mean", "cosine_p5", "top10_overlap"):
        assert f"  {name} = " in message
    assert "< 0.9900 FAIL" in message  # cosine_mean against its default
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.parquet"))  # no corpus run
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    runs = mlflow.search_runs(experiment_names=["tests"], filter_string="tags.`tokenmill.stage` = 'gate'")
    assert len(runs) >= 1 and runs.iloc[0]["metrics.gate_passed"] == 0.0


@pytest.mark.engine
def test_embed_gate_use_reference_runs_the_corpus_with_the_reference_measured_before_the_runs_prediction(
        tmp_path, embed_corpus, damaged_minilm):
    """`tokenmill run`, as a user runs it: the gate (no verdict here yet) measures before the prediction, which
    then names the model the corpus runs on, the reference; the next run finds the verdict kept."""
    import json
    import os
    import re
    import subprocess
    import sys

    import yaml

    job = {"input": str(embed_corpus), "output": str(tmp_path / "out"), "mode": "embed",
           "model": {"name": damaged_minilm, "engine": "transformers"},
           "gate": {"reference": REFERENCE_EMBED, "sample_rows": 64, "on_fail": "use_reference"},
           "tracking": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tests"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / ".prefect"), TOKENMILL_CACHE_DIR=str(tmp_path / "cache"))

    logs = []

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run", "--config", str(tmp_path / "job.yaml"),
                               "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        logs.append(done.stdout + done.stderr)
        return done.stdout.splitlines()

    lines = run()
    assert "eval gate FAILED" in logs[0] and "verdict cached" not in logs[0]  # the flow's gate: measured by this run
    measuring = lines.index("Eval gate: no verdict here on this sample yet; measuring 2 models on 64 rows before the "
                            "prediction")
    failed = next(i for i, line in enumerate(lines) if line.startswith("eval gate FAILED on 64 rows"))
    predicted = next(i for i, line in enumerate(lines) if line.startswith("predicted wall"))
    assert measuring < failed < predicted
    assert lines[predicted].startswith("predicted wall") and " on transformers: " in lines[predicted]
    assert "s before this prediction, no verdict here on this sample yet" in lines[predicted]
    assert "verdict on this sample kept (reference)" in lines[predicted]  # the flow's gate, after it
    mlflow.set_tracking_uri(job["tracking"]["mlflow_tracking_uri"])
    record = mlflow.search_runs(experiment_names=["tests"], order_by=["attributes.start_time DESC"]).iloc[0]
    assert record["params.gate_action"] == "reference" and record["params.model"] == "all-MiniLM-L6-v2"
    assert record["metrics.gate_passed"] == 0.0 and record["metrics.predicted_wall_seconds"] > 0
    assert "metrics.predicted_wall_seconds_as_gated" not in record or np.isnan(
        record["metrics.predicted_wall_seconds_as_gated"])  # predicted on the model that ran: no other branch
    # its seconds stored as a measuring gate's, for the next prediction of a gate of these models
    stored = json.loads((tmp_path / "cache" / "run-parts.json").read_text())
    gate_parts = next(v for k, v in stored.items() if "|gate|" in k)
    assert gate_parts["gate"] and gate_parts["gate, verdict kept"]  # measured before, found kept in the flow
    # the job's wall (its cost) holds its gate, as when the gate runs in the flow
    before = float(re.search(r"eval gate [\d.]+ s \(([\d.]+) s before this prediction", lines[predicted]).group(1))
    assert record["metrics.wall_seconds"] > before + record["metrics.engine_seconds"]
    # the corpus really ran on the reference: its vectors match the reference model's
    from sentence_transformers import SentenceTransformer

    table = pq.read_table(tmp_path / "out")
    texts = {i: t for i, t in zip(*pq.read_table(embed_corpus, columns=["id", "text"]).to_pydict().values())}
    first_ids = table.column("id").to_pylist()[:5]
    expected = SentenceTransformer(resolve_model("all-MiniLM-L6-v2"), device="cpu").encode(
        [texts[i] for i in first_ids])
    ours = np.array(table.column("embedding").to_pylist()[:5])
    assert (ours * expected).sum(1).min() > 0.999
    again = run()  # the verdict kept: no gate before the prediction
    assert not any(line.startswith("Eval gate:") for line in again)
    assert "verdict cached" in logs[1]  # kept by the run before
    assert "before this prediction" not in next(line for line in again if line.startswith("predicted wall"))


@pytest.fixture
def questions(tmp_path):
    write_parquet(tmp_path / "q.parquet", [f"q{i}" for i in range(len(QUESTIONS))], QUESTIONS)
    return tmp_path / "q.parquet"


def generate_spec(tmp_path, questions, model, **gate):
    return JobSpec.model_validate(dict(
        input=str(questions), output=str(tmp_path / "out"), mode="generate", model=model,
        generation={"max_tokens": 16}, batching={"max_shard_rows": 100},
        tracking={"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tests"},
        gate={"reference": {"name": "SmolLM2-135M-Instruct", "engine": "transformers"},
              "sample_rows": len(QUESTIONS), "max_tokens": 16, **gate}))


@pytest.mark.engine
def test_generate_gate_passes_the_same_model_on_vllm(tmp_path, questions):
    from tokenmill.flows.gate import gate_flow

    report = gate_flow(generate_spec(tmp_path, questions, TEST_GENERATE_MODEL))
    assert report.passed, report.message()
    values = {m.name: m.value for m in report.metrics}
    assert values["exact_match"] >= 0.75 and values["similarity_mean"] >= 0.95
    assert report.candidate.engine == "vllm" and report.reference.engine == "transformers"


@pytest.mark.engine
def test_generate_gate_fails_a_damaged_model_and_use_reference_runs_the_reference(tmp_path, questions,
                                                                                   damaged_smollm2):
    from tokenmill.flows.batch import batch_flow
    from tokenmill.flows.gate import GateFailed, gate_flow

    damaged = {"name": damaged_smollm2, "engine": "transformers"}
    with pytest.raises(GateFailed, match=r"exact_match = 0\.\d+ < 0\.6000 FAIL"):
        gate_flow(generate_spec(tmp_path, questions, damaged))

    spec = generate_spec(tmp_path, questions, damaged, on_fail="use_reference")
    record = batch_flow(spec)
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    run = mlflow.get_run(record.mlflow_run_id)
    assert run.data.params["gate_action"] == "reference" and run.data.params["engine"] == "transformers"
    answers = pq.read_table(tmp_path / "out").to_pydict()
    assert "paris" in answers["output_text"][0].lower()  # the reference answers; the damaged one would not
