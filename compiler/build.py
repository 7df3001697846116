"""From a region graph to a runnable ``CompiledRegion``: partition, fuse, render, assemble.

``build_region`` is the whole compiler for one region; ``lower`` turns one fused schedule
into a runtime ``Program`` (value slots, kernel launches, matmul calls, view outputs).
"""

from __future__ import annotations

import math
import re
import threading

import torch.fx as fx

from compiler.autodiff.partition import partition, propagate_requires_grad
from compiler.capture.regions import EAGER_NAMES, EAGER_SAVED, SAVED_BY_CONSUMERS, SAVED_INPUTS
from compiler.codegen.torch_kernel import render_torch_kernel
from compiler.codegen.triton_kernel import render_kernel
from compiler.fusion.fuse import Schedule, inlined_reads, fuse, kind_of
from compiler.ir.reference import first_nan
from runtime.autograd_bridge import CompiledRegion
from runtime.program import ExternCall, IndexCheck, KernelLaunch, Program, ValueRef, ViewStep
from compiler.ir.graph import meta_of, update_meta


def build_region(graph: fx.Graph, mutated_inputs=frozenset(), written_later=frozenset(), memory="balanced",
                 outputs_written_later=frozenset(), shape_generic=False, mutated_outputs=()):
    """Compile one captured region. Returns (CompiledRegion, details for ``explain``).
    ``mutated_inputs``: positions of inputs the region changes in place; ``written_later``:
    of inputs the function changes in place after the region; ``memory``: the saved-set
    policy (``compiler.autodiff.saved_set``); ``outputs_written_later``: of outputs the function
    changes in place after the region; ``shape_generic``: kernels take their sizes as arguments
    (``codegen.triton_kernel.render_kernel``), so builds that differ only in sizes share sources."""
    output = next(n for n in graph.nodes if n.op == "output")
    eager_saved = {output.args[0][i]: found for i, found in output.meta.get(EAGER_SAVED, {}).items()}
    # NOTE: an output that one of eager's ops saved as its input (minimum, log) and a later call
    # writes in place is eager's error at backward: saved as it is, ours raises it too (a copy
    # would not); only outputs eager never saved are copied or recomputed
    written_outputs = frozenset(outputs_written_later)
    outputs_written_later = written_outputs - output.meta.get(SAVED_BY_CONSUMERS, set())
    # likewise an input eager's op saved; one it did not (relu saves its result) but our backward
    # reads is saved as a copy the forward makes (API fuzz seed 687)
    copied_inputs = frozenset(written_later) - output.meta.get(SAVED_INPUTS, set())
    original_outputs = list(output.args[0])
    input_views = _split_input_views(graph)
    # (positions among the outputs the graph keeps: views of inputs left it; an IndexError in partition)
    position_of = {node: k for k, node in reversed(list(enumerate(output.args[0])))}  # (the first, as index)
    kept_position = {i: position_of[node] for i, node in enumerate(original_outputs) if node in position_of}
    outputs_written_later = frozenset(kept_position[i] for i in outputs_written_later if i in kept_position)
    output_views, remap, base_position = _split_written_output_views(
        graph, {kept_position[i] for i in written_outputs if i in kept_position})
    kept_position = {i: remap[j] for i, j in kept_position.items() if j in remap}
    outputs_written_later = frozenset(remap[j] for j in outputs_written_later if j in remap) | frozenset(
        base_position[k] for j, k, _ in output_views if j in outputs_written_later)
    eager_names = {(kind, kept_position[i] if kind == "output" else i): name
                   for (kind, i), name in output.meta.get(EAGER_NAMES, {}).items()
                   if kind == "input" or i in kept_position}
    pristine = _copy_graph(graph)  # partition appends the backward to ``graph``
    parts = partition(graph, mutated_inputs, written_later=written_later, memory=memory,
                      outputs_written_later=outputs_written_later, copied_inputs=copied_inputs)
    forward_schedule = fuse(parts.forward, shape_generic)
    forward_outputs = next(n for n in parts.forward.nodes if n.op == "output").args[0]
    # NOTE: not where something reads the input's old value after the forward program: the double
    # backward (it recomputes from it), an output made from the input by torch after the program
    # (``input_views``: ``x.flip(1)`` returned, then ``x.add_(1)``; the flip copies then)
    double_reads = _placeholders_read(parts.joint) if parts.joint is not None else ()
    viewed = {index for _, index, _ in input_views}
    donated = {i: forward_outputs[kept_position[k]] for i, k in mutated_outputs
               if k in kept_position and isinstance(forward_outputs[kept_position[k]], fx.Node)
               and not (i < len(double_reads) and double_reads[i]) and i not in viewed}
    forward_program, forward_kernels = lower(parts.forward, forward_schedule, shape_generic=shape_generic,
                                             donated_inputs=donated)
    backward_program, backward_kernels = None, []
    if parts.backward is not None:
        _transpose_matmul_gradients(parts.backward)
        _fold_permutes(parts.backward)
        backward_schedule = fuse(parts.backward, shape_generic)
        # the forward checked the indices the backward gathers with (saved: version-checked)
        transient = [k for k, (kind, _) in enumerate(parts.saved) if kind == "output"]  # freed when last read
        backward_program, backward_kernels = lower(parts.backward, backward_schedule, check_indices=False,
                                                   transient_inputs=transient, shape_generic=shape_generic)
    outputs = list(next(n for n in parts.forward.nodes if n.op == "output").args[0])[: parts.num_user_outputs]
    differentiable = [meta_of(o).requires_grad and (meta_of(o).dtype.is_floating_point or meta_of(o).dtype.is_complex)
                      for o in outputs]
    region = CompiledRegion(forward_program, backward_program, parts.num_user_outputs, parts.saved,
                            parts.grad_output_for, differentiable, input_views=input_views,
                            output_views=output_views, hidden_bases=len(base_position),
                            mutated_inputs=tuple(sorted(mutated_inputs)), written_later=tuple(sorted(written_later)))
    # NOTE: an input no output depends on (read only by values nobody used, DCE'd) is handed to
    # the region's autograd Function detached: connected, the engine would run its Node with no
    # gradient where eager's graph never reaches it (its hooks called with None: fuzz seed 155)
    region.unread_inputs = tuple(i for i, read in enumerate(_placeholders_read(pristine))
                                 if not read and i not in mutated_inputs)
    if parts.backward is not None and not mutated_inputs:
        region.output_groups = _output_groups(parts.forward, parts.num_user_outputs, differentiable)
    donors = {slot for step in forward_program.steps for _, slot in getattr(step, "reuse", ())}
    region.donated_inputs = tuple(sorted(slot for slot in donors if slot < forward_program.num_inputs))
    if parts.backward is not None:
        region.grad_sources = parts.grad_sources
        region.backward_for = _partial_backward_builder(pristine, mutated_inputs, parts, written_later, memory,
                                                        outputs_written_later, shape_generic, copied_inputs)
        kept = list(output.args[0])
        region.eager_saved = tuple((kept.index(node), name, output_nr, parts.output_sources[kept.index(node)])
                                   for node, (name, output_nr) in eager_saved.items() if node in kept)
        # (saved inputs are the graph's placeholders by position; saved outputs the forward's,
        # whose first are the graph's outputs in order, as ``eager_saved``'s positions)
        region.eager_names = {k: eager_names[kind, i] for k, (kind, i) in enumerate(parts.saved)
                              if (kind, i) in eager_names}
    if parts.joint is not None:
        region.build_double_backward = _double_backward_builder(parts.joint, memory, shape_generic)
        region.double_backward_reads = _placeholders_read(parts.joint)
        region.explain_nan = _nan_explainer(parts.backward)
    details = {
        "forward_graph": parts.forward,
        "backward_graph": parts.backward,
        "forward_kernels": forward_kernels,
        "backward_kernels": backward_kernels,
    }
    return region, details


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
    are called on every backward); a build happens under one."""
    cache: dict = {}
    lock = threading.Lock()

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


def _double_backward_builder(joint: fx.Graph, memory="balanced", shape_generic=False):
    """For create_graph=True: the backward as a compiled, differentiable region of its own,
    built per pattern of which of its inputs require grad (the same machinery, one order up)."""
    def build(requires_grad: tuple):
        graph = _copy_graph(joint)
        propagate_requires_grad(graph, requires_grad)
        output = next(n for n in graph.nodes if n.op == "output")
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
        sub = partition(_copy_graph(forward), mutated_inputs, only_outputs=given_outputs,
                        written_later=written_later, memory=memory, saved_from=set(position),
                        outputs_written_later=outputs_written_later, copied_inputs=copied_inputs)
        if sub is None or sub.backward is None or any(name not in position for name in sub.saved_names):
            return None
        program, _ = lower(sub.backward, fuse(sub.backward, shape_generic), check_indices=False,
                           shape_generic=shape_generic)
        double = _double_backward_builder(sub.joint, memory, shape_generic) if sub.joint is not None else None
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
    outputs = next(n for n in forward.nodes if n.op == "output").args[0][:num_user_outputs]
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
    output = next(n for n in graph.nodes if n.op == "output")
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

    @stats.setter
    def stats(self, value):
        self.region.stats = value

    def __call__(self, inputs):
        results = iter(self.region(inputs))
        return [next(results) if p else None for p in self.present]


def _nan_explainer(backward: fx.Graph):
    """Under detect_anomaly: which forward op's derivative made the NaN (op by op, eagerly)."""
    def explain(inputs) -> str:
        node = first_nan(backward, inputs)
        if node is None:
            return "Function '_RegionFunctionBackward' returned nan values (compiled region backward)"
        op, source = meta_of(node).origin or (node.target.name, None)
        return (f"Function '{op}' (compiled region backward) returned nan values: the derivative of "
                f"{op} called at {source or '?'} turned finite values into NaN "
                f"(backward graph node {node.name}: {meta_of(node).expr or node.target.name})")
    return explain


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    return new


