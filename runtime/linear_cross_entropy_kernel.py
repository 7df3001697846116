"""One chunk of the chunked linear cross-entropy in Triton: each row's loss, and the logits'
gradient written over the logits, in two passes over the row (``runtime.linear_cross_entropy``).

A program takes one row of the chunk's logits (any float dtype, computed in float32):

1. one pass: the running max and the sum of exponentials (online softmax), and the row's sum of
   logits (label smoothing; weighted by the class weights where given), so the logsumexp and
   the loss need no second read;
2. with ``GRAD``: a second pass writes, in place of each logit, ``scale_r`` times the loss's
   derivative in it (the module doc of ``runtime.linear_cross_entropy``), rounded to the logits'
   dtype, what the two matmuls after it read.

Per element: one read (two with ``GRAD``) and one write, where eager's loss and backward make
the logits' float32 copy, their log-softmax, the gradient and its cast (six passes or more).
The same algorithm as Liger-Kernel's cross-entropy kernel (``liger_kernel/ops/cross_entropy.py``),
written for this module's inputs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_loss_kernel(X, stride_x, TARGET, SHARE, SCALE, WEIGHT, MASS, LOSS, V, eps_over_classes, keep,
                      HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """``LOSS[r]`` for row r of X (V logits); with ``GRAD``, X's row becomes its gradient.
    ``TARGET``: the target class (-1 where ignored); ``SHARE``: w_t, 0 where ignored; ``SCALE``: the
    row's incoming gradient (0 where ignored); ``MASS``: the classes' summed weight (1 element);
    ``keep``: 1 - label smoothing."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    sx = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        alive = m_new > float("-inf")   # (a lane seen only masked elements so far: nothing to rescale)
        d = tl.where(alive, d * tl.exp(m - m_new) + tl.exp(x - m_new), d)
        m = m_new
        if SMOOTH:
            w = tl.load(WEIGHT + cols, mask=cols < V, other=0.0).to(tl.float32) if HAS_WEIGHT else 1.0
            sx += tl.where(cols < V, x * w, 0.0)
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(tl.where(m > float("-inf"), d * tl.exp(m - row_max), 0.0), 0))
    target = tl.load(TARGET + row)
    valid = target >= 0
    target = tl.where(valid, target, 0)
    share = tl.load(SHARE + row)
    picked = tl.load(x_row + target).to(tl.float32)
    mass = tl.load(MASS).to(tl.float32)
    loss = keep * share * (lse - picked)
    if SMOOTH:
        loss += eps_over_classes * (mass * lse - tl.sum(sx, 0))
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if GRAD:
        scale = tl.load(SCALE + row)
        coefficient = (keep * share + eps_over_classes * mass) * scale
        hit = keep * share * scale
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            dx = coefficient * tl.exp(x - lse) - tl.where(cols == target, hit, 0.0)
            if SMOOTH:
                w = tl.load(WEIGHT + cols, mask=cols < V, other=0.0).to(tl.float32) if HAS_WEIGHT else 1.0
                dx -= eps_over_classes * scale * w
            tl.store(x_row + cols, dx.to(X.dtype.element_ty), mask=cols < V)


def block_for(classes: int) -> tuple:
    """(BLOCK, num_warps): a row streamed in tiles of up to 4096 logits, 8 warps for the widest."""
    block = min(4096, triton.next_power_of_2(classes))
    return block, (8 if block >= 2048 else 4)
