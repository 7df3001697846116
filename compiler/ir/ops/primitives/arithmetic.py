"""Arithmetic ops: SymPy's own + - * / ** (printed structurally by the printer, not primitives
themselves) named as catalog ops, with their dtype kinds, bindings and in-place variants."""

from __future__ import annotations

import math

import sympy
import torch

from compiler.ir.ops.primitives.base import FLOAT, Primitive, as_tensor, composite
from compiler.ir.ops.primitives.comparisons import Where, compare


def _divide(a, b):
    # NOTE: SymPy makes x / 0 the complex infinity (zoo), which no kernel can print; IEEE
    # division by a constant zero is a product with an infinity of the zero's sign (x / 0.0
    # is inf, -inf or NaN, as eager; var() with no degrees of freedom divides by 0.0).
    if getattr(b, "is_number", False) and b.is_zero and b.is_extended_real:
        return a * (sympy.oo if math.copysign(1.0, float(b)) > 0 else -sympy.oo)
    return a / b


class PowTensor(Primitive, sympy.Function):
    """a ** b of two real tensors, with eager's derivatives at a = 0.

    SymPy's Pow differentiates to b·a^b/a and a^b·log(a): 0/0 and 0·(-inf), NaN, at a = 0. Eager's
    pow_backward_self is 0 where b == 0 (else b·a^(b-1), 0 for b > 1 at a = 0), and its
    pow_backward_exponent is 0 where a == 0 and b >= 0 (x ** p with a learned exponent p, as in
    generalized-mean pooling, meets zeros after a relu). A Python-number exponent or base keeps
    SymPy's Pow, whose derivatives have no such point and which prints x ** 2 as x * x.
    """

    nargs = 2
    torch_fn = torch.pow

    @classmethod
    def eval(cls, a, b):
        if a.is_number and b.is_number:
            return a**b

    def fdiff(self, argindex=1):
        a, b = self.args
        if argindex == 1:
            return Where(compare("eq", b, 0), 0, b * PowTensor(a, b - 1))
        return PowExponentSlope(a, b)

    @classmethod
    def render(cls, printer, e):
        return f"libdevice.pow({printer.p(e.args[0])}, {printer.p(e.args[1])})"

    @classmethod
    def torch_eval(cls, a, b):
        return torch.pow(as_tensor(a), b)


class PowExponentSlope(Primitive, sympy.Function):
    """PowTensor's derivative in its exponent: a^b·log(a), 0 where a == 0 and b >= 0 (eager's
    pow_backward_exponent, ``grad * where(cond, 0, result * log(self))``). Its own derivatives are
    NaN at those points, as eager's double backward: the where sends a zero into the masked branch,
    and 0 * log(0) is NaN there (fuzz seed 9919); a Where would differentiate to 0."""

    nargs = 2
    user_op = False  # PowTensor's derivative only

    def _at_zero_base(self, there, elsewhere):
        """``there`` where a == 0 and b >= 0, else ``elsewhere``."""
        a, b = self.args
        return Where(compare("eq", a, 0), Where(compare("ge", b, 0), there, elsewhere), elsewhere)

    def fdiff(self, argindex=1):
        a, b = self.args
        return self._at_zero_base(sympy.nan, sympy.diff(PowTensor(a, b) * sympy.log(a), self.args[argindex - 1]))

    @classmethod
    def render(cls, printer, e):
        a, b = e.args
        return printer.p(e._at_zero_base(0, PowTensor(a, b) * sympy.log(a)))

    @classmethod
    def torch_eval(cls, a, b):
        a, b = as_tensor(a), as_tensor(b)
        value = torch.pow(a, b) * torch.log(a)
        return torch.where((a == 0) & (b >= 0), torch.zeros_like(value), value)


def _power(a, b):
    both_real_tensors = all(isinstance(x, sympy.Symbol) and x.is_real for x in (a, b))
    return PowTensor(a, b) if both_real_tensors else a**b


# add, sub, mul, div and pow have hand-written bindings (alpha=, rounding_mode=, reflected forms)
composite("add", lambda a, b: a + b, in_place=True)
composite("sub", lambda a, b: a - b, in_place=True)
composite("mul", lambda a, b: a * b, in_place=True)
composite("div", _divide, in_place=True)
composite("pow", _power, in_place=True)
composite("neg", lambda a: -a, binds=("neg", "negative", "__neg__"), complex_inputs=True, in_place=True)
composite("sqrt", sympy.sqrt, result=FLOAT, binds=("sqrt",), complex_inputs=True, in_place=True, math=True)
composite("rsqrt", lambda a: 1 / sympy.sqrt(a), result=FLOAT, binds=("rsqrt",), complex_inputs=True, in_place=True,
          math=True)
composite("reciprocal", lambda a: 1 / a, result=FLOAT, binds=("reciprocal",), complex_inputs=True, in_place=True)
composite("square", lambda a: a * a, binds=("square",), complex_inputs=True, in_place=True)
composite("lerp", lambda start, end, weight: start + weight * (end - start), in_place=True)
composite("addcmul", lambda x, t1, t2, value: x + value * t1 * t2, in_place=True)
composite("addcdiv", lambda x, t1, t2, value: x + value * t1 / t2, in_place=True)
composite("identity", lambda a: a)  # dtype conversion: the node's dtype says what to convert to
composite("fill", lambda value: value)  # zeros_like & co: a constant over the node's shape
