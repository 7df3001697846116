"""Eager PyTorch as the oracle: run a function eagerly and compiled, compare values and grads."""

from __future__ import annotations

import torch

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def clone_inputs(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def run_eager(fn, args, grad_seed=None):
    args = clone_inputs(args)
    out = fn(*args)
    grads = _backward(out, args, grad_seed)
    return out, grads


def _backward(out, args, grad_seed):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not leaves or not out.requires_grad:
        return [None] * len(leaves)
    g = grad_seed if grad_seed is not None else torch.ones_like(out)
    out.backward(g)
    return [a.grad for a in leaves]


def check_cpu_backend(fn, args, backend: str, tol=None, calls=3):
    """``fn`` compiled with a CPU path's ``backend`` (``torch``, ``cpp``), fullgraph: every call's
    value and gradients (a random seed) equal eager's, the calls after the first replay its kernels
    on ``backend``, and none left its recording. Returns the compiled function."""
    compiled = compiler.compile(fn, backend=backend, fullgraph=True)
    tol = tol or {}
    for _ in range(calls):
        ref_args, our_args = clone_inputs(args), clone_inputs(args)
        ref, ours = fn(*ref_args), compiled(*our_args)
        torch.testing.assert_close(ours, ref, **tol)
        if ref.requires_grad:
            seed = torch.randn_like(ref) if ref.dtype.is_floating_point or ref.dtype.is_complex \
                else torch.ones_like(ref)
            ref.backward(seed)
            ours.backward(seed.clone())
            for a, b in zip(our_args, ref_args):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    torch.testing.assert_close(a.grad, b.grad, **tol)
    assert compiled.last_backend == backend
    assert compiled.stats["replays"] >= calls - 1 and compiled.stats["kernel_launches"] > 0, compiled.stats
    assert compiled.stats["divergences"] == 0, compiled.stats  # (a replay that left its recording ran eagerly)
    return compiled


def assert_ran_compiled(compiled, launches_before=0, backend=KERNELS, divergences=0):
    """``compiled``'s calls since its ``kernel_launches`` were ``launches_before`` ran its kernels,
    on ``backend``, and no replay left its recording (``divergences``: how many did, where a test
    expects some, e.g. the call after an optimizer's first step, which created its state): a
    parity test whose every call recorded or ran eagerly compares eager with eager.

    >>> f = compiler.compile(lambda x: x.exp() * 2, backend=KERNELS)
    >>> _ = f(torch.ones(3)), f(torch.ones(3))
    >>> assert_ran_compiled(f)
    """
    stats = compiled.stats
    assert stats["kernel_launches"] > launches_before, f"no generated kernel ran: {stats}"
    assert stats["divergences"] == divergences, f"replays left their recording: {stats}"
    assert compiled.last_backend == backend, compiled.last_backend


def check_parity(fn, args, *, dtype=None, tol=None, grad_seed=None, expect_kernels=True):
    """Compile ``fn`` (interpret backend), call it twice, compare the second (compiled) call
    with eager: output values and input gradients. Returns the compiled function."""
    compiled = compiler.compile(fn, backend=KERNELS, fullgraph=True)
    ref_out, ref_grads = run_eager(fn, args, grad_seed)
    first = compiled(*clone_inputs(args))               # records (runs eagerly)
    torch.testing.assert_close(first, ref_out, equal_nan=True, **(tol or TOLERANCE.get(dtype or ref_out.dtype, {})))
    launches = compiled.stats["kernel_launches"]
    inputs = clone_inputs(args)
    out = compiled(*inputs)                             # replays with the compiled kernels
    assert compiled.last_backend == KERNELS
    assert compiled.stats["divergences"] == 0
    grads = _backward(out, inputs, grad_seed)
    if expect_kernels:
        assert compiled.stats["kernel_launches"] > launches, "no generated kernel ran"
    t = tol or TOLERANCE.get(dtype or ref_out.dtype, {})
    torch.testing.assert_close(out, ref_out, equal_nan=True, **t)
    assert out.requires_grad == ref_out.requires_grad
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r, equal_nan=True, **t)
    return compiled
