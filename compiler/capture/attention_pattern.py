"""Attention written out becomes flash attention: ``softmax(q @ kᵀ · scale [+ mask | masked_fill])
[dropout] @ v``, as nanoGPT's non-flash path, older Hugging Face code and the benchmark transformer
write it, is rewritten into the flash-attention op (``catalog.emit_attention``) wherever nothing
else reads the scores or the weights: the T x T matrices are then never stored, where eager keeps
them (this goes beyond eager).

The pattern is matched on what the bindings record for it (``matmul``: reshapes around a ``bmm``;
``softmax``: the shifted ``exp`` over a ``sum``; ``masked_fill``: a ``where`` with ``-inf``;
dropout: a ``where`` of ``rand >= p``), reading each pointwise node's SymPy expression, not its
name. A mask made from positions alone (``torch.tril(torch.ones(T, T))``) is evaluated when the
graph is built: if it is the causal mask the kernels skip the tiles above the diagonal and
nothing is read. A row that every key is masked from stays NaN, as softmax makes it.

The other passes here shape what the flash op reads and writes (``attention_passes`` runs all four):
an operand that is a whole copy of another tensor is read from that tensor
(``attention_reads_whole_copies_source``); Llama's rotary embedding of q and k is applied inside
the kernels (``rotary_inside_attention``); an output only transposed back to [B, T, H, D] is
written in that layout (``outputs_heads_last``).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind, arg_symbol, kind_of, meta_of, output_node
from compiler.ir.ops import catalog as C
from compiler.ir.ops.primitives.comparisons import COMPARE_OPS, Compare, Where
from compiler.ir.reference import run_graph

A0, A1 = arg_symbol(0), arg_symbol(1)


class _Match:
    """One written-out attention, matched from the product ``weights @ v`` (``bmm``) down to
    q kᵀ: what it computes (``ok`` when the pattern holds), and the nodes only it may read."""

    def __init__(self, bmm: fx.Node | None = None):
        self.q = self.k = self.v = self.result = None
        self.scale, self.dropout_p = 1.0, 0.0
        self.mask = None          # boolean (True attends) or additive
        self.masked_out = None    # boolean, True where masked_fill wrote -inf
        self.seed = None
        self.inner: list = []     # the pattern's nodes (its result, replaced, aside)
        self.ok = bmm is not None and self._match(bmm)

    def private(self, outputs: set) -> bool:
        """No node of the pattern is returned or read outside it (its result, the reshape of the
        last product, is what the flash op replaces)."""
        inner = set(self.inner)
        return not any(node in outputs or any(u not in inner and u is not self.result for u in node.users)
                       for node in inner)

    def _match(self, bmm: fx.Node) -> bool:
        weights, values = (_unreshaped(a, 4) for a in bmm.args)
        out = _only_user(bmm)
        if weights is None or values is None or out is None or not _is_view(out, "reshape"):
            return False
        self.inner += [bmm, *bmm.args]
        self.v, self.result = values, out
        scores = self._softmax_input(self._dropout(self._through_casts(weights)))
        raw = self._mask_and_scale(scores) if scores is not None else None
        if raw is None or not self._scores_product(raw):
            return False
        shapes = [meta_of(x).shape for x in (self.q, self.k, self.v)]
        dtypes = {meta_of(x).dtype for x in (self.q, self.k, self.v)}
        return len(dtypes) == 1 and dtypes == {meta_of(out).dtype} and shapes[0][:2] == shapes[1][:2] \
            and shapes[1] == shapes[2] and shapes[0][-1] == shapes[1][-1] and 0 < shapes[0][-1] <= 256

    def _softmax_input(self, weights: fx.Node) -> fx.Node | None:
        """S where ``weights`` is softmax(S, -1) as recorded: exp(S - shift) / sum(exp(S - shift)),
        the shift computed from amax(S) alone."""
        if not _pointwise(weights, A0 / A1):
            return None
        e, total = weights.args
        if not _is_reduction(total, "sum", e) or not _pointwise(e, sympy.exp(A0)):
            return None
        shifted = e.args[0]
        if not _pointwise(shifted, A0 - A1):
            return None
        scores, shift = shifted.args
        made = _made_only_from(shift, scores)
        if made is None or not any(_is_reduction(n, "amax", scores) for n in made):
            return None
        self.inner += [weights, e, total, shifted, *made]
        return scores

    def _mask_and_scale(self, scores: fx.Node) -> fx.Node | None:
        """Walk from the scores down to q kᵀ through scalings, one mask and casts; the product's node."""
        node = scores
        while not (_is_view(node, "reshape") and _is_extern(node.args[0], "bmm")):
            expr = meta_of(node).expr if kind_of(node) == OpKind.POINTWISE else None
            if expr is None:
                return None
            self.inner.append(node)
            coefficient, rest = expr.as_coeff_Mul()
            unmasked = self.mask is None and self.masked_out is None
            if len(node.args) == 1 and (rest == A0 or expr == A0):   # a scaling, or a cast
                self.scale *= float(coefficient) if rest == A0 else 1.0
                node = node.args[0]
            elif _is_where(expr, A0, -sympy.oo, A1) and unmasked:    # masked_fill(cond, -inf)
                self.masked_out, node = node.args
            elif expr == A0 + A1 and unmasked:                       # an additive mask
                scores_side = next((a for a in node.args if _Match()._mask_and_scale(a) is not None), None)
                mask = next((a for a in node.args if a is not scores_side), None)
                if scores_side is None or mask is None or meta_of(mask).requires_grad:
                    return None
                self.mask, node = mask, scores_side
            else:
                return None
        return node

    def _scores_product(self, raw: fx.Node) -> bool:
        """``raw`` is reshape(bmm(reshape(q), reshape(kᵀ))) of 4-D q and k: sets them."""
        bmm = raw.args[0]
        q, kt = (_unreshaped(a, 4) for a in bmm.args)
        if q is None or kt is None or len(meta_of(raw).shape) != 4:
            return False
        if not _is_view(kt, "permute") or tuple(kt.kwargs.get("dims", ())) != (0, 1, 3, 2):
            return False
        self.inner += [raw, bmm, *bmm.args, kt]
        self.q, self.k = q, kt.args[0]
        return True

    def _dropout(self, weights: fx.Node) -> fx.Node:
        """The undropped weights where ``weights`` is where(rand(seed) >= p, w * 1/(1-p), 0), else
        ``weights``."""
        expr = meta_of(weights).expr if kind_of(weights) == OpKind.POINTWISE else None
        if expr is None or len(weights.args) != 2 or not _is_where(expr, A0, A1, 0):
            return weights
        keep, scaled = weights.args
        p = _compare_ge(meta_of(keep).expr) if kind_of(keep) == OpKind.POINTWISE else None
        if p is None or kind_of(keep.args[0]) != OpKind.RAND or meta_of(keep.args[0]).shape != meta_of(weights).shape:
            return weights
        coefficient, rest = meta_of(scaled).expr.as_coeff_Mul() if kind_of(scaled) == OpKind.POINTWISE else (0, None)
        if not 0 < p < 1 or rest != A0 or abs(float(coefficient) - 1.0 / (1.0 - p)) > 1e-12:
            return weights
        self.inner += [weights, keep, scaled, keep.args[0]]
        self.seed, self.dropout_p = keep.args[0].args[0], p
        return self._through_casts(scaled.args[0])

    def _through_casts(self, node: fx.Node) -> fx.Node:
        """The value under dtype casts (pointwise ``a0`` of one argument), which join the pattern."""
        while kind_of(node) == OpKind.POINTWISE and len(node.args) == 1 and meta_of(node).expr == A0:
            self.inner.append(node)
            node = node.args[0]
        return node


