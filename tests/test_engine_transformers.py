"""The transformers engine on CPU: same interface as vLLM, padding as cut, vectors as sentence-transformers."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import TEXTS, write_parquet
from tokenmill.encoding import encode_rows
from tokenmill.engines import get_engine
from tokenmill.embedding import Pooling, read_pooling
from tokenmill.models import resolve_model
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec, ModelSpec
from tokenmill.resolution import resolve_job

LONG_TEXT = " ".join(f"Sentence number {i} talks about batching and padding." for i in range(80))


@pytest.fixture(scope="module")
def embed_spec_hf():
    return JobSpec(mode="embed", model=ModelSpec(name="all-MiniLM-L6-v2", engine="transformers"))


def test_pooling_is_read_from_the_sentence_transformers_config():
    pooling = read_pooling(resolve_model("all-MiniLM-L6-v2"))
    assert (pooling.mode, pooling.normalize) == ("mean", True)


def test_embeddings_match_sentence_transformers_in_padded_batches(embed_spec_hf):
    from sentence_transformers import SentenceTransformer

    texts = TEXTS + [LONG_TEXT]
    model_path = resolve_model("all-MiniLM-L6-v2")
    encoded = encode_rows(texts, embed_spec_hf, model_path)
    engine = get_engine(model_path, embed_spec_hf)
    assert engine.name == "transformers"
    # one padded batch of very different lengths, then one row at a time: padding must not leak in
    together = np.stack(engine.embed(encoded.token_ids))
    alone = np.stack([engine.embed([ids])[0] for ids in encoded.token_ids])
    reference = SentenceTransformer(model_path, device="cpu").encode(texts, convert_to_numpy=True)
    for ours in (together, alone):
        cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
        assert cosine.min() >= 0.999, cosine
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


def test_vectors_hold_only_themselves_not_the_hidden_state(embed_spec_hf):
    """A shard keeps every batch's vectors until it is written. `cls` pooling is a view of the last
    hidden state; the engine must hand back memory of rows x dim, not rows x tokens x dim."""
    model_path = resolve_model("all-MiniLM-L6-v2")
    engine = get_engine(model_path, embed_spec_hf)
    encoded = encode_rows(TEXTS + [LONG_TEXT], embed_spec_hf, model_path)
    saved = engine.pooling
    try:
        for pooling in (Pooling("cls", False), saved):
            engine.pooling = pooling
            vectors = engine.embed(encoded.token_ids)
            for vector in vectors:
                parent = vector.base if vector.base is not None else vector
                # the batch's vectors and nothing else: a view into the hidden state strides over its tokens
                assert parent.strides == (384 * 4, 4) and parent.shape == (len(vectors), 384), (pooling, parent.strides)
    finally:
        engine.pooling = saved


def test_a_shard_runs_through_the_transformers_engine(tmp_path, embed_spec_hf):
    ids = [f"row-{i}" for i in range(len(TEXTS))]
    write_parquet(tmp_path / "in.parquet", ids, TEXTS)
    job = embed_spec_hf.model_copy(update={"input": str(tmp_path), "output": str(tmp_path / "out")})
    (shard,) = discover_shards(job.input)
    result = run_shard(shard, resolve_job(job))
    table = pq.read_table(tmp_path / "out")
    assert table.column("id").to_pylist() == ids and result.rows_out == len(TEXTS)
    assert len(table.column("embedding")[0]) == 384


def test_two_streams_keep_batch_order_progress_and_vectors(embed_spec_hf, monkeypatch):
    """On CPU the engine runs two batches at once (cpu_streams auto); run_batches must hand back every
    batch's vectors in the batches' order, report every row once, and match one batch at a time."""
    import threading

    import torch

    from tokenmill import progress
    from tokenmill.bucketing import plan_batches, restore_order
    from tokenmill.runner import run_batches

    model_path = resolve_model("all-MiniLM-L6-v2")
    texts = [f"{i} " + " ".join(["tokens"] * (1 + (i * 7) % 60)) for i in range(64)]
    encoded = encode_rows(texts, embed_spec_hf, model_path)
    lengths = [len(ids) for ids in encoded.token_ids]
    batches = plan_batches(lengths, 256, 8, 0.1)  # many small batches of different lengths
    engine = get_engine(model_path, embed_spec_hf)
    cores = engine._torch_threads  # torch's threads before the engine split them
    assert engine.streams == (2 if cores >= 2 else 1)
    assert torch.get_num_threads() == max(1, cores // engine.streams)
    calls = []
    original = engine.embed

    def recording(batch):
        calls.append(threading.current_thread().name)
        return original(batch)

    monkeypatch.setattr(engine, "embed", recording)
    events = []
    unsubscribe = progress.subscribe(lambda event, data: events.append((event, data)))
    try:
        together, seconds = run_batches(engine, batches, encoded.token_ids, embed_spec_hf, "s1")
        quiet, _ = run_batches(engine, batches, encoded.token_ids, embed_spec_hf, None)
    finally:
        unsubscribe()
    one_at_a_time = [original([encoded.token_ids[i] for i in batch]) for batch in batches]
    assert seconds > 0 and len(together) == len(batches)
    for ours, alone in zip(restore_order(batches, together), restore_order(batches, one_at_a_time)):
        assert np.allclose(ours, alone, atol=1e-5)
    assert [np.stack(b).shape[0] for b in together] == [len(b) for b in batches]
    rows = [data["rows"] for event, data in events if event == "rows_done"]
    assert sum(rows) == len(texts) and all(data["shard_id"] == "s1" for _, data in events)  # quiet run: none
    if engine.streams > 1:
        assert len({name for name in calls if name.startswith("tokenmill-stream")}) == engine.streams


def test_an_error_in_one_stream_reaches_the_caller(embed_spec_hf, monkeypatch):
    from tokenmill.runner import run_batches

    model_path = resolve_model("all-MiniLM-L6-v2")
    engine = get_engine(model_path, embed_spec_hf)
    encoded = encode_rows(TEXTS, embed_spec_hf, model_path)
    original = engine.embed

    def failing(batch):
        if len(batch) == 1:
            raise RuntimeError("engine fell over")
        return original(batch)

    monkeypatch.setattr(engine, "embed", failing)
    batches = [[0, 1], [2], [3, 4]]
    with pytest.raises(RuntimeError, match="engine fell over"):
        run_batches(engine, batches, encoded.token_ids, embed_spec_hf, None)


def test_cpu_streams_setting():
    from tokenmill.embedding import cpu_streams

    embed = JobSpec(mode="embed")
    assert cpu_streams(embed, "cpu", 2) == 2 and cpu_streams(embed, "cpu", 16) == 2
    assert cpu_streams(embed, "cpu", 1) == 1 and cpu_streams(embed, "cuda", 16) == 1
    one = JobSpec(mode="embed", model=ModelSpec(cpu_streams=1))
    four = JobSpec(mode="embed", model=ModelSpec(cpu_streams=4))
    assert cpu_streams(one, "cpu", 8) == 1 and cpu_streams(four, "cpu", 8) == 4 and cpu_streams(four, "cpu", 2) == 2
    assert cpu_streams(JobSpec(mode="generate"), "cpu", 8) == 1


@pytest.mark.engine
def test_generation_with_left_padding_is_greedy_and_deterministic():
    spec = JobSpec(mode="generate", model=ModelSpec(name="SmolLM2-135M-Instruct", engine="transformers"),
                   generation={"max_tokens": 12, "messages": [{"role": "user", "content": "{text}"}]})
    model_path = resolve_model(spec.model_name)
    texts = ["What is the capital of France? Answer in one word.",
             "Write a long and detailed story about a dragon who learns to bake bread in a small village."]
    encoded = encode_rows(texts, spec, model_path)
    assert len(encoded.token_ids[0]) != len(encoded.token_ids[1])  # the batch really is padded
    engine = get_engine(model_path, spec)
    first = engine.generate(encoded.token_ids, spec.generation)
    again = engine.generate(encoded.token_ids, spec.generation)
    alone = engine.generate([encoded.token_ids[0]], spec.generation)
    assert "paris" in first[0].text.lower()
    assert [g.text for g in first] == [g.text for g in again]
    assert first[0].text == alone[0].text  # left padding does not change the answer
    assert first[1].output_tokens == 12 and first[1].finish_reason == "length"


def test_on_a_cpu_every_linear_layer_runs_on_onednn_and_computes_what_torch_does():
    """tokenmill.hf_engine.onednn_linears: the LM head tied to the embeddings included; logits and greedy answers
    of a padded batch as the model torch loads computes them."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = JobSpec(mode="generate", model=ModelSpec(name="SmolLM2-135M-Instruct", engine="transformers"),
                   generation={"max_tokens": 16, "messages": [{"role": "user", "content": "{text}"}]})
    model_path = resolve_model(spec.model_name)
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    engine = get_engine(model_path, spec)
    linears = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert linears > 200 and engine.onednn_layers == linears
    assert not any(type(m) is torch.nn.Linear for m in engine.model.modules())
    texts = ["Name three colours.", "Say hello.", "Explain in two sentences why the sky is blue to a child."]
    ids, mask = engine._padded(encode_rows(texts, spec, model_path).token_ids, "left")
    with torch.inference_mode():
        expected = plain(input_ids=ids, attention_mask=mask).logits
        ours = engine.model(input_ids=ids, attention_mask=mask).logits
        greedy = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                pad_token_id=engine.pad_id)
        # float32 sums in another order: within 1e-4 of the logits' scale (a 2-core Xeon with AMX: 0.0011 at ~25)
        scale = float(expected.abs().max())
        assert torch.allclose(ours, expected, atol=1e-4 * scale, rtol=1e-4), (ours - expected).abs().max()
        assert torch.equal(engine.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16,
                                                 do_sample=False, pad_token_id=engine.pad_id), greedy)


