"""``python -m benchmarks.models``: whole training steps of real models, priced on an H100 from shapes
alone — ours, eager and torch.compile — with every fused kernel of ours compiled for sm_90.

    python -m benchmarks.models --models gpt2,llama,vision --size real --dtype bfloat16 \
        --json benchmarks/results/models-real-bfloat16.json

The models, built from configs (nothing downloaded), written as nanoGPT writes them: GPT-2 124M
(B=8, T=1024), a Llama-style 1.1B (TinyLlama's shape: GQA, RMSNorm, SwiGLU, rotary; B=4, T=2048) and
ResNet-18 (B=64, 224x224). A step is forward (bf16 autocast, fp32 master weights), cross-entropy,
backward, AdamW. Ours and eager are traced on meta tensors (``step_trace.trace_meta_step``: nothing
computed or allocated); torch.compile runs Inductor's Triton path on real CPU tensors at small probe
sizes (``inductor_triton.probe_model``) and is extrapolated to the real size. See benchmarks/README.md,
"Whole models on Hopper".

>>> model = GPT(GPT_CONFIGS["tiny"])
>>> idx = torch.zeros(2, 16, dtype=torch.long)
>>> model(idx, idx).shape
torch.Size([])
"""

from __future__ import annotations

import compiler  # noqa: F401  (first: before anything imports triton)

import contextlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402


# -- GPT-2 (nanoGPT's model.py, without dropout) ----------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int


GPT_CONFIGS = {"real": GPTConfig(layers=12, dim=768, heads=12, vocab=50257, seq=1024),
               "tiny": GPTConfig(layers=2, dim=64, heads=4, vocab=512, seq=32)}


def GPT(c: GPTConfig) -> nn.Module:
    """nanoGPT's GPT (``benchmarks.cpu_steps``, tied head, exact GELU) in config ``c``'s shape."""
    from benchmarks.cpu_steps import GPT as NanoGPT

    return NanoGPT(vocab=c.vocab, context=c.seq, n_layer=c.layers, n_embd=c.dim, n_head=c.heads)


# -- Llama-style (TinyLlama 1.1B's shape) -------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    seq: int


LLAMA_CONFIGS = {"real": LlamaConfig(layers=22, dim=2048, heads=32, kv_heads=4, hidden=5632, vocab=32000, seq=2048),
                 "tiny": LlamaConfig(layers=2, dim=64, heads=4, kv_heads=2, hidden=176, vocab=512, seq=32)}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim), RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.w1, self.w3 = nn.Linear(c.dim, c.hidden, bias=False), nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)   # (Hugging Face's apply_rotary_pos_emb casts them too)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        head_dim = c.dim // c.heads
        freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(c.seq, dtype=torch.float32)[:, None] * freqs[None]
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# -- a small ResNet-style CNN --------------------------------------------------------------------------
@dataclass(frozen=True)
class ResNetConfig:
    widths: tuple
    blocks: int       # residual blocks per stage
    classes: int
    image: int        # pixels per side


