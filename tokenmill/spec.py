"""The job, as one declarative object.

`JobSpec` is what a user writes in YAML, what the CLI builds from flags, and what
an orchestrator's UI renders as the batch job's form. Every field has a default, so
`JobSpec()` is the demo job: embed the sample corpus with all-MiniLM-L6-v2. The form
(the JSON schema) asks for input and output instead: a worker has no sample corpus.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.server_spec import ServerSpec, check_stop_by

DEFAULT_EMBED_MODEL = "all-MiniLM-L6-v2"
DEFAULT_GENERATE_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_INPUT = "data/sample-corpus"
DEFAULT_OUTPUT = "output/sample-corpus"
DEFAULT_PROMPT = "Summarize the following text in one sentence.\n\n{text}"

# dtypes both engines take, and the other names vLLM or torch users write for them
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
# What the form offers: vLLM's common quantization methods. Any other name the installed vLLM
# knows is accepted too (the list changes with every vLLM release; see _vllm_quantizations).
# The ONNX Runtime engine's own methods (tokenmill.onnx_models.RECIPES says how each is made).
ONNX_QUANTIZATIONS = ("int8", "int8-partial", "int4")
# The OpenVINO engine's (tokenmill.openvino_models.RECIPES): int8 calibrated on the job's own rows.
OPENVINO_QUANTIZATIONS = ("int8",)
QUANTIZATIONS = ONNX_QUANTIZATIONS + ("fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors",
                                      "bitsandbytes", "gguf", "modelopt", "modelopt_fp4", "mxfp4", "experts_int8",
                                      "torchao")


class _Spec(BaseModel):
    # Unknown keys in a job file are typos; fail loudly rather than ignore them.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def _vllm_quantizations() -> set[str]:
    """The quantization methods of the installed vLLM. Read from its source, since importing vLLM
    takes seconds (torch); live where vLLM is already imported, so methods registered at run time count."""
    module = sys.modules.get("vllm.model_executor.layers.quantization")
    if module is not None:
        return set(module.QUANTIZATION_METHODS)
    found = importlib.util.find_spec("vllm")  # a top-level name: found without being imported
    if found is None or not found.submodule_search_locations:
        return set()
    source = Path(list(found.submodule_search_locations)[0], "model_executor", "layers", "quantization", "__init__.py")
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "QuantizationMethods" and node.value is not None:
            return {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return set()


def _quantization_form(schema: dict[str, Any]) -> None:
    # Three choices in the form: a known method from a list, any other name vLLM knows, or none.
    # A plain enum would make a form that validates against the schema refuse the methods it leaves out.
    schema["anyOf"] = [
        {"type": "string", "enum": list(QUANTIZATIONS), "title": "Common method"},
        {"type": "string", "title": "Other vLLM method"},
        {"type": "null", "title": "None"},
    ]


def _model_name_form(schema: dict[str, Any]) -> None:
    # Two choices in the form: any path or Hugging Face name (empty: the mode's default), or a built-in model.
    schema.pop("type", None)
    schema["anyOf"] = [
        {"type": "string", "title": "Path or Hugging Face name"},
        {"type": "string", "enum": [DEFAULT_EMBED_MODEL, DEFAULT_GENERATE_MODEL], "title": "Built-in model"},
    ]


class ModelSpec(_Spec):
    """Which model to run, on which engine, and how to load it."""

    model_config = ConfigDict(title="Model")

    name: str = Field(
        "",
        description="A local path, a Hugging Face name, or a built-in alias "
        f"({DEFAULT_EMBED_MODEL}, {DEFAULT_GENERATE_MODEL}). Empty: the default for the mode.",
        json_schema_extra=_model_name_form,
    )
    engine: Literal["auto", "vllm", "transformers", "onnxruntime", "openvino", "openai-server"] = Field(
        "auto",
        description="auto: a short timed trial on the job's sample picks the engine that finishes the job "
        "soonest here (cached per model, mode and device; the reason is in the run record); it never changes "
        "the precision (a quantized candidate goes through the eval gate). vllm: continuous "
        "batching, the fast path for generation and large models. transformers: plain PyTorch with length "
        "buckets, often faster for small encoders. onnxruntime: embedding models exported to ONNX once, "
        "float32 or quantized (int8, int8-partial, int4): the cheap tier on CPU. openvino: the same export run "
        "by OpenVINO, float32 or int8 (static, calibrated by NNCF on a sample of the job's own rows). "
        "openai-server: requests to an OpenAI-compatible server someone runs (`vllm serve`, SGLang), "
        "described under `server`; never chosen by auto.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Weights and activations dtype. 'auto' is float32 on CPU (bf16 is far "
        "slower there) and the model's own dtype on GPU. half, fp16, bf16, float, fp32 are read as their full names.",
    )
    quantization: str | None = Field(
        None,
        description="onnxruntime engine: int8 (dynamic int8, weights per channel), int8-partial (the same, FFN "
        "output projections kept in float32), int4 (4-bit weight blocks); openvino engine: int8 (static int8, "
        "calibrated on the job's rows); the quantized model is made once per machine and cached. vLLM: 'fp8' quantizes a 16-bit model's weights when it loads (GPU); awq, gptq, "
        "compressed-tensors, ... read a checkpoint quantized that way. Empty: the weights as stored.",
        json_schema_extra=_quantization_form,
    )
    max_input_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest input in tokens. Default: the model's own limit "
        "(sentence-transformers max_seq_length, else its context length).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed verbatim to vllm.LLM(...) (e.g. {gpu_memory_utilization: 0.9}), or to "
        "from_pretrained(...) for the transformers engine.",
    )
    cpu_streams: int = Field(
        0,
        ge=0,
        title="CPU Streams",
        description="transformers engine embedding on CPU: batches run at once, each on its share of the "
        "cores (torch threads = cores / streams), at most one per core. 0: auto, 2 where there are 2 or more "
        "cores (on 2 cores, +16-19% documents/s over one batch on both cores, short to 256-token rows); with "
        "engine auto, the engine trial times 2 and 1 and the job runs the faster. 1: one batch at a time.",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _known_dtype(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        name = value.strip().lower()
        name = DTYPE_ALIASES.get(name, name)
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; known: {', '.join(DTYPES)} "
                             f"(or {', '.join(DTYPE_ALIASES)})")
        return name

    @field_validator("quantization", mode="before")
    @classmethod
    def _known_quantization(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        name = value.strip().lower()
        if not name:
            return None
        if name not in QUANTIZATIONS and name not in _vllm_quantizations():
            raise ValueError(f"unknown quantization {value!r}; known: {', '.join(QUANTIZATIONS)}, "
                             "or any other method the installed vLLM lists")
        return name

    @model_validator(mode="after")
    def _quantization_fits_engine(self) -> "ModelSpec":
        onnx_method = self.quantization in ONNX_QUANTIZATIONS
        if self.engine == "onnxruntime" and self.quantization is not None and not onnx_method:
            raise ValueError(f"quantization {self.quantization!r} is vLLM's; the onnxruntime engine makes "
                             f"{', '.join(ONNX_QUANTIZATIONS)}")
        if self.engine == "openvino" and self.quantization not in (None, *OPENVINO_QUANTIZATIONS):
            raise ValueError(f"quantization {self.quantization!r}: the openvino engine makes "
                             f"{', '.join(OPENVINO_QUANTIZATIONS)} (or runs the float32 model)")
        if onnx_method and self.engine not in ("onnxruntime", "openvino", "auto"):
            raise ValueError(f"quantization {self.quantization!r} is made by the onnxruntime engine; "
                             f"set engine: onnxruntime (openvino too for int8, or auto), not {self.engine}")
        return self


class ChatMessage(_Spec):
    """One message of the chat the model is asked to continue."""

    model_config = ConfigDict(title="Chat message")

    role: Literal["system", "user", "assistant"] = Field(
        "user", description="Who says it: system (instructions), user (the request) or assistant (an example reply).")
    content: str = Field(
        "{text}", description="The message's text; {text} is replaced by the row's text (text_column), "
        "{column} by that column's value.")


def _json_schema_form(schema: dict[str, Any]) -> None:
    # the form's choices by name rather than by JSON type ("dict", "str")
    inline, path, _ = schema["anyOf"]
    inline["title"], path["title"] = "Inline", "Path of a .json file"


class ResponseFormat(_Spec):
    """A constraint on every output (vLLM structured outputs): exactly one of the fields."""

    model_config = ConfigDict(title="Response format")

    json_schema: dict[str, Any] | str | None = Field(
        None, title="JSON Schema", description="A JSON schema, inline (a mapping) or as the path of a .json file.",
        json_schema_extra=_json_schema_form)
    pydantic_model: str | None = Field(
        None, description="An importable pydantic model whose JSON schema is used: 'package.module:Class' "
        "(or 'package.module.Class').")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    regex: str | None = Field(None, description="The output matches this regular expression, whole.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ResponseFormat:
        given = [name for name in ("json_schema", "pydantic_model", "choice", "regex")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("response_format takes exactly one of json_schema, pydantic_model, choice, regex; "
                             f"got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("response_format.choice must list at least one string")
        return self


class GenerationParams(_Spec):
    """Sampling and prompting for mode=generate. `{text}` marks where the row's text goes, `{column}`
    where another column's value goes."""

    model_config = ConfigDict(title="Generation")

    max_tokens: int = Field(128, ge=1, description="Most tokens generated per row (output tokens).")
    temperature: float = Field(
        0.0, ge=0.0, description="Sampling temperature; 0 is greedy: the same output for the same input.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, title="Top-p",
        description="Nucleus sampling: draw from the most likely tokens whose probabilities "
        "add up to this share (0 to 1]; 1 keeps every token.")
    seed: int | None = Field(
        0, description="Random seed of sampling, so a rerun samples the same tokens. Empty: a fresh seed each run.")
    messages: list[ChatMessage] | None = Field(
        default_factory=lambda: [ChatMessage(role="user", content=DEFAULT_PROMPT)],
        json_schema_extra={"default": [{"role": "user", "content": DEFAULT_PROMPT}]},  # the form shows it
        description="Chat messages rendered with the model's chat template. "
        "Set to null to use prompt_template as a plain completion prompt.",
    )
    prompt_template: str = Field("{text}", description="Plain prompt, used when messages is null.")
    messages_column: str | None = Field(
        None, description="A column holding each row's own chat (a list of {role, content}); when set, it is "
        "the prompt, and messages and prompt_template are not used.")
    # Sampling as vLLM has it (vllm.SamplingParams); the defaults change nothing.
    n: int = Field(
        1, ge=1, title="Completions per Row (n)",
        description="Completions per row; above 1, output_text is a list of n strings.")
    stop: list[str] | None = Field(None, description="Strings that end a completion (not included in it).")
    stop_token_ids: list[int] | None = Field(
        None, title="Stop Token IDs", description="Token ids that end a completion.")
    top_k: int = Field(0, ge=0, title="Top-k", description="Sample from the k most likely tokens; 0 keeps every token.")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, title="Min-p",
        description="Drop tokens less likely than this share of the most likely one.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Penalty on tokens already generated.")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Penalty on tokens by how often they were generated.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="Multiplicative penalty on tokens in the prompt or output; 1 is none.")
    min_tokens: int = Field(0, ge=0, description="Tokens generated before a stop or EOS may end a completion.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Store the log probability of each generated token and of the top-k "
        "alternatives (column logprobs). Empty: not stored.")
    response_format: ResponseFormat | None = Field(
        None, json_schema_extra={"title": "Response format"},
        description="Constrain outputs to a JSON schema, a choice or a regex (vLLM structured outputs); "
        "adds the columns parsed and structured_error. Empty: free text.")

    @model_validator(mode="after")
    def _min_below_max(self) -> GenerationParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is above max_tokens={self.max_tokens}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n={self.n} needs temperature > 0: greedy decoding gives one completion")
        return self


