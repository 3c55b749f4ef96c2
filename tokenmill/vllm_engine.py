"""The vLLM engine: continuous batching over token ids, in vLLM's own engine process.

One adapter between our Engine protocol (tokenmill.engine_protocol) and vllm.LLM: the job's
engine arguments (ours first, the user's engine_kwargs verbatim on top), generations in our
Generation shape, and a close() that leaves neither threads nor shared memory behind.
tokenmill.engines keeps the process's engines; tokenmill.hf_engine is the other engine.
"""

from __future__ import annotations

import gc
import getpass
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tokenmill import timeline
from tokenmill.engine_protocol import Engine, Generation
from tokenmill.generation import vllm_sampling_params
from tokenmill.json_store import read_json, rewrite_json
from tokenmill.processes import ProcessIdentity, is_gone, process_stat
from tokenmill.spec import GenerationParams, JobSpec

log = logging.getLogger(__name__)

# On CPU, vLLM's gpu_memory_utilization is the share of RAM given to the KV cache.
CPU_MEMORY_SHARE = 0.3

# Daemon threads vLLM's SyncMPClient starts beside the engine process
# (vllm/v1/engine/core_client.py); close() waits for them.
VLLM_CLIENT_THREADS = ("EngineCoreOutputQueueThread", "MPClientEngineMonitor")
ENGINE_THREAD_JOIN_SECONDS = 30.0
ENGINE_SHUTDOWN_SECONDS = 2.0


GRAPHS_INDEX = "tokenmill-graphs.json"  # in the compile cache: {model path|mode: the graph folders its start added}


def _compile_cache() -> Path:
    """VLLM_CACHE_ROOT/torch_compile_cache, read as vllm.envs reads it (without importing vLLM, which a
    prediction on the main thread would pay seconds for)."""
    cache_home = os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return Path(os.path.expanduser(os.getenv("VLLM_CACHE_ROOT", os.path.join(cache_home, "vllm")))) / "torch_compile_cache"


