"""Which backend can run here, and switching Triton to its interpreter on CPU-only machines.

Backends: ``triton`` (compiled Triton kernels, CUDA tensors), ``torch`` (the CPU path: each fused
kernel runs as a generated function of PyTorch ops, ``compiler.codegen.torch_kernel``; same
capture, SymPy backward and runtime), ``interpret`` (the real Triton kernels in Triton's
interpreter: slow, used by the tests), ``eager`` (the function unmodified). ``auto`` picks
``triton`` for CUDA tensors and ``torch`` for CPU tensors, or what ``SYMGRAD_CPU_BACKEND`` names
(``interpret``: the test suite sets it, so its default runs the real kernels).

Triton's interpreter is chosen per process, before Triton is first imported
(``TRITON_INTERPRET=1``): once Triton is imported normally its standard library cannot be
interpreted any more. ``import compiler`` therefore sets the variable on machines without
CUDA, where interpreting is the only way Triton can run at all.
"""

from __future__ import annotations

import os
import sys
import threading


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run these inputs here; the message says what to do."""


BACKENDS = ("auto", "triton", "torch", "interpret", "eager")
CPU_BACKEND_ENV = "SYMGRAD_CPU_BACKEND"   # what ``auto`` runs CPU tensors with: torch (default) or interpret


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


def auto_cpu_backend() -> str:
    """What ``backend="auto"`` runs CPU tensors with: ``$SYMGRAD_CPU_BACKEND`` or ``torch``."""
    name = os.environ.get(CPU_BACKEND_ENV, "").strip() or "torch"
    if name not in ("torch", "interpret"):
        raise ValueError(f"{CPU_BACKEND_ENV}={name!r}: choose torch (PyTorch's CPU kernels) or interpret "
                         "(Triton's interpreter)")
    return name


# NOTE: the backend of the compiled call this thread made last decides how CPU kernels run (the
# backward of a call runs later, in the same thread on CPU: it keeps its forward's backend).
_current = threading.local()


def torch_on_cpu() -> bool:
    """Whether kernels on CPU tensors run as PyTorch ops now (``KernelLaunch.run`` asks)."""
    backend = getattr(_current, "backend", None)
    if backend is None:
        backend = _current.backend = "torch" if auto_cpu_backend() == "torch" else "interpret"
    return backend == "torch"


def choose(backend: str, device_type: str | None) -> tuple[str, str]:
    """The backend that runs tensors on ``device_type``, and why. Raises if impossible. The
    choice (torch or interpret) is what CPU kernels run with from now on, in this thread
    (``use``). A compiled function chooses at its first call on each device type and keeps it,
    so ``SYMGRAD_CPU_BACKEND`` is read then."""
    backend, why = _choose(backend, device_type)
    use(backend)
    return backend, why


def use(backend: str) -> None:
    """CPU kernels run with ``backend`` from now on, in this thread, where it is one for CPU."""
    if backend == "torch" or backend == "interpret":
        _current.backend = backend


def _choose(backend: str, device_type: str | None) -> tuple[str, str]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return "eager", "backend='eager' runs the function unmodified"
    if device_type is None:
        device_type = "cpu"
    if backend == "auto":
        if device_type == "cuda":
            backend, why = "triton", "CUDA tensors: Triton kernels"
        elif auto_cpu_backend() == "torch":
            backend, why = "torch", ("CPU tensors: each fused kernel runs as PyTorch CPU ops (the generated Triton "
                                     "kernels run in Triton's interpreter with backend='interpret')")
        else:
            backend, why = "interpret", (f"CPU tensors, {CPU_BACKEND_ENV}=interpret: the generated Triton kernels "
                                         "run in Triton's interpreter")
    else:
        why = f"backend={backend!r}"
    if backend == "torch" and device_type != "cpu":
        raise BackendUnavailable(
            f"backend='torch' runs the fused kernels as PyTorch CPU ops, but the inputs are on {device_type}; "
            "use backend='triton' (or 'auto') for CUDA tensors")
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
