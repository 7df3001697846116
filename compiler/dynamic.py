"""Recordings made under a dynamic guard key are *templates*: re-made for new sizes, not recorded again.

A recording is a trace (its torch calls, with their Python ints) and one fx graph per region
(node shapes, view sizes, slice bounds, ...). Every int of it is a position; ``fit`` gives each
position an expression in the dynamic sizes s0, s1, ... (sympy, positive integers): the
constant itself, or ``c * m`` / ``m / c`` for a monomial ``m`` of the sizes (degree <= 3),
chosen to agree with every recording at hand (the template's, and an earlier recording of the
same function at other sizes when there is one). ``Template.instantiate`` evaluates them at a
call's sizes and re-makes the trace and the graphs, ready to build and replay: no eager run.

What the template relies on is kept as *relations*, checked there:
* where several expressions fit a position (two dynamic dims that were equal, a size equal to
  a product of others), they must still agree;
* a quotient (``s0 / 4``: a view that splits a dim) must still divide;
* a graph re-made at the new sizes must be consistent with the shape rules of its pointwise,
  reduction and view nodes (a guess that a constant 8 was the batch size 8 fails here).
A call that violates any of them is recorded (``NotInstantiable``); the replay's per-call checks
still compare every constant Python passes with the instantiated one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import sympy
import torch
import torch.fx as fx

from compiler.ir import NodeMeta, broadcast_shapes, meta_of, set_meta
from runtime.trace import TensorMeta, Trace, ValueId

MAX_DEGREE = 3          # monomials of the sizes tried: s0, s0*s1, s0**2*s1, ...
MAX_POSITIONS = 200_000  # ints in a recording beyond which no template is made (fitting would cost too much)


class NotInstantiable(Exception):
    """The call's sizes break a relation of the template, or the template cannot be made."""


def size_symbol(i: int) -> sympy.Symbol:
    return sympy.Symbol(f"s{i}", integer=True, positive=True)


# -- the ints of a recording, in a fixed order ----------------------------------------------------------
def _map_ints(x, f):
    if type(x) is int:
        return f(x)
    if type(x) is tuple:
        return tuple(_map_ints(y, f) for y in x)
    if isinstance(x, list):  # (fx's immutable_list too)
        return [_map_ints(y, f) for y in x]
    if isinstance(x, torch.Size):
        return torch.Size(_map_ints(tuple(x), f))
    if isinstance(x, dict):  # (fx's immutable_dict too)
        return {k: _map_ints(v, f) for k, v in x.items()}
    if type(x) is slice:
        return slice(_map_ints(x.start, f), _map_ints(x.stop, f), _map_ints(x.step, f))
    return x


def _map_expr(e, f):
    """``e`` with its integer and rational atoms mapped by ``f`` (unchanged parts kept as they are)."""
    if e.is_Integer:
        v = f(int(e))
        return e if v == int(e) else sympy.Integer(v)
    if e.is_Rational:
        p, q = f(int(e.p)), f(int(e.q))
        return e if (p, q) == (e.p, e.q) else sympy.Rational(p, q)
    if not e.args:
        return e
    args = [_map_expr(a, f) for a in e.args]
    if all(a is b for a, b in zip(args, e.args)):
        return e
    return e.func(*args)


def _map_meta(meta: TensorMeta, f) -> TensorMeta:
    return dataclasses.replace(meta, shape=_map_ints(tuple(meta.shape), f))


def _remake_graph(graph: fx.Graph, f) -> fx.Graph:
    new = fx.Graph()
    env = {}
    for node in graph.nodes:
        copy = new.node_copy(node, lambda n: env[n])
        copy.args = _map_ints(copy.args, f)
        copy.kwargs = _map_ints(copy.kwargs, f)
        if "symgrad" in node.meta:
            m: NodeMeta = meta_of(node)
            shape = None if m.shape is None else _map_ints(tuple(m.shape), f)
            expr = None if m.expr is None else _map_expr(m.expr, f)
            set_meta(copy, dataclasses.replace(m, shape=shape, expr=expr))
        env[node] = copy
    return new


