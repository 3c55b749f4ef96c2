"""The output dataset: one Parquet file per shard, rejects, shard records, the manifest.

Layout under the output root:
    <shard_id>.parquet          results, in the shard's input order
    _rejects/<shard_id>.parquet refused rows with their reason
    _rejects/<shard_id>.duplicates.parquet
                                rows whose id an earlier shard has (see tokenmill.audit)
    _shards/<shard_id>.json     one record per finished shard
    _manifest.json              every shard with its fingerprint, rows and tokens
    _state/                     the orchestrator's persisted shard results: what makes a re-run resume
    _tmp/<writer>/              files being written (local disk only), one folder per process
    _stale/                     files of shards that are no longer the job's, under their own names
    _cache/                     the row cache (tokenmill.row_cache), where the job's cache.uri is empty
Directory readers see only this run's output rows: pyarrow.dataset and pandas skip every
_-prefixed entry, and duckdb and polars read `<root>/*.parquet`, which does not descend
(polars' own directory reading takes every file below, _rejects/ and _manifest.json too).

Every file appears whole or not at all: locally it is written under _tmp/ (the same
filesystem, so the rename into place is atomic) and renamed; on an object store it is
one PUT, which is atomic. A process killed mid-write leaves its file under _tmp/, where
no reader looks; the end of the next run removes it once its writer is gone.

The manifest is the truth: at the end of a run, outputs, rejects, records and cached
results of shards outside the run's shard set (an earlier max_shard_rows, a removed input
file) move to _stale/, so they are never read as part of the result nor reused.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import re
import shutil
import time
import uuid
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import progress
from tokenmill.processes import ProcessIdentity, is_gone
from tokenmill.results import ShardResult
from tokenmill.spec import JobSpec
from tokenmill.storage import retry_io, url_to_fs

MANIFEST = "_manifest.json"
REJECTS_DIR = "_rejects"
SHARDS_DIR = "_shards"
STATE_DIR = "_state"
TEMP_DIR = "_tmp"
STALE_DIR = "_stale"

# A temporary file this old is left over whoever wrote it: a write is one buffer already in
# memory, done in seconds. Only files of writers on other machines wait this long.
TEMP_MAX_AGE_SECONDS = 24 * 3600

_OLD_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{32}$")  # what earlier versions left beside the outputs
_CACHE_KEY = re.compile(r"^(?P<shard_id>.+)-[0-9a-f]{32}$")  # tokenmill.runner.shard_cache_key

log = logging.getLogger(__name__)

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
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        folder = self.path(TEMP_DIR, writer_name())
        temporary = posixpath.join(folder, f"{uuid.uuid4().hex}.{posixpath.basename(path)}")
        try:
            with _create(temporary) as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            _remove_quietly(temporary)
            raise

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


def writer_name() -> str:
    """This process, as its folder under _tmp/ names it: host, PID namespace, PID and the
    process's start time, so a clean-up on the same host can tell a live writer from one
    that is gone, even when its PID has been given to a new process."""
    me = ProcessIdentity.current()
    return f"{_place(me)}.{me.pid}.{me.start_time or '0'}"


def _place(process: ProcessIdentity) -> str:
    """Host and PID namespace as a folder name has them: `<host, made safe>.<namespace digits>`."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", process.host or "") or "host"
    namespace = "".join(c for c in process.pid_namespace or "" if c.isdigit()) or "0"
    return f"{host}.{namespace}"


def remove_leftover_temporaries(store: OutputStore, max_age_seconds: float = TEMP_MAX_AGE_SECONDS) -> list[str]:
    """Remove what killed writes left, never a live writer's file; the paths removed.

    A folder under _tmp/ goes whole when its writer ran on this host (same PID namespace)
    and is gone; any other temporary file goes once it is older than max_age_seconds (its
    writer on another machine, or in a container that shares no PID namespace with us).
    Files an earlier version left beside the outputs (`*.tmp-<hex>`) go too: this version
    never writes them. Object stores have nothing to clean: a PUT leaves no temporary file.
    """
    if not store.local:
        return []
    removed: list[str] = []
    for folder in (store.root, store.path(REJECTS_DIR), store.path(SHARDS_DIR), store.path(STATE_DIR)):
        for name in _names(folder):
            path = posixpath.join(folder, name)
            if _OLD_TEMPORARY.search(name) and os.path.isfile(path):
                _remove_quietly(path)
                removed.append(path)
    oldest = time.time() - max_age_seconds
    temporaries = store.path(TEMP_DIR)
    for writer in _names(temporaries):
        folder = posixpath.join(temporaries, writer)
        files = [posixpath.join(dirpath, name) for dirpath, _, names in os.walk(folder) for name in names]
        if _writer_gone(writer):
            shutil.rmtree(folder, ignore_errors=True)
            removed += files
            continue
        for path in files:
            if _modified(path) < oldest:
                _remove_quietly(path)
                removed.append(path)
        if not _names(folder) and _modified(folder) < oldest:
            try:
                os.rmdir(folder)  # a writer that comes back makes it again (see _create)
            except OSError:
                pass
    if removed:
        log.warning("removed %d temporary files left by killed writes under %s: %s", len(removed), store.root,
                    _some([posixpath.relpath(p, store.root) for p in removed]))
    return sorted(removed)


