"""The reduction half of the kernel writer: rows held whole in a block (persistent), rows
looped over in steps of RBLOCK with per-lane accumulators, and the online softmax pair.

``ReductionWriter`` is a mixin of ``triton_kernel.KernelWriter``: it relies on the writer's
``value``/``cast``/``tmp``/``store``, its ``lines`` (the body being written), ``plan`` and
``base_index`` (the index of the current row's elements).
"""

from __future__ import annotations

import operator
from contextlib import contextmanager

from compiler.codegen.kernel_text import TL_DTYPE, ZERO, arange, broadcast_index, compose, contiguous_offset, masked
from compiler.codegen.triton_printer import NotPrintable, literal
from compiler.fusion.fuse import inlined_reads
from compiler.ir.graph import OpKind, compute_dtype, kind_of, meta_of, numel


class ReductionWriter:
    def scaled(self, total: str, node, scale: float) -> str:
        """A mean's row total times its ``scale`` (1 / count): the literal in a static kernel; in a
        shape-generic one divided by the count, an argument (the count follows the sizes)."""
        count = node.kwargs.get("count") or numel([meta_of(node.args[0]).shape[d] for d in node.kwargs["dims"]])
        if self.generic and count:
            return f"{total} / {self.size(count, (node, 'count'))}"
        return f"{total} * {literal(scale)}"

    @contextmanager
    def row_values(self):
        """While writing a row's values ([XBLOCK, 1]: an epilogue's, what follows a loop), whose
        loads are no block (``live_values``)."""
        held, self.writing_row_values = self.writing_row_values, True
        try:
            yield
        finally:
            self.writing_row_values = held

    # -- rows held whole in one block ----------------------------------------------------
    def reduced(self, node, index):
        """A reduction root of this kernel whose value is known, read by a later value of
        the same row (in a persistent kernel; after the loop, for the online softmax)."""
        kept = [d for d in range(len(self.plan.shape)) if d not in self.plan.reduce_dims]
        keepdim = node.kwargs["keepdim"]
        wanted = [index[d] for d in kept] if keepdim else list(index)
        if [i.element for i in wanted] != [self.base_index[d].element for d in kept]:
            raise NotPrintable("a reduction read at another row than the one it reduced")
        if node not in self.reductions:
            self.reductions[node] = self.reduce_row(node)
        return self.reductions[node]

    def reduce_row(self, node):
        """Reduce the current rows of ``node``'s input held in registers: [XBLOCK, 1]."""
        var, have = self.value(node.args[0], self.base_index)
        acc_dtype = compute_dtype(meta_of(node).dtype)
        var = self.cast(var, have, acc_dtype)
        scale = node.target.scale(node)
        parts = list(var) if acc_dtype.is_complex else [var]
        out = []
        for part in parts:
            if node.target.name == "amax" and self.long_row:
                # NOTE: NaN from a max over "is NaN" flags, not a sum of the NaN lanes' values (below):
                # that sum keeps a second row-shaped value and spills a row of 32768 on sm_90 (64
                # registers, 64 B spilled; this: 54, none). A tl.reduce with a NaN-propagating
                # combine also fits (48) but the interpreter runs it element by element (minutes).
                held = self.tmp(f"tl.where(MASK, {part}, float(\"-inf\"))")
                total = (f"tl.where(tl.max(({held} != {held}).to(tl.int8), 1)[:, None] > 0, float(\"nan\"), "
                         f"tl.max({held}, 1)[:, None])")
                self.row_reductions += 2     # (``live_values``: each tl.max and tl.sum of a row)
            elif node.target.name == "amax":
                held = self.tmp(f"tl.where(MASK, {part}, float(\"-inf\"))")
                total = (f"tl.max({held}, 1)[:, None] + "
                         f"tl.sum(tl.where({held} != {held}, {held}, 0.0), 1)[:, None]")
                self.row_reductions += 2
            else:
                total = f"tl.sum(tl.where(MASK, {part}, 0), 1)[:, None]"
                self.row_reductions += 1
            if scale != 1.0:
                total = self.scaled(f"({total})", node, scale)
            out.append(self.tmp(total))
        return (tuple(out) if acc_dtype.is_complex else out[0]), acc_dtype

    def write_persistent(self, header, body_prefix, rnumel, wide) -> tuple:
        """One block holds whole rows: reductions are computed once per row, in order, and
        later values of the same row (pointwise roots, other reductions) read them.
        Returns (source lines, stored roots)."""
        stores, columns = [], []
        for root in self.plan.roots:
            if root not in self.buffers:   # read only here (``compiler.fusion.fuse._read_only_where_computed``)
                continue                   # computed where a later root reads it (``reduced``)
            out = len(stores)
            stores.append(root)
            dtype = meta_of(root).dtype
            if root in self.plan.columns:
                columns.append((root, out, self.accumulate_column(root, f"cacc{len(columns)}")))
                continue
            if kind_of(root) == OpKind.REDUCTION:
                var, have = self.reduced(root, self._reduced_index(root))
                self.store(out, self.cast(var, have, dtype), self.row_addresses(dtype), "xmask")
                continue
            if root in self.plan.epilogue:
                self.store_epilogue(root, out)
                continue
            self.store_root(root, out)
        body = [masked(line, "xmask & rmask").replace("SHAPE", "[XBLOCK, RBLOCK]") for line in self.lines]
        rindex = [f"rindex = {arange('RBLOCK', wide)}[None, :]", f"rmask = rindex < {rnumel}"]
        if columns:
            return self.loop_over_chunk(header, rindex, body_prefix + body, columns, wide), stores
        return header + rindex + body_prefix + body, stores

    # -- values of a row, from its reductions (fusion.KernelPlan.takes_epilogue) ----------
    def store_epilogue(self, root, out: int, into: list | None = None) -> None:
        """Compute ``root`` (one value per row, from the rows' reductions) and store it at the row.
        Its lines are a row's values ([XBLOCK, 1], masked by rows only); the reductions it reads
        are computed first, among the row's lines (or, looped, kept after the loop: ``write_loop``)."""
        dims = self.plan.reduce_dims
        if len(meta_of(root).shape) == len(self.plan.shape):  # keepdim: size 1 at the reduced dims
            index = tuple(ZERO if d in dims else self.base_index[d] for d in range(len(self.plan.shape)))
        else:
            index = tuple(self.base_index[d] for d in range(len(self.plan.shape)) if d not in dims)
        reductions = {n for n in self.plan.roots if kind_of(n) == OpKind.REDUCTION}
        for n in inlined_reads(root):
            if n in reductions:
                self.reduced(n, self._reduced_index(n))  # among the row's lines, before the row's values
        mark = len(self.lines)
        with self.row_values():
            var, have = self.value(root, index)
        dtype = meta_of(root).dtype
        var = self.cast(var, have, dtype)
        self.lines[mark:] = [masked(line, "xmask").replace("SHAPE", "[XBLOCK, 1]") for line in self.lines[mark:]]
        self.store(out, var, self.row_addresses(dtype), "xmask")
        if into is not None:
            into.extend(self.lines[mark:])
            del self.lines[mark:]

    def write_epilogue(self, stores) -> list:
        """After a looped reduction: the epilogue roots, from the reduced values kept after the loop
        (its body's own variables are not visible there); their stores are appended to ``stores``."""
        self.values = {}
        src = []
        for root in self.plan.epilogue:
            stores.append(root)
            self.store_epilogue(root, len(stores) - 1, into=src)
        return src

    # -- column sums beside the rows (fusion.split_column_sum) ----------------------------
    def accumulate_column(self, root, acc: str) -> str:
        """The loop body's update of ``acc``, the partial column sums of a chunk's rows of ``root``'s
        value (``plan.columns``); returns the accumulator's dtype."""
        value, _ = self.plan.columns[root]
        acc_dtype = compute_dtype(meta_of(root).dtype)
        var, have = self.value(value, self.base_index)
        var = self.cast(var, have, acc_dtype)
        self.lines.append(f"{acc} = {acc} + tl.where(MASK, {var}, 0)")
        return acc_dtype

    def loop_over_chunk(self, header, rindex, body, columns, wide) -> list:
        """One program per chunk of rows (``plan.columns``): the rows of the chunk in steps of XBLOCK,
        whole rows at a time (``write_persistent``'s body), accumulating the chunk's column sums,
        stored once at the end at the program's row of the [chunks, N] partial sums."""
        chunk_rows = self.chunk_rows()
        pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
        _xindex, _xmask, *x_dims = header
        src = rindex + [f"{acc} = tl.zeros([XBLOCK, RBLOCK], {TL_DTYPE[dtype]})" for _, acc, dtype in
                        ((r, f"cacc{k}", d) for k, (r, _, d) in enumerate(columns))]
        chunk_rows = self.size(chunk_rows, ("chunk rows",))
        src.append(f"for xoffset in range(0, {chunk_rows}, XBLOCK):")
        src += ["    " + line for line in [
            f"xindex = {pid} * {chunk_rows} + xoffset + tl.arange(0, XBLOCK)[:, None]",
            f"xmask = xoffset + tl.arange(0, XBLOCK)[:, None] < {chunk_rows}", *x_dims, *body]]
        cols = self.size(self.plan.shape[-1], ("shape", len(self.plan.shape) - 1))
        for k, (root, out, _) in enumerate(columns):
            total = f"tl.sum(cacc{k}, 0)[None, :].to({TL_DTYPE[meta_of(root).dtype]})"
            self.store(out, total, [f"{pid} * {cols} + rindex"], "rmask", into=src)
        return src

    def chunk_rows(self) -> int:
        """Rows each program of a kernel with column sums takes (``loop_over_chunk``)."""
        chunks = {c for _, c in self.plan.columns.values()}
        assert len(chunks) == 1, chunks
        return numel(self.plan.shape[:-1]) // chunks.pop()     # the rows of (..., N)

    def _reduced_index(self, root):
        kept = [d for d in range(len(self.plan.shape)) if d not in self.plan.reduce_dims]
        if root.kwargs["keepdim"]:
            return tuple(ZERO if d in self.plan.reduce_dims else self.base_index[d]
                         for d in range(len(self.plan.shape)))
        return tuple(self.base_index[d] for d in kept)

    def store_root(self, root, out: int):
        """Store a pointwise root at the current elements (contiguous output). A root of shape (M, N)
        in a kernel over its rows' chunks (chunks, M / chunks, N) (``fusion.KernelPlan.loops_over_chunks``)
        is read at row chunk * (M / chunks) + row: the same contiguous offset; one of shape (..., N)
        at that row's index among its leading dims."""
        index = self.base_index
        shape = tuple(meta_of(root).shape)
        if shape != tuple(self.plan.shape):
            (chunk, row, col), rows = index, self.size_index(self.plan.shape[1], ("shape", 1))
            flat, index = compose("({}) * {} + ({})", chunk, rows, row, value=lambda c, n, r: c * n + r), [col]
            for d in reversed(range(1, len(shape) - 1)):    # row-major: the last leading dim varies fastest
                dim = self.size_index(shape[d], (root, "dim", d))
                index.insert(0, compose("{} % {}", flat, dim, value=operator.mod))
                flat = compose("{} // {}", flat, dim, value=operator.floordiv)
            index = (flat, *index)
        var, have = self.value(root, index)
        dtype = meta_of(root).dtype
        var = self.cast(var, have, dtype)
        single = "(xindex + rindex)" if self.plan.reduce_dims else "xindex"
        offset = contiguous_offset(self.base_index, tuple(self.plan.shape), single, self.size)
        self.store(out, var, self.element_addresses(offset, dtype), "MASK")

    # -- rows looped over ----------------------------------------------------------------
    def accumulate(self, root, accumulators: list):
        """The loop body's update of ``root``'s accumulators (one per real part), appended
        to ``accumulators`` as (root, [names], dtype); an amax computed with an online sum
        updates both."""
        var, have = self.value(root.args[0], self.base_index)
        acc_dtype = compute_dtype(meta_of(root).dtype)
        var = self.cast(var, have, acc_dtype)
        count = sum(len(a[1]) for a in accumulators)
        partner = next((total for total, m in self.plan.online.items() if m is root), None)
        if partner is not None:
            acc_max, acc_sum = f"acc{count}", f"acc{count + 1}"
            self.online_update(var, acc_max, acc_sum)
            accumulators += [(root, [acc_max], acc_dtype), (partner, [acc_sum], acc_dtype)]
            return
        names = []
        for part in (list(var) if acc_dtype.is_complex else [var]):
            acc = f"acc{count + len(names)}"
            if root.target.name == "amax":  # NaN wins, as in eager
                self.lines.append(f"{acc} = {_nan_or_max(part, acc)}")
            else:
                self.lines.append(f"{acc} = {acc} + tl.where(MASK, {part}, 0)")
            names.append(acc)
        accumulators.append((root, names, acc_dtype.to_real() if acc_dtype.is_complex else acc_dtype))

    def write_loop(self, body_prefix, body, rnumel, accumulators, stores, wide) -> list:
        """Accumulators, the loop over the row in steps of RBLOCK, and the stores of the
        reduced values (appended to ``stores``)."""
        src = []
        for root, accs, acc_dtype in accumulators:
            for acc in accs:
                if root.target.name == "amax":
                    src.append(f"{acc} = tl.full([XBLOCK, RBLOCK], float(\"-inf\"), {TL_DTYPE[acc_dtype]})")
                else:
                    src.append(f"{acc} = tl.zeros([XBLOCK, RBLOCK], {TL_DTYPE[acc_dtype]})")
        src.append(f"for roffset in range(0, {rnumel}, RBLOCK):")
        loop = [f"rindex = roffset + {arange('RBLOCK', wide)}[None, :]", f"rmask = rindex < {rnumel}"]
        src += ["    " + line for line in loop + body_prefix + body]
        maxima = {}    # amax root with an online sum -> (its accumulator, the variable holding its value)
        for root, accs, acc_dtype in accumulators:
            stored = root in self.buffers   # else read only by this kernel's second loop (not stored)
            out = len(stores)
            if stored:
                stores.append(root)
            scale = root.target.scale(root)
            dtype = meta_of(root).dtype
            part_dtype = dtype.to_real() if dtype.is_complex else dtype
            for k, acc in enumerate(accs):
                total = f"tl.sum({acc}, 1)[:, None]"
                if root.target.name == "amax":  # the max, plus NaN if any element was NaN
                    total = (f"(tl.max({acc}, 1)[:, None] + "
                             f"tl.sum(tl.where({acc} != {acc}, {acc}, 0.0), 1)[:, None])")
                    if any(m is root for m in self.plan.online.values()):
                        src.append(f"max{len(maxima)} = {total}")
                        maxima[root] = (acc, f"max{len(maxima)}")
                        total = maxima[root][1]
                if root in self.plan.online:
                    total = self.online_total(root, acc, *maxima[self.plan.online[root]], acc_dtype, src)
                if scale != 1.0:
                    total = self.scaled(total, root, scale)
                if len(accs) == 1:   # a real row's value, kept for a second loop (``write_second_loop``)
                    held = f"red{self.counter}"
                    self.counter += 1
                    src.append(f"{held} = {total}")
                    self.reductions[root] = (held, acc_dtype)
                    total = held
                if stored:
                    self.store(out, f"({total}).to({TL_DTYPE[part_dtype]})", [self.row_addresses(dtype)[k]],
                               "xmask", into=src)
        return src

    def write_second_loop(self, body_prefix, rnumel, stores, wide) -> list:
        """A second loop over the row for the roots that read its reductions (``plan.second_pass``,
        ``tiling.rereads_row_from_l2``): they read the reduced values kept by ``write_loop``, and
        their stores are appended to ``stores``."""
        self.values = {}     # the first loop's variables hold its last step's elements
        mark = len(self.lines)
        for root in self.plan.second_pass:
            stores.append(root)
            self.store_root(root, len(stores) - 1)
        body = [masked(line, "xmask & rmask").replace("SHAPE", "[XBLOCK, RBLOCK]") for line in self.lines[mark:]]
        loop = [f"rindex = roffset + {arange('RBLOCK', wide)}[None, :]", f"rmask = rindex < {rnumel}"]
        return [f"for roffset in range(0, {rnumel}, RBLOCK):"] + ["    " + line for line in loop + body_prefix + body]

    # -- online softmax ------------------------------------------------------------------
    def online_update(self, value, acc_max, acc_sum):
        """One step of online softmax, per lane: the running max takes ``value`` and the sum
        of exp(x - shift) is rescaled to the new shift before ``value``'s term is added. The
        shift is the max, or 0 where the max is ±inf (as softmax's own shift), so a lane of
        -inf adds nothing and a lane with +inf sums exp(x) itself; a zero sum is never
        rescaled (0 * inf would be NaN)."""
        new_max = self.tmp(_nan_or_max(value, acc_max))
        old_shift = self.tmp(_finite_or_zero(acc_max))
        new_shift = self.tmp(_finite_or_zero(new_max))
        self.lines.append(f"{acc_sum} = tl.where({acc_sum} == 0, 0.0, {acc_sum} * tl.exp({old_shift} - {new_shift})) + "
                          f"tl.where(MASK, tl.exp({value} - {new_shift}), 0.0)")
        self.lines.append(f"{acc_max} = {new_max}")

    def online_total(self, root, acc_sum, acc_max, max_value, acc_dtype, src) -> str:
        """The row's sum(exp(x - c)) from the per-lane sums of an online softmax: each lane's
        sum is rescaled from its own shift to c, which is computed here (after the loop, into
        ``src``) from the row's max."""
        amax = self.plan.online[root]
        shifted = root.args[0].args[0]            # x - c
        c = shifted.args[1]
        self.reductions[amax] = (max_value, acc_dtype)
        mark = len(self.lines)
        with self.row_values():
            value, have = self.value(c, broadcast_index(self.base_index, meta_of(shifted).shape, meta_of(c).shape))
        value = self.cast(value, have, acc_dtype)
        src.extend(line.replace("SHAPE", "[XBLOCK, 1]") for line in self.lines[mark:])
        del self.lines[mark:]
        return (f"tl.sum(tl.where({acc_sum} == 0, 0.0, {acc_sum} * tl.exp({_finite_or_zero(acc_max)} - {value})), "
                f"1)[:, None]")


def _nan_or_max(value: str, acc: str) -> str:
    """The accumulator updated with ``value`` where the mask holds: NaN wins, as in eager.
    NOTE: nested wheres, not `(v > acc) | (v != v)`: the interpreter cannot `|` a scalar
    load's comparison with a block (TypeError from numpy's bitwise_or)."""
    return f"tl.where(MASK, tl.where({value} != {value}, {value}, tl.where({value} > {acc}, {value}, {acc})), {acc})"


def _finite_or_zero(value: str) -> str:
    return f"tl.where(tl.abs({value}) == float(\"inf\"), 0.0, {value})"
