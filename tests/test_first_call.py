"""The recording call (the first call with new shapes) is eager PyTorch in every way user code
can observe: the user's tensors flow through plain eager autograd while the mode records, so
version checks, saved tensors and their hooks, grad_fn types and errors are eager's own.
Each check also runs on a replay, where the compiled regions must keep the same semantics."""

import pytest
import torch

import compiler

F64 = torch.float64
CALLS = ["first_call", "replay"]


def compiled_at(call, fn, *args):
    """``fn`` compiled, warmed up so that its next call with ``args`` is ``call``."""
    f = compiler.compile(fn, backend="interpret")
    if call == "replay":
        f(*args)
    return f


@pytest.mark.parametrize("call", CALLS)
def test_input_modified_after_the_call_raises_eagers_error(call):
    a = torch.randn(3, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64)
    f = compiled_at(call, lambda a, b: (a * b).sum(), a, b)
    out = f(a, b)
    b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    assert a.grad is None


@pytest.mark.parametrize("call", CALLS)
def test_saved_self_is_the_input_object(call):
    def f(x):
        y = x.pow(2)
        return y, y.grad_fn._saved_self is x, x.equal(y.grad_fn._saved_self)
    x = torch.randn(5, requires_grad=True)
    cf = compiled_at(call, f, x)
    y, same_object, equal = cf(x)
    assert (same_object, equal) == (True, True)
    assert type(y.grad_fn).__name__ == "PowBackward0"
    assert cf.last_backend == ("eager (recording)" if call == "first_call" else "interpret")


@pytest.mark.parametrize("call", CALLS)
def test_register_hooks_on_a_saved_tensor(call):
    events = []

    def f(x):
        y = x.pow(2)
        y.grad_fn._raw_saved_self.register_hooks(lambda t: (events.append("pack"), t * 1)[1],
                                                 lambda t: (events.append("unpack"), t)[1])
        return y.sum()
    x = torch.randn(5, dtype=F64, requires_grad=True)
    cf = compiled_at(call, f, x)
    events.clear()
    cf(x).backward()
    assert events == ["pack", "unpack"]
    torch.testing.assert_close(x.grad, 2 * x.detach())


@pytest.mark.parametrize("call", CALLS)
def test_no_saved_tensor_hooks_of_the_compilers_own(call):
    """Inside the function, no saved-tensor hooks are active that the user did not set."""
    seen = []

    def f(x):
        seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        return (x * x).sum()
    x = torch.randn(4, requires_grad=True)
    cf = compiled_at(call, f, x)
    seen.clear()
    cf(x)
    assert seen == [None]


@pytest.mark.parametrize("call", CALLS)
def test_eager_errors_are_raised_on_every_call(call):
    def f(x, w):
        return (x @ w).sum()
    x, w = torch.randn(3, 4), torch.randn(5, 2, requires_grad=True)
    cf = compiler.compile(f, backend="interpret")
    for _ in range(2 if call == "replay" else 1):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            cf(x, w)


def test_intermediates_kept_only_by_autograd_stay_inside_the_kernels():
    """Autograd holds what backward needs; that alone does not make a value escape."""
    x = torch.randn(64, requires_grad=True)
    report = compiler.explain(lambda x: ((x.sin() * 2).exp() * x).sum(), x)
    assert len(report.forward_kernels) == 1
    assert len(report.regions) == 1


def test_an_intermediate_the_user_keeps_is_materialized():
    kept = []

    def f(x):
        h = x.sin() * 2
        kept.append(h)  # also saved by autograd (h * x saves h): kept for both reasons
        return (h * x).exp().sum()
    x = torch.randn(8, requires_grad=True)
    cf = compiler.compile(f, backend="interpret")
    cf(x)
    kept.clear()
    out = cf(x)
    torch.testing.assert_close(kept[0], x.detach().sin() * 2)
    assert cf.last_backend == "interpret" and not torch.isnan(kept[0]).any()
    out.backward()
    torch.testing.assert_close(x.grad, torch.func.grad(lambda x: ((x.sin() * 2) * x).exp().sum())(x.detach()))


def test_a_value_only_another_thread_reads_raises_instead_of_computing_on_nothing():
    """The recording cannot see other threads: a value only a thread reads stays inside the
    kernels on replay. Its stand-in refuses the thread's use, loudly (never a wrong grad)."""
    import threading

    def f(x):
        shared = x.exp() * 2
        errors = []

        def worker():
            try:
                shared.sum().backward()
            except RuntimeError as e:
                errors.append(str(e))
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        return errors
    x = torch.randn(4, requires_grad=True)
    cf = compiler.compile(f, backend="interpret")
    assert cf(x) == [] and x.grad is not None  # the recording: eager
    x.grad = None
    errors = cf(x)
    assert cf.last_backend == "interpret"
    assert len(errors) == 1 and "symgrad" in errors[0] and "another thread" in errors[0]
    assert x.grad is None


def test_printing_a_tensor_shows_eagers_grad_fn_and_formatting_a_number_compiles():
    lines = []

    def f(x):
        loss = (x.sin() * 2).sum()
        lines.append(f"{loss:.3f}")  # a number: the sum stays compiled
        h = x.exp() * 3
        lines.append(repr(h).split("grad_fn=")[1])  # the Node: mul runs eagerly
        return loss + h.sum()
    x = torch.randn(4, requires_grad=True)
    cf = compiler.compile(f, backend="interpret")
    for _ in range(2):
        lines.clear()
        cf(x)
        assert lines[1] == "<MulBackward0>)"
    assert cf.last_backend == "interpret" and cf.stats["kernel_launches"] > 0
    assert "Tensor.sum" not in cf.last_entry.report.eager_calls
    assert "Tensor.mul" in cf.last_entry.report.eager_calls
