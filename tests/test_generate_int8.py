"""SmolLM2-135M-Instruct-W8A8: the float32 SmolLM2 quantized here to int8 weights and activations
(compressed-tensors W8A8), checked in its file and run by vLLM's CPU backend against float32.

The checkpoint tests need no engine. The engine test starts one vLLM engine (the int8 model's);
its float32 reference runs on the transformers engine, which generates exactly what float32 vLLM
generates on these prompts (tests/test_gate.py, bench/GENERATE_INT8.md).

What int8 agreement looks like on this model (bench/GENERATE_INT8.md has the figures on 64
prompts): SmolLM2-135M's greedy outputs are fragile, so whole outputs rarely match float32's
(the first token that flips sends the rest elsewhere), but token by token, with float32's tokens
fed to both, int8 picks float32's next token about 9 times in 10. The gate's default generate
thresholds (exact_match 0.60) fail this candidate; the thresholds below are what a sound int8 passes
and a broken one (scales off by 4x, a coarser grid) does not.
"""

import json
import re

import numpy as np
import pytest
from safetensors import safe_open

from conftest import TEST_GENERATE_MODEL
from tokenmill.encoding import encode_rows
from tokenmill.engines import get_engine, is_open
from tokenmill.gate import evaluate, job_for
from tokenmill.models import W8A8_RECIPE, prepare_smollm2_int8, resolve_model, weights_digest
from tokenmill.spec import ChatMessage, GenerationParams, JobSpec, ModelSpec

INT8_ALIAS = "SmolLM2-135M-Instruct-W8A8"
INT8_MODEL = ModelSpec(name=INT8_ALIAS, engine="vllm", engine_kwargs=TEST_GENERATE_MODEL.engine_kwargs)
REFERENCE = {"name": "SmolLM2-135M-Instruct", "engine": "transformers"}  # float32 on CPU
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "What does a batch job do?",
    "Why do spot GPUs cost less than on-demand ones?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Write one sentence about the sea.", "What is Parquet used for?",
]
MAX_TOKENS = 32
# Measured on these questions here (vLLM 0.32 CPU, oneDNN int8 kernel), sound int8: exact_match 0.25,
# prefix_agreement 0.40, similarity_mean 0.81; next-token agreement 0.885, float32's tokens 0.046 nats less
# likely. Quantized on a grid 4x coarser (scales x4 when quantizing: ~6-bit weights): exact_match 0,
# prefix_agreement 0.18, similarity_mean 0.73; next-token 0.82, 0.159 nats. Stored scales x4 (weights x4):
# every figure near 0, ~15 nats. On a Xeon with AMX (vLLM's AMX int8 kernel, bf16 activations: see the dtype
# test): exact_match 0.125, prefix_agreement 0.41, similarity_mean 0.85; next-token 0.917, 0.043 nats.
INT8_THRESHOLDS = {"exact_match": 0.1, "prefix_agreement": 0.2, "similarity_mean": 0.6}
NEXT_TOKEN_AGREEMENT = 0.8
LOGPROB_DROP = 0.1  # nats per token: float32's logprob of its own greedy tokens minus int8's


@pytest.fixture(scope="module")
def checkpoint():
    return prepare_smollm2_int8()


# --- the checkpoint, without an engine ------------------------------------------

def test_the_alias_resolves_to_a_cached_checkpoint_named_by_its_recipe_and_source(checkpoint):
    assert resolve_model(INT8_ALIAS) == str(checkpoint) == resolve_model(INT8_ALIAS.lower())
    written = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2_int8() == checkpoint  # made once: the second call finds it
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == written
    assert re.fullmatch(r"SmolLM2-135M-Instruct-W8A8-compressed-tensors-[0-9a-f]{12}", checkpoint.name)
    recipe = json.loads((checkpoint / "tokenmill-quantization.json").read_text())
    assert {k: recipe[k] for k in W8A8_RECIPE} == W8A8_RECIPE
    assert recipe["source_sha256"] == weights_digest(checkpoint.parent / "SmolLM2-135M-Instruct")
    assert not list(checkpoint.parent.glob(checkpoint.name + ".partial-*"))  # written aside, then renamed


def test_the_config_asks_for_w8a8_int8_as_llmcompressor_writes_it(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    assert config["quantization_status"] == "compressed" and config["ignore"] == ["lm_head"]
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    weights, activations = group["weights"], group["input_activations"]
    assert (weights["num_bits"], weights["type"], weights["strategy"], weights["symmetric"], weights["dynamic"]) \
        == (8, "int", "channel", True, False)
    assert (activations["num_bits"], activations["type"], activations["strategy"], activations["symmetric"],
            activations["dynamic"]) == (8, "int", "token", True, True)


def test_the_int8_checkpoint_runs_in_bf16_on_an_amx_cpu_and_float32_elsewhere(checkpoint, monkeypatch):
    """vLLM's CPU int8 linear takes its AMX kernel on any CPU with AMX tiles, and that kernel takes only bf16 or
    fp16 activations: in float32 the engine died on its first call on a Xeon with AMX. So an int8 checkpoint with
    dtype auto runs in bf16 there, float32 on a CPU without AMX (as every other model does), and a dtype the
    job sets is kept."""
    from tokenmill import vllm_engine

    assert vllm_engine.int8_checkpoint(str(checkpoint))
    assert not vllm_engine.int8_checkpoint(resolve_model("SmolLM2-135M-Instruct"))
    spec = JobSpec(mode="generate", model=ModelSpec(name=INT8_ALIAS, engine="vllm"))
    for amx, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(vllm_engine, "cpu_has_amx", lambda amx=amx: amx)
        assert vllm_engine.vllm_engine_args(str(checkpoint), spec)["dtype"] == dtype
        float_model = resolve_model("SmolLM2-135M-Instruct")
        assert vllm_engine.vllm_engine_args(float_model, spec)["dtype"] == "float32"
    pinned = spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "float32"})})
    assert vllm_engine.vllm_engine_args(str(checkpoint), pinned)["dtype"] == "float32"


