"""The index stage with real faiss-cpu and lancedb, over real embeddings (transformers engine, a few
hundred rows of the sample corpus): built by the flow, reused, rebuilt, searched, and refused with
a clear reason."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from pydantic import ValidationError

from conftest import flow_run_artifacts
from tokenmill.flows.batch import batch_flow
from tokenmill.index import (
    INDEX_DIR,
    IndexBuildError,
    build_index,
    choose_index,
    estimate_index_build,
    plan_index,
)
from tokenmill.index_search import OpenIndex, search_text
from tokenmill.sample_corpus import write_sample_corpus
from tokenmill.spec import IndexSpec, JobSpec
from tokenmill.tasks.job import PrefectJob

# transformers starts in seconds (vLLM takes 40+); inputs cut at 64 tokens keep the embedding short
HF_MODEL = {"name": "all-MiniLM-L6-v2", "engine": "transformers", "max_input_tokens": 64}


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory, prefect_api):
    """One embed job with a faiss index section, run by the batch flow on the session's API: (spec, its final
    state)."""
    root = tmp_path_factory.mktemp("index")
    write_sample_corpus(root / "corpus", documents=300, files=2, row_group_size=100)
    spec = PrefectJob.model_validate({
        "input": str(root / "corpus"), "output": str(root / "out"), "model": HF_MODEL, "index": {"backend": "faiss"},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "tests"}})
    return spec, batch_flow(spec, return_state=True)


@pytest.fixture(scope="module")
def embedded(embedded_run):
    """That job: (spec, its record)."""
    spec, state = embedded_run
    return spec, state.result()


def _copy_output(spec: JobSpec, tmp_path, **index) -> JobSpec:
    """The job's output copied elsewhere (manifest paths rewritten), with another index section."""
    target = tmp_path / "copy"
    shutil.copytree(spec.output, target, ignore=shutil.ignore_patterns(INDEX_DIR, "_state", "_tmp"))
    manifest_path = target / "_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for shard in manifest["shards"]:
        shard["output"] = shard["output"].replace(spec.output, str(target))
    manifest_path.write_text(json.dumps(manifest))
    return JobSpec(output=str(target), model=HF_MODEL, index=index)


def _corpus_rows(spec: JobSpec) -> pa.Table:
    return pq.read_table(spec.input, columns=["id", "text"])


def _pointer(output: str) -> dict:
    with open(os.path.join(output, INDEX_DIR, "index.json")) as handle:
        return json.load(handle)


def _index_folders(output: str) -> list[str]:
    return sorted(p for p in os.listdir(os.path.join(output, INDEX_DIR)) if p != "index.json")


def test_the_flow_builds_the_index_and_records_recall_and_cost(embedded, embedded_run):
    spec, record = embedded
    pointer = _pointer(spec.output)
    folder = pointer["folder"]
    assert pointer["kind"] == "flat" and pointer["rows"] == 300 and pointer["dim"] == 384  # 300 <= flat_max_rows
    assert os.path.exists(os.path.join(folder, "index.faiss"))
    ids = pq.read_table(os.path.join(folder, "ids.parquet"))
    assert ids.column("position").to_pylist() == list(range(300))
    assert sorted(ids.column("id").to_pylist()) == sorted(_corpus_rows(spec).column("id").to_pylist())
    metrics = MlflowClient(record.mlflow_tracking_uri).get_run(record.mlflow_run_id).data.metrics
    assert metrics["index_recall_at_10"] == pytest.approx(1.0)  # exact search against exact search
    assert metrics["index_bytes"] > 300 * 384 * 4 * 0.9
    assert metrics["index_build_seconds"] > 0 and metrics["index_queries_per_s"] > 0
    assert 0 < metrics["index_build_share_of_embed"] < 1
    artifacts = MlflowClient(record.mlflow_tracking_uri).list_artifacts(record.mlflow_run_id)
    assert "index.md" in {a.path for a in artifacts}
    assert "recall@10 1.000" in flow_run_artifacts(embedded_run[1].state_details.flow_run_id)["tokenmill-index"]


def test_a_second_build_from_the_same_outputs_reuses_the_index(embedded):
    spec, _ = embedded
    before = _pointer(spec.output)
    index_file = os.path.join(before["folder"], "index.faiss")
    written = os.stat(index_file).st_mtime_ns
    report = build_index(spec)
    assert report.reused and report.key == before["key"]
    assert os.stat(index_file).st_mtime_ns == written
    assert _index_folders(spec.output) == [before["key"]]


