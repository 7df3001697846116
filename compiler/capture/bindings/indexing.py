"""Bindings of indexing: embedding, gather, index_select, x[...] reads and writes, narrow,
select, tril/triu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, arange_along, full, gather, on_handles, where
from compiler.capture.bindings.registry import Unsupported, _in_place_variant, _no_out, _t, binds
from compiler.ir.ops import routing


@binds(F.embedding)
@on_handles
def _embedding(b, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    if max_norm is not None:
        raise Unsupported("embedding(max_norm=...) renormalizes the weight in place; not supported yet")
    if scale_grad_by_freq or sparse:
        raise Unsupported("embedding with scale_grad_by_freq or sparse gradients is not supported yet")
    if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
        raise Unsupported("embedding needs tensor indices and weight")
    _check_index(input, "embedding")
    if weight.ndim != 2:
        raise Unsupported("embedding weight must be 2-D")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return gather(weight, input, "embedding", 0, padding_idx=padding_idx)


@binds(torch.embedding)
def _torch_embedding(b, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _embedding(b, indices, weight, None if padding_idx == -1 else padding_idx,
                      scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)


def _check_index(index, what) -> Tensor:
    """The index as int64 or int32. An empty index of another integer dtype (uint8) is cast:
    eager's gather checks the dtype only where there is an element to read."""
    if not isinstance(index, Tensor):
        raise Unsupported(f"{what} needs a tensor index")
    if index.dtype not in (torch.int64, torch.int32):
        if index.numel() == 0 and not (index.dtype.is_floating_point or index.dtype.is_complex) and what == "gather":
            return index.to(torch.int64)
        raise Unsupported(f"{what} indices must be int64 or int32, not {index.dtype}")
    return index


@binds(torch.gather, _t("gather"))
@on_handles
def _gather(b, x, dim, index, *, sparse_grad=False, out=None):
    _no_out({"out": out})
    index = _check_index(index, "gather")
    if x.ndim == 0 and index.ndim <= 1:
        # a 0-d input reads as a 1-element one (eager: any 0-d or 1-d index of in-range zeros)
        if dim not in (0, -1):
            raise Unsupported(f"gather: dim {dim} of a 0-d tensor (eager raises)")
        return gather(x.reshape(1), index.reshape(index.numel()), "gather", 0).reshape(index.shape)
    dim %= max(x.ndim, 1)
    if index.ndim != x.ndim or any(i > s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != dim):
        if index.numel() == 0:  # eager checks no shapes where there is nothing to read: an empty result
            return gather(x.reshape(x.numel()), index.reshape(0), "gather", 0).reshape(index.shape)
        raise Unsupported("gather: index must have the input's rank and fit it outside dim (eager raises)")
    return gather(x, index, "gather", dim)


@binds(torch.index_select, _t("index_select"))
@on_handles
def _index_select(b, x, dim, index, *, out=None):
    _no_out({"out": out})
    index = _check_index(index, "index_select")
    if index.ndim > 1:
        raise Unsupported("index_select needs a 1-D index (eager raises)")
    if x.ndim == 0:
        # eager: a 0-d result, the element itself, for an index of one element (that must be 0)
        if dim not in (0, -1) or index.numel() != 1:
            raise Unsupported("index_select of a 0-d tensor needs dim 0 and one index (eager raises)")
        return gather(x.reshape(1), index.reshape(1), "index_select", 0).reshape(())
    dim %= max(x.ndim, 1)
    return gather(x, index.reshape(1) if index.ndim == 0 else index, "index_select", dim)


def _advanced_index(x: Tensor, index) -> Tensor:
    """x[..., idx, ...] with one integer index tensor and otherwise whole dims: a gather along
    that dim (negative indices count from the end, as in eager)."""
    items = index if isinstance(index, tuple) else (index,)
    tensors = [i for i, item in enumerate(items) if isinstance(item, Tensor)]
    if len(tensors) != 1:
        return _index_extern(x, items)
    at = tensors[0]
    idx = items[at]
    if idx.dtype == torch.bool:
        raise Unsupported("indexing with a boolean mask has a data-dependent shape")
    _check_index(idx, "indexing")
    if Ellipsis in items[at + 1:]:
        raise Unsupported("an ellipsis after an index tensor is not supported yet")
    if Ellipsis in items[:at]:
        dim = x.ndim - (len(items) - at)
    else:
        dim = at
    others = [item for i, item in enumerate(items) if i != at and item is not Ellipsis]
    if any(not (isinstance(item, slice) and item == slice(None)) for item in others):
        raise Unsupported("mixing an index tensor with ints, slices or None is not supported yet")
    return gather(x, idx, "index_select", dim, wrap=True)


# ----------------------------------------------------------------------------- indexing
def _basic_index(x: Tensor, index):
    """Split a basic index (ints, slices, None, ...) into per-dim slices of ``x`` and the final
    shape; advanced (tensor) indexing is not supported yet."""
    items = index if isinstance(index, tuple) else (index,)
    shape = x.shape
    consuming = [i for i in items if i is not None and i is not Ellipsis]
    if any(isinstance(i, (Tensor, list, bool)) or (not isinstance(i, (int, slice))) for i in consuming):
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
@on_handles
def _getitem(b, x, index):
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(item, Tensor) for item in items):
        return _advanced_index(x, index)
    slices, final = _basic_index(x, index)
    out = x
    for dim, start, step, length in slices:
        out = out.slice(dim, start, step, length)
    return out.reshape(final)


