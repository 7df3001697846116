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
import difflib
import inspect
import itertools
import math
from fractions import Fraction

import sympy
import torch
import torch.fx as fx

from compiler.ir.graph import NodeMeta, OpKind, broadcast_shapes, kind_of, meta_of, set_meta
from runtime.calls import unflatten_call
from runtime.program import ViewStep
from runtime.torch_functions import function_name
from runtime.trace import Recording, TensorMeta, ValueId

MAX_DEGREE = 3          # monomials of the sizes tried: s0, s0*s1, s0**2*s1, ...
MAX_POSITIONS = 200_000  # ints in a recording beyond which no template is made (fitting would cost too much)


class NotInstantiable(Exception):
    """The call's sizes break a relation of the template, or the template cannot be made."""


class ShapeRuleBroken(NotInstantiable):
    """A re-made graph's node (at ``position`` in its graph) disagrees with its op's shape rule."""

    def __init__(self, message: str, position: int, template_node=None, graph_index: int = 0):
        super().__init__(message)
        self.position = position
        self.template_node = template_node   # the node at ``position`` in the template's own graph
        self.where = (graph_index, position)  # (graph index, position): how far an instantiation got

    def located(self, template_graph, graph_index: int) -> "ShapeRuleBroken":
        """The same error, naming the template's node at its position in graph ``graph_index``."""
        return ShapeRuleBroken(str(self), self.position, list(template_graph.nodes)[self.position], graph_index)


# graph kwargs whose ints are never sizes: dim indices (a permute's (0, 2, 1, 3) at a batch of 3 became
# (0, 2, 1, 2) at a batch of 2), a convolution's or pooling's geometry, op flags
NOT_SIZES = frozenset({"dim", "dims", "dim0", "dim1", "stride", "padding", "dilation", "groups", "output_padding",
                       "kernel_size", "ceil_mode", "padding_idx", "wrap", "which", "zero_padding"})
MAX_REPAIRS = 8   # constants re-read as multiples of a size, one failing node at a time (``instantiate``)

# a binding's parameters whose ints are never sizes (``constant_leaves``): dim indices, and the
# constants of an op's math, which the graph keeps in its nodes' expressions (``_remake_graph``)
DIM_PARAMETERS = NOT_SIZES | {"start_dim", "end_dim", "dimension", "source", "destination", "axis"}
MATH_PARAMETERS = frozenset({"p", "ord", "_stacklevel", "ignore_index", "value", "alpha", "beta", "eps", "momentum",
                             "diagonal", "norm_type", "divisor_override", "fill_value", "src"})
# bindings whose every number argument is a constant of the math (pointwise ops), but sizes
_MATH_MODULES = ("compiler.capture.bindings.elementwise", "compiler.capture.bindings.losses")
# bindings that keep those numbers as graph kwargs, fitted as sizes there too (index_add's alpha)
_KWARG_MODULES = ("compiler.capture.bindings.routing",)
# bindings whose ``*size`` also takes a constant: x.new_full(size, fill_value)
_POSITIONAL_MATH = {torch.Tensor.new_full: 1}
_SIZE_PARAMETERS = frozenset({"size"})   # (x.new_zeros(*size), in the elementwise bindings)
# bindings that read dims from ``*args``: x.flip(0, 1) (every int), x.max(1, True) (the first)
_POSITIONAL_DIMS = {torch.flip: None, torch.Tensor.flip: None,
                    torch.max: 1, torch.Tensor.max: 1, torch.min: 1, torch.Tensor.min: 1}


class _Leaf:
    """Stands for leaf ``i`` of a recorded call while it is bound to its binding's signature."""

    def __init__(self, i: int):
        self.i = i


def _leaves_in(value) -> list:
    if isinstance(value, _Leaf):
        return [value.i]
    if isinstance(value, (tuple, list)):
        return [i for v in value for i in _leaves_in(v)]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _leaves_in(v)]
    return []


_CONSTANT_LEAVES: dict = {}


