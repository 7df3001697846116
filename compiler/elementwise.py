"""User-defined elementwise ops: write the scalar function once, get a fused forward and a
SymPy-derived backward for free.

``compiler.elementwise(fn)`` calls ``fn`` with SymPy symbols to obtain its expression
(built from ``compiler.math`` and arithmetic). The resulting op works on tensors:

* inside compiled functions it is a catalog pointwise op: it broadcasts, fuses with its
  neighbours, and its gradient (Wirtinger for complex inputs) comes from SymPy;
* outside them it runs eagerly as a ``torch.autograd.Function`` whose forward and backward
  evaluate the same expression and its derivatives with PyTorch ops (so double backward
  works wherever the expression is twice differentiable).
"""

from __future__ import annotations

import functools
import inspect

import sympy
import torch
import torch.fx as fx

from compiler.codegen.realify import realify
from compiler.codegen.triton_printer import NotPrintable
from compiler.ir.graph import _promote, meta_of, result_dtype
from compiler.ir.ops import catalog as C
from compiler.ir.ops import primitives
from compiler.ir.ops import symbols as Y
from compiler.capture.bindings import BINDINGS
from compiler.ir.ops.evaluate import evaluate

# The SymPy functions a user's expression may use: the primitives that allow it (``user_op``).
_ALLOWED_FUNCTIONS = {function for function, primitive in primitives.HEADS.items() if primitive.user_op}


def elementwise(fn=None, *, name: str | None = None):
    """Make a tensor op from a scalar function; usable as ``@compiler.elementwise`` too.

    >>> import torch, compiler
    >>> from compiler import math as cm
    >>> @compiler.elementwise(name="squareplus")
    ... def squareplus(x, b=4.0):
    ...     return (x + cm.sqrt(x * x + b)) / 2
    >>> y = squareplus(torch.randn(3, requires_grad=True))   # eager, SymPy backward
    """
    if fn is None:
        return lambda f: elementwise(f, name=name)
    return ElementwiseOp(fn, name)


