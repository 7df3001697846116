"""Scalar math for user-defined elementwise ops (``compiler.math``).

Functions here take SymPy scalars (the symbols ``compiler.elementwise`` calls your function
with) and return the catalog's expressions — the ones whose derivatives follow PyTorch's
conventions and that the Triton printer knows. Arithmetic (``+ - * / **``) works as usual.

    >>> import compiler
    >>> from compiler import math as cm
    >>> @compiler.elementwise(name="softplus_ish")
    ... def f(x, beta):
    ...     return cm.log(1 + cm.exp(beta * x)) / beta
"""

from __future__ import annotations

import sympy

from compiler.ops import scalar as _S
from compiler.ops.catalog import SCALAR_FUNCTIONS as _F

pi = sympy.pi
e = sympy.E

exp = _F["exp"]
log = _F["log"]
sqrt = _F["sqrt"]
rsqrt = _F["rsqrt"]
sin = _F["sin"]
cos = _F["cos"]
tanh = _F["tanh"]
sigmoid = _F["sigmoid"]
relu = _F["relu"]
gelu = _F["gelu"]
silu = _F["silu"]
abs = _F["abs"]  # noqa: A001 — the catalog's abs: PyTorch's gradient at 0 and for complex z
erf = sympy.erf
conj = _F["conj"]
real = _F["real"]
imag = _F["imag"]
angle = _F["angle"]
maximum = _F["maximum"]
minimum = _F["minimum"]


def where(condition, a, b):
    """``a`` where ``condition`` holds, else ``b`` (gradients flow to the chosen branch)."""
    return _S.Where(_condition(condition), a, b)


def _condition(c):
    """Python comparisons of symbols give SymPy relationals; make them catalog comparisons."""
    ops = {sympy.StrictLessThan: "lt", sympy.LessThan: "le", sympy.StrictGreaterThan: "gt",
           sympy.GreaterThan: "ge", sympy.Equality: "eq", sympy.Unequality: "ne"}
    for cls, name in ops.items():
        if isinstance(c, cls):
            return _S.Compare(sympy.Integer(_S.COMPARE_OPS.index(name)), c.lhs, c.rhs)
    if c in (sympy.true, sympy.false):
        raise ValueError(f"where(): the condition is always {bool(c)}; compare the arguments instead")
    return c


__all__ = ["pi", "e", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu",
           "silu", "abs", "erf", "conj", "real", "imag", "angle", "maximum", "minimum", "where"]
