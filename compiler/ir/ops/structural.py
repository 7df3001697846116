"""Ops computed inline from positions: iota, random numbers, gathers and slice scatters."""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir.graph import OpKind, meta_of, numel
from compiler.ir.ops import externs, views
from compiler.ir.ops.base import OpDef
from compiler.ir.ops.pointwise import emit_fill, emit_pointwise


class Iota(OpDef):
    """The position along ``dim`` of each element of ``shape`` (an index-valued constant):
    with a comparison it builds one-hot masks, as cross-entropy's target selection needs."""

    kind = OpKind.IOTA

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        """The op's value on real tensors (``compiler.ir.reference``)."""
        shape, dim = meta_of(node).shape, node.kwargs["dim"]
        view = [1] * len(shape)
        view[dim] = shape[dim]
        return torch.arange(shape[dim]).reshape(view).expand(shape)


IOTA = Iota("iota")


def emit_iota(b, shape, dim, dtype=torch.int64) -> fx.Node:
    return b.call(IOTA, [], {"dim": dim}, shape=shape, dtype=dtype, requires_grad=False)


class Rand(OpDef):
    """Uniform random numbers in [0, 1) over ``shape``: element i is Philox(seed, i), with i
    the element's position in ``shape`` (row-major). ``seed`` is a region input drawn from
    torch's generator on every call, so the numbers change per call and follow
    ``torch.manual_seed``; a backward that needs them computes them again from the seed
    instead of saving a mask (dropout's backward reads no mask from memory)."""

    kind = OpKind.RAND

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        # NOTE: the reference executor only attributes NaNs (anomaly mode); these numbers come
        # from torch's generator seeded alike, not from the kernels' Philox stream.
        generator = torch.Generator(device=args[0].device).manual_seed(int(args[0]))
        return torch.rand(meta_of(node).shape, generator=generator, device=args[0].device)


RAND = Rand("rand")


def emit_rand(b, seed, shape) -> fx.Node:
    return b.call(RAND, [seed], shape=shape, dtype=torch.float32, requires_grad=False)


class Gather(OpDef):
    """Elements of ``source`` at positions read from an integer ``index`` tensor, computed
    inline (the index is loaded, then the source element at it). ``mode``:

    * ``gather`` — torch.gather: out[p] = source[p with p[dim] = index[p]];
    * ``index_select`` — out[p] = source[p with p[dim] = index[p[dim]]] (``x[idx]`` too);
    * ``embedding`` — out[..., c] = source[index[...], c]; with ``zero_padding`` the rows picked
      at ``padding_idx`` read 0 (the double backward of embedding, which never writes them).

    The gradient is a scatter-add into zeros of the source's shape (``IndexBackward``).
    """

    kind = OpKind.GATHER

    def vjp(self, b, node, grad_out):
        source, index = node.args
        if not meta_of(source).requires_grad:
            return [None, None]
        p = node.kwargs
        if _picks_one_per_line(node):
            return [_one_hot_gradient(b, node, grad_out), None]
        return [b.call(externs.EXTERNS["index_backward"], [grad_out, index],
                       {"mode": p["mode"], "dim": p["dim"], "shape": meta_of(source).shape,
                        "padding_idx": p.get("padding_idx"), "wrap": p.get("wrap", False)},
                       shape=meta_of(source).shape, dtype=meta_of(grad_out).dtype,
                       requires_grad=meta_of(grad_out).requires_grad), None]

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        source, index = args
        mode, dim = node.kwargs["mode"], node.kwargs["dim"]
        if numel(meta_of(node).shape) == 0:   # (no element read, no index checked: eager's and the kernels')
            return source.new_empty(tuple(meta_of(node).shape))
        if node.kwargs.get("wrap"):
            index = torch.where(index < 0, index + source.shape[dim], index)
        if mode == "gather":
            return torch.gather(source, dim, index)
        if mode == "index_select":
            return source.index_select(dim, index.reshape(-1)).reshape(meta_of(node).shape)
        out = torch.nn.functional.embedding(index, source)
        if node.kwargs.get("zero_padding"):
            out = out.masked_fill((index == node.kwargs["padding_idx"]).unsqueeze(-1), 0)
        return out

    @staticmethod
    def positions(node, index: list):
        """For an output position: (the index tensor's position to read, the source position
        with None at the gathered dim)."""
        mode, dim = node.kwargs["mode"], node.kwargs["dim"]
        if mode == "gather":
            return list(index), [None if d == dim else i for d, i in enumerate(index)]
        if mode == "index_select":  # the index tensor's dims stand where ``dim`` was
            k = len(meta_of(node.args[1]).shape)
            return list(index[dim:dim + k]), list(index[:dim]) + [None] + list(index[dim + k:])
        return list(index[:-1]), [None, index[-1]]  # embedding: rows of a 2-D weight


