"""What every engine is: the protocol the runner, the gate and calibration call, and what a
generation returns. A leaf module, so engine implementations import it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from tokenmill.spec import GenerationParams, JobSpec


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
