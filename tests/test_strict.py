"""A compiler bug is never mistaken for an ordinary fallback. With SYMGRAD_STRICT off the user
still gets eager's results, and the log says it is a bug to report, with the traceback;
``explain`` lists it among internal errors. With SYMGRAD_STRICT=1 (the test suite and CI)
it raises ``compiler.InternalCompilerError``, chained to the original exception.
Failures are injected with monkeypatch where the compiler would meet them."""

import logging

import pytest
import torch

import compiler
import compiler.api
import compiler.capture.recorder
from runtime.fallback import InternalCompilerError

F64 = torch.float64


def f(x, w):
    return (x.sin() * w).exp().sum()


def inputs():
    return torch.randn(6, dtype=F64, requires_grad=True), torch.randn(6, dtype=F64)


def eager_result(x, w):
    x = x.detach().clone().requires_grad_()
    out = f(x, w)
    out.backward()
    return out, x.grad


def broken_build(graph, mutated, **options):
    raise KeyError("shape")


def broken_binding(*args, **kwargs):
    raise KeyError("shape")


def broken_finish(self, result, *watched):
    raise IndexError("a bug in escape analysis")


FAILURES = {  # where the compiler meets a bug: (module attribute to break, the stand-in)
    "build": (compiler.api, "build_region", broken_build),
    "binding": (compiler.capture.recorder, "_apply_binding", broken_binding),
    "escape_analysis": (compiler.capture.recorder.Capture, "finish", broken_finish),
}


@pytest.mark.parametrize("where", sorted(FAILURES))
def test_not_strict_the_user_gets_eagers_results_and_a_bug_report(where, monkeypatch, caplog):
    monkeypatch.setenv("SYMGRAD_STRICT", "0")
    monkeypatch.setenv("SYMGRAD_REGION_CACHE", "0")  # (a stored region would skip the broken build)
    owner, name, broken = FAILURES[where]
    monkeypatch.setattr(owner, name, broken)
    cf = compiler.compile(f, backend="interpret")
    x, w = inputs()
    expected, expected_grad = eager_result(x, w)
    with caplog.at_level(logging.ERROR, logger="compiler"):
        for _ in range(3):
            x.grad = None
            out = cf(x, w)
            out.backward()
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(x.grad, expected_grad)
    bugs = [r for r in caplog.records if "symgrad internal error in" in r.getMessage()]
    messages = [r.getMessage() for r in bugs]
    assert bugs and len(set(messages)) == len(messages), messages  # each said once, not on every call
    message = messages[0]
    assert "f (" in message and "this is a bug, please report it; running eagerly" in message
    assert ("KeyError: 'shape'" if where != "escape_analysis" else "IndexError") in message
    assert bugs[0].exc_info is not None  # the traceback, to report
    report = compiler.explain(cf, x, w)
    assert report.internal_errors and report.fallbacks == []
    assert "internal errors (compiler bugs: please report them)" in str(report)


@pytest.mark.parametrize("where", sorted(FAILURES))
def test_strict_a_bug_raises_with_its_traceback(where, monkeypatch):
    monkeypatch.setenv("SYMGRAD_STRICT", "1")
    owner, name, broken = FAILURES[where]
    monkeypatch.setattr(owner, name, broken)
    cf = compiler.compile(f, backend="interpret")
    with pytest.raises(InternalCompilerError, match="this is a bug") as err:
        cf(*inputs())
    assert isinstance(err.value.__cause__, KeyError if where != "escape_analysis" else IndexError)
    assert compiler.InternalCompilerError is InternalCompilerError


def test_strict_raises_even_where_the_users_code_catches_everything(monkeypatch):
    monkeypatch.setenv("SYMGRAD_STRICT", "1")
    monkeypatch.setattr(compiler.capture.recorder, "_apply_binding", broken_binding)

    def careless(x):
        try:
            return x.sin() * 2
        except Exception:  # noqa: BLE001 — a user's blanket handler must not hide the bug
            return x
    with pytest.raises(InternalCompilerError):
        compiler.compile(careless, backend="interpret")(torch.randn(3))


