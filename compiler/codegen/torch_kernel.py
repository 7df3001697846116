"""A fused kernel as a Python function of PyTorch ops: the CPU path (``backend="torch"``).

The same kernel plan that ``triton_kernel`` renders as a Triton kernel is written here as
straight-line PyTorch code, one line per graph node the kernel computes: a pointwise node's
SymPy expression printed as torch calls (each primitive's own ``torch_eval``, as
``compiler.ir.ops.evaluate`` uses), a reduction as ``torch.sum``/``torch.mean``/``torch.amax``, a
view as PyTorch's view function (the op's own ``apply``), and anything else (gathers, iota,
slice scatters, random numbers) by the op's reference evaluation (``op.evaluate``, as
``compiler.ir.reference`` runs it). On CPU tensors PyTorch's vectorized kernels run each line, so
a compiled program costs about what eager's ops cost, where Triton's interpreter costs
hundreds of times more.

Values are computed as the Triton kernel computes them: half types in float32 (``compute_dtype``),
rounded to the stored dtype at the store. Every store is a fresh contiguous tensor (a store
that would alias a loaded tensor, a view or an unchanged operand, is copied), as the Triton
kernel's outputs are.

``TorchKernel`` holds the source and the objects it names (ops, SymPy function classes, dtypes:
all picklable, so a region stored by ``compiler.reuse.persist`` keeps it); the function is compiled
once per kernel, at its first run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging
import math

import sympy
import torch
import torch.fx as fx

from compiler.ir.graph import OpKind, compute_dtype, kind_of, meta_of
from compiler.ir.ops import primitives
from compiler.ir.ops import symbols as Y

log = logging.getLogger("compiler")



@dataclass
class _Node:
    """What an op's ``evaluate`` reads of a graph node (its parameters and metadata), without
    the graph: picklable, unlike an ``fx.Node``."""
    kwargs: dict
    meta: dict
    args: tuple = ()


@dataclass
class TorchKernel:
    """A kernel's PyTorch function: ``run(env)`` reads the load slots of ``env`` and writes the
    store slots (the runtime's ``KernelLaunch`` calls it on the CPU path)."""
    name: str
    source: str            # ``def kernel(env): ...``
    objects: dict          # name -> object the source refers to
    functions: dict        # name -> SymPy function class (bound to its primitive's torch_eval at load)
    _fn: object = field(default=None, repr=False, compare=False)

    def run(self, env) -> None:
        fn = self._fn
        if fn is None:
            fn = self._fn = self._load()
        fn(env)

    def function(self):
        """``kernel(env)`` itself (``run`` without its frame: a program on the CPU path calls it)."""
        if self._fn is None:
            self._fn = self._load()
        return self._fn

    def __getstate__(self):  # the compiled function is made again after unpickling
        state = self.__dict__.copy()  # (one step: another thread may be loading _fn; see program.state_without)
        state["_fn"] = None
        return state

    def _load(self):
        names = {"torch": torch, "_fix": _fix, "_store": _store, "_sqrt": _sqrt, **self.objects}
        for name, func in self.functions.items():
            names[name] = primitives.head(func).torch_eval
        exec(compile(self.source, f"<symgrad torch kernel {self.name}>", "exec"), names)
        return names["kernel"]


def _fix(value, dtype, shape, device):
    """A pointwise value as its node's: a tensor of ``dtype`` and ``shape`` (as ``Pointwise.evaluate``)."""
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, device=device)
    if value.is_complex() and not dtype.is_complex:
        value = value.real
    if value.dtype != dtype:
        value = value.to(dtype)
    if value.shape != shape:
        value = value.expand(shape)
    return value


def _store(value, dtype, copy):
    """A kernel output: a fresh contiguous tensor of ``dtype`` (``copy``: the value may share
    memory with a loaded tensor)."""
    if value.dtype != dtype:
        return value.to(dtype).contiguous()
    if copy:
        return value.clone(memory_format=torch.contiguous_format)
    return value.contiguous()


