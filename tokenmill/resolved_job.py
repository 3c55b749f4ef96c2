"""The job as resolved once, at the top of an entry point: what every layer below reads and never
decides again. Made by tokenmill.resolution.resolve_job; a leaf, so the pipeline takes it without
importing the policy that made it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenmill.spec import JobSpec

Pipeline = Literal["rows", "openai-batch"]


@dataclass(frozen=True)
class ResolvedJob:
    """spec: the job with a concrete engine (`engine: auto` chosen) and, where its trial chose them, the
    engine's streams; OpenAI Batch generation on vLLM (each request's own sampling needs it).

    engine: the engine the job runs on (spec.model.engine). streams: batches at once where the job or the
    engine trial fixed them (None: the engine's own default). mode: embed or generate. input_format: the
    format of the input's first file (parquet, jsonl, openai-batch), None where it could not be read (the
    job reports what is wrong with its input). pipeline: the job's shard pipeline by that format; a shard's
    own format, fixed when the shards were discovered, picks its steps in an input that mixes formats.
    model_path: the model's local directory. token_budget: the job's batching.token_budget, None where
    the job leaves it to the engine (its declared `default_token_budget`). context_limit: the tokens a
    request may hold, prompt and answer together (the model's limit, max_input_tokens, max_model_len)."""

    spec: JobSpec
    engine: str
    streams: int | None
    mode: str
    input_format: str | None
    pipeline: Pipeline
    model_path: str
    token_budget: int | None
    context_limit: int

    def pipeline_of(self, shard_format: str) -> Pipeline:
        """The shard pipeline that runs a shard of this format."""
        return "openai-batch" if shard_format == "openai-batch" else "rows"
