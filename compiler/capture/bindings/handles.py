"""Tensor-like handles: decompositions written as tensor code, ``x - x.mean(dims, keepdim=True)``.

A ``Tensor`` handle wraps a graph node and the ``GraphBuilder`` that appends to it. Its
operators and methods append catalog ops, so a binding reads like PyTorch's ``torch/_refs``
and ``torch/_decomp/decompositions.py`` and can be checked against them line by line::

    >>> from compiler.ir.graph import GraphBuilder
    >>> b = GraphBuilder()
    >>> x = handle(b, b.placeholder("x", (4, 8), torch.float32, requires_grad=True))
    >>> centered = x - x.mean(1, keepdim=True)
    >>> centered.shape, centered.dtype, centered.requires_grad
    ((4, 8), torch.float32, True)

Each operation appends exactly one catalog op (views of no effect append none), in the
order Python evaluates the expression: left operand, right operand, then the op. The result
dtype follows ``_pointwise``'s rule, eager's type promotion of the operands (``result_dtype``;
bool arithmetic as logic, comparisons bool) — NOTE: without promoting integers to float for
math such as ``exp`` or ``/``: the bindings check for floating inputs or cast first.
Python scalars stay as given (``x ** 2`` and ``x ** 2.0`` are different expressions).

The registry's calling convention is unchanged (bindings take and return ``fx.Node``s):
``@on_handles`` converts at the boundary.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from compiler.capture.bindings.elementwise import _cast, _pointwise
from compiler.capture.bindings.registry import Writes
from compiler.capture.bindings.views import _expand, _t_, _transpose
from compiler.ir.graph import GraphBuilder, compute_dtype, meta_of, numel, result_dtype, update_meta
from compiler.ir.ops import catalog as C


class Tensor:
    """A graph value seen as a tensor: ``.shape``, ``.dtype``, operators and methods that append
    catalog ops. ``.node`` is the wrapped ``fx.Node``."""

    __slots__ = ("b", "node")
    __hash__ = object.__hash__  # __eq__ is elementwise, as torch.Tensor's

    def __init__(self, b: GraphBuilder, node: fx.Node):
        self.b = b
        self.node = node

    def __repr__(self):
        return f"Tensor({self.node.name}: {self.dtype} {list(self.shape)})"

    def __bool__(self):
        raise TypeError(f"{self!r} is a graph value: it has no truth value while the graph is built "
                        "(compare its .shape or .dtype, or use where())")

    # ------------------------------------------------------------------ metadata
    @property
    def shape(self) -> tuple:
        return meta_of(self.node).shape

    @property
    def dtype(self) -> torch.dtype:
        return meta_of(self.node).dtype

    @property
    def requires_grad(self) -> bool:
        return meta_of(self.node).requires_grad

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return numel(self.shape)

    def _wrap(self, node: fx.Node) -> Tensor:
        return Tensor(self.b, node)

    # ------------------------------------------------------------------ pointwise
    def _op(self, name, *others) -> Tensor:
        return self._wrap(_pointwise(self.b, name, [self.node, *map(_node, others)]))

    def _rop(self, name, other) -> Tensor:
        return self._wrap(_pointwise(self.b, name, [_node(other), self.node]))

    def __add__(self, other): return self._op("add", other)
    def __radd__(self, other): return self._rop("add", other)
    def __sub__(self, other): return self._op("sub", other)
    def __rsub__(self, other): return self._rop("sub", other)
    def __mul__(self, other): return self._op("mul", other)
    def __rmul__(self, other): return self._rop("mul", other)
    def __truediv__(self, other): return self._op("div", other)
    def __rtruediv__(self, other): return self._rop("div", other)
    def __pow__(self, other): return self._op("pow", other)
    def __rpow__(self, other): return self._rop("pow", other)
    def __neg__(self): return self._op("neg")
    def __lt__(self, other): return self._op("lt", other)
    def __le__(self, other): return self._op("le", other)
    def __gt__(self, other): return self._op("gt", other)
    def __ge__(self, other): return self._op("ge", other)
    def __eq__(self, other): return self._op("eq", other)
    def __ne__(self, other): return self._op("ne", other)
    def __and__(self, other): return self._op("logical_and", other)
    def __or__(self, other): return self._op("logical_or", other)
    def __invert__(self): return self._op("logical_not")

    def exp(self): return self._op("exp")
    def log(self): return self._op("log")
    def sqrt(self): return self._op("sqrt")
    def rsqrt(self): return self._op("rsqrt")
    def abs(self): return self._op("abs")
    def neg(self): return self._op("neg")
    def square(self): return self._op("square")
    def reciprocal(self): return self._op("reciprocal")
    def tanh(self): return self._op("tanh")
    def sigmoid(self): return self._op("sigmoid")
    def clamp_min(self, min): return self._op("clamp_min", min)
    def clamp_max(self, max): return self._op("clamp_max", max)

    def to(self, dtype: torch.dtype) -> Tensor:
        """This value as ``dtype`` (itself when it has that dtype already)."""
        return self._wrap(_cast(self.b, self.node, dtype))

    def detach(self) -> Tensor:
        """The same value with no gradient path (always a new node: the graph marks it, so a double
        backward that differentiates the graph again stops there too: ``propagate_requires_grad``)."""
        node = C.emit_pointwise(self.b, "identity", [self.node], dtype=self.dtype, requires_grad=False)
        update_meta(node, detached=True)
        return self._wrap(node)

    # ------------------------------------------------------------------ reductions
    def _reduce(self, name, dim, keepdim, dtype, **options) -> Tensor:
        dims = tuple(range(self.ndim)) if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
        return self._wrap(C.emit_reduction(self.b, name, self.node, dims, keepdim, dtype, **options))

    def sum(self, dim=None, keepdim=False, *, dtype=None) -> Tensor:
        """The sum over ``dim`` (an int, a tuple; None: every dim)."""
        return self._reduce("sum", dim, keepdim, dtype)

    def mean(self, dim=None, keepdim=False, *, dtype=None) -> Tensor:
        return self._reduce("mean", dim, keepdim, dtype)

    def amax(self, dim=None, keepdim=False, *, nan_takes_gradient=False) -> Tensor:
        """The max over ``dim``; its gradient shared among the maximal elements (``nan_takes_gradient``:
        among the NaN elements where the max is NaN, as torch.max(x)'s; amax's is NaN there)."""
        return self._reduce("amax", dim, keepdim, None, nan_takes_gradient=nan_takes_gradient)

    def statistic(self, name: str, dim, keepdim=True) -> Tensor:
        """A reduction that later ops (and the backward) read back: mean, variance, a softmax's
        sum. NOTE: in float32 for half types, computed and stored, as eager keeps its
        statistics (a bf16 mean or rstd, rounded, would renormalize every element with it)."""
        return self._reduce(name, dim, keepdim, compute_dtype(self.dtype))

    # ------------------------------------------------------------------ views
    def reshape(self, *shape) -> Tensor:
        """A reshape to ``shape`` (sizes given in full; no -1). No node when the shape is the same."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        return self._wrap(C.emit_view(self.b, "reshape", self.node, shape=shape))

    def permute(self, *dims) -> Tensor:
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        return self._wrap(C.emit_view(self.b, "permute", self.node, dims=tuple(d % self.ndim for d in dims)))

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        return self._wrap(_transpose(self.b, self.node, dim0, dim1))

    def t(self) -> Tensor:
        return self._wrap(_t_(self.b, self.node))

    @property
    def mT(self) -> Tensor:
        return self.transpose(-2, -1)

    def expand(self, *shape) -> Tensor:
        return self._wrap(_expand(self.b, self.node, *shape))

    def unsqueeze(self, dim: int) -> Tensor:
        shape = list(self.shape)
        shape.insert(dim % (len(shape) + 1), 1)
        return self.reshape(shape)

    def unfold(self, dim: int, size: int, step: int) -> Tensor:
        return self._wrap(C.emit_view(self.b, "unfold", self.node, dim=dim, size=size, step=step))

    def slice(self, dim: int, start: int, step: int, length: int) -> Tensor:
        """``length`` elements along ``dim`` from ``start`` every ``step`` (``x[..., start::step]``)."""
        return self._wrap(C.emit_slice(self.b, self.node, dim, start, step, length))

    def slice_scatter(self, src: Tensor, dim: int, start: int, step: int, length: int) -> Tensor:
        """This tensor with ``src`` written into the slice (dim, start, step, length)."""
        return self._wrap(C.emit_slice_scatter(self.b, self.node, src.node, dim, start, step, length))


