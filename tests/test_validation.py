import pyarrow as pa
import pytest

from tokenmill.errors import InputError
from tokenmill.schema import validate_rows
from tokenmill.shards import ROW_NUMBER


def table(ids, texts):
    return pa.table({"id": ids, "text": texts, ROW_NUMBER: pa.array(range(len(ids)), pa.int64())})


def test_row_errors_go_to_rejects_with_reasons():
    rows = table(["a", "b", None, "a", "c", "d"], ["ok", None, "no id", "dup", "   ", "fine"])
    result = validate_rows(rows, "file.parquet", "id", "text")
    assert result.valid.column("id").to_pylist() == ["a", "d"]
    reasons = {row: reason for row, _, reason in result.rejects}
    assert reasons[1] == "text is null"
    assert reasons[2] == "id is null"
    assert reasons[3].startswith("duplicate id")
    assert reasons[4] == "text is empty or whitespace"
    assert len(result.valid) + len(result.rejects) == len(rows)


def test_integer_ids_are_fine():
    result = validate_rows(table([1, 2, 3], ["x", "y", "z"]), "f", "id", "text")
    assert result.rejects == [] and result.valid.num_rows == 3


def test_missing_column_fails_naming_file_and_column():
    with pytest.raises(InputError) as error:
        validate_rows(pa.table({"id": ["a"], "body": ["x"], ROW_NUMBER: [0]}), "s3://b/part-1.parquet", "id", "text")
    message = str(error.value)
    assert "s3://b/part-1.parquet" in message and "'text'" in message and "body" in message


def test_wrong_type_fails_naming_file_and_column():
    with pytest.raises(InputError, match=r"f\.parquet, column 'text'.*int64"):
        validate_rows(pa.table({"id": ["a"], "text": [3], ROW_NUMBER: [0]}), "f.parquet", "id", "text")
    with pytest.raises(InputError, match=r"column 'id'.*double"):
        validate_rows(pa.table({"id": [1.5], "text": ["x"], ROW_NUMBER: [0]}), "f.parquet", "id", "text")


def test_a_jsonl_shard_with_no_readable_line_rejects_rows_instead_of_failing(tmp_path):
    from tokenmill.shards import discover_shards, read_shard

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"[1]\n\"just a string\"\n")
    (shard,) = discover_shards(str(path))
    table, unreadable = read_shard(shard, ["id", "text"])
    result = validate_rows(table, shard.uri, "id", "text")
    assert result.valid.num_rows == 0 and len(unreadable) == 2
