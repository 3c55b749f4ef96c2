"""What tokenmill moves from an object store, and how long its listings take: tokenmill's reads against the
store's defaults, side by side in one run, on three corpora of other shapes than the benches' (many small
Parquet objects; one large JSONL object; one large Parquet object of three columns, two read).

The store is moto's S3 server on loopback (the one the tests use), behind a relay that counts the bytes it
sends and holds each request `--latency` ms (a store's first-byte time; loopback has none). Both sides run the
library calls a `tokenmill run` makes (tokenmill.shards: discover_shards, read_shard); "the store's defaults"
is the same code with the filesystem's own read-ahead (fs.open as fsspec opens it: s3fs reads a 50 MiB block
past each read), files planned one after another, each listing planning every file again: what tokenmill did
before. A run lists its corpus 3 times before its shards run when auto's engine trials come first (the
trials' question, the trials, the prediction) and once more in the flow.

    python -m bench.s3_reads [--latency 25] [--mbps 800] [--files 200]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path

from bench import harness
from bench.relay import Relay

REPORT = harness.BENCH / "S3_READS.md"
LISTINGS = 4  # a first run with auto's trials: the trials' question, the trials, the prediction, the flow
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def _corpora(fs, bucket: str, files: int) -> dict[str, dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    random.seed(11)
    fs.mkdir(bucket)
    for i in range(files):  # many small objects: a day's partitions, a crawl's parts
        rows = random.randint(50, 400)
        texts = [" ".join(random.choices(WORDS, k=random.randint(5, 80))) for _ in range(rows)]
        buffer = io.BytesIO()
        pq.write_table(pa.table({"id": [f"{i}-{j}" for j in range(rows)], "text": texts}), buffer, row_group_size=100)
        fs.pipe(f"{bucket}/small/part-{i:04d}.parquet", buffer.getvalue())
    lines = [json.dumps({"id": f"j{i}", "text": " ".join(random.choices(WORDS, k=random.randint(20, 400)))}) + "\n"
             for i in range(2000)]
    data = "".join(lines).encode()
    fs.pipe(f"{bucket}/jsonl/big.jsonl", data * (64 * 2**20 // len(data) + 1))
    texts = [" ".join(random.choices(WORDS, k=150)) for _ in range(2000)] * 30
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": [str(i) for i in range(len(texts))], "text": texts, "title": texts}), buffer,
                   row_group_size=5000, compression="none", use_dictionary=False)
    fs.pipe(f"{bucket}/wide/big.parquet", buffer.getvalue())
    return {
        f"{files} small Parquet objects (50-400 rows each)": dict(uri=f"s3://{bucket}/small", cut={}),
        "one 64 MiB JSONL object, 16 MiB shards": dict(uri=f"s3://{bucket}/jsonl",
                                                        cut={"max_shard_bytes": 16 * 2**20}),
        f"one {len(buffer.getvalue()) / 2**20:.0f} MiB Parquet object, id and text of its 3 columns, "
        "15,000-row shards": dict(uri=f"s3://{bucket}/wide", cut={"max_shard_rows": 15_000}),
    }


@contextmanager
def _the_stores_defaults():
    """tokenmill.shards as it was: fsspec's read-ahead, files planned in series, no plan kept."""
    import tokenmill.shards as shards

    saved = shards._ranged, shards.PLAN_THREADS, shards._plan_file_once, shards.READ_WHOLE_BYTES
    shards._ranged = lambda fs, path: fs.open(path, "rb")
    shards.PLAN_THREADS, shards.READ_WHOLE_BYTES = 1, 0
    shards._plan_file_once = lambda fs, root, path, *cut: shards._plan_file(fs, root, path, *cut, fs.info(path))
    try:
        yield
    finally:
        shards._ranged, shards.PLAN_THREADS, shards._plan_file_once, shards.READ_WHOLE_BYTES = saved


