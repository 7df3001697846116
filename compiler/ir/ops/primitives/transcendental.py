"""Exponentials, logarithms, trigonometric and hyperbolic functions (SymPy builtins, declared),
their accurate forms (Log1p, Expm1), and NormSqrt; log2/log10/exp2, hypot, logaddexp, xlogy."""

from __future__ import annotations

import sympy
import torch

from compiler.ir.ops.primitives.base import (
    FLOAT,
    ZERO,
    Builtin,
    Primitive,
    as_tensor,
    complex_exp,
    complex_log,
    composite,
)
from compiler.ir.ops.primitives.comparisons import Maximum, Where, compare
from compiler.ir.ops.primitives.rounding import Abs

# NOTE: a real-only op's generated binding runs complex tensors eagerly, with the reason
# (complex_inputs=False); exp, log, sin, cos and tanh have complex rules (``re_im``).


class Exp(Builtin):
    function, triton, torch_fn = sympy.exp, "tl.exp", torch.exp
    op, result, binds, complex_inputs, in_place, math = "exp", FLOAT, ("exp",), True, True, True

    @classmethod
    def re_im(cls, cx, x):
        return complex_exp(cx(x))


class Log(Builtin):
    function, triton, torch_fn = sympy.log, "tl.log", torch.log
    op, result, binds, complex_inputs, in_place, math = "log", FLOAT, ("log",), True, True, True

    @classmethod
    def re_im(cls, cx, x):
        return complex_log(cx(x))


class Sin(Builtin):
    function, triton, torch_fn = sympy.sin, "tl.sin", torch.sin
    op, result, binds, complex_inputs, in_place, math = "sin", FLOAT, ("sin",), True, True, True

    @classmethod
    def re_im(cls, cx, x):
        a, b = cx(x)
        if b == 0:
            return (sympy.sin(a), ZERO)
        return (sympy.sin(a) * sympy.cosh(b), sympy.cos(a) * sympy.sinh(b))


class Cos(Builtin):
    function, triton, torch_fn = sympy.cos, "tl.cos", torch.cos
    op, result, binds, complex_inputs, in_place, math = "cos", FLOAT, ("cos",), True, True, True

    @classmethod
    def re_im(cls, cx, x):
        a, b = cx(x)
        if b == 0:
            return (sympy.cos(a), ZERO)
        return (sympy.cos(a) * sympy.cosh(b), -sympy.sin(a) * sympy.sinh(b))


class Tanh(Builtin):
    function, triton, torch_fn = sympy.tanh, "libdevice.tanh", torch.tanh
    op, result, binds, complex_inputs, in_place, math = "tanh", FLOAT, ("tanh",), True, True, True

    @classmethod
    def re_im(cls, cx, x):
        a, b = cx(x)
        if b == 0:
            return (sympy.tanh(a), ZERO)
        den = sympy.cosh(2 * a) + sympy.cos(2 * b)
        return (sympy.sinh(2 * a) / den, sympy.sin(2 * b) / den)


def _real_unary(name, function, triton, torch_fn, aliases=()):
    """Declare a real-only unary builtin: float result, generated binding and in-place variant."""
    facts = dict(function=function, triton=triton, torch_fn=torch_fn, op=name, result=FLOAT,
                 binds=(name, *aliases), in_place=True, math=True)
    return type(name.capitalize(), (Builtin,), facts)


Tan = _real_unary("tan", sympy.tan, "libdevice.tan", torch.tan)
Asin = _real_unary("asin", sympy.asin, "libdevice.asin", torch.asin, ("arcsin",))
Acos = _real_unary("acos", sympy.acos, "libdevice.acos", torch.acos, ("arccos",))
Atan = _real_unary("atan", sympy.atan, "libdevice.atan", torch.atan, ("arctan",))
Sinh = _real_unary("sinh", sympy.sinh, "libdevice.sinh", torch.sinh)
Cosh = _real_unary("cosh", sympy.cosh, "libdevice.cosh", torch.cosh)
Asinh = _real_unary("asinh", sympy.asinh, "libdevice.asinh", torch.asinh, ("arcsinh",))
Acosh = _real_unary("acosh", sympy.acosh, "libdevice.acosh", torch.acosh, ("arccosh",))
Atanh = _real_unary("atanh", sympy.atanh, "libdevice.atanh", torch.atanh, ("arctanh",))


class Atan2(Builtin):
    function, triton, torch_fn = sympy.atan2, "libdevice.atan2", torch.atan2
    op, result, binds, in_place, math = "atan2", FLOAT, ("atan2", "arctan2"), True, True


