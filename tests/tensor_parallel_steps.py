"""Worker side of tests/test_tensor_parallel.py: each rank trains a tensor-parallel MLP and an
attention block (``parallelize_module`` with ColwiseParallel/RowwiseParallel, 2 gloo processes)
twice, with a compiled step and with eager's, and writes what the test compares.

Scenarios: ``mlp`` (up-projection column-parallel, down-projection row-parallel, biases on both);
``block`` (pre-norm attention with q/k/v column-parallel and the output row-parallel, then the MLP,
residual adds reading the row-parallel layers' all-reduced outputs); ``block_triton``: ``block`` with
Triton kernels (in its interpreter). AdamW, 4 steps each.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS = 4
DIM, HEADS = 16, 4


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(DIM, 2 * DIM), torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = (torch.nn.Linear(DIM, DIM) for _ in range(3))
        # (no bias on k: softmax ignores what it adds to every key, so its exact gradient is 0 and
        # AdamW would turn either side's rounding noise, ~1e-9, into steps of the full learning rate)
        self.k = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape  # (each rank's q, k, v hold its heads: -1 is HEADS / ranks)
        q, k, v = (m(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _parallelized(scenario: str, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    if scenario == "mlp":
        return parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    return parallelize_module(Block(), mesh, plan)


def _captured_matmuls(report) -> int:
    """How many matrix products the compiled regions hold (the local shards' F.linear among them)."""
    return sum(1 for region in report.regions for node in region["captured"].nodes
               if node.op == "call_function" and str(node.target) in ("mm", "addmm", "bmm"))


def _train(scenario: str, compiled: bool, mesh):
    import compiler

    model = _parallelized(scenario, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        grads = [(type(p.grad).__name__, tuple(map(str, getattr(p.grad, "placements", ()))))
                 for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        return loss, grads

    backend = "interpret" if scenario.endswith("_triton") else "auto"
    run = compiler.compile(step, backend=backend) if compiled else step
    generator = torch.Generator().manual_seed(7)  # (the same input on both ranks, as TP needs)
    losses, grads = [], None
    for _ in range(STEPS):
        loss, grads = run(torch.randn(2, 8, DIM, generator=generator))
        losses.append(loss.item())
    out = {"losses": losses, "grads": grads,
           "params": [getattr(p, "full_tensor", p.detach)().detach().clone() for p in model.parameters()],
           "versions": [(p._version, *(t._version for t in opt.state[p].values())) for p in model.parameters()]}
    if compiled:
        report = run.last_entry.report
        out.update(stats=dict(run.stats), fallbacks=report.fallbacks, backend=run.last_backend,
                   matmuls=_captured_matmuls(report))
    return out


def worker(rank: int, world: int, init_file: str, out_dir: str):
    """One rank: every scenario, compiled and eager, saved to ``out_dir/rank{rank}.pt``."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {scenario: {"compiled": _train(scenario, True, mesh), "eager": _train(scenario, False, mesh)}
                   for scenario in ("mlp", "block", "block_triton")}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
