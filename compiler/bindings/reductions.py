"""Bindings of reductions: sum, mean, amax/max, softmax and log_softmax, logsumexp, var/std
and vector norms.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.bindings.elementwise import _cast, _pointwise
from compiler.bindings.handles import Tensor, on_handles, pointwise
from compiler.bindings.registry import Unsupported, _no_out, _t, binds
from compiler.ir import compute_dtype, meta_of, numel
from compiler.ops import catalog as C


# ----------------------------------------------------------------------------- reductions
def _dims(x, dim):
    ndim = x.ndim if isinstance(x, Tensor) else len(meta_of(x).shape)
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        return (dim,)
    return tuple(dim)


def _reduce(name):
    def bind(b, x, dim=None, keepdim=False, *, dtype=None, out=None):
        _no_out({"out": out})
        if not isinstance(x, fx.Node):
            raise Unsupported(f"{name} of a non-tensor")
        inexact = meta_of(x).dtype.is_floating_point or meta_of(x).dtype.is_complex
        if name == "mean" and not (inexact or dtype is not None):
            raise Unsupported("mean of an integer tensor (eager raises)")
        if dtype is None and name == "sum" and not inexact:
            dtype = torch.int64
        return C.emit_reduction(b, name, x, _dims(x, dim), keepdim, dtype)
    return bind


binds(torch.sum, _t("sum"))(_reduce("sum"))
binds(torch.mean, _t("mean"))(_reduce("mean"))


# ----------------------------------------------------------------------------- max, softmax, norms, losses
@binds(torch.amax, _t("amax"))
def _amax(b, x, dim=(), keepdim=False, *, out=None):
    _no_out({"out": out})
    if not meta_of(x).dtype.is_floating_point:
        raise Unsupported("amax of an integer tensor is not supported yet")
    return C.emit_reduction(b, "amax", x, _dims(x, dim), keepdim)


@binds(torch.max, _t("max"))
def _max(b, x, *args, **kwargs):
    if args or kwargs:
        raise Unsupported("max with a dim (values and indices) or of two tensors: use amax / maximum")
    return _amax(b, x)


def _statistic(b, name, x, dims, keepdim=True):
    """A reduction that later ops (and the backward) read back: mean, variance, a softmax's
    sum. NOTE: in float32 for half types, computed and stored, as eager keeps its
    statistics (a bf16 mean or rstd, rounded, would renormalize every element with it)."""
    return C.emit_reduction(b, name, x, dims, keepdim, dtype=compute_dtype(meta_of(x).dtype))


def _detached(b, node):
    """The same value without a gradient path (the stabilizing shift of softmax/logsumexp)."""
    return C.emit_pointwise(b, "identity", [node], dtype=meta_of(node).dtype, requires_grad=False)


def _shifted(b, x, dim):
    """(x - max, max): the max is finite-safe (0 where it is ±inf), as eager's logsumexp."""
    m = _detached(b, C.emit_reduction(b, "amax", x, (dim,), keepdim=True))
    m = C.emit_pointwise(b, "where", [C.emit_pointwise(b, "eq", [_pointwise(b, "abs", [m]), float("inf")],
                                                        dtype=torch.bool), 0.0, m], dtype=meta_of(m).dtype,
                         requires_grad=False)
    return _pointwise(b, "sub", [x, m]), m


def _softmax_dtype(b, x, dtype):
    if dtype is not None and dtype != meta_of(x).dtype:
        x = C.emit_pointwise(b, "identity", [x], dtype=dtype)
    if not meta_of(x).dtype.is_floating_point:
        raise Unsupported("softmax of a non-floating tensor")
    return x


