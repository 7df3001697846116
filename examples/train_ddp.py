"""Train a small transformer with DistributedDataParallel and a compiled training step.

    torchrun --nproc-per-node 2 examples/train_ddp.py [--steps 10] [--layers 2] [--backend auto]

Each rank wraps the same nanoGPT-style model (``--layers`` pre-norm blocks, 2 by default) in DDP
and trains it twice from one initialization: with a compiled step — forward, cross-entropy,
loss.backward() (DDP's bucketed all-reduce fires from our compiled backward's gradient
hooks), optimizer.step(), zero_grad() — and with the same step run eagerly. Every step prints
each rank's two losses side by side; at the end, the largest parameter difference and the
compiled step's kernels and fallbacks. On a CPU-only machine the backend is gloo and the
kernels run in Triton's interpreter; with GPUs, nccl and compiled kernels.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compiler
from runtime.backends import BACKENDS  # (every backend compiler.compile takes)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, dim, heads, seq, layers=2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.blocks(self.embed(idx) + self.pos[: idx.shape[1]])
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. `torchrun --nproc-per-node 2 examples/train_ddp.py`")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    vocab, dim, heads, seq, batch = 96, 32, 2, 16, 4
    torch.manual_seed(0)  # the same initialization on every rank (DDP also broadcasts rank 0's)
    base = TinyGPT(vocab, dim, heads, seq, args.layers).to(device)
    models = {"compiled": DDP(copy.deepcopy(base)), "eager": DDP(copy.deepcopy(base))}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=3e-3) for k, m in models.items()}

    def train_step(model, opt, idx, targets):
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled_step = compiler.compile(train_step, backend=args.backend)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    for step in range(args.steps):
        idx = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
        targets = torch.roll(idx, -1, dims=1)  # learnable: predict the next token of a random stream
        ours = compiled_step(models["compiled"], optimizers["compiled"], idx, targets).item()
        eager = train_step(models["eager"], optimizers["eager"], idx, targets).item()
        print(f"rank {rank}/{world} step {step:3d}  compiled {ours:.6f}  eager {eager:.6f}", flush=True)

    diff = max((p - q).abs().max().item()
               for p, q in zip(models["compiled"].parameters(), models["eager"].parameters()))
    report = compiled_step.last_entry.report if compiled_step.last_entry else None
    kernels = len(report.kernels) if report else 0
    fallbacks = (report.fallbacks or "none") if report else "n/a"
    print(f"rank {rank}: max |param difference| {diff:.2e}; {kernels} kernels per step; "
          f"replays {compiled_step.stats['replays']}; fallbacks: {fallbacks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
