"""The index stage on the 20,000-document sample corpus, and on ten times its vectors.

    python -m bench.index_scale          # part of `make bench`; writes bench/INDEX_SCALE.md
    python -m bench.index_scale --docs 2000   # a smaller slice of the sample corpus: proves the path

1. `tokenmill run` embeds the sample corpus with an `index:` section left to its defaults, as a user
   runs it: one process, timed spawn to exit, the peak memory of its process tree sampled; and the
   same job on a tenth of the corpus, so the peak of the whole job is compared at 10x. The
   index's own figures (kind chosen, build seconds beside the shards' embedding seconds, recall@10
   against exact search on held-out queries, bytes, queries/s) are the job's record.
2. The index stage alone (`build_index` in a process of its own, its peak RSS sampled) over that
   output, flat and HNSW forced; and over a 10x output: the same shard files ten times under new
   ids (what a corpus of ten copies embeds to, vectors being deterministic), with the default choice
   (HNSW above 100k vectors) and flat forced. The stage holds one shard plus the index, so its
   peak grows with the index, which at 10x holds 10x the vectors; the table splits the peak into
   the index's bytes and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import GIB, header, run_process  # noqa: E402
from bench.run import IndexBuildRun, index_build_run  # noqa: E402
from tokenmill.sample_corpus import write_sample_corpus  # noqa: E402

REPORT = ROOT / "bench" / "INDEX_SCALE.md"
SAMPLE = ROOT / "data" / "sample-corpus"
# Both jobs cut shards of this many rows, so the job on a tenth of the corpus also runs full shards
# (with the default 5,000 it would run one 2,000-row shard against the whole job's 5,000-row ones,
# and the comparison would measure the shard size, not the corpus size).
SHARD_ROWS = 1000


@dataclass
class JobRun:
    rows: int
    wall_s: float
    peak_tree_gib: float
    engine: str
    report: dict


def corpus(docs: int, scratch: Path) -> Path:
    if not SAMPLE.exists():
        write_sample_corpus(SAMPLE)
    table = pq.read_table(SAMPLE)
    if docs >= table.num_rows:
        return SAMPLE
    path = scratch / f"corpus-{docs}"
    path.mkdir(parents=True)
    pq.write_table(table.slice(0, docs), path / "part-0.parquet", row_group_size=1000)
    return path


def embed_with_index(source: Path, output: Path, scratch: Path) -> JobRun:
    """`tokenmill run` with `--set index={}`: the whole job as a user runs it."""
    args = [sys.executable, "-m", "tokenmill.cli", "run", "--input", str(source), "--output", str(output),
            "--set", "index={}", "--max-shard-rows", str(SHARD_ROWS), "--no-progress", "--tracking-uri", f"sqlite:///{scratch}/mlflow.db",
            "--experiment", "tokenmill-bench-index"]
    env = dict(os.environ, PREFECT_HOME=str(scratch / "prefect"), HF_HUB_OFFLINE="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    run = run_process(args, env=env, interval=0.2).check(f"tokenmill run on {source}")
    report = json.loads((output / "_index" / "index.json").read_text())
    manifest = json.loads((output / "_manifest.json").read_text())
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{scratch}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["tokenmill-bench-index"], order_by=["start_time DESC"],
                              max_results=1)
    engine = str(runs.iloc[0].get("params.engine", "")) if len(runs) else ""
    return JobRun(rows=manifest["totals"]["rows_in"], wall_s=run.wall_s, peak_tree_gib=run.peak_gib,
                  engine=engine, report=report)


def ten_times(output: Path, target: Path) -> Path:
    """The output's shard files ten times under new ids and shard ids, with a manifest that lists them."""
    target.mkdir(parents=True)
    manifest = json.loads((output / "_manifest.json").read_text())
    shards = []
    for copy in range(10):
        for shard in manifest["shards"]:
            if not shard["rows_out"]:
                continue
            table = pq.read_table(shard["output"])
            ids = pa.array([f"{i}-copy{copy}" for i in table.column("id").to_pylist()])
            path = target / f"copy{copy}-{Path(shard['output']).name}"
            pq.write_table(table.set_column(table.schema.get_field_index("id"), "id", ids), path)
            shards.append(dict(shard, shard_id=f"{shard['shard_id']}-copy{copy}", output=str(path),
                               fingerprint=f"{shard['fingerprint']}-copy{copy}"))
    totals = {k: v * 10 for k, v in manifest["totals"].items()}
    (target / "_manifest.json").write_text(json.dumps(dict(manifest, shards=shards, totals=totals,
                                                           shards_total=len(shards), shards_done=len(shards))))
    return target