def render_torch_kernel(name: str, loads: list, load_slots: list, stores: list, store_slots: list,
                        buffers: set) -> TorchKernel | None:
    """The PyTorch function of the kernel that reads buffer nodes ``loads`` (at ``load_slots``) and
    writes ``stores`` (at ``store_slots``); ``buffers`` are the values in memory (the schedule's).
    None where it cannot be written (logged): that kernel then runs as its Triton kernel on every
    backend, so the CPU path never makes a build fail."""
    if all(math.prod(meta_of(n).shape) == 0 for n in stores):  # nothing to compute: allocate the outputs
        lines = [f"env[{slot}] = torch.empty({tuple(meta_of(n).shape)!r}, dtype=o{k})"
                 for k, (n, slot) in enumerate(zip(stores, store_slots))]
        return TorchKernel(name, "def kernel(env):\n" + "".join(f"    {line}\n" for line in lines),
                           {f"o{k}": meta_of(n).dtype for k, n in enumerate(stores)}, {})
    try:
        return _Writer(loads, load_slots, stores, buffers).write(name, store_slots)
    except Exception as e:  # noqa: BLE001 — a gap of this printer: the kernel keeps its Triton form only
        log.warning("kernel %s has no PyTorch function for the CPU path (%s: %s); it runs as its Triton kernel "
                    "(Triton's interpreter on CPU); please report this", name, type(e).__name__, e)
        return None


