"""None vs zeros: which inputs get a gradient is eager's graph path, not the compiled region's.

Eager leaves ``.grad`` None for an input with no path to the loss and gives zeros for one
whose path only carries zeros (an in-place op that overwrote the value). Every case runs
the recording call and the replay (through kernels) against eager.
"""

from __future__ import annotations

import pytest
import torch

import compiler


def _overwrite_fill(x):
    y = x.sin()
    y.fill_(2.0)
    return y * 3


def _overwrite_zero(x):
    y = x * 2  # (exp would save its result: eager refuses the backward)
    y.zero_()
    return y + 1


def _overwrite_copy(x):
    y = x.cos()
    y.copy_(torch.ones(3))
    return y * y


def _overwrite_through_view(x):
    y = x * 2
    y.unsqueeze(0)[:] = 0.5
    return y.sum()


def _unused_region_output(x, w):
    hidden = w * 2  # computed in the same region as the loss's value, never in the loss's graph
    return (x.sin() * 2).sum(), hidden


@pytest.mark.parametrize("fn", [_overwrite_fill, _overwrite_zero, _overwrite_copy, _overwrite_through_view,
                                _unused_region_output])
def test_gradients_none_or_zeros_as_eager(fn):
    compiled = compiler.compile(fn, backend="interpret")
    for call in ("eager", "recording", "replay"):
        inputs = [torch.linspace(-1, 1, 3, requires_grad=True) for _ in range(fn.__code__.co_argcount)]
        out = (fn if call == "eager" else compiled)(*inputs)
        loss = (out[0] if isinstance(out, tuple) else out).sum()
        loss.backward()
        grads = [x.grad for x in inputs]
        if call == "eager":
            want = grads
            continue
        for got, expected in zip(grads, want):
            assert (got is None) == (expected is None), f"{call}: got {got}, eager {expected}"
            if expected is not None:
                torch.testing.assert_close(got, expected)
    assert compiled.stats["kernel_launches"] > 0


def _exp_then_add_(x):
    y = x.exp()  # eager's ExpBackward saves its result
    y.add_(1)
    return y * 2


def _relu_result_in_place(x):
    y = torch.relu(x * 3)  # eager's ReluBackward saves its result; no op reads y before the write
    y.mul_(2)
    return y


@pytest.mark.parametrize("fn", [_exp_then_add_, _relu_result_in_place])
def test_in_place_on_a_saved_result_raises_as_eager(fn):
    """Eager saves some ops' results (exp, relu, polar): an in-place op on one makes its backward
    raise, even where the compiled backward does not read the value."""
    compiled = compiler.compile(fn, backend="interpret")
    messages = []
    for call in (fn, compiled, compiled):
        x = torch.linspace(-1, 1, 3, requires_grad=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as error:
            call(x).sum().backward()
        messages.append(str(error.value))
    assert messages[1] == messages[0] and messages[2] == messages[0]


def _log_and_double(x):
    return torch.log(x), x * 2  # log's derivative at 0 is inf: 0 * inf would be NaN


@pytest.mark.parametrize("create_graph", [False, True])
def test_outputs_outside_the_loss_contribute_nothing(create_graph):
    """Only ``b`` is in the loss: eager's gradient has no term of log(x) (not a zero times 1/x,
    which is NaN at x = 0); with create_graph=True its second derivative neither."""
    compiled = compiler.compile(_log_and_double, backend="interpret")
    results = []
    for call in (_log_and_double, compiled, compiled):
        x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
        _, b = call(x)
        grad, = torch.autograd.grad((b * b).sum(), x, create_graph=create_graph)
        second = torch.autograd.grad(grad.sum(), x)[0] if create_graph else None
        results.append((grad.detach(), second))
    for grad, second in results[1:]:
        torch.testing.assert_close(grad, results[0][0])
        if create_graph:
            torch.testing.assert_close(second, results[0][1])

