"""The row cache and duplicate collapse (tokenmill.row_cache): a re-run of a changed shard computes only its
changed rows, identical rows are computed once, and what comes out is what a run without either gives.

Fast tests first (the key, safety, eviction, with engines that need no model); then real ones: the
ONNX Runtime engine (MiniLM) and transformers (SmolLM2) in real batch flows on a real Prefect API,
MLflow on SQLite. No vLLM engine starts in this module.
"""

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_parquet
from tokenmill import row_cache
from tokenmill.engine_protocol import Engine, Generation
from tokenmill.models import resolve_model
from tokenmill.planning import estimate_corpus
from tokenmill.row_cache import (
    ENTRIES_DIR,
    Entry,
    RowCache,
    bypass_reason,
    cache_identity,
    row_keys,
)
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards
from tokenmill.spec import JobSpec
from tokenmill.report import run_metrics, summary_markdown
from tokenmill.resolution import resolve_job

MINILM = "all-MiniLM-L6-v2"
ONNX = {"name": MINILM, "engine": "onnxruntime"}
DIMS = 384


# --- engines with no model: what reaches the engine is counted -----------------------------------------

class VectorEngine(Engine):
    """Embeds a row as a vector made from its token ids, so every row's output is its own; counts tokens."""

    def __init__(self, name="transformers"):
        self.name = name
        self.tokens = 0
        self.rows = 0

    def embed(self, batch):
        self.tokens += sum(len(ids) for ids in batch)
        self.rows += len(batch)
        return [np.full(DIMS, sum(ids) % 9973 + len(ids) / 1000, dtype=np.float32) for ids in batch]

    def close(self):
        pass


class EchoEngine(Engine):
    """Generates each row's token count as text, with a logprob per token; counts rows."""

    name = "vllm"

    def __init__(self):
        self.rows = 0

    def generate(self, batch, params, overrides=None):
        self.rows += len(batch)
        return [Generation(f"{len(ids)} tokens", 2, "stop", [{"token_id": 1, "token": "x", "logprob": -0.5,
                                                              "top_logprobs": []}]) for ids in batch]

    def close(self):
        pass


def corpus_texts(rows=60):
    return [f"document {i} is about {'trains' if i % 3 else 'boats'} and ships " * (1 + i % 4) for i in range(rows)]


def one_shard(tmp_path, texts, name="in.parquet", **spec_fields):
    path = write_parquet(tmp_path / name, [f"r{i}" for i in range(len(texts))], texts)
    fields = {"input": str(path), "output": str(tmp_path / "out"), "model": {"name": MINILM, "engine": "transformers"}}
    spec = JobSpec.model_validate({**fields, **spec_fields})
    (shard,) = discover_shards(spec.input)
    return shard, spec


def output_of(spec, shard):
    return pq.read_table(Path(spec.output) / f"{shard.shard_id}.parquet")


# --- the key ---------------------------------------------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path):
    """A model directory as sentence-transformers lays it out (weights, config, pooling module)."""
    root = tmp_path / "model"
    (root / "1_Pooling").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (root / "model.safetensors").write_bytes(b"weights-1" * 100)
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return root


def key_of(spec: JobSpec, model_path: str, engine: str = "transformers", ids=(101, 2023, 102)) -> str:
    row_cache.weights_fingerprint.cache_clear()  # files edited in place within a test
    return row_keys(RowCache(str(Path(spec.output) / "_cache"), {}, cache_identity(spec, model_path, engine)).digest,
                    [list(ids)])[0]


