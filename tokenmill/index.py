"""An ANN index over an embed job's outputs: FAISS or LanceDB, built shard by shard.

Layout under the output root:
    _index/index.json           the live index: its folder, kind, parameters, the job's model
                                and what it measured; written last, so a reader sees a whole
                                index or none
    _index/<key>/index.faiss    faiss: the index; vector i is the i-th row of ids.parquet
    _index/<key>/ids.parquet    faiss: position, id, shard_id and the stored output columns
    _index/<key>/lance/         lancedb: the table `vectors` (position, id, shard_id, vector,
                                stored columns) with its vector index

<key> digests what the index was built from: the manifest's model and shards (fingerprints,
rows) with each output file's size and modification time (ETag on S3), and the index
section. The same key finds the index already built; a changed output gives a new key and
a new build, which replaces the old one.

Memory holds one shard's vectors at a time plus the index itself (and, for IVF-PQ, its
training sample of at most index.train_rows vectors): the corpus is never one array.

The kind, when index.kind is auto (see `choose_index`):
    rows <= flat_max_rows (100k)   flat: exact inner-product search, recall 1
    rows <= hnsw_max_rows (1M)     HNSW: M=32, efConstruction=80, efSearch=128; full vectors
    above                          IVF-PQ: nlist ~ 4 sqrt(rows) (a power of two, <= rows/39),
                                   pq_m = the largest divisor of dim <= dim/4, 8-bit codes,
                                   nprobe = nlist/8 in [8, 256]
Vectors are L2-normalised and scored by inner product: the score is the cosine similarity.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from tokenmill.index_backends import (
    IndexBuildError,
    IndexChoice,
    OutputShard,
    build_faiss,
    build_lance,
    finished_manifest,
    index_key,
    iter_shards,
    output_shards,
    sample_positions,
    stored_columns,
    vector_dimension,
)
from tokenmill.models import resolve_model
from tokenmill.outputs import SHARDS_DIR, TEMP_DIR, OutputStore, writer_name
from tokenmill.spec import IndexSpec, JobSpec

INDEX_DIR = "_index"
POINTER = "index.json"
RECALL_K = 10

# What a build costs, for `tokenmill plan`: seconds per vector per dimension, measured with
# faiss-cpu 1.15 on the shared 2-core CPU machine (384 dims, 20,000 vectors, M=32, pq_m=96).
# Flat is a copy; HNSW pays for its graph links; IVF-PQ for training its quantizers (per
# training vector: pq_m k-means of 2^nbits centroids) and then for encoding each vector.
SECONDS_PER_VECTOR_DIM = {"flat": 4e-9, "hnsw": 4.3e-6, "ivfpq": 1.7e-7}
IVFPQ_TRAIN_SECONDS_PER_VECTOR_DIM = 4.7e-5

log = logging.getLogger(__name__)


def _power_of_two_near(value: float) -> int:
    return 1 << max(0, round(math.log2(max(value, 1.0))))


def choose_index(rows: int, dim: int, index: IndexSpec) -> IndexChoice:
    """The kind and parameters for `rows` vectors of `dim` dimensions (the rule in the module docstring)."""
    if index.kind != "auto":
        kind, reason = index.kind, "index.kind"
    elif rows <= index.flat_max_rows:
        kind, reason = "flat", f"{rows:,} rows <= flat_max_rows {index.flat_max_rows:,}: exact search"
    elif rows <= index.hnsw_max_rows:
        kind, reason = "hnsw", f"{rows:,} rows <= hnsw_max_rows {index.hnsw_max_rows:,}"
    else:
        kind, reason = "ivfpq", f"{rows:,} rows > hnsw_max_rows {index.hnsw_max_rows:,}: compressed codes"
    if kind == "flat":
        return IndexChoice("flat", {}, reason)
    if kind == "hnsw":
        m = index.hnsw_m or 32
        return IndexChoice("hnsw", {"m": m, "ef_construction": max(80, 2 * m), "ef_search": index.ef_search or 128},
                           reason)
    nlist = index.nlist or min(_power_of_two_near(4 * math.sqrt(rows)), max(1, rows // 39))
    pq_m = index.pq_m or max(d for d in range(1, max(1, dim // 4) + 1) if dim % d == 0)
    if dim % pq_m:
        raise IndexBuildError(f"index.pq_m={pq_m} does not divide the embedding dimension {dim}")
    nprobe = min(nlist, index.nprobe or min(256, max(8, nlist // 8)))
    return IndexChoice("ivfpq", {"nlist": nlist, "pq_m": pq_m, "nbits": index.nbits, "nprobe": nprobe}, reason)


class IndexReport(BaseModel):
    """What an index is and what it measured: the record's index_* metrics."""

    backend: str
    kind: str
    params: dict[str, int]
    reason: str
    metric: str = "cosine"
    rows: int
    dim: int
    key: str
    folder: str
    columns: list[str]
    build_seconds: float
    index_bytes: int
    recall_at_10: float
    recall_queries: int
    queries_per_s: float
    embed_seconds: float | None = None
    model: dict[str, Any]
    reused: bool = False

    def metrics(self) -> dict[str, float]:
        values = {"index_build_seconds": self.build_seconds, "index_bytes": float(self.index_bytes),
                  "index_recall_at_10": self.recall_at_10, "index_queries_per_s": self.queries_per_s,
                  "index_rows": float(self.rows), "index_dim": float(self.dim), "index_reused": float(self.reused)}
        if self.embed_seconds:
            values["index_embed_seconds"] = self.embed_seconds
            values["index_build_share_of_embed"] = self.build_seconds / self.embed_seconds
        return values

    def markdown(self) -> str:
        share = (f" ({self.build_seconds / self.embed_seconds:.1%} of the {self.embed_seconds:,.1f} s of embedding)"
                 if self.embed_seconds else "")
        params = ", ".join(f"{k}={v}" for k, v in self.params.items()) or "exact"
        return "\n".join([
            "# tokenmill index",
            "",
            f"- **Index:** {self.backend} {self.kind} ({params}); {self.reason}",
            f"- **Vectors:** {self.rows:,} x {self.dim} ({self.metric}), in `{self.folder}`"
            + (" (reused: built from the same outputs)" if self.reused else ""),
            f"- **Build:** {self.build_seconds:,.2f} s{share}; {self.index_bytes / 2**20:,.1f} MiB",
            (f"- **Quality:** recall@{RECALL_K} {self.recall_at_10:.3f} against exact search over "
             f"{self.recall_queries} held-out queries; {self.queries_per_s:,.0f} queries/s"),
        ]) + "\n"


