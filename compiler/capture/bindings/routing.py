"""Bindings of ordering, running sums, histograms, scatters and grouped matmuls: what a
mixture-of-experts layer routes tokens with (topk, sort/argsort, cumsum, histc, integer
``//`` and ``%``, ``torch._grouped_mm``), and scatter, scatter_add, index_add, one_hot.
The catalog ops are in ``compiler/ir/ops/routing.py`` (PyTorch's kernels, hand-written VJPs).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.capture.bindings.elementwise import _filled
from compiler.capture.bindings.handles import Tensor, arange_along, full, gather, on_handles
from compiler.capture.bindings.indexing import _check_index
from compiler.capture.bindings.registry import Unsupported, _in_place_variant, _no_out, _t, binds
from compiler.ir.graph import meta_of
from compiler.ir.ops import routing


def _dim(x: Tensor, dim) -> int:
    if not isinstance(dim, int):
        raise Unsupported("a dim that is not an int")
    return dim % max(x.ndim, 1)


def _wrap(x: Tensor, node: fx.Node) -> Tensor:
    return Tensor(x.b, node)


def _no_zero_d(x, what):
    if not isinstance(x, Tensor):
        raise Unsupported(f"{what} needs a tensor")
    if x.ndim == 0:
        raise Unsupported(f"{what} of a 0-d tensor")
    if x.dtype.is_complex:
        raise Unsupported(f"{what} of a complex tensor (eager raises)")


# ----------------------------------------------------------------------------- order
@binds(torch.topk, _t("topk"))
@on_handles
def _topk(b, x, k, dim=-1, largest=True, sorted=True, *, out=None):
    _no_out({"out": out})
    _no_zero_d(x, "topk")
    dim = _dim(x, dim)
    if not isinstance(k, int) or not 0 <= k <= x.shape[dim]:
        raise Unsupported("topk: k must be an int within the dim's size (eager raises)")
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    indices = _wrap(x, routing.emit_order_indices(b, x.node, shape, op="topk", dim=dim, k=k, largest=bool(largest),
                                                  sorted=bool(sorted)))
    return gather(x, indices, "gather", dim), indices


def _order(b, x, dim, descending, stable):
    _no_zero_d(x, "sort")
    dim = _dim(x, dim)
    return dim, _wrap(x, routing.emit_order_indices(b, x.node, x.shape, op="sort", dim=dim,
                                                    descending=bool(descending), stable=bool(stable)))


@binds(torch.sort, _t("sort"))
@on_handles
def _sort(b, x, dim=-1, descending=False, stable=None, *, out=None):
    if isinstance(dim, bool) or dim is None:  # sort(x, stable, dim=..., descending=...) overload
        raise Unsupported("sort(stable, ...) positional overload")
    _no_out({"out": out})
    dim, indices = _order(b, x, dim, descending, bool(stable))
    return gather(x, indices, "gather", dim), indices


@binds(torch.argsort, _t("argsort"))
@on_handles
def _argsort(b, x, dim=-1, descending=False, stable=False):
    return _order(b, x, dim, descending, stable)[1]


# ----------------------------------------------------------------------------- running sums, histograms
@binds(torch.cumsum, _t("cumsum"))
@on_handles
def _cumsum(b, x, dim, *, dtype=None, out=None):
    _no_out({"out": out})
    if not isinstance(x, Tensor) or x.dtype.is_complex:
        raise Unsupported("cumsum of a complex tensor is not supported yet")
    if x.ndim == 0:
        raise Unsupported("cumsum of a 0-d tensor")
    if dtype is None and not x.dtype.is_floating_point:
        dtype = torch.int64  # integers and bools sum in int64, as eager
    return _wrap(x, routing.emit_cumsum(b, x.node, _dim(x, dim), dtype))


binds(_t("cumsum_"))(_in_place_variant(_cumsum))


@binds(torch.histc, _t("histc"))
@on_handles
def _histc(b, x, bins=100, min=0, max=0, *, out=None):
    _no_out({"out": out})
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise Unsupported("histc of a non-floating tensor (eager raises on CPU)")
    if x.requires_grad:
        raise Unsupported("histc of a tensor that requires grad (eager has no derivative for it)")
    if min == max:
        raise Unsupported("histc with min == max takes its range from the data (a data-dependent result)")
    return _wrap(x, routing.emit_histc(b, x.node, int(bins), float(min), float(max)))


# ----------------------------------------------------------------------------- integer // and %
def _integer_op(op, reflected=False):
    def bind(b, x, y):
        if reflected:
            x, y = y, x
        tensors = [v for v in (x, y) if isinstance(v, fx.Node)]
        dtypes = [meta_of(v).dtype for v in tensors]
        if any(d.is_floating_point or d.is_complex or d == torch.bool for d in dtypes) or \
                any(isinstance(v, (float, complex, bool)) for v in (x, y)):
            raise Unsupported(f"{op} of floating or boolean operands is not supported yet (integers are)")
        if not isinstance(x, fx.Node):  # a number on the left: 7 // t
            if not isinstance(x, int):
                raise Unsupported(f"{op} with a non-int number")
            return routing.emit_integer_arithmetic(b, y, x, "r" + op, meta_of(y).shape, meta_of(y).dtype)
        if not isinstance(y, (fx.Node, int)):
            raise Unsupported(f"{op} with a non-int number")
        shape = torch.broadcast_shapes(*[meta_of(t).shape for t in tensors])
        dtype = torch.promote_types(*dtypes) if len(dtypes) == 2 else dtypes[0]
        if isinstance(y, fx.Node) and meta_of(y).shape != shape or meta_of(x).shape != shape:
            raise Unsupported(f"{op} of integer tensors that broadcast is not supported yet")
        return routing.emit_integer_arithmetic(b, x, y, op, shape, dtype)
    return bind


binds(torch.floor_divide, _t("floor_divide"), _t("__floordiv__"))(_integer_op("floor_divide"))
binds(_t("__rfloordiv__"))(_integer_op("floor_divide", reflected=True))
binds(torch.remainder, _t("remainder"), _t("__mod__"))(_integer_op("remainder"))
binds(_t("__rmod__"))(_integer_op("remainder", reflected=True))


# ----------------------------------------------------------------------------- grouped matmul
def _grouped_mm(b, a, w, offs=None, bias=None, out_dtype=None):
    if not all(isinstance(v, fx.Node) for v in (a, w, offs)):
        raise Unsupported("grouped_mm without offsets (offs=None) is not supported yet")
    if bias is not None or out_dtype not in (None, meta_of(a).dtype):
        raise Unsupported("grouped_mm with bias or out_dtype is not supported yet")
    ma, mw, mo = meta_of(a), meta_of(w), meta_of(offs)
    if len(ma.shape) != 2 or len(mw.shape) != 3 or len(mo.shape) != 1 or mo.dtype != torch.int32:
        raise Unsupported("grouped_mm: only rows (2-D) by per-group matrices (3-D) with int32 offsets "
                          "(a mixture of experts' layout) are supported yet")
    if ma.dtype != mw.dtype or ma.shape[1] != mw.shape[1] or mo.shape[0] != mw.shape[0]:
        raise Unsupported("grouped_mm: operands that do not fit (eager raises)")
    return routing.emit_grouped_mm(b, a, w, offs)


binds(*[f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None])(
    _grouped_mm)


# ----------------------------------------------------------------------------- scatters
def _scatter_binding(mode):
    @on_handles
    def bind(b, x, dim, index, src=None, *, value=None, alpha=1, reduce=None, out=None):
        _no_out({"out": out})
        if reduce is not None:
            raise Unsupported(f"{mode}(reduce=...) is not supported yet")
        if src is None:
            src = value
        if not isinstance(x, Tensor) or x.ndim == 0:
            raise Unsupported(f"{mode} of a 0-d tensor")
        _check_index(index, mode)
        dim = _dim(x, dim)
        if not isinstance(src, Tensor):  # scatter(dim, index, value): a constant src
            if mode != "scatter":
                raise Unsupported(f"{mode} needs a tensor src")
            src = full(b, index.shape, src, x.dtype)
        if src.dtype != x.dtype:
            raise Unsupported(f"{mode}: src's dtype differs from the tensor's (eager raises)")
        if mode == "index_add":
            expected = x.shape[:dim] + (index.numel(),) + x.shape[dim + 1:]
            if index.ndim > 1 or src.shape != (expected if x.ndim else ()):
                raise Unsupported("index_add: index must be 1-D and src the tensor's shape with index's "
                                  "length at dim (eager raises)")
        elif index.shape != src.shape or index.ndim != x.ndim or \
                any(i > s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != dim):
            raise Unsupported(f"{mode} with an index shaped unlike src is not supported yet")
        node = routing.emit_scatter(b, x.node, index.node, src.node, mode, dim, alpha=alpha)
        return _wrap(x, node)
    return bind


for _mode in ("scatter", "scatter_add", "index_add"):
    _bind = _scatter_binding(_mode)
    binds(getattr(torch, _mode), _t(_mode))(_bind)
    binds(_t(f"{_mode}_"))(_in_place_variant(_bind))


@binds(F.one_hot)
@on_handles
def _one_hot(b, x, num_classes=-1):
    """Rows of the identity matrix picked by ``x``: a gather (so indices out of range raise, as
    eager's do) of an identity computed inline (two iotas compared)."""
    if num_classes is None or num_classes < 0:
        raise Unsupported("one_hot without num_classes takes its width from the data (a data-dependent shape)")
    _check_index(x, "one_hot")
    if x.dtype != torch.int64:
        raise Unsupported("one_hot of a non-int64 tensor (eager raises)")
    shape = (num_classes, num_classes)
    identity = (arange_along(b, shape, 0) == arange_along(b, shape, 1)).to(torch.int64)
    return gather(identity, x, "embedding", 0)


# NOTE: empty_like's values are unspecified, so zeros are eager's too; a MoE layer makes its
# inverse permutation in one (``inv = torch.empty_like(perm); inv[perm] = arange``).
binds(torch.empty_like)(_filled(0))