def attention_passes(graph: fx.Graph) -> None:
    """Every pass of this module, in order (``build_region`` runs them first): written-out attention
    rewritten; then, where the graph has attention at all, its operands read past whole copies,
    its rotary embedding applied inside the kernels, its output in the layout its reader wants."""
    rewrite_written_out_attention(graph)
    if C.has_attention(graph):
        attention_reads_whole_copies_source(graph)
        rotary_inside_attention(graph)
        outputs_heads_last(graph)


def rewrite_written_out_attention(graph: fx.Graph) -> int:
    """Rewrite, in place, each written-out attention of ``graph`` whose scores and weights nothing
    else reads; returns how many."""
    outputs = set(n for n in output_node(graph).args[0] if isinstance(n, fx.Node))
    done = 0
    for node in list(graph.nodes):
        if not _is_extern(node, "bmm"):
            continue
        found = _Match(node)
        if found.ok and found.private(outputs):
            _replace(graph, node, found)
            done += 1
    if done:
        graph.eliminate_dead_code()
    return done


def outputs_heads_last(graph: fx.Graph) -> int:
    """Make each flash output that is only transposed back to [B, T, H, D] (``y.transpose(1, 2)``,
    before the output projection) in that layout: the kernel writes it so and the transpose, and
    the copy a reshape of it would need, disappear. Returns how many."""
    b = GraphBuilder(graph)
    done = 0
    for node in list(graph.nodes):
        users = list(node.users)
        if not (node.op == "call_function" and node.target is C.ATTENTION and node.kwargs["which"] == "out"
                and not node.kwargs.get("heads_last") and len(meta_of(node).shape) == 4 and len(users) == 1
                and _is_view(users[0], "permute") and tuple(users[0].kwargs.get("dims", ())) == (0, 2, 1, 3)):
            continue
        with graph.inserting_before(users[0]):
            made = _emit_again(b, node, heads_last=True)
        users[0].replace_all_uses_with(made)
        done += 1
    if done:
        graph.eliminate_dead_code()
    return done


