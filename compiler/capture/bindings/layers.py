"""Bindings of layers: matmul, linear, addmm, convolutions, pooling and interpolation
(scaled dot-product attention: ``attention.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compiler.capture.bindings.handles import (
    Tensor,
    addmm,
    arange_along,
    bmm,
    conv,
    full,
    gather,
    mm,
    on_handles,
    pointwise,
    where,
)
from compiler.capture.bindings.indexing import _triangle
from compiler.capture.bindings.registry import Unsupported, _no_out, _t, binds
from compiler.capture.bindings.views import _interleave, _pad
from compiler.ir.graph import compute_dtype, numel, update_meta


# ----------------------------------------------------------------------------- matmul
def matmul(a: Tensor, w: Tensor) -> Tensor:
    """``torch.matmul``: 1-D operands get a unit dim (removed after); 2-D weights one mm over all
    rows of ``a``; otherwise one bmm over the broadcast batch dims."""
    sa, sw = a.shape, w.shape
    if a.dtype != w.dtype:
        raise Unsupported("matmul of tensors with different dtypes (eager raises)")
    if len(sa) == 0 or len(sw) == 0:
        raise Unsupported("matmul of a 0-d tensor (eager raises)")
    if len(sa) == 1 and len(sw) == 1:
        return (a * w).sum(0)
    if len(sw) == 1:  # [.., M, K] @ [K] -> [.., M]
        out = matmul(a, w.reshape(sw[0], 1))
        return out.reshape(out.shape[:-1])
    if len(sa) == 1:  # [K] @ [.., K, N] -> [.., N]
        out = matmul(a.reshape(1, sa[0]), w)
        return out.reshape(out.shape[:-2] + out.shape[-1:])
    if sa[-1] != sw[-2]:
        raise Unsupported(f"matmul shapes {list(sa)} and {list(sw)} do not match (eager raises)")
    if len(sw) == 2:  # the common case: activations @ weight — one mm over all rows
        rows = a.reshape(numel(sa[:-1]), sa[-1])
        return mm(rows, w).reshape(tuple(sa[:-1]) + (sw[-1],))
    batch = tuple(torch.broadcast_shapes(sa[:-2], sw[:-2]))
    nb = numel(batch)
    a3 = a.expand(batch + tuple(sa[-2:])).reshape((nb,) + tuple(sa[-2:]))
    w3 = w.expand(batch + tuple(sw[-2:])).reshape((nb,) + tuple(sw[-2:]))
    return bmm(a3, w3).reshape(batch + (sa[-2], sw[-1]))


@binds(torch.matmul, _t("matmul"), _t("__matmul__"), torch.mm, _t("mm"), torch.bmm, _t("bmm"))
@on_handles
def _matmul(b, a, w, *, out=None):
    _no_out({"out": out})
    return matmul(a, w)


def _conv_binding(dims):
    def bind(b, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
            raise Unsupported("convolution needs tensor input and weight")
        if input.ndim == dims + 1:  # unbatched: a batch of one, as eager
            out = bind(b, input.unsqueeze(0), weight, bias, stride, padding, dilation, groups)
            return out.reshape(out.shape[1:])
        if input.ndim != dims + 2:
            raise Unsupported(f"conv{dims}d of a {input.ndim}-d input (eager raises)")
        if input.dtype != weight.dtype or input.dtype.is_complex:
            raise Unsupported("convolution of mixed or complex dtypes is not supported yet")

        def per_dim(v):
            return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims
        stride, dilation = per_dim(stride), per_dim(dilation)
        kernel = weight.shape[2:]
        if padding == "valid":
            padding = 0
        if padding == "same":
            if any(s != 1 for s in stride):
                raise Unsupported("padding='same' with a stride other than 1 (eager raises)")
            totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if any(t % 2 for t in totals):
                # eager (Convolution.cpp, _convolution_mode): the odd element of a dim's padding goes
                # on the right, as a zero pad of the input, and the convolution pads evenly
                pad = []
                for t in reversed(totals):
                    pad += [0, t % 2]
                input = Tensor(b, _pad(b, input.node, pad, value=0.0))
            padding = tuple(t // 2 for t in totals)
        padding = per_dim(padding)
        spatial = tuple((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
                        zip(input.shape[2:], padding, dilation, kernel, stride))
        shape = (input.shape[0], weight.shape[0]) + spatial
        out = conv(input, weight, shape, list(stride), list(padding), list(dilation), int(groups))
        if bias is not None:
            out = out + bias.reshape((shape[1],) + (1,) * dims)
        return out
    return on_handles(bind)


binds(F.conv1d, torch.conv1d)(_conv_binding(1))
binds(F.conv2d, torch.conv2d)(_conv_binding(2))
binds(F.conv3d, torch.conv3d)(_conv_binding(3))


@binds(F.linear)
@on_handles
def _linear(b, x, weight, bias=None):
    """x @ weight.T + bias. NOTE: with a 1-D bias, one addmm over the rows of x flattened to
    2-D (as eager's linear does; a 1-D x as one row: its output, a view as eager's is): the bias is
    added by the matmul, not by another pass."""
    if isinstance(bias, Tensor) and bias.ndim == 1 and x.ndim >= 1 and weight.ndim == 2 and \
            x.dtype == weight.dtype == bias.dtype and x.shape[-1] == weight.shape[1] and \
            bias.shape[0] == weight.shape[0]:
        rows = x.reshape(numel(x.shape[:-1]), x.shape[-1])
        return addmm(bias, rows, weight.t()).reshape(tuple(x.shape[:-1]) + (weight.shape[0],))
    out = matmul(x, weight.t())
    if bias is not None:
        out = out + bias
    return out


@binds(torch.addmm, _t("addmm"))
@on_handles
def _addmm(b, input, mat1, mat2, *, beta=1, alpha=1, out=None):
    """beta * input + alpha * (mat1 @ mat2) (GPT-2's Conv1D layers call it with a bias)."""
    _no_out({"out": out})
    if not all(isinstance(t, Tensor) for t in (input, mat1, mat2)) or mat1.ndim != 2 or mat2.ndim != 2:
        raise Unsupported("addmm needs a tensor input and 2-D matrices (eager raises)")
    product_shape = (mat1.shape[0], mat2.shape[1])
    if beta == 1 and alpha == 1 and input.dtype == mat1.dtype == mat2.dtype and \
            tuple(torch.broadcast_shapes(input.shape, product_shape)) == product_shape:
        return addmm(input, mat1, mat2)
    product = matmul(mat1, mat2)
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # eager ignores input then (even NaN in it)
        return product
    return product + (input if beta == 1 else input * beta)


@binds(F.interpolate)
@on_handles
def _interpolate(b, input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False):
    """Nearest-neighbour upsampling by whole factors (each element copied into a block)."""
    if mode not in ("nearest", "nearest-exact") or antialias:
        raise Unsupported(f"interpolate(mode={mode!r}) is not supported yet (nearest only)")
    spatial = input.shape[2:]
    if size is not None:
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * len(spatial)
        factors = [o / i for o, i in zip(sizes, spatial)]
    else:
        factors = list(scale_factor) if isinstance(scale_factor, (tuple, list)) else [scale_factor] * len(spatial)
    if all(f == int(f) and f >= 1 for f in factors):
        return _interleave(b, input.node, {2 + i: int(f) for i, f in enumerate(factors)})
    # any other size: each output element reads the input element at eager's source index,
    # floor(dst * scale) ("nearest") or floor((dst + 0.5) * scale) ("nearest-exact"), computed in
    # float32 as eager's kernel computes it; a gather per dim (its gradient an index_add)
    out = input
    for i, n in enumerate(spatial):
        if size is not None:
            o = sizes[i]
            scale = n / o
        else:
            o = math.floor(n * factors[i])
            scale = n / o if recompute_scale_factor else 1.0 / factors[i]
        if o == n and scale == 1.0:
            continue
        if o <= 0:
            raise Unsupported("interpolate to an empty size (eager raises)")
        scale = torch.tensor(scale, dtype=torch.float32).item()
        dst = arange_along(b, (o,), 0).to(torch.float32)
        source = pointwise("floor", (dst + 0.5 if mode == "nearest-exact" else dst) * scale)
        index = pointwise("minimum", source, float(n - 1)).to(torch.int64)
        out = gather(out, index, "index_select", 2 + i)
    return out


def _pool_windows(x: Tensor, dims, kernel, stride, padding, fill, dilation=None, extra=None) -> Tensor:
    """x padded with ``fill`` and cut into windows: [..., out_1, ..., out_n, k_1, ..., k_n] (views;
    overlapping windows read the same elements, and their gradients add up). ``dilation``: window
    elements that many apart; ``extra``: more padding on the right (ceil_mode's last windows)."""
    dilation = dilation or (1,) * dims
    extra = extra or (0,) * dims
    x = _padded(x, padding, extra, fill)
    lead = x.ndim - dims
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        if k == s and d == 1:
            x = _tiles(x, lead + i, k)
            continue
        x = x.unfold(lead + i, (k - 1) * d + 1, s)
        if d != 1:
            x = x.slice(x.ndim - 1, 0, d, k)
    return x


def _padded(x: Tensor, padding, extra, fill) -> Tensor:
    """x padded with ``fill`` on both sides of its last dims (``extra`` more on the right)."""
    if not (any(padding) or any(extra)):
        return x
    pad = []
    for p, e in zip(reversed(padding), reversed(extra)):
        pad += [p, p + e]
    return Tensor(x.b, _pad(x.b, x.node, pad, value=fill))


def _tiles(x: Tensor, dim: int, k: int) -> Tensor:
    """``x.unfold(dim, k, k)`` (windows that tile ``dim``) as a reshape: [..., size // k, k, ...] with
    the window's dim moved last. The same values; its gradient is the reshape's, each element's
    from its one window, where unfold's adds a slice_scatter per window position (an adaptive
    pool to 1x1 over 16x16: 16 per dim, each read at every element)."""
    size = x.shape[dim]
    if size % k:
        x = x.slice(dim, 0, 1, size - size % k)   # (the elements past the last window: in none)
    shape = list(x.shape)
    x = x.reshape(shape[:dim] + [size // k, k] + shape[dim + 1:])
    order = [a for a in range(x.ndim) if a != dim + 1] + [dim + 1]
    return x.permute(order)


def _pool_args(dims, kernel_size, stride, padding, dilation, ceil_mode, spatial=None):
    """(kernel, stride, padding, dilation, extra right padding) per dim. ceil_mode adds a last
    window where one starts inside the input or its left padding, as eager (extra padding)."""
    def per_dim(v):  # an int or a 1-element sequence applies to every dim, as in eager
        v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        return v * dims if len(v) == 1 else v
    kernel = per_dim(kernel_size)
    stride = kernel if stride is None or stride == [] or stride == () else per_dim(stride)
    padding, dilation = per_dim(padding), per_dim(dilation)
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise Unsupported("pooling padding larger than half the window (eager raises)")
    extra = [0] * dims
    if ceil_mode and spatial is not None:
        for i, (size, k, s, p, d) in enumerate(zip(spatial, kernel, stride, padding, dilation)):
            span = size + 2 * p - d * (k - 1) - 1
            out = -(-span // s) + 1   # (a window may overhang the padding by less than a stride)
            if (out - 1) * s >= size + p:
                out -= 1
            if out < 1:
                raise Unsupported("pooling window larger than the padded input (eager raises)")
            extra[i] = max(0, (out - 1) * s + d * (k - 1) + 1 - (size + 2 * p))
    elif ceil_mode:
        raise Unsupported("pooling with ceil_mode is not supported here")
    return kernel, stride, padding, dilation, tuple(extra)


def _avg_pool(dims):
    def bind(b, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None):
        spatial = x.shape[-dims:]
        kernel, stride, padding, _, extra = _pool_args(dims, kernel_size, stride, padding, 1, ceil_mode, spatial)
        window_dims = tuple(range(-dims, 0))
        total = _pool_windows(x, dims, kernel, stride, padding, 0.0, extra=extra).sum(window_dims)
        if divisor_override is not None:
            return total / float(divisor_override)
        if not any(extra) and (count_include_pad or not any(padding)):
            return total / float(numel(kernel))
        return (total / _window_counts(b, total.shape, spatial, kernel, stride, padding, count_include_pad)).to(x.dtype)
    return on_handles(bind)


def _window_counts(b, shape, spatial, kernel, stride, padding, count_include_pad) -> Tensor:
    """Each average-pooling window's divisor, as eager's avg_pool kernels count it (float32,
    whole numbers): per pooled dim, the window from start = o * stride - padding to start +
    kernel, cut at the padded input's end (ceil_mode's last windows reach past it), and with
    ``count_include_pad=False`` cut to the input itself; the product over the dims."""
    dims = len(kernel)
    count = None
    for j, (size, k, s, p) in enumerate(zip(spatial, kernel, stride, padding)):
        start = arange_along(b, shape, len(shape) - dims + j).to(torch.float32) * float(s) - float(p)
        end = pointwise("minimum", start + float(k), float(size + p))
        if not count_include_pad:
            start = pointwise("maximum", start, 0.0)
            end = pointwise("minimum", end, float(size))
        length = end - start
        count = length if count is None else count * length
    return count


def _adaptive_avg_pool(dims):
    def bind(b, x, output_size):
        out = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * dims
        sizes = x.shape[-dims:]
        out = tuple(s if o is None else o for s, o in zip(sizes, out))
        if any(o == 0 for o in out):
            raise Unsupported("adaptive_avg_pool to an empty size is not supported yet")
        if all(s % o == 0 for s, o in zip(sizes, out)):  # windows that tile: one unfold per dim
            kernel = tuple(s // o for s, o in zip(sizes, out))
            return _pool_windows(x, dims, kernel, kernel, (0,) * dims, 0.0).mean(tuple(range(-dims, 0)))
        dtype = x.dtype
        x = x.to(compute_dtype(dtype))  # half types: summed and divided in float32, rounded once
        for j, (s, o) in enumerate(zip(sizes, out)):
            if s % o:
                x = _adaptive_mean(x, x.ndim - dims + j, s, o)
        # the dims whose windows tile: their mean over windows of s // o
        kernel = tuple(s // o if s % o == 0 else 1 for s, o in zip(sizes, out))
        if any(k != 1 for k in kernel):
            x = _pool_windows(x, dims, kernel, kernel, (0,) * dims, 0.0).mean(tuple(range(-dims, 0)))
        return x.to(dtype)
    return on_handles(bind)


def _adaptive_mean(x: Tensor, dim: int, size: int, out: int) -> Tensor:
    """The mean along ``dim`` over adaptive pooling's windows, eager's: output o averages input
    elements floor(o * size / out) to ceil((o + 1) * size / out) (windows of two lengths that
    may overlap). A gather of each window's elements, padded to the longest window by
    repeating its last element, masked to 0 there, summed and divided by the window's length.
    NOTE: a mean over a rectangle taken one dim after another (as here) equals eager's single
    mean over it, up to rounding."""
    longest = max(-(-(o + 1) * size // out) - o * size // out for o in range(out))

    def bounds(shape):  # (start, end) of output o's window, o along dim 0 of ``shape`` (float64, exact)
        o = arange_along(x.b, shape, 0).to(torch.float64)
        start = pointwise("floor", o * float(size) / float(out))
        return start, -pointwise("floor", -(o + 1.0) * float(size) / float(out))

    grid = (out, longest)
    start, end = bounds(grid)
    at = start + arange_along(x.b, grid, 1).to(torch.float64)
    index = pointwise("minimum", at, end - 1.0).to(torch.int64).reshape(out * longest)
    rest = tuple(x.shape[dim + 1:])
    picked = gather(x, index, "index_select", dim).reshape(tuple(x.shape[:dim]) + grid + rest)
    inside = (at < end).reshape(grid + (1,) * len(rest))
    total = where(inside, picked, 0.0, dtype=x.dtype).sum(dim + 1)
    start, end = bounds((out,) + (1,) * len(rest))
    return total / (end - start).to(x.dtype)


# windows of at most this many elements are pooled elementwise (``_max_of_elements``), larger ones
# as reductions over the window's dims (Inductor's threshold for unrolling a pool's window is 25)
_UNROLLED_WINDOW = 25


def _max_pool(dims):
    """Max over windows (padding counts as -inf). Eager's gradient goes to the first maximum of
    each window (not shared among ties, unlike amax): the window's first maximal position is
    found from detached values, and the result is the element there, so autodiff sends the
    gradient to it alone; overlapping windows add up. NaN counts as the maximum, as in eager.
    ``return_indices``: that element's flat index in its input plane, as eager's."""
    def bind(b, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        if x.ndim < dims + 1 or any(s == 0 for s in x.shape):
            raise Unsupported("max_pool of an empty or unbatched-without-channels input is not supported yet")
        kernel, stride, padding, dilation, extra = _pool_args(dims, kernel_size, stride, padding, dilation,
                                                              ceil_mode, x.shape[-dims:])
        if any(k > s for k, s in zip(kernel, stride)):
            # NOTE: overlapping windows read each element several times (3x3/2: 2.25): a computed input
            # (a batch norm's ReLU) is stored once, not computed again at every window reading it
            update_meta(x.node, materialize=True)
        if numel(kernel) <= _UNROLLED_WINDOW:
            return _max_of_elements(b, x, dims, kernel, stride, padding, dilation, extra, return_indices)
        windows = _pool_windows(x, dims, kernel, stride, padding, float("-inf"), dilation, extra)
        window_dims = tuple(range(windows.ndim - dims, windows.ndim))
        values = windows.detach()
        hit = (values == values.amax(window_dims, keepdim=True)) | (values != values)
        position = None  # row-major position inside the window, as a float (small integers)
        for d, k in zip(window_dims, kernel):
            at = arange_along(b, windows.shape, d).to(torch.float32)
            position = at if position is None else position * float(k) + at
        negated = where(hit, -position, -float(numel(kernel)))
        first = -negated.amax(window_dims, keepdim=True)
        out = where(position == first, windows, 0.0, dtype=x.dtype).sum(window_dims)
        if not return_indices:
            return out
        return out, _pool_indices(b, first.reshape(out.shape), x.shape[-dims:], kernel, stride, padding, dilation)
    return on_handles(bind)


def _max_of_elements(b, x: Tensor, dims, kernel, stride, padding, dilation, extra, return_indices):
    """``_max_pool``'s result for a small window, elementwise: each window element a strided view of
    the padded input (``_window_elements``), scanned in order for the first maximum (NaN counts as
    the maximum: the first NaN), the result the element there. No reduction: the pooled values
    and the position of each window's maximum are computed in one pass over the outputs, as one
    vectorizable elementwise kernel (Inductor unrolls small windows alike); the gradient goes to
    the element at that position, the elements' views adding up where windows overlap."""
    elements = _window_elements(x, dims, kernel, stride, padding, float("-inf"), dilation, extra)
    best, first = elements[0].detach(), None
    for k, element in enumerate(elements[1:], 1):
        value = element.detach()
        better = (value > best) | ((value != value) & (best == best))
        best = where(better, value, best)
        first = where(better, float(k), 0.0 if first is None else first, dtype=torch.float32)
    if first is None:   # (a window of one element)
        first = full(b, elements[0].shape, 0.0, torch.float32)
    update_meta(first.node, never_recomputed=True)   # (the backward reads it at every element's view)
    out = None
    for k, element in enumerate(elements):
        term = where(first == float(k), element, 0.0, dtype=x.dtype)
        out = term if out is None else out + term
    # (the gradient is read at each element's view, and the input's, a sum over the views, by
    # whatever comes before: a batch norm's backward reads it in two kernels; each computed once)
    update_meta(out.node, materialize_grad=True)
    update_meta(x.node, materialize_grad=True)
    if not return_indices:
        return out
    return out, _pool_indices(b, first, x.shape[-dims:], kernel, stride, padding, dilation)


def _window_elements(x: Tensor, dims, kernel, stride, padding, fill, dilation, extra) -> list:
    """The windows' elements in row-major window order, each a view [..., out_1, ..., out_n] of x
    padded with ``fill``: element k of every window (``_pool_windows``' windows, taken apart)."""
    x = _padded(x, padding, extra, fill)
    lead = x.ndim - dims
    elements = [x]
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        out = (x.shape[lead + i] - d * (k - 1) - 1) // s + 1
        elements = [e.slice(lead + i, j * d, s, out) for e in elements for j in range(k)]
    return elements


def _pool_indices(b, first: Tensor, spatial, kernel, stride, padding, dilation) -> Tensor:
    """The flat input index (over the pooled dims) of each window's element at row-major window
    position ``first`` (float64 arithmetic on whole numbers: exact)."""
    dims = len(kernel)
    first = first.to(torch.float64)
    index = None
    inner = numel(kernel)
    for j in range(dims):
        inner //= kernel[j]
        k_j = pointwise("floor", first / float(inner)) - pointwise("floor", first / float(inner * kernel[j])) * \
            float(kernel[j])
        out_j = arange_along(b, first.shape, first.ndim - dims + j).to(torch.float64)
        coordinate = out_j * float(stride[j]) - float(padding[j]) + k_j * float(dilation[j])
        index = coordinate if index is None else index * float(spatial[j]) + coordinate
    return index.to(torch.int64)


def _with_indices(bind):
    def bind_with_indices(b, *args, **kwargs):
        return bind(b, *args, **{**kwargs, "return_indices": True})
    return bind_with_indices


for _dims in (1, 2, 3):
    # F.max_pool2d dispatches on return_indices to F._max_pool2d or F.max_pool2d_with_indices
    binds(getattr(F, f"max_pool{_dims}d"), getattr(F, f"_max_pool{_dims}d"))(_max_pool(_dims))
    binds(getattr(F, f"max_pool{_dims}d_with_indices"))(_with_indices(_max_pool(_dims)))
binds(F.avg_pool1d, torch.avg_pool1d)(_avg_pool(1))
binds(F.avg_pool2d, torch._C._nn.avg_pool2d)(_avg_pool(2))
binds(F.avg_pool3d, torch._C._nn.avg_pool3d)(_avg_pool(3))
binds(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d)(_adaptive_avg_pool(1))
binds(F.adaptive_avg_pool2d)(_adaptive_avg_pool(2))
binds(F.adaptive_avg_pool3d)(_adaptive_avg_pool(3))


binds(torch.tril, _t("tril"))(_triangle(True))
binds(torch.triu, _t("triu"))(_triangle(False))
