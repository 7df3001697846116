"""optimizer.step() inside a compiled training step: SGD, Adam and AdamW run as a few fused
kernels (compiler.optimizers), with eager's parameters, state and state_dict() after every
step; other optimizers run eagerly, with the reason in explain()."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import BACKENDS, KERNELS
from tests.parity import assert_ran_compiled

STEPS = 20
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=2e-6, atol=2e-7)}


def _model(dtype, layers=2):
    torch.manual_seed(0)
    mods = [torch.nn.Linear(6, 12), torch.nn.Tanh()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(12, 12), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(12, 3))
    return torch.nn.Sequential(*mods).to(dtype)


def training_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _batch(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g, dtype=dtype), torch.randn(16, 3, generator=g, dtype=dtype)


def _assert_same_state(eager_opt, ours_opt, tol):
    a, b = eager_opt.state_dict(), ours_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for name, value in state.items():
            other = b["state"][index][name]
            assert type(value) is type(other), name
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and value.device == other.device, name
                torch.testing.assert_close(other, value, **tol, msg=lambda m: f"state {index} {name}: {m}")
            else:
                assert value == other, name


def _versions(opt) -> dict:
    """(parameter's position, "param" or a state key) -> its version counter."""
    params = [p for group in opt.param_groups for p in group["params"]]
    out = {}
    for k, p in enumerate(params):
        out[k, "param"] = p._version
        if p.grad is not None:
            out[k, "grad"] = p.grad._version
        out.update({(k, name): t._version for name, t in opt.state.get(p, {}).items() if isinstance(t, torch.Tensor)})
    return out


def _assert_same_versions(eager_opt, ours_opt, i, start):
    """The fused kernels write where PyTorch cannot see: the step bumps the version counters as
    eager's in-place ops do, so a graph that saved a parameter fails its check after the step
    (``fused=True``'s kernels bump none, in eager and ours). Counted from ``start`` (the
    parameters' versions before the first step)."""
    eager, ours = ({key: v - begin.get(key, 0) for key, v in _versions(opt).items()}
                   for opt, begin in zip((eager_opt, ours_opt), start))
    assert ours == eager, f"step {i}: version counters {ours} vs eager's {eager}"


def _run_both(make_optimizer, dtype, steps=STEPS, layers=2, scheduler=None, between=None, backend="auto"):
    """The same training step, eager and compiled, from the same start; compares parameters and
    optimizer state after every step. Returns the compiled function and the optimizers; the
    compiled function's ``launches_per_step`` lists its optimizer launches in each step."""
    eager_model = _model(dtype, layers)
    ours_model = copy.deepcopy(eager_model)
    eager_opt, ours_opt = make_optimizer(eager_model.parameters()), make_optimizer(ours_model.parameters())
    schedulers = [scheduler(eager_opt), scheduler(ours_opt)] if scheduler else []
    step = compiler.compile(training_step, backend=backend)
    x, y = _batch(dtype)
    tol = TOLERANCE[dtype]
    step.launches_per_step = []
    start = [_versions(opt) for opt in (eager_opt, ours_opt)]  # (the parameters' only)
    for i in range(steps):
        if between:
            between(i, eager_model, eager_opt)
            between(i, ours_model, ours_opt)
        expected = training_step(eager_model, eager_opt, x, y)
        before = step.stats.get("optimizer_launches", 0)
        got = step(ours_model, ours_opt, x, y)
        step.launches_per_step.append(step.stats.get("optimizer_launches", 0) - before)
        torch.testing.assert_close(got, expected, **tol)
        for p, q in zip(eager_model.parameters(), ours_model.parameters()):
            torch.testing.assert_close(q, p, **tol, msg=lambda m: f"step {i}: {m}")
            # (after the step: foreach's nesterov step writes the gradients, the others do not)
            torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m: f"step {i}, gradient: {m}")
        _assert_same_state(eager_opt, ours_opt, tol)
        _assert_same_versions(eager_opt, ours_opt, i, start)
        for s in schedulers:
            s.step()
    assert_ran_compiled(step, backend=KERNELS if backend == "auto" else backend)
    return step, eager_opt, ours_opt


