"""Under torch.profiler / torch.autograd.profiler.profile, each compiled region's forward and
backward and each kernel appear by name with the user ops they fused; with no profiler on,
the replay records nothing."""

import pytest
import torch

import compiler
from runtime.program import Program


def _step():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    @compiler.compile(backend="interpret")
    def step(x):
        loss = torch.nn.functional.gelu(lin(x)).softmax(-1).sum()
        loss.backward()
        return loss
    return step


@pytest.mark.parametrize("profiler", ["torch.profiler", "torch.autograd.profiler"])
def test_profile_of_a_compiled_step_names_regions_and_kernels(profiler):
    step = _step()
    x = torch.randn(4, 8, requires_grad=True)
    step(x)  # recorded (eager)
    make = torch.profiler.profile if profiler == "torch.profiler" else torch.autograd.profiler.profile
    with make() as prof:
        step(x)  # replayed: forward and backward kernels
    names = [e.key for e in prof.key_averages()]
    report = step.last_entry.report
    name = step.fn.__qualname__  # _step.<locals>.step
    assert f"symgrad {name} region 0 forward [linear, gelu, Tensor.softmax, Tensor.sum]" in names
    assert f"symgrad {name} region 0 backward [linear, gelu, Tensor.softmax, Tensor.sum]" in names
    for kernel in report.kernels:
        matching = [n for n in names if n.startswith(f"symgrad kernel {kernel.name} [")]
        assert len(matching) == 1, (kernel.name, names)
        assert all(op in matching[0] for op in kernel.op_names)  # the user ops it fused
    assert any("gelu" in k.op_names and "Tensor.softmax" in k.op_names for k in report.forward_kernels)


def test_no_profiler_no_ranges(monkeypatch):
    step = _step()
    x = torch.randn(4, 8, requires_grad=True)
    step(x)

    def refuse(*args, **kwargs):
        raise AssertionError("profiled run without a profiler")
    monkeypatch.setattr(Program, "_run_profiled", refuse)
    step(x)  # a replay (forward and backward programs) takes the plain path
    assert step.stats["replays"] == 1 and step.stats["kernel_launches"] > 0


def test_fused_optimizer_and_clip_kernels_appear_by_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    @compiler.compile(backend="interpret")
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss
    x = torch.randn(4, 8)
    for _ in range(3):  # recorded, then the optimizer's first step (its state made), then replays
        step(x)
    with torch.profiler.profile() as prof:
        step(x)
    assert step.stats["optimizer_launches"] > 0
    names = [e.key for e in prof.key_averages()]
    adam = [n for n in names if n.startswith("symgrad kernel ") and "[Adam.step, " in n]
    clip = [n for n in names if n.startswith("symgrad kernel ") and "[clip_grad_norm_, " in n]
    assert adam and clip, names
    assert all(n.endswith(" tensors]") for n in adam + clip)


def test_a_profiler_range_inside_the_math_does_not_cut_its_region():
    # DDP's forward ends in its record_function range: the loss after it fused with the model's math
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    twin = torch.nn.Linear(8, 8)
    twin.load_state_dict(lin.state_dict())

    def body(layer, x):
        with torch.autograd.profiler.record_function("the model"):
            h = torch.nn.functional.gelu(layer(x))
        loss = h.softmax(-1).pow(2).sum()
        loss.backward()
        return loss

    step = compiler.compile(lambda x: body(lin, x), backend="interpret")
    x = torch.randn(4, 8)
    for _ in range(2):
        got, want = step(x), body(twin, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lin.weight.grad, twin.weight.grad)
    report = step.last_entry.report
    assert step.stats["replays"] == 1 and not report.fallbacks and len(report.regions) == 1
    assert any("gelu" in k.op_names and "Tensor.pow" in k.op_names for k in report.forward_kernels)
    with torch.profiler.profile() as prof:
        step(x)
    assert "the model" in [e.key for e in prof.key_averages()]   # (the range is still entered and left)
