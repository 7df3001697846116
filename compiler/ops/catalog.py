"""The op catalog: the one place that knows each op.

Four kinds of op, each with everything the stages need next to it:

* ``Pointwise`` — a scalar SymPy expression (``meta_of(node).expr``). Its shape rule is
  broadcasting, its derivative comes from SymPy (``pointwise_vjp``), its lowering is the
  Triton printer. Adding an elementwise op is adding one entry to ``SCALAR_FUNCTIONS``.
* ``Reduction`` — sum and mean over dims: shape rule, VJP (expand back), lowering as a
  fused reduction loop.
* ``View`` — reshape, permute, expand: shape rule, VJP, and an *index map* that says which
  element of the input each output element reads, so views fuse into kernels for free.
* ``Iota``, ``Rand`` — element positions and per-element random numbers, computed inline.
* ``Gather`` — elements picked by an index tensor (gather, index_select, embedding), inline.
* ``Extern`` — matmuls and a gather's scatter-add gradient, run by PyTorch (cuBLAS on GPU);
  hand-written VJPs.

Gradients flow as graph nodes built from these same ops, so backward graphs fuse exactly
like forward graphs (tinygrad's habit). Broadcasting is undone in one place: ``sum_to_shape``.
"""

from __future__ import annotations

import functools
import math

import sympy
import torch
import torch.fx as fx

from compiler.ir import GraphBuilder, arg_symbol, contiguous_strides, meta_of, numel, update_meta
from compiler.ops import scalar as S
from compiler.ops import symbols as Y
from compiler.ops.symbols import conj
from runtime.program import EXTERN_KERNELS

GRAD_SYMBOL = Y.GRAD
RESULT_SYMBOL = Y.RESULT


class OpDef:
    kind = "op"

    def __init__(self, name: str):
        self.name = name
        self.__name__ = name

    def __repr__(self):
        return self.name

    def __call__(self, *args, **kwargs):  # fx wants callable targets; we never call them
        raise RuntimeError(f"catalog op {self.name} is lowered by the compiler, not called")


# ----------------------------------------------------------------------------- pointwise
def _divide(a, b):
    # NOTE: SymPy makes x / 0 the complex infinity (zoo), which no kernel can print; IEEE
    # division by a constant zero is a product with an infinity of the zero's sign (x / 0.0
    # is inf, -inf or NaN, as eager; var() with no degrees of freedom divides by 0.0).
    if getattr(b, "is_number", False) and b.is_zero and b.is_extended_real:
        return a * (sympy.oo if math.copysign(1.0, float(b)) > 0 else -sympy.oo)
    return a / b


