"""A region's output that a later call writes in place (fuzz bug region-output-written-later-saved).

Eager's ops saved what they saved (``where`` its condition, ``leaky_relu`` its input): writing the
output later is no error there, unless an op saved the output itself (``exp``). The compiled
region's backward must not read the output's later value either: it saves a value the write does
not change (the condition, a copy) or recomputes from one, and raises only where eager raises.
"""

import pytest
import torch
import torch.nn.functional as F

import compiler


def _leaky_then_where(x0):   # the fuzz program of seeds 1148 and 4445
    v2 = F.leaky_relu(x0, 0.1)
    v4 = torch.where(v2 > 0, v2, x0)
    v2[1:] = 0.5
    return v4


def _written_through_a_view(x0):
    v2 = F.leaky_relu(x0, 0.1)
    v4 = torch.where(v2 > 0, v2, x0)
    v4.sum().item()   # a value read: the write below is in the next region
    view = v2[1:]
    view.fill_(0.5)
    return v4 * 2


def _matmul_output_written(x, w):   # a matmul's result cannot be recomputed: its condition is saved
    h = x @ w
    out = torch.where(h > 0, h, x)
    h.mul_(3)
    return out, h


def _saved_by_eager(x0):   # exp saves its result: eager raises, and so must we
    y = torch.exp(x0)
    z = y * x0
    y[1:] = 0.5
    return z


def _inputs(fn):
    torch.manual_seed(0)
    if fn is _matmul_output_written:
        return [torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)]
    return [torch.randn(2, 2, requires_grad=True)]


def _loss_and_grads(fn, args):
    out = fn(*args)
    loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
    loss.backward()
    return [a.grad for a in args]


@pytest.mark.parametrize("fn", [_leaky_then_where, _written_through_a_view, _matmul_output_written])
def test_gradients_as_eager_on_every_call(fn):
    compiled = compiler.compile(fn, backend="interpret")
    for _call in range(3):   # the recording call, then replays
        args = _inputs(fn)
        want = _loss_and_grads(fn, [a.detach().clone().requires_grad_() for a in args])
        got = _loss_and_grads(compiled, args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert compiled.stats["kernel_launches"] > 0


def test_output_eager_saved_still_raises():
    compiled = compiler.compile(_saved_by_eager, backend="interpret")
    for f in (_saved_by_eager, compiled, compiled, compiled):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _loss_and_grads(f, _inputs(_saved_by_eager))


def _logsumexp_result_written(x0):   # the fuzz program of seed 2049 (interpreter), its core
    v0 = torch.logsumexp(x0, dim=1)   # saves its result; ours is a view (a reshape) of the kernel's
    v1 = -x0
    v0.masked_fill_(v0 < 0, 0.5)
    return v1, v0


def test_a_saved_result_that_is_a_view_of_ours_still_raises_eagers_error():
    """logsumexp saves its result. In our graph that result is a reshape of the kernel's output, and
    the runtime makes it after the program, since a later call writes it in place. Its version
    counter is its base's: the base is checked, and the message names the tensor eager saved."""
    compiled = compiler.compile(_logsumexp_result_written, backend="interpret")
    torch.manual_seed(0)
    x = torch.randn(4, 1, requires_grad=True)
    with pytest.raises(RuntimeError) as eager:
        _loss_and_grads(_logsumexp_result_written, [x])
    for _call in range(3):   # the recording call, then replays
        with pytest.raises(RuntimeError) as ours:
            _loss_and_grads(compiled, [x])
        assert str(ours.value) == str(eager.value)
    assert compiled.stats["kernel_launches"] > 0 and compiled.stats["replays"] == 2