RESNET_CONFIGS = {"real": ResNetConfig(widths=(64, 128, 256, 512), blocks=2, classes=1000, image=224),
                  "tiny": ResNetConfig(widths=(8, 16), blocks=1, classes=10, image=16)}


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (``blocks=2``, widths 64..512): stem, four stages, pool, linear head."""

    def __init__(self, c: ResNetConfig):
        super().__init__()
        w = c.widths[0]
        self.stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], w
        for i, cout in enumerate(c.widths):
            for j in range(c.blocks):
                layers.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, c.classes)

    def forward(self, x, targets):
        x = self.layers(self.stem(x))
        return F.cross_entropy(self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)), targets)


# -- the batches and the step --------------------------------------------------------------------------
# model name -> size -> (batch, sequence length or image side)
BATCHES = {"gpt2": {"real": (8, 1024), "tiny": (2, 32)},
           "llama": {"real": (4, 2048), "tiny": (2, 32)},
           "vision": {"real": (64, 224), "tiny": (2, 16)}}


def build(model: str, size: str, layers: int | None = None):
    """(the model, its config) at ``size`` ("real" or "tiny"), on the current default device;
    ``layers`` overrides the config's depth (torch.compile's probes, ``benchmarks.models``)."""
    if model == "gpt2":
        c = GPT_CONFIGS[size]
        c = c if layers is None else GPTConfig(**{**c.__dict__, "layers": layers})
        return GPT(c), c
    if model == "llama":
        c = LLAMA_CONFIGS[size]
        c = c if layers is None else LlamaConfig(**{**c.__dict__, "layers": layers})
        return Llama(c), c
    if model == "vision":
        return ResNet(RESNET_CONFIGS[size]), RESNET_CONFIGS[size]
    raise ValueError(f"unknown model {model!r}: gpt2, llama, vision")


def make_batch(model: str, config, batch: int, length: int, device) -> tuple:
    """(inputs, targets) of one step: token ids, or images and class labels."""
    if model == "vision":
        return (torch.randn(batch, 3, length, length, device=device),
                torch.randint(0, config.classes, (batch,), device=device))
    return (torch.randint(0, config.vocab, (batch, length), device=device),
            torch.randint(0, config.vocab, (batch, length), device=device))


def depth(model: str, config) -> int | None:
    """Identical blocks in the model (what torch.compile's probes scale by), None for the CNN."""
    return None if model == "vision" else config.layers


def train_step(model, opt, inputs, targets, amp=None):
    """Forward, loss, backward, AdamW step, as training code writes it; ``amp`` the mixed-precision
    context of the forward (``torch.autocast``, or ``MetaAutocast`` on meta)."""
    if amp is None:
        loss = model(inputs, targets)
    else:
        with amp():
            loss = model(inputs, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


# -- mixed precision on meta tensors -------------------------------------------------------------------
# torch.autocast has no meta mode (its CPU and CUDA kernels cast only CPU and CUDA tensors), so on meta
# its casts are made explicitly: the operators CUDA's autocast runs in lower precision get their
# floating inputs cast to bfloat16 first, as autocast's ``lower_precision_fp`` policy does (a weight's
# cast is a ``_to_copy`` per use, autocast caches it per forward: one per use here, the same kernels
# for a weight used once). Other operators run in their inputs' dtype.
# NOTE: CUDA's autocast also runs a few operators in float32 (``fp32_set_opt_dtype``: log_softmax, so a
# cross-entropy over bf16 logits writes float32 log-probabilities); not modelled: eager's
# cross-entropy here reads and writes bf16 logits, which prices eager lower than a GPU runs it.
_LOWER_PRECISION = {F.linear, F.conv1d, F.conv2d, F.conv3d, torch.matmul, torch.Tensor.__matmul__, torch.mm,
                    torch.bmm, torch.addmm, torch.baddbmm, F.scaled_dot_product_attention}


class MetaAutocast(TorchFunctionMode):
    """``torch.autocast(dtype=torch.bfloat16)``'s casts for tensors autocast does not see (meta)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LOWER_PRECISION:
            args = tuple(_to_bf16(a) for a in args)
            kwargs = {k: _to_bf16(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _to_bf16(x):
    return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# -- ours and eager: traced from shapes ----------------------------------------------------------------
MODELS = ("gpt2", "llama", "vision")


def make_meta_args(model: str, size: str, batch: int | None = None, length: int | None = None):
    """``(model, AdamW, inputs, targets)`` on the meta device: nothing allocated. AdamW with
    ``foreach=True``, what it picks on a GPU (on meta it would pick its per-parameter loop)."""
    default_batch, default_length = BATCHES[model][size]
    with torch.device("meta"):
        net, config = build(model, size)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
        return (net, opt, *make_batch(model, config, batch or default_batch, length or default_length, "meta"))


def meta_step(dtype: str, eager: bool = False):
    """The training step traced on meta: under ``MetaAutocast`` in bfloat16, plain in float32;
    ``eager``: its attention as eager runs it on an H100 (``MetaFlashAttention``)."""
    def amp():
        modes = [MetaFlashAttention()] if eager else []
        modes += [MetaAutocast()] if dtype == "bfloat16" else []
        return _entered(modes)

    def step(model, opt, inputs, targets):
        return train_step(model, opt, inputs, targets, amp)
    return step


@contextlib.contextmanager
def _entered(modes):
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


class MetaFlashAttention(TorchFunctionMode):
    """Eager's ``scaled_dot_product_attention`` as an H100 runs it: the flash kernel. On meta tensors
    SDPA picks its math path (matmuls and a T×T softmax), so the call goes to the flash operator
    (the CPU one: its meta kernel gives the shapes; ``roofline.flash_op_cost`` prices it as
    FlashAttention-2). Grouped-query attention repeats k and v to q's heads first (a copy each, and
    its sum in backward), as SDPA does where its kernel lacks GQA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _flash_attention(*args, **kwargs)


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]


