"""Lesson 06, going further: FlashAttention forward and backward tuned for Hopper GPUs (H100, H200).

This is an advanced variant of the reference in ``flash_attention.py``, not a task: it computes the same
functions with the same online softmax and the same recomputation, and the student's kernels stay the simple
ones. It reuses the reference's input checks and argument packing; what changes is how the tiles reach the
tensor cores and how the backward pass is split:

* **Tensor descriptors (TMA).** Each program describes its (sequence, head) slices as 2-D tensors
  ``[tokens, head_dim]`` with ``tl.make_tensor_descriptor``. A tile load is then one instruction to Hopper's
  tensor memory accelerator, which copies the tile into shared memory by itself and fills rows past the
  sequence's end with zeros; a store is clipped at the end the same way. No address arithmetic, no masks in
  the loads, in the forward (K, V) and in the backward (Q, dO for dK/dV; K, V for dQ).
* **wgmma-sized tiles.** 128 query rows x 64 or 128 keys with 8 warps: two warp groups, each driving
  Hopper's warp-group matrix instruction on 64 rows.
* **Software pipelining.** ``num_stages`` keeps the next tiles in flight while the current one is
  multiplied; with ``warp_specialize`` (forward option) producer warps issue the copies and consumer warps
  do the math.
* **The loop body in the order the tensor cores like** (as Triton's own Hopper tutorial orders it): scores,
  row max, ``exp2(s * c - m)`` with the scale folded into one fused multiply-add, rescale the accumulator,
  ``P V``, and the running sum last, so that fewer float32 tiles are alive at once.
* **Scores one block ahead (option).** ``PREFETCH_S`` issues block j+1's ``q k^T`` before block j's softmax,
  so that the tensor cores and the exponentials could overlap (FlashAttention-3's intra-warp-group trick).
* **A persistent grid (option).** ``PERSISTENT`` launches one program per multiprocessor, each looping over
  query blocks (the longest first under a causal mask), instead of one program per query block.
* **Masks only where needed.** Only the blocks on the causal diagonal or at a ragged end pay for a mask.
* **Backward.** One small kernel computes ``delta = rowsum(dO * O)`` and the base-2 ``lse`` in one pass
  (the reference does it with four PyTorch operations and float32 copies of dO and O). dK/dV then come
  from a kernel that owns a block of keys, as in the reference; dQ either from a second kernel that
  recomputes the scores (7 matrix products per tile pair in all) or, ``dq_mode="atomic"``, from the dK/dV
  kernel itself, which adds each tile's ``dS K`` into a float32 buffer with atomic adds (5 products, as
  FlashAttention-2/3 and cuDNN do, at the cost of that atomic traffic).

Inputs this variant does not take (float32, head dims that are not a power of two from 16 to 128, strides
the copy engine cannot address, a sliding window, a GPU that is not a Hopper) go to the reference kernels,
so every call gets a correct answer.

Measured on an H100 (``bench/results/lesson06_cudnn_h100.md``, the notebook's "going further"): forward
0.68-0.86x of cuDNN at head dim 128 (the reference 0.67-0.77x in the same sweep: +4% to +11%, but -5% at 4k
causal); backward 0.66-0.77x (the reference 0.64-0.71x), the gain being the fused preprocessing alone. The TMA
loads, warp specialisation and the loop order moved nothing measurable; dq by atomics took 1.4-1.6x the time. The
softmax and the matrix products of a warp group run one after the other, which caps both kernels; the engine
keeps the reference.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from solutions.kernels import flash_attention as reference
from yaie.device import is_hopper, tma_addressable, triton_interpreted, use_triton_scratch

LOG2E = reference.LOG2E
FAST_DTYPES = (torch.float16, torch.bfloat16)
FAST_HEAD_DIMS = (16, 32, 64, 128)
DQ_MODES = ("kernel", "atomic")


def fast_path_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "dense",
                     *more: torch.Tensor) -> str | None:
    """Why these (already valid) inputs go to the reference kernels, or None if the fast kernels take them.

    ``more``: further tensors the copy engine must read (the backward's ``dout``)."""
    if q.dtype not in FAST_DTYPES:
        return f"dtype {q.dtype} (the fast kernels take float16 and bfloat16)"
    if q.shape[-1] not in FAST_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (the fast kernels take {', '.join(map(str, FAST_HEAD_DIMS))})"
    if not triton_interpreted() and not is_hopper(q.device):
        return "not a Hopper GPU (compute capability 9)"
    rank = 3 if layout == "dense" else 2
    if not all(tma_addressable(t, rank) for t in (q, k, v, *more)):
        return "strides or base addresses not 16-byte aligned"
    return None


# yaie: solution-only
@triton.jit
def _rows_desc(base, rows, HEAD_DIM: tl.constexpr, stride_row, BLOCK: tl.constexpr):
    """A descriptor of one (sequence, head) slice: ``rows`` x ``HEAD_DIM``, tiles of ``BLOCK`` rows."""
    return tl.make_tensor_descriptor(base, shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[BLOCK, HEAD_DIM])


# ============================================================================================ forward

# yaie: solution-only
@triton.jit
def _softmax_step(acc, l_i, m_i, s, v_desc, start_n, qk_scale_log2):
    """Fold one unmasked block of raw scores ``s`` into the running (acc, l, m): the online softmax step.

    The order is the one that keeps the fewest float32 tiles alive: the row sums are taken before the
    probabilities are rounded to 16 bits for the tensor cores, and ``l`` is updated after ``P V``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])     # scale folded in: one fused multiply-add
    alpha = tl.math.exp2(m_i - m_new)
    row_sum = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + row_sum
    return acc, l_i, m_new


# yaie: solution-only
@triton.jit
def _masked_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, k_len, causal_shift, qk_scale_log2,
                 CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax step of a block on the causal diagonal or at the ragged end (masked keys)."""
    s = tl.dot(q, k_desc.load([start_n, 0]).T)           # rows past the end of k read as zeros
    cols = start_n + tl.arange(0, BLOCK_N)
    keep = cols[None, :] < k_len
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
    s = tl.where(keep, s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only masked keys keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    row_sum = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + row_sum
    return acc, l_i, m_new


# yaie: solution-only
@triton.jit
def _full_blocks(acc, l_i, m_i, q, k_desc, v_desc, full_end, qk_scale_log2,
                 BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PREFETCH_S: tl.constexpr):
    """The unmasked key blocks [0, full_end): no mask code at all.

    PREFETCH_S: the next block's ``q k^T`` is issued before this block's softmax (FlashAttention-3's
    intra-warp-group overlap written at the source level: the tensor cores can work on block j+1's scores
    while the same warps compute block j's exponentials, if the compiler leaves the matrix instruction in
    flight until ``s`` is used in the next iteration). Costs one more score tile of registers.
    """
    if PREFETCH_S:
        if full_end > 0:
            s = tl.dot(q, k_desc.load([0, 0]).T)
            for start_n in tl.range(BLOCK_N, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                s_next = tl.dot(q, k_desc.load([start_n, 0]).T)
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v_desc, start_n - BLOCK_N, qk_scale_log2)
                s = s_next
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v_desc, full_end - BLOCK_N, qk_scale_log2)
    else:
        for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            s = tl.dot(q, k_desc.load([start_n, 0]).T)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v_desc, start_n, qk_scale_log2)
    return acc, l_i, m_i


