"""Functions of a complex z written in (z, z̄), so Wirtinger derivatives come from diff; the
complex-part ops (conj, real, imag, angle, complex, polar).

Each has PyTorch's value at 0 where the formula would give 0/0. They are realified (split into
real and imaginary parts) before printing, so only RealAngle prints itself.
"""

from __future__ import annotations

import sympy
import torch

from compiler.ir.ops.primitives.base import ZERO, Primitive, as_tensor, composite, hypot
from compiler.ir.ops.primitives.comparisons import Where, compare
from compiler.ir.ops.symbols import conj, is_complex_symbol


class CAbs(Primitive, sympy.Function):
    """|z| as a function of (z, z̄). ∂|z|/∂z̄ = sgn(z)/2, so the gradient is g·sgn(z), 0 at 0."""

    nargs = 2

    def fdiff(self, argindex=1):
        z, zc = self.args
        return CSgn(zc, z) / 2 if argindex == 1 else CSgn(z, zc) / 2

    @classmethod
    def torch_eval(cls, z, zc):
        return torch.abs(as_tensor(z))

    @classmethod
    def re_im(cls, cx, z, zc):
        return (hypot(*cx(z)), ZERO)


class CSgn(Primitive, sympy.Function):
    """z / |z| (0 at z = 0, as torch.sgn), as a function of (z, z̄)."""

    nargs = 2

    def fdiff(self, argindex=1):
        z, zc = self.args
        # sgn = z^(1/2) z̄^(-1/2): ∂/∂z = 1/(2|z|), ∂/∂z̄ = -sgn/(2 z̄)
        if argindex == 1:
            return 1 / (2 * CAbs(z, zc))
        return -self / (2 * zc)

    @classmethod
    def torch_eval(cls, z, zc):
        return torch.sgn(as_tensor(z))

    @classmethod
    def re_im(cls, cx, z, zc):
        a, b = cx(z)
        h = hypot(a, b)
        is_zero = compare("eq", h, 0)
        return (Where(is_zero, 0, a / h), Where(is_zero, 0, b / h))


class CAngle(Primitive, sympy.Function):
    """arg(z) = atan2(Im z, Re z) of (z, z̄); ∂/∂z = -i/(2z), ∂/∂z̄ = i/(2z̄), and 0 at z = 0
    (eager's angle_backward)."""

    nargs = 2

    def fdiff(self, argindex=1):
        z, zc = self.args
        at_zero = compare("eq", CAbs(z, zc), 0)
        return Where(at_zero, 0, -sympy.I / (2 * z) if argindex == 1 else sympy.I / (2 * zc))

    @classmethod
    def torch_eval(cls, z, zc):
        return torch.angle(as_tensor(z))

    @classmethod
    def re_im(cls, cx, z, zc):
        a, b = cx(z)
        return (sympy.atan2(b, a), ZERO)


class RealAngle(Primitive, sympy.Function):
    """angle of a real number: π where x < 0, else 0 (NaN stays NaN); derivative 0."""

    nargs = 1
    torch_fn = torch.angle

    def fdiff(self, argindex=1):
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        x = printer.p(e.args[0])
        return f"tl.where({x} < 0, 3.141592653589793, tl.where({x} != {x}, {x}, 0.0))"


# abs is declared with Abs (rounding.py); these are bound by hand (a real result for complex input)
composite("conj", conj, math=True)
composite("real", lambda a: (a + conj(a)) / 2 if is_complex_symbol(a) else a, math=True)
composite("imag", lambda a: (a - conj(a)) / (2 * sympy.I), math=True)
composite("angle", lambda a: CAngle(a, conj(a)) if is_complex_symbol(a) else RealAngle(a), math=True)
composite("complex", lambda re, im: re + sympy.I * im)
composite("polar", lambda r, theta: r * (sympy.cos(theta) + sympy.I * sympy.sin(theta)))
