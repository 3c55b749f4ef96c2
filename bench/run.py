"""Side-by-side benchmarks: every claim of speed, measured against what a team would use
instead, in one process run, interleaved and repeated (medians and ratios).

    make bench                     # or: python -m bench.run --docs 2000 --repeats 3
    python -m bench.run --quick    # smoke run: every comparison on a tiny corpus, one round

Writes bench/RESULTS.md and logs every figure to MLflow (experiment tokenmill-bench);
--quick writes data/bench/RESULTS-quick.md and logs to tokenmill-bench-quick instead.
Engine start is excluded from every timing; each engine is warmed up first.

Each comparison is a function that builds its variants and returns them under their own
names; `main` times all the embedding variants in one interleave (each round runs every
variant once), then the generation pair, then the memory runs, and `write_report` renders
what came back.
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
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field, fields  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bench.harness import Variant, header, interleave, machine, run_process  # noqa: E402
from tokenmill.bucketing import input_order_batches, padding_stats, plan_batches  # noqa: E402
from tokenmill.encoding import encode_rows, input_token_limit  # noqa: E402
from tokenmill.engine_choice import resolve  # noqa: E402
from tokenmill.engine_protocol import Engine, token_budget  # noqa: E402
from tokenmill.engines import close_engines, get_engine  # noqa: E402
from tokenmill.models import resolve_model  # noqa: E402
from tokenmill.runner import run_batches, run_shard  # noqa: E402
from tokenmill.sample_corpus import write_sample_corpus  # noqa: E402
from tokenmill.shards import ShardSpec, discover_shards  # noqa: E402
from tokenmill.spec import JobSpec, ModelSpec  # noqa: E402
from tokenmill.vllm_engine import VLLMEngine  # noqa: E402
from tokenmill.resolution import resolve_job  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
EXPERIMENT = "tokenmill-bench"
EMBED_MODEL = "all-MiniLM-L6-v2"
GENERATE_MODEL = "SmolLM2-135M-Instruct"
GENERATE_MAX_TOKENS = 32
MAX_SHARD_ROWS = 1000
# --quick: the same comparisons on a corpus small enough that the whole run proves the path, not the figures
QUICK = {"docs": 32, "repeats": 1, "single_docs": 8, "buckets_docs": 32, "generate_docs": 4,
         "results": ROOT / "data" / "bench" / "RESULTS-quick.md", "experiment": f"{EXPERIMENT}-quick"}


def variants_of(*comparisons) -> list[Variant]:
    """The variants the comparisons time, in the order they are run and reported."""
    return [variant for comparison in comparisons for variant in comparison.variants]


# --- the corpus every embedding comparison shares ----------------------------------------------------------

@dataclass
class EmbedCorpus:
    """The 1x corpus, tokenized once, and the embedding jobs (vLLM and transformers) run over it."""

    texts: list[str]
    token_ids: list[list[int]]
    lengths: list[int]
    shards: list[ShardSpec]
    spec: JobSpec
    hf_spec: JobSpec
    model_path: str
    input_limit: int

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def batches(self, rows: int) -> list[list[int]]:
        """Our length buckets over the first `rows` documents."""
        batching = self.spec.batching
        return plan_batches(self.lengths[:rows], token_budget(self.spec), batching.max_batch_size,
                            batching.length_tolerance)


def prepare_corpora(docs: int) -> tuple[Path, Path]:
    """x1: `docs` documents taken evenly from the sample corpus; x10: ten times as many."""
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


def load_embed_corpus(x1: Path, scratch: Path) -> EmbedCorpus:
    texts = pq.read_table(x1).column("text").to_pylist()
    spec = JobSpec(input=str(x1), output=str(scratch / "e2e"), mode="embed",
                   model=ModelSpec(name=EMBED_MODEL), batching={"max_shard_rows": MAX_SHARD_ROWS})
    hf_spec = spec.model_copy(update={"model": ModelSpec(name=EMBED_MODEL, engine="transformers")})
    model_path = resolve_model(spec.model_name)
    token_ids = encode_rows(texts, spec, model_path).token_ids
    return EmbedCorpus(texts=texts, token_ids=token_ids, lengths=[len(ids) for ids in token_ids],
                       shards=discover_shards(str(x1), max_shard_rows=MAX_SHARD_ROWS), spec=spec, hf_spec=hf_spec,
                       model_path=model_path, input_limit=input_token_limit(spec, model_path))


# --- ways of doing the work ----------------------------------------------------------------------------------

def tokenmill_variant(name: str, corpus: EmbedCorpus, job: JobSpec, engine: Engine) -> Variant:
    """tokenmill end to end: every shard read, validated, tokenized, bucketed, embedded and written."""
    def go() -> None:
        for shard in corpus.shards:
            run_shard(shard, resolve_job(job), engine=engine)
    return Variant(name, go, corpus.tokens, len(corpus.texts))


def batches_variant(name: str, corpus: EmbedCorpus, rows: int, engine: Engine, job: JobSpec,
                    batches: list[list[int]], show_padding: bool = False) -> Variant:
    """The engine over the first `rows` documents' token ids, in the given batches."""
    ids, lengths = corpus.token_ids[:rows], corpus.lengths[:rows]
    padded = padding_stats(lengths, batches).padded_slots if show_padding else None
    return Variant(name, lambda: run_batches(engine, batches, ids, job, "bench"), sum(lengths), rows, padded)


