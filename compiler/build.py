"""From a region graph to a runnable ``CompiledRegion``: partition (``compiler.autodiff``),
fuse (``compiler.fusion``), lower to programs (``compiler.lower``).

``build_region`` is the whole compiler for one region; the runtime asks it, through the
region's builders, for partial and double backwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from compiler.autodiff.partition import partition, propagate_requires_grad
from compiler.capture.attention_pattern import attention_passes
from compiler.capture.regions import EAGER_NAMES, EAGER_SAVED, SAVED_BY_CONSUMERS, SAVED_INPUTS
from compiler.fusion.fuse import fuse, keep_long_chains
from compiler.ir.ops import catalog as C
from compiler.ir.reference import first_nan
from compiler.ir.sympy_lock import SYMPY_LOCK
from compiler.report import logs
from compiler.lower.program import lower, view_step
from runtime.autograd_bridge import CompiledRegion, OnDemand
from compiler.ir.graph import OpKind, copy_graph, kind_of, meta_of, output_node, outputs_of, update_meta


@dataclass(frozen=True)
class _Outputs:
    """The region graph's outputs as the build hands them on: those the runtime makes by torch
    after the program (views of inputs, views of bases written later), and positions of the
    rest, among the outputs the graph keeps."""
    input_views: list        # (position, input, views): ``_split_input_views``
    output_views: list       # (position, base, views): ``_split_written_output_views``
    hidden_bases: int        # the bases those views are made from, returned last
    kept_position: dict      # original output position -> position among the kept outputs
    written_later: frozenset  # kept positions the function writes later and eager saved none of
    copied_inputs: frozenset  # input positions written later that no eager op saved
    eager_saved: dict        # output node eager's op saved -> (grad_fn name, output_nr)
    eager_names: dict        # ("input"|"output", kept position) -> the producer eager's error names


def build_region(graph: fx.Graph, mutated_inputs=frozenset(), written_later=frozenset(), memory="balanced",
                 outputs_written_later=frozenset(), shape_generic=False, mutated_outputs=(),
                 gradients_handed_out=False):
    """Compile one captured region (under ``SYMPY_LOCK``: builds in several threads share SymPy's
    cached expressions): ``_build_region``."""
    with SYMPY_LOCK:
        return _build_region(graph, mutated_inputs, written_later, memory, outputs_written_later, shape_generic,
                             mutated_outputs, gradients_handed_out)


def _build_region(graph: fx.Graph, mutated_inputs, written_later, memory, outputs_written_later, shape_generic,
                  mutated_outputs, gradients_handed_out=False):
    """Compile one captured region. Returns (CompiledRegion, details for ``explain``).
    ``mutated_inputs``: positions of inputs the region changes in place; ``written_later``:
    of inputs the function changes in place after the region; ``memory``: the saved-set
    policy (``compiler.autodiff.saved_set``); ``outputs_written_later``: of outputs the function
    changes in place after the region; ``shape_generic``: kernels take their sizes as arguments
    (``codegen.triton_kernel.render_kernel``), so builds that differ only in sizes share sources;
    ``gradients_handed_out``: the backward is handed out in segments (DDP: ``runtime.segments``), so its
    program makes each gradient as early as it can (``compiler.lower.program.lower``)."""
    attention_passes(graph)   # (written-out attention as flash attention; its rotary, operands and output layout)
    C.chunked_loss_pass(graph)   # (a linear's cross-entropy in row chunks, where nothing else reads its logits)
    if memory != "min":
        keep_long_chains(graph)   # (a residual stream's sums: saved, not remade from every layer's outputs)
    outputs = _plan_outputs(graph, written_later, outputs_written_later)
    pristine = copy_graph(graph)  # partition appends the backward to ``graph``
    parts = partition(graph, mutated_inputs, written_later=written_later, memory=memory,
                      outputs_written_later=outputs.written_later, copied_inputs=outputs.copied_inputs)
    forward_program, forward_kernels = lower(parts.forward, fuse(parts.forward, shape_generic),
                                             shape_generic=shape_generic,
                                             donated_inputs=_donated_inputs(parts, outputs, mutated_outputs))
    backward_program, backward_kernels = _lower_backward(parts, shape_generic, gradients_handed_out)
    user_outputs = outputs_of(parts.forward)[: parts.num_user_outputs]
    differentiable = [meta_of(o).requires_grad and (meta_of(o).dtype.is_floating_point or meta_of(o).dtype.is_complex)
                      for o in user_outputs]
    backward = {}
    if parts.backward is not None:
        kept = outputs_of(graph)
        backward = dict(
            grad_sources=parts.grad_sources,
            # (a view's entry holds its own shape: eager's message names the tensor the op saved)
            eager_saved=tuple((kept.index(holder), name, output_nr, parts.output_sources[kept.index(holder)],
                               None if holder is node else tuple(meta_of(node).shape))
                              for node, (name, output_nr) in outputs.eager_saved.items()
                              for holder in [_version_holder(node, kept)] if holder is not None),
            # (saved inputs are the graph's placeholders by position; saved outputs the forward's,
            # whose first are the graph's outputs in order, as ``eager_saved``'s positions)
            eager_names={k: outputs.eager_names[kind, i] for k, (kind, i) in enumerate(parts.saved)
                         if (kind, i) in outputs.eager_names})
        if not mutated_inputs:
            backward["output_groups"] = _output_groups(parts.forward, parts.num_user_outputs, differentiable)
    if parts.joint is not None:
        backward["double_backward_reads"] = _placeholders_read(parts.joint)
    backward["on_demand"] = OnDemand(
        partial_backward=_partial_backward_builder(pristine, mutated_inputs, parts, written_later, memory,
                                                   outputs.written_later, shape_generic, outputs.copied_inputs)
        if parts.backward is not None else None,
        double_backward=_double_backward_builder(parts.joint, memory, shape_generic, parts.joint_decomposed)
        if parts.joint is not None else None,
        explain_nan=_nan_explainer(parts.backward) if parts.joint is not None else None)
    donors = {slot for step in forward_program.steps for _, slot in getattr(step, "reuse", ())}
    region = CompiledRegion(
        forward_program, backward_program, parts.num_user_outputs, parts.saved, parts.grad_output_for,
        differentiable, input_views=outputs.input_views, output_views=outputs.output_views,
        hidden_bases=outputs.hidden_bases, mutated_inputs=tuple(sorted(mutated_inputs)),
        written_later=tuple(sorted(written_later)),
        # NOTE: an input no output depends on (read only by values nobody used, DCE'd) is handed to
        # the region's autograd Function detached: connected, the engine would run its Node with no
        # gradient where eager's graph never reaches it (its hooks called with None: fuzz seed 155)
        unread_inputs=tuple(i for i, read in enumerate(_placeholders_read(pristine))
                            if not read and i not in mutated_inputs),
        donated_inputs=tuple(sorted(slot for slot in donors if slot < forward_program.num_inputs)),
        **backward)
    details = {
        "forward_graph": parts.forward,
        "backward_graph": parts.backward,
        "forward_kernels": forward_kernels,
        "backward_kernels": backward_kernels,
    }
    return region, details


def _version_holder(node, kept: list):
    """The output among ``kept`` whose version counter is ``node``'s: ``node`` itself, or, for a view
    the runtime makes after the program (``_split_written_output_views``: logsumexp's result, a
    reshape, written in place later), the base it views, which shares its counter."""
    while node not in kept and isinstance(node, fx.Node) and kind_of(node) == OpKind.VIEW:
        node = node.args[0]
    return node if node in kept else None


def _plan_outputs(graph: fx.Graph, written_later, outputs_written_later) -> _Outputs:
    """Take the outputs the runtime makes by torch out of ``graph`` (in place) and map the
    positions the capture gave to those the graph keeps."""
    output = output_node(graph)
    eager_saved = {output.args[0][i]: found for i, found in output.meta.get(EAGER_SAVED, {}).items()}
    # NOTE: an output that one of eager's ops saved as its input (minimum, log) and a later call
    # writes in place is eager's error at backward: saved as it is, ours raises it too (a copy
    # would not); only outputs eager never saved are copied or recomputed
    written_outputs = frozenset(outputs_written_later)
    unsaved_written = written_outputs - output.meta.get(SAVED_BY_CONSUMERS, set())
    # likewise an input eager's op saved; one it did not (relu saves its result) but our backward
    # reads is saved as a copy the forward makes (API fuzz seed 687)
    copied_inputs = frozenset(written_later) - output.meta.get(SAVED_INPUTS, set())
    original_outputs = list(output.args[0])
    input_views = _split_input_views(graph)
    # (positions among the outputs the graph keeps: views of inputs left it; an IndexError in partition)
    position_of = {node: k for k, node in reversed(list(enumerate(output.args[0])))}  # (the first, as index)
    kept_position = {i: position_of[node] for i, node in enumerate(original_outputs) if node in position_of}
    unsaved_written = frozenset(kept_position[i] for i in unsaved_written if i in kept_position)
    output_views, remap, base_position = _split_written_output_views(
        graph, {kept_position[i] for i in written_outputs if i in kept_position})
    kept_position = {i: remap[j] for i, j in kept_position.items() if j in remap}
    unsaved_written = frozenset(remap[j] for j in unsaved_written if j in remap) | frozenset(
        base_position[k] for j, k, _ in output_views if j in unsaved_written)
    eager_names = {(kind, kept_position[i] if kind == "output" else i): name
                   for (kind, i), name in output.meta.get(EAGER_NAMES, {}).items()
                   if kind == "input" or i in kept_position}
    return _Outputs(input_views, output_views, len(base_position), kept_position, unsaved_written, copied_inputs,
                    eager_saved, eager_names)


def _donated_inputs(parts, outputs: _Outputs, mutated_outputs) -> dict:
    """Input position -> the forward node that is its new value, for inputs changed in place whose
    new value a kernel may store into their own memory (``compiler.lower.program._input_donors``).
    NOTE: not where something reads the input's old value after the forward program: the double
    backward (it recomputes from it), an output made from the input by torch after the program
    (``input_views``: ``x.flip(1)`` returned, then ``x.add_(1)``; the flip copies then)."""
    forward_outputs = outputs_of(parts.forward)
    double_reads = _placeholders_read(parts.joint) if parts.joint is not None else ()
    viewed = {index for _, index, _ in outputs.input_views}
    kept = outputs.kept_position
    return {i: forward_outputs[kept[k]] for i, k in mutated_outputs
            if k in kept and isinstance(forward_outputs[kept[k]], fx.Node)
            and not (i < len(double_reads) and double_reads[i]) and i not in viewed}


def _lower_backward(parts, shape_generic: bool, gradients_handed_out: bool = False):
    """The backward program and its kernels (None, [] without a backward)."""
    if parts.backward is None:
        return None, []
    _transpose_matmul_gradients(parts.backward)
    _fold_permutes(parts.backward)
    # the forward checked the indices the backward gathers with (saved: version-checked)
    transient = [k for k, (kind, _) in enumerate(parts.saved) if kind == "output"]  # freed when last read
    return lower(parts.backward, fuse(parts.backward, shape_generic), check_indices=False,
                 transient_inputs=transient, shape_generic=shape_generic, outputs_handed_out=gradients_handed_out)


def _transpose_matmul_gradients(graph: fx.Graph) -> None:
    """``mm(a, b).T`` read only as its transpose becomes ``mm(b.T, a.T)``, in place.

    NOTE (memory): a linear layer's weight gradient is the transpose of a matmul's result; as a
    view it reaches autograd non-contiguous, and ``AccumulateGrad`` then copies it into the
    parameter's layout (a second weight-sized buffer at the backward's peak). Computed
    transposed, it is contiguous and stolen as eager's is.
    """
    for node in list(graph.nodes):
        if getattr(node.target, "name", None) != "permute" or node.kwargs.get("dims") != (1, 0):
            continue
        mm = node.args[0]
        if getattr(mm.target, "name", None) != "mm" or len(mm.users) != 1 or mm.kwargs:
            continue
        a, b = mm.args
        with graph.inserting_before(node):
            b_t = graph.node_copy(node, lambda _: b)
            update_meta(b_t, shape=tuple(reversed(meta_of(b).shape)), dtype=meta_of(b).dtype)
            a_t = graph.node_copy(node, lambda _: a)
            update_meta(a_t, shape=tuple(reversed(meta_of(a).shape)), dtype=meta_of(a).dtype)
            swapped = graph.node_copy(mm, lambda n: {a: b_t, b: a_t}[n])
            update_meta(swapped, shape=meta_of(node).shape)
        node.replace_all_uses_with(swapped)
        graph.erase_node(node)
        graph.erase_node(mm)


def _fold_permutes(graph: fx.Graph) -> None:
    """``permute(permute(x, d1), d2)`` becomes ``permute(x, d1[d2])``, or ``x`` where that is the
    identity: each permute is a host view call per run (a linear layer's weight gradient reads
    the transpose of its input's transpose: ``_transpose_matmul_gradients``)."""
    def is_permute(n) -> bool:
        return isinstance(n, fx.Node) and getattr(n.target, "name", None) == "permute"

    for node in list(graph.nodes):
        if not is_permute(node) or not is_permute(node.args[0]):
            continue
        inner = node.args[0]
        dims = tuple(inner.kwargs["dims"][d] for d in node.kwargs["dims"])
        base = inner.args[0]
        if dims == tuple(range(len(dims))):
            node.replace_all_uses_with(base)
            graph.erase_node(node)
        else:
            node.args = (base,)
            node.kwargs = {**node.kwargs, "dims": dims}
        if not inner.users:
            graph.erase_node(inner)


def _memoized(make):
    """``make(key)``, built once per key and shared by threads: a lookup takes no lock (these
    are called on every backward); a build happens under ``SYMPY_LOCK`` (one lock for every build:
    a build that builds another part on demand takes no second lock, so none can deadlock)."""
    cache: dict = {}
    lock = SYMPY_LOCK

    def get(key):
        try:
            return cache[key]
        except KeyError:
            pass
        with lock:
            if key not in cache:
                cache[key] = make(key)
            return cache[key]
    return get


def _double_backward_builder(joint: fx.Graph, memory="balanced", shape_generic=False, decomposed=()):
    """For create_graph=True: the backward as a compiled, differentiable region of its own,
    built per pattern of which of its inputs require grad (the same machinery, one order up).
    ``decomposed``: ops the joint runs in their decomposed form (said in the log when built)."""
    def build(requires_grad: tuple):
        if decomposed:
            logs.logger("backward").info(
                "double backward (create_graph=True) runs %s in its decomposed form (flash attention as "
                "softmax(q k^T * scale + mask) v, a chunked loss with its whole logits): their kernels have no "
                "derivative of their own, so this backward saves the T x T attention weights or the logits",
                ", ".join(decomposed))
        graph = copy_graph(joint)
        propagate_requires_grad(graph, requires_grad)
        output = output_node(graph)
        present = [g is not None for g in output.args[0]]  # inputs with no gradient (indices)
        output.args = (tuple(g for g in output.args[0] if g is not None),)
        region, _ = build_region(graph, memory=memory, shape_generic=shape_generic)
        return region if all(present) else _WithAbsentOutputs(region, present)
    return _memoized(build)


def _partial_backward_builder(forward: fx.Graph, mutated_inputs, parts, written_later, memory,
                              outputs_written_later=frozenset(), shape_generic=False, copied_inputs=frozenset()):
    """The backward for a call where only some outputs are in the loss's graph, built per set of
    those outputs: the others contribute nothing, as in eager (a zero gradient through them is
    not nothing: 0 * inf is NaN, log(x) at 0). Returns (Program, positions in the full saved list
    of the values it reads, its double-backward builder), or None where it would read a value the
    forward did not save."""
    position = {name: k for k, name in enumerate(parts.saved_names)}

    def build(given_outputs: frozenset):
        sub = partition(copy_graph(forward), mutated_inputs, only_outputs=given_outputs,
                        written_later=written_later, memory=memory, saved_from=set(position),
                        outputs_written_later=outputs_written_later, copied_inputs=copied_inputs)
        if sub is None or sub.backward is None or any(name not in position for name in sub.saved_names):
            return None
        program, _ = lower(sub.backward, fuse(sub.backward, shape_generic), check_indices=False,
                           shape_generic=shape_generic)
        double = _double_backward_builder(sub.joint, memory, shape_generic, sub.joint_decomposed) \
            if sub.joint is not None else None
        return program, [position[name] for name in sub.saved_names], double
    return _memoized(build)


def _output_groups(forward: fx.Graph, num_user_outputs: int, differentiable: list) -> tuple:
    """The region's differentiable outputs grouped by the inputs requiring grad they depend on:
    ((output positions, input positions), ...), or () where all depend on the same inputs.

    NOTE: eager's graph connects a leaf only to the values made from it. One autograd Node per
    region connects every input to every output: where the loss reaches only outputs that do not
    depend on a leaf, the engine still runs the leaf's AccumulateGrad, with no gradient (its hooks
    called with None: API fuzz seeds 401, 474, 920, 5115, 5528). Each group gets a Node of its own
    (``CompiledRegion._apply_by_group``)."""
    placeholders = {n: i for i, n in enumerate(n for n in forward.nodes if n.op == "placeholder")}
    outputs = output_node(forward).args[0][:num_user_outputs]
    groups: dict = {}
    for position, out in enumerate(outputs):
        if not differentiable[position] or not isinstance(out, fx.Node):
            continue
        seen, stack = {out}, [out]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    stack.append(arg)
        inputs = frozenset(placeholders[n] for n in seen if n in placeholders and meta_of(n).requires_grad)
        groups.setdefault(inputs, []).append(position)
    if len(groups) < 2:
        return ()
    return tuple((tuple(positions), inputs) for inputs, positions in groups.items())


def _placeholders_read(graph: fx.Graph) -> tuple:
    """Per placeholder of ``graph``: whether any output depends on its value."""
    output = output_node(graph)
    read, stack = set(), [output]
    while stack:
        node = stack.pop()
        for arg in node.all_input_nodes:
            if arg not in read:
                read.add(arg)
                stack.append(arg)
    return tuple(n in read for n in graph.nodes if n.op == "placeholder")


class _WithAbsentOutputs:
    """A region whose graph had no value for some outputs: returns None in their places."""

    def __init__(self, region, present):
        self.region, self.present = region, present

    @property
    def stats(self):
        return self.region.stats

    def count_launches_in(self, stats: dict) -> None:
        self.region.count_launches_in(stats)

    def __call__(self, inputs):
        results = iter(self.region(inputs))
        return [next(results) if p else None for p in self.present]


def _nan_explainer(backward: fx.Graph):
    """Under detect_anomaly: which forward op's derivative made the NaN (op by op, eagerly)."""
    def explain(inputs) -> str:
        with SYMPY_LOCK:   # (the reference evaluates the graph's SymPy expressions)
            node = first_nan(backward, inputs)
        if node is None:
            return "Function '_RegionFunctionBackward' returned nan values (compiled region backward)"
        op, source = meta_of(node).origin or (node.target.name, None)
        return (f"Function '{op}' (compiled region backward) returned nan values: the derivative of "
                f"{op} called at {source or '?'} turned finite values into NaN "
                f"(backward graph node {node.name}: {meta_of(node).expr or node.target.name})")
    return explain




def _split_input_views(graph: fx.Graph):
    """Take outputs that are views of inputs (or inputs themselves) out of the graph.

    NOTE: a ``torch.autograd.Function`` that returns a view of its input makes that output
    a "view created inside a custom Function", which PyTorch refuses to modify in place; the
    runtime applies these views to the real inputs after the region runs instead, so they
    alias their base and take in-place ops exactly as eager views do.
    Returns [(output position, input position, (ViewStep, ...))].
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = output_node(graph)
    kept, views = [], []
    for position, out in enumerate(output.args[0]):
        chain, node = [], out
        while kind_of(node) == OpKind.VIEW:
            chain.append(view_step(node))
            node = node.args[0]
        if node.op == "placeholder":
            views.append((position, placeholders.index(node), tuple(reversed(chain))))
        else:
            kept.append(out)
    if views:
        output.args = (tuple(kept),)
    return views


def _split_written_output_views(graph: fx.Graph, written: set):
    """Take outputs that view a buffer the region does not return (a linear layer's 3-d output, a
    view of its 2-d matmul's) and that the function writes in place later (``written``: output
    positions) out of the graph, and return their bases instead, appended to the outputs.

    NOTE: the runtime makes such a view from the base with PyTorch's own view op after the region
    runs (``CompiledRegion.output_views``), so the later in-place op is recorded on a real view, as
    in eager (CopySlices: its Node and hooks see the base's gradient, API fuzz seed 9544). Other
    such views stay in the graph: handed over as tensors of their own, they cost no view Node.
    Returns ([(position, base index, (ViewStep, ...))], {old position: new one}, [base positions])."""
    output = output_node(graph)
    outs = list(output.args[0])
    views, kept, bases = [], [], []
    remap = {}
    for position, out in enumerate(outs):
        chain, node = [], out
        while isinstance(node, fx.Node) and kind_of(node) == OpKind.VIEW:
            chain.append(view_step(node))
            node = node.args[0]
        if position in written and chain and node.op == "call_function" and node not in outs:
            if node not in bases:
                bases.append(node)
            views.append((position, bases.index(node), tuple(reversed(chain))))
        else:
            remap[position] = len(kept)
            kept.append(out)
    if views:
        output.args = (tuple(kept + bases),)
    return views, remap, [len(kept) + k for k in range(len(bases))]
