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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel

from tokenmill.digest import stable_digest
from tokenmill.encoding import encode_rows
from tokenmill.engine_choice import resolve
from tokenmill.engines import get_engine
from tokenmill.errors import TokenmillError
from tokenmill.models import resolve_model
from tokenmill.outputs import MANIFEST, SHARDS_DIR, TEMP_DIR, OutputStore, writer_name
from tokenmill.spec import IndexSpec, JobSpec, ModelSpec

INDEX_DIR = "_index"
POINTER = "index.json"
INDEX_FORMAT_VERSION = 1
RECALL_K = 10
NOT_STORED = ("embedding", "input_tokens", "output_tokens", "truncated")  # never copied beside the ids
LANCE_TABLE = "vectors"

# What a build costs, for `tokenmill plan`: seconds per vector per dimension, measured with
# faiss-cpu 1.15 on the shared 2-core CPU machine (384 dims, 20,000 vectors, M=32, pq_m=96).
# Flat is a copy; HNSW pays for its graph links; IVF-PQ for training its quantizers (per
# training vector: pq_m k-means of 2^nbits centroids) and then for encoding each vector.
SECONDS_PER_VECTOR_DIM = {"flat": 4e-9, "hnsw": 4.3e-6, "ivfpq": 1.7e-7}
IVFPQ_TRAIN_SECONDS_PER_VECTOR_DIM = 4.7e-5

log = logging.getLogger(__name__)


class IndexBuildError(TokenmillError):
    """The index cannot be built or read: the reason names the output and the cause."""


@dataclass(frozen=True)
class IndexChoice:
    kind: str  # flat | hnsw | ivfpq
    params: dict[str, int]
    reason: str


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


# --- the outputs, shard by shard -------------------------------------------------------------


@dataclass(frozen=True)
class _Shard:
    shard_id: str
    path: str
    rows: int


def _manifest(store: OutputStore) -> dict[str, Any]:
    path = store.path(MANIFEST)
    if not store.exists(path):
        raise IndexBuildError(f"{store.uri}: no {MANIFEST}, so no finished output to index; run the embed job first")
    manifest = store.read_json(path)
    if manifest.get("mode") != "embed":
        raise IndexBuildError(f"{store.uri}: the output is from a mode={manifest.get('mode')} job; an index is built "
                          "over embeddings (mode: embed)")
    if not manifest.get("complete"):
        raise IndexBuildError(f"{store.uri}: the output is not complete ({manifest.get('shards_done')} of "
                          f"{manifest.get('shards_total')} shards); finish the job first")
    if not any(s["rows_out"] for s in manifest["shards"]):
        raise IndexBuildError(f"{store.uri}: the output has no rows ({manifest['totals']['rows_in']} in, all rejected "
                          "or empty): there is nothing to index")
    return manifest


def _shards(manifest: dict[str, Any]) -> list[_Shard]:
    return [_Shard(s["shard_id"], s["output"], s["rows_out"]) for s in manifest["shards"] if s["rows_out"]]


def _file_stamp(store: OutputStore, path: str) -> list[Any]:
    info = store.fs.info(path)
    return [info.get("size"), info.get("ETag") or info.get("mtime") or info.get("LastModified")]


def index_key(store: OutputStore, manifest: dict[str, Any], index: IndexSpec) -> str:
    """What the index is built from: a changed output file, shard set, model or index section changes it."""
    shards = [[s["shard_id"], s["fingerprint"], s["rows_out"], _file_stamp(store, s["output"])]
              for s in manifest["shards"] if s["rows_out"]]
    return stable_digest({"version": INDEX_FORMAT_VERSION, "model": manifest["model"], "shards": shards,
                          "index": index.model_dump(mode="json")}, 32)


def _stored_columns(store: OutputStore, first: _Shard, index: IndexSpec) -> list[str]:
    names = pq.read_schema(pa.BufferReader(store.read_bytes(first.path))).names
    if index.columns is None:
        return [c for c in names if c not in ("id", *NOT_STORED)]
    missing = [c for c in index.columns if c not in names]
    if missing:
        raise IndexBuildError(f"{first.path}: index.columns {missing} are not output columns (there are {names})")
    return [c for c in index.columns if c != "id"]