def one_at_a_time_variant(name: str, corpus: EmbedCorpus, rows: int, engine: Engine) -> Variant:
    ids = corpus.token_ids[:rows]
    return Variant(name, lambda: [engine.embed([row]) for row in ids], sum(corpus.lengths[:rows]), rows)


# --- the comparisons -------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """One comparison's variants, each under its own name."""

    @property
    def variants(self) -> list[Variant]:
        """The variants it times, in the order of its fields (not those borrowed from another comparison)."""
        named = [getattr(self, f.name) for f in fields(self) if not f.metadata.get("borrowed")]
        return [value for value in named if isinstance(value, Variant)]

@dataclass
class EndToEndVsDirect(Comparison):
    """tokenmill end to end against vLLM's `LLM.embed` called directly on the same texts."""

    tokenmill: Variant
    direct: Variant

    @property
    def speedup(self) -> float:
        return self.tokenmill.tokens_per_s / self.direct.tokens_per_s


def compare_end_to_end_vs_raw_vllm(corpus: EmbedCorpus, vllm: VLLMEngine) -> EndToEndVsDirect:
    truncation = {"truncation": True, "max_length": corpus.input_limit}
    direct = Variant("vLLM LLM.embed(texts) directly",
                     lambda: vllm.llm.embed(corpus.texts, use_tqdm=False, tokenization_kwargs=truncation),
                     corpus.tokens, len(corpus.texts))
    return EndToEndVsDirect(tokenmill=tokenmill_variant("tokenmill end to end (vLLM)", corpus, corpus.spec, vllm),
                            direct=direct)


@dataclass
class OfflineVsOneAtATime(Comparison):
    """Offline batches against one request at a time, on each engine, same rows."""

    vllm_batches: Variant
    vllm_single: Variant
    transformers_batches: Variant
    transformers_single: Variant

    @property
    def vllm_speedup(self) -> float:
        return self.vllm_batches.items_per_s / self.vllm_single.items_per_s

    @property
    def transformers_speedup(self) -> float:
        return self.transformers_batches.items_per_s / self.transformers_single.items_per_s


def compare_offline_vs_one_at_a_time(corpus: EmbedCorpus, vllm: Engine, hf: Engine, docs: int) -> OfflineVsOneAtATime:
    rows = min(docs, len(corpus.token_ids))
    batches = corpus.batches(rows)
    return OfflineVsOneAtATime(
        vllm_batches=batches_variant("vLLM, our batches", corpus, rows, vllm, corpus.spec, batches),
        vllm_single=one_at_a_time_variant("vLLM, one request at a time", corpus, rows, vllm),
        transformers_batches=batches_variant("transformers, our batches", corpus, rows, hf, corpus.hf_spec, batches),
        transformers_single=one_at_a_time_variant("transformers, one request at a time", corpus, rows, hf))


@dataclass
class BucketsVsInputOrder(Comparison):
    """The transformers engine with and without length buckets, same token budget."""

    bucketed: Variant
    input_order: Variant

    @property
    def speedup(self) -> float:
        return self.bucketed.tokens_per_s / self.input_order.tokens_per_s


def compare_buckets_vs_input_order(corpus: EmbedCorpus, hf: Engine, docs: int) -> BucketsVsInputOrder:
    rows = min(docs, len(corpus.token_ids))
    batching = corpus.spec.batching
    input_order = input_order_batches(corpus.lengths[:rows], token_budget(corpus.spec), batching.max_batch_size)
    return BucketsVsInputOrder(
        bucketed=batches_variant("transformers, length buckets", corpus, rows, hf, corpus.hf_spec,
                                 corpus.batches(rows), show_padding=True),
        input_order=batches_variant("transformers, input order", corpus, rows, hf, corpus.hf_spec, input_order,
                                    show_padding=True))


@dataclass
class VsSentenceTransformers(Comparison):
    """tokenmill end to end on each engine against sentence-transformers' own encode (which sorts by length)."""

    encode: Variant
    tokenmill_transformers: Variant
    tokenmill_vllm: Variant = field(metadata={"borrowed": True})  # EndToEndVsDirect.tokenmill times it

    @property
    def best(self) -> Variant:
        return max((self.tokenmill_vllm, self.tokenmill_transformers), key=lambda v: v.tokens_per_s)

    @property
    def speedup(self) -> float:
        return self.best.tokens_per_s / self.encode.tokens_per_s

    @property
    def transformers_speedup(self) -> float:
        return self.tokenmill_transformers.tokens_per_s / self.encode.tokens_per_s