def _split_input_views(graph: fx.Graph):
    """Take outputs that are views of inputs (or inputs themselves) out of the graph.

    NOTE: a ``torch.autograd.Function`` that returns a view of its input makes that output
    a "view created inside a custom Function", which PyTorch refuses to modify in place; the
    runtime applies these views to the real inputs after the region runs instead, so they
    alias their base and take in-place ops exactly as eager views do.
    Returns [(output position, input position, (ViewStep, ...))].
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    kept, views = [], []
    for position, out in enumerate(output.args[0]):
        chain, node = [], out
        while getattr(node.target, "kind", None) == "view":
            chain.append(_view_step(node))
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
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    views, kept, bases = [], [], []
    remap = {}
    for position, out in enumerate(outs):
        chain, node = [], out
        while isinstance(node, fx.Node) and getattr(node.target, "kind", None) == "view":
            chain.append(_view_step(node))
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


def _view_step(node) -> ViewStep:
    """The runtime's step for a view node: its op (which applies itself) and its parameters."""
    return ViewStep(node.target, tuple(node.kwargs.items()))


def lower(graph: fx.Graph, schedule: Schedule, check_indices: bool = True, transient_inputs=(), shape_generic=False,
          donated_inputs=None):
    """Assign slots to buffers and turn the schedule's steps into runtime steps.
    ``transient_inputs``: positions of inputs the program holds the only reference to (saved
    intermediates handed over by the backward), whose memory is freed at their last use;
    ``donated_inputs``: input position -> the node that is its new value (an input changed in place:
    the kernel storing that value may store it into the input's memory, ``_input_donors``)."""
    slots: dict = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for p in placeholders:
        slots[p] = len(slots)

    def ref(node) -> ValueRef:
        views = []
        while node not in slots:
            views.append(_view_step(node))
            node = node.args[0]
        return ValueRef(slots[node], tuple(reversed(views)))

    steps, sources = [], []
    donors = {}  # id(KernelLaunch) -> its (store index, load slot) candidates (``_donors``)
    rendered = {id(item): render_kernel(item, schedule.buffers, shape_generic, check_indices)
                for kind, item in schedule.steps if kind == "kernel"}
    # Gathers a launched kernel computes check their indices there (``render_kernel``); the rest
    # (a gather no kernel with elements computes: an empty result) on the host, as the buffer
    # holding the indices is written.
    index_checks = _index_checks(graph) if check_indices else {}
    in_kernels = {g for src in rendered.values() if src.grid for g in src.checked_gathers}
    checks: dict = {}  # buffer -> range checks of its indices
    for gather, (base, entry) in index_checks.items():
        if gather not in in_kernels and entry not in checks.setdefault(base, []):
            checks[base].append(entry)

    def check(produced):
        for node in produced:
            for index, size, wrap, what in checks.pop(node, ()):
                steps.append(IndexCheck([ref(index)], size, wrap, what))
    check(placeholders)
    joint = _joint_externs(schedule)
    for kind, item in schedule.steps:
        if kind == "extern":
            if item in slots:
                continue  # made by the call of another extern (``_joint_externs``)
            if item in joint:
                fn, kwargs, made = joint[item]
                for node in made:
                    slots[node] = len(slots)
                steps.append(ExternCall(item.target.name, fn, [ref(a) for a in item.args], slots[made[0]], kwargs,
                                        also=tuple(slots[n] for n in made[1:])))
                check(made)
                continue
            slots[item] = len(slots)
            steps.append(ExternCall(item.target.name, item.target.torch_fn, [ref(a) for a in item.args], slots[item],
                                     dict(item.kwargs)))
            check([item])
            continue
        src = rendered[id(item)]
        # what a failed check in this kernel is explained with: the host check of each index it
        # gathers with (a buffer it loads), run only then, for eager's message with the bad index
        explain = []
        for gather in src.checked_gathers:
            base, entry = index_checks.get(gather, (None, None))
            if base in slots and entry not in explain:
                explain.append(entry)
        for node in src.stores:
            slots[node] = len(slots)
        steps.append(KernelLaunch(
            src.name, src.source, [slots[n] for n in src.loads],
            [(slots[n], meta_of(n).shape, meta_of(n).dtype) for n in src.stores],
            src.grid, _constant(src.source, "XBLOCK_DEFAULT"), _constant(src.source, "RBLOCK_DEFAULT"),
            src.bytes_moved, src.num_warps, wide_name=src.wide_name, wide_source=src.wide_source, sizes=src.sizes,
            torch_kernel=render_torch_kernel(src.name, src.loads, [slots[n] for n in src.loads], src.stores,
                                             [slots[n] for n in src.stores], schedule.buffers),
            index_checks=tuple(IndexCheck([ref(index)], size, wrap, what) for index, size, wrap, what in explain)
            if src.checked_gathers else None))
        # NOTE: a kernel that checks indices stores no input's new value in place: its programs before
        # the one meeting a bad index would have written the user's tensor, which eager's error leaves
        # as it was (the write-back after the region never runs then)
        donors[id(steps[-1])] = _donors(item, src, slots, len(placeholders)) + \
            (_input_donors(item, src, slots, placeholders, donated_inputs or {}) if not src.checked_gathers else [])
        sources.append(src)
        check(src.stores)
    outputs = [ref(o) if isinstance(o, fx.Node) else None
               for o in next(n for n in graph.nodes if n.op == "output").args[0]]
    nbytes = {slot: math.prod(meta_of(node).shape) * meta_of(node).dtype.itemsize for node, slot in slots.items()
              if slot >= len(placeholders) or slot in transient_inputs}
    kept = {o.slot for o in outputs if o is not None}
    program = Program(len(placeholders), len(slots), _memory_order(steps, nbytes, kept), outputs)
    program.frees = _liveness(program)
    for step, dead in zip(program.steps, program.frees):
        if isinstance(step, KernelLaunch):
            step.reuse = _donations(donors[id(step)], set(dead) - kept)
    return program, sources


