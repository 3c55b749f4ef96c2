"""Engines: the process's registry of engines that run batches of token ids through a model.

The engine takes token ids, not text: the runner tokenizes once (to measure lengths
and cut batches) and the engine never tokenizes again. One engine per model spec is
kept per process, because starting vLLM costs tens of seconds and a worker runs
many shards. Each engine is a module of its own (tokenmill.vllm_engine, tokenmill.hf_engine)
behind the protocol in tokenmill.engine_protocol.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from tokenmill import progress, timeline
from tokenmill.device import engine_device
from tokenmill.engine_protocol import Engine
from tokenmill.spec import JobSpec
from tokenmill.storage import describe_error
from tokenmill.vllm_engine import VLLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")

_engines: dict[tuple, Engine] = {}
_engines_lock = threading.RLock()


def engine_key(spec: JobSpec, model_path: str | None = None) -> tuple:
    """What makes two jobs share one engine in a process (cpu_streams is set on a running engine)."""
    server = getattr(spec, "server", None)
    return (model_path or spec.model_name, spec.mode, spec.model.model_dump_json(exclude={"cpu_streams"}),
            spec.batching.max_batch_size,
            (server.model_dump_json(), getattr(spec, "stop_by", None)) if server is not None else None)


def refuse_auto(spec: JobSpec) -> JobSpec:
    """The spec, whose engine must be a real one: `engine: auto` is a choice, made above the registry
    (tokenmill.resolution.resolve_job) before any engine is asked for."""
    if spec.model.engine == "auto":
        raise ValueError("model.engine 'auto' reached the engine registry unresolved: resolve the job first "
                         "(tokenmill.resolution.resolve_job(spec)), then ask for the engine it chose")
    return spec


def get_engine(model_path: str, spec: JobSpec) -> Engine:
    """The process's engine for this model spec and mode, started on first use."""
    key = engine_key(refuse_auto(spec), model_path)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            timeline.mark("engine_start")
            started = time.perf_counter()
            engine = _engines[key] = start_engine(model_path, spec)
            # as a process waits for it: its library's import too, which the engine's own figure leaves out (an
            # engine trial that reuses it records this as its start: engine_choice.run_trial)
            engine.start_seconds = time.perf_counter() - started
            timeline.mark("engine_ready")
        else:  # one engine, jobs that ask for different streams
            engine.configure_streams(spec)
        return engine


def start_engine(model_path: str, spec: JobSpec) -> Engine:
    """A new engine of the kind the model spec names."""
    _close_engines_before_exit()
    if spec.model.engine == "transformers":
        from tokenmill.hf_engine import TransformersEngine

        return TransformersEngine(model_path, spec)
    if spec.model.engine == "onnxruntime":
        from tokenmill.onnx_engine import OnnxEngine

        return OnnxEngine(model_path, spec)
    if spec.model.engine == "openvino":
        from tokenmill.openvino_engine import OpenVinoEngine

        return OpenVinoEngine(model_path, spec)
    if spec.model.engine == "openai-server":
        from tokenmill.server_engine import ServerEngine

        return ServerEngine(model_path, spec)
    return VLLMEngine(model_path, spec)


def discard_engine(model_path: str, spec: JobSpec) -> None:
    """Forget (and close what is left of) the engine, so the next get_engine starts a new one."""
    with _engines_lock:
        engine = _engines.pop(engine_key(refuse_auto(spec), model_path), None)
    if engine is not None:
        engine.close()


def engine_died(exc: BaseException) -> bool:
    """Whether an error means the engine's process is gone (killed, out of memory), not a bad input."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"EngineDeadError", "EngineDied"})


def with_one_restart(run: Callable[[Engine], T], engine: Engine | None, model_path: str, spec: JobSpec,
                     shard_id: str) -> T:
    """run(engine), on the process's engine for the spec where none is given. An engine whose process
    died (killed, out of memory: not a bad row) is started again once and run goes again on the new
    one; a second death fails the shard."""
    try:
        return run(engine if engine is not None else get_engine(model_path, spec))
    except Exception as exc:
        if not engine_died(exc):
            raise
        log.warning("engine died during shard %s (%s); restarting it once and retrying the shard",
                    shard_id, describe_error(exc))
        progress.emit("shard_restarted", shard_id=shard_id)
        discard_engine(model_path, spec)
        return run(get_engine(model_path, spec))


def close_engines() -> None:
    """Close every engine this process holds, and wait for their processes to end."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.close()


def close_unscoped_engines() -> None:
    """close_engines, unless a caller holds an engine_scope (a notebook, a worker, a test session that
    calls a command in-process): then its engines are the scope's to close when it ends."""
    with _engines_lock:
        if _scope_depth > 0:
            return
    close_engines()


_exit_hook_registered = False


def _close_engines_before_exit() -> None:
    """Engines still open when the interpreter exits (a task called outside our flows, a
    notebook) are closed by an exit hook that runs before vLLM's own finalizers (exit hooks
    run last-registered first), so their threads end while the interpreter is whole."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(close_engines)
        _exit_hook_registered = True


def is_open(model_path: str, spec: JobSpec) -> bool:
    """Whether this process already holds the engine get_engine would return for this spec."""
    with _engines_lock:
        return engine_key(spec, model_path) in _engines


def open_engines() -> list[Engine]:
    """The engines this process holds now."""
    with _engines_lock:
        return list(_engines.values())


_scope_depth = 0


@contextmanager
def engine_scope() -> Iterator[None]:
    """Engines started inside are closed when the outermost scope ends.

    Every job runs inside one, so a notebook or a long-lived worker gets its memory (and
    on a GPU, the device) back when the flow ends, and nothing is left for the interpreter
    to tear down at exit. A caller that runs several flows on one engine (a test module,
    a benchmark) holds an outer scope around them; engines then live until it ends.
    """
    global _scope_depth
    with _engines_lock:
        _scope_depth += 1
    try:
        yield
    finally:
        with _engines_lock:
            _scope_depth -= 1
            outermost = _scope_depth == 0
        if outermost:
            close_engines()


def running_streams(model_path: str, spec: JobSpec) -> int | None:
    """Batches at once on the engine this process holds for the spec (None: no such engine open)."""
    with _engines_lock:
        engine = _engines.get(engine_key(refuse_auto(spec), model_path))
    return None if engine is None else engine.streams


def describe_engine(spec: JobSpec | None = None) -> tuple[str, str]:
    """(engine, device) for the run record (no spec: vLLM's)."""
    engine = refuse_auto(spec).model.engine if spec is not None else "vllm"
    return engine, engine_device(engine)