# Every elementwise op the compiler knows, as a function of SymPy scalars. The derivative,
# the kernel code and the broadcasting all follow from this one expression.
SCALAR_FUNCTIONS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: _divide(a, b),
    "neg": lambda a: -a,
    "pow": lambda a, b: a**b,
    "exp": sympy.exp,
    "log": sympy.log,
    "sqrt": sympy.sqrt,
    "rsqrt": lambda a: 1 / sympy.sqrt(a),
    "reciprocal": lambda a: 1 / a,
    "square": lambda a: a * a,
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tanh": sympy.tanh,
    "sigmoid": S.Sigmoid,
    "relu": S.Relu,
    "gelu": lambda a: a * (1 + sympy.erf(a / sympy.sqrt(2))) / 2,
    "gelu_tanh": lambda a: a * (1 + sympy.tanh(sympy.sqrt(2 / sympy.pi) * (a + sympy.Float("0.044715") * a**3))) / 2,
    "silu": lambda a: a * S.Sigmoid(a),
    "abs": lambda a: S.CAbs(a, conj(a)) if Y.is_complex_symbol(a) else S.Abs(a),
    "conj": conj,
    "real": lambda a: (a + conj(a)) / 2 if Y.is_complex_symbol(a) else a,
    "imag": lambda a: (a - conj(a)) / (2 * sympy.I),
    "angle": lambda a: S.CAngle(a, conj(a)) if Y.is_complex_symbol(a) else S.RealAngle(a),
    "complex": lambda re, im: re + sympy.I * im,
    "polar": lambda r, theta: r * (sympy.cos(theta) + sympy.I * sympy.sin(theta)),
    "tan": sympy.tan,
    "asin": sympy.asin,
    "acos": sympy.acos,
    "atan": sympy.atan,
    "sinh": sympy.sinh,
    "cosh": sympy.cosh,
    "asinh": sympy.asinh,
    "acosh": sympy.acosh,
    "atanh": sympy.atanh,
    "log1p": S.Log1p,
    "expm1": S.Expm1,
    "log2": lambda a: sympy.log(a) / sympy.log(2),
    "log10": lambda a: sympy.log(a) / sympy.log(10),
    "exp2": lambda a: sympy.exp(a * sympy.log(2)),
    "erf": sympy.erf,
    "erfc": sympy.erfc,
    "sign": S.Sign,
    "floor": S.Floor,
    "ceil": S.Ceil,
    "round": S.Round,
    "trunc": S.Trunc,
    "frac": lambda a: a - S.Trunc(a),
    # activations; where a boundary belongs matters, it is eager's backward's choice
    "softplus": lambda x, beta, threshold: S.Where(_compare("gt", x * beta, threshold), x,
                                                   S.Log1p(sympy.exp(beta * x)) / beta),
    "leaky_relu": lambda x, slope: S.Where(_compare("gt", x, 0), x, slope * x),
    "elu": lambda x, alpha, scale, input_scale: S.Where(_compare("gt", x, 0), scale * x,
                                                        scale * alpha * S.Expm1(input_scale * x)),
    "hardtanh": lambda x, lo, hi: S.Where(_compare("le", x, lo), lo, S.Where(_compare("ge", x, hi), hi, x)),
    "hardsigmoid": lambda x: S.Where(_compare("le", x, -3), 0,
                                     S.Where(_compare("ge", x, 3), 1, x / 6 + sympy.Rational(1, 2))),
    "hardswish": lambda x: S.Where(_compare("lt", x, -3), 0, S.Where(_compare("le", x, 3), x * (x + 3) / 6, x)),
    "mish": lambda x: x * sympy.tanh(S.Log1p(sympy.exp(x))),
    "logsigmoid": lambda x: S.Minimum(x, 0) - S.Log1p(sympy.exp(-S.Abs(x))),
    "softsign": lambda x: x / (1 + S.Abs(x)),
    "atan2": sympy.atan2,
    "hypot": lambda a, b: sympy.sqrt(a * a + b * b),
    "logaddexp": lambda a, b: S.Maximum(a, b) + S.Log1p(sympy.exp(-S.Abs(a - b))),
    "xlogy": lambda a, b: S.Where(_compare("eq", a, 0), 0, a * sympy.log(b)),
    "lerp": lambda start, end, weight: start + weight * (end - start),
    "addcmul": lambda x, t1, t2, value: x + value * t1 * t2,
    "addcdiv": lambda x, t1, t2, value: x + value * t1 / t2,
    "norm_sqrt": S.NormSqrt,
    "smooth_l1": lambda d, beta: S.Where(_compare("lt", S.Abs(d), beta), d * d / (2 * beta), S.Abs(d) - beta / 2),
    "huber": lambda d, delta: S.Where(_compare("le", S.Abs(d), delta), d * d / 2, delta * (S.Abs(d) - delta / 2)),
    "bce_with_logits": lambda x, t, pos_weight: (1 - t) * x + (1 + (pos_weight - 1) * t) * (
        S.Log1p(sympy.exp(-S.Abs(x))) + S.Maximum(-x, 0)),
    "kl_div": lambda x, t: S.Where(_compare("eq", t, 0), 0, t * sympy.log(t)) - t * x,  # xlogy(t, t) - t x
    "kl_div_log_target": lambda x, t: sympy.exp(t) * (t - x),
    "maximum": S.Maximum,
    "minimum": S.Minimum,
    "where": S.Where,
    # clamp: boundaries included in the pass-through region, as eager's backward does
    "clamp": lambda x, lo, hi: S.Where(_compare("lt", x, lo), lo, S.Where(_compare("gt", x, hi), hi, x)),
    "clamp_min": lambda x, lo: S.Where(_compare("lt", x, lo), lo, x),
    "clamp_max": lambda x, hi: S.Where(_compare("gt", x, hi), hi, x),
    # logic on booleans (any nonzero value is true, as in torch.logical_*)
    "logical_not": lambda a: _compare("eq", a, 0),
    # (the outer comparison keeps the result a boolean when it is inlined into a condition)
    "logical_and": lambda a, b: _compare("ne", S.Where(_compare("ne", a, 0), b, 0), 0),
    "logical_or": lambda a, b: _compare("ne", S.Where(_compare("ne", a, 0), 1, b), 0),
    "logical_xor": lambda a, b: _compare("ne", _compare("ne", a, 0), _compare("ne", b, 0)),
    "identity": lambda a: a,  # dtype conversion: the node's dtype says what to convert to
    "fill": lambda value: value,  # zeros_like & co: a constant over the node's shape
}
for _i, _cmp in enumerate(S.COMPARE_OPS):
    SCALAR_FUNCTIONS[_cmp] = functools.partial(lambda i, a, b: S.Compare(sympy.Integer(i), a, b), _i)

