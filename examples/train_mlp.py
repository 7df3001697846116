"""Train a small MLP regression with a compiled training step.

    python examples/train_mlp.py [--steps 60] [--backend auto] [--threads N] [--skip-python]

The whole step — forward, MSE loss, loss.backward(), optimizer.step(), zero_grad() — is
one compiled function. Its forward and backward run as fused kernels: on a GPU as compiled
Triton kernels, on CPU tensors as C++ kernels built by the system's compiler (as PyTorch CPU ops
where none works, or with ``--backend torch``; ``--backend interpret`` runs the generated Triton
kernels in Triton's interpreter instead: slow). The optimizer's step is fused too. The first call runs eagerly while the
compiler records it; every later call replays the compiled kernels. The recording is stored
(``$SYMGRAD_CACHE_DIR``): run the example again and its first step replays too. With
``--skip-python`` the replays make the recorded torch calls without running ``train_step``'s
Python again (``compile(..., skip_python=True)``: the step has no other effect, so the promise
holds). Each step prints the compiled loss next to eager PyTorch's, from an identical copy (the
two take turns at running first), and the end prints both times.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
import torch.nn.functional as F

import compiler
from runtime.backends import BACKENDS  # (every backend compiler.compile takes)


def make_data(n: int, device):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 4, generator=g) * 4 - 2
    y = (torch.sin(2 * x[:, :1]) + 0.5 * x[:, 1:2] ** 2 - x[:, 2:3] * x[:, 3:4]).contiguous()
    return x.to(device), y.to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: PyTorch's default)")
    parser.add_argument("--skip-python", action="store_true",
                        help="replays make the recorded calls without re-running train_step's Python")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    ).to(args.device)
    eager_model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    x, y = make_data(256, args.device)

    def train_step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled_step = compiler.compile(train_step, backend=args.backend, skip_python=args.skip_python)

    def timed(fn, model, opt):
        """The step's loss and its wall-clock and CPU time (all threads of this process: steadier
        on a shared machine). ``.item()`` synchronizes a GPU: the step's time is all in."""
        start, start_cpu = time.perf_counter(), time.process_time()
        value = fn(model, opt, x, y).item()
        return value, time.perf_counter() - start, time.process_time() - start_cpu

    compiled_times, eager_times, compiled_cpu, eager_cpu = [], [], [], []
    for step in range(args.steps):
        # NOTE: the two take turns at running first. Whichever runs right after the line printed
        # below finds the CPU's caches cooled by it: on this small step that costs it ~60-80 us
        # (~7%), enough to move the ratio by ~0.15x were one of them always first.
        if step % 2 == 0:
            loss_value, wall, cpu = timed(compiled_step, model, opt)
            eager_value, eager_wall, eager_cpu_time = timed(train_step, eager_model, eager_opt)
        else:
            eager_value, eager_wall, eager_cpu_time = timed(train_step, eager_model, eager_opt)
            loss_value, wall, cpu = timed(compiled_step, model, opt)
        compiled_times.append(wall)
        compiled_cpu.append(cpu)
        eager_times.append(eager_wall)
        eager_cpu.append(eager_cpu_time)
        print(f"step {step:3d}  loss {loss_value:.6f}  eager {eager_value:.6f}  ran: {compiled_step.last_backend}")
        if not math.isclose(loss_value, eager_value, rel_tol=1e-3, abs_tol=1e-5):
            raise SystemExit(f"compiled and eager losses differ at step {step}")

    report = compiler.explain(compiled_step)  # the last call's recording: no extra step
    print(f"\nbackend: {report.backend} ({report.backend_reason})")
    print(f"kernels per step: {len(report.forward_kernels)} forward, {len(report.backward_kernels)} backward "
          f"(+ {sum(1 for n in report.graph.nodes if getattr(n.target, 'kind', '') == 'extern')} matmuls)")
    print(f"fallbacks: {report.fallbacks or 'none'}")
    print(f"final loss {loss_value:.6f}")
    for what, ours, eager in (("time", compiled_times, eager_times), ("CPU time", compiled_cpu, eager_cpu)):
        print(f"{what}, {args.steps} steps: compiled {sum(ours):.3f}s, eager {sum(eager):.3f}s "
              f"({sum(ours) / sum(eager):.2f}x eager's)")
        if args.steps > 1:  # without the first call (the compiled one records it)
            ours, eager = sum(ours[1:]), sum(eager[1:])
            print(f"{what}, steps 1-{args.steps - 1} (replays): compiled {ours * 1e3:.1f}ms, eager {eager * 1e3:.1f}ms "
                  f"({ours / eager:.2f}x eager's)")


if __name__ == "__main__":
    main()
