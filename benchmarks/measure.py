"""Measurements: step times, correctness against the reference, kernels per step, peak memory,
copy bandwidth, and our per-call host overhead.

Times on CUDA come from CUDA events around each step (the GPU's own clock, after warm-up),
plus a wall-clock time per step over a synchronized round; on CPU from ``perf_counter``.
Backends are timed in interleaved rounds (eager, compiled, eager, ...) so that clock and
thermal drift hit them alike and their ratios stay fair.

>>> t = interleaved({"a": lambda: sum(range(100))}, torch.device("cpu"), rounds=2)
>>> t["a"].iterations > 0
True
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from runtime.program import StepRunner, installed_runner, reused_memory, steps_run_by


# -- step times --------------------------------------------------------------------------------
@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    wall_ms: float          # per step, from a round of steps timed end to end (synchronized on CUDA)
    iterations: int
    method: str             # "cuda events" | "wall clock" | an interpreter label


def _quantile(values, q):
    values = sorted(values)
    pos = (len(values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round(step, device, iterations):
    """Time ``iterations`` steps: per-step times (ms) and the round's wall time per step (ms)."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iterations)]
    sync(device)
    start_wall = time.perf_counter()
    if device.type == "cuda":
        for begin, end in events:
            begin.record()
            step()
            end.record()
        sync(device)
        per_step = [begin.elapsed_time(end) for begin, end in events]
    else:
        per_step = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            step()
            per_step.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    wall = (time.perf_counter() - start_wall) * 1e3 / iterations
    return per_step, wall


def interleaved(steps: dict, device, rounds=5, round_s=0.05, max_iterations=200) -> dict:
    """Time each of ``steps`` (name -> zero-argument callable, already warm) in interleaved
    rounds; each round runs about ``round_s`` seconds of every step (one step first, not
    counted, sizes the rounds)."""
    per_round = {}
    for name, step in steps.items():
        _, wall = _round(step, device, 1)
        per_round[name] = max(1, min(max_iterations, int(round_s * 1e3 / max(wall, 1e-3))))
    samples = {name: [] for name in steps}
    walls = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            per_step, wall = _round(step, device, per_round[name])
            samples[name].extend(per_step)
            walls[name].append(wall)
    method = "cuda events" if device.type == "cuda" else "wall clock"
    return {name: _timing(samples[name], walls[name], method) for name in steps}


def few(step, device, iterations, method) -> Timing:
    """A handful of steps, for a backend too slow to time properly (our interpreter on CPU)."""
    per_step, wall = _round(step, device, iterations)
    return _timing(per_step, [wall], method)


def _timing(samples, walls, method):
    return Timing(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8),
                  statistics.median(walls), len(samples), method)


# -- correctness ----------------------------------------------------------------------------------
def max_error(outputs, reference) -> float:
    """The largest error of any output, relative to the scale of its reference tensor
    (max |out - ref| / max |ref|): a float32 result of a float64 computation should be near
    float32's epsilon whatever its magnitude. NaN or inf where the reference has none is inf."""
    if len(outputs) != len(reference):
        return float("inf")
    worst = 0.0
    for out, ref in zip(outputs, reference):
        if out is None or ref is None:
            if out is not ref:
                return float("inf")
            continue
        if out.shape != ref.shape:
            return float("inf")
        out = out.detach().to(ref.dtype)
        ref = ref.detach()
        finite = torch.isfinite(ref)
        if not torch.equal(torch.isfinite(out), finite):
            return float("inf")
        if not ref.is_complex() and not torch.equal(_inf_signs(out[~finite]), _inf_signs(ref[~finite])):
            return float("inf")  # +inf where the reference has -inf, or inf where it has NaN
        if not finite.any():
            continue
        scale = ref[finite].abs().max().item()
        err = (out[finite] - ref[finite]).abs().max().item()
        worst = max(worst, err / scale if scale > 0 else err)
    return worst


def _inf_signs(t):
    return torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0)


# -- kernels per step ----------------------------------------------------------------------------
# On CPU a "kernel" is an outermost compute operator, as a GPU would launch it: views,
# allocations and metadata calls move no data, and the ops a composite operator calls
# internally (linear -> addmm -> copy_) are part of its one launch.
_NOT_KERNELS = {
    "aten::as_strided", "aten::resolve_conj", "aten::resolve_neg", "aten::t", "aten::transpose",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::expand",
    "aten::permute", "aten::mT", "aten::mH", "aten::adjoint",
    "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::detach_", "aten::alias",
    "aten::slice", "aten::select", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::narrow",
    "aten::chunk", "aten::broadcast_tensors", "aten::expand_as", "aten::view_as", "aten::flatten",
    "aten::view_as_real", "aten::view_as_complex", "aten::_conj", "aten::conj", "aten::real", "aten::imag",
    "aten::_neg_view", "aten::contiguous", "aten::to", "aten::type_as", "aten::requires_grad_",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::empty_permuted", "aten::resize_", "aten::set_", "aten::lift_fresh", "aten::result_type",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::size", "aten::stride",
    "aten::numel", "aten::dim", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type",
}


