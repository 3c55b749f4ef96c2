"""What every bench shares: variants timed in interleaved rounds, whole processes timed with their peak
memory, the machine-and-commit header every report opens with, markdown tables, and the report index
(bench/README.md) built from those headers.

Standard library only (psutil where it is installed): `bench/gpu.py` imports this on a lent GPU machine
that has no venv, where it travels with the working tree (see bench/gpu_kit.py).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
GIB = 2**30
# CPU flags that decide which kernels run (int8 dot products, bf16, AMX); the header lists those present
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


# --- variants, timed in interleaved rounds ------------------------------------------------------------

@dataclass
class Variant:
    """One way of doing the same work; timed once per round."""

    name: str
    run: Callable[[], Any] | None  # None once timing is done and its engines and models are let go
    tokens: int = 0  # real (unpadded) tokens per run
    items: int = 0
    padded_slots: int | None = None
    seconds: list[float] = field(default_factory=list)
    kind: str = ""
    last: Any = None  # what the last run returned

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median

    @property
    def items_per_s(self) -> float:
        return self.items / self.median

    @property
    def padding(self) -> float | None:
        return None if self.padded_slots is None else 1 - self.tokens / self.padded_slots


def round_orders(count: int, rounds: int) -> list[list[int]]:
    """The order of the variants in each round: as given, then reversed, alternately, so that neither
    the first nor the last place (a cold cache, a machine slowing down) always falls to the same one."""
    forward = list(range(count))
    return [forward if number % 2 == 0 else forward[::-1] for number in range(rounds)]


def interleave(variants: Sequence[Variant], rounds: int, sync: Callable[[], None] = lambda: None,
               warmup: bool = True) -> None:
    """One warm-up run of each (not counted), then `rounds` rounds that run every variant once, in
    alternating order; `sync` runs just before and after each timed run (a CUDA synchronisation)."""
    if warmup:
        for variant in variants:
            variant.last = variant.run()
    for order in round_orders(len(variants), rounds):
        for index in order:
            variant = variants[index]
            sync()
            started = time.perf_counter()
            variant.last = variant.run()
            sync()
            variant.seconds.append(time.perf_counter() - started)


# --- whole processes, with their peak memory ------------------------------------------------------------

@dataclass
class ProcessRun:
    command: list[str]
    returncode: int
    wall_s: float
    peak_bytes: int  # resident memory of the process and its children together, at its highest
    peak_root_bytes: int  # the process alone
    stdout: str
    stderr: str
    sampler: str  # how the peak was read

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def peak_root_gib(self) -> float:
        return self.peak_root_bytes / GIB

    def check(self, what: str = "") -> "ProcessRun":
        if self.returncode != 0:
            raise RuntimeError(f"{what or ' '.join(self.command[:4])} exited {self.returncode}:\n"
                               f"{(self.stderr or self.stdout)[-3000:]}")
        return self


class _TreeSampler(threading.Thread):
    """Samples the resident memory of a process tree with psutil until stopped."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.peak_root = pid, interval, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        def rss(proc) -> int:
            try:
                return proc.memory_info().rss
            except psutil.Error:
                return 0

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.stop.is_set():
            try:
                children = root.children(recursive=True)
            except psutil.Error:
                children = []
            own = rss(root)
            self.peak_root = max(self.peak_root, own)
            self.peak = max(self.peak, own + sum(map(rss, children)))
            self.stop.wait(self.interval)


