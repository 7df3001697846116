"""Bindings of reductions: sum, mean, amax/amin, max/min (with indices), argmax/argmin, all/any,
softmax and log_softmax, logsumexp, var/std and vector norms.

Read them beside PyTorch's: ``_softmax`` and ``_log_softmax`` in ``torch/_decomp/decompositions.py``,
``logsumexp`` in ``torch/_refs/__init__.py`` (its max masked to 0 where infinite, as ``_shifted``).
Where ours differ it is on purpose: the max carries no gradient, statistics of half types are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, arange_along, full, on_handles, pointwise, where
from compiler.capture.bindings.registry import Unsupported, _no_out, _t, binds
from compiler.ir.graph import compute_dtype, numel


# ----------------------------------------------------------------------------- reductions
def _dims(x: Tensor, dim) -> tuple:
    """A reduction's ``dim`` argument as a tuple (None or (): every dim)."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(x.ndim))
    if isinstance(dim, int):
        return (dim,)
    return tuple(dim)


def _reduce(name):
    def bind(b, x, dim=None, keepdim=False, *, dtype=None, out=None):
        _no_out({"out": out})
        if not isinstance(x, Tensor):
            raise Unsupported(f"{name} of a non-tensor")
        inexact = x.dtype.is_floating_point or x.dtype.is_complex
        if name == "mean" and not (inexact or dtype is not None):
            raise Unsupported("mean of an integer tensor (eager raises)")
        if dtype is None and name == "sum" and not inexact:
            dtype = torch.int64
        return getattr(x, name)(_dims(x, dim), keepdim, dtype=dtype)
    return on_handles(bind)


binds(torch.sum, _t("sum"))(_reduce("sum"))
binds(torch.mean, _t("mean"))(_reduce("mean"))


def _comparable(x: Tensor, what: str) -> Tensor:
    """``x`` in a dtype whose max the kernels compute exactly: floats as they are; bool and
    integers narrower than int64 as float64 (every value exact there)."""
    if x.dtype.is_complex:
        raise Unsupported(f"{what} of a complex tensor (eager raises)")
    if x.dtype.is_floating_point:
        return x
    if x.dtype == torch.int64:
        raise Unsupported(f"{what} of an int64 tensor is not supported yet (values beyond 2**53 have no exact float)")
    return x.to(torch.float64)


def _extreme(x: Tensor, dims: tuple, keepdim: bool, largest: bool, nan_takes_gradient=False) -> Tensor:
    """amax (``largest``) or amin over ``dims``, in x's dtype. amin is -amax(-x): NaN still wins,
    and the gradient is shared evenly among the extreme elements, as eager's amin backward."""
    what = "amax" if largest else "amin"
    if x.ndim and any(x.shape[d] == 0 for d in dims):
        raise Unsupported(f"{what} over an empty dim (eager raises)")
    values = _comparable(x, what)
    options = dict(nan_takes_gradient=nan_takes_gradient)
    out = values.amax(dims, keepdim, **options) if largest else -((-values).amax(dims, keepdim, **options))
    return out.to(x.dtype)


def _amax_like(largest):
    def bind(b, x, dim=(), keepdim=False, *, out=None):
        _no_out({"out": out})
        return _extreme(x, _dims(x, dim), keepdim, largest)
    return on_handles(bind)


_amax = binds(torch.amax, _t("amax"))(_amax_like(True))
binds(torch.amin, _t("amin"))(_amax_like(False))


def _position_dtype(size: int) -> torch.dtype:
    # positions are compared as floats (the kernels reduce floats): exact below 2**24 in float32
    return torch.float32 if size < 2 ** 24 else torch.float64


