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


def release_freed_heap() -> bool:
    """Give the heap's free pages back to the system (glibc `malloc_trim`), once per shard.

    A CPU engine's activations are freed after each batch, but glibc keeps freed heap pages
    resident, and a heap fragmented by batches of ever-different shapes grows shard by shard:
    measured on the transformers engine on CPU (MiniLM, 250-row shards), resident memory after
    each shard went 782 -> 888 MiB over 8 shards; with a trim after each, 730 -> 746 MiB (the
    memory was free, not live). A fixed mmap threshold does the same per batch, and cost the
    engine 13-25% in the whole-run bench (page faults on every batch); a trim per shard costs
    milliseconds. True when trimmed (glibc), False elsewhere.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