class _Writer:
    def __init__(self, loads, load_slots, stores, buffers):
        self.lines: list = []
        self.objects: dict = {}
        self.functions: dict = {}
        self.values: dict = {}       # node -> variable name
        self.aliases: set = set()    # variables that may share memory with a loaded tensor
        self.types: dict = {}        # variable -> (dtype, shape) where known when the code is written
        self.stores = set(stores)
        self.store_order = list(stores)
        self.printer = _ExprPrinter(self)
        self.buffers = buffers
        self.device = None
        for node, slot in zip(loads, load_slots):
            var = f"l{slot}"
            self.lines.append(f"{var} = env[{slot}]")
            dtype = meta_of(node).dtype
            if compute_dtype(dtype) != dtype:  # computed in float32, as the Triton kernel does
                self.lines.append(f"{var}c = {var}.to({self._obj(compute_dtype(dtype))})")
                var = f"{var}c"
            else:
                self.aliases.add(var)
            self.values[node] = var
            self.types[var] = (compute_dtype(dtype), tuple(meta_of(node).shape))
        self.first_load = f"l{load_slots[0]}" if load_slots else None

    def write(self, name, store_slots) -> TorchKernel:
        needed = self._needed()
        for node in next(iter(self.stores)).graph.nodes:  # graph order: each node after its arguments
            if node in needed:
                self.value(node)
        for node, slot in zip(self.store_order, store_slots):
            var = self.value(node)
            dtype = meta_of(node).dtype
            known = self.types.get(var)
            if known is not None and known[0] == dtype:  # (_store's work, without its call: a few a kernel)
                store = (f"{var}.clone(memory_format=torch.contiguous_format)" if var in self.aliases
                         else f"{var}.contiguous()")
            else:
                store = f"_store({var}, {self._obj(dtype)}, {var in self.aliases})"
            self.lines.append(f"env[{slot}] = {store}")
        source = "def kernel(env):\n" + "".join(f"    {line}\n" for line in self.lines)
        return TorchKernel(name, source, self.objects, self.functions)

    def _needed(self) -> set:
        """The nodes this kernel computes: its stores and what they read, back to the loads."""
        needed, stack = set(), list(self.stores)
        while stack:
            node = stack.pop()
            if node in needed or node in self.values:
                continue
            if node in self.buffers and node not in self.stores:
                # NOTE: a buffer an op of this kernel names but the Triton kernel does not load:
                # empty, an operand its expression lost (a1 * 0 simplified to 0), the base of a
                # slice_scatter whose slice covers it. Its value cannot change the Triton kernel's
                # result, so zeros stand for it (broadcast: no memory), as the op's operand.
                var = self.values[node] = f"z{len(self.values)}"
                dtype = compute_dtype(meta_of(node).dtype)
                shape = tuple(meta_of(node).shape)
                zero = f"torch.zeros((), dtype={self._obj(dtype)}, device={self._device()})"
                self.lines.append(f"{var} = {zero}.expand({shape!r})")
                self.types[var] = (dtype, shape)
                continue
            needed.add(node)
            stack.extend(a for a in node.all_input_nodes)
        return needed

    # -- values ----------------------------------------------------------------------------
    def value(self, node: fx.Node) -> str:
        var = self.values.get(node)
        if var is not None:
            return var
        args = [self.value(a) if isinstance(a, fx.Node) else repr(a) for a in node.args]
        kind = kind_of(node)
        var = f"v{len(self.values)}"
        self.values[node] = var
        meta = meta_of(node)
        dtype = compute_dtype(meta.dtype)
        if kind == OpKind.POINTWISE:
            text = self._pointwise(node, args)
            if self.types.get(text) == (dtype, tuple(meta.shape)):  # known to be the node's value as it is
                self.lines.append(f"{var} = {text}")
            else:
                self.lines.append(f"{var} = _fix({text}, {self._obj(dtype)}, {tuple(meta.shape)!r}, {self._device()})")
            if text in args or text in self.aliases:  # (the expression is an operand itself: no new tensor)
                self.aliases.add(var)
            self.types[var] = (dtype, tuple(meta.shape))
        elif kind == OpKind.REDUCTION and node.target.name in ("sum", "mean", "amax"):
            known = self.types.get(args[0])
            if known is not None and known[0] == dtype and dtype.is_floating_point:
                # (a floating reduction keeps its input's dtype: no conversion to call)
                self.lines.append(f"{var} = {self._reduction(node, args[0])}")
            else:  # (an integer or bool sum is int64 in torch)
                self.lines.append(f"{var} = {self._reduction(node, args[0])}.to({self._obj(dtype)})")
            self.types[var] = (dtype, tuple(meta.shape))
        elif kind == OpKind.VIEW:
            inline = getattr(node.target, "method_call", None)
            method = inline(args[0], dict(node.kwargs)) if inline is not None else None
            if method is not None:  # (the tensor method itself: ``v3 = l8.reshape((1, 1))``)
                self.lines.append(f"{var} = {method}")
            else:
                op = self._obj(node.target)
                params = ", ".join(f"{k}={v!r}" for k, v in node.kwargs.items())
                self.lines.append(f"{var} = {op}.apply({args[0]}{', ' if params else ''}{params})")
            if args[0] in self.aliases:
                self.aliases.add(var)
            if args[0] in self.types:
                self.types[var] = (self.types[args[0]][0], tuple(meta.shape))
        else:  # the op's own evaluation on real tensors (compiler.ir.reference)
            op = self._obj(node.target)
            stub = self._obj(_Node(dict(node.kwargs), dict(node.meta)))
            self.lines.append(f"{var} = {op}.evaluate({stub}, [{', '.join(args)}])")
            if dtype != meta.dtype:
                self.lines.append(f"{var} = {var}.to({self._obj(dtype)})")
        return var

    def _device(self) -> str:
        return f"{self.first_load}.device" if self.first_load else "None"

    def _reduction(self, node, x) -> str:
        dims, keepdim = tuple(node.kwargs["dims"]), node.kwargs["keepdim"]
        count = node.kwargs.get("count")
        if not dims:
            return f"{x}.clone()"
        if count:  # the second stage of a split mean
            return f"(torch.sum({x}, dim={dims!r}, keepdim={keepdim!r}) / {count!r})"
        if node.target.name == "amax" and any(meta_of(node.args[0]).shape[d] == 0 for d in dims):
            # a max over no elements: -inf, as the Triton kernels' (torch.amax raises; logsumexp of an
            # empty row reads it and gives eager's -inf)
            return f"torch.full({tuple(meta_of(node).shape)!r}, float('-inf'), dtype={x}.dtype, device={x}.device)"
        return f"torch.{node.target.name}({x}, dim={dims!r}, keepdim={keepdim!r})"

    def _obj(self, obj) -> str:
        for name, known in self.objects.items():
            if known is obj:
                return name
        name = f"o{len(self.objects)}"
        self.objects[name] = obj
        return name

    # -- a SymPy expression as torch calls -------------------------------------------------
    def _pointwise(self, node, args) -> str:
        binding = {}
        for i, (arg, var) in enumerate(zip(node.args, args)):
            is_complex = isinstance(arg, fx.Node) and meta_of(arg).dtype.is_complex
            binding[Y.operand(i, is_complex)] = var
        return self.printer.pointwise(meta_of(node).expr, binding)


