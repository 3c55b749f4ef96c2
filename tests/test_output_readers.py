"""What a directory reader sees under the output root is exactly this run's output rows.

Temporary files of killed writes and the outputs of an earlier sharding of the same job
are invisible to pyarrow.dataset, pandas, duckdb (`out/*.parquet`) and polars
(`out/*.parquet`), and the next run clears them away. Real batch flows with the
transformers engine (no vLLM) on a real Prefect API.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from conftest import write_parquet
from tokenmill.flows.batch import batch_flow
from tokenmill.outputs import TEMP_DIR, OutputStore, remove_leftover_temporaries, writer_name

REPO = Path(__file__).resolve().parents[1]
MODEL = {"name": "all-MiniLM-L6-v2", "engine": "transformers"}


@pytest.fixture(scope="module", autouse=True)
def prefect_server(prefect_api):  # the session's API (tests/conftest.py)
    yield


def a_ids():
    return [f"a{i:02d}" for i in range(45)]


@pytest.fixture
def corpus(tmp_path):
    """a: 45 rows in row groups of 5, one null text; b: 12 rows, one id that a has too."""
    root = tmp_path / "corpus"
    root.mkdir()
    texts = [f"document {i} is about {'trains' if i % 2 else 'boats'}" for i in range(45)]
    texts[7] = None
    write_parquet(root / "a.parquet", a_ids(), texts, row_group_size=5)
    b_ids = [f"b{i:02d}" for i in range(11)] + ["a03"]
    write_parquet(root / "b.parquet", b_ids, [f"note {i} on ships" for i in range(12)], row_group_size=4)
    return root


def expected_ids(files=("a", "b")):
    ids = set()
    if "a" in files:
        ids |= set(a_ids()) - {"a07"}
    if "b" in files:
        ids |= {f"b{i:02d}" for i in range(11)}
    return ids


def manifest_of(out: Path) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def reader_ids(out: Path) -> dict[str, list]:
    return {
        "pyarrow.dataset": ds.dataset(out, format="parquet").to_table(columns=["id"]).column("id").to_pylist(),
        "pandas": pd.read_parquet(out, columns=["id"])["id"].tolist(),
        "duckdb": [row[0] for row in duckdb.sql(f"select id from read_parquet('{out}/*.parquet')").fetchall()],
        "polars": pl.read_parquet(f"{out}/*.parquet", columns=["id"])["id"].to_list(),
    }


def assert_readers_see_exactly(out: Path, ids: set[str]) -> None:
    """Every reader sees the manifest's rows_out rows, each id once, and the rejects add up."""
    manifest = manifest_of(out)
    totals = manifest["totals"]
    assert manifest["complete"]
    assert totals["rows_in"] == totals["rows_out"] + totals["rows_rejected"]
    assert totals["rows_out"] == len(ids)
    assert ds.dataset(out, format="parquet").count_rows() == totals["rows_out"]
    for reader, seen in reader_ids(out).items():
        assert len(seen) == totals["rows_out"], reader
        assert set(seen) == ids, reader
    assert pq.read_table(out / "_rejects").num_rows == totals["rows_rejected"]


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


@pytest.fixture
def spec(embed_spec, corpus):
    def make(max_shard_rows=20, **overrides):
        return embed_spec(corpus, model=MODEL, batching={"max_shard_rows": max_shard_rows}, **overrides)
    return make