def _donors(plan, src, slots, num_inputs: int) -> list:
    """(store index, load slot) pairs of an elementwise kernel: an output that may be written into
    the memory of a buffer the kernel reads, where that buffer dies at this kernel (``_donations``),
    made by this program (an input may be held elsewhere: a saved tensor under retain_graph).

    NOTE (memory): as Inductor's in-place buffers (``in_out_ptr``): safe where every element of the
    output is written by the program that read the same element of the input, after reading it:
    the kernel has no reduction, reads every buffer at the output's own index (pointwise ops of
    one shape and reshapes only: no broadcast, permute or slice anywhere), computes the output from it
    (so each load comes before the store that depends on it), and loads it nowhere after the
    store. The runtime checks that the tensor is contiguous (``runtime.program.reused_memory``).
    """
    if plan.reduce_dims or plan.columns or plan.online or plan.second_pass or plan.reads_rows or \
            not _elementwise_aligned(plan, src):
        return []
    pairs = []
    for j, out in enumerate(src.stores):
        m = meta_of(out)
        if kind_of(out) != "pointwise" or tuple(m.shape) != tuple(plan.shape) or m.dtype.is_complex:
            continue
        for k, buffer in enumerate(src.loads):
            b = meta_of(buffer)
            if slots[buffer] >= num_inputs and _fresh(buffer) and b.dtype == m.dtype \
                    and math.prod(b.shape) == math.prod(m.shape) and _reads_value(out, buffer) \
                    and _loaded_before_store(src, k, j):
                pairs.append((j, slots[buffer]))
    return pairs


