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
# Ours runs its Triton program: on a GPU "auto" (Triton); on CPU the interpreter, whose memory,
# kernels and stubbed host work are the GPU program's ("auto" on CPU runs the kernels as PyTorch
# ops instead, the CPU path: its speed is measured by examples/train_mlp.py, results/cpu-path.md)
OURS_BACKEND = "auto" if torch.cuda.is_available() else "interpret"


def prepare(name: str, fn):
    """``fn`` as backend ``name`` runs it: a fresh compiled wrapper for each call of this."""
    if name == EAGER:
        return fn
    if name == OURS:
        return compiler.compile(fn, backend=OURS_BACKEND)
    if name.startswith(TORCH_COMPILE):
        mode = name.partition(":")[2] or None  # None: torch.compile's default mode
        return torch.compile(fn, mode=mode)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(ALL)}")


def what_ran(name: str, run) -> str:
    """What the last call actually ran: ours says (interpret, triton, eager (recording), ...)."""
    if name == OURS:
        return run.last_backend or "-"
    if name.startswith(TORCH_COMPILE):
        return "inductor" + (f" ({name.partition(':')[2]})" if ":" in name else "")
    return "eager"


def ran_eagerly(name: str, what: str) -> bool:
    """Whether a call of ours ran eagerly (recording, or leaving its recording): such a call's
    fair cost is eager's step time, not a compiled step's."""
    return name == OURS and "eager" in what


def reset() -> None:
    """Forget torch.compile's compiled code (Dynamo caches per code object, and workloads share
    step functions): each workload compiles afresh and never hits the recompile limit."""
    torch.compiler.reset()
