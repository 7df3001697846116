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

import sympy
import torch
import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind, compute_dtype, kind_of, meta_of, numel, output_node, update_meta
from compiler.ir.ops import catalog as C
from compiler.ir.ops import symbols as Y
from compiler.ir.ops.pointwise import emit_pointwise
from compiler.fusion.tiling import (MIN_PROGRAMS, fits_one_block, holds_row, is_outer, reduction_programs,
                                    rereads_row_from_l2)


@dataclass
class KernelPlan:
    shape: tuple                 # the iteration space
    reduce_dims: tuple           # dims of ``shape`` reduced by the reduction roots
    roots: list = field(default_factory=list)   # nodes this kernel computes: stored, but reductions only it reads
    online: dict = field(default_factory=dict)  # sum root -> the amax root it is computed with (online softmax)
    reads_rows: bool = False     # a root reads a reduction of this kernel: rows are held whole (persistent)
    second_pass: list = field(default_factory=list)  # roots that read a looped row's reductions: a second loop
    # column partial sums computed beside the rows (``_column_partial``): root -> (value of ``shape``,
    # chunks); each of the kernel's programs loops over one chunk of rows and writes its partial sums
    columns: dict = field(default_factory=dict)
    # pointwise roots over the reductions' own space (a row's value: layer norm's rstd, a loss's
    # mean as sum / count), computed from the rows' reductions once they are known and stored at
    # the row (``takes_epilogue``)
    epilogue: list = field(default_factory=list)

    def add_root(self, node: fx.Node, join, space: tuple, column) -> None:
        """Take ``node`` as a root, as the join rule's answer ``join`` says; ``space``: the root's
        (shape, reduce dims), ``column``: its column-sum value and chunks, if it is one."""
        if join.space is not None:
            self.shape, self.reduce_dims = join.space
        self.roots.append(node)
        if join.epilogue:  # (the kernel's iteration space stays the rows')
            self.epilogue.append(node)
            return
        if join.partner is not None:
            self.online[node] = join.partner
        if join.second:
            self.second_pass.append(node)
        if column is not None and self.shape != space[0]:  # a column sum joined a rows' kernel
            self.columns[node] = column
            self.reads_rows = True
            return
        self.reads_rows = self.reads_rows or join.reads_row
        self.reduce_dims = self.reduce_dims or space[1]

    def accepts(self, shape, reduce_dims) -> bool:
        if shape != self.shape:
            return False
        return not reduce_dims or not self.reduce_dims or reduce_dims == self.reduce_dims

    def persistent_with(self, reduce_dims, node: fx.Node, buffers) -> bool:
        """Whether a row of the reduction is held in one block with ``node`` among the roots, so
        values computed after the reduction (softmax's division, layer norm's scaling) can use
        it in the same kernel (``tiling.holds_row``: the row values held are the buffers the
        roots read in whole rows)."""
        dims = self.reduce_dims or reduce_dims
        if not dims or fits_one_block(self.shape, dims):
            return bool(dims)
        rows = {b for root in self.roots + [node] for b in _reads(root, buffers)
                if tuple(meta_of(b).shape) == tuple(self.shape)}
        wide = any(meta_of(n).dtype.itemsize >= 8 for n in rows | set(self.roots) | {node})
        return holds_row(self.shape, dims, row_values=len(rows), wide_values=wide)

    def takes_column(self, node: fx.Node, value: fx.Node, chunks: int, buffers) -> bool:
        """Whether this kernel, over rows of ``value``'s shape held whole, can also compute ``node``,
        a chunk's column sums of ``value``, in each program (``split_column_sum``)."""
        if tuple(self.shape) != tuple(meta_of(value).shape) or tuple(self.reduce_dims) != (len(self.shape) - 1,):
            return False
        if meta_of(node).dtype.is_complex:
            return False
        if self.online or self.second_pass or any(c != chunks for _, c in self.columns.values()):
            return False
        return self.persistent_with(self.reduce_dims, node, buffers)

    def loops_over_chunks(self, value: fx.Node, chunks: int) -> bool:
        """Whether this elementwise kernel over ``value``'s shape (..., N) can run as the kernel of the
        column sums of chunks of ``value``'s rows: a loop over each chunk's rows for a tile of
        columns, storing its elements at each (the complex gate's backward: the input's gradient and
        the gain's and bias's column sums of values computed from it, in one pass)."""
        shape = tuple(meta_of(value).shape)
        if self.reduce_dims or tuple(self.shape) != shape or self.columns:
            return False
        return all(kind_of(r) in (OpKind.POINTWISE, OpKind.SCATTER) and tuple(meta_of(r).shape) == shape
                   for r in self.roots)

    def takes_epilogue(self, node: fx.Node, reductions, buffers) -> bool:
        """Whether ``node``, a pointwise value with one element per row of this kernel's reductions,
        computed from them (and from values of other kernels), can be computed here once the rows
        are reduced and stored at its row: a kernel fewer than a kernel of its own over the
        reductions' space (Inductor computes such values in the reduction's kernel too: layer
        norm's rstd, a loss's sum / count, batch norm's running statistics). Its shape is the
        reductions' space (keepdim: size 1 at the reduced dims; or without them), and every value
        it reads that depends on this kernel's reductions is in that space too: pointwise values,
        reshapes between the two forms, the reductions themselves."""
        dims = self.reduce_dims
        kept = tuple(1 if d in dims else n for d, n in enumerate(self.shape))
        squeezed = tuple(n for d, n in enumerate(self.shape) if d not in dims)
        space = (kept, squeezed)
        shape = tuple(meta_of(node).shape)
        if not dims or self.columns or shape == tuple(self.shape) or shape not in space:
            return False
        reductions = set(reductions)
        if not reductions or meta_of(node).dtype.is_complex:
            return False
        found, stack, seen = False, [node], set()
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            m = meta_of(n)
            if n in reductions or (n is not node and n in self.epilogue):
                if tuple(m.shape) not in space or m.dtype.is_complex:
                    return False
                found = True
                continue  # (an epilogue value computed before this one: its reads were checked)
            if n is not node and n in buffers and n not in self.roots:
                continue  # another kernel's value: loaded at the row
            if n is not node and n in self.roots:
                return False  # a value of the rows' elements
            depends = _depends_on(n, reductions, ())
            if not depends:
                continue  # (read as any kernel reads other kernels' values)
            if tuple(m.shape) not in space or m.dtype.is_complex:
                return False
            if kind_of(n) == OpKind.VIEW and \
                    not (n.target.name == "reshape" and tuple(meta_of(n.args[0]).shape) in space):
                return False
            if kind_of(n) not in (OpKind.POINTWISE, OpKind.VIEW):
                return False
            stack.extend(n.args)
        return found

    def second_pass_with(self, node: fx.Node, reductions, buffers) -> bool:
        """Whether ``node``, a pointwise value reading this looped kernel's reductions at its own
        row, can be computed in a second loop over the row after the reductions' loop (as eager's
        softmax backward does: ``tiling.rereads_row_from_l2``), instead of a kernel of its own that
        reads the row from memory again. Real reductions of an inner row only."""
        if kind_of(node) == OpKind.REDUCTION or self.reads_rows or is_outer(self.shape, self.reduce_dims):
            return False
        if any(meta_of(n).dtype.is_complex for n in list(reductions) + [node]):
            return False
        if not _row_aligned(node, reductions, self):
            return False
        rows = {b for root in self.second_pass + [node] for b in _reads(root, buffers)
                if tuple(meta_of(b).shape) == tuple(self.shape)}
        return rereads_row_from_l2(self.shape, self.reduce_dims, [meta_of(b).dtype.itemsize for b in rows])


