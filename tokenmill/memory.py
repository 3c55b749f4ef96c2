"""Peak memory of a block of work: the GPU's allocator where there is a GPU, else the
resident memory of a process tree (vLLM's engine runs in a child process)."""

from __future__ import annotations

import functools
import os
import threading


class PeakMemory:
    """Peak memory while the block runs.

    With no pid: GPU memory allocated where there is a GPU, else the resident memory of
    this process and its children (vLLM's engine runs in a child). With a pid: the resident
    memory of that process and its children, sampled until the block ends; `peak_root_bytes`
    is that process alone."""

    def __init__(self, pid: int | None = None, interval: float = 0.05):
        self.pid = pid
        self.interval = interval
        self.peak_bytes = 0
        self.peak_root_bytes = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        import torch

        self.cuda = self.pid is None and torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            self.peak_bytes = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                tree = [root] + root.children(recursive=True)
                self.peak_root_bytes = max(self.peak_root_bytes, root.memory_info().rss)
            except psutil.Error:
                tree = []
            total = 0
            for proc in tree:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(self.interval)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30

    @property
    def peak_root_gib(self) -> float:
        return self.peak_root_bytes / 2**30


def release_freed_heap() -> bool:
    """Give the heap's free pages back to the system (glibc `malloc_trim`): after each shard, and
    between engine calls when the heap grows (HeapGuard).

    A CPU engine's activations are freed after each batch, but glibc keeps freed heap pages
    resident, and a heap fragmented by batches of ever-different shapes grows shard by shard:
    measured on the transformers engine on CPU (MiniLM, 250-row shards), resident memory after
    each shard went 782 -> 888 MiB over 8 shards; with a trim after each, 730 -> 746 MiB (the
    memory was free, not live). A fixed mmap threshold bounds it too, but cost the engine 13-25% in
    the whole-run bench and 10-39% in a plain loop (1 to 16 MiB; page faults on every batch); a trim
    costs milliseconds. True when trimmed (glibc), False elsewhere.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim():
    """libc's malloc_trim, looked up once per process (find_library runs `ldconfig -p`, a fork of this
    process); None where there is none."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


# How far this process may grow between engine calls, over what it held after the first call since the
# last trim, before the freed heap is given back (see HeapGuard).
HEAP_SLACK_BYTES = 64 * 2**20


def resident_bytes() -> int | None:
    """This process's resident memory, from /proc (microseconds); None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapGuard:
    """Gives the freed heap back between an in-process engine's calls, once it has grown.

    After a call, glibc keeps the freed activations resident for the next call to reuse: that is the
    heap working, and giving it back before every call makes each call fault its memory in again
    (measured once on `tokenmill run`, 6,000 documents: 100 s of engine against 72-82 s). But inside a
    Prefect run, whose threads allocate between the calls, the freed blocks are not all reused: a
    1,000-row shard's resident memory climbed about 0.2-0.5 GiB through its batches, each shard's
    peak above the last's, so the job's peak grew with the corpus. So: the resident memory after the
    first call since the last trim is the floor (that call's reusable heap included); before each
    later call, if the process holds more than the floor plus `slack_bytes`, the heap is trimmed and
    the floor is measured again after the next call. The growth is bounded by the slack, and a heap
    that reuses its blocks is never trimmed. Measured (bench/FINDINGS.md, index section): per-shard
    peaks 1.23-1.33 GiB over 6 shards against 1.26-1.61 GiB without it (two runs), 0-6 trims per
    shard, engine seconds within the run-to-run noise. An engine in another process (vLLM) never
    grows this one, so it never trims.
    """

    def __init__(self, slack_bytes: int = HEAP_SLACK_BYTES):
        self.slack_bytes = slack_bytes
        self.floor: int | None = None
        self.trims = 0
        self._called = False  # a call has run: there is a heap to judge

    def before_call(self) -> None:
        rss = resident_bytes() if self._called else None  # before any call there is no heap to judge
        self._called = True
        if rss is None:
            return
        if self.floor is None:
            self.floor = rss
        elif rss > self.floor + self.slack_bytes and release_freed_heap():
            self.trims += 1
            self.floor = None  # measured after this call, the first since the trim
