"""Attention's forward and backward as the runtime calls them: our Triton flash kernels
(``runtime.attention_kernels``), or on the CPU path (backend="torch") PyTorch's own fused CPU
flash kernel, the one eager's ``scaled_dot_product_attention`` runs there.

Every function takes q, k, v ([..., heads, length, head dim], 3-D or 4-D, any strides: views
of a projection are read where they lie), then the mask (if ``has_mask``) and the dropout seed
(if ``dropout_p``) as extra tensors; keys and values may have fewer heads (grouped-query
attention). Results are contiguous.
"""

from __future__ import annotations

import math

import torch
import triton

from runtime import attention_kernels as kernels
from runtime import extern_kernels
from runtime.triton_math import INTERPRETING


def forward(q, k, v, *extras, which=None, is_causal, scale, dropout_p, has_mask, empty_nan=False,
            heads_last=False, rotary=False, backend="interpret"):
    """(out, logsumexp) of softmax(scale * q k^T + mask) v, or the one ``which`` names. A row
    no key is seen by gives 0 (SDPA's), or NaN with ``empty_nan`` (softmax's, for attention
    written out). ``heads_last``: the output as [B, T, H, D], what the caller's transpose back
    makes, written so by the kernel (no copy). ``rotary``: q and k are rotated first by the
    extras' cos and sin ([B or 1, 1, T, D]), x * cos + rotate_half(x) * sin, inside the kernels."""
    mask, seed, rot = _extras(extras, has_mask, dropout_p, rotary)
    if backend in ("torch", "cpp") and q.device.type == "cpu":
        out, lse = _cpu_forward(*_rotated(q, k, rot), v, mask, seed, is_causal=is_causal, scale=scale,
                                dropout_p=dropout_p, empty_nan=empty_nan)
    else:
        out, lse = _triton_forward(q, k, v, mask, seed, rot, is_causal=is_causal, scale=scale,
                                   dropout_p=dropout_p, empty_nan=empty_nan, heads_last=heads_last)
    if heads_last:   # (the kernels wrote it so, and PyTorch's CPU kernel does too: no copy)
        out = out.transpose(1, 2).contiguous()
    return (out, lse) if which is None else (out, lse)[("out", "lse").index(which)]


def backward(grad, q, k, v, out, lse, *extras, which, is_causal, scale, dropout_p, has_mask, empty_nan=False,
             heads_last=False, rotary=False, backend="interpret"):
    """The gradients of q, k and v that ``which`` names (one name, or a tuple of them); with
    ``rotary``, those of the rotated q and k (the op's graph takes them back through the rotation,
    fused into what reads them)."""
    if heads_last:   # (the output and its gradient as [B, T, H, D]: read through their strides)
        grad, out = grad.transpose(1, 2), out.transpose(1, 2)
    mask, seed, rot = _extras(extras, has_mask, dropout_p, rotary)
    parameters = dict(is_causal=is_causal, scale=scale, dropout_p=dropout_p, empty_nan=empty_nan)
    if backend in ("torch", "cpp") and q.device.type == "cpu":
        made = _cpu_backward(grad, *_rotated(q, k, rot), v, out, lse, mask, seed, **parameters)
    else:
        made = _triton_backward(grad, q, k, v, out, lse, mask, seed, rot, **parameters)
    grads = dict(zip("qkv", made))
    return grads[which] if isinstance(which, str) else tuple(grads[w] for w in which)


def _extras(extras, has_mask, dropout_p, rotary=False):
    """(mask or None, seed or None, (cos, sin) or None) from the call's extra tensors."""
    extras = list(extras)
    mask = extras.pop(0) if has_mask else None
    seed = extras.pop(0) if dropout_p > 0 else None
    rot = (extras.pop(0), extras.pop(0)) if rotary else None
    return mask, seed, rot


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(q, k, rot):
    """q and k rotated by the rotary embedding (``rot``: cos, sin), as the model computes them."""
    if rot is None:
        return q, k
    cos, sin = (t.to(q.dtype) for t in rot)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------ Triton
def _interpreted(t: torch.Tensor) -> bool:
    """Whether this call's kernels run in Triton's interpreter (a recorded launch is a GPU's)."""
    return INTERPRETING and not t.is_cuda and not extern_kernels.recording()


