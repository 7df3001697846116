"""What cannot be compiled runs eagerly, correctly, with the reason said once and shown by
explain; fullgraph=True raises instead; bad arguments get clear errors."""

import logging

import pytest
import torch

import compiler
from runtime.backends import BackendUnavailable


@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_unsupported_op_runs_eagerly_with_reason(caplog):
    # (a name of its own: a fallback is said once per function name and reason in the process,
    # and tests/test_logs.py compiles an ``f`` with cumprod too)
    def cumprod_of_sin(x):
        return torch.cumprod(x.sin(), 0).sum()
    f = cumprod_of_sin
    x = torch.randn(6, requires_grad=True)
    report = compiler.explain(f, x)
    assert any("cumprod" in r and "not supported" in r for r in report.fallbacks)
    compiled = compiler.compile(f, backend="interpret")
    with caplog.at_level(logging.WARNING, logger="compiler"):
        outs = [compiled(x) for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, f(x))
    messages = [r.getMessage() for r in caplog.records if "cumprod" in r.getMessage()]
    assert len(messages) == 1  # said once, not per call
    # the supported ops around it still ran as kernels
    assert compiled.stats["kernel_launches"] > 0
    g1, = torch.autograd.grad(compiled(x), x)
    g2, = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g1, g2)


@pytest.mark.allows_eager("Python takes another branch: the replay leaves its recording, what it tests")
def test_item_and_tensor_control_flow_are_reported():
    def f(x):
        if x.sum() > 0:  # control flow on a tensor value
            return x * 2
        return x * 3
    x = torch.randn(5)
    report = compiler.explain(f, x)
    assert any("__bool__" in r for r in report.graph_breaks)  # (a graph break, not a fallback)
    compiled = compiler.compile(f, backend="interpret")
    for sign in (1, -1, 1, 1, -1):
        y = sign * x.abs()
        torch.testing.assert_close(compiled(y), f(y))  # right on either branch

    def g(x):
        return x * x.max().item()
    assert any("item" in r for r in compiler.explain(g, x).graph_breaks)


def test_fullgraph_raises_instead_of_falling_back():
    compiled = compiler.compile(lambda x: torch.cumprod(x, 0), backend="interpret", fullgraph=True)
    with pytest.raises(compiler.CompileError, match="cumprod"):
        compiled(torch.randn(4))


def test_fully_compiled_function_has_no_fallbacks():
    report = compiler.explain(lambda x: (x.exp() + 1).sum(), torch.randn(3, requires_grad=True))
    assert report.fallbacks == []
    assert "fallbacks: none" in str(report)


def test_backend_errors_say_what_to_do():
    with pytest.raises(ValueError, match="unknown backend"):
        compiler.compile(lambda x: x, backend="tpu")
    cuda_only = compiler.compile(lambda x: x * 2, backend="triton")
    with pytest.raises(BackendUnavailable, match="CUDA"):
        cuda_only(torch.randn(3))


def test_eager_backend_is_the_function_unmodified():
    calls = []

    def f(x):
        calls.append(1)
        return torch.cumprod(x, 0)
    compiled = compiler.compile(f, backend="eager")
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), torch.cumprod(x, 0))
    assert compiled.last_backend == "eager" and calls == [1]


def test_auto_on_cpu_says_which_backend_ran():
    compiled = compiler.compile(lambda x: x.sin() * 2)
    x = torch.randn(3)
    compiled(x)
    compiled(x)
    assert compiled.last_backend == "interpret"
    report = compiler.explain(compiled, x)
    assert report.backend == "interpret" and "interpreter" in report.backend_reason


def test_decorator_forms():
    @compiler.compile
    def f(x):
        return x + 1

    @compiler.compile(backend="interpret")
    def g(x):
        return x - 1
    x = torch.randn(3)
    assert torch.equal(f(x), x + 1) and torch.equal(g(x), x - 1)
    assert torch.equal(f(x), x + 1) and torch.equal(g(x), x - 1)