def attention_reads_whole_copies_source(graph: fx.Graph) -> int:
    """An attention operand that is a whole copy of another tensor (a key/value cache's ``cat`` onto
    an empty past) is read from that tensor itself: the copy is not made. Returns how many."""
    done = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is C.ATTENTION:
            for operand in dict.fromkeys(node.args[:3]):
                source = _whole_copy_of(operand)
                if source is not operand:
                    node.replace_input_with(operand, source)
                    done += 1
    if done:
        graph.eliminate_dead_code()
    return done


def rotary_inside_attention(graph: fx.Graph) -> int:
    """Read q and k's rotary embedding inside the flash kernels: an attention whose q and k are
    ``x * cos + rotate_half(x) * sin`` (Llama's, as the bindings record it) of the same cos and sin
    takes x, cos and sin instead, so the rotated q and k are never written. Head dims that are
    powers of two from 16 (the kernels rotate a whole tile in registers). Returns how many."""
    b = GraphBuilder(graph)
    done = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is C.ATTENTION and node.kwargs["which"] == "out"
                and not node.kwargs.get("rotary") and len(meta_of(node.args[0]).shape) == 4):
            continue
        q_parts, k_parts = _rotary_parts(node.args[0]), _rotary_parts(node.args[1])
        if q_parts is None or k_parts is None or q_parts[1:] != k_parts[1:]:
            continue
        (_, _, rows, dim), keys = meta_of(node.args[0]).shape, meta_of(node.args[1]).shape[2]
        cos = meta_of(q_parts[1]).shape
        if rows != keys or dim < 16 or dim & (dim - 1) or len(cos) != 4 or cos[1] != 1 or cos[2:] != (rows, dim):
            continue
        with graph.inserting_before(node):
            made = _emit_again(b, node, q=q_parts[0], k=k_parts[0], rotary=q_parts[1:])
        node.replace_all_uses_with(made)
        done += 1
    if done:
        graph.eliminate_dead_code()
    return done


