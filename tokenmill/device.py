"""The device this process runs on: one probe, read by the run record (tokenmill.tracking), the engine
choice's trial cache (tokenmill.engine_choice) and the engines' own account of where they ran.

A leaf: the standard library, and NVML, torch or vLLM only inside the probe that asks them (numpy inside
the CPU's matrix-product probe, core_gflops; torch in a fresh interpreter, model_tokens_per_s).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def device_name() -> str:
    """The GPU's name from NVML (not CUDA: initializing CUDA here would force vLLM to spawn its
    workers), else the CPU's."""
    gpu = _nvml_device_name()
    if gpu:
        return gpu
    return f"cpu: {cpu_model()}"


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def _nvml_device_name() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no GPU
        return None
    try:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        count = len(visible) if "CUDA_VISIBLE_DEVICES" in os.environ else pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        first = visible[0] if visible else "0"
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(first))
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        return f"{count}x {name}" if count > 1 else name
    except Exception:  # noqa: BLE001
        return None
    finally:
        pynvml.nvmlShutdown()


def device_label() -> str:
    """What the trial's figures hold for: the GPU's name, or the CPU's model and the cores this process may use."""
    name = device_name()
    if name.startswith("cpu"):
        name = f"{name} x{usable_cores()}"
    return name


CPU_ONLY_ENGINES = ("onnxruntime", "openvino")


def engine_device(engine: str) -> str:
    """The device as the engine itself sees it (the run record's `device` param): CUDA's name for
    transformers, vLLM's platform for vllm, "cpu" on a CPU (always, for onnxruntime and openvino)."""
    if engine in CPU_ONLY_ENGINES:
        return "cpu"
    if engine == "openai-server":
        return "server"  # another machine's: the record names its URL
    if ("torch" if engine == "transformers" else "vllm") not in sys.modules:
        # the engine's library never imported: no engine ran in this process (a rerun with every shard finished);
        # named from NVML, not by importing it for the record (torch: 1.1-1.4 s of a 6-8 s rerun on a 2-core Xeon)
        return _nvml_device_name() or "cpu"
    if engine == "transformers":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else str(current_platform.device_name)
    except Exception:  # noqa: BLE001
        return "unknown"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def core_gflops() -> float:
    """One CPU core's float32 matrix-product rate, in GFLOP/s: the feed-forward product of a MiniLM layer
    (256 tokens x 384 -> 1536, 0.3 GFLOP), with numpy's BLAS held to one thread, the fastest of 40 after a
    warm-up (0.08 s on a quiet 2-core Xeon, 0.2 s under load). It reads the vector units (AVX2 against
    AVX-512) that an import time does not. One core and the fastest single product, because a shared host's
    other work takes cores and time slices: with three busy processes on 2 cores, products on both cores or
    rounds of 4 read 78-108 GFLOP/s where the quiet figure is 164-171; the fastest single product read 163-171."""
    import time

    import numpy as np
    from threadpoolctl import threadpool_limits

    rows, width, hidden = 256, 384, 1536
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, width), dtype=np.float32)
    b = rng.standard_normal((width, hidden), dtype=np.float32)
    best = float("inf")
    with threadpool_limits(limits=1, user_api="blas"):
        a @ b
        for _ in range(40):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
    return 2 * rows * width * hidden / max(best, 1e-9) / 1e9


