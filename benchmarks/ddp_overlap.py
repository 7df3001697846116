"""When do DDP's gradient buckets fire during a compiled backward? (an observation, not a test)

DDP all-reduces a bucket as soon as every gradient in it has been accumulated, so that the
communication overlaps the rest of the backward. This script trains the same MLP under DDP
(2 gloo processes over loopback) with a compiled step and with an eager one, and logs, in
order, on rank 0 of each step: every kernel our runtime launches (forward, backward, extern
matmuls, optimizer), every aten op eager's backward runs, each parameter's gradient being
accumulated (``register_post_accumulate_grad_hook``) and each bucket reaching DDP's
communication hook. It prints, for each bucket, how much of the step's backward work had run
when the bucket fired.

    PYTHONPATH=$PWD python benchmarks/ddp_overlap.py [--layers 6] [--width 128] [--bucket-mb 0.1]

Instrumentation only: it logs the runtime's launches through a ``runtime.program.StepRunner``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import compiler  # noqa: F401  (first: on CPU it puts Triton in interpreter mode before torch imports it)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.program import StepRunner, steps_run_by

STEPS = 4   # the first calls record (and DDP rebuilds its buckets after its first step)


class _AtenLog(TorchDispatchMode):
    """Eager's work: each aten op run, as ("op", name)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(("op", func.__name__))
        return func(*args, **(kwargs or {}))


