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

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.bindings.elementwise import _cast, _pointwise
from compiler.bindings.losses import _reduce_loss
from compiler.bindings.reductions import _log_softmax, _shifted, _statistic
from compiler.bindings.registry import Unsupported, binds
from compiler.ir import meta_of
from compiler.ops import catalog as C


def _picked(b, values, target, ignore_index, keepdim=False):
    """values[n, target[n], ...] along dim 1 (``keepdim``: with that dim kept, size 1), whether
    each target counts (is not ``ignore_index``, bool) and the index gathered with.

    Ignored positions gather at class 0 (any valid class; callers discard the value); other
    targets out of range raise eager's IndexError (the gather's index check).
    """
    shape = meta_of(values).shape
    valid = C.emit_pointwise(b, "ne", [target, ignore_index], dtype=torch.bool)
    index = C.emit_pointwise(b, "where", [valid, target, 0], dtype=meta_of(target).dtype, requires_grad=False)
    picked = C.emit_gather(b, values, C.emit_view(b, "reshape", index, shape=shape[:1] + (1,) + shape[2:]),
                           "gather", 1)
    return (picked if keepdim else C.emit_view(b, "reshape", picked, shape=meta_of(target).shape)), valid, index


def _class_weight(weight, x):
    if weight is None:
        return None
    classes = meta_of(x).shape[1]
    if not isinstance(weight, fx.Node) or tuple(meta_of(weight).shape) != (classes,):
        raise Unsupported(f"a class weight must be a 1-D tensor of {classes} elements (eager raises)")
    if meta_of(weight).requires_grad:
        raise Unsupported("a class weight that requires grad (eager has no gradient for it)")
    if meta_of(weight).dtype != meta_of(x).dtype:
        raise Unsupported("a class weight of another dtype than the input (eager raises)")
    return weight


def _counted(b, weight, index, valid, dtype):
    """Each position's share of a mean: weight[target] (1 without weights), 0 where ignored."""
    if weight is None:
        return _cast(b, valid, dtype)
    return C.emit_pointwise(b, "where", [valid, C.emit_gather(b, weight, index, "index_select", 0), 0.0],
                            dtype=dtype)


def _per_class(b, weight, ndim):
    """A class weight shaped to broadcast along dim 1 of an (N, C, ...) tensor."""
    return C.emit_view(b, "reshape", weight, shape=(1, meta_of(weight).shape[0]) + (1,) * (ndim - 2))


def _check_legacy(name, size_average, reduce):
    if size_average is not None or reduce is not None:
        raise Unsupported(f"{name} with the legacy size_average/reduce arguments")


@binds(F.nll_loss)
def _nll_loss(b, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    _check_legacy("nll_loss", size_average, reduce)
    if len(meta_of(x).shape) < 2 or meta_of(target).dtype.is_floating_point:
        raise Unsupported("nll_loss needs (N, C, ...) log-probabilities and class-index targets")
    weight = _class_weight(weight, x)
    picked, valid, index = _picked(b, x, target, ignore_index)
    share = _counted(b, weight, index, valid, meta_of(x).dtype)
    loss = _pointwise(b, "neg", [picked])
    if weight is not None:
        loss = _pointwise(b, "mul", [loss, share])
    loss = C.emit_pointwise(b, "where", [valid, loss, 0.0], dtype=meta_of(x).dtype)
    return _reduce_loss(b, loss, reduction, _total(b, share) if reduction == "mean" else None)


def _total(b, x):
    return C.emit_reduction(b, "sum", x, tuple(range(len(meta_of(x).shape))))


@binds(F.cross_entropy)
def _cross_entropy(b, x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    _check_legacy("cross_entropy", size_average, reduce)
    if len(meta_of(x).shape) < 2:
        raise Unsupported("cross_entropy of an unbatched input")
    if not 0.0 <= label_smoothing <= 1.0:
        raise Unsupported(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing} (eager raises)")
    weight = _class_weight(weight, x)
    if meta_of(target).dtype.is_floating_point:
        return _with_probabilities(b, x, target, weight, ignore_index, reduction, label_smoothing)
    if meta_of(target).dtype.is_complex or len(meta_of(target).shape) != len(meta_of(x).shape) - 1:
        raise Unsupported("cross_entropy needs (N, C, ...) logits and (N, ...) class indices")
    dtype, ndim, classes = meta_of(x).dtype, len(meta_of(x).shape), meta_of(x).shape[1]
    # NOTE: -log_softmax(x)[t] written as log(sum(exp(x - max))) - (x[t] - max): eager's value
    # ((x[t] - max) - log(sum), negated), whose gradient (softmax - onehot) * grad needs no
    # sum over the classes of the one-hot part.
    shifted, _ = _shifted(b, x, 1)
    log_total = _pointwise(b, "log", [_statistic(b, "sum", _pointwise(b, "exp", [shifted]), (1,))])
    picked, valid, index = _picked(b, shifted, target, ignore_index, keepdim=True)
    share = _counted(b, weight, index, valid, dtype)
    loss = C.emit_view(b, "reshape", _pointwise(b, "sub", [log_total, picked]), shape=meta_of(target).shape)
    if weight is not None:
        loss = _pointwise(b, "mul", [loss, share])
    if label_smoothing > 0:
        # -sum_c w_c log_softmax(x)_c = sum_c(w_c) * log_total - sum_c w_c (x_c - max): a sum over
        # the classes that shares the pass summing the exponentials
        weighted = shifted if weight is None else _pointwise(b, "mul", [shifted, _per_class(b, weight, ndim)])
        mass = float(classes) if weight is None else C.emit_reduction(b, "sum", weight, (0,))
        smooth = _pointwise(b, "sub", [_pointwise(b, "mul", [log_total, mass]), _statistic(b, "sum", weighted, (1,))])
        smooth = C.emit_view(b, "reshape", smooth, shape=meta_of(target).shape)
        loss = _pointwise(b, "add", [_pointwise(b, "mul", [loss, 1.0 - label_smoothing]),
                                     _pointwise(b, "mul", [smooth, label_smoothing / classes])])
    loss = _cast(b, C.emit_pointwise(b, "where", [valid, loss, 0.0], dtype=meta_of(loss).dtype), dtype)
    return _reduce_loss(b, loss, reduction, _total(b, share) if reduction == "mean" else None)


def _with_probabilities(b, x, target, weight, ignore_index, reduction, label_smoothing):
    """Class probabilities as targets: -sum_c w_c p_c log_softmax(x)_c, the mean over positions."""
    if ignore_index != -100:
        raise Unsupported("ignore_index with class-probability targets (eager raises)")
    if meta_of(target).shape != meta_of(x).shape or meta_of(target).dtype != meta_of(x).dtype:
        raise Unsupported("class-probability targets must match the input's shape and dtype (eager raises)")
    classes = meta_of(x).shape[1]
    if label_smoothing > 0:
        target = _pointwise(b, "add", [_pointwise(b, "mul", [target, 1.0 - label_smoothing]),
                                       label_smoothing / classes])
    product = _pointwise(b, "mul", [_log_softmax(b, x, 1), target])
    if weight is not None:
        product = _pointwise(b, "mul", [product, _per_class(b, weight, len(meta_of(x).shape))])
    loss = _pointwise(b, "neg", [C.emit_reduction(b, "sum", product, (1,))])
    return _reduce_loss(b, loss, reduction)