class Log1p(Primitive, sympy.Function):
    """log(1 + x), printed as libdevice's log1p: exact near 0, as eager's."""

    nargs = 1
    triton, torch_fn = "libdevice.log1p", torch.log1p
    op, result, binds, in_place, math = "log1p", FLOAT, ("log1p",), True, True

    def fdiff(self, argindex=1):
        return 1 / (1 + self.args[0])


class Expm1(Primitive, sympy.Function):
    """exp(x) - 1, printed as libdevice's expm1."""

    nargs = 1
    triton, torch_fn = "libdevice.expm1", torch.expm1
    op, result, binds, in_place, math = "expm1", FLOAT, ("expm1",), True, True

    def fdiff(self, argindex=1):
        return sympy.exp(self.args[0])


class NormSqrt(Primitive, sympy.Function):
    """sqrt(s) of a sum of squares, as in a vector norm: its derivative is 0 where s = 0 (eager's
    norm backward masks the zero vector), not the infinity that would turn 0 * inf into NaN."""

    nargs = 1
    triton, torch_fn = "tl.sqrt", torch.sqrt
    op, result = "norm_sqrt", FLOAT
    user_op = False  # emitted by the norm bindings only

    def fdiff(self, argindex=1):
        return NormSqrtSlope(self.args[0])


class NormSqrtSlope(Primitive, sympy.Function):
    """NormSqrt's derivative: 1 / (2 sqrt(s)), 0 at s = 0. Its own derivative is NaN at s = 0, as
    eager's double backward of a norm at the zero vector: there eager's norm backward,
    ``(self / norm).masked_fill_(norm == 0, 0)``, differentiates to 0 * (1 / 0) (fuzz seeds 3213,
    5457). A ``Where`` would differentiate to 0 there."""

    nargs = 1
    user_op = False  # emitted by NormSqrt's derivative only

    def fdiff(self, argindex=1):
        s = self.args[0]
        return Where(compare("eq", s, 0), sympy.nan, -1 / (4 * s * NormSqrt(s)))

    @classmethod
    def render(cls, printer, e):
        s = e.args[0]
        return printer.p(Where(compare("eq", s, 0), 0, 1 / (2 * NormSqrt(s))))

    @classmethod
    def torch_eval(cls, s):
        s = as_tensor(s)
        return torch.where(s == 0, torch.zeros_like(s), 0.5 / torch.sqrt(s))


class StdSqrt(Primitive, sympy.Function):
    """sqrt(var) in std: its derivative is 0 where var = 0, as eager's std_backward masks the zero
    std, and so is its second derivative there (eager's double backward of std at a zero std is
    0, unlike a norm's at the zero vector: ``NormSqrtSlope``)."""

    nargs = 1
    triton, torch_fn = "tl.sqrt", torch.sqrt
    op, result = "std_sqrt", FLOAT
    user_op = False  # emitted by the std bindings only

    def fdiff(self, argindex=1):
        s = self.args[0]
        return Where(compare("eq", s, 0), 0, 1 / (2 * StdSqrt(s)))


class DegenerateVarianceTerm(Primitive, sympy.Function):
    """0 (x * 0: NaN where x is infinite, as the variance is then), with eager's gradient of a
    variance over all elements that has no degrees of freedom: ``DegenerateVarianceSlope``. The
    variance binding adds its sum to the value computed from detached x (``bindings.reductions.
    _variance``)."""

    nargs = 2
    op, result = "degenerate_var_term", FLOAT
    user_op = False  # emitted by the var bindings only

    def fdiff(self, argindex=1):
        return DegenerateVarianceSlope(*self.args) if argindex == 1 else sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        return f"({printer.p(e.args[0])} * 0.0)"

    @classmethod
    def torch_eval(cls, x, mean):
        return as_tensor(x) * 0.0


class DegenerateVarianceSlope(Primitive, sympy.Function):
    """Eager's var_backward where n - correction <= 0 over all elements: grad * (x == mean ? NaN :
    inf), a constant of x (no double backward through it; fuzz seeds 4363, 6343)."""

    nargs = 2
    user_op = False

    def fdiff(self, argindex=1):
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        x, mean = e.args
        return printer.p(Where(compare("eq", x, mean), sympy.nan, sympy.oo))

    @classmethod
    def torch_eval(cls, x, mean):
        x, mean = as_tensor(x), as_tensor(mean)
        return torch.where(x == mean, torch.full_like(x, float("nan")), torch.full_like(x, float("inf")))


