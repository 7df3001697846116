"""The binding of ``F.scaled_dot_product_attention``: flash attention (``catalog.emit_attention``)
for every form its kernels take, the decomposed ``softmax(q kᵀ · scale + mask) v`` otherwise
(and for double backward, ``decomposed_attention``).

Forms the flash kernels take: 3-D or 4-D q, k, v of one floating dtype and one head dim (at
most 256); causal; a boolean or additive mask (of q's dtype, broadcasting to the weights, no
gradient of its own); any scale; dropout; grouped-query attention, by ``enable_gqa`` or by
Hugging Face's ``repeat_kv`` (an expand and reshape of the key/value heads), whose repeat is
never made: the kernels read each key head for its group of query heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compiler.capture.bindings.handles import Tensor, arange_along, handle, on_handles, rand, unwrap, where
from compiler.capture.bindings.layers import matmul
from compiler.capture.bindings.reductions import _shifted
from compiler.capture.bindings.registry import Unsupported, binds
from compiler.ir.graph import compute_dtype, meta_of
from compiler.ir.ops import catalog as C

_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LARGEST_HEAD_DIM = 256


@binds(F.scaled_dot_product_attention)
@on_handles
def _scaled_dot_product_attention(b, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False):
    """Eager's checks, then flash attention where its kernels take the form (module docstring),
    else the decomposed form."""
    if is_causal and attn_mask is not None:
        raise Unsupported("scaled_dot_product_attention with both attn_mask and is_causal (eager raises)")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise Unsupported("scaled_dot_product_attention with a non-tensor attn_mask")
    if not 0 <= dropout_p < 1:
        raise Unsupported(f"scaled_dot_product_attention with dropout_p={dropout_p} (compiled for 0 <= p < 1)")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if enable_gqa:
        _check_groups(query, key), _check_groups(query, value)
    else:
        key, value = _ungrouped(query, key), _ungrouped(query, value)
    seed = None
    if dropout_p > 0:
        if b.new_seed is None:
            raise Unsupported("random numbers need a per-call seed, which this graph cannot take")
        seed = b.new_seed()
    if _flash_takes(query, key, value, attn_mask):
        return Tensor(b, C.emit_attention(b, query.node, key.node, value.node, _node(attn_mask), seed,
                                          is_causal=is_causal, scale=scale, dropout_p=dropout_p))
    return decomposed_attention(b, query, key, value, attn_mask, seed, is_causal, scale, dropout_p)


def _node(value):
    return None if value is None else value.node


def _flash_takes(query, key, value, mask) -> bool:
    """Whether the flash kernels compute this call (else: the decomposed form)."""
    ndim, dtype = query.ndim, query.dtype
    if ndim not in (3, 4) or key.ndim != ndim or value.ndim != ndim or dtype not in _FLASH_DTYPES:
        return False
    if key.dtype != dtype or value.dtype != dtype:
        return False
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim or not 0 < head_dim <= _LARGEST_HEAD_DIM:
        return False
    if key.shape[-2] != value.shape[-2] or key.shape[-3] != value.shape[-3] or key.shape[:-3] != query.shape[:-3]:
        return False
    if ndim == 3 and key.shape[0] != query.shape[0]:
        return False
    if ndim == 4 and (key.shape[1] == 0 or query.shape[1] % key.shape[1]):
        return False
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return False
    if mask is None:
        return True
    weights = tuple(query.shape[:-1]) + (key.shape[-2],)
    return (mask.dtype in (torch.bool, dtype) and not mask.requires_grad and mask.ndim <= 4
            and torch.broadcast_shapes(tuple(mask.shape), weights) == weights)


def _check_groups(query, kv) -> None:
    if query.ndim < 3 or kv.ndim < 3:
        raise Unsupported("scaled_dot_product_attention(enable_gqa=True) needs a head dim (eager raises)")
    heads, kv_heads = query.shape[-3], kv.shape[-3]
    if kv_heads == 0 or heads % kv_heads:
        raise Unsupported(f"enable_gqa with {heads} query heads and {kv_heads} key/value heads (eager raises)")


def _ungrouped(query, kv):
    """The key/value heads themselves where ``kv`` is Hugging Face's ``repeat_kv`` of them
    (x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)): the flash kernels
    read each head for its group, so the repeat is never made. Else ``kv``."""
    node = kv.node
    if kv.ndim != 4 or query.ndim != 4 or not _is_view(node, "reshape"):
        return kv
    expanded = node.args[0]
    if not _is_view(expanded, "expand") or len(meta_of(expanded).shape) != 5:
        return kv
    unit = expanded.args[0]
    b, heads, groups, n, d = meta_of(expanded).shape
    source = unit.args[0] if _is_view(unit, "reshape") else None  # (x[:, :, None] is a reshape here)
    if source is None or meta_of(unit).shape != (b, heads, 1, n, d) or meta_of(source).shape != (b, heads, n, d):
        return kv
    if query.shape[1] != heads * groups:
        return kv
    return handle(kv.b, source)


def _is_view(node, name: str) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target is C.VIEWS[name]


def decomposed_attention(b, query, key, value, attn_mask, seed, is_causal, scale, dropout_p, empty_nan=False):
    """softmax(q kᵀ · scale + mask) [dropout] v, as PyTorch's math backend computes it: a causal
    mask from element positions (nothing stored), rows masked entirely give 0 (not NaN; NaN with
    ``empty_nan``, as a softmax written out), dropout from the random numbers of ``seed`` at each
    weight's position, as the flash kernels draw them. ``query``... may be handles or graph
    nodes; returns the output's node."""
    query, key, value, attn_mask = (handle(b, unwrap(x)) if x is not None else None
                                    for x in (query, key, value, attn_mask))
    if query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        key, value = _grouped_heads(query, key), _grouped_heads(query, value)
    # NOTE: half types: the scores and their softmax in float32, as every eager backend keeps
    # them (CPU's kernels compute in float32; CUDA's flash and memory-efficient kernels
    # accumulate q kᵀ in float32): scores rounded to bf16 (|s| ~ 10: errors of 0.03) made
    # outputs 6x further from the exact result than eager's. The weights go back to the input's
    # dtype for the matmul with v, as flash attention's do.
    wide = compute_dtype(query.dtype)
    scores = matmul(query.to(wide), key.to(wide).transpose(-2, -1)) * scale
    if is_causal:
        rows, cols = arange_along(b, scores.shape, scores.ndim - 2), arange_along(b, scores.shape, scores.ndim - 1)
        attn_mask = cols <= rows
    if attn_mask is not None:
        scores = where(attn_mask, scores, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    shifted, _ = _shifted(scores, -1)
    e = shifted.exp()
    total = e.sum(-1, keepdim=True)
    # a row masked entirely has e = 0 and total = 0: dividing by 1 there gives eager's 0, and a
    # finite derivative (a where after the division would still send 0 * inf back: NaN)
    weights = e / total if empty_nan else e / where(total == 0.0, 1.0, total)
    if dropout_p > 0:
        keep = rand(b, unwrap(seed), weights.shape) >= dropout_p
        weights = where(keep, weights * (1.0 / (1.0 - dropout_p)), 0.0, dtype=weights.dtype)
    return matmul(weights.to(value.dtype), value).node


def _grouped_heads(query: Tensor, kv: Tensor) -> Tensor:
    """Grouped-query attention's keys or values: each of the kv heads (dim -3) repeated for
    the query heads of its group, as eager's ``repeat_interleave(groups, -3)`` (an expand
    and a reshape here: views, so the repeat moves no data before the matmul)."""
    _check_groups(query, kv)
    heads, kv_heads = query.shape[-3], kv.shape[-3]
    groups = heads // kv_heads
    lead, tail = tuple(kv.shape[:-3]), tuple(kv.shape[-2:])
    grouped = kv.reshape(lead + (kv_heads, 1) + tail).expand(lead + (kv_heads, groups) + tail)
    return grouped.reshape(lead + (heads,) + tail)