def _rotary_parts(node):
    """(x, cos, sin) where ``node`` is x * cos + rotate_half(x) * sin, else None."""
    if not _pointwise(node, A0 + A1) or not all(_pointwise(a, A0 * A1) for a in node.args):
        return None
    for plain, turned in (node.args, tuple(reversed(node.args))):
        for x, cos in (plain.args, tuple(reversed(plain.args))):
            for half_turned, sin in (turned.args, tuple(reversed(turned.args))):
                if _is_rotate_half(half_turned, x) and not meta_of(cos).requires_grad \
                        and not meta_of(sin).requires_grad and meta_of(node).dtype == meta_of(x).dtype:
                    return x, cos, sin
    return None


def _is_rotate_half(node, x) -> bool:
    """Whether ``node`` is cat(-x[..., D/2:], x[..., :D/2]) as recorded: two slice_scatters into zeros."""
    shape = meta_of(x).shape
    last, half = len(shape) - 1, shape[-1] // 2
    if not _slice_scatter(node, last, half, half):
        return False
    inner, low = node.args
    if not _slice_scatter(inner, last, 0, half):
        return False
    zeros = inner.args[0]
    if not (_pointwise(zeros, sympy.Float(0.0)) or _pointwise(zeros, sympy.Integer(0))) or zeros.args:
        return False
    negated = inner.args[1]
    return _is_slice_of(low, x, last, 0, half) and _pointwise(negated, -A0) \
        and _is_slice_of(negated.args[0], x, last, half, half)


def _slice_scatter(node, dim, start, length) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is C.SLICE_SCATTER \
        and (node.kwargs["dim"], node.kwargs["start"], node.kwargs["step"], node.kwargs["length"]) == (dim, start, 1,
                                                                                                        length)


def _is_slice_of(node, x, dim, start, length) -> bool:
    return _is_view(node, "slice") and node.args[0] is x and (node.kwargs["dim"], node.kwargs["start"],
                                                                node.kwargs["step"], node.kwargs["length"]) == \
        (dim, start, 1, length)


