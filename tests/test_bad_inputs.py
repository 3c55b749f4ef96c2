"""Each kind of bad input ends in a clear error naming the file (and row), or in rejects; never in
a bare traceback or a silently dropped row. Flow-level cases (duplicate ids across shards, empty
files beside good ones) are in test_flow.py."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TEST_EMBED_MODEL, write_parquet
from tokenmill.errors import InputError
from tokenmill.runner import run_shard
from tokenmill.shards import discover_shards, read_shard
from tokenmill.spec import JobSpec
from tokenmill.resolution import resolve_job


def spec_for(tmp_path, input_path, **overrides) -> JobSpec:
    fields = dict(input=str(input_path), output=str(tmp_path / "out"), mode="embed", model=TEST_EMBED_MODEL)
    return JobSpec.model_validate({**fields, **overrides})


def test_a_corrupt_parquet_file_is_an_error_naming_it(tmp_path):
    write_parquet(tmp_path / "good.parquet", ["a"], ["text"])
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])  # an upload that stopped half way
    with pytest.raises(InputError, match=r"cut\.parquet: not a readable Parquet file"):
        discover_shards(str(tmp_path))
    (tmp_path / "cut.parquet").write_bytes(b"this is not parquet at all, just text " * 20)
    with pytest.raises(InputError, match=r"cut\.parquet: not a readable Parquet file"):
        discover_shards(str(tmp_path))


def test_a_parquet_file_with_corrupt_pages_is_an_error_naming_it(tmp_path):
    path = tmp_path / "pages.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(2000)], "text": [f"row {i} " * 20 for i in range(2000)]}),
                   path, compression="zstd", row_group_size=1000)
    (shard,) = discover_shards(str(path), max_shard_rows=5000)
    data = bytearray(path.read_bytes())
    for offset in range(200, 4000):  # the first row group's data pages; the footer stays intact
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"pages\.parquet: cannot read Parquet row groups \[0, 1\]"):
        read_shard(shard, ["id", "text"])


def test_an_empty_parquet_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.parquet: file is empty \(0 bytes\)"):
        discover_shards(str(tmp_path))


def test_files_with_zero_rows_get_an_empty_shard_so_the_manifest_counts_them(tmp_path):
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}),
                   tmp_path / "none.parquet")
    (tmp_path / "none.jsonl").write_bytes(b"")
    shards = discover_shards(str(tmp_path))
    assert [(s.uri.rsplit("/", 1)[-1], s.is_empty) for s in shards] == [("none.jsonl", True), ("none.parquet", True)]
    for shard in shards:
        table, bad = read_shard(shard, ["id", "text"])
        assert table.num_rows == 0 and bad == []
    # the empty Parquet file still has to fit the job: its columns are checked like any other's
    empty_parquet = next(s for s in shards if s.format == "parquet")
    with pytest.raises(InputError, match=r"none\.parquet, column 'body': required column is missing"):
        run_shard(empty_parquet, resolve_job(spec_for(tmp_path, tmp_path, text_column="body")))


def test_a_missing_column_is_an_error_naming_file_and_column(tmp_path):
    lines = [json.dumps({"id": f"j{i}", "body": "text"}) for i in range(3)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (shard,) = discover_shards(str(tmp_path))
    # the file's own columns, not only those the job's read took
    with pytest.raises(InputError, match=r"docs\.jsonl, column 'text': required column is missing "
                                         r"\(columns found: id, body\)"):
        run_shard(shard, resolve_job(spec_for(tmp_path, tmp_path)))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.parquet"))
    # the prediction's and the gate's sample of the corpus say the same (a first read with too few columns
    # said `columns found: text` of a file that also had `doc_id`)
    from tokenmill.sampling import corpus_sample

    pq.write_table(pa.table({"doc_id": ["a", "b"], "text": ["x", "y"]}), tmp_path / "ids.parquet")
    (tmp_path / "docs.jsonl").unlink()
    with pytest.raises(InputError, match=r"ids\.parquet, column 'id': required column is missing "
                                         r"\(columns found: doc_id, text\); the job names it in id_column"):
        corpus_sample(spec_for(tmp_path, tmp_path), 2)


def test_a_wrong_column_type_is_an_error_naming_file_and_column(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b"], "text": [1.5, 2.5]}), tmp_path / "floats.parquet")
    (shard,) = discover_shards(str(tmp_path))
    with pytest.raises(InputError, match=r"floats\.parquet, column 'text': text column has type double"):
        run_shard(shard, resolve_job(spec_for(tmp_path, tmp_path)))
    pq.write_table(pa.table({"id": [[1], [2]], "text": ["x", "y"]}), tmp_path / "floats.parquet")
    (shard,) = discover_shards(str(tmp_path))
    with pytest.raises(InputError, match=r"floats\.parquet, column 'id': id column has type list"):
        run_shard(shard, resolve_job(spec_for(tmp_path, tmp_path)))


def test_a_jsonl_line_that_is_not_utf8_is_a_reject_at_its_byte_offset(tmp_path):
    good = json.dumps({"id": "ok", "text": "fine"}).encode() + b"\n"
    bad = b'{"id": "latin1", "text": "caf\xe9"}\n'
    (tmp_path / "mixed.jsonl").write_bytes(good + bad + good.replace(b'"ok"', b'"ok2"'))
    (shard,) = discover_shards(str(tmp_path))
    table, bad_rows = read_shard(shard, ["id", "text"])
    assert table.column("id").to_pylist() == ["ok", "ok2"]
    ((offset, reason),) = bad_rows
    assert offset == len(good) and reason.startswith("line is not valid UTF-8")


def test_a_jsonl_line_that_is_not_an_object_is_a_reject_at_its_byte_offset(tmp_path):
    lines = [b'{"id": "a", "text": "x"}', b'["a", "list"]', b"42", b'{"id": "b", "text": "y"}', b"{broken"]
    (tmp_path / "shapes.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (shard,) = discover_shards(str(tmp_path))
    table, bad_rows = read_shard(shard, ["id", "text"])
    assert table.column("id").to_pylist() == ["a", "b"]
    offsets = [sum(len(line) + 1 for line in lines[:i]) for i in (1, 2, 4)]
    assert [offset for offset, _ in bad_rows] == offsets
    assert [reason for _, reason in bad_rows] == [
        "line is a JSON list, not an object", "line is a JSON int, not an object",
        "line is not valid JSON (Expecting property name enclosed in double quotes at column 2)"]


@pytest.mark.engine
def test_a_document_far_longer_than_the_context_is_truncated_or_rejected(tmp_path):
    huge = "tokens " * 200_000  # about 200k tokens against MiniLM's 256
    write_parquet(tmp_path / "huge.parquet", ["small", "huge"], ["a short one", huge])
    (shard,) = discover_shards(str(tmp_path))
    result = run_shard(shard, resolve_job(spec_for(tmp_path, tmp_path)))
    output = pq.read_table(tmp_path / "out" / f"{shard.shard_id}.parquet").to_pydict()
    assert output["id"] == ["small", "huge"] and output["truncated"] == [False, True]
    assert output["input_tokens"][1] == 256 and result.rows_truncated == 1

    rejected = run_shard(shard, resolve_job(spec_for(tmp_path, tmp_path, overlong="reject", output=str(tmp_path / "out2"))))
    (reject,) = pq.read_table(tmp_path / "out2" / "_rejects").to_pylist()
    assert reject["id"] == "huge" and reject["row"] == 1 and reject["file"].endswith("huge.parquet")
    assert "the model takes at most 256" in reject["reason"]
    assert (rejected.rows_in, rejected.rows_out, rejected.rows_rejected) == (2, 1, 1)