def _order(nodes):
    index = {n: i for i, n in enumerate(nodes)}
    return index.__getitem__


class _ExprPrinter:
    """Prints expressions as the torch calls ``compiler.ir.ops.evaluate`` would make, each distinct
    subexpression once per kernel (a local variable: the nodes of one kernel share them, as the
    Triton kernel's common subexpressions are), numbers of a sum or product folded into one."""

    def __init__(self, writer: _Writer):
        self.writer = writer
        self.cache: dict = {}    # subexpression (over the kernel's variables) -> its variable or literal
        self.names: dict = {}    # variable symbol -> source text

    def pointwise(self, expr, binding: dict) -> str:
        """``expr`` with each operand symbol bound to a variable (``binding``: symbol -> text)."""
        subs = {}
        for symbol, var in binding.items():
            subs[symbol] = self._symbol(var, symbol)
            partner = Y.conj(symbol)
            if partner != symbol and partner.is_Symbol and partner not in binding:
                subs[partner] = self._symbol(f"torch.conj({var})", partner)
        return self.text(sympy.sympify(expr).xreplace(subs))

    def _symbol(self, text: str, like) -> sympy.Symbol:
        # (the operand's own assumptions: SymPy simplifies the rebuilt expression as it did the original)
        symbol = sympy.Symbol(f"_v{text}", **like.assumptions0)
        self.names[symbol] = text
        return symbol

    def text(self, e) -> str:
        cached = self.cache.get(e)
        if cached is not None:
            return cached
        text, info = self._text(e)
        if not (e.is_Symbol or e.is_number):
            var = f"e{len(self.writer.lines)}"
            self.writer.lines.append(f"{var} = {text}")
            text = var
            if info is not None:
                self.writer.types[var] = info
        self.cache[e] = text
        return text

    def _text(self, e) -> tuple:
        """(source text, (dtype, shape) of its value where known)."""
        types = self.writer.types
        if e.is_Symbol:
            if e not in self.names:
                raise KeyError(f"unbound symbol {e}")
            return self.names[e], types.get(self.names[e])
        if e.is_number:
            return _number(_as_number(e)), None
        if e.is_Add or e.is_Mul:
            return self._chain(e)
        if e.is_Pow:
            base = self.text(e.base)
            info = _float_info(types.get(base))
            if e.exp == sympy.Rational(1, 2):
                return (f"torch.sqrt({base})", info) if info else (f"_sqrt({base})", None)
            if e.exp == -1:
                return (f"torch.reciprocal({base})", info) if info else (f"(1 / {base})", None)
            if e.exp == 2 and info:
                return f"torch.square({base})", info
            exp = self.text(e.exp)
            return f"({base} ** {exp})", (info if e.exp.is_number and complex(e.exp).imag == 0 else None)
        primitive = primitives.head(e.func)
        if primitive is None:
            raise NotImplementedError(f"no torch evaluation for {e.func.__name__}")
        args = [self.text(a) for a in e.args]
        infos = [_float_info(types.get(a)) for a in args]
        if all(infos) and primitive.torch_fn is not None and \
                getattr(primitive.torch_eval, "__func__", None) is _BASE_TORCH_EVAL:
            # (tensors in: the torch function itself, without the wrapper's conversions)
            same = len(infos) == 1 and primitive.result in ("same", "float")
            return f"{self.writer._obj(primitive.torch_fn)}({', '.join(args)})", (infos[0] if same else None)
        functions = self.writer.functions
        name = next((n for n, f in functions.items() if f is e.func), None)
        if name is None:
            name = f"f{len(functions)}"
            functions[name] = e.func
        return f"{name}({', '.join(args)})", None

    def _chain(self, e) -> tuple:
        """A sum or product. Where every operand is a tensor of one floating dtype (known), one of
        them of the result's shape: one new tensor, then in-place ops on it (no allocation per term)."""
        add = e.is_Add
        if add:
            constant = sum((_as_number(a) for a in e.args if a.is_number), 0)
            terms = []  # (sign, text)
            for a in e.args:
                if a.is_number:
                    continue
                coefficient, rest = _split_coefficient(a)
                terms.append((-1, self.text(rest)) if coefficient == -1 else (1, self.text(a)))
        else:
            constant, rest = _split_coefficient(e)
            gelu = _gelu_argument(constant, rest)
            if gelu is not None:
                x = self.text(gelu)
                info = _float_info(self.writer.types.get(x))
                if info:  # 0.5·x·(1 + erf(x/√2)): PyTorch's own GELU (one pass, not five ops)
                    return f"torch.nn.functional.gelu({x})", info
            factors = list(rest.args if rest.is_Mul else (rest,))
            if constant == 1 and len(factors) == 2:
                for g, other in (factors, factors[::-1]):
                    x = _gelu_derivative_argument(other)
                    if x is None:
                        continue
                    g, x = self.text(g), self.text(x)
                    gi, xi = _float_info(self.writer.types.get(g)), _float_info(self.writer.types.get(x))
                    if gi and gi == xi:  # g · GELU'(x): eager's own GELU backward (one pass, not ten ops)
                        return f"torch.ops.aten.gelu_backward({g}, {x})", gi
            terms = [(1, self.text(a)) for a in factors]
        infos = [_float_info(self.writer.types.get(t)) for _, t in terms]
        known = all(infos) and len({i[0] for i in infos}) == 1 and constant.imag == 0
        if known:
            shape = tuple(torch.broadcast_shapes(*[i[1] for i in infos]))
            full = next((k for k, i in enumerate(infos) if i[1] == shape), None)
            if len(terms) == 1:  # one op (a Python float and a tensor of dtype D: a tensor of D)
                return self._plain(add, terms, constant), infos[0]
            if full is not None and (not add or any(sign > 0 for sign, _ in terms)):
                return self._in_place(add, terms, full, constant), (infos[0][0], shape)
        return self._plain(add, terms, constant), None

    def _in_place(self, add: bool, terms: list, full: int, constant: complex) -> str:
        first = terms.pop(full)
        if add and first[0] < 0:  # start from a term added: x - y, not -y + x
            k = next(k for k, (sign, _) in enumerate(terms) if sign > 0)
            terms.insert(0, first)
            first = terms.pop(k + 1)
            second = terms.pop(0)
        else:
            second = terms.pop(0)
        if add:
            text = f"torch.{'add' if second[0] > 0 else 'sub'}({first[1]}, {second[1]})"
            for sign, t in terms:
                text += f".{'add_' if sign > 0 else 'sub_'}({t})"
            if constant != 0:
                text += f".add_({_literal(constant.real)})"
            return text
        text = f"torch.mul({first[1]}, {second[1]})"
        for _, t in terms:
            text += f".mul_({t})"
        if constant == -1:
            text += ".neg_()"
        elif constant != 1:
            text += f".mul_({_literal(constant.real)})"
        return text

    def _plain(self, add: bool, terms: list, constant: complex) -> str:
        if add:
            plus = [t for sign, t in terms if sign > 0]
            minus = [t for sign, t in terms if sign < 0]
            if not plus:  # (a tensor first: ``-x`` then the rest)
                plus.append(f"(-{minus.pop(0)})")
            text = " + ".join(plus) + "".join(f" - {m}" for m in minus)
            if constant != 0:
                text += f" + {_number(constant)}"
            return f"({text})"
        factors = [t for _, t in terms]
        if constant == -1:
            return f"(-{' * '.join(factors)})"
        if constant != 1:
            factors.insert(0, _number(constant))
        return f"({' * '.join(factors)})"


