"""Which backend can run here, and switching Triton to its interpreter on CPU-only machines.

Triton's interpreter is chosen per process, before Triton is first imported
(``TRITON_INTERPRET=1``): once Triton is imported normally its standard library cannot be
interpreted any more. ``import compiler`` therefore sets the variable on machines without
CUDA, where interpreting is the only way Triton can run at all.
"""

from __future__ import annotations

import os
import sys


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run these inputs here; the message says what to do."""


BACKENDS = ("auto", "triton", "interpret", "eager")


def prepare_process() -> None:
    """Called on ``import compiler``: turn on the interpreter where no GPU can run Triton."""
    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_decided: bool | None = None   # the mode, once Triton is imported (it is fixed from then on)


def interpreting() -> bool:
    """Whether Triton runs in its interpreter in this process (``TRITON_INTERPRET``). Read from
    the environment until Triton is imported, then remembered: ``choose`` asks on every call of
    a compiled function, and the environment lookup costs microseconds a call."""
    global _decided
    if _decided is not None:
        return _decided
    value = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if "triton" in sys.modules:
        _decided = value
    return value


def choose(backend: str, device_type: str | None) -> tuple[str, str]:
    """The backend that runs tensors on ``device_type``, and why. Raises if impossible."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return "eager", "backend='eager' runs the function unmodified"
    if device_type is None:
        device_type = "cpu"
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "interpret"
        why = ("CUDA tensors: Triton kernels" if backend == "triton" else
               "CPU tensors: the generated Triton kernels run in Triton's interpreter")
    else:
        why = f"backend={backend!r}"
    if backend == "triton":
        if device_type != "cuda":
            raise BackendUnavailable(
                f"backend='triton' runs Triton kernels on CUDA tensors, but the inputs are on "
                f"{device_type}; move them to a GPU, or use backend='interpret' for CPU tensors")
        if interpreting():
            raise BackendUnavailable(
                "backend='triton' needs compiled Triton, but this process runs Triton in interpreter "
                "mode (TRITON_INTERPRET=1); unset it before starting Python")
    if backend == "interpret":
        if device_type != "cpu":
            raise BackendUnavailable(
                f"backend='interpret' runs kernels in Triton's interpreter on CPU tensors, but the "
                f"inputs are on {device_type}; use backend='triton' for CUDA tensors")
        if not interpreting():
            raise BackendUnavailable(
                "backend='interpret' needs Triton in interpreter mode, but Triton was imported "
                "without it; set TRITON_INTERPRET=1 before starting Python (or import compiler "
                "before anything imports triton)")
    return backend, why
