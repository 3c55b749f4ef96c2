"""The index's backends: the embed job's finished outputs read shard by shard (one shard's vectors in
memory at a time), and the FAISS and LanceDB builders and queries over them. tokenmill.index
decides the kind and publishes the build; tokenmill.index_search opens it for search."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill.digest import stable_digest
from tokenmill.errors import TokenmillError
from tokenmill.outputs import MANIFEST, OutputStore
from tokenmill.spec import IndexSpec

INDEX_FORMAT_VERSION = 1
NOT_STORED = ("embedding", "input_tokens", "output_tokens", "truncated")  # never copied beside the ids
LANCE_TABLE = "vectors"


class IndexBuildError(TokenmillError):
    """The index cannot be built or read: the reason names the output and the cause."""


@dataclass(frozen=True)
class IndexChoice:
    kind: str  # flat | hnsw | ivfpq
    params: dict[str, int]
    reason: str


# --- the outputs, shard by shard -------------------------------------------------------------


@dataclass(frozen=True)
class OutputShard:
    shard_id: str
    path: str
    rows: int


def finished_manifest(store: OutputStore) -> dict[str, Any]:
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


def output_shards(manifest: dict[str, Any]) -> list[OutputShard]:
    return [OutputShard(s["shard_id"], s["output"], s["rows_out"]) for s in manifest["shards"] if s["rows_out"]]


def file_stamp(store: OutputStore, path: str) -> list[Any]:
    info = store.fs.info(path)
    return [info.get("size"), info.get("ETag") or info.get("mtime") or info.get("LastModified")]


def index_key(store: OutputStore, manifest: dict[str, Any], index: IndexSpec) -> str:
    """What the index is built from: a changed output file, shard set, model or index section changes it."""
    shards = [[s["shard_id"], s["fingerprint"], s["rows_out"], file_stamp(store, s["output"])]
              for s in manifest["shards"] if s["rows_out"]]
    return stable_digest({"version": INDEX_FORMAT_VERSION, "model": manifest["model"], "shards": shards,
                          "index": index.model_dump(mode="json")}, 32)


def stored_columns(store: OutputStore, first: OutputShard, index: IndexSpec) -> list[str]:
    names = pq.read_schema(pa.BufferReader(store.read_bytes(first.path))).names
    if index.columns is None:
        return [c for c in names if c not in ("id", *NOT_STORED)]
    missing = [c for c in index.columns if c not in names]
    if missing:
        raise IndexBuildError(f"{first.path}: index.columns {missing} are not output columns (there are {names})")
    return [c for c in index.columns if c != "id"]


def read_vectors(store: OutputStore, shard: OutputShard, columns: list[str], dim: int | None
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


def iter_shards(store: OutputStore, shards: list[OutputShard], columns: list[str]
                 ) -> Iterator[tuple[int, OutputShard, np.ndarray, pa.Table]]:
    """(first position, shard, vectors, ids and columns) per shard; the dimension checked across shards."""
    dim, position = None, 0
    for shard in shards:
        vectors, table = read_vectors(store, shard, columns, dim)
        if dim is not None and vectors.shape[1] != dim:
            raise IndexBuildError(f"{shard.path}: embeddings have {vectors.shape[1]} dimensions, other shards {dim}")
        dim = vectors.shape[1]
        yield position, shard, vectors, table
        position += len(vectors)


def vector_dimension(store: OutputStore, shard: OutputShard) -> int:
    table = pq.ParquetFile(pa.BufferReader(store.read_bytes(shard.path))).read_row_group(0, columns=["embedding"])
    return len(table.column("embedding")[0].values)


def sample_positions(rows: int, index: IndexSpec, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the held-out queries and of the training sample (IVF-PQ), disjoint and deterministic."""
    rng = np.random.default_rng(index.seed)
    order = rng.permutation(rows)
    queries = np.sort(order[:min(index.recall_queries, rows)])
    train = np.sort(order[len(queries):len(queries) + index.train_rows]) if kind == "ivfpq" else np.array([], int)
    return queries, train


def take_rows(vectors: np.ndarray, start: int, positions: np.ndarray) -> np.ndarray:
    inside = positions[(positions >= start) & (positions < start + len(vectors))]
    return vectors[inside - start]


def ids_table(position: int, shard: OutputShard, table: pa.Table) -> pa.Table:
    return pa.table({"position": pa.array(np.arange(position, position + table.num_rows), pa.int64()),
                     "id": table.column("id").cast(pa.string()),
                     "shard_id": pa.array([shard.shard_id] * table.num_rows, pa.string()),
                     **{name: table.column(name) for name in table.column_names if name != "id"}})


def build_faiss(store, shards, columns, dim, choice, queries_at, train_at, folder):
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
        sample = np.concatenate([take_rows(v, start, train_at) for start, _, v, _ in iter_shards(store, shards, [])])
        index.train(sample)
        del sample
        index.nprobe = p["nprobe"]
    if choice.kind in ("flat", "hnsw"):
        reserve_vectors(index, sum(s.rows for s in shards))
    queries = []
    writer = None
    try:
        for start, shard, vectors, table in iter_shards(store, shards, columns):
            index.add(vectors)
            queries.append(take_rows(vectors, start, queries_at))
            ids = ids_table(start, shard, table)
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


def reserve_vectors(index, rows: int) -> None:
    """Allocate a flat or HNSW index's vector storage for every row before the first add. Grown
    shard by shard, the storage is reallocated and copied, so at the last growth the old and the
    new buffer are both resident: 483 MiB peak for 293 MiB of vectors (200k x 384), measured."""
    import faiss

    flat = faiss.downcast_index(index.storage) if hasattr(index, "storage") else index
    flat.codes.resize(rows * flat.code_size)  # std::vector keeps its capacity when it shrinks again
    flat.codes.resize(0)


def build_lance(store, shards, columns, dim, choice, queries_at, train_at, folder):
    import lancedb

    db = lancedb.connect(os.path.join(folder, "lance"))
    table = None
    queries = []
    for start, shard, vectors, rows in iter_shards(store, shards, columns):
        data = ids_table(start, shard, rows)
        data = data.append_column("vector", pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim))
        if table is None:
            table = db.create_table(LANCE_TABLE, data=data)
        else:
            table.add(data.cast(table.schema))
        queries.append(take_rows(vectors, start, queries_at))
    if choice.kind == "hnsw":
        table.create_index(metric="cosine", vector_column_name="vector", index_type="IVF_HNSW_SQ", num_partitions=1,
                           m=choice.params["m"], ef_construction=choice.params["ef_construction"])
    elif choice.kind == "ivfpq":
        p = choice.params
        table.create_index(metric="cosine", vector_column_name="vector", index_type="IVF_PQ",
                           num_partitions=p["nlist"], num_sub_vectors=p["pq_m"], num_bits=p["nbits"])

    def search(vectors: np.ndarray, k: int) -> list[list[int]]:
        return [lance_query(table, choice, vector, k).column("position").to_pylist() for vector in vectors]

    return search, np.concatenate(queries)


def lance_query(table, choice: IndexChoice, vector: np.ndarray, k: int, columns: list[str] | None = None):
    query = table.search(vector, vector_column_name="vector").distance_type("cosine").limit(k)
    if choice.kind == "hnsw":
        query = query.ef(choice.params["ef_search"])
    elif choice.kind == "ivfpq":
        query = query.nprobes(choice.params["nprobe"])
    return query.select([*(columns or ["position"]), "_distance"]).to_arrow()