DEFAULT_TOKEN_BUDGET = 16384
# transformers on CPU, two batches at once (cpu_streams): measured on 2 cores (MiniLM, fp32, four interleaved
# rounds, documents/s at 16,384 / 8,192 / 4,096 tokens a batch): 256-token rows 28.0 / 29.7 / 30.3, mixed
# 142 / 147 / 149, short 366 / 369 / 355 (within the rounds' spread)
CPU_TOKEN_BUDGET = 4096


class BatchingSpec(_Spec):
    """How rows are grouped into shards and batches: the levers of throughput and padding."""

    model_config = ConfigDict(title="Batching")

    token_budget: int | None = Field(
        None,
        ge=1,
        description="Most padded token slots in one batch (rows x longest row). Empty: the engine's own, "
        f"{CPU_TOKEN_BUDGET:,} for transformers on a CPU (two batches at once there, each small enough to stay "
        f"in cache), else {DEFAULT_TOKEN_BUDGET:,}.",
    )
    max_batch_size: int = Field(256, ge=1, description="Most rows in one batch (vLLM max_num_seqs).")
    length_tolerance: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="A row joins a batch only if it is at most this much shorter than the batch's "
        "longest row: the most padding any row carries.",
    )
    max_shard_rows: int = Field(
        5000, ge=1, description="Cap on rows per shard (Parquet). A shard is the unit of retry."
    )
    max_shard_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Cap on bytes per shard (JSONL byte ranges)."
    )
    baseline_batch_size: int = Field(
        32,
        ge=1,
        description="Batch size of the naive baseline (fixed-size batches in input order) "
        "that padding_fraction is compared against.",
    )