def _arg_extreme(x: Tensor, dim: int, keepdim: bool, largest: bool):
    """(index, hit-at-index mask) of the first maximum (``largest``) or minimum along ``dim``, as
    eager: NaN counts as the extreme, the first of ties wins. The index is int64."""
    what = "argmax" if largest else "argmin"
    size = x.shape[dim]
    if size == 0:
        raise Unsupported(f"{what} over an empty dim (eager raises)")
    values = _comparable(x, what).detach()
    if not largest:
        values = -values
    hit = (values == values.amax(dim, keepdim=True)) | (values != values)
    position = arange_along(x.b, x.shape, dim).to(_position_dtype(size))
    first = -(where(hit, -position, -float(size)).amax(dim, keepdim=True))
    index = first if keepdim else first.reshape(tuple(s for d, s in enumerate(x.shape) if d != dim))
    return index.to(torch.int64), position == first


def _values_and_indices(x: Tensor, dim: int, keepdim: bool, largest: bool):
    """max/min along ``dim``: (values, indices). The value is the element at the index, so its
    gradient goes to that element alone, as eager's (not shared among ties like amax's)."""
    if x.ndim == 0:
        if dim not in (0, -1):
            raise Unsupported(f"dim {dim} of a 0-dim tensor (eager raises)")
        return x.to(x.dtype), full(x.b, (), 0, torch.int64)
    dim %= x.ndim
    index, at_index = _arg_extreme(x, dim, keepdim, largest)
    values = where(at_index, x, False if x.dtype == torch.bool else 0, dtype=x.dtype)
    if x.dtype == torch.bool:
        return values.to(torch.float32).sum(dim, keepdim).to(torch.bool), index
    return values.sum(dim, keepdim, dtype=x.dtype), index


def _max_min(largest):
    """torch.max / torch.min: of all elements, along a dim (values and indices), or of two tensors."""
    def bind(b, x, *args, **kwargs):
        _no_out(kwargs)
        other = args[0] if args else kwargs.get("other")
        if isinstance(other, Tensor):
            return pointwise("maximum" if largest else "minimum", x, other)
        if not args and "dim" not in kwargs:
            return _extreme(x, _dims(x, None), False, largest, nan_takes_gradient=True)
        dim = args[0] if args else kwargs["dim"]
        keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        if not isinstance(dim, int):
            raise Unsupported(f"{'max' if largest else 'min'}(dim={dim!r}): dim must be an int (eager raises)")
        return _values_and_indices(x, dim, keepdim, largest)
    return on_handles(bind)


binds(torch.max, _t("max"))(_max_min(True))
binds(torch.min, _t("min"))(_max_min(False))


def _argmax_like(largest):
    def bind(b, x, dim=None, keepdim=False, *, out=None):
        _no_out({"out": out})
        if dim is None:  # the index into the flattened tensor
            index, _ = _arg_extreme(x.reshape(x.numel()), 0, False, largest)
            return index.reshape((1,) * x.ndim) if keepdim else index
        if x.ndim == 0:
            return _values_and_indices(x, dim, keepdim, largest)[1]
        index, _ = _arg_extreme(x, dim % x.ndim, keepdim, largest)
        return index
    return on_handles(bind)


binds(torch.argmax, _t("argmax"))(_argmax_like(True))
binds(torch.argmin, _t("argmin"))(_argmax_like(False))


def _all_any(name):
    """all / any over dims: whether every / some element is nonzero (NaN is). Counted as float32
    sums of 0/1 flags, 0 exactly when no flag is set (sums of non-negative terms); empty: all
    True, any False, as eager. Bool result (uint8 for uint8 input, as eager)."""
    def bind(b, x, dim=None, keepdim=False, *, out=None):
        _no_out({"out": out})
        flags = (x == 0) if name == "all" else (x != 0)
        count = flags.to(torch.float32).sum(_dims(x, dim), keepdim)
        result = (count == 0) if name == "all" else (count > 0)
        return result.to(torch.uint8) if x.dtype == torch.uint8 else result
    return on_handles(bind)


binds(torch.all, _t("all"))(_all_any("all"))
binds(torch.any, _t("any"))(_all_any("any"))


# ----------------------------------------------------------------------------- softmax, logsumexp
def _shifted(x: Tensor, dim):
    """(x - max, max) along ``dim`` (an int or a tuple of dims): the max held constant (no
    gradient path), and finite-safe (0 where it is ±inf), as eager's logsumexp."""
    m = x.amax(dim, keepdim=True).detach()
    m = where(m.abs() == float("inf"), 0.0, m, dtype=m.dtype)
    return x - m, m