def test_a_changed_output_rebuilds_the_index_and_drops_the_old_one(embedded, tmp_path):
    spec, _ = embedded
    copy = _copy_output(spec, tmp_path, backend="faiss")
    first = build_index(copy)
    assert not first.reused
    shard = json.loads((tmp_path / "copy" / "_manifest.json").read_text())["shards"][0]["output"]
    table = pq.read_table(shard)
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    vectors[0] = vectors[1]  # the first row's vector changes (a re-embedded shard)
    embedding = pa.array(list(vectors), pa.list_(pa.float32()))
    pq.write_table(table.set_column(table.schema.get_field_index("embedding"), "embedding", embedding), shard)
    second = build_index(copy)
    assert not second.reused and second.key != first.key
    assert _index_folders(copy.output) == [second.key]
    hit = OpenIndex(copy.output).search(vectors[1], k=2)[0]
    assert {h["id"] for h in hit} == set(table.column("id").to_pylist()[:2])


def test_near_duplicate_documents_do_not_lower_exact_recall(embedded, tmp_path):
    """Forty copies of one document, embedded a rounding error apart: which of them rank 10th is
    arbitrary (BLAS order), for the index and the exact check alike, and is not a recall miss."""
    spec, _ = embedded
    copy = _copy_output(spec, tmp_path, backend="faiss")
    shard = json.loads((tmp_path / "copy" / "_manifest.json").read_text())["shards"][0]["output"]
    table = pq.read_table(shard)
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    noise = np.random.default_rng(0).normal(size=(40, vectors.shape[1])).astype(np.float32) * 1e-7
    vectors[:40] = vectors[0] + noise
    embedding = pa.array(list(vectors), pa.list_(pa.float32()))
    pq.write_table(table.set_column(table.schema.get_field_index("embedding"), "embedding", embedding), shard)
    report = build_index(copy)
    assert report.kind == "flat" and report.recall_at_10 == pytest.approx(1.0)


def test_search_finds_a_document_from_its_own_text(embedded):
    spec, _ = embedded
    corpus = _corpus_rows(spec).to_pylist()
    counts: dict[str, int] = {}
    for row in corpus:
        counts[row["text"]] = counts.get(row["text"], 0) + 1
    picked = [row for row in corpus if counts[row["text"]] == 1][::60][:4]
    hits = search_text(spec.output, [row["text"] for row in picked], k=5)
    for row, found in zip(picked, hits):
        assert found[0]["id"] == row["id"] and found[0]["score"] > 0.999
        assert len(found) == 5 and found[0]["score"] >= found[-1]["score"]


def test_lancedb_table_with_hnsw_index_and_stored_columns(embedded, tmp_path):
    spec, _ = embedded
    copy = _copy_output(spec, tmp_path, backend="lancedb", kind="hnsw", columns=["truncated"])
    report = build_index(copy)
    assert (report.backend, report.kind, report.columns) == ("lancedb", "hnsw", ["truncated"])
    assert report.recall_at_10 >= 0.9
    import lancedb

    table = lancedb.connect(os.path.join(report.folder, "lance")).open_table("vectors")
    assert table.count_rows() == 300
    assert {"id", "vector", "position", "shard_id", "truncated"} <= set(table.schema.names)
    assert [i.index_type for i in table.list_indices()] == ["IvfHnswSq"]
    corpus = _corpus_rows(spec).to_pylist()
    row = corpus[7]
    (found,) = search_text(copy.output, [row["text"]], k=3)
    assert found[0]["id"] == row["id"] and "truncated" in found[0]
    assert build_index(copy).reused


def test_ivfpq_is_trained_and_measured_against_exact_search(embedded, tmp_path):
    spec, _ = embedded
    copy = _copy_output(spec, tmp_path, backend="faiss", kind="ivfpq", nlist=4, nbits=6, recall_queries=50)
    report = build_index(copy)
    assert report.kind == "ivfpq" and report.params == {"nlist": 4, "pq_m": 96, "nbits": 6, "nprobe": 4}
    assert report.recall_queries == 50 and 0.5 <= report.recall_at_10 <= 1.0
    assert report.index_bytes < 300 * 384 * 4  # codes, not vectors