def compare_vs_sentence_transformers(corpus: EmbedCorpus, hf: Engine,
                                     tokenmill_vllm: Variant) -> VsSentenceTransformers:
    from sentence_transformers import SentenceTransformer  # a dev dependency, and torch with it

    model = SentenceTransformer(corpus.model_path, device="cpu")
    encode = Variant("sentence-transformers encode (batch 32)",
                     lambda: model.encode(corpus.texts, batch_size=32, convert_to_numpy=True),
                     corpus.tokens, len(corpus.texts))
    return VsSentenceTransformers(
        encode=encode, tokenmill_vllm=tokenmill_vllm,
        tokenmill_transformers=tokenmill_variant("tokenmill end to end (transformers)", corpus, corpus.hf_spec, hf))


@dataclass
class VllmVsTransformersEmbed(Comparison):
    """The two engines side by side on the same bucketed batches."""

    vllm: Variant
    transformers: Variant

    @property
    def speedup(self) -> float:
        return self.vllm.tokens_per_s / self.transformers.tokens_per_s


def compare_vllm_vs_transformers_embed(corpus: EmbedCorpus, vllm: Engine, hf: Engine) -> VllmVsTransformersEmbed:
    rows = len(corpus.token_ids)
    batches = corpus.batches(rows)
    return VllmVsTransformersEmbed(
        vllm=batches_variant("vLLM engine, our batches", corpus, rows, vllm, corpus.spec, batches, show_padding=True),
        transformers=batches_variant("transformers engine, our batches", corpus, rows, hf, corpus.hf_spec, batches,
                                     show_padding=True))


@dataclass
class VllmVsTransformersGenerate(Comparison):
    """The two engines generating from the same prompts in the same batches."""

    vllm: Variant
    transformers: Variant
    max_tokens: int
    output_tokens: dict[str, int] = field(default_factory=dict)  # by engine, from its latest run

    @property
    def prompts(self) -> int:
        return self.vllm.items

    @property
    def speedup(self) -> float:
        return self.transformers.median / self.vllm.median


def compare_vllm_vs_transformers_generate(prompts: list[str]) -> VllmVsTransformersGenerate:
    """Starts both generation engines: call it once the embedding engines are closed."""
    spec = JobSpec(mode="generate", model=ModelSpec(name=GENERATE_MODEL),
                   generation={"max_tokens": GENERATE_MAX_TOKENS})
    hf_spec = spec.model_copy(update={"model": ModelSpec(name=GENERATE_MODEL, engine="transformers")})
    model_path = resolve_model(spec.model_name)
    token_ids = encode_rows(prompts, spec, model_path).token_ids
    lengths = [len(ids) for ids in token_ids]
    batching = spec.batching
    batches = plan_batches(lengths, token_budget(spec), batching.max_batch_size, batching.length_tolerance)
    output_tokens: dict[str, int] = {}

    def generate_with(job: JobSpec, engine_name: str) -> Callable[[], None]:
        engine = get_engine(model_path, resolve(job))

        def go() -> None:
            results, _ = run_batches(engine, batches, token_ids, job, "bench")
            output_tokens[engine_name] = sum(g.output_tokens for batch in results for g in batch)
        return go

    return VllmVsTransformersGenerate(
        vllm=Variant("vLLM generate", generate_with(spec, "vllm"), sum(lengths), len(prompts)),
        transformers=Variant("transformers generate", generate_with(hf_spec, "transformers"), sum(lengths),
                             len(prompts)),
        max_tokens=spec.generation.max_tokens, output_tokens=output_tokens)


# Structured outputs and prefix order: what a generation job asks for, and what it costs
LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["software", "science", "web", "data", "other"]},
                   "confidence": {"type": "number"}},
    "required": ["label", "confidence"],
    "additionalProperties": False,
}
STRUCTURED_MAX_TOKENS = 32
PREFIXES = 4  # distinct few-shot prefixes in the prefix-order case
PREFIX_MAX_TOKENS = 4  # short answers: the prompt (prefill), where the prefix cache saves, is the work
SHOT_CHARS = 600  # each few-shot example's description, cut: a prefix of ~500 tokens per task
ROW_CHARS = 300  # each row's own description, cut: most of a prompt is its task's shared prefix


def label_messages(topic: str, shots: list[str]) -> list[dict[str, str]]:
    """A system prompt and few-shot turns for one labelling task: the prefix rows of that task share."""
    messages = [{"role": "system", "content": f"You label package descriptions by {topic}. Answer in JSON."}]
    for i, shot in enumerate(shots):
        messages += [{"role": "user", "content": f"Description: {shot[:SHOT_CHARS]}"},
                     {"role": "assistant", "content": json.dumps({"label": "other", "confidence": 0.5 + i / 10})}]
    return messages + [{"role": "user", "content": "Description: {text}"}]


def generation_job(messages: list[dict[str, str]], max_tokens: int, **generation) -> JobSpec:
    """The bench's generation job (the engine of compare_vllm_vs_transformers_generate, shared)."""
    return JobSpec(mode="generate", model=ModelSpec(name=GENERATE_MODEL),
                   generation={"max_tokens": max_tokens, "messages": messages, **generation})


