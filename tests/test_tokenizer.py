"""The light tokenizer (tokenizer.json through `tokenizers` alone) gives transformers' ids, and an embed
job's encoding never imports transformers (seconds of every ONNX Runtime or OpenVINO process)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.models import TextTokenizer, light_tokenizer_fits, load_text_tokenizer, load_tokenizer, resolve_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée à la française, ÅNGSTRÖM naïve façade, über-cool ÀÉÎÕÜ",
    "中文字符测试 and 日本語のテキスト, 한국어",
    "  leading and trailing spaces  ",
    "",
    "emoji 🎉🚀 and symbols ©®™ ß ǅ ﬁ",
    "tab\there\nnewline\r\nwindows",
    "def f(x):\n    return x ** 2  # a docstring's code",
    "word " * 400,
    "unbrokenlongtokenwithoutanyspaces" * 20,
]


@pytest.mark.parametrize("model", ["all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"])
def test_the_light_tokenizer_gives_transformers_ids_cut_and_uncut(model):
    path = resolve_model(model)
    assert light_tokenizer_fits(path)
    light, full = TextTokenizer(path), load_tokenizer(path)
    for add in (True, False):
        assert light(TEXTS, add_special_tokens=add)["input_ids"] == full(TEXTS, add_special_tokens=add)["input_ids"]
    for limit in (8, 64, 256):
        cut = light(TEXTS, add_special_tokens=True, truncation=True, max_length=limit)["input_ids"]
        assert cut == full(TEXTS, add_special_tokens=True, truncation=True, max_length=limit)["input_ids"]
        assert max(map(len, cut)) == limit
    assert light(TEXTS[0])["input_ids"] == full(TEXTS[0])["input_ids"]
    assert light.pad_token_id == full.pad_token_id


def test_a_config_that_changes_the_special_tokens_gets_transformers_tokenizer(tmp_path):
    source = resolve_model("all-MiniLM-L6-v2")
    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((Path(source) / name).read_bytes())
    config = json.loads((Path(source) / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": True}))
    assert not light_tokenizer_fits(str(tmp_path))
    assert not isinstance(load_text_tokenizer(str(tmp_path)), TextTokenizer)


def test_an_embed_jobs_encoding_imports_neither_transformers_nor_torch():
    code = (
        "import sys\n"
        "from tokenmill.encoding import encode_rows\n"
        "from tokenmill.models import resolve_model\n"
        "from tokenmill.spec import JobSpec\n"
        "spec = JobSpec.model_validate({'input': 'x.parquet', 'output': 'out', 'mode': 'embed',"
        " 'model': {'name': 'all-MiniLM-L6-v2'}})\n"
        "rows = encode_rows(['a short text', 'word ' * 400], spec, resolve_model(spec.model_name))\n"
        "assert rows.truncated == [False, True], rows.truncated\n"
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