_BASE_TORCH_EVAL = primitives.base.Primitive.torch_eval.__func__


def _float_info(info):
    """``info`` when it is a real floating dtype's (dtype, shape), else None."""
    return info if info is not None and info[0].is_floating_point else None


def _gelu_derivative_argument(e):
    """x where ``e`` is GELU'(x) = 0.5 + 0.5·erf(x/√2) + x·exp(-x²/2)/√(2π) (as SymPy writes the
    derivative of the captured GELU), else None."""
    if not e.is_Add or len(e.args) != 3 or sum(1 for a in e.args if a.is_number and complex(a) == 0.5) != 1:
        return None
    from_erf = from_exp = None
    for a in e.args:
        if a.is_number:
            continue
        c, r = _split_coefficient(a)
        if c == 0.5 and r.func is sympy.erf:
            c1, from_erf = _split_coefficient(r.args[0])
            if abs(c1 - 0.5 ** 0.5) > 1e-15:
                return None
        elif abs(c - (2 * math.pi) ** -0.5) < 1e-15 and r.is_Mul and len(r.args) == 2:
            exp = next((f for f in r.args if f.func is sympy.exp), None)
            if exp is None:
                return None
            x = next(f for f in r.args if f is not exp)
            c2, square = _split_coefficient(exp.args[0])
            if c2 != -0.5 or square != x ** 2:
                return None
            from_exp = x
    return from_erf if from_erf is not None and from_erf == from_exp else None


