"""The batch flow on a real (temporary) Prefect server, with MLflow on SQLite."""

import asyncio
import json

import mlflow
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import flow_run_artifacts, write_parquet
from tokenmill.errors import InputError
from tokenmill.flows.batch import batch_flow

pytestmark = pytest.mark.engine

RUN_METRICS = ("rows", "input_tokens", "output_tokens", "wall_seconds", "tokens_per_s", "items_per_s", "gpu_hours",
               "usd_spot", "usd_on_demand", "usd_per_1m_tokens", "padding_fraction", "baseline_padding_fraction",
               "shards_cached", "rows_rejected")


@pytest.fixture(scope="module", autouse=True)
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


@pytest.fixture
def corpus(tmp_path):
    """Two Parquet files with bad rows, and a JSONL file with bad lines."""
    root = tmp_path / "corpus"
    root.mkdir()
    write_parquet(root / "a.parquet", [f"a{i}" for i in range(30)],
                  [f"Document {i} is about {'trains' if i % 2 else 'boats'}. " * (1 + i % 7) for i in range(30)],
                  row_group_size=10)
    write_parquet(root / "b.parquet", ["b0", "b1", "b2", "b1", "b4"], ["fine text", None, "   ", "dup id", "ok"])
    good = [json.dumps({"id": f"c{i}", "text": f"line {i} of the jsonl file"}).encode() for i in range(6)]
    bad = [b'{"id": "c-bad-utf8", "text": "caf\xe9"}', b'["not", "an", "object"]']
    (root / "c.jsonl").write_bytes(b"\n".join(good[:3] + bad + good[3:]) + b"\n")
    return root


def all_input_ids():
    return {f"a{i}" for i in range(30)} | {"b0", "b1", "b2", "b4"} | {f"c{i}" for i in range(6)}


def test_batch_flow_writes_outputs_rejects_manifest_and_run_record(tmp_path, corpus, embed_spec):
    spec = embed_spec(corpus, batching={"max_shard_rows": 20, "token_budget": 512})
    state = batch_flow(spec, return_state=True)
    record = state.result()
    out = tmp_path / "out"

    outputs = pq.read_table(out)  # readers skip _manifest.json and _rejects/
    rejects = pq.read_table(out / "_rejects").to_pylist()
    output_ids = outputs.column("id").to_pylist()
    assert len(output_ids) == len(set(output_ids))
    # every input row is accounted for exactly once: out, or rejected with a reason
    rejected_ids = [r["id"] for r in rejects if r["id"] is not None]
    assert set(output_ids) | set(rejected_ids) == all_input_ids() | {"b1"}
    reasons = {(r["id"], r["reason"]) for r in rejects}
    assert ("b1", "text is null") in reasons
    assert ("b2", "text is empty or whitespace") in reasons
    assert any(r["id"] == "b1" and r["reason"].startswith("duplicate id") for r in rejects)
    jsonl_rejects = [r for r in rejects if r["file"].endswith("c.jsonl")]
    assert len(jsonl_rejects) == 2 and all(r["byte_offset"] is not None for r in jsonl_rejects)

    # shards keep their input order
    first_shard = pq.read_table(next(out.glob("a.parquet.r000000000-*.parquet"))).column("id").to_pylist()
    assert first_shard == [f"a{i}" for i in range(20)]

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] and manifest["shards_done"] == manifest["shards_total"] == 4
    totals = manifest["totals"]
    assert totals["rows_in"] == 30 + 5 + 8 == totals["rows_out"] + totals["rows_rejected"]
    assert totals["rows_rejected"] == 3 + 2 and all(s["fingerprint"] for s in manifest["shards"])

    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    run = mlflow.get_run(record.mlflow_run_id)
    for name in RUN_METRICS:
        assert name in run.data.metrics, name
    metrics = run.data.metrics
    assert metrics["rows"] == len(output_ids) and metrics["input_tokens"] == sum(outputs.column("input_tokens").to_pylist())
    assert metrics["tokens_per_s"] == pytest.approx(metrics["input_tokens"] / metrics["wall_seconds"])
    assert metrics["usd_spot"] == pytest.approx(metrics["wall_seconds"] / 3600 * spec.pricing.usd_per_gpu_hour_spot)
    assert metrics["padding_fraction"] < metrics["baseline_padding_fraction"]
    assert run.data.params["model"] == "all-MiniLM-L6-v2" and run.data.params["engine"] == "vllm"
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"summary.md", "manifest.json", "padding.png"} <= artifacts

    keys = set(flow_run_artifacts(state.state_details.flow_run_id))
    assert {"tokenmill-summary", "tokenmill-shards", "tokenmill-progress"} <= keys


