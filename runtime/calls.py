"""Flattening a torch call's arguments into leaves, fast.

Replay checks every torch call the function makes, so this is on the per-call path.
``torch.utils._pytree`` costs ~10 µs a call; almost every call has flat arguments (tensors
and constants, where a tuple of ints is one constant), so those take a fast path and only
containers that hold tensors (``torch.cat([a, b])``) go through pytree.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def holds_tensor(value) -> bool:
    """Whether a list, tuple or dict holds a tensor, at any depth."""
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) or holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) or holds_tensor(v) for v in value.values())
    return False


def flatten_call(args, kwargs):
    """(leaves, spec): tensors are always leaves of their own; specs compare with ==."""
    for a in args:
        if type(a) in (list, tuple, dict) and holds_tensor(a):
            return _tree(args, kwargs)
    if kwargs:
        for v in kwargs.values():
            if type(v) in (list, tuple, dict) and holds_tensor(v):
                return _tree(args, kwargs)
        return [*args, *kwargs.values()], (len(args), tuple(kwargs))
    return list(args), (len(args), ())


def _tree(args, kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, ("tree", spec)


def unflatten_call(leaves, spec):
    """(args, kwargs) back from ``flatten_call``'s leaves and spec."""
    if spec[0] == "tree":
        return tree_unflatten(leaves, spec[1])
    n, keys = spec
    return tuple(leaves[:n]), dict(zip(keys, leaves[n:]))