def test_a_generation_trial_measures_calls_of_two_widths_and_its_answers():
    """The trial's calls (tokenmill.call_costs) are what the next prediction of a generation job is fit to: its
    timed calls as the runner cuts them, one call of another width (the fit's per-step cost apart from its
    per-row cost), one of its rows whole for one token (the prompts' cost apart from the steps'), and every
    timed row's answer length."""
    from tokenmill.call_costs import fit
    from tokenmill.engine_choice import PREFILL_ROWS, run_trial

    spec = JobSpec(mode="generate", model=ModelSpec(name="SmolLM2-135M-Instruct", engine="transformers"),
                   generation={"max_tokens": 8, "messages": [{"role": "user", "content": "{text}"}]})
    model_path = resolve_model(spec.model_name)
    rows = encode_rows(TEXTS[:6], spec, model_path).token_ids
    trial = run_trial(spec, "transformers", model_path, rows)
    assert trial.error is None
    timed = trial.rows
    assert len(trial.output_lengths) == timed and all(1 <= n <= 8 for n in trial.output_lengths)
    assert sorted(trial.input_lengths) == sorted(len(r) for r in rows[:timed])  # each answer's prompt's length
    widths = [c.rows for c in trial.calls]
    assert sum(widths[:-2]) == timed and widths[-2] == timed and timed not in widths[:-2], widths
    assert widths[-1] == min(PREFILL_ROWS, timed)
    for call in trial.calls:
        assert call.seconds > 0 and 1 <= call.steps <= 8 and call.output_slots == call.rows * call.steps
    assert sum(c.output_slots for c in trial.calls[:-2]) >= sum(trial.output_lengths)  # finished rows wait padded
    prefill = trial.calls[-1]
    assert prefill.steps == 1 and prefill.input_slots == prefill.rows * max(len(r) for r in rows[:timed])  # whole
    assert fit(trial.calls) is not None
    # the prediction of a first run's trials plans the same calls (its seconds: their costs, fit here before it)
    from tokenmill.prediction import trial_call_plan

    calls, prefill = trial_call_plan(spec, "transformers", [len(r) for r in rows])
    assert [len(c) for c in calls[1:]] + [len(prefill)] == widths  # calls[0]: the warm-up, not timed
    assert [len(c) * max(c) for c in calls[1:]] + [len(prefill) * max(prefill)] == [c.input_slots for c in trial.calls]


