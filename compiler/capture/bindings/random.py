"""Bindings of random ops: dropout (random numbers computed in the kernel from a per-call seed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, on_handles, rand, where
from compiler.capture.bindings.registry import Unsupported, _in_place, binds


@binds(F.dropout)
@on_handles
def _dropout(b, input, p=0.5, training=True, inplace=False):
    """Outside training (model.eval()) or with p=0, dropout returns its input itself. In
    training: keep each element with probability 1-p, scaled by 1/(1-p), from random numbers
    made inside the kernel (Philox, seeded per call from torch's generator). A ``p`` taken at run time
    (a handle: ``compiler.capture.numbers``) holds for 0 < p < 1, which each replay checks: at 0
    eager returns the input itself, at 1 zeros."""
    if isinstance(p, Tensor):
        return _dropout_at_run_time(b, input, p, training, inplace)
    if not 0 <= p <= 1:
        raise Unsupported(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0:
        return input
    if p == 1:
        raise Unsupported("dropout with p=1 (every element dropped) is not compiled")
    if b.new_seed is None:
        raise Unsupported("random numbers need a per-call seed, which this graph cannot take")
    keep = rand(b, b.new_seed(), input.shape) >= p
    out = where(keep, input * (1.0 / (1.0 - p)), 0.0, dtype=input.dtype)
    return _in_place(b, input.node, out.node) if inplace else out


def _dropout_at_run_time(b, input, p, training, inplace):
    if not training:
        return input
    if b.new_seed is None:
        raise Unsupported("random numbers need a per-call seed, which this graph cannot take")
    b.number_bounds[p.node] = (0.0, 1.0)
    keep = rand(b, b.new_seed(), input.shape) >= p
    out = where(keep, input * (1.0 / (1.0 - p)), 0.0, dtype=input.dtype)
    return _in_place(b, input.node, out.node) if inplace else out


@binds(torch.dropout)
def _torch_dropout(b, input, p, train):
    return _dropout(b, input, p, train)


@binds(F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
       torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout)
def _other_dropout(b, input, p=0.5, training=True, inplace=False):
    if training and p > 0:
        raise Unsupported("channel and alpha dropout in training mode are not compiled yet")
    return input
