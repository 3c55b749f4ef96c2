"""A job's fixed seconds, overlapped: the orchestrator's API starts while the engine does.

Run as a command, a job pays for Prefect's ephemeral API (a server subprocess: 5 to 15 s on a
small machine) and then for the engine (seconds for transformers, 30 to 50 s for vLLM on a
CPU), one after the other. Neither needs the other, so the CLI starts the API in a
background thread (its work is in the server's own process) while the main thread starts
the engine; the flow then finds both ready. vLLM starts in the main thread, where it
expects to be.
"""

from __future__ import annotations

import logging
import threading

from tokenmill import timeline
from tokenmill.spec import JobSpec

log = logging.getLogger(__name__)


class _ApiStart(threading.Thread):
    def __init__(self):
        super().__init__(name="tokenmill-api-start", daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
            timeline.mark("api_ready")
        except BaseException as exc:  # noqa: BLE001 - the flow's own client reports it when it starts the API
            self.error = exc


def start_api_in_background() -> _ApiStart | None:
    """Start Prefect's ephemeral API now, if this process would use one. Join the thread before
    any Prefect call: until then the server counts as running but may not answer yet."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    timeline.mark("api_start")
    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return None
    thread = _ApiStart()
    thread.start()
    return thread


def finish_api_start(thread: _ApiStart | None) -> None:
    if thread is None:
        return
    thread.join()
    if thread.error is not None:
        from prefect.server.api.server import SubprocessASGIServer

        SubprocessASGIServer().running = False  # let the flow's client try again, and report its error
        log.warning("starting Prefect's API ahead of the flow failed (%s); the flow starts it", thread.error)


def nothing_left_to_run(spec: JobSpec, shards) -> bool:
    """Whether the output's final manifest already covers every one of these shards (a rerun of a
    finished job): then no engine is needed, and starting one early would be pure cost."""
    from tokenmill.outputs import MANIFEST, OutputStore

    try:
        store = OutputStore(spec.output, spec.storage_options)
        manifest = store.read_json(store.path(MANIFEST))
    except Exception:  # noqa: BLE001 - no manifest (or none readable): there is work to do
        return False
    if not manifest.get("complete") or manifest.get("mode") != spec.mode or manifest.get("model") != spec.model_name:
        return False
    done = {(s["shard_id"], s["fingerprint"]) for s in manifest.get("shards", [])}
    return all((s.shard_id, s.fingerprint) in done for s in shards)


def start_engine_early(spec: JobSpec, api: _ApiStart | None = None) -> None:
    """The engine this job will run on, started now (for `auto`, chosen now: cached trials cost
    a second, a first trial runs here). Only for a job that runs here without a gate (a gate may
    change the model). Failures are left for the flow to meet and report."""
    if spec.gate is not None or getattr(spec, "dispatch", "local") != "local":
        return
    if getattr(spec, "storage_block", None):  # its credentials come through the API: wait for the flow
        return
    from tokenmill.engine_choice import choose_engine, resolve, trials_cached
    from tokenmill.engines import get_engine
    from tokenmill.models import resolve_model
    from tokenmill.planning import estimate_rows
    from tokenmill.shards import discover_shards_for

    try:
        shards = discover_shards_for(spec)
        if nothing_left_to_run(spec, shards):
            return
        if spec.model.engine == "auto":
            if not trials_cached(spec):  # measured on a machine that is not busy starting the API
                finish_api_start(api)
            choose_engine(spec, job_rows=estimate_rows(spec, shards))
        get_engine(resolve_model(spec.model_name), resolve(spec))
    except Exception as exc:
        log.debug("early engine start skipped: %s", exc, exc_info=True)
