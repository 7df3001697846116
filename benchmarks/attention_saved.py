"""What an attention layer saves for backward: eager against ours, form by form (issue 34).

``python -m benchmarks.attention_saved [--lengths 256,1024] [--json PATH] [--out DIR]``

Each form is one attention layer's forward (q, k, v made by the caller, requiring grad), run
under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd packs for backward is
counted once per storage (its bytes), and the tool notes the saved tensors with two dimensions of
length T (the T x T attention weights flash attention never stores). Ours is measured on a
replay (the second call; the first records eagerly) on both CPU paths: ``interpret`` (the Triton
kernels in Triton's interpreter) and ``torch`` (the CPU path). Issue 34's target: at most 1.25x
eager's bytes and no T x T tensor, for every form, at T=256 and T=1024.

Forms (B=2, D=32, float32): nanoGPT's causal SDPA; SDPA with an additive mask broadcast over
batch and heads and ``enable_gqa`` (4 query heads, 2 key/value heads); a boolean mask; dropout
0.1; and nanoGPT's explicit non-flash path (``softmax(q kᵀ · scale, masked_fill) @ v``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import compiler

BATCH, HEAD_DIM = 2, 32


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _masked_gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _bool_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)


def _explicit(q, k, v):
    """nanoGPT's attention without flash: the weights materialized, a causal masked_fill."""
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = att.masked_fill(~causal, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def forms(T: int) -> dict:
    """name -> (function, arguments); the arguments' tensors are fresh, q/k/v requiring grad. T must
    differ from every other dim (a saved tensor's dims of length T are what is counted)."""
    if T in (BATCH, 2, 4, HEAD_DIM):
        raise ValueError(f"T={T}: choose a length other than the batch, head counts and head dim")
    g = torch.Generator().manual_seed(T)

    def qkv(heads=2, kv_heads=2):
        return [torch.randn(BATCH, h, T, HEAD_DIM, generator=g).requires_grad_() for h in (heads, kv_heads, kv_heads)]
    return {
        "sdpa causal (nanoGPT)": (_causal, qkv()),
        "sdpa additive mask + GQA": (_masked_gqa, qkv(4, 2) + [torch.randn(1, 1, T, T, generator=g)]),
        "sdpa boolean mask": (_bool_mask, qkv() + [torch.rand(T, T, generator=g) > 0.2]),
        "sdpa causal + dropout 0.1": (_dropout, qkv()),
        "explicit (nanoGPT non-flash)": (_explicit, qkv()),
    }


class SavedBytes:
    """``with SavedBytes(T) as saved:`` counts what autograd packs for backward in the block."""

    def __init__(self, length: int):
        self.length = length
        self.storages: dict = {}    # storage address -> bytes
        self.square = 0             # saved tensors with two dims of length T

    def _pack(self, t):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
            if sum(1 for size in t.shape if size == self.length) >= 2:
                self.square += 1
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def measure(fn, args, length: int, backend: str | None) -> dict:
    """Bytes saved (and T x T tensors) by one call: eager (``backend`` None), or ours on a replay."""
    run = fn if backend is None else compiler.compile(fn, backend=backend)
    if backend is not None:
        run(*args)  # (the recording: eager, unmeasured)
    with SavedBytes(length) as saved:
        out = run(*args)
    out.sum().backward()  # (the saved tensors were live until here)
    stats = getattr(run, "stats", {})
    return {"bytes": saved.bytes, "square": saved.square, "replayed": stats.get("replays", 0) > 0,
            "kernels": stats.get("kernel_launches", 0)}


def run(lengths, backends=("interpret", "torch")) -> list:
    rows = []
    for T in lengths:
        for name, (fn, args) in forms(T).items():
            row = {"form": name, "T": T, "eager": measure(fn, args, T, None)}
            for backend in backends:
                row[backend] = measure(fn, args, T, backend)
            rows.append(row)
            print(f"T={T} {name}: eager {row['eager']['bytes'] / 1024:.0f} KB", file=sys.stderr, flush=True)
    return rows


def table(rows, backends=("interpret", "torch")) -> str:
    head = "| form | T | eager KB (T×T saved) | " + " | ".join(f"{b} KB (× eager, T×T saved)" for b in backends) + " |"
    lines = [head, "|" + "---|" * (3 + len(backends))]
    for row in rows:
        eager = row["eager"]["bytes"]
        cells = [f"{row[b]['bytes'] / 1024:,.0f} ({row[b]['bytes'] / eager:.2f}×, {row[b]['square']})"
                 + ("" if row[b]["replayed"] else " †") for b in backends]
        lines.append(f"| {row['form']} | {row['T']} | {eager / 1024:,.0f} ({row['eager']['square']}) | "
                     + " | ".join(cells) + " |")
    lines.append("\n† not a replay: the compiled call ran eagerly")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024", help="sequence lengths T, comma-separated")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--out", help="write attention-saved.md here (a folder)")
    args = parser.parse_args(argv)
    rows = run([int(t) for t in args.lengths.split(",")])
    text = table(rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention-saved.md"), "w") as f:
            f.write(f"# Saved for backward by one attention layer (B={BATCH}, D={HEAD_DIM}, float32)\n\n"
                    f"`python -m benchmarks.attention_saved --lengths {args.lengths}`; torch {torch.__version__}.\n\n"
                    + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
