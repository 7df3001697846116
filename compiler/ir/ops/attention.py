"""Scaled dot-product attention as flash attention: one op for the forward, one for its
gradients, run by our Triton flash kernels or, on the CPU path, PyTorch's fused CPU kernel
(``runtime.attention``). No T x T matrix is stored: the backward reads q, k, v, the output and
one float per row (the logsumexp), what eager's flash attention saves.

Graph form. The forward is two nodes one call makes (``joint_call``): the logsumexp
``attention(q, k, v, *extras, which="lse")`` and the output ``attention(q, k, v, *extras, lse,
which="out")``; the output names the logsumexp among its arguments so the two live and die
together (the backward reads both). ``extras``: the mask (``has_mask``), then the dropout seed
(``dropout_p`` > 0). Gradients: ``attention_backward(grad, q, k, v, out, lse, *extras,
which="q"|"k"|"v")``, those needed made by one call too.

The kernels have no derivative of their own: for double backward (create_graph=True) a
region's joint graph runs attention in its decomposed form (``decompose``, the binding's
``softmax(q kᵀ · scale + mask) v``), which SymPy's autodiff differentiates like any graph.
"""

from __future__ import annotations

import functools

import torch.fx as fx

from compiler.ir.graph import meta_of
from compiler.ir.ops import views
from compiler.ir.ops.externs import Extern
from compiler.ir.ops.pointwise import emit_fill, emit_pointwise
from compiler.ir.ops.structural import emit_slice_scatter
from runtime import attention as runtime_attention
from runtime import backends

_PARAMETERS = ("is_causal", "scale", "dropout_p", "has_mask", "empty_nan", "heads_last", "rotary")


def _parameters(node: fx.Node) -> dict:
    return {k: node.kwargs.get(k, False) for k in _PARAMETERS}   # (the flags: absent from older recordings)


class Attention(Extern):
    """The forward: the output (``which="out"``) or the row logsumexp (``which="lse"``)."""

    def __init__(self):
        super().__init__("attention")

    @staticmethod
    def torch_fn(q, k, v, *extras, which, **parameters):
        if which == "out":   # (the logsumexp it names is made by the same call, not read)
            extras = extras[:-1]
        return runtime_attention.forward(q, k, v, *extras, which=which, **parameters)

    def function_for(self, backend: str):
        return functools.partial(Attention.torch_fn, backend=backend)

    def kernels_launched(self, backend: str, nodes) -> int:
        return 0 if backends.cpu_path(backend) else 1

    def joint_key(self, node):
        args = node.args[:-1] if node.kwargs["which"] == "out" else node.args
        return tuple(args), tuple(sorted(_parameters(node).items()))

    def joint_call(self, nodes, backend):
        """(fn, kwargs, nodes in fn's output order): the output and its logsumexp, one kernel."""
        which = {n.kwargs["which"]: n for n in nodes}
        if len(nodes) != 2 or set(which) != {"out", "lse"}:
            return None
        return (functools.partial(runtime_attention.forward, backend=backend), _parameters(nodes[0]),
                [which["out"], which["lse"]])

    def vjp(self, b, node, grad_out):
        if node.kwargs["which"] != "out":
            return [None] * len(node.args)
        q, k, v = node.args[:3]
        extras, lse = list(node.args[3:-1]), node.args[-1]
        parameters = _parameters(node)
        grads = []
        for name, source in zip("qkv", (q, k, v)):
            if not meta_of(source).requires_grad:
                grads.append(None)
                continue
            operands = [grad_out, q, k, v, node, lse, *extras]
            grad = b.call(ATTENTION_BACKWARD, operands, {"which": name, **parameters},
                          shape=meta_of(source).shape, dtype=meta_of(source).dtype,
                          requires_grad=any(meta_of(o).requires_grad for o in operands[:4]))
            if parameters["rotary"] and name != "v":   # (the kernels' gradient is the rotated q's or k's)
                grad = unrotated(b, grad, extras[-2], extras[-1])
            grads.append(grad)
        return grads + [None] * (len(node.args) - 3)

    def decompose(self, b, node):
        """The output in the binding's decomposed form (for the joint graph of double backward);
        None for the logsumexp, which nothing reads there."""
        if node.kwargs["which"] != "out":
            return None
        from compiler.capture.bindings.attention import decomposed_attention  # (capture's math on handles)

        q, k, v = node.args[:3]
        extras = list(node.args[3:-1])
        p = _parameters(node)
        mask = extras.pop(0) if p["has_mask"] else None
        seed = extras.pop(0) if p["dropout_p"] > 0 else None
        if p["rotary"]:
            q, k = (rotated(b, x, extras[0], extras[1]) for x in (q, k))
        out = decomposed_attention(b, q, k, v, mask, seed, p["is_causal"], p["scale"], p["dropout_p"],
                                   empty_nan=p["empty_nan"])
        return views.emit_view(b, "permute", out, dims=(0, 2, 1, 3)) if p["heads_last"] else out


