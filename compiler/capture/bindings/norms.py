"""Bindings of normalization layers: layer, RMS, batch and group norm, F.normalize, cosine
similarity.

Layer, group, RMS and batch norm share one ``_normalize`` (as ``torch/_refs/__init__.py`` shares
its ``_normalize`` between ``native_layer_norm`` and ``native_group_norm``) and one ``_affine``.
Ours returns the variance rather than rstd, and computes it about the detached mean (see
``_variance_about``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.ir.ops import catalog as C
from compiler.capture.bindings.handles import Tensor, on_handles
from compiler.capture.bindings.reductions import _p_norm
from compiler.capture.bindings.registry import Unsupported, Writes, _no_out, binds
from compiler.ir.graph import numel


def _normalize(x: Tensor, dims, eps, *, centered=True, running=None, stats_shape=None):
    """x normalized over ``dims``: ``(x - mean) * rsqrt(var + eps)``. Returns (out, mean, var).

    ``centered=False``: RMS norm, ``x * rsqrt(mean(x²) + eps)`` (mean None, var the mean square).
    ``running=(mean, var)``: those statistics, viewed as ``stats_shape``, instead of x's own
    (batch norm in eval mode). Statistics of half types are float32.
    """
    if running is not None:
        mean = running[0].reshape(stats_shape)
        centered_x = x - mean
        var = running[1].reshape(stats_shape)
    elif centered:
        x = _gradient_summed_apart(x)
        mean = x.statistic("mean", dims)
        centered_x = x - mean
        var = _variance_about(x, mean, dims)
    else:
        mean, centered_x = None, x
        var = (x * x).statistic("mean", dims)
    return centered_x * (var + float(eps)).rsqrt(), mean, var


def _gradient_summed_apart(x: Tensor) -> Tensor:
    """x through a node of its own, so the backward sums the norm's gradient terms (which cancel,
    exactly for one element per row) before it adds x's gradients from other uses, as eager's
    fused backward does: added one by one to a small gradient of another use, 316 * g and
    -316 * g (rsqrt(eps)) left an error of ~1e-5 in fp32 (fuzz seed 5919)."""
    if not x.requires_grad:
        return x
    return x._wrap(C.emit_pointwise(x.b, "identity", [x.node], dtype=x.dtype, requires_grad=True))


def _variance_about(x: Tensor, mean: Tensor, dims) -> Tensor:
    """The (biased) variance of x over ``dims``, given its mean.

    NOTE: the variance about a constant shift c, E[(x - c)^2] - (E[x] - c)^2, exact for any c,
    with c = the mean held constant: the second term is 0 in value, and the first and second
    derivatives are the variance's own. The gradient then needs two independent sums per
    row (one pass when a row spans several blocks), not a sum that reads the other's result.
    """
    shift = mean.detach()
    about_shift, offset = x - shift, mean - shift
    return (about_shift * about_shift).statistic("mean", dims) - offset * offset


def _affine(out: Tensor, weight, bias, shape=None) -> Tensor:
    """out * weight + bias (each optional), weight and bias viewed as ``shape`` when given."""
    if weight is not None:
        out = out * (weight if shape is None else weight.reshape(shape))
    if bias is not None:
        out = out + (bias if shape is None else bias.reshape(shape))
    return out


def _norm_dims(x, normalized_shape):
    normalized_shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) \
        else (normalized_shape,)
    if tuple(x.shape[x.ndim - len(normalized_shape):]) != normalized_shape:
        raise Unsupported("normalized_shape does not match the input's last dims (eager raises)")
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


@binds(F.layer_norm, torch.layer_norm)
@on_handles
def _layer_norm(b, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    out, _, _ = _normalize(x, _norm_dims(x, normalized_shape), eps)
    return _affine(out, weight, bias).to(x.dtype)


if hasattr(F, "rms_norm"):
    @binds(F.rms_norm)
    @on_handles
    def _rms_norm(b, x, normalized_shape, weight=None, eps=None):
        dims = _norm_dims(x, normalized_shape)
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        out, _, _ = _normalize(x, dims, eps, centered=False)
        return _affine(out, weight, None).to(x.dtype)


@binds(F.group_norm)
@on_handles
def _group_norm(b, input, num_groups, weight=None, bias=None, eps=1e-5):
    shape = input.shape
    if len(shape) < 2 or shape[1] % num_groups:
        raise Unsupported("group_norm: channels must divide into the groups (eager raises)")
    grouped = input.reshape(shape[0], num_groups, numel(shape[1:]) // num_groups)
    out, _, _ = _normalize(grouped, (2,), eps)
    per_channel = (shape[1],) + (1,) * (len(shape) - 2)
    return _affine(out.reshape(shape), weight, bias, per_channel).to(input.dtype)


@binds(F.batch_norm)
@on_handles
def _batch_norm(b, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                eps=1e-5):
    """Normalization over the batch and spatial dims per channel. In training the batch's
    statistics normalize, and the running statistics are updated in place, as eager does:
    (1 - momentum) * running + momentum * batch (the variance unbiased)."""
    shape = input.shape
    if not input.dtype.is_floating_point:
        raise Unsupported("batch_norm of a non-floating input is not supported yet")
    if len(shape) < 2:
        if input.numel() == 0:  # eager: nothing to normalize, a copy (CloneBackward0), nothing updated
            return input._wrap(C.emit_pointwise(b, "identity", [input.node], dtype=input.dtype))
        raise Unsupported("batch_norm of an input without a channel dim (eager raises)")
    dims = (0,) + tuple(range(2, len(shape)))
    per_channel = (shape[1],) + (1,) * (len(shape) - 2)
    writes = []
    if training or running_mean is None:
        out, mean, var = _normalize(input, dims, eps)
        if training and running_mean is not None:
            if momentum is None:
                raise Unsupported("batch_norm with momentum=None (a cumulative average) is not supported yet")
            count = numel([shape[d] for d in dims])
            for stat, batch, scale in ((running_mean, mean, 1.0), (running_var, var, count / max(count - 1, 1))):
                batch = batch.detach().reshape(shape[1]).to(stat.dtype)
                writes.append((stat, stat * (1.0 - momentum) + batch * (momentum * scale)))
    else:
        out, _, _ = _normalize(input, dims, eps, running=(running_mean, running_var), stats_shape=per_channel)
    out = _affine(out, weight, bias, per_channel).to(input.dtype)
    return Writes(out, writes) if writes else out


@binds(F.normalize)
@on_handles
def _normalize_p(b, input, p=2.0, dim=1, eps=1e-12, out=None):
    """eager: input / input.norm(p, dim, keepdim=True).clamp_min(eps), for any p."""
    _no_out({"out": out})
    return input / _p_norm(input, p, dim, True).clamp_min(float(eps))


@binds(F.cosine_similarity)
@on_handles
def _cosine_similarity(b, x1, x2, dim=1, eps=1e-8):
    """eager: (x1 · x2) / sqrt(clamp_min(|x1|² |x2|², eps²)), on x1 and x2 broadcast first."""
    shape = tuple(torch.broadcast_shapes(x1.shape, x2.shape))
    x1, x2 = x1.expand(shape), x2.expand(shape)
    dot = (x1 * x2).sum(dim)
    n1 = (x1 * x1).sum(dim)
    n2 = (x2 * x2).sum(dim)
    return dot / (n1 * n2).clamp_min(float(eps) ** 2).sqrt()

