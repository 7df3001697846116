"""The IR every stage shares: a ``torch.fx.Graph`` whose call nodes target catalog ops.

Each node carries one typed record, ``NodeMeta`` (read with ``meta_of(node)``): its shape,
dtype, whether a gradient flows to it, a pointwise node's SymPy expression, and where it came
from. The record is frozen: fx's ``node_copy`` shares it between graphs, so a change is made
with ``update_meta``, which swaps in a new record for that node alone.

``GraphBuilder`` is the one way stages add nodes, so metadata is always filled in.
``format_graph`` prints a graph as Python-like text with ``# f32[4, 8]`` comments.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import sympy
import torch
import torch.fx as fx

@dataclasses.dataclass(frozen=True, slots=True)
class NodeMeta:
    """What every graph value carries (like fx's ``shape_prop.TensorMetadata``)."""

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool                 # whether a gradient flows to this value
    expr: sympy.Expr | None = None      # pointwise nodes: the value over a0, a1, ... (the tensor args)
    materialize: bool = False           # computed into memory once, never inlined into its readers
    device: torch.device | None = None  # capture's: the device of the recorded tensor
    torch_op: str | None = None         # capture's: the PyTorch function this node came from
    source: str | None = None           # capture's: the user's source line of that call
    origin: tuple | None = None         # autodiff's: (torch_op, source) of the forward node differentiated
    checkpoint: int | None = None       # capture's: the torch.utils.checkpoint block it ran in (recomputed)
    detached: bool = False              # a detach(): no gradient path through it, at any order
    # saved for the backward where it reads it, never recomputed there: its recompute costs far more
    # than its bytes (a pool's window scan, nine reads of its input; ``autodiff.saved_set``)
    never_recomputed: bool = False
    # its gradient is computed into memory once (the vjp reads it at many places: a pool's gradient,
    # at each window element's view; ``autodiff.partition.differentiate``)
    materialize_grad: bool = False
    # a Python number the region takes at run time (``runtime.trace.NumberId``), as a 0-dim tensor:
    # it promotes as the Python number it stands for (``result_dtype``), not as a tensor
    number: bool = False


_META_KEY = "symgrad"


def meta_of(node: fx.Node) -> NodeMeta:
    """The typed metadata of a graph node (every node made by ``GraphBuilder`` has it)."""
    return node.meta[_META_KEY]


def has_meta(node: fx.Node) -> bool:
    return _META_KEY in node.meta


def set_meta(node: fx.Node, meta: NodeMeta) -> None:
    """Give ``node`` the record ``meta`` (nodes copied from another graph share their record)."""
    node.meta[_META_KEY] = meta


def update_meta(node: fx.Node, **changes) -> NodeMeta:
    """Change some fields of ``node``'s record, for this node only."""
    meta = dataclasses.replace(node.meta[_META_KEY], **changes)
    node.meta[_META_KEY] = meta
    return meta


ARG_SYMBOLS = tuple(sympy.Symbol(f"a{i}", real=True) for i in range(64))


def arg_symbol(i: int) -> sympy.Symbol:
    return ARG_SYMBOLS[i]


DTYPE_SHORT = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def type_str(node: fx.Node) -> str:
    shape = meta_of(node).shape
    dtype = meta_of(node).dtype
    if shape is None:
        return ""
    return f"{DTYPE_SHORT.get(dtype, str(dtype))}{list(shape)}"


_SCALAR_OF_KIND = {"bool": True, "int": 1, "float": 1.0, "complex": 1j}


@functools.lru_cache(maxsize=4096)
def _promote(key):
    operands = []
    for item in key:
        if isinstance(item, tuple):  # (dtype, is_zero_dim)
            dtype, zero_dim = item
            operands.append(torch.empty(() if zero_dim else (1,), dtype=dtype, device="meta"))
        else:
            operands.append(_SCALAR_OF_KIND.get(item, item))
    result = operands[0] if isinstance(operands[0], torch.Tensor) else None
    dtype = None
    # torch.result_type takes two operands; fold left the way elementwise ops promote.
    acc = operands[0]
    for other in operands[1:]:
        dtype = torch.result_type(acc, other)
        acc = torch.empty((1,), dtype=dtype, device="meta")
    if dtype is None:
        dtype = result.dtype if result is not None else torch.get_default_dtype()
    return dtype


def result_dtype(operands) -> torch.dtype:
    """Eager PyTorch's type promotion for an elementwise op over nodes and Python scalars."""
    key = []
    for item in operands:
        if isinstance(item, fx.Node) and meta_of(item).number:
            key.append("float" if meta_of(item).dtype.is_floating_point else "int")
        elif isinstance(item, fx.Node):
            key.append((meta_of(item).dtype, len(meta_of(item).shape) == 0))
        # Python scalars by kind, as strings: 1, 1.0 and True are equal keys to the cache
        elif isinstance(item, bool):
            key.append("bool")
        elif isinstance(item, int):
            key.append("int")
        elif isinstance(item, float):
            key.append("float")
        elif isinstance(item, complex):
            key.append("complex")
        else:
            key.append(item)
    return _promote(tuple(key))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types are loaded, computed in float32 and stored back, as Inductor does."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def broadcast_shapes(*shapes) -> tuple:
    return tuple(torch.broadcast_shapes(*shapes))


def numel(shape) -> int:
    return math.prod(shape)


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


class OpKind(enum.StrEnum):
    """What a graph node is to the stages after capture (its op's ``kind``): how fusion groups it
    and how the kernel writer computes it."""
    INPUT = "input"          # a placeholder
    POINTWISE = "pointwise"  # an element from the elements of its arguments at the same index
    REDUCTION = "reduction"
    VIEW = "view"            # a new index map over its argument's elements (no data moved)
    SCATTER = "scatter"      # values written into positions of a zero (or given) tensor
    GATHER = "gather"        # elements read at positions a tensor holds
    IOTA = "iota"            # a value of its index (arange)
    RAND = "rand"            # a random number from a seed and its index
    EXTERN = "extern"        # a PyTorch call of its own (matmul, convolution): never fused
    OP = "op"                # a catalog op of no kind above
    OTHER = "other"          # no catalog op (the output node)


def kind_of(node: fx.Node) -> OpKind:
    if node.op == "placeholder":
        return OpKind.INPUT
    return getattr(node.target, "kind", OpKind.OTHER)


def output_node(graph: fx.Graph) -> fx.Node:
    """The graph's output node (fx keeps it last)."""
    node = next(iter(reversed(graph.nodes)))
    assert node.op == "output", f"a graph ends with its output node, not {node.op}"
    return node


def outputs_of(graph: fx.Graph) -> list:
    """The values the graph returns, in order."""
    return list(output_node(graph).args[0])


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph``: new nodes, the same metadata records (frozen: shared safely)."""
    new = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    return new


class GraphBuilder:
    """Appends catalog ops to an fx.Graph with their metadata filled in."""

    def __init__(self, graph: fx.Graph | None = None, new_seed=None):
        self.graph = graph if graph is not None else fx.Graph()
        self.created: list = []   # call nodes in creation order (stages tag what they made)
        self.new_seed = new_seed  # capture's: () -> a region input holding a fresh RNG seed per call
        # number inputs (``NodeMeta.number``) -> (low, high): the open interval a binding's kernels
        # hold for (dropout's p); a replay given a number outside it leaves the recording
        self.number_bounds: dict = {}

    def placeholder(self, name, shape, dtype, requires_grad=False, device=None) -> fx.Node:
        node = self.graph.placeholder(name)
        set_meta(node, NodeMeta(tuple(shape), dtype, requires_grad, device=device))
        return node

    def placeholder_like(self, name, source: fx.Node) -> fx.Node:
        """A placeholder standing for ``source`` of another graph (sharing its record)."""
        node = self.graph.placeholder(name)
        set_meta(node, meta_of(source))
        return node

    def call(self, op, args, kwargs=None, *, shape, dtype, requires_grad, expr=None) -> fx.Node:
        node = self.graph.call_function(op, tuple(args), dict(kwargs or {}))
        self.created.append(node)
        set_meta(node, NodeMeta(tuple(shape), dtype, requires_grad, expr=expr))
        return node

    def output(self, values):
        return self.graph.output(tuple(values))


def format_graph(graph: fx.Graph, title: str = "graph") -> str:
    """Python-like text of a graph, one line per node, with dtype/shape comments."""
    lines = []
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    lines.append(f"def {title}({', '.join(n.name for n in inputs)}):")
    for n in inputs:
        lines.append(f"    # {n.name}: {type_str(n)}{'  (requires grad)' if meta_of(n).requires_grad else ''}")
    for n in graph.nodes:
        if n.op == "call_function":
            op_name = getattr(n.target, "name", getattr(n.target, "__name__", str(n.target)))
            args = [a.name if isinstance(a, fx.Node) else repr(a) for a in n.args]
            args += [f"{k}={v!r}" for k, v in n.kwargs.items()]
            text = f"    {n.name} = {op_name}({', '.join(args)})"
            if meta_of(n).expr is not None and (op_name == "pointwise" or meta_of(n).expr.atoms(sympy.Float)):
                text += f"  [{meta_of(n).expr}]"
            lines.append(f"{text}  # {type_str(n)}")
        elif n.op == "output":
            outs = n.args[0]
            names = [o.name if isinstance(o, fx.Node) else repr(o) for o in outs]
            lines.append(f"    return ({', '.join(names)})")
    return "\n".join(lines)
