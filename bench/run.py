"""Side-by-side benchmarks: every claim of speed, measured against what a team would use
instead, in one process run, interleaved and repeated (medians and ratios).

    make bench                     # or: python -m bench.run --docs 2000 --repeats 3

Writes bench/RESULTS.md and logs every figure to MLflow (experiment tokenmill-bench).
Engine start is excluded from every timing; each engine is warmed up first.
"""

from __future__ import annotations

import os

for _name, _value in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                      "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                      "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"


@dataclass
class Variant:
    """One way of doing the same work; timed once per round."""

    name: str
    run: Callable[[], None]
    tokens: int  # real (unpadded) tokens per run
    items: int
    padded_slots: int | None = None
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median

    @property
    def items_per_s(self) -> float:
        return self.items / self.median

    @property
    def padding(self) -> float | None:
        return None if self.padded_slots is None else 1 - self.tokens / self.padded_slots


def interleave(variants: list[Variant], repeats: int) -> None:
    """Round-robin: each round runs every variant once, so drift on a shared machine hits all alike."""
    for variant in variants:
        variant.run()  # warm-up, not counted
    for _ in range(repeats):
        for variant in variants:
            started = time.perf_counter()
            variant.run()
            variant.seconds.append(time.perf_counter() - started)


def prepare_corpora(docs: int) -> tuple[Path, Path]:
    """x1: `docs` documents taken evenly from the sample corpus; x10: ten times as many."""
    from tokenmill.sample_corpus import write_sample_corpus

    sample = ROOT / "data" / "sample-corpus"
    if not sample.exists():
        write_sample_corpus(sample)
    table = pq.read_table(sample)
    out = ROOT / "data" / "bench"
    x1, x10 = out / f"x1-{docs}", out / f"x10-{docs}"
    if not x1.exists():
        step = max(1, table.num_rows // docs)
        picked = table.take(pa.array(range(0, step * docs, step))).slice(0, docs)
        x1.mkdir(parents=True)
        pq.write_table(picked, x1 / "part-0.parquet", row_group_size=500)
    if not x10.exists():
        x10.mkdir(parents=True)
        picked = pq.read_table(x1)
        for copy in range(10):  # same texts, new ids: ten times the rows, the same length profile
            ids = pa.array([f"{i}-copy{copy}" for i in picked.column("id").to_pylist()])
            pq.write_table(picked.set_column(0, "id", ids), x10 / f"part-{copy}.parquet", row_group_size=500)
    return x1, x10


def peak_memory_of_run(corpus: Path, scratch: Path, max_shard_rows: int) -> dict[str, float]:
    """Peak RSS of a `tokenmill run` process tree (CLI, Prefect server, vLLM engine), sampled every 0.2 s."""
    from tokenmill.calibrate import PeakMemory

    output = scratch / f"out-{corpus.name}"
    args = [sys.executable, "-m", "flows.cli", "run", "--input", str(corpus), "--output", str(output),
            "--max-shard-rows", str(max_shard_rows), "--no-progress",
            "--tracking-uri", f"sqlite:///{scratch}/mlflow-memory.db"]
    env = dict(os.environ, PREFECT_HOME=str(scratch / f"prefect-{corpus.name}"))
    started = time.perf_counter()
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_lines: list[str] = []
    reader = threading.Thread(target=lambda: log_lines.extend(process.stdout), daemon=True)
    reader.start()
    with PeakMemory(process.pid, interval=0.2) as memory:
        process.wait()
    reader.join(timeout=10)
    if process.returncode != 0:
        raise RuntimeError(f"tokenmill run on {corpus} failed:\n{''.join(log_lines)[-3000:]}")
    manifest = json.loads((output / "_manifest.json").read_text())
    return {"rows": manifest["totals"]["rows_in"], "peak_tree_gib": memory.peak_gib,
            "peak_main_gib": memory.peak_root_gib, "wall_s": time.perf_counter() - started}


def machine() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {psutil.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000, help="documents in the 1x corpus")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-docs", type=int, default=256, help="documents for the batch-of-1 comparison")
    parser.add_argument("--buckets-docs", type=int, default=1000, help="documents for buckets on/off")
    parser.add_argument("--generate-docs", type=int, default=32)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import numpy as np
    from sentence_transformers import SentenceTransformer

    from tokenmill.bucketing import input_order_batches, padding_stats, plan_batches
    from tokenmill.engines import get_engine
    from tokenmill.models import resolve_model
    from tokenmill.runner import encode_rows, input_token_limit, run_batches, run_shard
    from tokenmill.shards import discover_shards
    from tokenmill.spec import JobSpec, ModelSpec

    started_at = dt.datetime.now(dt.timezone.utc)
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    x1, x10 = prepare_corpora(args.docs)
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    table = pq.read_table(x1)
    texts = table.column("text").to_pylist()

    spec = JobSpec(input=str(x1), output=str(scratch / "e2e"), mode="embed",
                   model=ModelSpec(name="all-MiniLM-L6-v2"), batching={"max_shard_rows": 1000})
    hf_spec = spec.model_copy(update={"model": ModelSpec(name="all-MiniLM-L6-v2", engine="transformers")})
    model_path = resolve_model(spec.model_name)
    budget, max_rows = spec.batching.token_budget, spec.batching.max_batch_size
    encoded = encode_rows(texts, spec, model_path)
    ids, lengths = encoded.token_ids, [len(t) for t in encoded.token_ids]
    tokens = sum(lengths)
    limit = input_token_limit(spec, model_path)
    shards = discover_shards(str(x1), max_shard_rows=1000)
    print(f"corpus: {len(texts)} docs, {tokens} tokens (median {statistics.median(lengths)}, max {max(lengths)})")

    vllm = get_engine(model_path, spec)
    hf = get_engine(model_path, hf_spec)
    st = SentenceTransformer(model_path, device="cpu")

    def tokenmill_run(job: JobSpec, engine) -> Callable[[], None]:
        def go() -> None:
            for shard in shards:
                run_shard(shard, job, engine=engine)
        return go

    bucketed = plan_batches(lengths, budget, max_rows, spec.batching.length_tolerance)

    # 1. tokenmill end to end against the engine called directly on the same texts
    e2e = Variant("tokenmill end to end (vLLM)", tokenmill_run(spec, vllm), tokens, len(texts))
    direct = Variant("vLLM LLM.embed(texts) directly", lambda: vllm.llm.embed(
        texts, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": limit}), tokens, len(texts))
    # 2. offline batches against one request at a time, same engine, same rows
    k = min(args.single_docs, len(ids))
    sub_lengths = lengths[:k]
    sub_batches = plan_batches(sub_lengths, budget, max_rows, spec.batching.length_tolerance)
    offline = Variant("vLLM, our batches", lambda: run_batches(vllm, sub_batches, ids[:k], spec, "bench"),
                      sum(sub_lengths), k)
    single = Variant("vLLM, one request at a time", lambda: [vllm.embed([row]) for row in ids[:k]],
                     sum(sub_lengths), k)
    hf_offline = Variant("transformers, our batches", lambda: run_batches(hf, sub_batches, ids[:k], hf_spec, "bench"),
                         sum(sub_lengths), k)
    hf_single = Variant("transformers, one request at a time", lambda: [hf.embed([row]) for row in ids[:k]],
                        sum(sub_lengths), k)
    # 3. transformers engine with and without length buckets, same token budget
    c = min(args.buckets_docs, len(ids))
    c_lengths = lengths[:c]
    on = plan_batches(c_lengths, budget, max_rows, spec.batching.length_tolerance)
    off = input_order_batches(c_lengths, budget, max_rows)
    buckets_on = Variant("transformers, length buckets", lambda: run_batches(hf, on, ids[:c], hf_spec, "bench"),
                         sum(c_lengths), c, padding_stats(c_lengths, on).padded_slots)
    buckets_off = Variant("transformers, input order", lambda: run_batches(hf, off, ids[:c], hf_spec, "bench"),
                          sum(c_lengths), c, padding_stats(c_lengths, off).padded_slots)
    # 4. against sentence-transformers' own encode (which sorts by length inside)
    st_encode = Variant("sentence-transformers encode (batch 32)",
                        lambda: st.encode(texts, batch_size=32, convert_to_numpy=True), tokens, len(texts))
    hf_e2e = Variant("tokenmill end to end (transformers)", tokenmill_run(hf_spec, hf), tokens, len(texts))
    # 5. the engines side by side on the same bucketed batches
    vllm_engine = Variant("vLLM engine, our batches", lambda: run_batches(vllm, bucketed, ids, spec, "bench"),
                          tokens, len(texts), padding_stats(lengths, bucketed).padded_slots)
    hf_engine = Variant("transformers engine, our batches", lambda: run_batches(hf, bucketed, ids, hf_spec, "bench"),
                        tokens, len(texts), padding_stats(lengths, bucketed).padded_slots)

    embed_variants = [e2e, direct, offline, single, hf_offline, hf_single, buckets_on, buckets_off, st_encode, hf_e2e,
                      vllm_engine, hf_engine]
    print("embedding comparisons, interleaved ...")
    interleave(embed_variants, args.repeats)

    profile_text = profile(tokenmill_run(spec, vllm))

    from tokenmill.engines import close_engines

    close_engines()  # free the embedding engines' memory before the generation engines start
    del st

    gen_spec = JobSpec(mode="generate", model=ModelSpec(name="SmolLM2-135M-Instruct"),
                       generation={"max_tokens": 32})
    gen_hf_spec = gen_spec.model_copy(update={"model": ModelSpec(name="SmolLM2-135M-Instruct",
                                                                 engine="transformers")})
    gen_path = resolve_model(gen_spec.model_name)
    prompts = texts[: args.generate_docs]
    gen_encoded = encode_rows(prompts, gen_spec, gen_path)
    gen_lengths = [len(t) for t in gen_encoded.token_ids]
    gen_batches = plan_batches(gen_lengths, budget, max_rows, spec.batching.length_tolerance)
    gen_vllm = get_engine(gen_path, gen_spec)
    gen_hf = get_engine(gen_path, gen_hf_spec)
    generated: dict[str, int] = {}

    def generate_with(engine, job, name) -> Callable[[], None]:
        def go() -> None:
            results, _ = run_batches(engine, gen_batches, gen_encoded.token_ids, job, "bench")
            generated[name] = sum(g.output_tokens for batch in results for g in batch)
        return go

    gen_v = Variant("vLLM generate", generate_with(gen_vllm, gen_spec, "vllm"), sum(gen_lengths), len(prompts))
    gen_h = Variant("transformers generate", generate_with(gen_hf, gen_hf_spec, "hf"), sum(gen_lengths),
                    len(prompts))
    print("generation comparison, interleaved ...")
    interleave([gen_v, gen_h], args.repeats)
    close_engines()

    memory = None
    if not args.skip_memory:
        print("peak memory at 1x and 10x ...")
        memory = {"x1": peak_memory_of_run(x1, scratch, 1000), "x10": peak_memory_of_run(x10, scratch, 1000)}

    gpu = gpu_note()
    report = write_results(args, command, started_at, len(texts), tokens, embed_variants, gen_v, gen_h, generated,
                           memory, profile_text, gpu)
    log_to_mlflow(report, args.results)
    shutil.rmtree(scratch, ignore_errors=True)
    print(args.results.read_text())
    return 0


def profile(run: Callable[[], None]) -> str:
    """Where a tokenmill pass spends its time, outside the engine's own process."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.005)
    profiler.start()
    run()
    profiler.stop()
    return profiler.output_text(unicode=False, color=False, show_all=False, short_mode=True)


def gpu_note() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"a GPU is present ({torch.cuda.get_device_name()}): run `python -m bench.gpu` for its figures"
    except Exception:  # noqa: BLE001
        pass
    return "no GPU on this machine"


def write_results(args, command, started_at, docs, tokens, embed, gen_v, gen_h, generated, memory, profile_text,
                  gpu) -> dict:
    e2e, direct, offline, single, hf_offline, hf_single, on, off, st_encode, hf_e2e, vllm_engine, hf_engine = embed
    best = max((e2e, hf_e2e), key=lambda v: v.tokens_per_s)
    rows = []
    figures: dict[str, float] = {}

    def row(name, measured, target, met, note=""):
        rows.append(f"| {name} | {measured} | {target} | {'yes' if met else 'no' if met is not None else '—'} "
                    f"| {note} |")

    r1 = e2e.tokens_per_s / direct.tokens_per_s
    figures["e2e_vs_direct"] = r1
    row("tokenmill end to end vs the same engine called directly", f"{r1:.2f}×", "≥ 0.90", r1 >= 0.90,
        f"{e2e.tokens_per_s:,.0f} vs {direct.tokens_per_s:,.0f} tokens/s; ours reads Parquet, validates, "
        "tokenizes, buckets and writes Parquet")
    r2 = offline.items_per_s / single.items_per_s
    figures["offline_vs_single"] = r2
    row("offline batches vs one request at a time (vLLM)", f"{r2:.1f}× items/s", "≥ 20×", r2 >= 20,
        f"{offline.items_per_s:,.1f} vs {single.items_per_s:,.1f} items/s on {offline.items} docs")
    r2h = hf_offline.items_per_s / hf_single.items_per_s
    figures["offline_vs_single_transformers"] = r2h
    row("offline batches vs one request at a time (transformers)", f"{r2h:.1f}× items/s", "≥ 20×", r2h >= 20,
        f"{hf_offline.items_per_s:,.1f} vs {hf_single.items_per_s:,.1f} items/s on {hf_offline.items} docs")
    r3 = on.tokens_per_s / off.tokens_per_s
    figures.update(buckets_speedup=r3, padding_bucketed=on.padding, padding_input_order=off.padding)
    row("transformers engine, buckets on vs off (same token budget)",
        f"{r3:.2f}× tokens/s; padding {on.padding:.1%} vs {off.padding:.1%}", "≥ 2×; padding ≤ 5%",
        r3 >= 2 and on.padding <= 0.05, f"{on.items} docs")
    r4 = best.tokens_per_s / st_encode.tokens_per_s
    figures["best_vs_sentence_transformers"] = r4
    row("our best engine vs sentence-transformers encode", f"{r4:.2f}×", "≥ 1.0×", r4 >= 1.0,
        f"{best.name}: {best.tokens_per_s:,.0f} vs {st_encode.tokens_per_s:,.0f} tokens/s; "
        f"tokenmill on transformers: {hf_e2e.tokens_per_s / st_encode.tokens_per_s:.2f}×")
    r5 = vllm_engine.tokens_per_s / hf_engine.tokens_per_s
    r5g = gen_h.median / gen_v.median
    figures.update(vllm_vs_transformers_embed=r5, vllm_vs_transformers_generate=r5g)
    row("vLLM vs transformers engine, embed", f"{r5:.2f}×", "report", None,
        f"{vllm_engine.tokens_per_s:,.0f} vs {hf_engine.tokens_per_s:,.0f} tokens/s, same batches")
    row("vLLM vs transformers engine, generate", f"{r5g:.2f}×", "report", None,
        f"{args.generate_docs} prompts, max_tokens 32: {gen_v.median:.2f} s vs {gen_h.median:.2f} s; "
        f"output tokens {generated.get('vllm')} vs {generated.get('hf')}")
    if memory:
        r6 = memory["x10"]["peak_tree_gib"] / memory["x1"]["peak_tree_gib"]
        r6m = memory["x10"]["peak_main_gib"] / memory["x1"]["peak_main_gib"]
        figures.update(memory_10x_vs_1x=r6, memory_main_10x_vs_1x=r6m)
        row("peak memory, 10× corpus vs 1×", f"{r6:.2f}×", "≤ 1.2×", r6 <= 1.2,
            f"process tree {memory['x1']['peak_tree_gib']:.2f} → {memory['x10']['peak_tree_gib']:.2f} GiB; "
            f"driver alone {memory['x1']['peak_main_gib']:.2f} → {memory['x10']['peak_main_gib']:.2f} GiB "
            f"({r6m:.2f}×); {memory['x1']['rows']} → {memory['x10']['rows']} rows")

    detail = ["| variant | median s | runs (s) | tokens/s | items/s | padding |", "|---|---|---|---|---|---|"]
    for v in embed + [gen_v, gen_h]:
        padding = "" if v.padding is None else f"{v.padding:.1%}"
        detail.append(f"| {v.name} | {v.median:.2f} | {', '.join(f'{s:.2f}' for s in v.seconds)} | "
                      f"{v.tokens_per_s:,.0f} | {v.items_per_s:,.1f} | {padding} |")
        figures[f"tokens_per_s.{_slug(v.name)}"] = v.tokens_per_s

    text = f"""# tokenmill benchmarks

Written by `make bench` (`{command.strip()}`); do not edit by hand (notes go in bench/FINDINGS.md).

- **Date:** {started_at:%Y-%m-%d %H:%M} UTC
- **Machine:** {machine()}
- **GPU:** {gpu}
- **Corpus:** {docs} documents of the sample corpus ({tokens:,} tokens after truncation at 256), all-MiniLM-L6-v2
  for embeddings, SmolLM2-135M-Instruct for generation; fp32 on CPU
- **Method:** every variant does the same work on the same texts in one process; rounds are interleaved
  (each round runs every variant once) after one warm-up run each; {args.repeats} rounds; medians and ratios.
  Engine start is excluded.

## Against the targets

| comparison | measured | target | met | note |
|---|---|---|---|---|
{chr(10).join(rows)}

## Every variant

{chr(10).join(detail)}

What the profiler found, what was fixed, and what limits each figure that misses its
target: [FINDINGS.md](FINDINGS.md). GPU figures: see the GPU section there.

## Profile of one tokenmill pass (pyinstrument, this process; the vLLM engine core runs in its own)

```
{profile_text.strip()[:6000]}
```
"""
    args.results.write_text(text)
    return figures


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")[:60]


def log_to_mlflow(figures: dict, results: Path) -> None:
    import mlflow

    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}"))
    mlflow.set_experiment("tokenmill-bench")
    with mlflow.start_run(run_name=f"bench {dt.datetime.now():%Y-%m-%d %H:%M}"):
        mlflow.log_metrics({k: float(v) for k, v in figures.items() if v is not None})
        mlflow.log_artifact(str(results))


if __name__ == "__main__":  # vLLM spawns its engine process; keep this guard
    sys.exit(main())
