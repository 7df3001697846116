"""torch.nn.utils.clip_grad_norm_ inside a compiled training step: three fused launches per call
(compiler.optimizers.clip: per-block partial norms, the total norm and clip coefficient, the
scaling), with eager's total norm and parameters, eager's error for a non-finite norm, and
the calls it does not cover running eagerly with the reason in explain()."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import BACKENDS, KERNELS
from tests.parity import assert_ran_compiled

STEPS = 6
MAX_NORM = {2.0: 5.0, math.inf: 1.0, 1.0: 50.0, 3.0: 5.0}  # between the steps' norms (see _batches)
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=2e-6, atol=2e-7)}


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(dtype)


def _step(norm_type=2.0, error_if_nonfinite=False, foreach=None):
    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM[norm_type], norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        opt.step()
        return loss.detach(), norm
    return step


def _batches(dtype, steps=STEPS):
    """Targets scaled so the gradients' norm is over MAX_NORM on odd steps, under it on even ones."""
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, 6, generator=g, dtype=dtype)
        y = torch.randn(16, 3, generator=g, dtype=dtype) * (10.0 if i % 2 else 0.05)
        yield x, y


def _run_both(step, dtype, batches, norm_type=2.0, backend="auto"):
    """Eager and compiled from the same start, compared after every step; returns the compiled
    function and, per step, whether eager's call clipped. ``compiled.launches_per_step``: the
    fused clip launches of each step."""
    eager_model = _model(dtype)
    ours_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9)
    compiled = compiler.compile(step, backend=backend)
    tol = TOLERANCE[dtype]
    clipped = []
    compiled.launches_per_step = []
    for i, (x, y) in enumerate(batches):
        expected_loss, expected_norm = step(eager_model, eager_opt, x, y)
        before = compiled.stats.get("clip_launches", 0)
        loss, norm = compiled(ours_model, ours_opt, x, y)
        compiled.launches_per_step.append(compiled.stats.get("clip_launches", 0) - before)
        torch.testing.assert_close(loss, expected_loss, **tol)
        torch.testing.assert_close(norm, expected_norm, **tol, msg=lambda m: f"step {i}: {m}")
        assert norm.dtype == expected_norm.dtype and norm.shape == () and not norm.requires_grad
        for p, q in zip(eager_model.parameters(), ours_model.parameters()):
            torch.testing.assert_close(q, p, **tol, msg=lambda m: f"step {i}: {m}")
            torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m: f"step {i}: {m}")
            # (the scaling kernels write unseen: the gradients' versions move as eager's mul_)
            assert q.grad._version == p.grad._version, f"step {i}: gradient versions"
        clipped.append(expected_norm.item() > MAX_NORM[norm_type])
    assert_ran_compiled(compiled, backend=KERNELS if backend == "auto" else backend)
    return compiled, clipped


@pytest.mark.parametrize("norm_type,dtype", [(2.0, torch.float32), (2.0, torch.float64),
                                             (math.inf, torch.float32), (1.0, torch.float64)])
