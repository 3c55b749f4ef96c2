"""The real vLLM engine on CPU, embedding with all-MiniLM-L6-v2."""

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TEST_EMBED_MODEL, TEXTS, write_parquet
from tokenmill.encoding import encode_rows
from tokenmill.engines import get_engine
from tokenmill.models import resolve_model
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec
from tokenmill.resolution import resolve_job

pytestmark = pytest.mark.engine

LONG_TEXT = " ".join(f"Sentence number {i} talks about batching and padding." for i in range(80))


@pytest.fixture(scope="module")
def spec():
    return JobSpec(mode="embed", model=TEST_EMBED_MODEL)


@pytest.fixture(scope="module")
def engine(spec):
    return get_engine(resolve_model(spec.model_name), spec)


def test_embeddings_match_sentence_transformers(spec, engine):
    from sentence_transformers import SentenceTransformer

    texts = TEXTS + [LONG_TEXT]
    model_path = resolve_model(spec.model_name)
    encoded = encode_rows(texts, spec, model_path)
    assert encoded.truncated == [False] * len(TEXTS) + [True]  # past max_seq_length=256
    ours = np.stack(engine.embed(encoded.token_ids))
    reference = SentenceTransformer(model_path, device="cpu").encode(texts, convert_to_numpy=True)
    cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    assert ours.shape == (len(texts), 384)
    assert cosine.min() >= 0.999, cosine


def test_a_shard_is_written_in_input_order_with_token_counts(tmp_path, spec, engine):
    ids = [f"row-{i}" for i in range(len(TEXTS))]
    write_parquet(tmp_path / "in.parquet", ids, TEXTS, row_group_size=3)
    job = spec.model_copy(update={"input": str(tmp_path / "in.parquet"), "output": str(tmp_path / "out")})
    results = [run_shard(shard, resolve_job(job)) for shard in discover_shards(job.input, max_shard_rows=4)]
    table = pq.read_table(tmp_path / "out")
    assert table.column_names[:4] == ["id", "embedding", "input_tokens", "output_tokens"]
    assert table.column("id").to_pylist() == ids
    embedding_type = table.schema.field("embedding").type
    assert pa.types.is_list(embedding_type) and embedding_type.value_type == pa.float32()
    vectors = np.array(table.column("embedding").to_pylist())
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert sum(r.rows_out for r in results) == len(TEXTS)
    assert all(n > 2 for n in table.column("input_tokens").to_pylist())


def test_a_dead_engine_is_restarted_once_and_the_shard_redone(tmp_path, spec, engine, caplog):
    """Last in this module: it kills the module's engine (others get the restarted one). Killed in the middle of
    the shard's calls, as the OOM killer would: vLLM's client waited for ever on a call in flight then
    (tokenmill.vllm_engine.watch_engine_death wakes it); a kill between two calls is the same path."""
    import logging
    import os
    import signal
    import threading

    texts = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(3000)]  # calls for a few seconds
    ids = [f"row-{i}" for i in range(len(texts))]
    write_parquet(tmp_path / "in.parquet", ids, texts)
    job = spec.model_copy(update={"input": str(tmp_path / "in.parquet"), "output": str(tmp_path / "out")})
    (shard,) = discover_shards(job.input)
    core = engine.llm.llm_engine.engine_core.resources.engine_manager.processes[0]
    calling = threading.Event()
    embed = engine.embed

    def embed_then_kill(batch):
        calling.set()
        return embed(batch)

    engine.embed = embed_then_kill

    def kill():
        calling.wait(timeout=120)  # the shard's first call under way (it runs for seconds)
        time.sleep(0.05)
        os.kill(core.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        result = run_shard(shard, resolve_job(job))
    killer.join(timeout=5)
    said = f"{time.monotonic() - started:.1f} s; logged: {[r.getMessage()[:300] for r in caplog.records]}"
    assert not core.is_alive(), said
    assert result.rows_out == len(texts), said
    assert pq.read_table(tmp_path / "out").column("id").to_pylist() == ids
    (message,) = [r.getMessage() for r in caplog.records if "engine died" in r.getMessage()] or [said]
    assert message.startswith(f"engine died during shard {shard.shard_id} (EngineDeadError")
    assert "restarting it once and retrying the shard" in message
    assert get_engine(resolve_model(spec.model_name), job) is not engine