def remake(trace: Trace, graphs: list, f) -> tuple:
    """(trace, graphs) with every int position mapped by ``f``, in the order ``positions``
    lists them. The trace's calls and plans are new objects; what does not depend on sizes
    (functions, value ids, compiled optimizer steps, external tensors) is shared."""
    calls = []
    for call in trace.calls:
        leaves = [x if isinstance(x, ValueId) else _map_ints(x, f) for x in call.leaves]
        calls.append(dataclasses.replace(call, leaves=leaves))
    externals = {vid: (ref, _map_meta(meta, f)) for vid, (ref, meta) in trace.externals.items()}
    transient = {vid: _map_meta(meta, f) for vid, meta in trace.transient.items()}
    plans, new_graphs = [], []
    for plan, graph in zip(trace.regions, graphs):
        internal = {vid: _map_meta(meta, f) for vid, meta in plan.internal.items()}
        new_plan = dataclasses.replace(plan, internal=internal, compiled=None, stand_ins=None)
        new_graph = None if graph is None else _remake_graph(graph, f)
        new_plan.graph = new_graph
        plans.append(new_plan)
        new_graphs.append(new_graph)
    new = dataclasses.replace(trace, calls=calls, regions=plans, externals=externals, transient=transient,
                              recorded_optimizer_steps=[])
    return new, new_graphs


def positions(trace: Trace, graphs: list) -> list:
    """Every int of a recording, in ``remake``'s order."""
    found = []

    def note(x):
        found.append(x)
        return x
    remake(trace, graphs, note)
    return found


def same_structure(a: Trace, b: Trace, graphs_a: list, graphs_b: list) -> bool:
    """Whether two recordings made the same calls into the same graphs (ints aside)."""
    if len(a.calls) != len(b.calls) or len(a.regions) != len(b.regions) or a.arg_ids != b.arg_ids:
        return False
    for x, y in zip(a.calls, b.calls):
        if (x.func is not y.func and x.func != y.func) or x.spec != y.spec or x.kind != y.kind \
                or x.region != y.region or x.outputs != y.outputs or len(x.leaves) != len(y.leaves):
            return False
    for pa, pb, ga, gb in zip(a.regions, b.regions, graphs_a, graphs_b):
        if pa.calls != pb.calls or pa.input_ids != pb.input_ids or pa.output_ids != pb.output_ids \
                or (ga is None) != (gb is None) or (pa.compiled is None) != (pb.compiled is None):
            return False
        if ga is not None and [n.target for n in ga.nodes] != [n.target for n in gb.nodes]:
            return False
    return True


# -- fitting an expression to each position ---------------------------------------------------------------
def _monomials(count: int):
    for degree in range(1, MAX_DEGREE + 1):
        yield from itertools.combinations_with_replacement(range(count), degree)


def _value(mono, sizes) -> int:
    v = 1
    for i in mono:
        v *= sizes[i]
    return v


@dataclasses.dataclass(frozen=True)
class Fit:
    """A position's expressions: the constant ``constant`` (None: not one), or ``ratio * m`` for
    each monomial ``m`` (a tuple of size indices) in ``terms``. All of them must agree."""

    constant: int | None
    terms: tuple  # ((monomial, Fraction ratio), ...)

    def at(self, sizes):
        values = {self.constant} if self.constant is not None else set()
        for mono, ratio in self.terms:
            v = ratio * _value(mono, sizes)
            if v.denominator != 1:
                raise NotInstantiable(f"a size the recording divided ({self.describe()}) does not divide at {sizes}")
            values.add(int(v))
        if len(values) != 1:
            raise NotInstantiable(f"sizes the recording had related ({self.describe()}) differ now: {sorted(values)}")
        return values.pop()

    def describe(self) -> str:
        names = [str(self.constant)] if self.constant is not None else []
        for mono, ratio in self.terms:
            m = "*".join(f"s{i}" for i in mono)
            names.append(m if ratio == 1 else f"{ratio.numerator}*{m}" if ratio.denominator == 1
                         else f"{m}/{ratio.denominator}" if ratio.numerator == 1 else f"{ratio}*{m}")
        return " = ".join(names)


def fit_position(values: list, points: list, monos: list) -> Fit:
    """The expressions that give ``values[p]`` at sizes ``points[p]`` for every recording p.
    A monomial whose sizes changed between the recordings may be scaled (``4*s0``, ``s0/4``);
    one whose sizes did not (a size seen once) must equal the value exactly: that is a guess
    (the value is taken to be that size), which the relations and the shape rules check."""
    first = values[0]
    if first < 2:
        return Fit(first, ())
    same = all(v == first for v in values)
    terms = []
    for mono, varies in monos:
        if varies:
            ratio = Fraction(first, _value(mono, points[0]))
            if not (ratio.numerator == 1 or ratio.denominator == 1):
                continue
            if all(ratio * _value(mono, p) == v for v, p in zip(values, points)):
                terms.append((mono, ratio))
        elif same and _value(mono, points[0]) == first:
            terms.append((mono, Fraction(1)))
    if not terms:
        if same:
            return Fit(first, ())
        raise NotInstantiable(f"an int of the recording changed ({values}) as no product of the dynamic sizes does")
    # (several terms: sizes equal at every recording, or products that coincide: all kept, they must agree)
    return Fit(None, tuple(terms))


