"""Python numbers that change between calls are taken by the kernels at run time (issue 39).

A float argument is taken at run time from the first recording on; any other number (an attribute,
a global, ``param_groups[0]["lr"]``, dropout's ``p``) from the recording after a replay saw it
change (``compiler.capture.numbers``). Each test compares with eager over many calls, counts the
recordings, and checks that the replays ran the kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import KERNELS


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _twins():
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _step_taking_floats(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y, temperature, loss_scale, lr):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        loss = F.cross_entropy(model(x) / temperature, y) * loss_scale
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _floats(i):
    return 1.0 + 0.07 * i, 2.0 ** (i % 4), 0.05 / (1 + i)


def test_a_step_whose_float_arguments_change_every_call_records_once_and_replays_kernels():
    """The issue's Done-when: temperature, loss scale and learning rate change every call as Python
    floats; one recording, then kernels on every later call; eager's values over 20 steps."""
    model, reference = _twins()
    step = compiler.compile(_step_taking_floats(model), backend=KERNELS)
    eager = _step_taking_floats(reference)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    launches = []
    for i in range(20):
        got, want = step(x, y, *_floats(i)), eager(x, y, *_floats(i))
        torch.testing.assert_close(got, want)
        launches.append(step.stats["kernel_launches"])
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert step.stats["captures"] == 1 and step.stats["divergences"] == 0, step.stats
    assert all(b > a for a, b in zip(launches[1:], launches[2:])), launches  # kernels on every replay
    assert step.last_backend == KERNELS


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _mlp()
        self.temperature = 1.0

    def forward(self, x):
        return self.body(x) / self.temperature


LOSS_SCALE = 1.0


@pytest.mark.allows_eager("the first change of a number read from an attribute, a global or param_groups leaves its "
                          "recording once, and the next recording takes it at run time")
def test_an_attribute_a_global_and_the_learning_rate_read_into_math_are_taken_after_their_first_change():
    global LOSS_SCALE
    model, reference = _Tempered(), _Tempered()
    reference.load_state_dict(model.state_dict())

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y) * LOSS_SCALE
            penalty = sum(p.pow(2).sum() for p in m.parameters()) * opt.param_groups[0]["lr"]
            (loss + penalty).backward()
            opt.step()
            return loss.detach()
        return step, opt
    (step, opt), (eager, eager_opt) = make(model), make(reference)
    compiled = compiler.compile(step, backend=KERNELS)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    for i in range(12):
        model.temperature = reference.temperature = 1.0 + 0.1 * i
        LOSS_SCALE = 2.0 ** (i % 3)
        opt.param_groups[0]["lr"] = eager_opt.param_groups[0]["lr"] = 0.1 / (1 + i)
        torch.testing.assert_close(compiled(x, y), eager(x, y))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    # the first call records; the second sees all three change (one divergence), the third records them
    assert compiled.stats["captures"] == 2 and compiled.stats["divergences"] == 1, compiled.stats
    replays = compiled.stats["replays"]
    launches = compiled.stats["kernel_launches"]
    compiled(x, y)
    assert compiled.stats["replays"] == replays + 1 and compiled.stats["kernel_launches"] > launches
    assert compiled.stats["divergences"] == 1


@pytest.mark.allows_eager("p = 0 (eager returns the input itself) is outside what the kernels hold for: that call "
                          "leaves its recording")
def test_dropout_with_a_changing_p_keeps_one_recording_and_p_zero_returns_the_input():
    x = torch.randn(4000, dtype=torch.float64)
    f = compiler.compile(lambda x, p: F.dropout(x, p, training=True), backend=KERNELS)
    for p in (0.1, 0.3, 0.5, 0.7, 0.2):
        out = f(x, p)
        kept = out != 0
        assert abs(kept.double().mean().item() - (1 - p)) < 0.04, p
        torch.testing.assert_close(out[kept], x[kept] / (1 - p))
    assert f.stats["captures"] == 1 and f.stats["divergences"] == 0 and f.stats["kernel_launches"] >= 4
    assert f(x, 0.0) is x  # (eager's own answer: the replay leaves the recording before any kernel)


@pytest.mark.allows_eager("an int argument is part of the guard key until it changed three times; its first change "
                          "inside the math leaves the recording once")