def test_the_rule_picks_flat_then_hnsw_then_ivfpq_with_derived_parameters():
    index = IndexSpec()
    assert choose_index(20_000, 384, index).kind == "flat"
    assert choose_index(500_000, 384, index).params == {"m": 32, "ef_construction": 80, "ef_search": 128}
    big = choose_index(2_000_000, 384, index)
    assert big.kind == "ivfpq" and big.params == {"nlist": 4096, "pq_m": 96, "nbits": 8, "nprobe": 256}
    assert choose_index(20_000, 384, IndexSpec(kind="ivfpq")).params["nlist"] == 512
    assert choose_index(2_000_000, 384, IndexSpec(kind="hnsw", hnsw_m=16)).params["m"] == 16
    with pytest.raises(IndexBuildError, match="does not divide"):
        choose_index(2_000_000, 384, IndexSpec(pq_m=7))
    estimate = estimate_index_build(2_000_000, 384, index)
    assert estimate.kind == "ivfpq" and estimate.bytes < 2_000_000 * 384 * 4 / 10


def test_plan_adds_the_index_build_to_the_finish():
    text, metrics = plan_index(JobSpec(index={}), 500_000, finish_hours=1.0, window_hours=2.0)
    assert "Index (faiss):** hnsw" in text and metrics["plan_index_build_seconds"] > 0
    assert metrics["plan_finish_hours_with_index"] == pytest.approx(1.0 + metrics["plan_index_build_seconds"] / 3600)


def test_an_index_on_a_generate_job_is_refused():
    with pytest.raises(ValidationError, match="index: an index is built over embeddings.*mode=generate"):
        JobSpec(mode="generate", index={})


def test_a_dimension_mismatch_between_shards_names_the_shard(embedded, tmp_path):
    spec, _ = embedded
    copy = _copy_output(spec, tmp_path, backend="faiss")
    shard = json.loads((tmp_path / "copy" / "_manifest.json").read_text())["shards"][-1]["output"]
    table = pq.read_table(shard)
    narrow = pa.array([[0.5] * 8] * table.num_rows, pa.list_(pa.float32()))
    pq.write_table(table.set_column(table.schema.get_field_index("embedding"), "embedding", narrow), shard)
    with pytest.raises(IndexBuildError, match=f"{os.path.basename(shard)}: embeddings have 8 dimensions, other "
                                              "shards 384"):
        build_index(copy)


def test_an_empty_or_unfinished_or_generated_output_is_refused(embedded, tmp_path):
    with pytest.raises(IndexBuildError, match="no _manifest.json"):
        build_index(JobSpec(output=str(tmp_path / "nothing"), index={}))
    spec, _ = embedded
    copy = _copy_output(spec, tmp_path)
    manifest_path = tmp_path / "copy" / "_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for change, reason in [({"shards": [{**s, "rows_out": 0} for s in manifest["shards"]]}, "has no rows"),
                           ({"complete": False}, "not complete"), ({"mode": "generate"}, "mode=generate job")]:
        manifest_path.write_text(json.dumps({**manifest, **change}))
        with pytest.raises(IndexBuildError, match=reason):
            build_index(copy)


@pytest.mark.parametrize("backend", ["faiss", "lancedb"])
def test_an_output_on_s3_is_indexed_reused_and_searched(embedded, tmp_path, s3_server, backend):
    import s3fs

    spec, _ = embedded
    local = _copy_output(spec, tmp_path)
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    bucket = f"index-{backend}"  # moto keeps buckets across servers in one process
    fs.mkdir(bucket)
    manifest = json.loads((tmp_path / "copy" / "_manifest.json").read_text())
    for shard in manifest["shards"]:
        shard["output"] = shard["output"].replace(local.output, f"{bucket}/emb")
    (tmp_path / "copy" / "_manifest.json").write_text(json.dumps(manifest))
    fs.put(local.output + "/", f"{bucket}/emb/", recursive=True)
    remote = JobSpec(output=f"s3://{bucket}/emb", storage_options={"endpoint_url": s3_server}, model=HF_MODEL,
                     index={"backend": backend})
    report = build_index(remote)
    assert not report.reused and report.recall_at_10 == pytest.approx(1.0)
    fs.invalidate_cache()
    assert fs.exists(f"{bucket}/emb/{INDEX_DIR}/index.json") and fs.ls(report.folder)
    assert build_index(remote).reused
    row = _corpus_rows(spec).to_pylist()[3]
    (found,) = search_text(remote.output, [row["text"]], k=3, storage_options=remote.storage_options)
    assert found[0]["id"] == row["id"]