def _input_donors(plan, src, slots, placeholders, donated: dict) -> list:
    """(store index, input slot) pairs: the new value of an input the region changes in place,
    stored into that input's memory, where the write-back into it would copy it there after the
    region (``runtime.replay``: a copy skipped when the memory is the input's already). The
    donation is made only where the input's old value dies at this kernel (``_donations``) and
    the kernel reads it, if at all, only to compute the new value, at the new value's own
    elements, through pointwise values of its shape: each element is read before the same
    program stores it (batch norm's running statistics in the statistics kernel's epilogue,
    ``num_batches_tracked + 1``). An input that needs a gradient is not donated (its write-back
    copy is its autograd history)."""
    pairs = []
    for position, new in donated.items():
        if new not in src.stores:
            continue
        old = placeholders[position]
        m_old, m_new = meta_of(old), meta_of(new)
        if m_old.requires_grad or m_new.dtype != m_old.dtype or m_new.dtype.is_complex \
                or tuple(m_new.shape) != tuple(m_old.shape):
            continue
        if any(root is not new and _reads_value(root, old) for root in plan.roots) \
                or not _reads_at_own_index(new, old, src):
            continue
        pairs.append((src.stores.index(new), slots[old]))
    return pairs


def _reads_at_own_index(new, old, src) -> bool:
    """Whether ``new`` reads ``old`` (a loaded buffer) only through pointwise values of its own
    shape, each element at its own index, or not at all."""
    if kind_of(new) != "pointwise":
        return not _reads_value(new, old)
    shape, stack, seen = tuple(meta_of(new).shape), [new], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is old:
            continue
        if n is not new and n in src.loads:
            continue  # another buffer: its own reads are another kernel's
        if kind_of(n) == "pointwise" and tuple(meta_of(n).shape) == shape:
            stack.extend(n.all_input_nodes)
        elif n is not new and _reads_value(n, old):
            return False
    return True


