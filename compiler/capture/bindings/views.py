"""Bindings of views and data movement: reshape, permute, transpose, expand, squeeze, flatten,
repeat, pad, split/chunk/unbind, cat/stack.

These stay on ``fx.Node``s: they are mostly shape arithmetic around one view, and the handles
(``handles.py``) build their view methods on them (``_expand``, ``_transpose``, ``_t_``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.capture.bindings.registry import Unsupported, _no_out, _t, binds
from compiler.ir.graph import meta_of, numel, result_dtype
from compiler.ir.ops import catalog as C


# ----------------------------------------------------------------------------- views
def _shape_arg(x, shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(s, int) for s in shape):
        raise Unsupported("view/reshape with a non-integer size")
    total = numel(meta_of(x).shape)
    if shape.count(-1) > 1:
        raise Unsupported("more than one -1 in a shape")
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        shape = tuple(total // known if s == -1 else s for s in shape)
    if numel(shape) != total:
        raise Unsupported(f"shape {list(shape)} is invalid for input of size {total}")
    return tuple(shape)


@binds(torch.reshape, _t("reshape"), _t("view"))
def _reshape(b, x, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise Unsupported("Tensor.view(dtype) is not supported yet")
    return C.emit_view(b, "reshape", x, shape=_shape_arg(x, shape))


@binds(_t("view_as"), _t("reshape_as"))
def _view_as(b, x, other):
    return C.emit_view(b, "reshape", x, shape=meta_of(other).shape)


@binds(torch.flatten, _t("flatten"))
def _flatten(b, x, start_dim=0, end_dim=-1):
    shape = list(meta_of(x).shape)
    if not shape:
        return C.emit_view(b, "reshape", x, shape=(1,))
    s, e = start_dim % len(shape), end_dim % len(shape)
    return C.emit_view(b, "reshape", x, shape=shape[:s] + [numel(shape[s:e + 1])] + shape[e + 1:])


@binds(torch.unsqueeze, _t("unsqueeze"))
def _unsqueeze(b, x, dim):
    shape = list(meta_of(x).shape)
    shape.insert(dim % (len(shape) + 1), 1)
    return C.emit_view(b, "reshape", x, shape=shape)


@binds(torch.squeeze, _t("squeeze"))
def _squeeze(b, x, dim=None):
    shape = meta_of(x).shape
    if dim is None:
        dims = range(len(shape))
    else:
        dims = [d % max(len(shape), 1) for d in ((dim,) if isinstance(dim, int) else dim)]
    new = [s for i, s in enumerate(shape) if not (i in dims and s == 1)]
    return C.emit_view(b, "reshape", x, shape=new)


@binds(torch.permute, _t("permute"))
def _permute(b, x, *dims):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    ndim = len(meta_of(x).shape)
    return C.emit_view(b, "permute", x, dims=tuple(d % ndim for d in dims))


@binds(torch.transpose, _t("transpose"), torch.swapaxes, _t("swapaxes"))
def _transpose(b, x, dim0, dim1):
    ndim = len(meta_of(x).shape)
    dims = list(range(ndim))
    if ndim:
        dims[dim0 % ndim], dims[dim1 % ndim] = dims[dim1 % ndim], dims[dim0 % ndim]
    return C.emit_view(b, "permute", x, dims=tuple(dims))


@binds(torch.t, _t("t"))
def _t_(b, x):
    if len(meta_of(x).shape) < 2:
        return x
    return C.emit_view(b, "permute", x, dims=(1, 0))


@binds(_t("mT"))
def _mT(b, x):
    return _transpose(b, x, -2, -1)


@binds(_t("T"))
def _T(b, x):
    """Tensor.T reverses all dims (the same as mT only for 2 dims)."""
    ndim = len(meta_of(x).shape)
    return x if ndim < 2 else C.emit_view(b, "permute", x, dims=tuple(reversed(range(ndim))))


@binds(_t("expand"))
def _expand(b, x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    lead = len(shape) - len(meta_of(x).shape)
    full = tuple(meta_of(x).shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
    if lead:
        x = C.emit_view(b, "reshape", x, shape=(1,) * lead + tuple(meta_of(x).shape))
    return C.emit_view(b, "expand", x, shape=full)


@binds(_t("expand_as"))
def _expand_as(b, x, other):
    return _expand(b, x, meta_of(other).shape)


@binds(_t("contiguous"))
def _contiguous(b, x, memory_format=torch.contiguous_format):
    return x  # values are layout-free here; where eager copies, capture makes the copy


def _interleave(b, x, dims_and_repeats):
    """Each element repeated r times in place along each given dim (nearest upsampling,
    repeat_interleave): a unit dim after it, expanded to r, merged back. A copy, as in eager;
    the gradient sums each group of copies."""
    shape = list(meta_of(x).shape)
    split, expanded, final = [], [], []
    for d, n in enumerate(shape):
        r = dims_and_repeats.get(d, 1)
        split += [n, 1]
        expanded += [n, r]
        final.append(n * r)
    x = C.emit_view(b, "reshape", x, shape=tuple(split))
    x = _expand(b, x, tuple(expanded))
    out = C.emit_view(b, "reshape", x, shape=tuple(final))
    return C.emit_pointwise(b, "identity", [out], dtype=meta_of(out).dtype)


@binds(torch.repeat_interleave, _t("repeat_interleave"))
def _repeat_interleave(b, x, repeats=None, dim=None, *, output_size=None):
    if not isinstance(repeats, int):
        # NOTE: the result's size is the sum of the repeats' values, which eager reads on the host
        # (and, given output_size, checks against it, raising where they differ): a recording
        # cannot hold it, and a replay could not check it without reading them back
        raise Unsupported("repeat_interleave with tensor repeats: its output size is the sum of their values "
                          "(data-dependent, read and checked on the host)")
    if dim is None:
        x = C.emit_view(b, "reshape", x, shape=(numel(meta_of(x).shape),))
        dim = 0
    return _interleave(b, x, {dim % len(meta_of(x).shape): repeats})


@binds(_t("unfold"))
def _unfold(b, x, dimension, size, step):
    if not meta_of(x).shape:
        # eager: a 0-d tensor unfolds as one window of itself, shape (1,) (size must be 1)
        if dimension not in (0, -1) or size != 1 or step <= 0:
            raise Unsupported("unfold of a 0-d tensor: only dim 0, size 1 and a positive step are compiled")
        return C.emit_view(b, "reshape", x, shape=(1,))
    if size <= 0 or step <= 0:
        raise Unsupported("unfold needs a positive size and step (eager raises)")
    dim = dimension % max(len(meta_of(x).shape), 1)
    if size > meta_of(x).shape[dim]:
        raise Unsupported("unfold: the window is larger than the dim (eager raises)")
    return C.emit_view(b, "unfold", x, dim=dim, size=size, step=step)


@binds(F.pad)
def _pad(b, input, pad, mode="constant", value=None):
    """Constant padding, one dim at a time from the last (a negative pad crops): the input
    slice-scattered into a filled tensor; its gradient is the slice."""
    if mode != "constant":
        raise Unsupported(f"pad(mode={mode!r}) is not supported yet")
    fill = 0 if value is None else value
    x, ndim = input, len(meta_of(input).shape)
    for k in range(len(pad) // 2):
        dim = ndim - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        size = meta_of(x).shape[dim]
        start, stop = max(-before, 0), size - max(-after, 0)
        if start or stop != size:
            x = C.emit_slice(b, x, dim, start, 1, stop - start)
        if before > 0 or after > 0:
            target = list(meta_of(x).shape)
            n = target[dim]
            target[dim] = n + max(before, 0) + max(after, 0)
            base = C.emit_fill(b, tuple(target), meta_of(input).dtype, fill)
            x = C.emit_slice_scatter(b, base, x, dim, max(before, 0), 1, n)
    return x


@binds(_t("repeat"))
def _repeat(b, x, *sizes):
    """x.repeat(r0, r1, ...): each dim d of size n becomes r copies, as expand on a new dim
    in front of it and a reshape merging the two (a copy, as in eager)."""
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes
    shape = meta_of(x).shape
    if len(sizes) < len(shape):
        raise Unsupported("repeat with fewer sizes than dims (eager raises)")
    shape = (1,) * (len(sizes) - len(shape)) + tuple(shape)
    x = C.emit_view(b, "reshape", x, shape=shape)
    interleaved, expanded = [], []
    for r, n in zip(sizes, shape):
        interleaved += [1, n]
        expanded += [r, n]
    x = C.emit_view(b, "reshape", x, shape=tuple(interleaved))
    x = _expand(b, x, tuple(expanded))
    out = C.emit_view(b, "reshape", x, shape=tuple(r * n for r, n in zip(sizes, shape)))
    return C.emit_pointwise(b, "identity", [out], dtype=meta_of(out).dtype)


# ----------------------------------------------------------------------------- split, cat, masks
@binds(torch.split, _t("split"))
def _split(b, x, split_size_or_sections, dim=0):
    size = meta_of(x).shape[dim % len(meta_of(x).shape)]
    dim %= len(meta_of(x).shape)
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        sizes = [min(step, size - i) for i in range(0, size, step)] or [0]
    else:
        sizes = list(split_size_or_sections)
    out, start = [], 0
    for n in sizes:
        out.append(C.emit_slice(b, x, dim, start, 1, n))
        start += n
    return tuple(out)


@binds(torch.chunk, _t("chunk"))
def _chunk(b, x, chunks, dim=0):
    size = meta_of(x).shape[dim % len(meta_of(x).shape)]
    step = -(-size // chunks)
    return _split(b, x, step, dim)


@binds(torch.unbind, _t("unbind"))
def _unbind(b, x, dim=0):
    dim %= len(meta_of(x).shape)
    shape = meta_of(x).shape
    return tuple(C.emit_view(b, "reshape", C.emit_slice(b, x, dim, i, 1, 1), shape=shape[:dim] + shape[dim + 1:])
                 for i in range(shape[dim]))


@binds(torch.cat, torch.concat, torch.concatenate)
def _cat(b, tensors, dim=0, *, out=None):
    _no_out({"out": out})
    if not tensors or not all(isinstance(t, fx.Node) for t in tensors):
        raise Unsupported("cat of non-tensors")
    # NOTE: eager skips empty 1-d tensors in the shape check (legacy) but not in type promotion,
    # and gives them an empty gradient: they join the chain below as a slice of length 0.
    dtype = result_dtype(tensors)
    # (only empty 1-d tensors: an empty 1-d result, each input's gradient an empty slice)
    shaped = [t for t in tensors if not _empty_1d(t)] or tensors[:1]
    ndim = len(meta_of(shaped[0]).shape)
    dim %= ndim
    shape = list(meta_of(shaped[0]).shape)
    shape[dim] = sum(meta_of(t).shape[dim] for t in shaped)
    # NOTE: concatenation is a chain of slice-scatters into a buffer of the result's shape:
    # each element reads exactly one input, and the gradient of each input is its slice.
    out = C.emit_fill(b, tuple(shape), dtype, 0)
    start = 0
    for t in tensors:
        if _empty_1d(t):
            if not meta_of(t).requires_grad:
                continue
            t = C.emit_view(b, "reshape", t, shape=tuple(0 if d == dim else size for d, size in enumerate(shape)))
        n = meta_of(t).shape[dim]
        if meta_of(t).dtype != dtype:
            t = C.emit_pointwise(b, "identity", [t], dtype=dtype)
        out = C.emit_slice_scatter(b, out, t, dim, start, 1, n)
        start += n
    return out


def _empty_1d(t) -> bool:
    return meta_of(t).shape == (0,)


@binds(torch.stack)
def _stack(b, tensors, dim=0, *, out=None):
    _no_out({"out": out})
    ndim = len(meta_of(tensors[0]).shape) + 1
    dim %= ndim
    expanded = []
    for t in tensors:
        shape = list(meta_of(t).shape)
        shape.insert(dim, 1)
        expanded.append(C.emit_view(b, "reshape", t, shape=shape))
    return _cat(b, expanded, dim)
