"""What the numbers were measured on: machine, device, library versions. Written into every
results file, since a benchmark number means nothing without them.

>>> info = describe(torch.device("cpu"))
>>> info["device"].startswith("cpu")
True
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe(device: torch.device) -> dict:
    """An ordered description: date, machine, device, versions, interpreter mode."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, {_memory_gib()} GiB RAM, {platform.platform()}",
        "device": _device(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "sympy": _version("sympy"),
        "numpy": _version("numpy"),
        "symgrad": _commit(),
    }
    if device.type == "cuda":
        info["cuda"] = f"{torch.version.cuda}"
    info["our kernels"] = _our_kernels(device)
    return info


def _our_kernels(device):
    if device.type == "cuda":
        return "compiled Triton"
    forced = os.environ.get("SYMGRAD_CPU_BACKEND", "").strip()
    timed = f"SYMGRAD_CPU_BACKEND={forced}" if forced else "the compiler's CPU path"
    return (f"timed: backend='auto' ({timed}; column ran); checked: the Triton kernels in Triton's CPU "
            "interpreter, tiny sizes")


def device_kind(device: torch.device) -> str:
    """A short name for file names: ``cpu`` or e.g. ``cuda-nvidia-h100-80gb-hbm3``."""
    if device.type != "cuda":
        return "cpu"
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def _device(device):
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs)")
    return f"cpu ({torch.get_num_threads()} torch threads)"


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib():
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return f"{kib / 2**20:.0f}"
    except (OSError, StopIteration, ValueError):
        return "?"


def _commit():
    """The checkout's commit, marked ``+changes`` when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" +changes" if dirty else "")