def _reads_value(node, buffer) -> bool:
    """Whether ``node`` (or a value it computes inline: pointwise ops, views, gathers...) reads ``buffer``."""
    return node is buffer or any(n is buffer for n in inlined_reads(node))


# externs whose result is a new tensor of its own (never a view of an argument)
_FRESH_EXTERNS = ("mm", "bmm", "addmm", "conv", "conv_backward")


def _fresh(buffer) -> bool:
    """Whether ``buffer``'s memory is its own: a kernel's output, or a matmul's or convolution's."""
    return kind_of(buffer) != "extern" or buffer.target.name in _FRESH_EXTERNS


def _donations(donors, dying: set) -> tuple:
    """Of ``donors`` (``_donors``), one buffer per output among those that die here (``dying``)."""
    pairs, taken = [], set()
    for j, slot in donors:
        if slot in dying and slot not in taken and j not in {k for k, _ in pairs}:
            pairs.append((j, slot))
            taken.add(slot)
    return tuple(pairs)


def _elementwise_aligned(plan, src) -> bool:
    """Whether the kernel reads every buffer at its own index: each value it computes is a
    pointwise op of the kernel's shape over values of that shape, or a reshape (which keeps a
    contiguous tensor's element order). (A view elsewhere, a permute of a computed value,
    reads the buffers below it at other indices: ``dz + dz.t()`` loads dz's inputs transposed.)"""
    for node in _computed(src):
        if kind_of(node) == "view":
            if node.target.name != "reshape":
                return False
            continue
        if kind_of(node) != "pointwise" or tuple(meta_of(node).shape) != tuple(plan.shape) or \
                any(tuple(meta_of(a).shape) != tuple(plan.shape) for a in node.all_input_nodes):
            return False
    return True


def _computed(src) -> set:
    """The values a kernel computes: from its stores down to the buffers it loads."""
    computed, stack = set(), list(src.stores)
    while stack:
        node = stack.pop()
        if node not in computed and (node in src.stores or node not in src.loads):
            computed.add(node)
            stack.extend(node.all_input_nodes)
    return computed


