"""Gradients at non-differentiable points follow the autograd notes and equal eager's
("Gradients for non-differentiable functions"), through the compiled kernels."""

import pytest
import sympy
import torch

import compiler

from compiler.ir.graph import arg_symbol
from compiler.ir.ops.catalog import RESULT_SYMBOL, SCALAR_FUNCTIONS, partial_derivative
from tests.parity import check_parity

SPECIAL = torch.tensor([-2.0, -0.0, 0.0, 0.5, 3.0], dtype=torch.float64)


@pytest.mark.parametrize("name,fn", [
    ("relu", torch.relu),
    ("abs", torch.abs),
    ("sqrt", torch.sqrt),
    ("silu", torch.nn.functional.silu),
])
def test_gradient_at_special_points(name, fn):
    x = SPECIAL.clone().requires_grad_()
    if name == "sqrt":
        x = SPECIAL.abs().clone().requires_grad_()
    check_parity(fn, [x])


def test_relu_abs_sqrt_values_at_zero():
    x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    compiled = check_parity(lambda x: torch.relu(x) + torch.abs(x), [x])
    assert compiled.stats["kernel_launches"] >= 2
    # the rules themselves: relu'(0) = 0, abs'(0) = 0, sqrt'(0) = inf
    a = arg_symbol(0)
    assert partial_derivative(SCALAR_FUNCTIONS["relu"](a), 0).subs(a, 0) == 0
    assert partial_derivative(SCALAR_FUNCTIONS["abs"](a), 0).subs(a, 0) == 0
    assert partial_derivative(SCALAR_FUNCTIONS["sqrt"](a), 0).subs(a, 0) in (sympy.oo, sympy.zoo)


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum])
def test_ties_split_the_gradient(op):
    a = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([1.0, 5.0, 3.0, 0.0], dtype=torch.float64, requires_grad=True)
    weights = torch.arange(1.0, 5.0, dtype=torch.float64)
    check_parity(lambda a, b: op(a, b) * weights, [a, b])
    # direct check of the split at the ties (indices 0 and 2)
    out = op(a, b).sum()
    ga, gb = torch.autograd.grad(out, [a, b])
    assert ga[0] == 0.5 and gb[0] == 0.5


def test_nan_propagates_like_eager():
    x = torch.tensor([float("nan"), 1.0, -1.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0.0, float("nan"), 2.0], dtype=torch.float64, requires_grad=True)
    check_parity(lambda x, y: torch.maximum(x, y) + torch.relu(x) + torch.minimum(x, y), [x, y])


def test_forward_results_are_reused_as_pytorch_does():
    a = arg_symbol(0)
    assert partial_derivative(sympy.exp(a), 0) == RESULT_SYMBOL
    assert partial_derivative(sympy.tanh(a), 0) == 1 - RESULT_SYMBOL**2
    assert partial_derivative(SCALAR_FUNCTIONS["sigmoid"](a), 0) == RESULT_SYMBOL * (1 - RESULT_SYMBOL)


def test_derivatives_are_cached():
    expr = SCALAR_FUNCTIONS["gelu"](arg_symbol(0))
    partial_derivative(expr, 0)
    hits = partial_derivative.cache_info().hits
    partial_derivative(expr, 0)
    assert partial_derivative.cache_info().hits == hits + 1


def test_zero_derivatives_give_zero_gradients_not_none():
    """round, sign, x * 0: eager's backward gives zeros, so .grad is a zero tensor."""
    for fn in (lambda x: (x * 0).sum(), lambda x: x.round().sum(), lambda x: torch.sign(x).sum() + x.floor().mean()):
        x = torch.randn(4, requires_grad=True)
        fn(x).backward()
        expected, x.grad = x.grad, None
        compiled = compiler.compile(fn, backend="interpret")
        compiled(x)
        x.grad = None
        compiled(x).backward()
        assert x.grad is not None and torch.equal(x.grad, expected)
