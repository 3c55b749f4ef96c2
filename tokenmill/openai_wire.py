"""OpenAI Batch JSONL as it is on the wire: the request lines a batch file holds, and the result and
error lines and response bodies written back, in OpenAI's own schema (as vLLM's run_batch.py keeps its
wire models beside the runner, not inside it).

A leaf: pydantic, json and numpy only, so the shards layer (sniffing a file, reading a request's text)
and the OpenAI Batch shard pipeline (tokenmill.openai_batch) both read it without importing each other.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINT_MODES = {CHAT: "generate", COMPLETIONS: "generate", EMBEDDINGS: "embed"}
REQUIRED_KEYS = ("custom_id", "method", "url", "body")


# --- request bodies ------------------------------------------------------------------------------

class _Body(BaseModel):
    # A field the endpoint does not take is an error for that line, not a field silently dropped.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    user: str | None = None  # accepted and ignored, as by OpenAI's batch runner
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    stream: Literal[False] | None = Field(None, description="a batch answers whole; stream must be false")


class _Sampling(_Body):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r}: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ResponseFormatIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormatIn | None = None
    service_tier: str | None = None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] | None = None


class EmbeddingBody(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"


BODIES: dict[str, type[_Body]] = {CHAT: ChatBody, COMPLETIONS: CompletionBody, EMBEDDINGS: EmbeddingBody}


# --- lines -----------------------------------------------------------------------------------------

@dataclass
class BatchLine:
    """One valid request of the file."""

    offset: int  # byte offset of the line in its file
    custom_id: str
    url: str
    body: Any  # ChatBody | CompletionBody | EmbeddingBody


@dataclass
class LineError:
    """One line that gets an error line instead of a result."""

    offset: int
    custom_id: str | None
    code: str
    message: str
    status_code: int = 400


@dataclass
class ParsedLines:
    lines: list[BatchLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def rows_in(self) -> int:
        return len(self.lines) + len(self.errors)


def parse_lines(data: bytes, byte_start: int = 0) -> ParsedLines:
    """Every non-blank line of a byte range: a valid request or the reason it is not one."""
    parsed = ParsedLines()
    seen: set[str] = set()
    offset = byte_start
    for raw in data.split(b"\n"):
        line_offset, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        result = parse_line(raw, line_offset)
        if isinstance(result, BatchLine):
            if result.custom_id in seen:
                result = LineError(line_offset, result.custom_id, "duplicate_custom_id",
                                   f"custom_id {result.custom_id!r} is used by an earlier line; each line "
                                   "needs its own")
            else:
                seen.add(result.custom_id)
        (parsed.lines if isinstance(result, BatchLine) else parsed.errors).append(result)
    return parsed


def parse_line(raw: bytes, offset: int = 0) -> BatchLine | LineError:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return LineError(offset, None, "invalid_json", f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    except json.JSONDecodeError as exc:
        return LineError(offset, None, "invalid_json", f"line is not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(record, dict):
        return LineError(offset, None, "invalid_json", f"line is a JSON {type(record).__name__}, not an object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(offset, None, "missing_custom_id", "line has no custom_id (a non-empty string)")
    unknown = sorted(set(record) - set(REQUIRED_KEYS))
    if unknown:
        return LineError(offset, custom_id, "invalid_request",
                         f"line has fields a batch line does not take: {', '.join(unknown)}")
    method, url = record.get("method"), record.get("url")
    if not isinstance(method, str) or method.upper() != "POST":
        return LineError(offset, custom_id, "invalid_method", f"method {method!r} is not supported; use POST")
    if url not in BODIES:
        return LineError(offset, custom_id, "invalid_url",
                         f"url {url!r} is not a supported endpoint; supported: {', '.join(BODIES)}")
    body = record.get("body")
    if not isinstance(body, dict):
        return LineError(offset, custom_id, "invalid_request", "body must be a JSON object")
    try:
        model = BODIES[url].model_validate(body)
        if isinstance(model, ChatBody):
            for message in model.messages:
                message.text()
            if model.top_logprobs and not model.logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            if model.response_format and model.response_format.type == "json_schema":
                schema = (model.response_format.json_schema or {}).get("schema")
                if not isinstance(schema, dict):
                    raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        if isinstance(model, CompletionBody) and isinstance(model.prompt, list) and model.prompt and \
                isinstance(model.prompt[0], str) and len(model.prompt) != 1:
            raise ValueError("prompt: one prompt per line (a list of prompts is not supported)")
        if isinstance(model, (ChatBody, CompletionBody)) and isinstance(model.stop, list) and len(model.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        if isinstance(model, EmbeddingBody) and _embedding_inputs_empty(model.input):
            raise ValueError("input must not be empty (nor hold an empty string)")
    except ValidationError as exc:
        return LineError(offset, custom_id, "invalid_request", f"body is not a valid {url} request: "
                         + _first_error(exc))
    except ValueError as exc:
        return LineError(offset, custom_id, "invalid_request", f"body is not a valid {url} request: {exc}")
    return BatchLine(offset, custom_id, url, model)


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    extra = [".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return f"fields it does not take: {', '.join(extra)}"
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"] if not isinstance(p, str) or not p.startswith(("list[", "str")))
    return f"{where or 'body'}: {first['msg']}"


def _embedding_inputs_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value
    return not value or any((isinstance(v, (str, list)) and not v) for v in value)


def sniff_openai_batch(first_line: bytes) -> bool:
    """Whether a JSONL file's first line is an OpenAI Batch request."""
    try:
        record = json.loads(first_line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and all(key in record for key in REQUIRED_KEYS)


def file_mode(first_line: bytes) -> str | None:
    """The mode (embed or generate) a file's first request needs, if its first line says."""
    try:
        record = json.loads(first_line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return ENDPOINT_MODES.get(record.get("url")) if isinstance(record, dict) else None


def line_text(record: Any) -> str | None:
    """A request's text as one string (the last user message, the prompt, the first input): what a
    gate sample or a plain reader of the file sees."""
    if not isinstance(record, dict) or not isinstance(record.get("body"), dict):
        return None
    body = record["body"]
    if isinstance(body.get("messages"), list):
        users = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") == "user"]
        content = (users or body["messages"] or [{}])[-1].get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else None
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str):
            return value
    return None


# --- response bodies -------------------------------------------------------------------------------

def finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _top(entry: dict[str, Any], top: int) -> list[dict[str, Any]]:
    return [c for c in entry.get("top_logprobs") or []][:top]


def _chat_logprobs(logprobs: list[dict] | None, top: int) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    content = []
    for entry in logprobs:
        token = entry.get("token") or ""
        content.append({
            "token": token, "logprob": _finite(entry.get("logprob")), "bytes": _token_bytes(token),
            "top_logprobs": [{"token": c.get("token") or "", "logprob": _finite(c.get("logprob")),
                              "bytes": _token_bytes(c.get("token") or "")} for c in _top(entry, top)],
        })
    return {"content": content, "refusal": None}


def _completion_logprobs(logprobs: list[dict] | None, top: int) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets, position = [], [], [], [], 0
    for entry in logprobs:
        token = entry.get("token") or ""
        tokens.append(token)
        token_logprobs.append(_finite(entry.get("logprob")))
        tops.append({c.get("token") or "": _finite(c.get("logprob")) for c in _top(entry, top)})
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _finite(value: float | None) -> float:
    # JSON has no -inf; OpenAI reports -9999.0 for tokens it rules out
    return -9999.0 if value is None or math.isnan(value) or value < -9999.0 else float(value)


def choices_of(generation) -> tuple:
    """Every completion of a row's Generation (n of them)."""
    return generation.samples or (generation,)


def generation_body(line: BatchLine, generation, prompt_tokens: int, model: str, request_key: str,
                    created: int) -> dict[str, Any]:
    """A chat.completion or text_completion object from one row's Generation."""
    completions = choices_of(generation)
    completion_tokens = sum(c.output_tokens for c in completions)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if line.url == CHAT:
        top = line.body.top_logprobs or 0
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": _chat_logprobs(c.logprobs, top) if line.body.logprobs else None,
                    "finish_reason": finish_reason(c.finish_reason)}
                   for i, c in enumerate(completions)]
        return {"id": f"chatcmpl-{request_key}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage, "system_fingerprint": None}
    top = line.body.logprobs or 0
    choices = [{"index": i, "text": c.text,
                "logprobs": _completion_logprobs(c.logprobs, top) if line.body.logprobs is not None else None,
                "finish_reason": finish_reason(c.finish_reason)}
               for i, c in enumerate(completions)]
    return {"id": f"cmpl-{request_key}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage, "system_fingerprint": None}


def embedding_body(line: BatchLine, vectors: list[np.ndarray], prompt_tokens: int, model: str) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(vectors):
        values = np.asarray(vector, dtype=np.float32)
        if line.body.encoding_format == "base64":
            embedding: Any = base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = values.tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def result_line(key: str, custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{key}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}


def error_line(key: str, error: LineError) -> dict[str, Any]:
    """OpenAI's error line: the error as {code, message}, and the HTTP answer it would have had."""
    return {"id": f"batch_req_{key}", "custom_id": error.custom_id,
            "response": {"status_code": error.status_code, "request_id": f"req_{key}",
                         "body": {"error": {"message": error.message, "type": "invalid_request_error",
                                            "param": None, "code": error.code}}},
            "error": {"code": error.code, "message": error.message}}


def jsonl_bytes(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n" for line in lines).encode()