def _compare(name, a, b):
    return S.Compare(sympy.Integer(S.COMPARE_OPS.index(name)), a, b)


# Ops whose integer inputs give a floating result (sin of an int tensor is float).
FLOAT_RESULT_OPS = {"exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
                    "gelu", "gelu_tanh", "silu", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
                    "atanh", "log1p", "expm1", "log2", "log10", "exp2", "erf", "erfc", "atan2", "hypot",
                    "logaddexp", "xlogy", "norm_sqrt"}
BOOL_RESULT_OPS = set(S.COMPARE_OPS) | {"logical_not", "logical_and", "logical_or", "logical_xor"}


class Pointwise(OpDef):
    kind = "pointwise"


POINTWISE = {name: Pointwise(name) for name in SCALAR_FUNCTIONS}
DERIVED = Pointwise("pointwise")  # nodes made by differentiation: the expression says it all


def scalar_expr(name: str, operands) -> tuple[sympy.Expr, list]:
    """The expression of op ``name`` over ``operands`` (nodes or Python scalars).

    Returns the expression over a0..a{k-1} and the k tensor operands it refers to; Python
    scalars become numbers inside the expression.
    """
    tensors, symbols = [], []
    for item in operands:
        if isinstance(item, fx.Node):
            symbols.append(Y.operand(len(tensors), meta_of(item).dtype.is_complex))
            tensors.append(item)
        elif isinstance(item, complex):
            symbols.append(_float(item.real) + sympy.I * _float(item.imag))
        elif isinstance(item, bool):
            symbols.append(sympy.Integer(int(item)))
        elif isinstance(item, int):
            symbols.append(sympy.Integer(item))
        elif isinstance(item, float):
            symbols.append(_float(item))
        else:
            raise TypeError(f"unsupported scalar operand {item!r}")
    return SCALAR_FUNCTIONS[name](*symbols), tensors


def _float(value: float) -> sympy.Expr:
    if math.isinf(value):
        return sympy.oo if value > 0 else -sympy.oo
    if math.isnan(value):
        return sympy.nan
    if value == int(value) and abs(value) < 2**53:
        return sympy.Float(value)  # keep it a float: 2.0 must print as a float literal
    return sympy.Float(value, 17)


