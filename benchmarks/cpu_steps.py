"""Whole training steps on the CPU: eager, ours (the default backend) and torch.compile (Inductor's
C++), timed side by side in one process, and each compiled backend's cold start (issue 36).

    python -m benchmarks.cpu_steps [--out benchmarks/results] [--only nanogpt,...]   # ~3 minutes, 2 cores

Steps (each: forward, loss, ``loss.backward()``, the optimizer's step, ``zero_grad``):
- ``readme_mlp``: ``examples/train_mlp.py``'s step (Linear 4-64-64-1, GELU, MSE, Adam; batch 256);
- ``residual_mlp``: 4 residual blocks (d=256, LayerNorm, GELU MLP, dropout 0.1), AdamW,
  ``clip_grad_norm_``; batch 512;
- ``nanogpt``: nanoGPT's GPT (2 layers, n_embd 128, 4 heads, T=128, B=8, vocab 512, causal
  ``scaled_dot_product_attention``, tied embedding), AdamW, ``clip_grad_norm_(1.0)``.

Every backend trains its own copy from the same weights on the same batch. After 3 warm-up steps
(ours records at its first, torch.compile compiles), each backend's step is timed in rounds of
``--steps`` steps, the rounds interleaved; the table gives the median per-step time and its ratio
to eager's. The first call's time (the recording or compiling, in this process: torch.compile's
kernels compiled cold in a fresh cache folder, ours with an empty kernel cache) is the cold start.
Writes ``cpu-steps.md`` and ``cpu-steps.json`` under ``--out`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import tempfile
import time

import compiler  # noqa: F401  (first)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.cpu_kernels import write_results  # noqa: E402

ROUNDS, STEPS, WARMUP = 9, 5, 3


# -- nanoGPT's model (github.com/karpathy/nanoGPT, model.py), as its users write it -------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, context=128, n_layer=2, n_embd=128, n_head=4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(context, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class ResidualMLP(nn.Module):
    def __init__(self, d=256, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d), nn.Dropout(0.1)) for _ in range(blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(self.head(x), y)


def _clipped_step(model, opt, *batch):
    loss = model(*batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def _plain_step(model, opt, *batch):
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


class ReadmeMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def cases() -> dict:
    """name -> (model, optimizer maker, step function, batch)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (8, 129), generator=g)
    return {
        "readme_mlp": (ReadmeMLP(), lambda p: torch.optim.Adam(p, lr=1e-2), _plain_step,
                       (torch.rand(256, 4, generator=g) * 4 - 2, torch.randn(256, 1, generator=g))),
        "residual_mlp": (ResidualMLP(), lambda p: torch.optim.AdamW(p, lr=1e-3), _clipped_step,
                         (torch.randn(512, 256, generator=g), torch.randn(512, 1, generator=g))),
        "nanogpt": (GPT(), lambda p: torch.optim.AdamW(p, lr=1e-3), _clipped_step,
                    (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())),
    }


def _backends(model, make_opt, step, batch) -> dict:
    """name -> (callable step, first call's seconds)."""
    runs = {}
    for name in ("eager", "ours", "torch.compile"):
        m = copy.deepcopy(model)
        opt = make_opt(m.parameters())
        fn = {"eager": step, "ours": compiler.compile(step),
              "torch.compile": torch.compile(step)}[name]
        start = time.perf_counter()
        fn(m, opt, *batch).item()
        first = time.perf_counter() - start
        runs[name] = (fn, m, opt, first)
    return runs


def measure(name, model, make_opt, step, batch, rounds=ROUNDS, steps=STEPS) -> dict:
    torch.compiler.reset()
    runs = _backends(model, make_opt, step, batch)
    for fn, m, opt, _ in runs.values():
        for _ in range(WARMUP):
            fn(m, opt, *batch).item()
    times = {b: [] for b in runs}
    for _ in range(rounds):
        for b, (fn, m, opt, _) in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                loss = fn(m, opt, *batch)
            loss.item()
            times[b].append((time.perf_counter() - start) / steps * 1e3)
    ours = runs["ours"][0]
    row = {"workload": name, "ours_backend": ours.last_backend, "ours_divergences": ours.stats["divergences"],
           "ours_fallbacks": list(ours.last_entry.report.fallbacks) if ours.last_entry else []}
    eager = statistics.median(times["eager"])
    for b, ts in times.items():
        row[b] = {"ms": round(statistics.median(ts), 3), "x_eager": round(statistics.median(ts) / eager, 3),
                  "first_call_s": round(runs[b][3], 4)}
    return row


def table(rows, rounds: int = ROUNDS) -> str:
    lines = ["# Training steps on the CPU (`python -m benchmarks.cpu_steps`)", "",
             f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}. Median per-step time of "
             f"{rounds} interleaved rounds of {STEPS} steps, ms (× eager); first call (cold: recording and "
             "compiling, in a fresh kernel cache), s.", "",
             "| step | eager | ours | torch.compile | ours: first call | torch.compile: first call | ours ran |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[b]['ms']:.2f} ({r[b]['x_eager']:.2f}×)" for b in ("eager", "ours", "torch.compile")]
        lines.append(f"| {r['workload']} | {' | '.join(cells)} | {r['ours']['first_call_s']:.1f} | "
                     f"{r['torch.compile']['first_call_s']:.1f} | {r['ours_backend']}"
                     f"{', fallbacks: ' + '; '.join(r['ours_fallbacks']) if r['ours_fallbacks'] else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for cpu-steps.md/.json (default: a new temporary folder)")
    parser.add_argument("--only", help=f"comma-separated: {', '.join(cases())}")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    # cold starts: empty caches for both compilers, in this process only
    os.environ.setdefault("SYMGRAD_CACHE_DIR", tempfile.mkdtemp(prefix="symgrad-cold-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
    chosen = cases()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    rows = []
    for name, case in chosen.items():
        row = measure(name, *case, rounds=args.rounds)
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{b} {row[b]['ms']:.2f} ms ({row[b]['x_eager']:.2f}x)"
                                      for b in ("eager", "ours", "torch.compile")), flush=True)
    write_results(args.out, "cpu-steps", table(rows, args.rounds), rows)
    return rows


if __name__ == "__main__":
    main()
