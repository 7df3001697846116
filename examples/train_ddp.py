"""Train a small transformer with DistributedDataParallel or FSDP2 and a compiled training step.

    torchrun --nproc-per-node 2 examples/train_ddp.py [--steps 10] [--layers 2] [--backend auto]
    torchrun --nproc-per-node 2 examples/train_ddp.py --fsdp2 [--bf16]
    torchrun --nproc-per-node 2 examples/train_ddp.py --tp
    torchrun --nproc-per-node 2 examples/train_ddp.py --skip-python

Each rank builds the same nanoGPT-style model (``--layers`` pre-norm blocks, 2 by default) and
trains it twice from one initialization: with a compiled step — forward, cross-entropy,
loss.backward(), clip_grad_norm_(1.0), optimizer.step() (AdamW), zero_grad() — and with the same
step run eagerly. By default each copy is wrapped in DDP (its bucketed all-reduce fires from our
compiled backward's gradient hooks). With ``--fsdp2`` each block and the root are wrapped with
``fully_shard`` instead: FSDP2's all-gathers and per-layer reduce-scatters run between the compiled
regions, and clipping and AdamW are fused on the parameters' local shards; ``--bf16`` adds
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. With ``--tp`` each block's MLP
is tensor parallel instead (``parallelize_module``: its first Linear column-parallel, its second
row-parallel; every rank sees the same batch): the layers' math compiles on the local shards, and
the step does not clip (clip_grad_norm_ over DTensor and plain gradients together raises in eager
PyTorch). Every step prints each rank's
two losses side by side; at the end, the largest parameter difference and the compiled step's
kernels and fallbacks. On a CPU-only machine the backend is gloo and the kernels run in Triton's
interpreter; with GPUs, nccl and compiled kernels.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
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
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # (--bf16: bf16 logits)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--fsdp2", action="store_true", help="fully_shard each block and the root instead of DDP")
    parser.add_argument("--bf16", action="store_true", help="with --fsdp2: bf16 parameters, float32 reduction")
    parser.add_argument("--tp", action="store_true", help="tensor-parallel MLPs (parallelize_module) instead of DDP")
    parser.add_argument("--skip-python", action="store_true",
                        help="compile(..., skip_python=True): replays make the recorded calls (under DDP, and its "
                             "own pre- and post-forward) without running train_step's Python")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. `torchrun --nproc-per-node 2 examples/train_ddp.py`")
    if args.bf16 and not args.fsdp2:
        parser.error("--bf16 is FSDP2's MixedPrecisionPolicy: add --fsdp2")
    if args.tp and args.fsdp2:
        parser.error("--tp and --fsdp2 are separate modes here: choose one")
    return args


def wrap(base, fsdp2, bf16, tp=False):
    """Two copies of ``base``, one for the compiled step and one for the eager step, in DDP, FSDP2 or
    with tensor-parallel MLPs."""
    if tp:
        return {name: tensor_parallel_mlps(copy.deepcopy(base)) for name in ("compiled", "eager")}
    if not fsdp2:
        return {"compiled": DDP(copy.deepcopy(base)), "eager": DDP(copy.deepcopy(base))}
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    models = {}
    for name in ("compiled", "eager"):
        model = copy.deepcopy(base)
        for block in model.blocks:  # one reduce-scatter per block, started during the backward
            fully_shard(block, mp_policy=policy)
        models[name] = fully_shard(model, mp_policy=policy)  # the root: embeddings, final norm, head
    return models


def tensor_parallel_mlps(model):
    """Each block's MLP split over the ranks: its first Linear by output features, its second by input
    features (one all-reduce of the block's output); the rest of the model stays replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(model.head.weight.device.type, (dist.get_world_size(),))
    for block in model.blocks:
        parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def train_step(model, opt, idx, targets, clip=True):
    loss = model(idx, targets)
    loss.backward()
    if clip:  # under FSDP2: a norm of sharded DTensor gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    vocab, dim, heads, seq, batch = 96, 32, 2, 16, 4
    torch.manual_seed(0)  # the same initialization on every rank (DDP also broadcasts rank 0's)
    base = TinyGPT(vocab, dim, heads, seq, args.layers).to(device)
    models = wrap(base, args.fsdp2, args.bf16, args.tp)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=3e-3) for k, m in models.items()}

    compiled_step = compiler.compile(train_step, backend=args.backend, skip_python=args.skip_python)
    # each rank its own shard of the data; tensor parallel: the same batch, each rank its share of the math
    generator = torch.Generator().manual_seed(1000 + (0 if args.tp else rank))
    for step in range(args.steps):
        idx = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
        targets = torch.roll(idx, -1, dims=1)  # learnable: predict the next token of a random stream
        ours = compiled_step(models["compiled"], optimizers["compiled"], idx, targets, not args.tp).item()
        eager = train_step(models["eager"], optimizers["eager"], idx, targets, not args.tp).item()
        print(f"rank {rank}/{world} step {step:3d}  compiled {ours:.6f}  eager {eager:.6f}", flush=True)

    def full(p):  # (a DTensor shard gathered whole: a collective, every rank calls it in the same order)
        return p.full_tensor() if isinstance(p, DTensor) else p

    diff = max((full(p) - full(q)).abs().max().item()
               for p, q in zip(models["compiled"].parameters(), models["eager"].parameters()))
    report = compiled_step.last_entry.report if compiled_step.last_entry else None
    kernels = len(report.kernels) if report else 0
    fallbacks = (report.fallbacks or "none") if report else "n/a"
    stats = compiled_step.stats
    # (FSDP2: the first call's recording holds its lazy initialization; the next two calls leave it
    # and run eagerly from there, the fourth records the steady path, which the later calls replay)
    left = f" ({stats['divergences']} left their recording and ran eagerly)" if stats["divergences"] else ""
    print(f"rank {rank}: max |param difference| {diff:.2e}; {kernels} kernels per step; "
          f"replays {stats['replays']}{left}; fallbacks: {fallbacks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