def _inductor_cache() -> Path:
    """TORCHINDUCTOR_CACHE_DIR, else torch's default (torch._inductor.runtime.cache_dir_utils.default_cache_dir:
    <temp dir>/torchinductor_<user>), read without importing torch."""
    if os.getenv("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def compiled_graphs() -> set[str]:
    """The models vLLM keeps compiled on this machine, one entry per model and configuration: the folders of
    vLLM's torch.compile cache (VLLM_CACHE_ROOT/torch_compile_cache: torch_aot_compile/<hash>, or
    <hash>/rank_0_0 in older vLLM), and, where vLLM's AOT compile is off (on a CPU: keep_compiles_loadable),
    the graphs of inductor's FX graph cache (<inductor cache>/fxgraph/<xx>/<key>). A start that adds one
    compiled its model (20-50 s of a 2-core CPU's start); one that adds none loaded an earlier start's graphs."""
    found: set[str] = set()
    for root, pattern, prefix in ((_compile_cache(), "*/*", ""), (_inductor_cache(), "fxgraph/*/*", "inductor/")):
        try:
            found |= {prefix + str(p.relative_to(root)) for p in root.glob(pattern) if p.is_dir()}
        except OSError:  # no cache to read: nothing known compiled there
            pass
    return found


# vLLM 0.32 with torch 2.13 on a CPU saves its AOT-compiled model (VLLM_USE_AOT_COMPILE, on by default from
# torch 2.10) but cannot load it back: every later start logs "Compiling model again due to a load failure ...
# 'function' object has no attribute 'finalize_loading'" and compiles the model again. With AOT compile off,
# torch's own inductor cache keeps the compiled graphs and a later start loads them. Measured on a 2-core Xeon
# with AMX (2026-12-05, each start a fresh process, caches kept from a first start): MiniLM's later starts
# 33.8-36.5 s with AOT compile, 28.5-30.6 s without; SmolLM2's 98.7 s (38 s of it compiling again) against
# 68.9 s. A first start compiles either way (MiniLM 65.7 against 59.8 s, SmolLM2 122.5 against 116.1 s).
def keep_compiles_loadable(on_cpu: bool) -> None:
    """On a CPU, turn vLLM's AOT compile off (unless the user set VLLM_USE_AOT_COMPILE): see above. Set in this
    process's environment before the engine starts, which its engine and worker processes inherit."""
    if on_cpu:
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def graphs_kept(model_path: str, mode: str) -> bool:
    """Whether vLLM's cache still holds graphs a start of this model in this mode compiled (GRAPHS_INDEX,
    beside the graphs: it goes where they go, whatever became of tokenmill's own cache): its next start
    loads them, it does not compile."""
    added = read_json(_compile_cache() / GRAPHS_INDEX).get(f"{model_path}|{mode}") or []
    return bool(set(added) & compiled_graphs())


def _index_graphs(model_path: str, mode: str, added: set[str]) -> None:
    try:
        rewrite_json(_compile_cache() / GRAPHS_INDEX,
                     lambda index: index.update({f"{model_path}|{mode}": sorted(added)}))
    except OSError as exc:  # a read-only cache: the next prediction adds the compile, as before any start
        log.debug("indexing vLLM's compiled graphs failed: %s", exc)


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model_path: str, spec: JobSpec):
        from vllm import LLM
        from vllm.platforms import current_platform

        keep_compiles_loadable(current_platform.is_cpu())
        self.model_path = model_path
        self.engine_args = vllm_engine_args(model_path, spec)
        log.info("Starting vLLM: %s", self.engine_args)
        before = set(threading.enumerate())
        graphs = compiled_graphs()
        started = time.perf_counter()
        self.llm = LLM(**self.engine_args)
        self.start_seconds = time.perf_counter() - started
        # a start that compiled the model (its first here, or after vLLM's cache was cleared) against one that
        # loaded what an earlier start compiled: tokenmill.prediction holds them apart
        added = compiled_graphs() - graphs
        self.compiled = bool(added)
        if self.compiled:
            timeline.mark("engine_compiled")
            _index_graphs(model_path, spec.mode, added)
        self.client_threads = [t for t in threading.enumerate()
                               if t not in before and t.name in VLLM_CLIENT_THREADS]
        watch = watch_engine_death(self.llm)
        if watch is not None:
            self.client_threads.append(watch)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.leftovers = EngineLeftovers.watch(self.llm)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        outputs = self.llm.embed([{"prompt_token_ids": list(ids)} for ids in batch], use_tqdm=False)
        return [np.asarray(output.outputs.embedding, dtype=np.float32) for output in outputs]

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams,
                 overrides: Sequence[Mapping[str, Any] | None] | None = None) -> list[Generation]:
        """One request per row; with overrides, each row gets its own SamplingParams."""
        if overrides is None:
            sampling = vllm_sampling_params(params)
        else:
            sampling = [vllm_sampling_params(params, row) for row in overrides]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in batch], sampling, use_tqdm=False)
        return [vllm_generation(out) for out in outputs]

    def close(self) -> None:
        """Stop the engine process and wait for the client's threads to end.

        Left to the interpreter's exit, the shutdown runs from a finalizer while Python is
        tearing down: the client's daemon threads (the output socket poller, the process
        monitor) wake up as the engine process dies, find the interpreter finalizing, and
        are unwound out of libzmq's C++ frames, which aborts the process ("terminate called
        without an active exception", exit 134) after a job that succeeded.
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        client = llm.llm_engine.engine_core
        self.leftovers.look_again()  # segments made since the start, while the engine's processes still run
        try:
            # vLLM waits 5 s by default for the engine process to end on SIGTERM, then kills it. On a CPU
            # its engine core rarely ends in time (measured here: every run waited the full 5 s), and it
            # holds nothing a finished job needs: every output is written and recorded before close.
            client.shutdown(timeout=ENGINE_SHUTDOWN_SECONDS)
        except Exception:  # noqa: BLE001 - a dead engine may fail to shut down; its threads still end
            log.debug("vLLM shutdown raised", exc_info=True)
        for thread in self.client_threads:
            thread.join(timeout=ENGINE_THREAD_JOIN_SECONDS)
            if thread.is_alive():
                log.warning("vLLM client thread %s still running %.0f s after shutdown", thread.name,
                            ENGINE_THREAD_JOIN_SECONDS)
        del llm, client
        gc.collect()
        self.leftovers.unlink()


DEATH_WATCH_THREAD = "tokenmill-vllm-death-watch"


def watch_engine_death(llm) -> threading.Thread | None:
    """Wake a call waiting on a dead engine. vLLM's sync client waits for outputs on a queue with no timeout
    (SyncMPClient.get_output); when its engine core process dies, its monitor marks the engine dead and stops
    the output thread without putting anything on that queue, so a call in flight then (the OOM killer's
    moment) waited for ever, and so did one sent before the monitor's mark (tests/test_engine_embed.py's dead
    engine hung a CI run here, 2026-12-08). This thread waits on the core processes' ends (their sentinels,
    duplicated: vLLM may close its own) and then puts vLLM's EngineDeadError on that queue: the call raises it,
    and tokenmill.engines restarts the engine once and redoes the shard. After close() the core's end wakes it
    and it ends; what it put is never read. None where vLLM is laid out otherwise (no such queue or processes):
    nothing to watch."""
    try:
        client = llm.llm_engine.engine_core
        outputs, processes = client.outputs_queue, list(client.resources.engine_manager.processes)
        from vllm.v1.engine.exceptions import EngineDeadError
    except (AttributeError, ImportError):
        return None
    ends = [os.dup(process.sentinel) for process in processes if process.sentinel is not None]
    if not ends:
        return None

    def watch() -> None:  # holds the queue and the ends, not the client: the client is collected as before
        from multiprocessing.connection import wait

        try:
            wait(ends)
            outputs.put_nowait(EngineDeadError())
        finally:
            for end in ends:
                os.close(end)

    thread = threading.Thread(target=watch, name=DEATH_WATCH_THREAD, daemon=True)
    thread.start()
    return thread


SEGMENT_WAIT_SECONDS = 10.0  # for killed engine processes to be gone before their segments are unlinked


class EngineLeftovers:
    """The shared-memory segments a vLLM engine's processes made, unlinked once those processes are gone.

    vLLM's engine core makes a ring buffer for its workers (shm_broadcast), its workers one each for
    their replies, and it unlinks them only from the buffers' finalizers. close() gives the engine core
    ENGINE_SHUTDOWN_SECONDS after SIGTERM, then vLLM kills its process tree, and killed processes unlink
    nothing: the segments stayed in /dev/shm until multiprocessing's resource tracker (which the
    spawned engine processes share with this one) found them at exit and warned of "leaked
    shared_memory objects" (4 runs in 5 here). Linux only (/proc); elsewhere it finds nothing.
    """

    def __init__(self, processes: list, pids: dict[int, ProcessIdentity]):
        self.processes = processes  # the engine core's multiprocessing.Process objects
        self.pids = pids  # every process of the engine (the core and its descendants), by pid
        self.segments: set[str] = set()

    @classmethod
    def watch(cls, llm) -> "EngineLeftovers":
        try:
            processes = list(llm.llm_engine.engine_core.resources.engine_manager.processes)
        except AttributeError:  # an in-process engine core, or another vLLM layout: nothing to clean
            processes = []
        leftovers = cls(processes, {})
        leftovers.look_again()
        return leftovers

    def look_again(self) -> None:
        """Note the engine's processes and the psm_* segments they map now, less this process's own."""
        try:
            here = ProcessIdentity.current()
            for process in self.processes:
                for pid in _descendants(process.pid) if process.pid else []:
                    if pid not in self.pids:
                        stat = process_stat(pid)
                        self.pids[pid] = ProcessIdentity(here.host, here.pid_namespace, pid, stat[1] if stat else None)
            self.segments |= _mapped_segments(self.pids) - _mapped_segments([os.getpid()])
        except Exception:  # noqa: BLE001 - a cleanup aid; it must never fail an engine
            log.debug("Could not read the vLLM engine's shared memory", exc_info=True)

    def unlink(self) -> None:
        """Once every engine process is gone, unlink the segments they left and tell the tracker so."""
        segments, self.segments = self.segments, set()
        try:
            if not segments:
                return
            if not self._gone(SEGMENT_WAIT_SECONDS):
                log.debug("vLLM engine processes still running; left their segments to them: %s", segments)
                return
            from multiprocessing import resource_tracker

            for name in sorted(segments):
                try:
                    os.unlink(f"/dev/shm/{name}")  # shm_unlink, without attaching (which would register it)
                except FileNotFoundError:
                    continue  # its maker unlinked it, and unregistered it
                # Its maker registered it with the tracker (Python < 3.13 registers every segment) and,
                # killed, never unregistered it: we do, so the tracker has nothing to warn about.
                resource_tracker.unregister(f"/{name}", "shared_memory")
                log.debug("Unlinked %s, left by the stopped vLLM engine", name)
        except Exception:  # noqa: BLE001 - close() and close_engines() must go on to the next engine
            log.debug("Could not unlink the vLLM engine's shared memory", exc_info=True)

    def _gone(self, timeout: float) -> bool:
        """Wait (bounded) for the engine's processes to end: exited, or zombies, or a new pid's holder."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        while True:
            alive = [identity.pid for identity in self.pids.values() if not is_gone(identity)]
            if not alive or time.monotonic() >= deadline:
                return not alive
            time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    """pid and every process under it (Linux /proc; [pid] alone where /proc has no children)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    queue.extend(int(child) for child in handle.read().split())
            except OSError:  # the thread ended
                continue
    return found


def _mapped_segments(pids) -> set[str]:
    """The psm_* segments these processes map, from /proc/<pid>/maps (none where there is no /proc)."""
    names: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as handle:
                for line in handle:
                    path = line.rstrip("\n").partition("/dev/shm/")[2]
                    if path.startswith("psm_"):
                        names.add(path.removesuffix(" (deleted)"))
        except OSError:  # gone already, or no /proc here
            continue
    return names


def vllm_generation(output) -> Generation:
    """A vllm.RequestOutput as our Generation (every completion when n > 1)."""
    completions = [
        Generation(c.text, len(c.token_ids), c.finish_reason, _logprobs(c) if c.logprobs is not None else None)
        for c in output.outputs
    ]
    first = completions[0]
    return Generation(first.text, sum(c.output_tokens for c in completions), first.finish_reason, first.logprobs,
                      tuple(completions) if len(completions) > 1 else (), int(output.num_cached_tokens or 0))


def _logprobs(completion) -> list[dict]:
    """Per generated token: the sampled token's logprob and the top alternatives, OpenAI's shape."""
    entries = []
    for token_id, top in zip(completion.token_ids, completion.logprobs):
        chosen = top.get(token_id)
        ranked = sorted(top.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0)
        entries.append({
            "token_id": int(token_id),
            "token": chosen.decoded_token if chosen is not None else None,
            "logprob": float(chosen.logprob) if chosen is not None else None,
            "top_logprobs": [{"token_id": int(t), "token": lp.decoded_token, "logprob": float(lp.logprob)}
                             for t, lp in ranked],
        })
    return entries


def vllm_engine_args(model_path: str, spec: JobSpec) -> dict[str, Any]:
    """vllm.LLM(...) arguments: our defaults first, the user's engine_kwargs verbatim on top."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    dtype = spec.model.dtype
    if on_cpu and dtype == "auto":
        # float32 on a CPU (bf16 ran ~6x slower on an AVX2 host), except an int8 checkpoint on a CPU with AMX:
        # vLLM's CPU int8 linear picks its AMX kernel there whatever the activations' dtype, and that kernel
        # takes only bf16/fp16 ("int8_scaled_mm_with_quant: expect A to be bfloat16 or half"; vLLM's
        # kernels/linear/scaled_mm/cpu.py, check_cpu_sgl_kernel), so in float32 the engine dies on its first call
        dtype = "bfloat16" if int8_checkpoint(model_path) and cpu_has_amx() else "float32"
    args: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "max_num_seqs": spec.batching.max_batch_size,
    }
    if spec.mode == "embed":
        args["runner"] = "pooling"
    else:
        # rows that share a prompt prefix (system prompt, few-shot turns) reuse its KV cache; the runner
        # submits them adjacently (tokenmill.runner.prefix_order)
        args["enable_prefix_caching"] = True
    if spec.model.quantization:
        args["quantization"] = spec.model.quantization
    if on_cpu:
        args["gpu_memory_utilization"] = CPU_MEMORY_SHARE
    args.update(spec.model.engine_kwargs)
    return args


def int8_checkpoint(model_path: str) -> bool:
    """Whether the checkpoint's config asks for int8 weights (compressed-tensors' W8A8, as
    tokenmill.models.prepare_smollm2_int8 writes it)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any((group.get("weights") or {}).get("num_bits") == 8 and (group.get("weights") or {}).get("type") == "int"
               for group in groups.values() if isinstance(group, dict))


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, as torch (and so vLLM's CPU kernels) sees them."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())