@functools.lru_cache(maxsize=16384)
def partial_derivative(expr: sympy.Expr, index: int) -> sympy.Expr:
    """d expr / d a_index (a real argument), with the result replaced by ``y`` where it appears.

    NOTE: rules follow PyTorch's conventions through the functions in ``scalar.py``; the
    result is reused where PyTorch reuses it (exp' = y, sigmoid' = y(1-y), tanh' = 1-y²).
    Cached: the same op signature is differentiated once per process.
    """
    return _reuse_result(sympy.diff(expr, arg_symbol(index)), expr, False)


@functools.lru_cache(maxsize=16384)
def wirtinger_gradient(expr: sympy.Expr, index: int, arg_complex: bool, out_complex: bool) -> sympy.Expr:
    """The gradient reaching argument ``index`` of a pointwise op with a complex side.

    NOTE: the autograd notes, "Autograd for Complex Numbers", equation (4):
        grad_in = conj(grad_out) · ∂s/∂z̄ + grad_out · conj(∂s/∂z)
    with z and z̄ independent symbols. A real output has a real grad_out (the C→R case,
    2·grad_out·∂s/∂z̄, follows); a real input keeps the real part of its gradient.
    """
    g = Y.GRAD_Z if out_complex else Y.GRAD
    gc = Y.GRAD_ZC if out_complex else Y.GRAD
    if arg_complex:
        ds_dz = sympy.diff(expr, Y.COMPLEX_ARGS[index])
        ds_dzc = sympy.diff(expr, Y.CONJ_ARGS[index])
        grad = gc * ds_dzc + g * conj(ds_dz)
    else:
        grad = g * conj(sympy.diff(expr, Y.REAL_ARGS[index]))
        if out_complex or Y.has_complex(grad):
            grad = (grad + conj(grad)) / 2  # a real input keeps the real part
    return _reuse_result(grad, expr, out_complex)


def masked_product(g, derivative):
    """``g * derivative`` where every 0/1 mask in the derivative selects instead of multiplying.

    NOTE: eager's backward of relu, clamp, maximum and where *selects* (threshold_backward,
    ``where(mask, grad, 0)``): a NaN or inf gradient arriving where the mask is 0 gives 0, not
    NaN = inf·0 as a product would (a fully masked softmax row's NaN, kept out by a where,
    must not reach the parameters). So the masks become Where and ``g`` moves into the
    branches, where SymPy's g·0 = 0 is exactly eager's answer.
    """
    if not derivative.has(S.Step, S.TieShare, S.Where):
        return g * derivative
    derivative = derivative.replace(
        S.Step, lambda x: S.Where(_compare("le", x, 0), sympy.Integer(0), sympy.Integer(1)))
    derivative = derivative.replace(S.TieShare, lambda a, b: S.Where(
        _compare("eq", a, b), sympy.Rational(1, 2), S.Where(_compare("lt", a, b), sympy.Integer(0), sympy.Integer(1))))
    return _into_branches(g, derivative)


def _into_branches(g, d):
    if isinstance(d, S.Where):
        cond, a, b = d.args
        return S.Where(cond, _into_branches(g, a), _into_branches(g, b))
    if d.is_Add:
        return sympy.Add(*[_into_branches(g, term) for term in d.args])
    if d.is_Mul:
        masks = [f for f in d.args if isinstance(f, S.Where)]
        if masks:
            cond, a, b = masks[0].args
            rest = sympy.Mul(*[f for f in d.args if f is not masks[0]])
            return S.Where(cond, _into_branches(g, rest * a), _into_branches(g, rest * b))
    return g * d


def _reuse_result(derivative, expr, out_complex):
    if isinstance(expr, sympy.Symbol):
        return derivative
    if out_complex:
        return derivative.xreplace({expr: Y.RESULT_Z, conj(expr): Y.RESULT_ZC})
    return derivative.xreplace({expr: Y.RESULT})


