"""Host work per kernel launch, up to the driver call: our direct launch vs ``JITFunction.run``.

What a launch of ours does on the host before the GPU driver is called: compute its arguments
(each input with its strides, each output allocated), check the layout key and call the bound
launcher (``runtime/launcher.py``). Before issue 13 a launch went through ``JITFunction.run``
instead (binding, specialization, cache key, launch metadata). Both are timed here on the
real compiled-Triton code path, without a GPU:

1. a workload's step is replayed once (``recorded``) and every launch it makes is noted: the
   kernel, its grid, tiles and warps, and the layout of each input (shape, strides, offset);
2. a worker process started *without* ``TRITON_INTERPRET`` (an interpreted process has no
   ``JITFunction``) rebuilds each launch with CPU tensors of those layouts, gives Triton a
   host-only driver (target sm_90: kernels really compile; loading a binary and launching do
   nothing) and times, per launch, in interleaved rounds: ``arguments`` alone, our launch
   (``KernelLaunch.run``) and the old path (``arguments`` + ``fn[grid](...)``, i.e.
   ``JITFunction.run``). The driver's own launcher (``CudaLauncher.__call__``) is not timed in
   either: it is the driver call.

``python -m benchmarks.launch --only overhead_step,transformer_step`` prints a table; the
harness stores the mean of our launches as ``launch_us`` on our rows. Outputs are allocated by
a stand-in for CUDA's caching allocator (``_CachingEmpty``: a tensor per shape and dtype, kept):
the CPU allocator maps fresh pages for large tensors, tens of noisy microseconds that swamped
the differences measured here, while CUDA's allocator takes about a microsecond.

This file runs in two roles, as ``benchmarks/sm90.py`` does: imported, it records launches and
starts the worker; run as a script (``python benchmarks/launch.py JOBS.json``) it is the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATIONS = 300   # launches per timed round
ROUNDS = 7


# -- recording a step's launches (the main process) ----------------------------------------------
@contextlib.contextmanager
def recorded():
    """Within the block, each of our kernel launches is noted (a JSON-able dict, appended to the
    yielded list) before it runs (or is stubbed: use it inside ``measure.kernels_stubbed``).
    Index checks pass whatever they find: a stubbed kernel's garbage indices are no error."""
    from runtime import program

    jobs: list = []
    with program.steps_run_by(_recorder(program)(program.installed_runner(), jobs)):
        yield jobs


def _recorder(program):
    """The StepRunner class of ``recorded`` (``runtime.program`` is imported only where it records:
    this file is also the worker, which must import Triton first)."""

    class Recorder(program.StepRunner):
        def __init__(self, inner, jobs: list):
            super().__init__(inner)
            self.jobs = jobs

        def kernel(self, step, env, device, torch_path, fresh_loads):
            if step.grid:
                self.jobs.append(_job(step, env, fresh_loads))
            super().kernel(step, env, device, torch_path, fresh_loads)

        def index_check(self, step, env, device):
            with contextlib.suppress(IndexError):
                super().index_check(step, env, device)

    return Recorder


def _job(step, env, fresh_loads) -> dict:
    inputs = {}
    for slot in step.loads:
        t = env[slot]
        inputs[str(slot)] = [list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype),
                             t.untyped_storage().nbytes()]
    return dict(name=step.name, source=step.source, loads=list(step.loads), fresh=sorted(fresh_loads),
                stores=[[slot, list(shape), str(dtype)] for slot, shape, dtype in step.stores],
                grid=step.grid, xblock=step.xblock, rblock=step.rblock, num_warps=step.num_warps, inputs=inputs)


