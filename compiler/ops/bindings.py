"""How each torch function a user's code calls is expressed with catalog ops.

A binding receives the call's arguments with every tensor replaced by its graph node and
appends catalog ops to the graph. Functions with no binding, and bindings that meet an
argument they do not handle (raising ``Unsupported``), run eagerly: the reason is reported.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.ir import compute_dtype, meta_of, numel, result_dtype
from compiler.ops import catalog as C


class Unsupported(Exception):
    """This call cannot be compiled; the message says why (shown to the user)."""


class Writes:
    """A binding's result plus inputs the call changes in place without returning them
    (batch norm's running statistics): [(input node, its new value node)]."""

    def __init__(self, result, writes):
        self.result = result
        self.writes = writes


BINDINGS: dict = {}


def binds(*funcs):
    def register(fn):
        for f in funcs:
            BINDINGS[f] = fn
        return fn
    return register


def lookup(func):
    return BINDINGS.get(func)


def _t(name):
    return getattr(torch.Tensor, name)


def _no_out(kwargs):
    if kwargs.get("out") is not None:
        raise Unsupported("out= arguments are not supported")


# Arithmetic whose operands and result are all bool is logic in eager (True + True is True);
# computed on 1-bit integers it would wrap (1 + 1 = 0).
_BOOL_ARITHMETIC = {"add": "logical_or", "mul": "logical_and", "maximum": "logical_or", "minimum": "logical_and"}


def _pointwise(b, name, operands, float_result=False):
    dtype = result_dtype(operands)
    if dtype == torch.bool and name in _BOOL_ARITHMETIC:
        name = _BOOL_ARITHMETIC[name]
    if name in C.BOOL_RESULT_OPS:
        dtype = torch.bool
    elif float_result and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    return C.emit_pointwise(b, name, operands, dtype=dtype)


def _unary(name):
    def bind(b, x, **kwargs):
        _no_out(kwargs)
        return _pointwise(b, name, [x], float_result=name in C.FLOAT_RESULT_OPS)
    return bind


for _name in ("exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu",
              "neg", "reciprocal", "square"):
    _funcs = [getattr(torch, _name), _t(_name)]
    binds(*_funcs)(_unary(_name))
binds(_t("__neg__"), torch.negative, _t("negative"))(_unary("neg"))


def _real_unary(name):
    """Unary ops defined here for real tensors (complex ones run eagerly, with the reason)."""
    def bind(b, x, **kwargs):
        _no_out(kwargs)
        dtype = meta_of(x).dtype
        if dtype.is_complex:
            raise Unsupported(f"{name} of a complex tensor is not supported yet")
        if name in _ROUNDING and not dtype.is_floating_point:
            return C.emit_pointwise(b, "identity", [x], dtype=dtype)  # integers are whole already
        return _pointwise(b, name, [x], float_result=name in C.FLOAT_RESULT_OPS)
    return bind


_ROUNDING = ("floor", "ceil", "round", "trunc")  # of an integer: itself
_ALIASES = {"asin": ["arcsin"], "acos": ["arccos"], "atan": ["arctan"], "asinh": ["arcsinh"],
            "acosh": ["arccosh"], "atanh": ["arctanh"], "trunc": ["fix"]}
for _name in ("tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "log1p", "expm1", "log2",
              "log10", "exp2", "erf", "erfc", "sign", "floor", "ceil", "trunc", "frac"):
    _names = [_name] + _ALIASES.get(_name, [])
    _funcs = [getattr(module, n, None) for n in _names for module in (torch, torch.Tensor, torch.special)]
    _funcs = [f for f in _funcs if f is not None]
    binds(*_funcs)(_real_unary(_name))


@binds(torch.round, _t("round"))
def _round(b, x, *, decimals=0, out=None):
    _no_out({"out": out})
    if decimals != 0:
        raise Unsupported("round(decimals=...) is not supported yet")
    return _real_unary("round")(b, x)


def _activation(name, *params):
    """F.<activation>(x, *params, inplace=False), its expression taking the constant params
    (``params``: (name, default) pairs, in the function's order)."""
    def bind(b, x, *args, inplace=False, **kwargs):
        if meta_of(x).dtype.is_complex or not meta_of(x).dtype.is_floating_point:
            raise Unsupported(f"{name} of a {meta_of(x).dtype} tensor is not supported")
        if len(args) > len(params):  # inplace given positionally: F.leaky_relu(x, 0.2, True)
            inplace = args[len(params)]
        values = dict(params)
        values.update(zip(values, args))
        values.update({k: v for k, v in kwargs.items() if k in values})
        if any(isinstance(v, fx.Node) for v in values.values()):
            raise Unsupported(f"{name} with tensor parameters is not supported yet")
        out = C.emit_pointwise(b, name, [x, *(float(v) for v in values.values())], dtype=meta_of(x).dtype)
        return _in_place(b, x, out) if inplace else out
    return bind


binds(F.leaky_relu)(_activation("leaky_relu", ("negative_slope", 0.01)))
binds(F.hardtanh)(_activation("hardtanh", ("min_val", -1.0), ("max_val", 1.0)))
binds(F.relu6)(lambda b, x, inplace=False: _activation("hardtanh", ("min_val", 0.0), ("max_val", 6.0))(
    b, x, inplace=inplace))
binds(F.hardsigmoid)(_activation("hardsigmoid"))
binds(F.hardswish)(_activation("hardswish"))
binds(F.mish)(_activation("mish"))
binds(F.logsigmoid)(_activation("logsigmoid"))
binds(F.softplus)(_activation("softplus", ("beta", 1.0), ("threshold", 20.0)))
binds(F.softsign)(_activation("softsign"))


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@binds(F.elu)
def _elu(b, x, alpha=1.0, inplace=False):
    return _activation("elu", ("alpha", alpha), ("scale", 1.0), ("input_scale", 1.0))(b, x, inplace=inplace)


@binds(F.selu)
def _selu(b, x, inplace=False):
    return _activation("elu", ("alpha", _SELU_ALPHA), ("scale", _SELU_SCALE), ("input_scale", 1.0))(
        b, x, inplace=inplace)


@binds(F.celu)
def _celu(b, x, alpha=1.0, inplace=False):
    return _activation("elu", ("alpha", alpha), ("scale", 1.0), ("input_scale", 1.0 / alpha))(b, x, inplace=inplace)


def _real_binary(name):
    def bind(b, x, y, *, out=None):
        _no_out({"out": out})
        if any(isinstance(t, fx.Node) and meta_of(t).dtype.is_complex for t in (x, y)):
            raise Unsupported(f"{name} of complex tensors is not supported yet")
        return _pointwise(b, name, [x, y], float_result=True)
    return bind


binds(torch.atan2, torch.arctan2, _t("atan2"), _t("arctan2"))(_real_binary("atan2"))
binds(torch.hypot, _t("hypot"))(_real_binary("hypot"))
binds(torch.logaddexp, _t("logaddexp"))(_real_binary("logaddexp"))
binds(torch.xlogy, _t("xlogy"), torch.special.xlogy)(_real_binary("xlogy"))


@binds(torch.lerp, _t("lerp"))
def _lerp(b, start, end, weight, *, out=None):
    _no_out({"out": out})
    return _pointwise(b, "lerp", [start, end, weight])


def _addc(name):
    def bind(b, x, t1, t2, *, value=1, out=None):
        _no_out({"out": out})
        return _pointwise(b, name, [x, t1, t2, value])
    return bind


binds(torch.addcmul, _t("addcmul"))(_addc("addcmul"))
binds(torch.addcdiv, _t("addcdiv"))(_addc("addcdiv"))


# ----------------------------------------------------------------------------- complex
def _to_real(name):
    """Ops with a real result for complex input: abs, real, imag, angle."""
    def bind(b, x, **kwargs):
        _no_out(kwargs)
        dtype = meta_of(x).dtype
        if name == "real" and not dtype.is_complex:
            return x
        out = dtype.to_real() if dtype.is_complex else dtype
        if name == "angle" and not (dtype.is_complex or dtype.is_floating_point):
            out = torch.get_default_dtype()
        return C.emit_pointwise(b, name, [x], dtype=out)
    return bind


binds(torch.abs, _t("abs"), _t("__abs__"), torch.absolute)(_to_real("abs"))
binds(torch.real, _t("real"))(_to_real("real"))
binds(torch.imag, _t("imag"))(_to_real("imag"))
binds(torch.angle, _t("angle"))(_to_real("angle"))


@binds(torch.conj, _t("conj"), torch.conj_physical, _t("conj_physical"))
def _conj(b, x):
    if not meta_of(x).dtype.is_complex:
        return x
    return C.emit_pointwise(b, "conj", [x], dtype=meta_of(x).dtype)


@binds(torch.complex)
def _complex(b, real, imag, *, out=None):
    _no_out({"out": out})
    return C.emit_pointwise(b, "complex", [real, imag], dtype=result_dtype([real, imag]).to_complex())


@binds(torch.polar)
def _polar(b, abs, angle, *, out=None):
    _no_out({"out": out})
    return C.emit_pointwise(b, "polar", [abs, angle], dtype=result_dtype([abs, angle]).to_complex())


@binds(torch.view_as_real)
def _view_as_real(b, x):
    return C.emit_view(b, "view_as_real", x)


@binds(torch.view_as_complex)
def _view_as_complex(b, x):
    return C.emit_view(b, "view_as_complex", x)
binds(F.sigmoid)(_unary("sigmoid"))


@binds(F.relu)
def _relu(b, x, inplace=False):
    out = _pointwise(b, "relu", [x])
    return _in_place(b, x, out) if inplace else out


@binds(F.silu)
def _silu(b, x, inplace=False):
    out = _pointwise(b, "silu", [x], float_result=True)
    return _in_place(b, x, out) if inplace else out


@binds(F.gelu)
def _gelu(b, x, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise Unsupported(f"gelu(approximate={approximate!r}) is not a PyTorch option")
    return _pointwise(b, "gelu" if approximate == "none" else "gelu_tanh", [x], float_result=True)


def _with_alpha(b, name, x, y, alpha):
    if alpha != 1:
        y = _pointwise(b, "mul", [y, alpha])
    return _pointwise(b, name, [x, y])


@binds(torch.add, _t("add"), _t("__add__"), _t("__radd__"))
def _add(b, x, y, *, alpha=1, out=None):
    _no_out({"out": out})
    return _with_alpha(b, "add", x, y, alpha)


@binds(torch.sub, torch.subtract, _t("sub"), _t("subtract"), _t("__sub__"))
def _sub(b, x, y, *, alpha=1, out=None):
    _no_out({"out": out})
    return _with_alpha(b, "sub", x, y, alpha)


@binds(torch.rsub, _t("__rsub__"))
def _rsub(b, x, y, *, alpha=1):
    return _with_alpha(b, "sub", y, x, alpha)


@binds(torch.mul, torch.multiply, _t("mul"), _t("multiply"), _t("__mul__"), _t("__rmul__"))
def _mul(b, x, y, *, out=None):
    _no_out({"out": out})
    return _pointwise(b, "mul", [x, y])


@binds(torch.div, torch.divide, torch.true_divide, _t("div"), _t("divide"), _t("true_divide"),
       _t("__truediv__"))
def _div(b, x, y, *, rounding_mode=None, out=None):
    _no_out({"out": out})
    if rounding_mode is not None:
        raise Unsupported(f"div(rounding_mode={rounding_mode!r}) is not supported yet")
    return _pointwise(b, "div", [x, y], float_result=True)


@binds(_t("__rtruediv__"))
def _rdiv(b, x, y):
    return _pointwise(b, "div", [y, x], float_result=True)


@binds(torch.pow, _t("pow"), _t("__pow__"))
def _pow(b, x, y, *, out=None):
    _no_out({"out": out})
    return _pointwise(b, "pow", [x, y])


@binds(_t("__rpow__"))
def _rpow(b, x, y):
    return _pointwise(b, "pow", [y, x])


def _binary(name):
    def bind(b, x, y, *, out=None):
        _no_out({"out": out})
        return _pointwise(b, name, [x, y])
    return bind


for _name in ("maximum", "minimum"):
    binds(getattr(torch, _name), _t(_name))(_binary(_name))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    binds(getattr(torch, _name), _t(_name), _t(f"__{_name}__"))(_binary(_name))


for _name in ("logical_and", "logical_or", "logical_xor"):
    binds(getattr(torch, _name), _t(_name))(_binary(_name))
binds(torch.logical_not, _t("logical_not"))(_unary("logical_not"))


def _bitwise(name):
    """~, &, |, ^ and bitwise_*: on booleans they are logic ops; on integers, bit operations
    (not supported yet)."""
    def bind(b, *operands, out=None):
        _no_out({"out": out})
        for x in operands:
            dtype = meta_of(x).dtype if isinstance(x, fx.Node) else type(x)
            if dtype not in (torch.bool, bool):
                raise Unsupported(f"bitwise {name.split('_')[1]} on {dtype} (not bool) is not supported yet")
        return _pointwise(b, name, list(operands))
    return bind


binds(_t("__invert__"), torch.bitwise_not, _t("bitwise_not"))(_bitwise("logical_not"))
binds(_t("__and__"), torch.bitwise_and, _t("bitwise_and"))(_bitwise("logical_and"))
binds(_t("__or__"), torch.bitwise_or, _t("bitwise_or"))(_bitwise("logical_or"))
binds(_t("__xor__"), torch.bitwise_xor, _t("bitwise_xor"))(_bitwise("logical_xor"))


@binds(F.dropout)
def _dropout(b, input, p=0.5, training=True, inplace=False):
    """Outside training (model.eval()) or with p=0, dropout returns its input itself. In
    training: keep each element with probability 1-p, scaled by 1/(1-p), from random numbers
    made inside the kernel (Philox, seeded per call from torch's generator)."""
    if not 0 <= p <= 1:
        raise Unsupported(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0:
        return input
    if p == 1:
        raise Unsupported("dropout with p=1 (every element dropped) is not compiled")
    if b.new_seed is None:
        raise Unsupported("random numbers need a per-call seed, which this graph cannot take")
    keep = _pointwise(b, "ge", [C.emit_rand(b, b.new_seed(), meta_of(input).shape), p])
    out = C.emit_pointwise(b, "where", [keep, _pointwise(b, "mul", [input, 1.0 / (1.0 - p)]), 0.0],
                           dtype=meta_of(input).dtype)
    return _in_place(b, input, out) if inplace else out


@binds(torch.dropout)
def _torch_dropout(b, input, p, train):
    return _dropout(b, input, p, train)


@binds(F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
       torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout)
def _other_dropout(b, input, p=0.5, training=True, inplace=False):
    if training and p > 0:
        raise Unsupported("channel and alpha dropout in training mode are not compiled yet")
    return input


@binds(F.embedding)
def _embedding(b, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    if max_norm is not None:
        raise Unsupported("embedding(max_norm=...) renormalizes the weight in place; not supported yet")
    if scale_grad_by_freq or sparse:
        raise Unsupported("embedding with scale_grad_by_freq or sparse gradients is not supported yet")
    if not isinstance(input, fx.Node) or not isinstance(weight, fx.Node):
        raise Unsupported("embedding needs tensor indices and weight")
    _check_index(input, "embedding")
    if len(meta_of(weight).shape) != 2:
        raise Unsupported("embedding weight must be 2-D")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += meta_of(weight).shape[0]
    return C.emit_gather(b, weight, input, "embedding", 0, padding_idx)


@binds(torch.embedding)
def _torch_embedding(b, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _embedding(b, indices, weight, None if padding_idx == -1 else padding_idx,
                      scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)


def _check_index(index, what):
    if not isinstance(index, fx.Node):
        raise Unsupported(f"{what} needs a tensor index")
    if meta_of(index).dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"{what} indices must be int64 or int32, not {meta_of(index).dtype}")


@binds(torch.gather, _t("gather"))
def _gather(b, x, dim, index, *, sparse_grad=False, out=None):
    _no_out({"out": out})
    _check_index(index, "gather")
    rank = len(meta_of(x).shape)
    dim %= max(rank, 1)
    if len(meta_of(index).shape) != rank or any(
            i > s for d, (i, s) in enumerate(zip(meta_of(index).shape, meta_of(x).shape)) if d != dim):
        raise Unsupported("gather: index must have the input's rank and fit it outside dim (eager raises)")
    return C.emit_gather(b, x, index, "gather", dim)


@binds(torch.index_select, _t("index_select"))
def _index_select(b, x, dim, index, *, out=None):
    if not meta_of(x).shape:
        raise Unsupported("index_select on a 0-d tensor")
    _no_out({"out": out})
    _check_index(index, "index_select")
    if len(meta_of(index).shape) > 1:
        raise Unsupported("index_select needs a 1-D index (eager raises)")
    dim %= max(len(meta_of(x).shape), 1)
    return C.emit_gather(b, x, _as_1d(b, index), "index_select", dim)


def _as_1d(b, index):
    return index if len(meta_of(index).shape) == 1 else C.emit_view(b, "reshape", index, shape=(1,))


def _advanced_index(b, x, index):
    """x[..., idx, ...] with one integer index tensor and otherwise whole dims: a gather along
    that dim (negative indices count from the end, as in eager)."""
    items = index if isinstance(index, tuple) else (index,)
    tensors = [i for i, item in enumerate(items) if isinstance(item, fx.Node)]
    if len(tensors) != 1:
        raise Unsupported("indexing with several index tensors is not supported yet")
    at = tensors[0]
    idx = items[at]
    if meta_of(idx).dtype == torch.bool:
        raise Unsupported("indexing with a boolean mask has a data-dependent shape")
    _check_index(idx, "indexing")
    if Ellipsis in items[at + 1:]:
        raise Unsupported("an ellipsis after an index tensor is not supported yet")
    if Ellipsis in items[:at]:
        dim = len(meta_of(x).shape) - (len(items) - at)
    else:
        dim = at
    others = [item for i, item in enumerate(items) if i != at and item is not Ellipsis]
    if any(not (isinstance(item, slice) and item == slice(None)) for item in others):
        raise Unsupported("mixing an index tensor with ints, slices or None is not supported yet")
    return C.emit_gather(b, x, idx, "index_select", dim, wrap=True)


@binds(torch.where)
def _where(b, cond, x=None, y=None, *, out=None):
    _no_out({"out": out})
    if x is None or y is None:
        raise Unsupported("torch.where(cond) (the nonzero form) has a data-dependent shape")
    dtype = result_dtype([x, y])
    if not isinstance(cond, fx.Node):
        raise Unsupported("where() needs a tensor condition")
    return C.emit_pointwise(b, "where", [cond, x, y], dtype=dtype)


@binds(_t("where"))
def _tensor_where(b, x, cond, y):
    return _where(b, cond, x, y)


@binds(_t("to"), _t("type"))
def _to(b, x, *args, **kwargs):
    name = getattr(b, "_current_func_name", None)
    dtype = None
    for a in list(args) + [kwargs.get("dtype")]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif a is not None and not isinstance(a, (torch.device, str, bool)):
            raise Unsupported("Tensor.to() with these arguments is not supported yet")
    if isinstance(kwargs.get("device"), (torch.device, str)) or any(isinstance(a, (torch.device, str)) for a in args):
        raise Unsupported("moving tensors between devices inside a compiled function is not supported yet")
    if dtype is None:
        raise Unsupported(f"Tensor.{name or 'to'}() without a dtype is not supported yet")
    if dtype == meta_of(x).dtype:
        return x
    return C.emit_pointwise(b, "identity", [x], dtype=dtype,
                            requires_grad=meta_of(x).requires_grad and dtype.is_floating_point)


binds(_t("float"))(lambda b, x: _to(b, x, torch.float32))
binds(_t("double"))(lambda b, x: _to(b, x, torch.float64))


# ----------------------------------------------------------------------------- reductions
def _dims(x, dim):
    ndim = len(meta_of(x).shape)
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


# ----------------------------------------------------------------------------- views
def _shape_arg(x, shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(s, int) for s in shape):
        raise Unsupported("view/reshape with a non-integer size")
    total = numel(meta_of(x).shape)
    if shape.count(-1) > 1:
        raise Unsupported("more than one -1 in a shape")
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        shape = tuple(total // known if s == -1 else s for s in shape)
    if numel(shape) != total:
        raise Unsupported(f"shape {list(shape)} is invalid for input of size {total}")
    return tuple(shape)


@binds(torch.reshape, _t("reshape"), _t("view"))
def _reshape(b, x, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise Unsupported("Tensor.view(dtype) is not supported yet")
    return C.emit_view(b, "reshape", x, shape=_shape_arg(x, shape))


@binds(_t("view_as"), _t("reshape_as"))
def _view_as(b, x, other):
    return C.emit_view(b, "reshape", x, shape=meta_of(other).shape)


@binds(torch.flatten, _t("flatten"))
def _flatten(b, x, start_dim=0, end_dim=-1):
    shape = list(meta_of(x).shape)
    if not shape:
        return C.emit_view(b, "reshape", x, shape=(1,))
    s, e = start_dim % len(shape), end_dim % len(shape)
    return C.emit_view(b, "reshape", x, shape=shape[:s] + [numel(shape[s:e + 1])] + shape[e + 1:])


@binds(torch.unsqueeze, _t("unsqueeze"))
def _unsqueeze(b, x, dim):
    shape = list(meta_of(x).shape)
    shape.insert(dim % (len(shape) + 1), 1)
    return C.emit_view(b, "reshape", x, shape=shape)


@binds(torch.squeeze, _t("squeeze"))
def _squeeze(b, x, dim=None):
    shape = meta_of(x).shape
    if dim is None:
        dims = range(len(shape))
    else:
        dims = [d % max(len(shape), 1) for d in ((dim,) if isinstance(dim, int) else dim)]
    new = [s for i, s in enumerate(shape) if not (i in dims and s == 1)]
    return C.emit_view(b, "reshape", x, shape=new)


@binds(torch.permute, _t("permute"))
def _permute(b, x, *dims):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    ndim = len(meta_of(x).shape)
    return C.emit_view(b, "permute", x, dims=tuple(d % ndim for d in dims))


@binds(torch.transpose, _t("transpose"), torch.swapaxes, _t("swapaxes"))
def _transpose(b, x, dim0, dim1):
    ndim = len(meta_of(x).shape)
    dims = list(range(ndim))
    if ndim:
        dims[dim0 % ndim], dims[dim1 % ndim] = dims[dim1 % ndim], dims[dim0 % ndim]
    return C.emit_view(b, "permute", x, dims=tuple(dims))


@binds(torch.t, _t("t"))
def _t_(b, x):
    if len(meta_of(x).shape) < 2:
        return x
    return C.emit_view(b, "permute", x, dims=(1, 0))


@binds(_t("mT"))
def _mT(b, x):
    return _transpose(b, x, -2, -1)


@binds(_t("T"))
def _T(b, x):
    """Tensor.T reverses all dims (the same as mT only for 2 dims)."""
    ndim = len(meta_of(x).shape)
    return x if ndim < 2 else C.emit_view(b, "permute", x, dims=tuple(reversed(range(ndim))))


@binds(_t("expand"))
def _expand(b, x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    lead = len(shape) - len(meta_of(x).shape)
    full = tuple(meta_of(x).shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
    if lead:
        x = C.emit_view(b, "reshape", x, shape=(1,) * lead + tuple(meta_of(x).shape))
    return C.emit_view(b, "expand", x, shape=full)


@binds(_t("expand_as"))
def _expand_as(b, x, other):
    return _expand(b, x, meta_of(other).shape)


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


@binds(_t("contiguous"))
def _contiguous(b, x, memory_format=torch.contiguous_format):
    return x  # values are layout-free here; where eager copies, capture makes the copy


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


# ----------------------------------------------------------------------------- constants
def _filled(value):
    def bind(b, x, *, dtype=None, layout=None, device=None, pin_memory=False, memory_format=None,
             requires_grad=False, fill_value=None):
        if device is not None or layout is not None or requires_grad:
            raise Unsupported("*_like with device/layout/requires_grad arguments is not supported yet")
        fill = value if fill_value is None else fill_value
        out_dtype = dtype or meta_of(x).dtype
        # a pointwise op of x that ignores x's values: it has x's shape and no gradient
        expr = C.scalar_expr("fill", [float(fill) if out_dtype.is_floating_point else int(fill)])[0]
        return b.call(C.POINTWISE["fill"], [], shape=meta_of(x).shape, dtype=out_dtype, requires_grad=False, expr=expr)
    return bind


binds(torch.zeros_like)(_filled(0))
binds(torch.ones_like)(_filled(1))


@binds(torch.full_like)
def _full_like(b, x, fill_value, **kwargs):
    return _filled(fill_value)(b, x, **kwargs)


# ----------------------------------------------------------------------------- in-place
# NOTE: an in-place op is captured functionally: its result is a new value in the graph,
# and the capture maps the mutated tensor to it. The runtime writes the final value back
# into the real tensor with ``copy_`` after the region runs, so the tensor's version counter
# and autograd history change as eager's do (a saved old value then fails eager's check).
def _in_place(b, x, out):
    if not isinstance(x, fx.Node):
        raise Unsupported("in-place op on a non-tensor")
    if tuple(meta_of(out).shape) != tuple(meta_of(x).shape):
        raise Unsupported("in-place op whose result has a different shape (eager raises)")
    if meta_of(out).dtype != meta_of(x).dtype:
        out = C.emit_pointwise(b, "identity", [out], dtype=meta_of(x).dtype,
                               requires_grad=meta_of(out).requires_grad and meta_of(x).dtype.is_floating_point)
    return out


def _in_place_variant(bind):
    def in_place(b, x, *args, **kwargs):
        return _in_place(b, x, bind(b, x, *args, **kwargs))
    return in_place


for _name in ("add", "sub", "mul", "div", "pow", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh",
              "sigmoid", "relu", "neg", "reciprocal", "abs", "square", "tan", "asin", "acos", "atan", "sinh", "cosh",
              "asinh", "acosh", "atanh", "log1p", "expm1", "log2", "log10", "exp2", "erf", "erfc", "sign", "floor",
              "ceil", "round", "trunc", "frac", "atan2", "hypot", "xlogy", "lerp", "addcmul", "addcdiv"):
    _source = BINDINGS.get(getattr(torch.Tensor, _name))
    if _source is not None and hasattr(torch.Tensor, f"{_name}_"):
        binds(getattr(torch.Tensor, f"{_name}_"))(_in_place_variant(_source))
binds(torch.Tensor.__iadd__)(_in_place_variant(_add))
binds(torch.Tensor.__isub__)(_in_place_variant(_sub))
binds(torch.Tensor.__imul__)(_in_place_variant(_mul))
binds(torch.Tensor.__itruediv__)(_in_place_variant(_div))
binds(torch.relu_)(_in_place_variant(_unary("relu")))


@binds(torch.masked_fill, _t("masked_fill"))
def _masked_fill(b, x, mask, value):
    if isinstance(value, fx.Node) and meta_of(value).shape != ():
        raise Unsupported("masked_fill with a non-scalar value tensor")
    dtype = meta_of(x).dtype
    if isinstance(value, fx.Node):
        value = C.emit_pointwise(b, "identity", [value], dtype=dtype) if meta_of(value).dtype != dtype else value
    elif not dtype.is_floating_point and not dtype.is_complex:
        value = int(value)
    return C.emit_pointwise(b, "where", [mask, value, x], dtype=dtype)


binds(_t("masked_fill_"))(_in_place_variant(_masked_fill))


@binds(_t("copy_"))
def _copy_(b, x, src, non_blocking=False):
    if not isinstance(src, fx.Node):
        raise Unsupported("copy_ from a non-tensor")
    value = src
    if meta_of(src).shape != meta_of(x).shape:
        value = _expand(b, src, meta_of(x).shape)
    out = C.emit_pointwise(b, "identity", [value], dtype=meta_of(x).dtype,
                           requires_grad=meta_of(value).requires_grad)
    return out


@binds(_t("fill_"))
def _fill_(b, x, value):
    if isinstance(value, fx.Node):
        raise Unsupported("fill_ with a tensor value")
    return _filled(value)(b, x)


# ----------------------------------------------------------------------------- indexing
def _basic_index(x, index):
    """Split a basic index (ints, slices, None, ...) into per-dim slices of ``x`` and the final
    shape; advanced (tensor) indexing is not supported yet."""
    items = index if isinstance(index, tuple) else (index,)
    shape = meta_of(x).shape
    consuming = [i for i in items if i is not None and i is not Ellipsis]
    if any(isinstance(i, (fx.Node, list, bool)) or (not isinstance(i, (int, slice))) for i in consuming):
        raise Unsupported("indexing with tensors, lists or booleans (advanced indexing) is not supported yet")
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise Unsupported("an index can only have a single ellipsis (eager raises)")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = (slice(None),) * (len(shape) - len(consuming))
        items = items[:at] + fill + items[at + 1:]
    slices, final, dim = [], [], 0
    for item in items:
        if item is None:
            final.append(1)
            continue
        size = shape[dim]
        if isinstance(item, int):
            i = item + size if item < 0 else item
            slices.append((dim, i, 1, 1))
        else:
            start, stop, step = item.indices(size)
            if step <= 0:
                raise Unsupported("step must be greater than zero (eager raises)")
            length = max(0, -(-(stop - start) // step))
            slices.append((dim, start, step, length))
            final.append(length)
        dim += 1
    final += list(shape[dim:])
    return slices, tuple(final)


@binds(_t("__getitem__"))
def _getitem(b, x, index):
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(item, fx.Node) for item in items):
        return _advanced_index(b, x, index)
    slices, final = _basic_index(x, index)
    out = x
    for dim, start, step, length in slices:
        out = C.emit_slice(b, out, dim, start, step, length)
    return C.emit_view(b, "reshape", out, shape=final)


@binds(_t("__setitem__"))
def _setitem(b, x, index, value):
    """x[index] = value, functionally: x with value scattered into the indexed positions."""
    if index is None or (isinstance(index, tuple) and None in index):
        raise Unsupported("assignment through an index with None")
    slices, final = _basic_index(x, index)
    shape = meta_of(x).shape
    slices = [s for s in slices if s[1:] != (0, 1, shape[s[0]])]  # whole dims need no scatter
    chain = [x]
    for dim, start, step, length in slices:
        chain.append(C.emit_slice(b, chain[-1], dim, start, step, length))
    target_shape = meta_of(chain[-1]).shape
    dtype = meta_of(x).dtype
    if isinstance(value, fx.Node):
        if meta_of(value).shape != tuple(final):
            value = _expand(b, value, final)
        new = C.emit_view(b, "reshape", value, shape=target_shape)
        if meta_of(new).dtype != dtype:
            new = C.emit_pointwise(b, "identity", [new], dtype=dtype, requires_grad=meta_of(new).requires_grad)
    else:
        new = C.emit_fill(b, target_shape, dtype, value)
    for (dim, start, step, length), base in zip(reversed(slices), reversed(chain[:-1])):
        new = C.emit_slice_scatter(b, base, new, dim, start, step, length)
    return new


@binds(torch.narrow, _t("narrow"))
def _narrow(b, x, dim, start, length):
    if isinstance(start, fx.Node):
        raise Unsupported("narrow with a tensor start")
    dim %= len(meta_of(x).shape)
    start = start + meta_of(x).shape[dim] if start < 0 else start
    return C.emit_slice(b, x, dim, start, 1, length)


@binds(torch.select, _t("select"))
def _select(b, x, dim, index):
    dim %= len(meta_of(x).shape)
    items = (slice(None),) * dim + (index,)
    return _getitem(b, x, items)


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


def _cast(b, x, dtype):
    """``x`` as ``dtype`` (a result computed in float32 from float32 statistics, rounded once)."""
    if meta_of(x).dtype == dtype:
        return x
    return C.emit_pointwise(b, "identity", [x], dtype=dtype)


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


def _interleave(b, x, dims_and_repeats):
    """Each element repeated r times in place along each given dim (nearest upsampling,
    repeat_interleave): a unit dim after it, expanded to r, merged back. A copy, as in eager;
    the gradient sums each group of copies."""
    shape = list(meta_of(x).shape)
    split, expanded, final = [], [], []
    for d, n in enumerate(shape):
        r = dims_and_repeats.get(d, 1)
        split += [n, 1]
        expanded += [n, r]
        final.append(n * r)
    x = C.emit_view(b, "reshape", x, shape=tuple(split))
    x = _expand(b, x, tuple(expanded))
    out = C.emit_view(b, "reshape", x, shape=tuple(final))
    return C.emit_pointwise(b, "identity", [out], dtype=meta_of(out).dtype)


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


@binds(torch.repeat_interleave, _t("repeat_interleave"))
def _repeat_interleave(b, x, repeats=None, dim=None, *, output_size=None):
    if not isinstance(repeats, int):
        raise Unsupported("repeat_interleave with tensor repeats is not supported yet")
    if dim is None:
        x = C.emit_view(b, "reshape", x, shape=(numel(meta_of(x).shape),))
        dim = 0
    return _interleave(b, x, {dim % len(meta_of(x).shape): repeats})


@binds(_t("unfold"))
def _unfold(b, x, dimension, size, step):
    if not meta_of(x).shape:
        raise Unsupported("unfold of a 0-d tensor")
    if size <= 0 or step <= 0:
        raise Unsupported("unfold needs a positive size and step (eager raises)")
    dim = dimension % max(len(meta_of(x).shape), 1)
    if size > meta_of(x).shape[dim]:
        raise Unsupported("unfold: the window is larger than the dim (eager raises)")
    return C.emit_view(b, "unfold", x, dim=dim, size=size, step=step)


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
        values = _detached(b, windows)
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


def _l2_norm(b, x, dim, keepdim):
    if not meta_of(x).dtype.is_floating_point:
        raise Unsupported("norm of a non-floating tensor is not supported yet")
    squares = C.emit_reduction(b, "sum", _pointwise(b, "mul", [x, x]), _dims(x, dim), keepdim)
    return _pointwise(b, "norm_sqrt", [squares])


@binds(torch.norm, _t("norm"))
def _norm(b, x, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    _no_out({"out": out})
    if p not in (2, 2.0, "fro") or dtype is not None:
        raise Unsupported(f"norm(p={p!r}) is not supported yet (only the 2-norm)")
    return _l2_norm(b, x, dim, keepdim)


@binds(torch.linalg.vector_norm)
def _vector_norm(b, x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    _no_out({"out": out})
    if ord not in (2, 2.0) or dtype is not None:
        raise Unsupported(f"vector_norm(ord={ord!r}) is not supported yet (only the 2-norm)")
    return _l2_norm(b, x, dim, keepdim)


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


@binds(F.pad)
def _pad(b, input, pad, mode="constant", value=None):
    """Constant padding, one dim at a time from the last (a negative pad crops): the input
    slice-scattered into a filled tensor; its gradient is the slice."""
    if mode != "constant":
        raise Unsupported(f"pad(mode={mode!r}) is not supported yet")
    fill = 0 if value is None else value
    x, ndim = input, len(meta_of(input).shape)
    for k in range(len(pad) // 2):
        dim = ndim - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        size = meta_of(x).shape[dim]
        start, stop = max(-before, 0), size - max(-after, 0)
        if start or stop != size:
            x = C.emit_slice(b, x, dim, start, 1, stop - start)
        if before > 0 or after > 0:
            target = list(meta_of(x).shape)
            n = target[dim]
            target[dim] = n + max(before, 0) + max(after, 0)
            base = C.emit_fill(b, tuple(target), meta_of(input).dtype, fill)
            x = C.emit_slice_scatter(b, base, x, dim, max(before, 0), 1, n)
    return x


@binds(_t("repeat"))
def _repeat(b, x, *sizes):
    """x.repeat(r0, r1, ...): each dim d of size n becomes r copies, as expand on a new dim
    in front of it and a reshape merging the two (a copy, as in eager)."""
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes
    shape = meta_of(x).shape
    if len(sizes) < len(shape):
        raise Unsupported("repeat with fewer sizes than dims (eager raises)")
    shape = (1,) * (len(sizes) - len(shape)) + tuple(shape)
    x = C.emit_view(b, "reshape", x, shape=shape)
    interleaved, expanded = [], []
    for r, n in zip(sizes, shape):
        interleaved += [1, n]
        expanded += [r, n]
    x = C.emit_view(b, "reshape", x, shape=tuple(interleaved))
    x = _expand(b, x, tuple(expanded))
    out = C.emit_view(b, "reshape", x, shape=tuple(r * n for r, n in zip(sizes, shape)))
    return C.emit_pointwise(b, "identity", [out], dtype=meta_of(out).dtype)


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


@binds(torch.clamp, _t("clamp"), torch.clip, _t("clip"))
def _clamp(b, x, min=None, max=None, *, out=None):
    _no_out({"out": out})
    if min is None and max is None:
        raise Unsupported("clamp without min and max (eager raises)")
    if min is None:
        return _pointwise(b, "clamp_max", [x, max])
    if max is None:
        return _pointwise(b, "clamp_min", [x, min])
    return _pointwise(b, "clamp", [x, min, max])


binds(torch.clamp_min, _t("clamp_min"))(lambda b, x, min: _clamp(b, x, min=min))
binds(torch.clamp_max, _t("clamp_max"))(lambda b, x, max: _clamp(b, x, max=max))
binds(_t("clamp_"))(_in_place_variant(_clamp))


# ----------------------------------------------------------------------------- split, cat, masks
@binds(torch.split, _t("split"))
def _split(b, x, split_size_or_sections, dim=0):
    size = meta_of(x).shape[dim % len(meta_of(x).shape)]
    dim %= len(meta_of(x).shape)
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        sizes = [min(step, size - i) for i in range(0, size, step)] or [0]
    else:
        sizes = list(split_size_or_sections)
    out, start = [], 0
    for n in sizes:
        out.append(C.emit_slice(b, x, dim, start, 1, n))
        start += n
    return tuple(out)


@binds(torch.chunk, _t("chunk"))
def _chunk(b, x, chunks, dim=0):
    size = meta_of(x).shape[dim % len(meta_of(x).shape)]
    step = -(-size // chunks)
    return _split(b, x, step, dim)


@binds(torch.unbind, _t("unbind"))
def _unbind(b, x, dim=0):
    dim %= len(meta_of(x).shape)
    shape = meta_of(x).shape
    return tuple(C.emit_view(b, "reshape", C.emit_slice(b, x, dim, i, 1, 1), shape=shape[:dim] + shape[dim + 1:])
                 for i in range(shape[dim]))


@binds(torch.cat, torch.concat, torch.concatenate)
def _cat(b, tensors, dim=0, *, out=None):
    _no_out({"out": out})
    tensors = [t for t in tensors if not (len(meta_of(t).shape) == 1 and meta_of(t).shape[0] == 0)]
    if not tensors or not all(isinstance(t, fx.Node) for t in tensors):
        raise Unsupported("cat of non-tensors")
    ndim = len(meta_of(tensors[0]).shape)
    dim %= ndim
    dtype = result_dtype(tensors)
    shape = list(meta_of(tensors[0]).shape)
    shape[dim] = sum(meta_of(t).shape[dim] for t in tensors)
    # NOTE: concatenation is a chain of slice-scatters into a buffer of the result's shape:
    # each element reads exactly one input, and the gradient of each input is its slice.
    out = C.emit_fill(b, tuple(shape), dtype, 0)
    start = 0
    for t in tensors:
        n = meta_of(t).shape[dim]
        if meta_of(t).dtype != dtype:
            t = C.emit_pointwise(b, "identity", [t], dtype=dtype)
        out = C.emit_slice_scatter(b, out, t, dim, start, 1, n)
        start += n
    return out


@binds(torch.stack)
def _stack(b, tensors, dim=0, *, out=None):
    _no_out({"out": out})
    ndim = len(meta_of(tensors[0]).shape) + 1
    dim %= ndim
    expanded = []
    for t in tensors:
        shape = list(meta_of(t).shape)
        shape.insert(dim, 1)
        expanded.append(C.emit_view(b, "reshape", t, shape=shape))
    return _cat(b, expanded, dim)


def _triangle(keep_lower):
    def bind(b, x, diagonal=0, *, out=None):
        _no_out({"out": out})
        shape = meta_of(x).shape
        if len(shape) < 2:
            raise Unsupported("tril/triu of a tensor with fewer than 2 dims (eager raises)")
        rows = C.emit_iota(b, shape, len(shape) - 2)
        cols = C.emit_iota(b, shape, len(shape) - 1)
        shifted = C.emit_pointwise(b, "add", [rows, int(diagonal)], dtype=torch.int64)
        keep = C.emit_pointwise(b, "le" if keep_lower else "ge", [cols, shifted], dtype=torch.bool)
        return C.emit_pointwise(b, "where", [keep, x, 0], dtype=meta_of(x).dtype)
    return bind


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
    shifted, _ = _shifted(b, scores, -1)
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


# the loss bindings that pick by class index live in their own module (it registers them)
from compiler.ops import cross_entropy  # noqa: E402,F401
