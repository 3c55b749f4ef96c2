import json

import pytest

from conftest import write_parquet
from tokenmill.errors import InputError
from tokenmill.shards import ROW_NUMBER, discover_shards, read_shard


def test_parquet_shards_follow_row_groups_under_the_cap(tmp_path):
    write_parquet(tmp_path / "a.parquet", [f"a{i}" for i in range(1000)], ["x"] * 1000, row_group_size=100)
    shards = discover_shards(str(tmp_path), max_shard_rows=250)
    assert [(s.row_start, s.row_end) for s in shards] == [(0, 200), (200, 400), (400, 600), (600, 800), (800, 1000)]
    assert all(len(s.row_groups) == 2 for s in shards)


def test_a_row_group_over_the_cap_is_cut_by_row_range(tmp_path):
    write_parquet(tmp_path / "big.parquet", list(range(1000)), ["x"] * 1000, row_group_size=1000)
    shards = discover_shards(str(tmp_path / "big.parquet"), max_shard_rows=300)
    assert [(s.row_start, s.row_end) for s in shards] == [(0, 300), (300, 600), (600, 900), (900, 1000)]
    rows = []
    for shard in shards:
        table, bad = read_shard(shard, ["id", "text"])
        assert bad == []
        rows += table.column("id").to_pylist()
        assert table.column(ROW_NUMBER).to_pylist() == list(range(shard.row_start, shard.row_end))
    assert rows == list(range(1000))


def test_reading_all_parquet_shards_returns_every_row_once_in_order(tmp_path):
    for name in ("p0", "p1"):
        write_parquet(tmp_path / f"{name}.parquet", [f"{name}-{i}" for i in range(537)], ["t"] * 537,
                      row_group_size=64)
    shards = discover_shards(str(tmp_path), max_shard_rows=200)
    ids = [i for s in shards for i in read_shard(s, ["id"])[0].column("id").to_pylist()]
    assert ids == [f"p0-{i}" for i in range(537)] + [f"p1-{i}" for i in range(537)]


