"""A job's fixed seconds, overlapped: the orchestrator's API starts while the engine does.

Run as a command, a job pays for Prefect's ephemeral API (a server subprocess: 10 to 15 s on a
small machine) and then for the engine (seconds for transformers, 30 to 50 s for vLLM on a
CPU), one after the other. Neither needs the other, so the CLI spawns the API's process as
soon as the job is parsed (EphemeralApi) while the main thread imports the flow and starts
the engine; the flow then finds both ready. vLLM starts in the main thread, where it
expects to be.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tokenmill import timeline
from tokenmill.engine_protocol import Engine
from tokenmill.spec import JobSpec, sqlite_file
from tokenmill.tasks import api_process

log = logging.getLogger(__name__)


# What Prefect's own ephemeral server process gets (prefect.server.api.server.SubprocessASGIServer,
# Prefect 3.7): the API app, no UI, marked ephemeral.
SERVER_ENVIRONMENT = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
PORT_IN_USE_EXIT = 3  # uvicorn's exit status when its port was taken after we chose it


class EphemeralApi(threading.Thread):
    """Prefect's ephemeral API server, started by the CLI the way Prefect starts it, minus one cost.

    Left to itself, Prefect starts the server at the flow's first API call: the CLI process first
    imports the server's own code (`prefect.server.api.server`, 4.4 s here) only to spawn a process
    that imports it again. Here the process is spawned as soon as the job is parsed, with the same app,
    server and environment (tasks/api_process.py, which also marks when its startup began and ended:
    a first run's database creation, measured apart), and this thread waits for its health
    check while the main thread imports the flow and starts the engine. Once it answers,
    PREFECT_API_URL points at it, so Prefect's client talks to it as to any server; it is stopped at
    exit like Prefect's, and dies with the CLI if the CLI is killed.
    """

    def __init__(self, timeout: float):
        super().__init__(name="tokenmill-api-start", daemon=True)
        self.timeout = timeout
        self.error: str | None = None
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self.marks: int | None = None  # the pipe the server writes its start's marks to (tasks/api_process.py)
        self._spawn()
        atexit.register(self.stop)  # registered before Prefect's log and event workers: they flush first

    def _spawn(self) -> None:
        from prefect.settings import get_current_settings

        self.port = _free_port()
        # a respawn's start is not a start's: the process before it made the database, where one was made
        self.respawned = self.process is not None
        self._close_marks()
        self.marks, writing = os.pipe()
        # tied to the spawning thread's life: only the main thread lives as long as the CLI; the hook only calls
        # prctl (no locks), so it is safe beside the CLI's threads
        tied = _die_with_parent if threading.current_thread() is threading.main_thread() else None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", api_process.__file__, "--port", str(self.port)],
                env={**os.environ, **SERVER_ENVIRONMENT, api_process.MARKS_VARIABLE: str(writing),
                     **get_current_settings().to_environment_variables(exclude_unset=True)},
                pass_fds=(writing,), preexec_fn=tied,  # noqa: PLW1509
            )
        except BaseException:
            self._close_marks()
            raise
        finally:
            os.close(writing)  # the server's now; this end reads

    def run(self) -> None:
        try:
            self._wait_for_health()
        finally:
            self._close_marks()

    def _wait_for_health(self) -> None:
        import httpx

        deadline = time.monotonic() + self.timeout
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                status = self.process.poll()
                if status == PORT_IN_USE_EXIT:
                    self._spawn()
                    continue
                if status is not None:
                    self.error = f"the server process exited with status {status}"
                    return
                try:
                    if client.get(f"http://127.0.0.1:{self.port}/api/health").status_code == 200:
                        self.url = f"http://127.0.0.1:{self.port}/api"
                        timeline.mark("api_ready")
                        self._read_marks()
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        self.error = f"no answer within {self.timeout:.0f} s"

    def _read_marks(self) -> None:
        """The moments the server's own process marked (its startup begun and done: where it creates its
        database on a first run), into this process's timeline; all written before it answered."""
        if self.marks is not None and not self.respawned:
            for name, when in api_process.read_marks(self.marks).items():
                timeline.mark_at(name, when)

    def _close_marks(self) -> None:
        if self.marks is not None:
            os.close(self.marks)
            self.marks = None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