def test_the_key_changes_with_every_ingredient_of_a_rows_output(model_dir, tmp_path):
    path = str(model_dir)
    embed = JobSpec(output=str(tmp_path / "out"), model={"name": path, "engine": "transformers"})
    base = key_of(embed, path)
    assert key_of(embed, path) == base  # and nothing else moves it
    assert key_of(embed.model_copy(update={"batching": embed.batching.model_copy(update={"token_budget": 99})}),
                  path) == base  # batch settings are speed
    assert key_of(embed.model_copy(update={"output": str(tmp_path / "elsewhere")}), path) == base  # shareable
    variants = {
        "token ids": key_of(embed, path, ids=(101, 2023, 2024, 102)),
        "engine": key_of(embed, path, engine="vllm"),
        "dtype": key_of(JobSpec(model={"name": path, "engine": "transformers", "dtype": "bfloat16"}), path),
        "engine_kwargs": key_of(JobSpec(model={"name": path, "engine": "transformers",
                                               "engine_kwargs": {"revision": "v2"}}), path),
        "model name": key_of(JobSpec(model={"name": "other-name", "engine": "transformers"}), path),
        "quantization": key_of(JobSpec(model={"name": path, "engine": "onnxruntime", "quantization": "int8"}), path,
                               engine="onnxruntime"),
        "mode": key_of(JobSpec(mode="generate", model={"name": path, "engine": "transformers"}), path),
    }
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    variants["pooling"] = key_of(embed, path)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert key_of(embed, path) == base
    (model_dir / "model.safetensors").write_bytes(b"weights-2" * 100)  # same size, other weights
    variants["weights"] = key_of(embed, path)
    assert len(set(variants.values()) | {base}) == len(variants) + 1, variants


def test_generation_keys_follow_sampling_and_the_seed_only_when_sampling(model_dir, tmp_path):
    path = str(model_dir)

    def generate(**generation):
        return JobSpec(mode="generate", model={"name": path, "engine": "vllm"}, generation=generation)

    greedy = key_of(generate(), path, "vllm")
    assert key_of(generate(seed=7), path, "vllm") == greedy  # greedy draws nothing
    assert key_of(generate(messages=None, prompt_template="Q: {text}"), path, "vllm") == greedy  # in the tokens
    others = [key_of(generate(max_tokens=64), path, "vllm"), key_of(generate(temperature=0.5), path, "vllm"),
              key_of(generate(temperature=0.5, seed=1), path, "vllm"),
              key_of(generate(temperature=0.5, top_p=0.9), path, "vllm"),
              key_of(generate(stop=["\n"]), path, "vllm"),
              key_of(generate(response_format={"choice": ["yes", "no"]}), path, "vllm")]
    assert len(set(others) | {greedy}) == len(others) + 1


def test_the_key_is_the_same_in_another_process(tmp_path):
    spec = JobSpec(output=str(tmp_path / "out"), model=ONNX)
    path = resolve_model(MINILM)
    here = key_of(spec, path, "onnxruntime")
    code = ("import sys; from tokenmill.spec import JobSpec; from tokenmill.models import resolve_model;"
            "from tokenmill.row_cache import RowCache, cache_identity, row_keys;"
            f"spec = JobSpec.model_validate_json({spec.model_dump_json()!r});"
            "path = resolve_model(spec.model_name);"
            "print(row_keys(RowCache('x', {}, cache_identity(spec, path, 'onnxruntime')).digest, [[101, 2023, 102]])[0])")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert there == here


def test_only_deterministic_requests_are_cached():
    assert bypass_reason(JobSpec(), "vllm") is None  # embeddings
    assert bypass_reason(JobSpec(mode="generate"), "transformers") is None  # greedy
    assert bypass_reason(JobSpec(mode="generate", generation={"temperature": 0.8, "seed": 3}), "vllm") is None
    assert "without a seed" in bypass_reason(JobSpec(mode="generate", generation={"temperature": 0.8, "seed": None}),
                                             "vllm")
    assert "per batch" in bypass_reason(JobSpec(mode="generate", generation={"temperature": 0.8, "seed": 3}),
                                        "transformers")


# --- one shard, engines with no model --------------------------------------------------------------------

