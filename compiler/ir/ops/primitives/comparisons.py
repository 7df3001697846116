"""Comparisons, selection and logic: Compare, Where, Maximum, Minimum (and TieShare, their
derivative), the comparison and logical ops, and clamp.

NOTE: the autograd notes, "Gradients for non-differentiable functions": maximum/minimum split
the gradient evenly between equal inputs; clamp's boundaries pass the gradient through.
"""

from __future__ import annotations

import functools

import sympy
import torch

from compiler.ir.ops.primitives.base import BOOL, NotPrintable, Primitive, as_tensor, composite, is_number

COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
_TRITON_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_TORCH_COMPARE = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}


def compare(name, a, b):
    """The comparison ``a <name> b`` (name in COMPARE_OPS) as an expression."""
    return Compare(sympy.Integer(COMPARE_OPS.index(name)), a, b)


class Compare(Primitive, sympy.Function):
    """a <op> b for op in (lt, le, gt, ge, eq, ne), as a boolean; not differentiable.

    SymPy's own relationals would evaluate `x < x` to False and cannot be differentiated;
    this keeps the comparison opaque until it is printed.
    """

    nargs = 3  # (op code, a, b); the op code is an Integer index into COMPARE_OPS

    def fdiff(self, argindex=1):
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        op = _TRITON_COMPARE[COMPARE_OPS[int(e.args[0])]]
        return f"({printer.p(e.args[1])} {op} {printer.p(e.args[2])})"

    @classmethod
    def render_cpp(cls, printer, e):   # (C++ compares as Triton does)
        return cls.render(printer, e)

    @classmethod
    def torch_eval(cls, code, a, b):
        return _TORCH_COMPARE[COMPARE_OPS[int(code)]](as_tensor(a), b)


class Where(Primitive, sympy.Function):
    """cond ? a : b. The condition gets no gradient; each branch gets it where chosen."""

    nargs = 3
    op = "where"

    def fdiff(self, argindex=1):
        cond = self.args[0]
        if argindex == 2:
            return Where(cond, sympy.Integer(1), sympy.Integer(0))
        if argindex == 3:
            return Where(cond, sympy.Integer(0), sympy.Integer(1))
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        a, b = printer.p(e.args[1]), printer.p(e.args[2])
        if e.args[1].is_number and e.args[2].is_number:
            a, b = printer.whole(a), printer.whole(b)
        return f"tl.where({printer.p(e.args[0])}, {a}, {b})"

    @classmethod
    def render_cpp(cls, printer, e):
        return printer.where(printer.p(e.args[0]), printer.p(e.args[1]), printer.p(e.args[2]))

    @classmethod
    def torch_eval(cls, cond, a, b):
        return torch.where(as_tensor(cond), a, b)

    @classmethod
    def re_im(cls, cx, cond, a, b):  # a real condition choosing between complex values
        cond = cx(cond)
        if cond[1] != 0:
            raise NotPrintable("a complex condition")
        (ar, ai), (br, bi) = cx(a), cx(b)
        return (Where(cond[0], ar, br), Where(cond[0], ai, bi) if (ai != 0 or bi != 0) else sympy.Integer(0))


class Maximum(Primitive, sympy.Function):
    """Elementwise max that propagates NaN; equal inputs share the gradient evenly."""

    nargs = 2
    op, binds, complex_inputs, math = "maximum", ("maximum",), True, True
    torch_fn = torch.maximum

    def fdiff(self, argindex=1):
        a, b = self.args
        return TieShare(a, b) if argindex == 1 else TieShare(b, a)

    @classmethod
    def render(cls, printer, e):
        return _nan_propagating(printer, e, ">")

    @classmethod
    def render_cpp(cls, printer, e):
        return _nan_propagating_cpp(printer, e, ">")


class Minimum(Primitive, sympy.Function):
    """Elementwise min that propagates NaN; equal inputs share the gradient evenly."""

    nargs = 2
    op, binds, complex_inputs, math = "minimum", ("minimum",), True, True
    torch_fn = torch.minimum

    def fdiff(self, argindex=1):
        a, b = self.args
        return TieShare(b, a) if argindex == 1 else TieShare(a, b)

    @classmethod
    def render(cls, printer, e):
        return _nan_propagating(printer, e, "<")

    @classmethod
    def render_cpp(cls, printer, e):
        return _nan_propagating_cpp(printer, e, "<")