@binds(F.softmax, torch.softmax, _t("softmax"))
def _softmax(b, x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("softmax without dim")
    x = _softmax_dtype(b, x, dtype)
    shifted, _ = _shifted(b, x, dim)
    e = _pointwise(b, "exp", [shifted])
    return _cast(b, _pointwise(b, "div", [e, _statistic(b, "sum", e, (dim,))]), meta_of(x).dtype)


@binds(F.log_softmax, torch.log_softmax, _t("log_softmax"))
def _log_softmax(b, x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("log_softmax without dim")
    x = _softmax_dtype(b, x, dtype)
    shifted, _ = _shifted(b, x, dim)
    total = _statistic(b, "sum", _pointwise(b, "exp", [shifted]), (dim,))
    return _cast(b, _pointwise(b, "sub", [shifted, _pointwise(b, "log", [total])]), meta_of(x).dtype)


@binds(torch.logsumexp, _t("logsumexp"))
def _logsumexp(b, x, dim, keepdim=False, *, out=None):
    _no_out({"out": out})
    dims = _dims(x, dim)
    if len(dims) != 1:
        raise Unsupported("logsumexp over several dims is not supported yet")
    shifted, m = _shifted(b, x, dims[0])
    total = _statistic(b, "sum", _pointwise(b, "exp", [shifted]), dims)
    out = _cast(b, _pointwise(b, "add", [_pointwise(b, "log", [total]), m]), meta_of(x).dtype)
    return out if keepdim else C.emit_view(b, "reshape", out, shape=C.Reduction("sum").out_shape(
        meta_of(x).shape, tuple(d % max(len(meta_of(x).shape), 1) for d in dims), False))  # 0-dim: dim 0


# ----------------------------------------------------------------------------- statistics, norms, more losses
def _correction(correction, unbiased):
    if correction is not None:
        return float(correction)
    return 1.0 if unbiased is None or unbiased else 0.0


def _variance(b, x, dim, correction, keepdim):
    if not meta_of(x).dtype.is_floating_point:
        raise Unsupported("var/std of a non-floating tensor")
    dims = _dims(x, dim)
    count = numel([meta_of(x).shape[d] for d in dims])
    mean = _statistic(b, "mean", x, dims)
    centered = _pointwise(b, "sub", [x, mean])
    total = _statistic(b, "sum", _pointwise(b, "mul", [centered, centered]), dims, keepdim)
    var = _cast(b, _pointwise(b, "div", [total, max(count - correction, 0.0)]), meta_of(x).dtype)
    mean = _cast(b, mean, meta_of(x).dtype)
    return var, (mean if keepdim else C.emit_view(b, "reshape", mean, shape=meta_of(var).shape))


def _var_like(kind):
    def bind(b, x, dim=None, unbiased=None, keepdim=False, *, correction=None, out=None):
        _no_out({"out": out})
        if isinstance(dim, bool):  # var(x, unbiased) in the old positional form
            dim, unbiased = None, dim
        var, mean = _variance(b, x, dim, _correction(correction, unbiased), keepdim)
        # std: eager's gradient is 0 where the std is 0 (std_backward masks it), as norm_sqrt's
        value = _pointwise(b, "norm_sqrt", [var]) if kind.startswith("std") else var
        return (value, mean) if kind.endswith("_mean") else value
    return bind


binds(torch.var, _t("var"))(_var_like("var"))
binds(torch.std, _t("std"))(_var_like("std"))
binds(torch.var_mean)(_var_like("var_mean"))
binds(torch.std_mean)(_var_like("std_mean"))


def _l2_norm(x: Tensor, dim, keepdim) -> Tensor:
    """sqrt(sum(x²)) over ``dim``, its gradient 0 where the norm is 0 (``norm_sqrt``), as eager's."""
    if not x.dtype.is_floating_point:
        raise Unsupported("norm of a non-floating tensor is not supported yet")
    return pointwise("norm_sqrt", (x * x).sum(_dims(x, dim), keepdim))


@binds(torch.norm, _t("norm"))
@on_handles
def _norm(b, x, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    _no_out({"out": out})
    if p not in (2, 2.0, "fro") or dtype is not None:
        raise Unsupported(f"norm(p={p!r}) is not supported yet (only the 2-norm)")
    return _l2_norm(x, dim, keepdim)


@binds(torch.linalg.vector_norm)
@on_handles
def _vector_norm(b, x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    _no_out({"out": out})
    if ord not in (2, 2.0) or dtype is not None:
        raise Unsupported(f"vector_norm(ord={ord!r}) is not supported yet (only the 2-norm)")
    return _l2_norm(x, dim, keepdim)