def test_a_rerun_computes_only_the_changed_rows_and_duplicates_once(tmp_path):
    texts = corpus_texts()
    texts[5] = texts[6] = texts[40]  # three copies of one row
    texts.append(None)  # a rejected row: rows in = rows out + rejected, with the cache as without it
    shard, spec = one_shard(tmp_path, texts)
    engine = VectorEngine()
    first = run_shard(shard, resolve_job(spec), engine=engine)
    assert (first.row_cache, first.rows_from_cache, first.rows_collapsed) == ("on", 0, 2)
    assert engine.rows == 60 - 2 and first.real_tokens == engine.tokens
    assert first.rows_in == first.rows_out + first.rows_rejected == 61
    copies = output_of(spec, shard).to_pylist()
    assert copies[5]["embedding"] == copies[6]["embedding"] == copies[40]["embedding"]
    assert first.tokens_saved == 2 * copies[5]["input_tokens"]

    edited = list(texts)
    edited[10], edited[20], edited[30] = "an edited row", "another edited row", "a third one, edited"
    shard, spec = one_shard(tmp_path, edited)
    again = VectorEngine()
    second = run_shard(shard, resolve_job(spec), engine=again)
    assert again.rows == 3 and second.rows_from_cache == 57 and second.rows_cache_lookups == 60
    assert second.real_tokens == again.tokens == sum(output_of(spec, shard).column("input_tokens").to_pylist()[i]
                                                      for i in (10, 20, 30))
    assert second.tokens_saved == second.input_tokens - second.real_tokens
    assert second.engine_seconds_saved > 0

    fresh = one_shard(tmp_path, edited, output=str(tmp_path / "fresh"),
                      cache={"enabled": False, "collapse_duplicates": False})
    none = VectorEngine()
    run_shard(fresh[0], resolve_job(fresh[1]), engine=none)
    assert none.rows == 60 and output_of(spec, shard).equals(output_of(fresh[1], fresh[0]))


def test_generations_come_back_whole_from_the_cache(tmp_path):
    shard, spec = one_shard(tmp_path, corpus_texts(8) + ["same"] * 3, mode="generate",
                            model={"name": "SmolLM2-135M-Instruct", "engine": "vllm"},
                            generation={"max_tokens": 8, "logprobs": 1, "response_format": {"regex": "[0-9]+ tokens"}})
    engine = EchoEngine()
    first = run_shard(shard, resolve_job(spec), engine=engine)
    assert engine.rows == 9 and first.rows_collapsed == 2
    before = output_of(spec, shard)
    engine = EchoEngine()
    second = run_shard(shard, resolve_job(spec), engine=engine)
    assert engine.rows == 0 and second.rows_from_cache == 11 and second.batches == 0
    assert output_of(spec, shard).equals(before)
    assert second.output_tokens == first.output_tokens == 22 and second.tokens_saved == second.input_tokens + 22


def test_cache_enabled_false_writes_and_reads_nothing(tmp_path):
    texts = corpus_texts(20) + ["twice"] * 2
    shard, spec = one_shard(tmp_path, texts, cache={"enabled": False})
    engine = VectorEngine()
    result = run_shard(shard, resolve_job(spec), engine=engine)
    assert result.row_cache == "off" and result.rows_cache_lookups == 0
    assert result.rows_collapsed == 1 and engine.rows == 21  # collapse is its own switch
    assert not (tmp_path / "out" / "_cache").exists()
    shard, spec = one_shard(tmp_path, texts, cache={"enabled": False, "collapse_duplicates": False})
    engine = VectorEngine()
    assert run_shard(shard, resolve_job(spec), engine=engine).rows_collapsed == 0 and engine.rows == 22


def test_a_shared_cache_location_serves_another_job(tmp_path):
    shared = str(tmp_path / "shared-cache")
    shard, spec = one_shard(tmp_path, corpus_texts(30), cache={"uri": shared})
    run_shard(shard, resolve_job(spec), engine=VectorEngine())
    other = one_shard(tmp_path, corpus_texts(30), name="copy.parquet", output=str(tmp_path / "other"),
                      cache={"uri": shared})
    engine = VectorEngine()
    assert run_shard(other[0], resolve_job(other[1]), engine=engine).rows_from_cache == 30 and engine.rows == 0
    assert not (tmp_path / "other" / "_cache").exists()


# --- safety -----------------------------------------------------------------------------------------------

def entry_files(spec) -> list[Path]:
    return sorted((Path(spec.output) / "_cache" / ENTRIES_DIR).rglob("*.parquet"))


