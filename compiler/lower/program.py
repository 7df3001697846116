"""From one fused schedule to a runtime ``Program``: value slots, kernel launches, matmul
calls, index checks, buffer reuse (donations) and the order that keeps memory low."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch.fx as fx

from compiler.codegen.cpp_kernel import render_cpp_kernel
from compiler.codegen.torch_kernel import render_torch_kernel
from compiler.codegen.triton_kernel import render_kernel
from compiler.fusion.fuse import Schedule, inlined_reads
from compiler.ir.graph import OpKind, has_meta, kind_of, meta_of, output_node
from compiler.ir.ops.primitives.base import NotPrintable
from runtime import backends
from runtime.cpp_kernels import CppKernel
from runtime.program import ExternCall, IndexCheck, KernelLaunch, Program, ValueRef, ViewStep

log = logging.getLogger("compiler")


def view_step(node) -> ViewStep:
    """The runtime's step for a view node: its op (which applies itself) and its parameters."""
    return ViewStep(node.target, tuple(node.kwargs.items()))


def lower(graph: fx.Graph, schedule: Schedule, check_indices: bool = True, transient_inputs=(), shape_generic=False,
          donated_inputs=None, outputs_handed_out=False):
    """Assign slots to buffers and turn the schedule's steps into runtime steps.
    ``transient_inputs``: positions of inputs the program holds the only reference to (saved
    intermediates handed over by the backward), whose memory is freed at their last use;
    ``donated_inputs``: input position -> the node that is its new value (an input changed in place:
    the kernel storing that value may store it into the input's memory, ``_input_donors``);
    ``outputs_handed_out``: each output leaves once made (DDP's segments, ``runtime.segments``): made early."""
    slots: dict = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for p in placeholders:
        slots[p] = len(slots)

    def ref(node) -> ValueRef:
        views = []
        while node not in slots:
            views.append(view_step(node))
            node = node.args[0]
        return ValueRef(slots[node], tuple(reversed(views)))

    steps, sources = [], []
    rendered = {id(item): render_kernel(item, schedule.buffers, shape_generic, check_indices)
                for kind, item in schedule.steps if kind == "kernel"}
    index_checks = _index_checks(graph) if check_indices else {}
    checks = _host_index_checks(index_checks, rendered)

    def check(produced):
        for node in produced:
            for index, size, wrap, what in checks.pop(node, ()):
                steps.append(IndexCheck([ref(index)], size, wrap, what))
    check(placeholders)
    backend = backends.chosen()
    joint = _joint_externs(schedule, backend)
    for kind, item in schedule.steps:
        if kind == "extern":
            if item in slots:
                continue  # made by the call of another extern (``_joint_externs``)
            if item in joint:
                fn, kwargs, made = joint[item]
                for node in made:
                    slots[node] = len(slots)
                steps.append(ExternCall(item.target.name, fn, [ref(a) for a in item.args], slots[made[0]], kwargs,
                                        also=tuple(slots[n] for n in made[1:]),
                                        kernels=item.target.kernels_launched(backend, made)))
                check(made)
                continue
            slots[item] = len(slots)
            steps.append(ExternCall(item.target.name, item.target.function_for(backend), [ref(a) for a in item.args],
                                    slots[item], dict(item.kwargs),
                                    kernels=item.target.kernels_launched(backend, [item])))
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
        # NOTE: a kernel that checks indices stores no input's new value in place: its programs before
        # the one meeting a bad index would have written the user's tensor, which eager's error leaves
        # as it was (the write-back after the region never runs then)
        donors = _donors(item, src, slots, len(placeholders)) + \
            (_input_donors(item, src, slots, placeholders, donated_inputs or {}) if not src.checked_gathers else [])
        steps.append(_PlannedLaunch(_launch_arguments(
            src, slots, schedule.buffers,
            tuple(IndexCheck([ref(index)], size, wrap, what) for index, size, wrap, what in explain)
            if src.checked_gathers else None, item if backend == "cpp" else None), donors))
        sources.append(src)
        check(src.stores)
    outputs = [ref(o) if isinstance(o, fx.Node) else None
               for o in output_node(graph).args[0]]
    nbytes = {slot: math.prod(meta_of(node).shape) * meta_of(node).dtype.itemsize for node, slot in slots.items()
              if slot >= len(placeholders) or slot in transient_inputs}
    input_metas = tuple((tuple(meta_of(p).shape), meta_of(p).dtype) if has_meta(p) else None for p in placeholders)
    return _program(steps, outputs, len(placeholders), len(slots), nbytes, _recorded_device(graph),
                    input_metas, outputs_handed_out), sources


