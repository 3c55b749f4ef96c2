"""What a finished shard reports, and the key its result is found again by."""

from __future__ import annotations

from pydantic import BaseModel

from tokenmill.bucketing import PaddingStats
from tokenmill.digest import stable_digest
from tokenmill.shards import ShardSpec
from tokenmill.spec import JobSpec

OUTPUT_FORMAT_VERSION = 1


class ShardResult(BaseModel):
    shard_id: str
    fingerprint: str
    uri: str
    output: str
    rows_in: int
    rows_out: int
    rows_rejected: int
    rows_truncated: int
    input_tokens: int
    output_tokens: int
    batches: int
    real_tokens: int  # tokens the engine saw (= input_tokens, less those of rows from the row cache or collapsed)
    padded_slots: int  # rows x longest row over the engine calls (= real_tokens for an engine that does not pad)
    baseline_padded_slots: int  # the same, over fixed-size batches in input order
    engine_seconds: float
    seconds: float
    format_version: int = OUTPUT_FORMAT_VERSION
    worker: str = ""  # the worker run that wrote this result: a fleet's throughput per worker
    engine: str = ""  # the engine that ran it (with `engine: auto`, each worker chooses on its own device)
    structured_invalid_rows: int = 0  # rows whose output does not conform to generation.response_format
    prompt_cached_tokens: int | None = None  # prompt tokens found in vLLM's prefix cache; None: not reported
    # the row cache (tokenmill.row_cache). row_cache: on | off | bypassed: <why>; "" where it was not consulted
    # (OpenAI Batch shards, records from before it)
    row_cache: str = ""
    rows_cache_lookups: int = 0  # rows looked up in the row cache
    rows_from_cache: int = 0  # rows whose output came from it
    rows_collapsed: int = 0  # rows whose output is a copy of an identical row computed in this shard
    tokens_saved: int = 0  # input + output tokens of those rows: what the engine did not compute
    engine_seconds_saved: float = 0.0  # what computing them would have taken, at the rates they were computed at

    @property
    def padding_fraction(self) -> float:
        return PaddingStats(self.real_tokens, self.padded_slots).padding_fraction

    @property
    def baseline_padding_fraction(self) -> float:
        return PaddingStats(self.real_tokens, self.baseline_padded_slots).padding_fraction


def shard_cache_key(shard: ShardSpec, spec: JobSpec) -> str:
    """What a shard's output depends on, and nothing else.

    Not the code's source text (a comment edit must not redo a ten-hour job) and not
    the batching settings (they change speed, not results). The output location is
    in, so one job's finished shards never stand in for another's.
    """
    identity = {
        "fingerprint": shard.fingerprint,
        "mode": spec.mode,
        "model": spec.model_name,
        # `auto` reads as vllm, the default it replaced: finished shards of jobs that never named an
        # engine keep their keys. What auto picks does not enter: it is speed, like the batch settings.
        "model_spec": {**spec.model.model_dump(mode="json", exclude={"name"}),
                       **({"engine": "vllm"} if spec.model.engine == "auto" else {})},
        "generation": generation_identity(spec) if spec.mode == "generate" else None,
        "columns": [spec.id_column, spec.text_column],
        "overlong": spec.overlong,
        "output": spec.output.rstrip("/"),
        "format_version": OUTPUT_FORMAT_VERSION,
    }
    if spec.passthrough_columns:
        identity["passthrough_columns"] = spec.passthrough_columns
    if shard.format == "openai-batch":  # which request models run here; which files are written
        identity["openai_batch"] = [spec.openai_batch.model_dump(mode="json"), spec.output_format]
    digest = stable_digest(identity, 32)
    return f"{shard.shard_id}-{digest}"


# GenerationParams fields from before prompts from any column, full sampling and response formats: always
# in the key. The later ones are in it only when set, so the keys of jobs that leave them alone (their
# finished shards) are what they were.
_FIRST_GENERATION_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "messages", "prompt_template")


def generation_identity(spec: JobSpec) -> dict:
    dumped = spec.generation.model_dump(mode="json")
    defaults = type(spec.generation)().model_dump(mode="json")
    return {k: v for k, v in dumped.items() if k in _FIRST_GENERATION_FIELDS or v != defaults.get(k)}