@dataclass
class StructuredVsFree(Comparison):
    """vLLM generating from the same prompts with a JSON schema (xgrammar) and without: the grammar's cost."""

    structured: Variant
    free: Variant
    valid: dict[str, int] = field(default_factory=dict)  # outputs that validate, by variant, from its latest run
    output_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def cost(self) -> float:
        """Seconds with the grammar over seconds without."""
        return self.structured.median / self.free.median


def compare_structured_vs_free(texts: list[str]) -> StructuredVsFree:
    """Starts the vLLM generation engine (shared with compare_vllm_vs_transformers_generate)."""
    from tokenmill.generation import OutputChecker

    messages = label_messages("topic", texts[-2:])
    structured = generation_job(messages, STRUCTURED_MAX_TOKENS, response_format={"json_schema": LABEL_SCHEMA})
    free = generation_job(messages, STRUCTURED_MAX_TOKENS)
    model_path = resolve_model(free.model_name)
    token_ids = encode_rows([text[:ROW_CHARS] for text in texts], free, model_path).token_ids
    engine = get_engine(model_path, resolve(free))
    checker = OutputChecker(structured.generation.response_format)
    valid: dict[str, int] = {}
    output_tokens: dict[str, int] = {}

    def generate(job: JobSpec, name: str) -> Callable[[], None]:
        def go() -> None:
            (results,), _ = run_batches(engine, [list(range(len(token_ids)))], token_ids, job, "bench")
            valid[name] = sum(checker.check(g.text, g.finish_reason).error is None for g in results)
            output_tokens[name] = sum(g.output_tokens for g in results)
        return go

    tokens = sum(len(ids) for ids in token_ids)
    return StructuredVsFree(
        structured=Variant("vLLM generate, JSON schema (structured outputs)", generate(structured, "structured"),
                           tokens, len(texts)),
        free=Variant("vLLM generate, unconstrained", generate(free, "free"), tokens, len(texts)),
        valid=valid, output_tokens=output_tokens)


@dataclass
class PrefixOrder(Comparison):
    """Rows of several few-shot tasks, interleaved in the input: submitted in input order, or with rows that
    share a prompt prefix adjacent (tokenmill.prompts.prefix_order). vLLM's prefix cache is on and emptied
    before every run."""

    prefix_order: Variant
    input_order: Variant
    hit_rate: dict[str, float] = field(default_factory=dict)  # cached share of prompt tokens, by variant

    @property
    def speedup(self) -> float:
        return self.input_order.median / self.prefix_order.median


def compare_prefix_order(texts: list[str]) -> PrefixOrder:
    """Starts the vLLM generation engine (shared with compare_vllm_vs_transformers_generate)."""
    from tokenmill.prompts import prefix_order

    topics = ["topic", "audience", "maturity", "licence", "language", "size"][:PREFIXES]
    shots = [texts[i::PREFIXES][:3] for i in range(PREFIXES)]
    jobs = [generation_job(label_messages(topic, shot), PREFIX_MAX_TOKENS) for topic, shot in zip(topics, shots)]
    model_path = resolve_model(jobs[0].model_name)
    # row i belongs to task i % PREFIXES: in input order, no two neighbours share a prefix
    token_ids = [encode_rows([text[:ROW_CHARS]], jobs[i % PREFIXES], model_path).token_ids[0]
                 for i, text in enumerate(texts)]
    engine = get_engine(model_path, resolve(jobs[0]))
    hit_rate: dict[str, float] = {}

    def generate(order: list[int], name: str) -> Callable[[], None]:
        def go() -> None:
            engine.llm.reset_prefix_cache()  # every run starts cold
            (results,), _ = run_batches(engine, [order], token_ids, jobs[0], "bench")
            hit_rate[name] = sum(g.cached_prompt_tokens for g in results) / sum(len(token_ids[i]) for i in order)
        return go

    tokens = sum(len(ids) for ids in token_ids)
    return PrefixOrder(
        prefix_order=Variant(f"vLLM generate, {PREFIXES} few-shot prefixes, prefix order",
                             generate(prefix_order(token_ids), "prefix"), tokens, len(texts)),
        input_order=Variant(f"vLLM generate, {PREFIXES} few-shot prefixes, input order (interleaved)",
                            generate(list(range(len(texts))), "input"), tokens, len(texts)),
        hit_rate=hit_rate)


@dataclass
class PeakMemoryOfRun:
    rows: int
    peak_tree_gib: float  # the CLI, Prefect's server and the vLLM engine together
    peak_main_gib: float  # the CLI's process alone
    wall_s: float


@dataclass
class MemoryScaling:
    """Peak memory of `tokenmill run` on the 10x corpus against the 1x one."""

    x1: PeakMemoryOfRun
    x10: PeakMemoryOfRun

    @property
    def tree_ratio(self) -> float:
        return self.x10.peak_tree_gib / self.x1.peak_tree_gib

    @property
    def main_ratio(self) -> float:
        return self.x10.peak_main_gib / self.x1.peak_main_gib


