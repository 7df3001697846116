"""A fused kernel as one C++ function: the C++ CPU backend (``backend="cpp"``).

The kernel plan that ``triton_kernel`` renders for a GPU is written here as a loop nest over its
iteration space, compiled by the system's C++ compiler (``runtime.cpp_build``): the leading dims
flattened into one loop spread over threads by OpenMP, the last dim the inner loop, which
``-O3 -march=native`` vectorizes where the accesses allow (the compiler versions a loop for a
stride of 1). Every value is computed at the loop's multi-index as the Triton kernel computes
it: buffers loaded through their strides (kernel arguments, so any layout works), views through
their index maps (``View.index_map``, written in C by ``kernel_text.c_text``), broadcasts, and each
pointwise node's SymPy expression (``cpp_printer``), one value per (node, element), in the dtype
the Triton kernel computes in.

Printed today, over fp32, fp64, complex64/128 (interleaved parts), integer and bool buffers:
- pointwise kernels (views, broadcasts, loads, slice_scatters), with a vector body (at::vec);
- kernels reducing some dims (sum, mean, amax: softmax, norms, a loss's rows, a batch norm's N, H,
  W): per row a loop per group of reductions that wait for no other (their shared values computed
  once), in the order their values are needed, the row's values computed from them (an epilogue:
  layer norm's rstd), then a loop over the row's elements; each loop with a vector body where the
  row is one dim or its last dim is reduced in whole registers; float sums in double totals;
- kernels reducing their leading dims (a weight's gradient over the batch): blocks of columns, each
  column's accumulator updated row by row by an inner loop over consecutive columns.
In a vector body a value the same for every lane is a scalar (a row's target, a gathered row's
index); a load whose lanes read consecutive elements is one register (``lanes_consecutive``),
another fills a register lane by lane. A gathered index is checked (the function returns 1 where
one was out of range: the caller raises eager's IndexError), wrapped where negative indices count
from the end, and clamped; a random number is Triton's ``tl.rand`` (``_PHILOX``). Anything else
(half types, a primitive without a C++ lowering) raises ``NotPrintable``: that kernel runs on the
torch path (``compiler.codegen.torch_kernel``), the others of its program still in C++.

The argument order is the Triton kernel's (``KernelSource.loads``, then ``stores``): each input's
pointer and one int64 stride per dim, then each output's pointer (contiguous).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from compiler.codegen.cpp_printer import C_TYPE, CppPrinter, VectorPrinter
from compiler.codegen.realify import IM, RE, realify
from compiler.codegen.kernel_text import (ZERO, Index, broadcast_index, c_text, compose, constant_index, evaluate,
                                         leaves, variable_index)
from compiler.codegen.triton_kernel import _used_as_condition   # (whether a bool argument is a where's condition)
from compiler.fusion.fuse import KernelPlan
from compiler.ir.graph import OpKind, compute_dtype, contiguous_strides, kind_of, meta_of, numel
from compiler.ir.ops import symbols as Y
from compiler.ir.ops.views import _reshape_index
from compiler.ir.ops.primitives.base import NotPrintable
from runtime.cpp_build import VECTOR_HEADER
from runtime.program import INDEX_ASSERT

# below this many elements a kernel runs in one thread (OpenMP's start costs more than it saves)
PARALLEL_MIN = 32768
# the loop over rows (or chunks, or column blocks) spread over threads; ``bad``: an index a gather
# found out of range, in any thread (the function returns it: the caller raises eager's error)
_PARALLEL = "    #pragma omp parallel for schedule(static) reduction(|:bad)"
# columns a thread sums at once in a kernel reducing leading dims (its accumulators stay in L1)
_COLUMN_BLOCK = 256
# rows a column sum adds in its dtype before the run's sums go into its double totals
_ROW_RUN = 64
# the largest row whose element values a sum's loop keeps for the loops after it (on the thread's stack)
_ROW_BUFFER_BYTES = 64 * 1024
# bytes in the widest SIMD register a vector body may use (AVX-512's), and in the narrowest (AVX2's)
_WIDEST_REGISTER = 64
_NARROWEST_REGISTER = 32
# the most lanes ``lanes_consecutive`` evaluates an index at, per register width
_LANE_CHECKS = 1 << 14


# logical operations on a vector body's masks (each lane all ones, or zero)
_MASK_LOGIC = {"logical_and": lambda a, b: f"{a} & {b}", "logical_or": lambda a, b: f"{a} | {b}",
               "logical_not": lambda a: f"{a} == V(0)"}


def _parts(name: str, dtype: torch.dtype) -> tuple:
    """The accumulators of a sum of ``dtype``: one, or a complex sum's real and imaginary parts'."""
    return (f"{name}_re", f"{name}_im") if dtype.is_complex else (name,)


def _element_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a buffer's pointer points to: complex values as their interleaved real parts."""
    return dtype.to_real() if dtype.is_complex else dtype


@dataclass(frozen=True)
class CppKernelSource:
    name: str
    source: str            # a C++ translation unit defining ``extern "C" int <name>(...)`` (1: a bad index)
    loads: tuple           # (dims, dtype) per input, in argument order: a pointer, then a stride per dim
    stores: tuple          # dtype per output (contiguous), in argument order
    vectorized: bool = False   # the inner loop is written with at::vec::Vectorized (built with ATen's headers)
    # what a gathered index out of range is reported as (the Triton kernels' assert's words), or None
    index_error: str | None = None


def render_cpp_kernel(plan: KernelPlan, buffers: set, loads: list, stores: list) -> CppKernelSource:
    """The C++ source of one fused kernel, its arguments in the order of the Triton kernel's
    ``loads`` and ``stores`` (graph nodes). Raises NotPrintable where it cannot be printed."""
    return _CppWriter(plan, buffers, loads, stores).write()


