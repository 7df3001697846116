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
launch finds it. Flash attention's kernels, launched by an extern call, are found by running the
program on the meta device (``extern_kernel_jobs``) and compiled into their JITFunction's cache.
A launch with another layout (a transposed input) still binds its own at its first launch, as
before. A kernel that does not compile raises ``KernelsDidNotCompile`` here, in the
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
# the backends whose kernels are compiled: Triton's, and C++ (the interpreter and the torch path compile nothing)
BACKENDS = frozenset({"triton", "cpp"})


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
    built for ``backend``), logged with the time it took. Nothing where ``backend`` compiles nothing.
    C++ kernels (``backend="cpp"``) are built by the system compiler in the same pool (a build is a
    compiler process: threads overlap them)."""
    if backend not in BACKENDS or workers() == 0:
        return
    programs = [p for p in (region.forward, region.backward) if p is not None]
    if backend == "cpp":
        compile_jobs([Job(step.torch_kernel.name, step.torch_kernel, [], ()) for program in programs
                      for step in program.kernels if hasattr(step.torch_kernel, "prepare")], None)
        return
    device = next((p.recorded_device for p in programs if p.recorded_device is not None), None)
    jobs = [job for program in programs for job in program.ahead_of_time(device) + extern_kernel_jobs(program, device)]
    seconds = compile_jobs(jobs, device)
    if jobs:
        log.debug("compiler: %s: %d kernels compiled ahead of the first call in %.2f s (%d threads)", name,
                  len(jobs), seconds, min(workers(), len(jobs)))


def compile_optimizer_step(step, name: str, backend: str) -> None:
    """Compile a fused optimizer step's combo kernels now (``runtime.optimizer_step.FusedOptimizerStep``;
    C++ functions for ``backend="cpp"``; on the torch path the optimizer's own step runs: nothing to
    compile)."""
    if backend not in BACKENDS or workers() == 0:
        return
    if backend == "cpp":
        compile_jobs([Job(launch.name, launch, [], ()) for launch in step.launches if hasattr(launch, "prepare")],
                     None)
        return
    jobs, device = step.ahead_of_time()
    seconds = compile_jobs(jobs, device)
    if jobs:
        log.debug("compiler: %s: %d optimizer kernels compiled ahead in %.2f s", name, len(jobs), seconds)


def compile_clip(plan) -> None:
    """Build a fused ``clip_grad_norm_``'s C++ functions now (``runtime.clip_grad.FusedClipGradNorm``
    built for ``backend="cpp"``; its Triton kernels compile at their first launch)."""
    if plan.cpp is not None and workers() != 0:
        compile_jobs([Job(plan.cpp.norm.name, plan.cpp, [], ())], None)


def extern_kernel_jobs(program, device) -> list:
    """Jobs for our kernels that extern calls launch themselves (flash attention's): found by running
    ``program`` on the meta device from its recorded input shapes (contiguous), each such call
    handing its launches over (``runtime.extern_kernels.launches_recorded``) with the arguments a real
    call of those shapes passes, strides included. [] where the program has none, or where some
    step cannot run on the meta device (those kernels then compile at their first launch)."""
    from runtime.program import ExternCall

    if not any(isinstance(s, ExternCall) and s.kernels for s in program.steps):
        return []
    if len(program.input_metas) != program.num_inputs or any(m is None for m in program.input_metas):
        return []
    meta = torch.device("meta")
    env = [torch.empty(shape, dtype=dtype, device=meta) for shape, dtype in program.input_metas]
    env += [None] * (program.num_slots - program.num_inputs)
    runner = _MetaRun(device)
    try:
        program._steps_for(meta, through_runner=True)(env, meta, runner)
    except Exception as e:  # noqa: BLE001 — only the prediction failed: those kernels compile when first launched
        log.debug("compiler: the meta-device run that finds extern calls' kernels stopped (%s: %s); they compile "
                  "at their first launch", type(e).__name__, e)
        return runner.jobs
    return runner.jobs


class _MetaRun:
    """A program's steps on the meta device (``Program._steps_for``'s runner): kernels make their
    outputs, extern calls compute shapes, and the launches of our kernels inside extern calls are
    collected as jobs instead of run."""

    def __init__(self, device):
        self.device = device
        self.jobs: list = []

    def kernel(self, step, env, device, torch_path, fresh_loads) -> None:
        for slot, shape, dtype in step.stores:
            env[slot] = torch.empty(shape, dtype=dtype, device=device)

    def extern(self, step, env, device) -> None:
        if not step.kernels:
            step.run(env, device)
            return
        from runtime import extern_kernels

        with extern_kernels.launches_recorded(self._collect):
            step.run(env, device)

    def index_check(self, step, env, device) -> None:
        pass

    def _collect(self, kernel, grid, args, options, cost) -> None:
        real = [stand_in(a.dtype, self.device) if isinstance(a, torch.Tensor) else a for a in args]
        self.jobs.append(Job(getattr(getattr(kernel, "fn", None), "__name__", "kernel"),
                             _JitLaunch(kernel, tuple(grid), dict(options)), real, ()))


class _JitLaunch:
    """A kernel an extern call launches with ``kernel[grid](*args, **options)``: compiled for
    those arguments by ``JITFunction.run(..., warmup=True)``, into the JITFunction's own cache,
    where its first launch finds it."""

    def __init__(self, kernel, grid, options):
        self.fn, self.grid, self.options = kernel, grid, options

    def prepare(self, args, key) -> None:
        self.fn.run(*args, grid=self.grid, warmup=True, **self.options)


def stand_in(dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor argument for compiling: Triton reads only its dtype and its address (0: aligned)."""
    return torch.empty(0, dtype=dtype, device=device)
