"""The one registry of scalar primitives and named pointwise ops.

Two indexes, filled as the family modules are imported (``compiler.ir.ops.primitives``):

* ``HEADS``: SymPy head (``sympy.exp``, ``Relu``) → its primitive class. The Triton printer,
  realify, the torch evaluator and the user-op whitelist look functions up here.
* ``OPS``: catalog name (``"exp"``, ``"gelu"``) → its entry (a primitive class with ``op``, or
  a ``Composite``): the expression, dtype kind, generated bindings and in-place variants.
"""

from __future__ import annotations

HEADS: dict = {}
OPS: dict = {}


def register_primitive(cls):
    if cls.function in HEADS:
        raise ValueError(f"{cls.__name__}: {cls.function} is already declared by {HEADS[cls.function].__name__}")
    HEADS[cls.function] = cls
    if cls.op is not None:
        register_op(cls)


def register_op(entry):
    if entry.op in OPS:
        raise ValueError(f"op {entry.op!r} is declared twice")
    OPS[entry.op] = entry


def head(func):
    """The primitive declaring SymPy function ``func``, or None."""
    return HEADS.get(func)


def ops_of_kind(result: str) -> set:
    """Names of the ops whose dtype kind is ``result`` (FLOAT, BOOL or SAME)."""
    return {name for name, entry in OPS.items() if entry.result == result}