def peak_memory_of_run(corpus: Path, scratch: Path, max_shard_rows: int) -> PeakMemoryOfRun:
    """Peak RSS of a `tokenmill run` process tree (CLI, Prefect server, vLLM engine), sampled every 0.2 s."""
    output = scratch / f"out-{corpus.name}"
    args = [sys.executable, "-m", "tokenmill.cli", "run", "--input", str(corpus), "--output", str(output),
            "--max-shard-rows", str(max_shard_rows), "--no-progress",
            "--tracking-uri", f"sqlite:///{scratch}/mlflow-memory.db"]
    env = dict(os.environ, PREFECT_HOME=str(scratch / f"prefect-{corpus.name}"))
    run = run_process(args, env=env, interval=0.2).check(f"tokenmill run on {corpus}")
    manifest = json.loads((output / "_manifest.json").read_text())
    return PeakMemoryOfRun(rows=manifest["totals"]["rows_in"], peak_tree_gib=run.peak_gib,
                           peak_main_gib=run.peak_root_gib, wall_s=run.wall_s)


def compare_memory_scaling(x1: Path, x10: Path, scratch: Path) -> MemoryScaling:
    return MemoryScaling(x1=peak_memory_of_run(x1, scratch, MAX_SHARD_ROWS),
                         x10=peak_memory_of_run(x10, scratch, MAX_SHARD_ROWS))


@dataclass
class IndexBuildRun:
    rows: int
    kind: str
    recall_at_10: float
    build_s: float
    embed_s: float | None  # the shards' own seconds, from their records
    index_bytes: int
    queries_per_s: float
    peak_gib: float  # the building process (tokenmill.index alone, no Prefect), sampled every 0.05 s


@dataclass
class IndexCost:
    """The index stage over embed outputs: the default choice at 1x, HNSW forced at 1x, the default at 10x."""

    default: IndexBuildRun
    hnsw: IndexBuildRun
    x10: IndexBuildRun

    @property
    def build_share(self) -> float | None:
        return self.default.build_s / self.default.embed_s if self.default.embed_s else None

    @property
    def memory_ratio(self) -> float:
        return self.x10.peak_gib / self.default.peak_gib


def index_build_run(output: Path, kind: str) -> IndexBuildRun:
    """`build_index` on an existing embed output in a process of its own, its peak RSS sampled."""
    code = ("import sys; from tokenmill.index import build_index; from tokenmill.spec import JobSpec; "
            "print(build_index(JobSpec(output=sys.argv[1], index={'kind': sys.argv[2]})).model_dump_json())")
    run = run_process([sys.executable, "-c", code, str(output), kind], interval=0.05)
    report = json.loads(run.check(f"building the index of {output}").stdout.strip().splitlines()[-1])
    return IndexBuildRun(rows=report["rows"], kind=report["kind"], recall_at_10=report["recall_at_10"],
                         build_s=report["build_seconds"], embed_s=report["embed_seconds"],
                         index_bytes=report["index_bytes"], queries_per_s=report["queries_per_s"],
                         peak_gib=run.peak_gib)


def compare_index(x1_output: Path, x10_output: Path) -> IndexCost:
    """The outputs of the memory runs (1x and 10x), indexed: recall@10 against exact search on held-out
    queries, build seconds against the shards' embedding seconds, peak memory 10x vs 1x."""
    return IndexCost(default=index_build_run(x1_output, "auto"), hnsw=index_build_run(x1_output, "hnsw"),
                     x10=index_build_run(x10_output, "auto"))


# --- the run, and what it reports --------------------------------------------------------------------------------