def test_jsonl_byte_ranges_start_and_end_on_line_boundaries(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": i, "text": "word " * (i % 37 + 1)}) for i in range(3000)]
    path.write_text("\n".join(lines) + "\n")
    shards = discover_shards(str(path), max_shard_bytes=16 * 1024)
    assert len(shards) > 5
    assert shards[0].byte_start == 0 and shards[-1].byte_end == path.stat().st_size
    for before, after in zip(shards, shards[1:]):
        assert before.byte_end == after.byte_start
    ids = []
    for shard in shards:
        table, bad = read_shard(shard, ["id", "text"])
        assert bad == []
        ids += table.column("id").to_pylist()
    assert ids == list(range(3000))


def test_shard_ids_and_fingerprints_are_stable_and_track_content(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", ["x", "y"], ["one", "two"])
    first = discover_shards(str(tmp_path))
    again = discover_shards(str(tmp_path))
    assert [s.shard_id for s in first] == [s.shard_id for s in again]
    assert [s.fingerprint for s in first] == [s.fingerprint for s in again]
    write_parquet(path, ["x", "y", "z"], ["one", "two", "three"])
    changed = discover_shards(str(tmp_path))
    assert changed[0].fingerprint != first[0].fingerprint


def test_directories_skip_hidden_and_underscore_entries_and_globs_work(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["1"], ["t"])
    (tmp_path / "_rejects").mkdir()
    write_parquet(tmp_path / "_rejects" / "r.parquet", ["2"], ["t"])
    (tmp_path / "b.jsonl").write_text('{"id": "3", "text": "t"}\n')
    assert [s.format for s in discover_shards(str(tmp_path))] == ["parquet", "jsonl"]
    assert [s.format for s in discover_shards(str(tmp_path / "*.jsonl"))] == ["jsonl"]


def test_missing_input_names_the_path(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        discover_shards(str(tmp_path / "nope"))


def test_unknown_extension_asks_for_a_format(tmp_path):
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(InputError, match="data.txt.*format"):
        discover_shards(str(tmp_path / "data.txt"))


def test_corrupt_parquet_names_the_file(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match="broken.parquet.*not a readable Parquet file"):
        discover_shards(str(tmp_path))


def test_bad_jsonl_lines_are_reported_with_their_byte_offset(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = b'{"id": "a", "text": "fine"}\n'
    path.write_bytes(good + b'{"id": "b", "text": "caf\xe9"}\n' + b"[1, 2]\n" + b"{not json\n" + good)
    (shard,) = discover_shards(str(path))
    table, bad = read_shard(shard, ["id", "text"])
    assert table.num_rows == 2
    offsets = [offset for offset, _ in bad]
    assert offsets[0] == len(good)
    reasons = " | ".join(reason for _, reason in bad)
    assert "not valid UTF-8" in reasons and "not an object" in reasons and "not valid JSON" in reasons


def test_a_remote_corpus_is_planned_once_a_process_and_a_rewritten_file_again(tmp_path, s3_server, monkeypatch):
    """A command lists its corpus several times before its flow (trials, prediction, flow): on an object store
    each file's footer is read once a process, its files planned concurrently in their order; a file rewritten
    since (a new etag, the same size) is planned again, and one added since is found, in a subfolder too (the
    store's listing kept by the process's filesystem once raised FileNotFoundError on it)."""
    import io
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    import tokenmill.shards as shards

    monkeypatch.setattr(shards, "_plans", {})  # this test's plans only
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("plans")

    def put(name: str, rows: int, word: str = "some") -> None:
        buffer = io.BytesIO()
        pq.write_table(pa.table({"id": [f"{name}-{j}" for j in range(rows)], "text": [f"{word} words"] * rows}),
                       buffer, row_group_size=10, compression="none", use_dictionary=False)
        fs.pipe(f"plans/in/{name}.parquet", buffer.getvalue())

    names = [f"part-{i:02d}" for i in range(11)] + ["sub/part-00"]
    for name in names:
        put(name, 20)
    footers, threads = [], set()
    real = shards._parquet_metadata

    def read_footer(fs, path, uri):
        footers.append(path)
        threads.add(threading.current_thread().name.split("_")[0])
        return real(fs, path, uri)

    monkeypatch.setattr(shards, "_parquet_metadata", read_footer)
    plan = lambda: discover_shards("s3://plans/in", max_shard_rows=10,  # noqa: E731
                                   storage_options={"endpoint_url": s3_server})
    first = plan()
    assert len(footers) == 12 and threads == {"tokenmill-plan"}  # planned on the pool's threads
    assert [s.shard_id for s in first] == [f"{n.replace('/', '_')}.parquet.r{r:09d}-{r + 10:09d}" for n in names
                                            for r in (0, 10)]  # the files' order, each file's pieces in order
    assert plan() == first and len(footers) == 12  # kept: no footer read again
    size = fs.info("plans/in/part-05.parquet")["size"]
    put("part-05", 20, word="more")  # rewritten: a new etag, the same size
    put("sub/part-00", 20, word="more")  # rewritten in a subfolder
    put("sub/part-01", 10)  # added in a subfolder
    assert fs.info("plans/in/part-05.parquet", refresh=True)["size"] == size
    third = plan()
    changed = ("part-05.parquet", "sub/part-00.parquet", "sub/part-01.parquet")
    assert sorted(footers[12:]) == [f"plans/in/{name}" for name in sorted(changed)]
    assert [s.fingerprint for s in third if s.uri.endswith(changed[0])] != \
        [s.fingerprint for s in first if s.uri.endswith(changed[0])]  # its new version, not the plan kept
    assert [s.shard_id for s in third][-1] == "sub_part-01.parquet.r000000000-000000010"
    assert [s for s in third if not s.uri.endswith(changed)] == [s for s in first if not s.uri.endswith(changed)]
