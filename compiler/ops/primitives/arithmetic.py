"""Arithmetic ops: SymPy's own + - * / ** (printed structurally by the printer, not primitives
themselves) named as catalog ops, with their dtype kinds, bindings and in-place variants."""

from __future__ import annotations

import math

import sympy

from compiler.ops.primitives.base import FLOAT, composite


def _divide(a, b):
    # NOTE: SymPy makes x / 0 the complex infinity (zoo), which no kernel can print; IEEE
    # division by a constant zero is a product with an infinity of the zero's sign (x / 0.0
    # is inf, -inf or NaN, as eager; var() with no degrees of freedom divides by 0.0).
    if getattr(b, "is_number", False) and b.is_zero and b.is_extended_real:
        return a * (sympy.oo if math.copysign(1.0, float(b)) > 0 else -sympy.oo)
    return a / b


# add, sub, mul, div and pow have hand-written bindings (alpha=, rounding_mode=, reflected forms)
composite("add", lambda a, b: a + b, in_place=True)
composite("sub", lambda a, b: a - b, in_place=True)
composite("mul", lambda a, b: a * b, in_place=True)
composite("div", _divide, in_place=True)
composite("pow", lambda a, b: a**b, in_place=True)
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
