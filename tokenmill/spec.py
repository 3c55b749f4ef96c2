"""The job, as one declarative object.

`JobSpec` is what a user writes in YAML, what the CLI builds from flags, and what
the Prefect UI renders as the batch flow's form. Every field has a default, so
`JobSpec()` is the demo job: embed the sample corpus with all-MiniLM-L6-v2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_EMBED_MODEL = "all-MiniLM-L6-v2"
DEFAULT_GENERATE_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_INPUT = "data/sample-corpus"
DEFAULT_OUTPUT = "output/sample-corpus"


class _Spec(BaseModel):
    # Unknown keys in a job file are typos; fail loudly rather than ignore them.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelSpec(_Spec):
    """Which model to run, on which engine, and how to load it."""

    name: str = Field(
        "",
        description="A local path, a Hugging Face name, or a built-in alias "
        f"({DEFAULT_EMBED_MODEL}, {DEFAULT_GENERATE_MODEL}). Empty: the default for the mode.",
    )
    engine: Literal["vllm", "transformers"] = Field(
        "vllm",
        description="vllm: the fast path. transformers: plain PyTorch, for machines where vLLM cannot run.",
    )
    dtype: str = Field(
        "auto",
        description="Weights and activations dtype. 'auto' is float32 on CPU (bf16 is far "
        "slower there) and the model's own dtype on GPU.",
    )
    quantization: str | None = Field(None, description="vLLM quantization method, e.g. 'fp8'.")
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


class ChatMessage(_Spec):
    role: Literal["system", "user", "assistant"] = "user"
    content: str = "{text}"


class GenerationParams(_Spec):
    """Sampling and prompting for mode=generate. `{text}` marks where the row's text goes."""

    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = 0
    messages: list[ChatMessage] | None = Field(
        default_factory=lambda: [
            ChatMessage(role="user", content="Summarize the following text in one sentence.\n\n{text}")
        ],
        description="Chat messages rendered with the model's chat template. "
        "Set to null to use prompt_template as a plain completion prompt.",
    )
    prompt_template: str = Field("{text}", description="Plain prompt, used when messages is null.")


class BatchingSpec(_Spec):
    token_budget: int = Field(
        16384,
        ge=1,
        description="Most padded token slots in one batch (rows x longest row).",
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

    usd_per_gpu_hour_spot: float = Field(0.30, ge=0.0)
    usd_per_gpu_hour_on_demand: float = Field(0.80, ge=0.0)
    gpu_count: int = Field(1, ge=1)


class TrackingSpec(_Spec):
    mlflow_tracking_uri: str = Field(
        "sqlite:///mlflow.db", description="MLflow backend; a relative sqlite path is from the cwd."
    )
    experiment: str = "tokenmill"
    run_name: str | None = None


class GateSpec(_Spec):
    """The eval gate: the candidate runs the corpus only if it matches the reference on a sample."""

    reference: ModelSpec = Field(description="The model whose outputs count as right.")
    candidate: ModelSpec | None = Field(
        None, description="The cheaper model (quantized, other dtype, smaller, other engine). "
        "Empty: the job's own model.")
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


class FleetSpec(_Spec):
    """dispatch: pool. Shards fan out to the shard-worker deployment on a GPU work pool."""

    deployment: str = Field(
        "tokenmill-shard-worker/gpu-spot",
        description="The shard-worker deployment, as flow-name/deployment-name (deployments/prefect.yaml).")
    workers: int = Field(4, ge=1, description="Work lists per dispatch: one per GPU worker run.")
    max_rounds: int = Field(
        3, ge=1, description="Dispatch rounds: the first, plus re-dispatches of the unfinished shards of "
        "runs that ended Crashed, Failed or Cancelled (a preemption).")
    straggler_seconds: float | None = Field(
        None, gt=0, description="A worker run still going this long after it started gets a speculative "
        "copy of its unfinished shards. Empty: straggler_factor x the median finished run.")
    straggler_factor: float = Field(1.5, ge=1.0, description="See straggler_seconds.")
    concurrency_limit: str = Field(
        "tokenmill-gpu", description="Prefect global concurrency limit every shard-worker run holds a slot "
        "of while its engine is up: the cap on GPU workers at once, across jobs.")
    concurrency_slots: int = Field(
        8, ge=1, description="The limit's size, used only when the limit does not exist yet.")
    slot_lease_seconds: float = Field(
        300, ge=60, description="A slot of a worker that vanished (SIGKILL, lost node) frees after this long.")
    start_timeout_seconds: float | None = Field(
        3600, gt=0, description="A worker run not started this long after its launch (no worker, no capacity) "
        "is cancelled and counts as lost: its shards go to the next round. Empty: wait for ever.")
    poll_seconds: float = Field(5.0, gt=0, description="How often the orchestrator reads its worker runs' states.")
    job_variables: dict[str, Any] = Field(
        default_factory=dict, description="Work-pool job variables for the worker runs (image, env, ...).")


class JobSpec(_Spec):
    """One batch job: where the rows are, what to run on them, where the results go."""

    input: str = Field(DEFAULT_INPUT, description="A file, directory or glob; local or s3://.")
    format: Literal["auto", "parquet", "jsonl"] = Field(
        "auto", description="'auto' detects it from each file's extension."
    )
    id_column: str = "id"
    text_column: str = "text"
    mode: Literal["embed", "generate"] = "embed"
    model: ModelSpec = Field(default_factory=ModelSpec)
    generation: GenerationParams = Field(default_factory=GenerationParams)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    overlong: Literal["truncate", "reject"] = Field(
        "truncate",
        description="Inputs longer than the model's limit: cut and flag the row, or reject it.",
    )
    pricing: PricingSpec = Field(default_factory=PricingSpec)
    output: str = Field(DEFAULT_OUTPUT, description="Output directory; local or s3://.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for s3:// (endpoint_url, ...). Credentials belong in the "
        "environment or in storage_block, not here.",
    )
    storage_block: str | None = Field(
        None,
        description="Name of a Prefect Secret block whose value is a JSON object of fsspec options "
        "(key, secret, token, endpoint_url, ...), merged in when storage is opened.",
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    gate: GateSpec | None = Field(None, description="Run the eval gate first; see GateSpec.")
    dispatch: Literal["local", "pool"] = Field(
        "local", description="local: every shard in this process. pool: shards fan out to GPU worker runs "
        "of the fleet's deployment; see fleet.")
    fleet: FleetSpec = Field(default_factory=FleetSpec)
    calibration: str | None = Field(
        None, description="calibration.json from `tokenmill calibrate`: the run then records predicted "
        "against measured tokens/s and $.")

    @field_validator("input", "output")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

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
