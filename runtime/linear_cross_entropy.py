"""A linear layer's cross-entropy computed in row chunks: the logits are never whole.

``cross_entropy(a @ m + bias, target)`` over a large class dimension (a language model's head:
50,257 classes for GPT-2) materializes logits of rows x classes, and eager's backward a
gradient of that size again (at B=8, T=1024: 823 MB of bf16 logits, 1.6 GB of fp32
gradient). Here each chunk of rows makes its logits, its loss and, where asked, its share of
the gradients (of ``a``, of ``m`` and of the bias), then drops them: what stays is one chunk's
logits and the gradients' own sizes. The idea is Liger-Kernel's fused linear cross-entropy
(``src/liger_kernel/ops/fused_linear_cross_entropy.py``: the gradients made in the forward for
a reduced loss, then scaled by the incoming gradient); the code is ours.

Values are eager's (``aten/src/ATen/native/LossNLL.cpp``, and the binding in
``compiler.capture.bindings.cross_entropy``): per row r with target t (not ``ignore_index``),

    loss_r = (1 - eps) s_r (lse_r - x_rt) + (eps / C) (M lse_r - sum_c w_c x_rc)

with x the row's logits, lse_r their logsumexp, w the class weights (all 1 without), s_r =
w_t, M = sum_c w_c and eps the label smoothing; an ignored row is 0. ``mean`` divides the sum
by sum_r s_r over the counted rows. Its derivative in x_rc:

    (1 - eps) s_r (p_rc - [c = t]) + (eps / C) (M p_rc - w_c),   p = softmax(x_r)

The logits are computed in the matmul's dtype (as eager's matmul rounds them), then widened to
``loss_dtype`` (a float32 loss under autocast); the logits' gradient is rounded to the matmul's
dtype before the two matmuls that take it back (as eager's cast back does).
"""

from __future__ import annotations

import os

import torch

from runtime import extern_kernels
from runtime import linear_cross_entropy_kernel as kernels

# NOTE (memory): the bytes one chunk's work may hold: 128 MiB. With the Triton kernel that is the
# chunk's logits alone (the gradient is written over them): GPT-2's head (50,257 classes, bf16)
# gets 1,335 rows a chunk, matmuls wide enough for cuBLAS's tiles. PyTorch's ops (the CPU path)
# work in place over float32 logits too (667 rows a chunk); over bf16 ones they hold a float32
# copy and the gradient besides (333 rows).
DEFAULT_CHUNK_BYTES = 128 << 20