@pytest.mark.parametrize("backend", ["auto"] + [b for b in BACKENDS if b == "cpp"])
def test_clip_grad_norm_runs_fused_with_eagers_values(norm_type, dtype, backend):
    """(``cpp``: two C++ functions, the norm with the coefficient and the scaling,
    ``compiler.optimizers.cpp_combo.cpp_clip_sources``)"""
    compiled, clipped = _run_both(_step(norm_type), dtype, _batches(dtype), norm_type, backend)
    assert clipped == [False, True] * (STEPS // 2)  # clipping active on some steps, not on others
    # 4 gradients: one launch each for the partial norms, the total, the scaling (once the
    # recording settled: the first steps record, and meet gradients created, then zeroed)
    calls = 2 if backend == "cpp" else 3
    assert compiled.launches_per_step[-2:] == [calls, calls], compiled.launches_per_step
    report = compiled.last_entry.report
    assert report.fallbacks == []
    names = [k.name for k in report.kernels if k.phase == "optimizer"]
    assert sum(n.startswith("optimizer_clip_") and (("_cpp_" in n) == (backend == "cpp")) for n in names) == calls, \
        names
    for op in ("torch._foreach_norm", "linalg_vector_norm", "torch.stack", "torch.clamp", "torch._foreach_mul_"):
        assert op not in report.eager_calls, report.eager_calls


def test_foreach_false_gives_eagers_values_fused():
    compiled, _ = _run_both(_step(foreach=False), torch.float32, _batches(torch.float32))
    assert compiled.launches_per_step[-2:] == [3, 3], compiled.launches_per_step


@pytest.mark.parametrize("backend", ["auto"] + [b for b in BACKENDS if b == "cpp"])
def test_non_finite_norm_raises_eagers_error_with_gradients_unchanged(backend):
    step = _step(error_if_nonfinite=True)
    eager_model, ours_model = _model(torch.float32), _model(torch.float32)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1)
    compiled = compiler.compile(step, backend=backend)
    batches = list(_batches(torch.float32))
    for x, y in batches[:-1]:  # recorded, then replayed with the clip fused
        step(eager_model, eager_opt, x, y)
        compiled(ours_model, ours_opt, x, y)
    launches = compiled.stats.get("clip_launches", 0)
    assert launches > 0  # error_if_nonfinite=True compiles too
    x, y = batches[-1]
    x = x.clone()
    x[0, 0] = float("inf")
    with pytest.raises(RuntimeError) as eager_error:
        step(eager_model, eager_opt, x, y)
    with pytest.raises(RuntimeError) as our_error:
        compiled(ours_model, ours_opt, x, y)
    assert str(our_error.value) == str(eager_error.value)
    assert "non-finite" in str(our_error.value)
    # the fused call raised it, before its scaling (C++: the norm's one function)
    assert compiled.stats["clip_launches"] == launches + (1 if backend == "cpp" else 2)
    for p, q in zip(eager_model.parameters(), ours_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, equal_nan=True)  # left unscaled, as eager leaves them
        torch.testing.assert_close(q, p)


@pytest.mark.parametrize("norm_type,why", [(3.0, "norm_type=3.0 (fused for 1, 2 and inf)")])
@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_a_call_not_covered_runs_eagerly_with_the_reason(norm_type, why):
    compiled, _ = _run_both(_step(norm_type), torch.float32, _batches(torch.float32, steps=3), norm_type)
    assert compiled.stats.get("clip_launches", 0) == 0
    assert compiled.last_entry.report.fallbacks == [f"clip_grad_norm_ runs eagerly: {why}"]


@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_half_precision_gradients_run_eagerly_with_the_reason():
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(_batches(torch.bfloat16))
    report = compiler.explain(_step(), model, opt, x, y)
    assert any(f.startswith("clip_grad_norm_ runs eagerly: its gradients are torch.bfloat16") for f in report.fallbacks)


def test_other_parameters_than_recorded_run_the_call_eagerly():
    """The plan is for the recorded parameters: a call given others (or a gradient gone) runs
    PyTorch's own function, replayed op by op, with eager's values."""
    def step(params, x):
        for p in params:
            p.grad = None
        (x * params[0]).sum().backward()
        return torch.nn.utils.clip_grad_norm_(params, 0.5)

    first = [torch.randn(30, requires_grad=True), torch.randn(30, requires_grad=True)]
    compiled = compiler.compile(step)
    x = torch.randn(30)
    for _ in range(3):
        compiled(first, x)
    launches = compiled.stats["clip_launches"]
    assert launches > 0
    params = [first[0].detach().clone().requires_grad_(), first[1].detach().clone().requires_grad_()]
    eager_params = [p.detach().clone().requires_grad_() for p in params]
    norm = compiled(params, x)
    expected = step(eager_params, x)
    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(params[0].grad, eager_params[0].grad)
    assert compiled.stats["clip_launches"] == launches


def test_outside_a_compiled_function_clip_grad_norm_is_pytorchs():
    """``import compiler`` puts a stand-in at torch.nn.utils.clip_grad_norm_: outside a compiled
    function it is PyTorch's function (name, docstring, values, warnings)."""
    import torch.nn.utils.clip_grad as clip_grad

    assert torch.nn.utils.clip_grad_norm_.__name__ == "clip_grad_norm_"
    assert "Clip the gradient norm" in torch.nn.utils.clip_grad_norm_.__doc__
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    assert torch.nn.utils.clip_grad_norm_(p, 1.0).item() == 4.0
    torch.testing.assert_close(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))
    with pytest.warns(UserWarning, match="empty generator"):
        clip_grad.clip_grad_norm_((q for q in []), 1.0)

