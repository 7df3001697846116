"""The first minute on a GPU: does what users do first work, compiled, against eager on the same device?

``python -m benchmarks.gpu_smoke [--device cuda|cpu]`` runs each check and prints one JSON line per
check (``{"check", "ok", "detail", "seconds"}``), then a summary line; exit status 1 if any failed.
``benchmarks.gpu_check`` runs it first (and under ``compute-sanitizer`` where that is present). On
``cpu`` (``gpu_check --dry-run``) the same checks run through Triton's interpreter.

Each check compiles with the backend that runs the real kernels (``triton`` on CUDA, ``interpret``
on the CPU), compares with eager at tolerances stated per check, and asserts that kernels ran and
nothing ran eagerly where it should not.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback

import compiler  # noqa: F401  (first: Triton's interpreter on a machine without a GPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def _backend(device: str) -> str:
    return "triton" if device == "cuda" else "interpret"


def _close(a, b, what, rtol=1e-4, atol=1e-5):
    """fp32 at the CUDA test mode's tolerance (tests/devices.py says why)."""
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _ran_compiled(f, what):
    assert f.stats["kernel_launches"] > 0, f"{what}: no kernel launched ({f.stats})"
    assert f.stats["eager_calls"] == 0 and f.stats["divergences"] == 0, f"{what}: ran eagerly ({f.stats})"


@check
def readme_function(device):
    """The README's first example: forward and backward, fused."""
    f = compiler.compile(lambda x, y: (torch.sin(x) * y + torch.exp(-x)).sum(), backend=_backend(device))
    x = torch.randn(1024, device=device, requires_grad=True)
    y = torch.randn(1024, device=device, requires_grad=True)
    f(x, y)
    loss = f(x, y)
    loss.backward()
    gx, gy = torch.autograd.grad((torch.sin(x) * y + torch.exp(-x)).sum(), (x, y))
    _close(loss, (torch.sin(x) * y + torch.exp(-x)).sum(), "loss")
    _close(x.grad, gx, "x.grad")
    _close(y.grad, gy, "y.grad")
    _ran_compiled(f, "readme")
    return f"{f.stats['kernel_launches']} launches"


@check
def transposed_and_misaligned_inputs(device):
    """Strides are not guarded: a transposed and a misaligned view replay the recording, each binding
    its own specialization (a misaligned pointer loses 16-byte divisibility)."""
    f = compiler.compile(lambda x: torch.exp(x) * 2 + x.sum(1, keepdim=True), backend=_backend(device))
    base = torch.randn(4096 + 1, device=device)
    for x in (torch.randn(64, 64, device=device), torch.randn(64, 64, device=device).t(),
              base[1:].view(64, 64), torch.randn(64, 64, device=device)):
        _close(f(x), torch.exp(x) * 2 + x.sum(1, keepdim=True), "layout")
    return f"{f.stats['kernel_launches']} launches"


@check
def side_stream(device):
    """Launched on the current stream: a compiled call on a side stream, synchronized, equals eager."""
    if device != "cuda":
        return "skipped: no streams on the CPU"
    f = compiler.compile(lambda x: (x.tanh() * 3).sum(0), backend="triton")
    x = torch.randn(512, 256, device=device)
    f(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = f(x)
    torch.cuda.current_stream().wait_stream(stream)
    _close(out, (x.tanh() * 3).sum(0), "side stream")
    return "ok"


@check
def no_input_region(device):
    """A compiled function with no tensor arguments, making its tensors itself (positions, a causal
    mask): it runs on the device it recorded on, with the backend for that device."""
    def positions():
        t = torch.arange(16, device=device, dtype=torch.float32)
        return (t[:, None] - t[None, :]).clamp(min=0).exp().neg()
    f = compiler.compile(positions)
    f()
    out = f()
    assert out.device.type == device, f"ran on {out.device}, recorded on {device}"
    _close(out, positions(), "no-input region")
    expected = "triton" if device == "cuda" else None
    assert expected is None or f.last_backend == expected, f.last_backend
    return f"backend {f.last_backend}"


@check
def dropout_and_manual_seed(device):
    """Dropout's mask from the kernels' own generator: the same seed gives the same mask twice, and
    the expected keep rate."""
    f = compiler.compile(lambda x: F.dropout(x, 0.25, training=True), backend=_backend(device))
    x = torch.ones(256, 256, device=device)
    f(x)
    torch.manual_seed(123)
    a = f(x)
    torch.manual_seed(123)
    b = f(x)
    assert torch.equal(a, b), "the same seed gave two masks"
    kept = (a != 0).float().mean().item()
    assert abs(kept - 0.75) < 0.02 and torch.allclose(a[a != 0], torch.full_like(a[a != 0], 4 / 3)), kept
    return f"kept {kept:.3f}"


@check
def bf16_autocast(device):
    """A linear layer and GELU under bf16 autocast: eager's casts, bf16's tolerance."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(device)
    reference = copy.deepcopy(model)
    x = torch.randn(32, 64, device=device)
    f = compiler.compile(lambda x: model(x).float().square().mean(), backend=_backend(device))
    with torch.autocast(device, dtype=torch.bfloat16):
        f(x)
        out = f(x)
        expected = reference(x).float().square().mean()
    out.backward()
    expected.backward()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2)
    _ran_compiled(f, "autocast")
    return "ok"


def _train(device, make_optimizer, clip=None, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 4, device=device)

    def make_step(model):
        optimizer = make_optimizer(model.parameters())

        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()
        return step
    compiled, eager = compiler.compile(make_step(model), backend=_backend(device)), make_step(reference)
    for i in range(steps):
        _close(compiled(x, y), eager(x, y), f"loss at step {i}")
    for p, q in zip(model.parameters(), reference.parameters()):
        _close(p, q, "parameter after the steps")
    assert compiled.stats["kernel_launches"] > 0 and compiled.last_entry.report.fallbacks == [], \
        compiled.last_entry.report.fallbacks
    return f"{steps} steps, {compiled.stats['kernel_launches']} launches"


@check
def adam_against_eager(device):
    return _train(device, lambda params: torch.optim.Adam(params, lr=1e-2))


@check
def sgd_against_eager(device):
    return _train(device, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))


@check
def clip_grad_norm(device):
    return _train(device, lambda params: torch.optim.AdamW(params, lr=1e-2), clip=0.5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--only", help="comma-separated check names")
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    failed = 0
    for fn in CHECKS:
        if wanted and fn.__name__ not in wanted:
            continue
        started = time.perf_counter()
        try:
            detail, ok = fn(args.device), True
            if args.device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 — each check reports, the others still run
            detail, ok = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}", False
        failed += not ok
        print(json.dumps({"check": fn.__name__, "ok": ok, "detail": str(detail)[:2000],
                          "seconds": round(time.perf_counter() - started, 2)}), flush=True)
    print(json.dumps({"summary": True, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
