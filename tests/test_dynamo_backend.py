"""torch.compile(..., backend="symgrad"): Dynamo's graphs run through our capture, SymPy
autodiff and Triton kernels (the interpreter here), with eager's values and gradients."""

import copy
import functools
import inspect
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

import compiler.api
from compiler import dynamo_backend
from compiler.dynamo_backend import symgrad

REPO = Path(__file__).resolve().parents[1]


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


def _recorded_runs(monkeypatch):
    """The runs the backend returns when Dynamo finds it by name (no callable of ours to wrap)."""
    runs = []

    class Recorded(dynamo_backend._DynamoRun):
        def __init__(self, compiled):
            super().__init__(compiled)
            runs.append(self)

    monkeypatch.setattr(dynamo_backend, "_DynamoRun", Recorded)
    return runs


def test_options_by_name_train_an_mlp_like_eager(monkeypatch):
    # torch.compile hands options to the backend as one keyword, options={...} (torch._TorchCompileWrapper)
    torch._dynamo.reset()
    runs = _recorded_runs(monkeypatch)
    model = _mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="symgrad", options={"memory": "min", "fullgraph": True})
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        expected = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert len(runs) == 1  # one Dynamo graph, compiled with the options
    run = runs[0].compiled
    assert run.fullgraph is True and run.stored.memory == "min"
    assert run.stats["captures"] == 1 and run.stats["replays"] == 2 and run.stats["eager_calls"] == 0
    assert run.stats["kernel_launches"] > 0
    report = run.last_entry.report
    assert report.fallbacks == [] and report.internal_errors == []
    assert report.kernels and any(k.phase == "backward" for k in report.kernels)


def test_every_compile_keyword_is_an_option(monkeypatch):
    names = dynamo_backend.accepted_options()
    assert {"backend", "fullgraph", "memory", "dynamic", "skip_python"} <= set(names)
    real, given = compiler.api.compile, {}

    @functools.wraps(real)
    def compile_spy(fn=None, **kwargs):
        given.update(kwargs)
        return real(fn, **kwargs)

    monkeypatch.setattr(compiler.api, "compile", compile_spy)
    defaults = {name: p.default for name, p in inspect.signature(real).parameters.items()}
    options = {name: defaults[name] for name in names}
    options.update(memory="min", skip_python=True, dynamic=False)
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    run = symgrad(gm, [torch.randn(2)], options=dict(options))
    assert given == options
    assert run.compiled.skip_python is True and run.compiled.stored.memory == "min"
    # called directly, the same keywords work as keywords (and not twice)
    given.clear()
    symgrad(gm, [torch.randn(2)], memory="min")
    assert given == {"memory": "min"}
    with pytest.raises(TypeError, match="'memory' given twice"):
        symgrad(gm, [torch.randn(2)], options={"memory": "min"}, memory="min")


def test_unknown_option_is_a_clear_error():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() * 2, backend="symgrad", options={"memroy": "min"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        compiled(torch.randn(3))
    message = str(raised.value)
    assert "unknown option 'memroy'" in message and "did you mean 'memory'?" in message
    for name in dynamo_backend.accepted_options():  # what to use instead
        assert repr(name) in message
    assert "options" not in {name for name in dynamo_backend.accepted_options()}
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    with pytest.raises(TypeError, match="unknown options 'cudagraphs', 'triton.cudagraphs'"):
        symgrad(gm, [torch.randn(2)], options={"cudagraphs": True, "triton.cudagraphs": True})
    with pytest.raises(TypeError, match="takes a dict"):
        symgrad(gm, [torch.randn(2)], options=["memory"])
    with pytest.raises(ValueError, match="no modes"):  # torch.compile(mode="max-autotune") passes mode=
        symgrad(gm, [torch.randn(2)], mode="max-autotune")


def test_register_again_is_harmless():
    dynamo_backend.register()
    dynamo_backend.register()
    assert torch._dynamo.lookup_backend("symgrad") is symgrad
    assert "symgrad" in torch._dynamo.list_backends()


def _registry_without_symgrad(monkeypatch):
    from torch._dynamo.backends import registry

    registry.list_backends()  # (entry points discovered now, not inside the test)
    for table in (registry._BACKENDS, registry._COMPILER_FNS):
        if "symgrad" in table:
            monkeypatch.delitem(table, "symgrad")  # (put back after the test)
    with pytest.raises(torch._dynamo.exc.InvalidBackend):
        torch._dynamo.lookup_backend("symgrad")
    return registry


def test_import_after_dynamo_registers_at_once(monkeypatch):
    # a checkout on PYTHONPATH (no entry point) whose user imported Dynamo before compiler
    _registry_without_symgrad(monkeypatch)
    dynamo_backend.register()
    assert torch._dynamo.lookup_backend("symgrad") is symgrad
    torch.compile(lambda x: x.sin(), backend="symgrad", options={"memory": "min"})  # finds the name


def test_entry_point_loading_the_package_registers_nothing_twice(monkeypatch):
    # Dynamo loads the entry point when the name is first asked for; the load imports compiler, whose
    # register() runs inside it: registering then would make Dynamo's own registration a duplicate.
    from importlib.metadata import EntryPoint

    registry = _registry_without_symgrad(monkeypatch)
    monkeypatch.setitem(registry._BACKENDS, "symgrad", EntryPoint(
        name="symgrad", value="compiler.dynamo_backend:symgrad", group="torch_dynamo_backends"))
    dynamo_backend.register()  # what `import compiler` runs inside the load
    assert "symgrad" not in registry._COMPILER_FNS
    assert torch._dynamo.lookup_backend("symgrad") is symgrad  # Dynamo's load: no "duplicate name"


def test_plain_checkout_registers_when_dynamo_is_imported(tmp_path):
    # A process of its own: PYTHONPATH names the checkout and the entry point is hidden (not pip installed);
    # `import compiler` must not import Dynamo (a second of import time), yet make the name work once it is.
    script = textwrap.dedent("""
        import importlib.metadata as md
        import sys
        _entry_points = md.entry_points
        def entry_points(**kwargs):
            found = _entry_points(**kwargs)
            if kwargs.get("group") == "torch_dynamo_backends":
                found = md.EntryPoints(ep for ep in found if ep.name != "symgrad")
            return found
        md.entry_points = entry_points
        assert "symgrad" not in md.entry_points(group="torch_dynamo_backends").names

        import compiler
        assert "torch._dynamo" not in sys.modules, "import compiler imported Dynamo"
        import torch
        compiled = torch.compile(lambda x: x.sin(), backend="symgrad", options={"memory": "min"})
        from compiler.dynamo_backend import symgrad
        assert torch._dynamo.lookup_backend("symgrad") is symgrad
        assert "symgrad" in torch._dynamo.list_backends()
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
