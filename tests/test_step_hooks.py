"""Optimizer step hooks around a fused optimizer step: eager's ``step()`` runs every pre-hook
(global ones, then the optimizer's own) before its update, and the update must see what they did
(issue 32: the fused update ran from the replay's global pre-hook, first of all, so a hook
registered after the recording saw the parameters already updated, a hook that zeroed or scaled
the gradients was ignored, and one that raised left the parameters updated)."""

import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from tests.training import train_step

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def _twins(optimizer):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    make = OPTIMIZERS[optimizer]
    return (model, make(model.parameters())), (reference, make(reference.parameters()))


def _step(model, opt):
    return lambda x, y: train_step(model, opt, x, y).detach()


def _data(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _same(model, reference):
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _scale_grads(log, name):
    def hook(opt, args, kwargs):
        log.append((name, [p.detach().clone() for group in opt.param_groups for p in group["params"]]))
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.mul_(0.5)
    return hook


@pytest.mark.parametrize("skip_python", [False, True])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_pre_hooks_registered_after_the_recording_run_before_the_update(optimizer, skip_python):
    (model, opt), (reference, eager_opt) = _twins(optimizer)
    compiled = compiler.compile(_step(model, opt), backend=KERNELS, skip_python=skip_python)
    eager = _step(reference, eager_opt)
    for k in range(3):
        torch.testing.assert_close(compiled(*_data(k)), eager(*_data(k)))
    ours, theirs = [], []
    handles = [opt.register_step_pre_hook(_scale_grads(ours, "own")),
               eager_opt.register_step_pre_hook(_scale_grads(theirs, "own"))]
    launches = compiled.stats["kernel_launches"]
    for k in range(3, 6):
        torch.testing.assert_close(compiled(*_data(k)), eager(*_data(k)))
        _same(model, reference)
    # the hook saw the parameters before each update (and halved the gradients the update used)
    assert [name for name, _ in ours] == [name for name, _ in theirs] == ["own"] * 3
    for (_, seen), (_, expected) in zip(ours, theirs):
        for a, b in zip(seen, expected):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert compiled.stats["kernel_launches"] > launches and compiled.stats["divergences"] == 0, compiled.stats
    assert compiled.stats.get("optimizer_launches", 0) > 0, "the step was not the fused one"
    for h in handles:
        h.remove()


def test_a_global_pre_hook_registered_after_the_recording_runs_before_the_update():
    (model, opt), (reference, eager_opt) = _twins("sgd-momentum")
    compiled, eager = compiler.compile(_step(model, opt), backend=KERNELS), _step(reference, eager_opt)
    for k in range(3):
        compiled(*_data(k)), eager(*_data(k))
    log = []
    handle = register_optimizer_step_pre_hook(_scale_grads(log, "global"))
    try:
        for k in range(3, 5):
            torch.testing.assert_close(compiled(*_data(k)), eager(*_data(k)))
            _same(model, reference)
    finally:
        handle.remove()
    assert len(log) == 4 and compiled.stats["divergences"] == 0


def test_a_pre_hook_that_raises_leaves_the_parameters_as_they_were():
    (model, opt), (reference, eager_opt) = _twins("adamw")
    compiled, eager = compiler.compile(_step(model, opt), backend=KERNELS), _step(reference, eager_opt)
    for k in range(3):
        compiled(*_data(k)), eager(*_data(k))

    def refuse(opt, args, kwargs):
        raise ValueError("no step now")
    handles = [opt.register_step_pre_hook(refuse), eager_opt.register_step_pre_hook(refuse)]
    for run in (compiled, eager):
        with pytest.raises(ValueError, match="no step now"):
            run(*_data(3))
    _same(model, reference)
    for name, (a, b) in enumerate(zip(opt.state.values(), eager_opt.state.values())):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], msg=str(name))
    for h in handles:
        h.remove()
    # later steps: eager's, and the one the raise left pending is never made
    model.zero_grad(), reference.zero_grad()
    for k in range(4, 6):
        torch.testing.assert_close(compiled(*_data(k)), eager(*_data(k)))
        _same(model, reference)
    eager_opt.step(), opt.step()  # (no gradients: eager steps outside the compiled function change nothing)
    _same(model, reference)
