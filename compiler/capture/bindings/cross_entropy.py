"""``cross_entropy`` and ``nll_loss``: losses that pick one class per position.

NOTE (memory): the picked class's value is an inline gather (one element per row), not a
one-hot mask summed over all classes (a full pass over the logits); its gradient is a
one-hot ``where`` that fuses into the kernel writing the input's gradient. Cross-entropy
over class indices reads the logits twice in its forward (the row max, the sum of
exponentials; label smoothing's sum over classes shares the second pass) and once in its
backward, (softmax - onehot) * grad.

Semantics are eager's (``aten/src/ATen/native/LossNLL.cpp``): ``ignore_index``, reductions,
class ``weight`` (a mean divides by the summed weights of the counted targets),
``label_smoothing`` for class indices and for class probabilities.
"""

from __future__ import annotations

import os

import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, gather, on_handles, where
from compiler.capture.bindings.losses import _reduce_loss
from compiler.capture.bindings.reductions import _shifted, log_softmax
from compiler.capture.bindings.registry import Unsupported, binds
from compiler.ir.ops import catalog as C


def _picked(values: Tensor, target: Tensor, ignore_index, keepdim=False):
    """values[n, target[n], ...] along dim 1 (``keepdim``: with that dim kept, size 1), whether
    each target counts (is not ``ignore_index``, bool) and the index gathered with.

    Ignored positions gather at class 0 (any valid class; callers discard the value); other
    targets out of range raise eager's IndexError (the gather's index check).
    """
    shape = values.shape
    valid = target != ignore_index
    index = where(valid, target, 0)
    picked = gather(values, index.reshape(shape[:1] + (1,) + shape[2:]), "gather", 1)
    return (picked if keepdim else picked.reshape(target.shape)), valid, index


def _class_weight(weight, x: Tensor):
    if weight is None:
        return None
    classes = x.shape[1]
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (classes,):
        raise Unsupported(f"a class weight must be a 1-D tensor of {classes} elements (eager raises)")
    if weight.requires_grad:
        raise Unsupported("a class weight that requires grad (eager has no gradient for it)")
    if weight.dtype != x.dtype:
        raise Unsupported("a class weight of another dtype than the input (eager raises)")
    return weight


def _counted(weight, index: Tensor, valid: Tensor, dtype) -> Tensor:
    """Each position's share of a mean: weight[target] (1 without weights), 0 where ignored."""
    if weight is None:
        return valid.to(dtype)
    return where(valid, gather(weight, index, "index_select", 0), 0.0, dtype=dtype)


def _per_class(weight: Tensor, ndim: int) -> Tensor:
    """A class weight shaped to broadcast along dim 1 of an (N, C, ...) tensor."""
    return weight.reshape((1, weight.shape[0]) + (1,) * (ndim - 2))


def _check_legacy(name, size_average, reduce):
    if size_average is not None or reduce is not None:
        raise Unsupported(f"{name} with the legacy size_average/reduce arguments")


def _unbatched(loss, x: Tensor, target: Tensor, *args):
    """``loss`` of an unbatched (C,) input as eager computes it: a batch of one ((1, C), the
    target viewed as (1,) or (1, C)), its 'none' result viewed back as 0-d."""
    reduction = args[-1]
    out = loss(x.unsqueeze(0), target.unsqueeze(0), *args)
    return out.reshape(()) if reduction == "none" else out


