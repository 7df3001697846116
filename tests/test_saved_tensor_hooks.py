"""Saved-tensor hooks around compiled code, every form of the autograd notes ("Hooks for saved
tensors"), on the recording call, on replays, and on a fresh process's first call (a second
``compile`` of the function, which loads the recording the first stored).

Issue 32: a pack hook registered on one saved tensor (``_raw_saved_self.register_hooks``) that
computes its packed value (``t * 1``) gave NaN gradients on every replay, and on the first call
from a stored recording: the value it made was kept inside the fused kernels (no recorded call
read it), and autograd unpacked a stand-in's NaN storage (``compiler.capture.pack_hooks``).
"""

import pytest
import torch

import compiler
from tests.devices import KERNELS, BACKENDS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from tests.notes_examples import stored_recordings


class Box:
    """A packed value that is no tensor: an object holding one."""

    def __init__(self, tensor):
        self.tensor = tensor


_STORE: dict = {}


def _to_store(t):
    key = len(_STORE)
    _STORE[key] = t * 2
    return key


# name -> (pack, unpack): each pair unpacks the value autograd saved, exactly (scaling by powers
# of two): eager and the compiled region save different tensors, so lossy hooks would round apart
HOOKS = {
    "computed": (lambda t: t * 1, lambda t: t),
    "copy": (lambda t: t.clone(), lambda t: t),
    "unpack-computes": (lambda t: t, lambda t: t * 1),
    "copy-both-ways": (lambda t: t.clone(), lambda t: t + 0),
    "other-dtype": (lambda t: t.double(), lambda t: t.float()),
    "tuple": (lambda t: (t * 4, "packed"), lambda p: p[0] / 4),
    "object": (lambda t: Box(t * 2), lambda b: b.tensor / 2),
    "key-into-a-dict": (_to_store, lambda k: _STORE.pop(k) / 2),
    "detached": (lambda t: t.detach(), lambda t: t),
}


def _registered_on_one_saved_tensor(pack, unpack):
    """The notes' form: hooks on one saved tensor of an eager node, registered after the op."""
    def f(x, w):
        y = (x * w).pow(2)
        y.grad_fn._raw_saved_self.register_hooks(pack, unpack)
        z = (y.sin() * w).exp()
        z.grad_fn._raw_saved_result.register_hooks(pack, unpack)
        (z.sum() + y.mean()).backward()
        return z.detach(), x.grad.clone(), w.grad.clone()
    return f


def _default_hooks(pack, unpack):
    """``saved_tensors_hooks`` around the forward: every tensor autograd saves goes through them."""
    def f(x, w):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x * w).pow(2)
            z = (y.sin() * w).exp()
        (z.sum() + y.mean()).backward()
        return z.detach(), x.grad.clone(), w.grad.clone()
    return f


def _save_on_cpu():
    def f(x, w):
        with torch.autograd.graph.save_on_cpu():
            y = (x * w).pow(2)
            z = (y.sin() * w).exp()
        (z.sum() + y.mean()).backward()
        return z.detach(), x.grad.clone(), w.grad.clone()
    return f


FORMS = {"register_hooks": _registered_on_one_saved_tensor, "saved_tensors_hooks": _default_hooks}


def _inputs(call: int):
    g = torch.Generator().manual_seed(call)
    return torch.randn(6, 4, generator=g).requires_grad_(), torch.randn(4, generator=g).requires_grad_()


def _check_calls(fn, compiled, calls, first_call_records: bool):
    """``calls`` calls of ``compiled`` against eager ``fn`` on fresh inputs: equal outputs and
    gradients, never NaN; the calls after the recording replay kernels and never diverge."""
    for call in calls:
        expected = fn(*_inputs(call))
        launches = compiled.stats["kernel_launches"]
        got = compiled(*_inputs(call))
        for g, e in zip(got, expected):
            assert not g.isnan().any(), f"call {call}: NaN"
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
        replayed = call > calls[0] or not first_call_records
        if replayed:
            assert compiled.stats["kernel_launches"] > launches, f"call {call}: no kernel ran"
        assert compiled.stats["divergences"] == 0, compiled.last_backend


@pytest.mark.parametrize("hooks", list(HOOKS))
@pytest.mark.parametrize("form", list(FORMS))
def test_saved_tensor_hooks_give_eagers_gradients(form, hooks):
    fn = FORMS[form](*HOOKS[hooks])
    _STORE.clear()
    with stored_recordings():
        compiled = compiler.compile(fn, backend=KERNELS)
        _check_calls(fn, compiled, [0, 1, 2], first_call_records=True)
        assert compiled.stats["captures"] == 1, compiled.stats
        fresh = compiler.compile(fn, backend=KERNELS)  # a fresh process: the stored recording
        _check_calls(fn, fresh, [3, 4], first_call_records=False)
        assert (fresh.stats["captures"], fresh.stats["loaded"]) == (0, 1), fresh.stats
    assert not _STORE  # every packed value unpacked once


def test_save_on_cpu():
    fn = _save_on_cpu()
    with stored_recordings():
        compiled = compiler.compile(fn, backend=KERNELS)
        _check_calls(fn, compiled, [0, 1, 2], first_call_records=True)
        fresh = compiler.compile(fn, backend=KERNELS)
        _check_calls(fn, fresh, [3, 4], first_call_records=False)
        assert fresh.stats["loaded"] == 1, fresh.stats


def test_the_issues_example():
    def f(x):
        y = x.pow(2)
        y.grad_fn._raw_saved_self.register_hooks(lambda t: t * 1, lambda t: t)
        y.sum().backward()
        return x.grad.clone()
    for backend in BACKENDS[::-1]:
        c = compiler.compile(f, backend=backend)
        for _ in range(3):
            x = torch.randn(5, requires_grad=True)
            torch.testing.assert_close(c(x), 2 * x.detach())
        assert c.stats["replays"] == 2 and c.stats["divergences"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a hook that moves the value to another device needs a GPU")
def test_a_pack_hook_that_moves_the_value_to_another_device():
    fn = _registered_on_one_saved_tensor(lambda t: t.cpu(), lambda t: t.cuda())

    def on_gpu(call):
        return [t.detach().cuda().requires_grad_() for t in _inputs(call)]
    compiled = compiler.compile(fn)
    for call in range(3):
        for g, e in zip(compiled(*on_gpu(call)), fn(*on_gpu(call))):
            torch.testing.assert_close(g, e)
    assert compiled.stats["replays"] == 2 and compiled.stats["divergences"] == 0