def pointwise_vjp(b: GraphBuilder, node: fx.Node, grad_out: fx.Node):
    """Gradients of a pointwise node, in the node's shape (None where there is none).

    Real ops: grad_in_i = grad_out * d expr / d a_i. With a complex input or output, the
    Wirtinger form of ``wirtinger_gradient``.
    """
    expr = meta_of(node).expr
    out_complex = meta_of(node).dtype.is_complex
    any_complex = out_complex or any(meta_of(a).dtype.is_complex for a in node.args)
    grads = []
    for i, arg in enumerate(node.args):
        dtype = meta_of(arg).dtype
        if not meta_of(arg).requires_grad or not (dtype.is_floating_point or dtype.is_complex):
            grads.append(None)
            continue
        if any_complex:
            grad_expr = wirtinger_gradient(expr, i, dtype.is_complex, out_complex)
        else:
            derivative = partial_derivative(expr, i)
            if derivative == 1 and meta_of(grad_out).dtype == dtype:
                grads.append(grad_out)  # add, sub, identity: the gradient passes through
                continue
            grad_expr = masked_product(GRAD_SYMBOL, derivative)
        if grad_expr == 0:
            # eager gives zeros, not None, through a differentiable op whose derivative is 0
            # (round, sign, x * 0): the input's .grad is a zero tensor, not missing
            grads.append(emit_fill(b, meta_of(node).shape, dtype, 0))
            continue
        grads.append(derived_pointwise(b, grad_expr, node, grad_out, shape=meta_of(node).shape, dtype=dtype))
    return grads


def derived_pointwise(b: GraphBuilder, expr, node, grad_out, *, shape, dtype) -> fx.Node:
    """A pointwise node computing ``expr``, whose symbols stand for ``node``'s arguments,
    ``node`` itself (the result) and ``grad_out``; renumbered over the nodes it uses."""
    def bound(symbol):
        kind, index, _ = Y.role(symbol)
        return grad_out if kind == "grad" else node if kind == "result" else node.args[index]

    used = sorted(expr.free_symbols, key=lambda s: s.name)
    args: list = []
    for s in used:
        if bound(s) not in args:
            args.append(bound(s))
    renamed = {}
    for s in used:
        target = bound(s)
        k = args.index(target)
        if meta_of(target).dtype.is_complex:
            renamed[s] = Y.CONJ_ARGS[k] if Y.role(s)[2] else Y.COMPLEX_ARGS[k]
        else:
            renamed[s] = Y.REAL_ARGS[k]
    return b.call(DERIVED, args, shape=shape, dtype=dtype, requires_grad=False, expr=expr.xreplace(renamed))


def emit_pointwise(b: GraphBuilder, name: str, operands, *, dtype, requires_grad=None) -> fx.Node:
    """Append the catalog op ``name`` applied to ``operands`` (nodes and Python scalars)."""
    expr, tensors = scalar_expr(name, operands)
    shape = torch.broadcast_shapes(*[meta_of(t).shape for t in tensors]) if tensors else ()
    if requires_grad is None:
        requires_grad = name not in BOOL_RESULT_OPS and any(meta_of(t).requires_grad for t in tensors)
    return b.call(POINTWISE[name], tensors, shape=shape, dtype=dtype, requires_grad=requires_grad, expr=expr)


