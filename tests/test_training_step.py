"""A whole training step under @compile — forward, loss.backward(), optimizer.step() —
tracks eager PyTorch's losses and parameters step for step."""

import copy

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import BACKENDS, KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from tests.training import sgd_step, train_step


def make_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adamw"])
@pytest.mark.parametrize("backend", [KERNELS] + [b for b in BACKENDS if b != KERNELS])
def test_compiled_training_step_tracks_eager(dtype, optimizer, backend):
    model = make_model(dtype)
    reference = copy.deepcopy(model)

    def make_opt(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05)
        if optimizer == "sgd_momentum":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())

    compiled = compiler.compile(train_step, backend=backend)
    x = torch.randn(64, 8, dtype=dtype)
    y = torch.randn(64, 1, dtype=dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    for _ in range(5):
        loss = compiled(model, opt, x, y)
        ref_loss = train_step(reference, ref_opt, x, y)
        torch.testing.assert_close(loss, ref_loss, **tol)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, **tol)
            assert p.grad is None  # zero_grad(set_to_none=True) as in eager
    # an optimizer's first step differs (it creates its state): at most one more recording
    assert compiled.stats["captures"] <= 2
    assert compiled.stats["replays"] >= 3
    assert compiled.stats["kernel_launches"] >= 4 * 4  # forward and backward kernels each step
    assert compiled.last_backend == backend
    report = compiler.explain(compiled, model, opt, x, y)
    assert report.fallbacks == []
    assert "Tensor.backward" in report.eager_calls


def test_backward_outside_the_compiled_function_accumulates_grad():
    model = make_model(torch.float64)
    reference = copy.deepcopy(model)
    forward = compiler.compile(lambda x, y: F.mse_loss(model(x), y), backend=KERNELS)
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    for _ in range(3):  # .grad accumulates across backward calls, exactly as in eager
        forward(x, y).backward()
        F.mse_loss(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_loss_returned_has_grad_fn_and_second_backward_raises():
    w = torch.randn(5, requires_grad=True)
    f = compiler.compile(lambda x: (x * w).sin().sum(), backend=KERNELS)
    x = torch.randn(5)
    f(x)
    loss = f(x)
    assert loss.grad_fn is not None
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_profiler_around_a_compiled_step_stays_on_the_recording():
    """torch.profiler(with_stack=True) reads parameters' .grad from Python: extra reads of
    autograd state change nothing, so the replay lets them through."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    step = compiler.compile(sgd_step(model, lr=0.1), backend=KERNELS)
    for _ in range(3):
        step(x, y)
    with torch.profiler.profile(with_stack=True):
        for _ in range(2):
            step(x, y)
    assert step.stats["divergences"] == 0 and step.last_backend == KERNELS


def test_autocast_training_step_compiles_whole_and_tracks_eager():
    """Under torch.autocast eager casts each op's inputs (matmuls to bfloat16, mixed-dtype
    ops to a common one); the compiled graph makes the same casts, so nothing falls back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    x, target = torch.randn(64, 16), torch.randint(0, 4, (64,))

    def make_step(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, target):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    eager_step, compiled_step = make_step(reference), compiler.compile(make_step(model), backend=KERNELS)
    initial = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        torch.testing.assert_close(compiled_step(x, target), eager_step(x, target), rtol=1e-2, atol=1e-2)
    assert compiled_step.last_backend == KERNELS and compiled_step.last_entry.report.fallbacks == []
    assert compiled_step.stats["kernel_launches"] > 0 and compiled_step.stats["divergences"] == 0, compiled_step.stats
    for p, q, p0 in zip(model.parameters(), reference.parameters(), initial):
        # NOTE: the parameters were updated, and as eager updated them (float32 master weights: the
        # bfloat16 rounding, fused vs op by op, leaves a difference far below the update's size)
        assert (p - p0).abs().max() > 1e-3
        torch.testing.assert_close(p - p0, q - p0, rtol=0, atol=5e-4)  # (seen: 1.5e-4 at most; updates 1.7e-3+)

    f = compiler.compile(lambda x: model(x).sum(), backend=KERNELS)
    for autocast in (False, True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = f(x)
            out = f(x)
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert f.stats["captures"] == 2  # autocast on and off: one recording each


@pytest.mark.allows_eager("Adam's first step creates its state: the next calls leave the recording until that path is "
                          "recorded")
def test_optimizer_step_runs_unwatched_and_its_state_stays_right():
    """optimizer.step() is all eager calls: the replay lets it run without checking each call.
    Values it makes (Adam's moments) read by the function afterwards still give eager's results,
    and a step that raises leaves the replay machinery in order."""
    torch.manual_seed(0)
    modes_before = torch._C._len_torch_function_stack()
    model = torch.nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def make_step(model):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            moment = opt.state[model.weight]["exp_avg"]
            return loss.detach() + (moment * 0).sum() + moment.abs().sum()
        return step, opt
    (eager_step, _), (step, opt) = make_step(reference), make_step(model)
    compiled = compiler.compile(step, backend=KERNELS)
    for _ in range(6):  # the first step creates Adam's state: its path is recorded again
        torch.testing.assert_close(compiled(x, y), eager_step(x, y))
    assert compiled.last_backend == KERNELS

    def failing_hook(optimizer, args, kwargs):
        raise RuntimeError("hook failed")
    handle = opt.register_step_pre_hook(failing_hook)
    with pytest.raises(RuntimeError, match="hook failed"):
        compiled(x, y)
    handle.remove()
    assert torch._C._len_torch_function_stack() == modes_before   # (the CUDA test mode's default device: one)
    model.zero_grad()
    # the step whose hook raised changed no parameter (as eager's), and the next compiled steps are
    # eager's next steps, with kernels
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    launches = compiled.stats["kernel_launches"]
    for _ in range(2):
        torch.testing.assert_close(compiled(x, y), eager_step(x, y))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert compiled.last_backend == KERNELS and compiled.stats["kernel_launches"] > launches


@pytest.mark.parametrize("backend", [KERNELS] + [b for b in BACKENDS if b != KERNELS])
def test_cnn_training_step_with_batch_norm_tracks_eager(backend):
    """Conv, BatchNorm (batch statistics, running statistics updated in place), ReLU, Linear,
    SGD with momentum: compiled whole; parameters and every buffer equal eager's, in training
    and then in eval mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, stride=2), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(36, 2)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)

    eager_step = sgd_step(reference, lr=0.05, momentum=0.9)
    compiled = compiler.compile(sgd_step(model, lr=0.05, momentum=0.9), backend=backend)
    for _ in range(5):
        torch.testing.assert_close(compiled(x, y), eager_step(x, y))
    assert compiled.last_backend == backend and compiled.last_entry.report.fallbacks == []
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(mine, theirs, msg=name)
    model.eval()
    reference.eval()
    forward = compiler.compile(lambda x: model(x), backend=KERNELS)
    forward(x)
    torch.testing.assert_close(forward(x), reference(x))
    assert forward.last_backend == KERNELS
