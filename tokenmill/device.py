"""The device this process runs on: one probe, read by the run record (tokenmill.tracking), the engine
choice's trial cache (tokenmill.engine_choice) and the engines' own account of where they ran.

A leaf: the standard library, and NVML, torch or vLLM only inside the probe that asks them.
"""

from __future__ import annotations

import os
import platform
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
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        name = f"{name} x{cores}"
    return name


CPU_ONLY_ENGINES = ("onnxruntime", "openvino")


def engine_device(engine: str) -> str:
    """The device as the engine itself sees it (the run record's `device` param): CUDA's name for
    transformers, vLLM's platform for vllm, "cpu" on a CPU (always, for onnxruntime and openvino)."""
    if engine in CPU_ONLY_ENGINES:
        return "cpu"
    if engine == "openai-server":
        return "server"  # another machine's: the record names its URL
    if engine == "transformers":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else str(current_platform.device_name)
    except Exception:  # noqa: BLE001
        return "unknown"
