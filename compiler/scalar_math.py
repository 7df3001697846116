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
erfc = _F["erfc"]
tan = _F["tan"]
asin = _F["asin"]
acos = _F["acos"]
atan = _F["atan"]
sinh = _F["sinh"]
cosh = _F["cosh"]
asinh = _F["asinh"]
acosh = _F["acosh"]
atanh = _F["atanh"]
log1p = _F["log1p"]
expm1 = _F["expm1"]
floor = _F["floor"]
ceil = _F["ceil"]
trunc = _F["trunc"]
atan2 = _F["atan2"]
hypot = _F["hypot"]
logaddexp = _F["logaddexp"]


def softplus(x, beta=1.0, threshold=20.0):
    """log(1 + exp(beta x)) / beta, linear above ``threshold`` (as torch's softplus)."""
    return _F["softplus"](x, beta, threshold)
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
           "silu", "abs", "erf", "erfc", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
           "log1p", "expm1", "floor", "ceil", "trunc", "atan2", "hypot", "logaddexp", "softplus", "conj", "real",
           "imag", "angle", "maximum", "minimum", "where"]
