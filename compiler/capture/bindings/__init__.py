"""Bindings: how each torch function a user's code calls is expressed with catalog ops.

One module per family; importing this package registers them all (``lookup`` finds them).
Decompositions are written on tensor-like handles (``handles.py``: ``x - x.mean(1, keepdim=True)``),
so each reads like its counterpart in ``torch/_refs`` or ``torch/_decomp/decompositions.py``.
"""

from compiler.capture.bindings import (attention, cross_entropy, elementwise, factories, flip, indexing, layers, losses,  # noqa: F401
                               norms, random, reductions, routing, views)
from compiler.capture.bindings.registry import BINDINGS, Unsupported, Writes, binds, lookup

__all__ = ["BINDINGS", "Unsupported", "Writes", "binds", "lookup"]