# --- building ---------------------------------------------------------------------------------


def build_index(spec: JobSpec, embed_seconds: float | None = None, storage_options: dict[str, Any] | None = None
                ) -> IndexReport:
    """The job's index under <output>/_index/, reused when built from the same outputs; measured."""
    index = spec.index or IndexSpec()
    store = OutputStore(spec.output, storage_options if storage_options is not None else spec.storage_options)
    manifest = finished_manifest(store)
    key = index_key(store, manifest, index)
    existing = read_pointer(store)
    if existing is not None and existing.key == key and store.exists(store.path(INDEX_DIR, key)):
        log.info("index %s is built from the same outputs: reused", key)
        return existing.model_copy(update={"reused": True})

    shards = output_shards(manifest)
    rows = sum(s.rows for s in shards)
    dim = vector_dimension(store, shards[0])
    choice = choose_index(rows, dim, index)
    columns = stored_columns(store, shards[0], index)
    queries_at, train_at = sample_positions(rows, index, choice.kind)
    needed = max(2 ** choice.params["nbits"], 39 * choice.params["nlist"]) if choice.kind == "ivfpq" else 0
    if len(train_at) < needed:
        raise IndexBuildError(f"{store.uri}: IVF-PQ needs at least {needed} training vectors and the output has "
                              f"{len(train_at)} besides the held-out queries; use index.kind flat or hnsw")
    if choice.kind == "ivfpq" and index.backend == "lancedb" and choice.params["nbits"] not in (4, 8):
        raise IndexBuildError(f"index.nbits={choice.params['nbits']}: LanceDB's IVF-PQ takes 4 or 8 bits per code")
    building = _scratch(store)
    try:
        started = time.perf_counter()
        build = build_faiss if index.backend == "faiss" else build_lance
        searcher, queries = build(store, shards, columns, dim, choice, queries_at, train_at, building)
        build_seconds = time.perf_counter() - started
        started = time.perf_counter()
        found = searcher(queries, RECALL_K)
        queries_per_s = len(queries) / max(time.perf_counter() - started, 1e-9)
        recall = _recall(store, shards, queries, found)
        report = IndexReport(
            backend=index.backend, kind=choice.kind, params=choice.params, reason=choice.reason, rows=rows, dim=dim,
            key=key, folder=store.path(INDEX_DIR, key), columns=columns, build_seconds=build_seconds,
            index_bytes=_bytes_under(building), recall_at_10=recall, recall_queries=len(queries),
            queries_per_s=queries_per_s, embed_seconds=embed_seconds if embed_seconds is not None
            else shard_seconds(store, manifest), model=_model_of(spec))
        _publish(store, building, report, existing)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return report


