"""Writes the Triton source of one fused kernel.

A kernel walks an iteration space (``plan.shape``); non-reduced dims are spread over
programs in blocks of XBLOCK, reduced dims are looped over in blocks of RBLOCK. Every value
is computed at a multi-index: buffers are loaded at ``sum(index * stride)`` (strides are
kernel arguments, so any input layout works), pointwise nodes print their SymPy expression
over their arguments' values, and views rewrite the index (``View.index_map``). Values are
shared within a kernel by (node, index), so a fused chain is computed once per element.

Sizes are baked into the source (shapes are guarded), strides are arguments; the kernel's
name is a hash of its body, so identical kernels are compiled once.
"""

from __future__ import annotations

import hashlib
import re
import itertools
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from compiler.codegen.realify import IM, RE, realify
from compiler.codegen.triton_printer import NotPrintable, TritonPrinter
from compiler.ops import symbols as Y
from compiler.fusion import KernelPlan, kind_of
from compiler.ir import compute_dtype, contiguous_strides, numel
from compiler.tiling import choose_tiling, fits_one_block

TL_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
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


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels see complex tensors as their real view (torch.view_as_real)."""
    return dtype.to_real() if dtype.is_complex else dtype


class KernelWriter:
    def __init__(self, plan: KernelPlan, buffers: set):
        self.plan = plan
        self.buffers = buffers
        self.roots = set(plan.roots)
        self.lines: list[str] = []
        self.values: dict = {}
        self.load_args: dict = {}
        self.counter = 0
        self.reductions: dict = {}   # persistent kernels: reduction root -> its row value
        self.persistent = False
        self.base_index: tuple = ()
        self.x_names: set = set()    # index variables that do not vary along a row
        self.r_names: set = set()    # index variables that vary only along a row

    # -- helpers -----------------------------------------------------------------------
    def tmp(self, text: str) -> str:
        name = f"t{self.counter}"
        self.counter += 1
        self.lines.append(f"{name} = {text}")
        return name

    def load(self, node: fx.Node, index):
        """The element of buffer ``node`` at ``index``; complex: (real, imag) of it."""
        if node not in self.load_args:
            self.load_args[node] = f"in{len(self.load_args)}"
        arg = self.load_args[node]
        dtype = node.meta["dtype"]
        terms = [f"({idx}) * {arg}_s{d}" for d, (idx, size) in enumerate(zip(index, node.meta["shape"]))
                 if size != 1 and idx != "0"]
        offset = " + ".join(terms)
        if offset and all(idx.isdigit() for idx in index):  # a fixed element: scalar load
            if dtype.is_complex:
                return (self.tmp(f"tl.load({arg}_ptr + {offset})"),
                        self.tmp(f"tl.load({arg}_ptr + {offset} + 1)")), dtype
            return self.tmp(f"tl.load({arg}_ptr + {offset})"), dtype
        if dtype.is_complex:  # interleaved storage: strides count real elements
            if not offset:
                return (self.tmp(f"tl.load({arg}_ptr)"), self.tmp(f"tl.load({arg}_ptr + 1)")), dtype
            return (self.tmp(f"tl.load({arg}_ptr + {offset}, mask=MASK, other=0)"),
                    self.tmp(f"tl.load({arg}_ptr + {offset} + 1, mask=MASK, other=0)")), dtype
        if not offset:  # one element for the whole block: a scalar load, broadcast on use
            return self.tmp(f"tl.load({arg}_ptr)"), dtype
        names = set(re.findall(r"[A-Za-z_]\w*", offset)) - {f"{arg}_s{d}" for d in range(len(index))}
        if names <= self.x_names:  # the same element all along a row: one per row ([XBLOCK, 1])
            return self.tmp(f"tl.load({arg}_ptr + {offset}, mask=XMASK, other=0)"), dtype
        if names <= self.r_names:  # the same element for every row: one per column ([1, RBLOCK])
            return self.tmp(f"tl.load({arg}_ptr + {offset}, mask=RMASK, other=0)"), dtype
        return self.tmp(f"tl.load({arg}_ptr + {offset}, mask=MASK, other=0)"), dtype

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
        """(Triton variable(s), dtype) of ``node`` at ``index``: loaded, or computed inline."""
        index = tuple(_fold(i) for i in index)
        key = (node, index)
        if key in self.values:
            return self.values[key]
        kind = kind_of(node)
        if kind == "iota" and not (node in self.buffers and node not in self.roots):
            position = index[node.kwargs["dim"]]
            result = self.tmp(f"tl.full(SHAPE, {position}, tl.int64)" if position.isdigit()
                              else f"({position}).to(tl.int64)"), torch.int64
            self.values[key] = result
            return result
        if kind == "gather" and not (node in self.buffers and node not in self.roots):
            result = self.gathered(node, index)
            self.values[key] = result
            return result
        if kind == "rand" and not (node in self.buffers and node not in self.roots):
            result = self.random(node, index)
            self.values[key] = result
            return result
        if (node in self.buffers and node not in self.roots) or \
                kind not in ("pointwise", "scatter", "view", "reduction"):
            result = self.load(node, index)
        elif kind == "view" and node.target.name == "view_as_real":
            (re, im), dtype = self.value(node.args[0], index[:-1])
            result = self.tmp(f"tl.where({index[-1]} == 0, {re}, {im})"), dtype.to_real()
        elif kind == "view" and node.target.name == "view_as_complex":
            re, dtype = self.value(node.args[0], index + ("0",))
            im, _ = self.value(node.args[0], index + ("1",))
            result = (re, im), node.meta["dtype"]
        elif kind == "view":
            result = self.value(node.args[0], tuple(node.target.index_map(node, list(index))))
        elif kind == "reduction" and (self.persistent or node in self.reductions):
            result = self.reduced(node, index)  # a row's reduction, once its value is known
        elif kind == "pointwise":
            result = self.pointwise(node, index)
        elif kind == "scatter":
            result = self.slice_scatter(node, index)
        else:
            raise AssertionError(f"reduction {node.name} read inside the kernel that computes it")
        self.values[key] = result
        return result

    def pointwise(self, node: fx.Node, index: tuple):
        out_shape = node.meta["shape"]
        out_dtype = node.meta["dtype"]
        expr = node.meta["expr"]
        is_compare = getattr(node.target, "name", "") in ("lt", "le", "gt", "ge", "eq", "ne")
        args = []
        for arg in node.args:
            args.append(self.value(arg, _broadcast_index(index, out_shape, arg.meta["shape"])))
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
        dim, size = node.kwargs["dim"], source.meta["shape"][node.kwargs["dim"]]
        i, _ = self.value(index_node, tuple(index_at))
        i = self.tmp(f"{i}.to(tl.int64)")
        if node.kwargs.get("wrap"):
            i = self.tmp(f"tl.where({i} < 0, {i} + {size}, {i})")
        # NOTE: clamped, so a bad index never reads outside memory; the program checks the
        # indices on the host and raises eager's error (``runtime.program.IndexCheck``).
        i = self.tmp(f"tl.minimum(tl.maximum({i}, 0), {size - 1})")
        source_at[dim] = i
        value, dtype = self.value(source, tuple(source_at))
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
        shape, strides = node.meta["shape"], contiguous_strides(node.meta["shape"])
        if all(idx.isdigit() for idx in index):  # one known element
            position = f"tl.full(SHAPE, {sum(int(i) * st for i, st in zip(index, strides))}, tl.int64)"
        else:
            position = " + ".join(f"({idx}).to(tl.int64) * {stride}" for idx, size, stride in zip(index, shape, strides)
                                  if size != 1 and idx != "0") or "tl.full(SHAPE, 0, tl.int64)"
        return self.tmp(f"tl.rand({seed}, {position})"), torch.float32

    def reduced(self, node, index):
        """A reduction root of this persistent kernel, read by a later value of the same row."""
        kept = [d for d in range(len(self.plan.shape)) if d not in self.plan.reduce_dims]
        keepdim = node.kwargs["keepdim"]
        wanted = [index[d] for d in kept] if keepdim else list(index)
        if wanted != [self.base_index[d] for d in kept]:
            raise NotPrintable("a reduction read at another row than the one it reduced")
        if node not in self.reductions:
            self.reductions[node] = self.reduce_row(node)
        return self.reductions[node]

    def reduce_row(self, node):
        """Reduce the current rows of ``node``'s input held in registers: [XBLOCK, 1]."""
        var, have = self.value(node.args[0], self.base_index)
        acc_dtype = compute_dtype(node.meta["dtype"])
        var = self.cast(var, have, acc_dtype)
        scale = node.target.scale(node)
        parts = list(var) if acc_dtype.is_complex else [var]
        out = []
        for part in parts:
            if node.target.name == "amax":
                masked = self.tmp(f"tl.where(MASK, {part}, float(\"-inf\"))")
                total = (f"tl.max({masked}, 1)[:, None] + "
                         f"tl.sum(tl.where({masked} != {masked}, {masked}, 0.0), 1)[:, None]")
            else:
                total = f"tl.sum(tl.where(MASK, {part}, 0), 1)[:, None]"
            if scale != 1.0:
                total = f"({total}) * {scale!r}"
            out.append(self.tmp(total))
        return (tuple(out) if acc_dtype.is_complex else out[0]), acc_dtype

    def slice_scatter(self, node, index: tuple):
        """base[idx], or src at the slice position when idx lies in the slice."""
        base, src = node.args
        d, start, step, length = (node.kwargs[k] for k in ("dim", "start", "step", "length"))
        dtype = compute_dtype(node.meta["dtype"])
        base_value, base_dtype = self.value(base, index)
        base_value = self.cast(base_value, base_dtype, dtype)
        if length == 0:
            return base_value, dtype
        if index[d].isdigit():  # a known position: whether it is in the slice is known now
            at = int(index[d]) - start
            if not (0 <= at < length * step and at % step == 0):
                return base_value, dtype
            src_index = tuple(str(at // step) if i == d else idx for i, idx in enumerate(index))
            src_index = _broadcast_index(src_index, node.meta["shape"], src.meta["shape"])
            src_value, src_dtype = self.value(src, src_index)
            return self.cast(src_value, src_dtype, dtype), dtype
        rel = self.tmp(f"{index[d]} - {start}")
        inside = f"({rel} >= 0) & ({rel} < {length * step})"
        if step != 1:
            inside += f" & ({rel} % {step} == 0)"
        inside = self.tmp(inside)
        # clamp, so positions outside the slice still read inside src (their value is unused)
        position = self.tmp(f"tl.minimum(tl.maximum({rel} // {step}, 0), {length - 1})")
        src_index = tuple(position if i == d else idx for i, idx in enumerate(index))
        src_index = _broadcast_index(src_index, node.meta["shape"], src.meta["shape"])
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
        replacements, reduced = sympy.cse(list(exprs), symbols=_cse_symbols(), order="none")
        printer = TritonPrinter(names, dtype)
        for sym, sub in replacements:
            # NOTE: a number stays a literal: a Triton variable holding a Python float is a
            # float32 scalar, which would round fp64 constants.
            names[sym] = printer(sub) if sub.is_number else self.tmp(printer(sub))
        return [printer(e) for e in reduced]

    # -- the kernel --------------------------------------------------------------------
    def write(self) -> KernelSource:
        plan = self.plan
        shape = tuple(plan.shape)
        rdims = tuple(plan.reduce_dims)
        xdims = tuple(d for d in range(len(shape)) if d not in rdims)
        xnumel = numel([shape[d] for d in xdims])
        rnumel = numel([shape[d] for d in rdims])
        reduction = bool(rdims)
        wide = numel(shape) >= 2**31
        self.persistent = fits_one_block(shape, rdims)
        index = [None] * len(shape)
        header = []
        pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
        if reduction:
            header.append(f"xindex = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
        else:
            header.append(f"xindex = {pid} * XBLOCK + tl.arange(0, XBLOCK)")
        header.append(f"xmask = xindex < {xnumel}")
        body_prefix = []
        for dims, var, target in ((xdims, "xindex", header), (rdims, "rindex", body_prefix)):
            sizes = [shape[d] for d in dims]
            strides = contiguous_strides(sizes)
            for d, size, stride in zip(dims, sizes, strides):
                if size == 1:
                    index[d] = "0"
                    continue
                term = var if stride == 1 else f"({var} // {stride})"
                if stride * size < numel(sizes):
                    term = f"({term} % {size})"
                target.append(f"i{d} = {term}")
                index[d] = f"i{d}"
        index = tuple(index)
        self.base_index = index
        self.x_names = {"xindex"} | {f"i{d}" for d in xdims}
        self.r_names = {"rindex", "roffset"} | {f"i{d}" for d in rdims} if reduction else set()
        if self.persistent:
            return self.write_persistent(header, body_prefix, index, xnumel, rnumel, wide)

        stores = []
        accumulators = []   # (root, [accumulator per part], part dtype)
        for root in plan.roots:
            if root in plan.online:  # accumulated with its amax (below)
                continue
            if kind_of(root) == "reduction":
                var, have = self.value(root.args[0], index)
                acc_dtype = compute_dtype(root.meta["dtype"])
                var = self.cast(var, have, acc_dtype)
                partner = next((total for total, m in plan.online.items() if m is root), None)
                if partner is not None:
                    count = sum(len(a[1]) for a in accumulators)
                    acc_max, acc_sum = f"acc{count}", f"acc{count + 1}"
                    self.online_update(var, acc_max, acc_sum)
                    accumulators += [(root, [acc_max], acc_dtype), (partner, [acc_sum], acc_dtype)]
                    continue
                parts = list(var) if acc_dtype.is_complex else [var]
                names = []
                for part in parts:
                    acc = f"acc{sum(len(a[1]) for a in accumulators) + len(names)}"
                    if root.target.name == "amax":  # NaN wins, as in eager
                        self.lines.append(f"{acc} = tl.where((MASK) & (({part} > {acc}) | ({part} != {part})), "
                                          f"{part}, {acc})")
                    else:
                        self.lines.append(f"{acc} = {acc} + tl.where(MASK, {part}, 0)")
                    names.append(acc)
                accumulators.append((root, names, acc_dtype.to_real() if acc_dtype.is_complex else acc_dtype))
            else:
                var, have = self.value(root, index)
                out = f"out{len(stores)}"
                stores.append(root)
                offsets = contiguous_strides(shape)
                terms = [f"({i}) * {st}" if st != 1 else f"({i})" for i, st, size in zip(index, offsets, shape)
                         if size != 1 and i != "0"]
                dtype = root.meta["dtype"]
                var = self.cast(var, have, dtype)
                # one element: any lane index works as the offset, the mask keeps lane 0 only
                offset = " + ".join(terms) or ("(xindex + rindex)" if plan.reduce_dims else "xindex")
                if dtype.is_complex:  # interleaved: real at 2·offset, imaginary next to it
                    self.lines.append(f"tl.store({out}_ptr + 2 * ({offset}), {var[0]}, mask=MASK)")
                    self.lines.append(f"tl.store({out}_ptr + 2 * ({offset}) + 1, {var[1]}, mask=MASK)")
                else:
                    self.lines.append(f"tl.store({out}_ptr + {offset}, {var}, mask=MASK)")

        body = [_masked(line, "xmask & rmask" if reduction else "xmask")
                .replace("SHAPE", "[XBLOCK, RBLOCK]" if reduction else "[XBLOCK]") for line in self.lines]
        src = []
        src += header
        if reduction:
            for root, accs, acc_dtype in accumulators:
                for acc in accs:
                    if root.target.name == "amax":
                        src.append(f"{acc} = tl.full([XBLOCK, RBLOCK], float(\"-inf\"), {TL_DTYPE[acc_dtype]})")
                    else:
                        src.append(f"{acc} = tl.zeros([XBLOCK, RBLOCK], {TL_DTYPE[acc_dtype]})")
            src.append(f"for roffset in range(0, {rnumel}, RBLOCK):")
            loop = ["rindex = roffset + tl.arange(0, RBLOCK)[None, :]", f"rmask = rindex < {rnumel}"]
            loop += body_prefix + body
            src += ["    " + line for line in loop]
            maxima = {}    # amax root -> (its accumulator, the variable holding its value)
            for root, accs, acc_dtype in accumulators:
                out = f"out{len(stores)}"
                stores.append(root)
                scale = root.target.scale(root)
                dtype = root.meta["dtype"]
                part_dtype = dtype.to_real() if dtype.is_complex else dtype
                for k, acc in enumerate(accs):
                    total = f"tl.sum({acc}, 1)[:, None]"
                    if root.target.name == "amax":  # the max, plus NaN if any element was NaN
                        total = (f"(tl.max({acc}, 1)[:, None] + "
                                 f"tl.sum(tl.where({acc} != {acc}, {acc}, 0.0), 1)[:, None])")
                        if any(m is root for m in plan.online.values()):
                            src.append(f"max{len(maxima)} = {total}")
                            maxima[root] = (acc, f"max{len(maxima)}")
                            total = maxima[root][1]
                    if root in plan.online:
                        total = self.online_total(root, acc, *maxima[plan.online[root]], acc_dtype, src)
                    if scale != 1.0:
                        total = f"{total} * {scale!r}"
                    where = f"2 * xindex + {k}" if dtype.is_complex else "xindex"
                    src.append(f"tl.store({out}_ptr + {where}, ({total}).to({TL_DTYPE[part_dtype]}), mask=xmask)")
        else:
            src += body_prefix + body

        return self.finish(src, stores, xnumel, wide, accumulators=sum(len(a[1]) for a in accumulators))

    def online_update(self, value, acc_max, acc_sum):
        """One step of online softmax, per lane: the running max takes ``value`` and the sum
        of exp(x - shift) is rescaled to the new shift before ``value``'s term is added. The
        shift is the max, or 0 where the max is ±inf (as softmax's own shift), so a lane of
        -inf adds nothing and a lane with +inf sums exp(x) itself; a zero sum is never
        rescaled (0 * inf would be NaN)."""
        new_max = self.tmp(f"tl.where((MASK) & (({value} > {acc_max}) | ({value} != {value})), {value}, {acc_max})")
        old_shift = self.tmp(_finite_or_zero(acc_max))
        new_shift = self.tmp(_finite_or_zero(new_max))
        self.lines.append(f"{acc_sum} = tl.where({acc_sum} == 0, 0.0, {acc_sum} * tl.exp({old_shift} - {new_shift})) + "
                          f"tl.where(MASK, tl.exp({value} - {new_shift}), 0.0)")
        self.lines.append(f"{acc_max} = {new_max}")

    def online_total(self, root, acc_sum, acc_max, max_value, acc_dtype, src) -> str:
        """The row's sum(exp(x - c)) from the per-lane sums of an online softmax: each lane's
        sum is rescaled from its own shift to c, which is computed here from the row's max."""
        amax = self.plan.online[root]
        shifted = root.args[0].args[0]            # x - c
        c = shifted.args[1]
        self.reductions[amax] = (max_value, acc_dtype)
        mark = len(self.lines)
        value, have = self.value(c, _broadcast_index(self.base_index, shifted.meta["shape"], c.meta["shape"]))
        value = self.cast(value, have, acc_dtype)
        src.extend(line.replace("SHAPE", "[XBLOCK, 1]") for line in self.lines[mark:])
        del self.lines[mark:]
        return (f"tl.sum(tl.where({acc_sum} == 0, 0.0, {acc_sum} * tl.exp({_finite_or_zero(acc_max)} - {value})), "
                f"1)[:, None]")

    def write_persistent(self, header, body_prefix, index, xnumel, rnumel, wide):
        """One block holds whole rows: reductions are computed once per row, in order, and
        later values of the same row (pointwise roots, other reductions) read them."""
        stores = []
        for root in self.plan.roots:
            out = f"out{len(stores)}"
            stores.append(root)
            dtype = root.meta["dtype"]
            if kind_of(root) == "reduction":
                var, have = self.reduced(root, self._reduced_index(root))
                var = self.cast(var, have, dtype)
                parts = var if dtype.is_complex else (var,)
                for k, part in enumerate(parts):
                    where = f"2 * xindex + {k}" if dtype.is_complex else "xindex"
                    self.lines.append(f"tl.store({out}_ptr + {where}, {part}, mask=xmask)")
                continue
            var, have = self.value(root, index)
            var = self.cast(var, have, dtype)
            shape = self.plan.shape
            offsets = contiguous_strides(shape)
            terms = [f"({i}) * {st}" if st != 1 else f"({i})" for i, st, size in zip(index, offsets, shape)
                     if size != 1 and i != "0"]
            offset = " + ".join(terms) or "(xindex + rindex)"
            if dtype.is_complex:
                self.lines.append(f"tl.store({out}_ptr + 2 * ({offset}), {var[0]}, mask=MASK)")
                self.lines.append(f"tl.store({out}_ptr + 2 * ({offset}) + 1, {var[1]}, mask=MASK)")
            else:
                self.lines.append(f"tl.store({out}_ptr + {offset}, {var}, mask=MASK)")
        body = [_masked(line, "xmask & rmask").replace("SHAPE", "[XBLOCK, RBLOCK]") for line in self.lines]
        src = header + ["rindex = tl.arange(0, RBLOCK)[None, :]", f"rmask = rindex < {rnumel}"] + body_prefix + body
        return self.finish(src, stores, xnumel, wide, accumulators=0)

    def _reduced_index(self, root):
        kept = [d for d in range(len(self.plan.shape)) if d not in self.plan.reduce_dims]
        if root.kwargs["keepdim"]:
            return tuple("0" if d in self.plan.reduce_dims else self.base_index[d]
                         for d in range(len(self.plan.shape)))
        return tuple(self.base_index[d] for d in kept)

    def finish(self, src, stores, xnumel, wide, accumulators) -> KernelSource:
        loads = list(self.load_args)
        tiling = choose_tiling(self.plan.shape, self.plan.reduce_dims,
                               live_values=_live_values(self.lines, accumulators, self.persistent),
                               wide_values=any(n.meta["dtype"].itemsize >= 8 for n in loads + stores))
        xblock, rblock = tiling.xblock, tiling.rblock
        params, signature = [], {}
        for node, arg in self.load_args.items():
            params.append(f"{arg}_ptr")
            signature[f"{arg}_ptr"] = "*" + SIGNATURE_DTYPE[_storage_dtype(node.meta["dtype"])]
            for d in range(len(node.meta["shape"])):
                params.append(f"{arg}_s{d}")
                signature[f"{arg}_s{d}"] = "i64" if wide else "i32"
        for i, node in enumerate(stores):
            params.append(f"out{i}_ptr")
            signature[f"out{i}_ptr"] = "*" + SIGNATURE_DTYPE[_storage_dtype(node.meta["dtype"])]
        signature["XBLOCK"] = "constexpr"
        signature["RBLOCK"] = "constexpr"
        body_text = "\n".join("    " + line for line in src)
        digest = hashlib.sha256((",".join(params) + body_text + f"{xblock},{rblock},{tiling.num_warps}")
                                .encode()).hexdigest()[:12]
        name = f"{_describe(self.plan)}_{digest}"
        source = "\n".join([
            "import triton",
            "import triton.language as tl",
            "from runtime.triton_math import libdevice",
            "",
            f"XBLOCK_DEFAULT = {xblock}",
            f"RBLOCK_DEFAULT = {rblock}",
            f"NUM_WARPS = {tiling.num_warps}",
            f"SIGNATURE = {signature!r}",
            "",
            "",
            "@triton.jit",
            f"def {name}({', '.join(params + ['XBLOCK: tl.constexpr', 'RBLOCK: tl.constexpr'])}):",
            body_text,
            "",
        ])
        grid = -(-xnumel // xblock)
        moved = sum(numel(n.meta["shape"]) * n.meta["dtype"].itemsize for n in loads + stores)
        return KernelSource(name, source, loads, stores, grid, signature, moved, tiling.num_warps)


_cse_counter = itertools.count()


def _cse_symbols():
    while True:
        yield sympy.Symbol(f"cse{next(_cse_counter)}", real=True)


def _used_as_condition(expr, symbol) -> bool:
    from compiler.ops import scalar as S
    return any(w.args[0] == symbol for w in expr.atoms(S.Where))


def _masked(line: str, mask: str) -> str:
    """A body line with its mask placeholders filled: XMASK (a value per row), RMASK (a value
    per row position), MASK (a value per element)."""
    return line.replace("XMASK", "xmask").replace("RMASK", "rmask").replace("MASK", mask)


def _finite_or_zero(value: str) -> str:
    return f"tl.where(tl.abs({value}) == float(\"inf\"), 0.0, {value})"


def _live_values(lines, accumulators: int, persistent: bool) -> int:
    """An estimate of the block-shaped values a kernel holds at once: each block load, each
    accumulator, and in a persistent kernel each row reduction (values computed before it
    are held until the reduced value is known)."""
    loads = sum(1 for line in lines if "tl.load(" in line and "mask=MASK" in line)
    reductions = sum(line.count("tl.sum(") + line.count("tl.max(") for line in lines) if persistent else 0
    return loads + accumulators + 2 * reductions


def _fold(index: str) -> str:
    """An index expression with no variables in it, as its integer value ("(((0)))" -> "0")."""
    if index.isdigit() or re.search(r"[A-Za-z_]", index):
        return index
    return str(eval(index, {"__builtins__": {}}))  # digits, operators and parentheses only


def _broadcast_index(index: tuple, out_shape: tuple, arg_shape: tuple) -> tuple:
    lead = len(out_shape) - len(arg_shape)
    return tuple("0" if size == 1 else index[lead + d] for d, size in enumerate(arg_shape))


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
            if name not in ops and kind_of(n) != "view":
                ops.append(name)
            if kind_of(n) in ("pointwise", "scatter", "view") or n is root:
                stack.extend(n.args)
    return "fused_" + "_".join(reversed(ops[:4])).replace("pointwise", "pw")


def render_kernel(plan: KernelPlan, buffers: set) -> KernelSource:
    return KernelWriter(plan, buffers).write()
