"""Checking in one C++ call that many tensors are as they were: Dynamo's ``TensorGuards``.

A replay checks the tensors its recording reached (parameters, closed-over tensors) at every call,
and a fused optimizer step each parameter's tensors at every step: a few attribute reads per tensor
in Python, 3-10 microseconds a tensor when the step begins with them out of the caches. Dynamo
guards its graphs' tensors with ``torch._C._dynamo.guards.TensorGuards``: per tensor, its Python type,
dispatch keys (under the thread's dispatch state then), dtype, device, sizes, strides and
requires_grad, compared in C++ (about 0.2 us a tensor here). Stricter than the checks it stands in
front of, so a True lets them be skipped and a False says nothing: the caller checks the slow way.
"""

from __future__ import annotations

import torch

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:   # (a build without Dynamo's C++ guards: every check the slow way)
    TensorGuards = None


def _never(*tensors) -> bool:
    return False


def tensors_unchanged(tensors: list):
    """``unchanged(*now) -> bool``: True only where each of ``now`` is as ``tensors`` are now (type,
    dispatch keys, dtype, device, sizes, strides, requires_grad); False: unknown, check the slow way.
    It holds no reference to ``tensors``."""
    if TensorGuards is None or not tensors or not all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter
                                                      for t in tensors):
        return _never   # (a subclass's metadata may be its own: never taken as unchanged)
    try:
        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
    except Exception:   # (a tensor TensorGuards cannot describe: checked the slow way)
        return _never
