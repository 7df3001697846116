"""Writes the Triton source of one fused kernel.

A kernel walks an iteration space (``plan.shape``); non-reduced dims are spread over
programs in blocks of XBLOCK, reduced dims are looped over in blocks of RBLOCK. Every value
is computed at a multi-index: buffers are loaded at ``sum(index * stride)`` (strides are
kernel arguments, so any input layout works), pointwise nodes print their SymPy expression
over their arguments' values, and views rewrite the index (``View.index_map``, ``View.read``). Values are
shared within a kernel by (node, index), so a fused chain is computed once per element.

Sizes are baked into the source (shapes are guarded), strides are arguments; the kernel's
name is a hash of its body, so identical kernels are compiled once. A shape-generic kernel
(``render_kernel(..., shape_generic=True)``, for regions whose sizes change between calls) takes
its sizes as arguments too (``KernelWriter.size``: ``ks0, ks1, ...``; fp32 constants of its math
``kf0, ...``), and its blocks come from size buckets, so builds that differ only in sizes within a
bucket write one source. Block sizes and warps are
chosen by ``compiler.fusion.tiling`` from the written body and recorded in the module
(``XBLOCK_DEFAULT``, ``RBLOCK_DEFAULT``, ``NUM_WARPS``): the launch uses exactly these.
Reductions are written by ``reductions.ReductionWriter``.

Index width: offsets are computed in 32 bits unless one may pass 2**31 - 1 (Triton, like
CUDA, multiplies two int32 values in int32 and wraps). What the sizes decide is decided here
(``_index_extent``): a kernel whose iteration space, any node it computes or stores, or any
dim of a tensor it loads reaches 2**31 elements computes every index in int64. What the
strides decide is left to the launch: every 32-bit kernel comes with a twin that multiplies
its strides in int64 (``KernelSource.wide_source``), which the launch picks when a tensor's
strides reach that far (``runtime.program.KernelLaunch``); other kernels pay nothing.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from compiler.codegen.kernel_text import (TL_DTYPE, ZERO, Index, broadcast_index, constant_index,
                                          last_position, masked, variable_index)
from compiler.codegen.realify import IM, RE, realify
from compiler.codegen.reductions import ReductionWriter
from compiler.codegen.triton_printer import NotPrintable, TritonPrinter
from compiler.ir.ops import symbols as Y
from compiler.fusion.fuse import KernelPlan
from compiler.ir.graph import OpKind, compute_dtype, contiguous_strides, kind_of, meta_of, numel
from compiler.fusion.tiling import choose_tiling, fits_one_block, next_pow2
from runtime.program import INDEX_ASSERT

SIGNATURE_DTYPE = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass
class KernelSource:
    name: str
    source: str            # a complete Python module defining the @triton.jit kernel
    loads: list            # buffer nodes read, in argument order (pointer + one stride per dim)
    stores: list           # root nodes written (contiguous), in argument order
    grid: int              # number of programs
    signature: dict        # argument name -> Triton type, for ahead-of-time compilation
    bytes_moved: int       # bytes loaded and stored, counting each buffer once
    num_warps: int = 4     # warps per program at launch
    # the same kernel with strides multiplied in int64, for inputs whose offsets pass 2**31 - 1;
    # None when ``source`` computes every index in int64 already
    wide_name: str | None = None
    wide_source: str | None = None
    # shape-generic kernels (``render_kernel(..., shape_generic=True)``): the values of the size and
    # constant arguments (``ks0, ks1, ..., kf0, ...``) for this build, passed after the outputs
    sizes: tuple = ()
    # gather nodes whose indices the kernel checks (``render_kernel(..., check_indices=True)``): a
    # ``tl.device_assert`` on each index, so the kernel is compiled with Triton's ``debug`` option
    checked_gathers: tuple = ()
    xblock: int = 0        # the launch's block sizes (the module's XBLOCK_DEFAULT, RBLOCK_DEFAULT)
    rblock: int = 0
    # the kernel's memory accesses in the order its body runs them, as written: ("load", k) for a
    # ``tl.load`` of input k (``loads[k]``), ("store", j) for a ``tl.store`` of output j; the same in
    # ``source`` and ``wide_source`` (the twin only casts its strides before the body)
    accesses: tuple = ()

    def loaded_before_store(self, load: int, store: int) -> bool:
        """Whether every load of input ``load`` comes before the first store of output ``store``
        (and the kernel does both)."""
        loads = [at for at, access in enumerate(self.accesses) if access == ("load", load)]
        stores = [at for at, access in enumerate(self.accesses) if access == ("store", store)]
        return bool(loads) and bool(stores) and max(loads) < min(stores)


# Element offsets at or past this need 64-bit index math.
INT32_LIMIT = 2**31


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels see complex tensors as their real view (torch.view_as_real)."""
    return dtype.to_real() if dtype.is_complex else dtype


