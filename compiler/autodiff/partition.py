"""Reverse-mode differentiation of a region graph, and the forward/backward partition.

``differentiate`` appends the backward to the forward graph (a joint graph), node by node
in reverse order, with each op's VJP from the catalog; gradients reaching one value are
summed, and broadcasting is undone by ``catalog.sum_to_shape``. ``partition`` then splits
the joint graph into the forward program (which also returns what backward must keep) and
the backward program.

NOTE (memory): which forward values backward reads are saved and which are recomputed
inside the backward kernels is a minimum cut over the joint graph (``compiler.autodiff.saved_set``,
in the spirit of AOTAutograd's min-cut partitioner): a fused elementwise chain saves only
what it needs fewest bytes of; reductions' statistics are saved at their own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from compiler.ir.graph import (GraphBuilder, OpKind, arg_symbol, copy_graph, kind_of, meta_of, output_node,
                               update_meta)
from compiler.ir.ops import catalog as C
from compiler.ir.ops.pointwise import UNDEFINED
from compiler.autodiff.saved_set import choose_saved
from compiler.autodiff.softmax_vjp import output_vjp


@dataclass
class Partitioned:
    forward: fx.Graph          # inputs -> (*user outputs, *saved intermediates)
    backward: fx.Graph | None  # (*saved, *grad_outputs) -> grads of inputs (None where no grad)
    num_user_outputs: int
    saved: list                # descriptors: ("input", i) or ("output", j) of the forward
    grad_output_for: list      # indices of user outputs that receive a gradient
    input_needs_grad: list     # per forward input
    joint: fx.Graph | None = None  # (*inputs, *grad_outputs) -> input grads: for double backward
    grad_sources: tuple = ()   # per input: positions in grad_output_for whose gradient reaches it
    output_sources: tuple = ()  # per user output: the same (eager runs its op's backward iff any is given)
    saved_names: tuple = ()    # the forward node's name per saved value (to match another partition's)
    joint_decomposed: tuple = ()  # ops the joint runs in their decomposed form (flash attention)


def differentiate(graph: fx.Graph, only_outputs=None):
    """Append gradient nodes to ``graph``; return (grad_output placeholders, input grads, and per
    forward node the positions of the grad_output placeholders whose gradient reaches it: eager's
    graph path, even where the contribution is a constant zero). ``only_outputs``: positions of
    the outputs that get a gradient (default: every differentiable one)."""
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    output = output_node(graph)
    outputs = list(output.args[0])
    b = GraphBuilder(graph)
    grads: dict = {}
    sources: dict = {}  # node -> positions of the grad_output placeholders its gradient comes from
    grad_placeholders = []
    with graph.inserting_before(output):
        for i, out in enumerate(outputs):
            if _differentiable(out) and (only_outputs is None or i in only_outputs):
                g = b.placeholder(f"grad_out{i}", meta_of(out).shape, meta_of(out).dtype)
                sources[out] = sources.get(out, frozenset()) | {len(grad_placeholders)}
                grad_placeholders.append((i, g))
                grads[out] = _accumulate(b, grads.get(out), g)
        reached: dict = {}  # node an undefined gradient reached (``UNDEFINED``) -> its sources
        for node in reversed(nodes):
            if node.op == "call_function" and node not in grads and node in reached:
                for a in node.args:
                    if _differentiable(a):
                        reached[a] = reached.get(a, frozenset()) | reached[node]
            if node.op != "call_function" or node not in grads:
                continue
            start = len(b.created)
            closed_form = output_vjp(b, node, grads[node])
            if closed_form is not None:  # softmax and log_softmax: from their output, as eager
                z, contribution = closed_form
                _name_origin(b, start, node)
                grads[z] = _accumulate(b, grads.get(z), contribution)
                sources[z] = sources.get(z, frozenset()) | sources[node]
                continue
            if meta_of(node).materialize_grad:
                update_meta(grads[node], materialize=True)
            contributions = C.vjp(b, node, grads[node])
            _name_origin(b, start, node)
            for arg, contribution in zip(node.args, contributions):
                if contribution is UNDEFINED and _differentiable(arg):
                    reached[arg] = reached.get(arg, frozenset()) | sources[node]
                if contribution is None or contribution is UNDEFINED or not _differentiable(arg):
                    continue
                contribution = C.sum_to_shape(b, contribution, meta_of(arg).shape)
                grads[arg] = _accumulate(b, grads.get(arg), contribution)
                sources[arg] = sources.get(arg, frozenset()) | sources[node]
        for x in inputs:  # reached by undefined gradients only: eager's autograd.grad gives zeros
            if x not in grads and x in reached and meta_of(x).requires_grad:
                grads[x] = C.emit_fill(b, meta_of(x).shape, meta_of(x).dtype, 0)
                sources[x] = reached[x]
    return grad_placeholders, [grads.get(x) if meta_of(x).requires_grad else None for x in inputs], sources


def _name_origin(b, start, node) -> None:
    """Tag the gradient nodes made since ``start`` with ``node``'s op, for errors that name the
    forward op (anomaly mode)."""
    for made in b.created[start:]:
        if meta_of(made).origin is None:
            update_meta(made, origin=(meta_of(node).torch_op or node.target.name, meta_of(node).source))


def _differentiable(node) -> bool:
    dtype = meta_of(node).dtype if isinstance(node, fx.Node) else None
    return dtype is not None and meta_of(node).requires_grad and (dtype.is_floating_point or dtype.is_complex)


def _accumulate(b, existing, new):
    if existing is None:
        return new
    return C.emit_pointwise(b, "add", [existing, new], dtype=meta_of(existing).dtype, requires_grad=False)


def partition(graph: fx.Graph, mutated_inputs=frozenset(), only_outputs=None, written_later=frozenset(),
              memory="balanced", saved_from=None, outputs_written_later=frozenset(),
              copied_inputs=frozenset()) -> Partitioned | None:
    """Differentiate a forward region graph and split it into forward and backward programs.

    ``mutated_inputs`` are positions of inputs the region overwrites in place: backward must
    not recompute from them (their old value is gone), so values derived from them are saved.
    ``written_later``: positions of inputs the recorded function changes in place after this
    region: likewise never recomputed from. ``only_outputs``: differentiate through these
    output positions only (``differentiate``). ``memory``: the saved-set policy
    (``compiler.autodiff.saved_set``). ``saved_from``: names of the only forward values it may save
    (a backward for some outputs, reading the full one's saved values); None where they do not
    suffice. ``outputs_written_later``: positions of user outputs the recorded function changes in
    place after this region (through a view too): never saved as they are (their value at
    backward is not the forward's) but recomputed, or saved as a copy made by the forward.
    ``copied_inputs``: of ``written_later``, those no eager op saved (relu saves its result): where
    the backward still reads one, the forward saves a copy (eager's backward runs after the write);
    the others are saved as they are, and the write is eager's error at backward too.
    """
    forward_nodes = list(graph.nodes)
    inputs = [n for n in forward_nodes if n.op == "placeholder"]
    overwritten = {inputs[i] for i in mutated_inputs}
    user_outputs = list(output_node(graph).args[0])
    written_outputs = {user_outputs[j] for j in outputs_written_later
                       if isinstance(user_outputs[j], fx.Node) and user_outputs[j].op == "call_function"}
    input_needs_grad = [meta_of(x).requires_grad for x in inputs]
    if not any(_differentiable(o) for o in user_outputs) or not any(input_needs_grad):
        return Partitioned(graph, None, len(user_outputs), [], [], [False] * len(inputs))

    forward_set = set(forward_nodes)
    decomposed = copy_graph(graph) if _has_decomposed_form(graph) else None
    grad_placeholders, input_grads, sources = differentiate(graph, only_outputs)
    grad_sources = tuple(sources.get(x, frozenset()) for x in inputs)
    output_sources = tuple(sources.get(o, frozenset()) for o in user_outputs)
    joint, joint_decomposed = _joint(inputs, [g for _, g in grad_placeholders], input_grads), ()
    if decomposed is not None:
        joint, joint_decomposed = _decomposed_joint(decomposed, only_outputs)
    values = [n for n in forward_nodes if n.op in ("placeholder", "call_function")]
    # NOTE: an output written later is not free to save: it is saved as a copy (its bytes), as an
    # input the region overwrites is (eager's ops saved their values before the write, or the output
    # itself, which the runtime version-checks apart: eager_saved)
    free = (set(inputs) | set(user_outputs)) - written_outputs
    to_save = choose_saved(values, _read_by_backward(input_grads, forward_set), free,
                           overwritten | {inputs[i] for i in written_later}, memory, saved_from)
    if to_save is None:
        return None

    builder = _BackwardBuilder(forward_set, to_save, overwritten, written_outputs)
    backward = builder.build(grad_placeholders, input_grads, {inputs[i] for i in written_later} - overwritten,
                             {inputs[i] for i in copied_inputs},
                             [n for n in graph.nodes if n not in forward_set])
    forward, saved = _forward_program(forward_nodes, inputs, user_outputs, builder.saved_nodes, builder.clones)
    return Partitioned(forward, backward, len(user_outputs), saved,
                       [i for i, _ in grad_placeholders], input_needs_grad, joint, grad_sources,
                       output_sources, tuple(n.name for n in builder.saved_nodes), joint_decomposed)


class _BackwardBuilder:
    """The backward graph of a differentiated region: its gradient nodes copied out of the joint
    graph, each forward value they read recomputed (from what backward has anyway: the cut proved
    it) or read from a placeholder the forward fills (saved, or a copy of the old value)."""

    def __init__(self, forward_set: set, to_save: set, overwritten: set, written_outputs: set):
        self.forward_set, self.to_save = forward_set, to_save
        self.overwritten, self.written_outputs = overwritten, written_outputs
        self.graph = fx.Graph()
        self.builder = GraphBuilder(self.graph)
        self.env: dict = {}
        self.saved_nodes: list = []         # forward values backward reads, in placeholder order
        self.saved_placeholders: list = []
        self.clones: list = []              # of those, the ones saved as a copy the forward makes
        self.grad_inputs: dict = {}         # joint graph's grad placeholder -> backward's

    def build(self, grad_placeholders, input_grads, written_later: set, copied: set, joint_order: list) -> fx.Graph:
        for i, g in grad_placeholders:
            self.grad_inputs[g] = self.builder.placeholder_like(f"grad_out{i}", g)
        # NOTE (memory): copied in the joint graph's order (the forward's, reversed), not depth-first
        # from each input's gradient: depth-first made the first input's gradient chain first and every
        # weight's gradient last, holding each layer's output gradient and recomputed operands through
        # the whole backward (GPT-2: a 4.52 GB step peak; in this order 3.69 GB, as eager frees them).
        needed = _gradient_ancestors(input_grads, self.forward_set)
        for node in joint_order:
            if node in needed:
                self.copy(node)
        results = [self.copy(g) if g is not None else None for g in input_grads]
        for p in sorted(written_later, key=lambda n: n.name):
            if p in copied:
                self._read_without_saving(p)
            elif p not in self.env:
                # NOTE: an eager op of the region saved it (a division's numerator), though this
                # backward computes without it (from the quotient): saved as it is all the same, so
                # the later write is eager's version error at backward here too (API fuzz seed 22026)
                self.env[p] = self._placeholder(p, f"saved_{p.name}")
        self.graph.output(tuple(results))
        # fx keeps placeholders where they were created; put them first: saved, then grads.
        _reorder_placeholders(self.graph, self.saved_placeholders + [self.grad_inputs[g] for _, g in grad_placeholders])
        return self.graph

    def fetch(self, node):
        """The backward graph's version of a forward value: recomputed, or saved."""
        env = self.env
        if node in env:
            return env[node]
        if node in self.overwritten or (node in self.to_save and _view_base(node) in self.written_outputs):
            # NOTE: the region overwrites this input in place (eager keeps the original for
            # such backwards too), or a later call overwrites this output (or its base): the
            # forward saves a copy of the value it had.
            self.clones.append(node)
            env[node] = self._placeholder(node, f"saved_old_{node.name}")
        elif node in self.to_save or node.op == "placeholder":
            env[node] = self._placeholder(node, f"saved_{node.name}")
        else:  # recomputed from what backward has anyway (the cut proved its inputs are there)
            env[node] = self.graph.node_copy(node, self.fetch)
        return env[node]

    def copy(self, node):
        """A gradient node of the joint graph, copied into the backward with what it reads."""
        env = self.env
        if node in env:
            return env[node]
        if node in self.forward_set:
            return self.fetch(node)
        if node in self.grad_inputs:
            return self.grad_inputs[node]
        env[node] = self.graph.node_copy(node, self.copy)
        return env[node]

    def _placeholder(self, node, name: str) -> fx.Node:
        self.saved_nodes.append(node)
        p = self.builder.placeholder_like(name, node)
        self.saved_placeholders.append(p)
        return p

    def _read_without_saving(self, p) -> None:
        """An input the function writes in place later and no eager op saved (``partition``'s
        ``copied_inputs``: eager's backward runs after the write): read through a forward result
        instead where that removes it (``_read_result_instead``), else saved as a copy. (One an
        eager op saved stays saved as it is: the write is eager's version error.)"""
        if p not in self.env:
            return
        if _read_result_instead(self.graph, p, self.env, self.to_save, self.fetch):
            self.saved_placeholders.remove(self.env[p])
            self.saved_nodes.remove(p)
            self.graph.erase_node(self.env.pop(p))
        else:
            self.clones.append(p)


def _forward_program(forward_nodes, inputs, user_outputs, saved_nodes, clones):
    """The forward program: the region's nodes without the backward's, returning the user outputs
    and then the saved values it makes (copies of old values first made). Returns (graph, saved
    descriptors: ("input", i) or ("output", j) per saved value)."""
    forward = fx.Graph()
    fenv: dict = {}
    for node in forward_nodes:
        if node.op == "output":
            break
        fenv[node] = forward.node_copy(node, lambda n: fenv[n])
    saved, extra, copies = [], [], {}
    for node in clones:  # a copy of the old value, made before the region overwrites it
        m = meta_of(node)
        copies[node] = C.emit_pointwise(GraphBuilder(forward), "identity", [fenv[node]], dtype=m.dtype,
                                        requires_grad=m.requires_grad)
    for node in saved_nodes:
        if node in copies:
            saved.append(("output", len(user_outputs) + len(extra)))
            extra.append(node)
        elif node.op == "placeholder":
            saved.append(("input", inputs.index(node)))
        elif node in user_outputs:
            saved.append(("output", user_outputs.index(node)))
        else:
            saved.append(("output", len(user_outputs) + len(extra)))
            extra.append(node)
    forward.output(tuple([fenv[o] if isinstance(o, fx.Node) else o for o in user_outputs]
                         + [copies[o] if o in copies else fenv[o] for o in extra]))
    return forward, saved


def _view_base(node: fx.Node) -> fx.Node:
    """The value whose storage ``node`` shares: itself, or the base of its chain of views."""
    while kind_of(node) == OpKind.VIEW:
        node = node.args[0]
    return node


def _joint(inputs, grad_placeholders, input_grads) -> fx.Graph:
    """The backward as a function of the forward's *inputs* and the output gradients,
    recomputing what the first-order backward would read from saved values.

    NOTE: double backward (create_graph=True) differentiates this graph: its inputs are real
    tensors with autograd history, so every path from the inputs to the gradients is seen.
    """
    joint = fx.Graph()
    joint_builder = GraphBuilder(joint)
    env: dict = {}
    for p in list(inputs) + list(grad_placeholders):
        env[p] = joint_builder.placeholder_like(p.name, p)

    def copy(node):
        if node not in env:
            env[node] = joint.node_copy(node, copy)
        return env[node]
    joint.output(tuple(copy(g) if g is not None else None for g in input_grads))
    return joint


def _gradient_ancestors(input_grads, forward_set) -> set:
    """The gradient nodes (not the forward's) the input gradients are computed from."""
    needed, stack = set(), [g for g in input_grads if g is not None]
    while stack:
        node = stack.pop()
        if node in needed or node in forward_set or not isinstance(node, fx.Node):
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return needed


def _has_decomposed_form(graph: fx.Graph) -> bool:
    """Whether an op of ``graph`` has kernels with no derivative of their own (flash attention, a
    chunked loss): double backward differentiates its decomposed form (``decompose``)."""
    return any(n.op == "call_function" and hasattr(n.target, "decompose") for n in graph.nodes)


def _decomposed_joint(forward: fx.Graph, only_outputs) -> tuple:
    """(the joint graph, the ops decomposed) of a forward whose ops include kernels with no
    derivative of their own (flash attention): differentiated again with them in their
    decomposed form, so that double backward sees every path. The first-order backward keeps
    the kernels."""
    replaced = C.decompose_for_double_backward(forward)
    inputs = [n for n in forward.nodes if n.op == "placeholder"]
    grad_placeholders, input_grads, _ = differentiate(forward, only_outputs)
    return _joint(inputs, [g for _, g in grad_placeholders], input_grads), tuple(sorted(set(replaced)))


def propagate_requires_grad(graph: fx.Graph, placeholder_flags) -> None:
    """Set every node's requires_grad from the placeholders' (given in order), as autograd
    would: a value requires grad when a differentiable op reads one that does."""
    flags = iter(placeholder_flags)
    for node in graph.nodes:
        if node.op == "placeholder":
            update_meta(node, requires_grad=next(flags))
        elif node.op == "call_function":
            name = getattr(node.target, "name", "")
            dtype = meta_of(node).dtype
            update_meta(node, requires_grad=(
                (dtype.is_floating_point or dtype.is_complex) and name not in C.BOOL_RESULT_OPS
                and name != "fill" and not meta_of(node).detached
                and any(isinstance(a, fx.Node) and meta_of(a).requires_grad for a in node.args)))


def _read_result_instead(backward: fx.Graph, p, env, to_save, fetch) -> bool:
    """Rewrite backward pointwise nodes that read input ``p`` (changed in place after the
    forward) to read the result of a forward op on ``p`` instead, where that removes ``p``
    from them: ``g * x0 / sqrt(x0**2 + x1**2)`` becomes ``g * x0 / hypot`` (eager's hypot
    saved its result, so eager's backward runs after ``x1`` changes). Returns whether
    backward no longer reads ``p``."""
    read = env[p]
    for user in list(read.users):
        expr = meta_of(user).expr if kind_of(user) == OpKind.POINTWISE else None
        if expr is None:
            continue
        for op in p.users:
            op_expr = meta_of(op).expr if kind_of(op) == OpKind.POINTWISE else None
            if op_expr is None or (op in env and env[op].op != "placeholder") or \
                    any(a not in env or env[a] not in user.args for a in op.all_input_nodes):
                continue
            pattern = op_expr.xreplace({arg_symbol(k): arg_symbol(user.args.index(env[a]))
                                        for k, a in enumerate(op.args) if isinstance(a, fx.Node)})
            replaced = expr.subs(pattern, arg_symbol(len(user.args)))  # (subs: sees 1/sqrt(u) as u**-1)
            if arg_symbol(user.args.index(read)) in replaced.free_symbols:
                continue
            to_save.add(op)
            args = list(user.args) + [fetch(op)]
            kept = [k for k, a in enumerate(args) if a is not read]
            expr = replaced.xreplace({arg_symbol(old): arg_symbol(new) for new, old in enumerate(kept)})
            user.args = tuple(args[k] for k in kept)
            update_meta(user, expr=expr)
            break
    return not read.users


def _read_by_backward(input_grads, forward_set) -> set:
    """The forward values the backward nodes that make ``input_grads`` read directly."""
    needed, seen = set(), set()
    stack = [g for g in input_grads if g is not None]
    while stack:
        node = stack.pop()
        if node in forward_set:
            needed.add(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return needed


def _reorder_placeholders(graph: fx.Graph, order):
    anchor = None
    for p in order:
        if anchor is None:
            first = next(iter(graph.nodes))
            if p is not first:
                first.prepend(p)
        else:
            anchor.append(p)
        anchor = p
