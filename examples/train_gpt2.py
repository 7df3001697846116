"""Train a small GPT-2 from Hugging Face transformers with a compiled training step.

    pip install -e ".[test]"   # transformers
    python examples/train_gpt2.py [--steps 10] [--backend auto]

The model is built from a config (random init, nothing downloaded) and learns a repeating
token pattern. The whole step — forward, language-model loss, loss.backward(),
AdamW.step(), zero_grad() — is one compiled function; an identical eager copy trains beside
it. Each step prints the compiled loss next to eager's and the kernels the step launched;
what still runs eagerly (if anything) is printed first, from ``compiler.explain``.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch

import compiler
from runtime.backends import BACKENDS  # (every backend compiler.compile takes)


def make_model(device, width: int, layers: int, vocab: int, context: int):
    from transformers import GPT2Config, GPT2LMHeadModel  # a test dependency: pip install -e ".[test]"

    config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(device)


def make_batch(device, batch: int, context: int, vocab: int):
    """Sequences of a repeating pattern with a random phase per row: learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randperm(vocab, generator=g)[:7]
    phase = torch.randint(0, 7, (batch, 1), generator=g)
    ids = pattern[(phase + torch.arange(context)) % 7]
    return ids.to(device)


def training_step(model, lr):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []

    def step(input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return step, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)

    vocab, context, batch = 128, 32, 4
    model = make_model(args.device, args.width, args.layers, vocab, context)
    model.train()
    eager_model = copy.deepcopy(model)
    ids = make_batch(args.device, batch, context, vocab)
    step, losses = training_step(model, 3e-3)
    eager_step, eager_losses = training_step(eager_model, 3e-3)
    compiled_step = compiler.compile(step, backend=args.backend)

    start = time.perf_counter()
    report = compiler.explain(compiled_step, ids)  # step 0: runs eagerly while it records
    eager_step(ids)
    print(f"GPT-2: {sum(p.numel() for p in model.parameters())} parameters, {args.layers} layers, width {args.width}")
    print(f"kernels in the recording: {len(report.forward_kernels)} forward, {len(report.backward_kernels)} backward")
    print(f"fallbacks: {'none' if not report.fallbacks else ''}")
    for reason in report.fallbacks:
        print(f"  - {reason}")
    print(f"step   0  loss {losses[-1].item():.6f}  eager {eager_losses[-1].item():.6f}  (recording)")
    for i in range(1, args.steps):
        before = compiled_step.stats.get("kernel_launches", 0)
        compiled_step(ids)
        eager_step(ids)
        launched = compiled_step.stats.get("kernel_launches", 0) - before
        print(f"step {i:3d}  loss {losses[-1].item():.6f}  eager {eager_losses[-1].item():.6f}  "
              f"kernels {launched}  ran: {compiled_step.last_backend}")
        if not math.isclose(losses[-1].item(), eager_losses[-1].item(), rel_tol=1e-3, abs_tol=1e-4):
            raise SystemExit(f"compiled and eager losses differ at step {i}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s; final loss {losses[-1].item():.6f}")
    return losses, eager_losses


if __name__ == "__main__":
    main(sys.argv[1:])