# -- torch.compile: Inductor's Triton path at probe sizes, extrapolated -----------------------------------
def probes(model: str, size: str, dtype: str) -> tuple[list, dict]:
    """(the probes torch.compile runs at, the point they are extrapolated to). Real transformers: 1 and
    2 layers x 128 and 256 tokens (batch 1) at the real widths, fitted bilinear in layers and tokens
    (identical layers; every Triton kernel's bytes are affine in tokens: the T×T attention is not a
    Triton kernel); ResNet-18: batch 1 and 2, affine in the batch. Tiny: the tiny step itself."""
    net_config = {"gpt2": GPT_CONFIGS, "llama": LLAMA_CONFIGS, "vision": RESNET_CONFIGS}[model][size]
    batch, length = BATCHES[model][size]
    base = dict(model=model, size=size, dtype=dtype)
    if size == "tiny":
        layers = depth(model, net_config)
        return [dict(base, layers=layers, batch=batch, length=length)], {"layers": layers, "tokens": batch}
    if model == "vision":
        return [dict(base, layers=None, batch=b, length=length) for b in (1, 2)], {"layers": None, "tokens": batch}
    return ([dict(base, layers=n, batch=1, length=t) for n in (1, 2) for t in (128, 256)],
            {"layers": net_config.layers, "tokens": batch * length})


def extrapolated(points: list, values: list, target: dict) -> float:
    """``values`` at ``points`` ({"layers", "tokens"}) fitted exactly (one point: itself; two: affine in
    tokens; four on a 2x2 grid: bilinear in layers and tokens), evaluated at ``target``."""
    if len(points) == 1:
        return float(values[0])
    if len(points) == 2:
        (t1, v1), (t2, v2) = ((p["tokens"], v) for p, v in zip(points, values))
        return v1 + (v2 - v1) * (target["tokens"] - t1) / (t2 - t1)
    grid = {(p["layers"], p["tokens"]): v for p, v in zip(points, values)}
    (l1, l2), (t1, t2) = sorted({p["layers"] for p in points}), sorted({p["tokens"] for p in points})
    u, w = (target["layers"] - l1) / (l2 - l1), (target["tokens"] - t1) / (t2 - t1)
    return ((1 - u) * (1 - w) * grid[l1, t1] + u * (1 - w) * grid[l2, t1] + (1 - u) * w * grid[l1, t2]
            + u * w * grid[l2, t2])


def _in_layers(points: list, values: list, target: dict) -> float:
    """``values`` at the probes with the most tokens, affine in layers (or the one such value)."""
    most = max(p["tokens"] for p in points)
    kept = [(p["layers"], v) for p, v in zip(points, values) if p["tokens"] == most]
    if len(kept) == 1:
        return float(kept[0][1])
    (l1, v1), (l2, v2) = sorted(kept)
    return v1 + (v2 - v1) * (target["layers"] - l1) / (l2 - l1)


