"""Math a module's forward runs under its own ``torch.no_grad`` (a rotary embedding's cos/sin
from its ``inv_freq`` buffer, as in Llama, Qwen2, Mixtral) is the model's, not an update: it
compiles, as a region without autograd. Math under no_grad elsewhere (an optimizer's update,
whose step size changes every step) and anything reading a tensor that requires grad keep
running eagerly by design."""

from __future__ import annotations

import copy

import torch

import compiler


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    @torch.no_grad()
    def forward(self, positions):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * 1.5, emb.sin() * 1.5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = Rotary()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        cos, sin = self.rotary(torch.arange(x.shape[0]))
        return self.linear(x * cos + x.flip(-1) * sin)


def make_step(model, lr):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        with torch.no_grad():  # a hand-written update: eager by design (not inside a forward)
            for p in model.parameters():
                p.sub_(p.grad.mul(lr))
                p.grad = None
        return loss.detach()
    return step


def test_no_grad_math_in_a_forward_compiles_and_an_update_stays_eager():
    torch.manual_seed(0)
    model = Block()
    eager_model = copy.deepcopy(model)
    x = torch.randn(6, 8)
    step = compiler.compile(make_step(model, 0.1), backend="interpret")
    report = compiler.explain(step, x)
    assert report.fallbacks == []
    for op in ("Tensor.cos", "Tensor.sin", "torch.cat", "Tensor.float"):
        assert op not in report.eager_calls, report.eager_calls  # compiled
    assert "Tensor.mul" in report.eager_calls and "Tensor.sub_" in report.eager_calls  # the update
    no_grad_regions = [r for r in report.regions if r.get("kernels") and r.get("backward_graph") is None]
    assert no_grad_regions  # the rotary's region: kernels, no backward
    eager_step = make_step(eager_model, 0.1)
    eager_step(x)  # (explain ran the first step, recording it)
    for _ in range(3):
        torch.testing.assert_close(step(x), eager_step(x))
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
    assert step.stats["divergences"] == 0


def test_no_grad_math_reading_a_parameter_stays_eager():
    class Normalizer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            with torch.no_grad():
                scale = self.weight.abs().max()  # reads a parameter: eager by design
            return x * self.weight / scale

    model = Normalizer()
    report = compiler.explain(compiler.compile(lambda x: model(x).sum(), backend="interpret"), torch.randn(3, 4))
    assert "Tensor.abs" in report.eager_calls and report.fallbacks == []
