"""Bindings of torch.flip, Tensor.flip, fliplr and flipud: the ``flip`` view (``compiler.ir.ops.views.Flip``).

Eager's flip copies; here it is an index map (``size - 1 - i`` on the flipped dims) that
fuses into the kernels reading it. Capture treats its result as a new tensor, as eager's
has no ``_base``: an in-place op on it changes only it.
"""

from __future__ import annotations

import torch

from compiler.capture.bindings.registry import Unsupported, _t, binds
from compiler.ir.graph import meta_of
from compiler.ir.ops import catalog as C


@binds(torch.flip, _t("flip"))
def _flip(b, x, *args, dims=None):
    dims = args if dims is None else dims  # x.flip(0, 1), x.flip((0, 1)), torch.flip(x, dims=[0])
    if isinstance(dims, int):
        dims = (dims,)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
        dims = tuple(dims[0])
    if not all(isinstance(d, int) for d in dims):
        raise Unsupported("flip with non-integer dims")
    ndim = len(meta_of(x).shape)
    return C.emit_view(b, "flip", x, dims=tuple(sorted({d % ndim for d in dims})) if ndim else ())


@binds(torch.fliplr)
def _fliplr(b, x):
    return _flip(b, x, (1,))


@binds(torch.flipud)
def _flipud(b, x):
    return _flip(b, x, (0,))