def test_leftovers_of_the_old_temporary_names_are_removed_by_the_next_run(tmp_path, spec):
    batch_flow(spec())
    out = tmp_path / "out"
    assert files_under(out / TEMP_DIR) == []  # every write of the run was renamed into place
    first, second = sorted(out.glob("*.parquet"))[:2]
    data = first.read_bytes()
    # what a run killed mid-write used to leave beside the outputs: a whole file not yet
    # renamed, and one cut short
    shutil.copy(first, out / f"{first.name}.tmp-{uuid.uuid4().hex}")
    (out / f"{second.name}.tmp-{uuid.uuid4().hex}").write_bytes(data[: len(data) // 2])
    shutil.copy(out / "_rejects" / first.name, out / "_rejects" / f"{first.name}.tmp-{uuid.uuid4().hex}")
    (out / "_shards" / f"{first.stem}.json.tmp-{uuid.uuid4().hex}").write_text("{")
    with pytest.raises(Exception):
        pd.read_parquet(out)  # the cut-short one breaks every read of the directory

    batch_flow(spec())  # every shard cached; the end of the run clears the leftovers
    assert not [p for p in files_under(out) if ".tmp-" in p.name]
    assert_readers_see_exactly(out, expected_ids())


KILLED_WRITER = r"""
import io, os, signal, sys
import pyarrow.parquet as pq
from tokenmill.outputs import OutputStore

out, target, source, stop_at = sys.argv[1:]
store = OutputStore(out)
table = pq.read_table(source)


def hold(frame, event, arg):
    # just before the data is written, or just before the rename: the process waits here
    # for the SIGKILL, as a preempted machine dies wherever it happens to be
    if event != "c_call":
        return
    if (stop_at == "replace" and arg is os.replace) or (
            stop_at == "write" and getattr(arg, "__name__", "") == "write"
            and isinstance(getattr(arg, "__self__", None), io.BufferedWriter)):
        sys.setprofile(None)
        print("holding", flush=True)
        signal.pause()


sys.setprofile(hold)
store.write_table(target, table)
print("finished", flush=True)
"""


def kill_mid_write(out: Path, target: Path, stop_at: str) -> None:
    """Rewrite a file with OutputStore in another process, SIGKILLed in the middle."""
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out), str(target), str(target), stop_at],
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.PIPE, text=True)
    line = writer.stdout.readline().strip()
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=60)
    writer.stdout.close()
    assert line == "holding", line


def test_a_write_killed_mid_way_is_never_seen_and_the_next_run_clears_it(tmp_path, spec):
    batch_flow(spec())
    out = tmp_path / "out"
    shards = [s["shard_id"] for s in manifest_of(out)["shards"]]
    before = set(files_under(out))
    kill_mid_write(out, out / f"{shards[0]}.parquet", "write")
    kill_mid_write(out, out / f"{shards[1]}.parquet", "replace")
    kill_mid_write(out, out / "_rejects" / f"{shards[0]}.parquet", "replace")
    left = set(files_under(out)) - before
    assert len(left) == 3  # the killed writes did leave their files behind...
    assert_readers_see_exactly(out, expected_ids())  # ...where no reader sees them, even now

    batch_flow(spec())
    assert set(files_under(out)) - before == set()  # their writers are gone: the next run removed them
    assert_readers_see_exactly(out, expected_ids())


def test_only_temporaries_whose_writer_is_gone_or_that_are_old_are_removed(tmp_path):
    store = OutputStore(str(tmp_path / "out"))
    temporaries = tmp_path / "out" / TEMP_DIR
    ask_name = "from tokenmill.outputs import writer_name; print(writer_name(), flush=True)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    gone = subprocess.run([sys.executable, "-c", ask_name], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", ask_name + "; import sys; sys.stdin.read()"], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live_name = live.stdout.readline().strip()
        host, namespace, pid, started = writer_name().rsplit(".", 3)
        reused_pid = f"{host}.{namespace}.{pid}.{int(started) + 1}"  # this pid, but an earlier process
        elsewhere = "some-other-host.4026531836.1234.99"
        for writer in (gone, live_name, writer_name(), reused_pid, elsewhere):
            (temporaries / writer).mkdir(parents=True)
            (temporaries / writer / "0123.x.parquet").write_bytes(b"partial")
        old = temporaries / elsewhere / "4567.y.parquet"
        old.write_bytes(b"partial")
        two_days_ago = time.time() - 2 * 86400
        os.utime(old, (two_days_ago, two_days_ago))

        removed = remove_leftover_temporaries(store)
        assert sorted(removed) == sorted([str(temporaries / gone / "0123.x.parquet"),
                                          str(temporaries / reused_pid / "0123.x.parquet"), str(old)])
        assert sorted(p.relative_to(temporaries).as_posix() for p in files_under(temporaries)) == sorted(
            f"{w}/0123.x.parquet" for w in (live_name, writer_name(), elsewhere))
        assert not (temporaries / gone).exists() and not (temporaries / reused_pid).exists()
    finally:
        live.stdin.close()
        live.wait(timeout=60)
        live.stdout.close()
    # the live writer has ended now: its folder goes on the next clean-up, the others stay
    assert remove_leftover_temporaries(store) == [str(temporaries / live_name / "0123.x.parquet")]
    store.write_json(store.path("_manifest.json"), {"still": "writable"})
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text()) == {"still": "writable"}


