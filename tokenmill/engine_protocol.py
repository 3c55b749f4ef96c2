"""What every engine is: the protocol the runner, the gate and calibration call, what a
generation returns, and the token budget batches are cut to (the job's, else the engine's own).
The bottom of the engines layer, so engine implementations import it without importing each
other, and both shard pipelines (runner, openai_batch) without importing each other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tokenmill.spec import DEFAULT_TOKEN_BUDGET, GenerationParams, JobSpec


@dataclass(frozen=True)
class Generation:
    """One row's generation: its (first) completion, and with n > 1 every completion in `samples`.

    logprobs (when asked): one entry per generated token, OpenAI's shape:
    {token_id, token, logprob, top_logprobs: [{token_id, token, logprob}, ...]}.
    output_tokens counts every completion's tokens (what was paid for)."""

    text: str
    output_tokens: int
    finish_reason: str | None
    logprobs: list[dict] | None = None
    samples: tuple[Generation, ...] = ()  # all n completions when n > 1; empty when n == 1
    cached_prompt_tokens: int = 0  # prompt tokens the engine found in its prefix cache


class Engine(Protocol):
    """What the runner, the gate and calibration read of an engine. An engine class subclasses it, and
    so starts from these defaults: one batch at a time, the job's (or the default) token budget."""

    name: str
    streams: int = 1  # engine calls the runner keeps in flight at once (transformers on a CPU: 2)
    start_seconds: float = 0.0  # constructing it (model load, engine processes, warm-up), as measured
    default_token_budget: int | None = None  # the batch budget a job that sets none gets here (None: the default)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]: ...

    def generate(self, batch: Sequence[Sequence[int]], params: GenerationParams,
                 overrides: Sequence[Mapping[str, Any] | None] | None = None) -> list[Generation]:
        """overrides: per row, sampling fields over the job's (tokenmill.generation.sampling_kwargs)."""
        ...

    def close(self) -> None: ...

    def configure_streams(self, spec: JobSpec) -> None:
        """The streams a job asks for, on an engine the process already holds (one engine, jobs that ask
        for different streams). One batch at a time: nothing to configure."""

    def set_streams(self, streams: int) -> None:
        """Run `streams` batches at once from now on (the engine trial times more than one)."""
        self.streams = streams


def run_engine(engine: Engine, batch: Sequence[Sequence[int]], spec: JobSpec) -> list:
    """One engine call for the job's mode: vectors (embed) or Generations (generate)."""
    if spec.mode == "embed":
        return engine.embed(batch)
    return engine.generate(batch, spec.generation)


def token_budget(spec: JobSpec, engine: Engine | None = None) -> int:
    """batching.token_budget, or where the job leaves it empty, the engine's own (`default_token_budget`:
    transformers on a CPU cuts smaller batches), else DEFAULT_TOKEN_BUDGET."""
    return spec.batching.token_budget or (engine.default_token_budget if engine else None) or DEFAULT_TOKEN_BUDGET