def _read_vectors(store: OutputStore, shard: _Shard, columns: list[str], dim: int | None
                  ) -> tuple[np.ndarray, pa.Table]:
    """One shard's unit vectors (rows x dim, float32) and its id and stored columns."""
    table = store.read_table(shard.path, columns=["id", "embedding", *columns])
    embedding = table.column("embedding").combine_chunks()
    lengths = pc.unique(pc.list_value_length(embedding)).to_pylist() if len(embedding) else []
    if len(lengths) > 1:
        raise IndexBuildError(f"{shard.path}: embeddings of different lengths {sorted(lengths)} in one shard")
    if embedding.null_count:
        raise IndexBuildError(f"{shard.path}: {embedding.null_count} rows have no embedding")
    found = lengths[0] if lengths else dim
    if dim is not None and found != dim:
        raise IndexBuildError(f"{shard.path}: embeddings have {found} dimensions, other shards {dim}: the output mixes "
                          "models; re-run the job into an empty output")
    vectors = np.array(embedding.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)  # a writable copy
    vectors = vectors.reshape(len(embedding), found)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors /= np.where(norms > 0, norms, 1.0)
    return vectors, table.drop_columns(["embedding"])


def _iter_shards(store: OutputStore, shards: list[_Shard], columns: list[str]
                 ) -> Iterator[tuple[int, _Shard, np.ndarray, pa.Table]]:
    """(first position, shard, vectors, ids and columns) per shard; the dimension checked across shards."""
    dim, position = None, 0
    for shard in shards:
        vectors, table = _read_vectors(store, shard, columns, dim)
        if dim is not None and vectors.shape[1] != dim:
            raise IndexBuildError(f"{shard.path}: embeddings have {vectors.shape[1]} dimensions, other shards {dim}")
        dim = vectors.shape[1]
        yield position, shard, vectors, table
        position += len(vectors)


def _dimension(store: OutputStore, shard: _Shard) -> int:
    table = pq.ParquetFile(pa.BufferReader(store.read_bytes(shard.path))).read_row_group(0, columns=["embedding"])
    return len(table.column("embedding")[0].values)


