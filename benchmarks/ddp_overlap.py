"""When do DDP's buckets and FSDP2's reduce-scatters fire during a compiled backward? (an observation, not a test)

DDP all-reduces a bucket as soon as every gradient in it has been accumulated, so that the
communication overlaps the rest of the backward. This script trains the same MLP under DDP
(2 gloo processes over loopback) with a compiled step and with an eager one, and logs, in
order, on rank 0 of each step: every kernel our runtime launches (forward, backward, extern
matmuls, optimizer), every aten op eager's backward runs, each parameter's gradient being
accumulated (``register_post_accumulate_grad_hook``) and each bucket reaching DDP's
communication hook. It prints, for each bucket, how much of the step's backward work had run
when the bucket fired.

Then the same for FSDP2 (``fully_shard`` on each Linear and on the root, AdamW, one intra-op
thread per process): FSDP2 reduce-scatters a module's gradients (its ``foreach_reduce``) when the
module's backward is done. Each reduce-scatter's hand-over is logged among the launches or aten
ops; the aten ops FSDP2's own hooks run in the backward (unsharding, the reduce-scatter's copy-in,
the root's final callback) are not counted as backward work. FSDP2's first step initializes it
lazily, so the compiled function records twice: the step measured is the 6th, a replay.

Both parts also time the step with a delay injected into each all-reduce (DDP: a communication
hook) or reduce-scatter (FSDP2: ``FSDPModule.set_custom_reduce_scatter``), completed off the
backward's thread as a slow link would be: the backward goes on while it is pending. DDP's step is
timed two more ways beside those: compiled with ``skip_python=True`` (replays make the recorded calls
and DDP's own pre- and post-forward, not the step's Python) and eager's step run under a
``TorchFunctionMode`` that only passes each call through (what seeing the step's Python costs, which
the default replay pays: its floor). FSDP2 on
CPU waits for no reduce-scatter (its stream events do nothing there), so the pending ones are
waited for after its final backward callback, before the optimizer reads the gradients.

    PYTHONPATH=$PWD python benchmarks/ddp_overlap.py [--layers 6] [--width 128] [--bucket-mb 0.1] [--only ddp|fsdp2]

Instrumentation only: it logs the runtime's launches through a ``runtime.program.StepRunner``, and
for FSDP2 wraps, while it measures, FSDP2's ``foreach_reduce`` and backward hooks (module and
class attributes of torch.distributed.fsdp._fully_shard; torch's files are not edited).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import tempfile
import threading
import time

import compiler  # noqa: F401  (first: on CPU it puts Triton in interpreter mode before torch imports it)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
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


class _PassThrough(TorchFunctionMode):
    """Each torch call made as it is: what watching a step's Python costs by itself. Our default
    replay sees every call of the step's Python through such a mode (it checks that Python makes the
    recorded calls), so eager's step run under it is the floor of that replay's host work."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
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


class _SlowLink:
    """Collectives that complete ``delay_s`` after they were begun (or when gloo's work is, if later),
    each on its own clock as on the benchmark's model of a slow link, finished by one thread that
    lives as long as the link. NOTE: a thread started per collective put its start on the backward's
    thread: ``Thread.start`` waits until the new thread runs, 2-4 ms a step on this 2-core machine
    (py-spy, both modes), and as noisy as the machine's scheduling."""

    def __init__(self, delay_s):
        self.delay_s = delay_s
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._finish, daemon=True).start()

    def begin(self, work, then=None) -> threading.Event:
        """``work`` (an async collective's) done ``delay_s`` from now, then ``then()``: the event set then."""
        done = threading.Event()
        self.queue.put((time.perf_counter() + self.delay_s, work, then, done))
        return done

    def _finish(self):
        while True:   # (begun in order, each due ``delay_s`` after it: due in the order they come)
            due, work, then, done = self.queue.get()
            time.sleep(max(due - time.perf_counter(), 0.0))
            work.wait()
            if then is not None:
                then()
            done.set()


def _delayed_allreduce(delay_s):
    """A comm hook whose all-reduce completes ``delay_s`` late, off the backward's thread: a slow link.
    The backward goes on meanwhile; DDP waits for every bucket's future at the backward's end."""
    link = _SlowLink(delay_s)

    def hook(state, bucket):
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        future = torch.futures.Future()
        link.begin(work, lambda: future.set_result(bucket.buffer().div_(dist.get_world_size())))
        return future
    return hook


