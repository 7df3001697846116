"""Host time per kernel launch on a real GPU: our direct launch, ``JITFunction.run``, an eager op.

``benchmarks.launch`` times our launch up to the driver call on CPU, with a host-only driver:
it leaves out Triton's C launcher and ``cuLaunchKernelEx``. On a GPU this times the whole launch,
as a training step pays it: the host wall time of many launches back to back (the GPU is never
the bottleneck here: 4096-element kernels take ~2 µs, and the queue is drained between batches),
divided by their number:

- ``ours``: a compiled region's kernel launched by ``KernelLaunch.run`` (its generated
  straight-line launch: layout check, output allocation, the driver launcher);
- ``jit``: the same kernel through ``fn[grid](...)`` (``JITFunction.run``: binding, specialization,
  cache key, then the same driver launcher);
- ``combo``: a fused optimizer step's combo kernel (``ComboLaunch.launch_now``: SGD over 4 tensors);
- ``eager``: one eager op on the same tensor (``torch.exp``), PyTorch's own dispatch and launch.

``python -m benchmarks.real_launch [--json PATH]`` (CUDA only; ``gpu_check`` runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import compiler  # noqa: F401  (first)
import torch  # noqa: E402

BATCH, ROUNDS = 200, 15


def _per_launch_us(fn) -> float:
    """The median over rounds of host µs per call of ``fn``, BATCH calls back to back per round."""
    samples = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(BATCH):
            fn()
        samples.append((time.perf_counter() - start) / BATCH * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def measure() -> dict:
    device = torch.device("cuda")
    f = compiler.compile(lambda x: torch.exp(x) * 2, backend="triton")
    x = torch.randn(4096, device=device)
    for _ in range(3):
        f(x)
    launch, = [k for r in f.last_entry.trace.regions if r.compiled is not None for k in r.compiled.forward.kernels]
    env = [x, None]
    launch.run(env, device)
    args, key, _ = launch.arguments(env, device)
    fn = launch.kernel()

    def jit():
        fn[(launch.grid,)](*args, XBLOCK=launch.xblock, RBLOCK=launch.rblock, num_warps=launch.num_warps)

    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    compiled_step = compiler.compile(step, backend="triton")
    batch = torch.randn(8, 64, device=device)
    for _ in range(4):
        compiled_step(batch)
    fused = next(iter(compiled_step.last_entry.trace.fused_steps.values()))
    combo = fused.launches[0]
    params = [p for p in model.parameters()]
    tensors = [t for p in params for t in (p, p.grad, opt.state[p]["momentum_buffer"])]
    scalars = fused.groups[0].rule.scalars(opt.param_groups[0], 1, torch.float32)
    combo.launch_now(tensors, scalars, device)
    return {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "ours_us": round(_per_launch_us(lambda: launch.run(env, device)), 2),
        "jit_us": round(_per_launch_us(jit), 2),
        "combo_us": round(_per_launch_us(lambda: combo.launch_now(tensors, scalars, device)), 2),
        "eager_op_us": round(_per_launch_us(lambda: torch.exp(x)), 2),
        "batch": BATCH, "rounds": ROUNDS,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("real_launch: no CUDA device here (benchmarks.launch times the host work without one)", file=sys.stderr)
        return {}
    result = measure()
    for name in ("ours_us", "jit_us", "combo_us", "eager_op_us"):
        print(f"{name:>12}: {result[name]:.2f} µs per launch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