class _CppWriter:
    def __init__(self, plan: KernelPlan, buffers: set, loads: list, stores: list, vector_dtype=None):
        rdims = tuple(plan.reduce_dims)
        trailing = rdims == tuple(range(len(plan.shape) - len(rdims), len(plan.shape)))
        simple = not (plan.reads_rows or plan.online or plan.second_pass or plan.epilogue or plan.columns)
        # rows of each chunk of rows summed (``KernelPlan.loops_over_chunks``): (chunks, M / chunks, N)
        self.chunked = simple and rdims == (1,) and len(plan.shape) == 3
        self.over_columns = self.chunked or (bool(rdims) and not trailing and rdims == tuple(range(len(rdims)))
                                             and simple)
        if plan.columns and (not trailing or len(rdims) != 1
                             or len({chunks for _, chunks in plan.columns.values()}) != 1):
            raise NotPrintable("column sums beside rows of another form than [..., row length]")
        if rdims and vector_dtype is not None:
            raise NotPrintable("a reduction in a vector body")
        self.plan = plan
        self.buffers = buffers
        self.roots = set(plan.roots)
        self.load_names = {node: f"in{k}" for k, node in enumerate(loads)}
        self.loads = loads
        self.stores = stores
        self.lines: list = []
        self.values: dict = {}
        self.counter = 0
        # the vector body's element type (None: the scalar body): one float dtype for every value
        self.vector_dtype = vector_dtype
        self.inner_name = f"i{len(plan.shape) - 1}" if plan.shape else None
        self.row_lines: list = []    # a row's statements: its reductions' loops (kernels that reduce)
        self.row_vector_dtype = None  # a reducing kernel's vector bodies' dtype (None: scalar loops)
        self.used_vector = False      # whether a row loop got a vector body
        self.index_errors: dict = {}  # what each gather reports for an index out of range (ordered)
        self.uses_random = False      # a body calls symgrad_rand (``_PHILOX``, in the prelude)
        self.row_values: dict = {}   # reduction node -> (its row's value, dtype)
        self.reducing: set = set()   # reductions whose shared loop is being written
        # in a vector body: variables holding one scalar for every lane (values that do not vary along
        # the inner loop: a row's target, a gathered row's index), and vectors holding exact integers
        # as floats (an iota along the inner loop)
        self.scalar_vars: set = set()
        self.float_ints: set = set()
        # in a vector body: int variables holding the first lane's position along a dim whose lanes
        # are consecutive (a slice of whole registers: lane l's element is at the variable + l)
        self.consecutive: dict = {}
        self.lane_masks: set = set()   # in a vector body: mask variables chosen lane by lane (``lane_slice_position``)
        # a rows kernel's values the same for every element of the row (its mean, its rstd, a weight
        # read at the row): (node, index) -> their variable, computed once per row before the loops
        self.row_invariant: dict = {}
        self.row_names: frozenset = frozenset()   # the row's index variables (kept dims'), in a rows kernel
        self.in_row_loop = False                  # writing a loop over the row's elements
        self.hoisting = False   # writing such a value at the row (a row buffer's element is no value there)
        # a row's element values a sum's loop keeps in a buffer for the loops after it (softmax's
        # exp(x - max): computed once, not again for the row's outputs): key -> (buffer, dtype)
        self.row_cache: dict = {}
        self.used_buffers: set = set()
        self.kept_rows: set = set()   # row buffers a reduction's scalar body stores its values in
        self.base_index: tuple = ()
        for node in [*loads, *stores]:
            if C_TYPE.get(_element_dtype(meta_of(node).dtype)) is None:
                raise NotPrintable(f"a {meta_of(node).dtype} buffer")

    def tmp(self, ctype: str, text: str) -> str:
        name = f"t{self.counter}"
        self.counter += 1
        self.lines.append(f"const {'V' if self.vector_dtype is not None else ctype} {name} = {text};")
        return name

    def lane_vector(self, var: str, have: torch.dtype, condition: bool = False) -> str:
        """``var`` as a vector body's operand: a scalar (``scalar_vars``) broadcast to every lane (a
        bool used as a condition: a mask), a vector as it is."""
        if var not in self.scalar_vars:
            return var
        ctype = C_TYPE[self.vector_dtype]
        if condition or have == torch.bool:
            return f"(V(static_cast<{ctype}>({var})) != V(0))"
        return f"V(static_cast<{ctype}>({var}))"

    # -- values ----------------------------------------------------------------------------
    def value(self, node: fx.Node, index: tuple):
        """(C++ variable, dtype) of ``node`` at ``index`` (an ``Index`` a dim)."""
        index = tuple(i.folded() for i in index)
        key = (node, tuple(c_text(i) for i in index))
        if key in self.values:
            return self.values[key]
        if key in self.row_cache and not self.hoisting:   # (computed by an earlier loop, kept in its buffer)
            buffer, dtype = self.row_cache[key]
            self.used_buffers.add(buffer)
            result = (self.tmp("V", f"V::loadu({buffer} + r)") if self.vector_dtype is not None
                      else self.tmp(C_TYPE[dtype], f"{buffer}[r]"), dtype)
            self.values[key] = result
            return result
        if self.in_row_loop and all(i.names <= self.row_names for i in index):
            return self.row_value_once(node, index, key)
        kind = kind_of(node)
        if self.vector_dtype is not None and not any(self.inner_name in i.names for i in index):
            # the same for every lane: computed once, as a scalar, in any dtype (a row's target, the
            # index of an embedding's row), then broadcast where a vector operation reads it
            held, self.vector_dtype = self.vector_dtype, None
            try:
                result = self.value(node, index)
            finally:
                self.vector_dtype = held
            return self.as_scalar(result)
        if (node in self.buffers and node not in self.roots) or \
                kind not in (OpKind.POINTWISE, OpKind.VIEW, OpKind.REDUCTION):
            inside = not (node in self.buffers and node not in self.roots)
            if kind == OpKind.IOTA and inside:
                result = self.iota(node, index)
            elif kind == OpKind.GATHER and inside:
                result = self.gathered(node, index)
            elif kind == OpKind.RAND and inside:
                result = self.random(node, index)
            elif kind == OpKind.SCATTER and inside:
                result = self.slice_scatter(node, index)
            else:
                result = self.load(node, index)
        elif kind == OpKind.VIEW and node.target.name in ("view_as_real", "view_as_complex"):
            result = self.complex_view(node, index)
        elif kind == OpKind.VIEW:   # its input's value at the index the view maps to
            result = self.value(node.args[0], tuple(node.target.index_map(node, list(index))))
        elif kind == OpKind.REDUCTION:
            result = self.reduced(node, index)
        else:
            result = self.pointwise(node, index)
        self.values[key] = result
        return result

    def row_value_once(self, node: fx.Node, index: tuple, key):
        """A value the same for every element of a rows kernel's row, met in a loop over the row:
        computed once, at the row (its statements before the loop), in the scalar dtype (a vector body
        broadcasts it). GCC does not hoist it by itself: layer norm's backward computed its rstd's
        division in every register of its loop."""
        if key not in self.row_invariant:
            held = (self.lines, self.values, self.vector_dtype, self.in_row_loop, self.hoisting)
            self.lines, self.values, self.vector_dtype, self.in_row_loop, self.hoisting = [], {}, None, False, True
            try:
                result = self.value(node, index)
                self.row_lines += self.lines
            finally:
                self.lines, self.values, self.vector_dtype, self.in_row_loop, self.hoisting = held
            self.row_invariant[key] = result
        return self.as_scalar(self.row_invariant[key]) if self.vector_dtype is not None else self.row_invariant[key]

    def as_scalar(self, result):
        """``result``, a (variable, dtype) computed in the scalar dtype, as a vector body's value: its
        variables (a complex value's two) in ``scalar_vars``, broadcast where a vector operation reads it."""
        self.scalar_vars.update(result[0] if isinstance(result[0], tuple) else (result[0],))
        return result

    # -- reductions: one loop over its row each, before the loop that reads it -----------------
    def reduced(self, node: fx.Node, index: tuple):
        """A reduction of this kernel read at ``index``: its row's value (its loop written once, at
        row level, before whatever loop reads it; one that reads another's comes after it)."""
        kept = [d for d in range(len(self.plan.shape)) if d not in self.plan.reduce_dims]
        wanted = [index[d] for d in kept] if node.kwargs["keepdim"] else list(index)
        if not self.plan.reduce_dims or \
                [c_text(i) for i in wanted] != [c_text(self.base_index[d]) for d in kept]:
            raise NotPrintable("a reduction read at another row than the one it reduced")
        if node not in self.row_values:
            self.row_values[node] = self.reduce_row(node)
        return self.row_values[node]   # (a row's value: in a vector body, the same in every lane)

    def in_loop(self, compute, vector: bool):
        """(the statements, what ``compute()`` returns) of one loop body, written with values of its
        own (the scalar body, or with ``vector`` the vector body over the kernel's float dtype)."""
        held = (self.lines, self.values, self.vector_dtype, self.in_row_loop, self.hoisting)
        self.lines, self.values, self.in_row_loop, self.hoisting = [], {}, bool(self.row_names), False
        self.vector_dtype = self.row_vector_dtype if vector else None
        try:
            result = compute()
            return self.lines, result
        finally:
            self.lines, self.values, self.vector_dtype, self.in_row_loop, self.hoisting = held

    def vector_and_scalar(self, compute) -> tuple:
        """(vector body or None where it cannot be written, scalar body) of one loop over a row."""
        vector = None
        if self.row_vector_dtype is not None:
            try:
                vector = self.in_loop(compute, True)
            except NotPrintable:
                vector = None
        return vector, self.in_loop(compute, False)

    def row_loop(self, vector, scalar, vector_step: list, scalar_step: list, after_vector=()) -> list:
        """A loop over a row: the vector body while a register's worth of elements is left (where
        there is one), then the scalar body; ``*_step``: what each does with its body's values;
        ``after_vector``: statements between the two loops (a vector accumulator's total)."""
        self.used_vector = self.used_vector or vector is not None
        lines = ["int64_t r = 0;"] if vector is not None else []
        if vector is not None:   # (the reduced dims' indices at the register's first lane: ``r_header``)
            lines += ["#ifndef SYMGRAD_SCALAR_ONLY", f"for (; r + V::size() <= {self.rnumel}; r += V::size()) {{",
                      *[f"    {line}" for line in self.r_header + vector + vector_step], "}", *after_vector, "#endif",
                      f"for (; r < {self.rnumel}; ++r) {{"]
        else:
            lines.append(f"for (int64_t r = 0; r < {self.rnumel}; ++r) {{")
        lines += [f"    {line}" for line in self.r_header + scalar + scalar_step]
        return ["{"] + [f"    {line}" for line in lines + ["}"]] + ["}"]   # (a scope of its own: its r)

    def reduce_row(self, node: fx.Node):
        """``node``'s loop over its row, shared with the kernel's other reductions ready at this point
        (their arguments read no reduction still to come): one pass computes the values they have in
        common once (a batch norm's backward: four sums over one expression's parts). Where the
        shared loop has no vector body but ``node``'s own would, ``node`` gets its own loop."""
        group = [node] + self.ready_siblings(node)
        held = (list(self.row_lines), dict(self.row_values), dict(self.row_cache), dict(self.row_invariant))
        if len(group) > 1 and not self.reduce_rows(group) and self.row_vector_dtype is not None:
            self.row_lines, self.row_values, self.row_cache, self.row_invariant = held
            if self.reduce_rows([node]):
                return self.row_values[node]
            self.row_lines, self.row_values, self.row_cache, self.row_invariant = held
            self.reduce_rows(group)
        elif len(group) == 1:
            self.reduce_rows(group)
        return self.row_values[node]

    def ready_siblings(self, node: fx.Node) -> list:
        """The kernel's reductions other than ``node`` not yet written that read no reduction still
        to come and that ``node``'s argument does not read (written in one loop with ``node``; one
        its argument reads is written first, in a loop of its own)."""
        # NOTE: a reduction whose loop is being written (``reducing``: ``node``'s argument reads this
        # one) is no sibling, and not done either: one that reads it must wait for that loop to end
        done = set(self.row_values)
        waits_for = self.pending_reads(node.args[0], done)
        found = []
        for root in self.plan.roots:
            if root is node or root in done or root in self.reducing or root in waits_for \
                    or kind_of(root) != OpKind.REDUCTION or root in self.plan.columns or root in self.plan.epilogue \
                    or root.target.name not in ("sum", "mean", "amax") \
                    or compute_dtype(meta_of(root).dtype).is_complex:
                continue
            if not self.pending_reads(root.args[0], done):
                found.append(root)
        return found

    def pending_reads(self, value: fx.Node, written: set) -> set:
        """The kernel's reductions not in ``written`` that computing ``value`` here reads, directly or
        through another such reduction."""
        stack, seen, found = [value], set(), set()
        while stack:
            n = stack.pop()
            if n in seen or n in written:
                continue
            seen.add(n)
            if kind_of(n) == OpKind.REDUCTION and n in self.roots:
                found.add(n)   # (and the reductions its argument reads: a pool's max, under its argmax)
            if not (n in self.buffers and n not in self.roots):   # (a buffer not computed here: loaded)
                stack.extend(n.all_input_nodes)
        return found

    def reduce_rows(self, group: list) -> bool:
        """One loop over the row accumulating every reduction of ``group``, their row values set in
        ``row_values``; whether it has a vector body."""
        for node in group:
            if node.target.name not in ("sum", "mean", "amax"):
                raise NotPrintable(f"a {node.target.name} reduction")
            if compute_dtype(meta_of(node).dtype).is_complex:
                raise NotPrintable("a complex reduction")
        accs = []
        for node in group:
            accs.append(f"acc{self.counter}")
            self.counter += 1
        buffers = self.row_buffers(group, accs)

        def elements():
            return [self.reduced_element(node, buffers.get(node)) for node in group]
        self.reducing |= set(group)   # (a reduction an argument reads, written first, leaves these to this loop)
        try:
            vector, (body, values) = self.vector_and_scalar(elements)
        finally:
            self.reducing -= set(group)
        for node, acc in zip(group, accs):
            buffer = buffers.get(node)
            if buffer is not None and buffer in self.kept_rows:
                dtype = compute_dtype(meta_of(node).dtype)
                self.row_lines.append(f"alignas(64) {C_TYPE[dtype]} {buffer}[{self.rnumel}];")
                self.row_cache[(node.args[0], tuple(c_text(i) for i in self.base_index))] = (buffer, dtype)
        before, vector_step, after_vector, scalar_step, after = [], [], [], [], []
        for k, (node, acc) in enumerate(zip(group, accs)):
            parts = self.accumulator(node, acc, values[k], vector[1][k] if vector is not None else None)
            for lines, part in zip((before, vector_step, after_vector, scalar_step, after), parts):
                lines += part
            self.row_values[node] = (acc, compute_dtype(meta_of(node).dtype))
        self.row_lines += before + self.row_loop(vector[0] if vector is not None else None, body, vector_step,
                                                 scalar_step, after_vector=after_vector) + after
        return vector is not None

    def row_buffers(self, group: list, accs: list) -> dict:
        """reduction -> the buffer its loop keeps its computed argument in, for the loops after it
        (not a load's: that is read again as cheaply), where the row fits (a pool's window, after
        its max: the position of the max, then the value there)."""
        buffers, keys = {}, set()
        for node, acc in zip(group, accs):
            arg, dtype = node.args[0], compute_dtype(meta_of(node).dtype)
            key = (arg, tuple(c_text(i) for i in self.base_index))
            computed = kind_of(arg) == OpKind.POINTWISE and not (arg in self.buffers and arg not in self.roots)
            if computed and key not in self.row_cache and key not in keys \
                    and self.rnumel * dtype.itemsize <= _ROW_BUFFER_BYTES:
                buffers[node] = f"{acc}_row"
                keys.add(key)
        return buffers

    def reduced_element(self, node: fx.Node, buffer) -> str:
        """A reduction's argument at the row's current element, in the reduction's dtype (kept in
        ``buffer`` where one is given)."""
        dtype = compute_dtype(meta_of(node).dtype)
        var, have = self.value(node.args[0], self.base_index)
        if buffer is not None and have == dtype and var not in self.scalar_vars:
            self.lines.append(f"({var}).store({buffer} + r);" if self.vector_dtype is not None
                              else f"{buffer}[r] = {var};")
            if self.vector_dtype is None:   # (the scalar body, written last, decides: it keeps the row)
                self.kept_rows.add(buffer)
        var = self.cast(var, have, dtype)
        return self.lane_vector(var, dtype) if self.vector_dtype is not None else var

    def accumulator(self, node: fx.Node, acc: str, var: str, vvar) -> tuple:
        """(statements before the loop, the vector body's step, after the vector loop, the scalar
        body's step, after the loop) of ``node``'s accumulator ``acc`` (``vvar``: its value in the
        vector body, None where the loop has none)."""
        name, dtype = node.target.name, compute_dtype(meta_of(node).dtype)
        ctype = C_TYPE[dtype]
        if name == "amax":   # NaN wins, as eager's (at::vec::maximum's too); ``|``, not ``||``: no branch to mispredict
            init, update, combine = "-INFINITY", f"{acc} = (({var} > {acc}) | ({var} != {var})) ? {var} : {acc};", \
                "at::vec::maximum(a, b)"
        else:
            init, update, combine = "0", f"{acc} += {var};", "a + b"
        scale = node.target.scale(node)
        after = [f"{acc} = {acc} * {CppPrinter({}, dtype).literal(sympy.Float(scale))};"] if scale != 1.0 else []
        if vvar is None:
            if dtype == torch.float32 and name != "amax":
                # NOTE: one accumulator over a whole row (a batch norm's N*H*W): in float its error grows
                # with the row (2e-3 over 16384 values); in double it stays at the result's rounding
                return ([f"double {acc}_d = 0;"], [], [], [f"{acc}_d += {var};"],
                        [f"{ctype} {acc} = static_cast<{ctype}>({acc}_d);", *after])
            return [f"{ctype} {acc} = {init};"], [], [], [update], after
        # the vector body accumulates lanes apart, added up (or maxed) once after its loop; the scalar
        # tail then adds its elements
        lanes = f"at::vec::vec_reduce_all<{ctype}>([](V& a, V& b) {{ return {combine}; }}, {acc}_v)"
        if dtype == torch.float32 and name != "amax":
            # each lane's float sums over runs of _ROW_RUN registers, the runs' totals in double (the
            # scalar loop's precision over a long row: a batch norm's N*H*W, a 50k-class row)
            return ([f"double {acc}_d = 0;", "#ifndef SYMGRAD_SCALAR_ONLY", f"V {acc}_v = V(0);",
                     f"int {acc}_n = 0;", "#endif"],
                    [f"{acc}_v = {acc}_v + {vvar};",
                     f"if (++{acc}_n == {_ROW_RUN}) {{ {acc}_d += {lanes}; {acc}_v = V(0); {acc}_n = 0; }}"],
                    [f"{acc}_d += {lanes};"], [f"{acc}_d += {var};"],
                    [f"{ctype} {acc} = static_cast<{ctype}>({acc}_d);", *after])
        step = f"{acc}_v = at::vec::maximum({acc}_v, {vvar});" if name == "amax" else f"{acc}_v = {acc}_v + {vvar};"
        return ([f"{ctype} {acc} = {init};", "#ifndef SYMGRAD_SCALAR_ONLY", f"V {acc}_v = V({init});", "#endif"],
                [step], [f"{acc} = {lanes};"], [update], after)

    def iota(self, node: fx.Node, index: tuple):
        """The position along the iota's dim, as int64 (the Triton kernels' dtype for it)."""
        at = index[node.kwargs["dim"]]
        if self.vector_dtype is not None:
            # consecutive positions, held exactly as floats (``float_ints``: compared with integers only)
            exact = 2 ** (24 if self.vector_dtype == torch.float32 else 53)
            if c_text(at).strip("() ") != self.inner_name or meta_of(node).shape[node.kwargs["dim"]] >= exact:
                raise NotPrintable("an iota that is not the inner loop's position in a vector body")
            var = self.tmp("V", f"V::arange(static_cast<{C_TYPE[self.vector_dtype]}>({self.inner_name}), 1)")
            self.float_ints.add(var)
            return var, torch.int64
        return self.tmp("int64_t", f"static_cast<int64_t>({c_text(at)})"), torch.int64

    def random(self, node: fx.Node, index: tuple):
        """Philox(seed, the element's position in the rand node's shape) in [0, 1): the numbers
        Triton's ``tl.rand`` gives the Triton kernels (``_PHILOX``), so both backends drop alike."""
        vector = self.vector_dtype is not None
        if vector and self.vector_dtype != torch.float32:
            raise NotPrintable(f"random numbers in a {self.vector_dtype} vector body")
        shape = meta_of(node).shape
        if vector:   # lanes draw consecutive offsets only where the inner loop's index is the last dim's
            along = [d for d, i in enumerate(index) if self.inner_name in i.names]
            if along != [len(shape) - 1] or c_text(index[-1]).strip("() ") != self.inner_name:
                raise NotPrintable("random numbers whose offsets are not consecutive along the inner loop")
        self.vector_dtype = None   # (the seed: one number for every lane)
        try:
            seed, _ = self.value(node.args[0], ())
        finally:
            self.vector_dtype = torch.float32 if vector else None
        terms = [f"({c_text(i)}) * {st}" for i, size, st in zip(index, shape, contiguous_strides(shape))
                 if size != 1 and i.constant != 0]
        offset = " + ".join(terms) or "0"
        self.uses_random = True
        if not vector:
            return self.tmp("float", f"symgrad_rand(static_cast<uint64_t>({seed}), {offset})"), torch.float32
        lanes = f"lanes{self.counter}"
        self.counter += 1
        self.lines += [f"float {lanes}[V::size()];",
                       f"symgrad_rand_lanes(static_cast<uint64_t>({seed}), {offset}, {lanes}, V::size());"]
        return self.tmp("V", f"V::loadu({lanes})"), torch.float32

    def gathered(self, node: fx.Node, index: tuple):
        """The source element at the position the index tensor gives (``catalog.Gather``): the index
        checked (a bad one sets ``bad``: the caller raises eager's error), wrapped where negative
        indices count from the end, and clamped, so that a bad one never reads outside memory."""
        source, index_node = node.args
        index_at, source_at = node.target.positions(node, list(index))
        dim, size = node.kwargs["dim"], meta_of(source).shape[node.kwargs["dim"]]
        i, _ = self.value(index_node, tuple(index_at))
        vector, self.vector_dtype = self.vector_dtype, None   # (the position: a scalar's statements)
        if vector is not None and i not in self.scalar_vars:
            self.vector_dtype = vector
            raise NotPrintable("a gather whose index varies along the inner loop, in a vector body")
        try:
            g = self.gathered_position(node, i, size)
        finally:
            self.vector_dtype = vector
        source_at[dim] = variable_index(g)
        value, dtype = self.value(source, tuple(source_at))
        if node.kwargs.get("zero_padding"):
            zero = CppPrinter({}, compute_dtype(dtype)).literal(sympy.Integer(0))
            if vector is not None:
                value = self.tmp("V", f"{g} == {node.kwargs['padding_idx']} ? V({zero}) : "
                                      f"{self.lane_vector(value, dtype)}")
            else:
                value = self.tmp(C_TYPE[dtype], f"{g} == {node.kwargs['padding_idx']} ? {zero} : {value}")
        return value, dtype

    def gathered_position(self, node: fx.Node, i: str, size: int) -> str:
        """The checked, wrapped and clamped position a gather's index ``i`` names (scalar statements)."""
        g = self.tmp("int64_t", f"static_cast<int64_t>({i})")
        low = -size if node.kwargs.get("wrap") else 0
        self.lines.append(f"bad |= ({g} < {low} || {g} >= {size});")
        what = meta_of(node).torch_op or "indexing"
        self.index_errors.setdefault(f"{what}: {INDEX_ASSERT} of size {size}", None)
        if node.kwargs.get("wrap"):
            g = self.tmp("int64_t", f"{g} < 0 ? {g} + {size} : {g}")
        return self.tmp("int64_t", f"{g} < 0 ? 0 : ({g} > {size - 1} ? {size - 1} : {g})")

    def slice_scatter(self, node: fx.Node, index: tuple):
        """``base`` at ``index``, or ``src`` at the slice's position where ``index`` lies in the slice
        (``SliceScatter``; as the Triton kernels' ``slice_scatter``). In a vector body the choice is one
        for every lane: the slice's dim is not the inner loop's, or it is and the slice covers whole
        registers (step 1, its start and length multiples of the widest register's lanes)."""
        base, src = node.args
        d, start, step, length = (node.kwargs[k] for k in ("dim", "start", "step", "length"))
        dtype = compute_dtype(meta_of(node).dtype)
        if dtype.is_complex:
            raise NotPrintable("a complex slice_scatter")
        base_value, base_dtype = self.value(base, index)
        base_value = self.cast(base_value, base_dtype, dtype)
        if length == 0:
            return base_value, dtype
        if index[d].position is not None:   # (a known position: whether it is in the slice is known now)
            at = index[d].position - start
            if not (0 <= at < length * step and at % step == 0):
                return base_value, dtype
            src_index = tuple(constant_index(at // step) if i == d else idx for i, idx in enumerate(index))
            src_index = broadcast_index(src_index, meta_of(node).shape, meta_of(src).shape)
            src_value, src_dtype = self.value(src, src_index)
            return self.cast(src_value, src_dtype, dtype), dtype
        inside, position = self.slice_position(node, index[d])
        src_index = broadcast_index(tuple(position if i == d else idx for i, idx in enumerate(index)),
                                    meta_of(node).shape, meta_of(src).shape)
        src_value, src_dtype = self.value(src, src_index)
        src_value = self.cast(src_value, src_dtype, dtype)
        if self.vector_dtype is not None and inside in self.lane_masks:   # (a choice per lane)
            return self.tmp("V", f"V::blendv({self.lane_vector(base_value, dtype)}, "
                                 f"{self.lane_vector(src_value, dtype)}, {inside})"), dtype
        if self.vector_dtype is not None:
            return self.tmp("V", f"{inside} ? {self.lane_vector(src_value, dtype)} : "
                                 f"{self.lane_vector(base_value, dtype)}"), dtype
        return self.tmp(C_TYPE[dtype], f"{inside} ? {src_value} : {base_value}"), dtype

    def slice_position(self, node: fx.Node, at: Index) -> tuple:
        """(whether ``at`` lies in the slice, a bool variable; its index in ``src`` along the slice's
        dim), clamped so that a position outside the slice still reads inside ``src`` (its value is
        unused). In a vector body both are the first lane's, shared by every lane, where the slice
        covers whole registers; elsewhere (a padding, a stride's slice along the inner loop) a mask
        of the lanes inside and each lane's position (``lane_slice_position``)."""
        start, step, length = (node.kwargs[k] for k in ("start", "step", "length"))
        vector, self.vector_dtype = self.vector_dtype, None   # (scalar statements)
        try:
            if vector is not None and self.inner_name in at.names:
                lanes = _WIDEST_REGISTER // vector.itemsize   # (a multiple of it is one of any register's lanes)
                if step != 1 or c_text(at).strip("() ") != self.inner_name or start % lanes or length % lanes:
                    return self.lane_slice_position(at, start, step, length, vector)
            rel = self.tmp("int64_t", f"({c_text(at)}) - {start}")
            if vector is not None and self.inner_name in at.names:
                inside = self.tmp("bool", f"{rel} >= 0 && {rel} < {length}")
                last = f"{length} - static_cast<int64_t>(V::size())"
                position = self.tmp("int64_t", f"{rel} < 0 ? 0 : ({rel} > {last} ? {last} : {rel})")
                self.consecutive[position] = length   # (lane l reads src's element position + l)
                return inside, Index(position, frozenset({position, self.inner_name}))
            inside = f"{rel} >= 0 && {rel} < {length * step}" + (f" && {rel} % {step} == 0" if step != 1 else "")
            inside = self.tmp("bool", inside)
            position = self.tmp("int64_t", f"{rel} < 0 ? 0 : ({rel} / {step} > {length - 1} ? {length - 1} : "
                                           f"{rel} / {step})")
            return inside, variable_index(position)
        finally:
            self.vector_dtype = vector

    def lane_slice_position(self, at: Index, start: int, step: int, length: int, vector) -> tuple:
        """``slice_position`` in a vector body where lanes fall inside and outside the slice apart:
        (a mask variable, in ``lane_masks``: its lanes all ones where the lane's position lies in the
        slice, computed lane by lane as a strided load's lanes are; the position in ``src``, clamped,
        as an index of its own text, so that a load at it is each lane's own)."""
        rel = compose("{} - {}", at, constant_index(start), value=lambda a, s: a - s)
        last = constant_index(length - 1)
        position = compose("{} < 0 ? 0 : ({} / {} > {} ? {} : {} / {})", rel, rel, constant_index(step), last, last,
                           rel, constant_index(step), value=lambda r, _r, st, la, _la, _r2, _st: 0 if r < 0 else
                           min(r // st, la))
        inside = f"{c_text(rel)} >= 0 && {c_text(rel)} < {length * step}" + \
            (f" && {c_text(rel)} % {step} == 0" if step != 1 else "")
        mask = f"mask{self.counter}"
        self.counter += 1
        ctype = C_TYPE[vector]
        self.fill_lanes(f"{mask}_lanes", ctype, (at,), f"({inside}) ? {ctype}(1) : {ctype}(0)")
        self.lines.append(f"const V {mask} = V::loadu({mask}_lanes) != V(0);")
        self.lane_masks.add(mask)
        return mask, position

    def fill_lanes(self, array: str, ctype: str, index: tuple, value: str) -> None:
        """Statements filling ``array``, a register's worth of ``ctype``, lane by lane with ``value``: the
        variables ``index`` reads that advance with the lanes (the inner loop's, a slice's
        ``consecutive`` position) shadowed in a block of their own, lane l's the first lane's + l."""
        moving = sorted({self.inner_name} | {n for i in index for n in i.names if n in self.consecutive})
        firsts = [f"const int64_t {n}_l0 = {n};" for n in moving]
        shadows = " ".join(f"const int64_t {n} = {n}_l0 + l;" for n in moving)
        self.lines += [f"alignas(64) {ctype} {array}[V::size()];", "{", *firsts,
                       f"  for (int64_t l = 0; l < static_cast<int64_t>(V::size()); ++l) {{ {shadows} "
                       f"{array}[l] = {value}; }}", "}"]

    def load(self, node: fx.Node, index: tuple):
        if node not in self.load_names:
            raise NotPrintable(f"{node.name} is read but is no argument of the kernel")
        dtype = meta_of(node).dtype
        arg = self.load_names[node]
        shape = meta_of(node).shape
        terms = [f"({c_text(i)}) * {arg}_s{d}" for d, (i, size) in enumerate(zip(index, shape))
                 if size != 1 and i.constant != 0]
        offset = " + ".join(terms) or "0"
        if dtype.is_complex:   # (interleaved: the real part, then the imaginary part)
            if self.vector_dtype is not None:
                return self.complex_lanes(node, index, arg, offset), dtype
            part = C_TYPE[dtype.to_real()]
            return (self.tmp(part, f"{arg}[2 * ({offset})]"), self.tmp(part, f"{arg}[2 * ({offset}) + 1]")), dtype
        if self.vector_dtype is None:
            return self.tmp(C_TYPE[dtype], f"{arg}[{offset}]"), dtype
        if dtype != self.vector_dtype:
            raise NotPrintable(f"a {dtype} load in a {self.vector_dtype} vector body")
        along = [d for d, i in enumerate(index) if self.inner_name in i.names]
        if not along:   # the same element for every lane: broadcast
            return self.tmp("V", f"V({arg}[{offset}])"), dtype
        # lanes read consecutive elements only where the inner loop's index is the load's last dim
        # itself (the contiguous function's stride there is 1)
        last = len(shape) - 1
        if (along == [last] and c_text(index[last]).strip("() ") in {self.inner_name, *self.consecutive}) \
                or self.lanes_consecutive(index, dtype):
            return self.tmp("V", f"V::loadu({arg} + {offset})"), dtype
        # lanes apart (a strided or transposed read): each lane's element at its own position, then
        # one register
        lanes = f"lanes{self.counter}"
        self.counter += 1
        self.fill_lanes(lanes, C_TYPE[dtype], index, f"{arg}[{offset}]")
        return self.tmp("V", f"V::loadu({lanes})"), dtype

    def lanes_consecutive(self, index: tuple, dtype: torch.dtype) -> bool:
        """Whether a register's lanes read consecutive elements at ``index`` (its last dim's index
        advancing by one a lane, every other dim's the same for every lane) wherever a vector body
        starts one: checked by evaluating the index (``kernel_text.evaluate``) at each register's
        lanes over the moving variables' ranges (the inner loop's, a slice's ``consecutive``
        position), for registers of the narrowest and the widest SIMD width. A dim whose index also
        reads another variable (a row's), or too many cases to check: not known, False."""
        ranges = {self.inner_name: self.plan.shape[-1], **self.consecutive}
        moving = [leaves(i) & set(ranges) for i in index]
        if not moving[-1] or any(m and leaves(i) - m for m, i in zip(moving, index)):
            return False
        names = sorted(set().union(*moving))
        if len(names) != 1:   # (one moving variable: its registers' starts enumerated)
            return False
        name, extent = names[0], ranges[names[0]]
        dims = [d for d, m in enumerate(moving) if m]
        for width in (_NARROWEST_REGISTER // dtype.itemsize, _WIDEST_REGISTER // dtype.itemsize):
            if extent // width * width > _LANE_CHECKS:
                return False
            for start in range(0, extent - width + 1, width):
                first = [evaluate(index[d], {name: start}) for d in dims]
                if None in first:
                    return False
                for lane in range(1, width):
                    at = [evaluate(index[d], {name: start + lane}) for d in dims]
                    if at[:-1] != first[:-1] or at[-1] != first[-1] + lane:
                        return False
        return True

    def complex_view(self, node: fx.Node, index: tuple):
        """``view_as_complex``: the two parts read at positions 0 and 1 of the last dim;
        ``view_as_real``: the part the last dim's index names (where it varies, a choice per element:
        scalar bodies only)."""
        if node.target.name == "view_as_complex":
            re, dtype = self.value(node.args[0], index + (ZERO,))
            im, _ = self.value(node.args[0], index + (constant_index(1),))
            return (re, im), meta_of(node).dtype
        (re, im), dtype = self.value(node.args[0], index[:-1])
        if index[-1].position is not None:
            return (re, im)[index[-1].position], dtype.to_real()
        if self.vector_dtype is not None:
            raise NotPrintable("a complex value's parts chosen along the inner loop, in a vector body")
        return self.tmp(C_TYPE[dtype.to_real()], f"({c_text(index[-1])}) == 0 ? {re} : {im}"), dtype.to_real()

    def complex_lanes(self, node: fx.Node, index: tuple, arg: str, offset: str) -> tuple:
        """A complex load's (real parts, imaginary parts) in a vector body: two registers of its
        interleaved parts from the first lane's element, deinterleaved (consecutive elements along
        the inner loop only; one element for every lane: its parts broadcast)."""
        if meta_of(node).dtype.to_real() != self.vector_dtype:
            raise NotPrintable(f"a {meta_of(node).dtype} load in a {self.vector_dtype} vector body")
        along = [d for d, i in enumerate(index) if self.inner_name in i.names]
        last = len(meta_of(node).shape) - 1
        if not along:
            return (self.tmp("V", f"V({arg}[2 * ({offset})])"), self.tmp("V", f"V({arg}[2 * ({offset}) + 1])"))
        if along != [last] or c_text(index[last]).strip("() ") not in {self.inner_name, *self.consecutive}:
            raise NotPrintable("a complex load whose elements are not consecutive along the inner loop")
        pair = f"p{self.counter}"
        self.counter += 1
        self.lines.append(f"const auto {pair} = at::vec::deinterleave2(V::loadu({arg} + 2 * ({offset})), "
                          f"V::loadu({arg} + 2 * ({offset}) + V::size()));")
        return self.tmp("V", f"{pair}.first"), self.tmp("V", f"{pair}.second")

    def complex_store(self, var: tuple, out: str, at: str) -> str:
        """A vector body's complex value stored at element ``at`` of ``out``: its parts interleaved
        into two registers."""
        re, im = (self.lane_vector(v, self.vector_dtype) for v in var)
        pair = f"p{self.counter}"
        self.counter += 1
        return (f"{{ const auto {pair} = at::vec::interleave2({re}, {im}); ({pair}.first).store({out} + 2 * ({at})); "
                f"({pair}.second).store({out} + 2 * ({at}) + V::size()); }}")

    def cast(self, var, have: torch.dtype, want: torch.dtype):
        if have == want:
            return var
        if have.is_complex or want.is_complex:   # (a pair of parts)
            if not want.is_complex:
                raise NotPrintable(f"a {have} -> {want} conversion")
            part = want.to_real()
            if have.is_complex:
                return tuple(self.cast(v, have.to_real(), part) for v in var)
            zero = CppPrinter({}, part).literal(sympy.Integer(0))
            if self.vector_dtype is not None:
                return self.cast(var, have, part), self.tmp("V", f"V({zero})")
            return self.cast(var, have, part), zero
        if self.vector_dtype is not None and var in self.float_ints and want == self.vector_dtype:
            return var   # (exact integers held as floats already)
        if self.vector_dtype is not None and var in self.scalar_vars:   # (cast as the scalar it is)
            held, self.vector_dtype = self.vector_dtype, None
            try:
                var = self.cast(var, have, want)
            finally:
                self.vector_dtype = held
            self.scalar_vars.add(var)
            return var
        if self.vector_dtype is not None:
            if have != torch.bool or want != self.vector_dtype:
                raise NotPrintable(f"a {have} -> {want} conversion in a vector body")
            return self.tmp("V", f"V::blendv(V(0), V(1), {var})")   # (a mask: lanes all ones or zeros)
        return self.tmp(C_TYPE[want], f"static_cast<{C_TYPE[want]}>({var})")

    def pointwise(self, node: fx.Node, index: tuple):
        out_shape, out_dtype, expr = meta_of(node).shape, meta_of(node).dtype, meta_of(node).expr
        if out_dtype in (torch.float16, torch.bfloat16, torch.complex32):
            raise NotPrintable(f"{out_dtype} math")
        name = getattr(node.target, "name", "")
        is_compare = name in ("lt", "le", "gt", "ge", "eq", "ne")
        args = [self.value(arg, broadcast_index(index, out_shape, meta_of(arg).shape)) for arg in node.args]
        if any(dtype.is_complex for _, dtype in args):
            return self.complex_pointwise(node, expr, args, compute_dtype(out_dtype))
        if is_compare:
            want = compute_dtype(torch.promote_types(args[0][1], args[1][1]) if len(args) == 2 else args[0][1])
        else:
            want = compute_dtype(out_dtype)
        vector = self.vector_dtype is not None
        if vector and name in _MASK_LOGIC and all(have == torch.bool for _, have in args):
            # masks combined in a vector body: their bits (a comparison's lanes are all ones or zero)
            masks = [f"({self.lane_vector(var, torch.bool, True)})" for var, _ in args]
            return self.tmp("bool", _MASK_LOGIC[name](*masks)), torch.bool
        if vector and is_compare and not want.is_floating_point and \
                all(var in self.scalar_vars or var in self.float_ints for var, _ in args):
            # integers compared in a vector body: an iota's exact floats with broadcast integers (a
            # class index against the row's target), compared as floats (both below 2**24: exact)
            want = self.vector_dtype
            args = [(var, want if var in self.float_ints else have) for var, have in args]
        names = {}
        for i, (var, have) in enumerate(args):
            symbol = Y.REAL_ARGS[i]
            condition = (name == "where" and i == 0) or (name == "pointwise" and have == torch.bool
                                                          and _used_as_condition(expr, symbol))
            names[symbol] = var if condition else self.cast(var, have, want)
            if vector:
                names[symbol] = self.lane_vector(names[symbol], torch.bool if condition else want, condition)
        if vector and want != self.vector_dtype:
            raise NotPrintable(f"{want} math in a {self.vector_dtype} vector body")
        replacements, (reduced,) = sympy.cse([expr], symbols=sympy.numbered_symbols("c"), order="none")
        printer = (VectorPrinter if self.vector_dtype is not None else CppPrinter)(names, want)
        for symbol, sub in replacements:
            names[symbol] = printer(sub) if sub.is_number else self.tmp(C_TYPE[want], printer(sub))
        text = printer(reduced)
        if is_compare:   # (a vector body's comparison is a mask)
            return self.tmp("bool", text), torch.bool
        if self.vector_dtype is not None:
            return self.tmp("V", text), want
        return self.tmp(C_TYPE[want], f"static_cast<{C_TYPE[want]}>({text})"), want

    def complex_pointwise(self, node: fx.Node, expr, args: list, want: torch.dtype):
        """A pointwise op with complex operands or result, as real arithmetic on the parts
        (``realify``, as the Triton kernels compute it). Scalar bodies only."""
        if getattr(node.target, "name", "") in ("lt", "le", "gt", "ge", "eq", "ne"):
            raise NotPrintable("a complex comparison")
        part = want.to_real() if want.is_complex else want
        vector = self.vector_dtype is not None
        if vector and part != self.vector_dtype:
            raise NotPrintable(f"{want} math in a {self.vector_dtype} vector body")
        names = {}
        for i, (var, have) in enumerate(args):
            if have.is_complex:
                re, im = var
                names[RE[i]], names[IM[i]] = (self.cast(v, have.to_real(), part) for v in (re, im))
            else:
                names[Y.REAL_ARGS[i]] = self.cast(var, have, part)
        if vector:   # (parts the same for every lane: broadcast)
            names = {symbol: self.lane_vector(var, part) for symbol, var in names.items()}
        re_expr, im_expr = realify(expr)
        printer = (VectorPrinter if vector else CppPrinter)(names, part)
        ctype = C_TYPE[part]
        replacements, reduced = sympy.cse([re_expr, im_expr] if want.is_complex else [re_expr],
                                          symbols=sympy.numbered_symbols("c"), order="none")
        for symbol, sub in replacements:
            names[symbol] = printer(sub) if sub.is_number else self.tmp(ctype, printer(sub))
        parts = tuple(self.tmp(ctype, printer(e) if vector else f"static_cast<{ctype}>({printer(e)})") for e in reduced)
        return (parts if want.is_complex else parts[0]), want

    # -- the kernel ------------------------------------------------------------------------
    def write(self) -> CppKernelSource:
        if self.over_columns:
            return self.write_columns()
        if self.plan.reduce_dims:
            return self.write_rows()
        shape = tuple(self.plan.shape)
        inner = shape[-1] if shape else 1
        rows = numel(shape[:-1]) if shape else 1
        index, header = [], []
        for d, size in enumerate(shape[:-1]):
            if size == 1:
                index.append(ZERO)
                continue
            stride = numel(shape[d + 1:-1])
            term = "x" if stride == 1 else f"(x / {stride})"
            if stride * size < rows:
                term = f"({term} % {size})"
            header.append(f"const int64_t i{d} = {term};")
            index.append(variable_index(f"i{d}"))
        if shape:
            index.append(ZERO if inner == 1 else variable_index(self.inner_name))
        index = tuple(index)
        scalar = self.body(index, shape, inner)
        vector = None
        dtype = self._one_float_dtype()
        if dtype is not None and shape and inner > 1:
            try:
                writer = _CppWriter(self.plan, self.buffers, self.loads, self.stores, vector_dtype=dtype)
                vector = writer.body(index, shape, inner)
            except NotPrintable:   # (the scalar loop alone: the compiler may still vectorize it)
                vector = None
        return self.module(header, scalar, vector, dtype, rows, inner, len(shape))

    def _one_float_dtype(self):
        """The dtype of every buffer where they share one float dtype (a vector body's), else None.
        (Integer and bool inputs are not counted: read where they are the same for every lane, a row's
        target, a random number's seed, they are scalars; elsewhere the vector body is not written.)"""
        dtypes = {_element_dtype(meta_of(n).dtype) for n in [*self.loads, *self.stores]
                  if not (n in self.loads and not (meta_of(n).dtype.is_floating_point or meta_of(n).dtype.is_complex))}
        return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64} else None

    def body(self, index: tuple, shape: tuple, inner: int) -> list:
        """The statements computing and storing every output at ``index`` (one element, or in the
        vector body one register's worth starting there)."""
        self.lines, self.values, self.counter = [], {}, 0
        stores = []
        at = f"x * {inner} + {self.inner_name}" if shape and inner != 1 else "x"
        for out, root in enumerate(self.stores):
            if tuple(meta_of(root).shape) != shape:
                raise NotPrintable("an output stored in another shape than the kernel's space")
            var, have = self.value(root, index)
            dtype = meta_of(root).dtype
            if self.vector_dtype is not None:
                if have != dtype:
                    raise NotPrintable(f"a {have} value stored as {dtype} in a vector body")
                stores.append(self.complex_store(var, f"out{out}", at) if dtype.is_complex
                              else f"({self.lane_vector(var, have)}).store(out{out} + {at});")
            elif dtype.is_complex:
                var = self.cast(var, have, dtype)
                stores += [f"out{out}[2 * ({at})] = {var[0]};", f"out{out}[2 * ({at}) + 1] = {var[1]};"]
            else:
                stores.append(f"out{out}[{at}] = static_cast<{C_TYPE[dtype]}>({var});")
        return self.lines + stores

    def module(self, header, scalar, vector, dtype, rows: int, inner: int, ndim: int) -> CppKernelSource:
        """Two functions: ``<name>`` for contiguous inputs, their strides constants (a stride of 1 is
        known: the inner loop is the vector body, at::vec's, then the scalar one for the tail), and
        ``<name>_strided`` taking each input's strides as arguments (any layout, scalar). The vector
        parts are left out where the build has no ATen headers (``SYMGRAD_SCALAR_ONLY``)."""
        return self.assemble(self.loop(header, scalar, vector, rows, inner, ndim),
                             self.loop(header, scalar, None, rows, inner, ndim), dtype if vector is not None else None)

    def assemble(self, fast: list, plain: list, vector_dtype) -> CppKernelSource:
        """The translation unit: ``<name>`` running ``fast`` for contiguous inputs (their strides
        constants), ``<name>_strided`` running ``plain`` with each input's strides as arguments;
        ``vector_dtype``: ``fast`` holds a vector body over that dtype (at::vec's headers)."""
        pointers, strided, constants = [], [], []   # (strided: each input's pointer, then its strides)
        for node, arg in self.load_names.items():
            shape = meta_of(node).shape
            pointers.append(f"const {C_TYPE[_element_dtype(meta_of(node).dtype)]}* __restrict__ {arg}")
            strided += [pointers[-1]] + [f"int64_t {arg}_s{d}" for d in range(len(shape))]
            constants += [f"    constexpr int64_t {arg}_s{d} = {st};"
                          for d, st in enumerate(contiguous_strides(shape))]
        outputs = [f"{C_TYPE[_element_dtype(meta_of(n).dtype)]}* __restrict__ out{j}"
                   for j, n in enumerate(self.stores)]
        prelude = []
        if vector_dtype is not None:   # (first: the build may use its precompiled form, runtime.cpp_build)
            prelude += ["#ifndef SYMGRAD_SCALAR_ONLY", f'#include "{VECTOR_HEADER}"',
                        f"using V = at::vec::Vectorized<{C_TYPE[vector_dtype]}>;", VECTOR_HELPERS, "#endif"]
        prelude += ["#include <cmath>", "#include <cstdint>"] + ([_PHILOX] if self.uses_random else [])
        def text(name):
            return "\n".join([
                *prelude, "",
                f'extern "C" int {name}({", ".join(pointers + outputs)}) {{', *constants, "    int bad = 0;", *fast,
                "    return bad;", "}", "",
                f'extern "C" int {name}_strided({", ".join(strided + outputs)}) {{', "    int bad = 0;", *plain,
                "    return bad;", "}", ""])
        # NOTE: named by all it compiles: its helpers (a changed helper is another library, not a stale
        # one) and the contiguous inputs' strides it is built with (constants: a [4, 4] input's slice and
        # a [4, 3] input's, both [4, 2], were one name, and the second loaded the first's library)
        name = f"cpp_kernel_{hashlib.sha256(text('cpp_kernel').encode()).hexdigest()[:16]}"
        source = text(name)
        return CppKernelSource(name, source, tuple((len(meta_of(n).shape), meta_of(n).dtype) for n in self.loads),
                               tuple(meta_of(n).dtype for n in self.stores), vector_dtype is not None,
                               " / ".join(self.index_errors) or None)

    def write_rows(self) -> CppKernelSource:
        """A kernel that reduces some dims: per row, the kept dims' element (spread over threads), a
        loop per reduction over the reduced dims (in the order their values are needed), the reduced
        values stored at the row, then one loop computing and storing the row's elementwise outputs.
        Vector bodies where the one reduced dim is the last (a row is consecutive elements); dims
        reduced elsewhere (a batch norm's N, H, W) in scalar loops."""
        shape, rdims = tuple(self.plan.shape), tuple(self.plan.reduce_dims)
        kept = [d for d in range(len(shape)) if d not in rdims]
        trailing = kept == list(range(len(kept)))
        self.row_names = frozenset(f"i{d}" for d in kept)
        rows, self.rnumel = numel([shape[d] for d in kept]), numel([shape[d] for d in rdims])
        index, header, self.r_header = [], [], []
        for d, size in enumerate(shape):
            if size == 1:
                index.append(ZERO)
                continue
            group, var, extent = (kept, "x", rows) if d in kept else (rdims, "r", self.rnumel)
            stride = numel([shape[e] for e in group if e > d])
            term = var if stride == 1 else f"({var} / {stride})"
            if stride * size < extent:
                term = f"({term} % {size})"
            (header if d in kept else self.r_header).append(f"const int64_t i{d} = {term};")
            index.append(variable_index(f"i{d}"))
        self.base_index = tuple(index)
        # where an elementwise output's element is stored (contiguous: the row's elements are
        # consecutive only where the reduced dims are the trailing ones)
        self.element_at = f"x * {self.rnumel} + r" if trailing else " + ".join(
            [f"i{d} * {st}" for d, st in enumerate(contiguous_strides(shape)) if shape[d] != 1]) or "0"
        # vector bodies where one float dtype is used and the row is one dim (its index is r itself),
        # or the last dim is reduced in whole registers (a batch norm's W: a register's lanes share
        # every other index)
        vector = self._one_float_dtype()
        last = len(shape) - 1
        if not (trailing and len(rdims) == 1 and shape[-1] > 1) and \
                not (vector is not None and last in rdims and shape[last] % (_WIDEST_REGISTER // vector.itemsize) == 0):
            vector = None
        fast = self.rows_loop(header, rows, vector)
        vectorized = self.used_vector
        plain = self.rows_loop(header, rows, None)   # (the strided function: its loads' lanes need not be consecutive)
        return self.assemble(fast, plain, vector if vectorized else None)

    def rows_loop(self, header: list, rows: int, vector_dtype) -> list:
        """The loop over rows, its reductions and elements written with vector bodies over
        ``vector_dtype`` where they print (None: scalar loops only)."""
        self.lines, self.values, self.counter, self.row_lines, self.row_values = [], {}, 0, [], {}
        self.row_invariant = {}
        self.row_vector_dtype, self.used_vector = vector_dtype, False
        self.row_cache, self.used_buffers = {}, set()
        row_stores, elements, columns = [], [], []
        for out, root in enumerate(self.stores):
            dtype = meta_of(root).dtype
            if root in self.plan.columns:   # partial column sums over a chunk of rows (``columns_loop``)
                columns.append(root)
                continue
            if dtype.is_complex and (root in self.plan.epilogue or kind_of(root) == OpKind.REDUCTION):
                raise NotPrintable("a complex value stored per row")
            if root in self.plan.epilogue:   # a row's value computed from its reductions (layer norm's rstd)
                var = self.row_value(root, rows)
                row_stores.append(f"out{out}[x] = static_cast<{C_TYPE[dtype]}>({var});")
                continue
            if kind_of(root) == OpKind.REDUCTION:
                if numel(meta_of(root).shape) != rows:
                    raise NotPrintable("a reduction stored in another shape than its rows'")
                if root not in self.row_values:
                    self.row_values[root] = self.reduce_row(root)
                var, _ = self.row_values[root]
                row_stores.append(f"out{out}[x] = static_cast<{C_TYPE[dtype]}>({var});")
                continue
            if numel(meta_of(root).shape) != numel(self.plan.shape):
                raise NotPrintable("an output stored in another shape than the kernel's space")
            elements.append(root)   # (of another shape: the space reshaped, ``root_index``)
        element_loop = self.element_loop(elements, columns)   # (first: the reductions it reads are written then)
        unused = [buffer for buffer, _ in self.row_cache.values() if buffer not in self.used_buffers]
        body = [f"        {line}" for line in header + self.row_lines + row_stores + element_loop
                if not any(buffer in line for buffer in unused)]   # (a buffer no later loop read)
        if columns:
            return self.columns_loop(columns, rows, body)
        parallel = rows > 1 and rows * self.rnumel >= PARALLEL_MIN
        return ([_PARALLEL] if parallel else []) + \
            [f"    for (int64_t x = 0; x < {rows}; ++x) {{", *body, "    }"]

    def columns_loop(self, columns: list, rows: int, row_body: list) -> list:
        """Rows in chunks, one chunk a thread's task: the chunk's column sums (one accumulator per
        position of the row, ``col<j>``) added to by each of its rows' element loop, then stored as
        the chunk's partial sums (the next kernel adds the chunks up)."""
        chunks = self.plan.columns[columns[0]][1]
        if rows % chunks:
            raise NotPrintable("rows not a whole number of chunks")
        per_chunk, R = rows // chunks, self.rnumel
        start, stores = [], []
        for root in columns:
            j, ctype = self.stores.index(root), C_TYPE[compute_dtype(meta_of(root).dtype)]
            start += [f"{ctype} col{j}[{R}];", f"for (int64_t k = 0; k < {R}; ++k) col{j}[k] = 0;"]
            stores.append(f"for (int64_t k = 0; k < {R}; ++k) out{j}[chunk * {R} + k] = "
                          f"static_cast<{C_TYPE[meta_of(root).dtype]}>(col{j}[k]);")
        parallel = chunks > 1 and rows * R >= PARALLEL_MIN
        return ([_PARALLEL] if parallel else []) + [
            f"    for (int64_t chunk = 0; chunk < {chunks}; ++chunk) {{", *[f"        {line}" for line in start],
            f"    for (int64_t x = chunk * {per_chunk}; x < (chunk + 1) * {per_chunk}; ++x) {{", *row_body, "    }",
            *[f"        {line}" for line in stores], "    }"]

    def write_columns(self) -> CppKernelSource:
        """A kernel that reduces its leading dims (a weight's gradient summed over the batch), or the
        rows of each chunk of rows, ``(chunks, M / chunks, N)`` reducing dim 1 (``KernelPlan.
        loops_over_chunks``: partial sums, beside the (..., N) values it sums): per chunk, blocks of
        columns, the pairs spread over threads; each block's accumulators, one per column, updated
        row by row by an inner loop over the block's consecutive columns (no column's sum depends on
        another's): a vector body over a register's worth of columns where the kept part is one dim
        and one float dtype is used, the scalar body for the rest, then the sums stored."""
        shape, rdims = tuple(self.plan.shape), tuple(self.plan.reduce_dims)
        first = 1 if self.chunked else 0        # (dim 0: the chunk, ``o``)
        lead = first + len(rdims)
        outer, reduced, kept = numel(shape[:first]), numel(shape[first:lead]), numel(shape[lead:])
        index, r_lines, c_lines = [ZERO if shape[0] == 1 else variable_index("i0")] if first else [], [], []
        if first and shape[0] != 1:
            r_lines.append("const int64_t i0 = o;")
        for d, size in enumerate(shape[first:], first):
            if size == 1:
                index.append(ZERO)
                continue
            var, extent = ("r", reduced) if d < lead else ("c", kept)
            stride = numel(shape[d + 1:lead]) if d < lead else numel(shape[d + 1:])
            term = var if stride == 1 else f"({var} / {stride})"
            if stride * size < extent:
                term = f"({term} % {size})"
            (r_lines if d < lead else c_lines).append(f"const int64_t i{d} = {term};")
            index.append(variable_index(f"i{d}"))
        self.base_index = index = tuple(index)
        self.element_at = f"(o * {reduced} + r) * {kept} + c"
        row_index = {}
        for root in self.stores:
            if kind_of(root) != OpKind.REDUCTION and tuple(meta_of(root).shape) != shape:
                row_index[root] = self.chunk_row_index(root, shape)
        accumulators, finals, run_ends = self.column_accumulators(outer, kept)
        # the vector body's lanes are consecutive columns: the kept part must be one dim (its index c)
        self.row_vector_dtype = self._one_float_dtype() if lead == len(shape) - 1 and kept > 1 else None
        vector, (scalar, scalar_step) = self.vector_and_scalar(lambda: self.column_step(index, kept, row_index))
        column_loop = ["            int64_t c = cb;"]
        if vector is not None:
            column_loop += ["#ifndef SYMGRAD_SCALAR_ONLY", "            for (; c + V::size() <= ce; c += V::size()) {",
                            *[f"                {line}" for line in c_lines + vector[0] + vector[1]],
                            "            }", "#endif"]
        column_loop += ["            for (; c < ce; ++c) {",
                        *[f"                {line}" for line in c_lines + scalar + scalar_step], "            }"]
        blocks = -(-kept // _COLUMN_BLOCK)
        parallel = outer * blocks > 1 and outer * reduced * kept >= PARALLEL_MIN

        def loop(columns):
            return ([_PARALLEL] if parallel else []) + [
                f"    for (int64_t task = 0; task < {outer * blocks}; ++task) {{",
                f"        const int64_t o = task / {blocks}, block = task % {blocks};",
                f"        const int64_t cb = block * {_COLUMN_BLOCK};",
                f"        const int64_t ce = cb + {_COLUMN_BLOCK} < {kept} ? cb + {_COLUMN_BLOCK} : {kept};",
                *[f"        {line}" for line in accumulators],
                f"        for (int64_t r = 0; r < {reduced}; ++r) {{",
                *[f"            {line}" for line in r_lines], *columns,
                *([f"            if ((r + 1) % {_ROW_RUN} == 0 || r + 1 == {reduced}) {{",
                   *[f"                {line}" for line in run_ends], "            }"] if run_ends else []),
                "        }",
                "        for (int64_t c = cb; c < ce; ++c) {", *[f"            {line}" for line in finals], "        }",
                "    }"]
        # (the strided function: scalar only, its loads' lanes need not be consecutive)
        plain = column_loop if vector is None else column_loop[:1] + column_loop[column_loop.index("#endif") + 1:]
        return self.assemble(loop(column_loop), loop(plain), self.row_vector_dtype if vector is not None else None)

    def column_accumulators(self, outer: int, kept: int) -> tuple:
        """(declarations, final stores, statements ending a run of rows) of a column-sum kernel's
        accumulators: per sum a block's worth of columns (a complex sum: one per part), and for sums
        the run totals in double."""
        accumulators, finals, run_ends = [], [], []
        for out, root in enumerate(self.stores):
            dtype = meta_of(root).dtype
            if kind_of(root) != OpKind.REDUCTION:
                continue
            name, acc_dtype = root.target.name, compute_dtype(dtype)
            if name not in ("sum", "mean", "amax") or (acc_dtype.is_complex and name == "amax") \
                    or numel(meta_of(root).shape) != outer * kept:
                raise NotPrintable(f"a {name} over columns of {acc_dtype}")
            part = acc_dtype.to_real() if acc_dtype.is_complex else acc_dtype
            ctype, init = C_TYPE[part], "-INFINITY" if name == "amax" else "0"
            for k, acc in enumerate(_parts(f"acc{out}", acc_dtype)):
                accumulators.append(f"{ctype} {acc}[{_COLUMN_BLOCK}];")
                accumulators.append(f"for (int64_t k = 0; k < {_COLUMN_BLOCK}; ++k) {acc}[k] = {init};")
                at = f"{acc}[c - cb]"
                if name != "amax":
                    # NOTE: rows added in runs of ``_ROW_RUN`` into the lanes' accumulators, each run's sums
                    # then added into totals in double: the error grows with a run, not with the whole batch
                    accumulators += [f"double {acc}_t[{_COLUMN_BLOCK}];",
                                     f"for (int64_t k = 0; k < {_COLUMN_BLOCK}; ++k) {acc}_t[k] = 0;"]
                    run_ends.append(f"for (int64_t k = 0; k < {_COLUMN_BLOCK}; ++k) {{ {acc}_t[k] += {acc}[k]; "
                                    f"{acc}[k] = 0; }}")
                    at = f"static_cast<{ctype}>({acc}_t[c - cb])"
                scale = root.target.scale(root)
                total = at if scale == 1.0 else f"{at} * {CppPrinter({}, part).literal(sympy.Float(scale))}"
                where = f"2 * (o * {kept} + c) + {k}" if acc_dtype.is_complex else f"o * {kept} + c"
                finals.append(f"out{out}[{where}] = static_cast<{C_TYPE[_element_dtype(dtype)]}>({total});")
        return accumulators, finals, run_ends

    def chunk_row_index(self, root: fx.Node, shape: tuple) -> tuple:
        """The index of an elementwise root of shape (..., N) in a kernel over its rows' chunks
        (chunks, M / chunks, N): the kernel's index through the reshape between the two shapes, as
        the reshape's own index map writes it (``views._reshape_index``), so that a value both the
        sums read (through that reshape) and the root stores is one value of this kernel, computed
        once (not a second time, its exp and erf calls too, which the C++ compiler cannot merge)."""
        rshape = tuple(meta_of(root).shape)
        if not self.chunked or numel(rshape) != numel(shape) or rshape[-1] != shape[-1]:
            raise NotPrintable("an output stored in another shape than the kernel's space")
        return tuple(i.folded() for i in _reshape_index(rshape, shape, list(self.base_index)))

    def column_step(self, index: tuple, kept: int, row_index: dict) -> list:
        """What one column (or, in the vector body, a register's worth of columns from ``c``) does
        at row ``r``: each sum's accumulator added to, each elementwise output stored (one of
        another shape than the kernel's at its own index, ``row_index``)."""
        updates, elements = [], []
        vector = self.vector_dtype is not None
        for out, root in enumerate(self.stores):
            dtype = meta_of(root).dtype
            if kind_of(root) != OpKind.REDUCTION:
                var, have = self.value(root, row_index.get(root, index))
                if vector and have != dtype:
                    raise NotPrintable(f"a {have} value stored as {dtype} in a vector body")
                if dtype.is_complex:
                    var = self.cast(var, have, dtype)
                    elements += [self.complex_store(var, f"out{out}", self.element_at)] if vector else [
                        f"out{out}[2 * ({self.element_at})] = {var[0]};",
                        f"out{out}[2 * ({self.element_at}) + 1] = {var[1]};"]
                    continue
                elements.append(f"({self.lane_vector(var, have)}).store(out{out} + {self.element_at});" if vector
                                else f"out{out}[{self.element_at}] = static_cast<{C_TYPE[dtype]}>({var});")
                continue
            var, have = self.value(root.args[0], index)
            var = self.cast(var, have, compute_dtype(dtype))
            at = f"acc{out}[c - cb]"
            if dtype.is_complex:   # (one accumulator per part)
                updates += [f"(V::loadu({acc} + (c - cb)) + {self.lane_vector(v, self.vector_dtype)})"
                            f".store({acc} + (c - cb));" if vector else f"{acc}[c - cb] += {v};"
                            for acc, v in zip(_parts(f"acc{out}", dtype), var)]
                continue
            if vector:
                var = self.lane_vector(var, compute_dtype(dtype))
                held = f"V::loadu(acc{out} + (c - cb))"
                new = f"at::vec::maximum({held}, {var})" if root.target.name == "amax" else f"{held} + {var}"
                updates.append(f"({new}).store(acc{out} + (c - cb));")
            else:
                updates.append(f"{at} = ({var} > {at} || {var} != {var}) ? {var} : {at};"
                               if root.target.name == "amax" else f"{at} += {var};")
        return updates + elements

    def row_value(self, root: fx.Node, rows: int) -> str:
        """An epilogue root's value at the current row, computed at row level after the reductions
        it reads (their loops are written first, as it asks for them)."""
        shape, kept = meta_of(root).shape, [d for d in range(len(self.plan.shape)) if d not in self.plan.reduce_dims]
        if numel(shape) != rows:
            raise NotPrintable("a row value stored in another shape than its rows'")
        if len(shape) == len(self.plan.shape):   # (keepdim: 1 where the row was)
            index = tuple(self.base_index[d] if d in kept else ZERO for d in range(len(shape)))
        elif len(shape) == len(kept):
            index = tuple(self.base_index[d] for d in kept)
        else:
            raise NotPrintable("a row value of another rank")
        held, self.lines = self.lines, []
        try:
            var, have = self.value(root, index)
            var = self.cast(var, have, meta_of(root).dtype)
            self.row_lines += self.lines
        finally:
            self.lines = held
        return var

    def element_loop(self, roots: list, columns=()) -> list:
        """The loop computing and storing a reducing kernel's elementwise outputs over the row, and
        adding each column sum's value at the element to its chunk's accumulator (``columns``)."""
        if not roots and not columns:
            return []
        # the reductions the loop reads, written first (in the kernel's order), so that the values
        # their loops keep in row buffers are there for both of this loop's bodies to read
        reads = set()
        for root in [*roots, *(self.plan.columns[c][0] for c in columns)]:
            reads |= self.pending_reads(root, set(self.row_values))
        for node in [r for r in self.plan.roots if r in reads]:
            if node not in self.row_values:
                self.row_values[node] = self.reduce_row(node)

        def stores():
            out = []
            for root in columns:
                value, _ = self.plan.columns[root]
                dtype = compute_dtype(meta_of(root).dtype)
                var, have = self.value(value, self.base_index)
                var = self.cast(var, have, dtype)
                j = self.stores.index(root)
                if self.vector_dtype is not None:
                    var = self.lane_vector(var, dtype)
                out.append(f"(V::loadu(col{j} + r) + {var}).store(col{j} + r);" if self.vector_dtype is not None
                           else f"col{j}[r] += {var};")
            for root in roots:
                var, have = self.value(root, self.root_index(root))
                j, dtype = self.stores.index(root), meta_of(root).dtype
                if self.vector_dtype is not None:
                    if have != dtype:
                        raise NotPrintable(f"a {have} value stored as {dtype} in a vector body")
                    out.append(self.complex_store(var, f"out{j}", self.element_at) if dtype.is_complex
                               else f"({self.lane_vector(var, have)}).store(out{j} + {self.element_at});")
                elif dtype.is_complex:   # (interleaved parts)
                    re, im = self.cast(var, have, dtype)
                    out += [f"out{j}[2 * ({self.element_at})] = {re};", f"out{j}[2 * ({self.element_at}) + 1] = {im};"]
                else:
                    out.append(f"out{j}[{self.element_at}] = static_cast<{C_TYPE[dtype]}>({var});")
            return out
        vector, (body, store) = self.vector_and_scalar(stores)
        if vector is not None:
            return self.row_loop(vector[0], body, vector[1], store)
        return self.row_loop(None, body, [], store)

    def root_index(self, root: fx.Node) -> tuple:
        """Where an elementwise root is computed at the current element: the kernel's index, or for a
        root of another shape with as many elements (a weight gradient's kernel over its rows' chunks,
        ``(chunks, M / chunks, N)``, storing the (..., N) values it sums: ``KernelPlan.loops_over_chunks``)
        the root's index of the same contiguous position, the kernel's space being its reshape."""
        shape = tuple(meta_of(root).shape)
        if shape == tuple(self.plan.shape):
            return self.base_index
        if self.vector_dtype is not None:
            raise NotPrintable("an output of another shape in a vector body")
        position = self.tmp("int64_t", self.element_at)
        return tuple(ZERO if size == 1 else variable_index(self.tmp("int64_t", f"({position} / {stride}) % {size}"))
                     for size, stride in zip(shape, contiguous_strides(shape)))

    def loop(self, header, scalar, vector, rows: int, inner: int, ndim: int) -> list:
        """The loop nest: rows (over threads where it pays), then the last dim: its vector body
        while a register's worth of elements is left, the scalar body for the rest."""
        body = [f"        {line}" for line in header]
        if ndim and inner != 1:
            i = self.inner_name
            body.append(f"        int64_t {i} = 0;")
            if vector is not None:
                body += ["#ifndef SYMGRAD_SCALAR_ONLY",
                         f"        for (; {i} + V::size() <= {inner}; {i} += V::size()) {{",
                         *[f"            {line}" for line in vector], "        }", "#endif"]
            body.append(f"        for (; {i} < {inner}; ++{i}) {{")
            body += [f"            {line}" for line in scalar]
            body.append("        }")
        else:
            body += [f"        {line}" for line in scalar]
        parallel = rows > 1 and rows * inner >= PARALLEL_MIN
        return ([_PARALLEL] if parallel else []) + \
            [f"    for (int64_t x = 0; x < {rows}; ++x) {{", *body, "    }"]


# Functions a vector body calls that at::vec has no cheap form of (``VectorPrinter.call``). tanh in
# float: below 0.55 in magnitude its odd Taylor polynomial to z**15 (truncation below 5e-8 relative),
# above it 1 - 2 / (1 + exp(2z)) (no cancellation there), exact in its limits (+-1 at +-inf, NaN for
# NaN, -0 for -0); within a few ulp of eager's, where Sleef's 1-ulp tanh (at::vec's) costs several
# times as much (GELU's tanh form spent most of its time there). In double: Sleef's.
VECTOR_HELPERS = """static inline at::vec::Vectorized<float> symgrad_tanh(const at::vec::Vectorized<float>& z) {
    using F = at::vec::Vectorized<float>;
    const F z2 = z * z;
    F p = F(-929569.0f / 638512875);
    p = p * z2 + F(21844.0f / 6081075);
    p = p * z2 + F(-1382.0f / 155925);
    p = p * z2 + F(62.0f / 2835);
    p = p * z2 + F(-17.0f / 315);
    p = p * z2 + F(2.0f / 15);
    p = p * z2 + F(-1.0f / 3);
    const F small = z + z * z2 * p;
    const F large = F(1.0f) - F(2.0f) / ((z * F(2.0f)).exp() + F(1.0f));
    return F::blendv(large, small, z.abs() < F(0.55f));
}
static inline at::vec::Vectorized<double> symgrad_tanh(const at::vec::Vectorized<double>& z) { return z.tanh(); }"""


# Triton's tl.rand(seed, offset) (triton/language/random.py: randint4x's first word of Philox4x32,
# 10 rounds, the offset's low and high words as the counter, the seed's as the key; then
# uint_to_uniform_float), written for one element
_PHILOX = """static inline float symgrad_rand(uint64_t seed, int64_t offset) {
    uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(static_cast<uint64_t>(offset) >> 32);
    uint32_t c2 = 0, c3 = 0, k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    #pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
        const uint32_t a = c0, b = c2;
        c0 = static_cast<uint32_t>((static_cast<uint64_t>(0xCD9E8D57u) * b) >> 32) ^ c1 ^ k0;
        c2 = static_cast<uint32_t>((static_cast<uint64_t>(0xD2511F53u) * a) >> 32) ^ c3 ^ k1;
        c1 = 0xCD9E8D57u * b;
        c3 = 0xD2511F53u * a;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    int32_t x = static_cast<int32_t>(c0);
    x = x < 0 ? -x - 1 : x;
    return static_cast<float>(x) * 4.6566127342e-10f;
}

// ``n`` consecutive offsets' numbers at once (a vector body's lanes): the compiler vectorizes the rounds
static inline void symgrad_rand_lanes(uint64_t seed, int64_t offset, float* out, int64_t n) {
    #pragma omp simd
    for (int64_t l = 0; l < n; ++l) out[l] = symgrad_rand(seed, offset + l);
}"""
