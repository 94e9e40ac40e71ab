"""Lesson 06: FlashAttention, forward and backward, in Triton.

Standard attention builds the score matrix ``S = q k^T`` ([seq_q, seq_k] per head), its softmax ``P``
and then ``P v``. For 16k tokens and 32 heads, S alone is 16k * 16k * 32 * 2 bytes = 16 GiB: memory
grows as n^2 and the time goes into writing and re-reading S and P, not into the arithmetic.

FlashAttention never stores S or P. Each program owns a block of query rows and walks over the keys
block by block, keeping per row only

* ``m``   the largest score seen so far (for a numerically safe exp),
* ``l``   the sum of ``exp(score - m)`` over the keys seen so far,
* ``acc`` the sum of ``exp(score - m) * v`` over the keys seen so far ([BLOCK_M, head_dim]).

When a new block of keys brings a larger maximum ``m_new``, everything accumulated so far was scaled
by ``exp(-m)`` and must now be scaled by ``exp(-m_new)``: multiply ``l`` and ``acc`` by
``alpha = exp(m - m_new)`` and add the new block's terms. This is the *online softmax*. At the end
``out = acc / l`` is exactly ``softmax(S) v``, and ``lse = m + log(l)`` (the log of the softmax
denominator) is saved for the backward pass. Memory is O(n): q, k, v, out and one float per row.

The backward pass needs P again. Instead of storing it, it *recomputes* each tile from q, k and the
saved ``lse``: ``P = exp(S - lse)`` (one exp per score, no running max: ``lse`` already holds the
final normaliser). With ``dP = dout v^T`` and ``delta_i = sum_j P_ij dP_ij = dout_i . out_i``, the
softmax gradient is ``dS = P * (dP - delta)``, and then ``dq = scale * dS k``, ``dk = scale * dS^T q``,
``dv = P^T dout``. Recomputing costs one extra matmul per tile but saves the n^2 memory traffic,
which is the better deal on a GPU.

The kernels work in base 2 (``exp2``/``log2``, scores pre-multiplied by ``log2(e)``): exp2 is the
instruction the hardware has; the results are converted back to natural logs at the edges.

Layouts: the dense functions take ``[batch, heads, seq, head_dim]`` (like ``torch.nn.functional.
scaled_dot_product_attention``); the variable-length form takes token-major ``[total_tokens, heads,
head_dim]`` with cumulative offsets, the layout of an engine's batched prefill. One Triton kernel
serves both: it only needs the strides and, for varlen, where each sequence starts.

Sliding windows (task 5, the varlen form: the engine's prefill for Mistral-style layers): query ``p`` sees
keys ``p - w < j <= p``. A query block then visits only the key blocks its rows' windows touch, masking the
ones the window's edge crosses, so a prompt of ``n`` tokens costs ``n * w`` scores instead of ``n^2 / 2``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/flash_attention_given.py
from yaie.kernels.flash_attention_given import (
    LN2, LOG2E, MAX_HEAD_DIM, SUPPORTED_DTYPES, attention_reference, check_attention_inputs,
)


# yaie: solution-only
def _kernel_options(dtype: torch.dtype) -> dict:
    """Compile-time switches that depend on the dtype and on where the kernel runs."""
    return dict(
        # fp32 inputs: exact fp32 products (the GPU default for a fp32 tl.dot is the faster, rounder tf32).
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        # The CPU interpreter multiplies bf16 bit patterns as integers (triton issue 11584): upcast there.
        FP32_DOT=triton_interpreted() and dtype == torch.bfloat16,
    )


# yaie: solution-only
def _use_autotune(exact_fp32: bool, length: int) -> bool:
    """Autotune the blocks on a GPU for fp16/bf16 sequences longer than 1024, unless YAIE_FA_AUTOTUNE=0.

    Elsewhere fixed blocks: in the interpreter; for short sequences, where tuning (a compile of
    seconds per config, then timing runs) costs more than it can save; and for float32, whose exact
    ("ieee") dots skip the tensor cores: a correctness path, not a fast one, and very slow to compile
    at the large tuned blocks (seen on an H100: over 120 s for one grader test).
    """
    if triton_interpreted() or os.environ.get("YAIE_FA_AUTOTUNE", "1") == "0":
        return False
    return not exact_fp32 and length > 1024


# yaie: solution-only
def _tune_bucket(n: int) -> int:
    """Sequence lengths rounded up to a power of two: the autotuner re-tunes once per bucket, not per length."""
    return 1 << max(n - 1, 0).bit_length()


# yaie: solution-only
@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in float32 (FP32_DOT: upcast the operands first, for the interpreter)."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


# yaie: solution-only
@triton.jit
def _load_rows(base, rows, stride_row, offs_d, row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Load a [rows, BLOCK_D] tile (or its transpose [BLOCK_D, rows]); out-of-range entries read 0.

    The padding columns (head_dim < BLOCK_D) read 0, so they add nothing to q.k and produce
    nothing in the output. Masks are compile-time switched off where the tile is known in bounds.
    """
    if TRANSPOSED:
        ptrs = base + rows[None, :] * stride_row + offs_d[:, None]
        mask = (offs_d[:, None] < HEAD_DIM)
        if CHECK_ROWS:
            mask = mask & row_ok[None, :]
    else:
        ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
        mask = (offs_d[None, :] < HEAD_DIM)
        if CHECK_ROWS:
            mask = mask & row_ok[:, None]
    if CHECK_ROWS or HEAD_DIM != BLOCK_D:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