# The model probe (model_tokens_per_s), a program for a fresh interpreter: two layers of a MiniLM-shaped float32
# encoder (hidden 384, 12 heads, feed-forward 1536; random weights, seeded) run as the transformers engine runs
# MiniLM's (tokenmill.hf_engine: every linear layer on oneDNN's mkldnn_linear, attention by torch's
# scaled_dot_product_attention), torch held to one thread, 16 rows of 32 tokens a pass; the fastest of 9 passes
# after a warm-up, as a 6-layer model's tokens/s. It prints nothing where torch or oneDNN is not there.
_MODEL_PROBE = """
import time
try:
    import torch
    assert torch.backends.mkldnn.is_available() and hasattr(torch._C._nn, "mkldnn_linear")
except Exception:
    raise SystemExit(0)
torch.set_num_threads(1)
torch.manual_seed(0)
hidden, heads, inner, rows, tokens = 384, 12, 1536, 16, 32
def linear(n_in, n_out):
    return (torch.randn(n_out, n_in) * n_in ** -0.5).to_mkldnn(), torch.zeros(n_out).to_mkldnn()
def apply(x, weights):
    out = torch._C._nn.mkldnn_linear(x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn(), *weights).to_dense()
    return out.reshape(*x.shape[:-1], -1)
layers = [{n: linear(*shape) for n, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)),
          ("v", (hidden, hidden)), ("o", (hidden, hidden)), ("i", (hidden, inner)), ("out", (inner, hidden)))}
          for _ in range(2)]
def heads_of(y):
    return y.view(rows, tokens, heads, hidden // heads).transpose(1, 2)
def forward(x):
    for w in layers:
        a = torch.nn.functional.scaled_dot_product_attention(*(heads_of(apply(x, w[n])) for n in "qkv"))
        x = torch.nn.functional.layer_norm(x + apply(a.transpose(1, 2).reshape(rows, tokens, hidden), w["o"]), (hidden,))
        x = torch.nn.functional.layer_norm(x + apply(torch.nn.functional.gelu(apply(x, w["i"])), w["out"]), (hidden,))
    return x
x = torch.randn(rows, tokens, hidden)
best = float("inf")
with torch.inference_mode():
    forward(x)
    for _ in range(9):
        started = time.perf_counter()
        forward(x)
        best = min(best, time.perf_counter() - started)
print(rows * tokens / best * 2 / 6)
"""


def model_tokens_per_s() -> float | None:
    """One CPU core's float32 tokens/s through a MiniLM-shaped encoder run the way the transformers engine runs
    MiniLM (_MODEL_PROBE: oneDNN's linear layers, torch's attention, one thread, the fastest of 9 passes), in a
    fresh interpreter (2.4-3 s on a 2-core EPYC, mostly torch's import) so that it leaves nothing imported or
    threaded in the process that asks; None where torch or its oneDNN is not there or the probe fails. Where
    core_gflops reads one cache-resident product, this reads a model's layers as the engine runs them, in the
    engine's library: two 2-core EPYCs of one type (family 25, model 17) whose numpy products probed 20-30% apart
    (92-101 GFLOP/s a core on one, 120-130 on the other) ran MiniLM on the transformers engine 2x apart (5,040-6,730
    tokens/s against 11,600-12,800). On the first this read 2,670-3,350 tokens/s a core, quiet and beside a busy
    process (never run on the second: tokenmill.prediction.MODEL_PROBE_SCALE)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-I", "-c", _MODEL_PROBE], capture_output=True, text=True,
                              timeout=120, check=True)
        rate = float(done.stdout) if done.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return rate if rate and rate > 0 else None


# The interpreter probe (interpreter_ms), a program for a fresh interpreter: a module's body of 60 functions and
# 60 classes, compiled, run and each called, 5 times a round; the fastest of 7 rounds on the thread's CPU clock,
# the collector held off, printed as a reading. Given a count and a gap (argv: InterpreterProbes), that many
# readings, the gap's seconds of sleep apart, each printed as it is read.
_INTERPRETER_PROBE = """
import gc, sys, time
readings, gap = (int(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) > 2 else (1, 0.0)
source = "\\n".join(
    f"def f{i}(a, b=1):\\n    return {{'k{i}': a + b, 'v': [a] * 3}}\\n\\n"
    f"class C{i}:\\n    x = {i}\\n\\n    def m(self):\\n        return self.x + {i}\\n" for i in range(60))
gc.disable()
for reading in range(readings):
    if reading:
        time.sleep(gap)
    best = float("inf")
    for _ in range(7):
        started = time.thread_time()
        for _ in range(5):
            namespace = {}
            exec(compile(source, "<interpreter probe>", "exec"), namespace)
            total = 0
            for i in range(60):
                total += namespace[f"f{i}"](i)[f"k{i}"] + namespace[f"C{i}"]().m()
        best = min(best, time.thread_time() - started)
    print(best * 1000, flush=True)
"""


def interpreter_ms() -> float:
    """This CPU's pace at the interpreter's work, in milliseconds: the fastest of 7 rounds of compiling and
    running a module's body and calling what it defines, as an import does (_INTERPRETER_PROBE), in a fresh
    interpreter (0.1 s in all), so that every process reads it alike whatever it imported (in a process that
    had imported Prefect and torch it read 7% less). It reads what Python's imports, an engine's start and a
    small model's decode steps take, not the vector units (core_gflops). One thread's fastest round,
    because a process's CPU seconds count its other threads too: on a 2-core EPYC, a command's imports read
    1.13-1.33 s of CPU quiet and 1.01-1.14 s beside a busy process (its pools' spinning threads got less of
    the other core), where this read 10.2-10.8 ms quiet and 10.0-10.4 ms beside two busy processes."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-I", "-S", "-c", _INTERPRETER_PROBE], capture_output=True,
                          text=True, timeout=60, check=True)
    return float(done.stdout)