def torch_compile_row(model: str, size: str, dtype: str, eager_trace) -> dict:
    """torch.compile's predicted step and peak: its Triton kernels (bytes and launches from the probes,
    extrapolated) plus the compute operators it leaves to PyTorch — cuBLAS matmuls, convolutions and
    flash attention, the same calls as eager's: eager's, from the real-size trace — and its other
    operators (``ones_like``, ...) at eager's price for that operator, counted at the probes."""
    from benchmarks.inductor_triton import probe_models
    from benchmarks.roofline import COPY_BANDWIDTH, LAUNCH_US

    runs, target = probes(model, size, dtype)
    results = probe_models(runs)
    points = [{"layers": r["layers"], "tokens": r["batch"] * (1 if model == "vision" else r["length"])}
              for r in runs]
    # NOTE: launch counts are not affine in tokens (Inductor splits reductions by size: GPT-2's probes
    # launch 88 kernels at 128 tokens, 108 at 256): the longest probes' counts, extrapolated in layers only
    launches = _in_layers(points, [r["launches"] for r in results], target)
    moved = extrapolated(points, [r["bytes"] for r in results], target)
    compute = [op for op in eager_trace.eager_ops if op.flops or op.rate is not None]
    compute_us = sum(op.predicted_us for op in compute)
    names = {n for r in results for n in r["operators"]} - {op.name for op in compute}
    other_us = 0.0
    for name in names:
        count = _in_layers(points, [r["operators"].get(name, 0) for r in results], target)
        priced = [op.predicted_us for op in eager_trace.eager_ops if op.name == name]
        other_us += count * (sum(priced) / len(priced) if priced else LAUNCH_US)
    step_peak = extrapolated(points, [r["peak"] for r in results], target)
    # NOTE: at the probes' sizes the step's peak is the optimizer's (foreach temporaries of the
    # parameters' size), not the activations' (ResNet-18: 56 MB at batch 1 and 2); what the forward
    # leaves for backward does grow with the tokens, so the peak is at least that above the
    # resident state, extrapolated (the gradients made during the backward not counted: a lower bound)
    saved = extrapolated(points, [r.get("saved", 0) for r in results], target)
    resident = eager_trace.eager_memory.params + eager_trace.eager_memory.optimizer
    us = moved / COPY_BANDWIDTH * 1e6 + launches * LAUNCH_US + compute_us + other_us
    return {"model": model, "backend": "torch.compile", "predicted_ms": us / 1e3,
            "peak_bytes": int(resident + max(step_peak, saved)), "saved_bytes": int(saved),
            "triton_kernels": round(launches), "triton_bytes": int(moved), "compute_ops": len(compute),
            "compute_ms": compute_us / 1e3, "other_ops_ms": other_us / 1e3,
            "params_bytes": eager_trace.eager_memory.params, "optimizer_bytes": eager_trace.eager_memory.optimizer,
            "probes": [dict(p, **{k: r.get(k) for k in ("launches", "bytes", "peak", "saved", "operators")})
                       for p, r in zip(runs, results)]}


# -- the run ----------------------------------------------------------------------------------------------
def run(models=MODELS, size: str = "real", dtype: str = "bfloat16", processes: int = 2, inductor: bool = True,
        log=print) -> dict:
    """Trace, compile (sm_90) and price each model's step for ours, eager and torch.compile: the JSON
    document (``models``, ``kernels``, ``meta``; see the module doc)."""
    import time

    from benchmarks.sm90 import compile_launches
    from benchmarks.step_trace import trace_meta_step

    started = time.perf_counter()
    rows, kernels, seconds = [], [], {}
    for model in models:
        t0 = time.perf_counter()
        trace = trace_meta_step(model, lambda: make_meta_args(model, size), meta_step(dtype),
                                f"{dtype} (autocast)" if dtype == "bfloat16" else dtype, meta_step(dtype, eager=True))
        seconds[f"{model}: trace (meta)"] = round(time.perf_counter() - t0, 1)
        log(f"{model}: traced in {seconds[f'{model}: trace (meta)']} s; compiling for sm_90")
        t0 = time.perf_counter()
        unique = {}
        for ours in trace.launches:
            unique.setdefault(ours.launch.key(), []).append(ours)
        results = compile_launches([same[0].launch for same in unique.values()], processes=processes)
        kernels += [_kernel_row(model, same, result) for same, result in zip(unique.values(), results)]
        seconds[f"{model}: sm_90 compile"] = round(time.perf_counter() - t0, 1)
        rows += [_ours_row(model, trace), _eager_row(model, trace)]
        if inductor:
            log(f"{model}: torch.compile probes")
            t0 = time.perf_counter()
            rows.append(torch_compile_row(model, size, dtype, trace))
            seconds[f"{model}: torch.compile probes"] = round(time.perf_counter() - t0, 1)
    return {"models": rows, "kernels": kernels, "meta": _meta(size, dtype, seconds, time.perf_counter() - started)}