def constant_leaves(call) -> frozenset:
    """Positions in ``call.leaves`` of the ints the call passes that are not sizes, read from its
    binding: dim indices (a permute's (0, 2, 1, 3), a softmax's dim) and the constants of its math
    (``x * 3``, ``x.norm(p=3)``).

    NOTE: such an int is never read as a size seen at one value (one recording), as in the graph:
    - a dim index read as a batch of 3 became 2 at a batch of 2, and every replay at that batch
      diverged ("Tensor.permute called with a different constant (3 != 2)"), running eagerly;
    - a constant of the math stays a constant in the graph's expressions (``_remake_graph``'s
      "expr"), so a size that Python passes to the math (``x.sum(-1) / x.shape[-1]``) read as a size
      in the recorded call passed the replay's check while the kernel still divided by the old
      size: wrong values. A constant in both, the check sees the new size and the call runs
      eagerly. Seen changing between two recordings, both are fitted as sizes alike."""
    try:
        return _CONSTANT_LEAVES[(call.func, call.spec, len(call.leaves))]
    except KeyError:
        found = _CONSTANT_LEAVES[(call.func, call.spec, len(call.leaves))] = _find_constant_leaves(call)
        return found
    except TypeError:  # (an unhashable spec)
        return _find_constant_leaves(call)


def _find_constant_leaves(call) -> frozenset:
    from compiler.capture.bindings import lookup

    func = call.func
    binding = lookup(getattr(func, "__self__", None)) if getattr(func, "__name__", None) == "__get__" else lookup(func)
    if binding is None:
        return frozenset()
    try:
        args, kwargs = unflatten_call([_Leaf(i) for i in range(len(call.leaves))], call.spec)
        bound = inspect.signature(binding).bind(None, *args, **kwargs)
    except (TypeError, ValueError):  # (arguments the binding does not take: the call ran eagerly)
        return frozenset()
    module = getattr(binding, "__module__", None)
    math = module in _MATH_MODULES
    math_names = MATH_PARAMETERS if module not in _KWARG_MODULES else frozenset({"src"})

    def constant(name):
        return name in DIM_PARAMETERS or name in math_names or (math and name not in _SIZE_PARAMETERS)
    found = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL and func in _POSITIONAL_DIMS:
            first = _POSITIONAL_DIMS[func]
            found += _leaves_in(value if first is None else value[:first])
        elif kind is inspect.Parameter.VAR_POSITIONAL and func in _POSITIONAL_MATH:
            found += _leaves_in(value[_POSITIONAL_MATH[func]:])
        elif kind is inspect.Parameter.VAR_KEYWORD:   # (x.min(dim=1): read from **kwargs)
            found += [i for key, v in value.items() if constant(key) for i in _leaves_in(v)]
        elif constant(name):
            found += _leaves_in(value)
    return frozenset(found)


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


def _whole_of(e, inverse: bool):
    """N where the sympy Float ``e`` is 1/N (``inverse``: a mean's 1/count, written by a binding as
    ``total / float(numel)``) or N (a number Python passed, made a float: softplus's ``float(beta)``),
    for a whole N >= 2; else None."""
    value = float(e)
    if inverse:
        if not 0 < value <= 0.5:
            return None
        value = 1 / value
    n = round(value)
    return n if n >= 2 and abs(value - n) <= 1e-9 * n else None


def _map_floats(e, f, inverse: bool):
    """``e`` with each Float atom that is 1/N or N (``_whole_of``) made 1/f(N) or f(N)."""
    if e.is_Float:
        n = _whole_of(e, inverse)
        if n is None:
            return e
        v = f(n)
        return e if v == n else sympy.Float(1 / v if inverse else v, e._prec)
    if not e.args or e.is_Number:
        return e
    args = [_map_floats(a, f, inverse) for a in e.args]
    if all(a is b for a, b in zip(args, e.args)):
        return e
    return e.func(*args)


def _map_meta(meta: TensorMeta, f, unit) -> TensorMeta:
    unit(("meta", len(meta.shape)))
    return dataclasses.replace(meta, shape=_map_ints(tuple(meta.shape), f))