# -- the template ----------------------------------------------------------------------------------------------
class Template:
    """A recording (``trace``, region ``graphs``) with an expression for each of its ints."""

    def __init__(self, trace: Trace, graphs: list, sizes: tuple, others=()):
        """``sizes``: the dynamic sizes the recording was made at; ``others``: earlier
        recordings of the same calls at other sizes, as (trace, graphs, sizes)."""
        self.trace, self.graphs, self.sizes = trace, graphs, tuple(sizes)
        values = [positions(trace, graphs)]
        if len(values[0]) > MAX_POSITIONS:
            raise NotInstantiable(f"the recording has {len(values[0])} ints (more than {MAX_POSITIONS})")
        points = [self.sizes]
        for other_trace, other_graphs, other_sizes in others:
            if tuple(other_sizes) == self.sizes or len(other_sizes) != len(self.sizes) \
                    or not same_structure(trace, other_trace, graphs, other_graphs):
                continue
            other = positions(other_trace, other_graphs)
            if len(other) == len(values[0]):
                values.append(other)
                points.append(tuple(other_sizes))
        self.points = len(points)
        monos = [(m, any(_value(m, p) != _value(m, points[0]) for p in points)) for m in _monomials(len(self.sizes))]
        cache: dict = {}
        self.fits = []
        for column in zip(*values):
            fit = cache.get(column)
            if fit is None:
                fit = cache[column] = fit_position(list(column), points, monos)
            self.fits.append(fit)
        self.guessed = any(not varies for _, varies in monos)
        # (nodes whose rule does not give their shape even in the recording itself are not checked)
        self.unchecked = [_rule_breaks(g) if g is not None else set() for g in graphs]

    def instantiate(self, sizes) -> tuple:
        """(trace, graphs) re-made for ``sizes``; raises ``NotInstantiable`` when a relation fails."""
        sizes = tuple(sizes)
        values = {}
        new = [values.setdefault(fit, fit.at(sizes)) if fit not in values else values[fit] for fit in self.fits]
        it = iter(new)
        trace, graphs = remake(self.trace, self.graphs, lambda _: next(it))
        for graph, unchecked in zip(graphs, self.unchecked):
            if graph is not None:
                check_shapes(graph, unchecked)
        return trace, graphs


def _rule_breaks(graph: fx.Graph) -> set:
    broken = set()
    try:
        check_shapes(graph, broken, collect=broken)
    except NotInstantiable:
        pass
    return broken


def check_shapes(graph: fx.Graph, skip=frozenset(), collect=None) -> None:
    """Raise ``NotInstantiable`` where a node's re-made shape disagrees with its op's shape rule
    applied to its re-made inputs (pointwise broadcasting, reductions, views). ``skip``: node
    positions not checked; ``collect``: a set to add each disagreeing position to instead."""
    for position, node in enumerate(graph.nodes):
        if node.op != "call_function" or "symgrad" not in node.meta or position in skip:
            continue
        kind = getattr(node.target, "kind", None)
        shape = tuple(meta_of(node).shape)
        try:
            if kind == "pointwise":
                shapes = [tuple(meta_of(a).shape) for a in node.args if isinstance(a, fx.Node)]
                expected = broadcast_shapes(*shapes) if shapes else shape
                ok = expected == shape or (shapes and all(s == () for s in shapes))
            elif kind == "reduction":
                in_shape, kw = tuple(meta_of(node.args[0]).shape), node.kwargs
                ok = node.target.out_shape(in_shape, kw["dims"], kw["keepdim"]) == shape
            elif kind == "view":
                x = node.args[0]
                in_shape = tuple(meta_of(x).shape)
                ok = tuple(node.target.out_shape(in_shape, dict(node.kwargs))) == shape
                if node.target.name == "reshape":
                    ok = ok and math.prod(in_shape) == math.prod(shape)
            else:
                continue
        except Exception as e:  # noqa: BLE001 — a rule that cannot apply at these sizes: not instantiable
            if collect is not None:
                collect.add(position)
                continue
            raise NotInstantiable(f"{node.name} ({node.target}) cannot take the new sizes: {e}") from None
        if not ok and collect is not None:
            collect.add(position)
        elif not ok:
            raise NotInstantiable(f"{node.name} ({node.target}) would have shape {list(shape)}, which its rule "
                                  "does not give at the new sizes")