def _recorded_device(graph: fx.Graph):
    """The device capture recorded the graph's values on (None where it says none: a derived graph)."""
    return next((meta_of(n).device for n in graph.nodes
                 if n.op in ("placeholder", "call_function") and meta_of(n).device is not None), None)


def _program(steps: list, outputs: list, num_inputs: int, num_slots: int, nbytes: dict, device=None,
             input_metas=(), outputs_handed_out=False) -> Program:
    """The program running ``steps`` in an order that keeps less memory allocated (``_memory_order``),
    freeing each buffer after its last reader, each launch writing outputs into the memory of
    buffers that die at it where it may (``_donations``)."""
    kept = {o.slot for o in outputs if o is not None}
    ordered = _memory_order(steps, nbytes, kept, outputs_handed_out)
    frees = _liveness(ordered, kept)
    steps = [step.launch(set(dead) - kept) if isinstance(step, _PlannedLaunch) else step
             for step, dead in zip(ordered, frees)]
    return Program(num_inputs, num_slots, steps, outputs, frees, recorded_device=device, input_metas=input_metas)


@dataclass(frozen=True)
class _PlannedLaunch:
    """A kernel launch before the program's order is known: its ``KernelLaunch`` arguments, and the
    buffers it may write an output into (``_donors``); which it does follows from the order (what
    dies at the launch: ``_donations``), and is the launch's ``reuse``."""
    arguments: dict
    donors: list

    @property
    def loads(self) -> list:
        return self.arguments["loads"]

    @property
    def stores(self) -> list:
        return self.arguments["stores"]

    def launch(self, dying: set) -> KernelLaunch:
        return KernelLaunch(**self.arguments, reuse=_donations(self.donors, dying))


def _host_index_checks(index_checks: dict, rendered: dict) -> dict:
    """Buffer -> the range checks of the indices it holds that run on the host, as the buffer is
    written. Gathers a launched kernel computes check their indices there (``render_kernel``);
    the rest (a gather no kernel with elements computes: an empty result) here."""
    in_kernels = {g for src in rendered.values() if src.grid for g in src.checked_gathers}
    checks: dict = {}
    for gather, (base, entry) in index_checks.items():
        if gather not in in_kernels and entry not in checks.setdefault(base, []):
            checks[base].append(entry)
    return checks


def _launch_arguments(src, slots: dict, buffers, index_checks, cpp_plan=None) -> dict:
    """The arguments of the runtime's launch of a rendered kernel (``KernelLaunch``), with its CPU
    path's rendering: the kernel in C++ where ``cpp_plan`` (backend="cpp") and it prints, else its
    PyTorch function."""
    loads, stores = [slots[n] for n in src.loads], [slots[n] for n in src.stores]
    store_slots = [(slots[n], meta_of(n).shape, meta_of(n).dtype) for n in src.stores]
    cpu_kernel = None
    if cpp_plan is not None:
        try:
            cpp = render_cpp_kernel(cpp_plan, buffers, src.loads, src.stores)
            cpu_kernel = CppKernel(cpp.name, cpp.source, tuple(loads), tuple(d for d, _ in cpp.loads),
                                   tuple(store_slots), cpp.vectorized, cpp.index_error)
        except NotPrintable as e:   # (this kernel on the torch path, the others of its program in C++)
            log.debug("compiler: kernel %s runs as PyTorch ops, not C++: %s", src.name, e)
            cpu_kernel = None
    if cpu_kernel is None:
        cpu_kernel = render_torch_kernel(src.name, src.loads, loads, src.stores, stores, buffers)
    return dict(
        name=src.name, source=src.source, loads=loads, stores=store_slots,
        grid=src.grid, xblock=src.xblock, rblock=src.rblock, bytes_moved=src.bytes_moved, num_warps=src.num_warps,
        wide_name=src.wide_name, wide_source=src.wide_source, sizes=src.sizes,
        torch_kernel=cpu_kernel,
        index_checks=index_checks,
        expected_loads=tuple((tuple(meta_of(n).shape), meta_of(n).dtype) for n in src.loads))


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
        if kind_of(out) != OpKind.POINTWISE or tuple(m.shape) != tuple(plan.shape) or m.dtype.is_complex:
            continue
        for k, buffer in enumerate(src.loads):
            b = meta_of(buffer)
            if slots[buffer] >= num_inputs and _fresh(buffer) and b.dtype == m.dtype \
                    and math.prod(b.shape) == math.prod(m.shape) and _reads_value(out, buffer) \
                    and src.loaded_before_store(k, j):
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
    if kind_of(new) != OpKind.POINTWISE:
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
        if kind_of(n) == OpKind.POINTWISE and tuple(meta_of(n).shape) == shape:
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
    return kind_of(buffer) != OpKind.EXTERN or buffer.target.name in _FRESH_EXTERNS


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
        if kind_of(node) == OpKind.VIEW:
            if node.target.name != "reshape":
                return False
            continue
        if kind_of(node) != OpKind.POINTWISE or tuple(meta_of(node).shape) != tuple(plan.shape) or \
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


