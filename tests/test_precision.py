"""Precision in half types: the statistics a backward reads (mean, rstd, logsumexp) stay
float32, as eager keeps them, so a bf16 normalization's gradients are as accurate as eager's.

Each check runs the op in bf16 eagerly and compiled, and compares both against a float64
reference of the same inputs: ours may be at most a little worse than eager's own error.
"""

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from tests.parity import assert_ran_compiled

BF16 = torch.bfloat16
SLACK = 1.2   # ours vs eager, relative error against the float64 reference


def _relative_error(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _check(fn, inputs, names):
    torch.manual_seed(1)
    out_shape = fn(*inputs).shape
    grad = torch.randn(out_shape, dtype=BF16)
    reference = _run(fn, [t.double() for t in inputs], grad.double())
    eager = _run(fn, inputs, grad)
    compiled = compiler.compile(fn, backend=KERNELS, fullgraph=True)
    _run(compiled, inputs, grad)     # records
    launches = compiled.stats["kernel_launches"]
    ours = _run(compiled, inputs, grad)
    assert_ran_compiled(compiled, launches)
    for name, o, e, r in zip(["out"] + names, ours, eager, reference):
        assert o.dtype == e.dtype, name
        err_ours, err_eager = _relative_error(o, r), _relative_error(e, r)
        assert err_ours <= SLACK * err_eager + 1e-3, f"{name}: ours {err_ours:.4f} vs eager {err_eager:.4f}"


# rows longer than one block: the normalizing kernel reads the statistics back from memory
ROWS, WIDTH = 16, 8192


def _inputs(rows, width, offset=16.0):
    """Rows with a large mean (``offset``): rounding the mean or rstd to bf16 shows."""
    torch.manual_seed(0)
    x = (torch.randn(rows, width) + offset).to(BF16)
    w = (1 + 0.1 * torch.randn(width)).to(BF16)
    b = (0.1 * torch.randn(width)).to(BF16)
    return x, w, b


def test_bf16_layer_norm_gradients_as_accurate_as_eager():
    x, w, b = _inputs(ROWS, WIDTH)
    _check(lambda x, w, b: F.layer_norm(x, (WIDTH,), w, b), [x, w, b], ["dx", "dgamma", "dbeta"])


@pytest.mark.skipif(not hasattr(F, "rms_norm"), reason="F.rms_norm needs torch >= 2.4")
def test_bf16_rms_norm_gradients_as_accurate_as_eager():
    x, w, _ = _inputs(ROWS, WIDTH)
    _check(lambda x, w: F.rms_norm(x, (WIDTH,), w, eps=1e-6), [x, w], ["dx", "dgamma"])


def test_bf16_group_norm_gradients_as_accurate_as_eager():
    torch.manual_seed(0)
    x = (torch.randn(4, 8, 6, 6) + 3).to(BF16)
    w, b = (1 + 0.1 * torch.randn(8)).to(BF16), (0.1 * torch.randn(8)).to(BF16)
    _check(lambda x, w, b: F.group_norm(x, 2, w, b), [x, w, b], ["dx", "dgamma", "dbeta"])


def test_bf16_batch_norm_gradients_as_accurate_as_eager():
    torch.manual_seed(0)
    x = (torch.randn(16, 8, 5) + 3).to(BF16)
    w, b = (1 + 0.1 * torch.randn(8)).to(BF16), (0.1 * torch.randn(8)).to(BF16)
    _check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [x, w, b], ["dx", "dgamma", "dbeta"])


def test_bf16_log_softmax_and_cross_entropy_as_accurate_as_eager():
    torch.manual_seed(0)
    x = (4 * torch.randn(8, WIDTH)).to(BF16)
    target = torch.randint(0, WIDTH, (8,))
    _check(lambda x: F.log_softmax(x, 1), [x], ["dx"])
    _check(lambda x: F.cross_entropy(x, target, reduction="none"), [x], ["dx"])


def test_bf16_variance_as_accurate_as_eager():
    x, _, _ = _inputs(16, 1024)
    _check(lambda x: torch.var(x, dim=1), [x], ["dx"])
    _check(lambda x: torch.std_mean(x, dim=1, keepdim=True)[0], [x], ["dx"])