# yaie: solution-only
@triton.jit
def _attend_block(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, group_size, qk_scale_log2, pid_m, head, batch,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PREFETCH_S: tl.constexpr,
):
    """Attention of query block ``pid_m`` of one (sequence, head): out and lse of its BLOCK_M rows."""
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
    if start_m < q_len:          # varlen: this sequence may be shorter than the longest one
        kv_head = (head // group_size).to(tl.int64)
        head64 = head.to(tl.int64)
        batch64 = batch.to(tl.int64)
        q_row0 = q_start.to(tl.int64)
        k_row0 = k_start.to(tl.int64)
        q_desc = _rows_desc(Q + batch64 * stride_qb + head64 * stride_qh + q_row0 * stride_qs, q_len, HEAD_DIM,
                            stride_qs, BLOCK_M)
        k_desc = _rows_desc(K + batch64 * stride_kb + kv_head * stride_kh + k_row0 * stride_ks, k_len, HEAD_DIM,
                            stride_ks, BLOCK_N)
        v_desc = _rows_desc(V + batch64 * stride_vb + kv_head * stride_vh + k_row0 * stride_vs, k_len, HEAD_DIM,
                            stride_vs, BLOCK_N)
        o_desc = _rows_desc(O + batch64 * stride_ob + head64 * stride_oh + q_row0 * stride_os, q_len, HEAD_DIM,
                            stride_os, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([start_m, 0])
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Query row i sits at key position i + causal_shift. Blocks before full_end are seen whole by every
        # row of this block: no mask. The rest (causal diagonal, ragged last block) are masked.
        causal_shift = k_len - q_len
        full_end = (k_len // BLOCK_N) * BLOCK_N
        if CAUSAL:
            full_end = tl.minimum(full_end, (tl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N) * BLOCK_N)
            end = tl.minimum(k_len, start_m + BLOCK_M + causal_shift)
        else:
            end = k_len
        acc, l_i, m_i = _full_blocks(acc, l_i, m_i, q, k_desc, v_desc, full_end, qk_scale_log2,
                                     BLOCK_N, WARP_SPECIALIZE, PREFETCH_S)
        for start_n in range(full_end, end, BLOCK_N):
            acc, l_i, m_i = _masked_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, k_len, causal_shift,
                                         qk_scale_log2, CAUSAL, BLOCK_N)

        # Normalise once; a row with no visible key (l == 0) outputs zeros and lse = -inf.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o_desc.store([start_m, 0], (acc / l_safe[:, None]).to(O.dtype.element_ty))   # rows past q_len: clipped
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        l_ptrs = LSE + batch64 * stride_lb + head64 * stride_lh + (q_start + offs_m).to(tl.int64) * stride_ls
        tl.store(l_ptrs, lse, mask=offs_m < q_len)


# yaie: solution-only
@triton.jit
def _hopper_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, group_size, qk_scale_log2, tune_len, num_heads, num_seqs,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PREFETCH_S: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """The forward. Grid: (query blocks, heads, batch), one query block per program; or, PERSISTENT, a
    few programs (one per multiprocessor) that each take every num_programs-th query block in turn.

    The arguments are the reference forward kernel's (``reference._dense_forward_args``) less the window,
    then the number of heads and of sequences (which the persistent loop needs to number the blocks)."""
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    if PERSISTENT:
        per_row_block = num_heads * num_seqs
        for tile in range(tl.program_id(0), num_m * per_row_block, tl.num_programs(0)):
            pid_m = tile // per_row_block
            if CAUSAL:
                pid_m = num_m - 1 - pid_m       # the longest blocks first (fewer stragglers)
            rest = tile % per_row_block
            _attend_block(Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
                          stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                          stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                          stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, group_size, qk_scale_log2,
                          pid_m, rest % num_heads, rest // num_heads,
                          HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, VARLEN, WARP_SPECIALIZE, PREFETCH_S)
    else:
        pid_m = tl.program_id(0)
        if CAUSAL:
            pid_m = tl.num_programs(0) - 1 - pid_m      # the longest programs first (fewer stragglers)
        _attend_block(Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
                      stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                      stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                      stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, group_size, qk_scale_log2,
                      pid_m, tl.program_id(1), tl.program_id(2),
                      HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, VARLEN, WARP_SPECIALIZE, PREFETCH_S)


# ============================================================================================ backward

# yaie: solution-only
@triton.jit
def _bwd_preprocess_kernel(O, DO, LSE, DELTA, LSE2,
                           stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
                           stride_lb, stride_lh, stride_ls, seqlen,
                           HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf where lse = -inf), one pass, float32.

    Grid: (row blocks, heads, batch). DELTA and LSE2 are contiguous [batch, heads, seq]."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    row_ok = rows < seqlen
    cols = tl.arange(0, HEAD_DIM)
    o = tl.load(O + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + cols[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dos + cols[None, :],
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + batch * stride_lb + head * stride_lh + rows * stride_ls, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    out_offs = (batch * tl.num_programs(1) + head) * seqlen + rows
    tl.store(DELTA + out_offs, delta, mask=row_ok)
    tl.store(LSE2 + out_offs, lse2, mask=row_ok)


# yaie: solution-only
@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_desc, do_desc, lse2_base, delta_base, dq_base, m_lo, m_hi, offs_n,
                 seqlen_q, seqlen_k, causal_shift, qk_scale_log2, scale,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                 BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Fold the query blocks [m_lo, m_hi) of one head into (dk, dv) of one key block (all transposed tiles).

    Query rows past the end read zeros from the copy engine and lse2 = +inf, so their P is exactly 0.
    DQ_ATOMIC: also add this tile's ``scale * dS K`` into the float32 dq buffer (many programs add to the
    same rows, so the adds are atomic; "relaxed" because only the sum matters, not the order).
    """
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(m_lo, m_hi, BLOCK_M):
        rows = start_m + offs_m0
        row_ok = rows < seqlen_q
        q = q_desc.load([start_m, 0])
        do = do_desc.load([start_m, 0])
        lse2 = tl.load(lse2_base + rows, mask=row_ok, other=float("inf"))
        # Recompute P^T from the saved log-sum-exp: [BLOCK_N keys, BLOCK_M queries].
        p_t = tl.math.exp2(tl.dot(k, q.T) * qk_scale_log2 - lse2[None, :])
        if MASK:
            keep = offs_n[:, None] < seqlen_k
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :] + causal_shift)
            p_t = tl.where(keep, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, do.T)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if DQ_ATOMIC:
            dq_part = tl.dot(ds_t.T, k) * scale                     # [BLOCK_M, HEAD_DIM]
            cols = tl.arange(0, HEAD_DIM)
            tl.atomic_add(dq_base + rows[:, None] * HEAD_DIM + cols[None, :], dq_part,
                          mask=row_ok[:, None], sem="relaxed")
    return dk, dv


# yaie: solution-only
@triton.jit
def _hopper_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ_ACC,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    seqlen_q, seqlen_k, num_heads, group_size, qk_scale_log2, scale, tune_len,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):
    """One program: dk and dv of BLOCK_N keys of one KV head, summed over the query heads of its group.

    Grid: (key blocks, kv heads, batch). LSE2, DELTA: contiguous [batch, heads, seq_q]; DQ_ACC (DQ_ATOMIC):
    contiguous float32 [batch, heads, seq_q, HEAD_DIM], zeroed."""
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    batch64 = batch.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_desc = _rows_desc(K + batch64 * stride_kb + kv64 * stride_kh, seqlen_k, HEAD_DIM, stride_ks, BLOCK_N)
    v_desc = _rows_desc(V + batch64 * stride_vb + kv64 * stride_vh, seqlen_k, HEAD_DIM, stride_vs, BLOCK_N)
    k = k_desc.load([start_n, 0])                   # this program's keys and values stay loaded throughout
    v = v_desc.load([start_n, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Rows before `lo` see none of these keys; rows from `mid` on see all of them (no mask); the band in
    # between is the causal diagonal. The ragged last key block masks every tile (its missing keys).
    causal_shift = seqlen_k - seqlen_q
    q_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (tl.maximum(start_n - causal_shift, 0) // BLOCK_M) * BLOCK_M
        all_row = tl.maximum(start_n + BLOCK_N - 1 - causal_shift, 0)
        mid = tl.minimum(tl.maximum(tl.cdiv(all_row, BLOCK_M) * BLOCK_M, lo), q_end)
    else:
        lo = 0
        mid = 0
    mid = tl.where(start_n + BLOCK_N > seqlen_k, q_end, mid)

    for g in range(0, group_size):
        head = (kv_head * group_size + g).to(tl.int64)
        q_desc = _rows_desc(Q + batch64 * stride_qb + head * stride_qh, seqlen_q, HEAD_DIM, stride_qs, BLOCK_M)
        do_desc = _rows_desc(DO + batch64 * stride_dob + head * stride_doh, seqlen_q, HEAD_DIM, stride_dos, BLOCK_M)
        row0 = (batch64 * num_heads + head) * seqlen_q           # this head's first row in LSE2 / DELTA
        dq_base = DQ_ACC + row0 * HEAD_DIM
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_desc, do_desc, LSE2 + row0, DELTA + row0, dq_base, lo, mid, offs_n,
                              seqlen_q, seqlen_k, causal_shift, qk_scale_log2, scale,
                              True, CAUSAL, DQ_ATOMIC, BLOCK_M, HEAD_DIM)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_desc, do_desc, LSE2 + row0, DELTA + row0, dq_base, mid, q_end, offs_n,
                              seqlen_q, seqlen_k, causal_shift, qk_scale_log2, scale,
                              False, CAUSAL, DQ_ATOMIC, BLOCK_M, HEAD_DIM)

    dk_desc = _rows_desc(DK + batch64 * stride_dkb + kv64 * stride_dkh, seqlen_k, HEAD_DIM, stride_dks, BLOCK_N)
    dv_desc = _rows_desc(DV + batch64 * stride_dvb + kv64 * stride_dvh, seqlen_k, HEAD_DIM, stride_dvs, BLOCK_N)
    dk_desc.store([start_n, 0], (dk * scale).to(DK.dtype.element_ty))    # s = scale * q.k: dk = scale * dS^T q
    dv_desc.store([start_n, 0], dv.to(DV.dtype.element_ty))


# yaie: solution-only
@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_desc, v_desc, n_lo, n_hi, offs_m, seqlen_k, causal_shift, qk_scale_log2,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold the key blocks [n_lo, n_hi) into dq of one block of query rows."""
    for start_n in range(n_lo, n_hi, BLOCK_N):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        p = tl.math.exp2(tl.dot(q, k.T) * qk_scale_log2 - lse2[:, None])
        if MASK:
            cols = start_n + tl.arange(0, BLOCK_N)
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, v.T)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq)
    return dq


# yaie: solution-only
@triton.jit
def _hopper_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    seqlen_q, seqlen_k, num_heads, group_size, qk_scale_log2, scale, tune_len,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One program: dq of BLOCK_M query rows of one head. Grid: (query blocks, heads, batch)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m          # the last query blocks have the most keys: first
    start_m = pid_m * BLOCK_M
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    kv64 = (head // group_size).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen_q
    q = _rows_desc(Q + batch64 * stride_qb + head64 * stride_qh, seqlen_q, HEAD_DIM, stride_qs,
                   BLOCK_M).load([start_m, 0])
    do = _rows_desc(DO + batch64 * stride_dob + head64 * stride_doh, seqlen_q, HEAD_DIM, stride_dos,
                    BLOCK_M).load([start_m, 0])
    row0 = (batch64 * num_heads + head64) * seqlen_q
    lse2 = tl.load(LSE2 + row0 + offs_m, mask=row_ok, other=float("inf"))     # past the end: P = 0
    delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)
    k_desc = _rows_desc(K + batch64 * stride_kb + kv64 * stride_kh, seqlen_k, HEAD_DIM, stride_ks, BLOCK_N)
    v_desc = _rows_desc(V + batch64 * stride_vb + kv64 * stride_vh, seqlen_k, HEAD_DIM, stride_vs, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    causal_shift = seqlen_k - seqlen_q
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        full_end = tl.minimum(full_end, (tl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N) * BLOCK_N)
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_shift)
    else:
        end = seqlen_k
    dq = _dq_blocks(dq, q, do, lse2, delta, k_desc, v_desc, 0, full_end, offs_m, seqlen_k, causal_shift,
                    qk_scale_log2, False, CAUSAL, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_desc, v_desc, full_end, end, offs_m, seqlen_k, causal_shift,
                    qk_scale_log2, True, CAUSAL, BLOCK_N)
    dq_desc = _rows_desc(DQ + batch64 * stride_dqb + head64 * stride_dqh, seqlen_q, HEAD_DIM, stride_dqs, BLOCK_M)
    dq_desc.store([start_m, 0], (dq * scale).to(DQ.dtype.element_ty))


# ============================================================================================ configurations

def parse_config(text: str) -> tuple[int, int, int, int, bool, bool, bool]:
    """A forward configuration: "128,64,8,3,1" -> (128, 64, 8, 3, True, False, False); switches default off."""
    fields = [int(x) for x in text.split(",")]
    if len(fields) < 4 or len(fields) > 7:
        raise ValueError(f"a forward configuration is BLOCK_M,BLOCK_N,num_warps,num_stages[,warp_specialize"
                         f"[,prefetch_s[,persistent]]], got {text!r}")
    return _padded(tuple(fields))


def parse_backward_config(text: str) -> tuple[str, int, int, int, int]:
    """A backward configuration: "atomic,64,128,8,2" -> ("atomic", 64, 128, 8, 2).

    dq mode, then the dK/dV kernel's BLOCK_M (queries per step), BLOCK_N (keys per program), num_warps and
    num_stages; the dQ kernel (mode "kernel") mirrors the blocks: BLOCK_N queries per program, BLOCK_M keys
    per step."""
    fields = [x.strip() for x in text.split(",")]
    if len(fields) != 5 or fields[0] not in DQ_MODES or not all(x.isdigit() for x in fields[1:]):
        raise ValueError(f"a backward configuration is MODE,BLOCK_M,BLOCK_N,num_warps,num_stages with MODE in "
                         f"{DQ_MODES}, got {text!r}")
    return (fields[0], *(int(x) for x in fields[1:]))


# yaie: solution-only
def _padded(config: tuple) -> tuple:
    """A forward configuration with its missing switches (warp_specialize, prefetch_s, persistent) off."""
    return (*(int(x) for x in config[:4]), *(bool(x) for x in config[4:]), *(False,) * (7 - len(config)))


def _configs() -> list[tuple]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages[, warp_specialize, prefetch_s, persistent]) the forward
    autotuner tries (the persistent switch is ignored there: the grid depends on it).

    128 query rows over 8 warps (two warp groups of 64 rows for wgmma); keys 64 or 128 at a time; two or
    three tiles in flight (``python -m yaie.bench.lesson06 sweep`` times more, the options included).
    ``YAIE_FA_HOPPER_CONFIGS`` ("128,128,8,3;128,64,8,3,0,1") replaces the list.
    """
    text = os.environ.get("YAIE_FA_HOPPER_CONFIGS")
    if text:
        return [parse_config(part) for part in text.split(";") if part.strip()]
    return [(128, 128, 8, 3), (128, 64, 8, 3)]


def _backward_configs() -> list[tuple[str, int, int, int, int]]:
    """The backward configurations: the autotuner tries their blocks; their dq mode counts only where one
    is passed explicitly (the sweep), the autotuned path takes the caller's ``dq_mode`` (a mode cannot be
    timed per kernel: "atomic" makes the dK/dV kernel slower and the dQ kernel unnecessary).
    ``YAIE_FA_HOPPER_BWD_CONFIGS`` ("kernel,64,128,8,3;atomic,64,128,8,3") replaces the list."""
    text = os.environ.get("YAIE_FA_HOPPER_BWD_CONFIGS")
    if text:
        return [parse_backward_config(part) for part in text.split(";") if part.strip()]
    return [("kernel", 64, 128, 8, 2), ("kernel", 64, 128, 8, 3)]


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _tuned(kind: str):
    """The autotuned form of one kernel (GPU only)."""
    if kind == "fwd":
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "WARP_SPECIALIZE": ws, "PREFETCH_S": pf,
                                  "PERSISTENT": False}, num_warps=w, num_stages=s)
                   for m, n, w, s, ws, pf, _ in map(_padded, _configs())]
        return triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "VARLEN", "tune_len"])(_hopper_fwd_kernel)
    blocks = sorted({c[1:] for c in _backward_configs()})
    if kind == "dkdv":
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in blocks]
        return triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "DQ_ATOMIC", "tune_len",
                                                     "group_size"],
                               reset_to_zero=["DQ_ACC"])(_hopper_dkdv_kernel)
    configs = [triton.Config({"BLOCK_M": n, "BLOCK_N": m}, num_warps=w, num_stages=s) for m, n, w, s in blocks]
    return triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "tune_len"])(_hopper_dq_kernel)


def tuned_configs() -> str:
    """The autotuners' last choices (for the benchmark's log)."""
    if triton_interpreted():
        return ""
    parts = []
    for kind in ("fwd", "dkdv", "dq"):
        best = getattr(_tuned(kind), "best_config", None)
        if best is not None:
            parts.append(f"{kind}: {best}")
    return "; ".join(parts)


# yaie: solution-only
def _use_fixed_blocks(length: int, config: tuple | None) -> bool:
    """True: launch with fixed blocks (the interpreter, a given configuration, short sequences, or
    ``YAIE_FA_AUTOTUNE=0``); False: the autotuner."""
    return (triton_interpreted() or config is not None or length <= 1024
            or os.environ.get("YAIE_FA_AUTOTUNE", "1") == "0")


# ============================================================================================ forward, host side

def _new_output(q: torch.Tensor) -> torch.Tensor:
    """An output buffer shaped like q, contiguous (the descriptor store needs 16-byte aligned rows)."""
    return torch.empty(q.shape, device=q.device, dtype=q.dtype)


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# yaie: solution-only
def _launch_forward(args: tuple, grid_rows: int, heads: int, batch: int, config: tuple | None = None,
                    **constexprs) -> None:
    """Fixed small blocks in the interpreter (``config``'s switches apply); on a GPU ``config`` if given, the
    first configuration for short sequences, else the autotuner."""
    args = (*args, heads, batch)
    if triton_interpreted():
        _, _, _, _, _, prefetch, persistent = _padded(config or (0, 0, 0, 0))
        blocks = ((grid_rows + 31) // 32) * heads * batch
        grid = (min(3, blocks), 1, 1) if persistent else ((grid_rows + 31) // 32, heads, batch)
        _hopper_fwd_kernel[grid](*args, BLOCK_M=32, BLOCK_N=32, WARP_SPECIALIZE=False, PREFETCH_S=prefetch,
                                 PERSISTENT=persistent, **constexprs)
        return
    use_triton_scratch()        # the in-kernel descriptors' scratch, set at every launch (see the function)
    if _use_fixed_blocks(grid_rows, config):
        block_m, block_n, warps, stages, ws, prefetch, persistent = _padded(config or _configs()[0])
        grid = ((grid_rows + block_m - 1) // block_m, heads, batch)
        if persistent:
            # One program per multiprocessor (two where two fit: 4 warps), each looping over query blocks.
            per_sm = 2 if warps <= 4 else 1
            grid = (min(grid[0] * heads * batch, per_sm * _multiprocessors(torch.cuda.current_device())), 1, 1)
        _hopper_fwd_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=ws, PREFETCH_S=prefetch,
                                 PERSISTENT=persistent, num_warps=warps, num_stages=stages, **constexprs)
        return

    def grid(meta):
        return ((grid_rows + meta["BLOCK_M"] - 1) // meta["BLOCK_M"], heads, batch)
    _tuned("fwd")[grid](*args, **constexprs)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`solutions.kernels.flash_attention.flash_attention_forward`; the fast kernel
    where :func:`fast_path_reason` allows it, the reference elsewhere."""
    return forward_with_config(q, k, v, causal, scale, None)


def forward_with_config(q, k, v, causal: bool, scale: float | None, config: tuple | None):
    """:func:`flash_attention_forward` with the GPU blocks fixed to ``config`` (None: the usual choice);
    the benchmark's sweep times each configuration through it."""
    reference.check_attention_inputs(q, k, v, causal, scale)
    if fast_path_reason(q, k, v) is not None:
        return reference.flash_attention_forward(q, k, v, causal=causal, scale=scale)
    batch, num_heads, seq_q, head_dim = q.shape
    scale = reference._default_scale(head_dim, scale)
    out = _new_output(q)
    lse = torch.empty((batch, num_heads, seq_q), device=q.device, dtype=torch.float32)
    args = reference._dense_forward_args(q, k, v, out, lse, scale)
    _launch_forward(args, seq_q, num_heads, batch, config, HEAD_DIM=head_dim, CAUSAL=bool(causal), VARLEN=False)
    return out, lse


def flash_attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                                   scale: float | None = None, sliding_window: int | None = None,
                                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`solutions.kernels.flash_attention.flash_attention_varlen_forward` (the
    engine's prefill); a sliding window goes to the reference."""
    reference._check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                   sliding_window, validate)
    if sliding_window is not None or fast_path_reason(q, k, v, "varlen") is not None:
        return reference.flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                        max_seqlen_k, causal=causal, scale=scale,
                                                        sliding_window=sliding_window, validate=validate)
    num_heads, head_dim = q.shape[1], q.shape[2]
    scale = reference._default_scale(head_dim, scale)
    out = _new_output(q)
    lse = torch.empty((num_heads, q.shape[0]), device=q.device, dtype=torch.float32)
    args = reference._varlen_forward_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, scale)
    _launch_forward(args, int(max_seqlen_q), num_heads, cu_seqlens_q.numel() - 1, HEAD_DIM=head_dim,
                    CAUSAL=bool(causal), VARLEN=True)
    return out, lse


