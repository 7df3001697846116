"""Sign and magnitude, and rounding: piecewise functions whose derivatives follow PyTorch's
conventions, not SymPy's (SymPy's diff(sign) is a DiracDelta, its Abs' at 0 is undefined).

NOTE: the autograd notes, "Gradients for non-differentiable functions": abs'(0) = 0, and
sign, floor, ceil, round and trunc have derivative 0 everywhere.
"""

from __future__ import annotations

import sympy
import torch

from compiler.ir.ops.primitives.base import Builtin, Primitive, composite, is_number
from compiler.ir.ops.primitives.complex import CAbs
from compiler.ir.ops.symbols import conj, is_complex_symbol


def _render_sign(printer, e):
    x, c = printer.p(e.args[0]), printer.whole
    return f"tl.where({x} > 0, {c('1.0')}, tl.where({x} < 0, {c('-1.0')}, {c('0.0')}))"


def _render_sign_cpp(printer, e):
    x, c = printer.p(e.args[0]), (lambda v: printer.literal(sympy.Integer(v)))
    return printer.where(f"{x} > {c(0)}", c(1), printer.where(f"{x} < {c(0)}", c(-1), c(0)))


class Sign(Primitive, sympy.Function):
    """sign(x) with sign(0) = 0; derivative 0 everywhere (PyTorch's convention)."""

    nargs = 1
    torch_fn = torch.sign
    op, binds, in_place = "sign", ("sign",), True

    @classmethod
    def eval(cls, x):
        if is_number(x) and x.is_real:
            return sympy.sign(x)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        return _render_sign(printer, e)

    @classmethod
    def render_cpp(cls, printer, e):
        return _render_sign_cpp(printer, e)


class SympySign(Builtin):
    """SymPy's own sign, from derivatives (hypot's second); printed as Sign."""

    function, torch_fn, user_op = sympy.sign, torch.sign, False

    @classmethod
    def render(cls, printer, e):
        return _render_sign(printer, e)

    @classmethod
    def render_cpp(cls, printer, e):
        return _render_sign_cpp(printer, e)


class Abs(Primitive, sympy.Function):
    """|x| for real x; d/dx = sign(x), so abs'(0) = 0 as in eager PyTorch."""

    nargs = 1
    triton, torch_fn = "tl.abs", torch.abs
    op, in_place, math = "abs", True, True  # bound by hand: a real result for complex input

    @classmethod
    def eval(cls, x):
        if is_number(x) and x.is_real:
            return abs(x)

    def fdiff(self, argindex=1):
        return AbsSlope(self.args[0])

    @classmethod
    def expression(cls, a):
        """The op ``abs``: |z| of a complex z is written in (z, z̄) for Wirtinger derivatives."""
        return CAbs(a, conj(a)) if is_complex_symbol(a) else Abs(a)


class AbsSlope(Sign):
    """sign(x) as abs's derivative: eager's abs backward is ``grad * x.sgn()``, and a real
    tensor's sgn sends no gradient at all, where sign sends zeros. So a double backward stops
    here (``gradient_undefined``): a zero reaching var's backward would be 0 * NaN there (fuzz
    seed 4363). Sign's value, printing and derivative otherwise; not an op of its own."""

    op = expression = None
    user_op = False
    gradient_undefined = True


class SympyAbs(Builtin):
    """SymPy's own Abs (sqrt(x**2) of a real x becomes one)."""

    function, triton, torch_fn, user_op = sympy.Abs, "tl.abs", torch.abs, False


class _Rounding(Primitive, sympy.Function):
    """Piecewise-constant rounding: derivative 0 everywhere (eager's convention); an integer
    tensor is whole already, so its binding returns it unchanged."""

    abstract = True
    nargs = 1
    integers_unchanged, in_place = True, True

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Floor(_Rounding):
    triton, torch_fn = "libdevice.floor", torch.floor
    op, binds, math = "floor", ("floor",), True


class Ceil(_Rounding):
    triton, torch_fn = "libdevice.ceil", torch.ceil
    op, binds, math = "ceil", ("ceil",), True


class Round(_Rounding):
    """Round half to even, as torch.round (bound by hand: decimals=)."""

    triton, torch_fn = "libdevice.rint", torch.round
    op = "round"


class Trunc(_Rounding):
    triton, torch_fn = "libdevice.trunc", torch.trunc
    op, binds, math = "trunc", ("trunc", "fix"), True


composite("frac", lambda a: a - Trunc(a), binds=("frac",), in_place=True)