def _remake_graph(graph: fx.Graph, f, unit) -> fx.Graph:
    new = fx.Graph()
    env = {}
    for node in graph.nodes:
        unit(("node", node.op, str(node.target)))
        copy = new.node_copy(node, lambda n: env[n])
        copy.args = _map_ints(copy.args, f)
        kwargs = {}
        for key, value in copy.kwargs.items():
            if key in NOT_SIZES:   # (dim indices, a convolution's stride: never re-read as sizes)
                unit(("fixed",))
                kwargs[key] = _map_ints(value, f)
                unit(("node", node.op, str(node.target), "after", key))
            else:
                kwargs[key] = _map_ints(value, f)
        copy.kwargs = kwargs
        if "symgrad" in node.meta:
            m: NodeMeta = meta_of(node)
            shape = None if m.shape is None else _map_ints(tuple(m.shape), f)
            if m.expr is not None:
                unit(("expr",))   # (the constants of an op's math: never re-read as sizes, ``Template._repairs``)
            expr = None if m.expr is None else _map_expr(m.expr, f)
            if expr is not None:
                # NOTE: a mean written as ``total / float(numel)`` (the losses' reduction) holds its
                # count as a Float 1/N, and ``float(beta)`` (softplus) a Float N, which the ints above
                # miss: at other sizes the kernel still divided by the recording's count (l1_loss,
                # huber, BCE, KL: wrong values), or multiplied by the recording's number
                unit(("count",))
                expr = _map_floats(expr, f, inverse=True)
                unit(("whole",))
                expr = _map_floats(expr, f, inverse=False)
            set_meta(copy, dataclasses.replace(m, shape=shape, expr=expr))
        env[node] = copy
    return new


def _no_unit(label):
    pass


def remake(trace: Recording, graphs: list, f, unit=_no_unit) -> tuple:
    """(trace, graphs) with every int position mapped by ``f``, in the order ``positions``
    lists them. The trace's calls and plans are new objects; what does not depend on sizes
    (functions, value ids, compiled optimizer steps, external tensors) is shared. ``unit(label)``
    is called before the ints of each call, tensor metadata and graph node."""
    calls = []
    for call in trace.calls:
        name = function_name(call.func)
        unit(("call", name, call.kind, len(call.leaves)))
        constants = constant_leaves(call)
        leaves = []
        for i, x in enumerate(call.leaves):
            if isinstance(x, ValueId):
                leaves.append(x)
            elif i in constants:   # (a dim index, a constant of the math: as in ``_remake_graph``)
                unit(("fixed",))
                leaves.append(_map_ints(x, f))
                unit(("call", name, "after", i))
            else:
                leaves.append(_map_ints(x, f))
        calls.append(dataclasses.replace(call, leaves=leaves))
    externals = {vid: (ref, _map_meta(meta, f, unit)) for vid, (ref, meta) in trace.externals.items()}
    transient = {vid: _map_meta(meta, f, unit) for vid, meta in trace.transient.items()}
    plans, new_graphs = [], []
    for plan, graph in zip(trace.regions, graphs):
        internal = {vid: _map_meta(meta, f, unit) for vid, meta in plan.internal.items()}
        views = {}
        for vid, (base, steps) in plan.views.items():  # outputs remade as views of another output
            unit(("views", len(steps)))
            views[vid] = (base, tuple(ViewStep(step.op, _map_ints(step.params, f)) for step in steps))
        new_graph = None if graph is None else _remake_graph(graph, f, unit)
        plans.append(dataclasses.replace(plan, internal=internal, views=views, compiled=None, graph=new_graph))
        new_graphs.append(new_graph)
    # (a Recording, not compiled, whatever ``trace`` was)
    new = Recording(**(trace.recorded_fields() | dict(calls=calls, regions=plans, externals=externals,
                                                       transient=transient, recorded_optimizer_steps=[])))
    return new, new_graphs


def units(trace: Recording, graphs: list) -> list:
    """The ints of a recording in ``remake``'s order, by unit: [(label, [ints])]."""
    found = []

    def note(x):
        found[-1][1].append(x)
        return x
    remake(trace, graphs, note, lambda label: found.append((label, [])))
    return found


