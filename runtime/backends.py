"""Which backend can run here, and switching Triton to its interpreter on CPU-only machines.

Backends: ``triton`` (compiled Triton kernels, CUDA tensors), ``torch`` (the CPU path: each fused
kernel runs as a generated function of PyTorch ops, ``compiler.codegen.torch_kernel``; same
capture, SymPy backward and runtime), ``cpp`` (the CPU path with each kernel that prints as C++
compiled by the system's compiler, ``compiler.codegen.cpp_kernel``; the others as ``torch``),
``interpret`` (the real Triton kernels in Triton's interpreter: slow, used by the tests), ``eager``
(the function unmodified). ``auto`` picks
``triton`` for CUDA tensors; for CPU tensors ``cpp`` where a working C++ compiler is found, else
``torch``, or what ``SYMGRAD_CPU_BACKEND`` names (``interpret``: the test suite sets it, so its
default runs the real kernels).

Triton's interpreter is chosen per process, before Triton is first imported
(``TRITON_INTERPRET=1``): once Triton is imported normally its standard library cannot be
interpreted any more. ``import compiler`` therefore sets the variable on machines without
CUDA, where interpreting is the only way Triton can run at all.

A backend is fixed when something is built for it: a program (``runtime.program.Program``) or a
fused optimizer step or clip keeps the backend it was built for, and its launches read nothing
else. The compiled call this thread is making says which (``choose``, ``use``, ``chosen``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run these inputs here; the message says what to do."""


BACKENDS = ("auto", "triton", "torch", "cpp", "interpret", "eager")
CPU_PATHS = ("torch", "cpp")   # backends whose programs run CPU tensors without Triton (``cpu_path``)
CPU_BACKEND_ENV = "SYMGRAD_CPU_BACKEND"   # what ``auto`` runs CPU tensors with: cpp, torch or interpret


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
    """What ``backend="auto"`` runs CPU tensors with: ``$SYMGRAD_CPU_BACKEND``, else ``cpp`` where a
    working C++ compiler is found (``runtime.cpp_build``), else ``torch`` (said once, with why)."""
    name = os.environ.get(CPU_BACKEND_ENV, "").strip()
    if not name:
        return _default_cpu_backend()
    if name not in ("cpp", "torch", "interpret"):
        raise ValueError(f"{CPU_BACKEND_ENV}={name!r}: choose cpp (C++ kernels built by the system's compiler), "
                         "torch (PyTorch's CPU kernels) or interpret (Triton's interpreter)")
    return name


@functools.lru_cache(maxsize=None)
def _default_cpu_backend() -> str:
    from runtime import cpp_build

    found, why_not = cpp_build.available()
    if found:
        return "cpp"
    import logging

    logging.getLogger("symgrad").warning(
        "symgrad: CPU tensors run on the torch path (each fused kernel as PyTorch ops), not as C++ kernels: %s",
        why_not)
    return "torch"


# NOTE: the backend of the compiled call this thread is making (``choose``/``use`` set it at each
# call). It is read only while something is built (a region's programs, a fused optimizer step),
# which keeps it from then on: launches never read it. A build during a backward (a partial or
# double backward, made when first asked) is made for its region's backend (``building_for``),
# whichever thread runs the backward and whatever that thread's last compiled call chose.
_chosen = threading.local()


def chosen() -> str:
    """The backend that what is built now in this thread runs with: the one the compiled call it
    is making chose (``torch``, ``interpret`` or ``triton``), or ``building_for``'s. Before any
    compiled call: what ``auto`` runs CPU tensors with. Read at build time, never per launch."""
    backend = getattr(_chosen, "backend", None)
    if backend is None:
        backend = _chosen.backend = auto_cpu_backend()
    return backend


def choose(backend: str, device_type: str | None) -> tuple[str, str]:
    """The backend that runs tensors on ``device_type``, and why. Raises if impossible. What this
    thread builds from now on is built for it (``use``). A compiled function chooses at its first
    call on each device type and keeps it, so ``SYMGRAD_CPU_BACKEND`` is read then."""
    backend, why = _choose(backend, device_type)
    use(backend)
    return backend, why


# ``choose``'s answer for ``auto`` when a call has no tensor arguments: nothing says the device until the
# function has run, so the recording decides (``decide``) before anything is built for it.
UNDECIDED = "undecided"


def decide(backend: str, device_type: str | None) -> tuple[str, str]:
    """The backend for a call with no tensor arguments whose recording made its tensors on
    ``device_type`` (None: it made none; the CPU's then), as ``choose`` picks it for such inputs."""
    backend, why = _choose(backend, device_type or "cpu")
    use(backend)
    return backend, f"{why} (no tensor arguments: the device the recording's tensors are on)"


