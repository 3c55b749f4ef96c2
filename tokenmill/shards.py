"""Split a corpus into shards: bounded, independently retryable pieces with stable ids.

Parquet files split at row-group boundaries (a row group larger than the cap is cut
by row range); JSONL files split into byte ranges that start and end on line
boundaries, so no file is ever read whole to plan the work.

A file's plan reads its Parquet footer (or a JSONL file's first line and its cut points): one request each
on an object store, and one command lists its corpus several times before its shards run (the engine
trials, the prediction, the run itself). So a process keeps each object's plan by what names its content
(its etag, its size) and the job's cut, plans an object store's files concurrently, and reads ranges, not
the store's read-ahead blocks.
"""

from __future__ import annotations

import json
import posixpath
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.asyn import AsyncFileSystem
from pydantic import BaseModel, ConfigDict

from tokenmill.digest import stable_digest
from tokenmill.errors import InputError
from tokenmill.openai_wire import line_text, sniff_openai_batch
from tokenmill.spec import JobSpec
from tokenmill.storage import is_transient, retry_io, url_to_fs

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
ROW_NUMBER = "__row"  # where the row sits in its file: row index (Parquet) or byte offset (JSONL)


class ShardSpec(BaseModel):
    """A piece of one input file. Cheap to pass to a task; carries no data."""

    model_config = ConfigDict(frozen=True)

    shard_id: str
    uri: str
    format: Literal["parquet", "jsonl", "openai-batch"]  # openai-batch: JSONL of OpenAI Batch requests
    file_size: int
    file_version: str  # etag on object stores, mtime on local disk
    row_start: int = 0  # Parquet: global row range [row_start, row_end) in the file
    row_end: int = 0
    row_groups: tuple[int, ...] = ()
    byte_start: int = 0  # JSONL: byte range [byte_start, byte_end) in the file
    byte_end: int = 0
    fingerprint: str = ""
    # Uncompressed bytes of the shard's rows (Parquet row-group sizes, JSONL byte range): what a
    # fleet balances work by before any token is counted. Derived, so not in the fingerprint.
    data_bytes: int = 0

    @property
    def is_empty(self) -> bool:
        """A file with no rows (Parquet) or no bytes (JSONL)."""
        return self.row_end == self.row_start if self.format == "parquet" else self.byte_end == self.byte_start

    @property
    def expected_rows(self) -> int | None:
        return self.row_end - self.row_start if self.format == "parquet" else None


def discover_shards_for(spec: JobSpec, source: str | None = None) -> list[ShardSpec]:
    """The job's shards (or another source's, e.g. an eval file, cut the job's way)."""
    return discover_shards(source or spec.input, fmt=spec.format, max_shard_rows=spec.batching.max_shard_rows,
                           max_shard_bytes=spec.batching.max_shard_bytes, storage_options=spec.storage_options)


def discover_shards(
    input_uri: str,
    *,
    fmt: str = "auto",
    max_shard_rows: int = 5000,
    max_shard_bytes: int = 64 * 1024 * 1024,
    storage_options: dict[str, Any] | None = None,
) -> list[ShardSpec]:
    fs, root, files = list_input_files(input_uri, storage_options)

    def plan(path: str) -> list[ShardSpec]:
        return retry_io(lambda: _plan_file_once(fs, root, path, fmt, max_shard_rows, max_shard_bytes),
                        f"planning shards of {path}")

    if len(files) > 1 and isinstance(fs, AsyncFileSystem):  # a footer request each: overlapped, in order
        with ThreadPoolExecutor(min(PLAN_THREADS, len(files)), thread_name_prefix="tokenmill-plan") as pool:
            planned = list(pool.map(plan, files))
    else:
        planned = [plan(path) for path in files]
    return [shard for shards in planned for shard in shards]


PLAN_THREADS = 8  # requests in flight while planning an object store's files (under botocore's pool of 10)
PLANS_KEPT = 20_000  # objects whose plans a process keeps
_plans: dict[tuple, list[ShardSpec]] = {}
_plans_lock = threading.Lock()


def _local(fs) -> bool:
    return fs.protocol in ("file", ("file", "local"))


