"""A roofline model of an H100 SXM, and the cost (bytes, FLOPs) of one PyTorch operator.

A kernel or operator that moves ``bytes`` and computes ``flops`` takes, predicted,

    max(bytes / COPY_BANDWIDTH, flops / peak(dtype)) + LAUNCH_US

The constants (H100 SXM 80 GB, HBM3):

- ``COPY_BANDWIDTH`` 3.0 TB/s: a device-to-device copy measured on one (read + write bytes
  over time; the datasheet says 3.35 TB/s). A memory-bound kernel cannot beat it.
- ``MATMUL_PEAK``: dense matmul rates by operand dtype. bf16/fp16 ~800 TFLOP/s, the rate
  cuBLAS reaches on large GEMMs (datasheet: 989 dense). float32: 67 TFLOP/s, the datasheet's
  FP32 rate on CUDA cores — PyTorch runs float32 matmuls in full FP32 by default
  (``torch.backends.cuda.matmul.allow_tf32`` is False, ``float32_matmul_precision`` "highest"),
  so tensor-core TF32 rates do not apply. float64: 67 TFLOP/s (FP64 tensor cores).
- ``LAUNCH_US`` ~4 µs per kernel launched: the host cost of a launch, in the 3–6 µs measured
  for Triton launches (tritonbench) and of the order of an eager operator's dispatch and launch.

It is a lower bound per kernel (no caches, no tails, no occupancy effects), applied the same way
to our kernels and to eager's operators, so the ratio of two predictions is what it compares.

>>> round(predicted_us(3_000_000, 0, None), 3)     # 3 MB at 3 TB/s = 1 µs, plus the launch
5.0
"""

from __future__ import annotations

import math

import torch

COPY_BANDWIDTH = 3.0e12   # bytes/s, read + write
LAUNCH_US = 4.0
MATMUL_PEAK = {torch.bfloat16: 800e12, torch.float16: 800e12, torch.float32: 67e12, torch.float64: 67e12}

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm"}
# Operators that only write their first argument (reading it would double-count it).
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
# Operators that allocate or describe memory and launch no kernel.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted", "resize_",
              "set_", "lift_fresh", "detach", "alias", "_local_scalar_dense", "record_stream", "is_same_size",
              "_has_compatible_shallow_copy_type", "_record_function_enter", "_record_function_enter_new",
              "_record_function_exit"}