def _is_cpu_kernel(name: str) -> bool:
    # Inductor's C++ kernels are C functions named ``kernel`` in their compiled modules: the
    # profiler's Python tracer (``with_stack=True``) sees their calls.
    if name == "<built-in function kernel>" or "cpp_fused" in name:
        return True
    return name.startswith("aten::") and name not in _NOT_KERNELS


def count_kernels(step, device, python_calls=False) -> int:
    """Kernels one call of ``step`` launches, from ``torch.profiler``: on CUDA every GPU
    activity (kernels, memcpy, memset); on CPU outermost compute operators, and with
    ``python_calls`` (for torch.compile) Inductor's C++ kernels, seen by the Python tracer."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    # NOTE: not for ours: the Python tracer reads Tensor.grad of module parameters inside the
    # call, which our replay sees as a call the recording lacks (it then runs eagerly).
    with _quiet_stderr(), profile(activities=activities, with_stack=python_calls and device.type == "cpu") as prof:
        step()
        sync(device)
    events = list(prof.events())
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if _is_cpu_kernel(e.name) and not _inside_kernel(e))


def _inside_kernel(event) -> bool:
    return inside(event, lambda parent: _is_cpu_kernel(parent.name))


def inside(event, is_enclosing) -> bool:
    """Whether a profiler event runs inside one for which ``is_enclosing(parent)`` holds."""
    parent = event.cpu_parent
    while parent is not None:
        if is_enclosing(parent):
            return True
        parent = parent.cpu_parent
    return False


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto, the profiler's C++ side, prints a line to the process's stderr each time it
    starts and stops; they would break the progress bar. Silence file descriptor 2 meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# -- memory and bandwidth -------------------------------------------------------------------------
@dataclass
class Memory:
    peak: int           # bytes: the highest allocated during the step, above what was allocated before it
    saved: int          # bytes allocated when backward starts, above the step's start: what the graph keeps
    leaked: int         # bytes still allocated after the step, above its start (outputs the caller keeps too)


_LAUNCH = "symgrad::interpreted_launch"
_BACKWARD = "autograd::engine::evaluate_function"


def step_memory(step, device) -> Memory | None:
    """Peak and saved-for-backward bytes of one step, from ``torch.profiler``'s allocation
    records (``profile_memory=True``): every allocation and free in order, summed, the
    running maximum is the peak; the sum when autograd's engine runs its first node is what
    the forward left for backward (saved tensors, and anything else its graph holds: tensors
    kept on a ``ctx`` outside ``save_for_backward`` too). On CUDA the peak is
    ``max_memory_allocated``'s (the allocator's own count), the rest from the CUDA records.

    NOTE: where ours runs its kernels in Triton's interpreter (on CPU with
    ``SYMGRAD_CPU_BACKEND=interpret``), the interpreter copies arguments and makes NumPy
    temporaries that a GPU kernel never allocates: allocations made inside a
    launch (after the launch allocated its outputs) are left out, and the reference cycle it
    leaves holding the arguments is collected after each launch, so the numbers are the
    program's own (what a GPU run of the same program allocates).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # NOTE: garbage of earlier steps (reference cycles) freed by a collection during this step
    # would lower its running total and hide part of its peak: collected before it starts.
    gc.collect()
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with _quiet_stderr(), _launches_marked(), profile(activities=activities, profile_memory=True) as prof:
        step()
        sync(device)
    events = list(prof.profiler.kineto_results.events())
    launches = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == _LAUNCH]
    backward = min((e.start_ns() for e in events if e.name().startswith(_BACKWARD)), default=None)
    total = peak = 0
    saved = None
    mine = set()  # blocks this step allocated (outside launches): only their frees count
    for t, ptr, nbytes in _allocations(prof, device.type):
        if saved is None and backward is not None and t >= backward:
            saved = total
        if nbytes > 0:
            if any(lo <= t <= hi for lo, hi in launches):
                continue
            mine.add(ptr)
        elif ptr in mine:
            # NOTE: a free of a block allocated before the step (an earlier step's gradients,
            # outputs the harness let go) is left out: it is not this step's memory, and the
            # CPU allocator reports such frees only for blocks allocated while an earlier
            # profiler ran, which made the totals depend on what ran before (a negative
            # saved-for-backward figure).
            mine.discard(ptr)
        else:
            continue
        total += nbytes
        peak = max(peak, total)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - before
    return Memory(peak, saved or 0, total)