OPTIMIZERS = {
    "sgd": lambda p, **kw: torch.optim.SGD(p, lr=0.05, **kw),
    "sgd_momentum": lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, **kw),
    "sgd_nesterov": lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, **kw),
    "sgd_nesterov_decay": lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                          weight_decay=0.01, **kw),
    "sgd_dampening_maximize": lambda p, **kw: torch.optim.SGD(p, lr=0.01, momentum=0.5, dampening=0.3,
                                                              maximize=True, **kw),
    "adam": lambda p, **kw: torch.optim.Adam(p, lr=1e-2, **kw),
    "adam_decay_amsgrad": lambda p, **kw: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    "adamw": lambda p, **kw: torch.optim.AdamW(p, lr=1e-2, **kw),
    "adamw_maximize": lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, betas=(0.6, 0.9), weight_decay=0.05,
                                                        maximize=True, **kw),
}


# every optimizer in float64 (math), the common ones in float32 too (eager's rounding)
@pytest.mark.parametrize("name, dtype", [(name, torch.float64) for name in OPTIMIZERS]
                         + [(name, torch.float32) for name in ("sgd_momentum", "adamw", "adam_decay_amsgrad")])
@pytest.mark.parametrize("backend", ["auto"] + [b for b in BACKENDS if b == "cpp"])
def test_fused_step_tracks_eager_for_20_steps(name, dtype, backend):
    """(``cpp``: the update is a C++ function, ``compiler.optimizers.cpp_combo``, not a Triton kernel)"""
    step, _, _ = _run_both(OPTIMIZERS[name], dtype, backend=backend)
    assert step.stats["optimizer_launches"] >= STEPS - 4  # fused from the first replay on
    assert step.stats["captures"] <= 2  # (the first step creates the optimizer's state: one more)
    report = step.last_entry.report
    assert not report.fallbacks
    assert [k.phase for k in report.kernels].count("optimizer") == 1
    assert "[optimizer] optimizer_" in str(report)
    assert ("_cpp_" in str(report)) == (backend == "cpp")


@pytest.mark.parametrize("flags", [dict(foreach=True), dict(foreach=False), dict(fused=True)])
@pytest.mark.parametrize("name", ["sgd_momentum", "sgd_nesterov", "adamw"])
def test_foreach_and_fused_flags_give_eagers_numbers(name, flags):
    """(With foreach, eager's nesterov step is made in the gradients themselves: compared too.)"""
    step, _, _ = _run_both(lambda p: OPTIMIZERS[name](p, **flags), torch.float32, steps=8)
    assert step.stats["optimizer_launches"] >= 4


def test_lr_scheduler_changes_arguments_not_the_recording():
    def make(p):
        return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)

    def schedule(opt):  # a new lr every step
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9 ** i)

    step, _, ours = _run_both(make, torch.float32, scheduler=schedule)
    assert ours.param_groups[0]["lr"] != 1e-2
    assert step.stats["captures"] <= 2 and step.stats["divergences"] <= 2  # as without a scheduler
    assert step.stats["optimizer_launches"] >= STEPS - 4


def test_betas_and_momentum_changed_between_steps_are_read_each_step():
    def change(i, model, opt):
        for group in opt.param_groups:
            if "betas" in group:
                group["betas"] = (0.9 - 0.01 * i, 0.999)
            else:
                group["momentum"] = 0.9 - 0.02 * i
                group["dampening"] = 0.01 * i

    for name in ("adam", "sgd_momentum"):
        step, _, _ = _run_both(OPTIMIZERS[name], torch.float64, steps=10, between=change)
        assert step.stats["optimizer_launches"] >= 6


