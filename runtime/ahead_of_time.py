"""Compiling a region's kernels when it is built, all of them, in parallel, before its first replay.

Compiled Triton binds a kernel at its first launch: ``JITFunction.run`` compiles the specialization
the launch's arguments ask for (Triton 3.6 also builds a C launcher per signature then). Left there,
a GPT-sized step would compile its forward kernels one at a time inside its first replay and its
backward kernels inside ``loss.backward()`` (tens of seconds at the second call), and a kernel that
failed to compile would raise mid-step, after other kernels had changed tensors.

So when a region is built for compiled Triton, every kernel of its forward and backward programs
(and of a fused optimizer step) is compiled here for the launch it will most likely get: inputs
contiguous and 16-byte aligned, as fresh allocations and parameters are
(``KernelLaunch.ahead_of_time``), each specialization bound into the kernel's launcher, so the first
launch finds it. A launch with another layout (a transposed input) still binds its own at its first
launch, as before. A kernel that does not compile raises ``KernelsDidNotCompile`` here, in the
build: the compiler's usual handling of a bug applies (the region runs eagerly, the reason logged
and shown by ``explain``; ``SYMGRAD_STRICT`` raises), never a failure mid-step.

The compiles run in a thread pool, one kernel function per task (a JITFunction's caches are its
own). Threads, not Inductor's worker processes: Triton's compile spends its time in MLIR passes,
LLVM and ptxas, outside the GIL; measured on this 2-core machine, the transformer step's 36 sm_90
kernels compile in 6.6 s in one thread and 3.5 s in two (``python -m benchmarks.ahead_of_time``).
``SYMGRAD_COMPILE_WORKERS`` sets the pool's size (default: the CPUs this process may use, at most
32); 0 turns ahead-of-time compiling off (each kernel compiles at its first launch).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

log = logging.getLogger("compiler")

WORKERS_ENV = "SYMGRAD_COMPILE_WORKERS"
# the backends whose kernels are compiled Triton (the interpreter and the CPU path compile nothing)
BACKENDS = frozenset({"triton"})


@dataclass(frozen=True)
class Job:
    """One specialization to compile: ``launcher.prepare(args, key)``."""
    name: str          # the kernel's, for messages
    launcher: object   # a runtime.launcher.Launcher
    args: list         # the launch's arguments (stand-in tensors: only their dtype and address matter)
    key: tuple         # the layout key a launch with these arguments computes


class KernelsDidNotCompile(RuntimeError):
    """Some kernels of a region failed to compile; the message names each and Triton's error."""


def workers() -> int:
    """The compile pool's size: ``$SYMGRAD_COMPILE_WORKERS`` or the CPUs this process may use (≤ 32)."""
    chosen = os.environ.get(WORKERS_ENV, "").strip()
    if chosen:
        try:
            count = int(chosen)
        except ValueError:
            raise ValueError(f"{WORKERS_ENV}={chosen!r}: give a number of compile threads (0: compile each "
                             "kernel at its first launch)") from None
        if count < 0:
            raise ValueError(f"{WORKERS_ENV}={count}: give 0 or more compile threads")
        return count
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        available = os.cpu_count() or 1
    return max(1, min(32, available))


def compile_jobs(jobs: list, device: torch.device | None, pool_size: int | None = None) -> float:
    """Compile every job, in parallel; the seconds it took. Raises ``KernelsDidNotCompile`` naming
    every kernel that failed (after all were tried). ``device``: where the kernels will run (each
    compile thread makes it current: Triton compiles for the current device's target)."""
    size = workers() if pool_size is None else pool_size
    if not jobs or size == 0:
        return 0.0
    by_function: dict = {}
    for job in jobs:   # (one task per kernel function: its specializations in turn)
        by_function.setdefault(id(getattr(job.launcher, "fn", job.launcher)), []).append(job)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(size, len(by_function)), thread_name_prefix="symgrad-compile") as pool:
        outcomes = list(pool.map(lambda group: _compile_group(group, device), by_function.values()))
    failures = [failure for outcome in outcomes for failure in outcome]
    if failures:
        listed = "; ".join(f"{name}: {type(e).__name__}: {str(e).strip()[:400]}" for name, e in failures[:5])
        more = f" (and {len(failures) - 5} more)" if len(failures) > 5 else ""
        raise KernelsDidNotCompile(f"{len(failures)} of {len(jobs)} kernels did not compile: {listed}{more}") \
            from failures[0][1]
    return time.perf_counter() - started


def _compile_group(group: list, device) -> list:
    """Compile one kernel function's jobs; (name, exception) per failure."""
    failures = []
    with _current(device):
        for job in group:
            try:
                job.launcher.prepare(job.args, job.key)
            except Exception as e:  # noqa: BLE001 — collected: every kernel is tried, all failures named
                failures.append((job.name, e))
    return failures


def _current(device):
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    import contextlib

    return contextlib.nullcontext()


def compile_region(region, name: str, backend: str) -> None:
    """Compile ``region``'s forward and backward kernels now (``runtime.autograd_bridge.CompiledRegion``
    built for ``backend``), logged with the time it took. Nothing where ``backend`` compiles nothing."""
    if backend not in BACKENDS or workers() == 0:
        return
    programs = [p for p in (region.forward, region.backward) if p is not None]
    device = next((p.recorded_device for p in programs if p.recorded_device is not None), None)
    jobs = [job for program in programs for job in program.ahead_of_time(device)]
    seconds = compile_jobs(jobs, device)
    if jobs:
        log.debug("compiler: %s: %d kernels compiled ahead of the first call in %.2f s (%d threads)", name,
                  len(jobs), seconds, min(workers(), len(jobs)))


def compile_optimizer_step(step, name: str, backend: str) -> None:
    """Compile a fused optimizer step's combo kernels now (``runtime.optimizer_step.FusedOptimizerStep``)."""
    if backend not in BACKENDS or workers() == 0:
        return
    jobs, device = step.ahead_of_time()
    seconds = compile_jobs(jobs, device)
    if jobs:
        log.debug("compiler: %s: %d optimizer kernels compiled ahead in %.2f s", name, len(jobs), seconds)


def stand_in(dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor argument for compiling: Triton reads only its dtype and its address (0: aligned)."""
    return torch.empty(0, dtype=dtype, device=device)