def predicted_us(bytes_moved: float, flops: float, dtype) -> float:
    """Predicted time in µs of one kernel: the roofline bound plus one launch."""
    compute_s = flops / MATMUL_PEAK.get(dtype, MATMUL_PEAK[torch.float32]) if flops else 0.0
    return max(bytes_moved / COPY_BANDWIDTH, compute_s) * 1e6 + LAUNCH_US


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor covers: a broadcast (stride-0) dim is read once."""
    count = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0)
    return count * t.element_size() if t.numel() else 0


def launches_kernel(func, args, out) -> bool:
    """Whether an aten operator launches a kernel on a GPU: not an allocation, and not a view
    (an output that shares an input's memory without the operator writing to it)."""
    name = func._overloadpacket.__name__
    if name in _NO_KERNEL or func.is_view:
        return False
    if func._schema.is_mutable:
        return True
    inputs = {storage_key(t) for t in _tensors(args) if t.numel()}
    outputs = [t for t in _tensors(out) if t.numel()]
    return not outputs or not all(storage_key(t) in inputs for t in outputs)


def storage_key(t: torch.Tensor) -> int:
    """Which storage a tensor views: its StorageImpl's address, which tells apart meta tensors too
    (a meta storage's ``data_ptr()`` is 0 for all of them: ``benchmarks.models`` traces on meta)."""
    return t.untyped_storage()._cdata


def op_kernels(func, args, kwargs, out) -> list[tuple[int, float, torch.dtype | None]]:
    """(bytes, flops, matmul dtype) of each kernel an aten operator launches on a GPU: one
    (``op_cost``) for all but the operators in ``_SEVERAL_KERNELS``, whose CUDA implementation is
    known to run several kernels that each read their inputs (see there)."""
    several = _SEVERAL_KERNELS.get(func._overloadpacket.__name__)
    kernels = several(args, out) if several else None
    return kernels or [op_cost(func, args, kwargs, out)]


def _layer_norm_backward_kernels(args, out):
    """``native_layer_norm_backward(dY, X, shape, mean, rstd, weight, bias, mask)`` on CUDA
    (aten/src/ATen/native/cuda/layer_norm_kernel.cu, ``LayerNormBackwardKernelImplInternal``) runs
    one kernel for dX (``layer_norm_grad_input_kernel[_vectorized]``: reads dY, X, mean, rstd,
    weight) and another for dweight and dbias (``GammaBetaBackward*CUDAKernel``: reads dY, X, mean,
    rstd again), each one launch; priced as one operator it would read dY and X once."""
    dy, x, _shape, mean, rstd, weight = args[:6]
    mask = args[7] if len(args) > 7 else (True, True, True)
    grad_x, grad_w, grad_b = (out[k] if mask[k] else None for k in range(3))
    stats = sum(_cuda_stats_bytes(t) for t in (mean, rstd) if isinstance(t, torch.Tensor))
    kernels = []
    for reads, writes in (([dy, x, weight], [grad_x]), ([dy, x], [grad_w, grad_b])):
        writes = [t for t in writes if isinstance(t, torch.Tensor)]
        if writes:
            reads = [t for t in reads if isinstance(t, torch.Tensor)]
            moved = sum(distinct_bytes(t) for t in _unique(reads)) + sum(distinct_bytes(t) for t in _unique(writes))
            kernels.append((moved + stats, 0.0, None))
    return kernels


def _layer_norm_kernels(args, out):
    """``native_layer_norm``: one kernel, whose mean and rstd are float32 on CUDA for a bfloat16 or
    float16 input (``layer_norm_cuda``: ``at::empty({M}, X->options().dtype(acc_type))``), where
    the CPU op traced here returns them in the input's dtype."""
    y, mean, rstd = out
    reads = [t for t in args if isinstance(t, torch.Tensor)]
    moved = sum(distinct_bytes(t) for t in _unique(reads)) + distinct_bytes(y)
    return [(moved + _cuda_stats_bytes(mean) + _cuda_stats_bytes(rstd), 0.0, None)]


def _cuda_stats_bytes(t: torch.Tensor) -> int:
    """Bytes of a norm's saved statistic on CUDA: float32 (its accumulation type) for a narrower float."""
    return t.numel() * max(t.element_size(), 4)


# Operators whose CUDA implementation runs several kernels, each reading the inputs again, or whose
# CUDA outputs differ from the CPU op traced (the others are priced as one pass: their inputs read
# once, outputs written once).
_SEVERAL_KERNELS = {"native_layer_norm_backward": _layer_norm_backward_kernels,
                    "native_layer_norm": _layer_norm_kernels}   # one kernel, but CUDA's statistics


def op_cost(func, args, kwargs, out) -> tuple[int, float, torch.dtype | None]:
    """(bytes, flops, matmul dtype) of one aten operator: every input read once and every output
    written once (a tensor passed twice counts once); FLOPs of matmuls and convolutions."""
    name = func._overloadpacket.__name__
    # (an ``out=`` tensor is written, not read: Inductor calls ``mm(a, b, out=buf)``)
    reads = _tensors(args[1:] if name in _WRITE_ONLY_SELF else args) + _tensors(
        {k: v for k, v in kwargs.items() if k != "out"})
    writes = _tensors(out)
    moved = sum(distinct_bytes(t) for t in _unique(reads)) + sum(distinct_bytes(t) for t in _unique(writes))
    flops, dtype = 0.0, None
    if name in _MATMULS:
        a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]   # (addmm's ``out_dtype`` follows them)
        batch = a.shape[0] if a.dim() == 3 else 1
        flops = 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        dtype = a.dtype
    elif name == "convolution":
        weight = args[1]
        flops = 2.0 * out.numel() * weight[0].numel()
        dtype = weight.dtype
    elif name == "convolution_backward":
        grad, weight, mask = args[0], args[2], args[10]
        flops = 2.0 * grad.numel() * weight[0].numel() * sum(bool(m) for m in mask[:2])
        dtype = weight.dtype
    return moved, flops, dtype