def shard_of(name: str) -> str:
    """The shard a file under the output root belongs to."""
    base = name.rsplit("/", 1)[-1]
    if name.startswith("_state/"):
        return base.rsplit("-", 1)[0]
    for suffix in (".duplicates.parquet", ".parquet", ".json"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def test_outputs_of_an_earlier_sharding_move_to_stale(tmp_path, spec, corpus):
    out = tmp_path / "out"
    batch_flow(spec(max_shard_rows=20))
    first = {s["shard_id"] for s in manifest_of(out)["shards"]}
    first_files = {p.relative_to(out).as_posix() for p in files_under(out)} - {"_manifest.json"}
    assert any(name.endswith(".duplicates.parquet") for name in first_files)  # b's copy of a03

    batch_flow(spec(max_shard_rows=25))
    second = {s["shard_id"] for s in manifest_of(out)["shards"]}
    gone = first - second
    assert gone == {s for s in first if s.startswith("a.parquet")}  # b's one shard is the same at 20 and 25
    assert_readers_see_exactly(out, expected_ids())
    assert {p.stem for p in out.glob("*.parquet")} == second
    assert {p.stem for p in (out / "_shards").glob("*.json")} == second
    # the earlier shards' outputs, rejects, records and cached results, under their own names
    stale = {p.relative_to(out / "_stale").as_posix() for p in files_under(out / "_stale")}
    assert stale == {n for n in first_files if shard_of(n) in gone}
    assert {n.split("/")[0] for n in stale} >= {"_rejects", "_shards", "_state"}
    rejects = {p.name for p in (out / "_rejects").iterdir()}
    duplicates = {n for n in rejects if n.endswith(".duplicates.parquet")}
    assert rejects - duplicates == {f"{s}.parquet" for s in second}
    assert [n[: -len(".duplicates.parquet")] in second for n in duplicates] == [True]  # kept with its shard

    (corpus / "b.parquet").unlink()  # a removed input file: its shards are no longer the job's
    batch_flow(spec(max_shard_rows=25))
    assert_readers_see_exactly(out, expected_ids("a"))
    assert not [p for p in out.glob("*.parquet") if p.name.startswith("b.parquet")]
    assert not list((out / "_rejects").glob("*.duplicates.parquet"))
    b_shard = "b.parquet.r000000000-000000012"
    assert {f"{b_shard}.parquet", f"_rejects/{b_shard}.duplicates.parquet", f"_shards/{b_shard}.json"} <= {
        p.relative_to(out / "_stale").as_posix() for p in files_under(out / "_stale")}

    # back to the first sharding: its shards run again, since their outputs are stale
    record = batch_flow(spec(max_shard_rows=20))
    assert record.metrics["shards_cached"] == 0
    assert_readers_see_exactly(out, expected_ids("a"))
    assert {p.stem for p in out.glob("*.parquet")} == gone


def test_outputs_of_an_earlier_sharding_move_to_stale_on_s3(tmp_path, embed_spec, corpus, s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("readers-bucket")
    options = {"endpoint_url": s3_server}

    def run(max_shard_rows):
        batch_flow(embed_spec(corpus, model=MODEL, output="s3://readers-bucket/out", storage_options=options,
                              batching={"max_shard_rows": max_shard_rows}))
        fs.invalidate_cache()
        return json.loads(fs.cat_file("readers-bucket/out/_manifest.json"))

    first = {s["shard_id"] for s in run(20)["shards"]}
    manifest = run(25)
    second = {s["shard_id"] for s in manifest["shards"]}
    gone = first - second
    assert gone == {s for s in first if s.startswith("a.parquet")}
    totals = manifest["totals"]
    assert totals["rows_out"] == len(expected_ids())

    ids = ds.dataset("readers-bucket/out", filesystem=fs, format="parquet").to_table(columns=["id"]).column("id")
    assert ds.dataset("readers-bucket/out", filesystem=fs, format="parquet").count_rows() == totals["rows_out"]
    assert sorted(ids.to_pylist()) == sorted(expected_ids())
    pandas_ids = pd.read_parquet("s3://readers-bucket/out", columns=["id"], storage_options=options)["id"]
    assert sorted(pandas_ids) == sorted(expected_ids())
    assert pq.read_table("readers-bucket/out/_rejects", filesystem=fs).num_rows == totals["rows_rejected"]

    top = {p.rsplit("/", 1)[-1] for p in fs.ls("readers-bucket/out")}
    assert {n[: -len(".parquet")] for n in top if n.endswith(".parquet")} == second
    stale = {p[len("readers-bucket/out/_stale/"):] for p in fs.find("readers-bucket/out/_stale")}
    assert {shard_of(n) for n in stale} == gone
    assert {f"{s}.parquet" for s in gone} | {f"_rejects/{s}.parquet" for s in gone} | {
        f"_shards/{s}.json" for s in gone} <= stale
    assert len([n for n in stale if n.startswith("_state/")]) == len(gone)