def measure_launches(jobs: list, iterations: int = ITERATIONS, rounds: int = ROUNDS, timeout: float = 600) -> list:
    """Per job: µs of host work per launch (medians of round means): ``alloc_us`` allocating its
    outputs, ``args_us`` computing its arguments (allocations included), ``ours_us`` our whole
    launch and ``jit_us`` the old path (arguments, then ``JITFunction.run``), each up to the
    driver call; ``launch_us`` and ``jit_launch_us`` are the last two without the allocations.
    Identical kernels and layouts are timed once."""
    unique = {json.dumps(j, sort_keys=True): j for j in jobs}
    with tempfile.TemporaryDirectory(prefix="symgrad-launch-") as tmp:
        path = os.path.join(tmp, "jobs.json")
        with open(path, "w") as f:
            json.dump(dict(jobs=list(unique.values()), iterations=iterations, rounds=rounds), f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
        env["SYMGRAD_CACHE_DIR"] = env.get("SYMGRAD_CACHE_DIR") or os.path.join(tmp, "kernels")
        done = subprocess.run([sys.executable, os.path.abspath(__file__), path], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the launch-timing worker failed: {done.stderr[-2000:]}")
    timed = dict(zip(unique, json.loads(done.stdout.strip().splitlines()[-1])))
    return [timed[json.dumps(j, sort_keys=True)] for j in jobs]


def mean_us(results: list, field: str = "launch_us") -> float | None:
    """The mean over a step's launches (each launch counted as often as the step makes it)."""
    return statistics.fmean(r[field] for r in results) if results else None


# -- the worker (a process without TRITON_INTERPRET) ----------------------------------------------
class _HostOnlyDriver:
    """Triton's active driver as far as ``JITFunction.run`` and our launcher reach before the
    launch, on a machine without a GPU: an sm_90 target, device 0, stream 0; loading a binary
    returns placeholder handles and the launcher does nothing."""

    def __init__(self):
        from types import SimpleNamespace

        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", 90, 32)
        self.utils = SimpleNamespace(
            load_binary=lambda name, kernel, shared, device: (1, 1, 32, 0, 1024),
            get_device_properties=lambda device: {"max_shared_mem": 232448, "multiprocessor_count": 132},
            unload_module=lambda module: None)
        self.launcher_cls = lambda src, metadata: (lambda *args: None)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self._target


def _tensor(shape, stride, offset, dtype, nbytes):
    import torch

    dtype = getattr(torch, dtype.split(".")[-1])
    storage = torch.empty(max(1, nbytes // dtype.itemsize), dtype=dtype)
    return storage.as_strided(shape, stride, offset)


class _CachingEmpty:
    """``torch.empty`` as CUDA's caching allocator behaves on the host: a block of the size asked
    for comes back from a cache (here: one tensor per shape and dtype, handed out again; the
    timed launches do not read their outputs). Installed as ``torch.empty`` in the worker before
    any launch is built, so our launches, the old path and the allocation column all use it."""

    def __init__(self, empty):
        self._empty = empty
        self._kept: dict = {}

    def __call__(self, shape, dtype=None, device=None):
        key = (shape, dtype)
        t = self._kept.get(key)
        if t is None:
            t = self._kept[key] = self._empty(shape, dtype=dtype, device=device)
        return t


def _time_us(calls: dict, iterations: int, rounds: int) -> dict:
    """µs per call of each zero-argument callable: interleaved rounds, median of round means.
    CPU time of this thread: host work, not what other processes on a busy machine take."""
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.thread_time()
            for _ in range(iterations):
                call()
            samples[name].append((time.thread_time() - start) * 1e6 / iterations)
    return {name: statistics.median(values) for name, values in samples.items()}


def _worker(jobs_path: str) -> None:
    import triton
    import torch

    torch.set_num_threads(1)
    torch.empty = _CachingEmpty(torch.empty)
    triton.runtime.driver.set_active(_HostOnlyDriver())
    from runtime import launcher as direct
    from runtime.program import KernelLaunch, asserts_indices

    cpu = torch.device("cpu")
    with open(jobs_path) as f:
        spec = json.load(f)
    out = []
    for job in spec["jobs"]:
        stores = [(slot, tuple(shape), getattr(torch, dtype.split(".")[-1])) for slot, shape, dtype in job["stores"]]
        launch = KernelLaunch(job["name"], job["source"], job["loads"], stores, job["grid"], job["xblock"],
                              job["rblock"], 0, job["num_warps"],
                              # (a kernel that checks indices is compiled with its asserts, as it runs)
                              index_checks=() if asserts_indices(job["source"]) else None)
        fresh = frozenset(job["fresh"])
        env = [None] * (1 + max([*job["loads"], *(s for s, _, _ in stores)]))
        for slot, layout in job["inputs"].items():
            env[int(slot)] = _tensor(*layout)
        fn = launch.kernel()
        kwargs = dict(XBLOCK=launch.xblock, RBLOCK=launch.rblock, num_warps=launch.num_warps)
        grid = (launch.grid,)

        def args_only():
            launch.arguments(env, cpu)

        def allocations():  # what every backend pays for its outputs, eager's kernels included
            for _, shape, dtype in stores:
                torch.empty(shape, dtype=dtype, device=cpu)

        def ours():
            launch.run(env, cpu, fresh)

        def jit():  # the launch before issue 13: arguments, then JITFunction.run
            args, _, _ = launch.arguments(env, cpu)
            fn[grid](*args, **kwargs)

        jit()
        ours()  # the first calls compile for sm_90 and bind
        assert isinstance(launch.launcher(), direct.DirectLauncher)
        calls = {"alloc_us": allocations, "args_us": args_only, "ours_us": ours, "jit_us": jit}
        timed = _time_us(calls, spec["iterations"], spec["rounds"])
        # launch_us: our launch's host work up to the driver call, its outputs' allocation aside
        out.append(dict(name=job["name"], launch_us=timed["ours_us"] - timed["alloc_us"],
                        jit_launch_us=timed["jit_us"] - timed["alloc_us"], generated=bool(launch._straight), **timed))
    print(json.dumps(out), flush=True)


# -- the command line -----------------------------------------------------------------------------
def main(argv=None) -> None:
    """``python -m benchmarks.launch [--only a,b] [--size small]``: launch host work per workload."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="overhead_step,transformer_step", help="workloads, comma-separated")
    parser.add_argument("--size", default="small", choices=("full", "small", "tiny"))
    options = parser.parse_args(argv)

    import compiler
    import torch

    from benchmarks import measure
    from benchmarks.workloads import WORKLOADS

    print("µs of host work per launch up to the driver call (outputs' allocation aside; it is shown apart)")
    print("| workload | launches / step | allocation µs | ours: launch_us | before (JITFunction.run) |")
    print("|---|---|---|---|---|")
    for name in options.only.split(","):
        results = launches_of(WORKLOADS[name], options.size, compiler, measure, torch)
        print(f"| `{name}` | {len(results)} | {mean_us(results, 'alloc_us'):.2f} | {mean_us(results):.2f} "
              f"| {mean_us(results, 'jit_launch_us'):.2f} |")


def launches_of(workload, size, compiler, measure, torch, **timing) -> list:
    """Record one replayed step of ``workload`` (launches stubbed) and time its launches
    (``timing``: ``iterations``, ``rounds`` of ``measure_launches``)."""
    case = workload.build(size, torch.device("cpu"))
    run = compiler.compile(case.fn, backend="interpret")  # (the Triton launches, stubbed: not the CPU path)
    args = case.make_args(torch.float32)
    case.step(run, args)  # the recording
    with measure.kernels_stubbed(), recorded() as jobs:
        case.step(run, args)
    return measure_launches(jobs, **timing)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        _worker(sys.argv[1])
    else:
        main()
