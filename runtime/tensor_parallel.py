"""Tensor parallel layers inside compiled steps (issue 38): their math on the local shards.

``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` makes a Linear's parameters
DTensors and wraps its input in one; ``F.linear`` then runs through DTensor's dispatch, which the
compiler does not see into. Both the recording and the replay rewrite such a call, before anything
else sees it, into what DTensor computes on each rank (``rewrite_linear``):

    x_local = x.to_local(grad_placements=...)     # eager: autograd's bridge out of the DTensor
    y_local = F.linear(x_local, w_local, b_local) # compiled: plain tensors, fused with what follows
    y = DTensor.from_local(y_local, mesh, ...)    # eager: back into a DTensor, placed as DTensor's

The ``grad_placements`` say what the local gradient is: a replicated input of a column-parallel
layer gets a partial gradient from each rank (summed by DTensor's backward, as eager's linear
backward sums it); a sharded one its own shard's. Placements other than these two layouts run
through DTensor eagerly, with the reason said.

A row-parallel layer's output is all-reduced asynchronously: ``AsyncCollectiveTensor``, a wrapper
that waits at its first use. The recording and the replay hand the compiled regions the waited
result instead (``waited``: one autograd identity, whose backward passes the gradient on).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from runtime import shards


def _module_attr(module: str, name: str):
    return getattr(sys.modules.get(module), name, None)


_PENDING = None  # AsyncCollectiveTensor, once imported


def pending_class():
    """AsyncCollectiveTensor where torch.distributed's functional collectives are imported, else None
    (none can exist then); cheap: the replay asks it per call."""
    global _PENDING
    if _PENDING is None:
        _PENDING = _module_attr("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
    return _PENDING


def reentered(mode, fn, *args):
    """``fn(*args)`` with ``mode`` (whose ``__torch_function__`` runs now, off the stack) back on the
    torch-function stack: each torch call ``fn`` makes goes through the mode."""
    torch._C._push_on_torch_function_stack(mode)
    try:
        return fn(*args)
    finally:
        torch._C._pop_torch_function_stack()


def _linear_operands(args, kwargs):
    names = ("input", "weight", "bias")
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    return (values + [None] * 3)[:3]


def linear_layout(args, kwargs):
    """For ``F.linear(*args, **kwargs)`` on DTensors: (output placements, gradient placements of
    input, weight, bias), or a string saying why the layout is not computed on local shards.
    None where no operand is a DTensor."""
    dtensor = shards.dtensor_class()
    if dtensor is None:  # (the common case, per F.linear of a replay: no DTensor exists)
        return None
    x, w, b = _linear_operands(args, kwargs)
    if not (isinstance(w, dtensor) or isinstance(x, dtensor) or isinstance(b, dtensor)):
        return None
    if not all(isinstance(t, dtensor) for t in (x, w, b) if t is not None):
        return "it mixes DTensors and plain tensors"
    if any(t.device_mesh != w.device_mesh or t.device_mesh.ndim != 1 for t in (x, w, b) if t is not None):
        return "its DTensors are not on one one-dimensional mesh"
    from torch.distributed.tensor import Partial, Shard

    (px,), (pw,), last = x.placements, w.placements, x.ndim - 1
    pb = b.placements[0] if b is not None else None
    if px.is_replicate() and pw == Shard(0) and pb in (None, Shard(0)):      # ColwiseParallel
        return [Shard(last)], ([Partial()], [Shard(0)], [Shard(0)])
    if px.is_shard() and px.dim in (-1, last) and pw == Shard(1) and (pb is None or pb.is_replicate()):
        # RowwiseParallel: a replicated bias is added once in the sum, each rank adding its 1/n
        # (DTensor's Replicate -> Partial), so its gradient is all-reduced (_SummedGradient)
        return [Partial()], ([Shard(last)], [Shard(1)], _REPLICATED_BIAS if b is not None else None)
    return (f"its placements (input {px}, weight {pw}, bias {pb}) are not a column- or row-parallel "
            "layer's")


def rewrite_linear(layout, args, kwargs):
    """``F.linear`` on DTensors laid out as ``layout`` (``linear_layout``'s answer), computed on the
    local shards; called inside the mode, so each of its calls is recorded or replayed."""
    from torch.distributed.tensor import DTensor

    x, w, b = _linear_operands(args, kwargs)
    placements, (gx, gw, gb) = layout
    x_local = x.to_local(grad_placements=gx)
    w_local = w.to_local(grad_placements=gw)
    if gb is _REPLICATED_BIAS:   # (eager's value: bias / n on each rank, then the partial sum)
        mesh = b.device_mesh
        b_local = _SummedGradient.apply(b.to_local(), mesh.get_group()) / mesh.size()
    else:
        b_local = b.to_local(grad_placements=gb) if b is not None else None
    y_local = F.linear(x_local, w_local, b_local)
    shape = (*x.shape[:-1], w.shape[0])
    return DTensor.from_local(y_local, x.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_strides(shape))


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_REPLICATED_BIAS = "replicated bias"


class _SummedGradient(torch.autograd.Function):
    """Identity whose backward all-reduces the gradient over ``group``: a replicated tensor each rank
    uses a share of (a row-parallel layer's bias), whose gradient is the sum of the ranks' shares."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Waited(torch.autograd.Function):
    """An AsyncCollectiveTensor's result, waited for, as a plain tensor on its autograd path."""

    @staticmethod
    def forward(ctx, pending):
        result = pending.trigger_wait()
        return result.view_as(result)  # (a new tensor object: autograd records its Node on it)

    @staticmethod
    def backward(ctx, grad):
        return grad


def has_pending(leaves) -> bool:
    """Whether any of ``leaves`` is an AsyncCollectiveTensor."""
    cls = pending_class()
    return cls is not None and any(type(t) is cls for t in leaves)


def waited(leaves, cache: dict) -> list:
    """``leaves`` with each AsyncCollectiveTensor replaced by its waited result, the same plain tensor
    for the same wrapper (``cache``: id -> (wrapper, result), kept by the caller for its call)."""
    cls = pending_class()
    out = []
    for t in leaves:
        if type(t) is cls:
            entry = cache.get(id(t))
            if entry is None or entry[0] is not t:
                entry = cache[id(t)] = (t, _Waited.apply(t))
            t = entry[1]
        out.append(t)
    return out
