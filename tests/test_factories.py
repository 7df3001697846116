"""Tensor factories inside a compiled function are region constants (compiler/capture/bindings/factories.py):
`torch.arange` an index expression, `zeros`/`ones`/`full`/`empty`/`tensor(number)` a fill, computed
by the kernels that read them, with eager's values, dtypes and devices; the forms they do not take
stay eager calls without a fallback, and a factory called with other constants than recorded
leaves the recording safely."""

from __future__ import annotations

import pytest
import torch

import compiler

FACTORY_FORMS = {
    "arange(end)": lambda x: x + torch.arange(x.shape[-1]),
    "arange(start, end, step)": lambda x: x * torch.arange(3, 3 + 2 * x.shape[-1], 2),
    "arange negative step": lambda x: x - torch.arange(x.shape[-1], 0, -1),
    "arange ragged step": lambda x: x[..., :3] + torch.arange(0, 7, 3),
    "arange dtype float32": lambda x: x / torch.arange(1, x.shape[-1] + 1, dtype=torch.float32),
    "arange of floats": lambda x: x * torch.arange(4.0, 4.0 + x.shape[-1]),
    "arange as an index": lambda x: x[:, torch.arange(x.shape[-1] - 1, -1, -1)],
    "zeros and ones": lambda x: x * torch.ones(x.shape[-1]) + torch.zeros((x.shape[0], 1)),
    "full of a float": lambda x: x.masked_fill(torch.full((x.shape[-1],), True).logical_not(), 0) * 2,
    "full of finfo.min": lambda x: (x + torch.full((x.shape[-1], x.shape[-1]), torch.finfo(x.dtype).min).triu(1)[0]),
    "empty filled": lambda x: x + torch.empty(x.shape[-1]).fill_(3.0),
    "tensor of a float": lambda x: x * torch.tensor(0.5),
    "tensor of an int, dtype": lambda x: x + torch.tensor(3, dtype=torch.float64),
    "an empty tensor to grow": lambda x: torch.cat([torch.tensor([], dtype=x.dtype), x.flatten()]) * 2,
    "causal mask": lambda x: x.masked_fill(
        torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool).tril().logical_not()[0], float("-inf")).softmax(-1),
}


@pytest.mark.parametrize("form", list(FACTORY_FORMS))
def test_factory_compiles_with_eager_values_and_gradients(form):
    fn = FACTORY_FORMS[form]
    x = torch.randn(3, 5, requires_grad=True)
    report = compiler.explain(fn, x)
    assert report.fallbacks == [] and report.eager_calls == [], (report.fallbacks, report.eager_calls)
    compiled = compiler.compile(fn, backend="interpret")
    for _call in range(3):   # the recording call, then replays
        x = torch.randn(3, 5, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        got, expected = compiled(x), fn(xe)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected)
        got.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, xe.grad)
    assert compiled.stats["divergences"] == 0 and compiled.stats["captures"] == 1


def test_factory_results_returned_keep_eager_dtype_and_flags():
    def fn(x):
        return x * 2, torch.arange(4), torch.zeros(2, 3), torch.full((2,), 7), torch.tensor(True)

    compiled = compiler.compile(fn, backend="interpret")
    x = torch.randn(3)
    for _call in range(2):
        got, expected = compiled(x), fn(x)
        for g, e in zip(got, expected):
            assert (g.dtype, g.shape, g.requires_grad, g.is_leaf) == (e.dtype, e.shape, e.requires_grad, e.is_leaf)
            torch.testing.assert_close(g, e)


def test_forms_left_eager_are_eager_calls_not_fallbacks():
    def fn(x):
        w = torch.zeros(3, requires_grad=True)          # a new leaf of the autograd graph
        table = torch.tensor([1.0, 2.0, 4.0])           # a list's data
        return (x * w).sum() + (x * table).sum(), w

    x = torch.randn(3, requires_grad=True)
    report = compiler.explain(fn, x)
    assert report.fallbacks == []
    assert sorted(report.eager_calls) == ["torch.tensor", "torch.zeros"], report.eager_calls
    compiled = compiler.compile(fn, backend="interpret")
    for _call in range(2):
        loss, w = compiled(x)
        loss.backward()
        torch.testing.assert_close(w.grad, x.detach())   # the leaf made inside gets its gradient
        assert w.is_leaf and w.requires_grad


def test_a_factory_with_other_constants_leaves_the_recording_safely():
    def fn(x, n, value):
        return x[:n] + torch.full((n,), value) + torch.arange(n)

    compiled = compiler.compile(fn, backend="interpret")
    x = torch.randn(8)
    for n, value in [(4, 1.5), (4, 1.5), (4, -2.0), (6, 1.5), (4, 1.5)]:
        torch.testing.assert_close(compiled(x, n, value), fn(x, n, value))


def test_positions_follow_a_changing_sequence_length():
    def fn(tokens, table):
        positions = torch.arange(tokens.shape[1])
        return (table[tokens] + table[positions]).sum()

    compiled = compiler.compile(fn, backend="interpret")
    table = torch.randn(64, 4, requires_grad=True)
    for length in (8, 12, 16, 20, 9):
        tokens = torch.randint(0, 64, (2, length))
        got, expected = compiled(tokens, table), fn(tokens, table)
        torch.testing.assert_close(got, expected)
        (grad,) = torch.autograd.grad(got, table)
        (expected_grad,) = torch.autograd.grad(expected, table)
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.allows_eager("a module built inside the function: its init runs eagerly, and its new parameters leave "
                          "the recording")
def test_a_module_built_inside_the_function_gets_real_parameters():
    # nn.Linear's constructor wraps torch.empty's tensor as nn.Parameter (a use the mode does not
    # see) and initializes it in place: the factory's value must be a real tensor on replay
    def fn(x):
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2)
        return layer(x).sum(), layer.weight.detach().clone()

    compiled = compiler.compile(fn, backend="interpret")
    x = torch.randn(4, 3)
    for _call in range(3):
        (loss, weight), (expected_loss, expected_weight) = compiled(x), fn(x)
        torch.testing.assert_close(weight, expected_weight)
        torch.testing.assert_close(loss, expected_loss)
