"""Encoder models as ONNX files, in float32 or quantized, made once per machine and cached.

The ONNX Runtime engine (tokenmill.onnx_engine) runs an embedding model from a Hugging Face
directory by exporting it to ONNX once, then quantizing the export by a named method:

- int8: dynamic int8 (ONNX Runtime's quantize_dynamic): int8 weights per output channel, activations
  quantized per call, on every weight MatMul; activation-by-activation products (attention scores)
  stay float32. Where the CPU has VNNI (avx512_vnni, avx_vnni) the u8 x s8 products run at full
  range; where it has not, they saturate (the cosine 0.86 of torch's dynamic int8 on an AVX2 CPU),
  so the weights are quantized to 7 bits there (reduce_range), which does not.
- int8-partial: the same, with each layer's FFN output projection (the MatMul fed by the GELU, whose
  activations have the widest range) left in float32: closer to the reference, a little slower.
- int4: 4-bit weights in blocks of 32 (MatMulNBits), activations in float32: the smallest weights and,
  on MiniLM, a loss of quality the eval gate refuses (cosine 0.965 to float32 on mixed documents).

The cache key says how a file was made: the source weights' digest, the method's recipe, the CPU's
instruction set where the recipe depends on it, and the versions of torch, transformers and onnxruntime.
A file is written under a temporary name and renamed, so two processes making it at once both end
with a whole file.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path

from tokenmill.digest import stable_digest
from tokenmill.errors import ConfigError
from tokenmill.models import models_home
from tokenmill.versions import library_versions

log = logging.getLogger(__name__)

OPSET = 17
# what each method does, as recorded beside the file it makes (and in the cache key)
RECIPES: dict[str, dict] = {
    "int8": {"kind": "dynamic", "weights": "int8 per channel", "matmul_const_b_only": True, "exclude": []},
    "int8-partial": {"kind": "dynamic", "weights": "int8 per channel", "matmul_const_b_only": True,
                     "exclude": ["ffn_output"]},
    "int4": {"kind": "weights_only", "weights": "int4 blocks", "block_size": 32, "symmetric": True},
}
QUANTIZATIONS = tuple(RECIPES)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def int8_isa(flags: set[str] | None = None) -> str:
    """The instruction set int8 products run on here: 'vnni' (u8 x s8 at full range) or 'no-vnni'."""
    flags = cpu_flags() if flags is None else flags
    return "vnni" if flags & {"avx512_vnni", "avx_vnni", "amx_int8"} else "no-vnni"


def recipe(method: str, isa: str | None = None) -> dict:
    """The method's recipe as applied on this CPU (int8 reduces its range where there is no VNNI)."""
    if method not in RECIPES:
        raise ConfigError(f"unknown ONNX quantization {method!r}; known: {', '.join(QUANTIZATIONS)}")
    made = dict(RECIPES[method])
    if made["kind"] == "dynamic":
        made["isa"] = isa or int8_isa()
        made["reduce_range"] = made["isa"] != "vnni"
    return made


def onnx_model(model_path: str, quantization: str | None = None, label: str | None = None) -> Path:
    """The model as an ONNX file, made (exported, then quantized) on first use and cached under a
    folder named after `label` (the job's model name; default: the model directory's name)."""
    source = Path(model_path)
    label = (label or source.name).replace("/", "--")
    if not (source / "config.json").exists():
        raise ConfigError(f"{model_path}: the ONNX Runtime engine exports a local Hugging Face model directory "
                          "(config.json and weights); this is not one")
    (fp32, identity), *quantized = onnx_steps(model_path, quantization, label)
    exported = _cached(fp32, identity, lambda target: _export(source, target))
    if quantization is None:
        return exported
    name, quantized_identity = quantized[0]
    return _cached(name, quantized_identity, lambda target: _quantize(exported, target, quantized_identity["recipe"]))


def onnx_steps(model_path: str, quantization: str | None = None, label: str | None = None) -> list[tuple[str, dict]]:
    """The (name, identity) of each model onnx_model makes, in order: the float32 export, then its quantized
    copy (tokenmill.prediction reads which are made, without making them)."""
    label = (label or Path(model_path).name).replace("/", "--")
    identity = {"weights": weights_digest(str(model_path)), "opset": OPSET,
                "versions": library_versions(("torch", "transformers", "onnxruntime"))}
    steps = [(f"{label}.fp32", identity)]
    if quantization is not None:
        how = recipe(quantization)
        steps.append((f"{label}.{quantization}-{how.get('isa', 'any')}", {**identity, "recipe": how}))
    return steps