def _softmax_input(x: Tensor, dtype) -> Tensor:
    if dtype is not None and dtype != x.dtype:
        x = x.to(dtype)
    if not x.dtype.is_floating_point:
        raise Unsupported("softmax of a non-floating tensor")
    return x


@binds(F.softmax, torch.softmax, _t("softmax"))
@on_handles
def _softmax(b, x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("softmax without dim")
    x = _softmax_input(x, dtype)
    shifted, _ = _shifted(x, dim)
    e = shifted.exp()
    return (e / e.statistic("sum", dim)).to(x.dtype)


def log_softmax(x: Tensor, dim: int, dtype=None) -> Tensor:
    """(x - max) - log(sum(exp(x - max))) along ``dim``, in x's dtype (``dtype``: computed in it)."""
    x = _softmax_input(x, dtype)
    shifted, _ = _shifted(x, dim)
    total = shifted.exp().statistic("sum", dim)
    return (shifted - total.log()).to(x.dtype)


@binds(F.log_softmax, torch.log_softmax, _t("log_softmax"))
@on_handles
def _log_softmax(b, x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("log_softmax without dim")
    out = log_softmax(x, dim, dtype)
    if dtype is None and x.ndim == 2 and dim in (1, -1):
        # (what nll_loss's binding reads to see cross_entropy written as nll_loss(log_softmax(x)),
        # a linear's loss it may compute in chunks: ``cross_entropy._chunked_linear_loss``)
        out.node.meta["log_softmax_of"] = x.node
    return out


@binds(torch.logsumexp, _t("logsumexp"))
@on_handles
def _logsumexp(b, x, dim, keepdim=False, *, out=None):
    """log(sum(exp(x - max))) + max over one dim or several (the max over all of them)."""
    _no_out({"out": out})
    dims = _dims(x, dim)
    shifted, m = _shifted(x, dims)
    total = shifted.exp().statistic("sum", dims)
    out = (total.log() + m).to(x.dtype)
    if keepdim:
        return out
    reduced = {d % max(x.ndim, 1) for d in dims}  # a 0-dim x: dim 0
    return out.reshape(tuple(s for d, s in enumerate(x.shape) if d not in reduced))


# ----------------------------------------------------------------------------- statistics, norms
def _correction(correction, unbiased):
    if correction is not None:
        return float(correction)
    return 1.0 if unbiased is None or unbiased else 0.0


def _variance(x: Tensor, dim, correction, keepdim, constant_gradient=False):
    """(var, mean) over ``dim``: sum((x - mean)²) / (count - correction), mean kept as var's shape.

    ``constant_gradient`` (var, not std): over all elements with no degrees of freedom (n -
    correction <= 0; eager warns) the value comes from detached x (NaN or inf) and the gradient
    is eager's var_backward there, grad * (x == mean ? NaN : inf), a constant of x, through a
    term that is 0 (``DegenerateVarianceTerm``): its double backward is 0, as eager's, where the
    quotient rule's would be NaN (fuzz seeds 4363, 6343)."""
    if not x.dtype.is_floating_point:
        raise Unsupported("var/std of a non-floating tensor")
    dims = _dims(x, dim)
    count = numel([x.shape[d] for d in dims])
    degenerate = constant_gradient and (dim is None or x.ndim == 0) and count - correction <= 0
    source = x.detach() if degenerate else x
    mean = source.statistic("mean", dims)
    centered = source - mean
    total = (centered * centered).statistic("sum", dims, keepdim)
    if degenerate:
        # total / 0, written out: as a SymPy product with 1/0 (zoo), adding the term would make NaN
        term = pointwise("degenerate_var_term", x, mean).statistic("sum", dims, keepdim)
        var = where(total == 0, float("nan"), total * float("inf")) + term.to(total.dtype)
    else:
        var = total / max(count - correction, 0.0)
    var = var.to(x.dtype)
    mean = mean.to(x.dtype)
    return var, (mean if keepdim else mean.reshape(var.shape))


def _var_like(kind):
    def bind(b, x, dim=None, unbiased=None, keepdim=False, *, correction=None, out=None):
        _no_out({"out": out})
        if isinstance(dim, bool):  # var(x, unbiased) in the old positional form
            dim, unbiased = None, dim
        var, mean = _variance(x, dim, _correction(correction, unbiased), keepdim,
                              constant_gradient=kind.startswith("var"))
        # std: eager's gradient is 0 where the std is 0 (std_backward masks it)
        value = pointwise("std_sqrt", var) if kind.startswith("std") else var
        return (value, mean) if kind.endswith("_mean") else value
    return on_handles(bind)


binds(torch.var, _t("var"))(_var_like("var"))
binds(torch.std, _t("std"))(_var_like("std"))
binds(torch.var_mean)(_var_like("var_mean"))
binds(torch.std_mean)(_var_like("std_mean"))


def _l2_norm(x: Tensor, dim, keepdim) -> Tensor:
    """sqrt(sum(x²)) over ``dim``, its gradient 0 where the norm is 0 (``norm_sqrt``), as eager's."""
    if not x.dtype.is_floating_point:
        raise Unsupported("norm of a non-floating tensor is not supported yet")
    return _in_float32(x, lambda x: pointwise("norm_sqrt", (x * x).sum(_dims(x, dim), keepdim)))


def _in_float32(x: Tensor, norm) -> Tensor:
    """``norm(x)`` computed in float32 for half types and rounded once, as eager's norm kernels
    (their opmath type): rounding the sum of powers before its root rounds twice, and the
    gradient through bf16 intermediates cancelled to errors of 0.05 (normalize, p = 0.5)."""
    wide = compute_dtype(x.dtype)
    return norm(x.to(wide)).to(x.dtype) if wide != x.dtype else norm(x)


def _p_norm(x: Tensor, p, dim, keepdim) -> Tensor:
    """The vector p-norm over ``dim`` (torch.linalg.vector_norm's definition): 2 as ``_l2_norm``;
    ±inf the max/min of |x| (the gradient shared among the extreme elements, as eager's); 1 the
    sum of |x|; 0 the count of nonzero elements (no gradient); another p (sum |x|^p)^(1/p)."""
    if p in (2, 2.0, "fro"):
        return _l2_norm(x, dim, keepdim)
    if not x.dtype.is_floating_point or isinstance(p, str):
        raise Unsupported(f"norm(p={p!r}) of a {x.dtype} tensor is not supported yet")
    dims = _dims(x, dim)
    if p == 0:
        # NOTE: eager's value is sum(x != 0) (NaN counts); its result requires grad, but its
        # backward gives x no gradient (None: linalg_vector_norm_backward's undefined tensor)
        count = where(x != 0, 1.0, 0.0, dtype=x.dtype, requires_grad=x.requires_grad)
        return count.sum(dims, keepdim)
    empty = x.ndim > 0 and numel([x.shape[d] for d in dims]) == 0
    if empty and (p < 0 or abs(p) == float("inf")):
        raise Unsupported(f"norm(p={p!r}) over an empty dim (eager raises)")
    if p == float("inf"):
        return x.abs().amax(dims, keepdim)
    if p == -float("inf"):
        return -((-x.abs()).amax(dims, keepdim))
    if p == 1:
        return _in_float32(x, lambda x: x.abs().sum(dims, keepdim))
    return _in_float32(x, lambda x: (x.abs() ** float(p)).sum(dims, keepdim) ** (1.0 / float(p)))


@binds(torch.norm, _t("norm"))
@on_handles
def _norm(b, x, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    _no_out({"out": out})
    if dtype is not None:
        raise Unsupported("norm(dtype=...) is not supported yet")
    return _p_norm(x, p, dim, keepdim)


@binds(torch.linalg.vector_norm)
@on_handles
def _vector_norm(b, x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    _no_out({"out": out})
    if dtype is not None:
        raise Unsupported("vector_norm(dtype=...) is not supported yet")
    return _p_norm(x, ord, dim, keepdim)
