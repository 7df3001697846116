"""Guards decide when a recording may be reused; anything else records again."""

import copy

import pytest
import torch

import compiler


def test_shape_dtype_and_requires_grad_changes_record_again():
    compiled = compiler.compile(lambda x: (x * 2).sin(), backend="interpret")
    a = torch.randn(4)
    compiled(a), compiled(a)
    assert compiled.stats["captures"] == 1
    compiled(torch.randn(5))
    compiled(torch.randn(4, dtype=torch.float64))
    compiled(torch.randn(4, requires_grad=True))
    assert compiled.stats["captures"] == 4
    with torch.no_grad():
        compiled(a)
    assert compiled.stats["captures"] == 5  # grad mode is part of the key


def test_parameters_are_guarded_by_identity_and_requires_grad():
    lin = torch.nn.Linear(3, 2)
    compiled = compiler.compile(lambda x: lin(x).relu(), backend="interpret")
    x = torch.randn(4, 3)
    compiled(x), compiled(x)
    assert compiled.stats["captures"] == 1
    lin.weight = torch.nn.Parameter(torch.randn(2, 3))  # a new tensor: record again
    torch.testing.assert_close(compiled(x), lin(x).relu())
    assert compiled.stats["captures"] == 2
    lin.weight.requires_grad_(False)                     # frozen: record again
    out = compiled(x)
    assert compiled.stats["captures"] == 3
    out.sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is not None


def test_a_parameter_whose_data_is_swapped_in_place_records_again():
    """The same Parameter object given new data (``p.data = ...``) of another shape after replays: the
    replay's check of the tensors it reaches (at its quick C++ check after the first replay,
    ``Recording.external_values``) sees it and records again; a swap to data like the old (same shape,
    dtype, strides) replays on the new values."""
    lin = torch.nn.Linear(3, 2)
    compiled = compiler.compile(lambda x: lin(x).relu(), backend="interpret")
    x = torch.randn(4, 3)
    for _ in range(3):
        compiled(x)
    assert compiled.stats["captures"] == 1 and compiled.stats["replays"] == 2
    lin.weight.data, lin.bias.data = torch.randn(2, 3), torch.randn(2)
    torch.testing.assert_close(compiled(x), lin(x).relu())
    assert compiled.stats["captures"] == 1
    lin.weight.data, lin.bias.data = torch.randn(5, 3), torch.randn(5)
    torch.testing.assert_close(compiled(x), lin(x).relu())
    assert compiled.stats["captures"] == 2


def test_in_place_update_of_a_parameter_is_seen():
    w = torch.randn(3, requires_grad=True)
    compiled = compiler.compile(lambda x: (x * w).sum(), backend="interpret")
    x = torch.randn(3)
    compiled(x), compiled(x)
    with torch.no_grad():
        w.add_(1.0)
    torch.testing.assert_close(compiled(x), (x * w).sum())
    assert compiled.stats["captures"] == 1


@pytest.mark.allows_eager("a replay that leaves its recording (a per-call guard): what it tests")
def test_python_control_flow_divergence_stays_correct():
    state = {"n": 0}

    def f(x):
        state["n"] += 1
        y = x.sin()
        if state["n"] % 2:  # Python-side control flow the guards cannot see
            y = y * 2
        return (y + 1).sum()
    compiled = compiler.compile(f, backend="interpret")
    x = torch.randn(5, requires_grad=True)
    for _ in range(6):
        out = compiled(x)
        expected = ((x.sin() * 2 if state["n"] % 2 else x.sin()) + 1).sum()
        torch.testing.assert_close(out, expected)
        g, = torch.autograd.grad(out, x)
        g_ref, = torch.autograd.grad(expected, x)
        torch.testing.assert_close(g, g_ref)
    assert compiled.stats["divergences"] >= 1


def test_intermediates_kept_by_the_user_are_materialized():
    kept = []

    def f(x):
        h = x.exp()
        kept.append(h)  # escapes through a list: must be a real value
        return (h * 2).sum()
    compiled = compiler.compile(f, backend="interpret")
    x = torch.randn(4)
    compiled(x)
    kept.clear()
    compiled(x)
    torch.testing.assert_close(kept[0], x.exp())


def test_int_arguments_are_part_of_the_key_and_float_arguments_are_taken_at_run_time():
    """An int may be a size or a dim (part of the key until it changed DYNAMIC_AFTER times); a float
    argument is taken by the kernels at run time (compiler.capture.numbers): one recording serves all."""
    compiled = compiler.compile(lambda x, s: x * s, backend="interpret")
    x = torch.randn(3)
    for s in (2, 3, 2, 3):
        torch.testing.assert_close(compiled(x, s), x * s)
    assert compiled.stats["captures"] == 2 and compiled.stats["divergences"] == 0
    compiled = compiler.compile(lambda x, s: x * s, backend="interpret")
    for s in (2.0, 3.0, 2.0, 3.5):
        torch.testing.assert_close(compiled(x, s), x * s)
    assert compiled.stats["captures"] == 1 and compiled.stats["divergences"] == 0