class AttentionBackward(Extern):
    """The gradient of q, k or v (``which``)."""

    def __init__(self):
        super().__init__("attention_backward")

    @staticmethod
    def torch_fn(grad, q, k, v, out, lse, *extras, which, **parameters):
        return runtime_attention.backward(grad, q, k, v, out, lse, *extras, which=which, **parameters)

    def function_for(self, backend: str):
        return functools.partial(AttentionBackward.torch_fn, backend=backend)

    def kernels_launched(self, backend: str, nodes) -> int:
        return 0 if backends.cpu_path(backend) else 2   # dQ (with delta), then dK and dV

    def joint_key(self, node):
        return tuple(node.args), tuple(sorted(_parameters(node).items()))

    def joint_call(self, nodes, backend):
        """Every gradient asked for from one backward (its dQ and dK/dV kernels)."""
        order = sorted(nodes, key=lambda n: "qkv".index(n.kwargs["which"]))
        if len({n.kwargs["which"] for n in nodes}) != len(nodes):
            return None
        return (functools.partial(runtime_attention.backward, backend=backend),
                {"which": tuple(n.kwargs["which"] for n in order), **_parameters(nodes[0])}, order)

    def vjp(self, b, node, grad_out):
        raise AssertionError("attention_backward is differentiated through its decomposed form "
                             "(Attention.decompose, in the region's joint graph); it has no derivative of its own")


ATTENTION = Attention()
ATTENTION_BACKWARD = AttentionBackward()


def emit_attention(b, q, k, v, mask, seed, *, is_causal: bool, scale: float, dropout_p: float,
                   empty_nan: bool = False, heads_last: bool = False, rotary=None) -> fx.Node:
    """softmax(scale * q kᵀ + mask) [dropout] v by the flash kernels: the output node (its
    logsumexp node is made with it). ``empty_nan``: a row no key is seen by is NaN (softmax's,
    for attention written out) rather than SDPA's 0. ``heads_last``: the output is [B, T, H, D]
    (4-D q), the kernel writing it in the layout the caller's transpose back would make.
    ``rotary``: (cos, sin), [B or 1, 1, T, D]: q and k are rotated by them (x * cos +
    rotate_half(x) * sin) inside the kernels, and their gradients are those of q and k before."""
    extras = [x for x in (mask, seed, *(rotary or ())) if x is not None]
    parameters = {"is_causal": bool(is_causal), "scale": float(scale), "dropout_p": float(dropout_p),
                  "has_mask": mask is not None, "empty_nan": bool(empty_nan), "heads_last": bool(heads_last),
                  "rotary": rotary is not None}
    mq = meta_of(q)
    lse = b.call(ATTENTION, [q, k, v, *extras], {"which": "lse", **parameters}, shape=mq.shape[:-1],
                 dtype=runtime_attention.lse_dtype(mq.dtype), requires_grad=False)
    shape = mq.shape[:-1] + meta_of(v).shape[-1:]
    if heads_last:
        shape = (shape[0], shape[2], shape[1], shape[3])
    return b.call(ATTENTION, [q, k, v, *extras, lse], {"which": "out", **parameters}, shape=shape, dtype=mq.dtype,
                  requires_grad=any(meta_of(x).requires_grad for x in (q, k, v)))


def _rotate_half(b, x: fx.Node) -> fx.Node:
    """cat(-x[..., D/2:], x[..., :D/2]) as graph nodes (what a model's rotary embedding records)."""
    shape, dtype = meta_of(x).shape, meta_of(x).dtype
    half, last = shape[-1] // 2, len(shape) - 1
    low, high = (views.emit_slice(b, x, last, start, 1, half) for start in (0, half))
    negated = emit_pointwise(b, "neg", [high], dtype=dtype)
    zeros = emit_fill(b, shape, dtype, 0.0)
    return emit_slice_scatter(b, emit_slice_scatter(b, zeros, negated, last, 0, 1, half), low, last, half, 1, half)


def rotated(b, x: fx.Node, cos: fx.Node, sin: fx.Node) -> fx.Node:
    """x * cos + rotate_half(x) * sin."""
    dtype = meta_of(x).dtype
    products = [emit_pointwise(b, "mul", [a, t], dtype=dtype) for a, t in ((x, cos), (_rotate_half(b, x), sin))]
    return emit_pointwise(b, "add", products, dtype=dtype)


def unrotated(b, g: fx.Node, cos: fx.Node, sin: fx.Node) -> fx.Node:
    """The gradient of x from ``g``, that of ``rotated(x)``: g * cos - rotate_half(g * sin)
    (rotate_half's transpose is its negation). Pointwise: it fuses into what reads it."""
    dtype = meta_of(g).dtype
    turned = _rotate_half(b, emit_pointwise(b, "mul", [g, sin], dtype=dtype))
    return emit_pointwise(b, "sub", [emit_pointwise(b, "mul", [g, cos], dtype=dtype), turned], dtype=dtype)


def decompose_for_double_backward(graph: fx.Graph) -> list:
    """Replace, in place, each op of ``graph`` that has a decomposed form (``decompose``) by it;
    returns the names of the ops replaced (for the log)."""
    from compiler.ir.graph import GraphBuilder

    replaced = []
    b = GraphBuilder(graph)
    for node in list(graph.nodes):
        decompose = getattr(node.target, "decompose", None) if node.op == "call_function" else None
        if decompose is None:
            continue
        with graph.inserting_before(node):
            made = decompose(b, node)
        if made is not None:
            node.replace_all_uses_with(made)
            replaced.append(node.target.name)
    graph.eliminate_dead_code()
    return replaced


def has_attention(graph: fx.Graph) -> bool:
    return any(n.op == "call_function" and n.target is ATTENTION for n in graph.nodes)