def _joint_externs(schedule, backend: str) -> dict:
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
        call = op.joint_call(nodes, backend) if len(nodes) > 1 else None
        if call is not None:
            joint[nodes[0]] = call
    return joint


def _index_checks(graph: fx.Graph) -> dict:
    """For each gather whose indices eager checks: (the buffer holding its indices, or the value
    they are computed from inline; (index value, dim size, wrap, op name)). (Kernels clamp
    indices, so a bad one never reads outside memory; the check gives eager's error.)"""
    checks: dict = {}
    for node in graph.nodes:
        if kind_of(node) != OpKind.GATHER:
            continue
        source, index = node.args
        if math.prod(meta_of(node).shape) == 0 and "index_select" not in (meta_of(node).torch_op or ""):
            continue  # eager checks no index for an empty result (x[idx] of a zero-size tensor)
        base = index
        while kind_of(base) == OpKind.VIEW:
            base = base.args[0]
        checks[node] = (base, (index, meta_of(source).shape[node.kwargs["dim"]], node.kwargs.get("wrap", False),
                               meta_of(node).torch_op or "indexing"))
    return checks


def _reads(step) -> list:
    return step.loads if isinstance(step, _PlannedLaunch) else [a.slot for a in step.args]


def _writes(step) -> list:
    if isinstance(step, _PlannedLaunch):
        return [slot for slot, _, _ in step.stores]
    return [step.out, *step.also] if isinstance(step, ExternCall) else []


def _memory_order(steps, nbytes, kept, kept_free=False) -> list:
    """The steps in an order that keeps less memory allocated at once: greedily, of the steps
    whose inputs are ready, the one that allocates least net of what it frees (the buffers it
    is the last reader of; ``kept``: slots never freed, the program's outputs); ties keep the
    schedule's order.

    NOTE (memory): the fusion's order is a valid one, not a frugal one: a bias gradient's sum
    run last keeps the output gradient alive across both weight-gradient matmuls; a matmul
    that frees two buffers waits behind one that frees one. Slots are written once, so a
    step depends only on the steps that write what it reads. ``kept_free``: the outputs leave as
    they are made (their bytes count as none), and a step that makes one runs as soon as it can.
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
            net = sum(nbytes.get(slot, 0) for slot in _writes(step) if not (kept_free and slot in kept)) - freed
            if kept_free:   # (first what makes an output: the gradients leave as soon as they are made)
                net = (not any(slot in kept for slot in _writes(step)), net)
            if best_net is None or net < best_net:
                best, best_net = i, net
        done.add(best)
        order.append(steps[best])
    return order


def _liveness(steps: list, kept: set) -> list:
    """Per step, the slots no later step reads (nor are ``kept``: the program's outputs): freed as
    soon as possible."""
    last_use = {}
    for i, step in enumerate(steps):
        for slot in _reads(step):
            last_use[slot] = i
    frees = [[] for _ in steps]
    for slot, i in last_use.items():
        if slot not in kept:
            frees[i].append(slot)
    return frees