def _psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def run_process(command: Sequence[str], cwd: Path = ROOT, env: dict[str, str] | None = None,
                timeout: float | None = 3600, interval: float = 0.1) -> ProcessRun:
    """Run a command to its end, timed spawn to exit, its output captured and its peak memory read: the
    process tree's summed RSS sampled every `interval` s with psutil, or without psutil the largest
    single process's peak from getrusage(RUSAGE_CHILDREN) (exact, but not a sum over the tree)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    process = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    sampler = _TreeSampler(process.pid, interval) if _psutil() else None
    if sampler:
        sampler.start()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    wall = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    exact = children if children > before * 1024 else 0  # a new high: this run's largest process
    if sampler:
        sampler.stop.set()
        sampler.join()
    peak = max(sampler.peak if sampler else 0, exact)
    root = max(sampler.peak_root if sampler else 0, 0) or exact
    how = (f"psutil, process tree every {interval} s" if sampler else "getrusage, largest single process")
    return ProcessRun(list(command), process.returncode, wall, peak, root, stdout, stderr, how)


# --- the machine, the commit, the date ------------------------------------------------------------------

def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of FLAGS it has (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, [flag for flag in FLAGS if flag in flags]


def memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def gpu_name() -> str | None:
    """The GPUs nvidia-smi lists (no torch import), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return "; ".join(names.splitlines()) or None


def git_commit(root: Path = ROOT, short: bool = True) -> str | None:
    """HEAD's commit, with "+ uncommitted changes" when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, check=True,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" + uncommitted changes" if dirty else "")


def now() -> str:
    return f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"


def machine() -> dict[str, Any]:
    model, flags = cpu_info()
    return {"date": now(), "commit": git_commit(), "cpu": model, "flags": flags, "cores": os.cpu_count(),
            "ram_gib": memory_gib(), "gpu": gpu_name(), "python": platform.python_version()}


def machine_line(info: dict[str, Any]) -> str:
    ram = f", {info['ram_gib']:.0f} GiB RAM" if info.get("ram_gib") else ""
    flags = f" ({' '.join(info['flags'])})" if info.get("flags") else ""
    return (f"{info['cpu']}{flags}, {info['cores']} logical cores{ram}; GPU: {info.get('gpu') or 'none'}; "
            f"Python {info['python']}")


def header(title: str, command: str, info: dict[str, Any] | None = None, notes: Iterable[str] = ()) -> list[str]:
    """A report's opening lines: title, how it was made, and the date, commit and machine (which
    the report index reads back)."""
    info = info or machine()
    return [f"# {title}", "", f"Written by `{command}`; do not edit by hand.", "",
            f"- **Date:** {info['date']}", f"- **Commit:** {info.get('commit') or 'unknown'}",
            f"- **Machine:** {machine_line(info)}", *notes]


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table; cells as given (None as empty), pipes escaped."""
    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|")

    return ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(map(cell, row)) + " |" for row in rows)]


# --- the report index (bench/README.md) ------------------------------------------------------------------

# Which comparison each report holds and which command writes it; a report not named here is listed by its title.
REPORTS = {
    "RESULTS.md": ("in-process comparisons on this CPU: tokenmill vs the engine called directly, offline batches "
                   "vs one at a time, buckets, vs sentence-transformers, vLLM vs transformers, memory at 10×",
                   "python -m bench.run"),
    "WHOLE_RUN.md": ("whole `tokenmill run` processes vs a sentence-transformers script and one `LLM.chat` call, "
                     "short/long/mixed corpora", "python -m bench.whole"),
    "INDEX_SCALE.md": ("the index stage on the sample corpus: recall@10, build vs embed time, memory at 10× the "
                       "vectors", "python -m bench.index_scale"),
    "ROW_CACHE.md": ("row cache: re-runs after edits/appends, duplicate collapse, unchanged re-runs, as whole "
                     "processes", "python -m bench.row_cache"),
    "GENERATE_INT8.md": ("int8 (W8A8) SmolLM2 vs float32 on vLLM's CPU backend: tokens/s and agreement",
                         "python -m bench.generate_int8"),
    "GPU_RESULTS.md": ("the GPU figures: embed vs sentence-transformers, calibrate, batched generation",
                       "make bench-gpu"),
    "CHEAP_TIER.md": ("the cheap tier: quantized/ONNX embedding rungs vs the fp32 script, quality and cost",
                      "python -m bench.cheap_tier"),
    "CHEAP_TIER_LONG.md": ("the cheap tier on long documents alone (a second round of that shape)",
                           "python -m bench.cheap_tier --shapes long --report bench/CHEAP_TIER_LONG.md"),
    "ROW_CACHE_7K.md": ("the row cache bench at 7,000 rows (where fixed process seconds weigh less)",
                        "python -m bench.row_cache --rows 7000 --report bench/ROW_CACHE_7K.md"),
    "PREDICTION.md": ("the wall-time prediction against measured runs", "python -m bench.prediction"),
    "USER_SESSION.md": ("a new user's first session predicted against measured: `make run` and its rerun on a new "
                        "machine, then jobs on installed packages' docstrings", "python -m bench.user_session"),
    "BACKFILL.md": ("backfill runs", "python -m bench.backfill"),
    "SPEED_DRIFT.md": ("identical engine work timed for minutes: how much its speed drifts here, and whether a "
                       "speed probe or recent costs would predict it better", "python -m bench.speed_drift"),
    "VLLM_STARTS.md": ("vLLM's start: a model's first on a machine (it compiles) against later ones (they load), "
                       "and the CPU's compute probe", "python -m bench.vllm_starts"),
    "S3_READS.md": ("object-store reads: bytes moved and listing seconds, tokenmill's ranged reads and kept plans "
                    "against the store's read-ahead and re-planning", "python -m bench.s3_reads"),
    "FINDINGS.md": ("what the figures mean (prose, written by hand)", "—"),
}
INDEX_START, INDEX_END = "<!-- report index: written by bench/harness.py; do not edit by hand -->", "<!-- end of index -->"
_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})(?:[ T](\d{2}:\d{2}))?")
_COMMIT = re.compile(r"\bcommit:?\**:?\s+([0-9a-f]{7,40})", re.IGNORECASE)


