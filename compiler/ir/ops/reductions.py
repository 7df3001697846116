"""Reductions (sum, mean, amax over dims) and ``sum_to_shape``, the one place broadcasting is undone."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind, meta_of, numel
from compiler.ir.ops import views
from compiler.ir.ops.base import OpDef
from compiler.ir.ops.pointwise import emit_pointwise


# ----------------------------------------------------------------------------- reductions
class Reduction(OpDef):
    """sum / mean / amax over ``dims`` (a sorted tuple); ``keepdim`` as in PyTorch."""

    kind = OpKind.REDUCTION

    def out_shape(self, in_shape, dims, keepdim):
        if keepdim:
            return tuple(1 if d in dims else s for d, s in enumerate(in_shape))
        return tuple(s for d, s in enumerate(in_shape) if d not in dims)

    def scale(self, node: fx.Node) -> float:
        if self.name != "mean":
            return 1.0
        shape = meta_of(node.args[0]).shape
        count = node.kwargs.get("count") or numel([shape[d] for d in node.kwargs["dims"]])
        return 1.0 / count if count else math.nan

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        """The op's value on real tensors (``compiler.ir.reference``)."""
        x, dtype = args[0], meta_of(node).dtype
        dims, keepdim = node.kwargs["dims"], node.kwargs["keepdim"]
        if node.kwargs.get("count"):  # the second stage of a split mean
            return (torch.sum(x, dim=dims, keepdim=keepdim) / node.kwargs["count"]).to(dtype)
        fn = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax}[self.name]
        return (fn(x, dim=dims, keepdim=keepdim) if dims else x.clone()).to(dtype)

    def vjp(self, b, node, grad_out):
        (x,) = node.args
        dims, keepdim = node.kwargs["dims"], node.kwargs["keepdim"]
        in_shape = meta_of(x).shape
        g = grad_out
        kept = self.out_shape(in_shape, dims, True)
        if not keepdim:
            g = views.emit_view(b, "reshape", g, shape=kept)
        g = views.emit_view(b, "expand", g, shape=in_shape)
        if self.name == "mean":
            g = emit_pointwise(b, "mul", [g, self.scale(node)], dtype=meta_of(x).dtype, requires_grad=False)
        if self.name == "amax":
            # eager's amax backward: the gradient is shared evenly among the maximal elements
            dtype = meta_of(x).dtype
            m = views.emit_view(b, "expand", views.emit_view(b, "reshape", node, shape=kept), shape=in_shape)
            hit = emit_pointwise(b, "eq", [x, m], dtype=torch.bool)
            if node.kwargs.get("nan_takes_gradient"):
                # torch.max(x) / min(x) of all elements (eager's evenly_distribute_backward): where
                # the max is NaN, the NaN elements share the gradient (amax's goes NaN everywhere)
                hit = emit_pointwise(b, "logical_or", [hit, emit_pointwise(b, "ne", [x, x], dtype=torch.bool)],
                                     dtype=torch.bool)
            hit = emit_pointwise(b, "identity", [hit], dtype=dtype, requires_grad=False)
            count = views.emit_view(b, "expand", emit_reduction(b, "sum", hit, dims, keepdim=True), shape=in_shape)
            g = emit_pointwise(b, "div", [emit_pointwise(b, "mul", [g, hit], dtype=dtype, requires_grad=False),
                                          count], dtype=dtype, requires_grad=False)
        return [g]


REDUCTIONS = {name: Reduction(name) for name in ("sum", "mean", "amax")}


def emit_reduction(b, name, x, dims, keepdim=False, dtype=None, nan_takes_gradient=False) -> fx.Node:
    """``name`` (sum, mean, amax) of ``x`` over ``dims``. ``nan_takes_gradient``: an amax whose
    gradient goes to the NaN elements where the max is NaN (torch.max(x) rather than amax)."""
    ndim = len(meta_of(x).shape)
    if ndim == 0:
        # NOTE: reducing a 0-dim tensor (x.sum(), x.amax() of a scalar) reduces nothing: the
        # value itself, in the result dtype (a reduction over no dims has no iteration space).
        return emit_pointwise(b, "identity", [x], dtype=dtype or meta_of(x).dtype,
                              requires_grad=meta_of(x).requires_grad)
    dims = tuple(sorted({d % ndim for d in dims}))
    op = REDUCTIONS[name]
    kwargs = {"dims": dims, "keepdim": keepdim, **({"nan_takes_gradient": True} if nan_takes_gradient else {})}
    return b.call(op, [x], kwargs,
                  shape=op.out_shape(meta_of(x).shape, dims, keepdim),
                  dtype=dtype or meta_of(x).dtype, requires_grad=meta_of(x).requires_grad)


def sum_to_shape(b: GraphBuilder, g: fx.Node, shape) -> fx.Node:
    """Undo broadcasting: sum ``g`` down to ``shape``. The only place this is done."""
    shape = tuple(shape)
    g_shape = meta_of(g).shape
    if g_shape == shape:
        return g
    lead = len(g_shape) - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g_shape[lead + i] != 1)
    if dims:
        g = emit_reduction(b, "sum", g, dims, keepdim=True)
    if meta_of(g).shape != shape:
        g = views.emit_view(b, "reshape", g, shape=shape)
    return g
