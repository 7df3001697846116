"""Views: one class per view, each declaring its whole story.

A view moves no data: it says which element of its input each output element is. Every
view class declares, next to each other:

* ``out_shape(in_shape, params)`` — its shape rule;
* ``index_map(node, out_index, size)`` — the input index an output index reads (``Index`` values of
  the kernel being written, made from those of ``out_index`` with ``compose``), so a view fuses into
  any kernel for free; every size in it comes from ``size(value, key)`` (an ``Index``: its literal, or
  a shape-generic kernel's argument: ``KernelWriter.size_index``);
* ``vjp(b, node, grad_out)`` — its gradient, as graph nodes;
* ``apply(tensor, **params)`` — the same view on a real tensor, with PyTorch's own view
  function (the runtime's views of buffers, the reference executor);
* ``scatter_back(b, node, value)`` — where it has one: its source's new value when the view's
  value changes (an in-place op on a view writes its base, ``compiler.capture.recorder``).

Parameters are the node's kwargs (``node.kwargs`` is ``params``). To add a view, write one
class here and register it in ``VIEWS``; ``Flip`` is the example the README walks through.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from compiler.codegen.kernel_text import ZERO, Index, compose, constant_index, last_position, literal_index
from compiler.ir.graph import OpKind, meta_of, update_meta
from compiler.ir.ops import reductions, structural
from compiler.ir.ops.base import OpDef
from compiler.ir.ops.pointwise import emit_fill, emit_pointwise


class View(OpDef):
    """A view: no data moves. ``index_map`` turns an output index into the input index."""

    kind = OpKind.VIEW
    writes_back = False  # whether ``scatter_back`` maps a new value of the view to its source

    def out_shape(self, in_shape: tuple, params: dict) -> tuple:
        """The view's shape, from its input's shape and its parameters."""
        raise NotImplementedError(f"{self.name}: out_shape")

    def index_map(self, node: fx.Node, out_index: list[Index], size=literal_index) -> list[Index]:
        """The input index (an ``Index`` per input dim) that ``out_index`` reads; ``size(value, key)``
        gives a size in it as an ``Index`` (``key``: which size of ``node`` it is)."""
        raise NotImplementedError(f"{self.name}: index_map")

    def vjp(self, b, node: fx.Node, grad_out: fx.Node) -> list:
        raise NotImplementedError(f"{self.name}: vjp")

    def apply(self, tensor: torch.Tensor, **params) -> torch.Tensor:
        """The view of a real tensor, made by PyTorch (no copy where PyTorch makes none)."""
        raise NotImplementedError(f"{self.name}: apply")

    # ``apply`` as one tensor method call, ``{name}(**params)``, for generated code to write in
    # line (``method_call``): no Python frame of ours per view on the CPU path. None: call apply.
    method: str | None = None

    def method_call(self, text: str, params: dict) -> str | None:
        """``apply`` on the tensor that source ``text`` evaluates to, as source (or None)."""
        if self.method is None or len(params) != 1:
            return None
        (value,) = params.values()
        if not (isinstance(value, int) or (isinstance(value, (tuple, list)) and all(type(v) is int for v in value))):
            return None  # (only literal ints are written into source)
        return f"{text}.{self.method}({tuple(value) if not isinstance(value, int) else value!r})"

    def scatter_back(self, b, node: fx.Node, value: fx.Node) -> fx.Node:
        """The new value of ``node``'s source once the view ``node`` holds ``value``."""
        raise NotImplementedError(f"{self.name} cannot write a new value back to its source")

    def is_identity(self, in_shape: tuple, params: dict) -> bool:
        """Whether the view returns its input unchanged (then no node is made)."""
        return self.out_shape(in_shape, params) == tuple(in_shape)

    def read(self, writer, node: fx.Node, index: tuple):
        """The view's value at ``index`` inside a kernel being written (``KernelWriter``):
        its input's value at the mapped index."""
        return writer.value(node.args[0], tuple(self.index_map(node, list(index), writer.size_index)))

    def evaluate(self, node: fx.Node, args: list) -> torch.Tensor:
        """The op's value on real tensors (``compiler.ir.reference``)."""
        return self.apply(args[0], **node.kwargs)

    def emit(self, b, x: fx.Node, **params) -> fx.Node:
        """The view of ``x`` as a graph node (``x`` itself where the view changes nothing)."""
        if "shape" in params:
            params["shape"] = tuple(params["shape"])
        in_shape = meta_of(x).shape
        if self.is_identity(in_shape, params):
            return x
        return b.call(self, [x], params, shape=self.out_shape(in_shape, params), dtype=meta_of(x).dtype,
                      requires_grad=meta_of(x).requires_grad)