def _last_commit(path: Path, field: str) -> str | None:
    """A field (git log format: %cs its date, %h its hash) of the last commit that changed the file."""
    try:
        return subprocess.run(["git", "log", "-1", f"--format={field}", "--", path.name], cwd=path.parent,
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def report_header(path: Path) -> dict[str, str | None]:
    """The title, date and commit a report states in its first lines; where it states none (prose, or a
    report older than the harness), those of the last commit that changed the file, so marked."""
    head = path.read_text().splitlines()[:15]
    title = next((line.lstrip("# ").strip() for line in head if line.startswith("# ")), path.stem)
    date = commit = None
    for line in head:
        if date is None and (found := _DATE.search(line)) and ("date" in line.lower() or "utc" in line.lower()):
            date = " ".join(part for part in found.groups() if part)
        if commit is None and (found := _COMMIT.search(line)):
            commit = found.group(1)[:7]
    if date is None and (edited := _last_commit(path, "%cs")):
        date = f"{edited} (last edited)"
    if commit is None and (changed := _last_commit(path, "%h")):
        commit = f"{changed} (file's last commit)"
    return {"title": title, "date": date, "commit": commit}


def report_index(bench: Path = BENCH) -> list[str]:
    """The index table: every bench/*.md but README.md, what it compares, its date and commit."""
    rows = []
    for path in sorted(bench.glob("*.md")):
        if path.name == "README.md":
            continue
        about = report_header(path)
        what, command = REPORTS.get(path.name, (about["title"], "—"))
        rows.append((f"[{path.name}]({path.name})", what, f"`{command}`" if command != "—" else "—",
                     about["date"] or "undated", about["commit"] or ""))
    return table(("report", "comparison", "written by", "date", "commit"), rows)


def write_index(bench: Path = BENCH) -> Path:
    """Rewrite the index between its markers in bench/README.md (the prose around it is kept)."""
    readme = bench / "README.md"
    text = readme.read_text() if readme.exists() else "# Benchmarks\n"
    block = "\n".join([INDEX_START, "", *report_index(bench), "", INDEX_END])
    if INDEX_START in text and INDEX_END in text:
        before, rest = text.split(INDEX_START, 1)
        text = before + block + rest.split(INDEX_END, 1)[1]
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{block}\n{rest}"
    readme.write_text(text)
    return readme


if __name__ == "__main__":
    print(f"wrote {write_index(Path(sys.argv[1]) if len(sys.argv) > 1 else BENCH)}")
