"""Views: reshape, permute, expand, slice, unfold, view_as_real/complex; an index map each."""

from __future__ import annotations

import torch
import torch.fx as fx

from compiler.ir import meta_of, update_meta
from compiler.ops import reductions, structural
from compiler.ops.base import OpDef
from compiler.ops.pointwise import emit_fill, emit_pointwise


# ----------------------------------------------------------------------------- views
class View(OpDef):
    """A view: no data moves. ``index_map`` turns an output index into the input index."""

    kind = "view"

    def out_shape(self, in_shape, params):
        if self.name == "permute":
            return tuple(in_shape[d] for d in params["dims"])
        if self.name == "slice":
            shape = list(in_shape)
            shape[params["dim"]] = params["length"]
            return tuple(shape)
        if self.name == "view_as_real":
            return tuple(in_shape) + (2,)
        if self.name == "view_as_complex":
            return tuple(in_shape[:-1])
        if self.name == "unfold":  # Tensor.unfold: windows along dim, the window last
            shape = list(in_shape)
            shape[params["dim"]] = (in_shape[params["dim"]] - params["size"]) // params["step"] + 1
            return tuple(shape) + (params["size"],)
        return tuple(params["shape"])

    def index_map(self, node: fx.Node, out_index: list[str]) -> list[str]:
        in_shape = meta_of(node.args[0]).shape
        out_shape = meta_of(node).shape
        if self.name == "permute":
            result = [None] * len(in_shape)
            for out_dim, in_dim in enumerate(node.kwargs["dims"]):
                result[in_dim] = out_index[out_dim]
            return result
        if self.name == "slice":
            result = list(out_index)
            d, start, step = node.kwargs["dim"], node.kwargs["start"], node.kwargs["step"]
            scaled = result[d] if step == 1 else f"({result[d]}) * {step}"
            result[d] = scaled if start == 0 else f"{start} + {scaled}"
            return result
        if self.name == "unfold":
            result = list(out_index[:-1])
            d, step = node.kwargs["dim"], node.kwargs["step"]
            result[d] = f"({result[d]}) * {step} + ({out_index[-1]})"
            return result
        if self.name == "expand":
            lead = len(out_shape) - len(in_shape)
            return ["0" if size == 1 else out_index[lead + i] for i, size in enumerate(in_shape)]
        kept_in = [d for d, size in enumerate(in_shape) if size != 1]
        kept_out = [d for d, size in enumerate(out_shape) if size != 1]
        if [in_shape[d] for d in kept_in] == [out_shape[d] for d in kept_out]:
            # a reshape that only adds or drops size-1 dims: each other dim maps to itself
            # (no division by sizes: a zero-size dim would divide by 0, and a reduction read
            # through it is still recognised as its own row, index text and all)
            result = ["0"] * len(in_shape)
            for d_in, d_out in zip(kept_in, kept_out):
                result[d_in] = out_index[d_out]
            return result
        return _reshape_index(in_shape, out_shape, out_index)

    def vjp(self, b, node, grad_out):
        x = node.args[0]
        if self.name == "view_as_real":  # the gradient of the parts is the complex gradient
            return [emit_view(b, "view_as_complex", grad_out)]
        if self.name == "view_as_complex":
            return [emit_view(b, "view_as_real", grad_out)]
        if self.name == "permute":
            inverse = [0] * len(node.kwargs["dims"])
            for i, d in enumerate(node.kwargs["dims"]):
                inverse[d] = i
            return [emit_view(b, "permute", grad_out, dims=tuple(inverse))]
        if self.name == "expand":
            return [reductions.sum_to_shape(b, grad_out, meta_of(x).shape)]
        if self.name == "slice":  # the gradient goes back to the sliced positions, 0 elsewhere
            zeros = emit_fill(b, meta_of(x).shape, meta_of(grad_out).dtype, 0)
            return [structural.emit_slice_scatter(b, zeros, grad_out, **node.kwargs)]
        if self.name == "unfold":  # window position k of every window lands at k, k+step, ...: add them
            d, size, step = node.kwargs["dim"], node.kwargs["size"], node.kwargs["step"]
            # NOTE: each input element reads the gradient at `size` places: computed once into
            # memory, not inlined `size` times (nested windows would multiply the code)
            update_meta(grad_out, materialize=True)
            count = meta_of(node).shape[d]
            last = len(meta_of(node).shape) - 1
            total = None
            for k in range(size):
                part = emit_view(b, "reshape", emit_slice(b, grad_out, last, k, 1, 1),
                                 shape=meta_of(grad_out).shape[:-1])
                zeros = emit_fill(b, meta_of(x).shape, meta_of(grad_out).dtype, 0)
                placed = structural.emit_slice_scatter(b, zeros, part, d, k, step, count)
                total = placed if total is None else emit_pointwise(b, "add", [total, placed],
                                                                    dtype=meta_of(grad_out).dtype)
            return [total]
        return [emit_view(b, "reshape", grad_out, shape=meta_of(x).shape)]

    def host(self, tensor: torch.Tensor, node: fx.Node) -> torch.Tensor:
        """Apply the view to a real tensor (used when the source is already in memory)."""
        if self.name == "permute":
            return tensor.permute(node.kwargs["dims"])
        if self.name == "expand":
            return tensor.expand(node.kwargs["shape"])
        if self.name == "unfold":
            return tensor.unfold(node.kwargs["dim"], node.kwargs["size"], node.kwargs["step"])
        return tensor.reshape(node.kwargs["shape"])