@pytest.mark.allows_eager("steps the fused kernels cannot take run eagerly: what it tests")
def test_steps_after_fused_ones_see_settings_and_gradients_changed_in_place(monkeypatch):
    """After a step checked in full, the fused step takes the next ones where the group's settings
    are the same objects and its tensors are as they were (one C++ check, ``GroupStep._bind_unchanged``).
    Each change is still seen: the learning rate changed (SGD's scalars, kept while the settings are
    the same objects, read again), ``maximize`` set for one step (another kernel: that step runs
    eagerly), a gradient made non-contiguous or a negative view by a hook (eagerly too), ``betas`` a
    list changed in place (a mutable setting: every step checked in full). Values stay eager's at
    every step (``_run_both``), and the quick check is taken where nothing changed."""
    from runtime.optimizer_step import GroupStep

    quick = []   # per quick check: whether it stood for the full one
    original = GroupStep._bind_unchanged

    def spied(self, *args):
        bound = original(self, *args)
        quick.append(bound is not None)
        return bound

    monkeypatch.setattr(GroupStep, "_bind_unchanged", spied)
    hooks = {}

    def change(i, model, opt):
        group = opt.param_groups[0]
        if i == 6:
            group["lr"] = 0.02
        group["maximize"] = i == 13
        if i in (8, 11):   # (removed after one step: the steps after it take the quick check again)
            make = (lambda p: p.grad.t().contiguous().t()) if i == 8 else (lambda p: torch._neg_view(-p.grad))
            hooks[id(opt)] = model[0].weight.register_post_accumulate_grad_hook(
                lambda p: setattr(p, "grad", make(p)))
        if i in (9, 12):
            hooks.pop(id(opt)).remove()

    step, _, ours = _run_both(OPTIMIZERS["sgd_momentum"], torch.float64, steps=17, between=change)
    assert ours.param_groups[0]["lr"] == 0.02
    assert sum(quick) >= 8 and step.launches_per_step[-3:] == [1, 1, 1]
    assert [step.launches_per_step[i] for i in (8, 11, 13)] == [0, 0, 0]   # (those steps: eager)

    def as_list(i, model, opt):   # (torch's Adam reads any pair)
        group = opt.param_groups[0]
        if i == 0:
            group["betas"] = [0.9, 0.999]
        group["betas"][0] = 0.9 - 0.02 * i

    quick.clear()
    step, _, _ = _run_both(OPTIMIZERS["adam"], torch.float64, steps=8, between=as_list)
    assert not any(quick) and step.stats["optimizer_launches"] >= 6


def test_an_optimizer_step_is_a_few_launches_not_one_per_parameter():
    """A 12-linear-layer MLP: 24 parameters, each of which eager updates with several ops; the
    fused step is one launch (32 parameters per kernel), whatever the optimizer."""
    for name in ("adamw", "sgd_momentum"):
        step, _, ours = _run_both(OPTIMIZERS[name], torch.float32, steps=8, layers=12)
        assert len(ours.param_groups[0]["params"]) == 24
        assert step.launches_per_step[-3:] == [1, 1, 1]
        report = step.last_entry.report
        assert [k.phase for k in report.kernels].count("optimizer") == 1


