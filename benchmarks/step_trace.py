"""One step of a workload, traced on CPU: eager's operators, and our kernel launches and the
operators that run between them — each with its shapes, and none of our kernels run.

``trace_workload`` builds a workload, then:

1. runs one eager step, logging every aten operator that would launch a GPU kernel (a
   ``TorchDispatchMode``, which sees the operators autograd, autocast and PyTorch's
   decompositions dispatch — what a GPU would run — with their real tensors);
2. records our compiled step (``compiler.explain``: one eager run, then the program is built);
3. replays our step with each Triton launch replaced by the allocation of its outputs, keeping
   what the launch passes (tensor offsets, strides, tile sizes: what Triton specializes on), and
   logging the operators that run between our kernels (matmuls, eager calls, index checks).

Every operator and launch is tagged with the phase it ran in: ``forward`` until
``torch.autograd.backward`` is called, ``backward`` while it runs, ``update`` after it (a
training step's optimizer). Matmuls and convolutions are not computed (their outputs are
allocated with the right shape and strides, from a meta-tensor run): only shapes matter here,
and this CPU has no fast bfloat16 matmul.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import compiler
from benchmarks.roofline import (FA2_LAUNCHES, FLASH_OPS, LAUNCH_US, distinct_bytes, flash_op_cost, flash_rate,
                                 flash_us, launches_kernel, op_kernels, predicted_us, storage_key)
from benchmarks.measure import step_memory
from benchmarks.sm90 import Launch, recorded_launches
from benchmarks.workloads import WORKLOADS

PHASES = ("forward", "backward", "update")
_NOT_COMPUTED = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "convolution_backward", *FLASH_OPS}


@dataclass
class Op:
    """An operator modelled by its bytes and FLOPs (eager's, or one between our kernels)."""
    phase: str
    name: str
    bytes: int
    flops: float
    dtype: object
    rate: float | None = None   # FLOP/s of a flash-attention kernel (``roofline.flash_rate``)
    launches: int = 1

    @property
    def predicted_us(self) -> float:
        if self.rate is not None:
            return flash_us(self.flops, self.rate, self.bytes, self.launches)
        return predicted_us(self.bytes, self.flops, self.dtype) + (self.launches - 1) * LAUNCH_US


@dataclass
class OurLaunch:
    phase: str
    launch: Launch
    bytes: int            # the kernel's bytes moved (KernelSource.bytes_moved)
    flops: float = 0.0    # a flash-attention kernel's matmul FLOPs, priced at ``rate`` FLOP/s
    rate: float | None = None

    @property
    def predicted_us(self) -> float:
        if self.rate is not None:
            return flash_us(self.flops, self.rate, self.bytes)
        return predicted_us(self.bytes, 0, None)


@dataclass
class WorkloadTrace:
    workload: str
    dtype: str            # "float32", "bfloat16", or "bfloat16 (autocast)"
    eager_ops: list
    our_ops: list
    launches: list
    min_bytes: dict       # phase -> bytes
    fallbacks: list = field(default_factory=list)
    # bytes: the most allocated during the traced step above its start, eager's and ours (outputs
    # allocated as they would be on a GPU; the kernels' and operators' own workspaces not counted)
    eager_peak: int = 0
    ours_peak: int = 0
    # a step traced from shapes (``trace_meta_step``): StepMemory of each, from the live storages
    eager_memory: object = None
    ours_memory: object = None


class LiveBytes:
    """The bytes of the storages a step allocates that are still alive, as the step runs: each
    operator's fresh output storage (not one of its inputs': views and in-place results are not
    allocations) is counted until a ``weakref.finalize`` on it says it died. Works on meta tensors,
    which allocate nothing: the allocation order and the saved sets are autograd's own."""

    def __init__(self):
        self.live = self.peak = self.largest = 0
        self.marks: dict = {}      # label -> live bytes then (``saved``: when backward starts)

    def add(self, args, out) -> None:
        inputs = {storage_key(t) for t in _tensors_in(args)}
        for t in _tensors_in(out):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs:
                continue
            inputs.add(key)
            size = storage.nbytes()
            self.live += size
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, size)
            weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size