def cpu_path(backend: str) -> bool:
    """Whether programs built for ``backend`` run CPU tensors without Triton: the torch path
    (each kernel as PyTorch ops) or C++ kernels (``cpp``, the kernels it cannot print as PyTorch ops)."""
    return backend in CPU_PATHS


def use(backend: str) -> None:
    """What this thread builds from now on runs with ``backend`` (a compiled call's; not ``eager``)."""
    if backend in ("torch", "cpp", "interpret", "triton"):
        _chosen.backend = backend


@contextlib.contextmanager
def building_for(backend: str):
    """Within the block, what this thread builds runs with ``backend`` (then the thread's own choice
    again)."""
    saved = getattr(_chosen, "backend", None)
    _chosen.backend = backend
    try:
        yield
    finally:
        _chosen.backend = saved


def builds_keep_backend(region, backend: str):
    """``region`` (a ``runtime.autograd_bridge.CompiledRegion`` built for ``backend``) whose builds
    during backward (its ``OnDemand``: a partial backward and its double backward, a double backward)
    are made for ``backend`` too. The region itself is unchanged: its programs were built for it."""
    on_demand = region.on_demand
    if on_demand.partial_backward is None and on_demand.double_backward is None:
        return region
    partial = on_demand.partial_backward and _PartialBackwardFor(on_demand.partial_backward, backend)
    double = on_demand.double_backward and functools.partial(_build_for, on_demand.double_backward, backend)
    return dataclasses.replace(region, on_demand=dataclasses.replace(on_demand, partial_backward=partial,
                                                                     double_backward=double))


def _build_for(build, backend: str, key):
    """``build(key)`` made for ``backend``."""
    with building_for(backend):
        return build(key)


class _PartialBackwardFor:
    """A region's partial backward builder (``OnDemand.partial_backward``) whose answers, and the
    double backward each answer builds, are made for ``backend``; each wrapped answer kept."""

    def __init__(self, build, backend: str):
        self.build, self.backend = build, backend
        self.answers: dict = {}

    def __call__(self, given):
        answer = self.answers.get(given, _UNSEEN)
        if answer is _UNSEEN:
            answer = _build_for(self.build, self.backend, given)
            if answer is not None and answer[2] is not None:
                program, take, double = answer
                answer = (program, take, functools.partial(_build_for, double, self.backend))
            self.answers[given] = answer
        return answer


_UNSEEN = object()


def _choose(backend: str, device_type: str | None) -> tuple[str, str]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return "eager", "backend='eager' runs the function unmodified"
    if device_type is None and backend == "auto":
        return UNDECIDED, ("no tensor arguments: the backend is chosen by the device the recording's tensors are "
                           "on (decide)")
    if backend == "auto":
        if device_type == "cuda":
            backend, why = "triton", "CUDA tensors: Triton kernels"
        elif auto_cpu_backend() == "cpp":
            backend, why = "cpp", ("CPU tensors: each fused kernel compiled to C++ by the system's compiler "
                                   "(backend='torch' runs them as PyTorch ops, backend='interpret' the Triton "
                                   "kernels in Triton's interpreter)")
        elif auto_cpu_backend() == "torch":
            backend, why = "torch", ("CPU tensors: each fused kernel runs as PyTorch CPU ops (no C++ compiler "
                                     "found; the generated Triton kernels run in Triton's interpreter with "
                                     "backend='interpret')")
        else:
            backend, why = "interpret", (f"CPU tensors, {CPU_BACKEND_ENV}=interpret: the generated Triton kernels "
                                         "run in Triton's interpreter")
    else:
        why = f"backend={backend!r}"
    if device_type is None:  # (no tensor arguments: only what the process allows is checked)
        device_type = "cuda" if backend == "triton" else "cpu"
    if backend == "torch" and device_type != "cpu":
        raise BackendUnavailable(
            f"backend='torch' runs the fused kernels as PyTorch CPU ops, but the inputs are on {device_type}; "
            "use backend='triton' (or 'auto') for CUDA tensors")
    if backend == "cpp":
        if device_type != "cpu":
            raise BackendUnavailable(f"backend='cpp' compiles the fused kernels to C++ for CPU tensors, but the "
                                     f"inputs are on {device_type}; use backend='triton' (or 'auto') for CUDA tensors")
        from runtime import cpp_build

        ok, why_not = cpp_build.available()
        if not ok:
            raise BackendUnavailable(f"backend='cpp': {why_not}; backend='torch' runs without a compiler")
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