class ElementwiseOp:
    def __init__(self, fn, name=None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "elementwise")
        self.signature = inspect.signature(fn)
        for p in self.signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"compiler.elementwise({self.name}): *args/**kwargs are not supported; "
                                "name each scalar argument")
        self.op = C.Pointwise(self.name)
        self._expressions: dict = {}
        functools.update_wrapper(self, fn, updated=())
        BINDINGS[self] = self._bind
        self.expression((False,) * len(self.signature.parameters))  # fail now on a bad function

    def __repr__(self):
        return f"<elementwise op {self.name}{self.signature}>"

    # -- the expression ---------------------------------------------------------------------
    def expression(self, complex_args: tuple):
        """The expression over operand symbols (a_i real, z_i/zc_i complex), validated;
        built once per combination of real and complex operands."""
        if complex_args not in self._expressions:
            self._expressions[complex_args] = self._build_expression(complex_args)
        return self._expressions[complex_args]

    def _build_expression(self, complex_args: tuple):
        symbols = [Y.operand(i, c) for i, c in enumerate(complex_args)]
        try:
            expr = self.fn(*symbols)
        except TypeError as e:
            raise ValueError(
                f"compiler.elementwise({self.name}): calling the function with symbolic scalars failed ({e}). "
                "Build it from arithmetic and compiler.math functions (compiler.math.exp, not math.exp "
                "or torch.exp), without Python `if` on the arguments (use compiler.math.where).") from e
        expr = sympy.sympify(expr)
        for f in {type(a) for a in expr.atoms(sympy.Function)} | {a.func for a in expr.atoms(sympy.Function)}:
            if isinstance(f, type) and issubclass(f, sympy.Function) and f not in _ALLOWED_FUNCTIONS:
                raise ValueError(f"compiler.elementwise({self.name}): `{f.__name__}` is not supported in "
                                 f"elementwise expressions; use the functions of compiler.math: "
                                 f"{', '.join(sorted(_public_math()))}")
        if any(complex_args):
            try:
                realify(expr)
            except NotPrintable as e:
                raise ValueError(f"compiler.elementwise({self.name}): {e}") from e
        return expr

    def real_valued(self, complex_args: tuple) -> bool:
        """Whether the result is real although some operand is complex (like |z|²)."""
        return any(complex_args) and realify(self.expression(complex_args))[1] == 0

    def result_dtype(self, kinds, dtype):
        return dtype.to_real() if dtype.is_complex and self.real_valued(kinds) else dtype

    def _operands(self, args, kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return list(bound.arguments.values())

    # -- calls ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        operands = self._operands(args, kwargs)
        tensors = tuple(o for o in operands if isinstance(o, torch.Tensor))
        if not tensors:
            raise TypeError(f"{self.name}() needs at least one tensor argument")
        if torch.overrides.has_torch_function(tensors):  # a compiled function is recording
            return torch.overrides.handle_torch_function(self, tensors, *operands)
        return _EagerElementwise.apply(self, *operands)

    def _bind(self, b, *operands):
        """Inside a compiled function: one catalog pointwise node with this expression."""
        kinds = tuple(_is_complex(o) for o in operands)
        expr = self.expression(kinds)
        tensors, renamed = [], {}
        for i, o in enumerate(operands):
            sym = Y.operand(i, kinds[i])
            if isinstance(o, fx.Node):
                k = len(tensors)
                tensors.append(o)
                renamed[sym] = Y.operand(k, kinds[i])
                if kinds[i]:
                    renamed[Y.CONJ_ARGS[i]] = Y.CONJ_ARGS[k]
            else:
                value = _number(o)
                renamed[sym] = value
                if kinds[i]:
                    renamed[Y.CONJ_ARGS[i]] = sympy.conjugate(value)
        expr = expr.xreplace(renamed)
        dtype = self.result_dtype(kinds, _result_dtype(operands))
        shape = torch.broadcast_shapes(*[meta_of(t).shape for t in tensors])
        requires_grad = (dtype.is_floating_point or dtype.is_complex) and any(meta_of(t).requires_grad for t in tensors)
        return b.call(self.op, tensors, shape=shape, dtype=dtype, requires_grad=requires_grad, expr=expr)


def _is_complex(o) -> bool:
    if isinstance(o, fx.Node):
        return meta_of(o).dtype.is_complex
    if isinstance(o, torch.Tensor):
        return o.is_complex()
    return isinstance(o, complex)


def _number(value):
    if isinstance(value, complex):
        return sympy.Float(value.real, 17) + sympy.I * sympy.Float(value.imag, 17)
    if isinstance(value, bool) or isinstance(value, int):
        return sympy.Integer(int(value))
    if isinstance(value, float):
        return sympy.Float(value, 17)
    raise TypeError(f"elementwise ops take tensors and Python numbers, not {type(value).__name__}")


def _result_dtype(operands):
    dtype = result_dtype(operands)
    if not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    return dtype


def _eager_dtype(operands):
    """Eager PyTorch's type promotion over tensors and Python numbers (ints give floats)."""
    key = tuple((o.dtype, o.dim() == 0) if isinstance(o, torch.Tensor) else o for o in operands)
    dtype = _promote(key)
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()


def _public_math():
    from compiler import scalar_math
    return [n for n in scalar_math.__all__ if n not in ("pi", "e")]


class _EagerElementwise(torch.autograd.Function):
    """Outside compiled functions: PyTorch evaluates the expression and its SymPy derivatives."""

    @staticmethod
    def forward(ctx, op: ElementwiseOp, *operands):
        kinds = tuple(_is_complex(o) for o in operands)
        expr = op.expression(kinds)
        env = {Y.operand(i, c): o for i, (o, c) in enumerate(zip(operands, kinds))}
        tensors = [o for o in operands if isinstance(o, torch.Tensor)]
        shape = torch.broadcast_shapes(*[t.shape for t in tensors])
        dtype = op.result_dtype(kinds, _eager_dtype(operands))
        out = torch.as_tensor(evaluate(expr, env), device=tensors[0].device)
        if out.is_complex() and not dtype.is_complex:
            out = out.real
        out = out.to(dtype).expand(shape).contiguous()
        ctx.op, ctx.kinds = op, kinds
        ctx.scalars = [None if isinstance(o, torch.Tensor) else o for o in operands]
        ctx.save_for_backward(*tensors, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        *tensors, out = ctx.saved_tensors
        it = iter(tensors)
        operands = [next(it) if s is None else s for s in ctx.scalars]
        expr = ctx.op.expression(ctx.kinds)
        out_complex = out.is_complex()
        env = {Y.operand(i, c): o for i, (o, c) in enumerate(zip(operands, ctx.kinds))}
        env[Y.RESULT_Z if out_complex else Y.RESULT] = out
        env[Y.GRAD_Z if out_complex else Y.GRAD] = grad
        grads = [None]
        for i, (o, c) in enumerate(zip(operands, ctx.kinds)):
            if not isinstance(o, torch.Tensor) or not ctx.needs_input_grad[i + 1]:
                grads.append(None)
                continue
            if out_complex or any(ctx.kinds):
                g_expr = C.wirtinger_gradient(expr, i, c, out_complex)
            else:
                g_expr = Y.GRAD * C.partial_derivative(expr, i)
            g = torch.as_tensor(evaluate(g_expr, env), device=o.device)
            if o.is_complex() is False and g.is_complex():
                g = g.real
            g = g.expand(out.shape) if g.dim() < out.dim() or g.shape != out.shape else g
            grads.append(g.sum_to_size(o.shape).to(o.dtype))
        return tuple(grads)
