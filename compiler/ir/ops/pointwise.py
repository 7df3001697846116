"""Pointwise ops: a scalar SymPy expression per op; derivative by SymPy, lowering by the printer."""

from __future__ import annotations

import functools
import math

import sympy
import torch
import torch.fx as fx

from compiler.ir.graph import GraphBuilder, OpKind, arg_symbol, meta_of
from compiler.ir.ops import primitives
from compiler.ir.ops import scalar as S
from compiler.ir.ops import symbols as Y
from compiler.ir.ops.base import OpDef
from compiler.ir.ops.evaluate import evaluate
from compiler.ir.ops.primitives.base import BOOL, FLOAT
from compiler.ir.ops.symbols import conj

GRAD_SYMBOL = Y.GRAD


RESULT_SYMBOL = Y.RESULT


# ----------------------------------------------------------------------------- pointwise
# Every elementwise op the compiler knows, as a function of SymPy scalars. The derivative,
# the kernel code and the broadcasting all follow from this one expression. Each is declared,
# with its dtype kind and bindings, in ``compiler.ir.ops.primitives``.
SCALAR_FUNCTIONS = {name: entry.expression for name, entry in primitives.OPS.items()}

_compare = S.compare

# Ops whose integer inputs give a floating result (sin of an int tensor is float).
FLOAT_RESULT_OPS = primitives.ops_of_kind(FLOAT)


BOOL_RESULT_OPS = primitives.ops_of_kind(BOOL)


class Pointwise(OpDef):
    """A pointwise op: its value is ``meta_of(node).expr`` over the node's tensor arguments."""

    kind = OpKind.POINTWISE

    def evaluate(self, node: fx.Node, args) -> torch.Tensor:
        """The value with PyTorch: the SymPy expression evaluated on the argument tensors."""
        dtype = meta_of(node).dtype
        binding = {Y.operand(i, meta_of(arg).dtype.is_complex): value
                   for i, (arg, value) in enumerate(zip(node.args, args))}
        value = evaluate(meta_of(node).expr, binding)
        value = torch.as_tensor(value, device=args[0].device if args else None)
        if value.is_complex() and not dtype.is_complex:
            value = value.real
        return value.to(dtype).expand(meta_of(node).shape)


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
            if not any_complex and _only_inside_undefined_gradients(expr, i):
                grads.append(UNDEFINED)  # (AbsSlope in a backward: eager's sgn sends nothing)
                continue
            # eager gives zeros, not None, through a differentiable op whose derivative is 0
            # (round, sign, x * 0): the input's .grad is a zero tensor, not missing
            grads.append(emit_fill(b, meta_of(node).shape, dtype, 0))
            continue
        grads.append(derived_pointwise(b, grad_expr, node, grad_out, shape=meta_of(node).shape, dtype=dtype))
    return grads


class _Undefined:
    """A vjp's contribution where eager's backward sends an undefined gradient: nothing flows
    on, but an input reached only so gets zeros (autograd.grad materializes them), not None."""

    def __repr__(self):
        return "UNDEFINED"


UNDEFINED = _Undefined()


@functools.lru_cache(maxsize=4096)
def _only_inside_undefined_gradients(expr: sympy.Expr, index: int) -> bool:
    """Whether argument ``index`` appears in ``expr`` only inside primitives through which
    eager's backward sends no gradient (``gradient_undefined``)."""
    symbol = arg_symbol(index)
    if symbol not in expr.free_symbols:
        return False
    undefined = [f for f in expr.atoms(sympy.Function)
                 if getattr(primitives.head(f.func), "gradient_undefined", False) and symbol in f.free_symbols]
    return bool(undefined) and symbol not in expr.xreplace({f: sympy.Dummy() for f in undefined}).free_symbols


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


def emit_fill(b, shape, dtype, value) -> fx.Node:
    """A constant tensor of ``shape`` (no inputs)."""
    expr = sympy.Float(value) if dtype.is_floating_point or dtype.is_complex else sympy.Integer(int(value))
    return b.call(POINTWISE["fill"], [], shape=shape, dtype=dtype, requires_grad=False, expr=expr)