# looked up here, not in the forked child: the CLI may have threads of its own when it spawns the API (the interpreter
# probe's), and a child of a threaded process must not take the dynamic loader's lock (dlopen, dlsym)
_PRCTL = getattr(_libc(), "prctl", None)


def _die_with_parent() -> None:
    """In the server process, before it runs: end it when the CLI dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def temporary_api_url() -> str | None:
    """The URL of the ephemeral API this process started, if it did: a server that ends with the
    process, not one someone runs (whose URLs are worth recording)."""
    return os.environ.get(TEMPORARY_API_VARIABLE)


TEMPORARY_API_VARIABLE = "TOKENMILL_TEMPORARY_PREFECT_API_URL"


def start_api_in_background() -> EphemeralApi | None:
    """Start Prefect's ephemeral API now, if this process would use one. Call finish_api_start
    before any Prefect API call."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    timeline.mark("api_start")
    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return None
    if not _database_exists():  # the API creates its tables first: a first run's cost (tokenmill.prediction)
        timeline.mark("api_store_created")
    try:
        api = EphemeralApi(float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    except Exception as exc:  # noqa: BLE001 - Prefect starts its own at the flow's first call
        log.warning("starting Prefect's API ahead of the flow failed (%s); the flow starts it", exc)
        return None
    api.start()
    return api


def _database_exists() -> bool:
    """Whether the ephemeral API's SQLite database is there (a server's on another database: assumed so)."""
    from prefect.settings import get_current_settings

    try:
        url = get_current_settings().server.database.connection_url
    except AttributeError:  # settings laid out otherwise (another Prefect): not a first run's cost to predict
        return True
    path = sqlite_file(url.get_secret_value() if hasattr(url, "get_secret_value") else str(url or ""))
    return path is None or path.exists()


def finish_api_start(api: EphemeralApi | None) -> None:
    """Wait for the API started ahead, then point Prefect at it. If it did not come up, stop it
    and leave Prefect to start its own at the flow's first call (and report its error)."""
    if api is None:
        return
    api.join()
    if api.url is None:
        api.stop()
        log.warning("starting Prefect's API ahead of the flow failed (%s); the flow starts it", api.error)
        return
    import prefect.context

    refresh = getattr(prefect.context, "refresh_global_settings_context", None)  # Prefect >= 3.4.x
    if refresh is None:
        api.stop()
        return
    os.environ["PREFECT_API_URL"] = os.environ[TEMPORARY_API_VARIABLE] = api.url
    refresh()  # every thread's Prefect client now uses it


def warm_tracking(spec: JobSpec) -> None:
    """What the flow's first and last steps import and open, made ready while the API starts: MLflow
    (its import, and the job's tracking store: a SQLite store checks its schema when it opens, 2 to 5 s
    together on a loaded 2-core machine) and matplotlib's pyplot (the record's padding chart). The
    main thread would otherwise wait on the API's health check with nothing to do, then pay for
    these inside the flow. MLflow keeps the store per tracking URI, so the flow's client finds it
    open. Failures are left for the flow to meet and report."""
    try:
        from tokenmill.spec import local_tracking_store
        from tokenmill.tracking import tracking_client

        store = local_tracking_store(spec)
        created = store is not None and not store.exists()  # MLflow creates its tables: a first run's cost
        timeline.mark("tracking_open_start")  # tokenmill.prediction: the store's part, apart from the main thread's
        tracking_client(spec)  # the client opens its store (and creates it) as it is made
        timeline.mark("tracking_created" if created else "tracking_opened")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        log.debug("warming MLflow and matplotlib skipped: %s", exc, exc_info=True)
    timeline.mark("tracking_warm")


def nothing_left_to_run(spec: JobSpec, shards) -> bool:
    """Whether the output's manifest already covers every one of these shards (a rerun of a
    finished job): then no engine is needed, and starting one early would be pure cost."""
    from tokenmill.prediction import finished_shards

    return len(finished_shards(spec, shards)) == len(shards)


def trials_first(spec: JobSpec) -> bool:
    """Whether `tokenmill run` measures auto's engine trials before its prediction (choose_engine_first): an
    embedding job on `auto` that runs here, ungated, with shards left to compute and no trials kept here at its
    length. Generation's trials stay after the prediction: its answers' probe opens the trials' first engine.
    Asked beside the API's start (it reads the job's sample), as start_engine_early asked it before."""
    if spec.model.engine != "auto" or spec.mode != "embed" or not _starts_here(spec):
        return False
    from tokenmill.engine_choice import trials_cached
    from tokenmill.shards import discover_shards_for

    try:
        return not nothing_left_to_run(spec, discover_shards_for(spec)) and not trials_cached(spec)
    except Exception as exc:  # noqa: BLE001 - bad input: the flow meets it and reports it
        log.debug("trials before the prediction skipped: %s", exc, exc_info=True)
        return False


def choose_engine_first(spec: JobSpec, api: EphemeralApi | None = None):
    """Auto's engine trials for this job, measured now (where trials_first), before the prediction, which then
    holds them as measured (tokenmill.prediction.trials_ahead) and knows the engine they chose. As the early start
    ran them: once the API has started (`api`: waited for here), on a machine busy with nothing else. The trials'
    last engine stays open for the job (start_engine_early finds the choice made). Returns the choice; None where it
    failed (logged: the flow's own choice meets the failure and reports it)."""
    from tokenmill.engine_choice import choose_engine
    from tokenmill.planning import estimate_rows
    from tokenmill.shards import discover_shards_for

    try:
        rows = estimate_rows(spec, discover_shards_for(spec))
        timeline.mark("api_wait")
        finish_api_start(api)
        return choose_engine(spec, job_rows=rows)
    except Exception as exc:  # noqa: BLE001
        log.warning("engine trials before the prediction failed: %s", exc)
        log.debug("trials before the prediction", exc_info=True)
        timeline.forget("engine_choice_start", "engine_choice_done", "engine_start", "engine_ready")
        return None


def _starts_here(spec: JobSpec) -> bool:
    """Whether this process starts the job's engine ahead of its flow: ungated (a gate may change the model),
    run here (not a pool's), its corpus readable without the API (no storage block's credentials)."""
    return (spec.gate is None and getattr(spec, "dispatch", "local") == "local"
            and not getattr(spec, "storage_block", None))


def start_engine_early(spec: JobSpec, api: EphemeralApi | None = None) -> Engine | None:
    """The engine this job will run on, started now (for `auto`, chosen now: cached trials cost
    a second, a first trial runs here). Only for a job that runs here without a gate (a gate may
    change the model). Failures are left for the flow to meet and report. Returns the engine where this call
    started it; None where it started none (auto's trial or a caller's engine_scope holds it open already)."""
    if not _starts_here(spec):
        return None
    from tokenmill.engine_choice import choose_engine, trials_cached
    from tokenmill.engines import get_engine, is_open
    from tokenmill.planning import estimate_rows
    from tokenmill.resolution import resolve_job
    from tokenmill.shards import discover_shards_for

    try:
        shards = discover_shards_for(spec)
        if nothing_left_to_run(spec, shards):
            return None
        if spec.model.engine == "auto":
            if not trials_cached(spec):  # measured on a machine that is not busy starting the API
                timeline.mark("api_wait")
                finish_api_start(api)
            choose_engine(spec, job_rows=estimate_rows(spec, shards))
        job = resolve_job(spec)  # as the shards will resolve it: the engine they ask for is this one
        timeline.mark("early_engine_start")  # tokenmill.prediction: the main thread's parts, apart
        starts = not is_open(job.model_path, job.spec)
        engine = get_engine(job.model_path, job.spec)
        timeline.mark("early_engine_ready")
        return engine if starts else None
    except Exception as exc:
        log.debug("early engine start skipped: %s", exc, exc_info=True)
        return None
