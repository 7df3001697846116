"""torch.compile(..., backend="symgrad"): Dynamo's graphs run through our capture, SymPy
autodiff and Triton kernels (the interpreter here), with eager's values and gradients."""

import copy
from importlib.metadata import entry_points

import pytest
import torch

from compiler.dynamo_backend import symgrad


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def _recording_backend(seen):
    def backend(gm, example_inputs):
        run = symgrad(gm, example_inputs)
        seen.append(run.compiled)
        return run
    return backend


def test_entry_point_is_registered():
    # pip install (CI: `pip install -e .`) registers it; Dynamo looks names up in this group.
    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("symgrad") == "compiler.dynamo_backend:symgrad"
    assert "symgrad" in torch._dynamo.list_backends()


def test_training_steps_match_eager_and_replay_kernels():
    torch._dynamo.reset()
    model, seen = _mlp(), []
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=_recording_backend(seen))
    for _ in range(3):
        x = torch.randn(8, 16)
        loss = compiled(x).square().mean()
        expected = reference(x).square().mean()
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(seen) == 1  # one Dynamo graph: the forward
    stats, report = seen[0].stats, seen[0].last_entry.report
    assert stats["captures"] == 1 and stats["replays"] == 2
    assert report.fallbacks == [] and report.internal_errors == []
    assert report.kernels and any(k.phase == "backward" for k in report.kernels)


def test_by_name_and_graph_break():
    torch._dynamo.reset()

    def f(x, w):
        y = torch.tanh(x @ w)
        print_count = int(y.shape[0])  # a Python int: no break; the print below breaks the graph
        print("rows", print_count)
        return (y * y).sum()

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    out = torch.compile(f, backend="symgrad")(x, w)
    out.backward()
    expected = f(x, w_ref)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_unknown_option_is_a_clear_error():
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    with pytest.raises(TypeError, match="unknown options"):
        symgrad(gm, [torch.randn(2)], mode="max-autotune")