def _measure(relay: Relay, corpus: dict, options: dict) -> dict[str, float]:
    import tokenmill.shards as shards

    shards._plans.clear()
    figures: dict[str, float] = {}
    relay.reset_counts()
    started = time.perf_counter()
    for _ in range(LISTINGS):
        found = shards.discover_shards(corpus["uri"], storage_options=options, **corpus["cut"])
    figures.update(list_s=time.perf_counter() - started, list_mib=relay.sent / 2**20, list_requests=relay.requests,
                   shards=len(found))
    relay.reset_counts()
    started = time.perf_counter()
    figures["rows"] = sum(shards.read_shard(s, ["id", "text"], options)[0].num_rows for s in found)
    figures.update(read_s=time.perf_counter() - started, read_mib=relay.sent / 2**20, read_requests=relay.requests)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=25.0, help="ms each request is held (default 25)")
    parser.add_argument("--mbps", type=float, default=800.0,
                        help="megabits a second a connection (default 800: ~100 MB/s, an S3 GET's order)")
    parser.add_argument("--files", type=int, default=200, help="small Parquet objects (default 200)")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(name, value)
    import s3fs
    from moto.server import ThreadedMotoServer

    info = harness.machine()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        corpora = _corpora(s3fs.S3FileSystem(endpoint_url=f"http://{host}:{port}"), "bench-s3-reads", args.files)
        relay = Relay(port, args.latency / 1000, args.mbps * 1e6 / 8).start()
        options = {"endpoint_url": relay.address}
        results = {}
        for name, corpus in corpora.items():
            with _the_stores_defaults():
                before = _measure(relay, corpus, options)
            results[name] = (before, _measure(relay, corpus, options))
            print(name, results[name], flush=True)
    finally:
        server.stop()
    args.report.write_text("\n".join(_report(info, args, results)) + "\n")
    print(f"wrote {args.report}")
    return 0


def _report(info: dict, args: argparse.Namespace, results: dict) -> list[str]:
    from tokenmill.shards import PLAN_THREADS

    rows = []
    for name, (before, after) in results.items():
        assert before["rows"] == after["rows"] and before["shards"] == after["shards"], name  # the same work
        for what, unit in (("list", f"{LISTINGS} listings"), ("read", "every shard read")):
            rows.append([name, unit, f"{before[f'{what}_mib']:.1f}", f"{after[f'{what}_mib']:.1f}",
                         f"{before[f'{what}_requests']:,.0f}", f"{after[f'{what}_requests']:,.0f}",
                         f"{before[f'{what}_s']:.2f}", f"{after[f'{what}_s']:.2f}"])
    command = f"python -m bench.s3_reads --latency {args.latency:g} --mbps {args.mbps:g} --files {args.files}"
    return [
        *harness.header("Object-store reads: what tokenmill moves and how long its listings take", command, info),
        f"- **Store:** moto's S3 server on loopback behind a relay holding each request {args.latency:g} ms, "
        f"sending at most {args.mbps:g} Mbit/s a connection, and counting the bytes the store sends "
        "(bench/relay.py): a store's first-byte time and a connection's bandwidth, which loopback has not.",
        "- **Sides:** the store's defaults (fsspec's read-ahead: s3fs fetches a 50 MiB block past each read; files "
        "planned in series; every listing plans every file again), against tokenmill (each read fetches its "
        f"range; files planned {PLAN_THREADS} at a time, each object's plan kept by its etag for the process). The "
        f"same calls, the same shards and rows on both sides; {LISTINGS} listings: a first run with auto's trials "
        "(their question, the trials, the prediction, the flow).",
        "",
        *harness.table(["corpus", "work", "MiB moved, defaults", "MiB moved, tokenmill", "requests, defaults",
                        "requests, tokenmill", "s, defaults", "s, tokenmill"], rows),
        "",
        "Listings: the read-ahead fetched 50 MiB past each JSONL probe (its first line, each cut point), and every "
        "listing read every Parquet footer again, one after another. Reads: an object of at most 4 MiB is fetched "
        "whole at once (one request, as the read-ahead's first block fetched it); a larger Parquet object's shard "
        "is its footer and its row groups' column chunks, coalesced by pyarrow (pre_buffer, its default on both "
        "sides), against the read-ahead's 50 MiB blocks: more requests, a fraction of the bytes; a JSONL shard its "
        "byte range, once. Seconds here are "
        "the relay's latency and bandwidth on a shared 2-core machine, not a real store's: the bytes and requests "
        "are what carries over.",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