def _tensors(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _unique(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        key = (storage_key(t) if t.numel() else id(t), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


# -- flash attention ------------------------------------------------------------------------------
# FlashAttention-2 on an H100 SXM5 (80 GB), 16-bit inputs, TFLOP/s by sequence length: the
# FlashAttention-3 paper (Shah et al., 2024, arXiv:2407.08608), Figures 5 (forward) and 6 (backward),
# FlashAttention-2's bars at batch x length = 16k tokens, hidden 2048. PyTorch's SDPA runs
# FlashAttention-2 on an H100 (its flash backend), so eager's attention is priced by these. Ours
# is FlashAttention-2's algorithm in Triton and is priced at the same rates: the paper's Triton
# bars (its fused-attention tutorial, same algorithm) are 0-15% above FlashAttention-2's, which we
# do not claim. Entries not in the paper are derived and say how: causal head dim 64 (forward and
# backward) and causal backward take the non-causal rate times the head-dim-128 forward's
# causal / non-causal ratio at the same length.
_FA2_TFLOPS = {
    ("forward", 64, False): {512: 282, 1024: 306, 2048: 318, 4096: 321, 8192: 322, 16384: 324},
    ("forward", 128, False): {512: 309, 1024: 350, 2048: 362, 4096: 368, 8192: 370, 16384: 370},
    ("forward", 128, True): {512: 191, 1024: 260, 2048: 298, 4096: 319, 8192: 333, 16384: 335},
    ("backward", 64, False): {512: 198, 1024: 238, 2048: 264, 4096: 279, 8192: 287, 16384: 291},
    ("backward", 128, False): {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322},
}
# float32 has no FlashAttention-2 kernel (eager runs the memory-efficient one on CUDA cores): priced,
# ours and eager's alike, at FlashAttention-2's fraction of the 16-bit peak applied to the FP32 rate.
_DENSE_16BIT_PEAK = 989e12
# kernels each attention call launches: FlashAttention-2's backward runs three (csrc/flash_attn/src/
# flash_bwd_launch_template.h: the dO·O row sums, the dQ/dK/dV loop, the dQ conversion from float32)
FA2_LAUNCHES = {"forward": 1, "backward": 3}


def _by_length(table: dict, length: int) -> float:
    """The table's rate at ``length``: log-linear between its lengths, its ends beyond them."""
    lengths = sorted(table)
    if length <= lengths[0]:
        return table[lengths[0]]
    for lo, hi in zip(lengths, lengths[1:]):
        if length <= hi:
            t = math.log(length / lo) / math.log(hi / lo)
            return table[lo] + t * (table[hi] - table[lo])
    return table[lengths[-1]]


def flash_rate(phase: str, head_dim: int, length: int, causal: bool, dtype) -> float:
    """FLOP/s of a flash-attention kernel (FlashAttention-2 on an H100; see ``_FA2_TFLOPS``)."""
    dim = 64 if head_dim <= 96 else 128
    rate = _by_length(_FA2_TFLOPS[(phase, dim, False)], length)
    if causal:
        ratio = _by_length(_FA2_TFLOPS[("forward", 128, True)], length) / _by_length(
            _FA2_TFLOPS[("forward", 128, False)], length)
        rate = _by_length(_FA2_TFLOPS[(phase, dim, True)], length) if (phase, dim, True) in _FA2_TFLOPS \
            else rate * ratio
    rate *= 1e12
    if dtype not in (torch.bfloat16, torch.float16):
        rate *= MATMUL_PEAK[torch.float32] / _DENSE_16BIT_PEAK
    return rate


def flash_us(flops: float, rate: float, bytes_moved: float = 0.0, launches: int = 1) -> float:
    """Predicted µs of a flash-attention call: compute-bound at ``rate`` (its bytes, q/k/v/o once,
    bound it only at tiny sizes), plus its launches."""
    return max(flops / rate, bytes_moved / COPY_BANDWIDTH) * 1e6 + launches * LAUNCH_US


# eager's attention operators (the CPU ones traced here are the CUDA flash kernels on an H100)
FLASH_OPS = {"_scaled_dot_product_flash_attention_for_cpu": "forward",
             "_scaled_dot_product_flash_attention_for_cpu_backward": "backward"}


def flash_op_cost(func, args, kwargs, out) -> tuple[str, int, float, float]:
    """(phase, bytes, flops, FLOP/s) of one of eager's flash-attention operators."""
    name = func._overloadpacket.__name__
    phase = FLASH_OPS[name]
    q, k = (args[0], args[1]) if phase == "forward" else (args[1], args[2])
    causal = bool(args[4] if phase == "forward" else args[7]) if len(args) > (4 if phase == "forward" else 7) \
        else bool(kwargs.get("is_causal", False))
    batch_heads, M, D = math.prod(q.shape[:-2]), q.shape[-2], q.shape[-1]
    N = k.shape[-2]
    flops = 4.0 * batch_heads * M * N * D * (0.5 if causal else 1.0) * (1.0 if phase == "forward" else 2.5)
    moved, _, _ = op_cost(func, args, kwargs, out)
    return phase, moved, flops, flash_rate(phase, D, max(M, N), causal, q.dtype)