def test_switching_train_and_eval_keeps_one_recording_each():
    """model.train()/eval() changes what dropout does: each mode is recorded once and chosen
    by the modules' mode, so alternating never exhausts the recapture limit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU())
    f = compiler.compile(lambda x: model(x), backend="interpret")
    x = torch.randn(4, 8)
    for _ in range(12):
        model.train()
        f(x)
        model.eval()
        torch.testing.assert_close(f(x), model(x))
    assert f.stats["captures"] == 2 and f.stats["divergences"] == 0 and f.last_backend == "interpret"
    assert not f.disabled


@pytest.mark.allows_eager("a replay that leaves its recording (a per-call guard): what it tests")
def test_a_changing_number_argument_stops_being_specialized():
    """A learning rate passed per call: after a few different values the guard stops keying
    on it (the replay still checks every constant a kernel uses)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def make_step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y, lr):
            for group in opt.param_groups:
                group["lr"] = lr
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    eager_step, compiled = make_step(reference), compiler.compile(make_step(model), backend="interpret")
    for i in range(12):
        lr = 0.1 / (1 + i)
        torch.testing.assert_close(compiled(x, y, lr), eager_step(x, y, lr))
    assert compiled.stats["captures"] <= 4 and not compiled.disabled
    assert compiled.last_backend == "interpret"

    scale = compiler.compile(lambda x, k: (x * k).sin(), backend="interpret")
    for k in (1.0, 2.0, 3.0, 4.0, 5.0):
        torch.testing.assert_close(scale(x, k), (x * k).sin())  # a constant in a kernel: still right


@pytest.mark.allows_eager("the calls with an optimizer step leave the recording without one for its eager tail: what "
                          "it tests")
def test_an_optimizer_step_every_few_calls_costs_no_recording():
    """Gradient accumulation decided by Python state the guards cannot see: the call with the
    optimizer step leaves the recording only for its eager tail, and nothing is recorded again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def make_step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        calls = [0]

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y) / 4
            loss.backward()
            calls[0] += 1
            if calls[0] % 4 == 0:
                opt.step()
                opt.zero_grad()
            return loss.detach()
        return step
    eager_step, compiled = make_step(reference), compiler.compile(make_step(model), backend="interpret")
    for _ in range(16):
        torch.testing.assert_close(compiled(x, y), eager_step(x, y))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert compiled.stats["captures"] == 1 and compiled.stats["replays"] == 15
    assert compiled.stats["divergences"] == 4 and not compiled.disabled


@pytest.mark.allows_eager("a replay that leaves its recording (a per-call guard): what it tests")
def test_paths_taken_in_turn_are_each_recorded_and_switched_between():
    """Python state picks one of two paths after the backward, for a while each: each path is
    recorded once (after it is taken twice in a row), and a replay that starts on one
    recording goes on with the other where their calls part, without running eagerly."""
    base = torch.randn(6)
    phase = ["a"]

    def fn(x):
        loss = (x.sin() * 2).exp().sum()
        loss.backward()
        if phase[0] == "a":
            return loss.detach()
        return loss.detach() + (x.grad * x).sum()
    f = compiler.compile(fn, backend="interpret")
    for p in "aaabbbab":
        phase[0] = p
        torch.testing.assert_close(f(base.clone().requires_grad_()), fn(base.clone().requires_grad_()))
    assert f.stats["captures"] == 2
    divergences = f.stats["divergences"]
    for p in "abba":
        phase[0] = p
        torch.testing.assert_close(f(base.clone().requires_grad_()), fn(base.clone().requires_grad_()))
        assert f.last_backend == "interpret"  # went on with the other recording
    assert f.stats["captures"] == 2 and f.stats["divergences"] == divergences


@pytest.mark.allows_eager("a replay that leaves its recording (a per-call guard): what it tests")
def test_a_path_that_returns_an_intermediate_gets_its_real_value():
    """The recording kept h inside the kernels; a later call returns h itself (Python state
    the guards cannot see): the caller gets h's real value, never a placeholder."""
    x = torch.randn(6)
    state = {"full": False}

    def fn(x):
        h = (x.sin() * 2).exp()
        return h if state["full"] else h.sum()
    f = compiler.compile(fn, backend="interpret")
    f(x)
    f(x)
    state["full"] = True
    torch.testing.assert_close(f(x), (x.sin() * 2).exp())
