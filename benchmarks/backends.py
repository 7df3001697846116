"""The backends compared: eager PyTorch, ``torch.compile`` in its modes, and ours.

>>> run = prepare("eager", lambda x: x + 1)
>>> run(torch.ones(2)).tolist(), what_ran("eager", run)
([2.0, 2.0], 'eager')
"""

from __future__ import annotations

import compiler  # noqa: F401  (before anything imports triton; see compiler's README)
import torch

EAGER, TORCH_COMPILE, OURS = "eager", "torch.compile", "ours"
DEFAULT = (EAGER, TORCH_COMPILE, OURS)
# CUDA-graph and autotuning modes: GPU options, each much slower to compile.
GPU_MODES = ("torch.compile:max-autotune-no-cudagraphs", "torch.compile:reduce-overhead")
ALL = DEFAULT + GPU_MODES
# Ours is what a user gets: ``compiler.compile(fn)``, backend "auto" (Triton on a GPU; on CPU a CPU
# path, which one is the compiler's choice: the "ran" column says). Without a GPU our Triton kernels
# still run, in Triton's interpreter, but only as a check, never timed (``INTERPRETER_CHECK``).
OURS_BACKEND = "auto"
INTERPRETER_CHECK = "ours (interpreter check)"
# What builds our GPU program here, the one whose kernels, bytes moved and host work (launches
# stubbed) the report gives: "auto" on a GPU; on CPU the interpreter, whose program is the GPU's
# (the CPU path's programs save pointwise values as eager does, and launch no Triton kernels).
GPU_PROGRAM_BACKEND = "auto" if torch.cuda.is_available() else "interpret"


def prepare(name: str, fn):
    """``fn`` as backend ``name`` runs it: a fresh compiled wrapper for each call of this."""
    if name == EAGER:
        return fn
    if name == OURS:
        return compiler.compile(fn, backend=OURS_BACKEND)
    if name == INTERPRETER_CHECK:
        return compiler.compile(fn, backend="interpret")
    if name.startswith(TORCH_COMPILE):
        mode = name.partition(":")[2] or None  # None: torch.compile's default mode
        return torch.compile(fn, mode=mode)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(ALL)}")


def what_ran(name: str, run) -> str:
    """What the last call actually ran: ours says (interpret, triton, eager (recording), ...)."""
    if name in (OURS, INTERPRETER_CHECK):
        return run.last_backend or "-"
    if name.startswith(TORCH_COMPILE):
        return "inductor" + (f" ({name.partition(':')[2]})" if ":" in name else "")
    return "eager"


def ran_eagerly(name: str, what: str) -> bool:
    """Whether a call of ours ran eagerly (recording, or leaving its recording): such a call's
    fair cost is eager's step time, not a compiled step's."""
    return name == OURS and "eager" in what


def interprets(device: torch.device) -> bool:
    """Whether ours ("auto") runs its kernels in Triton's interpreter on ``device``: only on CPU
    with ``SYMGRAD_CPU_BACKEND=interpret`` (the test suite sets it)."""
    from runtime.backends import auto_cpu_backend

    return device.type == "cpu" and auto_cpu_backend() == "interpret"


def reset() -> None:
    """Forget torch.compile's compiled code (Dynamo caches per code object, and workloads share
    step functions): each workload compiles afresh and never hits the recompile limit."""
    torch.compiler.reset()