# ----------------------------------------------------------------------------- reductions
class Reduction(OpDef):
    """sum / mean / amax over ``dims`` (a sorted tuple); ``keepdim`` as in PyTorch."""

    kind = "reduction"

    def out_shape(self, in_shape, dims, keepdim):
        if keepdim:
            return tuple(1 if d in dims else s for d, s in enumerate(in_shape))
        return tuple(s for d, s in enumerate(in_shape) if d not in dims)

    def scale(self, node: fx.Node) -> float:
        if self.name != "mean":
            return 1.0
        shape = meta_of(node.args[0]).shape
        count = node.kwargs.get("count") or numel([shape[d] for d in node.kwargs["dims"]])
        return 1.0 / count if count else math.nan

    def vjp(self, b, node, grad_out):
        (x,) = node.args
        dims, keepdim = node.kwargs["dims"], node.kwargs["keepdim"]
        in_shape = meta_of(x).shape
        g = grad_out
        kept = self.out_shape(in_shape, dims, True)
        if not keepdim:
            g = emit_view(b, "reshape", g, shape=kept)
        g = emit_view(b, "expand", g, shape=in_shape)
        if self.name == "mean":
            g = emit_pointwise(b, "mul", [g, self.scale(node)], dtype=meta_of(x).dtype, requires_grad=False)
        if self.name == "amax":
            # eager's amax backward: the gradient is shared evenly among the maximal elements
            dtype = meta_of(x).dtype
            m = emit_view(b, "expand", emit_view(b, "reshape", node, shape=kept), shape=in_shape)
            hit = emit_pointwise(b, "identity", [emit_pointwise(b, "eq", [x, m], dtype=torch.bool)],
                                 dtype=dtype, requires_grad=False)
            count = emit_view(b, "expand", emit_reduction(b, "sum", hit, dims, keepdim=True), shape=in_shape)
            g = emit_pointwise(b, "div", [emit_pointwise(b, "mul", [g, hit], dtype=dtype, requires_grad=False),
                                          count], dtype=dtype, requires_grad=False)
        return [g]


REDUCTIONS = {name: Reduction(name) for name in ("sum", "mean", "amax")}


def emit_reduction(b, name, x, dims, keepdim=False, dtype=None) -> fx.Node:
    ndim = len(meta_of(x).shape)
    if ndim == 0:
        # NOTE: reducing a 0-dim tensor (x.sum(), x.amax() of a scalar) reduces nothing: the
        # value itself, in the result dtype (a reduction over no dims has no iteration space).
        return emit_pointwise(b, "identity", [x], dtype=dtype or meta_of(x).dtype,
                              requires_grad=meta_of(x).requires_grad)
    dims = tuple(sorted({d % ndim for d in dims}))
    op = REDUCTIONS[name]
    return b.call(op, [x], {"dims": dims, "keepdim": keepdim},
                  shape=op.out_shape(meta_of(x).shape, dims, keepdim),
                  dtype=dtype or meta_of(x).dtype, requires_grad=meta_of(x).requires_grad)


def sum_to_shape(b: GraphBuilder, g: fx.Node, shape) -> fx.Node:
    """Undo broadcasting: sum ``g`` down to ``shape``. The only place this is done."""
    shape = tuple(shape)
    g_shape = meta_of(g).shape
    if g_shape == shape:
        return g
    lead = len(g_shape) - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g_shape[lead + i] != 1)
    if dims:
        g = emit_reduction(b, "sum", g, dims, keepdim=True)
    if meta_of(g).shape != shape:
        g = emit_view(b, "reshape", g, shape=shape)
    return g


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
            return [sum_to_shape(b, grad_out, meta_of(x).shape)]
        if self.name == "slice":  # the gradient goes back to the sliced positions, 0 elsewhere
            zeros = emit_fill(b, meta_of(x).shape, meta_of(grad_out).dtype, 0)
            return [emit_slice_scatter(b, zeros, grad_out, **node.kwargs)]
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
                placed = emit_slice_scatter(b, zeros, part, d, k, step, count)
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


def emit_fill(b, shape, dtype, value) -> fx.Node:
    """A constant tensor of ``shape`` (no inputs)."""
    expr = sympy.Float(value) if dtype.is_floating_point or dtype.is_complex else sympy.Integer(int(value))
    return b.call(POINTWISE["fill"], [], shape=shape, dtype=dtype, requires_grad=False, expr=expr)


class Iota(OpDef):
    """The position along ``dim`` of each element of ``shape`` (an index-valued constant):
    with a comparison it builds one-hot masks, as cross-entropy's target selection needs."""

    kind = "iota"


