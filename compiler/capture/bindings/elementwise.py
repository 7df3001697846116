"""Bindings of elementwise torch functions: arithmetic, math, activations, complex parts,
comparisons and logic, casts, constants, clamp, and their in-place variants.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from compiler.capture.bindings.registry import BINDINGS, Unsupported, _in_place, _in_place_variant, _no_out, _t, binds
from compiler.capture.bindings.views import _expand
from compiler.ir.graph import meta_of, result_dtype
from compiler.ir.ops import catalog as C
from compiler.ir.ops import primitives
from compiler.ir.ops.primitives.base import FLOAT

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


# ----------------------------------------------------------------------------- generated
# An op declared with ``binds`` in compiler.ir.ops.primitives gets its binding here, made from its
# declaration (arity, dtype kind, complex inputs, integers unchanged); ops whose arguments need
# handling of their own (alpha=, inplace=, decimals=, a real result for complex input) are
# bound by hand below.
def _generated_binding(entry):
    name, float_result = entry.op, entry.result == FLOAT

    def check_real(x, message):
        if not entry.complex_inputs and isinstance(x, fx.Node) and meta_of(x).dtype.is_complex:
            raise Unsupported(message)

    if entry.arity() == 1:
        def bind(b, x, **kwargs):
            _no_out(kwargs)
            check_real(x, f"{name} of a complex tensor is not supported yet")
            if entry.integers_unchanged and not meta_of(x).dtype.is_floating_point:
                return C.emit_pointwise(b, "identity", [x], dtype=meta_of(x).dtype)  # integers are whole already
            return _pointwise(b, name, [x], float_result=float_result)
    else:
        def bind(b, x, y, *, out=None):
            _no_out({"out": out})
            for operand in (x, y):
                check_real(operand, f"{name} of complex tensors is not supported yet")
            return _pointwise(b, name, [x, y], float_result=float_result)
    bind.__qualname__ = f"generated_binding[{name}]"
    return bind


def _torch_callables(entry):
    """The callables an op binds: each of its names on torch, torch.Tensor and torch.special
    (dunder names on torch.Tensor only), then ``also_binds``."""
    found = []
    for name in entry.binds:
        modules = (torch.Tensor,) if name.startswith("__") else (torch, torch.Tensor, torch.special)
        found += [getattr(module, name) for module in modules if hasattr(module, name)]
    return [*found, *entry.also_binds]


for _entry in primitives.OPS.values():
    if _entry.binds:
        binds(*_torch_callables(_entry))(_generated_binding(_entry))


@binds(torch.round, _t("round"))
def _round(b, x, *, decimals=0, out=None):
    _no_out({"out": out})
    if decimals != 0:
        raise Unsupported("round(decimals=...) is not supported yet")
    return _generated_binding(primitives.OPS["round"])(b, x)


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


_KEPT_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _same_device(x, device):
    """Raise Unsupported unless ``device`` (a torch.device, a string, an index) is ``x``'s own."""
    if device is None:
        return
    here = meta_of(x).device
    try:
        there = torch.device(device)
    except (RuntimeError, TypeError):
        raise Unsupported(f"Tensor.to({device!r}): not a device") from None
    if here is None or there.type != here.type or (there.index is not None and there.index != here.index):
        raise Unsupported("moving tensors between devices inside a compiled function is not supported yet "
                          f"({here} -> {there}): move them before the call")


@binds(_t("to"), _t("type"))
def _to(b, x, *args, **kwargs):
    """Tensor.to / Tensor.type on x's own device: a cast, or x itself when nothing changes (a copy
    with copy=True). The forms: to(dtype), to(device, dtype), to(other tensor), keywords."""
    args = list(args)
    dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
    copy = kwargs.pop("copy", False)
    kwargs.pop("non_blocking", None)
    if kwargs.pop("memory_format", None) not in _KEPT_FORMATS:
        raise Unsupported("Tensor.to(memory_format=...) other than preserve/contiguous is not supported yet")
    if kwargs:
        raise Unsupported(f"Tensor.to() with {sorted(kwargs)} is not supported yet")
    if args and isinstance(args[0], fx.Node):       # to(other): other's dtype and device
        other = args.pop(0)
        dtype, device = meta_of(other).dtype, meta_of(other).device or device
    elif args and isinstance(args[0], (torch.device, str, int)) and not isinstance(args[0], bool):
        device = args.pop(0)
    if args and isinstance(args[0], torch.dtype):
        dtype = args.pop(0)
    if args and isinstance(args[0], bool):           # non_blocking, then copy, positionally
        args.pop(0)
        copy = args.pop(0) if args and isinstance(args[0], bool) else copy
    if args or (dtype is not None and not isinstance(dtype, torch.dtype)):
        raise Unsupported("Tensor.to() with these arguments is not supported yet")
    _same_device(x, device)
    dtype = dtype or meta_of(x).dtype
    if dtype == meta_of(x).dtype and not copy:
        return x
    return C.emit_pointwise(b, "identity", [x], dtype=dtype,
                            requires_grad=meta_of(x).requires_grad and (dtype.is_floating_point or dtype.is_complex))


@binds(torch.clone, _t("clone"))
def _clone(b, x, *, memory_format=torch.preserve_format):
    """A copy of x (a new value; its gradient passes straight through)."""
    if memory_format not in _KEPT_FORMATS:
        raise Unsupported("clone(memory_format=...) other than preserve/contiguous is not supported yet")
    return C.emit_pointwise(b, "identity", [x], dtype=meta_of(x).dtype)


