"""Dropout compiled: random numbers made inside the kernels (Philox, seeded per call from
torch's generator), the mask never stored — the backward makes the same numbers again."""

import pytest
import torch
import torch.nn.functional as F

import compiler
from tests.devices import KERNELS  # noqa: E402  (the CUDA test mode's: tests/devices.py)
from compiler.ir.graph import meta_of
from tests.training import sgd_step


def _compiled(fn):
    return compiler.compile(fn, backend=KERNELS, fullgraph=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_dropout_keeps_scales_and_differentiates_with_one_mask(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 33, dtype=dtype, requires_grad=True)
    f = _compiled(lambda x: F.dropout(x.sin(), 0.3, training=True) * 2)
    f(x)                                            # records (eager dropout)
    out = f(x)
    assert f.last_backend == KERNELS and f.stats["kernel_launches"] > 0
    keep = out != 0
    assert 0.6 < keep.to(dtype).mean().item() < 0.8  # 2112 draws of keep-probability 0.7
    torch.testing.assert_close(out, torch.where(keep, x.sin() * 2 / 0.7, 0).detach())
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, torch.where(keep, x.cos() * 2 / 0.7, 0).detach())


def test_dropout_is_one_kernel_each_way_and_saves_no_mask():
    x = torch.randn(64, 33, requires_grad=True)
    report = compiler.explain(lambda x: F.dropout(x.sin(), 0.3) * 2, x)
    assert [k.phase for k in report.kernels] == ["forward", "backward"] and report.fallbacks == []
    saved = [meta_of(n).dtype for n in report.backward_graph.nodes if n.op == "placeholder"]
    assert torch.bool not in saved and torch.int64 in saved  # the seed, not a mask


def test_new_numbers_every_call_and_manual_seed_reproduces_them():
    x = torch.randn(1000)
    f = _compiled(lambda x: F.dropout(x, 0.5, training=True))
    f(x)
    first, second = f(x), f(x)
    assert not torch.equal(first != 0, second != 0)
    torch.manual_seed(7)
    a = f(x)
    torch.manual_seed(7)
    b = f(x)
    assert torch.equal(a, b)


def test_dropout_module_train_eval_and_in_place():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                torch.nn.Dropout(0.2, inplace=True))
    x = torch.randn(16, 8)
    f = compiler.compile(lambda x: model(x), backend=KERNELS, fullgraph=True)
    model.eval()                                   # dropout is the identity: compiled away
    f(x)
    torch.testing.assert_close(f(x), model(x))
    model.train()
    f(x)                                           # records the training-mode variant
    out = f(x)
    assert f.last_backend == KERNELS
    kept = out != 0                                # dropped by either dropout: 0
    assert 0.25 < kept.float().mean().item() < 0.55
    # a kept element went through both dropouts: scaled by 1/0.5 and then by 1/0.8
    torch.testing.assert_close(out[kept], (F.gelu(model[0](x) * 2) / 0.8)[kept])


@pytest.mark.allows_eager("a fallback with its reason: what it tests")
def test_channel_dropout_in_training_runs_eagerly_with_a_reason():
    x = torch.randn(2, 4, 3, 3)
    report = compiler.explain(lambda x: F.dropout2d(x.sin(), 0.5, training=True).cos(), x)
    assert any("channel and alpha dropout" in r for r in report.fallbacks)
    assert compiler.explain(lambda x: F.dropout2d(x.sin(), 0.5, training=False).cos(), x).fallbacks == []


def test_dropout_in_a_training_step_and_double_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    step = compiler.compile(sgd_step(model, lr=0.1), backend=KERNELS)
    losses = [step(x, y).item() for _ in range(30)]
    assert step.stats["divergences"] <= 1 and step.last_backend == KERNELS
    assert losses[-1] < losses[0]

    w = torch.randn(5, dtype=torch.float64, requires_grad=True)

    def penalty(w):
        out = F.dropout(w.sin(), 0.4)
        g, = torch.autograd.grad(out.sum(), w, create_graph=True)
        return (g * g).sum(), out
    f = compiler.compile(penalty, backend=KERNELS)
    f(w)
    value, out = f(w)
    value.backward()
    keep = (out != 0).to(w.dtype)
    # d/dw sum((keep * cos(w) / 0.6)^2) = -2 keep sin(w) cos(w) / 0.36
    torch.testing.assert_close(w.grad, (-2 * keep * w.sin() * w.cos() / 0.36).detach())


def test_attention_dropout_is_compiled():
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    f = _compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True))
    f(q, k, v)
    torch.manual_seed(3)
    a = f(q, k, v)
    torch.manual_seed(3)
    b = f(q, k, v)
    assert torch.equal(a, b) and f.last_backend == KERNELS
    a.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    no_dropout = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(a, no_dropout)