class PricingSpec(_Spec):
    """What the hardware costs. Defaults are an illustrative single NVIDIA L4."""

    model_config = ConfigDict(title="Pricing")

    usd_per_gpu_hour_spot: float = Field(
        0.30, ge=0.0, title="Spot $ per GPU-Hour",
        description="US dollars per GPU-hour on spot (preemptible) capacity: the run's usd_spot.")
    usd_per_gpu_hour_on_demand: float = Field(
        0.80, ge=0.0, title="On-Demand $ per GPU-Hour",
        description="US dollars per GPU-hour on on-demand capacity: the run's usd_on_demand.")
    gpu_count: int = Field(
        1, ge=1, title="GPUs",
        description="GPUs the job holds while it runs: GPU-hours = wall hours x this.")
    sunk: bool = Field(
        False, description="The GPUs are paid for whether the job runs or not (an online fleet's, backfilled "
        "with engine openai-server): the run's usd_per_1m_tokens_marginal prices its GPU-hours at "
        "usd_per_gpu_hour_marginal instead of the rent.")
    usd_per_gpu_hour_marginal: float = Field(
        0.0, ge=0.0, title="Marginal $ per GPU-Hour",
        description="What one more GPU-hour of work costs on GPUs already paid for (power, wear); with sunk.")


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(spec: JobSpec) -> str:
    """The job's tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite file in the cwd."""
    return spec.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def local_tracking_store(spec: JobSpec) -> Path | None:
    """The SQLite file of the job's MLflow store where it is one on this machine (MLflow creates it, tables
    and all, the first time a run opens it); None for a server's or an in-memory store."""
    return sqlite_file(resolve_tracking_uri(spec))


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names (sqlite:///path, sqlite+driver:///path); None for any other URL, or in memory."""
    if not url.startswith("sqlite") or ":///" not in url or url.endswith(":memory:"):
        return None
    return Path(url.split(":///", 1)[1])


class TrackingSpec(_Spec):
    """Where the job's MLflow run goes: one run per job, opened when the job starts."""

    model_config = ConfigDict(title="Tracking (MLflow)")

    mlflow_tracking_uri: str | None = Field(
        None, title="MLflow Tracking URI",
        description="MLflow tracking URI (an MLflow server's http://..., or sqlite:///...; a relative "
        "sqlite path is from the cwd). Empty: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
    experiment: str = Field("tokenmill", description="MLflow experiment the run is filed under (created if missing).")
    run_name: str | None = Field(None, description="Empty: the name the orchestrator gives the run.")
    stale_run_seconds: float = Field(
        600, gt=0, description="A RUNNING run of the same job from another machine whose heartbeat is this old "
        "is closed as KILLED by the next run of the job (on this machine: as soon as its process is gone).")


class GatedModelSpec(ModelSpec):
    """A model the gate runs here, on a sample: every engine but openai-server (a server serves what it
    serves; the gate compares models it loads itself)."""

    model_config = ConfigDict(title="Gated model")

    engine: Literal["auto", "vllm", "transformers", "onnxruntime", "openvino"] = Field(
        "auto", description="As the job's model.engine, without openai-server: the gate runs its models here.")


class GateSpec(_Spec):
    """The eval gate: the candidate runs the corpus only if it matches the reference on a sample."""

    model_config = ConfigDict(title="Eval gate")

    # pydantic leaves a title off a $ref; the form would show the definition's ("Model")
    reference: GatedModelSpec = Field(description="The model whose outputs count as right.",
                                 json_schema_extra={"title": "Reference model"})
    candidate: GatedModelSpec | None = Field(
        None, title="Candidate model", description="One cheaper model (quantized, other dtype, smaller, other engine): "
        "a ladder of one. Empty: the candidates below, or else the job's own model.")
    candidates: list[GatedModelSpec] = Field(
        default_factory=list, title="Candidate models",
        description="A ladder of cheaper models (e.g. onnxruntime int8, int8-partial): each is judged against the "
        "reference on the same sample, and the corpus runs on the cheapest by measured $/1M tokens among those "
        "that pass. The record shows every candidate's metrics, $/1M and verdict.")
    sample_rows: int = Field(256, ge=2, description="Rows in the deterministic sample (chosen by a hash of the id).")
    sample_seed: int = Field(0, description="Changes which rows the hash picks.")
    eval_file: str | None = Field(None, description="Evaluate on this file's rows instead of a corpus sample.")
    max_tokens: int = Field(32, ge=1, description="generate: greedy tokens per row in the gate.")
    thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="Per-metric minimums over the defaults. embed: cosine_mean, cosine_p5, top10_overlap; "
        "generate: exact_match, prefix_agreement, similarity_mean.")
    on_fail: Literal["fail", "use_reference"] = Field(
        "fail", description="fail: the flow ends Failed. use_reference: the corpus runs with the reference.")
    min_saving: float | None = Field(
        0.1, lt=1, title="Minimum saving",
        description="The share of the reference's measured $/1M tokens a passing candidate must save to run the "
        "corpus; one that saves less (on this machine, e.g. int8 on a CPU without VNNI) leaves the corpus to the "
        "reference, at its exact quality. 0.1 (default): more than the sample's timing noise; 0: any saving; "
        "negative: a candidate that costs up to that share more still runs. Empty: any candidate that passes "
        "runs, whatever it costs.")

    @model_validator(mode="after")
    def _one_way_to_name_candidates(self) -> "GateSpec":
        if self.candidate is not None and self.candidates:
            raise ValueError("gate: give candidate (one model) or candidates (a ladder), not both")
        return self


class IndexSpec(_Spec):
    """An ANN index over the job's embeddings, built from the output files after the shards (embed jobs)."""

    model_config = ConfigDict(title="Index")

    backend: Literal["faiss", "lancedb"] = Field(
        "faiss", description="faiss: a FAISS index file and an id table. lancedb: a Lance table with the ids, "
        "vectors and passthrough columns, plus its vector index.")
    kind: Literal["auto", "flat", "hnsw", "ivfpq"] = Field(
        "auto", description="auto: exact flat search up to flat_max_rows, HNSW up to hnsw_max_rows, IVF-PQ "
        "above (parameters derived from rows and dimension). flat, hnsw or ivfpq: that kind whatever the size.")
    flat_max_rows: int = Field(
        100_000, ge=0, description="auto: corpora of at most this many vectors get exact (flat) search.")
    hnsw_max_rows: int = Field(
        1_000_000, ge=0, title="HNSW Max Rows",
        description="auto: corpora above flat_max_rows and up to this many vectors get HNSW "
        "(full vectors in memory); larger ones get IVF-PQ (compressed codes).")
    hnsw_m: int | None = Field(None, ge=4, title="HNSW M", description="HNSW links per node. Empty: 32.")
    ef_search: int | None = Field(
        None, ge=1, title="HNSW efSearch", description="HNSW candidates searched per query. Empty: 128.")
    nlist: int | None = Field(
        None, ge=1, title="IVF Lists (nlist)",
        description="IVF-PQ lists (partitions). Empty: about 4 x sqrt(rows), a power of two, "
        "at most rows / 39 so every list trains on enough vectors.")
    pq_m: int | None = Field(
        None, ge=1, title="PQ Sub-quantizers (pq_m)",
        description="IVF-PQ sub-quantizers per vector; must divide the dimension. Empty: the largest "
        "divisor of the dimension at most dimension / 4 (4 dimensions per code).")
    nbits: int = Field(
        8, ge=4, le=12, title="PQ Bits per Code (nbits)",
        description="IVF-PQ bits per sub-quantizer code.")
    nprobe: int | None = Field(
        None, ge=1, title="IVF Lists Searched (nprobe)",
        description="IVF-PQ lists searched per query. Empty: nlist / 8, between 8 and 256.")
    train_rows: int = Field(
        100_000, ge=256, title="IVF-PQ Training Rows",
        description="IVF-PQ: at most this many vectors, a deterministic sample, train the "
        "quantizers (the held-out queries are never among them).")
    recall_queries: int = Field(
        200, ge=1, description="Held-out corpus vectors queried to measure recall@10 against exact search, "
        "and queries/s.")
    columns: list[str] | None = Field(
        None, description="Output columns stored beside each id and shown by `tokenmill search`. "
        "Empty: every output column except the embedding and the token counts.")
    seed: int = Field(0, description="Changes which rows are the training sample and the held-out queries.")


class OpenAIBatchSpec(_Spec):
    """OpenAI Batch input (format: openai-batch): which `model` names a request may give, and endpoints."""

    model_config = ConfigDict(title="OpenAI Batch")

    model_aliases: dict[str, str] = Field(
        default_factory=dict, description="A request's `model` -> the job's model it runs on, e.g. "
        "{gpt-4o-mini: SmolLM2-135M-Instruct}. A request naming any other model gets an error line.")
    mixed_endpoints: bool = Field(
        False, description="Let one file mix endpoints (/v1/chat/completions with /v1/completions). Off: a "
        "file that mixes them fails the job. Lines for another mode (/v1/embeddings in a generate job) get "
        "error lines.")


def _passthrough_form(schema: dict[str, Any]) -> None:
    # The form's two choices, named ("list" and "str" otherwise). 'all' as a one-item list to pick from:
    # as a const, the form shows an empty box that cannot be edited.
    columns, _ = schema["anyOf"]
    columns["title"] = "Columns"
    schema["anyOf"][1] = {"type": "string", "enum": ["all"], "title": "All columns"}


class CacheSpec(_Spec):
    """The row cache (tokenmill.row_cache): each row's output kept under a digest of everything that decides
    it, so a re-run computes only the rows that changed, and identical rows are computed once."""

    model_config = ConfigDict(title="Row cache")

    enabled: bool = Field(
        True, description="Look rows up before the engine and store what it computed after. Only deterministic "
        "requests are cached (embeddings; greedy generation, or sampling with a fixed seed on vLLM); the rest "
        "bypass it, and the run record says so. false: no lookups, no writes.")
    uri: str | None = Field(
        None, title="URI", description="Where the entries live; local or s3:// (the job's storage_options apply). "
        "A location shared by many jobs lets them share entries. Empty: the _cache folder under the output.")
    max_bytes: int | None = Field(
        None, ge=0, title="Max Bytes", description="Cap on the entries' size under uri; the oldest files (locally: "
        "least recently used) are evicted after each write. Empty: no cap.")
    collapse_duplicates: bool = Field(
        True, description="Rows with identical inputs in a shard are computed once and the output fanned out to "
        "each of them (deterministic requests only), whether or not the cache is enabled.")


def _form_asks_for_paths(schema: dict[str, Any]) -> None:
    # The demo corpus exists only in a checkout that ran `tokenmill sample-corpus`: the form and the
    # API behind it ask for input and output instead of offering it. JobSpec() in Python keeps it.
    for name in ("input", "output"):
        schema["properties"][name].pop("default", None)
        schema["properties"][name]["minLength"] = 1
    schema["required"] = ["input", "output", *schema.get("required", [])]


def _section_titles(schema: dict[str, Any], model: type[BaseModel]) -> None:
    # pydantic drops the title beside a section's $ref when it equals the section's own title, and
    # Prefect's form then labels the group with the field's name ("Openai Batch"): put it back.
    for name, field in model.model_fields.items():
        prop = schema["properties"].get(name, {})
        section = field.annotation
        if "$ref" in prop and "title" not in prop and isinstance(section, type) and issubclass(section, BaseModel):
            prop["title"] = section.model_config.get("title") or name


def _job_form(schema: dict[str, Any], model: type[BaseModel]) -> None:
    _form_asks_for_paths(schema)
    _section_titles(schema, model)


class JobSpec(_Spec):
    """One batch job: where the rows are, what to run on them, where the results go."""

    model_config = ConfigDict(title="Batch job", json_schema_extra=_job_form)

    input: str = Field(DEFAULT_INPUT, description="A file, directory or glob; local or s3://.")
    format: Literal["auto", "parquet", "jsonl", "openai-batch"] = Field(
        "auto", description="'auto' detects it from each file's extension; a .jsonl file whose lines are "
        "OpenAI Batch requests (custom_id, method, url, body) is read as openai-batch."
    )
    output_format: Literal["auto", "parquet", "openai-batch"] = Field(
        "auto", description="openai-batch: besides the Parquet output, OpenAI Batch result and error files "
        "and a batch object under `<output>/_openai/` (needs openai-batch input). auto: openai-batch for "
        "openai-batch input. parquet: the Parquet output only.")
    openai_batch: OpenAIBatchSpec = Field(
        default_factory=lambda: OpenAIBatchSpec(), title="OpenAI Batch",
        description="How OpenAI Batch request lines are checked against the job.")
    id_column: str = Field(
        "id", title="ID Column",
        description="Column with each row's unique, non-null id; outputs and rejects carry it as `id`.")
    text_column: str = Field("text", description="Column with the text to embed, or the {text} of the prompts.")
    mode: Literal["embed", "generate"] = Field(
        "embed",
        description="embed: one vector per row (`embedding`). generate: one completion per row (`output_text`).")
    model: ModelSpec = Field(
        default_factory=ModelSpec, description="Which model, on which engine, in which dtype.")
    generation: GenerationParams = Field(
        default_factory=GenerationParams, description="Prompts and sampling; used by mode=generate only.")
    batching: BatchingSpec = Field(
        default_factory=BatchingSpec, description="Shard and batch sizes: throughput and padding.")
    overlong: Literal["truncate", "reject"] = Field(
        "truncate",
        description="Inputs longer than the model's limit: cut and flag the row, or reject it.",
    )
    passthrough_columns: list[str] | Literal["all"] = Field(
        default_factory=list,
        json_schema_extra=_passthrough_form,
        description="Input columns copied into the output rows, after the results ('all': every input column "
        "but the id), so no join back is needed.")
    pricing: PricingSpec = Field(
        default_factory=PricingSpec, description="GPU prices the run's cost ($, $/1M tokens) is computed from.")
    output: str = Field(DEFAULT_OUTPUT, description="Output directory; local or s3://.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for s3:// (endpoint_url, ...). Credentials belong in the "
        "environment (or the orchestrator's secret store), not here.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Where the run's record goes.")
    gate: GateSpec | None = Field(
        None, title="Eval gate", description="Check a cheaper candidate model against the reference on a sample "
        "before the corpus runs; on_fail says what a failed check does. Empty: no gate.")
    calibration: str | None = Field(
        None, description="calibration.json from `tokenmill calibrate`, kept with the run's params. The run's "
        "predicted wall, engine and fixed seconds are the same prediction `tokenmill plan` prints, from parts "
        "measured on this machine, calibrated or not.")
    cache: CacheSpec = Field(
        default_factory=CacheSpec, title="Row cache", description="Re-runs pay only for rows that changed; "
        "duplicate rows are computed once.")
    index: IndexSpec | None = Field(
        None, title="Index", description="embed jobs: build an ANN index (FAISS or LanceDB) over the outputs "
        "under `<output>/_index/` after the shards, with recall@10 and build cost on record. Empty: no index.")
    server: ServerSpec | None = Field(
        None, title="Server", description="model.engine openai-server: the OpenAI-compatible server the rows are sent to, and "
        "how the job shares it with live traffic. Empty: the engine runs in this process.")
    stop_by: str | None = Field(
        None, title="Stop By", description="A wall-clock time the job stops before: an ISO date-time, or HH:MM (UTC; the next "
        "one after the job starts). No shard starts after it; on openai-server, in-flight requests drain and "
        "nothing new is sent once a request would not finish before it. The job ends cleanly with the "
        "finished shards, and the next run resumes from them. Empty: no limit.")

    @field_validator("stop_by")
    @classmethod
    def _stop_by_readable(cls, value: str | None) -> str | None:
        return check_stop_by(value)

    @field_validator("input", "output")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

    @model_validator(mode="after")
    def _index_needs_embeddings(self) -> "JobSpec":
        if self.index is not None and self.mode != "embed":
            raise ValueError(f"index: an index is built over embeddings, and this job is mode={self.mode}; "
                             "remove the index section or set mode: embed")
        return self

    @model_validator(mode="after")
    def _engine_supports_generation(self) -> JobSpec:
        if self.mode == "generate" and (self.model.engine in ("onnxruntime", "openvino")
                                        or self.model.quantization in ONNX_QUANTIZATIONS):
            raise ValueError(f"the {self.model.engine if self.model.engine == 'openvino' else 'onnxruntime'} engine "
                             "(and its int8/int4 models) embeds; generation runs on model.engine vllm or transformers")
        if self.mode == "generate" and self.model.engine == "transformers":
            unsupported = transformers_unsupported(self.generation)
            if unsupported:
                raise ValueError("the transformers engine does not support generation."
                                 f"{', generation.'.join(unsupported)}; use model.engine: vllm, or leave them at "
                                 "their defaults")
        return self

    @model_validator(mode="after")
    def _server_for_server_engine(self) -> JobSpec:
        if self.model.engine == "openai-server" and self.server is None:
            raise ValueError("model.engine openai-server needs a server section (server.url: the server's "
                             "OpenAI API, e.g. http://gpu-1:8000/v1)")
        return self

    @property
    def model_name(self) -> str:
        if self.model.name:
            return self.model.name
        return DEFAULT_EMBED_MODEL if self.mode == "embed" else DEFAULT_GENERATE_MODEL

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "JobSpec":
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a job file must be a mapping of fields, got {type(data).__name__}")
        return cls.model_validate(deep_merge(data, overrides or {}))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# Fields Hugging Face `generate` has no equivalent for: the transformers engine refuses them.
TRANSFORMERS_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": None,
                            "response_format": None}


def transformers_unsupported(params: GenerationParams) -> list[str]:
    """The generation fields set to something the transformers engine cannot do."""
    return [name for name, default in TRANSFORMERS_UNSUPPORTED.items() if getattr(params, name) != default]


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; nested mappings merge key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def set_dotted(target: dict[str, Any], dotted_key: str, value: Any) -> None:
    """`set_dotted(d, "batching.token_budget", 8192)` -> d["batching"]["token_budget"] = 8192."""
    *parents, leaf = dotted_key.split(".")
    node = target
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