# x.float(), x.long(), ...: casts, as x.to(dtype)
for _name, _dtype in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                      ("bfloat16", torch.bfloat16), ("long", torch.int64), ("int", torch.int32),
                      ("short", torch.int16), ("char", torch.int8), ("byte", torch.uint8), ("bool", torch.bool),
                      ("cfloat", torch.complex64), ("cdouble", torch.complex128)):
    binds(_t(_name))(lambda b, x, _dtype=_dtype: _to(b, x, _dtype))


# ----------------------------------------------------------------------------- constants
def _filled(value):
    def bind(b, x, *, dtype=None, layout=None, device=None, pin_memory=False, memory_format=None,
             requires_grad=False, fill_value=None):
        if layout not in (None, torch.strided) or requires_grad or memory_format not in _KEPT_FORMATS:
            raise Unsupported("*_like with layout/requires_grad/memory_format arguments is not supported yet")
        _same_device(x, device)
        fill = value if fill_value is None else fill_value
        out_dtype = dtype or meta_of(x).dtype
        # a pointwise op of x that ignores x's values: it has x's shape and no gradient
        expr = C.scalar_expr("fill", [float(fill) if out_dtype.is_floating_point else int(fill)])[0]
        return b.call(C.POINTWISE["fill"], [], shape=meta_of(x).shape, dtype=out_dtype, requires_grad=False, expr=expr)
    return bind


binds(torch.zeros_like)(_filled(0))
binds(torch.ones_like)(_filled(1))


def _new_filled(value):
    """Tensor.new_ones / new_zeros / new_full / new_empty: a constant of the given size, x's dtype
    unless given (new_empty's values are unspecified in eager: zeros here)."""
    def bind(b, x, *size, fill_value=None, dtype=None, layout=None, device=None, pin_memory=False,
             requires_grad=False):
        if value == "full":
            size, fill_value = size[:-1] if fill_value is None else size, size[-1] if fill_value is None else fill_value
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        if any(not isinstance(s, int) for s in size) or isinstance(fill_value, fx.Node):
            raise Unsupported("Tensor.new_* with a tensor size or fill value is not supported yet")
        if layout not in (None, torch.strided) or pin_memory or requires_grad:
            raise Unsupported("Tensor.new_* with layout/pin_memory/requires_grad is not supported yet")
        _same_device(x, device)
        out_dtype = dtype or meta_of(x).dtype
        return C.emit_fill(b, tuple(size), out_dtype, value if fill_value is None else fill_value)
    return bind


binds(_t("new_ones"))(_new_filled(1))
binds(_t("new_zeros"))(_new_filled(0))
binds(_t("new_empty"))(_new_filled(0))
binds(_t("new_full"))(_new_filled("full"))


@binds(torch.full_like)
def _full_like(b, x, fill_value, **kwargs):
    return _filled(fill_value)(b, x, **kwargs)


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


def _cast(b, x, dtype):
    """``x`` as ``dtype`` (a result computed in float32 from float32 statistics, rounded once)."""
    if meta_of(x).dtype == dtype:
        return x
    return C.emit_pointwise(b, "identity", [x], dtype=dtype)


@binds(torch.clamp, _t("clamp"), torch.clip, _t("clip"))
def _clamp(b, x, min=None, max=None, *, out=None):
    _no_out({"out": out})
    if min is None and max is None:
        raise Unsupported("clamp without min and max (eager raises)")
    if min is None:
        return _pointwise(b, "clamp_max", [x, max])
    if max is None:
        return _pointwise(b, "clamp_min", [x, min])
    if isinstance(min, fx.Node) or isinstance(max, fx.Node) or min > max:
        return _crossing_clamp(b, x, min, max)
    return _pointwise(b, "clamp", [x, min, max])


def _crossing_clamp(b, x, lo, hi):
    """clamp with bounds that may cross (tensor bounds, or min > max): eager's min(max(x, lo), hi),
    which is ``hi`` wherever lo > hi. Its gradients as eager's clamp_backward_min_max: to hi where
    x > hi or lo > hi, to lo where x < lo below it, to x in between."""
    dtype = result_dtype([x, lo, hi])
    above = _pointwise(b, "logical_or", [_pointwise(b, "gt", [x, hi]), _pointwise(b, "gt", [lo, hi])])
    inside = C.emit_pointwise(b, "where", [_pointwise(b, "lt", [x, lo]), lo, x], dtype=dtype)
    return C.emit_pointwise(b, "where", [above, hi, inside], dtype=dtype)


binds(torch.clamp_min, _t("clamp_min"))(lambda b, x, min: _clamp(b, x, min=min))
binds(torch.clamp_max, _t("clamp_max"))(lambda b, x, max: _clamp(b, x, max=max))
binds(_t("clamp_"))(_in_place_variant(_clamp))


# In-place variants (x.add_(y), x += y): the out-of-place binding, written back into x, for
# every op declared ``in_place`` (as torch._refs' _make_inplace).
for _name, _entry in primitives.OPS.items():
    _source = BINDINGS.get(getattr(torch.Tensor, _name, None))
    if _entry.in_place and _source is not None and hasattr(torch.Tensor, f"{_name}_"):
        binds(getattr(torch.Tensor, f"{_name}_"))(_in_place_variant(_source))
binds(torch.Tensor.__iadd__)(_in_place_variant(_add))
binds(torch.Tensor.__isub__)(_in_place_variant(_sub))
binds(torch.Tensor.__imul__)(_in_place_variant(_mul))
binds(torch.Tensor.__itruediv__)(_in_place_variant(_div))
binds(torch.relu_)(_in_place_variant(BINDINGS[torch.relu]))