def _marked_step(model, opt, marks, mode, rank, width):
    """(the training step, ``mode``: "compiled", "eager", "watched" (eager's under ``_PassThrough``) or
    "skip_python" (compiled with ``skip_python=True``: its Python, and so its marks, not run on replays;
    timed with the delay only, where the marks are not read),
    noting in ``marks`` when its backward begins and returns; the 4 batches the timed steps cycle through)."""
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        return loss
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, width, generator=generator), torch.randn(32, 4, generator=generator))
               for _ in range(4)]
    if mode in ("compiled", "skip_python"):   # (skip_python: only its recording makes the marks; unused there)
        return compiler.compile(step, skip_python=mode == "skip_python"), batches
    if mode == "watched":
        def watched(x, y):
            with _PassThrough():
                return step(x, y)
        return watched, batches
    return step, batches


def _median_fractions(fractions) -> list:
    """Per hand-over, the median over the timed steps of its fraction of the backward's wall time."""
    return [sorted(f[k] for f in fractions)[len(fractions) // 2] for k in range(len(fractions[0]))]


def _timed(rank, args) -> dict:
    """Per mode ("compiled", "eager"): (per bucket, the median fraction of the backward's wall time elapsed
    when it was handed over, no delay; the median step time with ``args.delay_ms`` injected per bucket);
    "watched" (eager's step under ``_PassThrough``) and "skip_python": (None, the median step time with the delay).
    The modes' steps alternate, each first in turn, each on a DDP model of its own: all see the same
    machine, whatever else it runs meanwhile (two timings one after the other differed by up to 20%
    between runs of this script)."""
    fractions = {"compiled": [], "eager": []}
    times = {"compiled": [], "eager": [], "watched": [], "skip_python": []}
    for delay in (0.0, args.delay_ms / 1000):
        steps = {}
        modes = tuple(times) if delay else tuple(fractions)
        for mode in modes:
            model = DDP(_model(args.layers, args.width), bucket_cap_mb=args.bucket_mb)
            marks: list = []
            model.register_comm_hook(dist.group.WORLD, _marking(marks, _delayed_allreduce(delay)))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            fn, batches = _marked_step(model, opt, marks, mode, rank, args.width)
            steps[mode] = (fn, batches, marks)
        for i in range(STEPS + args.timed_steps):
            turn = i % len(modes)
            for mode in modes[turn:] + modes[:turn]:   # (each first in turn)
                fn, batches, marks = steps[mode]
                marks.clear()
                start = time.perf_counter()
                fn(*batches[i % 4])
                elapsed = time.perf_counter() - start
                if i < STEPS:
                    continue
                if delay:
                    times[mode].append(elapsed)
                else:   # (the backward begins at marks[0], returns at marks[-1])
                    span = marks[-1] - marks[0]
                    fractions[mode].append([(m - marks[0]) / span for m in marks[1:-1]])
    return {mode: (_median_fractions(fractions[mode]) if mode in fractions else None,
                   sorted(times[mode])[len(times[mode]) // 2]) for mode in times}


def _marking(marks, hook):
    """``hook``, noting in ``marks`` when each bucket is handed to it."""
    def marked(state, bucket):
        marks.append(time.perf_counter())
        return hook(state, bucket)
    return marked


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
        if kind not in ("grad", "bucket", "reduce-scatter"):
            continue
        if run:
            marks.append(f"Kx{run}")
            run = 0
        marks.append("g" if kind == "grad" else f"B{what}" if kind == "bucket" else f"R{what}")
    if run:
        marks.append(f"Kx{run}")
    return " ".join(marks)


def _ops(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


# -- FSDP2 --------------------------------------------------------------------------------------

FSDP_STEPS = 6   # FSDP2 initializes its state lazily in its first step: the compiled function records twice


def _fsdp2_model(layers, width):
    """The same MLP, ``fully_shard`` on each Linear layer and on the root (which then holds no parameter
    of its own): one reduce-scatter per Linear in each backward."""
    from torch.distributed.fsdp import fully_shard

    model = _model(layers, width)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


@contextlib.contextmanager
def _fsdp2_logged(log):
    """Within: each reduce-scatter FSDP2 begins (its ``foreach_reduce``, once per FSDP module in the
    backward) is logged as ("reduce-scatter", number of parameters), and FSDP2's own hooks in the
    backward (unsharding before a module's backward, the reduce-scatter's copy-in and its sharded
    gradients after, the root's final callback) are bracketed by ("fsdp", "enter"/"exit"): the aten ops
    and launches between are FSDP2's bookkeeping, not the backward's work."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    def bracketed(f):
        def wrapper(*args, **kwargs):
            log.append(("fsdp", "enter"))
            try:
                return f(*args, **kwargs)
            finally:
                log.append(("fsdp", "exit"))
        return wrapper

    def reduce(*args, **kwargs):
        log.append(("reduce-scatter", len(args[0])))
        return saved[0][2](*args, **kwargs)
    saved = [(_fsdp_param_group, "foreach_reduce", _fsdp_param_group.foreach_reduce, reduce)]
    for owner, name in ((_fsdp_state.FSDPState, "_pre_backward"), (_fsdp_param_group.FSDPParamGroup, "post_backward"),
                        (_fsdp_state.FSDPState, "_root_post_backward_final_callback")):
        saved.append((owner, name, getattr(owner, name), bracketed(getattr(owner, name))))
    for owner, name, _, wrapper in saved:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original, _ in saved:
            setattr(owner, name, original)


def _fsdp2_step(model, opt, log):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        log.append(("backward", "begins"))
        loss.backward()
        log.append(("backward", "returned"))
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _fsdp2_run(rank, compiled, args, log):
    """FSDP_STEPS steps of AdamW on the sharded MLP, logged: (the last step's log; the compiled function's
    report and a line of its stats, or None, None)."""
    model = _fsdp2_model(args.layers, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _fsdp2_step(model, opt, log)
    fn = compiler.compile(step) if compiled else step
    generator = torch.Generator().manual_seed(rank)
    with _fsdp2_logged(log):
        for _ in range(FSDP_STEPS):
            log.clear()
            before = dict(fn.stats) if compiled else None
            x, y = torch.randn(32, args.width, generator=generator), torch.randn(32, 4, generator=generator)
            if compiled:
                fn(x, y)
            else:
                with _AtenLog(log):
                    fn(x, y)
    if not compiled:
        return list(log), None, None
    stats = dict(fn.stats)
    # (the last step replayed whole: one more replay, no divergence, and the fused optimizer step launched)
    whole = (stats["replays"] - before["replays"], stats["divergences"] - before["divergences"],
             stats.get("optimizer_launches", 0) - before.get("optimizer_launches", 0)) == (1, 0, 1)
    return list(log), fn.last_entry.report, f"calls {stats['calls']}, recordings {stats['captures']}, replays " \
        f"{stats['replays']} ({stats['divergences']} left the recording), the measured step replayed whole: {whole}"


def _fsdp2_summary(log, report):
    """Lines: for each reduce-scatter, the backward work done before it was handed over; and its
    fractions of the work before the last one."""
    start = next(i for i, e in enumerate(log) if e == ("backward", "begins"))
    end = next(i for i, e in enumerate(log) if e == ("backward", "returned"))
    work, theirs, depth = [], 0, 0
    for i in range(start, end):
        kind, what = log[i]
        if kind == "fsdp":
            depth += 1 if what == "enter" else -1
        elif kind in ("kernel", "op"):
            if depth:
                theirs += 1
            else:
                work.append(i)
    if report is not None:
        unit = "backward launches"
        kernels = [log[i][1] for i in work]
        backward = {k.name for k in report.backward_kernels}
        detail = f"{sum(k in backward for k in kernels)} fused kernels + {kernels.count('extern')} extern calls"
    else:
        unit, detail = "backward aten ops", "eager"
    lines = [f"backward: {len(work)} {unit} ({detail}; not counted: {theirs} run by FSDP2's own hooks)"]
    handed = [i for i in range(start, end) if log[i][0] == "reduce-scatter"]
    computing = sum(1 for j in work if j < handed[-1])
    fractions = []
    for i in handed:
        done = sum(1 for j in work if j < i)
        fractions.append(done / computing)
        lines.append(f"  reduce-scatter of {log[i][1]} parameters handed over after {done}/{len(work)} {unit} "
                     f"({done}/{computing} = {done / computing:.2f} of the work before the last reduce-scatter)")
    lines.append("  timeline (K: backward work, N of them in a row as Kxn; R<n>: a reduce-scatter of n parameters "
                 "handed over):")
    lines.append("    " + _timeline(log, set(work), start, end))
    return lines, fractions


class _DelayedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) begun without waiting, as a
    slow link's: it counts as done ``delay_s`` after it was begun (or when gloo's work is, if later),
    finished by the link's thread (``_SlowLink``), and the backward goes on meanwhile. FSDP2 on CPU waits for no
    reduce-scatter (its stream events are no-ops there) and takes the sharded gradients as views of
    the output at once, reading none of them (float32, gradients set to None by zero_grad), so
    ``wait`` is called at the root's final backward callback, before the optimizer reads them."""

    def __init__(self, delay_s, marks):
        self.link, self.marks, self.pending, self.waited = _SlowLink(delay_s), marks, [], []

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.marks.append(time.perf_counter())
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        self.pending.append(self.link.begin(work))
        return None

    def wait(self):
        start = time.perf_counter()
        for done in self.pending:
            done.wait()
        self.pending.clear()
        self.waited.append(time.perf_counter() - start)


def _then(callback, wait):
    """FSDP2's final backward callback, then ``wait``: FSDP2 queues its state's bound method, so the
    instance's attribute is the one queued. (The callback may reduce-scatter: the first layer's, whose
    input needs no gradient, so no autograd Node of the backward runs its post-backward.)"""
    def finish():
        callback()
        wait()
    return finish


def _fsdp2_delayed(args, delay_s, marks):
    """The sharded MLP and AdamW, each reduce-scatter ``_DelayedReduceScatter``'s."""
    model = _fsdp2_model(args.layers, args.width)
    comm = _DelayedReduceScatter(delay_s, marks)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.set_custom_reduce_scatter(comm)
    for module in model.modules():
        if isinstance(module, FSDPModule):   # (the first module whose backward begins queues its own state's)
            state = module._get_fsdp_state()
            state._root_post_backward_final_callback = _then(state._root_post_backward_final_callback, comm.wait)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), comm


def _fsdp2_timed(rank, compiled, args):
    """(per reduce-scatter: the fraction of the backward's wall time elapsed when it was handed over,
    no delay; the median step time with no delay and with ``args.delay_ms`` per reduce-scatter; the
    median time the backward's end waited for reduce-scatters in flight, with the delay; whether the
    delay left every loss as it was)."""
    fractions, times, waits, losses = [], [], None, []
    for delay in (0.0, args.delay_ms / 1000):
        marks: list = []
        model, opt, comm = _fsdp2_delayed(args, delay, marks)
        fn, batches = _marked_step(model, opt, marks, "compiled" if compiled else "eager", rank, args.width)
        step_times, losses_now = [], []
        for i in range(FSDP_STEPS + args.timed_steps):
            marks.clear()
            start = time.perf_counter()
            losses_now.append(fn(*batches[i % 4]).item())
            step_times.append(time.perf_counter() - start)
            if delay == 0 and i >= FSDP_STEPS:   # (marks: backward begins, each hand-over, backward returned)
                span = marks[-1] - marks[0]
                fractions.append([(m - marks[0]) / span for m in marks[1:-1]])
        times.append(sorted(step_times[FSDP_STEPS:])[args.timed_steps // 2])
        waits = sorted(comm.waited[FSDP_STEPS:])[args.timed_steps // 2]
        losses.append(losses_now)
    return _median_fractions(fractions), times, waits, losses[0] == losses[1]


def _kernels_line(report) -> str:
    return (f"forward kernels {len(report.forward_kernels)}, backward kernels {len(report.backward_kernels)}, "
            f"regions with a backward {report.backward_segments} "
            f"(regions' captured ops: {[_ops(r['captured']) for r in report.regions]}), "
            f"fallbacks {report.fallbacks or 'none'}")


def _ddp_results(rank, args, results):
    log: list = []
    for compiled in (True, False):
        with steps_run_by(_LaunchLog(log)):
            events, report = _run(rank, compiled, args, log)
        results["compiled" if compiled else "eager"] = _summary(events, report)
        if compiled:
            results["kernels"] = _kernels_line(report)
    timed = _timed(rank, args)
    for mode, timing in timed.items():
        results[f"timed {mode}"] = timing


def _fsdp2_results(rank, args, results):
    log: list = []
    for compiled in (True, False):
        with steps_run_by(_LaunchLog(log)):
            events, report, stats = _fsdp2_run(rank, compiled, args, log)
        results["fsdp2 compiled" if compiled else "fsdp2 eager"] = _fsdp2_summary(events, report)
        if compiled:
            results["fsdp2 kernels"] = f"{_kernels_line(report)}; {stats}"
    for compiled in (True, False):
        results["fsdp2 timed compiled" if compiled else "fsdp2 timed eager"] = _fsdp2_timed(rank, compiled, args)


def worker(rank, world, init_file, args, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # One intra-op thread per process: two processes of two threads each on two cores made eager's FSDP2
    # step about 1 s, 70 ms with one, and the DDP step swing from 34 to 940 ms (likely OpenMP's threads
    # of the two processes spinning against each other at each collective)
    torch.set_num_threads(1)
    try:
        results = {}
        if args.only != "fsdp2":
            _ddp_results(rank, args, results)
        if args.only != "ddp":
            _fsdp2_results(rank, args, results)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _print_ddp(results, args):
    params = (args.width + 1) * args.width * args.layers + (args.width + 1) * 4
    print(f"DDP, 2 gloo processes (1 intra-op thread each), MLP of {args.layers} Linear({args.width}, {args.width}) "
          f"+ GELU and a head ({params} parameters in {2 * args.layers + 2} tensors), bucket_cap_mb={args.bucket_mb}; "
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
    skipping_ms, watched_ms = results["timed skip_python"][1], results["timed watched"][1]
    print(f"  compiled with skip_python=True (replays make the recorded calls and DDP's own pre- and post-forward, "
          f"not the step's Python): {skipping_ms * 1e3:.1f} ms (skip_python/eager {skipping_ms / eager_ms:.2f})")
    print(f"  eager's step under a TorchFunctionMode that only passes each torch call through (what seeing the "
          f"step's Python costs, as the default replay does): {watched_ms * 1e3:.1f} ms "
          f"(watched/eager {watched_ms / eager_ms:.2f}; compiled/watched {ours_ms / watched_ms:.2f})")


def _print_fsdp2(results, args):
    print(f"FSDP2, 2 gloo processes (1 intra-op thread each), the same MLP with fully_shard on each Linear and on "
          f"the root, AdamW; step {FSDP_STEPS} of {FSDP_STEPS}, rank 0")
    print(results["fsdp2 kernels"])
    for mode in ("compiled", "eager"):
        print(f"{mode}:")
        for line in results[f"fsdp2 {mode}"][0]:
            print("  " + line)
    ratios = [f"{o / e:.2f}" if e else "-" for o, e in zip(results["fsdp2 compiled"][1], results["fsdp2 eager"][1])]
    print("each reduce-scatter's hand-over point, compiled/eager (as fractions of the work before the last "
          f"reduce-scatter): {', '.join(ratios)}")
    (ours, ours_t, ours_wait, ours_same), (eager, eager_t, eager_wait, eager_same) = \
        results["fsdp2 timed compiled"], results["fsdp2 timed eager"]
    print(f"wall time, median of {args.timed_steps} steps (rank 0): fraction of the backward elapsed when each "
          "reduce-scatter was handed over, no delay injected")
    for r, (o, e) in enumerate(zip(ours, eager)):
        print(f"  reduce-scatter {r}: compiled {o:.2f}, eager {e:.2f} (compiled/eager {o / e:.2f})")
    print(f"step time, no delay: compiled {ours_t[0] * 1e3:.1f} ms, eager {eager_t[0] * 1e3:.1f} ms "
          f"(compiled/eager {ours_t[0] / eager_t[0]:.2f})")
    print(f"step time with {args.delay_ms:g} ms injected per reduce-scatter (asynchronous: begun without waiting, "
          f"finished by the link's thread; waited for at the backward's end): compiled {ours_t[1] * 1e3:.1f} ms, "
          f"eager {eager_t[1] * 1e3:.1f} ms (compiled/eager {ours_t[1] / eager_t[1]:.2f})")
    print(f"  of which the backward's end waited for reduce-scatters in flight: compiled {ours_wait * 1e3:.1f} ms, "
          f"eager {eager_wait * 1e3:.1f} ms; losses unchanged by the delay: compiled {ours_same}, eager {eager_same}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=0.1)
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="injected per bucket's all-reduce (DDP) and per reduce-scatter (FSDP2)")
    parser.add_argument("--timed-steps", type=int, default=30)
    parser.add_argument("--only", choices=("ddp", "fsdp2"), help="measure one of the two (default: both)")
    args = parser.parse_args()
    # Each run records its steps afresh (the workers inherit this): a recording stored by an earlier run
    # would replay DDP's first step at once, and DDP builds its buckets from the order the gradients
    # arrived in that step, which then differs (buckets of 6, 3 and 5 parameters, eager's 6, 4 and 4).
    os.environ.setdefault("SYMGRAD_STORED_RECORDINGS", "0")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.start_processes(worker, args=(2, os.path.join(tmp, "init"), args, out), nprocs=2, start_method="spawn")
        results = torch.load(out)
    if args.only != "fsdp2":
        _print_ddp(results, args)
    if args.only != "ddp":
        if args.only != "fsdp2":
            print()
        _print_fsdp2(results, args)


if __name__ == "__main__":
    main()
