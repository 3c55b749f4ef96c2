"""Prompts from a row's columns: which columns a job reads, checks that they exist before any
engine starts, row-level checks (a null value a template needs), and the rendering of one row's
prompt with `{column}` placeholders filled.

`{text}` always means the row's text column (text_column), whatever it is called; any other
`{name}` is the column of that name. A placeholder is a name in braces (letters, digits, _);
other braces (a JSON example in a few-shot turn) are left alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from tokenmill.errors import InputError
from tokenmill.shards import ROW_NUMBER, ShardSpec, read_shard
from tokenmill.spec import JobSpec

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEXT = "text"  # the placeholder that always means the row's text column
# Output columns a passthrough column may not shadow.
OUTPUT_COLUMNS = ("id", "embedding", "output_text", "parsed", "structured_error", "input_tokens",
                  "output_tokens", "truncated", "finish_reason", "logprobs")


def template_columns(spec: JobSpec) -> list[str]:
    """Input columns named by the job's placeholders, `{text}` read as the text column, in order."""
    params = spec.generation
    if spec.mode != "generate" or params.messages_column:
        return []
    texts = [m.content for m in params.messages] if params.messages is not None else [params.prompt_template]
    names: list[str] = []
    for text in texts:
        for name in PLACEHOLDER.findall(text):
            column = spec.text_column if name == TEXT else name
            if column not in names:
                names.append(column)
    return names


def prompt_columns(spec: JobSpec) -> list[str]:
    """Columns a prompt is rendered from besides the text column."""
    return [c for c in template_columns(spec) if c != spec.text_column]


def passthrough_columns(spec: JobSpec, available: Sequence[str]) -> list[str]:
    """The input columns copied to the output, in the order asked (or the input's, for 'all')."""
    if spec.passthrough_columns == "all":
        return [c for c in available if c not in (spec.id_column, ROW_NUMBER)]
    return [c for c in spec.passthrough_columns if c != spec.id_column]


def text_column_used(spec: JobSpec) -> str | None:
    """The column every row must have as non-empty text: the text column, or none for a messages column."""
    if spec.mode == "generate" and spec.generation.messages_column:
        return None
    return spec.text_column


def read_columns(spec: JobSpec) -> list[str] | None:
    """Columns a shard read takes; None reads every column (passthrough_columns: all)."""
    if spec.passthrough_columns == "all":
        return None
    wanted = [spec.id_column, text_column_used(spec), *prompt_columns(spec), *spec.passthrough_columns]
    if spec.mode == "generate":
        wanted.append(spec.generation.messages_column)
    columns: list[str] = []
    for column in wanted:
        if column and column not in columns:
            columns.append(column)
    return columns


def check_columns(available: Sequence[str], uri: str, spec: JobSpec) -> None:
    """Every column the job names exists in the input: an InputError naming the first missing one
    (with the columns there are, and a likely intended name)."""
    needed = [("id_column", spec.id_column)]
    text = text_column_used(spec)
    if text:
        needed.append(("text_column", text))
    if spec.mode == "generate" and spec.generation.messages_column:
        needed.append(("generation.messages_column", spec.generation.messages_column))
    needed += [("a {placeholder} of the prompt", c) for c in prompt_columns(spec)]
    if spec.passthrough_columns != "all":
        needed += [("passthrough_columns", c) for c in spec.passthrough_columns]
    present = [c for c in available if c != ROW_NUMBER]
    for where, column in needed:
        if column not in present:
            hint = _closest(column, present)
            raise InputError(uri, f"required column is missing (columns found: {', '.join(present) or 'none'}); "
                             f"the job names it in {where}" + (f"; did you mean {hint!r}?" if hint else ""),
                             column=column)
    for column in passthrough_columns(spec, present):
        if column in OUTPUT_COLUMNS:
            raise InputError(uri, f"passthrough column {column!r} has the name of an output column", column=column)


