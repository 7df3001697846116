"""The workloads, written as model code is written, each at three sizes.

A workload builds a ``Case`` for one size on one device: the function every backend runs
(``fn``), fresh seeded arguments in a dtype (``make_args``: float32 for the backends,
float64 for the reference), one step (``step``: the call, and for forward+backward
workloads the backward with a fixed ``grad_out``), and the tensors a step is checked by
(``observe``: the output and every gradient, or a training step's loss and parameters).

Sizes: ``full`` is the issue's GPU size; ``cpu`` times the CPU (the default without a GPU): eager's
step takes 5 to 50 ms on 2 cores, so fixed per-call costs do not decide the times, with tensors
under 32 MiB (see benchmarks/README.md); ``small`` fits Triton's CPU interpreter; ``tiny`` is for
the tests and the interpreter check.

>>> case = WORKLOADS["gelu"].build("tiny", torch.device("cpu"))
>>> args = case.make_args(torch.float32)
>>> [tuple(t.shape) for t in case.observe(args, case.step(case.fn, args))]
[(8, 64), (8, 64)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SIZES = ("full", "cpu", "small", "tiny")


@dataclass
class Case:
    fn: Callable                  # what each backend runs (compiled or not)
    make_args: Callable           # (dtype) -> fresh arguments, the same values for every dtype
    step: Callable                # (fn, args) -> result of one step
    observe: Callable             # (args, result) -> tensors to check against the reference
    fn_args: Callable             # (args) -> the arguments ``fn`` itself is called with
    shape: str                    # the sizes, for the report
    flops: float | None = None    # per step, for matmul-bound workloads (TFLOP/s)


@dataclass
class Workload:
    name: str
    group: int                    # the numbering (1 elementwise ... 7 overhead)
    description: str
    sizes: dict                   # size -> keyword arguments of make
    make: Callable                # (device, **sizes) -> Case

    def build(self, size: str, device: torch.device) -> Case:
        return self.make(device, **self.sizes[size])


# -- helpers ---------------------------------------------------------------------------------
def _randn(gen, shape, device, dtype, scale=1.0, requires_grad=False):
    # Drawn in float32 on the device, then cast: every dtype sees the same values, so the
    # float64 reference computes on exactly the backends' inputs.
    t = (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _generator(device, seed=0):
    return torch.Generator(device=device).manual_seed(seed)


def forward_backward(fn, make_inputs, shape, flops=None) -> Case:
    """A function of tensors, then ``out.backward(grad_out)``: a layer's forward and backward.
    ``make_inputs(dtype)`` returns (inputs, grad_out); grad_out None for a scalar loss."""

    def make_args(dtype):
        inputs, grad_out = make_inputs(dtype)
        return (*inputs, grad_out)

    def step(f, args):
        *inputs, grad_out = args
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
        out = f(*inputs)
        out.backward(grad_out)
        return out

    def observe(args, out):
        grads = [t.grad for t in args[:-1] if isinstance(t, torch.Tensor) and t.requires_grad]
        return [out.detach(), *grads]

    return Case(fn, make_args, step, observe, lambda args: tuple(args[:-1]), shape, flops)


def training_step(fn, make_model, make_batch, shape, flops=None, lr=1e-2) -> Case:
    """``fn(model, opt, *batch)``: forward, loss, backward, SGD step, zero_grad."""

    def make_args(dtype):
        torch.manual_seed(0)  # the same initial weights for every backend and dtype
        model = make_model().to(device=make_batch.device, dtype=dtype)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        return (model, opt, *make_batch(dtype))

    def step(f, args):
        return f(*args)

    def observe(args, loss):
        return [loss.detach(), *[p.detach() for p in args[0].parameters()]]

    return Case(fn, make_args, step, observe, tuple, shape, flops)


class _Batch:
    """Seeded batch maker that remembers its device (training_step moves the model there)."""

    def __init__(self, device, make):
        self.device = device
        self._make = make

    def __call__(self, dtype):
        return self._make(_generator(self.device, seed=1), dtype)


# -- 1. elementwise chains -------------------------------------------------------------------
def gelu(x):
    return F.gelu(x, approximate="tanh")


def swiglu(gate, up):
    return F.silu(gate) * up


def _make_gelu(device, t, i):
    def inputs(dtype):
        g = _generator(device)
        return [_randn(g, (t, i), device, dtype, requires_grad=True)], _randn(g, (t, i), device, dtype)
    return forward_backward(gelu, inputs, f"x {t}x{i}")


def _make_swiglu(device, t, i):
    def inputs(dtype):
        g = _generator(device)
        gate = _randn(g, (t, i), device, dtype, requires_grad=True)
        up = _randn(g, (t, i), device, dtype, requires_grad=True)
        return [gate, up], _randn(g, (t, i), device, dtype)
    return forward_backward(swiglu, inputs, f"gate, up {t}x{i}")


# -- 2. normalization --------------------------------------------------------------------------
def rms_norm(x, weight, eps=1e-6):
    # As LLaMA's reference code writes it.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def _make_norm(kind):
    def make(device, rows, cols):
        def inputs(dtype):
            g = _generator(device)
            x = _randn(g, (rows, cols), device, dtype, requires_grad=True)
            w = (1 + _randn(g, (cols,), device, dtype, scale=0.1)).requires_grad_(True)
            params = [w] if kind == "rms" else [w, _randn(g, (cols,), device, dtype, 0.1, requires_grad=True)]
            return [x, *params], _randn(g, (rows, cols), device, dtype)
        return forward_backward(rms_norm if kind == "rms" else layer_norm, inputs, f"x {rows}x{cols}")
    return make


# -- 3. softmax and cross-entropy ----------------------------------------------------------------
def softmax(logits):
    return F.softmax(logits, dim=-1)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits, targets)


def _make_softmax(device, rows, vocab):
    def inputs(dtype):
        g = _generator(device)
        x = _randn(g, (rows, vocab), device, dtype, scale=2.0, requires_grad=True)
        return [x], _randn(g, (rows, vocab), device, dtype)
    return forward_backward(softmax, inputs, f"logits {rows}x{vocab}")


def _make_cross_entropy(device, rows, vocab):
    def inputs(dtype):
        g = _generator(device)
        x = _randn(g, (rows, vocab), device, dtype, scale=2.0, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,), generator=g, device=device)
        return [x, targets], None  # a scalar loss: backward() without grad_out
    return forward_backward(cross_entropy, inputs, f"logits {rows}x{vocab}")


# -- 4. MLP training step ------------------------------------------------------------------------
def mlp_train_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _make_mlp(device, batch, dim, hidden):
    def make_model():
        return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def make_batch(g, dtype):
        return _randn(g, (batch, dim), device, dtype), _randn(g, (batch, dim), device, dtype)

    # forward 2 matmuls of 2*B*D*H flops; backward twice that (input and weight gradients)
    return training_step(mlp_train_step, make_model, _Batch(device, make_batch),
                         f"batch {batch}, {dim}->{hidden}->{dim}", flops=12.0 * batch * dim * hidden)


# -- 5. complex-valued elementwise chain ---------------------------------------------------------
def complex_gate(z, w, b):
    # A learnable complex gain and bias, then a modulus-gated activation (as in complex-valued
    # networks): u * sigmoid(|u|) keeps the phase of u and squashes its magnitude.
    u = z * w + b
    return u * torch.sigmoid(u.abs())


def _make_complex(device, rows, cols):
    def inputs(dtype):
        g = _generator(device)  # complex64 from float32 parts, complex128 from float64

        def c(shape, requires_grad=False):
            re, im = _randn(g, shape, device, dtype), _randn(g, shape, device, dtype)
            return torch.complex(re, im).requires_grad_(requires_grad)
        return [c((rows, cols), True), c((cols,), True), c((cols,), True)], c((rows, cols))
    return forward_backward(complex_gate, inputs, f"z {rows}x{cols} complex64")


# -- 6. a small transformer block training step --------------------------------------------------
class TinyTransformer(nn.Module):
    """Token embedding, one pre-norm block (causal attention, GELU MLP), final norm, LM head and
    cross-entropy, in the style of nanoGPT: attention by ``F.scaled_dot_product_attention``, or
    with ``explicit`` by matmuls, a masked_fill and a softmax (nanoGPT's path without flash)."""

    def __init__(self, vocab, dim, heads, seq, explicit=False):
        super().__init__()
        self.heads, self.explicit = heads, explicit
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.embed(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        if self.explicit:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def transformer_train_step(model, opt, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _make_transformer(device, batch, seq, dim, heads, vocab, explicit=False):
    def make_batch(g, dtype):
        idx = torch.randint(0, vocab, (batch, seq), generator=g, device=device)
        return idx, torch.randint(0, vocab, (batch, seq), generator=g, device=device)

    # matmul flops per token, forward: qkv 6D², proj 2D², MLP 16D², head 2DV, attention 4TD;
    # the backward is twice the forward.
    per_token = 24 * dim * dim + 2 * dim * vocab + 4 * seq * dim
    return training_step(transformer_train_step, lambda: TinyTransformer(vocab, dim, heads, seq, explicit),
                         _Batch(device, make_batch), f"batch {batch}x{seq}, dim {dim}, {heads} heads, vocab {vocab}"
                         + (", attention by matmuls" if explicit else ", SDPA"), flops=3.0 * per_token * batch * seq)


def _make_explicit_transformer(device, **sizes):
    return _make_transformer(device, explicit=True, **sizes)


# -- 6b. causal attention alone ------------------------------------------------------------------
def causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _make_attention(head_dim):
    def make(device, batch, heads, seq):
        def inputs(dtype):
            g = _generator(device)
            shape = (batch, heads, seq, head_dim)
            return [_randn(g, shape, device, dtype, requires_grad=True) for _ in range(3)], \
                _randn(g, shape, device, dtype)
        # causal: half of the 4·T²·D products per head forward, 2.5x that backward
        flops = 3.5 * 4.0 * batch * heads * seq * seq * head_dim * 0.5
        return forward_backward(causal_attention, inputs, f"causal, {batch}x{heads} heads, T {seq}, D {head_dim}",
                                flops=flops)
    return make


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_attention(q, k, v, cos, sin):
    """Llama's attention after its projections: the rotary embedding on q and k (Hugging Face's
    apply_rotary_pos_emb), then causal SDPA with grouped-query attention."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _make_rotary_attention(device, batch, heads, kv_heads, seq, head_dim):
    def inputs(dtype):
        g = _generator(device)
        q = _randn(g, (batch, heads, seq, head_dim), device, dtype, requires_grad=True)
        k, v = (_randn(g, (batch, kv_heads, seq, head_dim), device, dtype, requires_grad=True) for _ in range(2))
        angles = torch.arange(seq, device=device)[:, None] * (10000.0 ** (-torch.arange(0, head_dim, 2, device=device)
                                                                         / head_dim))[None]
        angles = torch.cat((angles, angles), -1)[None].expand(batch, seq, head_dim)
        return [q, k, v, angles.cos().to(dtype), angles.sin().to(dtype)], \
            _randn(g, (batch, heads, seq, head_dim), device, dtype)
    flops = 3.5 * 4.0 * batch * heads * seq * seq * head_dim * 0.5
    return forward_backward(rotary_attention, inputs, f"rotary + causal GQA, {batch}x{heads} heads ({kv_heads} "
                            f"key/value), T {seq}, D {head_dim}", flops=flops)


# -- 7. a tiny overhead-bound step ----------------------------------------------------------------
def _make_overhead(device, batch, dim, layers):
    def make_model():
        blocks = []
        for i in range(layers):
            blocks += [nn.Linear(dim, dim)] + ([nn.ReLU()] if i < layers - 1 else [])
        return nn.Sequential(*blocks)

    def make_batch(g, dtype):
        return _randn(g, (batch, dim), device, dtype), _randn(g, (batch, dim), device, dtype)

    return training_step(mlp_train_step, make_model, _Batch(device, make_batch),
                         f"{layers}x Linear({dim}), batch {batch}", flops=6.0 * layers * batch * dim * dim)


# -- 8. a small CNN training step ---------------------------------------------------------------
class TinyResNet(nn.Module):
    """A ResNet-style stem and one residual block: conv, batch norm (training statistics and
    running-statistics updates), ReLU, 3x3/2 max pool, global average pool, linear head."""

    def __init__(self, channels, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.block = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                   nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x, targets):
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        return F.cross_entropy(self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)), targets)


def _make_cnn(device, batch, channels, size, classes):
    def make_batch(g, dtype):
        images = _randn(g, (batch, 3, size, size), device, dtype)
        return images, torch.randint(0, classes, (batch,), generator=g, device=device)

    out = size // 2
    # conv flops: 2 * K * K * Cin * Cout * H * W per image; the backward twice the forward
    per_image = 2 * 9 * (3 * channels * size * size + 2 * channels * channels * out * out)
    return training_step(transformer_train_step, lambda: TinyResNet(channels, classes), _Batch(device, make_batch),
                         f"batch {batch}, {channels} channels, {size}x{size} images, {classes} classes",
                         flops=3.0 * per_image * batch)


# -- varying: the transformer step over batches whose shapes change (issue 15; benchmarks.varying) --------
VARYING = {
    "small": dict(batch=3, last_batch=2, steps=20, min_len=16, max_len=128, dim=64, heads=4, vocab=256),
    "tiny": dict(batch=3, last_batch=2, steps=5, min_len=5, max_len=20, dim=16, heads=2, vocab=32),
}


def varying_run(device, size="small", seed=0):
    """(make_model, batches) of the "varying" workload: the transformer step's model with room
    for the longest sequence, and ``steps`` batches of (idx, targets) whose sequence lengths are
    distinct, drawn from ``min_len..max_len`` (seeded), the last batch smaller, as the last
    batch of an epoch is."""
    import random

    c = VARYING[size]
    lengths = random.Random(seed).sample(range(c["min_len"], c["max_len"] + 1), c["steps"])
    g = _generator(device, seed=1)
    batches = []
    for i, t in enumerate(lengths):
        b = c["last_batch"] if i == len(lengths) - 1 else c["batch"]
        batches.append((torch.randint(0, c["vocab"], (b, t), generator=g, device=device),
                        torch.randint(0, c["vocab"], (b, t), generator=g, device=device)))

    def make_model():
        torch.manual_seed(0)
        return TinyTransformer(c["vocab"], c["dim"], c["heads"], c["max_len"]).to(device)
    return make_model, batches


# The attention workloads' cpu size: the same work (T²·heads) at each length, the shorter sequence
# with more heads, so that eager takes over 5 ms on 2 cores at both.
_CPU_ATTENTION = {1024: dict(batch=1, heads=16, seq=256), 4096: dict(batch=1, heads=4, seq=512)}

WORKLOADS = {w.name: w for w in [
    Workload("gelu", 1, "GELU (tanh) forward+backward", make=_make_gelu, sizes={
        "full": dict(t=8192, i=14336), "cpu": dict(t=4096, i=1024), "small": dict(t=64, i=512),
        "tiny": dict(t=8, i=64)}),
    Workload("swiglu", 1, "SwiGLU silu(gate)*up forward+backward", make=_make_swiglu, sizes={
        "full": dict(t=8192, i=14336), "cpu": dict(t=4096, i=1024), "small": dict(t=64, i=512),
        "tiny": dict(t=8, i=64)}),
    Workload("rmsnorm", 2, "RMSNorm forward+backward", make=_make_norm("rms"), sizes={
        "full": dict(rows=32768, cols=4096), "cpu": dict(rows=4096, cols=1024), "small": dict(rows=64, cols=512),
        "tiny": dict(rows=8, cols=64)}),
    Workload("layernorm", 2, "LayerNorm (F.layer_norm) forward+backward", make=_make_norm("layer"), sizes={
        "full": dict(rows=32768, cols=4096), "cpu": dict(rows=7680, cols=1024), "small": dict(rows=64, cols=512),
        "tiny": dict(rows=8, cols=64)}),
    Workload("softmax", 3, "softmax forward+backward", make=_make_softmax, sizes={
        "full": dict(rows=8192, vocab=32768), "cpu": dict(rows=7680, vocab=1024), "small": dict(rows=32, vocab=1024),
        "tiny": dict(rows=4, vocab=64)}),
    Workload("cross_entropy", 3, "cross-entropy forward+backward", make=_make_cross_entropy, sizes={
        "full": dict(rows=8192, vocab=32768), "cpu": dict(rows=1920, vocab=4096), "small": dict(rows=32, vocab=1024),
        "tiny": dict(rows=4, vocab=64)}),
    Workload("mlp_step", 4, "MLP training step: Linear-GELU-Linear, MSE, SGD", make=_make_mlp, sizes={
        "full": dict(batch=8192, dim=2048, hidden=8192), "cpu": dict(batch=1024, dim=256, hidden=1024),
        "small": dict(batch=64, dim=128, hidden=512),
        "tiny": dict(batch=4, dim=16, hidden=32)}),
    Workload("complex", 5, "complex elementwise chain forward+backward", make=_make_complex, sizes={
        "full": dict(rows=8192, cols=8192), "cpu": dict(rows=512, cols=1024), "small": dict(rows=64, cols=256),
        "tiny": dict(rows=4, cols=16)}),
    Workload("transformer_step", 6, "transformer block training step", make=_make_transformer, sizes={
        "full": dict(batch=8, seq=1024, dim=1024, heads=16, vocab=16384),
        "cpu": dict(batch=2, seq=128, dim=256, heads=4, vocab=2048),
        "small": dict(batch=2, seq=32, dim=64, heads=4, vocab=256),
        "tiny": dict(batch=1, seq=8, dim=16, heads=2, vocab=32)}),
    Workload("transformer_explicit_step", 6, "transformer block training step, attention by matmuls",
             make=_make_explicit_transformer, sizes={
                 "full": dict(batch=8, seq=1024, dim=1024, heads=16, vocab=16384),
                 "cpu": dict(batch=2, seq=128, dim=256, heads=4, vocab=2048),
                 "small": dict(batch=2, seq=32, dim=64, heads=4, vocab=256),
                 "tiny": dict(batch=1, seq=8, dim=16, heads=2, vocab=32)}),
    *[Workload(f"attention_d{d}_t{t}", 6, f"causal SDPA forward+backward, head dim {d}, T {t}",
               make=_make_attention(d), sizes={"full": dict(batch=8, heads=12, seq=t),
                                               "cpu": _CPU_ATTENTION[t],
                                               "small": dict(batch=1, heads=2, seq=96),
                                               "tiny": dict(batch=1, heads=2, seq=16)})
      for d in (64, 128) for t in (1024, 4096)],
    Workload("rotary_attention", 6, "Llama's rotary embedding + causal GQA SDPA, forward+backward",
             make=_make_rotary_attention, sizes={
                 "full": dict(batch=4, heads=32, kv_heads=8, seq=2048, head_dim=64),
                 "cpu": dict(batch=1, heads=8, kv_heads=2, seq=512, head_dim=64),
                 "small": dict(batch=1, heads=4, kv_heads=2, seq=64, head_dim=16),
                 "tiny": dict(batch=1, heads=2, kv_heads=1, seq=16, head_dim=16)}),
    Workload("overhead_step", 7, "tiny training step, 4 Linear layers: per-call overhead", make=_make_overhead,
             sizes={"full": dict(batch=16, dim=256, layers=4), "cpu": dict(batch=16, dim=256, layers=4),
                    "small": dict(batch=16, dim=256, layers=4),
                    "tiny": dict(batch=4, dim=16, layers=4)}),
    Workload("cnn_step", 8, "ResNet-style CNN training step (conv, batch norm, pools)", make=_make_cnn, sizes={
        "full": dict(batch=64, channels=128, size=64, classes=1000),
        "cpu": dict(batch=16, channels=32, size=32, classes=100),
        "small": dict(batch=4, channels=8, size=8, classes=10),
        "tiny": dict(batch=2, channels=4, size=8, classes=3)}),
]}