def _allocations(prof, device_type: str) -> list:
    """(time ns, address, bytes: negative for a free) of the profiled allocations on
    ``device_type``, in time order (the profiler's event tree: its records carry the address)."""
    allocation = torch._C._profiler._EventType.Allocation
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == allocation and e.extra_fields.device.type == device_type:
            out.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
    out.sort(key=lambda r: r[0])
    return out


@contextlib.contextmanager
def _launches_marked():
    """Each of our Triton launches inside a profiler range (see ``step_memory``): the kernel call
    itself, after its outputs were allocated."""
    with steps_run_by(_MarkedLaunches(installed_runner())):
        yield


class _MarkedLaunches(StepRunner):
    """Kernel calls (and the optimizer's combo kernels) inside ``_LAUNCH`` ranges."""

    def kernel(self, step, env, device, torch_path, fresh_loads):
        if torch_path or self.inner is not None:  # (PyTorch's ops, or another runner's: as they run)
            super().kernel(step, env, device, torch_path, fresh_loads)
            return
        args, key, wide = step.arguments(env, device)  # the outputs, allocated outside the range
        with torch.profiler.record_function(_LAUNCH):
            step.launch_arguments(args, key, wide, device)
        _collect_interpreter_cycle()

    def combo(self, launch, tensors, scalars, device):
        # (a combo kernel's launch is the kernel call: it updates in place, allocating nothing)
        with torch.profiler.record_function(_LAUNCH):
            super().combo(launch, tensors, scalars, device)
        _collect_interpreter_cycle()


def _collect_interpreter_cycle():
    # NOTE: the interpreter's argument copier is a recursive closure (a reference cycle,
    # triton/runtime/interpreter.py ``_init_args_hst``) that holds every argument's storage
    # until the garbage collector runs: collect it now, as a GPU launch holds none.
    gc.collect(0)


def copy_bandwidth(device, nbytes=1 << 30) -> float | None:
    """The machine's device-to-device copy bandwidth in GB/s (read + write), the ceiling that
    memory-bound kernels are compared against (CUDA only)."""
    if device.type != "cuda":
        return None
    ms = _copy_ms(device, nbytes)
    torch.cuda.empty_cache()  # the buffers are gone: give their memory back to the workloads
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _copy_ms(device, nbytes):
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return interleaved({"copy": lambda: dst.copy_(src)}, device, rounds=5)["copy"].median_ms


# -- our host overhead ----------------------------------------------------------------------------
@contextlib.contextmanager
def kernels_stubbed():
    """Our runtime with each Triton launch replaced by the allocation of its outputs.

    What is left of a call is its host-side work — guards, replay, autograd bridge,
    allocations — plus matmuls and eager ops: on CPU, where our Triton kernels only run in the
    interpreter, this is how the GPU program's per-call overhead and non-Triton work are measured.
    Results are garbage: use throwaway arguments. Installed with ``runtime.program.steps_run_by``.

    Denormal floats are flushed to zero meanwhile (``torch.set_flush_denormal``): the outputs
    are uninitialized memory, and the matmuls and convolutions that read them ran up to 1.5x
    slower on the denormals in it (the CNN step's ``convolution_backward``: 143 µs a call in our
    stubbed step, 96-97 µs on real values, in eager's step and ours alike with the flag), which
    real kernels' values would not have made. Eager, timed in the same context, has no denormals
    to flush. Set back to PyTorch's default (off) at the end.
    """
    torch.set_flush_denormal(True)
    try:
        with steps_run_by(_Stubbed(installed_runner())):
            yield
    finally:
        torch.set_flush_denormal(False)


class _Stubbed(StepRunner):
    """Each kernel launch replaced by the allocation of its outputs; combo kernels (the optimizer's
    steps, clips: in place) by nothing."""

    def __init__(self, inner=None):
        super().__init__(inner)
        # Integer and bool outputs are zeros: an index a skipped kernel computed (cross entropy's
        # target with ignore_index masked) is checked and gathered with later, and uninitialized
        # memory there fails the index check (issue 13). Made once and handed out again: a zero
        # fill per step would be counted as one more kernel.
        self.zeros: dict = {}

    def kernel(self, step, env, device, torch_path, fresh_loads):
        donors = dict(step.reuse)
        for k, (slot, shape, dtype) in enumerate(step.stores):
            out = reused_memory(env[donors[k]], shape, dtype) if k in donors else None
            if out is not None:  # where the launch writes into a buffer's memory (as ``arguments`` does)
                env[slot] = out
            elif dtype.is_floating_point or dtype.is_complex:
                env[slot] = torch.empty(shape, dtype=dtype, device=device)
            else:
                key = (tuple(shape), dtype, device)
                if key not in self.zeros:
                    self.zeros[key] = torch.zeros(shape, dtype=dtype, device=device)
                env[slot] = self.zeros[key]

    def combo(self, launch, tensors, scalars, device):
        pass
