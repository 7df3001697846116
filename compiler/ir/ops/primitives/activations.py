"""Activations (Relu, Sigmoid, and compositions such as gelu and softplus) and the scalar parts
of losses. Where a boundary belongs matters, it is eager's backward's choice.

NOTE: the autograd notes, "Gradients for non-differentiable functions": relu'(0) = 0.
"""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

from compiler.ir.ops.primitives.base import FLOAT, Primitive, as_tensor, complex_exp, complex_recip, composite, is_number
from compiler.ir.ops.primitives.comparisons import Maximum, Minimum, Where, compare
from compiler.ir.ops.primitives.rounding import Abs
from compiler.ir.ops.primitives.transcendental import Expm1, Log1p


class Relu(Primitive, sympy.Function):
    """max(x, 0) that keeps NaN; d/dx is 0 where x <= 0 and 1 elsewhere (relu'(0) = 0)."""

    nargs = 1
    torch_fn = torch.relu
    op, binds, complex_inputs, in_place, math = "relu", ("relu",), True, True, True

    @classmethod
    def eval(cls, x):
        if is_number(x) and x.is_real:
            return x if x > 0 else sympy.Integer(0)

    def fdiff(self, argindex=1):
        return Step(self.args[0])

    @classmethod
    def render(cls, printer, e):
        x = printer.p(e.args[0])
        return f"tl.where({x} < 0, 0.0, {x})"

    @classmethod
    def render_cpp(cls, printer, e):   # (relu(nan) = nan: NaN < 0 is false)
        x, zero = printer.p(e.args[0]), printer.literal(sympy.Integer(0))
        return printer.where(f"{x} < {zero}", zero, x)


class Step(Primitive, sympy.Function):
    """0 where x <= 0, else 1 (so 1 at NaN, as eager's threshold_backward). relu's derivative."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if is_number(x) and x.is_real:
            return sympy.Integer(0 if x <= 0 else 1)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)

    @classmethod
    def render(cls, printer, e):
        return f"tl.where({printer.p(e.args[0])} <= 0, {printer.whole('0.0')}, {printer.whole('1.0')})"

    @classmethod
    def render_cpp(cls, printer, e):
        zero, one = printer.literal(sympy.Integer(0)), printer.literal(sympy.Integer(1))
        return printer.where(f"{printer.p(e.args[0])} <= {zero}", zero, one)

    @classmethod
    def torch_eval(cls, x):
        x = as_tensor(x)
        return torch.where(x <= 0, 0.0, 1.0).to(x.dtype)


class Sigmoid(Primitive, sympy.Function):
    """1 / (1 + exp(-x)); derivative written as y(1 - y) so it reuses the forward result."""

    nargs = 1
    torch_fn = torch.sigmoid
    op, result, binds, also_binds = "sigmoid", FLOAT, ("sigmoid",), (F.sigmoid,)
    complex_inputs, in_place, math = True, True, True

    def fdiff(self, argindex=1):
        return self * (1 - self)

    @classmethod
    def render(cls, printer, e):
        return f"(1.0 / (1.0 + tl.exp(-{printer.p(e.args[0])})))"

    @classmethod
    def render_cpp(cls, printer, e):
        one = printer.one()
        return f"({one} / ({one} + {printer.call('std::exp', printer.neg(printer.p(e.args[0])))}))"

    @classmethod
    def re_im(cls, cx, x):
        a, b = cx(x)
        if b == 0:
            return (Sigmoid(a), sympy.Integer(0))
        return complex_recip((1 + complex_exp((-a, -b))[0], complex_exp((-a, -b))[1]))


# ----------------------------------------------------------------------------- compositions
_GELU_K = sympy.sqrt(2 / sympy.pi)
# (bound by hand in compiler/capture/bindings/elementwise.py: inplace=, approximate=, parameters)
composite("gelu", lambda a: a * (1 + sympy.erf(a / sympy.sqrt(2))) / 2, result=FLOAT, math=True)
composite("gelu_tanh", lambda a: a * (1 + sympy.tanh(_GELU_K * (a + sympy.Float("0.044715") * a**3))) / 2,
          result=FLOAT)
composite("silu", lambda a: a * Sigmoid(a), result=FLOAT, math=True)
composite("softplus", lambda x, beta, threshold: Where(compare("gt", x * beta, threshold), x,
                                                       Log1p(sympy.exp(beta * x)) / beta))
composite("leaky_relu", lambda x, slope: Where(compare("gt", x, 0), x, slope * x))
composite("elu", lambda x, alpha, scale, input_scale: Where(compare("gt", x, 0), scale * x,
                                                            scale * alpha * Expm1(input_scale * x)))
composite("hardtanh", lambda x, lo, hi: Where(compare("le", x, lo), lo, Where(compare("ge", x, hi), hi, x)))
composite("hardsigmoid", lambda x: Where(compare("le", x, -3), 0,
                                         Where(compare("ge", x, 3), 1, x / 6 + sympy.Rational(1, 2))))
composite("hardswish", lambda x: Where(compare("le", x, -3), 0, Where(compare("lt", x, 3), x * (x + 3) / 6, x)))
composite("mish", lambda x: x * sympy.tanh(Log1p(sympy.exp(x))))
composite("logsigmoid", lambda x: Minimum(x, 0) - Log1p(sympy.exp(-Abs(x))))
composite("softsign", lambda x: x / (1 + Abs(x)))

# ----------------------------------------------------------------------------- losses' scalar parts
composite("smooth_l1", lambda d, beta: Where(compare("lt", Abs(d), beta), d * d / (2 * beta), Abs(d) - beta / 2))
composite("huber", lambda d, delta: Where(compare("le", Abs(d), delta), d * d / 2, delta * (Abs(d) - delta / 2)))
composite("bce_with_logits", lambda x, t, pos_weight: (1 - t) * x + (1 + (pos_weight - 1) * t) * (
    Log1p(sympy.exp(-Abs(x))) + Maximum(-x, 0)))
composite("kl_div", lambda x, t: Where(compare("eq", t, 0), 0, t * sympy.log(t)) - t * x)  # xlogy(t, t) - t x
composite("kl_div_log_target", lambda x, t: sympy.exp(t) * (t - x))
