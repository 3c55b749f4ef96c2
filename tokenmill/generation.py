"""What a generation job asks the engine for, as plain functions: the sampling parameters (the
job's, with per-row overrides on top, e.g. an OpenAI Batch request's own), the response format
resolved to what vLLM's structured outputs take, and each output checked against it.

No vLLM import except in `vllm_sampling_params`: the rest is what tests and other engines use.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.spec import GenerationParams, ResponseFormat

# GenerationParams fields that are vllm.SamplingParams arguments of the same name.
SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs")


def sampling_kwargs(params: GenerationParams, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vllm.SamplingParams(**kwargs) for a job's rows: the job's fields, then a row's overrides on
    top (any SamplingParams argument; `response_format` takes our ResponseFormat's fields). The
    structured-output constraint is a plain mapping under `structured_outputs` (the keyword of
    vllm.sampling_params.StructuredOutputsParams), so this stays importable without vLLM."""
    kwargs: dict[str, Any] = {name: getattr(params, name) for name in SAMPLING_FIELDS}
    response_format = params.response_format
    for name, value in (overrides or {}).items():
        if name == "response_format":
            response_format = value if value is None or isinstance(value, ResponseFormat) \
                else ResponseFormat.model_validate(value)
        else:
            kwargs[name] = value
    if response_format is not None:
        kwargs["structured_outputs"] = structured_outputs(response_format)
    return kwargs


def vllm_sampling_params(params: GenerationParams, overrides: Mapping[str, Any] | None = None):
    """The vllm.SamplingParams for sampling_kwargs(params, overrides)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = sampling_kwargs(params, overrides)
    if kwargs.get("structured_outputs") is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def structured_outputs(response_format: ResponseFormat) -> dict[str, Any]:
    """StructuredOutputsParams keywords for a response format."""
    if response_format.choice is not None:
        return {"choice": list(response_format.choice)}
    if response_format.regex is not None:
        return {"regex": response_format.regex}
    return {"json": json_schema(response_format)}


def json_schema(response_format: ResponseFormat) -> dict[str, Any]:
    """The JSON schema of a response format: inline, from a file, or from a pydantic model."""
    if isinstance(response_format.json_schema, dict):
        return response_format.json_schema
    if isinstance(response_format.json_schema, str):
        path = Path(response_format.json_schema)
        try:
            schema = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"response_format.json_schema: cannot read a JSON schema from {path} ({exc})") from exc
        if not isinstance(schema, dict):
            raise ConfigError(f"response_format.json_schema: {path} holds a JSON {type(schema).__name__}, not a schema")
        return schema
    return _pydantic_schema(response_format.pydantic_model or "")


def _pydantic_schema(dotted: str) -> dict[str, Any]:
    module_name, _, name = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    try:
        model = getattr(importlib.import_module(module_name), name)
        return model.model_json_schema()
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"response_format.pydantic_model: cannot import a pydantic model {dotted!r} ({exc})") from exc


def check_response_format(params: GenerationParams) -> None:
    """Before any engine starts: the schema can be read and is a valid JSON schema, the regex compiles."""
    response_format = params.response_format
    if response_format is None:
        return
    if response_format.regex is not None:
        try:
            re.compile(response_format.regex)
        except re.error as exc:
            raise ConfigError(f"response_format.regex does not compile: {exc}") from exc
    if response_format.choice is None and response_format.regex is None:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(json_schema(response_format))
        except SchemaError as exc:
            raise ConfigError(f"response_format: not a valid JSON schema ({exc.message})") from exc


@dataclass(frozen=True)
class Checked:
    parsed: str | None  # the value as canonical JSON text (json), or the output itself (choice, regex)
    error: str | None  # why the output does not conform; None when it does


class OutputChecker:
    """Checks outputs against a response format; built once per shard (the schema compiles once)."""

    def __init__(self, response_format: ResponseFormat):
        self.format = response_format
        self.validator = None
        if response_format.choice is None and response_format.regex is None:
            from jsonschema import Draft202012Validator

            self.validator = Draft202012Validator(json_schema(response_format))
        self.pattern = re.compile(response_format.regex) if response_format.regex is not None else None

    def check(self, text: str, finish_reason: str | None = None) -> Checked:
        cut = " (the output hit max_tokens)" if finish_reason == "length" else ""
        if self.format.choice is not None:
            if text in self.format.choice:
                return Checked(text, None)
            return Checked(None, f"output is not one of the {len(self.format.choice)} choices{cut}")
        if self.pattern is not None:
            if self.pattern.fullmatch(text):
                return Checked(text, None)
            return Checked(None, f"output does not match the regex{cut}")
        try:
            value = json.loads(text)
        except ValueError as exc:
            return Checked(None, f"output is not JSON ({exc.msg} at character {exc.pos}){cut}")
        errors = sorted(self.validator.iter_errors(value), key=lambda e: list(e.absolute_path))
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path) or "the value"
            return Checked(None, f"output does not validate against the schema at {where}: {errors[0].message}{cut}")
        return Checked(json.dumps(value, ensure_ascii=False, sort_keys=True), None)


def parsed_agreement(reference: list[str | None], candidate: list[str | None]) -> float:
    """Share of rows where two models' parsed values agree, field by field: for JSON objects the
    share of fields (over both objects' keys) with equal values, else 1 for equal values; a row
    either side failed to produce a valid value for counts 0."""
    if not reference:
        return 1.0
    scores = []
    for ref, cand in zip(reference, candidate):
        if ref is None or cand is None:
            scores.append(0.0)
            continue
        ref_value, cand_value = _value(ref), _value(cand)
        if isinstance(ref_value, dict) and isinstance(cand_value, dict):
            keys = set(ref_value) | set(cand_value)
            scores.append(sum(ref_value.get(k, _MISSING) == cand_value.get(k, _MISSING) for k in keys) / len(keys)
                          if keys else 1.0)
        else:
            scores.append(float(ref_value == cand_value))
    return sum(scores) / len(scores)


_MISSING = object()


def _value(parsed: str) -> Any:
    try:
        return json.loads(parsed)
    except ValueError:
        return parsed  # a choice or regex output is the string itself