def align(base: list, other: list) -> list:
    """For each int of ``base`` (``units``), the int at the same place of ``other`` (another
    recording of the same function), or None where the recordings differ there (a first call
    whose optimizer step created its state made calls the later ones do not)."""
    matcher = difflib.SequenceMatcher(None, [label for label, _ in base], [label for label, _ in other],
                                      autojunk=False)
    matched = {}
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            if len(base[a + k][1]) == len(other[b + k][1]):
                matched[a + k] = other[b + k][1]
    out = []
    for u, (_, ints) in enumerate(base):
        out += matched.get(u) or [None] * len(ints)
    return out


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


def fit_position(values: list, points: list, varying: list, fixed: list) -> Fit:
    """The expressions that give ``values[p]`` at sizes ``points[p]`` for every recording p.

    First over the sizes that changed between the recordings (``varying`` monomials, scaled:
    ``4*s0``, ``s0/4``), or the constant where the value never changed. Then each is *lifted*
    by the sizes the recordings all had alike (``fixed`` monomials, seen at one value): where
    the scale (or the constant) equals such a monomial's value exactly, the size is taken to be
    it (``8*s1`` with a batch of 8 becomes ``s0*s1``). That is a guess; the relations and the
    shape rules check it at instantiation, and the replay checks every int Python passes."""
    first = values[0]
    if first < 2:
        return Fit(first, ())
    base = []  # (monomial over changing sizes, ratio); () with the constant as ratio
    for mono in varying:
        ratio = Fraction(first, _value(mono, points[0]))
        if (ratio.numerator == 1 or ratio.denominator == 1) \
                and all(ratio * _value(mono, p) == v for v, p in zip(values, points)):
            base.append((mono, ratio))
    if not base:
        if any(v != first for v in values):
            raise NotInstantiable(f"an int of the recording changed ({values}) as no product of the dynamic "
                                  "sizes does")
        base = [((), Fraction(first))]
    terms = []
    for mono, ratio in base:
        lifted = [(tuple(sorted(mono + extra)), Fraction(1)) for extra in fixed
                  if len(mono) + len(extra) <= MAX_DEGREE and ratio == _value(extra, points[0])]
        terms += lifted or [(mono, ratio)]
    if len(terms) == 1 and terms[0][0] == ():
        return Fit(first, ())
    # (several terms: sizes equal at every recording, or products that coincide: all kept, they must agree)
    return Fit(None, tuple(dict.fromkeys(terms)))


def _monomial_space(points, count) -> tuple:
    """(monomials of the sizes that changed between ``points``, of those that did not)."""
    changing = [i for i in range(count) if any(p[i] != points[0][i] for p in points)]
    alike = [i for i in range(count) if i not in changing]
    varying = [tuple(changing[j] for j in m) for m in _monomials(len(changing))]
    # (one size seen at one value only: a product of two such, 8*8, is far likelier a constant, 64)
    fixed = [tuple(alike[j] for j in m) for m in _monomials(len(alike)) if len(m) == 1]
    return varying, fixed