def _cost(phase: str, share: float, q4, k4, is_causal: bool, tensors) -> dict:
    """What ``extern_kernels.launches_recorded`` tells of a launch: ``share`` of the phase's FLOPs."""
    B, H, M, D = q4.shape
    N = k4.shape[2]
    return {"phase": phase, "flops": share * flops(B * H, M, N, D, is_causal, phase), "head_dim": D,
            "length": max(M, N), "causal": is_causal, "dtype": q4.dtype,
            "bytes": sum(t.numel() * t.element_size() for t in tensors)}


def flops(batch_heads: int, M: int, N: int, D: int, is_causal: bool, phase: str) -> float:
    """The matmul FLOPs of attention over ``batch_heads`` heads, counted as FlashAttention's
    benchmarks count them: 4·M·N·D forward (q kᵀ and P v), 2.5x that backward (five products),
    halved where causal."""
    forward = 4.0 * batch_heads * M * N * D * (0.5 if is_causal else 1.0)
    return forward if phase == "forward" else 2.5 * forward


# (BLOCK_M rows, BLOCK_N keys, warps, stages) per kernel, by padded head dim: 16-bit inputs, float32
# (float64 takes float32's). The dK/dV kernel's BLOCK_N is the keys it keeps, BLOCK_M the rows it streams.
_TILES = {
    "16-bit": {64: {"forward": (128, 64, 4, 3), "dq": (128, 64, 4, 2), "dkv": (64, 64, 8, 2)},
               128: {"forward": (128, 64, 8, 2), "dq": (128, 64, 8, 2), "dkv": (64, 64, 8, 1)},
               256: {"forward": (64, 32, 8, 1), "dq": (64, 32, 8, 1), "dkv": (32, 64, 8, 1)}},
    "32-bit": {64: {"forward": (64, 32, 8, 2), "dq": (64, 32, 8, 2), "dkv": (16, 32, 4, 1)},
               128: {"forward": (32, 32, 4, 2), "dq": (32, 32, 4, 2), "dkv": (16, 16, 8, 1)},
               256: {"forward": (16, 32, 4, 1), "dq": (16, 32, 4, 1), "dkv": (16, 16, 8, 1)}},
}


# with the rotary embedding applied inside (cos and sin tiles, the rotated copies), where the plain
# tiles would spill (sm_90 compiles: none does with these)
_ROTARY_TILES = {
    "16-bit": {64: {"forward": (128, 64, 8, 2), "dq": (128, 64, 8, 2), "dkv": (32, 64, 8, 2)},
               128: {"forward": (128, 64, 8, 2), "dq": (64, 64, 8, 2), "dkv": (32, 32, 8, 2)}},
    "32-bit": {64: {"forward": (32, 32, 8, 2), "dq": (32, 32, 8, 2), "dkv": (16, 32, 4, 1)}},
}


def tiles(block_d: int, dtype: torch.dtype, kernel: str, interpreted: bool = False, rotary: bool = False) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kernel`` ("forward", "dq" or "dkv") for a
    head dim padded to ``block_d``.

    NOTE: chosen on Hopper's terms (228 KB of shared memory and 64K registers per SM, 255 per
    thread): FlashAttention-2's Triton tiles, 128 x 64 for 16-bit inputs (8 warps past head dim
    64); smaller where the float32 accumulators (the dK/dV kernel keeps two) would spill. The
    sm_90 compiles (``benchmarks.kernels``' attention workloads, ``tests/test_attention.py``'s
    compile check) show none spills. The interpreter runs 64 x 64 tiles: one NumPy operation per
    tile, fewer when tiles are large."""
    if interpreted:
        return 64, 64, 4, 1
    width = "16-bit" if dtype in (torch.float16, torch.bfloat16) else "32-bit"
    if rotary and block_d in _ROTARY_TILES[width]:
        return _ROTARY_TILES[width][block_d][kernel]
    return _TILES[width][max(64, block_d)][kernel]


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 3 else t


def _mask_4d(mask, shape):
    """The mask broadcast to [B, H, M, N] (a view: stride 0 where it broadcasts)."""
    return None if mask is None else mask.expand(shape)


def _constants(q, mask, seed, rot, is_causal, dropout_p):
    """The kernels' compile-time arguments."""
    wide = q.dtype == torch.float64
    return dict(IS_CAUSAL=is_causal, MASK_KIND=0 if mask is None else (1 if mask.dtype == torch.bool else 2),
                DROPOUT=dropout_p > 0, PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
                WIDE=wide, ROTARY=rot is not None)