def _index_layout(x: Tensor, items, what):
    """(layout, index tensors) of aten.index/index_put for ``items`` made of index tensors,
    whole-dim slices and one ellipsis: per indexed dim, None (whole) or its tensor's position."""
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise Unsupported("an index can only have a single ellipsis (eager raises)")
    if any(item is Ellipsis for item in items):  # by identity: ``in`` would compare handles elementwise
        at = next(i for i, item in enumerate(items) if item is Ellipsis)
        items = items[:at] + (slice(None),) * (x.ndim - len(items) + 1) + items[at + 1:]
    layout, tensors = [], []
    for item in items:
        if isinstance(item, Tensor):
            if item.dtype not in (torch.int64, torch.int32, torch.bool, torch.uint8):
                raise Unsupported(f"{what}: index tensors must be integer or boolean, not {item.dtype} (eager raises)")
            layout.append(len(tensors))
            tensors.append(item)
        elif isinstance(item, slice) and item == slice(None):
            layout.append(None)
        else:
            raise Unsupported(f"{what}: mixing index tensors with ints, slices or None is not supported yet")
    if len(layout) > x.ndim:
        raise Unsupported(f"{what}: too many indices (eager raises)")
    return layout, tensors


def _index_extern(x: Tensor, items) -> Tensor:
    """x[i, j, ...] with several index tensors: aten.index (PyTorch's kernel)."""
    layout, tensors = _index_layout(x, items, "indexing")
    if any(t.dtype in (torch.bool, torch.uint8) for t in tensors):
        raise Unsupported("indexing with a boolean mask has a data-dependent shape")
    try:
        node = routing.emit_advanced_index(x.b, x.node, [t.node for t in tensors], layout)
    except (IndexError, RuntimeError) as e:
        raise Unsupported(f"indexing: {e} (eager raises)") from None
    return Tensor(x.b, node)


def _setitem_tensors(b, x: Tensor, items, value) -> Tensor:
    """x[i, j, ...] = value with index tensors (integer or boolean): index_put."""
    layout, tensors = _index_layout(x, items, "assignment")
    if isinstance(value, Tensor) and value.requires_grad and any(t.dtype in (torch.bool, torch.uint8) for t in tensors):
        raise Unsupported("assignment through a boolean mask of a value that requires grad (its gradient has a "
                          "data-dependent shape)")
    if isinstance(value, Tensor):
        new = value.to(x.dtype) if value.dtype != x.dtype else value
    elif isinstance(value, (int, float, bool)):
        new = full(b, (), value, x.dtype)
    else:
        raise Unsupported("assignment of a value that is neither a tensor nor a number")
    return Tensor(b, routing.emit_index_put(b, x.node, new.node, [t.node for t in tensors], layout))


@binds(_t("__setitem__"))
@on_handles
def _setitem(b, x, index, value):
    """x[index] = value, functionally: x with value scattered into the indexed positions."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(item, Tensor) for item in items):
        return _setitem_tensors(b, x, items, value)
    if index is None or (isinstance(index, tuple) and None in index):
        raise Unsupported("assignment through an index with None")
    slices, final = _basic_index(x, index)
    slices = [s for s in slices if s[1:] != (0, 1, x.shape[s[0]])]  # whole dims need no scatter
    chain = [x]
    for dim, start, step, length in slices:
        chain.append(chain[-1].slice(dim, start, step, length))
    target_shape = chain[-1].shape
    if isinstance(value, Tensor):
        if value.shape != tuple(final):
            value = value.expand(final)
        new = value.reshape(target_shape).to(x.dtype)
    else:
        new = full(b, target_shape, value, x.dtype)
    for (dim, start, step, length), base in zip(reversed(slices), reversed(chain[:-1])):
        new = base.slice_scatter(new, dim, start, step, length)
    return new


@binds(torch.narrow, _t("narrow"))
@on_handles
def _narrow(b, x, dim, start, length):
    if isinstance(start, Tensor):
        raise Unsupported("narrow with a tensor start")
    dim %= x.ndim
    start = start + x.shape[dim] if start < 0 else start
    return x.slice(dim, start, 1, length)


@binds(torch.select, _t("select"))
@on_handles
def _select(b, x, dim, index):
    dim %= x.ndim
    items = (slice(None),) * dim + (index,)
    return _getitem(b, x, items)


def _triangle(keep_lower):
    """tril (``keep_lower``) or triu: x where the column is at most (least) the row + ``diagonal``, else 0."""
    def bind(b, x, diagonal=0, *, out=None):
        _no_out({"out": out})
        if x.ndim < 2:
            raise Unsupported("tril/triu of a tensor with fewer than 2 dims (eager raises)")
        rows, cols = arange_along(b, x.shape, x.ndim - 2), arange_along(b, x.shape, x.ndim - 1)
        keep = cols <= rows + int(diagonal) if keep_lower else cols >= rows + int(diagonal)
        return where(keep, x, 0, dtype=x.dtype)
    return on_handles(bind)


@binds(torch.index_put, _t("index_put"))
@on_handles
def _index_put(b, x, indices, values, accumulate=False):
    layout, tensors = _index_layout(x, tuple(indices), "index_put")
    if not isinstance(values, Tensor) or values.dtype != x.dtype:
        raise Unsupported("index_put needs values of the tensor's dtype (eager raises)")
    return Tensor(b, routing.emit_index_put(b, x.node, values.node, [t.node for t in tensors], layout,
                                            accumulate=bool(accumulate)))


binds(_t("index_put_"))(_in_place_variant(_index_put))
