from __future__ import annotations

import os

# Set before anything imports Prefect, transformers or vLLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
# engine: auto caches its trials; tests (and the commands they start) share one fresh cache, not the user's,
# removed when the session ends (each `make test` made one more under /tmp)
if "TOKENMILL_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TOKENMILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenmill-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TOKENMILL_CACHE_DIR"], ignore_errors=True)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from tokenmill.cli import EARLY_START  # noqa: E402
from tokenmill.spec import JobSpec, ModelSpec  # noqa: E402
from tokenmill.tasks.job import PrefectJob  # noqa: E402

# One model spec for every embedding test, so the process starts one vLLM engine.
# vLLM named, not `auto`: these tests are about vLLM (tests/test_engine_choice.py tests `auto`).
# enforce_eager: no torch.compile at engine start. The tests check behaviour, not speed, and on this
# CPU vLLM recompiles at every start (its compile cache fails to load), tens of seconds per engine.
VLLM_TEST_KWARGS = {"enforce_eager": True}
TEST_EMBED_MODEL = ModelSpec(name="all-MiniLM-L6-v2", engine="vllm",
                             engine_kwargs={"gpu_memory_utilization": 0.1, **VLLM_TEST_KWARGS})
TEST_GENERATE_MODEL = ModelSpec(
    name="SmolLM2-135M-Instruct", engine="vllm",
    engine_kwargs={"gpu_memory_utilization": 0.3, "max_model_len": 1024, **VLLM_TEST_KWARGS},
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference trades latency for throughput.",
    "Parquet stores columns together, so reading one column is cheap.",
    "A shard is the unit of retry: losing one costs minutes, not hours.",
    "Short.",
    "Spot GPUs cost less because the cloud may take them back at any time. " * 3,
    "Embeddings map text to vectors whose cosine similarity tracks meaning.",
    "The manifest lists every shard with its fingerprint and row counts.",
]


# what a run prints when it starts its engine early (tokenmill.cli, any engine), and the engines' own lines where one
# starts inside a shard's task: transformers' (tokenmill.hf_engine), vLLM's
ENGINE_STARTED = (EARLY_START, "Starting transformers", "Initializing a V1 LLM engine")


def assert_clean_exit(done, what: str) -> None:
    """A command's process (a subprocess.CompletedProcess) ended as a user's must: exit 0, and nothing of the
    failures its end once had: vLLM torn down by the interpreter's exit (exit 134, "terminate called"), or
    multiprocessing's resource tracker, at exit, on a segment a killed vLLM engine left in /dev/shm. The abort was
    intermittent (exit 0, 134, 134 in three runs): every test that runs a command to its end checks it."""
    stdout, stderr = done.stdout or "", done.stderr or ""
    tail = stdout[-1500:] + "\n" + stderr[-3000:]
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{tail}"
    assert "terminate called" not in stdout + stderr, f"{what}: {tail}"
    assert "leaked shared_memory" not in stdout + stderr, f"{what}: {tail}"


def write_parquet(path, ids, texts, row_group_size=None, **extra):
    table = pa.table({"id": ids, "text": texts, **extra})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture
def embed_spec(tmp_path):
    def make(input_uri, **overrides) -> JobSpec:
        fields = dict(
            input=str(input_uri),
            output=str(tmp_path / "out"),
            mode="embed",
            model=TEST_EMBED_MODEL,
            tracking={"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tests"},
        )
        fields.update(overrides)
        return PrefectJob.model_validate(fields)  # the job as the flows take it

    return make


@pytest.fixture(scope="session", autouse=True)
def _engines_for_the_session():
    # Flows close the engines they start when they end; tests hold one scope around the whole
    # session so that the process starts one vLLM engine per model spec, not one per flow run.
    # (tests/test_engine_lifecycle.py checks the flows' own closing in separate processes.)
    from tokenmill.engines import engine_scope

    with engine_scope():
        yield


@pytest.fixture(scope="module", autouse=True)
def _only_the_shared_engines_outlive_a_module():
    # The two shared test models stay open for the whole session; any other engine a module started
    # (another model spec, a gate's reference, an engine trial) is closed when the module ends, so
    # no module finds another's engine (and reuses it instead of starting its own), and the
    # session's memory does not grow with every module's engines.
    yield
    from tokenmill import engines

    # the shared engines' keys as engines.engine_key makes them (the model without cpu_streams, the default batch
    # cap, no server): compared with the model whole, no key matched and every module started both shared
    # engines again (MiniLM's and SmolLM2's vLLM starts, 20-30 s each)
    shared = {engines.engine_key(JobSpec(mode=mode, model=model))[1:]
              for mode, model in (("embed", TEST_EMBED_MODEL), ("generate", TEST_GENERATE_MODEL))}
    with engines._engines_lock:
        others = [key for key in engines._engines if key[1:] not in shared]
        closing = [engines._engines.pop(key) for key in others]
    for engine in closing:
        engine.close()


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect API (prefect_test_harness: a server on a temporary database) for the modules whose flows need
    one: started once, when the first of them asks (18-23 s a start on the CI host, once per module before). What
    a test reads back of it is its own flow run's (flow_run_artifacts). Flows of the modules that do not ask for it
    run on it too once it has started (Prefect's in-process default server is the harness's), and before on the
    ephemeral server Prefect starts once per process."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def flow_run_artifacts(flow_run_id) -> dict[str, object]:
    """The Prefect artifacts one flow run made (key: data), read from the API it ran on: its own, not those of the
    other runs the API holds (the session's API serves several modules)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))

    return {artifact.key: artifact.data for artifact in asyncio.run(read())}


@pytest.fixture
def s3_server(monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    yield f"http://{host}:{port}"
    server.stop()


def pytest_sessionfinish(session, exitstatus):
    """Stop the ephemeral Prefect servers the tests started while pytest still captures output.

    Prefect stops them at interpreter exit otherwise, and its log line ("Stopping temporary server")
    then goes to a stream pytest has closed: a `--- Logging error ---` traceback after every run's summary.
    Prefect's event and log workers are drained first, as at its own exit, so nothing they hold is lost.
    """
    import sys

    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is None:
        return
    # first what Prefect's workers still hold for the servers (events, logs), then the servers
    try:  # Prefect's own internals: a Prefect without them is left to stop its servers at exit
        from prefect._internal.concurrency.services import QueueService

        QueueService.drain_all(timeout=30)
        servers = list(server_module.SubprocessASGIServer._instances.values())
    except (ImportError, AttributeError):
        return
    for server in servers:
        server.stop()


def seed_trials(spec: JobSpec, trials: list[dict]) -> None:
    """Figures as an earlier trial on this machine would have cached them (in TOKENMILL_CACHE_DIR)."""
    from tokenmill import engine_choice
    from tokenmill.models import resolve_model

    model_path = resolve_model(spec.model_name)
    rows = engine_choice.trial_rows(spec, model_path)
    mean = sum(map(len, rows)) / len(rows)
    key = engine_choice.trial_key(spec, model_path, engine_choice.device_label(), mean)
    engine_choice._write_cache(key, [engine_choice.EngineTrial(**t) for t in trials], "test",
                               engine_choice.trial_family(spec, model_path, engine_choice.device_label()), mean)
