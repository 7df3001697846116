"""Scalar functions whose derivatives follow PyTorch's conventions, not SymPy's.

SymPy's own rules differ from eager PyTorch at non-differentiable points: ``Heaviside(0)``
is 1/2 (``relu'(0)`` must be 0), ``diff(Max)`` splits ties with a Heaviside, ``diff(sign)``
is a DiracDelta. Each function here is a ``sympy.Function`` whose ``fdiff`` states the
PyTorch rule directly, and which the Triton printer knows how to print.

NOTE: the autograd notes, "Gradients for non-differentiable functions": where a function is
not differentiable, PyTorch uses a chosen subgradient (relu'(0) = 0, abs'(0) = 0,
maximum/minimum split the gradient evenly between equal inputs).
"""

from __future__ import annotations

import sympy


def _number(*args) -> bool:
    return all(a.is_number for a in args)


class Relu(sympy.Function):
    """max(x, 0) that keeps NaN; d/dx is 0 where x <= 0 and 1 elsewhere (relu'(0) = 0)."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if _number(x) and x.is_real:
            return x if x > 0 else sympy.Integer(0)

    def fdiff(self, argindex=1):
        return Step(self.args[0])


class Step(sympy.Function):
    """0 where x <= 0, else 1 (so 1 at NaN, as eager's threshold_backward). relu's derivative."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if _number(x) and x.is_real:
            return sympy.Integer(0 if x <= 0 else 1)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Sign(sympy.Function):
    """sign(x) with sign(0) = 0; derivative 0 everywhere (PyTorch's convention)."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if _number(x) and x.is_real:
            return sympy.sign(x)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Abs(sympy.Function):
    """|x| for real x; d/dx = sign(x), so abs'(0) = 0 as in eager PyTorch."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if _number(x) and x.is_real:
            return abs(x)

    def fdiff(self, argindex=1):
        return Sign(self.args[0])


class Sigmoid(sympy.Function):
    """1 / (1 + exp(-x)); derivative written as y(1 - y) so it reuses the forward result."""

    nargs = 1

    def fdiff(self, argindex=1):
        return self * (1 - self)


class Maximum(sympy.Function):
    """Elementwise max that propagates NaN; equal inputs share the gradient evenly."""

    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        return TieShare(a, b) if argindex == 1 else TieShare(b, a)


class Minimum(sympy.Function):
    """Elementwise min that propagates NaN; equal inputs share the gradient evenly."""

    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        return TieShare(b, a) if argindex == 1 else TieShare(a, b)


class TieShare(sympy.Function):
    """1/2 where a == b, 0 where a < b, else 1 (NaN included): the share of the gradient
    that reaches a of maximum(a, b), as eager's maximum/minimum backward computes it."""

    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if _number(a, b) and a.is_real and b.is_real:
            return sympy.Rational(1, 2) if a == b else sympy.Integer(0 if a < b else 1)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Where(sympy.Function):
    """cond ? a : b. The condition gets no gradient; each branch gets it where chosen."""

    nargs = 3

    def fdiff(self, argindex=1):
        cond = self.args[0]
        if argindex == 2:
            return Where(cond, sympy.Integer(1), sympy.Integer(0))
        if argindex == 3:
            return Where(cond, sympy.Integer(0), sympy.Integer(1))
        return sympy.Integer(0)


class Compare(sympy.Function):
    """a <op> b for op in (lt, le, gt, ge, eq, ne), as a boolean; not differentiable.

    SymPy's own relationals would evaluate `x < x` to False and cannot be differentiated;
    this keeps the comparison opaque until it is printed.
    """

    nargs = 3  # (op code, a, b); the op code is an Integer index into COMPARE_OPS

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")


# ----------------------------------------------------------------------------- complex
# Functions of a complex z written in (z, z̄), so Wirtinger derivatives come from diff.
# Each has PyTorch's value at 0 where the formula would give 0/0.


class CAbs(sympy.Function):
    """|z| as a function of (z, z̄). ∂|z|/∂z̄ = sgn(z)/2, so the gradient is g·sgn(z), 0 at 0."""

    nargs = 2

    def fdiff(self, argindex=1):
        z, zc = self.args
        return CSgn(zc, z) / 2 if argindex == 1 else CSgn(z, zc) / 2


class CSgn(sympy.Function):
    """z / |z| (0 at z = 0, as torch.sgn), as a function of (z, z̄)."""

    nargs = 2

    def fdiff(self, argindex=1):
        z, zc = self.args
        # sgn = z^(1/2) z̄^(-1/2): ∂/∂z = 1/(2|z|), ∂/∂z̄ = -sgn/(2 z̄)
        if argindex == 1:
            return 1 / (2 * CAbs(z, zc))
        return -self / (2 * zc)


class CAngle(sympy.Function):
    """arg(z) = atan2(Im z, Re z) of (z, z̄); ∂/∂z = -i/(2z), ∂/∂z̄ = i/(2z̄), and 0 at z = 0
    (eager's angle_backward)."""

    nargs = 2

    def fdiff(self, argindex=1):
        z, zc = self.args
        at_zero = Compare(sympy.Integer(COMPARE_OPS.index("eq")), CAbs(z, zc), 0)
        return Where(at_zero, 0, -sympy.I / (2 * z) if argindex == 1 else sympy.I / (2 * zc))


class RealAngle(sympy.Function):
    """angle of a real number: π where x < 0, else 0 (NaN stays NaN); derivative 0."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


# ----------------------------------------------------------------------------- accurate forms
class Log1p(sympy.Function):
    """log(1 + x), printed as libdevice's log1p: exact near 0, as eager's."""

    nargs = 1

    def fdiff(self, argindex=1):
        return 1 / (1 + self.args[0])


class Expm1(sympy.Function):
    """exp(x) - 1, printed as libdevice's expm1."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sympy.exp(self.args[0])


class _Rounding(sympy.Function):
    """Piecewise-constant rounding: derivative 0 everywhere (eager's convention)."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Floor(_Rounding):
    pass


class Ceil(_Rounding):
    pass


class Round(_Rounding):
    """Round half to even, as torch.round."""


class Trunc(_Rounding):
    pass


class NormSqrt(sympy.Function):
    """sqrt(s) of a sum of squares, as in a vector norm: its derivative is 0 where s = 0 (eager's
    norm backward masks the zero vector), not the infinity that would turn 0 * inf into NaN."""

    nargs = 1

    def fdiff(self, argindex=1):
        s = self.args[0]
        return Where(Compare(sympy.Integer(COMPARE_OPS.index("eq")), s, 0), 0, 1 / (2 * NormSqrt(s)))
