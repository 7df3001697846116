"""Bindings of losses: MSE, L1, smooth L1, Huber, BCE with logits, KL divergence (cross-entropy
and NLL in ``cross_entropy.py``).
"""

from __future__ import annotations

import torch.nn.functional as F

from compiler.bindings.elementwise import _pointwise
from compiler.bindings.registry import Unsupported, binds
from compiler.ir import meta_of, numel
from compiler.ops import catalog as C


@binds(F.mse_loss)
def _mse_loss(b, x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if size_average is not None or reduce is not None or weight is not None:
        raise Unsupported("mse_loss with legacy size_average/reduce or weight arguments")
    diff = _pointwise(b, "sub", [x, target])
    sq = _pointwise(b, "pow", [diff, 2])
    if reduction == "none":
        return sq
    if reduction not in ("mean", "sum"):
        raise Unsupported(f"mse_loss(reduction={reduction!r})")
    return C.emit_reduction(b, reduction, sq, tuple(range(len(meta_of(sq).shape))))


def _legacy_reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        raise Unsupported("the legacy size_average/reduce arguments are not supported")
    return reduction


@binds(F.l1_loss)
def _l1_loss(b, input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if weight is not None:
        raise Unsupported("l1_loss with weight is not supported yet")
    reduction = _legacy_reduction(size_average, reduce, reduction)
    return _reduce_loss(b, _pointwise(b, "abs", [_pointwise(b, "sub", [input, target])]), reduction)


@binds(F.smooth_l1_loss)
def _smooth_l1_loss(b, input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    diff = _pointwise(b, "sub", [input, target])
    loss = _pointwise(b, "abs", [diff]) if beta == 0 else _pointwise(b, "smooth_l1", [diff, float(beta)])
    return _reduce_loss(b, loss, reduction)


@binds(F.huber_loss)
def _huber_loss(b, input, target, reduction="mean", delta=1.0, weight=None):
    if weight is not None:
        raise Unsupported("huber_loss with weight is not supported yet")
    return _reduce_loss(b, _pointwise(b, "huber", [_pointwise(b, "sub", [input, target]), float(delta)]), reduction)


@binds(F.binary_cross_entropy_with_logits)
def _bce_with_logits(b, input, target, weight=None, size_average=None, reduce=None, reduction="mean",
                     pos_weight=None):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    loss = _pointwise(b, "bce_with_logits", [input, target, 1.0 if pos_weight is None else pos_weight])
    if weight is not None:
        loss = _pointwise(b, "mul", [loss, weight])
    return _reduce_loss(b, loss, reduction)


@binds(F.kl_div)
def _kl_div(b, input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    loss = _pointwise(b, "kl_div_log_target" if log_target else "kl_div", [input, target])
    if reduction == "batchmean":
        total = C.emit_reduction(b, "sum", loss, tuple(range(len(meta_of(loss).shape))))
        return _pointwise(b, "div", [total, float(meta_of(loss).shape[0]) if meta_of(loss).shape else 1.0])
    return _reduce_loss(b, loss, reduction)


def _reduce_loss(b, loss, reduction, count=None):
    if reduction == "none":
        return loss
    total = C.emit_reduction(b, "sum", loss, tuple(range(len(meta_of(loss).shape))))
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise Unsupported(f"reduction={reduction!r}")
    if count is None:
        return _pointwise(b, "div", [total, float(numel(meta_of(loss).shape))])
    return _pointwise(b, "div", [total, count])