def _scratch(store: OutputStore) -> str:
    """Where a build is written before it is published: under _tmp/<writer>/ locally (the same
    filesystem, so publishing is a rename; a killed build's folder goes with its writer)."""
    if store.local:
        folder = store.path(TEMP_DIR, writer_name(), f"index-{uuid.uuid4().hex}")
        os.makedirs(folder)
        return folder
    return tempfile.mkdtemp(prefix="tokenmill-index-")


def _publish(store: OutputStore, building: str, report: IndexReport, previous: IndexReport | None) -> None:
    target = store.path(INDEX_DIR, report.key)
    if store.local:
        if os.path.exists(target):  # a build of the same key whose pointer never got written
            shutil.rmtree(target)
        os.makedirs(store.path(INDEX_DIR), exist_ok=True)
        os.replace(building, target)
    else:
        store.fs.put(building.rstrip("/") + "/", target, recursive=True)
    store.write_json(store.path(INDEX_DIR, POINTER), report.model_dump(mode="json"))
    if previous is not None and previous.key != report.key:
        try:
            store.fs.rm(store.path(INDEX_DIR, previous.key), recursive=True)
        except FileNotFoundError:
            pass


def _bytes_under(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)


def _model_of(spec: JobSpec) -> dict[str, Any]:
    return {**spec.model.model_dump(mode="json"), "name": spec.model_name}


def shard_seconds(store: OutputStore, manifest: dict[str, Any]) -> float | None:
    """Seconds the shards took to embed, from their records under output_shards/ (None when none is there)."""
    total, found = 0.0, False
    for shard in manifest["shards"]:
        path = store.path(SHARDS_DIR, f"{shard['shard_id']}.json")
        if store.exists(path):
            total += float(store.read_json(path).get("seconds", 0.0))
            found = True
    return total if found else None


TIE_TOLERANCE = 1e-5  # inner products this close are equal (float sums differ with BLAS order)


def _recall(store: OutputStore, shards: list[OutputShard], queries: np.ndarray, found: list[list[int]],
            k: int = RECALL_K) -> float:
    """recall@k against exact search: the share of each query's k hits that score at least as well as
    its k-th true nearest neighbour.

    Counting hits by score, not by position, keeps ties from reading as misses: near-duplicate
    documents embed a rounding error apart, and which of them ranks k-th is arbitrary for the
    index and for exact search alike (ann-benchmarks counts recall the same way).
    """
    hits = np.full((len(queries), k), -1, dtype=np.int64)
    for row, positions in enumerate(found):
        hits[row, :min(k, len(positions))] = positions[:k]
    best = np.full((len(queries), 0), -np.inf, dtype=np.float32)
    hit_scores = np.full(hits.shape, -np.inf, dtype=np.float32)
    for start, _, vectors, _ in iter_shards(store, shards, []):
        scores = queries @ vectors.T
        best = -np.sort(-np.concatenate([best, scores], axis=1), axis=1)[:, :k]
        inside = (hits >= start) & (hits < start + len(vectors))
        rows, columns = np.nonzero(inside)
        hit_scores[rows, columns] = scores[rows, hits[rows, columns] - start]
    kth = best[:, -1:] - TIE_TOLERANCE
    return float(np.mean(np.sum(hit_scores >= kth, axis=1) / k))