# yaie: solution-only
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
               lo, hi, k_lo, k_len, causal_shift, window, qk_scale_log2,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key blocks [lo, hi) into the running (acc, l, m) of one block of query rows.

    MASK=False is the fast path for key blocks that every row of the block fully sees and that lie
    inside the sequence; MASK=True handles the causal diagonal, the ragged last block and (WINDOWED)
    the lower edge of a sliding window, where a row sees only keys after ``its position - window``; keys
    before ``k_lo``, which no row of the block sees, are not even loaded.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < k_len
        if WINDOWED and MASK:
            col_ok = col_ok & (cols >= k_lo)
        k_t = _load_rows(k_base, cols, stride_ks, offs_d, col_ok, HEAD_DIM, BLOCK_D, MASK, True)
        # Scores in base-2 units: s = (q . k) * scale * log2(e).
        s = _dot(q, k_t, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), FP32_DOT, PRECISION)
        s = s * qk_scale_log2
        if MASK:
            keep = col_ok[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
            if WINDOWED:
                keep = keep & (cols[None, :] > offs_m[:, None] + causal_shift - window)
            s = tl.where(keep, s, float("-inf"))
        # Online softmax: new running max, rescale what was accumulated under the old max.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK:
            # A row that has seen only masked keys keeps max -inf; subtract 0 instead (exp2(-inf) = 0).
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, cols, stride_vs, offs_d, col_ok, HEAD_DIM, BLOCK_D, MASK, False)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], FP32_DOT, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# yaie: solution-only
@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, group_size, qk_scale_log2, tune_len, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, WINDOWED: tl.constexpr, FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, head). Grid: (query blocks, heads, batch).

    WINDOWED (with CAUSAL): row ``i`` sees only keys ``i + shift - window < j <= i + shift``."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if CAUSAL:
        # Under a causal mask later query blocks have more keys to visit: start those first so the
        # long programs do not all end up in the last wave.
        pid_m = tl.num_programs(0) - 1 - pid_m
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        q_len = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + batch)
        k_len = tl.load(CU_SEQLENS_K + batch + 1) - k_start
    else:
        q_start = tl.full([], 0, tl.int32)
        q_len = seqlen_q
        k_start = tl.full([], 0, tl.int32)
        k_len = seqlen_k
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return  # varlen: this sequence is shorter than the longest one
    kv_head = head // group_size
    batch64 = batch.to(tl.int64)
    q_base = Q + batch64 * stride_qb + head.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qs
    k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_ks
    v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vs

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    q = _load_rows(q_base, offs_m, stride_qs, offs_d, row_ok, HEAD_DIM, BLOCK_D, True, False)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Query row i sits at key position i + causal_shift (the last query aligns with the last key).
    causal_shift = k_len - q_len
    full_end = (k_len // BLOCK_N) * BLOCK_N           # key blocks that lie wholly inside the sequence
    if CAUSAL:
        # Keys <= start_m + shift are visible to every row of this block: no mask needed there.
        seen_by_all = tl.maximum(start_m + causal_shift + 1, 0)
        full_end = tl.minimum(full_end, (seen_by_all // BLOCK_N) * BLOCK_N)
        end = tl.minimum(k_len, start_m + BLOCK_M + causal_shift)   # past the last row's last key
    else:
        end = k_len
    start = 0
    k_lo = 0
    if WINDOWED:
        # A sliding window also has a lower edge: key blocks wholly before the first row's window are
        # skipped (that is the saving: each row visits at most `window` keys), the blocks the window's
        # edge crosses are masked, and the blocks every row sees whole stay on the fast path.
        k_lo = tl.maximum(start_m + causal_shift - window + 1, 0)     # the first row's first visible key
        start = (k_lo // BLOCK_N) * BLOCK_N
        seen_from = tl.maximum(start_m + BLOCK_M + causal_shift - window, 0)   # visible to the last row on
        # (start <= fast_start <= full_end: the three ranges below tile [start, end) without overlap.)
        fast_start = tl.minimum(tl.maximum((seen_from + BLOCK_N - 1) // BLOCK_N * BLOCK_N, start), full_end)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                                   start, fast_start, k_lo, k_len, causal_shift, window, qk_scale_log2,
                                   True, CAUSAL, WINDOWED, HEAD_DIM, BLOCK_D, BLOCK_N, FP32_DOT, PRECISION)
        start = fast_start
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                               start, full_end, k_lo, k_len, causal_shift, window, qk_scale_log2,
                               False, CAUSAL, WINDOWED, HEAD_DIM, BLOCK_D, BLOCK_N, FP32_DOT, PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                               full_end, end, k_lo, k_len, causal_shift, window, qk_scale_log2,
                               True, CAUSAL, WINDOWED, HEAD_DIM, BLOCK_D, BLOCK_N, FP32_DOT, PRECISION)

    # Normalise once at the end; a row with no visible key (l == 0) outputs zeros and lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    # m is in base-2 units, so log2 of the denominator is m + log2(l); times ln(2) gives the natural log.
    # (A jitted kernel may only read globals declared tl.constexpr, so LN2 is written out here.)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)

    o_base = O + batch64 * stride_ob + head.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_os
    o_ptrs = o_base + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    l_ptrs = LSE + batch64 * stride_lb + head.to(tl.int64) * stride_lh + (q_start + offs_m).to(tl.int64) * stride_ls
    tl.store(l_ptrs, lse, mask=row_ok)


# yaie: solution-only
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, group_size, qk_scale_log2, scale, tune_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: dk and dv of BLOCK_N keys of one KV head, summed over the query heads of its group.

    Grid: (key blocks, kv heads, batch). Each program owns its rows of dk/dv, so no atomics are needed:
    it loops over every query head of the group and every query block that sees its keys.
    """
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    # (Under a causal mask the first key blocks have the most queries to visit; they already start first.)
    start_n = pid_n * BLOCK_N
    batch64 = batch.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < seqlen_k
    k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    k = _load_rows(k_base, offs_n, stride_ks, offs_d, col_ok, HEAD_DIM, BLOCK_D, True, False)
    v = _load_rows(v_base, offs_n, stride_vs, offs_d, col_ok, HEAD_DIM, BLOCK_D, True, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    causal_shift = seqlen_k - seqlen_q
    if CAUSAL:
        # Rows before start_n - shift see none of these keys; rows from start_n + BLOCK_N - 1 - shift
        # on see all of them; the rows in between (the diagonal band) need the mask.
        first_row = tl.maximum(start_n - causal_shift, 0)
        lo = (first_row // BLOCK_M) * BLOCK_M
        all_row = tl.maximum(start_n + BLOCK_N - 1 - causal_shift, 0)
        mid = tl.maximum(tl.cdiv(all_row, BLOCK_M) * BLOCK_M, lo)
        mid = tl.minimum(mid, tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M)
    else:
        lo = 0
        mid = 0

    for g in range(0, group_size):
        head = (kv_head * group_size + g).to(tl.int64)
        q_base = Q + batch64 * stride_qb + head * stride_qh
        do_base = DO + batch64 * stride_dob + head * stride_doh
        lse_base = LSE2 + batch64 * stride_lb + head * stride_lh
        delta_base = DELTA + batch64 * stride_lb + head * stride_lh
        # Two passes over the query blocks: the masked diagonal band, then the rest unmasked.
        for phase in tl.static_range(2):
            if phase == 0:
                m_lo = lo
                m_hi = mid
            else:
                m_lo = mid
                m_hi = seqlen_q
            for start_m in range(m_lo, m_hi, BLOCK_M):
                rows = start_m + offs_m0
                row_ok = rows < seqlen_q
                q_t = _load_rows(q_base, rows, stride_qs, offs_d, row_ok, HEAD_DIM, BLOCK_D, True, True)
                # Padded rows read lse = +inf, so their recomputed probabilities are exactly 0.
                lse2 = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
                # Recompute P^T for this tile from the saved log-sum-exp: no running max needed.
                s_t = _dot(k, q_t, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), FP32_DOT, PRECISION)
                p_t = tl.math.exp2(s_t * qk_scale_log2 - lse2[None, :])
                if CAUSAL and phase == 0:
                    p_t = tl.where(offs_n[:, None] <= rows[None, :] + causal_shift, p_t, 0.0)
                do = _load_rows(do_base, rows, stride_dos, offs_d, row_ok, HEAD_DIM, BLOCK_D, True, False)
                dv = _dot(p_t.to(do.dtype), do, dv, FP32_DOT, PRECISION)
                delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
                dp_t = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), FP32_DOT, PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                dk = _dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, FP32_DOT, PRECISION)

    dk = dk * scale    # s = scale * q.k, so dL/dk = scale * dS^T q
    mask = col_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    dk_ptrs = DK + batch64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + batch64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


# yaie: solution-only
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs, stride_lb, stride_lh,
    seqlen_q, seqlen_k, group_size, qk_scale_log2, scale, tune_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: dq of BLOCK_M query rows of one head. Grid: (query blocks, heads, batch)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m   # the last query blocks have the most keys: start them first
    start_m = pid_m * BLOCK_M
    kv_head = head // group_size
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    q = _load_rows(Q + batch64 * stride_qb + head64 * stride_qh, offs_m, stride_qs, offs_d, row_ok,
                   HEAD_DIM, BLOCK_D, True, False)
    do = _load_rows(DO + batch64 * stride_dob + head64 * stride_doh, offs_m, stride_dos, offs_d, row_ok,
                    HEAD_DIM, BLOCK_D, True, False)
    lse2 = tl.load(LSE2 + batch64 * stride_lb + head64 * stride_lh + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + batch64 * stride_lb + head64 * stride_lh + offs_m, mask=row_ok, other=0.0)
    k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_shift = seqlen_k - seqlen_q
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        seen_by_all = tl.maximum(start_m + causal_shift + 1, 0)
        full_end = tl.minimum(full_end, (seen_by_all // BLOCK_N) * BLOCK_N)
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_shift)
    else:
        end = seqlen_k
    for phase in tl.static_range(2):   # unmasked key blocks first, then the masked tail / diagonal
        if phase == 0:
            n_lo = 0
            n_hi = full_end
        else:
            n_lo = full_end
            n_hi = end
        for start_n in range(n_lo, n_hi, BLOCK_N):
            cols = start_n + offs_n0
            col_ok = cols < seqlen_k
            k_t = _load_rows(k_base, cols, stride_ks, offs_d, col_ok, HEAD_DIM, BLOCK_D, phase == 1, True)
            v_t = _load_rows(v_base, cols, stride_vs, offs_d, col_ok, HEAD_DIM, BLOCK_D, phase == 1, True)
            s = _dot(q, k_t, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), FP32_DOT, PRECISION)
            p = tl.math.exp2(s * qk_scale_log2 - lse2[:, None])
            if phase == 1:
                keep = col_ok[None, :]
                if CAUSAL:
                    keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
                p = tl.where(keep, p, 0.0)
            dp = _dot(do, v_t, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), FP32_DOT, PRECISION)
            ds = p * (dp - delta[:, None])
            dq = _dot(ds.to(k_t.dtype), tl.trans(k_t), dq, FP32_DOT, PRECISION)

    dq = dq * scale
    dq_ptrs = DQ + batch64 * stride_dqb + head64 * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


# yaie: solution-only
def _fixed_config(kind: str, block_d: int, exact_fp32: bool = False) -> dict:
    """Block sizes used without autotuning: small square blocks in the interpreter, sane GPU defaults.

    Shared memory (227 KB a block on Hopper) bounds the tiles: float32 tiles are twice as large, so
    wide float32 heads get smaller blocks (float32, head_dim 128, forward 128 x 64: 225 KB, just in).
    """
    if triton_interpreted():
        return dict(BLOCK_M=32, BLOCK_N=32)
    wide = block_d > 128
    if exact_fp32 and wide:
        if kind == "fwd":
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    if kind == "fwd":
        return dict(BLOCK_M=64 if wide else 128, BLOCK_N=64, num_warps=8 if block_d >= 128 else 4,
                    num_stages=2 if wide else 3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8 if block_d >= 128 else 4, num_stages=2)


# yaie: solution-only
def _autotune_configs(kind: str) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner tries on a GPU: few, to keep compiles short.

    Forward: 128 query rows per program with 8 warps (two warp groups for Hopper's wgmma). dK/dV: many
    keys per program (BLOCK_N = 128) over short query blocks; dQ: the mirror image.
    """
    return {
        "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
        "dkdv": [(32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)],
        "dq": [(128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)],
    }[kind]


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _tuned(kind: str):
    """The autotuned form of one kernel (GPU only), keyed on what changes the best blocks."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in _autotune_configs(kind)]
    if kind == "fwd":
        kernel, key = _flash_fwd_kernel, ["HEAD_DIM", "CAUSAL", "VARLEN", "WINDOWED", "tune_len"]
    elif kind == "dkdv":
        kernel, key = _bwd_dkdv_kernel, ["HEAD_DIM", "CAUSAL", "tune_len", "group_size"]
    else:
        kernel, key = _bwd_dq_kernel, ["HEAD_DIM", "CAUSAL", "tune_len"]
    return triton.autotune(configs=configs, key=key)(kernel)


# yaie: solution-only
def _launch(kind: str, grid_rows: int, grid_heads: int, batch: int, args: tuple, block_d: int, **constexprs):
    """Launch one kernel, autotuned (see :func:`_use_autotune`) or with fixed blocks.

    ``grid_rows`` is the length the first grid axis tiles (query rows or keys, per BLOCK_M or BLOCK_N).
    """
    tile = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    exact_fp32 = constexprs.get("PRECISION") == "ieee"
    if _use_autotune(exact_fp32, grid_rows):
        def grid(meta):
            return ((grid_rows + meta[tile] - 1) // meta[tile], grid_heads, batch)
        _tuned(kind)[grid](*args, BLOCK_D=block_d, **constexprs)
    else:
        kernel = {"fwd": _flash_fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}[kind]
        config = _fixed_config(kind, block_d, exact_fp32)
        grid = ((grid_rows + config[tile] - 1) // config[tile], grid_heads, batch)   # not triton.cdiv: slow on the host
        kernel[grid](*args, BLOCK_D=block_d, **constexprs, **config)


# yaie: solution-only
def _block_d(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16, the smallest tl.dot inner size)."""
    return max(16, triton.next_power_of_2(head_dim))


# yaie: solution-only
def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head_dim axis with stride 1 (wide vector loads): copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


# yaie: solution-only
def _default_scale(head_dim: int, scale: float | None) -> float:
    """The score multiplier: ``head_dim ** -0.5`` unless the caller gave one."""
    return head_dim ** -0.5 if scale is None else float(scale)


# yaie: solution-only
def _dense_forward_args(q, k, v, out, lse, scale: float) -> tuple:
    """The forward kernel's arguments for ``[batch, heads, seq, head_dim]`` tensors, up to the window.

    Pointers, strides as (batch, head, token), lengths, the query heads per KV head, the base-2 score scale
    and the autotuning bucket. The cu_seqlens pointers are unused in the dense layout (lse stands in).
    """
    seq_q, seq_k = q.shape[2], k.shape[2]
    return (q, k, v, out, lse, lse, lse,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride(),
            seq_q, seq_k, q.shape[1] // k.shape[1], scale * LOG2E, _tune_bucket(seq_q))


# yaie: solution-only
def _varlen_forward_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                         scale: float) -> tuple:
    """The forward kernel's arguments for packed ``[tokens, heads, head_dim]`` tensors, up to the window.

    Token-major strides as (batch, head, token): the batch stride is 0, each sequence starts at its offset.
    """
    return (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
            0, out.stride(1), out.stride(0), 0, lse.stride(0), lse.stride(1),
            int(max_seqlen_q), int(max_seqlen_k), q.shape[1] // k.shape[1], scale * LOG2E,
            _tune_bucket(int(max_seqlen_q)))


# yaie: solution-only
def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                         sliding_window, validate=True) -> None:
    """Everything :func:`flash_attention_varlen_forward` rejects, as ``ValueError``."""
    check_attention_inputs(q, k, v, causal, scale, layout="varlen")
    if sliding_window is not None and (not isinstance(sliding_window, int) or isinstance(sliding_window, bool)
                                       or sliding_window < 1 or not causal):
        raise ValueError(f"sliding_window must be None or an int >= 1 with causal=True, got {sliding_window!r} "
                         f"(causal={causal})")
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], int(max_seqlen_q), int(max_seqlen_k),
                      causal, q.device, validate)


# yaie: task 1
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward: ``softmax(q k^T * scale) v`` without ever storing the score matrix.

    Args:
        q: ``[batch, num_heads, seq_q, head_dim]``.
        k, v: ``[batch, num_kv_heads, seq_k, head_dim]``; ``num_heads`` must be a multiple of
            ``num_kv_heads`` (grouped-query attention: query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``).
        causal: mask future keys. The last query aligns with the last key: query ``i`` sits at position
            ``seq_k - seq_q + i`` and sees keys ``0 .. seq_k - seq_q + i`` (as lesson 01's
            ``cpu_attention_forward``); ``seq_q > seq_k`` is then an error.
        scale: multiplier of the scores, default ``head_dim ** -0.5``.

    Dtypes: float16 or bfloat16 (float32 too, mainly for the CPU interpreter), the same for q, k, v.
    Any sequence lengths and any head_dim from 1 to 256 (padded inside to a power of two).
    On the CPU the kernel runs in the Triton interpreter.

    Returns:
        ``(out, lse)``: ``out`` like q; ``lse`` float32 ``[batch, num_heads, seq_q]``, the natural log
        of each row's softmax denominator, ``log(sum_j exp(scale * q_i . k_j))`` over the visible keys.

    Raises:
        ValueError: wrong ranks, dtypes or devices; mismatched batch, head_dim or k/v shapes; heads not
            divisible; empty tensors; a non-positive scale; causal with ``seq_q > seq_k``.
    """
    check_attention_inputs(q, k, v, causal, scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    batch, num_heads, seq_q, head_dim = q.shape
    scale = _default_scale(head_dim, scale)
    out = torch.empty_like(q)
    lse = torch.empty((batch, num_heads, seq_q), device=q.device, dtype=torch.float32)
    args = (*_dense_forward_args(q, k, v, out, lse, scale), 0)    # window 0: no sliding window
    _launch("fwd", seq_q, num_heads, batch, args, _block_d(head_dim), HEAD_DIM=head_dim, CAUSAL=bool(causal),
            VARLEN=False, WINDOWED=False, **_kernel_options(q.dtype))
    return out, lse


# yaie: solution-only
def _check_backward_inputs(dout, q, out, lse) -> None:
    batch, num_heads, seq_q, _ = q.shape
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {shape}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), "
                             f"got {t.dtype}, {t.device}")
    if not isinstance(lse, torch.Tensor) or lse.shape != (batch, num_heads, seq_q):
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"lse must be [batch, num_heads, seq_q] = {[batch, num_heads, seq_q]}, got {shape}")
    if lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be float32 on {q.device} (as flash_attention_forward returns it), "
                         f"got {lse.dtype} on {lse.device}")


# yaie: task 2
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention backward: the gradients of ``out = flash_attention_forward(q, k, v)[0]``.

    Recomputes each tile of the probabilities from q, k and the saved ``lse`` instead of storing them.

    Args:
        dout: gradient of the loss with respect to ``out``, q's shape and dtype.
        q, k, v, causal, scale: exactly as given to :func:`flash_attention_forward`.
        out, lse: what :func:`flash_attention_forward` returned for them.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v. Under grouped-query attention ``dk``
        and ``dv`` of a KV head are summed over the query heads that share it.

    Raises:
        ValueError: everything :func:`flash_attention_forward` rejects; ``dout`` or ``out`` not of q's
            shape, dtype and device; ``lse`` not float32 ``[batch, num_heads, seq_q]``.
    """
    check_attention_inputs(q, k, v, causal, scale)
    _check_backward_inputs(dout, q, out, lse)
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    scale = _default_scale(head_dim, scale)
    # delta_i = sum_j P_ij dP_ij = dout_i . out_i: one number per query row, computed once up front.
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    # The kernels work in base 2. A row with no visible key (lse = -inf) gets +inf, so its P is 0.
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse * LOG2E).contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    options = dict(HEAD_DIM=head_dim, CAUSAL=bool(causal), **_kernel_options(q.dtype))
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    dkdv_args = (q, k, v, dout, lse2, delta, dk, dv, *common, *dk.stride()[:3], *dv.stride()[:3],
                 *lse2.stride()[:2], seq_q, seq_k, group, scale * LOG2E, scale, _tune_bucket(seq_k))
    _launch("dkdv", seq_k, num_kv_heads, batch, dkdv_args, block_d, **options)
    dq_args = (q, k, v, dout, lse2, delta, dq, *common, *dq.stride()[:3], *lse2.stride()[:2],
               seq_q, seq_k, group, scale * LOG2E, scale, _tune_bucket(seq_q))
    _launch("dq", seq_q, num_heads, batch, dq_args, block_d, **options)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """``flash_attention`` as an autograd op: the forward saves (q, k, v, out, lse), not the scores."""

    # yaie: task 3
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                scale: float | None = None) -> torch.Tensor:
        """Run :func:`flash_attention_forward`, save what the backward needs on ``ctx``, return ``out``."""
        out, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.scale = scale
        return out

    # yaie: task 3
    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        """Return ``(dq, dk, dv, None, None)`` from :func:`flash_attention_backward` (no gradient for causal, scale)."""
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Differentiable FlashAttention: ``out`` of :func:`flash_attention_forward`, with a backward pass."""
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


# yaie: solution-only
def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, causal, device,
                      read_values=True):
    """Validate the offsets (their values on the host: a copy that waits for the GPU, skipped when
    ``read_values`` is False) and return nothing, or raise ValueError."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1] of cumulative offsets")
        if cu.device != device:
            raise ValueError(f"{name} must be on {device}, got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    # Host values, checked even without read_values: a grid sized by max_seqlen_q < 1 has no program, and
    # the output would be returned unwritten.
    if max_seqlen_q < 1 or max_seqlen_k < 1:
        raise ValueError(f"max_seqlen_q and max_seqlen_k must be >= 1 (q and k hold tokens), got "
                         f"{max_seqlen_q} and {max_seqlen_k}")
    if not read_values:
        return
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if cu[0] != 0 or cu[-1] != total:
            raise ValueError(f"{name} must start at 0 and end at the number of tokens ({total}), got {cu[0]}..{cu[-1]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must be non-decreasing")
    len_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    len_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    if max(len_q) > max_seqlen_q or max(len_k) > max_seqlen_k:
        raise ValueError(f"max_seqlen_q/k ({max_seqlen_q}, {max_seqlen_k}) are below the longest sequence "
                         f"({max(len_q)}, {max(len_k)})")
    for i, (lq, lk) in enumerate(zip(len_q, len_k)):
        if lq > 0 and lk == 0:
            raise ValueError(f"sequence {i} has {lq} queries but no keys")
        if causal and lq > lk:
            raise ValueError(f"causal attention needs seq_q <= seq_k per sequence; sequence {i} has {lq} > {lk}")


# yaie: task 4
def flash_attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                                   scale: float | None = None, sliding_window: int | None = None,
                                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention over a batch of sequences of different lengths, packed token by token.

    This is the engine's batched prefill: the prompts of a batch are concatenated, no padding.

    Args:
        q: ``[total_q, num_heads, head_dim]``; sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k, v: ``[total_k, num_kv_heads, head_dim]``, split by ``cu_seqlens_k`` the same way.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` cumulative offsets, starting at 0 and ending
            at ``total_q`` / ``total_k``, on q's device.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (they size the launch grid).
        causal: as :func:`flash_attention_forward`, per sequence (query ``i`` of a sequence sits at
            position ``len_k - len_q + i``: new tokens after a cached context, if ``len_k > len_q``).
        scale: default ``head_dim ** -0.5``.
        sliding_window: task 5. None: plain causal attention. An int ``w >= 1`` (needs ``causal``): the
            query at position ``p`` sees only keys ``p - w < j <= p`` (Mistral's rule, as Hugging Face
            applies it), and key blocks wholly before a query block's window are not visited. Until you do
            task 5, raise ``NotImplementedError("lesson 06, task 5: sliding window")`` when it is not None.
        validate: also check the offsets' *values* (start, end, order, ``max_seqlen_*``): they are read on
            the host, which waits for the GPU to finish everything queued before. The engine, whose offsets
            come from its scheduler, passes False on CUDA; shapes, dtypes and devices are always checked.

    Returns:
        ``(out, lse)``: ``out`` like q; ``lse`` float32 ``[num_heads, total_q]`` (heads first, like
        flash-attn's varlen API), natural log.

    Raises:
        ValueError: bad q, k, v (as the dense form, 3-D); offsets that are not int32 1-D on q's device;
            ``max_seqlen_q`` or ``max_seqlen_k`` below 1; offsets that (with ``validate``) do not start at
            0, end at the token counts, decrease, exceed ``max_seqlen_*``, or give a sequence queries
            without keys (or more queries than keys under ``causal``); a ``sliding_window`` that is not an
            int >= 1, or one without ``causal``.
    """
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                         sliding_window, validate)
    num_heads, head_dim = q.shape[1], q.shape[2]
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    batch = cu_seqlens_q.numel() - 1
    scale = _default_scale(head_dim, scale)
    out = torch.empty_like(q)
    lse = torch.empty((num_heads, q.shape[0]), device=q.device, dtype=torch.float32)
    args = (*_varlen_forward_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale),
            sliding_window or 0)
    _launch("fwd", int(max_seqlen_q), num_heads, batch, args, _block_d(head_dim), HEAD_DIM=head_dim,
            CAUSAL=bool(causal), VARLEN=True, WINDOWED=sliding_window is not None, **_kernel_options(q.dtype))
    return out, lse
