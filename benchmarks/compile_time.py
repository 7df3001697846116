"""Compile time, cold and warm, each measured in a fresh process.

Cold: a fresh process with empty caches — ``SYMGRAD_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``
and ``TRITON_CACHE_DIR`` point at a new temporary directory. Warm: a second fresh process with
the same, now filled, caches: what a restarted training job sees. (``fresh_process`` says how
the processes are made: subprocesses on GPU, forks of a clean server on CPU.)

Compile time is the extra wall time of the first calls over what those calls cost once warm.
A call of ours that ran eagerly (the recording call) is charged eager's step time, every
other call the backend's steady step time; so the recording's capture and codegen, kernel
loading and Triton's JIT are counted, and running the step itself is not.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from benchmarks import backends, fresh_process
from benchmarks.measure import sync
from benchmarks.workloads import WORKLOADS
from runtime.backends import CPU_BACKEND_ENV

WARMUP = 3


class ProbeError(RuntimeError):
    pass


def warm_up(case, name, run, args, device, calls=WARMUP):
    """The first ``calls`` steps of backend ``name``: their wall times, what each ran, and
    the last step's result."""
    times, ran, result = [], [], None
    for _ in range(calls):
        sync(device)
        start = time.perf_counter()
        result = case.step(run, args)
        sync(device)
        times.append(time.perf_counter() - start)
        ran.append(backends.what_ran(name, run))
    return times, ran, result


def compile_seconds(name, first_times, ran, steady_s, eager_s) -> float:
    """Extra time of the first calls over their warm cost (never below zero: noise)."""
    baseline = sum(eager_s if backends.ran_eagerly(name, what) else steady_s for what in ran)
    return max(0.0, sum(first_times) - baseline)


def cold_and_warm(workload: str, backend: str, size: str, device: torch.device, on_start=None, timeout=600):
    """(cold, warm) compile seconds of ``backend`` on ``workload``, from two fresh processes
    sharing one cache directory that starts empty; ``on_start("cold" | "warm")`` is called
    before each. Raises ProbeError with the reason."""
    request = {"workload": workload, "backend": backend, "size": size, "device": str(device)}
    with tempfile.TemporaryDirectory(prefix="symgrad-bench-caches-") as caches:
        env = {var: os.path.join(caches, sub) for var, sub in (
            ("SYMGRAD_CACHE_DIR", "symgrad"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))}
        # ours runs "auto" there as here (a fork server started earlier keeps the environment it had then)
        env[CPU_BACKEND_ENV] = os.environ.get(CPU_BACKEND_ENV, "")
        times = []
        for which in ("cold", "warm"):
            if on_start is not None:
                on_start(which)
            try:
                result = fresh_process.call("benchmarks.compile_time:probe", request, env,
                                            os.path.join(caches, f"{which}.log"), timeout, fork=device.type == "cpu")
            except fresh_process.FreshProcessError as e:
                raise ProbeError(f"{which} compile process failed: {e}") from None
            if "error" in result:
                raise ProbeError(result["error"])
            times.append(result["compile_s"])
        return tuple(times)


def probe(request: dict) -> dict:
    """In the fresh process: ``{"compile_s": ...}``, or ``{"error": ...}``."""
    try:
        return {"compile_s": _probe(**request)}
    except Exception as e:  # noqa: BLE001 — reported to the parent, which records the failure
        text = str(e).strip()
        return {"error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"}


def _probe(workload, backend, size, device):
    device = torch.device(device)
    case = WORKLOADS[workload].build(size, device)
    # Eager first: it is the recording call's baseline, and it warms PyTorch itself (lazy
    # initialization that would otherwise be charged to the compiler).
    eager_args = case.make_args(torch.float32)
    eager_times = [_timed(lambda: case.step(case.fn, eager_args), device) for _ in range(4)]
    eager_s = min(eager_times[1:])

    run = backends.prepare(backend, case.fn)
    args = case.make_args(torch.float32)
    interpreted = backend == backends.OURS and backends.interprets(device)
    if interpreted:
        # NOTE: ours compiles in its first two calls: the recording (capture, SymPy, codegen)
        # and the first replay (loading kernels; Triton's JIT on a GPU). In the interpreter the
        # second is a few milliseconds of loading inside a step whose time varies by 10%: only
        # the recording is counted, against eager's step time.
        first, ran, _ = warm_up(case, backend, run, args, device, calls=1)
        return compile_seconds(backend, first, ran, 0.0, eager_s)
    first, ran, _ = warm_up(case, backend, run, args, device)
    steady = sorted(_timed(lambda: case.step(run, args), device) for _ in range(5))
    return compile_seconds(backend, first, ran, steady[len(steady) // 2], eager_s)


def _timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start
