"""Softmax and log-softmax differentiated from their output, as eager's backward kernels are.

Capture decomposes ``softmax(x)`` into ``e = exp(x - max)``, ``s = sum(e)``, ``e / s`` (and
``log_softmax`` into ``z - log(sum(exp(z)))``). Differentiated op by op, the gradient reads
``e`` and ``s``: backward recomputes ``e`` from the input and the saved row statistics, reading
the input and the statistics where eager's ``_softmax_backward_data`` reads only the output. The
closed forms below read the output instead:

    softmax:      dz = y * (g - sum(g * y))
    log_softmax:  dz = g - exp(y) * sum(g)

Then the saved-set cut (``compiler.autodiff.saved_set``) chooses as it does for any value: the output
is saved where that holds fewest bytes (a user output is alive anyway; an attention
probability feeds a matmul whose backward reads it too), and it is recomputed from the input and
the statistics where those hold fewer (``memory="min"`` with the input alive anyway), so no
choice reads more in backward nor holds more between forward and backward than the op-by-op
gradient did. Where the output is cast to a narrower dtype (``softmax`` of a bfloat16 tensor,
computed in float32), the cast output is read, as eager saves its bfloat16 result.
"""

from __future__ import annotations

import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind, arg_symbol, compute_dtype, kind_of, meta_of
from compiler.ir.ops import catalog as C


def output_vjp(b: GraphBuilder, node: fx.Node, grad: fx.Node):
    """(z, dz) where ``node`` ends a softmax or log-softmax of ``z`` whose intermediate values
    only it reads; None otherwise (the op-by-op VJP applies)."""
    matched = _softmax(node) or _log_softmax(node)
    if matched is None:
        return None
    kind, z, dims = matched
    y = _narrow_cast(node) or node
    z_dtype = meta_of(z).dtype
    wide = compute_dtype(z_dtype)
    if kind == "softmax":
        gy = C.emit_pointwise(b, "mul", [grad, y], dtype=wide, requires_grad=False)
        total = _expanded_sum(b, gy, dims)
        inner = C.emit_pointwise(b, "sub", [grad, total], dtype=wide, requires_grad=False)
        return z, C.emit_pointwise(b, "mul", [y, inner], dtype=z_dtype, requires_grad=False)
    total = _expanded_sum(b, grad, dims)
    probs = C.emit_pointwise(b, "exp", [y], dtype=wide, requires_grad=False)
    scaled = C.emit_pointwise(b, "mul", [probs, total], dtype=wide, requires_grad=False)
    return z, C.emit_pointwise(b, "sub", [grad, scaled], dtype=z_dtype, requires_grad=False)


def _expanded_sum(b, value, dims):
    total = C.emit_reduction(b, "sum", value, dims, keepdim=True, dtype=meta_of(value).dtype)
    return C.emit_view(b, "expand", total, shape=meta_of(value).shape)


def _softmax(node):
    """("softmax", z, dims) for ``node = e / sum(e, dims, keepdim)`` with ``e = exp(z)``."""
    if not _is(node, "div", 2) or meta_of(node).expr != arg_symbol(0) / arg_symbol(1):
        return None
    e, s = node.args
    if not (_is(e, "exp", 1) and _is_row_sum(s, e)) or set(e.users) != {node, s} or set(s.users) != {node}:
        return None
    return _same_shape("softmax", e.args[0], node, s)


def _log_softmax(node):
    """("log_softmax", z, dims) for ``node = z - log(sum(exp(z), dims, keepdim))``."""
    if not _is(node, "sub", 2) or meta_of(node).expr != arg_symbol(0) - arg_symbol(1):
        return None
    z, log = node.args
    if not _is(log, "log", 1) or set(log.users) != {node}:
        return None
    s = log.args[0]
    e = s.args[0] if isinstance(s, fx.Node) and s.args else None
    if not (_is(e, "exp", 1) and e.args[0] is z and _is_row_sum(s, e)) or set(e.users) != {s} or \
            set(s.users) != {log}:
        return None
    return _same_shape("log_softmax", z, node, s)


def _same_shape(kind, z, node, s):
    if not isinstance(z, fx.Node) or meta_of(z).shape != meta_of(node).shape or meta_of(z).dtype.is_complex:
        return None
    return kind, z, s.kwargs["dims"]


def _is(node, name, nargs) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and \
        getattr(node.target, "name", None) == name and len(node.args) == nargs and \
        all(isinstance(a, fx.Node) for a in node.args)


def _is_row_sum(s, e) -> bool:
    return isinstance(s, fx.Node) and kind_of(s) == OpKind.REDUCTION and \
        getattr(s.target, "name", None) == "sum" and s.args[0] is e and s.kwargs.get("keepdim") is True


def _narrow_cast(node):
    """The single user of ``node`` casting it to a narrower floating dtype (softmax's ``.to(x.dtype)``
    of a bfloat16 input), or None."""
    users = list(node.users)
    if len(users) != 1:
        return None
    cast = users[0]
    if not _is(cast, "identity", 1):
        return None
    dtype, wide = meta_of(cast).dtype, meta_of(node).dtype
    return cast if dtype.is_floating_point and dtype.itemsize < wide.itemsize else None
