"""Cross-entropy of a linear layer's output over many classes, computed in row chunks
(``runtime.linear_cross_entropy``): the logits, and their gradient, are never whole.

Graph form. ``linear_cross_entropy(a, m, [bias], target, [weight], [logits], which="loss", ...)``
is the loss of ``cross_entropy(bias + a @ m, target, weight)`` (``a``: rows x features, ``m``:
features x classes, what the linear's matmul multiplied). The binding names the logits it
replaced as a last argument that is never read, so ``chunked_loss_pass`` can tell whether
anything else reads them: if nothing does, the name is dropped (and with it the matmul making
them, dead); if something does, the op is replaced by its decomposed form, the logits being
made anyway.

Gradients. For a ``mean`` or ``sum`` the forward call makes them too, chunk by chunk while each
chunk's logits exist (``which="grad_a"``, ``"grad_m"``, ``"grad_bias"``: nodes its VJP adds, made
by the same call as the loss, ``joint_call``), as the gradients of the loss itself; the VJP
multiplies them by the incoming 0-d gradient. For ``none``, the rows' gradient is only known in
backward: ``linear_cross_entropy_backward(grad, a, m, [bias], target, [weight], which=...)``
makes the logits again. For double backward (create_graph=True) a region's joint graph runs the
decomposed form, which SymPy's autodiff differentiates like any graph.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from compiler.ir.graph import kind_of, meta_of, OpKind, output_node, set_meta
from compiler.ir.ops.externs import EXTERNS, Extern
from compiler.ir.ops.pointwise import POINTWISE, emit_pointwise
from compiler.report import logs
from runtime import backends
from runtime import linear_cross_entropy as runtime_loss

_PARAMETERS = ("reduction", "ignore_index", "label_smoothing", "has_bias", "has_weight", "loss_dtype")
_GRADS = {"a": 0, "m": 1, "bias": 2}   # operand name -> position among the arguments


def _parameters(node: fx.Node) -> dict:
    return {k: node.kwargs[k] for k in _PARAMETERS}


def _core_count(parameters: dict) -> int:
    """How many of the op's arguments it reads (the logits' name, if still there, follows)."""
    return 3 + bool(parameters["has_bias"]) + bool(parameters["has_weight"])


def _for_runtime(parameters: dict) -> dict:
    """The op's parameters as ``runtime.linear_cross_entropy`` takes them (the dtype a torch.dtype)."""
    return {**parameters, "loss_dtype": getattr(torch, parameters["loss_dtype"])}


class LinearCrossEntropy(Extern):
    """The loss (``which="loss"``), or one of its gradients made with it (``grad_a`` ...)."""

    def __init__(self):
        super().__init__("linear_cross_entropy")

    @staticmethod
    def torch_fn(*args, which, **parameters):
        return runtime_loss.forward(*args[:_core_count(parameters)], which=which, **_for_runtime(parameters))

    def function_for(self, backend: str):
        return functools.partial(LinearCrossEntropy.torch_fn, backend=backend)

    def kernels_launched(self, backend: str, nodes) -> int:
        """One chunk kernel a chunk, where the Triton kernels run (counted as one: the chunks
        depend on the sizes, not known here)."""
        return 0 if backends.cpu_path(backend) else 1

    def joint_key(self, node):
        return tuple(node.args[:_core_count(node.kwargs)]), tuple(sorted(_parameters(node).items()))

    def joint_call(self, nodes, backend):
        """The loss and the gradients asked for, one pass over the chunks."""
        order = sorted(nodes, key=lambda n: ("loss", "grad_a", "grad_m", "grad_bias").index(n.kwargs["which"]))
        if len({n.kwargs["which"] for n in nodes}) != len(nodes) or len(nodes[0].args) != _core_count(nodes[0].kwargs):
            return None
        kwargs = {"which": tuple(n.kwargs["which"] for n in order), **_for_runtime(_parameters(nodes[0]))}
        return runtime_loss.forward, {**kwargs, "backend": backend}, order

    def vjp(self, b, node, grad_out):
        if node.kwargs["which"] != "loss":
            return [None] * len(node.args)
        core = list(node.args[:_core_count(node.kwargs)])
        p = _parameters(node)
        grads = [None] * len(node.args)
        for name, position in _GRADS.items():
            if name == "bias" and not p["has_bias"]:
                continue
            source = core[position]
            if not meta_of(source).requires_grad:
                continue
            dtype = meta_of(source).dtype
            if p["reduction"] == "none":
                grads[position] = b.call(LINEAR_CROSS_ENTROPY_BACKWARD, [grad_out, *core], {"which": name, **p},
                                         shape=meta_of(source).shape, dtype=dtype, requires_grad=False)
                continue
            made = _made_with(node, f"grad_{name}") if len(node.args) == len(core) else None
            if made is None:   # (not made with the loss: the backward makes the logits again)
                made = b.call(LINEAR_CROSS_ENTROPY, core, {"which": f"grad_{name}", **p},
                              shape=meta_of(source).shape, dtype=dtype, requires_grad=False)
            grads[position] = emit_pointwise(b, "mul", [made, grad_out], dtype=dtype)
        return grads

    def decompose(self, b, node, logits=None):
        """The loss as the binding writes it when not chunked, of ``logits`` (a node; by default
        made again from the operands); None for a gradient node."""
        if node.kwargs["which"] != "loss":
            return None
        from compiler.capture.bindings.cross_entropy import class_index_loss   # (capture's math on handles)
        from compiler.capture.bindings.handles import Tensor

        p = _parameters(node)
        core = list(node.args[:_core_count(node.kwargs)])
        target, weight = core[2 + p["has_bias"]], (core[-1] if p["has_weight"] else None)
        if logits is None:
            logits = Tensor(b, emit_logits(b, core[0], core[1], core[2] if p["has_bias"] else None))
            if logits.dtype != getattr(torch, p["loss_dtype"]):
                logits = logits.to(getattr(torch, p["loss_dtype"]))
        else:
            logits = Tensor(b, logits)
        loss = class_index_loss(logits, Tensor(b, target), None if weight is None else Tensor(b, weight),
                                p["ignore_index"], p["label_smoothing"], p["reduction"])
        return loss.node