def chunk_rows(rows: int, classes: int, dtype: torch.dtype, fused: bool = False) -> int:
    """Rows per chunk: as many as ``SYMGRAD_LOSS_CHUNK_MB`` (default 128) holds, counting per element
    the logits in the matmul's dtype and, unless ``fused`` (the Triton kernel) or float32 (PyTorch's
    ops then work in place over them), a float32 copy and the gradient in the matmul's dtype."""
    budget = int(float(os.environ.get("SYMGRAD_LOSS_CHUNK_MB", DEFAULT_CHUNK_BYTES / 2**20)) * 2**20)
    size = torch.empty((), dtype=dtype).element_size()
    per_row = classes * (size if fused or size == 4 else 4 + 2 * size)
    return max(1, min(rows, budget // per_row))


def forward(a, m, *rest, which=None, reduction, ignore_index, label_smoothing, has_bias, has_weight, loss_dtype,
            backend="torch"):
    """The loss (a 0-d tensor for ``mean``/``sum``, one value per row for ``none``), or with
    ``which`` naming ``loss`` and gradients (``grad_a``, ``grad_m``, ``grad_bias``, one name or a
    tuple) those, the gradients being of the reduced loss (an incoming gradient of 1)."""
    bias, target, weight = _operands(rest, has_bias, has_weight)
    names = (which,) if isinstance(which, str) else tuple(which or ("loss",))
    wanted = [n[len("grad_"):] for n in names if n.startswith("grad_")]
    if wanted and reduction == "none":
        raise ValueError("the gradients of a per-row loss are made by backward(), which takes the rows' gradient")
    setup = _Setup(a, m, bias, target, weight, ignore_index, label_smoothing, loss_dtype, backend)
    counted = setup.share.sum() if reduction == "mean" else None   # (a mean's denominator)
    scale = None
    if wanted:   # d(loss)/d(loss_r): 1 / sum(s) for a mean, 1 for a sum; 0 where ignored (all ignored too)
        scale = setup.valid if reduction == "sum" else torch.where(setup.valid > 0, setup.valid / counted, 0.0)
    rows_loss, made = _chunks(setup, scale, wanted)
    loss = rows_loss if reduction == "none" else rows_loss.sum()
    if reduction == "mean":
        loss = loss / counted
    values = {"loss": loss.to(loss_dtype), **{f"grad_{k}": v for k, v in made.items()}}
    return values[names[0]] if isinstance(which, str) else tuple(values[n] for n in names)


def backward(grad_rows, a, m, *rest, which, ignore_index, label_smoothing, has_bias, has_weight, loss_dtype,
             backend="torch", **_):
    """The gradients ``which`` names (``a``, ``m``, ``bias``; one or a tuple) of a per-row loss
    (``reduction="none"``), given the rows' gradient: the logits are made again, chunk by chunk."""
    bias, target, weight = _operands(rest, has_bias, has_weight)
    names = (which,) if isinstance(which, str) else tuple(which)
    setup = _Setup(a, m, bias, target, weight, ignore_index, label_smoothing, loss_dtype, backend)
    _, made = _chunks(setup, grad_rows.to(torch.float32) * setup.valid, list(names))
    return made[names[0]] if isinstance(which, str) else tuple(made[n] for n in names)


def _operands(rest, has_bias, has_weight):
    rest = list(rest)
    bias = rest.pop(0) if has_bias else None
    target = rest.pop(0)
    weight = rest.pop(0) if has_weight else None
    return bias, target, weight


class _Setup:
    """What every chunk reads: the operands, each row's share s_r (0 where ignored), the index
    gathered with (class 0 where ignored) and the smoothing's constants."""

    def __init__(self, a, m, bias, target, weight, ignore_index, label_smoothing, loss_dtype, backend):
        self.a, self.m, self.bias, self.loss_dtype = a, m, bias, loss_dtype
        self.classes = m.shape[1]
        self.valid = (target != ignore_index).to(torch.float32)
        self.index = torch.where(target != ignore_index, target, 0)
        _check_targets(self.index, self.classes)
        self.eps = float(label_smoothing)
        if weight is None:
            self.weight, self.mass = None, float(self.classes)
            self.share = self.valid
        else:
            self.weight = weight.to(torch.float32)
            self.mass = self.weight.sum()
            self.share = self.weight[self.index] * self.valid
        # our Triton kernel for each chunk's softmax and gradient (the CPU path: PyTorch's ops)
        self.triton = backend in ("interpret", "triton") and m.dtype in (torch.float32, torch.bfloat16, torch.float16)
        self.rows_per_chunk = chunk_rows(a.shape[0], self.classes, m.dtype, fused=self.triton)
        if self.triton:
            self.target = torch.where(target != ignore_index, target, -1)
            mass = self.mass if isinstance(self.mass, torch.Tensor) else torch.tensor(self.mass)
            self.mass_tensor = mass.reshape(1).to(device=a.device, dtype=torch.float32)


def _check_targets(index, classes: int) -> None:
    """Eager's IndexError for a target out of range (not ``ignore_index``). Unchecked, the CPU path's
    gather would raise another error and the kernel would read outside the row. On CUDA the check
    is a device assert, as eager's: no sync."""
    bad = (index < 0) | (index >= classes)
    if index.device.type == "cuda":
        torch._assert_async(~bad.any(), "Target is out of bounds.")
    elif index.device.type != "meta" and bool(bad.any()):
        raise IndexError(f"Target {int(index[bad][0])} is out of bounds.")


def _chunks(setup: _Setup, scale, wanted: list) -> tuple:
    """(each row's loss as float32, the gradients in ``wanted``), chunk by chunk; ``scale``: each
    row's incoming gradient (None: no gradients)."""
    a, m = setup.a, setup.m
    rows_loss = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    made = {}
    if "a" in wanted:
        made["a"] = torch.empty_like(a, memory_format=torch.contiguous_format)
    accumulators = {k: None for k in ("m", "bias") if k in wanted}   # float32 sums over the chunks
    for start in range(0, a.shape[0], setup.rows_per_chunk):
        rows = slice(start, min(start + setup.rows_per_chunk, a.shape[0]))
        logits = a[rows] @ m if setup.bias is None else torch.addmm(setup.bias, a[rows], m)
        if setup.triton:
            rows_loss[rows], dx = _kernel_chunk(setup, logits, rows, None if scale is None else scale[rows])
            if scale is None:
                continue
        else:
            rows_loss[rows], dx = _torch_chunk(setup, logits, rows, None if scale is None else scale[rows])
            del logits
            if scale is None:
                continue
        if "a" in made:
            torch.mm(dx, m.t(), out=made["a"][rows])
        if "m" in accumulators:
            _accumulate_product(accumulators, "m", a[rows].t(), dx)
        if "bias" in accumulators:
            _accumulate(accumulators, "bias", dx.sum(0, dtype=torch.float32))
    if "m" in accumulators:
        made["m"] = _finished(accumulators["m"], m)
    if "bias" in accumulators:
        made["bias"] = _finished(accumulators["bias"], setup.bias)
    return rows_loss, made


def _kernel_chunk(setup: _Setup, logits, rows, scale) -> tuple:
    """(the chunk's rows' loss, the logits' gradient written over them, or None without ``scale``)
    by ``chunk_loss_kernel``."""
    count, classes = logits.shape
    loss = torch.empty(count, dtype=torch.float32, device=logits.device)
    block, warps = kernels.block_for(classes)
    weight = setup.weight if setup.weight is not None else loss   # (unread without HAS_WEIGHT)
    args = (logits, logits.stride(0), setup.target[rows], setup.share[rows],
            scale if scale is not None else loss, weight, setup.mass_tensor, loss, classes,
            setup.eps / classes, 1.0 - setup.eps)
    options = dict(HAS_WEIGHT=setup.weight is not None, SMOOTH=setup.eps > 0, GRAD=scale is not None,
                   BLOCK=block, num_warps=warps)
    moved = logits.numel() * logits.element_size() * (3 if scale is not None else 1)
    extern_kernels.launch(kernels.chunk_loss_kernel, (count,), args, options, {"kind": "memory", "bytes": moved})
    return loss, (logits if scale is not None else None)


def _torch_chunk(setup: _Setup, logits, rows, scale) -> tuple:
    """``_kernel_chunk`` by PyTorch's ops (the CPU path), in place over the chunk's float32 logits:
    nothing else of their size is made (``torch.logsumexp`` would make two)."""
    x = logits.to(torch.float32) if logits.dtype != torch.float32 else logits
    index = setup.index[rows, None]
    picked = x.gather(1, index).squeeze(1)
    weighted = None
    if setup.eps > 0:   # (the smoothing's sum over the classes, of the logits before they are shifted)
        weighted = x.sum(1) if setup.weight is None else x @ setup.weight
    shift = x.amax(1)
    exps = x.sub_(shift[:, None]).exp_()
    total = exps.sum(1)
    lse = shift + total.log()
    loss = (lse - picked) * setup.share[rows] if setup.weight is not None else (lse - picked)
    if weighted is not None:
        loss = loss * (1.0 - setup.eps) + (lse * setup.mass - weighted) * (setup.eps / setup.classes)
    loss = torch.where(setup.valid[rows] > 0, loss, 0.0)
    if scale is None:
        return loss, None
    return loss, _logits_grad(setup, exps.div_(total[:, None]), rows, scale).to(setup.m.dtype)


def _logits_grad(setup: _Setup, p, rows, scale):
    """scale_r * d(loss_r)/d(x_r) from the softmax ``p``, in place over it."""
    s = setup.share[rows] if setup.weight is not None else setup.valid[rows]
    one_hot = (1.0 - setup.eps) * s * scale           # the coefficient of -[c = t]
    p.mul_((one_hot + (setup.eps / setup.classes) * setup.mass * scale)[:, None])
    p.scatter_add_(1, setup.index[rows, None], -one_hot[:, None])
    if setup.eps > 0:
        smoothing = (setup.eps / setup.classes) * scale[:, None]
        p.sub_(smoothing if setup.weight is None else smoothing * setup.weight)
    return p


def _accumulate_product(accumulators: dict, key: str, left, right) -> None:
    """accumulators[key] += left @ right in float32, in place: no product of the weight's size is
    made per chunk. float32 operands: ``addmm_``; bf16/fp16 on CUDA: cuBLAS's float32 output
    (``addmm``'s ``out_dtype``); elsewhere (CPU half precision) the product, then an add."""
    total = accumulators[key]
    if total is None:
        accumulators[key] = (left @ right).to(torch.float32)
    elif left.dtype == total.dtype:
        total.addmm_(left, right)
    elif left.device.type in ("cuda", "meta"):
        torch.addmm(total, left, right, torch.float32, out=total)
    else:
        total.add_(left @ right)


def _accumulate(accumulators: dict, key: str, value) -> None:
    if accumulators[key] is None:
        accumulators[key] = value.to(torch.float32) if value.dtype != torch.float32 else value
    else:
        accumulators[key].add_(value)


def _finished(total, like):
    if total is None:   # (no rows)
        return torch.zeros_like(like)
    return total.to(like.dtype)
