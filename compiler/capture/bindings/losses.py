"""Bindings of losses: MSE, L1, smooth L1, Huber, BCE with logits, KL divergence (cross-entropy
and NLL in ``cross_entropy.py``).
"""

from __future__ import annotations

import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, on_handles, pointwise
from compiler.capture.bindings.registry import Unsupported, binds


def _reduce_loss(loss: Tensor, reduction: str, count=None) -> Tensor:
    """The loss per element (``none``), summed, or averaged over the elements (or over ``count``)."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise Unsupported(f"reduction={reduction!r}")
    return total / (float(loss.numel()) if count is None else count)


def _legacy_reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        raise Unsupported("the legacy size_average/reduce arguments are not supported")
    return reduction


@binds(F.mse_loss)
@on_handles
def _mse_loss(b, x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if size_average is not None or reduce is not None or weight is not None:
        raise Unsupported("mse_loss with legacy size_average/reduce or weight arguments")
    squared = (x - target) ** 2
    if reduction == "none":
        return squared
    if reduction not in ("mean", "sum"):
        raise Unsupported(f"mse_loss(reduction={reduction!r})")
    return squared.sum() if reduction == "sum" else squared.mean()


@binds(F.l1_loss)
@on_handles
def _l1_loss(b, input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if weight is not None:
        raise Unsupported("l1_loss with weight is not supported yet")
    reduction = _legacy_reduction(size_average, reduce, reduction)
    return _reduce_loss((input - target).abs(), reduction)


@binds(F.smooth_l1_loss)
@on_handles
def _smooth_l1_loss(b, input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    diff = input - target
    loss = diff.abs() if beta == 0 else pointwise("smooth_l1", diff, float(beta))
    return _reduce_loss(loss, reduction)


@binds(F.huber_loss)
@on_handles
def _huber_loss(b, input, target, reduction="mean", delta=1.0, weight=None):
    if weight is not None:
        raise Unsupported("huber_loss with weight is not supported yet")
    return _reduce_loss(pointwise("huber", input - target, float(delta)), reduction)


@binds(F.binary_cross_entropy_with_logits)
@on_handles
def _bce_with_logits(b, input, target, weight=None, size_average=None, reduce=None, reduction="mean",
                     pos_weight=None):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    loss = pointwise("bce_with_logits", input, target, 1.0 if pos_weight is None else pos_weight)
    if weight is not None:
        loss = loss * weight
    return _reduce_loss(loss, reduction)


@binds(F.kl_div)
@on_handles
def _kl_div(b, input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    reduction = _legacy_reduction(size_average, reduce, reduction)
    loss = pointwise("kl_div_log_target" if log_target else "kl_div", input, target)
    if reduction == "batchmean":
        return loss.sum() / (float(loss.shape[0]) if loss.shape else 1.0)
    return _reduce_loss(loss, reduction)