def _picks(rows: int, index: IndexSpec, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the held-out queries and of the training sample (IVF-PQ), disjoint and deterministic."""
    rng = np.random.default_rng(index.seed)
    order = rng.permutation(rows)
    queries = np.sort(order[:min(index.recall_queries, rows)])
    train = np.sort(order[len(queries):len(queries) + index.train_rows]) if kind == "ivfpq" else np.array([], int)
    return queries, train


def _take(vectors: np.ndarray, start: int, positions: np.ndarray) -> np.ndarray:
    inside = positions[(positions >= start) & (positions < start + len(vectors))]
    return vectors[inside - start]


# --- building ---------------------------------------------------------------------------------


def build_index(spec: JobSpec, embed_seconds: float | None = None, storage_options: dict[str, Any] | None = None
                ) -> IndexReport:
    """The job's index under <output>/_index/, reused when built from the same outputs; measured."""
    index = spec.index or IndexSpec()
    store = OutputStore(spec.output, storage_options if storage_options is not None else spec.storage_options)
    manifest = _manifest(store)
    key = index_key(store, manifest, index)
    existing = read_pointer(store)
    if existing is not None and existing.key == key and store.exists(store.path(INDEX_DIR, key)):
        log.info("index %s is built from the same outputs: reused", key)
        return existing.model_copy(update={"reused": True})

    shards = _shards(manifest)
    rows = sum(s.rows for s in shards)
    dim = _dimension(store, shards[0])
    choice = choose_index(rows, dim, index)
    columns = _stored_columns(store, shards[0], index)
    queries_at, train_at = _picks(rows, index, choice.kind)
    needed = max(2 ** choice.params["nbits"], 39 * choice.params["nlist"]) if choice.kind == "ivfpq" else 0
    if len(train_at) < needed:
        raise IndexBuildError(f"{store.uri}: IVF-PQ needs at least {needed} training vectors and the output has "
                              f"{len(train_at)} besides the held-out queries; use index.kind flat or hnsw")
    if choice.kind == "ivfpq" and index.backend == "lancedb" and choice.params["nbits"] not in (4, 8):
        raise IndexBuildError(f"index.nbits={choice.params['nbits']}: LanceDB's IVF-PQ takes 4 or 8 bits per code")
    building = _scratch(store)
    try:
        started = time.perf_counter()
        build = _build_faiss if index.backend == "faiss" else _build_lance
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
    """Seconds the shards took to embed, from their records under _shards/ (None when none is there)."""
    total, found = 0.0, False
    for shard in manifest["shards"]:
        path = store.path(SHARDS_DIR, f"{shard['shard_id']}.json")
        if store.exists(path):
            total += float(store.read_json(path).get("seconds", 0.0))
            found = True
    return total if found else None


def _ids_table(position: int, shard: _Shard, table: pa.Table) -> pa.Table:
    return pa.table({"position": pa.array(np.arange(position, position + table.num_rows), pa.int64()),
                     "id": table.column("id").cast(pa.string()),
                     "shard_id": pa.array([shard.shard_id] * table.num_rows, pa.string()),
                     **{name: table.column(name) for name in table.column_names if name != "id"}})


def _build_faiss(store, shards, columns, dim, choice, queries_at, train_at, folder):
    import faiss

    if choice.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif choice.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, choice.params["m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = choice.params["ef_construction"]
        index.hnsw.efSearch = choice.params["ef_search"]
    else:
        p = choice.params
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFPQ(quantizer, dim, p["nlist"], p["pq_m"], p["nbits"], faiss.METRIC_INNER_PRODUCT)
        sample = np.concatenate([_take(v, start, train_at) for start, _, v, _ in _iter_shards(store, shards, [])])
        index.train(sample)
        del sample
        index.nprobe = p["nprobe"]
    if choice.kind in ("flat", "hnsw"):
        _reserve_vectors(index, sum(s.rows for s in shards))
    queries = []
    writer = None
    try:
        for start, shard, vectors, table in _iter_shards(store, shards, columns):
            index.add(vectors)
            queries.append(_take(vectors, start, queries_at))
            ids = _ids_table(start, shard, table)
            if writer is None:
                writer = pq.ParquetWriter(os.path.join(folder, "ids.parquet"), ids.schema, compression="zstd")
            writer.write_table(ids.cast(writer.schema))
    finally:
        if writer is not None:
            writer.close()
    faiss.write_index(index, os.path.join(folder, "index.faiss"))

    def search(vectors: np.ndarray, k: int) -> list[list[int]]:
        _, labels = index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)
        return [[int(i) for i in row if i >= 0] for row in labels]

    return search, np.concatenate(queries)


def _reserve_vectors(index, rows: int) -> None:
    """Allocate a flat or HNSW index's vector storage for every row before the first add. Grown
    shard by shard, the storage is reallocated and copied, so at the last growth the old and the
    new buffer are both resident: 483 MiB peak for 293 MiB of vectors (200k x 384), measured."""
    import faiss

    flat = faiss.downcast_index(index.storage) if hasattr(index, "storage") else index
    flat.codes.resize(rows * flat.code_size)  # std::vector keeps its capacity when it shrinks again
    flat.codes.resize(0)


def _build_lance(store, shards, columns, dim, choice, queries_at, train_at, folder):
    import lancedb

    db = lancedb.connect(os.path.join(folder, "lance"))
    table = None
    queries = []
    for start, shard, vectors, rows in _iter_shards(store, shards, columns):
        data = _ids_table(start, shard, rows)
        data = data.append_column("vector", pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim))
        if table is None:
            table = db.create_table(LANCE_TABLE, data=data)
        else:
            table.add(data.cast(table.schema))
        queries.append(_take(vectors, start, queries_at))
    if choice.kind == "hnsw":
        table.create_index(metric="cosine", vector_column_name="vector", index_type="IVF_HNSW_SQ", num_partitions=1,
                           m=choice.params["m"], ef_construction=choice.params["ef_construction"])
    elif choice.kind == "ivfpq":
        p = choice.params
        table.create_index(metric="cosine", vector_column_name="vector", index_type="IVF_PQ",
                           num_partitions=p["nlist"], num_sub_vectors=p["pq_m"], num_bits=p["nbits"])

    def search(vectors: np.ndarray, k: int) -> list[list[int]]:
        return [_lance_query(table, choice, vector, k).column("position").to_pylist() for vector in vectors]

    return search, np.concatenate(queries)


def _lance_query(table, choice: IndexChoice, vector: np.ndarray, k: int, columns: list[str] | None = None):
    query = table.search(vector, vector_column_name="vector").distance_type("cosine").limit(k)
    if choice.kind == "hnsw":
        query = query.ef(choice.params["ef_search"])
    elif choice.kind == "ivfpq":
        query = query.nprobes(choice.params["nprobe"])
    return query.select([*(columns or ["position"]), "_distance"]).to_arrow()


