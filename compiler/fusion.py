"""Fusion: decide which values live in memory and group the rest into kernels.

Every pointwise op and view is *inlined* into the kernels that consume it, with views
turned into index arithmetic, so a chain of elementwise ops with broadcasts, views and a
trailing reduction is one kernel. A value is materialized (a *buffer*) only where it must
be: graph inputs, matmul results, reductions, values the graph returns, and matmul
operands. Kernels are formed over an iteration space (a shape, plus the dims a reduction
runs over): consecutive roots that share it share one kernel, so a backward that produces
the gradients of several inputs of one shape is one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from compiler.ir import GraphBuilder, compute_dtype, numel
from compiler.ops import catalog as C


@dataclass
class KernelPlan:
    shape: tuple                 # the iteration space
    reduce_dims: tuple           # dims of ``shape`` reduced by the reduction roots
    roots: list = field(default_factory=list)   # nodes this kernel stores

    def accepts(self, shape, reduce_dims) -> bool:
        if shape != self.shape:
            return False
        return not reduce_dims or not self.reduce_dims or reduce_dims == self.reduce_dims

    def persistent_with(self, reduce_dims) -> bool:
        """Whether a row of the reduction fits one block, so values computed after the
        reduction (softmax's division, layer norm's scaling) can use it in the same kernel."""
        dims = self.reduce_dims or reduce_dims
        return bool(dims) and numel([self.shape[d] for d in dims]) <= PERSISTENT_MAX


@dataclass
class Schedule:
    """What runs, in order: ("kernel", KernelPlan) or ("extern", node) steps."""

    steps: list
    buffers: set                 # nodes whose value lives in memory
    host_views: set              # view nodes applied to buffers on the host (no copy)

    @property
    def kernels(self):
        return [plan for kind, plan in self.steps if kind == "kernel"]


# computed per element inside the kernels that read them
INLINE_KINDS = ("pointwise", "scatter", "iota", "rand", "gather")


def kind_of(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    return getattr(node.target, "kind", "other")


SPLIT_REDUCTION_MIN = 1 << 16   # a full reduction at least this large runs in two stages
PERSISTENT_MAX = 4096           # a reduced row up to this size is held in one block


def split_large_reductions(graph: fx.Graph) -> None:
    """A reduction of a large tensor to a single value becomes two: many programs reduce
    chunks in parallel, one reduces their partial results (one program alone would use one
    GPU core). The first stage fuses with the ops that feed it, as any reduction does."""
    for node in list(graph.nodes):
        if kind_of(node) != "reduction":
            continue
        x = node.args[0]
        shape, dims = x.meta["shape"], node.kwargs["dims"]
        rnumel = numel([shape[d] for d in dims])
        if rnumel < SPLIT_REDUCTION_MIN or numel(shape) != rnumel:
            continue
        split = next((s for s in (1024, 512, 256, 128) if rnumel % s == 0), None)
        if split is None:
            continue
        b = GraphBuilder(graph)
        with graph.inserting_before(node):
            flat = C.emit_view(b, "reshape", x, shape=(split, rnumel // split))
            partial = C.emit_reduction(b, "sum", flat, (1,), dtype=compute_dtype(node.meta["dtype"]))
            total = C.emit_reduction(b, node.target.name, partial, (0,), dtype=node.meta["dtype"])
            if node.target.name == "mean":
                total.kwargs = {**total.kwargs, "count": rnumel}
            total = C.emit_view(b, "reshape", total, shape=node.meta["shape"])
        node.replace_all_uses_with(total)
        graph.erase_node(node)


def fuse(graph: fx.Graph) -> Schedule:
    split_large_reductions(graph)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    outputs = [o for o in next(n for n in graph.nodes if n.op == "output").args[0] if isinstance(o, fx.Node)]
    buffers = {n for n in graph.nodes if kind_of(n) in ("input", "extern", "reduction")}
    host_views: set = set()

    def needs_memory(value: fx.Node):
        """``value`` must be readable as a tensor: a buffer, or views of one."""
        chain = []
        while kind_of(value) == "view":
            chain.append(value)
            value = value.args[0]
        if value not in buffers:
            buffers.add(value)  # a pointwise result: becomes a kernel root
        host_views.update(chain)

    for node in nodes:
        if kind_of(node) == "extern":
            for arg in node.args:
                needs_memory(arg)
        elif kind_of(node) == "gather":
            needs_memory(node.args[1])  # indices are range-checked on the host (eager's error)
        if node.meta.get("materialize"):  # read at many places by its consumers (see the op's vjp)
            needs_memory(node)
    for out in outputs:
        needs_memory(out)

    steps: list = []
    step_of: dict = {}            # buffer node -> index of the step that writes it
    reduction_roots_of: dict = {}
    for node in nodes:
        kind = kind_of(node)
        if kind == "extern":
            step_of[node] = len(steps)
            steps.append(("extern", node))
            continue
        if node not in buffers or kind not in ("pointwise", "scatter", "iota", "rand", "gather", "reduction"):
            continue
        if kind == "reduction":
            space = (node.args[0].meta["shape"], node.kwargs["dims"])
        else:  # pointwise or scatter: one element per position of its shape
            space = (node.meta["shape"], ())
        # The earliest kernel that can take this root: at or after the last step that
        # writes something it reads, same iteration space, not reading its reductions.
        barrier = max((step_of[b] for b in _reads(node, buffers) if b in step_of), default=0)
        target = None
        for i in range(barrier, len(steps)):
            kind_i, plan = steps[i]
            reductions = reduction_roots_of.get(id(plan), ())
            if kind_i == "kernel" and plan.accepts(*space) and (
                    not _depends_on(node, reductions, buffers) or
                    (plan.persistent_with(space[1]) and _row_aligned(node, reductions, plan))):
                target = i
                break
        if target is None:
            target = len(steps)
            steps.append(("kernel", KernelPlan(space[0], space[1], [])))
        plan = steps[target][1]
        plan.roots.append(node)
        plan.reduce_dims = plan.reduce_dims or space[1]
        step_of[node] = target
        if kind == "reduction":
            reduction_roots_of.setdefault(id(plan), []).append(node)
    return Schedule(steps, buffers, host_views)


def _inlined_reads(node: fx.Node):
    """Every value ``node`` reads, looking through the values its kernel computes inline
    (pointwise ops, scatters, views); buffers are yielded and their own inputs not followed,
    except pointwise buffers, which a kernel that stores them also computes."""
    stack, seen = list(node.args), set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        yield n
        if kind_of(n) in INLINE_KINDS or kind_of(n) == "view":
            stack.extend(n.args)


def _reads(node: fx.Node, buffers) -> set:
    """The buffers a root reads."""
    return {n for n in _inlined_reads(node) if n in buffers}


def _row_aligned(node: fx.Node, reductions, plan) -> bool:
    """Whether ``node``, read at the kernel's index, reads each of ``reductions`` at its own
    row: through pointwise ops and expands of values of the kernel's rank, or through a reshape
    of a reduction that puts size-1 dims back exactly where it reduced.

    NOTE: equal shapes are not enough: ``x / x.sum(1)`` for x of shape (4, 4, 3) broadcasts the
    (4, 3) sums as (1, 4, 3), reading the reduction of another row (the writer refuses that)."""
    reductions = set(reductions)
    rank, dims = len(plan.shape), plan.reduce_dims
    memo: dict = {}

    def aligned(n) -> bool:
        if not isinstance(n, fx.Node):
            return True
        if n in reductions:
            return len(n.meta["shape"]) == rank  # keepdim=True: its own row at the kernel's index
        if n not in memo:
            memo[n] = not _depends_on(n, reductions, ()) or _aligned_through(n)
        return memo[n]

    def _aligned_through(n) -> bool:
        kind = kind_of(n)
        if len(n.meta["shape"]) != rank or kind == "reduction":
            return False  # an implicit broadcast (lower rank) or another reduction's space
        if kind in INLINE_KINDS:
            return all(aligned(a) for a in n.args)
        if kind != "view":
            return False
        source = n.args[0]
        if n.target.name == "expand":
            return aligned(source)
        if n.target.name == "reshape" and source in reductions and not source.kwargs["keepdim"]:
            shape = n.meta["shape"]
            return all(shape[d] == 1 for d in dims) and \
                [s for d, s in enumerate(shape) if d not in dims] == list(source.meta["shape"])
        return n.target.name == "reshape" and n.meta["shape"] == source.meta["shape"] and aligned(source)

    return all(aligned(a) for a in node.args)


def _depends_on(node: fx.Node, targets, buffers) -> bool:
    """Whether ``node`` reads any of ``targets`` (reductions of a kernel it would join)."""
    targets = set(targets)
    return bool(targets) and any(n in targets for n in _inlined_reads(node))