# ----------------------------------------------------------------------------- shape views
class Reshape(View):
    """``x.reshape(shape)``: the same elements in row-major order, another shape."""

    method = "reshape"

    writes_back = True

    def out_shape(self, in_shape, params):
        return tuple(params["shape"])

    def index_map(self, node, out_index, size=literal_index):
        in_shape = meta_of(node.args[0]).shape
        out_shape = meta_of(node).shape
        kept_in = [d for d, size in enumerate(in_shape) if size != 1]
        kept_out = [d for d, size in enumerate(out_shape) if size != 1]
        if [in_shape[d] for d in kept_in] == [out_shape[d] for d in kept_out]:
            # a reshape that only adds or drops size-1 dims: each other dim maps to itself
            # (no division by sizes: a zero-size dim would divide by 0, and a reduction read
            # through it is still recognised as its own row, index text and all)
            result = [ZERO] * len(in_shape)
            for d_in, d_out in zip(kept_in, kept_out):
                result[d_in] = out_index[d_out]
            return result
        return _reshape_index(in_shape, out_shape, out_index, lambda value, key: size(value, (node, *key)))

    def vjp(self, b, node, grad_out):
        return [emit_view(b, "reshape", grad_out, shape=meta_of(node.args[0]).shape)]

    def apply(self, tensor, *, shape):
        return tensor.reshape(shape)

    def scatter_back(self, b, node, value):
        return emit_view(b, "reshape", value, shape=meta_of(node.args[0]).shape)