def test_a_corrupt_or_unreadable_cache_file_means_computing_not_failing(tmp_path, caplog):
    shard, spec = one_shard(tmp_path, corpus_texts(30))
    run_shard(shard, resolve_job(spec), engine=VectorEngine())
    expected = output_of(spec, shard)
    (written,) = entry_files(spec)
    (written.parent / "garbage.parquet").write_bytes(b"not parquet at all")
    with caplog.at_level(logging.WARNING, logger="tokenmill.row_cache"):
        engine = VectorEngine()
        assert run_shard(shard, resolve_job(spec), engine=engine).rows_from_cache == 30  # the good file still answers
    assert "garbage.parquet, which cannot be read" in caplog.text
    data = written.read_bytes()
    written.write_bytes(data[: len(data) // 2])  # cut short after this process indexed it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill.row_cache"):
        engine = VectorEngine()
        result = run_shard(shard, resolve_job(spec), engine=engine)
    assert engine.rows == 30 and result.rows_from_cache == 0 and "computed again" in caplog.text
    assert output_of(spec, shard).equals(expected)
    engine = VectorEngine()
    assert run_shard(shard, resolve_job(spec), engine=engine).rows_from_cache == 30  # the entries were written again


def test_entries_of_another_dimension_or_model_are_ignored_with_a_warning(tmp_path, caplog):
    spec = JobSpec(output=str(tmp_path / "out"), model={"name": MINILM, "engine": "transformers"})
    path = resolve_model(MINILM)
    cache = RowCache.for_job(spec, path, "transformers")
    assert cache.dimensions == DIMS
    ids = [[101, 7, 102], [101, 8, 102], [101, 9, 102]]
    keys = cache.keys(ids)
    cache.write([Entry(keys[0], np.ones(10, np.float32), 3, 0)], 0.001)  # a vector of another length
    impostor = RowCache(cache.store.uri, {}, {**cache.identity, "model": "someone-else"})
    impostor.folder = cache.folder  # files of another model under this model's folder (a copy, a collision)
    impostor.write([Entry(keys[1], np.ones(DIMS, np.float32), 3, 0)], 0.001)
    cache.write([Entry(keys[2], np.ones(DIMS, np.float32), 3, 0)], 0.001)
    with caplog.at_level(logging.WARNING, logger="tokenmill.row_cache"):
        found = cache.lookup({k: 3 for k in keys})
        assert cache.lookup({keys[2]: 4}) == {}  # an entry for an input of another length
    assert set(found) == {keys[2]}
    assert "of dimension 10, not the model's 384" in caplog.text
    assert "made by another model, engine or setting" in caplog.text
    assert "for an input of another length" in caplog.text


def write_entries(folder_uri: str, identity: dict, start: int, count: int) -> None:
    cache = RowCache(folder_uri, {}, identity)
    for n in range(start, start + count):
        cache.write([Entry(f"{n:032x}", np.full(4, n, np.float32), 1, 0)], 0.0)


def test_two_processes_writing_one_cache_location_never_corrupt_it(tmp_path):
    identity = {"version": 1, "mode": "embed", "model": "m"}
    uri = str(tmp_path / "cache")
    context = multiprocessing.get_context("spawn")
    # overlapping key ranges: the same rows written by both
    workers = [context.Process(target=write_entries, args=(uri, identity, start, 40)) for start in (0, 20)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    cache = RowCache(uri, {}, identity)
    files = list((tmp_path / "cache" / ENTRIES_DIR).rglob("*.parquet"))
    assert len(files) == 60 and all(pq.read_table(f).num_rows == 1 for f in files)
    found = cache.lookup({f"{n:032x}": 1 for n in range(60)})
    assert len(found) == 60 and all(found[f"{n:032x}"].value[0] == n for n in range(60))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".parquet"]


def test_the_oldest_files_are_evicted_past_max_bytes_and_a_hit_counts_as_use(tmp_path):
    identity = {"version": 1, "mode": "embed", "model": "m"}
    cache = RowCache(str(tmp_path / "cache"), {}, identity)
    paths = []
    for n in range(4):
        paths.append(Path(cache.write([Entry(f"{n:032x}", np.full(256, n, np.float32), 1, 0)], 0.0)))
        os.utime(paths[-1], (time.time() - 1000 + n * 100,) * 2)  # written in order, 100 s apart
    size = paths[0].stat().st_size
    assert cache.lookup({f"{0:032x}": 1})  # the oldest, used now: the least recently used is file 1
    removed = cache.evict(2 * size + size // 2)
    assert sorted(Path(p).name for p in removed) == sorted(p.name for p in paths[1:3])
    assert set(cache.lookup({f"{n:032x}": 1 for n in range(4)})) == {f"{0:032x}", f"{3:032x}"}


def test_max_bytes_is_kept_after_every_shard(tmp_path):
    shard, spec = one_shard(tmp_path, corpus_texts(30), cache={"max_bytes": 1})
    run_shard(shard, resolve_job(spec), engine=VectorEngine())
    assert entry_files(spec) == []  # written, then evicted: a cap below one file keeps nothing
    engine = VectorEngine()
    assert run_shard(shard, resolve_job(spec), engine=engine).rows_from_cache == 0 and engine.rows == 30


def test_the_cache_on_an_object_store(tmp_path, s3_server):
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_server).mkdir("cache-bucket")
    options = {"endpoint_url": s3_server}
    shard, spec = one_shard(tmp_path, corpus_texts(30), storage_options=options,
                            cache={"uri": "s3://cache-bucket/rows", "max_bytes": 10**9})
    run_shard(shard, resolve_job(spec), engine=VectorEngine())
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    written = [p for p in fs.find("cache-bucket/rows") if p.endswith(".parquet")]
    assert len(written) == 1 and not fs.exists("cache-bucket/rows/_tmp")  # one PUT, no temporary file
    row_cache._indexes.clear()  # another process: it knows the bucket only by listing it
    engine = VectorEngine()
    assert run_shard(shard, resolve_job(spec), engine=engine).rows_from_cache == 30 and engine.rows == 0
    cache = RowCache.for_job(spec, resolve_model(MINILM), "transformers")
    assert [Path(p).name for p in cache.evict(0)] == [Path(written[0]).name]
    fs.invalidate_cache()
    assert not [p for p in fs.find("cache-bucket/rows") if p.endswith(".parquet")]


# --- the plan ---------------------------------------------------------------------------------------------

def test_the_plan_counts_only_the_tokens_still_to_compute(tmp_path):
    texts = corpus_texts(200)
    shard, spec = one_shard(tmp_path, texts)
    before = estimate_corpus(spec, sample_rows=64)
    assert before.row_cache_share == 0 and before.tokens_to_compute == before.tokens
    run_shard(shard, resolve_job(spec), engine=VectorEngine())
    after = estimate_corpus(spec, sample_rows=64)
    assert after.row_cache_share == 1.0 and after.tokens_to_compute == 0
    assert "tokens still to compute" in after.describe()
    half = texts[:100] + [f"new text {i} " + t for i, t in enumerate(texts[100:])]
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(200)], half)
    changed = estimate_corpus(spec, sample_rows=64)
    assert 0.2 < changed.row_cache_share < 0.8
    off = estimate_corpus(spec.model_copy(update={"cache": spec.cache.model_copy(update={"enabled": False})}), 64)
    assert off.row_cache_share == 0