class LinearCrossEntropyBackward(Extern):
    """A gradient (``which``: a, m or bias) of the per-row loss, from the rows' gradient."""

    def __init__(self):
        super().__init__("linear_cross_entropy_backward")

    @staticmethod
    def torch_fn(grad, *args, which, **parameters):
        return runtime_loss.backward(grad, *args, which=which, **_for_runtime(parameters))

    def function_for(self, backend: str):
        return functools.partial(LinearCrossEntropyBackward.torch_fn, backend=backend)

    def kernels_launched(self, backend: str, nodes) -> int:
        return 0 if backends.cpu_path(backend) else 1

    def joint_key(self, node):
        return tuple(node.args), tuple(sorted(_parameters(node).items()))

    def joint_call(self, nodes, backend):
        order = sorted(nodes, key=lambda n: tuple(_GRADS).index(n.kwargs["which"]))
        if len({n.kwargs["which"] for n in nodes}) != len(nodes):
            return None
        return (runtime_loss.backward, {"which": tuple(n.kwargs["which"] for n in order),
                                        **_for_runtime(_parameters(nodes[0])), "backend": backend}, order)

    def vjp(self, b, node, grad_out):
        raise AssertionError("linear_cross_entropy_backward is differentiated through the decomposed loss "
                             "(LinearCrossEntropy.decompose, in the region's joint graph); it has no derivative")


LINEAR_CROSS_ENTROPY = LinearCrossEntropy()
LINEAR_CROSS_ENTROPY_BACKWARD = LinearCrossEntropyBackward()


def emit_logits(b, a, m, bias):
    """bias + a @ m as the linear's binding makes it (one addmm, or an mm)."""
    from compiler.ir.ops.externs import emit_addmm, emit_extern
    return emit_extern(b, "mm", a, m) if bias is None else emit_addmm(b, bias, a, m)


def emit_linear_cross_entropy(b, a, m, bias, target, weight, logits, *, reduction: str, ignore_index: int,
                              label_smoothing: float, loss_dtype: torch.dtype) -> fx.Node:
    """The chunked loss node (see the module doc); ``logits``: the node it stands for."""
    args = [x for x in (a, m, bias, target, weight, logits) if x is not None]
    parameters = {"which": "loss", "reduction": reduction, "ignore_index": int(ignore_index),
                  "label_smoothing": float(label_smoothing), "has_bias": bias is not None,
                  "has_weight": weight is not None, "loss_dtype": str(loss_dtype).replace("torch.", "")}
    shape = () if reduction != "none" else meta_of(target).shape
    return b.call(LINEAR_CROSS_ENTROPY, args, parameters, shape=shape, dtype=loss_dtype,
                  requires_grad=any(meta_of(x).requires_grad for x in (a, m, bias) if x is not None))


