"""Flash attention in Triton (FlashAttention-2's algorithm): forward and backward kernels.

Forward: each program takes BLOCK_M rows of q and streams K/V tiles past them with an online
softmax (running max and sum), so no T x T matrix exists anywhere; it stores the output and
each row's logsumexp (float32, float64 for float64 inputs). Backward recomputes the weights
from q, k and that logsumexp: one kernel per block of q rows computes delta = rowsum(dO * O)
and dQ, then one per block of key rows computes dK and dV, summing over the query heads that
share a key head (grouped-query attention: the repeat is never materialized).

Forms (one kernel each, by constexpr): causal (top-left aligned, as eager: key j is seen by
row i when j <= i; tiles wholly above the diagonal are skipped), a boolean or additive mask read
through its strides (0 where it broadcasts), dropout on the weights from Philox numbers
regenerated in backward (element (row, col) of head bh draws ``tl.rand(seed, (bh*M + row)*N +
col)``, the position in the weights' shape the decomposed form's ``rand`` draws too), any
``scale``, head dims padded to a power of two, lengths that are not a multiple of the tile. A
row no key may attend gives eager's 0 (and zero gradients).

Accumulation is in float32 (float64 for float64); the weights are rounded to v's dtype for the
P @ V product, as FlashAttention does. float32 products use IEEE float32 (no TF32), as eager.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_t(X, base, cols, offs_d, N, D, s_n, s_d):
    """The [BLOCK_D, BLOCK_N] tile of rows ``cols`` of a [N, D] matrix, transposed (zeros outside)."""
    return tl.load(X + base + cols[None, :] * s_n + offs_d[:, None] * s_d,
                   mask=(cols[None, :] < N) & (offs_d[:, None] < D), other=0.0)


@triton.jit
def _rotate_half(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """[-x_hi, x_lo] along the last dim of a [ROWS, BLOCK_D] tile (rotary's rotate_half), in registers."""
    pairs = tl.permute(tl.reshape(x, [ROWS, 2, BLOCK_D // 2]), [0, 2, 1])
    lo, hi = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(-hi, lo), [0, 2, 1]), [ROWS, BLOCK_D])


@triton.jit
def _cos_sin(Cos, Sin, r_base, pos, offs_d, n, s_rt, s_rd, ACC: tl.constexpr):
    at = r_base + pos[:, None] * s_rt + offs_d[None, :] * s_rd
    inside = pos[:, None] < n
    return tl.load(Cos + at, mask=inside, other=0.0).to(ACC), tl.load(Sin + at, mask=inside, other=0.0).to(ACC)


@triton.jit
def _rotary(x, Cos, Sin, r_base, pos, offs_d, n, s_rt, s_rd, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
            ACC: tl.constexpr):
    """x * cos + rotate_half(x) * sin at positions ``pos`` (rows of x), computed in ACC and rounded
    to x's dtype, as the rotated tensor eager makes is."""
    cos, sin = _cos_sin(Cos, Sin, r_base, pos, offs_d, n, s_rt, s_rd, ACC)
    wide = x.to(ACC)
    return (wide * cos + _rotate_half(wide, ROWS, BLOCK_D) * sin).to(x.dtype)


@triton.jit
def _rows_tile(X, base, rows, offs_d, n, D, s_m, s_d, Cos, Sin, r_base, s_rt, s_rd,
               ROTARY: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """The [ROWS, BLOCK_D] tile of rows ``rows`` of q (or k), rotated where ROTARY."""
    x = tl.load(X + base + rows[:, None] * s_m + offs_d[None, :] * s_d,
                mask=(rows[:, None] < n) & (offs_d[None, :] < D), other=0.0)
    if ROTARY:
        x = _rotary(x, Cos, Sin, r_base, rows, offs_d, n, s_rt, s_rd, ROWS, BLOCK_D, ACC)
    return x


@triton.jit
def _keys_t(K, k_base, cols, offs_d, N, D, s_kn, s_kd, Cos, Sin, r_base, s_rt, s_rd,
            ROTARY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """k's tile of keys ``cols``, transposed ([BLOCK_D, BLOCK_N]) and rotated where ROTARY."""
    if ROTARY:
        return tl.trans(_rows_tile(K, k_base, cols, offs_d, N, D, s_kn, s_kd, Cos, Sin, r_base, s_rt, s_rd,
                                   ROTARY, BLOCK_N, BLOCK_D, ACC))
    return _tile_t(K, k_base, cols, offs_d, N, D, s_kn, s_kd)


@triton.jit
def _scores(q, kt, Mask, m_base, rows, cols, M, N, s_mm, s_mn, scale, scale_lo,
            IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """scale * q k^T + mask over rows x cols, -inf where a key is not seen (``kt``: k's tile, [D, N])."""
    s = tl.dot(q, kt, input_precision=PRECISION, out_dtype=ACC)
    s = s * scale + s * scale_lo   # (scale_lo: what float32 lost of a float64 scale; else 0)
    seen = (cols[None, :] < N) & (rows[:, None] < M)
    if IS_CAUSAL:
        seen = seen & (cols[None, :] <= rows[:, None])
    if MASK_KIND == 1:   # boolean: True attends
        allowed = tl.load(Mask + m_base + rows[:, None] * s_mm + cols[None, :] * s_mn, mask=seen, other=0)
        seen = seen & (allowed != 0)
    if MASK_KIND == 2:   # additive
        s = s + tl.load(Mask + m_base + rows[:, None] * s_mm + cols[None, :] * s_mn, mask=seen, other=0.0).to(ACC)
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _kept(Seed, bh, rows, cols, M, N, dropout_p):
    """Dropout's keep decision for weights (rows, cols) of head ``bh``: Philox(seed, position)."""
    seed = tl.load(Seed)
    position = (bh.to(tl.int64) * M + rows[:, None].to(tl.int64)) * N + cols[None, :].to(tl.int64)
    return tl.rand(seed, position) >= dropout_p


@triton.jit
def attention_forward(Q, K, V, Mask, Seed, Cos, Sin, Out, LSE,
                      s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                      s_mb, s_mh, s_mm, s_mn, s_rb, s_rt, s_rd, s_ob, s_oh, s_om, s_od,
                      H, GROUP, M, N, D, scale, scale_lo, keep, keep_lo, dropout_p,
                      IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                      PRECISION: tl.constexpr, WIDE: tl.constexpr, EMPTY_NAN: tl.constexpr, ROTARY: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """O and the logsumexp of BLOCK_M rows of one (batch, head); grid (cdiv(M, BLOCK_M), B * H)."""
    ACC: tl.constexpr = tl.float64 if WIDE else tl.float32
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = bh // H, bh % H
    rows, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = _rows_tile(Q, b * s_qb + h * s_qh, rows, offs_d, M, D, s_qm, s_qd, Cos, Sin, b * s_rb, s_rt, s_rd,
                   ROTARY, BLOCK_M, BLOCK_D, ACC)
    k_base, v_base = b * s_kb + (h // GROUP) * s_kh, b * s_vb + (h // GROUP) * s_vh
    m_base = b * s_mb + h * s_mh
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    end = tl.minimum(N, start_m + BLOCK_M) if IS_CAUSAL else N
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kt = _keys_t(K, k_base, cols, offs_d, N, D, s_kn, s_kd, Cos, Sin, b * s_rb, s_rt, s_rd, ROTARY, BLOCK_N,
                     BLOCK_D, ACC)
        s = _scores(q, kt, Mask, m_base, rows, cols, M, N, s_mm, s_mn, scale, scale_lo, IS_CAUSAL, MASK_KIND,
                    PRECISION, ACC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: no NaN
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_kept(Seed, bh, rows, cols, M, N, dropout_p), p * keep + p * keep_lo, 0.0)
        v = tl.load(V + v_base + cols[:, None] * s_vn + offs_d[None, :] * s_vd,
                    mask=(cols[:, None] < N) & (offs_d[None, :] < D), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
        m_i = m_new
    # every key masked: SDPA's 0, and a logsumexp of 0 as eager's CPU kernel; or (EMPTY_NAN, attention
    # written out as softmax) softmax's NaN, and a NaN logsumexp, which the backward spreads as eager's does
    empty = l_i == 0.0
    if EMPTY_NAN:
        out = acc / l_i[:, None]
        m_i = tl.where(empty, float("nan"), m_i)
    else:
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(Out + b * s_ob + h * s_oh + rows[:, None] * s_om + offs_d[None, :] * s_od, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < M) & (offs_d[None, :] < D))
    lse = tl.where(empty, 0.0, m_i + tl.log(tl.where(empty, 1.0, l_i)))
    if EMPTY_NAN:
        lse = tl.where(empty, float("nan"), lse)
    tl.store(LSE + bh * M + rows, lse, mask=rows < M)


@triton.jit
def _weights_and_dscores(q, do, lse, delta, kt, vt, Mask, Seed, bh, m_base, rows, cols, M, N, s_mm, s_mn, scale,
                         scale_lo, keep, keep_lo, dropout_p, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                         DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """For one tile (k's and v's tiles transposed, [D, N]): the weights P as they multiplied V
    (after dropout) and dS, the scores' gradient (before the scale)."""
    s = _scores(q, kt, Mask, m_base, rows, cols, M, N, s_mm, s_mn, scale, scale_lo, IS_CAUSAL, MASK_KIND,
                PRECISION, ACC)
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, vt, input_precision=PRECISION, out_dtype=ACC)
    if DROPOUT:
        kept = _kept(Seed, bh, rows, cols, M, N, dropout_p)
        dp = tl.where(kept, dp * keep + dp * keep_lo, 0.0)
        p_used = tl.where(kept, p * keep + p * keep_lo, 0.0)
    else:
        p_used = p
    return p_used, p * (dp - delta[:, None])


@triton.jit
def attention_backward_dq(Q, K, V, Mask, Seed, Cos, Sin, Out, DO, LSE, DELTA, DQ,
                          s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                          s_mb, s_mh, s_mm, s_mn, s_rb, s_rt, s_rd, s_ob, s_oh, s_om, s_od, s_gb, s_gh, s_gm, s_gd,
                          H, GROUP, M, N, D, scale, scale_lo, keep, keep_lo, dropout_p,
                          IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                          PRECISION: tl.constexpr, WIDE: tl.constexpr, ROTARY: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) (stored for the dK/dV kernel) and dQ for BLOCK_M rows; dQ is
    written contiguous [B, H, M, D]. Grid (cdiv(M, BLOCK_M), B * H)."""
    ACC: tl.constexpr = tl.float64 if WIDE else tl.float32
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = bh // H, bh % H
    rows, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < M) & (offs_d[None, :] < D)
    q = _rows_tile(Q, b * s_qb + h * s_qh, rows, offs_d, M, D, s_qm, s_qd, Cos, Sin, b * s_rb, s_rt, s_rd,
                   ROTARY, BLOCK_M, BLOCK_D, ACC)
    do = tl.load(DO + b * s_gb + h * s_gh + rows[:, None] * s_gm + offs_d[None, :] * s_gd, mask=inside, other=0.0)
    o = tl.load(Out + b * s_ob + h * s_oh + rows[:, None] * s_om + offs_d[None, :] * s_od, mask=inside, other=0.0)
    delta = tl.sum(do.to(ACC) * o.to(ACC), 1)
    tl.store(DELTA + bh * M + rows, delta, mask=rows < M)
    lse = tl.load(LSE + bh * M + rows, mask=rows < M, other=0.0)
    k_base, v_base = b * s_kb + (h // GROUP) * s_kh, b * s_vb + (h // GROUP) * s_vh
    m_base = b * s_mb + h * s_mh
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    end = tl.minimum(N, start_m + BLOCK_M) if IS_CAUSAL else N
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kt = _keys_t(K, k_base, cols, offs_d, N, D, s_kn, s_kd, Cos, Sin, b * s_rb, s_rt, s_rd, ROTARY, BLOCK_N,
                     BLOCK_D, ACC)
        vt = _tile_t(V, v_base, cols, offs_d, N, D, s_vn, s_vd)
        _, ds = _weights_and_dscores(q, do, lse, delta, kt, vt, Mask, Seed, bh, m_base, rows, cols, M, N, s_mm, s_mn,
                                     scale, scale_lo, keep, keep_lo, dropout_p, IS_CAUSAL, MASK_KIND, DROPOUT,
                                     PRECISION, ACC)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION, out_dtype=ACC)
    dq = dq * scale + dq * scale_lo   # (with ROTARY, of the rotated q: the graph takes it back through the rotation)
    tl.store(DQ + bh * M * D + rows[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=inside)


@triton.jit
def attention_backward_dkv(Q, K, V, Mask, Seed, Cos, Sin, DO, LSE, DELTA, DK, DV,
                           s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                           s_mb, s_mh, s_mm, s_mn, s_rb, s_rt, s_rd, s_gb, s_gh, s_gm, s_gd,
                           H, GROUP, M, N, D, scale, scale_lo, keep, keep_lo, dropout_p,
                           IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                           PRECISION: tl.constexpr, WIDE: tl.constexpr, ROTARY: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK and dV for BLOCK_N keys of one (batch, key head), summed over the GROUP query heads
    that read it; written contiguous [B, H // GROUP, N, D]. Grid (cdiv(N, BLOCK_N), B * H // GROUP)."""
    ACC: tl.constexpr = tl.float64 if WIDE else tl.float32
    start_n, bhk = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    hk_count = H // GROUP
    b, hk = bhk // hk_count, bhk % hk_count
    cols, offs_d = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k_base, v_base = b * s_kb + hk * s_kh, b * s_vb + hk * s_vh
    kt = _keys_t(K, k_base, cols, offs_d, N, D, s_kn, s_kd, Cos, Sin, b * s_rb, s_rt, s_rd, ROTARY, BLOCK_N,
                 BLOCK_D, ACC)   # kept for every row block
    vt = _tile_t(V, v_base, cols, offs_d, N, D, s_vn, s_vd)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    begin = (start_n // BLOCK_M) * BLOCK_M if IS_CAUSAL else 0   # rows above the tile see none of it
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        m_base = b * s_mb + h * s_mh
        for start_m in range(begin, M, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            inside = (rows[:, None] < M) & (offs_d[None, :] < D)
            q = _rows_tile(Q, b * s_qb + h * s_qh, rows, offs_d, M, D, s_qm, s_qd, Cos, Sin, b * s_rb, s_rt, s_rd,
                           ROTARY, BLOCK_M, BLOCK_D, ACC)
            do = tl.load(DO + b * s_gb + h * s_gh + rows[:, None] * s_gm + offs_d[None, :] * s_gd, mask=inside,
                         other=0.0)
            lse = tl.load(LSE + bh * M + rows, mask=rows < M, other=0.0)
            delta = tl.load(DELTA + bh * M + rows, mask=rows < M, other=0.0)
            p, ds = _weights_and_dscores(q, do, lse, delta, kt, vt, Mask, Seed, bh, m_base, rows, cols, M, N, s_mm,
                                         s_mn, scale, scale_lo, keep, keep_lo, dropout_p, IS_CAUSAL, MASK_KIND,
                                         DROPOUT, PRECISION, ACC)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION, out_dtype=ACC)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION, out_dtype=ACC)
    out = bhk * N * D + cols[:, None] * D + offs_d[None, :]
    inside = (cols[:, None] < N) & (offs_d[None, :] < D)
    dk = dk * scale + dk * scale_lo   # (with ROTARY, of the rotated k: the graph takes it back through the rotation)
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=inside)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=inside)