@binds(F.nll_loss)
@on_handles
def _nll_loss(b, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    _check_legacy("nll_loss", size_average, reduce)
    if not isinstance(target, Tensor) or target.dtype.is_floating_point or target.dtype.is_complex:
        raise Unsupported("nll_loss needs class-index targets (eager raises)")
    if x.ndim == 1 and target.ndim == 0:
        return _unbatched(_nll, x, target, weight, ignore_index, reduction)
    if x.ndim < 2 or target.ndim != x.ndim - 1:
        raise Unsupported("nll_loss needs (N, C, ...) or (C,) log-probabilities and matching targets (eager raises)")
    return _nll(x, target, weight, ignore_index, reduction)


def _nll(x: Tensor, target: Tensor, weight, ignore_index, reduction) -> Tensor:
    """-x[n, target[n], ...] (times its class weight), 0 where ignored, reduced."""
    weight = _class_weight(weight, x)
    logits = x.node.meta.get("log_softmax_of")
    if logits is not None and target.ndim == 1:   # nll_loss(log_softmax(logits)): cross_entropy(logits)
        chunked = _chunked_linear_loss(Tensor(x.b, logits), target, weight, ignore_index, 0.0, reduction)
        if chunked is not None:
            return chunked
    picked, valid, index = _picked(x, target, ignore_index)
    share = _counted(weight, index, valid, x.dtype)
    loss = -picked
    if weight is not None:
        loss = loss * share
    loss = where(valid, loss, 0.0, dtype=x.dtype)
    return _reduce_loss(loss, reduction, share.sum() if reduction == "mean" else None)


@binds(F.cross_entropy)
@on_handles
def _cross_entropy(b, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    _check_legacy("cross_entropy", size_average, reduce)
    if not 0.0 <= label_smoothing <= 1.0:
        raise Unsupported(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing} (eager raises)")
    if not isinstance(target, Tensor):
        raise Unsupported("cross_entropy needs a tensor target (eager raises)")
    if x.ndim == 1 and target.ndim == (1 if target.dtype.is_floating_point else 0):
        return _unbatched(_cross_entropy_batched, x, target, weight, ignore_index, label_smoothing, reduction)
    if x.ndim < 2:
        raise Unsupported("cross_entropy of a 0-d input, or of a (C,) input with a batched target (eager raises)")
    return _cross_entropy_batched(x, target, weight, ignore_index, label_smoothing, reduction)


def _cross_entropy_batched(x: Tensor, target: Tensor, weight, ignore_index, label_smoothing, reduction) -> Tensor:
    """cross_entropy of (N, C, ...) logits: class indices (N, ...) or probabilities (N, C, ...)."""
    weight = _class_weight(weight, x)
    if target.dtype.is_floating_point:
        return _with_probabilities(x, target, weight, ignore_index, reduction, label_smoothing)
    if target.dtype.is_complex or target.ndim != x.ndim - 1:
        raise Unsupported("cross_entropy needs (N, C, ...) logits and (N, ...) class indices")
    chunked = _chunked_linear_loss(x, target, weight, ignore_index, label_smoothing, reduction)
    if chunked is not None:
        return chunked
    return class_index_loss(x, target, weight, ignore_index, label_smoothing, reduction)


def class_index_loss(x: Tensor, target: Tensor, weight, ignore_index, label_smoothing, reduction) -> Tensor:
    """cross_entropy of (N, C, ...) logits and (N, ...) class indices (``weight`` checked already)."""
    classes = x.shape[1]
    # NOTE: -log_softmax(x)[t] written as log(sum(exp(x - max))) - (x[t] - max): eager's value
    # ((x[t] - max) - log(sum), negated), whose gradient (softmax - onehot) * grad needs no
    # sum over the classes of the one-hot part.
    shifted, _ = _shifted(x, 1)
    log_total = shifted.exp().statistic("sum", 1).log()
    picked, valid, index = _picked(shifted, target, ignore_index, keepdim=True)
    share = _counted(weight, index, valid, x.dtype)
    loss = (log_total - picked).reshape(target.shape)
    if weight is not None:
        loss = loss * share
    if label_smoothing > 0:
        # -sum_c w_c log_softmax(x)_c = sum_c(w_c) * log_total - sum_c w_c (x_c - max): a sum over
        # the classes that shares the pass summing the exponentials
        weighted = shifted if weight is None else shifted * _per_class(weight, x.ndim)
        mass = float(classes) if weight is None else weight.sum(0)
        smooth = (log_total * mass - weighted.statistic("sum", 1)).reshape(target.shape)
        loss = loss * (1.0 - label_smoothing) + smooth * (label_smoothing / classes)
    loss = where(valid, loss, 0.0).to(x.dtype)
    return _reduce_loss(loss, reduction, share.sum() if reduction == "mean" else None)


def _chunked_linear_loss(x: Tensor, target: Tensor, weight, ignore_index, label_smoothing, reduction):
    """The loss as one chunked op (``compiler.ir.ops.linear_cross_entropy``) where ``x`` is a linear
    layer's (N, C) output over classes many enough that its logits are worth never holding
    whole (``CHUNKED_LOSS_MIN_LOGITS`` elements); else None. Whether something else reads the
    logits is only known once the region is whole: ``chunked_loss_pass`` decides then."""
    if x.ndim != 2 or x.numel() < chunked_loss_min_logits() or reduction not in ("mean", "sum", "none"):
        return None
    found = C.linear_source(x.node)
    if found is None:
        return None
    a, m, bias, _ = found
    return Tensor(x.b, C.emit_linear_cross_entropy(
        x.b, a, m, bias, target.node, None if weight is None else weight.node, x.node, reduction=reduction,
        ignore_index=ignore_index, label_smoothing=label_smoothing, loss_dtype=x.dtype))


# NOTE (memory): 2**22 logits (16 MiB in float32; GPT-2's head at 84 rows) and more are chunked:
# below that a chunk would be most of the logits, and the matmuls smaller for nothing.
CHUNKED_LOSS_MIN_LOGITS = 1 << 22


def chunked_loss_min_logits() -> int:
    """``SYMGRAD_CHUNKED_LOSS_MIN_LOGITS`` if set (tests chunk small heads), else the default."""
    return int(os.environ.get("SYMGRAD_CHUNKED_LOSS_MIN_LOGITS", CHUNKED_LOSS_MIN_LOGITS))


def _with_probabilities(x: Tensor, target: Tensor, weight, ignore_index, reduction, label_smoothing) -> Tensor:
    """Class probabilities as targets: -sum_c w_c p_c log_softmax(x)_c, the mean over positions."""
    if ignore_index != -100:
        raise Unsupported("ignore_index with class-probability targets (eager raises)")
    if target.shape != x.shape or target.dtype != x.dtype:
        raise Unsupported("class-probability targets must match the input's shape and dtype (eager raises)")
    classes = x.shape[1]
    if label_smoothing > 0:
        target = target * (1.0 - label_smoothing) + label_smoothing / classes
    product = log_softmax(x, 1) * target
    if weight is not None:
        product = product * _per_class(weight, x.ndim)
    return _reduce_loss(-product.sum(1), reduction)