def _ours_row(model, trace) -> dict:
    launches_us = sum(k.predicted_us for k in trace.launches)
    ops_us = sum(o.predicted_us for o in trace.our_ops)
    return {"model": model, "backend": "ours", "predicted_ms": (launches_us + ops_us) / 1e3,
            "peak_bytes": trace.ours_memory.peak, "kernels": len(trace.launches),
            "kernel_bytes": sum(k.bytes for k in trace.launches), "other_ops": len(trace.our_ops),
            "other_ops_ms": ops_us / 1e3, "fallbacks": trace.fallbacks, **_memory(trace.ours_memory)}


def _eager_row(model, trace) -> dict:
    return {"model": model, "backend": "eager", "predicted_ms": sum(o.predicted_us for o in trace.eager_ops) / 1e3,
            "peak_bytes": trace.eager_memory.peak, "ops": sum(o.launches for o in trace.eager_ops),
            "bytes": sum(o.bytes for o in trace.eager_ops), **_memory(trace.eager_memory)}


def _memory(m) -> dict:
    return {"params_bytes": m.params, "grads_bytes": m.grads, "optimizer_bytes": m.optimizer, "saved_bytes": m.saved,
            "largest_allocation_bytes": m.largest}


def _kernel_row(model, same: list, result: dict) -> dict:
    """One distinct launch (source and specialization) and how often the step makes it."""
    first = same[0]
    return {"model": model, "name": first.launch.name, "phase": first.phase, "launches": len(same),
            "grid": first.launch.grid, "num_warps": first.launch.num_warps, "registers": result["registers"],
            "spill_bytes": result["spill_bytes"], "vector_share": result["vector_share"], "bytes": first.bytes,
            "predicted_us": first.predicted_us, "total_us": sum(k.predicted_us for k in same),
            "error": result["error"]}


def _meta(size, dtype, seconds, total) -> dict:
    from importlib.metadata import version

    from benchmarks import roofline
    return {"size": size, "dtype": dtype, "torch": torch.__version__, "triton": version("triton"),
            "target": "H100 SXM (sm_90)", "copy_bandwidth": roofline.COPY_BANDWIDTH, "launch_us": roofline.LAUNCH_US,
            "matmul_peak": {str(k).replace("torch.", ""): v for k, v in roofline.MATMUL_PEAK.items()},
            "batches": {m: BATCHES[m][size] for m in MODELS}, "seconds": {**seconds, "total": round(total, 1)},
            "approximations": APPROXIMATIONS}