def step_then_zero_grad(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()  # the gradients are gone (None) when the call returns and the step is compiled
    return loss


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_gradients_zeroed_after_the_step_still_fuse_it(name):
    eager_model = _model(torch.float32)
    ours_model = copy.deepcopy(eager_model)
    eager_opt, ours_opt = OPTIMIZERS[name](eager_model.parameters()), OPTIMIZERS[name](ours_model.parameters())
    step = compiler.compile(step_then_zero_grad)
    x, y = _batch(torch.float32)
    for _ in range(6):
        before = step.stats.get("optimizer_launches", 0)
        step_then_zero_grad(eager_model, eager_opt, x, y)
        step(ours_model, ours_opt, x, y)
    assert step.stats["optimizer_launches"] - before == 1
    for p, q in zip(eager_model.parameters(), ours_model.parameters()):
        torch.testing.assert_close(q, p, **TOLERANCE[torch.float32])
    _assert_same_state(eager_opt, ours_opt, TOLERANCE[torch.float32])


def test_parameter_groups_and_dtypes_each_get_their_kernels():
    """Two groups (one with its own lr) of 40 parameters: a launch per group and 32 parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)]).double()
    params = list(model.parameters())

    def make(p):
        p = list(p)
        return torch.optim.SGD([{"params": p[:34]}, {"params": p[34:], "lr": 0.01}], lr=0.05, momentum=0.9)

    eager_model, ours_model = model, copy.deepcopy(model)
    eager_opt, ours_opt = make(eager_model.parameters()), make(ours_model.parameters())
    step = compiler.compile(lambda m, o, x: training_step(m, o, x, x))
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(6):
        before = dict(step.stats)
        training_step(eager_model, eager_opt, x, x)
        step(ours_model, ours_opt, x)
    assert len(params) == 40
    assert step.stats["optimizer_launches"] - before.get("optimizer_launches", 0) == 3  # 32 + 2, then 6
    for p, q in zip(eager_model.parameters(), ours_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14)
    _assert_same_state(eager_opt, ours_opt, TOLERANCE[torch.float64])


class MySGD(torch.optim.SGD):
    pass


@pytest.mark.parametrize("make, why", [
    (lambda p: torch.optim.RMSprop(p, lr=1e-2), "RMSprop is not an optimizer the compiler fuses"),
    (lambda p: MySGD(p, lr=0.05, momentum=0.9), "MySGD is not an optimizer the compiler fuses"),
    (lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2)), "lr is a Tensor"),
])
@pytest.mark.allows_eager("an optimizer step that runs eagerly, with its reason: what it tests")
def test_an_optimizer_not_fused_runs_eagerly_with_its_reason(make, why, caplog):
    with caplog.at_level(logging.WARNING, logger="compiler"):
        step, _, _ = _run_both(make, torch.float64, steps=6)
    assert step.stats.get("optimizer_launches", 0) == 0
    fallbacks = step.last_entry.report.fallbacks
    assert any("optimizer.step()" in r and why in r for r in fallbacks), fallbacks


@pytest.mark.allows_eager("an optimizer step that runs eagerly, with its reason: what it tests")
def test_half_precision_parameters_run_eagerly_with_the_reason():
    model = _model(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(torch.bfloat16)
    report = compiler.explain(training_step, model, opt, x, y)
    assert any("torch.bfloat16" in r and "optimizer.step()" in r for r in report.fallbacks), report.fallbacks


def test_a_step_that_is_not_the_compiled_one_runs_eagerly():
    """A layer frozen (no gradient) for a few steps, then its state loaded back from a
    checkpoint: those steps do not match the compiled one and run eagerly, and every value
    stays eager's."""
    checkpoint = {}

    def between(i, model, opt):
        model[0].weight.requires_grad_(not 8 <= i < 11)
        if i == 5:
            checkpoint[id(opt)] = copy.deepcopy(opt.state_dict())
        if i == 14:
            opt.load_state_dict(checkpoint[id(opt)])

    step, _, _ = _run_both(OPTIMIZERS["adam"], torch.float64, between=between)
    assert step.stats["optimizer_launches"] >= 8


@pytest.mark.allows_eager("an optimizer step that runs eagerly, with its reason: what it tests")
def test_a_closure_runs_the_step_eagerly():
    model = _model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _batch(torch.float64)

    def with_closure(model, opt, x, y):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        return opt.step(closure)

    report = compiler.explain(with_closure, model, opt, x, y)
    assert any("closure" in r for r in report.fallbacks), report.fallbacks


def test_optimizer_kernels_compile_for_hopper_without_spills():
    """The combo kernels of the richest settings (Adam with weight decay and amsgrad in fp32,
    SGD with nesterov momentum in fp64, and foreach's, which stores the gradient, in fp32), 32
    parameters each, compile for sm_90 with their real
    specialization (aligned pointers) and do not spill; whole blocks load in vectors (all loads
    when every size is a multiple of the vector width, as Linear layers' are). So do
    clip_grad_norm_'s three kernels for the 2-norm over 32 gradients (tests/test_clip_grad.py
    runs them; compiled here, in the same worker processes, to keep the suite's time down)."""
    from benchmarks.sm90 import Launch, compile_launches
    from compiler.optimizers import _fuse, _gradient_facts, clip
    from compiler.optimizers.combo import BLOCK, MAX_PARAMETERS, NUM_WARPS

    launches = []
    linear_sizes = [64 * 64 if i % 2 else 64 for i in range(MAX_PARAMETERS)]
    odd_sizes = [3000 + i for i in range(MAX_PARAMETERS)]
    for make, dtype, sizes in [
            (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True), torch.float32, linear_sizes),
            (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), torch.float64,
             odd_sizes),
            # (foreach's nesterov step also stores the gradient)
            (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True), torch.float32,
             linear_sizes)]:
        params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]
        opt = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # (eager: creates the state the kernels update)
        grads = [[_gradient_facts(p) for p in group["params"]] for group in opt.param_groups]
        (group_step,) = _fuse(opt, False, grads, None).groups
        (combo,) = group_step.launches
        tensors = 2 + len(group_step.state_names)  # parameter, gradient, state
        values = group_step.rule.scalars(opt.param_groups[0], 1, dtype)
        args = [["ptr", str(dtype), 0]] * (tensors * MAX_PARAMETERS) + [["int", values[n]] for n in combo.scalar_names]
        launches.append(Launch(combo.name, combo.source, args, {"BLOCK": combo.block}, combo.num_warps, combo.grid))
    pointer = ["ptr", "torch.float32", 0]
    partials = clip.partials_source(2.0, torch.float32, linear_sizes)
    finalize = clip.finalize_source(2.0, torch.float32, MAX_PARAMETERS)
    scale = clip.scale_source(torch.float32, linear_sizes)
    launches += [
        Launch(partials[0], partials[1], [pointer] * (MAX_PARAMETERS + 1), {"BLOCK": BLOCK}, NUM_WARPS, partials[2]),
        Launch(scale[0], scale[1], [pointer] * (MAX_PARAMETERS + 1), {"BLOCK": BLOCK}, NUM_WARPS, scale[2]),
        Launch(finalize[0], finalize[1], [pointer, ["ptr", "torch.int32", 0], pointer, pointer, ["int", 1.0],
                                          ["int", 1e-6]], {"BLOCK": BLOCK}, NUM_WARPS, 1)]
    results = compile_launches(launches)
    for launch, result in zip(launches, results):
        assert result["error"] is None, (launch.name, result["error"])
        assert result["spill_bytes"] == 0, (launch.name, result)
    for launch, result in zip(launches[:-1], results):  # (the finalize kernel reads one partial per block)
        assert result["vector_loads"] > 0, (launch.name, result)
    assert "tl.store(g_ptr" in launches[2].source
    assert results[0]["vector_share"] == 1.0 and results[3]["vector_share"] == 1.0, results