def _plan_file_once(fs, root: str, path: str, fmt: str, max_shard_rows: int, max_shard_bytes: int) -> list[ShardSpec]:
    """_plan_file, kept for this process where the file is a store's object with a version (its etag or
    modification time): by that, its size, the store (fsspec's token of its options), the root it is named from
    and the job's format and cut, so a rewritten object is planned again. Local files are planned every time
    (a footer read from disk costs little, and a same-size rewrite can keep its mtime within the clock's tick), as
    are other filesystems' (fsspec keys a synchronous one's instances by thread too)."""
    info = fs.info(path)
    version = _file_version(info)
    if not isinstance(fs, AsyncFileSystem) or not version:
        return _plan_file(fs, root, path, fmt, max_shard_rows, max_shard_bytes, info)
    key = (getattr(fs, "_fs_token", None), fs.unstrip_protocol(path), root, int(info.get("size") or 0), version,
           fmt, max_shard_rows, max_shard_bytes)
    with _plans_lock:
        kept = _plans.get(key)
    if kept is None:
        kept = _plan_file(fs, root, path, fmt, max_shard_rows, max_shard_bytes, info)
        with _plans_lock:
            if len(_plans) >= PLANS_KEPT:  # the older half goes (a corpus of more objects still hits the rest)
                for stale in list(_plans)[: PLANS_KEPT // 2]:
                    del _plans[stale]
            _plans[key] = kept
    return list(kept)


def _plan_file(fs, root: str, path: str, fmt: str, max_shard_rows: int, max_shard_bytes: int,
               info: dict[str, Any]) -> list[ShardSpec]:
    """The shards of one file (`info`: its fs.info). A file with no rows still gets one (empty) shard, so the
    manifest accounts for it instead of the file vanishing from the job."""
    file_format = file_format_of(fs, path, fmt)
    uri = path if _local(fs) else fs.unstrip_protocol(path)
    base = dict(uri=uri, format=file_format, file_size=int(info.get("size") or 0), file_version=_file_version(info))
    name = _shard_name(root, path)
    if file_format == "parquet":
        if base["file_size"] == 0:
            raise InputError(uri, "file is empty (0 bytes), so not a Parquet file: a Parquet file has at least "
                                  "a header and a footer")
        pieces = _parquet_pieces(fs, path, uri, max_shard_rows) or [(0, 0, (), 0)]
        return [_finish(ShardSpec(shard_id=f"{name}.r{start:09d}-{end:09d}", row_start=start, row_end=end,
                                  row_groups=groups, data_bytes=data_bytes, **base))
                for start, end, groups, data_bytes in pieces]
    ranges = list(_jsonl_ranges(fs, path, base["file_size"], max_shard_bytes)) or [(0, 0)]
    return [_finish(ShardSpec(shard_id=f"{name}.b{start:012d}-{end:012d}", byte_start=start, byte_end=end,
                              data_bytes=end - start, **base))
            for start, end in ranges]


def file_format_of(fs, path: str, fmt: str = "auto") -> Literal["parquet", "jsonl", "openai-batch"]:
    """A file's format: as the job names it, else by its extension, and a .jsonl file whose first line
    is an OpenAI Batch request is one."""
    file_format = detect_format(path, fmt)
    if file_format == "jsonl" and fmt == "auto" and sniff_openai_batch(first_line(fs, path)):
        return "openai-batch"
    return file_format


def input_format(input_uri: str, fmt: str = "auto", storage_options: dict[str, Any] | None = None) -> str | None:
    """The format of the input's first file, as discovery reads it; None where the input cannot be
    listed or read (the job reports what is wrong with its input when it discovers its shards)."""
    try:
        fs, _, files = list_input_files(input_uri, storage_options)
        return file_format_of(fs, files[0], fmt)
    except (InputError, OSError):
        return None


def list_input_files(input_uri: str, storage_options: dict[str, Any] | None = None):
    fs, path = url_to_fs(input_uri, storage_options)
    _forget_listings(fs, _glob_root(path) if any(ch in path for ch in "*?[") else path)
    return retry_io(lambda: _list_files(fs, input_uri, path), f"listing {input_uri}")


def _forget_listings(fs, root: str) -> None:
    """An object store's filesystem is one per process (fsspec's instance cache) and keeps the listings it made:
    listed again, a corpus that gained a file since was found by find but unknown to info (FileNotFoundError on
    the new file: a job's second run in one process), and a rewritten file kept its old etag. So each listing
    asks the store anew: the root, its parents, and every folder under it (invalidate_cache(root) drops the
    first two only, and find keeps a subfolder's listing it already holds)."""
    fs.invalidate_cache(root)
    listings = getattr(fs, "dircache", None)
    if not listings:
        return
    under = fs._strip_protocol(root).rstrip("/") + "/"
    for folder in [key for key in list(listings) if key.startswith(under)]:
        listings.pop(folder, None)


def _list_files(fs, input_uri: str, path: str):
    if any(ch in path for ch in "*?["):
        files = sorted(p for p in fs.glob(path) if fs.isfile(p))
        root = _glob_root(path)
    elif fs.isdir(path):
        files = sorted(
            p for p in fs.find(path)
            if p.lower().endswith(PARQUET_SUFFIXES + JSONL_SUFFIXES) and not _hidden(path, p)
        )
        root = path
    elif fs.exists(path):
        files, root = [path], posixpath.dirname(path)
    else:
        raise InputError(input_uri, "no such file or directory")
    if not files:
        raise InputError(input_uri, "no input files found (looked for *.parquet, *.jsonl, *.ndjson)")
    return fs, root, files


def detect_format(path: str, fmt: str = "auto") -> Literal["parquet", "jsonl", "openai-batch"]:
    if fmt in ("parquet", "jsonl", "openai-batch"):
        return fmt  # type: ignore[return-value]
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise InputError(path, "cannot tell the format from the extension; set format: parquet or jsonl")


def read_shard(shard: ShardSpec, columns: list[str] | None, storage_options: dict[str, Any] | None = None):
    """Read a shard's rows. Returns (table, bad_rows).

    The table holds `columns` (those the file has; None: every column) plus ROW_NUMBER. bad_rows lists
    (row_number, reason) for JSONL lines that are not a JSON object; Parquet has none.
    """
    fs, path = url_to_fs(shard.uri, storage_options)
    if shard.format == "parquet":
        return retry_io(lambda: _read_parquet_shard(fs, path, shard, columns), f"reading {shard.shard_id}"), []
    data = retry_io(lambda: _read_bytes(fs, path, shard.byte_start, shard.byte_end), f"reading {shard.shard_id}")
    if shard.format == "openai-batch":
        data = _openai_batch_as_rows(data, columns)
    return _parse_jsonl_shard(data, shard, columns)


def read_shard_bytes(shard: ShardSpec, storage_options: dict[str, Any] | None = None) -> bytes:
    """A JSONL shard's byte range, as stored."""
    fs, path = url_to_fs(shard.uri, storage_options)
    return retry_io(lambda: _read_bytes(fs, path, shard.byte_start, shard.byte_end), f"reading {shard.shard_id}")


def read_first_line(shard: ShardSpec, storage_options: dict[str, Any] | None = None) -> bytes:
    """The first non-blank line of a JSONL shard's file."""
    fs, path = url_to_fs(shard.uri, storage_options)
    return retry_io(lambda: first_line(fs, path), f"reading the first line of {shard.uri}")


def first_line(fs, path: str, limit: int = 1 << 20) -> bytes:
    """The first non-blank line of a JSONL file (read from its first MiB)."""
    with _ranged(fs, path) as handle:
        head = handle.read(limit)
    for line in head.split(b"\n"):
        if line.strip():
            return line
    return b""


def _ranged(fs, path: str):
    """A file opened for reads of ranges it knows (a first line, a cut point, a shard's bytes, a footer, a shard's
    row groups): on an object store each read fetches what it asks and no more. The store's default read-ahead
    fetched a block of 50 MiB (s3fs) past every read: 4 listings of a 64 MiB JSONL object moved 400 MiB, reading
    its shards 165 MiB (bench/S3_READS.md)."""
    return fs.open(path, "rb") if _local(fs) else fs.open(path, "rb", cache_type="none")


READ_WHOLE_BYTES = 4 * 2**20  # an object this small is fetched whole, in one request, to read a shard of it


def _openai_batch_as_rows(data: bytes, columns: list[str]) -> bytes:
    """OpenAI Batch lines as plain rows (id = custom_id, text = the request's text), for readers that
    take a corpus sample (the eval gate) or ids (the cross-shard audit): the first column asked for is
    the id, the second (if any) the text. A line that is not JSON stays as it is, so it is reported as such."""
    if not columns:
        return data
    out = []
    for line in data.split(b"\n"):
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            out.append(line)
            continue
        if isinstance(record, dict):
            record = {columns[0]: record.get("custom_id"), **({columns[1]: line_text(record)} if columns[1:] else {})}
        row = json.dumps(record, ensure_ascii=False).encode()
        out.append(row.ljust(len(line)))  # same length, so rejects keep the line's byte offset
    return b"\n".join(out)


# --- Parquet -----------------------------------------------------------------

def _parquet_pieces(fs, path: str, uri: str, max_rows: int) -> list[tuple[int, int, tuple[int, ...], int]]:
    """(row_start, row_end, row_groups, uncompressed bytes) of each piece of one file."""
    metadata = _parquet_metadata(fs, path, uri)
    pieces: list[tuple[int, int, tuple[int, ...]]] = []
    start, groups, rows = 0, [], 0
    offset = 0
    for index in range(metadata.num_row_groups):
        group_rows = metadata.row_group(index).num_rows
        if group_rows == 0:
            continue
        if group_rows > max_rows:
            if groups:
                pieces.append((start, start + rows, tuple(groups)))
                groups, rows = [], 0
            for cut in range(offset, offset + group_rows, max_rows):
                pieces.append((cut, min(cut + max_rows, offset + group_rows), (index,)))
        elif rows + group_rows > max_rows:
            pieces.append((start, start + rows, tuple(groups)))
            start, groups, rows = offset, [index], group_rows
        else:
            if not groups:
                start = offset
            groups.append(index)
            rows += group_rows
        offset += group_rows
    if groups:
        pieces.append((start, start + rows, tuple(groups)))
    offsets = [0]
    for index in range(metadata.num_row_groups):
        offsets.append(offsets[-1] + metadata.row_group(index).num_rows)
    return [(start, end, groups, _piece_bytes(metadata, offsets, start, end, groups)) for start, end, groups in pieces]


def _piece_bytes(metadata, offsets: list[int], start: int, end: int, groups: tuple[int, ...]) -> int:
    """The row groups' uncompressed size, pro rata where a piece cuts a group (offsets[i]:
    the first row of group i)."""
    total = 0.0
    for index in groups:
        group = metadata.row_group(index)
        overlap = min(end, offsets[index + 1]) - max(start, offsets[index])
        total += group.total_byte_size * overlap / max(group.num_rows, 1)
    return int(total)


def _parquet_metadata(fs, path: str, uri: str):
    try:
        with _ranged(fs, path) as handle:
            return pq.ParquetFile(handle).metadata
    except (pa.ArrowException, OSError, ValueError) as exc:
        if is_transient(exc):
            raise  # the store's trouble, not the file's: retried
        raise InputError(uri, f"not a readable Parquet file ({exc})") from exc


def _read_parquet_shard(fs, path: str, shard: ShardSpec, columns: list[str]) -> pa.Table:
    try:
        with _ranged(fs, path) as handle:
            source, size = handle, getattr(handle, "size", None) or 0
            if not _local(fs) and 0 < size <= READ_WHOLE_BYTES:  # its footer and rows in one request, not two
                source = pa.BufferReader(handle.read())  # (s3fs checks the object's etag on the read)
            parquet = pq.ParquetFile(source)
            names = parquet.schema_arrow.names
            present = list(names) if columns is None else [c for c in columns if c in names]
            if not shard.row_groups:  # a file with no rows: its columns still say whether it fits the job
                empty = parquet.schema_arrow.empty_table().select(present)
                return empty.append_column(ROW_NUMBER, pa.array([], pa.int64()))
            table = parquet.read_row_groups(list(shard.row_groups), columns=present)
            first_row = sum(parquet.metadata.row_group(i).num_rows for i in range(shard.row_groups[0]))
    except (pa.ArrowException, OSError) as exc:
        if is_transient(exc):
            raise
        raise InputError(shard.uri, f"cannot read Parquet row groups {list(shard.row_groups)} ({exc})") from exc
    table = table.slice(shard.row_start - first_row, shard.row_end - shard.row_start)
    rows = pa.array(range(shard.row_start, shard.row_start + table.num_rows), pa.int64())
    return table.append_column(ROW_NUMBER, rows)


# --- JSONL -------------------------------------------------------------------

def _jsonl_ranges(fs, path: str, size: int, max_bytes: int) -> Iterator[tuple[int, int]]:
    start = 0
    with _ranged(fs, path) as handle:
        while start < size:
            end = min(start + max_bytes, size)
            if end < size:
                end = _next_line_start(handle, end, size)
            yield start, end
            start = end


def _next_line_start(handle, offset: int, size: int) -> int:
    """The offset just past the first newline at or after `offset - 1`."""
    handle.seek(offset - 1)
    position, step = offset - 1, 1 << 16
    while position < size:
        chunk = handle.read(step)  # a request each on an object store: a long line takes a few, growing
        if not chunk:
            break
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(chunk)
        step = min(step * 2, 1 << 24)
    return size


def _read_bytes(fs, path: str, start: int, end: int) -> bytes:
    if end <= start:
        return b""
    with _ranged(fs, path) as handle:
        handle.seek(start)
        return handle.read(end - start)


def _parse_jsonl_shard(data: bytes, shard: ShardSpec, columns: list[str] | None):
    every_column = columns is None  # every key any row has, absent ones null
    values: dict[str, list] = {c: [] for c in columns or []}
    row_numbers: list[int] = []
    bad_rows: list[tuple[int, str]] = []
    offset = shard.byte_start
    for line in data.split(b"\n"):
        line_offset, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad_rows.append((line_offset, f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})"))
            continue
        except json.JSONDecodeError as exc:
            bad_rows.append((line_offset, f"line is not valid JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(record, dict):
            bad_rows.append((line_offset, f"line is a JSON {type(record).__name__}, not an object"))
            continue
        if every_column:
            for key in record:
                if key not in values:
                    values[key] = [None] * len(row_numbers)
        row_numbers.append(line_offset)
        for column, column_values in values.items():
            column_values.append(record.get(column))
    arrays = {}
    for column, column_values in values.items():
        if all(v is None for v in column_values) and column_values:
            continue  # the column is absent from this shard: a structural error for the validator
        arrays[column] = _jsonl_column(column_values)
    arrays[ROW_NUMBER] = pa.array(row_numbers, pa.int64())
    return pa.table(arrays), bad_rows


def _jsonl_column(values: list) -> pa.Array:
    """Keep JSON's types where they agree; mixed types become strings so a reject can say why."""
    kinds = {type(v) for v in values if v is not None}
    if kinds <= {str} or kinds <= {int} or kinds <= {float, int} or kinds <= {bool}:
        return pa.array(values)
    return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], pa.string())


# --- helpers -----------------------------------------------------------------

def _finish(shard: ShardSpec) -> ShardSpec:
    identity = shard.model_dump(exclude={"fingerprint", "shard_id", "data_bytes"})
    return shard.model_copy(update={"fingerprint": stable_digest(identity)})


def _file_version(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "ETAG"):
        if info.get(key):
            return str(info[key]).strip('"')
    for key in ("mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _shard_name(root: str, path: str) -> str:
    relative = posixpath.relpath(path, root) if root else posixpath.basename(path)
    if relative.startswith(".."):
        relative = posixpath.basename(path)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", relative)


def _glob_root(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            break
        fixed.append(part)
    return "/".join(fixed)


def _hidden(root: str, path: str) -> bool:
    relative = posixpath.relpath(path, root)
    return any(part.startswith(("_", ".")) for part in relative.split("/"))