def _whole_copy_of(node):
    """``src`` where ``node`` writes it over all of another tensor (a key cache's cat onto nothing),
    else ``node``."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is C.SLICE_SCATTER:
        src = node.args[1]
        if meta_of(src).shape == meta_of(node).shape and node.kwargs["start"] == 0 and node.kwargs["step"] == 1:
            return src
    return node


def _emit_again(b: GraphBuilder, node: fx.Node, **changes) -> fx.Node:
    """The flash output ``node`` made anew with ``changes`` (q, k, heads_last, rotary)."""
    q, k, v, *extras = node.args[:-1]
    p = node.kwargs
    mask = extras.pop(0) if p["has_mask"] else None
    seed = extras.pop(0) if p["dropout_p"] > 0 else None
    rotary = (extras[0], extras[1]) if p.get("rotary") else None
    arguments = dict(q=q, k=k, is_causal=p["is_causal"], scale=p["scale"], dropout_p=p["dropout_p"],
                     empty_nan=p.get("empty_nan", False), heads_last=p.get("heads_last", False), rotary=rotary)
    arguments.update(changes)
    q, k = arguments.pop("q"), arguments.pop("k")
    return C.emit_attention(b, q, k, v, mask, seed, **arguments)


# ------------------------------------------------------------------------------ replacing
def _replace(graph: fx.Graph, bmm: fx.Node, found: "_Match") -> None:
    out = _only_user(bmm)
    b = GraphBuilder(graph)
    with graph.inserting_before(out):
        mask, causal = _attend_mask(b, found)
        made = C.emit_attention(b, found.q, found.k, found.v, mask, found.seed, is_causal=causal,
                                scale=found.scale, dropout_p=found.dropout_p,
                                empty_nan=mask is not None)   # (a causal mask leaves no row empty)
    out.replace_all_uses_with(made)


def _attend_mask(b: GraphBuilder, found: "_Match"):
    """(the mask the kernels read, whether causal). A masked_fill's mask made from positions alone is
    evaluated now: the causal one is no mask at all."""
    if found.mask is not None:
        return found.mask, False
    if found.masked_out is None:
        return None, False
    cond = found.masked_out
    rows, cols = meta_of(found.q).shape[-2], meta_of(found.k).shape[-2]
    value = _constant(cond)
    if value is not None and rows <= cols:
        above_diagonal = ~torch.ones(rows, cols, dtype=torch.bool).tril()
        if value.shape[-2:] == (rows, cols) and bool((value == above_diagonal).all()):
            return None, True
    if kind_of(cond) == OpKind.POINTWISE and _is_compare(meta_of(cond).expr, "eq", A0, 0) \
            and meta_of(cond.args[0]).dtype == torch.bool:
        return cond.args[0], False    # masked_fill(~mask, -inf): the mask itself
    return C.emit_pointwise(b, "logical_not", [cond], dtype=torch.bool, requires_grad=False), False


# ------------------------------------------------------------------------------ helpers
def _is_extern(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is C.EXTERNS.get(name)


def _is_view(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is C.VIEWS[name]


def _is_reduction(node, name: str, of: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is C.REDUCTIONS[name] \
        and node.args[0] is of and tuple(node.kwargs.get("dims", ())) == (len(meta_of(of).shape) - 1,) \
        and node.kwargs.get("keepdim", False)


def _pointwise(node, expr) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and kind_of(node) == OpKind.POINTWISE \
        and meta_of(node).expr == expr


def _only_user(node: fx.Node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _unreshaped(node, ndim: int):
    """The ``ndim``-D tensor a matmul operand was reshaped from (for the bmm), or None."""
    if _is_view(node, "reshape") and len(meta_of(node.args[0]).shape) == ndim:
        return node.args[0]
    return None


def _made_only_from(node: fx.Node, source: fx.Node, limit: int = 8):
    """The nodes between ``source`` and ``node`` if ``node`` is computed from ``source`` alone."""
    made, stack = [], [node]
    while stack:
        n = stack.pop()
        if n is source:
            continue
        if n.op != "call_function" or len(made) > limit or kind_of(n) == OpKind.RAND:
            return None
        made.append(n)
        stack += [a for a in n.args if isinstance(a, fx.Node)]
    return made


def _same(a, b) -> bool:
    a, b = sympy.sympify(a), sympy.sympify(b)
    return a == b or (a.is_number and b.is_number and a.is_finite and b.is_finite and float(a) == float(b))


def _is_where(expr, *args) -> bool:
    return isinstance(expr, Where) and all(_same(x, y) for x, y in zip(expr.args, args))


def _is_compare(expr, name: str, *args) -> bool:
    return isinstance(expr, Compare) and int(expr.args[0]) == COMPARE_OPS.index(name) \
        and all(_same(x, y) for x, y in zip(expr.args[1:], args))


def _compare_ge(expr):
    """p where ``expr`` is ``a0 >= p`` (dropout's keep test), else None."""
    if isinstance(expr, Compare) and int(expr.args[0]) == COMPARE_OPS.index("ge") and expr.args[1] == A0 \
            and expr.args[2].is_number:
        return float(expr.args[2])
    return None


def _constant(node: fx.Node):
    """``node``'s value if it is computed from no input (iota, fill, ...), else None."""
    ancestors, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            return None
        if n in ancestors:
            continue
        if n.op != "call_function" or len(ancestors) > 32 or kind_of(n) == OpKind.RAND:
            return None
        ancestors.append(n)
        stack += [a for a in n.args if isinstance(a, fx.Node)]
    graph, env = fx.Graph(), {}
    for n in node.graph.nodes:
        if n in ancestors:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output((env[node],))
    return run_graph(graph, [])[0]