APPROXIMATIONS = [
    "ours and eager are traced on meta tensors; bf16 autocast is emulated (MetaAutocast: CUDA's lower-precision "
    "ops cast to bf16; its float32 ops, e.g. log_softmax, are not upcast, which prices eager's cross-entropy low)",
    "eager's attention is the flash operator (FlashAttention-2 rates); GQA repeats k and v first",
    "torch.compile: Inductor's Triton path on CPU tensors at probe sizes (real widths; 1-2 layers, 128-256 tokens; "
    "ResNet: batch 1-2), kernel bytes = each tensor argument once, extrapolated bilinearly in layers and tokens, "
    "launch counts from the longest probes, in layers only; "
    "its matmuls, convolutions and attention are eager's (the same cuBLAS/flash calls) at the real size",
    "torch.compile's peak: a lower bound, the parameters and optimizer state plus the larger of the probes' "
    "step peak and what its forward leaves for backward (torch.profiler's allocations when autograd's engine "
    "starts: AOTAutograd's saved set as Inductor's code allocates it), each extrapolated; the gradients and "
    "transients of its backward are not counted (at the probes' sizes the step's peak is the optimizer's)",
    "peaks of ours and eager: live storages (weakref finalizers) over the meta step, on top of parameters and "
    "optimizer state; allocator rounding, workspaces (cuBLAS, flash) and fragmentation not counted",
    "our fused optimizer step's combo kernels are priced by bytes, not compiled for sm_90 (benchmarks.sm90)",
]


# -- the markdown and the command line ----------------------------------------------------------------
def markdown(doc: dict) -> str:
    meta = doc["meta"]
    out = [f"# Whole training steps on an H100, predicted from shapes: {meta['size']} size, {meta['dtype']}", "",
           f"Roofline: copy {meta['copy_bandwidth'] / 1e12:.1f} TB/s, {meta['launch_us']:.0f} µs per launch, "
           f"cuBLAS bf16 {meta['matmul_peak']['bfloat16'] / 1e12:.0f} TFLOP/s, flash attention at FlashAttention-2's "
           f"measured rates. torch {meta['torch']}, triton {meta['triton']}; `python -m benchmarks.models` "
           f"(benchmarks/README.md, \"Whole models on Hopper\"), {meta['seconds']['total']:.0f} s.", "",
           "| model | backend | predicted ms | × eager | peak GB | params GB | grads GB | optimizer GB | saved GB |",
           "|---|---|---|---|---|---|---|---|---|"]
    eager = {r["model"]: r["predicted_ms"] for r in doc["models"] if r["backend"] == "eager"}
    for r in doc["models"]:
        speed = eager[r["model"]] / r["predicted_ms"] if r["predicted_ms"] else float("nan")
        out.append(f"| {r['model']} | {r['backend']} | {r['predicted_ms']:.2f} | {speed:.2f} | "
                   f"{_gb(r['peak_bytes'])} | "
                   f"{_gb(r.get('params_bytes'))} | {_gb(r.get('grads_bytes'))} | {_gb(r.get('optimizer_bytes'))} | "
                   f"{_gb(r.get('saved_bytes'))} |")
    out += ["", "## Our kernels (distinct launches; sm_90 registers and spills)", "",
            "| model | phase | kernel | launches | warps | regs | spill B | MB | µs each |",
            "|---|---|---|---|---|---|---|---|---|"]
    for k in doc["kernels"]:
        regs = "ERROR" if k["error"] else k["registers"]
        out.append(f"| {k['model']} | {k['phase']} | `{k['name']}` | {k['launches']} | {k['num_warps']} | {regs} | "
                   f"{k['spill_bytes']} | {k['bytes'] / 1e6:.3g} | {k['predicted_us']:.1f} |")
    spills = [k for k in doc["kernels"] if k["spill_bytes"]]
    out += ["", "## Notes", "", "- spilling kernels: " + (", ".join(
        f"`{k['name']}` ({k['model']}, {k['spill_bytes']} B)" for k in spills) or "none")]
    out += [f"- approximated: {a}" for a in meta["approximations"]]
    out += [f"- wall time: {k} {v} s" for k, v in meta["seconds"].items()]
    return "\n".join(out) + "\n"


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def main(argv=None) -> int:
    import argparse
    import json
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: %(default)s")
    parser.add_argument("--size", choices=("real", "tiny"), default="real")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", help="write the JSON document here (and the markdown next to it, .md)")
    parser.add_argument("--processes", type=int, default=2, help="sm_90 compile workers (default: %(default)s)")
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile's probes")
    args = parser.parse_args(argv)
    doc = run(args.models.split(","), args.size, args.dtype, args.processes, not args.no_inductor,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    text = markdown(doc)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