@pytest.mark.allows_eager("an optimizer step that runs eagerly, with its reason: what it tests")
def test_an_optimizer_made_inside_the_function_runs_eagerly_and_records_once():
    """A new optimizer each call cannot have a compiled step; noting its step must not keep it
    (and its parameters) alive past the call, or each call would record again."""
    def fn(x):
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(x).pow(2).sum().backward()
        opt.step()
        return model.weight.detach().clone()

    step = compiler.compile(fn)
    x = torch.randn(3, 4)
    for _ in range(3):
        torch.manual_seed(0)
        expected = fn(x)
        torch.manual_seed(0)
        torch.testing.assert_close(step(x), expected)
    assert step.stats["captures"] == 1 and step.stats["replays"] == 2, step.stats
    assert any("made inside the function" in r for r in step.last_entry.report.fallbacks)


@pytest.mark.parametrize("name", ["sgd_nesterov_decay", "adam_decay_amsgrad"])
def test_complex_parameters_are_updated_as_their_real_views(name):
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.complex128)
    eager_w, ours_w = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    eager_opt, ours_opt = OPTIMIZERS[name]([eager_w]), OPTIMIZERS[name]([ours_w])
    x = torch.randn(4, 5, dtype=torch.complex128)

    def fn(w, opt, x):
        opt.zero_grad()
        loss = (x @ w).abs().pow(2).sum()
        loss.backward()
        opt.step()
        return loss

    step = compiler.compile(fn)
    for _ in range(8):
        fn(eager_w, eager_opt, x)
        step(ours_w, ours_opt, x)
        torch.testing.assert_close(ours_w, eager_w, **TOLERANCE[torch.float64])
    _assert_same_state(eager_opt, ours_opt, TOLERANCE[torch.float64])
    assert step.stats["optimizer_launches"] >= 4 and not step.last_entry.report.fallbacks