def _reshape_index(in_shape, out_shape, out_index: list[Index], size=literal_index) -> list[Index]:
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
        return [ZERO] * len(in_shape)
    p_in, p_out = prefixes(in_shape), prefixes(out_shape)
    bounds = sorted(set(p_in) & set(p_out))
    result = [ZERO] * len(in_shape)
    for low, high in zip(bounds, bounds[1:]):
        outs = [d for d in range(len(out_shape)) if out_shape[d] != 1 and low <= p_out[d] and p_out[d + 1] <= high]
        ins = [d for d in range(len(in_shape)) if in_shape[d] != 1 and low <= p_in[d] and p_in[d + 1] <= high]
        # the group's row-major position, "((i0) * 8 + (i1))"; its sizes asked for in the order they
        # are written (a shape-generic kernel numbers its size arguments as they are first asked for)
        terms = [compose("({}) * {}", out_index[d], size(high // p_out[d + 1], ('out', d)), value=operator.mul,
                         wrap=False) if p_out[d + 1] != high
                 else compose("({})", out_index[d], value=lambda i: i, wrap=False) for d in outs]
        linear = compose(" + ".join(["{}"] * len(terms)) or "0", *terms, value=lambda *t: sum(t))
        for k, d in enumerate(ins):
            stride = high // p_in[d + 1]
            term = linear if stride == 1 else compose("{} // {}", linear, size(stride, ('in', d)),
                                                      value=operator.floordiv)
            result[d] = term if k == 0 else compose("{} % {}", term, size(in_shape[d], ('dim', d)), value=operator.mod)
    return result


class Permute(View):
    """``x.permute(dims)``: output dim i is input dim ``dims[i]``."""

    method = "permute"

    writes_back = True

    def out_shape(self, in_shape, params):
        return tuple(in_shape[d] for d in params["dims"])

    def method_call(self, text: str, params: dict) -> str | None:
        """A matmul operand's transpose (the last two dims swapped) as ``.mT``: half the host time of
        ``.permute((1, 0))`` (0.5 µs against 1.1 µs), a few times in every training step."""
        dims = tuple(params.get("dims", ()))
        if len(dims) >= 2 and all(type(d) is int for d in dims) and \
                dims == tuple(range(len(dims) - 2)) + (len(dims) - 1, len(dims) - 2):
            return f"{text}.mT"
        return super().method_call(text, params)

    def is_identity(self, in_shape, params):
        return tuple(params["dims"]) == tuple(range(len(in_shape)))

    def index_map(self, node, out_index, size=literal_index):
        result = [None] * len(meta_of(node.args[0]).shape)
        for out_dim, in_dim in enumerate(node.kwargs["dims"]):
            result[in_dim] = out_index[out_dim]
        return result

    def vjp(self, b, node, grad_out):
        return [emit_view(b, "permute", grad_out, dims=_inverse(node.kwargs["dims"]))]

    def apply(self, tensor, *, dims):
        return tensor.permute(dims)

    def scatter_back(self, b, node, value):
        return emit_view(b, "permute", value, dims=_inverse(node.kwargs["dims"]))


def _inverse(dims) -> tuple:
    """The permutation that undoes ``dims``."""
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return tuple(inverse)


class Expand(View):
    """``x.expand(shape)`` of an ``x`` with as many dims: size-1 dims repeated (stride 0)."""

    method = "expand"

    def out_shape(self, in_shape, params):
        return tuple(params["shape"])

    def index_map(self, node, out_index, size=literal_index):
        in_shape = meta_of(node.args[0]).shape
        lead = len(meta_of(node).shape) - len(in_shape)
        return [ZERO if size == 1 else out_index[lead + i] for i, size in enumerate(in_shape)]

    def vjp(self, b, node, grad_out):
        return [reductions.sum_to_shape(b, grad_out, meta_of(node.args[0]).shape)]

    def apply(self, tensor, *, shape):
        return tensor.expand(shape)


# ----------------------------------------------------------------------------- windows
class Slice(View):
    """``x[..., start:start + length * step:step, ...]`` along ``dim``."""

    writes_back = True

    def out_shape(self, in_shape, params):
        shape = list(in_shape)
        shape[params["dim"]] = params["length"]
        return tuple(shape)

    def is_identity(self, in_shape, params):
        return params["start"] == 0 and params["step"] == 1 and params["length"] == in_shape[params["dim"]]

    def index_map(self, node, out_index, size=literal_index):
        result = list(out_index)
        d, start, step = node.kwargs["dim"], node.kwargs["start"], node.kwargs["step"]
        scaled = result[d] if step == 1 else compose("({}) * {}", result[d], constant_index(step),
                                                     value=operator.mul, wrap=False)
        # a start follows the sizes where it counts from the end (x[:, -T:]): an argument when generic
        result[d] = scaled if start == 0 else compose("{} + {}", size(start, (node, 'start')), scaled,
                                                      value=operator.add, wrap=False)
        return result

    def vjp(self, b, node, grad_out):  # the gradient goes back to the sliced positions, 0 elsewhere
        zeros = emit_fill(b, meta_of(node.args[0]).shape, meta_of(grad_out).dtype, 0)
        return [structural.emit_slice_scatter(b, zeros, grad_out, **node.kwargs)]

    def apply(self, tensor, *, dim, start, step, length):
        return tensor[(slice(None),) * dim + (slice(start, start + length * step, step),)]

    def scatter_back(self, b, node, value):  # written into the slice of the (old) source
        return structural.emit_slice_scatter(b, node.args[0], value, **node.kwargs)


def slice_tensor(tensor, dim, start, step, length):
    """The real view ``tensor[..., start:start+length*step:step, ...]`` along ``dim``."""
    return VIEWS["slice"].apply(tensor, dim=dim, start=start, step=step, length=length)


class Unfold(View):
    """``Tensor.unfold(dim, size, step)``: windows of ``size`` along ``dim``, every ``step``
    elements; the position in the window is a new last dim."""

    def out_shape(self, in_shape, params):
        shape = list(in_shape)
        shape[params["dim"]] = (in_shape[params["dim"]] - params["size"]) // params["step"] + 1
        return tuple(shape) + (params["size"],)

    def index_map(self, node, out_index, size=literal_index):
        result = list(out_index[:-1])
        d, step = node.kwargs["dim"], node.kwargs["step"]
        result[d] = compose("({}) * {} + ({})", result[d], constant_index(step), out_index[-1],
                            value=lambda i, s, k: i * s + k, wrap=False)
        return result

    def vjp(self, b, node, grad_out):  # window position k of every window lands at k, k+step, ...: add them
        x = node.args[0]
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

    def apply(self, tensor, *, dim, size, step):
        return tensor.unfold(dim, size, step)


class Flip(View):
    """``torch.flip(x, dims)``: the order of elements reversed along each of ``dims``.

    NOTE: eager's flip copies (its result has no ``_base``), so an in-place op on a flip's
    result never writes back to its source: capture follows eager's ``_base`` and
    ``apply`` is ``torch.flip`` itself (a copy wherever the runtime applies it). Inside
    kernels it is an index map like any view, so it moves no data there.
    """

    def out_shape(self, in_shape, params):
        return tuple(in_shape)

    def is_identity(self, in_shape, params):
        return all(in_shape[d] == 1 for d in params["dims"])

    def index_map(self, node, out_index, size=literal_index):
        shape, dims = meta_of(node).shape, node.kwargs["dims"]
        return [compose("{} - ({})", last_position(size(shape[d], (node, 'dim', d))), i, value=operator.sub,
                        wrap=False) if d in dims and shape[d] != 1 else i
                for d, i in enumerate(out_index)]

    def vjp(self, b, node, grad_out):  # each element's gradient comes from its mirrored position
        return [emit_view(b, "flip", grad_out, dims=node.kwargs["dims"])]

    def apply(self, tensor, *, dims):
        return torch.flip(tensor, dims)


# ----------------------------------------------------------------------------- complex parts
# view_as_real / view_as_complex reinterpret interleaved storage; the kernel writer reads
# them as (real, imag) parts rather than through an index map.
class ViewAsReal(View):
    """``torch.view_as_real``: a complex tensor as its (real, imag) parts, a new last dim of 2."""

    def out_shape(self, in_shape, params):
        return tuple(in_shape) + (2,)

    def is_identity(self, in_shape, params):
        return False

    def read(self, writer, node, index):
        (re, im), dtype = writer.value(node.args[0], index[:-1])
        return writer.tmp(f"tl.where({index[-1]} == 0, {re}, {im})"), dtype.to_real()

    def vjp(self, b, node, grad_out):  # the gradient of the parts is the complex gradient
        return [emit_view(b, "view_as_complex", grad_out)]

    def apply(self, tensor):
        return torch.view_as_real(tensor.resolve_conj())

    def emit(self, b, x, **params):
        m = meta_of(x)
        return b.call(self, [x], shape=self.out_shape(m.shape, params), dtype=m.dtype.to_real(),
                      requires_grad=m.requires_grad)


class ViewAsComplex(View):
    """``torch.view_as_complex``: a last dim of 2 (real, imag) as one complex element."""

    def out_shape(self, in_shape, params):
        return tuple(in_shape[:-1])

    def is_identity(self, in_shape, params):
        return False

    def read(self, writer, node, index):
        re, dtype = writer.value(node.args[0], index + (ZERO,))
        im, _ = writer.value(node.args[0], index + (constant_index(1),))
        return (re, im), meta_of(node).dtype

    def vjp(self, b, node, grad_out):
        return [emit_view(b, "view_as_real", grad_out)]

    def apply(self, tensor):
        # a view where PyTorch can make one (the parts adjacent, every other stride and the
        # offset even), else of a contiguous copy (a buffer the runtime permuted, an expanded one)
        if tensor.stride(-1) != 1 or tensor.storage_offset() % 2 or any(s % 2 for s in tensor.stride()[:-1]):
            tensor = tensor.contiguous()
        return torch.view_as_complex(tensor)

    def emit(self, b, x, **params):
        m = meta_of(x)
        return b.call(self, [x], shape=self.out_shape(m.shape, params), dtype=m.dtype.to_complex(),
                      requires_grad=m.requires_grad)


VIEWS = {view.name: view for view in (
    Reshape("reshape"), Permute("permute"), Expand("expand"), ViewAsReal("view_as_real"),
    ViewAsComplex("view_as_complex"), Slice("slice"), Unfold("unfold"), Flip("flip"))}


def emit_view(b, name, x, **params) -> fx.Node:
    """The view ``name`` (a key of ``VIEWS``) of ``x`` with ``params``:
    ``emit_view(b, "reshape", x, shape=(4, 2))``."""
    return VIEWS[name].emit(b, x, **params)


def emit_slice(b, x, dim, start, step, length) -> fx.Node:
    """``x[..., start:start + length * step:step, ...]`` along ``dim``."""
    return VIEWS["slice"].emit(b, x, dim=dim, start=start, step=step, length=length)
