"""How long a job takes as a whole process, predicted, and afterwards checked.

    predicted wall = fixed seconds + tokens / steady tokens/s x steady factor

- fixed seconds: process start to the first engine call (interpreter and imports, the
  orchestrator's API, the engine's start, the first shard's read and tokenize), as the last
  run of this job shape on this machine measured it; before any run, the engine's start from
  its trial plus nominal imports and API start.
- steady tokens/s: the engine's, from its trial on the job's sample (`engine: auto`) or from a
  calibration.
- steady factor: what the rest of a run adds to the engine's own time (reading, tokenizing
  and writing the other shards, the manifest, the record), as measured by the last run here;
  1 before any run.

The run record holds the prediction made from earlier runs beside what this run measured,
like with like: predicted against measured wall (the same tokens, so the corpus estimate's
error stays out of it), and the trial's tokens/s against the engine's measured tokens/s.
History is kept per job shape (model, mode, engine, device, length class) in the cache
directory (`TOKENMILL_CACHE_DIR`), beside the engine trials.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tokenmill.engine_choice import cache_dir

# Before the first run on a machine: seconds for the interpreter, imports and Prefect's API
# (measured on the 2-core CI machine: 8 to 15 s; a nominal middle)
NOMINAL_STARTUP_SECONDS = 12.0


class WallPrediction(BaseModel):
    engine: str
    tokens: float
    tokens_per_s: float
    rate_source: str
    fixed_seconds: float
    fixed_source: str
    steady_factor: float
    factor_source: str

    @property
    def seconds(self) -> float:
        return self.fixed_seconds + self.tokens / self.tokens_per_s * self.steady_factor

    def describe(self) -> str:
        return (f"{self.seconds:,.0f} s = {self.fixed_seconds:,.0f} s fixed ({self.fixed_source}) + "
                f"{self.tokens:,.0f} tokens / {self.tokens_per_s:,.0f} tokens/s ({self.rate_source})"
                + (f" x {self.steady_factor:.2f} ({self.factor_source})" if self.steady_factor != 1.0 else ""))


def history_key(shape_key: str, engine: str) -> str:
    return f"{shape_key}:{engine}"


def _history_path() -> Path:
    return cache_dir() / "run-history.json"


def read_history(key: str) -> dict[str, Any] | None:
    try:
        return json.loads(_history_path().read_text()).get(key)
    except (OSError, ValueError):
        return None


def write_history(key: str, entry: dict[str, Any]) -> None:
    path = _history_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        history = json.loads(path.read_text())
    except (OSError, ValueError):
        history = {}
    history[key] = {**entry, "measured_at": time.time()}
    temporary = path.with_name(f".run-history.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(history, indent=1))
    temporary.replace(path)


def predict_wall(key: str, engine: str, tokens: float, tokens_per_s: float, rate_source: str,
                 engine_start_seconds: float) -> WallPrediction:
    """The whole-process prediction for `tokens` on `engine`, from this job shape's last run here."""
    last = read_history(key)
    if last:
        fixed, fixed_source = last["fixed_seconds"], "last run here"
        factor, factor_source = last["steady_factor"], "last run here"
    else:
        fixed = NOMINAL_STARTUP_SECONDS + engine_start_seconds
        fixed_source = f"no run here yet: {NOMINAL_STARTUP_SECONDS:.0f} s nominal start-up + the engine's trial start"
        factor, factor_source = 1.0, "no run here yet"
    return WallPrediction(engine=engine, tokens=tokens, tokens_per_s=tokens_per_s, rate_source=rate_source,
                          fixed_seconds=fixed, fixed_source=fixed_source, steady_factor=factor,
                          factor_source=factor_source)


def compare(prediction: WallPrediction, measured: dict[str, float]) -> dict[str, float]:
    """Prediction beside measurement, as run metrics. `measured` holds the run's fixed_seconds,
    process_seconds and engine tokens/s (tokens over engine seconds)."""
    out = {"predicted_wall_seconds": prediction.seconds, "predicted_fixed_seconds": prediction.fixed_seconds,
           "predicted_engine_tokens_per_s": prediction.tokens_per_s}
    if measured.get("process_seconds"):
        out["measured_wall_seconds"] = measured["process_seconds"]
        out["wall_prediction_error"] = prediction.seconds / measured["process_seconds"] - 1.0
    if measured.get("engine_tokens_per_s"):
        out["measured_engine_tokens_per_s"] = measured["engine_tokens_per_s"]
        out["engine_tokens_per_s_error"] = prediction.tokens_per_s / measured["engine_tokens_per_s"] - 1.0
    return out


def remember(key: str, prediction: WallPrediction, measured: dict[str, float]) -> None:
    """This run's fixed seconds and steady factor, for the next prediction of this job shape here."""
    fixed, wall = measured.get("fixed_seconds"), measured.get("process_seconds")
    if not fixed or not wall or prediction.tokens <= 0:
        return
    steady_wall = wall - fixed
    factor = steady_wall / (prediction.tokens / prediction.tokens_per_s)
    write_history(key, {"fixed_seconds": fixed, "steady_factor": factor, "tokens": prediction.tokens})