# -- the template ----------------------------------------------------------------------------------------------
class Template:
    """A recording (``trace``, region ``graphs``) with an expression for each of its ints."""

    def __init__(self, trace: Recording, graphs: list, sizes: tuple, others=()):
        """``sizes``: the dynamic sizes the recording was made at; ``others``: earlier
        recordings of the same calls at other sizes, as (trace, graphs, sizes)."""
        self.trace, self.graphs, self.sizes = trace, graphs, tuple(sizes)
        base = units(trace, graphs)
        values = [x for _, ints in base for x in ints]
        # (positions of op constants and dim indices: ``_remake_graph``'s "expr" and "fixed" units)
        self.in_math = [label in (("expr",), ("fixed",), ("count",), ("whole",)) for label, ints in base for _ in ints]
        if len(values) > MAX_POSITIONS:
            raise NotInstantiable(f"the recording has {len(values)} ints (more than {MAX_POSITIONS})")
        # the newest other recording at other sizes: a second point for the ints it shares
        other_sizes, other_values, same_structure = None, [None] * len(values), True
        for o_trace, o_graphs, o_sizes in reversed(list(others)):
            if len(o_sizes) == len(self.sizes) and tuple(o_sizes) != self.sizes:
                other_units = units(o_trace, o_graphs)
                other_sizes, other_values = tuple(o_sizes), align(base, other_units)
                same_structure = [label for label, _ in base] == [label for label, _ in other_units]
                break
        self.points = 1 + (other_sizes is not None)
        one = [self.sizes]
        two = [self.sizes, other_sizes] if other_sizes is not None else one
        spaces = {1: _monomial_space(one, len(self.sizes)), 2: _monomial_space(two, len(self.sizes))}
        cache: dict = {}
        self.fits = []
        alike = spaces[2][1]
        counts = [label == ("count",) for label, ints in base for _ in ints]
        numels = _numels(graphs) if any(counts) else set()
        for v, w, math_constant, count in zip(values, other_values, self.in_math, counts):
            column = (v,) if w is None else (v, w)
            if count and w is None and v in numels:
                # (a mean's 1/N with N a tensor's element count, seen at one size: whether N follows
                # the sizes is a guess either way, and a wrong one gives wrong values: record)
                raise NotInstantiable(f"an expression divides by {v}, a tensor's element count, seen at one size")
            if math_constant and (len(set(column)) == 1 or not same_structure):
                # NOTE: an op's constant (a comparison's code: eq is 4) is never a size, though it
                # may equal one seen at one value (a batch of 4: eq became ge at a batch of 3).
                # One that changed with the sizes follows them only where both recordings made the
                # same graphs: a binding may branch on it (a norm's p of 2 is a square root, of 3 a
                # power), and the other branch is not in this template.
                self.fits.append(Fit(v, ()))
                continue
            fit = cache.get(column)
            if fit is None:
                points = one if w is None else two
                fit = cache[column] = fit_position(list(column), points, *spaces[len(column)])
            self.fits.append(fit)
        self.guessed = bool(alike)  # (some sizes were seen at one value only: their expressions are guesses)
        # the sizes seen at one value only, for constants that turn out to be multiples of one (``_repairs``)
        self.alike = [(mono, _value(mono, self.sizes)) for mono in alike]
        # (nodes whose rule does not give their shape even in the recording itself are not checked)
        self.unchecked = [_rule_breaks(g) if g is not None else set() for g in graphs]
        self.values = values

    def instantiate(self, sizes, arg_shapes=None) -> tuple:
        """(trace, graphs) re-made for ``sizes``; raises ``NotInstantiable`` when a relation fails.
        ``arg_shapes``: the call's tensor arguments' shapes, which the re-made graphs must have.

        A node whose shape rule fails may hold a constant that was a product with a size the
        recordings saw at one value only (batch x heads = 12 at a batch of 3, in an attention's
        reshape, when the batch becomes dynamic only later): such constants of that node are read
        as that multiple of the size, everywhere they appear, and the instantiation is tried again
        (``MAX_REPAIRS`` times at most). A wrong reading fails the shape rules again, or the
        replay's check of the ints Python passes: the call then records, as without it."""
        sizes, repairs = tuple(sizes), {}
        try:
            return self._instantiate(sizes, arg_shapes, repairs)
        except ShapeRuleBroken as e:
            broken = e
        for _attempt in range(MAX_REPAIRS):
            # one constant of the failing node at a time: a repair that gets past the node is kept
            for fit, multiple in self._repairs(broken.template_node, repairs).items():
                trial = {**repairs, fit: multiple}
                try:
                    return self._instantiate(sizes, arg_shapes, trial)
                except ShapeRuleBroken as e:
                    if e.where > broken.where:
                        repairs, broken = trial, e
                        break
                except NotInstantiable:
                    continue
            else:
                raise broken
        raise broken

    def _repairs(self, node: fx.Node, done: dict) -> dict:
        """Constant fits among the ints of ``node`` (of a template graph: its shape, its arguments, its
        inputs' shapes) that are a multiple (2x or more) of one size seen at one value: {fit: c * size}
        (``node`` None: none)."""
        if node is None:
            return {}
        ints: list = []
        _map_ints((tuple(meta_of(node).shape), node.args, node.kwargs), ints.append)
        for arg in node.all_input_nodes:
            if "symgrad" in arg.meta and meta_of(arg).shape is not None:
                ints += list(meta_of(arg).shape)
        found = {}
        for fit in self.fits_by_value(ints):
            if fit in done:
                continue
            # a constant c, or c * m of sizes that changed: c a multiple of a size seen at one value
            mono, c = ((), fit.constant) if fit.constant is not None else fit.terms[0]
            c = Fraction(c)
            if c.denominator != 1 or c < 2:
                continue
            for extra, value in self.alike:
                if c % value == 0 and c // value >= 2 and len(mono) + len(extra) <= MAX_DEGREE:
                    found[fit] = Fit(None, ((tuple(sorted(mono + extra)), c / value),))
                    break
        return found

    def fits_by_value(self, ints) -> list:
        """The single-expression fits (a constant, or one ``c * m``) of positions holding one of ``ints``
        in the template, outside op constants."""
        wanted = set(ints)
        return list(dict.fromkeys(
            fit for fit, value, math_constant in zip(self.fits, self.values, self.in_math)
            if value in wanted and not math_constant and (fit.constant is not None) != bool(fit.terms)
            and len(fit.terms) <= 1))

    def _instantiate(self, sizes, arg_shapes, repairs) -> tuple:
        fits = [fit if math_constant else repairs.get(fit, fit) for fit, math_constant in zip(self.fits, self.in_math)]
        values = {}
        new = [values.setdefault(fit, fit.at(sizes)) if fit not in values else values[fit] for fit in fits]
        it = iter(new)
        trace, graphs = remake(self.trace, self.graphs, lambda _: next(it))
        # what is known exactly: tensors reached from outside keep their metadata, arguments have the call's
        known = {vid: tuple(meta.shape) for vid, (_, meta) in self.trace.externals.items()}
        for vid, (_, meta) in trace.externals.items():
            if tuple(meta.shape) != known[vid]:
                raise NotInstantiable(f"a guess changed the shape of a tensor the function reaches (value {vid})")
        if arg_shapes is not None:
            known.update((vid, tuple(shape)) for vid, shape in zip(trace.arg_ids, arg_shapes))
        for index, (graph, template_graph, unchecked) in enumerate(zip(graphs, self.graphs, self.unchecked)):
            if graph is None:
                continue
            for node in graph.nodes:
                if node.op != "placeholder" or not node.name.startswith("v") or not node.name[1:].isdigit():
                    continue
                shape = known.get(int(node.name[1:]))
                if shape is not None and tuple(meta_of(node).shape) != shape:
                    raise NotInstantiable(f"input {node.name} would have shape {list(meta_of(node).shape)}, "
                                          f"not its {list(shape)}")
            try:
                check_shapes(graph, unchecked)
            except ShapeRuleBroken as e:
                raise e.located(template_graph, index) from e
        return trace, graphs