# ----------------------------------------------------------------------------- the logits' source
def linear_source(x: fx.Node):
    """(a, m, bias or None, the nodes from the matmul to ``x``) if ``x`` is ``bias + a @ m`` (an mm or
    addmm), reshaped to the same 2-D shape or widened to another float dtype on the way; else None."""
    chain, node = [x], x
    while True:
        if kind_of(node) == OpKind.VIEW and node.target.name == "reshape":
            node = node.args[0]
        elif node.op == "call_function" and node.target is POINTWISE["identity"] and len(node.args) == 1 and \
                _widens(meta_of(node.args[0]).dtype, meta_of(node).dtype):
            node = node.args[0]
        else:
            break
        chain.append(node)
    if node.op != "call_function" or tuple(meta_of(node).shape) != tuple(meta_of(x).shape):
        return None
    if node.target is EXTERNS["mm"]:
        return node.args[0], node.args[1], None, chain
    if node.target is EXTERNS["addmm"] and len(meta_of(node.args[0]).shape) == 1:
        return node.args[1], node.args[2], node.args[0], chain
    return None


def _widens(source: torch.dtype, dest: torch.dtype) -> bool:
    return source.is_floating_point and dest.is_floating_point and \
        torch.finfo(dest).bits >= torch.finfo(source).bits and torch.promote_types(source, dest) == dest


def chunked_loss_pass(graph: fx.Graph) -> int:
    """Drop the logits' name from each chunked loss whose logits nothing else reads (the matmul
    making them dies); decompose the others (their logits are made anyway). Returns how many
    stay chunked. Run last before the partition: the gradient nodes it adds are read only by the
    VJP, and a dead-code pass in between would drop them."""
    from compiler.ir.graph import GraphBuilder

    outputs = set(n for n in output_node(graph).args[0] if isinstance(n, fx.Node))
    kept, b = [], GraphBuilder(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not LINEAR_CROSS_ENTROPY or \
                len(node.args) == _core_count(node.kwargs):
            continue
        logits = node.args[-1]
        found = linear_source(logits)
        if found is not None and _private(found[3], node, outputs):
            kept.append(_without_logits(node))
            continue
        logs.logger("graphs").info("the cross-entropy of a linear's logits is not chunked: something else reads "
                                   "the logits (they are made whole anyway)")
        with graph.inserting_before(node):
            made = LINEAR_CROSS_ENTROPY.decompose(b, node, logits)
        node.replace_all_uses_with(made)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    for node in kept:   # (after the dead code is gone: nothing reads them before the VJP does)
        _gradients_with_the_loss(b, node)
        rows, classes = meta_of(node.args[0]).shape[0], meta_of(node.args[1]).shape[1]
        logs.logger("graphs").info("the cross-entropy of %d x %d logits runs in row chunks (%s; nothing else reads "
                                   "the logits)", rows, classes, node.kwargs["reduction"])
    return len(kept)


def _without_logits(node: fx.Node) -> fx.Node:
    """``node`` again without the logits' name (its last argument), in its place."""
    with node.graph.inserting_before(node):
        made = node.graph.call_function(node.target, node.args[:-1], dict(node.kwargs))
    set_meta(made, meta_of(node))
    node.replace_all_uses_with(made)
    node.graph.erase_node(node)
    return made


def _gradients_with_the_loss(b, loss: fx.Node) -> None:
    """The loss's gradients as forward nodes next to it (a mean or sum: those of the loss itself),
    so the partition has the forward's call make them while each chunk's logits exist, and saves
    them; the VJP finds them (``_made_with``). (Made by the VJP, they would be backward nodes: the
    logits made a second time.)"""
    p = _parameters(loss)
    if p["reduction"] == "none":
        return
    core = loss.args
    for name, position in _GRADS.items():
        if (name == "bias" and not p["has_bias"]) or not meta_of(core[position]).requires_grad:
            continue
        with loss.graph.inserting_after(loss):
            b.call(LINEAR_CROSS_ENTROPY, core, {"which": f"grad_{name}", **p}, shape=meta_of(core[position]).shape,
                   dtype=meta_of(core[position]).dtype, requires_grad=False)


def _made_with(loss: fx.Node, which: str):
    """The node of ``loss``'s gradient ``which`` that ``_gradients_with_the_loss`` made, if any."""
    for user in loss.args[0].users:
        if user is not loss and user.target is LINEAR_CROSS_ENTROPY and user.kwargs["which"] == which and \
                user.args == loss.args and _parameters(user) == _parameters(loss):
            return user
    return None


def _private(chain: list, loss: fx.Node, outputs: set) -> bool:
    """Whether the logits' chain (from ``x`` back to the matmul) is read by nothing but itself and
    the loss: then no other value needs the logits."""
    inside = set(chain) | {loss}
    return not any(n in outputs for n in chain) and all(set(n.users) <= inside for n in chain)
