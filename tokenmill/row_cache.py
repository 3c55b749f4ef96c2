"""The row cache: each row's output kept under a digest of everything that decides it, so a re-run of a
changed shard computes only its changed rows, and identical rows are computed once.

The shard stays the unit of resume (tokenmill.results.shard_cache_key): a shard whose fingerprint is
unchanged is not run at all. A shard that changed (rows edited or appended) runs again, and this cache
answers the rows that did not.

**Key.** A row's key is `stable_digest([identity, token ids], 32)`: the token ids the engine gets (after
the prompt is rendered and the overlong policy applied), under the identity of everything else that
decides the output (`cache_identity`): the model's name and a fingerprint of its files' contents, the
engine, the dtype as it resolves on this kind of device, the quantization (for ONNX Runtime, its recipe
as applied on this CPU; for OpenVINO, its recipe and a digest of its calibration rows), engine_kwargs, the mode, the pooling and normalisation (embed) or the sampling
parameters (generate; the seed only when sampling). Not in it: batch settings and library versions
(speed, and the low bits of floats; the shard key leaves them out for the same reason).

**Only deterministic requests.** Embeddings, greedy generation, and sampling with a fixed seed on vLLM
(one generator per request) are cached and collapsed. Sampling without a seed, or on the transformers
engine (one generator per batch: a row's draw depends on its batch), bypass the cache; the shard's
record says why (`bypass_reason`).

**Storage.** Parquet under `<cache.uri>/rows-v1/<identity digest>/<content digest>.parquet`, one file per
shard's newly computed rows, named by the digest of its keys, so two writers never clash (the same name
means the same rows), written atomically (tokenmill.outputs.OutputStore: temporary name and rename, or
one PUT). A process reads each file's key column once and keeps a key -> file index (`_FolderIndex`),
refreshed by listing the folder before each shard's bulk lookup; the rows found are read from their
files, checked (identity, token count, dimensions) and returned. A file that cannot be read, or an entry
that does not check out, is a miss with a warning, never an error and never a wrong answer. With
cache.max_bytes, the oldest files (locally, least recently used: a hit touches its file) are evicted
after each write.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill.call_costs import output_tokens
from tokenmill.device import CPU_ONLY_ENGINES
from tokenmill.digest import stable_digest
from tokenmill.embedding import read_pooling
from tokenmill.engine_protocol import Generation
from tokenmill.models import models_home
from tokenmill.outputs import OutputStore, remove_leftover_temporaries
from tokenmill.results import generation_identity
from tokenmill.spec import ONNX_QUANTIZATIONS, JobSpec
from tokenmill.storage import describe_error, retry_io

log = logging.getLogger(__name__)

ROW_CACHE_VERSION = 1  # bump when an entry's meaning changes: older entries are then never found
ENTRIES_DIR = "rows-v1"
CACHE_DIR = "_cache"  # under the output root when cache.uri is empty (readers skip _-prefixed entries)
METADATA_KEY = b"tokenmill.row_cache"
# prompt fields: already in the token ids, so a template rewritten to the same tokens keeps its entries
_PROMPT_FIELDS = ("messages", "prompt_template", "messages_column")


# --- what decides a row's output ------------------------------------------------------------------

def bypass_reason(spec: JobSpec, engine_name: str) -> str | None:
    """Why this job's rows cannot be cached or collapsed (their outputs are not a function of their
    inputs), or None when they can."""
    if spec.mode != "generate" or spec.generation.temperature == 0:
        return None
    temperature = spec.generation.temperature
    if spec.generation.seed is None:
        return f"sampling at temperature {temperature:g} without a seed: no two runs give the same output"
    if engine_name != "vllm":
        return (f"sampling at temperature {temperature:g} on the {engine_name} engine: its seed draws per batch, "
                "so a row's output depends on the rows beside it")
    return None


def cache_identity(spec: JobSpec, model_path: str, engine_name: str) -> dict[str, Any]:
    """Everything but the row's tokens that decides its output (see the module's docstring)."""
    model = spec.model
    identity: dict[str, Any] = {
        "version": ROW_CACHE_VERSION,
        "mode": spec.mode,
        "model": spec.model_name,
        "weights": weights_fingerprint(model_path, model.engine_kwargs.get("revision")),
        "engine": engine_name,
        "device": "cpu" if engine_name in CPU_ONLY_ENGINES else device_kind(),
        "dtype": "float32" if engine_name in CPU_ONLY_ENGINES else model.dtype,
        "quantization": model.quantization,
        "engine_kwargs": model.engine_kwargs,
    }
    if engine_name == "onnxruntime" and model.quantization in ONNX_QUANTIZATIONS:
        from tokenmill.onnx_models import recipe

        identity["onnx_recipe"] = recipe(model.quantization)  # int8 reduces its range on a CPU without VNNI
    if engine_name == "openvino" and model.quantization is not None:
        identity["openvino_recipe"] = openvino_identity(spec, model_path)
    if spec.mode == "embed":
        pooling = read_pooling(model_path) if Path(model_path).is_dir() else None
        identity["pooling"] = asdict(pooling) if pooling else "engine's own"
    else:
        sampling = {k: v for k, v in generation_identity(spec).items() if k not in _PROMPT_FIELDS}
        if spec.generation.temperature == 0:
            sampling.pop("seed", None)  # greedy: the seed draws nothing
        identity["sampling"] = sampling
    return identity


def openvino_identity(spec: JobSpec, model_path: str) -> dict[str, Any]:
    """OpenVINO int8's recipe as applied here, and its calibration rows (another corpus: another model)."""
    from tokenmill.openvino_engine import calibration
    from tokenmill.openvino_models import recipe

    how = recipe(spec.model.quantization)
    how.pop("versions")  # library versions are not in the row cache's key (see the module's docstring)
    return {**how, "calibration": calibration(spec, model_path)[1]}