def test_a_graph_that_saved_a_parameter_fails_its_version_check_after_the_step():
    """A graph made before the fused step and backpropagated after it read the parameter the
    step wrote: eager raises; so must we (the kernels write unseen; the step bumps versions)."""
    x, y = _batch(torch.float32)

    def step_then_late_backward(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
        return loss

    model = _model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = compiler.compile(step_then_late_backward)
    for _ in range(4):
        loss = step(model, opt, x, y)
    assert step.stats["optimizer_launches"] >= 1   # (the second step, before the hook)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.allows_eager("a step whose gradients are lazy views runs eagerly: what it tests")
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_gradients_that_are_negative_or_conjugate_views_give_eagers_step(dtype):
    """A gradient replaced by a hook with a view PyTorch negates or conjugates lazily (a bit on
    the tensor: the memory holds -g, or conj(g)): the fused step reads memory by address, so such
    a step runs eagerly, and every value stays eager's. The fused clip_grad_norm_ does the same:
    eager's raises on such gradients (its foreach kernels refuse them), and so does ours."""
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=dtype)
    x = torch.randn(4, 5, dtype=dtype)

    def lazy(p):   # the same value, its memory negated (or conjugated) under the view's bit
        p.grad = torch.conj(p.grad.conj_physical()) if dtype.is_complex else torch._neg_view(-p.grad)

    def fn(w, opt, x, clip=False):
        opt.zero_grad()
        loss = (x @ w).abs().pow(2).sum()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()
        return loss

    def outcome(call, *args):   # (eager's Adam refuses a conjugate gradient: ours must too)
        try:
            call(*args)
        except RuntimeError as e:
            return str(e)
        return None

    params = [torch.nn.Parameter(w.clone()) for _ in range(2)]
    opts = [torch.optim.Adam([p], lr=0.1) for p in params]
    step = compiler.compile(fn)
    for i in range(6):
        for p in params:   # (from the third step on: the compiled step has run as recorded before)
            if i == 2:
                p.register_post_accumulate_grad_hook(lazy)
        assert outcome(step, params[1], opts[1], x) == outcome(fn, params[0], opts[0], x)
        torch.testing.assert_close(params[1], params[0], **TOLERANCE[torch.float64])
    _assert_same_state(opts[0], opts[1], TOLERANCE[torch.float64])
    assert step.stats["optimizer_launches"] >= 1   # (the second step, before the hook)

    clipped = compiler.compile(fn)
    plain = [torch.nn.Parameter(w.clone()) for _ in range(2)]
    for p, opt in zip(plain, [torch.optim.Adam([p], lr=0.1) for p in plain]):
        clipped(p, opt, x, True)   # (recorded and replayed with plain gradients: the fused clip)
        clipped(p, opt, x, True)
        p.register_post_accumulate_grad_hook(lazy)
        with pytest.raises(RuntimeError) as ours:
            clipped(p, opt, x, True)
        with pytest.raises(RuntimeError) as eager:
            fn(p, opt, x, True)
        assert str(ours.value) == str(eager.value)
        break