@dataclass
class Schedule:
    """What runs, in order: ("kernel", KernelPlan) or ("extern", node) steps."""

    steps: list
    buffers: set                 # nodes whose value lives in memory

    @property
    def kernels(self):
        return [plan for kind, plan in self.steps if kind == "kernel"]


# computed per element inside the kernels that read them
INLINE_KINDS = (OpKind.POINTWISE, OpKind.SCATTER, OpKind.IOTA, OpKind.RAND, OpKind.GATHER)


SPLIT_MIN_CHUNK = 256   # a split reduction's programs each reduce at least this many elements
# An inner reduction (over the trailing, contiguous dims) of at most this many elements per result is
# not split, however few programs it runs as: one looped program reads it faster than a second launch
# costs. Inductor's threshold for sm_90 (torch/_inductor/choices.py ``reduction_split_factor``:
# ``no_split_threshold``); e.g. a loss's mean over a (64, 128) batch is one kernel, not two.
NO_SPLIT_NUMEL = 8192


def split_starved_reductions(graph: fx.Graph) -> None:
    """A reduction that would run as fewer programs than the GPU has SMs to fill (a full
    reduction, a few long rows, the column sums of a tall tensor) becomes two: the first
    splits one reduced dim into chunks and reduces each chunk in its own program, the
    second reduces the partial results (deterministic, no atomics). The first stage fuses
    with the ops that feed it, as any reduction does. A row that fits one block is left
    whole, so the ops after it stay in its kernel (layer norm, softmax)."""
    for node in list(graph.nodes):
        if kind_of(node) != OpKind.REDUCTION:
            continue
        x = node.args[0]
        shape, dims = tuple(meta_of(x).shape), tuple(node.kwargs["dims"])
        if not dims or fits_one_block(shape, dims):
            continue
        if reduction_programs(shape, dims) >= MIN_PROGRAMS:
            continue
        inner = dims == tuple(range(len(shape) - len(dims), len(shape)))
        if inner and numel([shape[d] for d in dims]) <= NO_SPLIT_NUMEL:
            continue
        chunks = _row_kernel_chunks(graph, x, dims)
        if chunks:   # as many chunks as the rows' kernel has programs: it computes the partial sums
            split_column_sum(graph, node, chunks)
            continue
        if len(dims) > 1 and dims == tuple(range(dims[0], dims[-1] + 1)):  # adjacent: split them as one
            shape = shape[:dims[0]] + (numel([shape[d] for d in dims]),) + shape[dims[-1] + 1:]
            dims = (dims[0],)
        d = max(dims, key=lambda k: shape[k])
        first_dims = tuple(k + 1 if k >= d else k for k in dims)   # d + 1: the chunk dim

        def split_shape(k, shape=shape, d=d):
            return shape[:d] + (k, shape[d] // k) + shape[d + 1:]
        split = _split_count(shape[d], numel([shape[k] for k in dims]) // shape[d],
                             lambda k: reduction_programs(split_shape(k), first_dims))
        if split is None:
            continue
        b = GraphBuilder(graph)
        with graph.inserting_before(node):
            x = C.emit_view(b, "reshape", x, shape=split_shape(split))   # row-major: merges, then splits
            stage_one = "amax" if node.target.name == "amax" else "sum"
            partial = C.emit_reduction(b, stage_one, x, first_dims, dtype=compute_dtype(meta_of(node).dtype))
            at = sum(1 for k in range(d) if k not in dims)             # the split dim among kept dims
            total = C.emit_reduction(b, node.target.name, partial, (at,), dtype=meta_of(node).dtype)
            if node.target.name == "mean":
                count = node.kwargs.get("count") or numel([meta_of(node.args[0]).shape[k] for k in node.kwargs["dims"]])
                total.kwargs = {**total.kwargs, "count": count}
            total = C.emit_view(b, "reshape", total, shape=meta_of(node).shape)
        node.replace_all_uses_with(total)
        graph.erase_node(node)


# NOTE (launches): a value only the graph's outputs read, made from small values alone (the second
# stage of a bias's or a norm weight's gradient: a sum of partial sums), is made at the end of the
# graph. Where it sits does not matter to memory (its inputs are small), but those of one space then
# meet and share a kernel: a backward copied in the forward's reverse order makes each layer's
# beside that layer's rows, and GPT-2's took 100 launches instead of 4.
SMALL_TAIL_BYTES = 4 << 20


def make_small_tails_last(graph: fx.Graph) -> None:
    """Move the values only outputs read, made from values of ``SMALL_TAIL_BYTES`` or less, to just
    before the output (keeping their order)."""
    out = output_node(graph)
    tails: dict = {}   # (ordered)
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or kind_of(node) == OpKind.EXTERN or _bytes(node) > SMALL_TAIL_BYTES:
            continue
        if not node.users or not all(u is out or u in tails for u in node.users):
            continue
        if all(_bytes(a) <= SMALL_TAIL_BYTES for a in node.all_input_nodes):
            tails[node] = None
    for node in reversed(list(tails)):
        out.prepend(node)


COLUMN_CHUNK_MIN_ROWS = 16   # a column sum shares its rows' kernel when each program gets this many rows


def _row_kernel_chunks(graph: fx.Graph, x: fx.Node, dims) -> int | None:
    """How many chunks of rows to split ``x.sum(0)`` (of a (B, T, N) ``x``: ``x.sum((0, 1))``, its B*T
    rows) into so that the kernel that reduces the rows of
    ``x``'s shape (a norm's backward: its row sums and input gradient) computes the column sums too,
    one chunk a program, instead of a kernel of its own reading the rows again (dgamma, dbeta); None
    when no such kernel is expected: ``x`` (M, N) computed inline or an input, rows that
    fit one block, a row reduction over that shape in the graph, and at least MIN_PROGRAMS chunks of
    COLUMN_CHUNK_MIN_ROWS rows. The partial sums ([chunks, N] in fp32) are then summed by a small
    second kernel, as Apex's and Triton's tutorial layer-norm backwards do (each program accumulates
    its rows' dgamma into a buffer, reduced by a second kernel)."""
    shape = tuple(meta_of(x).shape)
    last = len(shape) - 1
    if last < 1 or tuple(dims) != tuple(range(last)) or kind_of(x) not in (*INLINE_KINDS, OpKind.INPUT) or \
            meta_of(x).dtype.is_complex:
        return None
    if not fits_one_block(shape, (last,)):
        return None
    if not any(kind_of(n) == OpKind.REDUCTION and tuple(n.kwargs["dims"]) == (last,) and
               tuple(meta_of(n.args[0]).shape) == shape for n in graph.nodes):
        return None
    rows = numel(shape[:-1])
    return next((k for k in range(MIN_PROGRAMS, rows // COLUMN_CHUNK_MIN_ROWS + 1) if rows % k == 0), None)


def split_column_sum(graph: fx.Graph, node: fx.Node, chunks: int) -> None:
    """``node`` (a sum over all dims but the last of an (M, N) or (..., N) value) as the sum of ``chunks``
    partial column sums."""
    x = node.args[0]
    shape = meta_of(x).shape
    rows, cols = numel(shape[:-1]), shape[-1]
    b = GraphBuilder(graph)
    with graph.inserting_before(node):
        chunked = C.emit_view(b, "reshape", x, shape=(chunks, rows // chunks, cols))
        partial = C.emit_reduction(b, "sum", chunked, (1,), dtype=compute_dtype(meta_of(node).dtype))
        total = C.emit_reduction(b, node.target.name, partial, (0,), dtype=meta_of(node).dtype)
        if node.target.name == "mean":
            total.kwargs = {**total.kwargs, "count": node.kwargs.get("count") or rows}
        total = C.emit_view(b, "reshape", total, shape=meta_of(node).shape)
    node.replace_all_uses_with(total)
    graph.erase_node(node)


def column_sums_after_their_rows(graph: fx.Graph) -> None:
    """Move each chunk's column sums (``_column_partial``), with what reads them, to just after the
    next root of the kernel that can compute them, where one comes before the next extern: a row
    reduction over their rows' shape (``takes_column``), or a value of that shape the graph returns
    (``loops_over_chunks``).

    NOTE (launches): fusion gives a root to the first kernel at or after what it reads. A backward
    copied in the forward's reverse order emits a norm's weight and bias gradients before the row
    sums of its input's gradient, and a gate's gain and bias gradients before its input's: the
    partial sums found no kernel of their rows yet and took one of their own (GPT-2: 24 launches
    reading each layer's gradient again). Past an extern they stay: it would hold their rows."""
    out = output_node(graph)
    for node in list(graph.nodes):
        column = _column_partial(node)
        if column is not None:
            _after(graph, [node.args[0], node], _rows_kernel_root(node, column[0], out))


def _rows_kernel_root(partial: fx.Node, value: fx.Node, out: fx.Node):
    shape, last = tuple(meta_of(value).shape), len(meta_of(value).shape) - 1
    node = partial.next
    while node is not out and kind_of(node) != OpKind.EXTERN:
        if kind_of(node) == OpKind.REDUCTION and tuple(node.kwargs["dims"]) == (last,) and \
                tuple(meta_of(node.args[0]).shape) == shape:
            return node
        if kind_of(node) == OpKind.POINTWISE and tuple(meta_of(node).shape) == shape and out in node.users:
            return node
        node = node.next
    return None


def _after(graph: fx.Graph, made: list, anchor) -> None:
    """Move ``made``, with what reads them before ``anchor``, to just after it (unless ``anchor``
    reads them)."""
    if anchor is None:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved, stack = set(made), list(made)
    while stack:
        for user in stack.pop().users:
            if user is anchor:
                return
            if user not in moved and order[user] < order[anchor]:
                moved.add(user)
                stack.append(user)
    at = anchor
    for n in sorted(moved, key=order.__getitem__):
        at.append(n)
        at = n


def _column_partial(node: fx.Node):
    """(value, chunks) when ``node`` is a chunk's column sums made by ``split_column_sum``: a sum over
    dim 1 of an (M, N) value (or (..., N), M rows in all) reshaped to (chunks, M / chunks, N)."""
    if kind_of(node) != OpKind.REDUCTION or node.target.name != "sum" or tuple(node.kwargs["dims"]) != (1,):
        return None
    view = node.args[0]
    if node.kwargs["keepdim"] or kind_of(view) != OpKind.VIEW or view.target.name != "reshape":
        return None
    value = view.args[0]
    shape, chunked = tuple(meta_of(value).shape), tuple(meta_of(view).shape)
    if len(shape) < 2 or len(chunked) != 3:
        return None
    chunks, rows, cols = chunked
    if (numel(shape[:-1]), shape[-1]) != (chunks * rows, cols):
        return None
    return value, chunks


def _split_count(size: int, other: int, programs):
    """How many chunks to cut a reduced dim of ``size`` into (``other`` reduced elements go
    with each of its indices): the fewest that give ``programs(count)`` enough programs while
    chunks keep ``SPLIT_MIN_CHUNK`` elements, else as many as that allows; a divisor of
    ``size``. None when no split helps."""
    most = min(size, (size * other) // SPLIT_MIN_CHUNK)
    divisors = [k for k in range(2, most + 1) if size % k == 0]
    if not divisors:
        return None
    return next((k for k in divisors if programs(k) >= MIN_PROGRAMS), divisors[-1])


def copy_operands_in_kernels(graph: fx.Graph) -> None:
    """A matmul's (any extern's) operand or a graph output that PyTorch can only make from its
    buffer with a copy (attention's q, k and v: slices of the qkv projection's output, split into
    heads and transposed, then flattened to a batch of matrices; its output, transposed back and
    flattened) is copied by a kernel: a pointwise copy of the view chain's value at the point from
    which the rest of the chain is views of that copy, a root fused with the other values of its
    shape (q, k and v in one kernel), instead of a host ``reshape`` copying each alone (eager's
    and our host views made ``aten::clone``s: 10 in the transformer step, where Inductor's
    kernels write those layouts)."""
    b = GraphBuilder(graph)
    output = output_node(graph)
    for node in list(graph.nodes):
        if kind_of(node) == OpKind.EXTERN:
            operands = list(node.args)
        elif node is output:
            operands = list(output.args[0])
        else:
            continue
        for arg in operands:
            if not isinstance(arg, fx.Node) or kind_of(arg) != OpKind.VIEW:
                continue
            chain = []  # the views from the buffer to the operand, the buffer's side first
            value = arg
            while kind_of(value) == OpKind.VIEW:
                chain.append(value)
                value = value.args[0]
            chain.reverse()
            if not all(type(d) is int for n in [value] + chain for d in meta_of(n).shape) \
                    or _views_without_copy(value, chain):
                continue
            # where to copy: the point of the chain from which the views left are views of the copy,
            # the smallest such value (a slice is copied, not what it is sliced from), the first of equals
            points = [i for i in range(1, len(chain) + 1) if _views_without_copy(chain[i - 1], chain[i:])]
            i = min(points, key=lambda k: (numel(meta_of(chain[k - 1]).shape), k))
            source = chain[i - 1]
            with graph.inserting_after(source):
                copy = emit_pointwise(b, "identity", [source], dtype=meta_of(source).dtype,
                                      requires_grad=meta_of(source).requires_grad)
            if i < len(chain):
                chain[i].args = (copy,) + tuple(chain[i].args[1:])
            elif node is output:  # the output itself
                output.args = (tuple(copy if a is arg else a for a in output.args[0]),) + tuple(output.args[1:])
            else:
                node.args = tuple(copy if a is arg else a for a in node.args)


def _views_without_copy(source: fx.Node, views: list) -> bool:
    """Whether ``views`` (view nodes, applied in order) make a view of a contiguous tensor of
    ``source``'s shape without a copy (PyTorch's own view functions on a meta tensor)."""
    m = meta_of(source)
    base = torch.empty(tuple(m.shape), dtype=m.dtype, device="meta")
    value = base
    try:
        for view in views:
            value = view.target.apply(value, **view.kwargs)
    except (NotImplementedError, RuntimeError):  # (a view that cannot run on a meta tensor: say "copies")
        return not views
    return value is base or (value._is_view() and value._base is base)


def column_sums_over_their_source(graph: fx.Graph) -> None:
    """``x.reshape(B * T, N).sum(0)`` becomes ``x.sum((0, 1))`` reshaped: a linear layer's bias
    gradient is the column sum of its output's gradient flattened to the matmul's rows, while the
    kernel that computes that gradient (a GELU's backward, a residual's sum) runs over the
    activation's own (B, T, N). Over the source's shape the sum joins that kernel (it reads the
    gradient where it is computed), as Inductor fuses a reduction with its pointwise producer;
    over the flattened one it was a kernel of its own. Only a sum or mean over the first dim of
    a reshape that merges leading dims and keeps the others, of a value no row reduction reads."""
    b = GraphBuilder(graph)
    for node in list(graph.nodes):
        if kind_of(node) != OpKind.REDUCTION or node.target.name not in ("sum", "mean") \
                or tuple(node.kwargs["dims"]) != (0,) or set(node.kwargs) - {"dims", "keepdim", "count"}:
            continue
        view = node.args[0]
        if kind_of(view) != OpKind.VIEW or view.target.name != "reshape":
            continue
        source = view.args[0]
        flat, shape = tuple(meta_of(view).shape), tuple(meta_of(source).shape)
        merged = len(shape) - len(flat) + 1   # the source's leading dims that make the first
        if merged < 2 or shape[merged:] != flat[1:] or numel(shape[:merged]) != flat[0]:
            continue
        if _row_kernel_chunks(graph, source, tuple(range(merged))) is not None:
            # NOTE: rows of that shape are reduced by a kernel (a layer norm's backward), which would
            # take this sum beside its rows (``split_column_sum``) with its own two: a third column
            # accumulator spilled on sm_90 (4 bytes at 80 registers, rows of 128 at 8 warps:
            # tests/test_hopper_compile.py). Left as it was: a kernel of its own. (Rows too few to
            # split among that kernel's programs: the sum joins the column sums over the same
            # rows instead, the norms' weight gradients: a kernel fewer.)
            continue
        with graph.inserting_before(node):
            total = C.emit_reduction(b, node.target.name, source, tuple(range(merged)),
                                     keepdim=node.kwargs["keepdim"], dtype=meta_of(node).dtype)
            if "count" in node.kwargs:
                total.kwargs = {**total.kwargs, "count": node.kwargs["count"]}
            if tuple(meta_of(total).shape) != tuple(meta_of(node).shape):
                total = C.emit_view(b, "reshape", total, shape=meta_of(node).shape)
        node.replace_all_uses_with(total)
        graph.erase_node(node)


def fuse(graph: fx.Graph, shape_generic: bool = False) -> Schedule:
    """Kernels of ``graph``. ``shape_generic``: reductions are not split (a split's chunk count and
    its chunks' shapes follow the sizes: each size would make new kernels; ``render_kernel``)."""
    copy_operands_in_kernels(graph)
    column_sums_over_their_source(graph)
    if not shape_generic:
        split_starved_reductions(graph)
    column_sums_after_their_rows(graph)
    make_small_tails_last(graph)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    outputs = [o for o in output_node(graph).args[0] if isinstance(o, fx.Node)]
    buffers = {n for n in graph.nodes if kind_of(n) in (OpKind.INPUT, OpKind.EXTERN, OpKind.REDUCTION)}

    def needs_memory(value: fx.Node):
        """``value`` must be readable as a tensor: a buffer, or views of one (applied to it on
        the host by the runtime)."""
        while kind_of(value) == OpKind.VIEW:
            value = value.args[0]
        if value not in buffers:
            buffers.add(value)  # a pointwise result: becomes a kernel root

    for node in nodes:
        if kind_of(node) == OpKind.EXTERN:
            for arg in node.args:
                needs_memory(arg)
        elif kind_of(node) == OpKind.GATHER and numel(meta_of(node).shape) == 0:
            # (the kernels that gather check their indices; a gather with no elements has no kernel
            # to, and eager still checks index_select's: on the host, as its indices' buffer is written)
            needs_memory(node.args[1])
        if meta_of(node).materialize:  # read at many places by its consumers (see the op's vjp)
            needs_memory(node)
    for out in outputs:
        needs_memory(out)
    for node in _recomputed_too_widely(nodes, buffers):
        needs_memory(node)

    steps: list = []
    step_of: dict = {}            # buffer node -> index of the step that writes it
    reduction_roots_of: dict = {}
    externs = []   # their steps
    for node in nodes:
        kind = kind_of(node)
        if kind == OpKind.EXTERN:
            step_of[node] = len(steps)
            externs.append(len(steps))
            steps.append(("extern", node))
            continue
        if node not in buffers or kind not in (*INLINE_KINDS, OpKind.REDUCTION):
            continue
        root = _Root(node, kind, buffers, reduction_roots_of)
        # The earliest kernel that can take this root: at or after the last step that
        # writes something it reads, same iteration space, not reading its reductions.
        # (after the kernel that writes a value marked ``materialize``: read from memory, never
        # computed again where it is read, at other positions, by a root beside it)
        barrier = max((step_of[b] + bool(meta_of(b).materialize) for b in _reads(node, buffers) if b in step_of),
                      default=0)
        if len(externs) > HOIST_PAST_EXTERNS and _bytes(node) >= HOIST_MIN_BYTES and _matmul_operand(node):
            barrier = max(barrier, externs[-HOIST_PAST_EXTERNS - 1] + 1)
        target, join = _first_join(root, steps, barrier)
        if target is None and not shape_generic and node not in outputs:
            found = _copies_kernel(node, steps, barrier)
            if found is not None:   # made by that kernel, in its shape (then read through a reshape)
                node = _stored_in_shape(graph, node, steps[found][1].shape, buffers)
                target, join = found, _Join()
        if target is None:
            target, join = len(steps), _Join()
            steps.append(("kernel", KernelPlan(root.space[0], root.space[1], [])))
        plan = steps[target][1]
        plan.add_root(node, join, root.space, root.column)
        step_of[node] = target
        if kind == OpKind.REDUCTION and not join.epilogue and not _joined_rows_kernel(plan, root):
            reduction_roots_of.setdefault(id(plan), []).append(node)
    buffers -= _read_only_where_computed(nodes, outputs, steps, step_of, buffers)
    return Schedule(steps, buffers)


# NOTE (memory traffic): a pointwise value read by several kernels is computed again by each. That
# is cheap for a value of one or two reads, and costs a pass per read where the inline chain is
# long: a transformer's residual stream x0 + y0 + y1 + ... (each layer's sum read by its norm and,
# past the layer's matmuls, by the next sum) made every norm re-read all earlier layers' outputs
# (GPT-2's ninth layer norm: 142 MB where 25 MB suffice). Such a value is stored once its chain
# reads this many buffers of its size, as eager stores each sum.
RECOMPUTE_MAX_READS = 3


def keep_long_chains(graph: fx.Graph) -> int:
    """Mark the values the forward's fusion will store as too long to recompute
    (``_recomputed_too_widely``) ``never_recomputed``, so the backward reads them rather than
    computing the chain again (GPT-2: one backward kernel remade all 12 layers' residual sums from
    24 saved matmul outputs, 1 GB moved, and held them through the backward). Returns how many."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    buffers = {n for n in graph.nodes if kind_of(n) in (OpKind.INPUT, OpKind.EXTERN, OpKind.REDUCTION)}
    chosen = _recomputed_too_widely(nodes, buffers)
    for node in chosen:
        update_meta(node, never_recomputed=True)
    return len(chosen)


def _recomputed_too_widely(nodes, buffers) -> list:
    """Pointwise values (not buffers) whose inline computation reads ``RECOMPUTE_MAX_READS`` buffers
    of their own size or more (counting up to values already chosen, in graph order: a chain is
    cut every few links) and that kernels a matmul separates compute (``_kernels_apart``)."""
    chosen, full_reads = [], {}
    stored = set(buffers)
    for node in nodes:
        if kind_of(node) != OpKind.POINTWISE or node in stored:
            continue
        size = numel(meta_of(node).shape)
        reads = set()
        for arg in node.all_input_nodes:
            source = arg
            while kind_of(source) == OpKind.VIEW and source not in stored:
                source = source.args[0]
            if source in stored:
                if numel(meta_of(source).shape) == size:
                    reads.add(source)
            else:
                reads |= full_reads.get(source, set())
        full_reads[node] = reads
        if len(reads) >= RECOMPUTE_MAX_READS and len(node.users) >= 2 and _kernels_apart(node, stored):
            chosen.append(node)
            stored.add(node)
    # NOTE: judged in graph order, a value's readers were followed past values chosen after it; with
    # those stored, its readers may all share its kernel (a layer norm's gradient term, read by the
    # row's sum and by the residual gradient that kernel stores): such a value is dropped again
    for _ in range(3):
        kept = [n for n in chosen if _kernels_apart(n, stored - {n})]
        if len(kept) == len(chosen):
            break
        chosen, stored = kept, stored - (set(chosen) - set(kept))
    return chosen


def _kernels_apart(node: fx.Node, stored: set) -> bool:
    """Whether ``node`` is computed inline by kernels a matmul separates: of the values it reaches
    through inlined ops (the reductions and stored values whose kernels compute it), one depends on
    another through an extern (the next layer's norm, past this layer's matmuls; in a backward, the
    earlier layer's norm gradient, past the matmul gradients)."""
    consumers, stack = set(), list(node.users)
    while stack:
        n = stack.pop()
        if n in consumers:
            continue
        if n not in stored and (kind_of(n) in INLINE_KINDS or kind_of(n) == OpKind.VIEW):
            stack.extend(u for u in n.users if u not in consumers)
        consumers.add(n)
    readers = {n for n in consumers if n in stored or kind_of(n) not in (*INLINE_KINDS, OpKind.VIEW)}
    for start in readers:
        stack, seen = [(u, False) for u in start.users], set()
        while stack:
            n, through = stack.pop()
            through = through or kind_of(n) == OpKind.EXTERN
            if (n, through) in seen:
                continue
            seen.add((n, through))
            if through and n in readers:
                return True
            stack.extend((u, through) for u in n.users)
    return False


class _Root:
    """A value that must be in memory, looking for the kernel that computes it: its kind, its
    iteration space (shape, reduced dims) and, for a column sum, its rows' partial."""

    def __init__(self, node: fx.Node, kind: OpKind, buffers: set, reduction_roots_of: dict):
        self.node, self.kind, self.buffers = node, kind, buffers
        if kind == OpKind.REDUCTION:
            self.space = (meta_of(node.args[0]).shape, node.kwargs["dims"])
        else:  # pointwise or scatter: one element per position of its shape
            self.space = (meta_of(node).shape, ())
        self.column = _column_partial(node)
        self._reduction_roots_of = reduction_roots_of

    def reductions_of(self, plan) -> tuple:
        """The reductions ``plan`` computes as roots."""
        return self._reduction_roots_of.get(id(plan), ())


@dataclass(frozen=True)
class _Join:
    """How a root joins a kernel (the answer of a join rule)."""
    reads_row: bool = False      # it reads the rows the kernel holds
    epilogue: bool = False       # computed after the kernel's reductions, in its rows' space
    second: bool = False         # in the kernel's second pass over its rows
    partner: fx.Node | None = None  # the reduction it computes with as an online softmax
    space: tuple | None = None   # the kernel takes the root's (shape, reduce dims): it loops over column chunks


def _joins_as_epilogue(root: _Root, plan) -> _Join | None:
    """Is the root a pointwise epilogue of this kernel's reductions?"""
    if root.kind == OpKind.POINTWISE and plan.takes_epilogue(root.node, root.reductions_of(plan), root.buffers):
        return _Join(epilogue=True)
    return None


def _joins_column_sums(root: _Root, plan) -> _Join | None:
    """Is the root a column sum this kernel's rows can feed, or whose chunks it loops over?"""
    if root.column is None:
        return None
    if plan.takes_column(root.node, *root.column, root.buffers):
        return _Join(reads_row=True)
    if plan.loops_over_chunks(*root.column):   # its elements, met in the column sums' loop
        return _Join(space=root.space)
    return None


def _joins_same_space(root: _Root, plan) -> _Join | None:
    """Does the root share this kernel's iteration space, and can the kernel compute it there:
    independently, on the rows it holds, beside a reduction (online softmax) or in a second pass?"""
    if not plan.accepts(*root.space):
        return None
    if root.kind == OpKind.REDUCTION and _accumulators(plan) >= MAX_ACCUMULATORS:
        return None
    node, reductions, buffers = root.node, root.reductions_of(plan), root.buffers
    depends = _depends_on(node, reductions, buffers)
    persistent = (depends or plan.reads_rows) and plan.persistent_with(root.space[1], node, buffers)
    if not depends:
        # (a root beside a kernel holding rows: its loads must fit beside them)
        return _Join() if persistent or not plan.reads_rows else None
    if persistent:
        return _Join(reads_row=True) if _row_aligned(node, reductions, plan) else None
    partner = _online_softmax_partner(node, reductions, buffers, plan)
    if partner is not None:
        return _Join(partner=partner)
    return _Join(second=True) if plan.second_pass_with(node, reductions, buffers) else None


# NOTE (registers): a kernel holds an accumulator tile per reduction it computes. The second stage
# of every layer's bias and norm-weight gradients (sums of partial sums, one space) joined one
# kernel: GPT-2's had 50 accumulators, 255 registers a thread and spills on sm_90. Past this many
# a reduction starts a kernel of its own.
MAX_ACCUMULATORS = 16


def _accumulators(plan) -> int:
    return sum(1 for n in plan.roots if kind_of(n) == OpKind.REDUCTION)


# The questions asked of each kernel at or after a root's barrier, in order; the first answer wins.
JOIN_RULES = (_joins_as_epilogue, _joins_column_sums, _joins_same_space)


HOIST_PAST_EXTERNS = 4
# (below this a value is held for nothing much, and a launch saved is worth more: an attention
# backward's operand copies, made by one kernel)
HOIST_MIN_BYTES = 8 << 20


def _bytes(node: fx.Node) -> int:
    return numel(meta_of(node).shape) * meta_of(node).dtype.itemsize


def _matmul_operand(node: fx.Node) -> bool:
    """Whether an extern (a matmul) reads ``node``, directly or through views.

    NOTE (memory): such a value of ``HOIST_MIN_BYTES`` or more joins no kernel more than
    ``HOIST_PAST_EXTERNS`` externs before its place in the graph. A backward recomputes the
    forward's matmul operands (a layer norm's or a GELU's output) from saved values, which nothing
    else orders: each joined the first kernel of its shape, so all layers' operands were made at
    the start of the backward and held through it (GPT-2: 24 of them, 1.3 GB in one kernel), more
    memory than saving them would have cost. Four externs back keep a layer's own kernels joined:
    a SwiGLU's backward makes the gate's and the up projection's gradients and the recomputed
    product in one pass, with matmuls between the first and the last in the graph. Llama-1.1B's
    step with two: 129.8 ms, 26.0 GB peak; three: 126.9 ms, 24.5 GB; four: 126.2 ms, 23.1 GB;
    six: 126.9 ms, 22.9 GB. GPT-2's: 18.79 ms at two to four, 18.91 ms at six."""
    stack, seen = list(node.users), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if kind_of(n) == OpKind.EXTERN:
            return True
        if kind_of(n) == OpKind.VIEW:
            stack.extend(n.users)
    return False


def _first_join(root: _Root, steps: list, barrier: int):
    """(step index, _Join) of the first kernel at or after ``barrier`` that takes ``root``, or (None, None)."""
    for i in range(barrier, len(steps)):
        kind, plan = steps[i]
        if kind != "kernel":
            continue
        for rule in JOIN_RULES:
            join = rule(root, plan)
            if join is not None:
                return i, join
    return None, None


def _joined_rows_kernel(plan, root: _Root) -> bool:
    """Whether a column-sum root joined a rows' kernel (``takes_column``): not the kernel's space."""
    return root.column is not None and plan.shape != root.space[0]


def _copies_kernel(node: fx.Node, steps, barrier: int):
    """The kernel at or after ``barrier`` that can also make ``node``, a copy into another layout (an
    ``identity``: a bmm's operand made contiguous) with no kernel of its own shape to join: one
    that only copies too, as many elements, another shape. Each copy's elements are stored in
    order, so one kernel over one shape stores both (Inductor's combo kernels launch unrelated
    pointwise kernels as one): a launch fewer, where each copy is small enough to be launch-bound
    (the transformer's backward: k transposed and the attention output, beside q, k, v)."""
    if kind_of(node) != OpKind.POINTWISE or node.target.name != "identity" or meta_of(node).dtype.is_complex:
        return None
    shape = tuple(meta_of(node).shape)
    for i in range(barrier, len(steps)):
        kind_i, plan = steps[i]
        if kind_i != "kernel" or plan.reduce_dims or tuple(plan.shape) == shape:
            continue
        if numel(plan.shape) == numel(shape) and all(kind_of(r) == OpKind.POINTWISE and r.target.name == "identity"
                                                     for r in plan.roots):
            return i
    return None


def _stored_in_shape(graph: fx.Graph, node: fx.Node, shape, buffers) -> fx.Node:
    """``node``'s value stored as a copy of ``shape`` (its elements in order), its readers reading
    that through a reshape back: the copy is the root, ``node`` is computed inline in it."""
    b = GraphBuilder(graph)
    m = meta_of(node)
    with graph.inserting_after(node):
        flat = C.emit_view(b, "reshape", node, shape=tuple(shape))
    with graph.inserting_after(flat):
        root = emit_pointwise(b, "identity", [flat], dtype=m.dtype, requires_grad=m.requires_grad)
    with graph.inserting_after(root):
        back = C.emit_view(b, "reshape", root, shape=tuple(m.shape))
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not flat)
    buffers.discard(node)
    buffers.add(root)
    return root


def _read_only_where_computed(nodes, outputs, steps, step_of, buffers) -> set:
    """The reduction roots no other step reads and the program does not return: softmax's row max
    and sum of exponentials, read only by the division of the same kernel. They are computed in
    registers and never stored (eager moves no bytes for them either: 8 bytes a row of fp32 that our
    softmax moved more than eager's). Taken out of ``buffers``, a kernel computes them as roots
    (``reductions.ReductionWriter``) without a store, and the CPU path computes them inline."""
    def memory_of(value):
        while kind_of(value) == OpKind.VIEW:
            value = value.args[0]
        return value

    candidates = {n for n in nodes
                  if kind_of(n) == OpKind.REDUCTION and n in step_of and steps[step_of[n]][0] == "kernel"}
    kept = {memory_of(o) for o in outputs}
    for node in nodes:
        if kind_of(node) == OpKind.EXTERN:
            kept |= {memory_of(a) for a in node.args if isinstance(a, fx.Node)}
        elif kind_of(node) == OpKind.GATHER:
            kept.add(memory_of(node.args[1]))   # its range check reads the indices on the host
        if meta_of(node).materialize:
            kept.add(memory_of(node))
    for i, (kind, plan) in enumerate(steps):
        if kind != "kernel":
            continue
        for root in plan.roots:
            kept |= {b for b in _reads(root, buffers) if step_of.get(b) != i}
        for value, _chunks in plan.columns.values():
            kept |= {b for b in inlined_reads(value) if b in buffers and step_of.get(b) != i}
    return candidates - kept


def _online_softmax_partner(node: fx.Node, reductions, buffers, plan):
    """The amax among ``reductions`` (roots of ``plan``, a kernel that loops over rows) that ``node``
    can be computed with in the same pass, or None.

    ``node`` must be ``sum(exp(x - c))`` over the amax's dims, with ``x`` the amax's input and
    ``c`` computed from the amax alone (softmax, log_softmax and logsumexp shift by it): the
    kernel then keeps a running max and a sum rescaled to it as the row streams by (online
    softmax: Milakov & Gimelshein 2018; Inductor and flash-attention do the same), instead
    of reading the row once for the max and again for the sum."""
    if kind_of(node) != OpKind.REDUCTION or node.target.name != "sum" or node.args[0] in buffers:
        return None
    e = node.args[0]
    a0, a1 = Y.REAL_ARGS[0], Y.REAL_ARGS[1]
    if kind_of(e) != OpKind.POINTWISE or meta_of(e).expr != sympy.exp(a0):
        return None
    d = e.args[0]
    if not isinstance(d, fx.Node) or d in buffers or kind_of(d) != OpKind.POINTWISE or meta_of(d).expr != a0 - a1:
        return None
    x, c = d.args
    if not isinstance(c, fx.Node) or meta_of(d).shape != meta_of(x).shape:
        return None
    for m in reductions:
        if m.target.name != "amax" or m.args[0] is not x or m.kwargs["dims"] != node.kwargs["dims"]:
            continue
        if compute_dtype(meta_of(m).dtype) != compute_dtype(meta_of(node).dtype) or meta_of(m).dtype.is_complex:
            continue
        others = [n for n in list(inlined_reads(c)) + [c] if n is not m]
        if _depends_on(c, [m], ()) and _row_aligned(c, [m], plan) and \
                all(n not in buffers and kind_of(n) in (OpKind.POINTWISE, OpKind.VIEW) for n in others):
            return m
    return None


def inlined_reads(node: fx.Node):
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
        if kind_of(n) in INLINE_KINDS or kind_of(n) == OpKind.VIEW:
            stack.extend(n.args)


def _reads(node: fx.Node, buffers) -> set:
    """The buffers a root reads."""
    return {n for n in inlined_reads(node) if n in buffers}


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
            return len(meta_of(n).shape) == rank  # keepdim=True: its own row at the kernel's index
        if n not in memo:
            memo[n] = not _depends_on(n, reductions, ()) or _aligned_through(n)
        return memo[n]

    def _aligned_through(n) -> bool:
        kind = kind_of(n)
        if len(meta_of(n).shape) != rank or kind == OpKind.REDUCTION:
            return False  # an implicit broadcast (lower rank) or another reduction's space
        if kind in INLINE_KINDS:
            return all(aligned(a) for a in n.args)
        if kind != OpKind.VIEW:
            return False
        source = n.args[0]
        if n.target.name == "expand":
            return aligned(source)
        if n.target.name == "reshape" and source in reductions and not source.kwargs["keepdim"]:
            shape = meta_of(n).shape
            return all(shape[d] == 1 for d in dims) and \
                [s for d, s in enumerate(shape) if d not in dims] == list(meta_of(source).shape)
        return n.target.name == "reshape" and meta_of(n).shape == meta_of(source).shape and aligned(source)

    return all(aligned(a) for a in node.args)


def _depends_on(node: fx.Node, targets, buffers) -> bool:
    """Whether ``node`` reads any of ``targets`` (reductions of a kernel it would join)."""
    targets = set(targets)
    return bool(targets) and any(n in targets for n in inlined_reads(node))
