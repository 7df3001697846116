"""Bindings of normalization layers: layer, RMS, batch and group norm, F.normalize, cosine
similarity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.bindings.elementwise import _cast, _pointwise
from compiler.bindings.reductions import _detached, _l2_norm, _statistic
from compiler.bindings.registry import Unsupported, Writes, _no_out, binds
from compiler.ir import meta_of, numel
from compiler.ops import catalog as C


def _norm_dims(x, normalized_shape):
    shape = meta_of(x).shape
    normalized_shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) \
        else (normalized_shape,)
    if tuple(shape[len(shape) - len(normalized_shape):]) != normalized_shape:
        raise Unsupported("normalized_shape does not match the input's last dims (eager raises)")
    return tuple(range(len(shape) - len(normalized_shape), len(shape)))


@binds(F.layer_norm, torch.layer_norm)
def _layer_norm(b, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    dims = _norm_dims(x, normalized_shape)
    out = _normalized(b, x, dims, eps)
    if weight is not None:
        out = _pointwise(b, "mul", [out, weight])
    if bias is not None:
        out = _pointwise(b, "add", [out, bias])
    return _cast(b, out, meta_of(x).dtype)


def _normalized(b, x, dims, eps, stats=None):
    """(x - mean) * rsqrt(var + eps) over ``dims``, with float32 statistics for half types;
    ``stats``, when given, receives (mean, var)."""
    mean = _statistic(b, "mean", x, dims)
    centered = _pointwise(b, "sub", [x, mean])
    # NOTE: the variance about a constant shift c, E[(x - c)^2] - (E[x] - c)^2, exact for any c,
    # with c = the mean held constant: the second term is 0 in value, and the first and second
    # derivatives are the variance's own. The gradient then needs two independent sums per
    # row (one pass when a row spans several blocks), not a sum that reads the other's result.
    shift = _detached(b, mean)
    about_shift = _pointwise(b, "sub", [x, shift])
    offset = _pointwise(b, "sub", [mean, shift])
    var = _pointwise(b, "sub", [_statistic(b, "mean", _pointwise(b, "mul", [about_shift, about_shift]), dims),
                                _pointwise(b, "mul", [offset, offset])])
    if stats is not None:
        stats.extend([mean, var])
    return _pointwise(b, "mul", [centered, _pointwise(b, "rsqrt", [_pointwise(b, "add", [var, float(eps)])])])


@binds(F.batch_norm)
def _batch_norm(b, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                eps=1e-5):
    """Normalization over the batch and spatial dims per channel. In training the batch's
    statistics normalize, and the running statistics are updated in place, as eager does:
    (1 - momentum) * running + momentum * batch (the variance unbiased)."""
    shape = meta_of(input).shape
    if len(shape) < 2 or not meta_of(input).dtype.is_floating_point:
        raise Unsupported("batch_norm of this input is not supported yet")
    dims = (0,) + tuple(range(2, len(shape)))
    per_channel = (shape[1],) + (1,) * (len(shape) - 2)

    def channel(t):
        return C.emit_view(b, "reshape", t, shape=per_channel)
    writes = []
    if training or running_mean is None:
        stats = []
        out = _normalized(b, input, dims, eps, stats)
        mean, var = stats
        if training and running_mean is not None:
            if momentum is None:
                raise Unsupported("batch_norm with momentum=None (a cumulative average) is not supported yet")
            count = numel([shape[d] for d in dims])
            for stat, batch, scale in ((running_mean, mean, 1.0), (running_var, var, count / max(count - 1, 1))):
                batch = C.emit_view(b, "reshape", _detached(b, batch), shape=(shape[1],))
                if meta_of(batch).dtype != meta_of(stat).dtype:
                    batch = C.emit_pointwise(b, "identity", [batch], dtype=meta_of(stat).dtype, requires_grad=False)
                new = _pointwise(b, "add", [_pointwise(b, "mul", [stat, 1.0 - momentum]),
                                            _pointwise(b, "mul", [batch, momentum * scale])])
                writes.append((stat, new))
    else:
        out = _pointwise(b, "mul", [_pointwise(b, "sub", [input, channel(running_mean)]),
                                    _pointwise(b, "rsqrt", [_pointwise(b, "add", [channel(running_var),
                                                                                   float(eps)])])])
    if weight is not None:
        out = _pointwise(b, "mul", [out, channel(weight)])
    if bias is not None:
        out = _pointwise(b, "add", [out, channel(bias)])
    if meta_of(out).dtype != meta_of(input).dtype:
        out = C.emit_pointwise(b, "identity", [out], dtype=meta_of(input).dtype)
    return Writes(out, writes) if writes else out


if hasattr(F, "rms_norm"):
    @binds(F.rms_norm)
    def _rms_norm(b, x, normalized_shape, weight=None, eps=None):
        dims = _norm_dims(x, normalized_shape)
        if eps is None:
            eps = torch.finfo(meta_of(x).dtype).eps
        ms = _statistic(b, "mean", _pointwise(b, "mul", [x, x]), dims)
        out = _pointwise(b, "mul", [x, _pointwise(b, "rsqrt", [_pointwise(b, "add", [ms, float(eps)])])])
        return _cast(b, _pointwise(b, "mul", [out, weight]) if weight is not None else out, meta_of(x).dtype)


@binds(F.normalize)
def _normalize(b, input, p=2.0, dim=1, eps=1e-12, out=None):
    _no_out({"out": out})
    if p not in (2, 2.0):
        raise Unsupported(f"normalize(p={p!r}) is not supported yet (only p=2)")
    return _pointwise(b, "div", [input, _pointwise(b, "clamp_min", [_l2_norm(b, input, dim, True), float(eps)])])


@binds(F.cosine_similarity)
def _cosine_similarity(b, x1, x2, dim=1, eps=1e-8):
    """eager: (x1 · x2) / sqrt(clamp_min(|x1|² |x2|², eps²))."""
    dot = C.emit_reduction(b, "sum", _pointwise(b, "mul", [x1, x2]), (dim,))
    n1 = C.emit_reduction(b, "sum", _pointwise(b, "mul", [x1, x1]), (dim,))
    n2 = C.emit_reduction(b, "sum", _pointwise(b, "mul", [x2, x2]), (dim,))
    denominator = _pointwise(b, "sqrt", [_pointwise(b, "clamp_min", [_pointwise(b, "mul", [n1, n2]),
                                                                      float(eps) ** 2])])
    return _pointwise(b, "div", [dot, denominator])


@binds(F.group_norm)
def _group_norm(b, input, num_groups, weight=None, bias=None, eps=1e-5):
    shape = meta_of(input).shape
    if len(shape) < 2 or shape[1] % num_groups:
        raise Unsupported("group_norm: channels must divide into the groups (eager raises)")
    grouped = C.emit_view(b, "reshape", input, shape=(shape[0], num_groups, numel(shape[1:]) // num_groups))
    out = C.emit_view(b, "reshape", _normalized(b, grouped, (2,), eps), shape=shape)
    per_channel = (shape[1],) + (1,) * (len(shape) - 2)
    if weight is not None:
        out = _pointwise(b, "mul", [out, C.emit_view(b, "reshape", weight, shape=per_channel)])
    if bias is not None:
        out = _pointwise(b, "add", [out, C.emit_view(b, "reshape", bias, shape=per_channel)])
    return _cast(b, out, meta_of(input).dtype)
