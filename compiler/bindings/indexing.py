"""Bindings of indexing: embedding, gather, index_select, x[...] reads and writes, narrow,
select, tril/triu.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.bindings.registry import Unsupported, _no_out, _t, binds
from compiler.bindings.views import _expand
from compiler.ir import meta_of
from compiler.ops import catalog as C


@binds(F.embedding)
def _embedding(b, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    if max_norm is not None:
        raise Unsupported("embedding(max_norm=...) renormalizes the weight in place; not supported yet")
    if scale_grad_by_freq or sparse:
        raise Unsupported("embedding with scale_grad_by_freq or sparse gradients is not supported yet")
    if not isinstance(input, fx.Node) or not isinstance(weight, fx.Node):
        raise Unsupported("embedding needs tensor indices and weight")
    _check_index(input, "embedding")
    if len(meta_of(weight).shape) != 2:
        raise Unsupported("embedding weight must be 2-D")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += meta_of(weight).shape[0]
    return C.emit_gather(b, weight, input, "embedding", 0, padding_idx)


@binds(torch.embedding)
def _torch_embedding(b, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _embedding(b, indices, weight, None if padding_idx == -1 else padding_idx,
                      scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)


def _check_index(index, what):
    if not isinstance(index, fx.Node):
        raise Unsupported(f"{what} needs a tensor index")
    if meta_of(index).dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"{what} indices must be int64 or int32, not {meta_of(index).dtype}")


@binds(torch.gather, _t("gather"))
def _gather(b, x, dim, index, *, sparse_grad=False, out=None):
    _no_out({"out": out})
    _check_index(index, "gather")
    rank = len(meta_of(x).shape)
    dim %= max(rank, 1)
    if len(meta_of(index).shape) != rank or any(
            i > s for d, (i, s) in enumerate(zip(meta_of(index).shape, meta_of(x).shape)) if d != dim):
        raise Unsupported("gather: index must have the input's rank and fit it outside dim (eager raises)")
    return C.emit_gather(b, x, index, "gather", dim)


@binds(torch.index_select, _t("index_select"))
def _index_select(b, x, dim, index, *, out=None):
    if not meta_of(x).shape:
        raise Unsupported("index_select on a 0-d tensor")
    _no_out({"out": out})
    _check_index(index, "index_select")
    if len(meta_of(index).shape) > 1:
        raise Unsupported("index_select needs a 1-D index (eager raises)")
    dim %= max(len(meta_of(x).shape), 1)
    return C.emit_gather(b, x, _as_1d(b, index), "index_select", dim)


def _as_1d(b, index):
    return index if len(meta_of(index).shape) == 1 else C.emit_view(b, "reshape", index, shape=(1,))


def _advanced_index(b, x, index):
    """x[..., idx, ...] with one integer index tensor and otherwise whole dims: a gather along
    that dim (negative indices count from the end, as in eager)."""
    items = index if isinstance(index, tuple) else (index,)
    tensors = [i for i, item in enumerate(items) if isinstance(item, fx.Node)]
    if len(tensors) != 1:
        raise Unsupported("indexing with several index tensors is not supported yet")
    at = tensors[0]
    idx = items[at]
    if meta_of(idx).dtype == torch.bool:
        raise Unsupported("indexing with a boolean mask has a data-dependent shape")
    _check_index(idx, "indexing")
    if Ellipsis in items[at + 1:]:
        raise Unsupported("an ellipsis after an index tensor is not supported yet")
    if Ellipsis in items[:at]:
        dim = len(meta_of(x).shape) - (len(items) - at)
    else:
        dim = at
    others = [item for i, item in enumerate(items) if i != at and item is not Ellipsis]
    if any(not (isinstance(item, slice) and item == slice(None)) for item in others):
        raise Unsupported("mixing an index tensor with ints, slices or None is not supported yet")
    return C.emit_gather(b, x, idx, "index_select", dim, wrap=True)


# ----------------------------------------------------------------------------- indexing
def _basic_index(x, index):
    """Split a basic index (ints, slices, None, ...) into per-dim slices of ``x`` and the final
    shape; advanced (tensor) indexing is not supported yet."""
    items = index if isinstance(index, tuple) else (index,)
    shape = meta_of(x).shape
    consuming = [i for i in items if i is not None and i is not Ellipsis]
    if any(isinstance(i, (fx.Node, list, bool)) or (not isinstance(i, (int, slice))) for i in consuming):
        raise Unsupported("indexing with tensors, lists or booleans (advanced indexing) is not supported yet")
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise Unsupported("an index can only have a single ellipsis (eager raises)")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = (slice(None),) * (len(shape) - len(consuming))
        items = items[:at] + fill + items[at + 1:]
    slices, final, dim = [], [], 0
    for item in items:
        if item is None:
            final.append(1)
            continue
        size = shape[dim]
        if isinstance(item, int):
            i = item + size if item < 0 else item
            slices.append((dim, i, 1, 1))
        else:
            start, stop, step = item.indices(size)
            if step <= 0:
                raise Unsupported("step must be greater than zero (eager raises)")
            length = max(0, -(-(stop - start) // step))
            slices.append((dim, start, step, length))
            final.append(length)
        dim += 1
    final += list(shape[dim:])
    return slices, tuple(final)


@binds(_t("__getitem__"))
def _getitem(b, x, index):
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(item, fx.Node) for item in items):
        return _advanced_index(b, x, index)
    slices, final = _basic_index(x, index)
    out = x
    for dim, start, step, length in slices:
        out = C.emit_slice(b, out, dim, start, step, length)
    return C.emit_view(b, "reshape", out, shape=final)


@binds(_t("__setitem__"))
def _setitem(b, x, index, value):
    """x[index] = value, functionally: x with value scattered into the indexed positions."""
    if index is None or (isinstance(index, tuple) and None in index):
        raise Unsupported("assignment through an index with None")
    slices, final = _basic_index(x, index)
    shape = meta_of(x).shape
    slices = [s for s in slices if s[1:] != (0, 1, shape[s[0]])]  # whole dims need no scatter
    chain = [x]
    for dim, start, step, length in slices:
        chain.append(C.emit_slice(b, chain[-1], dim, start, step, length))
    target_shape = meta_of(chain[-1]).shape
    dtype = meta_of(x).dtype
    if isinstance(value, fx.Node):
        if meta_of(value).shape != tuple(final):
            value = _expand(b, value, final)
        new = C.emit_view(b, "reshape", value, shape=target_shape)
        if meta_of(new).dtype != dtype:
            new = C.emit_pointwise(b, "identity", [new], dtype=dtype, requires_grad=meta_of(new).requires_grad)
    else:
        new = C.emit_fill(b, target_shape, dtype, value)
    for (dim, start, step, length), base in zip(reversed(slices), reversed(chain[:-1])):
        new = C.emit_slice_scatter(b, base, new, dim, start, step, length)
    return new


@binds(torch.narrow, _t("narrow"))
def _narrow(b, x, dim, start, length):
    if isinstance(start, fx.Node):
        raise Unsupported("narrow with a tensor start")
    dim %= len(meta_of(x).shape)
    start = start + meta_of(x).shape[dim] if start < 0 else start
    return C.emit_slice(b, x, dim, start, 1, length)


@binds(torch.select, _t("select"))
def _select(b, x, dim, index):
    dim %= len(meta_of(x).shape)
    items = (slice(None),) * dim + (index,)
    return _getitem(b, x, items)


def _triangle(keep_lower):
    def bind(b, x, diagonal=0, *, out=None):
        _no_out({"out": out})
        shape = meta_of(x).shape
        if len(shape) < 2:
            raise Unsupported("tril/triu of a tensor with fewer than 2 dims (eager raises)")
        rows = C.emit_iota(b, shape, len(shape) - 2)
        cols = C.emit_iota(b, shape, len(shape) - 1)
        shifted = C.emit_pointwise(b, "add", [rows, int(diagonal)], dtype=torch.int64)
        keep = C.emit_pointwise(b, "le" if keep_lower else "ge", [cols, shifted], dtype=torch.bool)
        return C.emit_pointwise(b, "where", [keep, x, 0], dtype=meta_of(x).dtype)
    return bind