def test_a_structural_error_fails_the_flow_naming_file_and_column(tmp_path, embed_spec):
    root = tmp_path / "wrong"
    root.mkdir()
    write_parquet(root / "part-0.parquet", ["x"], ["y"])
    with pytest.raises(InputError, match=r"part-0\.parquet, column 'body': required column is missing"):
        batch_flow(embed_spec(root, text_column="body"))
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_overlong_reject_policy_sends_long_documents_to_rejects(tmp_path, embed_spec):
    root = tmp_path / "long"
    root.mkdir()
    write_parquet(root / "d.parquet", ["short", "long"], ["a short document", "many words here " * 200])
    batch_flow(embed_spec(root, overlong="reject"))
    outputs = pq.read_table(tmp_path / "out").column("id").to_pylist()
    (reject,) = pq.read_table(tmp_path / "out" / "_rejects").to_pylist()
    assert outputs == ["short"]
    assert reject["id"] == "long" and "the model takes at most 256" in reject["reason"] and reject["row"] == 1


def test_input_and_output_on_s3(tmp_path, corpus, embed_spec, s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("corpus-bucket")
    fs.put(str(corpus) + "/", "corpus-bucket/docs/", recursive=True)
    spec = embed_spec("s3://corpus-bucket/docs/", output="s3://corpus-bucket/embeddings",
                      storage_options={"endpoint_url": s3_server}, batching={"max_shard_rows": 20})
    record = batch_flow(spec)
    fs.invalidate_cache()
    names = {p.rsplit("/", 1)[-1] for p in fs.ls("corpus-bucket/embeddings")}
    assert "_manifest.json" in names and "_rejects" in names
    assert not [n for n in names if ".tmp-" in n]
    with fs.open("corpus-bucket/embeddings/_manifest.json") as handle:
        manifest = json.load(handle)
    assert manifest["complete"] and manifest["totals"]["rows_in"] == 43
    assert manifest["shards"][0]["uri"].startswith("s3://corpus-bucket/docs/")
    ids = pq.read_table("corpus-bucket/embeddings", filesystem=fs).column("id").to_pylist()
    assert set(ids) == all_input_ids() - {"b1", "b2"}
    # the endpoint and credentials stay out of the run record
    mlflow.set_tracking_uri(record.mlflow_tracking_uri)
    params = mlflow.get_run(record.mlflow_run_id).data.params
    assert not any(s3_server in str(v) or "testing-secret" in str(v) for v in params.values())


def test_an_id_in_two_shards_is_kept_by_the_first_and_rejected_by_the_later(tmp_path, embed_spec):
    root = tmp_path / "dups"
    root.mkdir()
    # "shared" is in both files; "twice" is in both row groups (two shards) of one file
    write_parquet(root / "a.parquet", ["a0", "shared", "twice", "a3"], ["one", "two", "three", "four"],
                  row_group_size=2)
    write_parquet(root / "a.parquet", ["a0", "shared", "twice", "a3", "twice", "a5"],
                  ["one", "two", "three", "four", "five", "six"], row_group_size=3)
    write_parquet(root / "b.parquet", ["b0", "shared", "b2"], ["seven", "eight", "nine"])
    spec = embed_spec(root, batching={"max_shard_rows": 3})
    for _ in range(2):  # the second run is all cached: the result must be the same, nothing moved twice
        batch_flow(spec)
        out = tmp_path / "out"
        output_ids = pq.read_table(out).column("id").to_pylist()
        rejects = pq.read_table(out / "_rejects").to_pylist()
        assert sorted(output_ids) == ["a0", "a3", "a5", "b0", "b2", "shared", "twice"]
        assert sorted((r["id"], r["file"].rsplit("/", 1)[-1], r["row"]) for r in rejects) == [
            ("shared", "b.parquet", 1), ("twice", "a.parquet", 4)]
        reasons = {r["id"]: r["reason"] for r in rejects}
        assert reasons["shared"] == ("duplicate id: shard a.parquet.r000000000-000000003 of "
                                     f"{root / 'a.parquet'} has it too and keeps it")
        manifest = json.loads((out / "_manifest.json").read_text())
        totals = manifest["totals"]
        assert (totals["rows_in"], totals["rows_out"], totals["rows_rejected"]) == (9, 7, 2)
        assert all(s["rows_in"] == s["rows_out"] + s["rows_rejected"] for s in manifest["shards"])


def test_empty_files_are_counted_and_warned_about_and_an_all_empty_input_fails(tmp_path, embed_spec):
    root = tmp_path / "some-empty"
    root.mkdir()
    write_parquet(root / "full.parquet", ["f0", "f1"], ["first", "second"])
    write_parquet(root / "none.parquet", pa.array([], pa.string()), pa.array([], pa.string()))
    (root / "none.jsonl").write_bytes(b"")
    state = batch_flow(embed_spec(root), return_state=True)
    assert state.is_completed()
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    by_file = {s["uri"].rsplit("/", 1)[-1]: s for s in manifest["shards"]}
    assert set(by_file) == {"full.parquet", "none.parquet", "none.jsonl"}
    assert by_file["none.parquet"]["rows_in"] == by_file["none.jsonl"]["rows_in"] == 0
    logs = asyncio.run(_flow_run_logs(state.state_details.flow_run_id))
    assert any("none.jsonl has no rows" in line for line in logs)

    (root / "full.parquet").unlink()
    with pytest.raises(InputError, match=r"every input file is empty \(.*none\.jsonl, .*none\.parquet\)"):
        batch_flow(embed_spec(root))


def test_s3_faults_are_retried_and_the_retries_show_in_the_run_log(tmp_path, corpus, embed_spec, s3_server):
    import s3fs

    from faulty_s3 import FaultyS3Proxy

    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("flaky-bucket")
    fs.put(str(corpus) + "/", "flaky-bucket/docs/", recursive=True)
    # 5 faults: within the one retry layer's 6 attempts per call (tokenmill.storage.IO_ATTEMPTS)
    with FaultyS3Proxy(s3_server, faults=5) as proxy:
        spec = embed_spec("s3://flaky-bucket/docs/", output="s3://flaky-bucket/embeddings",
                          storage_options={"endpoint_url": proxy.url}, batching={"max_shard_rows": 20})
        state = batch_flow(spec, return_state=True)
    assert state.is_completed() and len(proxy.injected) == 5
    fs.invalidate_cache()
    ids = pq.read_table("flaky-bucket/embeddings", filesystem=fs).column("id").to_pylist()
    rejects = pq.read_table("flaky-bucket/embeddings/_rejects", filesystem=fs).column("id").to_pylist()
    assert set(ids) == all_input_ids() - {"b1", "b2"} and len(ids) + len(rejects) == 43
    logs = asyncio.run(_flow_run_logs(state.state_details.flow_run_id))
    retries = [line for line in logs if "; retry " in line]
    assert sum("injected SlowDown" in line for line in retries) >= 2, logs
    assert sum("injected InternalError" in line for line in retries) >= 2, logs
    assert not any(proxy.url in line or s3_server in line for line in logs)  # the endpoint stays out


async def _flow_run_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    await APILogHandler.aflush()
    async with get_client() as client:
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
    return [log.message for log in logs]


def test_s3_credentials_and_endpoint_from_a_prefect_secret_block(tmp_path, corpus, embed_spec, s3_server,
                                                                monkeypatch):
    import s3fs
    from prefect.blocks.system import Secret

    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("block-bucket")
    fs.put(str(corpus) + "/", "block-bucket/docs/", recursive=True)
    Secret(value={"key": "block-key", "secret": "block-secret-value", "endpoint_url": s3_server}).save(
        "tokenmill-test-s3", overwrite=True)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)  # the block is the only source of credentials and endpoint
    spec = embed_spec("s3://block-bucket/docs/", output="s3://block-bucket/embeddings",
                      storage_block="tokenmill-test-s3", batching={"max_shard_rows": 20})
    state = batch_flow(spec, return_state=True)
    assert state.is_completed()
    ids = pq.read_table("block-bucket/embeddings", filesystem=fs).column("id").to_pylist()
    assert set(ids) == all_input_ids() - {"b1", "b2"}

    # the secret and the endpoint appear nowhere that is kept: flow parameters, saved blocks, MLflow
    record = state.result()
    mlflow.set_tracking_uri(spec.tracking.mlflow_tracking_uri)
    stored = asyncio.run(_stored_documents(state.state_details.flow_run_id))
    params = mlflow.get_run(record.mlflow_run_id).data.params
    for kept in (stored, json.dumps(params)):
        assert "block-secret-value" not in kept and s3_server not in kept
    assert "tokenmill-test-s3" in stored  # the state storage block names the secret, and only names it


async def _stored_documents(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        blocks = await client.read_block_documents(include_secrets=False)
        # this job's (its bucket): the session's API holds other modules' state storage blocks too
        state_blocks = [b for b in blocks if b.block_type and b.block_type.slug == "tokenmill-state-storage"
                        and "block-bucket" in json.dumps(b.data, default=str)]
    return json.dumps(run.parameters, default=str) + json.dumps([b.data for b in state_blocks], default=str)
