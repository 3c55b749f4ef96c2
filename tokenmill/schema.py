"""Validate a shard's rows with pandera.

Two kinds of bad input, treated differently:
- structural (a column missing or of the wrong type): the whole job is misconfigured
  or pointed at the wrong data, so it fails, naming the file and the column;
- row-level (null or empty text, null or duplicate id): those rows go to rejects with
  a reason, and the rest of the shard runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pandera.pandas as pa_schema
import pyarrow as pa

from tokenmill.errors import InputError
from tokenmill.shards import ROW_NUMBER

REASONS = {
    "not_nullable": "{column} is null",
    "field_uniqueness": "duplicate id (an earlier row in this shard has it)",
    "text_not_blank": "text is empty or whitespace",
    "text_is_string": "text is not a string",
    "id_is_scalar": "id is not a string or integer",
}


@dataclass
class ValidatedRows:
    valid: pa.Table  # the columns read, ROW_NUMBER included
    rejects: list[tuple[int, object, str]]  # (row number, id, reason)


def check_structure(table: pa.Table, uri: str, id_column: str, text_column: str | None) -> None:
    for column in (id_column, text_column) if text_column else (id_column,):
        if column not in table.column_names:
            found = ", ".join(c for c in table.column_names if c != ROW_NUMBER) or "none"
            raise InputError(uri, f"required column is missing (columns found: {found})", column=column)
    id_type = table.schema.field(id_column).type
    # null type: no row of this shard has a value (or none was readable); rows decide, not the schema
    if not (pa.types.is_integer(id_type) or pa.types.is_string(id_type) or pa.types.is_large_string(id_type)
            or pa.types.is_null(id_type)):
        raise InputError(uri, f"id column has type {id_type}; expected a string or integer", column=id_column)
    if text_column is None:  # rows whose prompt is their own chat (generation.messages_column)
        return
    text_type = table.schema.field(text_column).type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type) or pa.types.is_null(text_type)):
        raise InputError(uri, f"text column has type {text_type}; expected a string", column=text_column)


def _row_schema(id_column: str, text_column: str | None) -> pa_schema.DataFrameSchema:
    columns = {
        id_column: pa_schema.Column(
            nullable=False,
            unique=True,
            report_duplicates="exclude_first",
            checks=pa_schema.Check(
                lambda s: s.map(lambda v: isinstance(v, (str, int))), element_wise=False, name="id_is_scalar"
            ),
        ),
        text_column: pa_schema.Column(
            nullable=False,
            checks=[
                pa_schema.Check(lambda s: s.map(lambda v: isinstance(v, str)), name="text_is_string"),
                pa_schema.Check(
                    lambda s: s.map(lambda v: not isinstance(v, str) or bool(v.strip())),
                    name="text_not_blank",
                ),
            ],
        ),
    }
    if text_column is None:
        del columns[None]
    return pa_schema.DataFrameSchema(columns, coerce=False)


def validate_rows(table: pa.Table, uri: str, id_column: str, text_column: str | None) -> ValidatedRows:
    """text_column None: rows need no text (their prompt is a messages column), only a good id."""
    check_structure(table, uri, id_column, text_column)
    frame = pd.DataFrame(
        {
            column: pd.Series(table.column(column).to_pylist(), dtype=object)
            for column in ((id_column, text_column) if text_column else (id_column,))
        }
    )
    reasons: dict[int, str] = {}
    try:
        _row_schema(id_column, text_column).validate(frame, lazy=True)
    except pa_schema.errors.SchemaErrors as errors:
        for case in errors.failure_cases.itertuples(index=False):
            if pd.isna(case.index):
                raise InputError(uri, f"validation failed: {case.check}", column=case.column) from errors
            position = int(case.index)
            reason = _reason(str(case.check), str(case.column))
            reasons.setdefault(position, reason)  # first reason found is enough to act on
    row_numbers = table.column(ROW_NUMBER).to_pylist()
    ids = frame[id_column].tolist()
    rejects = [(row_numbers[i], ids[i], reasons[i]) for i in sorted(reasons)]
    keep = pa.array([i not in reasons for i in range(table.num_rows)], pa.bool_())
    valid = table.filter(keep)
    return ValidatedRows(valid, rejects)


def _reason(check: str, column: str) -> str:
    for key, template in REASONS.items():
        if key in check:
            return template.format(column=column)
    return f"{column} failed check {check}"