def test_every_linear_weight_is_int8_per_output_channel_and_dequantizes_to_the_float32_weight(checkpoint):
    source = checkpoint.parent / "SmolLM2-135M-Instruct" / "model.safetensors"
    with safe_open(checkpoint / "model.safetensors", "pt") as quantized, safe_open(source, "pt") as reference:
        names = set(quantized.keys())
        linear = sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale"))
        assert len(linear) == 30 * 7  # q, k, v, o, gate, up, down in each of the 30 layers
        for name in linear:
            weight, scale = quantized.get_tensor(f"{name}.weight"), quantized.get_tensor(f"{name}.weight_scale")
            original = reference.get_tensor(f"{name}.weight")
            assert weight.dtype.is_floating_point is False and str(weight.dtype) == "torch.int8", name
            assert scale.shape == (weight.shape[0], 1) and weight.shape == original.shape
            # symmetric minmax, as llmcompressor's observer: the row's absmax spans [-127.5, 127.5] steps
            expected = original.abs().amax(dim=1, keepdim=True) / 127.5
            assert np.allclose(scale.numpy(), expected.numpy(), rtol=1e-6), name
            error = (weight.float() * scale - original).abs()
            assert bool((error <= scale / 2 * (1 + 1e-4)).all()), name  # round to nearest, no clipping
        # embeddings (tied to lm_head) and norms stay float32
        rest = names - {f"{n}.{p}" for n in linear for p in ("weight", "weight_scale")}
        assert "model.embed_tokens.weight" in rest
        assert all(str(quantized.get_slice(n).get_dtype()) == "F32" for n in rest)
        assert not any(n.startswith("lm_head") and n.endswith("scale") for n in names)


# --- on vLLM, against float32 ---------------------------------------------------

@pytest.mark.engine
def test_vllm_runs_the_int8_candidate_as_int8_and_it_agrees_with_float32(checkpoint):
    """tokenmill's gate (reference float32, candidate the alias on vLLM), then, on the same engine,
    how often int8 picks float32's next token."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    generation = GenerationParams(max_tokens=MAX_TOKENS, messages=[ChatMessage(role="user", content="{text}")])
    spec = JobSpec(mode="generate", model=INT8_MODEL, generation=generation,
                   gate={"reference": REFERENCE, "sample_rows": len(QUESTIONS), "max_tokens": MAX_TOKENS,
                         "thresholds": INT8_THRESHOLDS})
    report = evaluate(spec, QUESTIONS, "questions")
    print(report.message())
    assert report.passed, report.message()
    assert report.candidate.engine == "vllm" and report.reference.engine == "transformers"

    # the candidate's engine stays open after the gate: vLLM found the quantization in the config
    candidate = job_for(spec, INT8_MODEL)
    assert is_open(str(checkpoint), candidate)
    engine = get_engine(str(checkpoint), candidate)
    model_config = engine.llm.llm_engine.model_config
    assert model_config.quantization == "compressed-tensors"
    assert model_config.hf_config.quantization_config["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    answers = engine.generate(encode_rows(QUESTIONS[:1], candidate, str(checkpoint)).token_ids, generation)
    assert "paris" in answers[0].text.lower()

    # next-token agreement: float32's greedy outputs (transformers) fed to the int8 engine. Greedy outputs part
    # for good at the first token that flips; this counts how often one does, and how much less likely the
    # int8 model finds float32's tokens.
    prompts = encode_rows(QUESTIONS, candidate, str(checkpoint)).token_ids
    reference = AutoModelForCausalLM.from_pretrained(resolve_model(REFERENCE["name"]), dtype=torch.float32).eval()
    sequences, reference_logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            sequence = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0]
            logprobs = reference(sequence[None]).logits[0].log_softmax(-1)
            sequences.append(sequence.tolist())
            reference_logprobs.append([float(logprobs[i - 1, sequence[i]]) for i in range(len(prompt), len(sequence))])
    scored = engine.llm.generate([{"prompt_token_ids": s} for s in sequences],
                                 SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    top, drops = [], []
    for prompt, sequence, output, wanted in zip(prompts, sequences, scored, reference_logprobs):
        for position, reference_logprob in zip(range(len(prompt), len(sequence)), wanted):
            entry = output.prompt_logprobs[position][sequence[position]]
            top.append(entry.rank == 1)
            drops.append(reference_logprob - entry.logprob)
    agreement, drop = float(np.mean(top)), float(np.mean(drops))
    print(f"next-token agreement {agreement:.3f} over {len(top)} tokens; mean logprob drop {drop:.3f}")
    assert agreement >= NEXT_TOKEN_AGREEMENT and drop <= LOGPROB_DROP, (agreement, drop)