@dataclass
class StepMemory:
    """Bytes at a step's peak and what they are: the resident parameters and optimizer state,
    gradients (all of them, at the step's end), what the forward left for backward (``saved``:
    allocated in the step and alive when backward starts, the loss included), the largest single
    allocation, and the peak (resident + the most allocated in the step at once)."""
    params: int
    grads: int
    optimizer: int
    saved: int
    largest: int
    peak: int


class _Tracer(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.ops: list | None = None   # logging when a list
        self.launches: list = []
        self.memory: LiveBytes | None = None   # counting allocations when set

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        out = _allocated_like_result(func, args, kwargs) if name in _NOT_COMPUTED else func(*args, **kwargs)
        if self.memory is not None:
            self.memory.add((args, kwargs), out)
        if self.ops is not None and name in FLASH_OPS:   # eager's attention: FlashAttention-2 on an H100
            phase, moved, flops, rate = flash_op_cost(func, args, kwargs, out)
            self.ops.append(Op(self.phase, name, moved, flops, None, rate, FA2_LAUNCHES[phase]))
        elif self.ops is not None and launches_kernel(func, args, out):
            for moved, flops, dtype in op_kernels(func, args, kwargs, out):   # an Op per kernel launched
                self.ops.append(Op(self.phase, name, moved, flops, dtype))
        return out


def _allocated_like_result(func, args, kwargs):
    """The operator's outputs (shapes, strides, dtypes from a meta run), uninitialized."""
    device = next(t.device for t in _flat(args) if isinstance(t, torch.Tensor))

    def to_meta(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, (list, tuple)):
            return type(x)(to_meta(i) for i in x)
        return x

    def to_real(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        if isinstance(x, (list, tuple)):
            return type(x)(to_real(i) for i in x)
        return x

    return to_real(func(*to_meta(args), **{k: to_meta(v) for k, v in kwargs.items()}))


def _flat(tree):
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _flat(item)
    else:
        yield tree


@contextlib.contextmanager
def _phases(tracer: _Tracer):
    """Tag what runs inside ``torch.autograd.backward`` as backward, what follows as update."""
    original = torch.autograd.backward

    def backward(*args, **kwargs):
        tracer.phase = "backward"
        if tracer.memory is not None:
            tracer.memory.marks.setdefault("saved", tracer.memory.live)
        try:
            return original(*args, **kwargs)
        finally:
            tracer.phase = "update"

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def trace_workload(name: str, size, dtype: torch.dtype) -> WorkloadTrace:
    """Eager's operators and our launches for one step of workload ``name`` (see the module doc)
    at ``size`` (a size name, or the workload's size keywords: ``{"rows": 64, "cols": 8192}``).
    Training steps in bfloat16 run under ``torch.autocast`` with float32 weights (mixed precision,
    as such steps are trained); forward+backward workloads take bfloat16 tensors."""
    workload, cpu = WORKLOADS[name], torch.device("cpu")
    case = workload.build(size, cpu) if isinstance(size, str) else workload.make(cpu, **size)
    training = name.endswith("_step")   # the training steps: fn(model, opt, *batch)
    autocast = dtype == torch.bfloat16 and training
    args = case.make_args(torch.float32 if autocast else dtype)
    assert training == isinstance(args[0], nn.Module), f"{name}: a training step is named *_step"
    tracer = _Tracer()

    def amp():
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def record(step, launch):
        tracer.launches.append(OurLaunch(tracer.phase, launch, step.bytes_moved))

    def flash(launch, cost):   # our flash-attention kernels: priced as FlashAttention-2's
        if cost.get("kind") == "memory":   # a memory-bound kernel of an extern (``_priced_launch``)
            return tracer.launches.append(_priced_launch(tracer, launch, cost))
        rate = flash_rate(cost["phase"], cost["head_dim"], cost["length"], cost["causal"], cost["dtype"])
        tracer.launches.append(OurLaunch(tracer.phase, launch, cost["bytes"], cost["flops"], rate))

    def combo(launch):   # the fused optimizer step's kernels: priced by their bytes, among the other ops
        if tracer.ops is not None:
            tracer.ops.append(Op(tracer.phase, "fused_optimizer_step", launch.bytes_moved, 0.0, None))

    def traced_step(fn, launches):
        """(the step's result, its peak bytes). NOTE: the second of two steps is traced: the first
        makes what later steps reuse (our replay's stand-in tensors, made once per region)."""
        made = {}
        for ops in (None, []):
            _reset_grads(args, training)
            tracer.phase, tracer.ops, tracer.launches = "forward", ops, []
            recording = recorded_launches(record, on_combo=combo, on_flash=flash) if launches else \
                contextlib.nullcontext()

            def step():
                with amp(), recording:
                    made["out"] = case.step(fn, args)
            memory = step_memory(step, cpu) if ops is not None else step()
        return made["out"], memory.peak

    with tracer, _phases(tracer):
        out, eager_peak = traced_step(case.fn, launches=False)
        eager_ops = tracer.ops
        min_bytes = minimal_bytes(args, out, training)
        del out

        compiled = compiler.compile(case.fn, backend="interpret")
        tracer.ops = None
        with amp():
            report = compiler.explain(compiled, *case.fn_args(args))
        _, ours_peak = traced_step(compiled, launches=True)
        if compiled.stats.get("captures", 1) != 1:
            raise RuntimeError(f"{name}: the traced step recorded again instead of replaying; its launches "
                               "would not be the compiled program's")
    label = "bfloat16 (autocast)" if autocast else str(dtype).replace("torch.", "")
    return WorkloadTrace(name, label, eager_ops, tracer.ops, tracer.launches, min_bytes, list(report.fallbacks),
                         eager_peak, ours_peak)


def _reset_grads(args, training):
    if training:
        args[0].zero_grad(set_to_none=True)
    else:
        for t in args[:-1]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None


def minimal_bytes(args, out, training: bool) -> dict:
    """Per phase, the bytes no implementation can avoid: each input of the phase read once and
    each output written once. Forward reads every input (batch, weights, buffers) and writes the
    result; backward reads them and grad_out and writes each gradient; a training step's update
    reads weights and gradients and writes the weights."""
    def total(tensors):
        return sum(distinct_bytes(t) for t in tensors if isinstance(t, torch.Tensor))

    result = out if isinstance(out, torch.Tensor) else torch.as_tensor(0.0)
    if training:
        model, _opt, *batch = args
        params = list(model.parameters())
        inputs = params + list(model.buffers()) + list(batch)
        return {"forward": total(inputs) + total([result]),
                "backward": total(inputs) + total(params),
                "update": 3 * total(params)}
    *inputs, grad_out = args
    grads = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return {"forward": total(inputs) + total([result]),
            "backward": total(inputs) + total([grad_out]) + total(grads)}


def _tensors_in(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# -- a training step traced from shapes alone (meta tensors) ------------------------------------------
def trace_meta_step(name: str, make_args, step, label: str, eager_step=None) -> WorkloadTrace:
    """``trace_workload`` for a training step ``step(model, opt, *batch)`` on meta tensors: nothing is
    computed or allocated, so a 1B-parameter step traces here in seconds. ``make_args()`` builds
    ``(model, opt, *batch)`` on the meta device. Eager's operators, our launches and the operators
    between them are traced as ``trace_workload`` traces them; the peaks come from ``LiveBytes`` (the
    storages alive at once, on top of the resident parameters and optimizer state). The second of
    two steps is traced (the first makes the optimizer state; ours: the recording, then a replay).
    An extern op of ours whose function has ``roofline_cost(*args, **kwargs)`` (a list of dicts:
    ``bytes``, and optionally ``flops``, ``dtype``, ``launches``, ``name``) is priced by it; any other
    extern by the aten operators it runs (matmuls by their FLOPs), as eager's are. ``eager_step``:
    what eager runs, where it differs from what ours records (``benchmarks.models``: attention)."""
    args = make_args()
    tracer = _Tracer()
    with _meta_runs_as_cpu(), tracer, _phases(tracer):
        out, eager_memory = _traced_meta(tracer, eager_step or step, args, None)
        eager_ops = tracer.ops
        min_bytes = minimal_bytes(args, out, True)
        del out
        compiled = compiler.compile(step, backend="interpret")
        tracer.ops = None
        report = compiler.explain(compiled, *args)
        _, ours_memory = _traced_meta(tracer, compiled, args, _extern_costs(tracer))
        if compiled.stats.get("captures", 1) != 1 or compiled.stats.get("divergences", 0):
            raise RuntimeError(f"{name}: the traced step did not replay the recording ({compiled.stats})")
    return WorkloadTrace(name, label, eager_ops, tracer.ops, tracer.launches, min_bytes, list(report.fallbacks),
                         eager_memory.peak, ours_memory.peak, eager_memory, ours_memory)


def _traced_meta(tracer: _Tracer, fn, args, on_extern):
    """(the loss, StepMemory) of the second of two steps of ``fn`` (launches recorded when
    ``on_extern`` is given: ours), its operators logged into ``tracer.ops``."""
    for ops in (None, []):
        args[0].zero_grad(set_to_none=True)
        tracer.phase, tracer.ops, tracer.launches = "forward", ops, []
        tracer.memory = LiveBytes() if ops is not None else None
        gc.collect()   # (earlier garbage freed during the step would hide part of its peak)
        with _launches_recorded(tracer) if on_extern is not None else contextlib.nullcontext():
            out = fn(*args)
    memory, tracer.memory = tracer.memory, None
    model, opt = args[0], args[1]
    params = sum(p.untyped_storage().nbytes() for p in {storage_key(p): p for p in model.parameters()}.values())
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    optimizer = sum(t.untyped_storage().nbytes() for t in state)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return out, StepMemory(params, grads, optimizer, memory.marks.get("saved", 0), memory.largest,
                           params + optimizer + memory.peak)


def _launches_recorded(tracer: _Tracer):
    """Our launches recorded into ``tracer.launches`` (priced as ``trace_workload`` prices them)."""
    def record(step, launch):
        tracer.launches.append(OurLaunch(tracer.phase, launch, step.bytes_moved))

    def flash(launch, cost):
        if cost.get("kind") == "memory":
            return tracer.launches.append(_priced_launch(tracer, launch, cost))
        rate = flash_rate(cost["phase"], cost["head_dim"], cost["length"], cost["causal"], cost["dtype"])
        tracer.launches.append(OurLaunch(tracer.phase, launch, cost["bytes"], cost["flops"], rate))

    def combo(launch):
        if tracer.ops is not None:
            tracer.ops.append(Op(tracer.phase, "fused_optimizer_step", launch.bytes_moved, 0.0, None))

    return recorded_launches(record, on_combo=combo, on_flash=flash, on_extern=_extern_costs(tracer))


def _priced_launch(tracer: _Tracer, launch, cost: dict) -> OurLaunch:
    """A kernel of ours launched inside an extern call (``runtime.extern_kernels.launch``) whose ``cost``
    says ``{"kind": "memory", "bytes": ...}`` (the chunked linear + cross-entropy's): by its bytes."""
    return OurLaunch(tracer.phase, launch, int(cost["bytes"]))


def _extern_costs(tracer: _Tracer):
    """``recorded_launches``'s ``on_extern``: an extern whose function declares ``roofline_cost`` is
    priced by it, and the aten operators it runs are then not logged (they are that cost)."""
    @contextlib.contextmanager
    def on_extern(fn, args, kwargs):
        cost = getattr(fn, "roofline_cost", None)
        if cost is None or tracer.ops is None:
            yield
            return
        ops = tracer.ops
        for c in cost(*args, **kwargs):
            ops.append(Op(tracer.phase, c.get("name", getattr(fn, "__name__", "extern")), int(c["bytes"]),
                          float(c.get("flops", 0.0)), c.get("dtype"), launches=int(c.get("launches", 1))))
        tracer.ops = None
        try:
            yield
        finally:
            tracer.ops = ops
    return on_extern


@contextlib.contextmanager
def _meta_runs_as_cpu():
    """Our compiler picks the backend of CPU tensors (``interpret``: the Triton program a GPU gets)
    for meta ones: the backend choice is the only place it refuses the meta device."""
    from runtime import backends

    original = backends._choose
    backends._choose = lambda backend, device_type: original(backend, "cpu" if device_type == "meta" else device_type)
    try:
        yield
    finally:
        backends._choose = original