# ============================================================================================ backward, host side

def default_dq_mode() -> str:
    """The dq mode used when none is given: ``YAIE_FA_HOPPER_DQ`` ("kernel" or "atomic"), else "kernel"."""
    mode = os.environ.get("YAIE_FA_HOPPER_DQ", "kernel")
    if mode not in DQ_MODES:
        raise ValueError(f"YAIE_FA_HOPPER_DQ must be one of {DQ_MODES}, got {mode!r}")
    return mode


# yaie: solution-only
def _launch_backward(kind: str, args: tuple, grid_rows: int, heads: int, batch: int, config: tuple | None,
                     **constexprs) -> None:
    """Launch the dK/dV (``kind="dkdv"``, one program per BLOCK_N keys) or dQ kernel (one per query block)."""
    kernel = _hopper_dkdv_kernel if kind == "dkdv" else _hopper_dq_kernel
    if triton_interpreted():
        grid = ((grid_rows + 31) // 32, heads, batch)
        kernel[grid](*args, BLOCK_M=32, BLOCK_N=32, **constexprs)
        return
    use_triton_scratch()        # the in-kernel descriptors' scratch, set at every launch (see the function)
    if _use_fixed_blocks(grid_rows, config):
        _, block_m, block_n, warps, stages = config or _backward_configs()[0]
        if kind == "dq":
            block_m, block_n = block_n, block_m      # the mirror image: many query rows, a few keys per step
        tile = block_n if kind == "dkdv" else block_m
        grid = ((grid_rows + tile - 1) // tile, heads, batch)
        kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **constexprs)
        return
    tile = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"

    def grid(meta):
        return ((grid_rows + meta[tile] - 1) // meta[tile], heads, batch)
    _tuned(kind)[grid](*args, **constexprs)


def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             scale: float | None = None,
                             dq_mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`solutions.kernels.flash_attention.flash_attention_backward`; ``dq_mode``
    ("kernel" or "atomic", default :func:`default_dq_mode`) picks how dq is computed (module docstring)."""
    return backward_with_config(dout, q, k, v, out, lse, causal, scale, dq_mode, None)


def backward_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, lse2)``, float32 ``[batch, heads, seq]``: ``delta = rowsum(dout * out)`` and the base-2 lse
    (+inf where lse is -inf), from one kernel that reads out and dout once."""
    batch, num_heads, seq_q, head_dim = out.shape
    delta = torch.empty((batch, num_heads, seq_q), device=out.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    block = 32 if triton_interpreted() else 128
    _bwd_preprocess_kernel[((seq_q + block - 1) // block, num_heads, batch)](
        out, dout, lse, delta, lse2, *out.stride()[:3], *dout.stride()[:3], *lse.stride(), seq_q,
        HEAD_DIM=head_dim, BLOCK=block)
    return delta, lse2


def backward_with_config(dout, q, k, v, out, lse, causal: bool, scale: float | None, dq_mode: str | None,
                         config: tuple | None):
    """:func:`flash_attention_backward` with the GPU blocks fixed to ``config`` (a
    :func:`parse_backward_config` tuple, whose mode wins over ``dq_mode``; None: the usual choice)."""
    reference.check_attention_inputs(q, k, v, causal, scale)
    reference._check_backward_inputs(dout, q, out, lse)
    mode = config[0] if config is not None else (dq_mode or default_dq_mode())
    if mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {mode!r}")
    if fast_path_reason(q, k, v, "dense", dout) is not None:
        return reference.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    scale = reference._default_scale(head_dim, scale)
    delta, lse2 = backward_preprocess(out, dout, lse)

    atomic = mode == "atomic"
    dq = _new_output(q)
    dk, dv = _new_output(k), _new_output(v)
    # The float32 buffer the atomic adds go to (a one-element stand-in when dq has its own kernel).
    dq_acc = torch.zeros(q.shape if atomic else (1,), device=q.device, dtype=torch.float32)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    lengths = (seq_q, seq_k, num_heads, num_heads // num_kv_heads, scale * LOG2E, scale)
    _launch_backward("dkdv", (q, k, v, dout, lse2, delta, dk, dv, dq_acc, *common, *dk.stride()[:3],
                              *dv.stride()[:3], *lengths, reference._tune_bucket(seq_k)),
                     seq_k, num_kv_heads, batch, config, HEAD_DIM=head_dim, CAUSAL=bool(causal), DQ_ATOMIC=atomic)
    if atomic:
        dq.copy_(dq_acc)
    else:
        _launch_backward("dq", (q, k, v, dout, lse2, delta, dq, *common, *dq.stride()[:3], *lengths,
                                reference._tune_bucket(seq_q)),
                         seq_q, num_heads, batch, config, HEAD_DIM=head_dim, CAUSAL=bool(causal))
    return dq, dk, dv


class FlashAttentionHopperFunction(torch.autograd.Function):
    """Autograd op: this module's forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, dq_mode=None):
        out, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.scale = scale
        ctx.dq_mode = dq_mode
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale,
                                              dq_mode=ctx.dq_mode)
        return dq, dk, dv, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, dq_mode: str | None = None) -> torch.Tensor:
    """Differentiable attention: the Hopper forward and backward (``dq_mode`` as in the backward)."""
    return FlashAttentionHopperFunction.apply(q, k, v, causal, scale, dq_mode)