def move_stale_outputs(store: OutputStore, shard_ids: Iterable[str], keep: Iterable[str] = ()) -> list[str]:
    """Move every file of a shard outside `shard_ids` under _stale/; the paths moved.

    Looked at: the root's *.parquet (any of them, ours or not: a directory reader would
    take it for output), _rejects/*.parquet (`<id>.duplicates.parquet` is shard <id>'s),
    _shards/*.json and _state/<shard_id>-<key> (a cached result whose output is now stale
    must not stand in for running the shard again). `keep`: paths never moved, such as
    the job's own input files should they lie in the output root.
    """
    current = set(shard_ids)
    kept = {_strip(store, path) if "://" in path else os.path.abspath(path) for path in keep}

    def owner(folder: str, name: str) -> str | None:
        if folder == "" and name.endswith(".parquet"):
            return name[: -len(".parquet")]
        if folder == REJECTS_DIR and name.endswith(".parquet"):
            stem = name[: -len(".parquet")]
            if stem.endswith(".duplicates") and stem not in current:
                return stem[: -len(".duplicates")]
            return stem
        if folder == SHARDS_DIR and name.endswith(".json"):
            return name[: -len(".json")]
        match = _CACHE_KEY.match(name) if folder == STATE_DIR else None
        return match.group("shard_id") if match else None

    moved: list[str] = []
    stale_shards: set[str] = set()
    for folder in ("", REJECTS_DIR, SHARDS_DIR, STATE_DIR):
        for path in _files(store, store.path(folder) if folder else store.root):
            name = posixpath.basename(path)
            shard_id = owner(folder, name)
            if shard_id is None or shard_id in current or path in kept or _OLD_TEMPORARY.search(name):
                continue
            target = store.path(STALE_DIR, folder, name) if folder else store.path(STALE_DIR, name)
            if _move(store, path, target):
                moved.append(path)
                stale_shards.add(shard_id)
    if moved:
        log.warning("moved %d files of %d shard(s) not among this run's %d to %s: %s", len(moved),
                    len(stale_shards), len(current), store.path(STALE_DIR),
                    _some([posixpath.relpath(p, store.root) for p in moved]))
    return moved


def _files(store: OutputStore, folder: str) -> list[str]:
    """The files directly in a folder, fresh from the store (s3fs caches listings)."""
    def listing() -> list[str]:
        store.fs.invalidate_cache(folder)
        try:
            entries = store.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return []
        return sorted(_strip(store, e["name"]) for e in entries if e.get("type") == "file")
    return retry_io(listing, f"listing {folder}")


def _move(store: OutputStore, source: str, target: str) -> bool:
    def move() -> bool:
        try:
            if store.local:
                os.makedirs(posixpath.dirname(target), exist_ok=True)
                os.replace(source, target)
            else:
                store.fs.mv(source, target)  # copy, then delete: the file is never missing from both
        except FileNotFoundError:
            return False  # another run of the job moved it first
        return True
    return retry_io(move, f"moving {source} to {target}")


def _strip(store: OutputStore, name: str) -> str:
    return store.fs._strip_protocol(name) if "://" in name else name


