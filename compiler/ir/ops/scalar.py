"""The scalar primitives' SymPy classes, under the names stages import them by (``S.Where``).

Each class is declared, with its printing, evaluation and op facts, in a family module of
``compiler.ir.ops.primitives``; this module re-exports them.
"""

from __future__ import annotations

from compiler.ir.ops.primitives.activations import Relu, Sigmoid, Step
from compiler.ir.ops.primitives.comparisons import COMPARE_OPS, Compare, Maximum, Minimum, TieShare, Where, compare
from compiler.ir.ops.primitives.complex import CAbs, CAngle, CSgn, RealAngle
from compiler.ir.ops.primitives.rounding import Abs, Ceil, Floor, Round, Sign, Trunc
from compiler.ir.ops.primitives.transcendental import (
    DegenerateVarianceSlope,
    DegenerateVarianceTerm,
    Expm1,
    Log1p,
    NormSqrt,
    NormSqrtSlope,
    StdSqrt,
)

__all__ = ["Relu", "Sigmoid", "Step", "COMPARE_OPS", "Compare", "Maximum", "Minimum", "TieShare", "Where", "compare",
           "CAbs", "CAngle", "CSgn", "RealAngle", "Abs", "Ceil", "Floor", "Round", "Sign", "Trunc", "Expm1", "Log1p",
           "NormSqrt", "NormSqrtSlope", "StdSqrt", "DegenerateVarianceTerm", "DegenerateVarianceSlope"]
