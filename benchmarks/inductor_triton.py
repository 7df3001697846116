"""Kernels per step of torch.compile's GPU code path, counted without a GPU.

On a GPU, torch.compile's Inductor generates Triton kernels; on CPU it generates C++ loops,
and a C++ kernel can do what a Triton kernel cannot (a row loop and the sum over its rows'
results in one kernel: a loss's mean, a norm's weight gradients), so the CPU count of
``python -m benchmarks`` is not what a GPU run of torch.compile would launch. This counts the
Triton path's launches on CPU: Inductor with ``cpu_backend="triton"`` schedules and fuses with
its Triton scheduler and writes Triton kernels for the CPU tensors; ``TRITON_INTERPRET=1`` lets
it load them; each kernel's ``run`` is replaced by a counter (the kernels are not run: their
outputs are zero-filled, so indices a kernel makes stay valid for the PyTorch ops after it).
The device reports an H100's 132 SMs, so Inductor's reduction splits are decided as on sm_90.
A step's kernels are its Triton launches plus the compute operators ``torch.profiler`` sees
(matmuls, convolutions, ``ones_like``, ops Inductor leaves to PyTorch: the harness's rule,
``benchmarks.measure.count_kernels``). The step runs twice first (compile, then warm).

Limits: only the SM count is an H100's (other device properties are the CPU's); an op that
Inductor's CPU Triton path does not lower (complex numbers) falls back to PyTorch ops, as it
may not on a GPU. Inductor's private hooks (``CpuInterface``, ``CachingAutotuner.run``) are
patched, so this runs in a process of its own (``python -m benchmarks.inductor_triton``).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

H100_SMS = 132
_ZERO_FILL = "uncounted zero fill"   # the profiler range around our zero fills (not the step's operators)


def _patch_inductor():
    """Inductor's Triton path on CPU tensors, kernels counted instead of run."""
    import torch
    import triton
    import torch._inductor.config as config
    from torch._dynamo import device_interface
    from torch._inductor.runtime import triton_heuristics

    from benchmarks.launch import _HostOnlyDriver

    config.cpu_backend = "triton"
    config.compile_threads = 1

    class H100Properties:
        multi_processor_count = H100_SMS

    device_interface.CpuInterface.Worker.get_device_properties = staticmethod(lambda device=None: H100Properties())
    triton.runtime.driver.set_active(_HostOnlyDriver())   # Inductor asks Triton's driver for a target
    launches: list = []

    def run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        with torch.profiler.record_function(_ZERO_FILL):
            for name, value in zip(self.fn.arg_names, args):
                if name.startswith("out_ptr") and isinstance(value, torch.Tensor):
                    value.zero_()

    triton_heuristics.CachingAutotuner.run = run
    return launches


def count(name: str, size: str) -> dict:
    """{"workload", "kernels", "triton", "operators"} of one step (in this process: patches Inductor)."""
    import torch

    from benchmarks import measure
    from benchmarks.workloads import WORKLOADS

    launches = _patch_inductor()
    case = WORKLOADS[name].build(size, torch.device("cpu"))
    step = torch.compile(case.fn)
    args = case.make_args(torch.float32)
    case.step(step, args)
    case.step(step, args)
    launches.clear()
    with measure._quiet_stderr(), torch.profiler.profile() as prof:
        case.step(step, args)
    operators = collections.Counter(
        e.name for e in prof.events()
        if measure._is_cpu_kernel(e.name) and not measure._inside_kernel(e)
        and not measure.inside(e, lambda parent: parent.name == _ZERO_FILL))
    return dict(workload=name, kernels=len(launches) + sum(operators.values()), triton=len(launches),
                operators=dict(operators))


