"""Scalar primitives, one class each, and the named pointwise ops composed of them.

Importing this package fills ``registry`` (see ``base`` for what a primitive declares).
Families: ``arithmetic``, ``transcendental``, ``special``, ``activations`` (and losses'
scalar parts), ``comparisons`` (and logic, clamp), ``rounding`` (sign, abs), ``complex``.
"""

from compiler.ir.ops.primitives import (  # noqa: F401  (imported for their registrations)
    activations,
    arithmetic,
    comparisons,
    complex,
    rounding,
    special,
    transcendental,
)
from compiler.ir.ops.primitives.registry import HEADS, OPS, head, ops_of_kind

__all__ = ["HEADS", "OPS", "head", "ops_of_kind"]