def _some(paths: list[str], shown: int = 10) -> str:
    names = sorted(paths)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _create(path: str):
    """Open a new file for writing, making its folder first."""
    folder = posixpath.dirname(path)
    os.makedirs(folder, exist_ok=True)
    try:
        return open(path, "xb")
    except FileNotFoundError:  # a clean-up took the folder, empty for a day, just now
        os.makedirs(folder, exist_ok=True)
        return open(path, "xb")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _modified(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")  # gone already: nothing to remove


def _writer_gone(writer: str) -> bool:
    """Whether the process a _tmp/ folder names ran in this host's PID namespace and has ended
    (a zombie, or another process on its PID, counts as ended)."""
    parts = writer.rsplit(".", 2)
    me = ProcessIdentity.current()
    if len(parts) != 3 or parts[0] != _place(me) or not parts[1].isdigit():
        return False  # another host or PID namespace (or not a writer's folder): only age tells
    return is_gone(ProcessIdentity(me.host, me.pid_namespace, int(parts[1]), parts[2])) is True


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


def write_shard_tables(store: OutputStore, shard_id: str, uri: str, output: pa.Table,
                       rejects: list[tuple[int, object, str]], by_byte_offset: bool) -> None:
    """A shard's output and its rejects, in place of what an earlier run of it left."""
    store.delete(store.shard_duplicates(shard_id))  # the new output has every row; the audit re-decides
    store.write_table(store.shard_output(shard_id), output)
    store.write_table(store.shard_rejects(shard_id), rejects_table(shard_id, uri, rejects, by_byte_offset))


def record_shard(store: OutputStore, result: ShardResult) -> ShardResult:
    """The finished shard's record, once its rows add up: rows in = rows out + rows rejected."""
    if result.rows_in != result.rows_out + result.rows_rejected:  # the one invariant we never break
        raise AssertionError(f"shard {result.shard_id}: {result.rows_in} rows in, {result.rows_out} out, "
                             f"{result.rows_rejected} rejected")
    store.write_json(store.shard_record(result.shard_id), result.model_dump())
    progress.emit("shard_done", shard_id=result.shard_id, result=result)
    return result


def _protocols(fs) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def build_output(valid: pa.Table, spec: JobSpec, results: list, lengths: list[int], truncated: list[bool]) -> pa.Table:
    """The shard's output rows: id; embedding, or output_text (plus parsed and structured_error with a
    response format); input_tokens, output_tokens, truncated (and finish_reason, logprobs when asked);
    then the passthrough columns. With generation.n > 1, output_text, finish_reason, parsed,
    structured_error and logprobs hold one list entry per completion; output_tokens counts them all."""
    from tokenmill.prompts import passthrough_columns

    columns: dict[str, pa.Array] = {"id": valid.column(spec.id_column).combine_chunks()}
    params = spec.generation
    many = spec.mode == "generate" and params.n > 1
    completions = [list(g.samples) or [g] for g in results] if spec.mode == "generate" else []

    def per_row(values: list[list], kind: pa.DataType) -> pa.Array:
        if many:
            return pa.array(values, pa.list_(kind))
        return pa.array([v[0] for v in values], kind)

    if spec.mode == "embed":
        columns["embedding"] = _embedding_array(results)
        output_tokens = [0] * len(results)
    else:
        columns["output_text"] = per_row([[c.text for c in row] for row in completions], pa.string())
        if params.response_format is not None:
            from tokenmill.generation import OutputChecker

            checker = OutputChecker(params.response_format)
            checked = [[checker.check(c.text, c.finish_reason) for c in row] for row in completions]
            columns["parsed"] = per_row([[c.parsed for c in row] for row in checked], pa.string())
            columns["structured_error"] = per_row([[c.error for c in row] for row in checked], pa.string())
        output_tokens = [g.output_tokens for g in results]
    columns["input_tokens"] = pa.array(lengths, pa.int32())
    columns["output_tokens"] = pa.array(output_tokens, pa.int32())
    columns["truncated"] = pa.array(truncated, pa.bool_())
    if spec.mode == "generate":
        columns["finish_reason"] = per_row([[c.finish_reason for c in row] for row in completions], pa.string())
        if params.logprobs is not None:
            columns["logprobs"] = per_row([[c.logprobs for c in row] for row in completions], LOGPROBS_TYPE)
    for name in passthrough_columns(spec, valid.column_names):
        columns[name] = valid.column(name).combine_chunks()
    return pa.table(columns)


_LOGPROB = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
# One completion's logprobs: per generated token, its own and the top alternatives'.
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32()),
                                    ("top_logprobs", pa.list_(_LOGPROB))]))


def structured_invalid_rows(output: pa.Table) -> int:
    """Rows with a structured_error (any of their completions): outputs that do not conform."""
    if "structured_error" not in output.column_names:
        return 0
    column = output.column("structured_error")
    if pa.types.is_list(column.type):
        return sum(any(e is not None for e in row or []) for row in column.to_pylist())
    return output.num_rows - column.null_count


def _embedding_array(vectors: list[np.ndarray]) -> pa.Array:
    if not vectors:
        return pa.array([], pa.list_(pa.float32()))
    matrix = np.ascontiguousarray(np.stack(vectors), dtype=np.float32)
    offsets = pa.array(np.arange(0, matrix.size + 1, matrix.shape[1], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))