GATHER = Gather("gather")


def _picks_one_per_line(node) -> bool:
    """A torch.gather that picks one element of each line along ``dim`` (cross-entropy's
    target logit): its index has the source's shape with size 1 at ``dim``."""
    source, index = node.args
    ss, si, dim = meta_of(source).shape, meta_of(index).shape, node.kwargs["dim"]
    return (node.kwargs["mode"] == "gather" and not node.kwargs.get("wrap") and len(ss) == len(si)
            and si[dim] == 1 and all(a == b for d, (a, b) in enumerate(zip(ss, si)) if d != dim)
            and not meta_of(node).dtype.is_complex)


def _one_hot_gradient(b, node, grad_out) -> fx.Node:
    """The gradient of a one-per-line gather: grad_out where the position along ``dim`` is the
    picked one, 0 elsewhere. Pointwise (a comparison of an iota with the index), so it fuses
    into the kernel that consumes it; a scatter-add would write a zero tensor first and run
    as a separate op."""
    source, index = node.args
    shape, dim = meta_of(source).shape, node.kwargs["dim"]
    positions = emit_iota(b, shape, dim, dtype=meta_of(index).dtype)
    hit = emit_pointwise(b, "eq", [positions, views.emit_view(b, "expand", index, shape=shape)], dtype=torch.bool)
    spread = views.emit_view(b, "expand", grad_out, shape=shape)
    return emit_pointwise(b, "where", [hit, spread, 0.0], dtype=meta_of(grad_out).dtype,
                          requires_grad=meta_of(grad_out).requires_grad)


def emit_gather(b, source, index, mode, dim, padding_idx=None, zero_padding=False, wrap=False) -> fx.Node:
    """``wrap``: negative indices count from the end (``x[idx]``); otherwise they are errors."""
    ss, si = meta_of(source).shape, meta_of(index).shape
    if mode == "gather":
        shape = si
    elif mode == "index_select":
        shape = ss[:dim] + si + ss[dim + 1:]
    else:
        shape = (*si, ss[1])
    kwargs = {"mode": mode, "dim": dim}
    if wrap:
        kwargs["wrap"] = True
    if padding_idx is not None:
        kwargs["padding_idx"] = padding_idx
        kwargs["zero_padding"] = zero_padding
    return b.call(GATHER, [source, index], kwargs, shape=shape, dtype=meta_of(source).dtype,
                  requires_grad=meta_of(source).requires_grad)


# ----------------------------------------------------------------------------- scatter
class SliceScatter(OpDef):
    """``base`` with ``src`` written into the slice (dim, start, step, length): the
    functional form of ``x[..., a:b:c] = v`` and the gradient of a slice. Inlined into
    kernels like a pointwise op whose value depends on the index."""

    kind = OpKind.SCATTER

    def vjp(self, b, node, grad_out):
        base, src = node.args
        params = node.kwargs
        g_base = g_src = None
        if meta_of(base).requires_grad:
            zeros = emit_fill(b, meta_of(src).shape, meta_of(grad_out).dtype, 0)
            g_base = emit_slice_scatter(b, grad_out, zeros, **params)
        if meta_of(src).requires_grad:
            g_src = views.emit_slice(b, grad_out, **params)
        return [g_base, g_src]

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        base, src = args
        out = base.clone()
        view = views.slice_tensor(out, **node.kwargs)
        view.copy_(src.expand(view.shape) if src.dim() else src)
        return out


SLICE_SCATTER = SliceScatter("slice_scatter")


def emit_slice_scatter(b, base, src, dim, start, step, length) -> fx.Node:
    return b.call(SLICE_SCATTER, [base, src], {"dim": dim, "start": start, "step": step, "length": length},
                  shape=meta_of(base).shape, dtype=meta_of(base).dtype,
                  requires_grad=meta_of(base).requires_grad or meta_of(src).requires_grad)