class _LaunchLog(StepRunner):
    """Logs each launch of our runtime as ("kernel", name), each matmul and other PyTorch call as
    ("kernel", "extern"), before it runs."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def kernel(self, step, env, device, torch_path, fresh_loads):
        self.log.append(("kernel", step.name))
        super().kernel(step, env, device, torch_path, fresh_loads)

    def extern(self, step, env, device):
        self.log.append(("kernel", "extern"))
        super().extern(step, env, device)


def _model(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    mods.append(torch.nn.Linear(width, 4))
    return torch.nn.Sequential(*mods)


def _run(rank, compiled, args, log):
    model = DDP(_model(args.layers, args.width), bucket_cap_mb=args.bucket_mb)
    names = {p: n for n, p in model.module.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: log.append(("grad", names[p])))

    def hook(state, bucket):
        log.append(("bucket", len(bucket.parameters())))
        return allreduce_hook(state, bucket)
    model.register_comm_hook(dist.group.WORLD, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        log.append(("backward", "begins"))
        loss.backward()
        log.append(("backward", "returned"))
        opt.step()
        opt.zero_grad()
        return loss

    fn = compiler.compile(step) if compiled else step
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        log.clear()
        x, y = torch.randn(32, args.width, generator=generator), torch.randn(32, 4, generator=generator)
        if compiled:
            fn(x, y)
        else:
            with _AtenLog(log):
                fn(x, y)
    report = fn.last_entry.report if compiled else None
    return list(log), report


def _delayed_allreduce(delay_s):
    """A comm hook whose all-reduce completes ``delay_s`` late, off the backward's thread: a slow link.
    The backward goes on meanwhile; DDP waits for every bucket's future at the backward's end."""
    def hook(state, bucket):
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        future = torch.futures.Future()

        def finish():
            time.sleep(delay_s)
            work.wait()
            future.set_result(bucket.buffer().div_(dist.get_world_size()))
        threading.Thread(target=finish, daemon=True).start()
        return future
    return hook


def _timed(rank, compiled, args):
    """(per bucket: the fraction of the backward's wall time elapsed when it was handed over, no delay;
    the median step time with ``args.delay_ms`` injected per bucket)."""
    fractions, times = [], []
    for delay in (0.0, args.delay_ms / 1000):
        model = DDP(_model(args.layers, args.width), bucket_cap_mb=args.bucket_mb)
        marks: list = []
        hook = _delayed_allreduce(delay)
        model.register_comm_hook(dist.group.WORLD, lambda state, bucket: (marks.append(time.perf_counter()),
                                                                          hook(state, bucket))[1])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            marks.append(time.perf_counter())
            loss.backward()
            marks.append(time.perf_counter())
            opt.step()
            opt.zero_grad()
            return loss
        fn = compiler.compile(step) if compiled else step
        generator = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(32, args.width, generator=generator), torch.randn(32, 4, generator=generator))
                   for _ in range(4)]
        step_times = []
        for i in range(STEPS + args.timed_steps):
            marks.clear()
            start = time.perf_counter()
            fn(*batches[i % 4])
            step_times.append(time.perf_counter() - start)
            if delay == 0 and i >= STEPS:   # (the backward begins at marks[0], returns at marks[-1])
                span = marks[-1] - marks[0]
                fractions.append([(m - marks[0]) / span for m in marks[1:-1]])
        if delay:
            times = sorted(step_times[STEPS:])
    per_bucket = [sorted(f[b] for f in fractions)[len(fractions) // 2] for b in range(len(fractions[0]))]
    return per_bucket, times[len(times) // 2]


def _summary(log, report):
    """Lines: for each bucket, the backward work done before it fired."""
    if report is not None:
        backward = {k.name for k in report.backward_kernels}
        work = [i for i, (kind, name) in enumerate(log) if kind == "kernel"]
        start = next(i for i, e in enumerate(log) if e == ("backward", "begins"))
        end = next(i for i, e in enumerate(log) if e == ("backward", "returned"))
        bwd = [i for i in work if start < i < end]
        unit = "backward launches (our kernels and extern matmuls)"
        kernels = [log[i][1] for i in bwd]
        detail = f"{sum(k in backward for k in kernels)} fused kernels + {kernels.count('extern')} extern calls"
    else:
        start = next(i for i, e in enumerate(log) if e == ("backward", "begins"))
        end = next(i for i, e in enumerate(log) if e == ("backward", "returned"))
        bwd = [i for i, (kind, _) in enumerate(log) if kind == "op" and start < i < end]
        unit = "backward aten ops"
        detail = "eager"
    lines = [f"backward: {len(bwd)} {unit} ({detail})"]
    # (the work that computes gradients: up to the last one accumulated; after it eager's count has
    # DDP's own finalization, copying each all-reduced bucket back into .grad, which ours does not count)
    last_grad = max(i for i in range(start, end) if log[i][0] == "grad")
    computing = sum(1 for j in bwd if j < last_grad)
    grads, fractions = 0, []
    for i in range(start, end):
        kind, what = log[i]
        if kind == "grad":
            grads += 1
        if kind == "bucket":
            done = sum(1 for j in bwd if j < i)
            fractions.append(done / computing)
            lines.append(f"  bucket of {what} parameters fired after {done}/{len(bwd)} {unit.split(' (')[0]}, "
                         f"{grads} gradients accumulated ({done}/{computing} = {done / computing:.2f} of the work "
                         "before the last gradient)")
    lines.append("  timeline (K: backward work, N of them in a row as Kxn; g: a gradient accumulated; B<n>: a bucket "
                 "of n parameters handed to its all-reduce):")
    lines.append("    " + _timeline(log, set(bwd), start, end))
    return lines, fractions


def _timeline(log, work, start, end) -> str:
    marks, run = [], 0
    for i in range(start, end):
        kind, what = log[i]
        if i in work:
            run += 1
            continue
        if kind not in ("grad", "bucket"):
            continue
        if run:
            marks.append(f"Kx{run}")
            run = 0
        marks.append("g" if kind == "grad" else f"B{what}")
    if run:
        marks.append(f"Kx{run}")
    return " ".join(marks)


def _ops(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def worker(rank, world, init_file, args, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        log: list = []
        results = {}
        for compiled in (True, False):
            with steps_run_by(_LaunchLog(log)):
                events, report = _run(rank, compiled, args, log)
            results["compiled" if compiled else "eager"] = _summary(events, report)
            if compiled:
                results["kernels"] = (f"forward kernels {len(report.forward_kernels)}, backward kernels "
                                      f"{len(report.backward_kernels)}, backward segments {report.backward_segments} "
                                      f"(regions' captured ops: {[_ops(r['captured']) for r in report.regions]}), "
                                      f"fallbacks {report.fallbacks or 'none'}")
        for compiled in (True, False):
            results["timed compiled" if compiled else "timed eager"] = _timed(rank, compiled, args)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=0.1)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="injected per bucket's all-reduce")
    parser.add_argument("--timed-steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.start_processes(worker, args=(2, os.path.join(tmp, "init"), args, out), nprocs=2, start_method="spawn")
        results = torch.load(out)
    params = (args.width + 1) * args.width * args.layers + (args.width + 1) * 4
    print(f"DDP, 2 gloo processes, MLP of {args.layers} Linear({args.width}, {args.width}) + GELU and a head "
          f"({params} parameters in {2 * args.layers + 2} tensors), bucket_cap_mb={args.bucket_mb}; "
          f"step {STEPS} of {STEPS}, rank 0")
    print(results["kernels"])
    for mode in ("compiled", "eager"):
        print(f"{mode}:")
        for line in results[mode][0]:
            print("  " + line)
    ratios = [f"{o / e:.2f}" for o, e in zip(results["compiled"][1], results["eager"][1])]
    print(f"each bucket's hand-over point, compiled/eager (as fractions of the work before the last gradient): "
          f"{', '.join(ratios)}")
    (ours, ours_ms), (eager, eager_ms) = results["timed compiled"], results["timed eager"]
    print(f"wall time, median of {args.timed_steps} steps (rank 0): fraction of the backward elapsed when each "
          "bucket was handed over, no delay injected")
    for b, (o, e) in enumerate(zip(ours, eager)):
        print(f"  bucket {b}: compiled {o:.2f}, eager {e:.2f} (compiled/eager {o / e:.2f})")
    print(f"step time with {args.delay_ms:g} ms injected per bucket's all-reduce: compiled {ours_ms * 1e3:.1f} ms, "
          f"eager {eager_ms * 1e3:.1f} ms (compiled/eager {ours_ms / eager_ms:.2f})")


if __name__ == "__main__":
    main()
