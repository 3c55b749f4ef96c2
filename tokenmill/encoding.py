"""Rows to token ids, once per row: prompts rendered from the job's template, the model's
input limit applied with the overlong policy (cut the row's text, never the template)."""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel

from tokenmill.models import load_tokenizer, model_input_limit
from tokenmill.spec import JobSpec


class EncodedRows(BaseModel):
    token_ids: list[list[int]]
    truncated: list[bool]
    overlong: list[tuple[int, str]]  # (position, reason): rows refused under overlong=reject


def encode_rows(texts: Sequence[str], spec: JobSpec, model_path: str) -> EncodedRows:
    """Token ids per row, under the model's input limit, with the overlong policy applied."""
    tokenizer = load_tokenizer(model_path)
    limit = input_token_limit(spec, model_path)
    if spec.mode == "embed":
        return _encode_for_embedding(list(texts), tokenizer, limit, spec.overlong)
    return _encode_for_generation(list(texts), tokenizer, limit, spec)


def input_token_limit(spec: JobSpec, model_path: str) -> int:
    limit = spec.model.max_input_tokens or model_input_limit(model_path)
    if spec.model.engine_kwargs.get("max_model_len"):
        limit = min(limit, int(spec.model.engine_kwargs["max_model_len"]))
    if spec.mode == "generate":
        limit -= spec.generation.max_tokens  # room for the answer inside the context
        if limit < 1:
            raise ValueError(f"generation.max_tokens={spec.generation.max_tokens} leaves no room for input")
    return limit


def _encode_for_embedding(texts: list[str], tokenizer, limit: int, policy: str) -> EncodedRows:
    token_ids = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
    truncated = [False] * len(texts)
    overlong = []
    long_rows = [i for i, ids in enumerate(token_ids) if len(ids) > limit]
    if long_rows and policy == "reject":
        overlong = [(i, f"input has {len(token_ids[i])} tokens; the model takes at most {limit}") for i in long_rows]
    elif long_rows:
        cut = tokenizer([texts[i] for i in long_rows], add_special_tokens=True, truncation=True, max_length=limit)
        for i, ids in zip(long_rows, cut["input_ids"]):
            token_ids[i] = ids
            truncated[i] = True
    return EncodedRows(token_ids=token_ids, truncated=truncated, overlong=overlong)


def _encode_for_generation(texts: list[str], tokenizer, limit: int, spec: JobSpec) -> EncodedRows:
    overhead = len(_render_prompts([""], tokenizer, spec)[0])
    room = limit - overhead
    if room < 1:
        raise ValueError(f"the prompt template alone takes {overhead} tokens; the input limit is {limit}")
    text_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    truncated = [len(ids) > room for ids in text_ids]
    overlong = []
    if spec.overlong == "reject":
        overlong = [(i, f"input has {len(ids)} tokens; at most {room} fit beside the prompt and "
                        f"max_tokens={spec.generation.max_tokens}") for i, ids in enumerate(text_ids) if len(ids) > room]
        truncated = [False] * len(texts)
    else:
        # re-joining cut tokens can merge into slightly different tokens; keep a margin
        texts = [tokenizer.decode(ids[: max(room - 8, 1)]) if cut else text
                 for text, ids, cut in zip(texts, text_ids, truncated)]
    token_ids = _render_prompts(texts, tokenizer, spec) if texts else []
    return EncodedRows(token_ids=token_ids, truncated=truncated, overlong=overlong)


def _render_prompts(texts: list[str], tokenizer, spec: JobSpec) -> list[list[int]]:
    params = spec.generation
    if params.messages is None:
        prompts = [params.prompt_template.replace("{text}", text) for text in texts]
        return tokenizer(prompts, add_special_tokens=True)["input_ids"]
    conversations = [
        [{"role": m.role, "content": m.content.replace("{text}", text)} for m in params.messages] for text in texts
    ]
    rendered = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