def _node(value):
    """The operand a catalog op takes: a handle's node; Python scalars and nodes as they are."""
    return value.node if isinstance(value, Tensor) else value


def handle(b: GraphBuilder, value):
    """``value`` with every ``fx.Node`` in it (also inside lists and tuples) wrapped as a handle."""
    if isinstance(value, fx.Node):
        return Tensor(b, value)
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [handle(b, v) for v in value])
    return value


def unwrap(value):
    """``value`` with every handle in it (lists, tuples, ``Writes``) back as its ``fx.Node``."""
    if isinstance(value, Tensor):
        return value.node
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [unwrap(v) for v in value])
    if isinstance(value, Writes):
        return Writes(unwrap(value.result), [(unwrap(t), unwrap(v)) for t, v in value.writes])
    return value


def _rebuilt(sequence, items):
    """``sequence`` itself when no item changed (a torch.Size stays one), else a copy of its type."""
    if all(new is old for new, old in zip(items, sequence)):
        return sequence
    return type(sequence)(items)


def on_handles(bind):
    """Decorator: the binding sees its tensor arguments as handles and may return handles; its
    callers (the registry, other bindings) still pass and receive ``fx.Node``s."""
    @functools.wraps(bind)
    def wrapper(b, *args, **kwargs):
        args = [handle(b, unwrap(a)) for a in args]
        kwargs = {k: handle(b, unwrap(v)) for k, v in kwargs.items()}
        return unwrap(bind(b, *args, **kwargs))
    return wrapper


