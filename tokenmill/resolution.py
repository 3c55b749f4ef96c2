"""resolve_job: the job resolved once, at the top of every entry point (the batch flow's shard task, the
shard worker, the gate, calibration, the index's search, the early engine start).

Everything below takes the ResolvedJob and never resolves, chooses or sniffs again: the engine
(`engine: auto` chosen here, by tokenmill.engine_choice) and its streams, the input's format and the
shard pipeline it runs, the model's directory, the token budget and the context limit."""

from __future__ import annotations

from tokenmill.digest import stable_digest
from tokenmill.encoding import context_limit
from tokenmill.engine_choice import resolve, with_engine
from tokenmill.errors import InputError
from tokenmill.models import resolve_model
from tokenmill.openai_batch import NEEDS_VLLM, PER_REQUEST_SAMPLING
from tokenmill.resolved_job import ResolvedJob
from tokenmill.shards import input_format
from tokenmill.spec import JobSpec

# the input's format, read once per input and process (every shard of a job asks; on object storage
# each asking is a listing and a read). The engine is not kept here: engine_choice keeps its choice, and
# a later choice for more rows (the flow's, after an early engine start's) is the one that holds.
_formats: dict[str, str | None] = {}


def resolve_job(spec: JobSpec) -> ResolvedJob:
    """The job as it runs here (see the module's docstring)."""
    found = input_format_of(spec)
    pipeline = "openai-batch" if found == "openai-batch" else "rows"
    resolved = resolve(spec)  # engine: auto, chosen (once per process: cached trials, or a trial now)
    if pipeline == "openai-batch" and resolved.mode == "generate":
        resolved = openai_batch_engine(resolved)
    model_path = resolve_model(resolved.model_name)
    return ResolvedJob(spec=resolved, engine=resolved.model.engine, streams=resolved.model.cpu_streams or None,
                       mode=resolved.mode, input_format=found, pipeline=pipeline, model_path=model_path,
                       token_budget=resolved.batching.token_budget,
                       context_limit=context_limit(resolved, model_path))


def input_format_of(spec: JobSpec) -> str | None:
    """The job's input format, read once per input and process. None (no input yet, or unreadable) is not
    kept: the input may be there when asked again."""
    key = stable_digest([spec.input, spec.format, spec.storage_options], 32)
    if _formats.get(key) is None:
        _formats[key] = input_format(spec.input, spec.format, spec.storage_options)
    return _formats[key]


def openai_batch_engine(spec: JobSpec) -> JobSpec:
    """OpenAI Batch generation runs each request with its own sampling parameters, which vLLM takes per
    row (and a server takes per request): a job that names transformers is refused, any other engine
    (auto, onnx, openvino) runs on vLLM."""
    if spec.model.engine in PER_REQUEST_SAMPLING:
        return spec
    if spec.model.engine == "transformers":
        raise InputError(spec.input, NEEDS_VLLM)
    return with_engine(spec, "vllm")