class InterpreterProbes:
    """The interpreter probe's readings spread over a command's first seconds: `readings` of them, `gap` seconds
    apart, in one fresh interpreter beside the command (started as a command that reads it is ready:
    tokenmill.prediction.start_command_probes), each read as it is printed. best() is the fastest reading so far
    (waiting for the first), and ends the rest.

    Why several, seconds apart: what slows the probe on a shared host comes and goes over seconds, and one
    reading, 0.1-0.3 s of rounds, falls inside a slow spell or not. On the 2-core EPYC of bench/PREDICTION.md run
    42a the first command's one reading was 39.5 ms where the next commands' read 19.4-22.6, and that first
    reading scaled every default part of the first job by 3.00 where 2.06 held (+52% on it); a trace of the
    rounds beside a busy neighbour read 21-23 ms and 30-46 ms in spells of 0.2 to more than 4 s. The readings
    run beside the command's own start (in a first command, beside the model probe, one thread of torch on the
    other core): what the probe counts is its own thread's CPU clock, which a neighbour on the other core did
    not move here (a pure-Python loop or a numpy product there: 18.8-20.8 ms against 18.8-20.3 without it)."""

    def __init__(self, readings: int = 3, gap: float = 1.5):
        import subprocess
        import sys
        import threading

        self.readings: list[float] = []
        self.taken_at: list[float] = []  # time.perf_counter() as each reading was read, beside it
        self._first = threading.Event()
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _INTERPRETER_PROBE, str(readings), str(gap)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="interpreter-probes", daemon=True)
        try:
            self._reader.start()
        except BaseException:  # no thread to read it: no process left without an owner
            self._process.kill()
            self._process.wait()
            raise

    def _read(self) -> None:
        import time

        try:
            for line in self._process.stdout:
                try:
                    reading = float(line)
                except ValueError:
                    continue
                self.taken_at.append(time.perf_counter())
                self.readings.append(reading)
                self._first.set()
        finally:
            self._first.set()  # ended without a reading: best() answers None, not a wait
            try:  # its output ended: it exits, reaped here, not left a zombie child until best() or stop()
                self._process.wait(timeout=5)
            except Exception:  # noqa: BLE001 - still running (a closed pipe, not an exit): stop() ends it
                pass

    def best(self, timeout: float = 60.0) -> float | None:
        """The fastest reading so far, once there is one (None where the probe ended or timed out without
        one); the readings not yet taken are not taken."""
        self._first.wait(timeout)
        found = list(self.readings)
        self.stop()
        return min(found) if found else None

    def between(self, started: float, ended: float) -> list[float]:
        """The readings read between two time.perf_counter() times (a watch beside other work)."""
        return [ms for at, ms in zip(list(self.taken_at), list(self.readings)) if started <= at <= ended]

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._reader.join(timeout=5)
        if self._process.stdout is not None and not self._reader.is_alive():  # a reader still in a read keeps it
            self._process.stdout.close()


_command_probes: InterpreterProbes | None = None
_probes_started = False


def start_interpreter_probes() -> None:
    """Start a command's interpreter probes (InterpreterProbes), once a process (a notebook's or a worker's
    later main() calls read the figure their first read, or none); tokenmill.prediction.start_command_probes
    asks as a command that reads them is ready, and take_interpreter_probes hands them to the prediction."""
    global _command_probes, _probes_started
    if _probes_started:
        return
    _probes_started = True
    try:
        _command_probes = InterpreterProbes()
    except Exception:  # noqa: BLE001 - none started: the prediction probes on its own (interpreter_ms) or not at all
        _command_probes = None


def take_interpreter_probes() -> InterpreterProbes | None:
    """The command's probes, once: whoever takes them reads them (best()); None where none were started."""
    global _command_probes
    probes, _command_probes = _command_probes, None
    return probes


def stop_interpreter_probes() -> None:
    """End probes no one took (a command that failed or predicted nothing), so none outlives its command."""
    probes = take_interpreter_probes()
    if probes is not None:
        probes.stop()