@dataclass
class BenchResults:
    """Everything RESULTS.md and the MLflow run say."""

    command: str
    machine: dict  # bench.harness.machine(): date, commit, CPU and its flags, cores, RAM, GPU
    docs: int
    tokens: int
    repeats: int
    end_to_end: EndToEndVsDirect
    offline: OfflineVsOneAtATime
    buckets: BucketsVsInputOrder
    sentence_transformers: VsSentenceTransformers
    engines_embed: VllmVsTransformersEmbed
    engines_generate: VllmVsTransformersGenerate
    memory: MemoryScaling | None
    profile_text: str
    structured: StructuredVsFree | None = None
    prefix: PrefixOrder | None = None
    index: IndexCost | None = None

    @property
    def variants(self) -> list[Variant]:
        return variants_of(self.end_to_end, self.offline, self.buckets, self.sentence_transformers,
                           self.engines_embed, self.engines_generate,
                           *[c for c in (self.structured, self.prefix) if c is not None])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000, help="documents in the 1x corpus")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-docs", type=int, default=256, help="documents for the batch-of-1 comparison")
    parser.add_argument("--buckets-docs", type=int, default=1000, help="documents for buckets on/off")
    parser.add_argument("--generate-docs", type=int, default=32)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--generation-features-only", action="store_true",
                        help="run only the structured-output and prefix-order comparisons and print their rows")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--experiment", default=EXPERIMENT, help="MLflow experiment")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run of every comparison; defaults become "
                             + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)  # options given on the command line still win
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    x1, x10 = prepare_corpora(args.docs)
    if args.generation_features_only:
        texts = pq.read_table(x1, columns=["text"]).column("text").to_pylist()
        structured, prefix = generation_features(texts, args.generate_docs, args.repeats)
        print("\n".join(generation_feature_rows(structured, prefix)))
        print("\n".join(variant_row(v) for v in variants_of(structured, prefix)))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    corpus = load_embed_corpus(x1, scratch)
    print(f"corpus: {len(corpus.texts)} docs, {corpus.tokens} tokens "
          f"(median {statistics.median(corpus.lengths)}, max {max(corpus.lengths)})")

    # One engine of each kind serves every embedding comparison.
    vllm = get_engine(corpus.model_path, resolve(corpus.spec))  # the spec's engine is auto: as a job would choose
    hf = get_engine(corpus.model_path, corpus.hf_spec)
    end_to_end = compare_end_to_end_vs_raw_vllm(corpus, vllm)
    offline = compare_offline_vs_one_at_a_time(corpus, vllm, hf, args.single_docs)
    buckets = compare_buckets_vs_input_order(corpus, hf, args.buckets_docs)
    vs_sentence_transformers = compare_vs_sentence_transformers(corpus, hf, end_to_end.tokenmill)
    engines_embed = compare_vllm_vs_transformers_embed(corpus, vllm, hf)
    embed_variants = variants_of(end_to_end, offline, buckets, vs_sentence_transformers, engines_embed)
    print("embedding comparisons, interleaved ...")
    interleave(embed_variants, args.repeats)
    profile_text = profile(end_to_end.tokenmill.run)

    # Free the embedding engines' memory (and sentence-transformers' model, which only the
    # variants' closures hold) before the generation engines start.
    for variant in embed_variants:
        variant.run = None
    del vllm, hf
    close_engines()

    engines_generate = compare_vllm_vs_transformers_generate(corpus.texts[: args.generate_docs])
    print("generation comparison, interleaved ...")
    interleave(engines_generate.variants, args.repeats)
    structured, prefix = generation_features(corpus.texts, args.generate_docs, args.repeats)
    close_engines()

    memory = index = None
    if not args.skip_memory:
        print("peak memory at 1x and 10x ...")
        memory = compare_memory_scaling(x1, x10, scratch)
        print("the index stage over those outputs ...")
        index = compare_index(scratch / f"out-{x1.name}", scratch / f"out-{x10.name}")

    results = BenchResults(
        command=command, machine=machine(), docs=len(corpus.texts),
        tokens=corpus.tokens, repeats=args.repeats, end_to_end=end_to_end, offline=offline, buckets=buckets,
        sentence_transformers=vs_sentence_transformers, engines_embed=engines_embed,
        engines_generate=engines_generate, memory=memory, profile_text=profile_text, structured=structured,
        prefix=prefix, index=index)
    write_report(results, args.results)
    log_to_mlflow(figures(results), args.results, args.experiment)
    shutil.rmtree(scratch, ignore_errors=True)
    print(args.results.read_text())
    return 0


def generation_features(texts: list[str], docs: int, repeats: int) -> tuple[StructuredVsFree, PrefixOrder]:
    """The structured-output and prefix-order comparisons, each interleaved on the vLLM generation engine."""
    structured = compare_structured_vs_free(texts[:docs])
    print("structured outputs vs unconstrained, interleaved ...")
    interleave(structured.variants, repeats)
    prefix = compare_prefix_order(texts[PREFIXES * 3: PREFIXES * 3 + 2 * docs])
    print("prefix order vs input order, interleaved ...")
    interleave(prefix.variants, repeats)
    return structured, prefix


def generation_feature_rows(structured: StructuredVsFree | None, prefix: PrefixOrder | None) -> list[str]:
    """Rows of the "Against the targets" table for the generation features."""
    rows = []
    if structured is not None:
        rows.append(_target_row(
            "JSON schema (structured outputs) vs unconstrained, vLLM generate", f"{structured.cost:.2f}× time",
            "report", None,
            f"{structured.structured.items} prompts, max_tokens {STRUCTURED_MAX_TOKENS}: "
            f"{structured.structured.median:.2f} s vs {structured.free.median:.2f} s; outputs valid "
            f"{structured.valid.get('structured')} vs {structured.valid.get('free')}; output tokens "
            f"{structured.output_tokens.get('structured')} vs {structured.output_tokens.get('free')}"))
    if prefix is not None:
        rows.append(_target_row(
            f"prefix order vs input order, {PREFIXES} few-shot prefixes, vLLM prefix cache on",
            f"{prefix.speedup:.2f}×", "report", None,
            f"{prefix.prefix_order.items} rows, max_tokens {PREFIX_MAX_TOKENS}: {prefix.prefix_order.median:.2f} s vs "
            f"{prefix.input_order.median:.2f} s; prefix-cache hit rate {prefix.hit_rate.get('prefix', 0):.1%} vs "
            f"{prefix.hit_rate.get('input', 0):.1%}"))
    return rows