def _nan_propagating(printer, e, op):
    a, b = printer.p(e.args[0]), printer.p(e.args[1])
    # nested wheres, not `(a > b) | (a != a)`: the interpreter cannot `|` a 0-dim
    # operand's scalar comparison with a block (TypeError from numpy's bitwise_or)
    return f"tl.where({a} != {a}, {a}, tl.where({a} {op} {b}, {a}, {b}))"


def _nan_propagating_cpp(printer, e, op):
    """NaN wins, as torch.maximum/minimum: the printer's own (at::vec's propagate NaN too)."""
    return printer.extremum(printer.p(e.args[0]), printer.p(e.args[1]), op)


class TieShare(Primitive, sympy.Function):
    """1/2 where a == b, 0 where a < b, else 1 (NaN included): the share of the gradient
    that reaches a of maximum(a, b), as eager's maximum/minimum backward computes it."""

    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if is_number(a, b) and a.is_real and b.is_real:
            return sympy.Rational(1, 2) if a == b else sympy.Integer(0 if a < b else 1)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        a, b = printer.p(e.args[0]), printer.p(e.args[1])
        c = printer.whole
        return f"tl.where({a} == {b}, {c('0.5')}, tl.where({a} < {b}, {c('0.0')}, {c('1.0')}))"

    @classmethod
    def render_cpp(cls, printer, e):
        a, b = printer.p(e.args[0]), printer.p(e.args[1])
        half, zero, one = (printer.literal(sympy.Float(v)) for v in (0.5, 0.0, 1.0))
        return printer.where(f"{a} == {b}", half, printer.where(f"{a} < {b}", zero, one))

    @classmethod
    def torch_eval(cls, a, b):
        a, b = as_tensor(a), as_tensor(b)
        return torch.where(a == b, 0.5, torch.where(a < b, 0.0, 1.0)).to(torch.result_type(a, b))


# ----------------------------------------------------------------------------- named ops
for _code, _name in enumerate(COMPARE_OPS):
    composite(_name, functools.partial(lambda i, a, b: Compare(sympy.Integer(i), a, b), _code),
              result=BOOL, binds=(_name, f"__{_name}__"), complex_inputs=True)

# logic on booleans (any nonzero value is true, as in torch.logical_*)
composite("logical_not", lambda a: compare("eq", a, 0), result=BOOL, binds=("logical_not",), complex_inputs=True)
# (the outer comparison keeps the result a boolean when it is inlined into a condition)
composite("logical_and", lambda a, b: compare("ne", Where(compare("ne", a, 0), b, 0), 0),
          result=BOOL, binds=("logical_and",), complex_inputs=True)
composite("logical_or", lambda a, b: compare("ne", Where(compare("ne", a, 0), 1, b), 0),
          result=BOOL, binds=("logical_or",), complex_inputs=True)
composite("logical_xor", lambda a, b: compare("ne", compare("ne", a, 0), compare("ne", b, 0)),
          result=BOOL, binds=("logical_xor",), complex_inputs=True)

class Passed(Primitive, sympy.Function):
    """``x`` itself, its derivative 1 where ``cond`` holds and 0 elsewhere: clamp's value between its
    bounds. Eager's backward passes the gradient only where lo <= x <= hi (``where(self >= min &
    self <= max, grad, 0)``): a NaN gets none, though the value NaN is x's own."""

    nargs = 2

    def fdiff(self, argindex=1):
        return Where(self.args[1], sympy.Integer(1), sympy.Integer(0)) if argindex == 1 else sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        return f"({printer.p(e.args[0])})"

    @classmethod
    def render_cpp(cls, printer, e):
        return f"({printer.p(e.args[0])})"

    @classmethod
    def torch_eval(cls, x, cond):
        return x


def _between(x):
    """x between clamp's bounds (the comparisons that chose this branch were false): a NaN is too."""
    return Passed(x, compare("eq", x, x))


# clamp: boundaries included in the pass-through region, as eager's backward does (NaN excluded)
composite("clamp", lambda x, lo, hi: Where(compare("lt", x, lo), lo, Where(compare("gt", x, hi), hi, _between(x))))
composite("clamp_min", lambda x, lo: Where(compare("lt", x, lo), lo, _between(x)))
composite("clamp_max", lambda x, hi: Where(compare("gt", x, hi), hi, _between(x)))