def probe_model(model: str, size: str, layers: int | None, batch: int, length: int, dtype: str) -> dict:
    """One training step of ``benchmarks.models``' ``model`` under torch.compile, on CPU tensors, on
    Inductor's Triton path (kernels counted with their bytes, not run): {"launches", "bytes" (each
    launch's tensor arguments, once each, an in-out buffer twice), "operators" (the other compute
    operators by name, ``count``'s rule), "peak" (the most allocated in the step above its start),
    "resident" (parameters and optimizer state)}. The step runs twice first (compile, then warm)."""
    import torch

    from torch._inductor.runtime import triton_heuristics

    from benchmarks import measure, models
    from benchmarks.roofline import distinct_bytes

    launches = _patch_inductor()
    moved: list = []
    counting = triton_heuristics.CachingAutotuner.run   # (_patch_inductor's counter)

    def run(self, *args, **kwargs):
        moved.append(sum(distinct_bytes(v) * (2 if name.startswith("in_out_ptr") else 1)
                         for name, v in zip(self.fn.arg_names, args) if isinstance(v, torch.Tensor)))
        return counting(self, *args, **kwargs)

    triton_heuristics.CachingAutotuner.run = run
    torch.manual_seed(0)
    net, config = models.build(model, size, layers=layers)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
    batch_ = models.make_batch(model, config, batch, length, "cpu")
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bfloat16" else None
    step = torch.compile(lambda m, o, x, y: models.train_step(m, o, x, y, amp))
    for _ in range(2):
        step(net, opt, *batch_)
    launches.clear()
    moved.clear()
    with measure._quiet_stderr(), torch.profiler.profile() as prof:
        step(net, opt, *batch_)
    operators = collections.Counter(
        e.name.removeprefix("aten::") for e in prof.events()
        if measure._is_cpu_kernel(e.name) and not measure._inside_kernel(e)
        and not measure.inside(e, lambda parent: parent.name == _ZERO_FILL))
    memory = measure.step_memory(lambda: step(net, opt, *batch_), torch.device("cpu"))
    resident = sum(p.untyped_storage().nbytes() for p in net.parameters()) + sum(
        t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return dict(launches=len(moved), bytes=sum(moved), operators=dict(operators), peak=memory.peak,
                saved=memory.saved, resident=resident)


def probe_models(probes: list, timeout: int = 1800) -> list:
    """``probe_model(**probe)`` of each probe, each in a fresh process (Inductor patched there)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = []
    for probe in probes:
        done = subprocess.run([sys.executable, "-m", "benchmarks.inductor_triton", "--probe", json.dumps(probe)],
                              env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"torch.compile probe {probe} failed: "
                               + (done.stderr.strip().splitlines() or ["no output"])[-1])
        out.append(json.loads(lines[-1]))
    return out


def counts(names, size: str = "small", timeout: int = 900) -> list:
    """``count`` of each workload, each in a fresh process (Inductor patched there, not here)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = []
    for name in names:
        done = subprocess.run([sys.executable, "-m", "benchmarks.inductor_triton", "--worker", name, "--size", size],
                              env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            out.append(dict(workload=name, error=(done.stderr.strip().splitlines() or ["no output"])[-1]))
            continue
        out.append(json.loads(lines[-1]))
    return out


def main(argv=None) -> None:
    import argparse

    from benchmarks.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated workloads (default: all): {', '.join(WORKLOADS)}")
    parser.add_argument("--size", default="small", choices=("full", "small", "tiny"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)   # one workload, in this process
    parser.add_argument("--probe", help=argparse.SUPPRESS)    # one model probe (JSON), in this process
    options = parser.parse_args(argv)
    if options.probe:
        print(json.dumps(probe_model(**json.loads(options.probe))), flush=True)
        return
    if options.worker:
        print(json.dumps(count(options.worker, options.size)), flush=True)
        return
    names = options.only.split(",") if options.only else list(WORKLOADS)
    print("| workload | torch.compile's Triton path: kernels / step | Triton kernels | other operators |")
    print("|---|---|---|---|")
    for r in counts(names, options.size):
        if "error" in r:
            print(f"| `{r['workload']}` | failed: {r['error']} | | |")
            continue
        others = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in sorted(r["operators"].items()))
        print(f"| `{r['workload']}` | {r['kernels']} | {r['triton']} | {others or '-'} |", flush=True)


if __name__ == "__main__":
    main()