# --- the live index -------------------------------------------------------------------------


def read_pointer(store: OutputStore) -> IndexReport | None:
    path = store.path(INDEX_DIR, POINTER)
    if not store.exists(path):
        return None
    return IndexReport.model_validate(store.read_json(path))


# --- planning ---------------------------------------------------------------------------------


class IndexEstimate(BaseModel):
    kind: str
    params: dict[str, int]
    seconds: float
    bytes: int

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items()) or "exact"
        return (f"{self.kind} ({params}): ~{self.seconds:,.0f} s to build on the orchestrator's CPU after the shards, "
                f"~{self.bytes / 2**30:,.2f} GiB")


def model_dimension(model_path: str) -> int | None:
    """The embedding width a model's config names (hidden_size or d_model), without loading it."""
    try:
        config = json.loads(Path(model_path, "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("hidden_size") or config.get("d_model")


def estimate_index_build(rows: int, dim: int, index: IndexSpec) -> IndexEstimate:
    """Seconds and bytes of the index the rule picks for `rows` x `dim`, for `tokenmill plan`."""
    choice = choose_index(rows, dim, index)
    seconds = rows * dim * SECONDS_PER_VECTOR_DIM[choice.kind]
    if choice.kind == "ivfpq":
        seconds += min(index.train_rows, rows) * dim * IVFPQ_TRAIN_SECONDS_PER_VECTOR_DIM
    seconds += 2 * rows * dim * 4 / 200e6  # reading the vectors back from Parquet, twice with the recall pass
    if choice.kind == "flat":
        size = rows * dim * 4
    elif choice.kind == "hnsw":
        size = rows * (dim * 4 + 2 * choice.params["m"] * 4)
    else:
        p = choice.params
        size = rows * (p["pq_m"] * p["nbits"] // 8 + 8) + p["nlist"] * dim * 4
    return IndexEstimate(kind=choice.kind, params=choice.params, seconds=seconds, bytes=int(size))


# --- the record ---------------------------------------------------------------------------------


def index_params(report: IndexReport) -> dict[str, Any]:
    return {"index_backend": report.backend, "index_kind": report.kind, "index_metric": report.metric,
            **{f"index_{k}": v for k, v in report.params.items()}}


def log_index(spec: JobSpec, report: IndexReport, run_id: str | None = None) -> str:
    """The index's figures into the job's MLflow run (`run_id`, still open), or a run of its own
    (stage `index`) when there is none; returns the run's id."""
    from mlflow.entities import Metric, Param

    from tokenmill.tracking import log_stage_run, tracking_client

    if run_id is None:
        return log_stage_run(spec, "index", report.metrics(), index_params(report),
                             run_name=spec.tracking.run_name or "index", texts={"index.md": report.markdown()})
    client = tracking_client(spec)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in report.metrics().items()],
                     params=[Param(k, str(v)) for k, v in index_params(report).items()])
    client.log_text(run_id, report.markdown(), "index.md")
    return run_id


def plan_index(spec: JobSpec, rows: int, finish_hours: float, window_hours: float) -> tuple[str, dict[str, float]]:
    """`tokenmill plan`'s index lines and metrics: the build runs after the shards, so it adds to the finish."""
    dim = model_dimension(resolve_model(spec.model_name))
    assumed = "" if dim else " (dimension assumed: the model's config names none)"
    estimate = estimate_index_build(rows, dim or 768, spec.index or IndexSpec())
    finish = finish_hours + estimate.seconds / 3600
    verdict = "inside" if finish <= window_hours else f"{finish - window_hours:.2f} h past"
    text = (f"\n- **Index ({(spec.index or IndexSpec()).backend}):** {estimate.describe()}{assumed}; the job then "
            f"finishes in **{finish:.2f} h**, {verdict} the {window_hours:g} h window.\n")
    return text, {"plan_index_build_seconds": estimate.seconds, "plan_index_bytes": float(estimate.bytes),
                  "plan_finish_hours_with_index": finish}