IOTA = Iota("iota")


def emit_iota(b, shape, dim, dtype=torch.int64) -> fx.Node:
    return b.call(IOTA, [], {"dim": dim}, shape=shape, dtype=dtype, requires_grad=False)


class Rand(OpDef):
    """Uniform random numbers in [0, 1) over ``shape``: element i is Philox(seed, i), with i
    the element's position in ``shape`` (row-major). ``seed`` is a region input drawn from
    torch's generator on every call, so the numbers change per call and follow
    ``torch.manual_seed``; a backward that needs them computes them again from the seed
    instead of saving a mask (dropout's backward reads no mask from memory)."""

    kind = "rand"


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

    kind = "gather"

    def vjp(self, b, node, grad_out):
        source, index = node.args
        if not meta_of(source).requires_grad:
            return [None, None]
        p = node.kwargs
        if _picks_one_per_line(node):
            return [_one_hot_gradient(b, node, grad_out), None]
        return [b.call(EXTERNS["index_backward"], [grad_out, index],
                       {"mode": p["mode"], "dim": p["dim"], "shape": meta_of(source).shape,
                        "padding_idx": p.get("padding_idx"), "wrap": p.get("wrap", False)},
                       shape=meta_of(source).shape, dtype=meta_of(grad_out).dtype,
                       requires_grad=meta_of(grad_out).requires_grad), None]

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
    hit = emit_pointwise(b, "eq", [positions, emit_view(b, "expand", index, shape=shape)], dtype=torch.bool)
    spread = emit_view(b, "expand", grad_out, shape=shape)
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

    kind = "scatter"

    def vjp(self, b, node, grad_out):
        base, src = node.args
        params = node.kwargs
        g_base = g_src = None
        if meta_of(base).requires_grad:
            zeros = emit_fill(b, meta_of(src).shape, meta_of(grad_out).dtype, 0)
            g_base = emit_slice_scatter(b, grad_out, zeros, **params)
        if meta_of(src).requires_grad:
            g_src = emit_slice(b, grad_out, **params)
        return [g_base, g_src]


SLICE_SCATTER = SliceScatter("slice_scatter")


def emit_slice_scatter(b, base, src, dim, start, step, length) -> fx.Node:
    return b.call(SLICE_SCATTER, [base, src], {"dim": dim, "start": start, "step": step, "length": length},
                  shape=meta_of(base).shape, dtype=meta_of(base).dtype,
                  requires_grad=meta_of(base).requires_grad or meta_of(src).requires_grad)


# ----------------------------------------------------------------------------- extern
class Extern(OpDef):
    """An op whose kernel is PyTorch's (``runtime.program.EXTERN_KERNELS``): a hand-written
    VJP here, a call at run time. Its result is always a buffer; fusion works around it."""

    kind = "extern"

    def __init__(self, name):
        super().__init__(name)
        self.torch_fn = EXTERN_KERNELS[name]


class MatMul(Extern):
    """mm and bmm (cuBLAS on GPU)."""

    def vjp(self, b, node, grad_out):
        return _matmul_grads(b, self.name, *node.args, grad_out)


def _matmul_grads(b, name, a, w, grad_out):
    """grad_a = g @ w^H, grad_w = a^H @ g (the conjugate transpose; a plain one if real)."""
    t = (1, 0) if name == "mm" else (0, 2, 1)

    def adjoint(x):
        x = emit_view(b, "permute", x, dims=t)
        if meta_of(x).dtype.is_complex:
            x = emit_pointwise(b, "conj", [x], dtype=meta_of(x).dtype, requires_grad=False)
        return x
    ga = gw = None
    if meta_of(a).requires_grad:
        ga = emit_extern(b, name, grad_out, adjoint(w))
    if meta_of(w).requires_grad:
        gw = emit_extern(b, name, adjoint(a), grad_out)
    return [ga, gw]


