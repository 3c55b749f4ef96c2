"""Rows to token ids, once per row: prompts rendered from the job's template, the model's
input limit applied with the overlong policy (cut the row's text, never the template)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from tokenmill.models import load_text_tokenizer, load_tokenizer, model_input_limit
from tokenmill.prompts import TEXT, fill
from tokenmill.spec import JobSpec


class EncodedRows(BaseModel):
    token_ids: list[list[int]]
    truncated: list[bool]
    overlong: list[tuple[int, str]]  # (position, reason): rows refused under overlong=reject


def encode_rows(rows: Sequence, spec: JobSpec, model_path: str) -> EncodedRows:
    """Token ids per row, under the model's input limit, with the overlong policy applied.

    A row is its text; for generation it may instead be a mapping of the columns its prompt is
    rendered from (tokenmill.prompts.prompt_inputs: `text` and other template columns, or `messages`)."""
    limit = input_token_limit(spec, model_path)
    if spec.mode == "embed":  # texts to ids only: without transformers where the model's tokenizer.json says it all
        return _encode_for_embedding(list(rows), load_text_tokenizer(model_path), limit, spec.overlong)
    return _encode_for_generation(list(rows), load_tokenizer(model_path), limit, spec)


def context_limit(spec: JobSpec, model_path: str) -> int:
    """The tokens a request may hold, prompt and answer together: max_input_tokens, else the model's
    limit, and at most the engine's max_model_len where the job sets one."""
    limit = spec.model.max_input_tokens or model_input_limit(model_path)
    if spec.model.engine_kwargs.get("max_model_len"):
        limit = min(limit, int(spec.model.engine_kwargs["max_model_len"]))
    return limit


def input_token_limit(spec: JobSpec, model_path: str) -> int:
    """The tokens a row's input may hold: the context, less the room for the answer when generating."""
    limit = context_limit(spec, model_path)
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


def _encode_for_generation(rows: list, tokenizer, limit: int, spec: JobSpec) -> EncodedRows:
    """A row is its text, or a mapping of the columns its prompt is rendered from (see
    tokenmill.prompts.prompt_inputs). Only the text is ever cut: the rest of the prompt (the
    template, other columns' values) is what the row's text gets room beside."""
    if rows and isinstance(rows[0], dict) and "messages" in rows[0]:
        return _encode_chats([r["messages"] for r in rows], tokenizer, limit, spec)
    texts = [r[TEXT] if isinstance(r, dict) else r for r in rows]
    values = [r if isinstance(r, dict) else {} for r in rows]
    overhead = len(_render_prompts([""], tokenizer, spec, [{}])[0])
    if limit - overhead < 1:
        raise ValueError(f"the prompt template alone takes {overhead} tokens; the input limit is {limit}")
    if any(values):  # other columns' values vary the prompt's own length, row by row
        overheads = [len(ids) for ids in _render_prompts([""] * len(rows), tokenizer, spec, values)]
    else:
        overheads = [overhead] * len(rows)
    rooms = [limit - o for o in overheads]
    text_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    truncated = [len(ids) > room for ids, room in zip(text_ids, rooms)]
    overlong = [(i, f"the prompt without its text takes {overheads[i]} tokens; the input limit is {limit}")
                for i, room in enumerate(rooms) if room < 1]
    if spec.overlong == "reject":
        overlong += [(i, (f"input has {len(ids)} tokens; at most {room} fit beside the prompt and "
                          f"max_tokens={spec.generation.max_tokens}"))
                     for i, (ids, room) in enumerate(zip(text_ids, rooms)) if len(ids) > room >= 1]
        truncated = [False] * len(texts)
    else:
        # re-joining cut tokens can merge into slightly different tokens; keep a margin
        texts = [tokenizer.decode(ids[: max(room - 8, 1)]) if cut else text
                 for text, ids, cut, room in zip(texts, text_ids, truncated, rooms)]
        dropped = {i for i, _ in overlong}
        truncated = [cut and i not in dropped for i, cut in enumerate(truncated)]
    token_ids = _render_prompts(texts, tokenizer, spec, values) if texts else []
    return EncodedRows(token_ids=token_ids, truncated=truncated, overlong=sorted(overlong))


def _encode_chats(chats: list[list[dict]], tokenizer, limit: int, spec: JobSpec) -> EncodedRows:
    """Rows that carry their own chat have no text column to cut: a too-long chat is refused."""
    rendered = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False)
    token_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    overlong = [(i, (f"the chat has {len(ids)} tokens; at most {limit} fit beside max_tokens="
                     f"{spec.generation.max_tokens} (a messages column is never cut)"))
                for i, ids in enumerate(token_ids) if len(ids) > limit]
    return EncodedRows(token_ids=token_ids, truncated=[False] * len(chats), overlong=overlong)


def _render_prompts(texts: list[str], tokenizer, spec: JobSpec, values: list[dict]) -> list[list[int]]:
    params = spec.generation
    column = spec.text_column
    if params.messages is None:
        prompts = [fill(params.prompt_template, text, row, column) for text, row in zip(texts, values)]
        return tokenizer(prompts, add_special_tokens=True)["input_ids"]
    conversations = [
        [{"role": m.role, "content": fill(m.content, text, row, column)} for m in params.messages]
        for text, row in zip(texts, values)
    ]
    rendered = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