def row(name: str, run: IndexBuildRun) -> str:
    rest = run.peak_gib - run.index_bytes / GIB
    return (f"| {name} | {run.rows:,} | {run.kind} | {run.recall_at_10:.3f} | {run.build_s:.2f} | "
            f"{run.index_bytes / 2**20:.1f} | {run.queries_per_s:,.0f} | {run.peak_gib:.2f} | {rest:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20_000, help="documents of the sample corpus (default: all)")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-bench-index-"))
    try:
        tenth = corpus(max(1, args.docs // 10), scratch)
        # not measured: a first run on a machine pays for the engine trials (`auto`), and vLLM's trial
        # process would count in the small job's peak memory; both measured jobs find them cached
        print(f"warm-up: embedding {tenth} (engine trials, if not cached) ...", flush=True)
        embed_with_index(tenth, scratch / "warm-up", scratch)
        print(f"embedding {tenth} with an index section ...", flush=True)
        small = embed_with_index(tenth, scratch / "tenth", scratch)
        source = corpus(args.docs, scratch)
        print(f"embedding {source} with an index section ...", flush=True)
        job = embed_with_index(source, scratch / "x1", scratch)
        print(f"job: {job.wall_s:.1f} s, index {job.report['kind']} recall {job.report['recall_at_10']:.3f}",
              flush=True)
        x10 = ten_times(scratch / "x1", scratch / "x10")
        builds = {}
        for name, output, kind in [("1x, flat", scratch / "x1", "flat"), ("1x, HNSW", scratch / "x1", "hnsw"),
                                   ("10x, default", x10, "auto"), ("10x, flat", x10, "flat")]:
            builds[name] = index_build_run(output, kind)
            print(f"{name}: {builds[name]}", flush=True)
        report = render(job, small, builds)
        args.report.write_text(report)
        print(report)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def render(job: JobRun, small: JobRun, builds: dict[str, IndexBuildRun]) -> str:
    r = job.report
    share = r["build_seconds"] / r["embed_seconds"] if r.get("embed_seconds") else None
    flat1, default10, flat10 = builds["1x, flat"], builds["10x, default"], builds["10x, flat"]
    ratio = default10.peak_gib / flat1.peak_gib
    rest_ratio = (default10.peak_gib - default10.index_bytes / GIB) / (flat1.peak_gib - flat1.index_bytes / GIB)
    lines = [
        *header("The index stage at the sample corpus's scale", "python -m bench.index_scale (part of make bench)"),
        f"- **Job:** `tokenmill run --input data/sample-corpus --set index={{}} --max-shard-rows {SHARD_ROWS}` "
        f"({job.rows:,} documents, "
        f"all-MiniLM-L6-v2, engine auto: it chose {job.engine}), one process timed spawn to exit.",
        "",
        "## The job",
        "",
        "| figure | measured | goal | met |",
        "|---|---|---|---|",
        f"| index chosen by default | {r['backend']} {r['kind']}: {r['reason']} | | |",
        f"| recall@10 against exact search ({r['recall_queries']} held-out queries) | {r['recall_at_10']:.3f} | "
        f"≥ 0.95 | {'yes' if r['recall_at_10'] >= 0.95 else 'no'} |",
        f"| index build / embedding seconds | {r['build_seconds']:.2f} s / {r.get('embed_seconds') or 0:,.1f} s"
        + (f" = {share:.2%}" if share is not None else "") + " | report | |",
        f"| index bytes, queries/s | {r['index_bytes'] / 2**20:.1f} MiB, {r['queries_per_s']:,.0f} | report | |",
        f"| whole job: wall, peak memory of its process tree | {job.wall_s:.1f} s, {job.peak_tree_gib:.2f} GiB "
        "| report | |",
        f"| whole job's peak memory, {job.rows:,} documents against {small.rows:,} (the same job on a tenth) | "
        f"{job.peak_tree_gib / small.peak_tree_gib:.2f}× ({small.peak_tree_gib:.2f} → {job.peak_tree_gib:.2f} GiB; "
        f"index {small.report['kind']} → {job.report['kind']}) | ≤ 1.3× | "
        f"{'yes' if job.peak_tree_gib / small.peak_tree_gib <= 1.3 else 'no'} |",
        "",
        "## The index stage alone, 1x and 10x",
        "",
        "`build_index` in a process of its own (no Prefect, no engine), peak RSS sampled every 0.05 s. "
        "10x: the job's shard files ten times under new ids. \"Peak less index\": the peak minus the "
        "index's own bytes, i.e. the interpreter, the libraries and the one shard in flight.",
        "",
        "| build | vectors | kind | recall@10 | build s | index MiB | queries/s | peak GiB | peak less index GiB |",
        "|---|---|---|---|---|---|---|---|---|",
        *[row(name, run) for name, run in builds.items()],
        "",
        "| memory, 10x against 1x | ratio | goal | met |",
        "|---|---|---|---|",
        f"| peak of the stage, default choice (10x {default10.kind} against 1x flat) | {ratio:.2f}× | ≤ 1.3× | "
        f"{'yes' if ratio <= 1.3 else 'no'} |",
        f"| peak less the index's bytes (what the stage holds besides the index) | {rest_ratio:.2f}× | ≤ 1.3× | "
        f"{'yes' if rest_ratio <= 1.3 else 'no'} |",
        f"| peak, flat at both sizes | {flat10.peak_gib / flat1.peak_gib:.2f}× | report | |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
