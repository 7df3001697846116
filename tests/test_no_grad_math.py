"""Math a compiled function runs under its own ``no_grad`` compiles, as a region without autograd
(Llama's rotary cos/sin under ``@torch.no_grad()`` inside its forward), except a training step's
bookkeeping, which runs eagerly by design: a hand-written update (it reads ``.grad`` and writes a
parameter in place; its step size changes every step), an optimizer step, and torch.distributed's
own copies (FSDP2's all-gather buffers: tests/test_distributed.py)."""

from __future__ import annotations

import torch

import compiler


def rotary_like(x, w):
    with torch.no_grad():
        angles = torch.arange(4.0) * 0.5  # (a factory: a constant of the region, tests/test_factories.py)
        cos, sin = angles.cos() * 2, angles.sin() + 1
    return (x * cos + w * sin).sum()


def test_no_grad_math_inside_the_function_compiles():
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    report = compiler.explain(rotary_like, x, w)
    assert report.fallbacks == []
    assert set(report.eager_calls) <= {"_set_grad_enabled"}, report.eager_calls
    assert len(report.regions) >= 2 and all(r.get("kernels") for r in report.regions)

    compiled = compiler.compile(rotary_like, backend="interpret")
    for _ in range(3):
        x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        got, expected = compiled(x, w), rotary_like(xe, we)
        torch.testing.assert_close(got, expected)
        got.backward()
        expected.backward()
        torch.testing.assert_close((x.grad, w.grad), (xe.grad, we.grad))
    assert compiled.stats["divergences"] == 0 and compiled.stats["captures"] == 1


def test_a_no_grad_value_needs_no_grad_inside_a_compiled_function():
    def f(x):
        with torch.no_grad():
            y = x.exp() * 2
        return y, x * y

    x = torch.randn(3, requires_grad=True)
    compiled = compiler.compile(f, backend="interpret")
    for _ in range(2):
        y, z = compiled(x)
        y_e, z_e = f(x)
        assert not y.requires_grad and z.requires_grad and y.grad_fn is None
        torch.testing.assert_close((y, z), (y_e, z_e))
        (g,) = torch.autograd.grad(z.sum(), x)
        torch.testing.assert_close(g, y_e)  # y is a constant to autograd, as in eager


def sgd_by_hand(w, x, lr):
    loss = (w * x).sum()
    loss.backward()
    with torch.no_grad():
        w -= lr * w.grad
        w.grad = None
    return loss.detach()


def test_a_hand_written_update_stays_eager_by_design():
    """Its step size changes every step: compiled, each new constant would leave the recording."""
    w_c, w_e = torch.randn(5, requires_grad=True), None
    w_e = w_c.detach().clone().requires_grad_()
    compiled = compiler.compile(sgd_by_hand, backend="interpret")
    report = compiler.explain(sgd_by_hand, torch.randn(5, requires_grad=True), torch.randn(5), 0.1)
    assert report.fallbacks == []
    for step in range(6):
        x, lr = torch.randn(5), 0.1 / (step + 1)
        torch.testing.assert_close(compiled(w_c, x, lr), sgd_by_hand(w_e, x, lr))
        torch.testing.assert_close(w_c.detach(), w_e.detach())
    assert compiled.stats["divergences"] == 0


class _ScaledSin(torch.autograd.Function):
    """A custom Function whose forward (run by autograd under no_grad) saves an intermediate."""

    @staticmethod
    def forward(ctx, x):
        s = x.sin()
        ctx.save_for_backward(x, s)
        return s * 3

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * 3 * x.cos() + 0 * s


def test_a_custom_functions_forward_stays_its_own():
    # a custom Function's forward runs under no_grad too, but its math is the Function's: it runs
    # eagerly, as the Function does (compiled, its saved intermediates and a checkpoint around it
    # gave wrong gradients: tests/test_checkpoint.py, the autograd notes' sinh examples)
    def f(x):
        return (_ScaledSin.apply(x * 2) * x).sum()

    report = compiler.explain(f, torch.randn(5, requires_grad=True))
    assert "torch.Tensor.sin" in report.eager_calls or "Tensor.sin" in " ".join(report.eager_calls), report.eager_calls
    compiled = compiler.compile(f, backend="interpret")
    for _ in range(3):
        x = torch.randn(5, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        got, expected = compiled(x), f(xe)
        torch.testing.assert_close(got, expected)
        got.backward()
        expected.backward()
        torch.testing.assert_close(x.grad, xe.grad)
