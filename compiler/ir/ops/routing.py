"""Externs of indexing and mixture-of-experts routing, run by PyTorch's own kernels (on GPU
its CUDA kernels): the order of a tensor (topk, sort), running sums (cumsum), histograms,
grouped matmuls, writes at indexed positions (index_put, scatter, scatter_add, index_add)
and reads at several index tensors (``x[i, j]``). Each has a hand-written VJP.

Values picked by an order (topk's, sort's) are not externs: only the *indices* are, and the
values are an inline gather of the input at them, so they fuse into their consumer and their
gradient is the gather's (a scatter-add of the gradient at the picked positions, eager's too).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir.graph import meta_of
from compiler.ir.ops import structural, views
from compiler.ir.ops.externs import Extern
from compiler.ir.ops.pointwise import emit_fill, emit_pointwise
from compiler.ir.ops.reductions import sum_to_shape


def _call(b, op, args, kwargs, shape, dtype, requires_grad=False) -> fx.Node:
    return b.call(op, list(args), kwargs, shape=tuple(shape), dtype=dtype, requires_grad=requires_grad)


def _cast(b, node, dtype) -> fx.Node:
    if meta_of(node).dtype == dtype:
        return node
    return emit_pointwise(b, "identity", [node], dtype=dtype, requires_grad=meta_of(node).requires_grad)


# ----------------------------------------------------------------------------- order
class OrderIndices(Extern):
    """The int64 positions that topk or sort picks along ``dim`` (PyTorch's kernel, so ties
    resolve as eager's do). Integer: no gradient."""

    @staticmethod
    def torch_fn(x, *, op, dim, k=None, largest=True, descending=False, stable=False, sorted=True):
        if op == "topk":
            return torch.topk(x, k, dim, largest=largest, sorted=sorted).indices
        return torch.sort(x, dim=dim, descending=descending, stable=stable).indices

    def vjp(self, b, node, grad_out):
        return [None]


class Cumsum(Extern):
    """torch.cumsum along ``dim`` (in ``dtype``). Its VJP is the reversed running sum of the
    gradient (flip, cumsum, flip), cast back to the input's dtype."""

    @staticmethod
    def torch_fn(x, *, dim, dtype=None):
        return torch.cumsum(x, dim, dtype=dtype)

    def vjp(self, b, node, grad_out):
        (x,) = node.args
        if not meta_of(x).requires_grad:
            return [None]
        dim = node.kwargs["dim"]
        flipped = views.emit_view(b, "flip", grad_out, dims=(dim,))
        summed = emit_cumsum(b, flipped, dim)
        return [_cast(b, views.emit_view(b, "flip", summed, dims=(dim,)), meta_of(x).dtype)]


class Histc(Extern):
    """torch.histc: counts in ``bins`` equal bins over [min, max] (the bindings refuse an
    input that requires grad: eager has no derivative for it and raises at backward)."""

    @staticmethod
    def torch_fn(x, *, bins, min, max):
        return torch.histc(x, bins=bins, min=min, max=max)

    def vjp(self, b, node, grad_out):
        return [None]


# ----------------------------------------------------------------------------- grouped matmul
class GroupedMM(Extern):
    """torch._grouped_mm of rows ``a`` (S, K) by per-group matrices ``w`` (G, K, N): the rows
    from offs[g-1] to offs[g] are multiplied by w[g] (a mixture of experts' expert layers).
    Gradients: a's is grouped_mm(grad, w^T); w's the per-group a^T @ grad (grouped_mm's 2-D
    by 2-D form, PyTorch's own backward's)."""

    @staticmethod
    def torch_fn(a, w, offs, *, which="out"):
        if which == "out":
            return torch._grouped_mm(a, w, offs=offs)
        if which == "a":  # a is the gradient (S, N), w the weights (G, K, N)
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(a.t(), w, offs=offs)  # which == "w": a (S, K), w the gradient (S, N)

    def vjp(self, b, node, grad_out):
        a, w, offs = node.args
        if node.kwargs.get("which", "out") != "out":
            raise NotImplementedError("double backward through torch._grouped_mm is not supported yet")
        ga = gw = None
        rg, dtype = meta_of(grad_out).requires_grad, meta_of(grad_out).dtype
        if meta_of(a).requires_grad:
            ga = _call(b, GROUPED_MM, [grad_out, w, offs], {"which": "a"}, meta_of(a).shape, dtype, rg)
        if meta_of(w).requires_grad:
            gw = _call(b, GROUPED_MM, [a, grad_out, offs], {"which": "w"}, meta_of(w).shape, dtype, rg)
        return [ga, gw, None]


# ----------------------------------------------------------------------------- advanced indexing
def _index_list(layout, tensors):
    """aten.index's list of optional index tensors: ``layout`` holds, per indexed dim, None
    (the whole dim) or the position of its tensor in ``tensors``."""
    return [None if at is None else tensors[at] for at in layout]


class AdvancedIndex(Extern):
    """``x[i, j, ...]`` with several index tensors (broadcast together; whole dims between
    them as eager arranges them): aten.index, with eager's errors for indices out of range.
    Its VJP puts the gradient back with index_put(accumulate=True) into zeros."""

    @staticmethod
    def torch_fn(x, *indices, layout):
        return torch.ops.aten.index.Tensor(x, _index_list(layout, indices))

    def vjp(self, b, node, grad_out):
        x, *indices = node.args
        if not meta_of(x).requires_grad:
            return [None] * len(node.args)
        zeros = emit_fill(b, meta_of(x).shape, meta_of(grad_out).dtype, 0)
        put = emit_index_put(b, zeros, grad_out, indices, node.kwargs["layout"], accumulate=True)
        return [put] + [None] * len(indices)


class IndexPut(Extern):
    """``x[i, j, ...] = values`` (index_put; ``accumulate``: added, as index_put_(...,
    accumulate=True)). Integer or boolean index tensors; values broadcast to the indexed
    shape. VJP: x's gradient is the gradient with the written positions zeroed (unless
    accumulated); the values' is the gradient read at them, summed where they broadcast."""

    @staticmethod
    def torch_fn(x, values, *indices, layout, accumulate=False):
        return torch.ops.aten.index_put.default(x, _index_list(layout, indices), values, accumulate)

    def vjp(self, b, node, grad_out):
        x, values, *indices = node.args
        layout = node.kwargs["layout"]
        gx = gv = None
        if meta_of(x).requires_grad:
            gx = grad_out
            if not node.kwargs.get("accumulate"):
                zero = emit_fill(b, (), meta_of(grad_out).dtype, 0)
                gx = emit_index_put(b, grad_out, zero, indices, layout)
        if meta_of(values).requires_grad:
            picked = emit_advanced_index(b, grad_out, indices, layout)
            gv = _cast(b, sum_to_shape(b, picked, meta_of(values).shape), meta_of(values).dtype)
        return [gx, gv] + [None] * len(indices)


def _shape_of(fn, *metas, **kwargs):
    """The result shape of ``fn`` on meta tensors like ``metas`` (no data moves)."""
    fakes = [torch.empty(meta_of(m).shape, dtype=meta_of(m).dtype, device="meta") for m in metas]
    return tuple(fn(*fakes, **kwargs).shape)


def emit_advanced_index(b, x, indices, layout) -> fx.Node:
    shape = _shape_of(AdvancedIndex.torch_fn, x, *indices, layout=layout)
    return _call(b, ADVANCED_INDEX, [x, *indices], {"layout": tuple(layout)}, shape, meta_of(x).dtype,
                 meta_of(x).requires_grad)


def emit_index_put(b, x, values, indices, layout, accumulate=False) -> fx.Node:
    return _call(b, INDEX_PUT, [x, values, *indices], {"layout": tuple(layout), "accumulate": accumulate},
                 meta_of(x).shape, meta_of(x).dtype, meta_of(x).requires_grad or meta_of(values).requires_grad)


class ScatterAdd(Extern):
    """``x.scatter_add(dim, index, src)`` and ``x.index_add(dim, index, src, alpha=)``
    (``mode``: "scatter_add", "index_add"), or ``x.scatter(dim, index, src)`` ("scatter";
    where two indices collide eager keeps an unspecified one, as here). The bindings take an
    index of src's shape only. VJP: x's gradient is
    the gradient (with the scattered positions zeroed for scatter); src's the gradient
    gathered at the same index (an inline gather)."""

    @staticmethod
    def torch_fn(x, index, src, *, mode, dim, alpha=1):
        if mode == "index_add":
            return x.index_add(dim, index, src, alpha=alpha)
        if mode == "scatter":
            return x.scatter(dim, index, src)
        return x.scatter_add(dim, index, src)

    def vjp(self, b, node, grad_out):
        x, index, src = node.args
        mode, dim = node.kwargs["mode"], node.kwargs["dim"]
        gx = gs = None
        if meta_of(x).requires_grad:
            gx = grad_out
            if mode == "scatter":
                zeros = emit_fill(b, meta_of(src).shape, meta_of(grad_out).dtype, 0)
                gx = emit_scatter(b, grad_out, index, zeros, "scatter", dim)
        if meta_of(src).requires_grad:
            gather_mode = "index_select" if mode == "index_add" else "gather"
            gs = structural.emit_gather(b, grad_out, index, gather_mode, dim)
            if node.kwargs.get("alpha", 1) != 1:
                gs = emit_pointwise(b, "mul", [gs, node.kwargs["alpha"]], dtype=meta_of(gs).dtype)
        return [gx, None, gs]


def emit_scatter(b, x, index, src, mode, dim, alpha=1) -> fx.Node:
    kwargs = {"mode": mode, "dim": dim}
    if alpha != 1:
        kwargs["alpha"] = alpha
    return _call(b, SCATTER, [x, index, src], kwargs, meta_of(x).shape, meta_of(x).dtype,
                 meta_of(x).requires_grad or meta_of(src).requires_grad)


class IntegerArithmetic(Extern):
    """Python's ``//`` and ``%`` of integer tensors (floor division and its remainder, with
    eager's ZeroDivisionError): integer routing arithmetic, no gradient."""

    @staticmethod
    def torch_fn(a, *divisor, op, scalar=None):
        """``a // d`` or ``a % d``: ``d`` the tensor in ``divisor``, else the Python number ``scalar``;
        ``op`` "rfloor_divide"/"rremainder" for a number on the left (``scalar // a``)."""
        fn = torch.floor_divide if op.endswith("floor_divide") else torch.remainder
        d = divisor[0] if divisor else scalar
        if op in ("rfloor_divide", "rremainder"):
            return fn(torch.tensor(d, dtype=a.dtype, device=a.device), a)
        return fn(a, d)

    def vjp(self, b, node, grad_out):
        return [None] * len(node.args)


ORDER_INDICES = OrderIndices("order_indices")
CUMSUM = Cumsum("cumsum")
HISTC = Histc("histc")
GROUPED_MM = GroupedMM("grouped_mm")
ADVANCED_INDEX = AdvancedIndex("advanced_index")
INDEX_PUT = IndexPut("index_put")
SCATTER = ScatterAdd("scatter")
INTEGER_ARITHMETIC = IntegerArithmetic("integer_arithmetic")
ROUTING = {op.name: op for op in (ORDER_INDICES, CUMSUM, HISTC, GROUPED_MM, ADVANCED_INDEX, INDEX_PUT, SCATTER,
                                  INTEGER_ARITHMETIC)}


def emit_order_indices(b, x, shape, **params) -> fx.Node:
    return _call(b, ORDER_INDICES, [x], params, shape, torch.int64)


def emit_cumsum(b, x, dim, dtype=None) -> fx.Node:
    out_dtype = dtype or meta_of(x).dtype
    kwargs = {"dim": dim} if dtype is None else {"dim": dim, "dtype": dtype}
    return _call(b, CUMSUM, [x], kwargs, meta_of(x).shape, out_dtype,
                 meta_of(x).requires_grad and out_dtype.is_floating_point)


def emit_histc(b, x, bins, min, max) -> fx.Node:
    return _call(b, HISTC, [x], {"bins": bins, "min": min, "max": max}, (bins,), meta_of(x).dtype)


def emit_grouped_mm(b, a, w, offs) -> fx.Node:
    shape = (meta_of(a).shape[0], meta_of(w).shape[-1])
    return _call(b, GROUPED_MM, [a, w, offs], {}, shape, meta_of(a).dtype,
                 meta_of(a).requires_grad or meta_of(w).requires_grad)


def emit_integer_arithmetic(b, x, y, op, shape, dtype) -> fx.Node:
    """``x // y`` or ``x % y`` (``op``) of integer tensors; ``y`` may be a Python int."""
    if isinstance(y, fx.Node):
        return _call(b, INTEGER_ARITHMETIC, [x, y], {"op": op}, shape, dtype)
    return _call(b, INTEGER_ARITHMETIC, [x], {"op": op, "scalar": y}, shape, dtype)