def _rotary_arguments(rot, q4):
    """(cos, sin, their strides for batch, position and dim; the kernels take one set): cos and sin
    broadcast over heads. q's stand-ins (never read) without a rotary embedding."""
    if rot is None:
        return q4, q4, (0, 0, 0)
    B, _, M, D = q4.shape
    cos, sin = (t.expand(B, 1, M, D) for t in rot)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, (cos.stride(0), cos.stride(2), cos.stride(3))


def _scale_arguments(scale, dropout_p):
    """Python floats reach a kernel as float32: a float64 scale goes as two parts (hi + lo), and
    so does dropout's 1 / (1 - p), so float64 inputs keep float64's precision."""
    keep = 1.0 / (1.0 - dropout_p)
    hi, keep_hi = float(torch.tensor(scale, dtype=torch.float32)), float(torch.tensor(keep, dtype=torch.float32))
    return hi, scale - hi, keep_hi, keep - keep_hi


def _strides(t):
    return t.stride() if t is not None else (0, 0, 0, 0)


def _triton_forward(q, k, v, mask, seed, rot=None, *, is_causal, scale, dropout_p, empty_nan, heads_last=False):
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    B, H, M, D = q4.shape
    N = k4.shape[2]
    mask4 = _mask_4d(mask, (B, H, M, N))
    out = torch.empty((B, M, H, D), dtype=q.dtype, device=q.device).transpose(1, 2) if heads_last else \
        torch.empty((B, H, M, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=lse_dtype(q.dtype), device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    block_m, block_n, warps, stages = tiles(block_d, q.dtype, "forward", _interpreted(q), rot is not None)
    cos, sin, rot_strides = _rotary_arguments(rot, q4)
    args = (q4, k4, v4, mask4 if mask4 is not None else q4, seed if seed is not None else q4, cos, sin, out, lse,
            *q4.stride(), *k4.stride(), *v4.stride(), *_strides(mask4), *rot_strides, *out.stride(),
            H, H // k4.shape[1], M, N, D, *_scale_arguments(scale, dropout_p), dropout_p)
    extern_kernels.launch(kernels.attention_forward, (triton.cdiv(M, block_m), B * H), args,
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
                 EMPTY_NAN=empty_nan, **_constants(q, mask, seed, rot, is_causal, dropout_p)),
            _cost("forward", 1.0, q4, k4, is_causal, (q4, k4, v4, out, lse)))
    return (out if heads_last else out.view(q.shape)), lse.view(q.shape[:-1])


def _triton_backward(grad, q, k, v, out, lse, mask, seed, rot=None, *, is_causal, scale, dropout_p, empty_nan):
    q4, k4, v4, g4, o4 = (_as_4d(t) for t in (q, k, v, grad, out))
    B, H, M, D = q4.shape
    HK, N = k4.shape[1], k4.shape[2]
    mask4 = _mask_4d(mask, (B, H, M, N))
    delta = torch.empty((B, H, M), dtype=lse_dtype(q.dtype), device=q.device)
    dq = torch.empty((B, H, M, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, HK, N, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, HK, N, D), dtype=v.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    constants = _constants(q, mask, seed, rot, is_causal, dropout_p)
    cos, sin, rot_strides = _rotary_arguments(rot, q4)
    pointers = (mask4 if mask4 is not None else q4, seed if seed is not None else q4, cos, sin)
    sizes = (H, H // HK, M, N, D, *_scale_arguments(scale, dropout_p), dropout_p)
    strides = (*q4.stride(), *k4.stride(), *v4.stride(), *_strides(mask4), *rot_strides)
    # (the backward's five products: dQ's kernel recomputes P and dP and makes dS k, 3 of 5; the
    # dK/dV kernel all but dS k, 4 of 5; counted as FlashAttention counts them: 2 and 3 of 5)
    block_m, block_n, warps, stages = tiles(block_d, q.dtype, "dq", _interpreted(q), rot is not None)
    extern_kernels.launch(kernels.attention_backward_dq, (triton.cdiv(M, block_m), B * H),
            (q4, k4, v4, *pointers, o4, g4, lse, delta, dq, *strides, *o4.stride(), *g4.stride(), *sizes),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
                 **constants), _cost("backward", 0.4, q4, k4, is_causal, (q4, k4, v4, o4, g4, lse, delta, dq)))
    block_m, block_n, warps, stages = tiles(block_d, q.dtype, "dkv", _interpreted(q), rot is not None)
    extern_kernels.launch(kernels.attention_backward_dkv, (triton.cdiv(N, block_n), B * HK),
            (q4, k4, v4, *pointers, g4, lse, delta, dk, dv, *strides, *g4.stride(), *sizes),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
                 **constants), _cost("backward", 0.6, q4, k4, is_causal, (q4, k4, v4, g4, lse, delta, dk, dv)))
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


# ------------------------------------------------------------------------ CPU (torch)
def _cpu_forward(q, k, v, mask, seed, *, is_causal, scale, dropout_p, empty_nan):
    """PyTorch's fused CPU flash kernel (eager's own); with dropout, which it lacks, or softmax's
    NaN rows, which it does not make, the weights are made whole for this call only (never saved)."""
    if dropout_p > 0 or empty_nan:
        return _math_forward(q, k, v, mask, seed, is_causal, scale, dropout_p, empty_nan)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _as_4d(q), _as_4d(k), _as_4d(v), 0.0, is_causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    return out.contiguous().view(q.shape), lse.view(q.shape[:-1])


def _cpu_backward(grad, q, k, v, out, lse, mask, seed, *, is_causal, scale, dropout_p, empty_nan):
    if dropout_p > 0 or empty_nan:
        return _math_backward(grad, q, k, v, out, lse, mask, seed, is_causal, scale, dropout_p)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _as_4d(grad), _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(out), _as_4d(lse.unsqueeze(-1)).squeeze(-1), 0.0,
        is_causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _additive(mask, dtype):
    """The CPU kernel takes a mask of the query's dtype, added to the scores: a boolean one
    becomes 0 where True and -inf where False (the mask's own size)."""
    if mask is None or mask.dtype == dtype:
        return mask
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
    return mask.to(dtype)


def _weights(q, k, mask, seed, is_causal, scale, dropout_p, lse=None, empty_nan=False):
    """(the weights softmax(scale q k^T + mask), their dropout keep mask or None, key repeat):
    float32 (float64 for float64). From the saved logsumexp where given, as the kernels do."""
    wide = lse_dtype(q.dtype)
    group = q.shape[-3] // k.shape[-3] if q.dim() == 4 else 1
    keys = k.repeat_interleave(group, dim=-3) if group > 1 else k
    s = torch.matmul(q.to(wide), keys.to(wide).transpose(-2, -1)) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril().logical_not(), -math.inf)
    if mask is not None:
        s = s.masked_fill(mask.logical_not(), -math.inf) if mask.dtype == torch.bool else s + mask.to(wide)
    if lse is None:
        lse = torch.logsumexp(s, -1)
        lse = torch.where(torch.isinf(lse) & (lse < 0), math.nan if empty_nan else 0.0, lse)
    p = torch.exp(s - lse.unsqueeze(-1))
    kept = None
    if dropout_p > 0:  # the decomposed form's numbers: torch's generator seeded with the call's seed
        generator = torch.Generator(device=seed.device).manual_seed(int(seed))
        kept = torch.rand(p.shape, generator=generator, device=seed.device) >= dropout_p
    return p, kept, lse, group


def _math_forward(q, k, v, mask, seed, is_causal, scale, dropout_p, empty_nan=False):
    p, kept, lse, group = _weights(q, k, mask, seed, is_causal, scale, dropout_p, empty_nan=empty_nan)
    if kept is not None:
        p = torch.where(kept, p * (1.0 / (1.0 - dropout_p)), 0.0)
    values = v.repeat_interleave(group, dim=-3) if group > 1 else v
    return torch.matmul(p.to(v.dtype), values).contiguous(), lse.to(lse_dtype(q.dtype))


def _math_backward(grad, q, k, v, out, lse, mask, seed, is_causal, scale, dropout_p):
    p, kept, _, group = _weights(q, k, mask, seed, is_causal, scale, dropout_p, lse)
    wide = p.dtype
    keep_scale = 1.0 / (1.0 - dropout_p)
    values = v.repeat_interleave(group, dim=-3) if group > 1 else v
    dp = torch.matmul(grad.to(wide), values.to(wide).transpose(-2, -1))
    p_used = p
    if kept is not None:
        dp, p_used = torch.where(kept, dp * keep_scale, 0.0), torch.where(kept, p * keep_scale, 0.0)
    delta = (grad.to(wide) * out.to(wide)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    keys = k.repeat_interleave(group, dim=-3) if group > 1 else k
    dq = torch.matmul(ds, keys.to(wide))
    dk = torch.matmul(ds.transpose(-2, -1), q.to(wide))
    dv = torch.matmul(p_used.transpose(-2, -1), grad.to(wide))
    if group > 1:
        dk, dv = (t.unflatten(-3, (k.shape[-3], group)).sum(-3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