def test_a_runs_answers_are_what_the_next_prediction_of_its_corpus_plans_with(tmp_path, monkeypatch):
    """How long a corpus's answers run is measured by its runs and calibrations, stored by model, corpus and
    prompt at the cap they ran to: the next prediction of that job plans its calls with them; another
    corpus, or this one asked otherwise, is planned with every answer to its cap."""
    from tokenmill import call_costs, prediction
    from tokenmill.engine_choice import answers_key

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "docs.parquet", [f"row-{i}" for i in range(6)], TEXTS[:6])
    spec = JobSpec(input=str(tmp_path / "in"), output=str(tmp_path / "out"), mode="generate",
                   model=ModelSpec(name="SmolLM2-135M-Instruct", engine="transformers"),
                   generation={"max_tokens": 8, "messages": [{"role": "user", "content": "Summarize: {text}"}]})
    call_costs.forget()
    (shard,) = discover_shards(spec.input)
    run_shard(shard, resolve_job(spec))
    written = sorted(pq.read_table(tmp_path / "out").column("output_tokens").to_pylist())
    assert len(written) == 6 and all(1 <= n <= 8 for n in written)
    prediction.remember_run(spec, "transformers", {}, 6, False)  # as the run's record stores its parts

    stored = call_costs.read_answers(tmp_path / "cache", answers_key(spec))
    assert sorted(stored.answers) == written and stored.cap == 8 and stored.source == "run"
    table = pq.read_table(tmp_path / "out")  # each answer beside its own prompt's length
    assert sorted(zip(stored.inputs, stored.answers)) == sorted(zip(table.column("input_tokens").to_pylist(),
                                                                    table.column("output_tokens").to_pylist()))
    assert prediction.job_answers(spec, [])[1] == stored.inputs
    answers, _, source = prediction.job_answers(spec, [])
    assert sorted(answers) == written and "this corpus's last run" in source
    wider = spec.model_copy(update={"generation": spec.generation.model_copy(update={"max_tokens": 32})})
    answers, _, source = prediction.job_answers(wider, [])  # a larger cap: those cut at 8 run to it
    assert sorted(answers) == sorted(32 if n >= 8 else n for n in written) and "cut at its cap of 8" in source
    call_costs.remember_answers(tmp_path / "cache", answers_key(spec), [1, 1], 4, "run")
    assert sorted(call_costs.read_answers(tmp_path / "cache", answers_key(spec)).answers) == written  # kept: cut less
    # a calibration of the job at a higher cap: its sample's answers, cut less, are what the job plans with
    from tokenmill.calibrate import calibrate

    calibrate(JobSpec.model_validate({**spec.model_dump(mode="json"), "generation": {
        **spec.generation.model_dump(mode="json"), "max_tokens": 12}}), (1, 2), sample_rows=6)
    stored = call_costs.read_answers(tmp_path / "cache", answers_key(spec))
    assert stored.source == "calibration" and stored.cap == 12 and len(stored.answers) == len(stored.inputs) == 6
    answers, _, source = prediction.job_answers(spec, [])
    assert "this corpus's last calibration" in source and sorted(answers) == sorted(min(n, 8) for n in stored.answers)
    other = spec.model_copy(update={"input": str(tmp_path / "elsewhere")})
    asked = JobSpec.model_validate({**spec.model_dump(mode="json"), "generation": {
        "max_tokens": 8, "messages": [{"role": "user", "content": "Classify: {text}"}]}})
    for job in (other, asked):
        answers, _, source = prediction.job_answers(job, [])
        assert answers == [8] and "every answer to the cap (8 tokens), an upper bound" in source
