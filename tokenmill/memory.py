"""Peak memory of a block of work: the GPU's allocator where there is a GPU, else the
resident memory of a process tree (vLLM's engine runs in a child process)."""

from __future__ import annotations

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


# glibc's mallopt parameter for the size above which an allocation gets its own mapping
M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD_BYTES = 1 << 20


def bound_cpu_heap() -> bool:
    """Give large allocations (a CPU engine's activations) back to the system when freed.

    glibc serves an allocation above its mmap threshold with a mapping of its own, unmapped on
    free, but it raises that threshold to the size of every mapped block freed (up to 32 MiB).
    After the first batches, a PyTorch forward pass's activations (tens of MiB for a batch of
    long rows) come from the heap instead, and a heap fragmented by batches of ever-different
    shapes is not given back: measured on the transformers engine on CPU (MiniLM, 250-row
    shards), resident memory grew about 15 MiB per shard, and `malloc_trim` brought it back,
    so it was freed memory the heap kept, not live data. A fixed threshold (which also ends the
    adjustment) keeps it bounded: over 8 shards 745 -> 780 MiB resident, against 782 -> 888.
    Process-wide; True when set (glibc), False elsewhere (other allocators behave otherwise).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