# --- real engines in real flows -----------------------------------------------------------------------------

def flow_spec(tmp_path, corpus: Path, output: str, **fields):
    from tokenmill.tasks.job import PrefectJob

    return PrefectJob.model_validate({
        "input": str(corpus), "output": str(tmp_path / output), "model": ONNX,
        "batching": {"max_shard_rows": 100},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "row-cache"},
        **fields})


def read_output(tmp_path, output: str) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / output).glob("*.parquet")))


def test_a_rerun_after_editing_5_percent_of_rows_computes_only_those_and_outputs_the_same(tmp_path, prefect_api,
                                                                                          monkeypatch):
    from tokenmill.flows.batch import batch_flow

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = corpus_texts(200)
    write_parquet(corpus / "docs.parquet", [f"r{i}" for i in range(200)], texts)
    first = batch_flow(flow_spec(tmp_path, corpus, "out"))
    assert first.metrics["rows_from_cache"] == 0 and first.metrics["shards"] == 2

    edited = list(texts)
    changed = list(range(3, 200, 20))  # 10 rows: 5%, in both shards of the file
    for i in changed:
        edited[i] = f"edited: row {i} now says something else entirely"
    write_parquet(corpus / "docs.parquet", [f"r{i}" for i in range(200)], edited)
    second = batch_flow(flow_spec(tmp_path, corpus, "out"))
    with_cache = read_output(tmp_path, "out")
    edited_tokens = sum(with_cache.column("input_tokens").to_pylist()[i] for i in changed)
    m = second.metrics
    assert m["shards_cached"] == 0  # the file changed: both shards ran again, as they did before the row cache
    assert m["rows_from_cache"] == 190 and m["row_cache_hit_rate"] == pytest.approx(0.95)
    assert m["engine_tokens"] == edited_tokens == m["input_tokens"] - m["tokens_saved"]
    assert m["usd_saved"] > 0 and "190 rows from the cache (95.0% of lookups)" in second.summary

    without = batch_flow(flow_spec(tmp_path, corpus, "no-cache",
                                   cache={"enabled": False, "collapse_duplicates": False}))
    assert without.metrics["engine_tokens"] == without.metrics["input_tokens"] and "row cache: off" in without.summary
    assert with_cache.equals(read_output(tmp_path, "no-cache"))  # the same rows, bit for bit

    opened = []  # nothing changed: every shard from the shard cache, and the row cache never opened
    monkeypatch.setattr(RowCache, "_index", lambda self: opened.append(self.folder) or pytest.fail("opened"))
    third = batch_flow(flow_spec(tmp_path, corpus, "out"))
    assert third.metrics["shards_cached"] == 2 and third.metrics["engine_tokens"] == 0 and not opened


