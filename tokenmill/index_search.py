"""Search over a built index: open it (copied down from object storage when remote), embed the query
texts with the job's model, and return each query's hits with their stored columns."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from tokenmill.encoding import encode_rows
from tokenmill.engines import get_engine
from tokenmill.index import INDEX_DIR, POINTER, read_pointer
from tokenmill.index_backends import LANCE_TABLE, IndexBuildError, IndexChoice, lance_query
from tokenmill.outputs import OutputStore
from tokenmill.resolution import resolve_job
from tokenmill.spec import JobSpec, ModelSpec


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
                found = lance_query(self.table, choice, vector, k, names).to_pylist()
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
    job = resolve_job(JobSpec(mode="embed", model=ModelSpec(**fields)))
    encoded = encode_rows(texts, job.spec, job.model_path)
    return np.stack(get_engine(job.model_path, job.spec).embed(encoded.token_ids)).astype(np.float32)


def search_text(output: str, texts: list[str], k: int = 10, storage_options: dict[str, Any] | None = None,
                engine: str | None = None) -> list[list[dict[str, Any]]]:
    """Each text's top-k hits in the output's index: id, score (cosine) and the stored columns."""
    opened = OpenIndex(output, storage_options)
    try:
        return opened.search(embed_queries(texts, opened.report.model, engine), k)
    finally:
        opened.close()