def test_an_int_step_counter_in_the_math_is_taken_at_run_time():
    x = torch.randn(7, dtype=torch.float64, requires_grad=True)

    def f(x, step):
        return (x * step).sin().sum()
    c = compiler.compile(f, backend=KERNELS)
    for step in range(1, 12):
        got = c(x, step)
        (gx,) = torch.autograd.grad(got, x)
        xe = x.detach().requires_grad_()
        want = f(xe, step)
        (wx,) = torch.autograd.grad(want, xe)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, wx)
    assert c.stats["captures"] <= 4 and c.stats["replays"] >= 7, c.stats
    launches = c.stats["kernel_launches"]
    c(x, 40)
    assert c.stats["kernel_launches"] > launches and c.last_backend == KERNELS


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.float64])
def test_a_number_taken_at_run_time_promotes_and_rounds_as_the_python_number(dtype):
    """``x * t`` with an int tensor is float32 (the default dtype), with a half tensor half, and with a
    double tensor computed in double with ``t`` exactly: eager's promotion and opmath, bit for bit."""
    x = (torch.arange(1, 13) * 3).to(dtype)
    f = compiler.compile(lambda x, t: x * t + 1, backend=KERNELS)
    for t in (0.1, 1 / 3, 2.5):
        got, want = f(x, t), x * t + 1
        assert got.dtype == want.dtype
        assert torch.equal(got, want), (t, got, want)
    assert f.stats["captures"] == 1 and f.stats["kernel_launches"] >= 2


@pytest.mark.allows_eager("a float that sets a shape or a branch: each new value leaves the recording (the replay's "
                          "checks), with eager's values")
def test_a_float_argument_that_decides_a_shape_or_a_branch_still_gives_eager_values():
    x = torch.randn(10, dtype=torch.float64)

    def f(x, frac):
        y = x[: int(10 * frac)] * frac
        return y.exp() if frac > 0.5 else y.cos()
    c = compiler.compile(f, backend=KERNELS)
    for frac in (0.3, 0.3, 0.4, 0.7, 0.9, 0.4, 0.35):
        torch.testing.assert_close(c(x, frac), f(x, frac))


def test_a_float_argument_where_the_binding_needs_a_constant_is_part_of_the_key_by_value():
    """An activation's slope is a constant of its kernel: the first recording finds that, and from then
    on the guard key holds the value (each value records once, as before; none leaves a recording)."""
    x = torch.randn(9, dtype=torch.float64)
    f = compiler.compile(lambda x, slope: F.leaky_relu(x * 2, slope), backend=KERNELS)
    for slope in (0.2, 0.2, 0.3, 0.3, 0.2, 0.3):
        torch.testing.assert_close(f(x, slope), F.leaky_relu(x * 2, slope))
    assert f.stats["captures"] == 2 and f.stats["divergences"] == 0, f.stats
    assert f.stats["kernel_launches"] >= 4 and not f.last_entry.report.fallbacks


_MATH_WITH_A_NUMBER = {
    "add": lambda x, t: x + t, "rsub": lambda x, t: t - x, "mul": lambda x, t: x * t, "div": lambda x, t: x / t,
    "rdiv": lambda x, t: t / x, "pow": lambda x, t: x ** t, "rpow": lambda x, t: t ** x,
    "clamp": lambda x, t: x.clamp(min=t), "clamp_max": lambda x, t: torch.clamp(x, max=t),
    "where": lambda x, t: torch.where(x > 0, x, t), "gt": lambda x, t: (x > t).to(x.dtype) * x,
    "remainder": lambda x, t: torch.remainder(x, t), "fmod": lambda x, t: torch.fmod(x, t),
    "lerp": lambda x, t: torch.lerp(x, x.sin(), t), "maximum": lambda x, t: torch.maximum(x, torch.tensor(t)),
    "add_alpha": lambda x, t: torch.add(x, x.cos(), alpha=t), "masked_fill": lambda x, t: x.masked_fill(x < 0, t),
}


@pytest.mark.allows_eager("a form whose binding needs the number as a constant leaves its recording when it changes")
@pytest.mark.parametrize("name", list(_MATH_WITH_A_NUMBER))
def test_each_elementwise_form_given_a_changing_float_argument_gives_eager_values_and_gradients(name):
    """Negative bases, zero and changing exponents (``x ** t`` with t = 2.0 then 0.5 then 0.0), each
    value and gradient as eager's, NaN where eager's is NaN."""
    op = _MATH_WITH_A_NUMBER[name]
    x = torch.tensor([-2.0, -0.5, 0.0, 0.75, 3.0], dtype=torch.float64, requires_grad=True)
    f = compiler.compile(lambda x, t: op(x, t).sum(), backend=KERNELS)
    for t in (2.0, -1.5, 0.5, 0.0, 2.0, 3.0):
        got = f(x, t)
        (grad,) = torch.autograd.grad(got, x)
        xe = x.detach().requires_grad_()
        want = op(xe, t).sum()
        (wanted,) = torch.autograd.grad(want, xe)
        torch.testing.assert_close(got, want, equal_nan=True)
        torch.testing.assert_close(grad, wanted, equal_nan=True)
    assert f.stats["kernel_launches"] > 0