def _gelu_argument(coefficient, rest):
    """x where ``coefficient · rest`` is 0.5·x·(1 + erf(x/√2)) (GELU, as captured), else None."""
    if coefficient != 0.5 or not rest.is_Mul or len(rest.args) != 2:
        return None
    for x, other in (rest.args, reversed(rest.args)):
        if not other.is_Add or len(other.args) != 2 or sympy.Integer(1) not in other.args:
            continue
        erf = next(a for a in other.args if a != 1)
        if erf.func is not sympy.erf:
            continue
        c, inner = _split_coefficient(erf.args[0])
        if inner == x and abs(c - 0.5 ** 0.5) < 1e-15:
            return x
    return None


def _split_coefficient(e):
    """(the product of a product's numbers, as a Python complex, and the rest of it)."""
    if not e.is_Mul:
        return 1, e
    numbers = [a for a in e.args if a.is_number]
    if not numbers:
        return 1, e
    coefficient = 1
    for a in numbers:
        coefficient *= _as_number(a)
    rest = [a for a in e.args if not a.is_number]
    return coefficient, (sympy.Mul(*rest, evaluate=False) if len(rest) > 1 else rest[0])


def _as_number(e):
    """A SymPy number as a Python float where it is real (oo and NaN too), else a complex.
    NOTE: complex arithmetic would turn a real infinity's 0 imaginary part into NaN (a 1 + 0j
    coefficient times inf is inf + nan*j), which a real part taken later carries into the value."""
    if e is sympy.nan or e.is_extended_real:
        return float(e)
    return complex(e)


def _number(value) -> str:
    if not isinstance(value, complex):
        return _literal(float(value))
    if value.imag == 0:
        return _literal(value.real)
    return f"complex({_literal(value.real)}, {_literal(value.imag)})"


def _sqrt(x):
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else x ** 0.5


def _literal(x: float) -> str:
    """A float as Python source (``inf`` and ``nan`` are not literals)."""
    return repr(x) if x == x and abs(x) != float("inf") else f"float({str(x)!r})"
