"""Engines: run batches of token ids through a model.

The engine takes token ids, not text: the runner tokenizes once (to measure lengths
and cut batches) and the engine never tokenizes again. One engine per model spec is
kept per process, because starting vLLM costs tens of seconds and a worker runs
many shards.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from tokenmill.spec import GenerationParams, JobSpec

log = logging.getLogger(__name__)

# On CPU, vLLM's gpu_memory_utilization is the share of RAM given to the KV cache.
CPU_MEMORY_SHARE = 0.3


@dataclass(frozen=True)
class Generation:
    text: str
    output_tokens: int
    finish_reason: str | None


class Engine(Protocol):
    name: str

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]: ...

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams) -> list[Generation]: ...

    def close(self) -> None: ...


def run_engine(engine: Engine, batch: Sequence[Sequence[int]], spec: JobSpec) -> list:
    """One engine call for the job's mode: vectors (embed) or Generations (generate)."""
    if spec.mode == "embed":
        return engine.embed(batch)
    return engine.generate(batch, spec.generation)


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_path: str, spec: JobSpec):
        from vllm import LLM

        self.model_path = model_path
        self.engine_args = vllm_engine_args(model_path, spec)
        log.info("Starting vLLM: %s", self.engine_args)
        self.llm = LLM(**self.engine_args)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        outputs = self.llm.embed([{"prompt_token_ids": list(ids)} for ids in batch], use_tqdm=False)
        return [np.asarray(output.outputs.embedding, dtype=np.float32) for output in outputs]

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams) -> list[Generation]:
        from vllm import SamplingParams

        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in batch], sampling, use_tqdm=False)
        return [
            Generation(out.outputs[0].text, len(out.outputs[0].token_ids), out.outputs[0].finish_reason)
            for out in outputs
        ]

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the process is going away anyway
            log.debug("vLLM shutdown raised", exc_info=True)
        self.llm = None


def vllm_engine_args(model_path: str, spec: JobSpec) -> dict[str, Any]:
    """vllm.LLM(...) arguments: our defaults first, the user's engine_kwargs verbatim on top."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    args: dict[str, Any] = {
        "model": model_path,
        "dtype": "float32" if (on_cpu and spec.model.dtype == "auto") else spec.model.dtype,
        "max_num_seqs": spec.batching.max_batch_size,
    }
    if spec.mode == "embed":
        args["runner"] = "pooling"
    if spec.model.quantization:
        args["quantization"] = spec.model.quantization
    if on_cpu:
        args["gpu_memory_utilization"] = CPU_MEMORY_SHARE
    args.update(spec.model.engine_kwargs)
    return args


_engines: dict[tuple, Engine] = {}
_engines_lock = threading.Lock()


def _engine_key(model_path: str, spec: JobSpec) -> tuple:
    return (model_path, spec.mode, spec.model.model_dump_json(), spec.batching.max_batch_size)


def get_engine(model_path: str, spec: JobSpec) -> Engine:
    """The process's engine for this model spec and mode, started on first use."""
    key = _engine_key(model_path, spec)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = start_engine(model_path, spec)
        return engine


def start_engine(model_path: str, spec: JobSpec) -> Engine:
    """A new engine of the kind the model spec names."""
    if spec.model.engine == "transformers":
        from tokenmill.hf_engine import TransformersEngine

        return TransformersEngine(model_path, spec)
    return VLLMEngine(model_path, spec)


def discard_engine(model_path: str, spec: JobSpec) -> None:
    """Forget (and close what is left of) the engine, so the next get_engine starts a new one."""
    with _engines_lock:
        engine = _engines.pop(_engine_key(model_path, spec), None)
    if engine is not None:
        engine.close()


def engine_died(exc: BaseException) -> bool:
    """Whether an error means the engine's process is gone (killed, out of memory), not a bad input."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"EngineDeadError", "EngineDied"})


def close_engines() -> None:
    with _engines_lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()


def describe_engine(spec: JobSpec | None = None) -> tuple[str, str]:
    """(engine, device) for the run record."""
    if spec is not None and spec.model.engine == "transformers":
        import torch

        return "transformers", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        from vllm.platforms import current_platform

        return "vllm", "cpu" if current_platform.is_cpu() else str(current_platform.device_name)
    except Exception:  # noqa: BLE001
        return "vllm", "unknown"
