"""What every printer of SymPy scalar expressions shares: the walk over an expression, and products
written as a numerator over a denominator (so ``x / y`` prints as a division, not ``x * y**-1``).

A printer for one kernel language (``triton_printer.TritonPrinter``, ``cpp_printer.CppPrinter``)
gives its ``literal`` (a number in the kernel's type), its ``_pow`` (powers: products, roots, a
library call), ``render`` (a primitive's application, as the primitive declares it for that
language) and ``language`` (for errors).
"""

from __future__ import annotations

import sympy

from compiler.ir.ops import primitives
from compiler.ir.ops.primitives.base import NotPrintable


class ExpressionPrinter:
    """Prints one expression; ``names`` maps each free symbol to a variable of the kernel."""

    language = "?"

    def __init__(self, names: dict):
        self.names = names

    def __call__(self, expr) -> str:
        return self.p(expr)

    def p(self, e) -> str:
        if e.is_Symbol:
            return self.names[e]
        primitive = primitives.head(e.func) if isinstance(e, sympy.Function) else None
        if e.is_number and primitive is not None and primitive.folds_constants():
            try:  # log(2), exp(1), ...: one constant, evaluated exactly here, not in the kernel's precision
                e = sympy.Float(e.evalf(30), 30)
            except (TypeError, ValueError):
                pass
        if e.is_number and not isinstance(e, sympy.Function):
            if e.is_extended_real is False:
                raise NotPrintable(f"complex constant {e}")
            return self.literal(e)
        if e.is_Add:
            return "(" + " + ".join(self.p(a) for a in e.args) + ")"
        if e.is_Mul:
            return self._mul(e)
        if e.is_Pow:
            return self._pow(e.base, e.exp)
        if primitive is None:
            raise NotPrintable(f"no {self.language} lowering for {e.func.__name__}")
        return self.render(primitive, e)

    def one(self) -> str:
        return self.literal(sympy.Integer(1))

    def _mul(self, e) -> str:
        num, den = [], []
        for factor in e.args:
            if factor.is_Pow and factor.exp.is_number and factor.exp.is_negative and factor.exp.is_Integer:
                den.append(self._pow(factor.base, -factor.exp))
            elif factor.is_Rational and not factor.is_Integer:
                num.append(self.literal(factor))
            else:
                num.append(self.p(factor))
        text = " * ".join(num) if num else self.one()
        if den:
            text = f"{text} / ({' * '.join(den)})"
        return f"({text})"

    def literal(self, value) -> str:
        raise NotImplementedError

    def render(self, primitive, e) -> str:
        raise NotImplementedError

    def _pow(self, base, exp) -> str:
        raise NotImplementedError

    def small_power(self, b: str, exp, one: str, root) -> str | None:
        """``b ** exp`` as products and square roots (``root(x)``: the language's correctly rounded
        square root of ``x``; ``one``: its 1 to divide) where ``exp`` is an integer up to 8 in size or 1/2, -1/2 or
        -3/2, as eager's pow kernels special-case them; None for any other exponent."""
        if exp.is_Integer:
            n = int(exp)
            if n == 0:
                return self.one()
            if 0 < n <= 8:
                return "(" + " * ".join([b] * n) + ")"
            if -8 <= n < 0:
                return f"({one} / (" + " * ".join([b] * -n) + "))"
        if exp == sympy.Rational(1, 2):
            return root(b)
        if exp == sympy.Rational(-1, 2):
            return f"({one} / {root(b)})"
        if exp == sympy.Rational(-3, 2):
            return f"({one} / ({root(b)} * {b}))"
        return None