@functools.cache
def device_kind() -> str:
    """cpu or cuda: float results differ between them in their low bits, so entries are not shared."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch comes with every engine
        return "cpu"


def row_keys(identity_digest: str, token_ids: Sequence[Sequence[int]]) -> list[str]:
    return [stable_digest([identity_digest, list(ids)], 32) for ids in token_ids]


# Files that make a model what it is: weights, configs, tokenizer files, sentence-transformers modules.
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".gguf", ".json", ".txt", ".model", ".jinja")


@functools.lru_cache(maxsize=16)
def weights_fingerprint(model_path: str, revision: str | None = None) -> str:
    """sha256 over the contents of the model's files (weights, configs, tokenizer, sentence-transformers
    modules): a new checkpoint in the same place is a new model, and the same files anywhere are the same
    model, so machines share entries. Each file's digest is kept on this machine by (path, size, mtime), so
    a large checkpoint is read once. A hub name not in the local hub cache is identified by name and revision."""
    root = Path(model_path)
    if not root.is_dir():
        root = _hub_snapshot(model_path, revision)
        if root is None:
            log.warning("row cache: %s is not a local model directory; its entries are keyed by its name%s only",
                        model_path, f" and revision {revision}" if revision else "")
            return stable_digest({"name": model_path, "revision": revision}, 16)
    files = [p for p in root.iterdir() if p.is_file() and p.suffix in _MODEL_SUFFIXES]
    for module in _module_dirs(root):
        files += [p for p in module.iterdir() if p.is_file() and p.suffix in _MODEL_SUFFIXES]
    parts = sorted((str(p.relative_to(root)), _file_digest(p)) for p in files)
    return stable_digest(parts, 16)


def _module_dirs(root: Path) -> list[Path]:
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [root / m["path"] for m in modules if isinstance(m, dict) and m.get("path") and (root / m["path"]).is_dir()]


def _hub_snapshot(name: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub name, or not downloaded here
        return None


def _file_digest(path: Path) -> str:
    stat = path.stat()
    memo = models_home().parent / "file-digests" / stable_digest([str(path.resolve()), stat.st_size,
                                                                   stat.st_mtime_ns], 32)
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    value = digest.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}")
        partial.write_text(value)
        partial.replace(memo)
    except OSError:
        pass  # read again next time
    return value


def embedding_dimensions(model_path: str) -> int | None:
    """The vectors' length the model gives: its last sentence-transformers Dense module's out_features,
    else its hidden size. None where neither is known (then the entries' own lengths are not checked)."""
    root = Path(model_path)
    for module in reversed(_module_dirs(root)):
        try:
            config = json.loads((module / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if "out_features" in config:
            return int(config["out_features"])
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("hidden_size", "d_model", "dim", "n_embd"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


# --- entries and where they live ----------------------------------------------------------------

@dataclass
class Entry:
    key: str
    value: Any  # embed: np.ndarray (float32); generate: Generation
    input_tokens: int
    output_tokens: int
    seconds_per_token: float = 0.0  # engine seconds per input + output token when it was computed


def cache_uri(spec: JobSpec) -> str:
    return spec.cache.uri or posixpath.join(spec.output.rstrip("/"), CACHE_DIR)


class _FolderIndex:
    """One identity's folder, as this process knows it: which file holds each key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[str, list[str]] = {}  # path -> its keys ([] for a file that could not be read)
        self.where: dict[str, str] = {}  # key -> the file holding it (the latest written, if several)

    def add(self, path: str, keys: list[str]) -> None:
        self.files[path] = keys
        for key in keys:
            self.where[key] = path

    def forget(self, path: str) -> None:
        for key in self.files.pop(path, []):
            if self.where.get(key) == path:
                del self.where[key]


_indexes: dict[tuple[str, str], _FolderIndex] = {}
_indexes_lock = threading.Lock()
_cleaned: set[str] = set()  # cache roots whose leftover temporaries this process removed


class RowCache:
    """The entries of one identity under a cache location: bulk lookup, write, eviction."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None, identity: dict[str, Any],
                 dimensions: int | None = None):
        self.store = OutputStore(uri, storage_options)
        self.identity = identity
        self.digest = stable_digest(identity, 32)
        self.folder = self.store.path(ENTRIES_DIR, self.digest[:24])
        self.dimensions = dimensions  # embed: the vectors' length the model gives

    @classmethod
    def for_job(cls, spec: JobSpec, model_path: str, engine_name: str) -> RowCache:
        dimensions = embedding_dimensions(model_path) if spec.mode == "embed" else None
        return cls(cache_uri(spec), spec.storage_options, cache_identity(spec, model_path, engine_name), dimensions)

    def keys(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        return row_keys(self.digest, token_ids)

    def _index(self) -> _FolderIndex:
        """This folder's index, brought up to date with a listing (other processes write here too)."""
        protocol = self.store.fs.protocol if isinstance(self.store.fs.protocol, str) else self.store.fs.protocol[0]
        with _indexes_lock:
            index = _indexes.setdefault((protocol, self.folder), _FolderIndex())
        with index.lock:
            try:
                listed = set(self._listing())
            except Exception as exc:  # noqa: BLE001 - an unreadable cache is an empty one
                log.warning("row cache: could not list %s (%s); rows are computed", self.folder, describe_error(exc))
                return _FolderIndex()
            for path in set(index.files) - listed:  # evicted, by us or another process
                index.forget(path)
            for path in sorted(listed - set(index.files)):
                try:
                    keys = self._read(path, ["key"]).column("key").to_pylist()
                except Exception as exc:  # noqa: BLE001 - corrupt, truncated, not Parquet, or gone meanwhile
                    log.warning("row cache: ignoring %s, which cannot be read (%s)", path, describe_error(exc))
                    keys = []
                index.add(path, keys)
        return index

    def _listing(self) -> list[str]:
        fs = self.store.fs

        def listing() -> list[str]:
            fs.invalidate_cache(self.folder)
            try:
                entries = fs.ls(self.folder, detail=True)
            except FileNotFoundError:
                return []
            return [_strip(fs, e["name"]) for e in entries
                    if e.get("type") == "file" and e["name"].endswith(".parquet")]
        return retry_io(listing, f"listing {self.folder}")

    def _read(self, path: str, columns: list[str] | None = None) -> pa.Table:
        def read() -> pa.Table:
            with self.store.fs.open(path, "rb") as handle:
                return pq.read_table(handle, columns=columns)
        return retry_io(read, f"reading {path}")

    def contains(self, keys: Iterable[str]) -> set[str]:
        """The keys some file here holds, by the index alone (nothing checked, nothing read): for estimates."""
        index = self._index()
        return {key for key in keys if key in index.where}

    def lookup(self, wanted: dict[str, int]) -> dict[str, Entry]:
        """The entries for these keys (key -> the row's input token count) that exist and check out."""
        index = self._index()
        by_file: dict[str, list[str]] = defaultdict(list)
        for key in wanted:
            if key in index.where:
                by_file[index.where[key]].append(key)
        found: dict[str, Entry] = {}
        for path, keys in by_file.items():
            try:
                table = self._read(path)
                seconds_per_token = float(_file_metadata(table).get("engine_seconds_per_token") or 0.0)
                table = table.filter(pc.is_in(table.column("key"), pa.array(keys, pa.string())))
                found.update(self._checked(path, table, wanted, seconds_per_token))
            except Exception as exc:  # noqa: BLE001 - its rows are computed again
                log.warning("row cache: could not read %s (%s); its %d rows are computed again", path,
                            describe_error(exc), len(keys))
                with index.lock:
                    index.forget(path)
                continue
            if self.store.local:
                _touch(path)  # eviction takes the least recently used first
        return found

    def _checked(self, path: str, table: pa.Table, wanted: dict[str, int],
                 seconds_per_token: float) -> dict[str, Entry]:
        found: dict[str, Entry] = {}
        wrong: dict[str, int] = defaultdict(int)
        keys = table.column("key").to_pylist()
        identities = table.column("identity").cast(pa.string()).to_pylist()
        inputs = table.column("input_tokens").to_pylist()
        outputs = table.column("output_tokens").to_pylist()
        embed = self.identity["mode"] == "embed"
        if embed:
            vectors = table.column("embedding").combine_chunks()
            offsets = vectors.offsets.to_numpy()
            values = vectors.values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
            present = vectors.is_valid().to_numpy(zero_copy_only=False)
        else:
            generations = table.column("generation").to_pylist()
        for row, key in enumerate(keys):
            if identities[row] != self.digest:
                wrong["made by another model, engine or setting"] += 1
                continue
            if inputs[row] != wanted[key]:
                wrong["for an input of another length"] += 1
                continue
            if embed:
                length = int(offsets[row + 1] - offsets[row])
                if not present[row] or (self.dimensions is not None and length != self.dimensions):
                    wrong[f"of dimension {length}, not the model's {self.dimensions}"] += 1
                    continue
                value: Any = values[offsets[row]:offsets[row + 1]]
            else:
                try:
                    value = _generation(json.loads(generations[row]))
                except (TypeError, ValueError, KeyError):
                    wrong["whose generation cannot be read"] += 1
                    continue
            found[key] = Entry(key, value, int(inputs[row]), int(outputs[row] or 0), seconds_per_token)
        for why, count in wrong.items():
            log.warning("row cache: ignored %d entries in %s %s; those rows are computed", count, path, why)
        return found

    def write(self, entries: list[Entry], seconds_per_token: float) -> str | None:
        """Store newly computed entries as one file; its path, or None when nothing was written (a failed
        write is a warning: the rows are in the shard's output, and only the next run pays for them)."""
        if not entries:
            return None
        keys = [e.key for e in entries]
        path = posixpath.join(self.folder, f"{stable_digest([self.digest, sorted(keys)], 32)}.parquet")
        try:
            table = self._table(entries, seconds_per_token)
            if self.store.uri not in _cleaned:
                _cleaned.add(self.store.uri)
                remove_leftover_temporaries(self.store)  # what killed writers left under <cache>/_tmp
            self.store.write_table(path, table)
        except Exception as exc:  # noqa: BLE001
            log.warning("row cache: could not write %d entries to %s (%s)", len(entries), path, describe_error(exc))
            return None
        protocol = self.store.fs.protocol if isinstance(self.store.fs.protocol, str) else self.store.fs.protocol[0]
        with _indexes_lock:
            index = _indexes.setdefault((protocol, self.folder), _FolderIndex())
        with index.lock:
            index.add(path, keys)
        return path

    def _table(self, entries: list[Entry], seconds_per_token: float) -> pa.Table:
        columns: dict[str, pa.Array] = {
            "key": pa.array([e.key for e in entries], pa.string()),
            "identity": pa.array([self.digest] * len(entries), pa.string()).dictionary_encode(),
            "input_tokens": pa.array([e.input_tokens for e in entries], pa.int32()),
            "output_tokens": pa.array([e.output_tokens for e in entries], pa.int32()),
        }
        if self.identity["mode"] == "embed":
            matrix = np.ascontiguousarray(np.stack([e.value for e in entries]), dtype=np.float32)
            offsets = pa.array(np.arange(0, matrix.size + 1, matrix.shape[1], dtype=np.int32))
            columns["embedding"] = pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))
        else:
            columns["generation"] = pa.array([json.dumps(_generation_dict(e.value)) for e in entries], pa.string())
        about = {"identity": self.identity, "engine_seconds_per_token": seconds_per_token, "written": time.time()}
        table = pa.table(columns)
        return table.replace_schema_metadata({METADATA_KEY: json.dumps(about, default=str).encode()})

    def evict(self, max_bytes: int) -> list[str]:
        """Remove the oldest entry files (by modification time) under the cache location until what is left
        fits in max_bytes; the paths removed. Another process's reader finding a file gone computes its rows."""
        fs = self.store.fs
        root = self.store.path(ENTRIES_DIR)
        try:
            fs.invalidate_cache(root)
            found = fs.find(root, detail=True)
        except Exception as exc:  # noqa: BLE001
            log.warning("row cache: could not list %s to evict (%s)", root, describe_error(exc))
            return []
        files = [(info, _strip(fs, name)) for name, info in found.items() if name.endswith(".parquet")]
        total = sum(int(info.get("size") or 0) for info, _ in files)
        removed: list[str] = []
        for info, path in sorted(files, key=lambda item: _modified(item[0])):
            if total <= max_bytes:
                break
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass  # another process evicted it first
            except Exception as exc:  # noqa: BLE001
                log.warning("row cache: could not evict %s (%s)", path, describe_error(exc))
                continue
            total -= int(info.get("size") or 0)
            removed.append(path)
        if removed:
            log.info("row cache: evicted %d files (oldest first) to stay under %d bytes", len(removed), max_bytes)
        return removed


def _file_metadata(table: pa.Table) -> dict[str, Any]:
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def _generation_dict(generation: Generation) -> dict[str, Any]:
    return {"text": generation.text, "output_tokens": generation.output_tokens,
            "finish_reason": generation.finish_reason, "logprobs": generation.logprobs,
            "samples": [_generation_dict(s) for s in generation.samples]}


def _generation(data: dict[str, Any]) -> Generation:
    return Generation(data["text"], int(data["output_tokens"]), data["finish_reason"], data.get("logprobs"),
                      tuple(_generation(s) for s in data.get("samples") or ()))


def _strip(fs, name: str) -> str:
    return fs._strip_protocol(name) if "://" in name else name


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _modified(info: dict[str, Any]) -> float:
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0


# --- one shard: which rows the engine runs, and every row's output --------------------------------

@dataclass
class RowReuse:
    """What the cache and duplicate collapse decided for one shard's rows (in input order)."""

    status: str  # on | off | bypassed: <why>
    token_ids: list[list[int]]
    compute: list[int]  # positions the engine runs: one per distinct input not answered by the cache
    source: list[int | None]  # per position: its index in `compute`, or None when the cache answered it
    hits: dict[int, Entry] = field(default_factory=dict)  # position -> cache entry
    keys: list[str] | None = None
    cache: RowCache | None = None
    max_bytes: int | None = None
    rows_cache_lookups: int = 0
    tokens_saved: int = 0
    engine_seconds_saved: float = 0.0

    @property
    def rows_from_cache(self) -> int:
        return len(self.hits)

    @property
    def rows_collapsed(self) -> int:
        return len(self.source) - len(self.hits) - len(self.compute)

    def outputs(self, computed: list, engine_seconds: float) -> list:
        """Every row's output in input order, from the engine's results for `compute` (in its order); counts
        what was saved, and stores the new entries."""
        if len(computed) != len(self.compute):
            raise ValueError(f"{len(computed)} results for {len(self.compute)} rows computed")
        computed_tokens = sum(len(self.token_ids[i]) + output_tokens(r) for i, r in zip(self.compute, computed))
        seconds_per_token = engine_seconds / computed_tokens if computed_tokens else 0.0
        results: list = []
        first_of = set(self.compute)
        for position, index in enumerate(self.source):
            if index is None:
                entry = self.hits[position]
                results.append(entry.value)
                tokens = entry.input_tokens + entry.output_tokens
                self.tokens_saved += tokens
                self.engine_seconds_saved += tokens * entry.seconds_per_token
            else:
                result = computed[index]
                results.append(result)
                if position not in first_of:  # a copy of an identical row's output
                    tokens = len(self.token_ids[position]) + output_tokens(result)
                    self.tokens_saved += tokens
                    self.engine_seconds_saved += tokens * seconds_per_token
        if self.cache is not None and self.keys is not None:
            entries = [Entry(self.keys[i], r, len(self.token_ids[i]), output_tokens(r))
                       for i, r in zip(self.compute, computed)]
            if self.cache.write(entries, seconds_per_token) is not None and self.max_bytes is not None:
                self.cache.evict(self.max_bytes)
        return results

    def record(self) -> dict[str, Any]:
        """The ShardResult fields."""
        return {"row_cache": self.status, "rows_cache_lookups": self.rows_cache_lookups,
                "rows_from_cache": self.rows_from_cache, "rows_collapsed": self.rows_collapsed,
                "tokens_saved": self.tokens_saved, "engine_seconds_saved": self.engine_seconds_saved}


def reuse_rows(spec: JobSpec, model_path: str, engine_name: str, token_ids: list[list[int]]) -> RowReuse:
    """Look the shard's rows up in the row cache (in bulk), and collapse identical rows: the rows the engine
    still has to run, and how every row's output is made from them (RowReuse.outputs)."""
    positions = list(range(len(token_ids)))
    reason = bypass_reason(spec, engine_name)
    status = f"bypassed: {reason}" if reason else ("on" if spec.cache.enabled else "off")
    if reason or not token_ids or not (spec.cache.enabled or spec.cache.collapse_duplicates):
        return RowReuse(status, token_ids, positions, list(positions))
    cache = keys = None
    hits: dict[int, Entry] = {}
    if spec.cache.enabled:
        cache = RowCache.for_job(spec, model_path, engine_name)
        keys = cache.keys(token_ids)
        found = cache.lookup({key: len(ids) for key, ids in zip(keys, token_ids)})
        hits = {i: found[key] for i, key in enumerate(keys) if key in found}
    compute: list[int] = []
    source: list[int | None] = []
    first: dict[Any, int] = {}
    for i, ids in enumerate(token_ids):
        if i in hits:
            source.append(None)
            continue
        same = (keys[i] if keys is not None else tuple(ids)) if spec.cache.collapse_duplicates else i
        if same not in first:
            first[same] = len(compute)
            compute.append(i)
        source.append(first[same])
    return RowReuse(status, token_ids, compute, source, hits, keys, cache, spec.cache.max_bytes,
                    rows_cache_lookups=len(token_ids) if cache is not None else 0)


def keep_sample_rows(spec: JobSpec, model_path: str, engine_name: str, token_ids: list[list[int]],
                     outputs: list, engine_seconds: float) -> int:
    """Store rows an engine computed outside a shard (the eval gate's sample of the corpus) as the shard
    pipeline would, so the corpus run answers them from the cache instead of computing them again; the
    number of rows stored (0 when this job's cache is off or bypassed, or the write failed)."""
    if not spec.cache.enabled or bypass_reason(spec, engine_name) or not token_ids:
        return 0
    cache = RowCache.for_job(spec, model_path, engine_name)
    keys = cache.keys(token_ids)
    fresh = {key: i for i, key in enumerate(keys) if key not in cache.contains(keys)}
    if not fresh:
        return 0
    tokens = sum(len(ids) + output_tokens(r) for ids, r in zip(token_ids, outputs))
    entries = [Entry(key, outputs[i], len(token_ids[i]), output_tokens(outputs[i])) for key, i in fresh.items()]
    if cache.write(entries, engine_seconds / tokens if tokens else 0.0) is None:
        return 0
    if spec.cache.max_bytes is not None:
        cache.evict(spec.cache.max_bytes)
    return len(entries)


def cached_token_share(spec: JobSpec, model_path: str, engine_names: Sequence[str],
                       token_ids: list[list[int]]) -> tuple[float, str | None]:
    """The share of these rows' input tokens the row cache already holds (by its index: for estimates),
    under the engine that holds most of them; (0, None) when caching is off or bypassed."""
    total = sum(len(ids) for ids in token_ids)
    best: tuple[float, str | None] = (0.0, None)
    if not spec.cache.enabled or not total:
        return best
    for engine_name in engine_names:
        if bypass_reason(spec, engine_name):
            continue
        try:
            cache = RowCache.for_job(spec, model_path, engine_name)
            keys = cache.keys(token_ids)
            held = cache.contains(keys)
        except Exception as exc:  # noqa: BLE001 - an estimate: no cache reads as no hits
            log.warning("row cache: could not estimate hits for %s (%s)", engine_name, describe_error(exc))
            continue
        share = sum(len(ids) for ids, key in zip(token_ids, keys) if key in held) / total
        if share > best[0]:
            best = (share, engine_name)
    return best

