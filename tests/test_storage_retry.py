"""Transient store errors are retried with backoff and logged; data and access errors never are."""

import errno
import logging

import pyarrow as pa
import pytest
import s3fs

from faulty_s3 import FaultyS3Proxy
from tokenmill.errors import InputError
from tokenmill.outputs import OutputStore
from tokenmill.shards import discover_shards, read_shard
from tokenmill.storage import is_transient, retry_io


def flaky(failures):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return "done"

    return call, calls


def test_transient_errors_are_retried_and_each_retry_is_logged(caplog, monkeypatch):
    monkeypatch.setattr("tokenmill.storage.time.sleep", lambda seconds: None)
    call, calls = flaky([OSError(errno.EBUSY, "Please reduce your request rate."), ConnectionResetError("reset")])
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        assert retry_io(call, "reading s3://b/k") == "done"
    assert len(calls) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("reading s3://b/k failed (OSError: [Errno 16] Please reduce your request rate.); "
                                  "retry 1/5 in ")
    assert messages[1].startswith("reading s3://b/k failed (ConnectionResetError: reset); retry 2/5 in ")


def test_endpoints_are_kept_out_of_retry_logs(caplog, monkeypatch):
    monkeypatch.setattr("tokenmill.storage.time.sleep", lambda seconds: None)
    error = ConnectionError('Could not connect to the endpoint URL: "http://10.0.0.7:9000/bucket/key"')
    call, _ = flaky([error])
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        retry_io(call, "reading s3://bucket/key")
    (message,) = [r.getMessage() for r in caplog.records]
    assert "10.0.0.7" not in message and "endpoint URL: \"<endpoint>\"" in message


def test_backoff_grows_exponentially_with_jitter(monkeypatch):
    waits = []
    monkeypatch.setattr("tokenmill.storage.time.sleep", waits.append)
    call, _ = flaky([TimeoutError()] * 5)
    retry_io(call, "x", attempts=6, base_seconds=1.0, max_seconds=100)
    assert len(waits) == 5
    for attempt, wait in enumerate(waits):
        assert 0.5 * 2 ** attempt <= wait <= 1.5 * 2 ** attempt


@pytest.mark.parametrize("error", [
    FileNotFoundError("no such key"), PermissionError("access denied"), InputError("f.parquet", "bad"),
    pa.ArrowInvalid("Parquet magic bytes not found"), OSError(errno.EINVAL, "InvalidArgument"),
    OSError("Couldn't deserialize thrift"),  # pyarrow reports corrupt pages as an OSError with no errno
])
def test_data_and_access_errors_are_never_retried(error, monkeypatch):
    monkeypatch.setattr("tokenmill.storage.time.sleep", lambda seconds: None)
    call, calls = flaky([error])
    with pytest.raises(type(error)):
        retry_io(call, "x")
    assert len(calls) == 1 and not is_transient(error)


def test_s3_faults_on_the_first_requests_are_retried_until_the_data_arrives(tmp_path, s3_server, caplog):
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("flaky")
    for name in ("a", "b"):
        with fs.open(f"flaky/in/{name}.jsonl", "wb") as handle:
            handle.write(b"".join(f'{{"id": "{name}{i}", "text": "row {i}"}}\n'.encode() for i in range(50)))
    with FaultyS3Proxy(s3_server, faults=6) as proxy, caplog.at_level(logging.WARNING, logger="tokenmill"):
        options = {"endpoint_url": proxy.url}
        shards = discover_shards("s3://flaky/in/", storage_options=options)
        rows = sum(read_shard(shard, ["id", "text"], options)[0].num_rows for shard in shards)
        store = OutputStore("s3://flaky/out", options)
        store.write_json(store.path("probe.json"), {"ok": True})
        assert store.read_json(store.path("probe.json")) == {"ok": True}
    assert rows == 100 and len(shards) == 2
    assert [kind for kind, _, _ in proxy.injected] == ["slowdown", "internal", "reset"] * 2
    retries = [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]
    # every 5xx is retried by us, with its cause in the log; a reset connection may instead be
    # re-opened by the HTTP client's pool before any error surfaces
    assert sum("injected SlowDown" in m for m in retries) == 2, retries
    assert sum("injected InternalError" in m for m in retries) == 2, retries


def test_storage_io_has_one_retry_layer():
    """retry_io is the one place storage I/O is retried (each retry logged with its cause); the
    Prefect tasks around it add none, so a failing call is made IO_ATTEMPTS times, not 5 x 6."""
    from prefect import Task

    import tokenmill.flows.calibrate
    import tokenmill.tasks.gate
    import tokenmill.tasks.shards


    storage_tasks = [obj for module in (tokenmill.tasks.shards, tokenmill.tasks.gate, tokenmill.flows.calibrate) for obj in vars(module).values()
                     if isinstance(obj, Task)]
    assert {t.name for t in storage_tasks} >= {"discover-shards", "process-shard", "write-manifest",
                                                 "reject-cross-shard-duplicates", "gate-sample", "estimate-corpus"}
    assert {t.name: t.retries for t in storage_tasks} == {t.name: 0 for t in storage_tasks}