def _closest(name: str, names: Sequence[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return found[0] if found else None


def input_column_names(shard: ShardSpec, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The columns of a shard's file: the Parquet schema, or the keys of a JSONL file's first rows."""
    from tokenmill.storage import retry_io, url_to_fs

    fs, path = url_to_fs(shard.uri, storage_options)
    if shard.format == "parquet":
        import pyarrow.parquet as pq

        def names() -> list[str]:
            with fs.open(path, "rb") as handle:
                return list(pq.ParquetFile(handle).schema_arrow.names)
        return retry_io(names, f"reading the schema of {shard.uri}")

    def head() -> bytes:
        with fs.open(path, "rb") as handle:
            handle.seek(shard.byte_start)
            return handle.read(min(shard.byte_end - shard.byte_start, 1 << 20))
    keys: list[str] = []
    for line in head().split(b"\n")[:100]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            keys += [k for k in record if k not in keys]
    return keys


def check_job_inputs(spec: JobSpec, shards: Sequence[ShardSpec]) -> None:
    """Before any engine starts: every input file has every column the job names (an InputError naming
    the column), and the response format can be read and compiled (a ConfigError)."""
    if spec.mode == "generate":
        from tokenmill.generation import check_response_format

        check_response_format(spec.generation)
    # an OpenAI Batch file has no columns: each line is checked as a request when its shard runs
    check_job_columns(spec, [s for s in shards if not s.is_empty and s.format != "openai-batch"])


def check_job_columns(spec: JobSpec, shards: Sequence[ShardSpec]) -> None:
    """The first shard of each input file has every column the job names."""
    seen: set[str] = set()
    for shard in shards:
        if shard.uri in seen:
            continue
        seen.add(shard.uri)
        check_columns(input_column_names(shard, spec.storage_options), shard.uri, spec)


def row_rejects(valid: pa.Table, spec: JobSpec) -> dict[int, str]:
    """Rows (positions in `valid`) a prompt cannot be made from, with the reason: a null value a
    placeholder needs, a messages column that is not a list of {role, content}."""
    reasons: dict[int, str] = {}
    for column in prompt_columns(spec):
        for i, value in enumerate(valid.column(column).to_pylist()):
            if value is None:
                reasons.setdefault(i, f"{column} is null (the prompt's {{{column}}})")
    if spec.mode == "generate" and spec.generation.messages_column:
        column = spec.generation.messages_column
        for i, value in enumerate(valid.column(column).to_pylist()):
            problem = _chat_problem(value)
            if problem:
                reasons.setdefault(i, f"{column} {problem}")
    return reasons


def prompt_inputs(valid: pa.Table, spec: JobSpec) -> list:
    """What encode_rows takes for each row: its text (the plain case), or a mapping of the columns
    its prompt is rendered from (other template columns, or a messages column)."""
    if spec.mode == "generate" and spec.generation.messages_column:
        return [{"messages": _chat(v)} for v in valid.column(spec.generation.messages_column).to_pylist()]
    texts = valid.column(spec.text_column).to_pylist()
    others = prompt_columns(spec)
    if not others:
        return texts
    values = {c: valid.column(c).to_pylist() for c in others}
    return [{TEXT: text, **{c: values[c][i] for c in others}} for i, text in enumerate(texts)]


def fill(template: str, text: str, values: dict[str, Any], text_column: str) -> str:
    """One template with the row's values in: `{text}` and `{<text_column>}` get the text."""
    def value(match: re.Match) -> str:
        name = match.group(1)
        if name in (TEXT, text_column):
            return text
        if name in values:
            return _as_text(values[name])
        return match.group(0)
    return PLACEHOLDER.sub(value, template)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _chat(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        value = json.loads(value)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _chat_problem(value: Any) -> str | None:
    if value is None:
        return "is null"
    try:
        chat = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return "is not JSON"
    if not isinstance(chat, list) or not chat:
        return "is not a non-empty list of {role, content} messages"
    for message in chat:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return "has a message that is not {role: string, content: string}"
    return None


def read_job_rows(shard: ShardSpec, spec: JobSpec) -> tuple[Any, list[tuple[int, str]], int]:
    """A shard's rows as a job reads them, only the columns it names (read_columns), validated
    (validate_job_rows): (the validated rows, the lines it could not read with their reasons, the rows in).
    A column the job names that the file lacks is reported with the file's own columns, not only those
    this read took (`columns found: text`, where the file also had `doc_id`)."""
    columns = read_columns(spec)
    table, unreadable = read_shard(shard, columns, spec.storage_options)
    if columns is not None and not set(columns) <= set(table.column_names):
        check_columns(input_column_names(shard, spec.storage_options), shard.uri, spec)
    return validate_job_rows(table, shard.uri, spec), unreadable, table.num_rows + len(unreadable)


def validate_job_rows(table: pa.Table, uri: str, spec: JobSpec):
    """tokenmill.schema.validate_rows for the job's columns: every named column present (else an
    InputError naming it), then rows refused with a reason: a bad id or text, a null value a
    placeholder needs, a messages column that is not a chat."""
    from tokenmill.schema import ValidatedRows, validate_rows

    check_columns(table.column_names, uri, spec)
    validated = validate_rows(table, uri, spec.id_column, text_column_used(spec))
    reasons = row_rejects(validated.valid, spec)
    if not reasons:
        return validated
    valid = validated.valid
    row_numbers = valid.column(ROW_NUMBER).to_pylist()
    ids = valid.column(spec.id_column).to_pylist()
    rejects = validated.rejects + [(row_numbers[i], ids[i], reasons[i]) for i in sorted(reasons)]
    keep = pa.array([i not in reasons for i in range(valid.num_rows)], pa.bool_())
    return ValidatedRows(valid.filter(keep), sorted(rejects, key=lambda r: r[0]))


def prefix_order(token_ids: Sequence[Sequence[int]]) -> list[int]:
    """Row positions with rows that share a prompt prefix next to each other (sorted by their token
    ids), so an engine with a prefix cache computes each shared prefix (a system prompt, few-shot
    turns) once while it is still cached. Ties keep input order."""
    return sorted(range(len(token_ids)), key=lambda i: token_ids[i])