def _numels(graphs) -> set:
    """The element counts of the graphs' values, and of their leading and trailing dims."""
    found = set()
    for graph in graphs:
        for node in graph.nodes if graph is not None else ():
            if "symgrad" in node.meta and meta_of(node).shape is not None:
                shape = tuple(meta_of(node).shape)
                found.update(math.prod(shape[:k]) for k in range(1, len(shape) + 1))
                found.update(math.prod(shape[k:]) for k in range(len(shape)))
    return found


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
        kind = kind_of(node)
        shape = tuple(meta_of(node).shape)
        try:
            if kind == OpKind.POINTWISE:
                shapes = [tuple(meta_of(a).shape) for a in node.args if isinstance(a, fx.Node)]
                expected = broadcast_shapes(*shapes) if shapes else shape
                ok = expected == shape or (shapes and all(s == () for s in shapes))
            elif kind == OpKind.REDUCTION:
                in_shape, kw = tuple(meta_of(node.args[0]).shape), node.kwargs
                ok = node.target.out_shape(in_shape, kw["dims"], kw["keepdim"]) == shape
            elif kind == OpKind.VIEW:
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
            raise ShapeRuleBroken(f"{node.name} ({node.target}) cannot take the new sizes: {e}", position) from None
        if not ok and collect is not None:
            collect.add(position)
        elif not ok:
            raise ShapeRuleBroken(f"{node.name} ({node.target}) would have shape {list(shape)}, which its rule "
                                  "does not give at the new sizes", position)
