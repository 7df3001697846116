"""The binding registry: which function binds each torch callable, and the errors a binding raises.

A binding receives the call's arguments with every tensor replaced by its graph node and
appends catalog ops to the graph. Functions with no binding, and bindings that meet an
argument they do not handle (raising ``Unsupported``), run eagerly: the reason is reported.
Bindings decorated ``@on_handles`` (``handles.py``) see those nodes as tensor-like handles.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir.graph import meta_of
from compiler.ir.ops import catalog as C


class Unsupported(Exception):
    """This call cannot be compiled; the message says why (shown to the user)."""


class Writes:
    """A binding's result plus inputs the call changes in place without returning them
    (batch norm's running statistics): [(input node, its new value node)]."""

    def __init__(self, result, writes):
        self.result = result
        self.writes = writes


BINDINGS: dict = {}


def binds(*funcs):
    def register(fn):
        for f in funcs:
            BINDINGS[f] = fn
        return fn
    return register


def lookup(func):
    return BINDINGS.get(func)


def _t(name):
    return getattr(torch.Tensor, name)


def _no_out(kwargs):
    if kwargs.get("out") is not None:
        raise Unsupported("out= arguments are not supported")


# ----------------------------------------------------------------------------- in-place
# NOTE: an in-place op is captured functionally: its result is a new value in the graph,
# and the capture maps the mutated tensor to it. The runtime writes the final value back
# into the real tensor with ``copy_`` after the region runs, so the tensor's version counter
# and autograd history change as eager's do (a saved old value then fails eager's check).
def _in_place(b, x, out):
    if not isinstance(x, fx.Node):
        raise Unsupported("in-place op on a non-tensor")
    if tuple(meta_of(out).shape) != tuple(meta_of(x).shape):
        raise Unsupported("in-place op whose result has a different shape (eager raises)")
    if meta_of(out).dtype != meta_of(x).dtype:
        out = C.emit_pointwise(b, "identity", [out], dtype=meta_of(x).dtype,
                               requires_grad=meta_of(out).requires_grad and meta_of(x).dtype.is_floating_point)
    return out


def _in_place_variant(bind):
    def in_place(b, x, *args, **kwargs):
        return _in_place(b, x, bind(b, x, *args, **kwargs))
    return in_place