class KernelWriter(ReductionWriter):
    def __init__(self, plan: KernelPlan, buffers: set, shape_generic: bool = False, check_indices: bool = False):
        self.plan = plan
        self.generic = shape_generic
        self.check_indices = check_indices
        self.checked_gathers: dict = {}  # gather node -> None (ordered): its indices are asserted in range
        self.size_args: dict = {}    # shape-generic: key -> (argument name, value), in argument order
        self.float_args: dict = {}   # shape-generic: key -> (argument name, value) of fp32 constants
        self.buffers = buffers
        self.roots = set(plan.roots)
        self.lines: list[str] = []
        self.values: dict = {}
        self.load_args: dict = {}
        self.counter = 0
        self.reductions: dict = {}   # persistent kernels: reduction root -> its row value
        self.persistent = False
        self.long_row = False        # a persistent row longer than tiling.PERSISTENT_MAX (tiling.holds_row)
        self.base_index: tuple = ()
        # bytes_moved: a buffer read only through gathers counts the elements gathered
        self.gathering: list = []        # element counts of the gathers being computed
        self.gathered_reads: dict = {}   # buffer -> elements read at gathered positions
        self.full_reads: set = set()     # buffers read at the kernel's own positions
        self.x_names: set = set()    # index variables that do not vary along a row
        self.r_names: set = set()    # index variables that vary only along a row
        # what the body holds (``live_values``): its block-shaped masked loads, and (persistent
        # kernels) its row reductions; a row's values (``row_values``) are no block
        self.block_loads = 0
        self.row_reductions = 0
        self.writing_row_values = False
        # the loads and stores written, in order (``KernelSource.accesses``): the order the kernel
        # runs them, as the writers lay out each block of lines (a loop's body, what follows the
        # loop, an epilogue, a second loop) after every line written before it
        self.accesses: list = []

    # -- helpers -----------------------------------------------------------------------
    def size(self, value: int, key) -> str:
        """A size (or a product of sizes) used in the kernel's index math, masks or loop bounds, as
        kernel text: the literal in a static kernel; in a shape-generic one an argument ``ks<k>``,
        one per ``key`` (what the size is: ``("shape", d)``, ``(view_node, "in", d)``...), so that
        two builds of one region whose sizes differ write the same text. Sizes 0 and 1 stay literal:
        they are part of the guard key (a dim of size 1 broadcasts, one of 0 has no elements).

        NOTE: keyed by what the size is, not by its value: two dims equal at one size and not at
        another would otherwise share an argument at one and not the other (two sources)."""
        if not self.takes_size(value):
            return str(value)
        if key not in self.size_args:
            self.size_args[key] = (f"ks{len(self.size_args)}", value)
        name, known = self.size_args[key]
        assert known == value, (key, known, value)
        return name

    def takes_size(self, value: int) -> bool:
        """Whether a size of ``value`` is an argument of this kernel (``size``), not a literal."""
        return self.generic and value not in (0, 1)

    def size_index(self, value: int, key) -> Index:
        """``size`` as an index term: a constant where it is a literal, else a size argument."""
        text = self.size(value, key)
        return Index(text, sized=True) if self.takes_size(value) else constant_index(value)

    def tmp(self, text: str) -> str:
        name = f"t{self.counter}"
        self.counter += 1
        self.lines.append(f"{name} = {text}")
        return name

    def load(self, node: fx.Node, index: tuple):
        """The element of buffer ``node`` at ``index``; complex: (real, imag) of it."""
        dtype = meta_of(node).dtype
        if numel(meta_of(node).shape) == 0:
            # NOTE: no element to read (only masked-off lanes and empty sums use it); a load at
            # a fixed element is unmasked and would read outside the storage (a crash, at times)
            zero = self.tmp(f"tl.full(SHAPE, 0, {TL_DTYPE[_storage_dtype(dtype)]})")
            return ((zero, zero) if dtype.is_complex else zero), dtype
        if node not in self.load_args:
            self.load_args[node] = f"in{len(self.load_args)}"
        if self.gathering:
            self.gathered_reads[node] = self.gathered_reads.get(node, 0) + self.gathering[-1]
        else:
            self.full_reads.add(node)
        arg = self.load_args[node]
        terms = [(idx, d) for d, (idx, size) in enumerate(zip(index, meta_of(node).shape))
                 if size != 1 and idx.constant != 0]
        offset = " + ".join(f"({idx}) * {arg}_s{d}" for idx, d in terms)
        if not offset or all(idx.fixed for idx in index):
            mask = None    # one element for the whole block (a fixed one, or the only one): scalar, broadcast on use
        elif dtype.is_complex:
            mask = "MASK"  # interleaved parts (strides count real elements), each a block
        else:
            mask = self.load_mask(frozenset().union(*(idx.names for idx, _ in terms)))
        if dtype.is_complex:
            return (self.load_line(node, offset, mask), self.load_line(node, offset, mask, "1")), dtype
        return self.load_line(node, offset, mask), dtype

    def load_mask(self, names: frozenset) -> str:
        """The mask of a block load at an offset that varies with index variables ``names``."""
        if self.r_names and names <= self.x_names:  # the same element all along a row: one per row ([XBLOCK, 1])
            return "XMASK"
        if names <= self.r_names:  # the same element for every row: one per column ([1, RBLOCK])
            return "RMASK"
        return "MASK"

    def load_line(self, node, offset: str, mask: str | None, part: str = "") -> str:
        """A ``tl.load`` of buffer ``node`` at ``offset`` (plus ``part``), under ``mask`` (None: a
        scalar load), into a new variable; recorded (``accesses``, ``block_loads``)."""
        arg = self.load_args[node]
        address = " + ".join(a for a in (f"{arg}_ptr", offset, part) if a)
        self.accesses.append(("load", list(self.load_args).index(node)))
        if mask is None:
            return self.tmp(f"tl.load({address})")
        if mask in ("MASK", "RMASK") and not self.writing_row_values:
            self.block_loads += 1
        return self.tmp(f"tl.load({address}, mask={mask}, other=0)")

    def store(self, out: int, value, addresses: list, mask: str, into: list | None = None) -> None:
        """Write ``value`` into output ``out`` (its position among the stores): one ``tl.store`` per
        part (a complex value is its (real, imag) pair, stored interleaved), each at its address in
        ``addresses``; appended to the body (``self.lines``) unless ``into`` is given. Every store of
        a kernel is made here."""
        parts = value if isinstance(value, tuple) else (value,)
        lines = self.lines if into is None else into
        for address, part in zip(addresses, parts, strict=True):
            self.accesses.append(("store", out))
            lines.append(f"tl.store(out{out}_ptr + {address}, {part}, mask={mask})")

    @staticmethod
    def element_addresses(offset: str, dtype: torch.dtype) -> list:
        """Where the element at ``offset`` of a contiguous output goes (complex: the real part at
        2·offset, the imaginary part next to it)."""
        return [f"2 * ({offset})", f"2 * ({offset}) + 1"] if dtype.is_complex else [offset]

    @staticmethod
    def row_addresses(dtype: torch.dtype) -> list:
        """Where a row's reduced value goes: one value per row, at ``xindex`` (complex: interleaved)."""
        return ["2 * xindex + 0", "2 * xindex + 1"] if dtype.is_complex else ["xindex"]

    def cast(self, value, have: torch.dtype, want: torch.dtype):
        """Convert a value; complex values convert componentwise, a real one gains 0j."""
        if have == want:
            return value
        if want.is_complex:
            part = want.to_real()
            if have.is_complex:
                return (self.cast(value[0], have.to_real(), part), self.cast(value[1], have.to_real(), part))
            return (self.cast(value, have, part), "0.0")
        if have.is_complex:
            raise NotPrintable("a complex value used as a real one")
        return self.tmp(f"{value}.to({TL_DTYPE[want]})")

    # -- values ------------------------------------------------------------------------
    def value(self, node: fx.Node, index: tuple):
        """(Triton variable(s), dtype) of ``node`` at ``index`` (an ``Index`` a dim): loaded, or computed
        inline."""
        index = tuple(i.folded() for i in index)
        key = (node, tuple(i.element for i in index))   # "((i0))" is the element "i0" is
        if key in self.values:
            return self.values[key]
        kind = kind_of(node)
        if kind == OpKind.IOTA and not (node in self.buffers and node not in self.roots):
            position = index[node.kwargs["dim"]]
            result = self.tmp(f"tl.full(SHAPE, {position}, tl.int64)" if position.fixed
                              else f"({position}).to(tl.int64)"), torch.int64
            self.values[key] = result
            return result
        if kind == OpKind.GATHER and not (node in self.buffers and node not in self.roots):
            result = self.gathered(node, index)
            self.values[key] = result
            return result
        if kind == OpKind.RAND and not (node in self.buffers and node not in self.roots):
            result = self.random(node, index)
            self.values[key] = result
            return result
        if (node in self.buffers and node not in self.roots) or \
                kind not in (OpKind.POINTWISE, OpKind.SCATTER, OpKind.VIEW, OpKind.REDUCTION):
            result = self.load(node, index)
        elif kind == OpKind.VIEW:  # its input's value at the index the view maps to (``View.read``)
            result = node.target.read(self, node, index)
        elif kind == OpKind.REDUCTION and (self.persistent or node in self.reductions):
            result = self.reduced(node, index)  # a row's reduction, once its value is known
        elif kind == OpKind.POINTWISE:
            result = self.pointwise(node, index)
        elif kind == OpKind.SCATTER:
            result = self.slice_scatter(node, index)
        else:
            raise AssertionError(f"reduction {node.name} read inside the kernel that computes it")
        self.values[key] = result
        return result

    def pointwise(self, node: fx.Node, index: tuple):
        out_shape = meta_of(node).shape
        out_dtype = meta_of(node).dtype
        expr = meta_of(node).expr
        is_compare = getattr(node.target, "name", "") in ("lt", "le", "gt", "ge", "eq", "ne")
        args = []
        for arg in node.args:
            args.append(self.value(arg, broadcast_index(index, out_shape, meta_of(arg).shape)))
        if is_compare:
            want = compute_dtype(torch.promote_types(args[0][1], args[1][1]) if len(args) == 2 else args[0][1])
        else:
            want = compute_dtype(out_dtype)
        complex_math = out_dtype.is_complex or any(dtype.is_complex for _, dtype in args)
        if complex_math:
            return self.complex_pointwise(node, expr, args, want)
        names = {}
        for i, (var, have) in enumerate(args):
            symbol = Y.REAL_ARGS[i]
            is_condition = getattr(node.target, "name", "") == "where" and i == 0
            if node.target.name == "pointwise" and have == torch.bool and _used_as_condition(expr, symbol):
                is_condition = True
            names[symbol] = var if is_condition else self.cast(var, have, want)
        text, = self.print_exprs([expr], names, want)
        if is_compare:
            return self.tmp(text), torch.bool
        if expr.is_number:  # a constant: give it the block's shape
            return self.tmp(f"tl.full(SHAPE, {text}, {TL_DTYPE[want]})"), want
        return self.tmp(text), want

    def gathered(self, node, index: tuple):
        """The source element at the position an index tensor gives (see ``catalog.Gather``)."""
        source, index_node = node.args
        index_at, source_at = node.target.positions(node, list(index))
        dim = node.kwargs["dim"]
        size = self.size_index(meta_of(source).shape[dim], (source, "dim", dim))   # a literal, or an argument
        i, _ = self.value(index_node, tuple(index_at))
        i = self.tmp(f"{i}.to(tl.int64)")
        if all(idx.fixed for idx in index_at):
            # one index for the whole block (a scalar load): give it the block's shape, since
            # the gathered load is masked and a masked load needs a block of pointers
            i = self.tmp(f"tl.full(SHAPE, 0, tl.int64) + {i}")
        if self.check_indices:
            # eager's error for an index out of range, from the kernel itself, as Inductor's kernels
            # check indirect indices (``assert_indirect_indexing``): no reduction over the indices
            # on the host first. Masked-off lanes are no element (a reduction over an empty gather
            # has lanes, and no index to check).
            low = f"-{size}" if node.kwargs.get("wrap") else "0"
            what = (meta_of(node).torch_op or "indexing").replace('"', "'")
            of_size = f" of size {size}" if size.constant is not None else ""  # (shape-generic: an argument)
            in_range = f"({i} >= {low}) & ({i} < {size}) | ~(MASK)"
            self.lines.append(f'tl.device_assert({in_range}, "{what}: {INDEX_ASSERT}{of_size}")')
            self.checked_gathers[node] = None
        if node.kwargs.get("wrap"):
            i = self.tmp(f"tl.where({i} < 0, {i} + {size}, {i})")
        # NOTE: clamped too, so a bad index never reads outside memory where the assert is compiled
        # out, or on GPU before the asynchronous assert stops the kernel.
        i = self.tmp(f"tl.minimum(tl.maximum({i}, 0), {last_position(size)})")
        source_at[dim] = variable_index(i)
        self.gathering.append(numel(meta_of(node).shape))
        value, dtype = self.value(source, tuple(source_at))
        self.gathering.pop()
        if node.kwargs.get("zero_padding"):
            hit = f"{i} == {node.kwargs['padding_idx']}"
            if dtype.is_complex:
                value = tuple(self.tmp(f"tl.where({hit}, 0.0, {part})") for part in value)
            else:
                value = self.tmp(f"tl.where({hit}, 0.0, {value})")
        return value, dtype

    def random(self, node, index: tuple):
        """Philox(seed, position of the element in the rand node's shape), in [0, 1)."""
        seed, _ = self.value(node.args[0], ())
        shape, strides = meta_of(node).shape, contiguous_strides(meta_of(node).shape)
        strides = [self.size_index(st, (node, "stride", d)) for d, st in enumerate(strides)]
        terms = [(idx, st) for idx, size, st in zip(index, shape, strides) if size != 1 and idx.constant != 0]
        if all(idx.position is not None and st.constant is not None for idx, st in terms):  # one known element
            position = f"tl.full(SHAPE, {sum(i.position * st.constant for i, st in terms)}, tl.int64)"
        elif all(idx.fixed for idx in index):   # a known element at sizes given as arguments
            position = "tl.full(SHAPE, 0, tl.int64) + " + " + ".join(f"({idx}) * {st}" for idx, st in terms)
        else:
            position = " + ".join(f"({idx}).to(tl.int64) * {stride}" for idx, stride in terms) \
                or "tl.full(SHAPE, 0, tl.int64)"
        return self.tmp(f"tl.rand({seed}, {position})"), torch.float32

    def slice_scatter(self, node, index: tuple):
        """base[idx], or src at the slice position when idx lies in the slice."""
        base, src = node.args
        d, start, step, length = (node.kwargs[k] for k in ("dim", "start", "step", "length"))
        dtype = compute_dtype(meta_of(node).dtype)
        base_value, base_dtype = self.value(base, index)
        base_value = self.cast(base_value, base_dtype, dtype)
        if length == 0:
            return base_value, dtype
        if index[d].position is not None:  # a known position: whether it is in the slice is known now
            at = index[d].position - start
            if not (0 <= at < length * step and at % step == 0):
                return base_value, dtype
            src_index = tuple(constant_index(at // step) if i == d else idx for i, idx in enumerate(index))
            src_index = broadcast_index(src_index, meta_of(node).shape, meta_of(src).shape)
            src_value, src_dtype = self.value(src, src_index)
            return self.cast(src_value, src_dtype, dtype), dtype
        length_at = self.size_index(length, (node, "length"))
        extent = length * step if length_at.constant is not None else f"{length_at} * {step}"
        rel = self.tmp(f"{index[d]} - {self.size(start, (node, 'start')) if start else start}")
        inside = f"({rel} >= 0) & ({rel} < {extent})"
        if step != 1:
            inside += f" & ({rel} % {step} == 0)"
        inside = self.tmp(inside)
        # clamp, so positions outside the slice still read inside src (their value is unused)
        position = self.tmp(f"tl.minimum(tl.maximum({rel} // {step}, 0), {last_position(length_at)})")
        src_index = tuple(variable_index(position) if i == d else idx for i, idx in enumerate(index))
        src_index = broadcast_index(src_index, meta_of(node).shape, meta_of(src).shape)
        src_value, src_dtype = self.value(src, src_index)
        src_value = self.cast(src_value, src_dtype, dtype)
        if dtype.is_complex:
            return (self.tmp(f"tl.where({inside}, {src_value[0]}, {base_value[0]})"),
                    self.tmp(f"tl.where({inside}, {src_value[1]}, {base_value[1]})")), dtype
        return self.tmp(f"tl.where({inside}, {src_value}, {base_value})"), dtype

    def complex_pointwise(self, node, expr, args, want):
        """A pointwise op with complex operands or result, as real arithmetic on parts."""
        part = want.to_real() if want.is_complex else want
        names = {}
        for i, (var, have) in enumerate(args):
            if have.is_complex:
                re, im = var
                names[RE[i]] = self.cast(re, have.to_real(), part)
                names[IM[i]] = self.cast(im, have.to_real(), part)
            else:
                names[Y.REAL_ARGS[i]] = self.cast(var, have, part)
        re_expr, im_expr = realify(expr)
        if not want.is_complex:
            text, = self.print_exprs([re_expr], names, part)
            return self._shaped(text, re_expr, part), want
        re_text, im_text = self.print_exprs([re_expr, im_expr], names, part)
        return (self._shaped(re_text, re_expr, part), self._shaped(im_text, im_expr, part)), want

    def _shaped(self, text, expr, dtype):
        if expr.is_number:
            return self.tmp(f"tl.full(SHAPE, {text}, {TL_DTYPE[dtype]})")
        return self.tmp(text)

    def print_exprs(self, exprs, names, dtype):
        if self.generic and dtype == torch.float32:
            exprs = [self.hoist_constants(e, names) for e in exprs]
        replacements, reduced = sympy.cse(list(exprs), symbols=_cse_symbols(), order="none")
        printer = TritonPrinter(names, dtype)
        for sym, sub in replacements:
            # NOTE: a number stays a literal: a Triton variable holding a Python float is a
            # float32 scalar, which would round fp64 constants.
            names[sym] = printer(sub) if sub.is_number else self.tmp(printer(sub))
        return [printer(e) for e in reduced]

    def hoist_constants(self, expr, names):
        """``expr`` with each non-whole float coefficient or term (a mean's 1/N in its backward, a
        variance's N/(N-1), a loss's 1/(B*T)) replaced by an fp32 argument ``kf<k>`` of a
        shape-generic kernel: such constants follow the sizes, and as literals they would make
        every size a new source. Only fp32 math: an fp32 argument would round an fp64 constant
        (fp64 kernels keep their literals, a source per value)."""
        found = []

        def visit(e):
            if e.is_Add or e.is_Mul:
                found.extend(a for a in e.args if a.is_Float and a.is_finite and not float(a).is_integer())
            for a in e.args:
                visit(a)
        visit(expr)
        if not found:
            return expr
        replace = {}
        for constant in dict.fromkeys(found):
            key = ("constant", len(self.float_args))
            name = f"kf{len(self.float_args)}"
            self.float_args[key] = (name, float(constant))
            symbol = sympy.Symbol(name, real=True)
            names[symbol] = name
            replace[constant] = symbol
        return expr.xreplace(replace)

    # -- the kernel --------------------------------------------------------------------
    def write(self) -> KernelSource:
        plan = self.plan
        shape = tuple(plan.shape)
        rdims = tuple(plan.reduce_dims)
        xdims = tuple(d for d in range(len(shape)) if d not in rdims)
        xnumel = numel([shape[d] for d in xdims])
        rnumel = numel([shape[d] for d in rdims])
        reduction = bool(rdims)
        # rows are held whole when later values read their reduction (fusion decided that the row
        # fits: ``tiling.holds_row``); otherwise looped, so a block holds only what the registers
        # can (a heavy body over rows of 4096 cannot)
        self.persistent = plan.reads_rows
        self.long_row = self.persistent and not fits_one_block(shape, rdims)
        # NOTE: blocks are chosen after the body is written (from its live values); a block is a
        # power of two no larger than its extent's, so rounding up to those bounds the index
        wide = _index_extent(plan, self.buffers, xnumel, next_pow2(max(xnumel, 1)),
                             rnumel, next_pow2(max(rnumel, 1))) >= INT32_LIMIT
        index = [None] * len(shape)
        header = []
        pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
        if reduction:
            header.append(f"xindex = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
        else:
            header.append(f"xindex = {pid} * XBLOCK + tl.arange(0, XBLOCK)")
        header.append(f"xmask = xindex < {self.size(xnumel, ('xnumel',))}")
        body_prefix = []
        for dims, var, target in ((xdims, "xindex", header), (rdims, "rindex", body_prefix)):
            sizes = [shape[d] for d in dims]
            if self.generic:
                target.extend(self.split_index(var, dims, sizes, index))
                continue
            strides = contiguous_strides(sizes)
            for d, size, stride in zip(dims, sizes, strides):
                if size == 1:
                    index[d] = ZERO
                    continue
                term = var if stride == 1 else f"({var} // {self.size(stride, (var, 'stride', d))})"
                if stride * size < numel(sizes):
                    term = f"({term} % {self.size(size, ('shape', d))})"
                target.append(f"i{d} = {term}")
                index[d] = variable_index(f"i{d}")
        index = tuple(index)
        self.base_index = index
        self.x_names = {"xindex"} | {f"i{d}" for d in xdims}
        self.r_names = {"rindex", "roffset"} | {f"i{d}" for d in rdims} if reduction else set()
        rnumel = self.size(rnumel, ("rnumel",))   # text from here on: a literal, or an argument
        if self.persistent:
            src, stores = self.write_persistent(header, body_prefix, rnumel, wide)
            return self.finish(src, stores, xnumel, wide, accumulators=len(plan.columns))

        stores = []
        accumulators = []   # (root, [accumulator per part], part dtype)
        for root in plan.roots:
            if root in plan.online or root in plan.second_pass or root in plan.epilogue:
                continue  # accumulated with its amax; the second loop; after the loop
            if kind_of(root) == OpKind.REDUCTION:
                self.accumulate(root, accumulators)
            else:
                stores.append(root)
                self.store_root(root, len(stores) - 1)
        body = [masked(line, "xmask & rmask" if reduction else "xmask")
                .replace("SHAPE", "[XBLOCK, RBLOCK]" if reduction else "[XBLOCK]") for line in self.lines]
        if reduction:
            src = header + self.write_loop(body_prefix, body, rnumel, accumulators, stores, wide)
            if plan.epilogue:
                src += self.write_epilogue(stores)
            if plan.second_pass:
                src += self.write_second_loop(body_prefix, rnumel, stores, wide)
        else:
            src = header + body_prefix + body
        return self.finish(src, stores, xnumel, wide, accumulators=sum(len(a[1]) for a in accumulators))

    def split_index(self, var: str, dims, sizes, index: list) -> list:
        """Lines splitting the flat ``var`` into the row-major index of ``dims`` (of ``sizes``, given
        as arguments), filling ``index``: one division a dim, innermost first, each remainder as a
        product's difference. NOTE: a static kernel writes ``(var // stride) % size`` per dim (one
        or two divisions by constants, which the compiler turns into multiplications); by runtime
        sizes each division is a long sequence of instructions, so a shape-generic kernel chains
        them instead (as many divisions as dims, less one)."""
        kept = [(d, size) for d, size in zip(dims, sizes) if size != 1]
        for d, size in zip(dims, sizes):
            if size == 1:
                index[d] = ZERO
        lines, rest = [], var
        for k, (d, size) in enumerate(reversed(kept)):
            index[d] = variable_index(f"i{d}")
            if k == len(kept) - 1:   # the outermost dim: what is left
                lines.append(f"i{d} = {rest}")
                break
            text = self.size(size, ("shape", d))
            quotient = f"{var[0]}q{d}"
            lines += [f"{quotient} = {rest} // {text}", f"i{d} = {rest} - {quotient} * {text}"]
            rest = quotient
        return lines

    def live_values(self, accumulators: int) -> int:
        """An estimate of the block-shaped values a kernel holds at once: each block load, each
        accumulator, and in a persistent kernel each row reduction (values computed before it
        are held until the reduced value is known).

        NOTE: a load of the same elements for every row (``mask=RMASK``, [1, RBLOCK]) counts too: a kernel
        over rows this long takes one row a program, where it is as large as the block (the cross-entropy
        over 8192 targets: two such int64 loads uncounted, 2048 a step at 8 warps spilled 4 bytes)."""
        return self.block_loads + accumulators + (2 * self.row_reductions if self.persistent else 0)

    def finish(self, src, stores, xnumel, wide, accumulators) -> KernelSource:
        loads = list(self.load_args)
        tiling = choose_tiling(self.plan.shape, self.plan.reduce_dims, persistent=self.persistent,
                               live_values=self.live_values(accumulators),
                               wide_values=any(meta_of(n).dtype.itemsize >= 8 for n in loads + stores),
                               two_pass=bool(self.plan.second_pass), shape_generic=self.generic)
        xblock = tiling.xblock
        strides = [f"{arg}_s{d}" for node, arg in self.load_args.items() for d in range(len(meta_of(node).shape))]
        # Strides in int64 make every offset product int64 (the index stays int32 where it fits).
        # NOTE: tl.cast, not .to(): Triton passes a stride equal to 1 as a constexpr.
        widen = [f"{stride} = tl.cast({stride}, tl.int64)" for stride in strides]
        wide_name = wide_source = None
        if wide:
            name, source, signature = self.module(widen + src, stores, tiling, "i64", "i64")
        else:
            name, source, signature = self.module(src, stores, tiling, "i32")
            if strides:
                wide_name, wide_source, _ = self.module(widen + src, stores, tiling, "i64")
        # a kernel with column sums runs one program per chunk of rows (``loop_over_chunk``)
        grid = xnumel // self.chunk_rows() if self.plan.columns else -(-xnumel // xblock)
        read = {n: numel(meta_of(n).shape) if n in self.full_reads else
                min(numel(meta_of(n).shape), self.gathered_reads[n]) for n in loads}
        moved = sum(read[n] * meta_of(n).dtype.itemsize for n in loads)
        moved += sum(numel(meta_of(n).shape) * meta_of(n).dtype.itemsize for n in stores)
        sizes = tuple(value for _, value in self.size_args.values()) + \
            tuple(value for _, value in self.float_args.values())
        return KernelSource(name, source, loads, stores, grid, signature, moved, tiling.num_warps,
                            wide_name, wide_source, sizes, tuple(self.checked_gathers), tiling.xblock, tiling.rblock,
                            tuple(self.accesses))

    def module(self, src, stores, tiling, stride_type, size_type="i32"):
        """(name, source, signature) of the module defining the kernel that runs ``src``."""
        params, signature = [], {}
        for node, arg in self.load_args.items():
            params.append(f"{arg}_ptr")
            signature[f"{arg}_ptr"] = "*" + SIGNATURE_DTYPE[_storage_dtype(meta_of(node).dtype)]
            for d in range(len(meta_of(node).shape)):
                params.append(f"{arg}_s{d}")
                signature[f"{arg}_s{d}"] = stride_type
        for i, node in enumerate(stores):
            params.append(f"out{i}_ptr")
            signature[f"out{i}_ptr"] = "*" + SIGNATURE_DTYPE[_storage_dtype(meta_of(node).dtype)]
        # shape-generic: the sizes (64-bit where the kernel's index math is) and fp32 constants
        sized = [name for name, _ in self.size_args.values()] + [name for name, _ in self.float_args.values()]
        for name, _ in self.size_args.values():
            signature[name] = size_type
        for name, _ in self.float_args.values():
            signature[name] = "fp32"
        params += sized
        signature["XBLOCK"] = "constexpr"
        signature["RBLOCK"] = "constexpr"
        body_text = "\n".join("    " + line for line in src)
        # the signature too: fp32 and fp64 variants of one body are different files (the cache
        # checks a file's whole text against its kernel, and the Hopper build reads SIGNATURE)
        digest = hashlib.sha256((repr(signature) + body_text + f"{tiling.xblock},{tiling.rblock},{tiling.num_warps}")
                                .encode()).hexdigest()[:12]
        name = f"{_describe(self.plan)}_{digest}"
        source = "\n".join([
            "import triton",
            "import triton.language as tl",
            "from runtime.triton_math import libdevice",
            "",
            f"XBLOCK_DEFAULT = {tiling.xblock}",
            f"RBLOCK_DEFAULT = {tiling.rblock}",
            f"NUM_WARPS = {tiling.num_warps}",
            f"SIGNATURE = {signature!r}",
            "",
            "",
            # NOTE: sizes are not specialized (an integer divisible by 16 or equal to 1 would be a
            # compiled variant of its own): one compiled kernel for every size of a bucket
            f"@triton.jit(do_not_specialize={sized!r})" if sized else "@triton.jit",
            f"def {name}({', '.join(params + ['XBLOCK: tl.constexpr', 'RBLOCK: tl.constexpr'])}):",
            body_text,
            "",
        ])
        return name, source, signature


_cse_counter = itertools.count()


def _cse_symbols():
    while True:
        yield sympy.Symbol(f"cse{next(_cse_counter)}", real=True)


def _used_as_condition(expr, symbol) -> bool:
    from compiler.ir.ops import scalar as S
    return any(w.args[0] == symbol for w in expr.atoms(S.Where))


_COMPUTED_KINDS = (OpKind.POINTWISE, OpKind.SCATTER, OpKind.VIEW, OpKind.REDUCTION, OpKind.IOTA, OpKind.GATHER,
                  OpKind.RAND)  # see value()


def _index_extent(plan: KernelPlan, buffers: set, xnumel, xblock, rnumel, rblock) -> int:
    """A bound (exclusive) on the index values the sizes let this kernel compute: the iteration
    space's positions (rounded up to whole blocks: the last block's masked lanes compute them
    too), the row-major positions of every node it computes at an index (a reshape's index map
    goes through them) or stores (complex ones count real elements), and the sizes of the dims
    of the buffers it loads (a slice's index · step runs up to them). A loaded buffer's offsets
    depend on its strides, which the launch checks (``runtime.program.KernelLaunch``)."""
    extent = max(-(-xnumel // xblock) * xblock, -(-rnumel // rblock) * rblock)
    roots, stack, seen = set(plan.roots), list(plan.roots), set()
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, fx.Node):
            continue
        seen.add(node)
        shape = meta_of(node).shape
        if (node in buffers and node not in roots) or kind_of(node) not in _COMPUTED_KINDS:  # loaded
            extent = max(extent, *shape, 1)
            continue
        extent = max(extent, numel(shape) * (2 if meta_of(node).dtype.is_complex else 1))
        stack.extend(arg for arg in node.args if isinstance(arg, fx.Node))
    return extent


def _describe(plan: KernelPlan) -> str:
    ops = []
    for root in plan.roots:
        stack, seen = [root], set()
        while stack:
            n = stack.pop()
            if n in seen or not isinstance(n, fx.Node) or n.op != "call_function":
                continue
            seen.add(n)
            name = getattr(n.target, "name", "op")
            if name not in ops and kind_of(n) != OpKind.VIEW:
                ops.append(name)
            if kind_of(n) in (OpKind.POINTWISE, OpKind.SCATTER, OpKind.VIEW) or n is root:
                stack.extend(n.args)
    return "fused_" + "_".join(reversed(ops[:4])).replace("pointwise", "pw")


def render_kernel(plan: KernelPlan, buffers: set, shape_generic: bool = False,
                  check_indices: bool = False) -> KernelSource:
    """The Triton source of one fused kernel (``plan``; ``buffers``: the nodes held in memory).

    ``shape_generic``: every size the kernel's text would hold (numels, row lengths, the dims of its
    index math and of its views' index maps, a mean's count, the float constants of its math) is
    an argument instead (``KernelSource.sizes`` holds their values for this build), and blocks and
    warps come from the sizes' buckets (``tiling.size_bucket``): builds of one region that differ
    only in sizes within a bucket give the same source, compiled once. Static kernels keep their
    sizes as literals (index math by constants is cheaper: divisions become shifts).

    ``check_indices``: every gathered index is asserted in range in the kernel (``tl.device_assert``,
    compiled in with Triton's ``debug`` option: ``runtime.launcher``); a forward's gathers, whose
    indices come from the user (a backward's were checked by its forward)."""
    return KernelWriter(plan, buffers, shape_generic, check_indices).write()
