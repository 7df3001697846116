"""create_graph=True through compiled code: the backward is itself a compiled region built
from the same primitives, so second derivatives (and gradgradcheck) match eager."""

import copy

import pytest
import torch
import torch.nn.functional as F

import compiler

F64 = torch.float64


def compiled(fn):
    return compiler.compile(fn, backend="interpret")


@pytest.mark.parametrize("fn", [
    lambda x, w: (x.sin() * w).exp().sum(),
    lambda x, w: torch.tanh(x @ w.t()).pow(2).mean(),
    lambda x, w: (F.gelu(x) * torch.sigmoid(w) + torch.relu(x - w) ** 3).sum(1),
    lambda x, w: (x.abs() + 1).sqrt() * w,
], ids=["exp_chain", "matmul_tanh", "gelu_sigmoid_relu", "sqrt"])
def test_second_derivatives_match_eager(fn):
    x = torch.randn(4, 4, dtype=F64, requires_grad=True)
    w = torch.randn(4, 4, dtype=F64, requires_grad=True)
    c = compiled(fn)
    c(x, w)
    launches = c.stats["kernel_launches"]
    out, ref = c(x, w), fn(x, w)
    seed = torch.randn_like(out)
    g1 = torch.autograd.grad(out, [x, w], seed, create_graph=True)
    g2 = torch.autograd.grad(ref, [x, w], seed, create_graph=True)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
        assert a.requires_grad
    v = [torch.randn_like(x), torch.randn_like(w)]
    h1 = torch.autograd.grad(g1, [x, w], v)
    h2 = torch.autograd.grad(g2, [x, w], v)
    for a, b in zip(h1, h2):
        torch.testing.assert_close(a, b)
    assert c.stats["kernel_launches"] > launches


def test_gradgradcheck_on_compiled_functions():
    x = torch.randn(3, 2, dtype=F64, requires_grad=True)
    w = torch.randn(3, 2, dtype=F64, requires_grad=True)
    c = compiled(lambda x, w: (torch.exp(x) * w.tanh() + x * x).sum(0))
    c(x, w)
    assert torch.autograd.gradcheck(c, (x, w))
    assert torch.autograd.gradgradcheck(c, (x, w))


def test_gradgradcheck_complex():
    z = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    c = compiled(lambda z, w: torch.exp(z) * w + z * z.conj())
    c(z, w)
    assert torch.autograd.gradgradcheck(c, (z, w))


def test_gradient_penalty_training_step_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 1)).to(F64)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)

    def step(model, opt, x, y):
        x = x.requires_grad_()
        out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = F.mse_loss(out, y) + 0.1 * (gx * gx).sum(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    c = compiled(step)
    x, y = torch.randn(8, 3, dtype=F64), torch.randn(8, 1, dtype=F64)
    for _ in range(4):
        loss = c(model, opt, x.clone(), y)
        ref = step(reference, ref_opt, x.clone(), y)
        torch.testing.assert_close(loss, ref)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)
    assert c.stats["kernel_launches"] > 0 and c.last_entry.report.fallbacks == []


def test_in_place_change_before_double_backward_raises():
    x = torch.randn(4, dtype=F64, requires_grad=True)
    c = compiled(lambda x, w: (x * w).sum())
    w = torch.randn(4, dtype=F64)
    c(x, w)
    out = c(x, w)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, x, create_graph=True)


def test_double_backward_with_an_integer_input():
    """The joint graph has no gradient for integer inputs (indices): create_graph=True still works."""
    idx = torch.tensor([[1, 2, 3, 2], [0, 0, 4, 2]])

    def penalty(w):
        y = F.embedding(idx, w, padding_idx=2)
        gw, = torch.autograd.grad((y.sin() * y).sum(), w, create_graph=True)
        return (gw ** 2).sum()

    w = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    compiled = compiler.compile(penalty, backend="interpret")
    results = []
    for fn in (penalty, compiled, compiled):
        w.grad = None
        out = fn(w)
        out.backward()
        results.append((out.detach(), w.grad.clone()))
    assert compiled.last_backend == "interpret"
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0])
        torch.testing.assert_close(grad, results[0][1])


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non_leaf"])
def test_an_input_kept_without_hooks_unpacks_as_a_saved_tensor_would(leaf):
    """Without saved-tensor hooks a region keeps its double backward's inputs as (tensor, version)
    (runtime.autograd_bridge._Kept): unpacked, the same tensor, and after an in-place change
    PyTorch's own SavedTensor error, word for word."""
    from torch._C._autograd import _make_saved_tensor

    from runtime.autograd_bridge import _Kept

    base = torch.randn(3, 4, requires_grad=True)
    t = base if leaf else base * 2
    kept, packed = _Kept(t), _make_saved_tensor(t, is_output=False)
    assert kept.unpack() is t
    with torch.no_grad():
        t.add_(1)
    with pytest.raises(RuntimeError) as ours:
        kept.unpack()
    with pytest.raises(RuntimeError) as theirs:
        packed.unpack()
    assert str(ours.value) == str(theirs.value)