def slice_tensor(tensor, dim, start, step, length):
    """The real view ``tensor[..., start:start+length*step:step, ...]`` along ``dim``."""
    index = (slice(None),) * dim + (slice(start, start + length * step, step),)
    return tensor[index]


# view_as_real / view_as_complex reinterpret interleaved storage; the kernel writer reads
# them as (real, imag) parts rather than through an index map.
def _reshape_index(in_shape, out_shape, out_index: list[str]) -> list[str]:
    """A reshape's input index: through the row-major position of the element, taken
    separately in each group of dims that the reshape merges or splits (where the prefix
    products of both shapes meet), so dims it leaves alone keep their index unchanged and
    the index math stays simple enough for the compiler to see contiguous accesses."""
    def prefixes(shape):
        out = [1]
        for size in shape:
            out.append(out[-1] * size)
        return out
    if 0 in in_shape or 0 in out_shape:  # no elements: the index is never used
        return ["0"] * len(in_shape)
    p_in, p_out = prefixes(in_shape), prefixes(out_shape)
    bounds = sorted(set(p_in) & set(p_out))
    result = ["0"] * len(in_shape)
    for low, high in zip(bounds, bounds[1:]):
        outs = [d for d in range(len(out_shape)) if out_shape[d] != 1 and low <= p_out[d] and p_out[d + 1] <= high]
        ins = [d for d in range(len(in_shape)) if in_shape[d] != 1 and low <= p_in[d] and p_in[d + 1] <= high]
        terms = [f"({out_index[d]}) * {high // p_out[d + 1]}" if p_out[d + 1] != high else f"({out_index[d]})"
                 for d in outs]
        linear = " + ".join(terms) if terms else "0"
        for k, d in enumerate(ins):
            stride = high // p_in[d + 1]
            term = f"({linear})" if stride == 1 else f"(({linear}) // {stride})"
            result[d] = term if k == 0 else f"({term} % {in_shape[d]})"
    return result


VIEWS = {name: View(name) for name in ("reshape", "permute", "expand", "view_as_real", "view_as_complex",
                                       "slice", "unfold")}


def emit_view(b, name, x, **params) -> fx.Node:
    op = VIEWS[name]
    if name in ("view_as_real", "view_as_complex"):
        dtype = meta_of(x).dtype.to_real() if name == "view_as_real" else meta_of(x).dtype.to_complex()
        return b.call(op, [x], shape=op.out_shape(meta_of(x).shape, params), dtype=dtype,
                      requires_grad=meta_of(x).requires_grad)
    if "shape" in params:
        params["shape"] = tuple(params["shape"])
    shape = op.out_shape(meta_of(x).shape, params)
    if name != "permute" and shape == meta_of(x).shape:
        return x
    if name == "permute" and tuple(params["dims"]) == tuple(range(len(shape))):
        return x
    return b.call(op, [x], params, shape=shape, dtype=meta_of(x).dtype, requires_grad=meta_of(x).requires_grad)


def emit_slice(b, x, dim, start, step, length) -> fx.Node:
    if start == 0 and step == 1 and length == meta_of(x).shape[dim]:
        return x
    return b.call(VIEWS["slice"], [x], {"dim": dim, "start": start, "step": step, "length": length},
                  shape=VIEWS["slice"].out_shape(meta_of(x).shape, {"dim": dim, "length": length}),
                  dtype=meta_of(x).dtype, requires_grad=meta_of(x).requires_grad)