class Hypot(Primitive, sympy.Function):
    """sqrt(a² + b²) of reals without overflow or underflow, as C's hypot (eager's torch.hypot
    and complex |z|): printed scaled by m = max(|a|, |b|), m·sqrt((a/m)² + (b/m)²), so parts
    near 1e30 in float32 do not square to inf (nor parts near 1e-30 to 0); inf if either part is
    infinite (even with a NaN), 0 at (0, 0). Derivatives a/hypot and b/hypot (eager's hypot
    backward)."""

    nargs = 2
    torch_fn = torch.hypot
    # (the op hypot, compiler.math.hypot in user ops, and complex |z|, sgn and log)

    def fdiff(self, argindex=1):
        return self.args[argindex - 1] / self

    @classmethod
    def render(cls, printer, e):
        a, b = e.args
        m = Maximum(Abs(a), Abs(b))
        scale = Where(compare("eq", m, 0), 1, m)  # (0, 0): 0 · sqrt(0), not 0/0
        # (unevaluated squares: SymPy would write (a/m)² as a²/m², which overflows again)
        ratio_a, ratio_b = sympy.Pow(a / scale, 2, evaluate=False), sympy.Pow(b / scale, 2, evaluate=False)
        scaled = m * sympy.sqrt(sympy.Add(ratio_a, ratio_b, evaluate=False), evaluate=False)
        # (|a| = inf with b NaN: C's hypot gives inf, where Maximum would propagate the NaN)
        infinite = sympy.oo
        return printer.p(Where(compare("eq", Abs(a), infinite), infinite,
                               Where(compare("eq", Abs(b), infinite), infinite, scaled)))

    @classmethod
    def render_cpp(cls, printer, e) -> str:
        """C's own hypot (<cmath>; at::vec's in a vector body), as eager's CPU kernels compute it."""
        return printer.call("std::hypot", *(printer.p(a) for a in e.args))


_FLOAT_REAL = dict(result=FLOAT, in_place=True)
composite("log2", lambda a: sympy.log(a) / sympy.log(2), binds=("log2",), **_FLOAT_REAL)
composite("log10", lambda a: sympy.log(a) / sympy.log(10), binds=("log10",), **_FLOAT_REAL)
composite("exp2", lambda a: sympy.exp(a * sympy.log(2)), binds=("exp2",), **_FLOAT_REAL)
composite("hypot", lambda a, b: Hypot(a, b), binds=("hypot",), math=True, **_FLOAT_REAL)
composite("xlogy", lambda a, b: Where(compare("eq", a, 0), 0, a * sympy.log(b)), binds=("xlogy",), **_FLOAT_REAL)


class LogAddExp(Primitive, sympy.Function):
    """log(exp(a) + exp(b)), printed as eager's stable max(a, b) + log1p(exp(-|a - b|)) (a + log 2
    where a == b, so logaddexp(inf, inf) is inf). A head of its own, not that expression: SymPy
    would differentiate logaddexp(v, v) as v + log 2 (derivative 1 where eager's is NaN at NaN)."""

    nargs = 2
    torch_fn = torch.logaddexp
    op, result, binds, math = "logaddexp", FLOAT, ("logaddexp",), True

    def fdiff(self, argindex=1):
        a, b = self.args
        return LogAddExpShare(a, b) if argindex == 1 else LogAddExpShare(b, a)

    @classmethod
    def render(cls, printer, e):
        a, b = e.args
        return printer.p(Where(compare("eq", a, b), a + sympy.log(2), Maximum(a, b) + Log1p(sympy.exp(-Abs(a - b)))))


class LogAddExpShare(Primitive, sympy.Function):
    """1 / (1 + exp(b - a)): the share of logaddexp(a, b)'s gradient that reaches a, eager's
    formula, printed as is (NaN where a or b is NaN, or both infinite; 1/2 where a == b)."""

    nargs = 2
    user_op = False  # emitted by LogAddExp's derivative only

    def fdiff(self, argindex=1):
        slope = self * (1 - self)
        return slope if argindex == 1 else -slope

    @classmethod
    def render(cls, printer, e):
        a, b = printer.p(e.args[0]), printer.p(e.args[1])
        return f"(1.0 / (1.0 + tl.exp(({b}) - ({a}))))"

    @classmethod
    def torch_eval(cls, a, b):
        return 1 / (1 + torch.exp(as_tensor(b) - as_tensor(a)))
