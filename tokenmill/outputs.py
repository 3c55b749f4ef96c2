"""The output dataset: one Parquet file per shard, rejects, shard records, the manifest.

Layout under the output root:
    <shard_id>.parquet          results, in the shard's input order
    _rejects/<shard_id>.parquet refused rows with their reason
    _shards/<shard_id>.json     one record per finished shard
    _manifest.json              every shard with its fingerprint, rows and tokens
    _state/                     Prefect's persisted shard results: what makes a re-run resume
Readers such as pandas and pyarrow.dataset skip the _-prefixed entries.

Every file appears whole or not at all: locally it is written under a temporary
name and renamed; on an object store it is one PUT, which is atomic.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.storage import retry_io, url_to_fs

MANIFEST = "_manifest.json"
REJECTS_DIR = "_rejects"
SHARDS_DIR = "_shards"
STATE_DIR = "_state"

REJECTS_SCHEMA = pa.schema(
    [
        ("shard_id", pa.string()),
        ("file", pa.string()),
        ("row", pa.int64()),  # row index in the file (Parquet)
        ("byte_offset", pa.int64()),  # where the line starts (JSONL)
        ("id", pa.string()),
        ("reason", pa.string()),
    ]
)


class OutputStore:
    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None):
        self.uri = uri
        self.fs, self.root = url_to_fs(uri, storage_options)
        self.local = "file" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def shard_output(self, shard_id: str) -> str:
        return self.path(f"{shard_id}.parquet")

    def shard_rejects(self, shard_id: str) -> str:
        return self.path(REJECTS_DIR, f"{shard_id}.parquet")

    def shard_duplicates(self, shard_id: str) -> str:
        """Rows whose id an earlier shard has (see tokenmill.audit)."""
        return self.path(REJECTS_DIR, f"{shard_id}.duplicates.parquet")

    def shard_record(self, shard_id: str) -> str:
        return self.path(SHARDS_DIR, f"{shard_id}.json")

    def write_bytes(self, path: str, data: bytes) -> None:
        retry_io(lambda: self._write_bytes(path, data), f"writing {path}")

    def _write_bytes(self, path: str, data: bytes) -> None:
        if self.local:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            temporary = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        else:
            self.fs.pipe_file(path, data)

    def write_table(self, path: str, table: pa.Table) -> None:
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="zstd")
        self.write_bytes(path, buffer.getvalue())

    def write_json(self, path: str, value: Any) -> None:
        self.write_bytes(path, json.dumps(value, indent=2, sort_keys=False, default=str).encode())

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    def read_bytes(self, path: str) -> bytes:
        return retry_io(lambda: self.fs.cat_file(path), f"reading {path}")

    def read_table(self, path: str, columns: list[str] | None = None) -> pa.Table:
        data = self.read_bytes(path)
        return pq.read_table(pa.BufferReader(data), columns=columns)

    def exists(self, path: str) -> bool:
        return retry_io(lambda: self.fs.exists(path), f"checking {path}")

    def delete(self, path: str) -> None:
        """Remove a file if it is there."""
        def remove() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
        retry_io(remove, f"deleting {path}")


def rejects_table(shard_id: str, uri: str, rows: list[tuple[int, object, str]], by_byte_offset: bool) -> pa.Table:
    positions = [row for row, _, _ in rows]
    return pa.table(
        {
            "shard_id": [shard_id] * len(rows),
            "file": [uri] * len(rows),
            "row": [None] * len(rows) if by_byte_offset else positions,
            "byte_offset": positions if by_byte_offset else [None] * len(rows),
            "id": [None if ident is None else str(ident) for _, ident, _ in rows],
            "reason": [reason for _, _, reason in rows],
        },
        schema=REJECTS_SCHEMA,
    )


def _protocols(fs) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
