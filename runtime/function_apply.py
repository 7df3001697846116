"""``Function.apply`` without its Python, for the autograd Functions every compiled call makes.

Without a functorch transform active (the usual case) ``torch.autograd.Function.apply`` binds a
``setup_context`` (ours have none), unwraps each dead functorch wrapper and calls autograd's own
apply: ``apply`` does the same two real things directly. That is about 10 of the 20 microseconds a
Function's apply costs (measured on this CPU with torch 2.13), a fair part of a small CPU step
that makes a region's Node and, under DDP, a Node per segment of its backward.
"""

from __future__ import annotations

import torch

_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_c_applies: dict = {}   # Function class -> autograd's apply bound to it


def apply(function: type, *args):
    """``function.apply(*args)`` (``function``: a ``torch.autograd.Function`` with a ``forward(ctx, ...)``)."""
    if _functorch_active():
        return function.apply(*args)
    c_apply = _c_applies.get(function)
    if c_apply is None:
        c_apply = _c_applies[function] = super(torch.autograd.Function, function).apply
    return c_apply(*[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])