class AddMM(Extern):
    """bias + a @ w in one call: a linear's bias added in the matmul's epilogue (cuBLAS)
    rather than by a pass of its own over the product. Gradients: mm's for a and w; the
    bias's is grad_out, summed over the rows it was broadcast to (``sum_to_shape``)."""

    def vjp(self, b, node, grad_out):
        bias, a, w = node.args
        return [grad_out] + _matmul_grads(b, "mm", a, w, grad_out)


class IndexBackward(Extern):
    """The scatter-add of a gather's gradient (``runtime.program._index_backward``). Linear in
    the gradient: its own VJP gathers again, with the same index (double backward)."""

    def vjp(self, b, node, grad_out):
        grad, index = node.args
        if not meta_of(grad).requires_grad:
            return [None, None]
        p = node.kwargs
        return [emit_gather(b, grad_out, index, p["mode"], p["dim"], p.get("padding_idx"), zero_padding=True,
                            wrap=p.get("wrap", False)), None]


class Convolution(Extern):
    """conv1d/2d/3d without bias (cuDNN on GPU); gradients through PyTorch's
    convolution_backward, one extern per gradient that is needed."""

    def vjp(self, b, node, grad_out):
        x, w = node.args
        grads = []
        for which, source in (("input", x), ("weight", w)):
            if not meta_of(source).requires_grad:
                grads.append(None)
                continue
            grads.append(b.call(EXTERNS["conv_backward"], [grad_out, x, w], {"which": which, **node.kwargs},
                                shape=meta_of(source).shape, dtype=meta_of(grad_out).dtype,
                                requires_grad=meta_of(grad_out).requires_grad))
        return grads


class ConvolutionBackward(Extern):
    def vjp(self, b, node, grad_out):
        raise NotImplementedError("double backward through a convolution is not supported yet "
                                  "(create_graph=True through conv1d/conv2d/conv3d)")


EXTERNS = {"mm": MatMul("mm"), "bmm": MatMul("bmm"), "addmm": AddMM("addmm"),
           "index_backward": IndexBackward("index_backward"),
           "conv": Convolution("conv"), "conv_backward": ConvolutionBackward("conv_backward")}


def emit_conv(b, x, w, shape, stride, padding, dilation, groups) -> fx.Node:
    return b.call(EXTERNS["conv"], [x, w], {"stride": stride, "padding": padding, "dilation": dilation,
                                            "groups": groups},
                  shape=shape, dtype=meta_of(x).dtype, requires_grad=meta_of(x).requires_grad or meta_of(w).requires_grad)


def emit_extern(b, name, a, w) -> fx.Node:
    sa, sw = meta_of(a).shape, meta_of(w).shape
    shape = (sa[0], sw[1]) if name == "mm" else (sa[0], sa[1], sw[2])
    dtype = torch.promote_types(meta_of(a).dtype, meta_of(w).dtype)
    return b.call(EXTERNS[name], [a, w], shape=shape, dtype=dtype,
                  requires_grad=meta_of(a).requires_grad or meta_of(w).requires_grad)


def emit_addmm(b, bias, a, w) -> fx.Node:
    """bias + a @ w for 2-D ``a`` and ``w`` and a bias that broadcasts to the product."""
    return b.call(EXTERNS["addmm"], [bias, a, w], shape=(meta_of(a).shape[0], meta_of(w).shape[1]),
                  dtype=torch.promote_types(meta_of(a).dtype, meta_of(w).dtype),
                  requires_grad=any(meta_of(x).requires_grad for x in (bias, a, w)))


def vjp(b: GraphBuilder, node: fx.Node, grad_out: fx.Node):
    """Gradient contributions for each tensor argument of ``node`` (None: no gradient)."""
    if node.target.kind == "pointwise":
        return pointwise_vjp(b, node, grad_out)
    return node.target.vjp(b, node, grad_out)