TIE_TOLERANCE = 1e-5  # inner products this close are equal (float sums differ with BLAS order)


def _recall(store: OutputStore, shards: list[_Shard], queries: np.ndarray, found: list[list[int]],
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
    for start, _, vectors, _ in _iter_shards(store, shards, []):
        scores = queries @ vectors.T
        best = -np.sort(-np.concatenate([best, scores], axis=1), axis=1)[:, :k]
        inside = (hits >= start) & (hits < start + len(vectors))
        rows, columns = np.nonzero(inside)
        hit_scores[rows, columns] = scores[rows, hits[rows, columns] - start]
    kth = best[:, -1:] - TIE_TOLERANCE
    return float(np.mean(np.sum(hit_scores >= kth, axis=1) / k))


# --- reading and searching ------------------------------------------------------------------


def read_pointer(store: OutputStore) -> IndexReport | None:
    path = store.path(INDEX_DIR, POINTER)
    if not store.exists(path):
        return None
    return IndexReport.model_validate(store.read_json(path))


class OpenIndex:
    """A built index, opened for search: `search(vectors, k)` gives each query's hits, best first."""

    def __init__(self, output: str, storage_options: dict[str, Any] | None = None):
        self.store = OutputStore(output, storage_options)
        report = read_pointer(self.store)
        if report is None:
            raise IndexBuildError(f"{output}: no index ({INDEX_DIR}/{POINTER}); build one with `tokenmill index` or an "
                              "index section in the job")
        self.report = report
        self._local = tempfile.mkdtemp(prefix="tokenmill-search-") if not self.store.local else None
        folder = report.folder
        if self._local:
            self.store.fs.get(folder.rstrip("/") + "/", self._local, recursive=True)
            folder = self._local
        if report.backend == "faiss":
            import faiss

            self.index = faiss.read_index(os.path.join(folder, "index.faiss"))
            self.ids = pq.read_table(os.path.join(folder, "ids.parquet"))
        else:
            import lancedb

            self.table = lancedb.connect(os.path.join(folder, "lance")).open_table(LANCE_TABLE)

    def search(self, vectors: np.ndarray, k: int = 10) -> list[list[dict[str, Any]]]:
        vectors = np.ascontiguousarray(np.atleast_2d(vectors), dtype=np.float32)
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        if vectors.shape[1] != self.report.dim:
            raise IndexBuildError(f"the query vectors have {vectors.shape[1]} dimensions, the index "
                              f"{self.report.dim}: embed them with the job's model")
        names = ["id", *self.report.columns]
        hits = []
        if self.report.backend == "faiss":
            scores, labels = self.index.search(vectors, k)
            for row_scores, row_labels in zip(scores, labels):
                keep = [(float(s), int(i)) for s, i in zip(row_scores, row_labels) if i >= 0]
                rows = self.ids.take([i for _, i in keep]).select(names).to_pylist()
                hits.append([{**row, "score": score} for (score, _), row in zip(keep, rows)])
        else:
            choice = IndexChoice(self.report.kind, self.report.params, self.report.reason)
            for vector in vectors:
                found = _lance_query(self.table, choice, vector, k, names).to_pylist()
                hits.append([{**{n: row[n] for n in names}, "score": 1.0 - row["_distance"]} for row in found])
        return hits

    def close(self) -> None:
        if self._local:
            shutil.rmtree(self._local, ignore_errors=True)


def embed_queries(texts: list[str], model: dict[str, Any], engine: str | None = None) -> np.ndarray:
    """The texts embedded with the job's model (as the index recorded it); `engine` overrides its engine
    (`auto` is decided here, as for a job)."""
    fields = {k: v for k, v in model.items() if k in ModelSpec.model_fields}
    if engine:
        fields["engine"] = engine
    spec = resolve(JobSpec(mode="embed", model=ModelSpec(**fields)))
    model_path = resolve_model(spec.model_name)
    encoded = encode_rows(texts, spec, model_path)
    return np.stack(get_engine(model_path, spec).embed(encoded.token_ids)).astype(np.float32)


def search_text(output: str, texts: list[str], k: int = 10, storage_options: dict[str, Any] | None = None,
                engine: str | None = None) -> list[list[dict[str, Any]]]:
    """Each text's top-k hits in the output's index: id, score (cosine) and the stored columns."""
    opened = OpenIndex(output, storage_options)
    try:
        return opened.search(embed_queries(texts, opened.report.model, engine), k)
    finally:
        opened.close()


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