def _loaded_before_store(src, load: int, store: int) -> bool:
    """Whether, in the kernel's source (and its 64-bit twin), every load of input ``load`` comes
    before the store to output ``store``."""
    for source in (src.source, src.wide_source):
        if source is None:
            continue
        lines = source.splitlines()
        loads = [i for i, line in enumerate(lines) if re.search(rf"tl\.load\(in{load}_ptr\b", line)]
        stores = [i for i, line in enumerate(lines) if re.search(rf"tl\.store\(out{store}_ptr\b", line)]
        if not loads or not stores or max(loads) > min(stores):
            return False
    return True


def _joint_externs(schedule) -> dict:
    """Externs one PyTorch call computes together (an op's ``joint_call``: a convolution's input and
    weight gradients, one ``convolution_backward`` as eager's autograd calls it, not two): the first
    of each group in the schedule -> (fn, kwargs, the group's nodes in the order fn returns them)."""
    groups: dict = {}
    for kind, item in schedule.steps:
        key = getattr(item.target, "joint_key", None) if kind == "extern" else None
        key = key(item) if key is not None else None
        if key is not None:
            groups.setdefault((item.target, key), []).append(item)
    joint = {}
    for (op, _), nodes in groups.items():
        call = op.joint_call(nodes) if len(nodes) > 1 else None
        if call is not None:
            joint[nodes[0]] = call
    return joint


def _index_checks(graph: fx.Graph) -> dict:
    """For each gather whose indices eager checks: (the buffer holding its indices, or the value
    they are computed from inline; (index value, dim size, wrap, op name)). (Kernels clamp
    indices, so a bad one never reads outside memory; the check gives eager's error.)"""
    checks: dict = {}
    for node in graph.nodes:
        if getattr(node.target, "kind", None) != "gather":
            continue
        source, index = node.args
        if math.prod(meta_of(node).shape) == 0 and "index_select" not in (meta_of(node).torch_op or ""):
            continue  # eager checks no index for an empty result (x[idx] of a zero-size tensor)
        base = index
        while getattr(base.target, "kind", None) == "view":
            base = base.args[0]
        checks[node] = (base, (index, meta_of(source).shape[node.kwargs["dim"]], node.kwargs.get("wrap", False),
                               meta_of(node).torch_op or "indexing"))
    return checks


def _constant(source: str, name: str) -> int:
    for line in source.splitlines():
        if line.startswith(f"{name} = "):
            return int(line.split("=")[1])
    raise KeyError(name)


def _reads(step) -> list:
    return step.loads if isinstance(step, KernelLaunch) else [a.slot for a in step.args]


def _writes(step) -> list:
    if isinstance(step, KernelLaunch):
        return [slot for slot, _, _ in step.stores]
    return [step.out, *step.also] if isinstance(step, ExternCall) else []


def _memory_order(steps, nbytes, kept) -> list:
    """The steps in an order that keeps less memory allocated at once: greedily, of the steps
    whose inputs are ready, the one that allocates least net of what it frees (the buffers it
    is the last reader of; ``kept``: slots never freed, the program's outputs); ties keep the
    schedule's order.

    NOTE (memory): the fusion's order is a valid one, not a frugal one: a bias gradient's sum
    run last keeps the output gradient alive across both weight-gradient matmuls; a matmul
    that frees two buffers waits behind one that frees one. Slots are written once, so a
    step depends only on the steps that write what it reads.
    """
    writer = {slot: i for i, step in enumerate(steps) for slot in _writes(step)}
    readers: dict = {}
    for i, step in enumerate(steps):
        for slot in set(_reads(step)):
            readers.setdefault(slot, set()).add(i)
    done: set = set()
    order = []
    while len(order) < len(steps):
        best, best_net = None, None
        for i, step in enumerate(steps):
            if i in done or any(writer.get(slot, -1) not in done and slot in writer for slot in _reads(step)):
                continue
            freed = sum(nbytes.get(slot, 0) for slot in set(_reads(step))
                        if slot not in kept and readers[slot] - done == {i})
            net = sum(nbytes.get(slot, 0) for slot in _writes(step)) - freed
            if best_net is None or net < best_net:
                best, best_net = i, net
        done.add(best)
        order.append(steps[best])
    return order


def _liveness(program: Program):
    """Per step, the slots no later step or output reads: freed as soon as possible."""
    keep = {o.slot for o in program.outputs if o is not None}
    last_use = {}
    for i, step in enumerate(program.steps):
        for slot in _reads(step):
            last_use[slot] = i
    frees = [[] for _ in program.steps]
    for slot, i in last_use.items():
        if slot not in keep:
            frees[i].append(slot)
    return frees
