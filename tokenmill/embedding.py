"""What every padding embedding engine shares (transformers, ONNX Runtime): the model's pooling as
sentence-transformers would apply it, and how many batches run at once on a CPU.

A leaf of the engine layer: engine modules import it, never each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tokenmill.spec import JobSpec


@dataclass(frozen=True)
class Pooling:
    mode: str  # mean | cls | max | lasttoken
    normalize: bool


def read_pooling(model_path: str) -> Pooling:
    """The pooling and normalisation sentence-transformers would apply to this model."""
    root = Path(model_path)
    modules_file = root / "modules.json"
    if not modules_file.exists():
        return Pooling("mean", True)  # no sentence-transformers config: mean pooling, unit vectors
    modules = json.loads(modules_file.read_text())
    mode, normalize = "mean", False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            config = json.loads((root / module.get("path", "") / "config.json").read_text())
            for key, name in (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                              ("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_mean_tokens", "mean")):
                if config.get(key):
                    mode = name
                    break
        elif kind.endswith("Normalize"):
            normalize = True
    return Pooling(mode, normalize)


def padded_arrays(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) as int64 arrays, each row padded on the right to the longest."""
    longest = max(len(ids) for ids in batch)
    input_ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    return input_ids, mask


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling) -> np.ndarray:
    """The rows' vectors from the last hidden state (rows x tokens x dim), as float32."""
    weights = mask[..., None].astype(np.float32)
    hidden = hidden.astype(np.float32, copy=False)
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "max":
        pooled = np.where(weights > 0, hidden, np.finfo(np.float32).min).max(axis=1)
    elif pooling.mode == "lasttoken":
        pooled = hidden[np.arange(hidden.shape[0]), mask.sum(1) - 1]
    else:
        pooled = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1, None)
    if pooling.normalize:
        pooled = pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
    return np.ascontiguousarray(pooled, dtype=np.float32)


def cpu_streams(spec: JobSpec, device_type: str, cores: int) -> int:
    """Batches the engine runs at once (the runner keeps this many calls in flight: run_batches).

    On CPU, one batch on all cores leaves them partly idle: the GEMMs split well across threads,
    but the rest of a forward (attention, GELU, layer norm, copies: ~38% of MiniLM's time at 256
    tokens) and the Python between ops do not. Two batches at once, each on half the cores, keep
    them busy: measured on 2 cores (MiniLM, fp32), 26.2 -> 30.4 documents/s at 256 tokens, 48.6 ->
    56.9 at 128, 222 -> 264 at 32 (transformers); ONNX Runtime int8, 38.8-42.2 -> 44.0-45.1 at 256
    tokens and 139-145 -> 151-159 on mixed lengths. Embedding only (generate's decode loop is
    Python-bound per token and unmeasured here); one stream on a GPU, which runs one kernel stream anyway.
    """
    if device_type != "cpu" or spec.mode != "embed" or cores < 2:
        return 1
    return min(spec.model.cpu_streams or 2, cores)


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
