"""Bindings of layers: matmul, linear, addmm, convolutions, pooling, interpolation and
scaled dot-product attention.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.bindings.elementwise import _pointwise
from compiler.bindings.indexing import _triangle
from compiler.bindings.random import _dropout
from compiler.bindings.handles import Tensor
from compiler.bindings.reductions import _shifted
from compiler.bindings.registry import Unsupported, _no_out, _t, binds
from compiler.bindings.views import _expand, _interleave, _pad, _t_, _transpose
from compiler.ir import meta_of, numel
from compiler.ops import catalog as C


# ----------------------------------------------------------------------------- matmul
def _matmul_nodes(b, a, w):
    sa, sw = meta_of(a).shape, meta_of(w).shape
    if meta_of(a).dtype != meta_of(w).dtype:
        raise Unsupported("matmul of tensors with different dtypes (eager raises)")
    if len(sa) == 0 or len(sw) == 0:
        raise Unsupported("matmul of a 0-d tensor (eager raises)")
    if len(sa) == 1 and len(sw) == 1:
        return C.emit_reduction(b, "sum", _pointwise(b, "mul", [a, w]), (0,))
    if len(sw) == 1:  # [.., M, K] @ [K] -> [.., M]
        out = _matmul_nodes(b, a, C.emit_view(b, "reshape", w, shape=(sw[0], 1)))
        return C.emit_view(b, "reshape", out, shape=meta_of(out).shape[:-1])
    if len(sa) == 1:  # [K] @ [.., K, N] -> [.., N]
        out = _matmul_nodes(b, C.emit_view(b, "reshape", a, shape=(1, sa[0])), w)
        return C.emit_view(b, "reshape", out, shape=meta_of(out).shape[:-2] + meta_of(out).shape[-1:])
    if sa[-1] != sw[-2]:
        raise Unsupported(f"matmul shapes {list(sa)} and {list(sw)} do not match (eager raises)")
    if len(sw) == 2:  # the common case: activations @ weight — one mm over all rows
        rows = C.emit_view(b, "reshape", a, shape=(numel(sa[:-1]), sa[-1]))
        out = C.emit_extern(b, "mm", rows, w)
        return C.emit_view(b, "reshape", out, shape=tuple(sa[:-1]) + (sw[-1],))
    batch = tuple(torch.broadcast_shapes(sa[:-2], sw[:-2]))
    nb = numel(batch)
    a3 = C.emit_view(b, "reshape", _expand(b, a, batch + tuple(sa[-2:])), shape=(nb,) + tuple(sa[-2:]))
    w3 = C.emit_view(b, "reshape", _expand(b, w, batch + tuple(sw[-2:])), shape=(nb,) + tuple(sw[-2:]))
    out = C.emit_extern(b, "bmm", a3, w3)
    return C.emit_view(b, "reshape", out, shape=batch + (sa[-2], sw[-1]))


@binds(torch.matmul, _t("matmul"), _t("__matmul__"), torch.mm, _t("mm"), torch.bmm, _t("bmm"))
def _matmul(b, a, w, *, out=None):
    _no_out({"out": out})
    return _matmul_nodes(b, a, w)


def _conv_binding(dims):
    def bind(b, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if not isinstance(input, fx.Node) or not isinstance(weight, fx.Node):
            raise Unsupported("convolution needs tensor input and weight")
        if len(meta_of(input).shape) != dims + 2:
            raise Unsupported(f"conv{dims}d of an unbatched input is not supported yet")
        if meta_of(input).dtype != meta_of(weight).dtype or meta_of(input).dtype.is_complex:
            raise Unsupported("convolution of mixed or complex dtypes is not supported yet")

        def per_dim(v):
            return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims
        stride, dilation = per_dim(stride), per_dim(dilation)
        kernel = meta_of(weight).shape[2:]
        if padding == "valid":
            padding = 0
        if padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if any(t % 2 for t in totals) or any(s != 1 for s in stride):
                raise Unsupported("padding='same' that pads unevenly is not supported yet")
            padding = tuple(t // 2 for t in totals)
        padding = per_dim(padding)
        spatial = tuple((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
                        zip(meta_of(input).shape[2:], padding, dilation, kernel, stride))
        shape = (meta_of(input).shape[0], meta_of(weight).shape[0]) + spatial
        out = C.emit_conv(b, input, weight, shape, list(stride), list(padding), list(dilation), int(groups))
        if bias is not None:
            out = _pointwise(b, "add", [out, C.emit_view(b, "reshape", bias, shape=(shape[1],) + (1,) * dims)])
        return out
    return bind


binds(F.conv1d, torch.conv1d)(_conv_binding(1))
binds(F.conv2d, torch.conv2d)(_conv_binding(2))
binds(F.conv3d, torch.conv3d)(_conv_binding(3))


@binds(F.linear)
def _linear(b, x, weight, bias=None):
    """x @ weight.T + bias. NOTE: with a 1-D bias, one addmm over the rows of x flattened to
    2-D (as eager's linear does): the bias is added by the matmul, not by another pass."""
    if isinstance(bias, fx.Node) and len(meta_of(bias).shape) == 1 and len(meta_of(x).shape) >= 2 and \
            len(meta_of(weight).shape) == 2 and meta_of(x).dtype == meta_of(weight).dtype == meta_of(bias).dtype and \
            meta_of(x).shape[-1] == meta_of(weight).shape[1] and meta_of(bias).shape[0] == meta_of(weight).shape[0]:
        sx = meta_of(x).shape
        rows = C.emit_view(b, "reshape", x, shape=(numel(sx[:-1]), sx[-1]))
        out = C.emit_addmm(b, bias, rows, _t_(b, weight))
        return C.emit_view(b, "reshape", out, shape=tuple(sx[:-1]) + (meta_of(weight).shape[0],))
    out = _matmul_nodes(b, x, _t_(b, weight))
    if bias is not None:
        out = _pointwise(b, "add", [out, bias])
    return out


@binds(torch.addmm, _t("addmm"))
def _addmm(b, input, mat1, mat2, *, beta=1, alpha=1, out=None):
    """beta * input + alpha * (mat1 @ mat2) (GPT-2's Conv1D layers call it with a bias)."""
    _no_out({"out": out})
    if not all(isinstance(t, fx.Node) for t in (input, mat1, mat2)) or \
            len(meta_of(mat1).shape) != 2 or len(meta_of(mat2).shape) != 2:
        raise Unsupported("addmm needs a tensor input and 2-D matrices (eager raises)")
    if beta == 1 and alpha == 1 and meta_of(input).dtype == meta_of(mat1).dtype == meta_of(mat2).dtype and \
            tuple(torch.broadcast_shapes(meta_of(input).shape, (meta_of(mat1).shape[0], meta_of(mat2).shape[1]))) == \
            (meta_of(mat1).shape[0], meta_of(mat2).shape[1]):
        return C.emit_addmm(b, input, mat1, mat2)
    product = _matmul_nodes(b, mat1, mat2)
    if alpha != 1:
        product = _pointwise(b, "mul", [product, alpha])
    if beta == 0:  # eager ignores input then (even NaN in it)
        return product
    return _pointwise(b, "add", [product, input if beta == 1 else _pointwise(b, "mul", [input, beta])])


@binds(F.interpolate)
def _interpolate(b, input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False):
    """Nearest-neighbour upsampling by whole factors (each element copied into a block)."""
    if mode not in ("nearest", "nearest-exact") or antialias:
        raise Unsupported(f"interpolate(mode={mode!r}) is not supported yet (nearest only)")
    spatial = meta_of(input).shape[2:]
    if size is not None:
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * len(spatial)
        factors = [o / i for o, i in zip(sizes, spatial)]
    else:
        factors = list(scale_factor) if isinstance(scale_factor, (tuple, list)) else [scale_factor] * len(spatial)
    if any(f != int(f) or f < 1 for f in factors):
        raise Unsupported("interpolate by a non-integer or shrinking factor is not supported yet")
    return _interleave(b, input, {2 + i: int(f) for i, f in enumerate(factors)})


def _pool_windows(b, x, dims, kernel, stride, padding, fill):
    """x padded with ``fill`` and cut into windows: [..., out_1, ..., out_n, k_1, ..., k_n] (views;
    overlapping windows read the same elements, and their gradients add up)."""
    if any(padding):
        pad = []
        for p in reversed(padding):
            pad += [p, p]
        x = _pad(b, x, pad, value=fill)
    lead = len(meta_of(x).shape) - dims
    for i, (k, s) in enumerate(zip(kernel, stride)):
        x = C.emit_view(b, "unfold", x, dim=lead + i, size=k, step=s)
    return x


def _pool_args(dims, kernel_size, stride, padding, dilation, ceil_mode):
    def per_dim(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims
    kernel = per_dim(kernel_size)
    stride = kernel if stride is None or stride == [] or stride == () else per_dim(stride)
    padding = per_dim(padding)
    if ceil_mode or any(d != 1 for d in per_dim(dilation)):
        raise Unsupported("pooling with ceil_mode or dilation is not supported yet")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise Unsupported("pooling padding larger than half the window (eager raises)")
    return kernel, stride, padding


def _avg_pool(dims):
    def bind(b, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None):
        kernel, stride, padding = _pool_args(dims, kernel_size, stride, padding, 1, ceil_mode)
        window_dims = tuple(range(-dims, 0))
        windows = _pool_windows(b, x, dims, kernel, stride, padding, 0.0)
        total = C.emit_reduction(b, "sum", windows, window_dims)
        if divisor_override is not None:
            return _pointwise(b, "div", [total, float(divisor_override)])
        if count_include_pad or not any(padding):
            return _pointwise(b, "div", [total, float(numel(kernel))])
        ones = C.emit_fill(b, meta_of(x).shape, meta_of(x).dtype, 1)
        counts = C.emit_reduction(b, "sum", _pool_windows(b, ones, dims, kernel, stride, padding, 0.0), window_dims)
        return _pointwise(b, "div", [total, counts])
    return bind


def _adaptive_avg_pool(dims):
    def bind(b, x, output_size):
        out = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * dims
        sizes = meta_of(x).shape[-dims:]
        out = tuple(s if o is None else o for s, o in zip(sizes, out))
        if any(o == 0 or s % o for s, o in zip(sizes, out)):
            raise Unsupported("adaptive_avg_pool with windows that do not tile the input is not supported yet")
        kernel = tuple(s // o for s, o in zip(sizes, out))
        windows = _pool_windows(b, x, dims, kernel, kernel, (0,) * dims, 0.0)
        return C.emit_reduction(b, "mean", windows, tuple(range(-dims, 0)))
    return bind


def _max_pool(dims):
    """Max over windows (padding counts as -inf). Eager's gradient goes to the first maximum of
    each window (not shared among ties, unlike amax): the window's first maximal position is
    found from detached values, and the result is the element there, so autodiff sends the
    gradient to it alone; overlapping windows add up. NaN counts as the maximum, as in eager."""
    def bind(b, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        if return_indices:
            raise Unsupported("max_pool with return_indices is not supported yet")
        kernel, stride, padding = _pool_args(dims, kernel_size, stride, padding, dilation, ceil_mode)
        windows = _pool_windows(b, x, dims, kernel, stride, padding, float("-inf"))
        split = meta_of(windows).shape
        window_dims = tuple(range(len(split) - dims, len(split)))
        values = Tensor(b, windows).detach().node
        peak = C.emit_reduction(b, "amax", values, window_dims, keepdim=True)
        hit = _pointwise(b, "logical_or", [_pointwise(b, "eq", [values, peak]), _pointwise(b, "ne", [values, values])])
        position = None  # row-major position inside the window, as a float (small integers)
        for d, k in zip(window_dims, kernel):
            at = C.emit_pointwise(b, "identity", [C.emit_iota(b, split, d)], dtype=torch.float32)
            if position is not None:
                at = _pointwise(b, "add", [_pointwise(b, "mul", [position, float(k)]), at])
            position = at
        big = float(numel(kernel))
        negated = C.emit_pointwise(b, "where", [hit, _pointwise(b, "neg", [position]), -big], dtype=torch.float32)
        first = _pointwise(b, "neg", [C.emit_reduction(b, "amax", negated, window_dims, keepdim=True)])
        chosen = _pointwise(b, "eq", [position, first])
        picked = C.emit_pointwise(b, "where", [chosen, windows, 0.0], dtype=meta_of(x).dtype)
        return C.emit_reduction(b, "sum", picked, window_dims)
    return bind


binds(F.max_pool1d)(_max_pool(1))
binds(F.max_pool2d)(_max_pool(2))
binds(F.max_pool3d)(_max_pool(3))
binds(F.avg_pool1d, torch.avg_pool1d)(_avg_pool(1))
binds(F.avg_pool2d, torch._C._nn.avg_pool2d)(_avg_pool(2))
binds(F.avg_pool3d, torch._C._nn.avg_pool3d)(_avg_pool(3))
binds(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d)(_adaptive_avg_pool(1))
binds(F.adaptive_avg_pool2d)(_adaptive_avg_pool(2))
binds(F.adaptive_avg_pool3d)(_adaptive_avg_pool(3))


@binds(F.scaled_dot_product_attention)
def _scaled_dot_product_attention(b, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v, as PyTorch's math backend computes it: a causal mask
    from element positions (nothing stored), rows masked entirely give 0 (not NaN), dropout on
    the attention weights from in-kernel random numbers. The matmuls are PyTorch's; the
    scaling, masking, softmax and dropout fuse around them."""
    if enable_gqa:
        raise Unsupported("scaled_dot_product_attention(enable_gqa=True) is not supported yet")
    if is_causal and attn_mask is not None:
        raise Unsupported("scaled_dot_product_attention with both attn_mask and is_causal (eager raises)")
    if scale is None:
        scale = 1.0 / math.sqrt(meta_of(query).shape[-1])
    scores = _pointwise(b, "mul", [_matmul_nodes(b, query, _transpose(b, key, -2, -1)), scale])
    shape, dtype = meta_of(scores).shape, meta_of(scores).dtype
    if is_causal:
        rows, cols = C.emit_iota(b, shape, len(shape) - 2), C.emit_iota(b, shape, len(shape) - 1)
        attn_mask = C.emit_pointwise(b, "le", [cols, rows], dtype=torch.bool)
    if isinstance(attn_mask, fx.Node):
        if meta_of(attn_mask).dtype == torch.bool:
            scores = C.emit_pointwise(b, "where", [attn_mask, scores, float("-inf")], dtype=dtype)
        else:
            scores = _pointwise(b, "add", [scores, attn_mask])
    elif attn_mask is not None:
        raise Unsupported("scaled_dot_product_attention with a non-tensor attn_mask")
    shifted = _shifted(Tensor(b, scores), -1)[0].node
    e = _pointwise(b, "exp", [shifted])
    total = C.emit_reduction(b, "sum", e, (len(shape) - 1,), keepdim=True)
    # a row masked entirely has e = 0 and total = 0: dividing by 1 there gives eager's 0, and a
    # finite derivative (a where after the division would still send 0 * inf back: NaN)
    empty = C.emit_pointwise(b, "eq", [total, 0.0], dtype=torch.bool)
    weights = _pointwise(b, "div", [e, C.emit_pointwise(b, "where", [empty, 1.0, total], dtype=dtype)])
    if dropout_p > 0:
        weights = _dropout(b, weights, dropout_p, True)
    return _matmul_nodes(b, weights, value)


binds(torch.tril, _t("tril"))(_triangle(True))
binds(torch.triu, _t("triu"))(_triangle(False))