# ---------------------------------------------------------------------- functions
def _builder(operands) -> GraphBuilder:
    return next(v.b for v in operands if isinstance(v, Tensor))


def pointwise(name: str, *operands) -> Tensor:
    """The catalog's pointwise op ``name`` (one with no tensor method: ``huber``, ``norm_sqrt``,
    ...) over handles and Python scalars, its dtype by eager's promotion."""
    b = _builder(operands)
    return Tensor(b, _pointwise(b, name, [_node(v) for v in operands]))


def where(condition: Tensor, x, y, *, dtype=None, requires_grad=None) -> Tensor:
    """``torch.where``: x where ``condition``, else y; the dtype is x's and y's promoted unless given."""
    b = condition.b
    operands = [_node(x), _node(y)]
    return Tensor(b, C.emit_pointwise(b, "where", [condition.node, *operands], dtype=dtype or result_dtype(operands),
                                      requires_grad=requires_grad))


def maximum(x, y) -> Tensor:
    return pointwise("maximum", x, y)


def minimum(x, y) -> Tensor:
    return pointwise("minimum", x, y)


def full(b: GraphBuilder, shape, value, dtype: torch.dtype) -> Tensor:
    """``torch.full``: a constant tensor (no inputs, no gradient)."""
    return Tensor(b, C.emit_fill(b, tuple(shape), dtype, value))


def arange_along(b: GraphBuilder, shape, dim: int) -> Tensor:
    """Each element's index along ``dim`` of ``shape`` (int64): an arange broadcast along ``dim``."""
    return Tensor(b, C.emit_iota(b, shape, dim))


def gather(source: Tensor, index: Tensor, mode: str, dim: int, **params) -> Tensor:
    """The catalog's inline gather (``mode``: gather, index_select, embedding)."""
    return Tensor(source.b, C.emit_gather(source.b, source.node, index.node, mode, dim, **params))


def mm(a: Tensor, w: Tensor) -> Tensor:
    """a @ w of 2-D matrices (run by PyTorch: cuBLAS on GPU)."""
    return Tensor(a.b, C.emit_extern(a.b, "mm", a.node, w.node))


def bmm(a: Tensor, w: Tensor) -> Tensor:
    """Batched a @ w of 3-D tensors (run by PyTorch)."""
    return Tensor(a.b, C.emit_extern(a.b, "bmm", a.node, w.node))


def addmm(bias: Tensor, a: Tensor, w: Tensor) -> Tensor:
    """bias + a @ w, one matmul that adds the bias (run by PyTorch)."""
    return Tensor(a.b, C.emit_addmm(a.b, bias.node, a.node, w.node))


def conv(input: Tensor, weight: Tensor, shape, stride, padding, dilation, groups) -> Tensor:
    """A convolution with output ``shape`` (run by PyTorch: cuDNN on GPU)."""
    return Tensor(input.b, C.emit_conv(input.b, input.node, weight.node, shape, stride, padding, dilation, groups))


def rand(b: GraphBuilder, seed: fx.Node, shape) -> Tensor:
    """Uniform random float32 numbers in [0, 1) computed in the kernel from ``seed``."""
    return Tensor(b, C.emit_rand(b, seed, shape))
