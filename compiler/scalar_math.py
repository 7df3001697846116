"""Scalar math for user-defined elementwise ops (``compiler.math``).

Functions here take SymPy scalars (the symbols ``compiler.elementwise`` calls your function
with) and return the catalog's expressions — the ones whose derivatives follow PyTorch's
conventions and that the Triton printer knows. Arithmetic (``+ - * / **``) works as usual.
Every op declared with ``math=True`` in ``compiler.ir.ops.primitives`` is exported here under
its catalog name (``exp``, ``log1p``, ``erfinv``, ``abs``...), plus ``softplus`` and ``where``.

    >>> import compiler
    >>> from compiler import math as cm
    >>> @compiler.elementwise(name="softplus_ish")
    ... def f(x, beta):
    ...     return cm.log(1 + cm.exp(beta * x)) / beta
"""

from __future__ import annotations

import sympy

from compiler.ir.ops import primitives as _primitives
from compiler.ir.ops import scalar as _S

pi = sympy.pi
e = sympy.E

_EXPORTED = {name: entry.expression for name, entry in _primitives.OPS.items() if entry.math}
globals().update(_EXPORTED)


def softplus(x, beta=1.0, threshold=20.0):
    """log(1 + exp(beta x)) / beta, linear above ``threshold`` (as torch's softplus)."""
    return _primitives.OPS["softplus"].expression(x, beta, threshold)


def where(condition, a, b):
    """``a`` where ``condition`` holds, else ``b`` (gradients flow to the chosen branch)."""
    return _S.Where(_condition(condition), a, b)


def _condition(c):
    """Python comparisons of symbols give SymPy relationals; make them catalog comparisons."""
    ops = {sympy.StrictLessThan: "lt", sympy.LessThan: "le", sympy.StrictGreaterThan: "gt",
           sympy.GreaterThan: "ge", sympy.Equality: "eq", sympy.Unequality: "ne"}
    for cls, name in ops.items():
        if isinstance(c, cls):
            return _S.compare(name, c.lhs, c.rhs)
    if c in (sympy.true, sympy.false):
        raise ValueError(f"where(): the condition is always {bool(c)}; compare the arguments instead")
    return c


__all__ = ["pi", "e", *_EXPORTED, "softplus", "where"]