@functools.lru_cache(maxsize=16)
def weights_digest(model_path: str) -> str:
    """sha256 over the model's config and weight files: a new checkpoint in the same place is a new model."""
    import hashlib

    digest = hashlib.sha256()
    root = Path(model_path)
    for path in sorted(p for p in root.iterdir() if p.suffix in (".json", ".safetensors", ".bin")):
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _cached(name: str, identity: dict, make) -> Path:
    return cached_model("onnx", name, identity, make, "model.onnx")


# When this process made each model, (start, end) in wall-clock seconds (tokenmill.prediction: a gate's or an
# engine start's making of a model, once per machine, is kept apart from the seconds it stores for the next run).
MADE_SPANS: list[tuple[float, float]] = []


def model_folder(kind: str, name: str, identity: dict) -> Path:
    return models_home() / kind / f"{name}.{stable_digest(identity, 12)}"


def made_seconds(kind: str, name: str) -> list[float]:
    """What making this model took here before, in any of its versions (its other identities: other
    weights, libraries or calibration rows): the seconds in each made folder's made.json."""
    out = []
    for made in sorted((models_home() / kind).glob(f"{name}.*/made.json")):
        try:
            out.append(float(json.loads(made.read_text())["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def cached_model(kind: str, name: str, identity: dict, make, file_name: str) -> Path:
    """models_home()/kind/<name>.<digest of identity>/file_name, made by make(staging path) when missing
    (in a staging folder, renamed whole: a reader sees no folder or a finished one)."""
    folder = model_folder(kind, name, identity)
    model_file = folder / file_name
    if model_file.exists():
        return model_file
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started, wall = time.perf_counter(), time.time()
    make(staging / file_name)
    (staging / "made.json").write_text(json.dumps({**identity, "seconds": time.perf_counter() - started},
                                                  indent=1, sort_keys=True))
    try:
        staging.rename(folder)
    except OSError:  # another process made it first: theirs is as good
        shutil.rmtree(staging, ignore_errors=True)
    MADE_SPANS.append((wall, time.time()))
    log.info("Made %s in %.1f s (once per machine)", folder, time.perf_counter() - started)
    return model_file


def _export(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager").eval()

    class LastHiddenState(torch.nn.Module):  # keyword arguments: positions differ between transformers versions
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    example = (torch.ones((2, 8), dtype=torch.long), torch.ones((2, 8), dtype=torch.long))
    dynamic = {0: "rows", 1: "tokens"}
    with torch.inference_mode():
        torch.onnx.export(LastHiddenState(model), example, str(target), input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], opset_version=OPSET, dynamo=False,
                          dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic, "last_hidden_state": dynamic})


def _quantize(exported: Path, target: Path, how: dict) -> None:
    import onnx

    if how["kind"] == "weights_only":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(onnx.load(str(exported)), block_size=how["block_size"],
                                         is_symmetric=how["symmetric"])
        quantizer.process()
        quantizer.model.save_model_to_file(str(target), False)
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    excluded = _ffn_output_matmuls(onnx.load(str(exported))) if "ffn_output" in how["exclude"] else []
    quantize_dynamic(str(exported), str(target), per_channel=True, reduce_range=how["reduce_range"],
                     weight_type=QuantType.QInt8, nodes_to_exclude=excluded,
                     extra_options={"MatMulConstBOnly": how["matmul_const_b_only"]})


def _ffn_output_matmuls(model) -> list[str]:
    """Each layer's FFN output projection: the weight MatMul fed, through elementwise ops alone, by a
    GELU (a Gelu node, or the Erf of its exported form). Found by the graph's shape, not by node
    names, which differ between architectures and exporters."""
    producers = {output: node for node in model.graph.node for output in node.output}
    initializers = {init.name for init in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in initializers:
            continue
        frontier, seen = [node.input[0]], set()
        for _ in range(GELU_SEARCH_DEPTH):
            parents = [producers[name] for name in frontier if name in producers and name not in seen]
            seen.update(frontier)
            if any(parent.op_type in GELU_OPS for parent in parents):
                found.append(node.name)
                break
            frontier = [name for parent in parents if parent.op_type in ELEMENTWISE_OPS for name in parent.input]
            if not frontier:
                break
    return found


GELU_OPS = frozenset({"Gelu", "FastGelu", "BiasGelu", "Erf"})
ELEMENTWISE_OPS = frozenset({"Mul", "Add", "Div", "Tanh", "Pow", "Sigmoid"})
GELU_SEARCH_DEPTH = 6