def test_duplicates_in_a_shard_are_computed_once(tmp_path, prefect_api):
    from tokenmill.flows.batch import batch_flow

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = corpus_texts(60) + corpus_texts(60)[:30]  # 30 of 90 rows are copies
    write_parquet(corpus / "docs.parquet", [f"r{i}" for i in range(90)], texts)
    collapsed = batch_flow(flow_spec(tmp_path, corpus, "out", cache={"enabled": False}))
    plain = batch_flow(flow_spec(tmp_path, corpus, "plain", cache={"enabled": False, "collapse_duplicates": False}))
    assert collapsed.metrics["rows_collapsed"] == 30 and plain.metrics["rows_collapsed"] == 0
    unique = read_output(tmp_path, "out").column("input_tokens").to_pylist()[:60]
    assert collapsed.metrics["engine_tokens"] == sum(unique) == plain.metrics["engine_tokens"] - sum(unique[:30])
    assert read_output(tmp_path, "out").equals(read_output(tmp_path, "plain"))


def test_sampling_without_a_seed_bypasses_the_cache_and_the_record_says_so(tmp_path, prefect_api):
    from tokenmill.flows.batch import batch_flow

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_parquet(corpus / "docs.parquet", ["a", "b", "c"], ["Say hi.", "Say hi.", "Name a fruit."])
    spec = flow_spec(tmp_path, corpus, "out", mode="generate",
                     model={"name": "SmolLM2-135M-Instruct", "engine": "transformers"},
                     generation={"max_tokens": 4, "temperature": 0.9, "seed": None})
    record = batch_flow(spec)
    m = record.metrics
    assert m["rows_cache_bypassed"] == 3 and m["rows_collapsed"] == 0 and m["rows_from_cache"] == 0
    assert m["engine_tokens"] == m["input_tokens"] + m["output_tokens"]  # the copies were sampled too
    assert "row cache: bypassed: sampling at temperature 0.9 without a seed" in record.summary
    assert not (tmp_path / "out" / "_cache").exists()
    records = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_shards").glob("*.json")]
    assert [r["row_cache"].startswith("bypassed: sampling at temperature 0.9 without a seed") for r in records] == [True]


def test_the_summary_says_what_the_cache_answered():
    from tokenmill.results import ShardResult

    result = ShardResult(shard_id="s", fingerprint="f", uri="u", output="o", rows_in=10, rows_out=10, rows_rejected=0,
                         rows_truncated=0, input_tokens=100, output_tokens=0, batches=1, real_tokens=20,
                         padded_slots=20, baseline_padded_slots=20, engine_seconds=1.0, seconds=2.0, row_cache="on",
                         rows_cache_lookups=10, rows_from_cache=7, rows_collapsed=1, tokens_saved=80,
                         engine_seconds_saved=4.0)

    spec = JobSpec()
    metrics = run_metrics([result], 3.0, spec)
    assert metrics["engine_tokens"] == 20 and metrics["engine_tokens_per_s"] == 20
    assert metrics["usd_saved"] == pytest.approx(4.0 / 3600 * spec.pricing.usd_per_gpu_hour_spot)
    assert "7 rows from the cache (70.0% of lookups), 1 duplicate rows collapsed; 80 tokens not computed" in \
        summary_markdown(spec, metrics, [result])
