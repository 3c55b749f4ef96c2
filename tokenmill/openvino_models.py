"""Encoder models as OpenVINO IR, quantized to int8 by NNCF on a sample of the job's own rows, cached.

The OpenVINO engine (tokenmill.openvino_engine) runs an embedding model from a Hugging Face directory
through the float32 ONNX export tokenmill.onnx_models makes once per machine:

- float32 (no quantization): OpenVINO reads the ONNX export itself.
- int8: static int8 (nncf.quantize, transformer model type, the performance preset: symmetric int8
  weights and activations, SmoothQuant on the activations with outliers), calibrated on padded
  batches of the job's own rows, cut as the engine is fed. Unlike ONNX Runtime's dynamic int8,
  activations have fixed scales and the attention products run in int8 too, which is why it is the
  faster of the two (bench/CHEAP_TIER.md).

The cache key says how the IR was made: the ONNX export it came from (itself keyed by the weights'
digest and the exporter's versions), the recipe, the CPU's int8 instruction set, the openvino and
nncf versions, and a digest of the calibration rows' token ids (another corpus: another model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.onnx_models import cached_model, int8_isa, onnx_model
from tokenmill.versions import library_versions

# what each method does, as recorded beside the IR it makes (and in the cache key)
RECIPES: dict[str, dict] = {
    "int8": {"kind": "static", "tool": "nncf.quantize", "model_type": "transformer", "preset": "performance",
             "weights": "int8 per channel, symmetric", "activations": "int8, calibrated", "fp16_weights": False},
}
OPENVINO_QUANTIZATIONS = tuple(RECIPES)
LIBRARIES = ("openvino", "nncf")
# compile settings: one request on all the cores. Measured on 2 cores (MiniLM int8, 400 rows near 256 tokens):
# LATENCY with one request 2.58 s, THROUGHPUT with 2 streams and 2 requests at once 2.53-2.63 s: no gain.
COMPILE_CONFIG = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}


def recipe(method: str, isa: str | None = None) -> dict:
    """The method's recipe as applied here: with the CPU's int8 instruction set and the libraries' versions."""
    if method not in RECIPES:
        raise ConfigError(f"unknown OpenVINO quantization {method!r}; known: {', '.join(OPENVINO_QUANTIZATIONS)}")
    return {**RECIPES[method], "isa": isa or int8_isa(), "versions": library_versions(LIBRARIES)}


def compile_config(cores: int) -> dict:
    return {**COMPILE_CONFIG, "INFERENCE_NUM_THREADS": cores}


def openvino_model(model_path: str, quantization: str | None, label: str | None,
                   calibration: Sequence[dict[str, np.ndarray]] = (), calibration_digest: str = "") -> Path:
    """The model OpenVINO compiles: the float32 ONNX export, or its int8 IR (model.xml and model.bin), made
    from `calibration` (inputs as the engine feeds them) on first use and cached under `label`."""
    exported = onnx_model(model_path, None, label)
    if quantization is None:
        return exported
    if not calibration:
        raise ConfigError(f"OpenVINO {quantization}: static quantization needs calibration rows, and none were given")
    name, identity = openvino_step(exported, model_path, quantization, label, calibration_digest, len(calibration))
    return cached_model("openvino", name, identity, lambda target: _quantize(exported, target, calibration),
                        "model.xml")


def openvino_step(exported: Path, model_path: str, quantization: str, label: str | None, calibration_digest: str,
                  calibration_batches: int) -> tuple[str, dict]:
    """The (name, identity) of the int8 model openvino_model makes from the float32 export `exported`."""
    label = (label or Path(model_path).name).replace("/", "--")
    identity = {"source": exported.parent.name, "recipe": recipe(quantization), "calibration": calibration_digest,
                "calibration_batches": calibration_batches}
    return f"{label}.{quantization}-{identity['recipe']['isa']}", identity


def _quantize(exported: Path, target: Path, calibration: Sequence[dict[str, np.ndarray]]) -> None:
    import nncf
    import openvino

    model = openvino.convert_model(str(exported))
    quantized = nncf.quantize(model, nncf.Dataset(list(calibration)), model_type=nncf.ModelType.TRANSFORMER,
                              preset=nncf.QuantizationPreset.PERFORMANCE, subset_size=len(calibration))
    openvino.save_model(quantized, str(target), compress_to_fp16=False)  # model.bin beside it
