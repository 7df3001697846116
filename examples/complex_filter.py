"""Fit a learnable complex filter to a signal, with a compiled training step.

    python examples/complex_filter.py [--steps 40]

A signal's spectrum X (complex) passes through an unknown filter H_true; we learn a complex
filter H (a complex nn.Parameter) so that H·X matches the observed output Y. The loss uses a
user-defined elementwise op, |z|², written once as a scalar function; its gradient comes
from SymPy by Wirtinger calculus (PyTorch's convention: ∂L/∂z̄). Each step prints the
compiled loss next to eager PyTorch's, from an identical copy.
"""

from __future__ import annotations

import argparse
import math

import torch

import compiler
from compiler import math as cm
from runtime.backends import BACKENDS  # (every backend compiler.compile takes)


@compiler.elementwise(name="abs2")
def abs2(z):
    """|z|² = Re(z·z̄): real-valued, so the op returns a real tensor for complex z."""
    return cm.real(z * cm.conj(z))


def make_problem(n_freq=64, n_signals=32):
    g = torch.Generator().manual_seed(0)
    f = torch.linspace(0, 1, n_freq)
    h_true = torch.polar(1 / (1 + (4 * f) ** 2), -2 * math.pi * 0.3 * f)       # a low-pass with a delay
    def complex_noise():
        return torch.complex(torch.randn(n_signals, n_freq, generator=g), torch.randn(n_signals, n_freq, generator=g))
    x = complex_noise()
    noise = 0.01 * complex_noise()
    return x, h_true * x + noise, h_true


class Filter(torch.nn.Module):
    def __init__(self, n_freq):
        super().__init__()
        self.h = torch.nn.Parameter(torch.zeros(n_freq, dtype=torch.complex64))

    def forward(self, x):
        return self.h * x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    args = parser.parse_args()

    x, y, h_true = make_problem()
    model, eager_model = Filter(x.shape[1]), Filter(x.shape[1])
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=0.05)

    def train_step(model, opt, x, y):
        loss = abs2(model(x) - y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = compiler.compile(train_step, backend=args.backend)
    for i in range(args.steps):
        loss = step(model, opt, x, y)
        eager_loss = train_step(eager_model, eager_opt, x, y)
        print(f"step {i:3d}  loss {loss.item():.6f}  eager {eager_loss.item():.6f}  ran: {step.last_backend}")
        if not math.isclose(loss.item(), eager_loss.item(), rel_tol=1e-3, abs_tol=1e-6):
            raise SystemExit(f"compiled and eager losses differ at step {i}")
    report = compiler.explain(step)  # the last call's recording: no extra step
    print(f"\nkernels per step: {len(report.forward_kernels)} forward, {len(report.backward_kernels)} backward; "
          f"fallbacks: {report.fallbacks or 'none'}")
    err = (model.h.detach() - h_true).abs().mean()
    print(f"final loss {loss.item():.6f}; mean |H - H_true| {err.item():.4f}")


if __name__ == "__main__":
    main()