def profile(run: Callable[[], object]) -> str:
    """Where a tokenmill pass spends its time, outside the engine's own process."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.005)
    profiler.start()
    run()
    profiler.stop()
    return profiler.output_text(unicode=False, color=False, show_all=False, short_mode=True)


def _target_row(comparison: str, measured: str, target: str, met: bool | None, note: str = "") -> str:
    return f"| {comparison} | {measured} | {target} | {'yes' if met else 'no' if met is not None else '—'} | {note} |"


def target_rows(results: BenchResults) -> list[str]:
    """The "Against the targets" table's rows."""
    e2e, offline, buckets = results.end_to_end, results.offline, results.buckets
    st, embed, generate = results.sentence_transformers, results.engines_embed, results.engines_generate
    rows = [
        _target_row("tokenmill end to end vs the same engine called directly", f"{e2e.speedup:.2f}×", "≥ 0.90",
                    e2e.speedup >= 0.90,
                    f"{e2e.tokenmill.tokens_per_s:,.0f} vs {e2e.direct.tokens_per_s:,.0f} tokens/s; ours reads "
                    "Parquet, validates, tokenizes, buckets and writes Parquet"),
        _target_row("offline batches vs one request at a time (vLLM)", f"{offline.vllm_speedup:.1f}× items/s",
                    "≥ 20×", offline.vllm_speedup >= 20,
                    f"{offline.vllm_batches.items_per_s:,.1f} vs {offline.vllm_single.items_per_s:,.1f} items/s "
                    f"on {offline.vllm_batches.items} docs"),
        _target_row("offline batches vs one request at a time (transformers)",
                    f"{offline.transformers_speedup:.1f}× items/s", "≥ 20×", offline.transformers_speedup >= 20,
                    f"{offline.transformers_batches.items_per_s:,.1f} vs "
                    f"{offline.transformers_single.items_per_s:,.1f} items/s "
                    f"on {offline.transformers_batches.items} docs"),
        _target_row("transformers engine, buckets on vs off (same token budget)",
                    f"{buckets.speedup:.2f}× tokens/s; padding {buckets.bucketed.padding:.1%} vs "
                    f"{buckets.input_order.padding:.1%}", "≥ 2×; padding ≤ 5%",
                    buckets.speedup >= 2 and buckets.bucketed.padding <= 0.05, f"{buckets.bucketed.items} docs"),
        _target_row("our best engine vs sentence-transformers encode", f"{st.speedup:.2f}×", "≥ 1.0×",
                    st.speedup >= 1.0,
                    f"{st.best.name}: {st.best.tokens_per_s:,.0f} vs {st.encode.tokens_per_s:,.0f} tokens/s; "
                    f"tokenmill on transformers: {st.transformers_speedup:.2f}×"),
        _target_row("vLLM vs transformers engine, embed", f"{embed.speedup:.2f}×", "report", None,
                    f"{embed.vllm.tokens_per_s:,.0f} vs {embed.transformers.tokens_per_s:,.0f} tokens/s, same batches"),
        _target_row("vLLM vs transformers engine, generate", f"{generate.speedup:.2f}×", "report", None,
                    f"{generate.prompts} prompts, max_tokens {generate.max_tokens}: {generate.vllm.median:.2f} s vs "
                    f"{generate.transformers.median:.2f} s; output tokens {generate.output_tokens.get('vllm')} vs "
                    f"{generate.output_tokens.get('transformers')}"),
    ]
    rows += generation_feature_rows(results.structured, results.prefix)
    memory = results.memory
    if memory is not None:
        rows.append(_target_row(
            "peak memory, 10× corpus vs 1×", f"{memory.tree_ratio:.2f}×", "≤ 1.2×", memory.tree_ratio <= 1.2,
            f"process tree {memory.x1.peak_tree_gib:.2f} → {memory.x10.peak_tree_gib:.2f} GiB; "
            f"driver alone {memory.x1.peak_main_gib:.2f} → {memory.x10.peak_main_gib:.2f} GiB "
            f"({memory.main_ratio:.2f}×); {memory.x1.rows} → {memory.x10.rows} rows"))
    rows += index_rows(results.index)
    return rows