@pytest.mark.allows_eager("a deliberate fallback, not an internal error: what it tests")
def test_deliberate_fallbacks_are_not_internal_errors(monkeypatch):
    monkeypatch.setenv("SYMGRAD_STRICT", "1")

    def g(x):
        return torch.cumprod(x.sin(), 0).sum() * x.max().item()
    x = torch.randn(6, requires_grad=True)
    report = compiler.explain(g, x)
    assert any("cumprod" in r for r in report.fallbacks) and any("item" in r for r in report.graph_breaks)
    assert report.internal_errors == []


def test_fullgraph_turns_a_bug_into_compile_error_when_not_strict(monkeypatch):
    monkeypatch.setenv("SYMGRAD_STRICT", "0")
    monkeypatch.setenv("SYMGRAD_REGION_CACHE", "0")  # (a stored region would skip the broken build)
    monkeypatch.setattr(compiler.api, "build_region", broken_build)
    cf = compiler.compile(f, backend="interpret", fullgraph=True)
    with pytest.raises(compiler.CompileError) as err:
        cf(*inputs())
    assert isinstance(err.value.__cause__, KeyError)


def test_the_suite_runs_strict():
    import os
    assert os.environ.get("SYMGRAD_STRICT") == "1"


# -- bugs strict mode found in PyTorch's OpInfo samples, fixed -----------------------------

ZERO_DIM_REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "sum_dim_keepdim": lambda x: x.sum(0, keepdim=True) * 2,
    "mean": lambda x: x.mean(-1),
    "amax": lambda x: torch.amax(x, 0).exp(),
    "logsumexp": lambda x: torch.logsumexp(x, (0,), True),
    "l1_loss": lambda x: torch.nn.functional.l1_loss(x, torch.tensor(0.25, dtype=F64)),
    "mse_loss": lambda x: torch.nn.functional.mse_loss(x * 3, torch.tensor(0.5, dtype=F64)),
}


@pytest.mark.parametrize("name", sorted(ZERO_DIM_REDUCTIONS))
def test_reductions_of_a_zero_dim_tensor_compile(name):
    """Reducing a 0-d tensor used to leave the reduction unmaterialized (KeyError 'shape')."""
    from tests.parity import check_parity
    compiled = check_parity(ZERO_DIM_REDUCTIONS[name], [torch.tensor(0.75, dtype=F64, requires_grad=True)],
                            expect_kernels=False)
    assert compiled.last_entry.report.internal_errors == []


@pytest.mark.allows_eager("a deliberate fallback, not an internal error: what it tests")
def test_an_argument_a_binding_does_not_take_is_a_deliberate_fallback():
    """x.double(memory_format=...) used to raise TypeError inside the compiler."""
    f = lambda x: x.double(memory_format=torch.contiguous_format).sin()
    x = torch.randn(3, requires_grad=True)
    report = compiler.explain(f, x)
    assert report.internal_errors == []
    assert any("memory_format" in r for r in report.fallbacks), report.fallbacks
    cf = compiler.compile(f, backend="interpret")
    cf(x)
    torch.testing.assert_close(cf(x), f(x))


@pytest.mark.parametrize("name", ["index_select", "unfold"])
def test_zero_dim_gathers_and_windows_compile(name):
    """index_select / unfold of a 0-d tensor used to fail inside their bindings, then fell back;
    they compile since e69d8e0 (a 0-d result, a (1,) window of itself)."""
    f = {"index_select": lambda x: torch.index_select(x, 0, torch.tensor([0])) * 2,
         "unfold": lambda x: x.unfold(0, 1, 1) * 2}[name]
    x = torch.tensor(1.5, requires_grad=True)
    report = compiler.explain(f, x)
    assert report.internal_errors == [] and report.fallbacks == [], report.fallbacks
    cf = compiler.compile(f, backend="interpret")
    cf(x)
    torch.testing.assert_close(cf(x), f(x))
    assert cf.stats["kernel_launches"] > 0 and cf.stats["divergences"] == 0, cf.stats