def index_rows(index: IndexCost | None) -> list[str]:
    if index is None:
        return []
    share = ("" if index.build_share is None
             else f", {index.build_share:.1%} of the {index.default.embed_s:,.1f} s of embedding")
    return [
        _target_row(f"index, default choice ({index.default.kind}): recall@10 vs exact search",
                    f"{index.default.recall_at_10:.3f}", "≥ 0.95", index.default.recall_at_10 >= 0.95,
                    f"{index.default.rows} vectors; built in {index.default.build_s:.2f} s{share}; "
                    f"{index.default.index_bytes / 2**20:.1f} MiB; {index.default.queries_per_s:,.0f} queries/s"),
        _target_row("index, HNSW forced: recall@10 vs exact search", f"{index.hnsw.recall_at_10:.3f}", "report", None,
                    f"built in {index.hnsw.build_s:.2f} s; {index.hnsw.index_bytes / 2**20:.1f} MiB; "
                    f"{index.hnsw.queries_per_s:,.0f} queries/s"),
        _target_row("index build peak memory, 10× corpus vs 1×", f"{index.memory_ratio:.2f}×", "≤ 1.3×",
                    index.memory_ratio <= 1.3,
                    f"{index.default.peak_gib:.2f} → {index.x10.peak_gib:.2f} GiB (the building process); "
                    f"{index.default.rows} → {index.x10.rows} vectors, {index.x10.kind}"),
    ]


def variant_row(variant: Variant) -> str:
    """A row of the "Every variant" table."""
    padding = "" if variant.padding is None else f"{variant.padding:.1%}"
    runs = ", ".join(f"{s:.2f}" for s in variant.seconds)
    return (f"| {variant.name} | {variant.median:.2f} | {runs} | {variant.tokens_per_s:,.0f} | "
            f"{variant.items_per_s:,.1f} | {padding} |")


def render_report(results: BenchResults) -> str:
    detail = ["| variant | median s | runs (s) | tokens/s | items/s | padding |", "|---|---|---|---|---|---|"]
    detail += [variant_row(variant) for variant in results.variants]
    opening = "\n".join(header("tokenmill benchmarks", results.command.strip(), results.machine))
    return f"""{opening}
- **Corpus:** {results.docs} documents of the sample corpus ({results.tokens:,} tokens after truncation at 256), all-MiniLM-L6-v2
  for embeddings, SmolLM2-135M-Instruct for generation; fp32 on CPU
- **Method:** every variant does the same work on the same texts in one process; rounds are interleaved
  (each round runs every variant once, the order reversed every other round) after one warm-up run each;
  {results.repeats} rounds; medians and ratios.
  Engine start is excluded: these are engine-path figures on the sample corpus. Whole processes as users run
  them (start-up included, corpora nobody tuned for, against a sentence-transformers script and one LLM.chat
  call): [WHOLE_RUN.md](WHOLE_RUN.md).

## Against the targets

| comparison | measured | target | met | note |
|---|---|---|---|---|
{chr(10).join(target_rows(results))}

## Every variant

{chr(10).join(detail)}

What the profiler found, what was fixed, and what limits each figure that misses its
target: [FINDINGS.md](FINDINGS.md). GPU figures: see the GPU section there.

## Profile of one tokenmill pass (pyinstrument, this process; the vLLM engine core runs in its own)

```
{results.profile_text.strip()[:6000]}
```
"""


def write_report(results: BenchResults, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(results))


def figures(results: BenchResults) -> dict[str, float | None]:
    """Every figure of the report, by its MLflow metric name."""
    buckets = results.buckets
    named = {
        "e2e_vs_direct": results.end_to_end.speedup,
        "offline_vs_single": results.offline.vllm_speedup,
        "offline_vs_single_transformers": results.offline.transformers_speedup,
        "buckets_speedup": buckets.speedup,
        "padding_bucketed": buckets.bucketed.padding,
        "padding_input_order": buckets.input_order.padding,
        "best_vs_sentence_transformers": results.sentence_transformers.speedup,
        "vllm_vs_transformers_embed": results.engines_embed.speedup,
        "vllm_vs_transformers_generate": results.engines_generate.speedup,
    }
    if results.structured is not None:
        named["structured_vs_free_time"] = results.structured.cost
    if results.prefix is not None:
        named.update(prefix_order_speedup=results.prefix.speedup,
                     prefix_cache_hit_rate_prefix_order=results.prefix.hit_rate.get("prefix"),
                     prefix_cache_hit_rate_input_order=results.prefix.hit_rate.get("input"))
    if results.memory is not None:
        named.update(memory_10x_vs_1x=results.memory.tree_ratio, memory_main_10x_vs_1x=results.memory.main_ratio)
    if results.index is not None:
        named.update(index_recall_at_10=results.index.default.recall_at_10,
                     index_hnsw_recall_at_10=results.index.hnsw.recall_at_10,
                     index_build_share_of_embed=results.index.build_share,
                     index_memory_10x_vs_1x=results.index.memory_ratio)
    named.update({f"tokens_per_s.{_slug(v.name)}": v.tokens_per_s for v in results.variants})
    return named


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")[:60]


def log_to_mlflow(figures: dict[str, float | None], results: Path, experiment: str = EXPERIMENT) -> None:
    import mlflow

    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}"))
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=f"bench {dt.datetime.now():%Y-%m-%d %H:%M}"):
        mlflow.log_metrics({k: float(v) for k, v in figures.items() if v is not None})
        mlflow.log_artifact(str(results))


if __name__ == "__main__":  # vLLM spawns its engine process; keep this guard
    sys.exit(main())
