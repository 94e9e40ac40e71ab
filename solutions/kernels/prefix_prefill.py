"""Lesson 05, part 1: the prefix-prefill kernel (new tokens attending to a cached, paged prefix).

With prefix caching (the radix tree of this lesson) a request often arrives with most of its prompt
already in the paged KV cache of lesson 03: a system prompt, the earlier turns of a chat. Only the NEW
tokens need a prefill. Each new query token must attend to

(a) the sequence's cached prefix (``context_len`` tokens), read through its block table: every new token
    comes after all of them, so no mask is needed there;
(b) the new tokens themselves (their keys and values are passed in, packed), under a causal mask.

One program handles ``BLOCK_M`` new query rows of one head of one sequence and folds both parts into ONE
online softmax (lesson 06): running max ``m``, running sum ``l``, running ``acc``. So the prefix is never
gathered into a contiguous copy, and the output is exact attention over ``context + new`` tokens::

    new tokens of sequence b:  q, k, v rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    query i of sequence b sits at absolute position  p = context_lens[b] + i
    it sees:   cached keys 0 .. context_lens[b] - 1   (through block_tables[b])
               new keys    0 .. i                      (p's own key included)

Features (those of a production prefix-prefill kernel):

* grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
* any head size up to 256 (80, 96, ...): padded to a power of two inside, the padding reads 0;
* a sliding window ``w``: position ``p`` sees keys ``p - w < j <= p`` only; tiles wholly before a query
  block's window are not even read. Masked scores get a LARGE NEGATIVE NUMBER, not ``-inf``: a row whose
  first tiles are all masked then keeps a finite running max, ``exp2(m - m_new)`` never becomes
  ``exp2(-inf + inf) = NaN``, and the junk such a row summed is multiplied by ``exp2(-1e30 - real) = 0``
  as soon as it meets its first visible key (every row sees at least its own key);
* attention sinks (gpt-oss): a learned logit per head that joins every row's softmax denominator
  without contributing a value. The kernel starts each row with ``m = sink, l = 1`` (the sink seeds
  the running max) instead of ``m = -big, l = 0``;
* an fp8 (e4m3) K/V cache with per-tensor scales (``real = stored * scale``): ``k_scale`` is folded into
  the score scale, ``v_scale`` into the probabilities, so no dequantized copy of a tile is made;
* ``skip_decode``: sequences with exactly one new token are left to the decode kernel (lesson 04);
* a K-cache layout whose innermost vector is 16 bytes (see :func:`to_vector_k_layout`).

The output is exact, so it also returns the log-sum-exp of every row: lesson 05 part 2 merges attention
states computed over different key sets (cascade attention) with it.

Tasks: 3 the naive reference (gather the prefix, attention with masks), 4 the Triton kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/prefix_prefill_given.py
from yaie.kernels.prefix_prefill_given import (
    FP8_DTYPES, LN2, LOG2E, MASKED, MAX_HEAD_DIM, SUPPORTED_DTYPES, VECTOR_BYTES, check_prefix_prefill_inputs,
    check_prefix_prefill_values, from_vector_k_layout, to_vector_k_layout, vector_width,
)


# yaie: task 3
def prefix_prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             context_lens: torch.Tensor, *, scale: float | None = None,
                             sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                             k_scale: float | None = None,
                             v_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive prefix prefill: gather each sequence's cached prefix, append its new keys, masked attention.

    Same arguments and meaning as :func:`prefix_prefill_attention` (without ``max_query_len`` and the
    launch options), one sequence at a time:

    1. gather the prefix: cached token ``t`` is row ``t % block_size`` of block
       ``block_tables[b, t // block_size]``, for ``t < context_lens[b]`` (a 5-D ``k_cache`` is in the
       vector layout: :func:`from_vector_k_layout` undoes it); an fp8 cache is converted to q's dtype and
       multiplied by ``k_scale`` / ``v_scale`` (default 1);
    2. keys = prefix + the sequence's new ``k`` rows (values alike); query ``i`` sits at position
       ``context_len + i`` and sees key ``j`` when ``j <= context_len + i`` (and, with a window ``w``,
       ``j > context_len + i - w``);
    3. scores ``scale * q . k`` (query head ``h`` reads KV head ``h // group``), softmax over the visible
       keys plus, with ``sinks``, one extra logit ``sinks[h]`` per head (it takes probability mass but
       has no value), then ``p @ v``.

    Computes in q's dtype: call it on float64 copies to get a reference. ``skip_decode`` does not exist
    here: every sequence is computed.

    Returns:
        ``(out, lse)``: ``out`` ``[total_new, num_heads, head_dim]`` in q's dtype; ``lse``
        ``[num_heads, total_new]`` (float32, float64 for float64 inputs): ``log`` of each row's softmax
        denominator, the sink included.

    Raises:
        ValueError: as :func:`check_prefix_prefill_inputs` and :func:`check_prefix_prefill_values`.
    """
    check_prefix_prefill_inputs(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, None,
                                scale, sliding_window, sinks, k_scale, v_scale, for_kernel=False)
    check_prefix_prefill_values(block_tables, cu_seqlens_q, context_lens, q.shape[0], None,
                                v_cache.shape[0], v_cache.shape[1], sliding_window)
    total, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    block_size = v_cache.shape[1]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    token_major_k = from_vector_k_layout(k_cache) if k_cache.dim() == 5 else k_cache
    out = torch.zeros_like(q)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.zeros((num_heads, total), dtype=lse_dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        first, last = cu[b], cu[b + 1]
        new, ctx = last - first, int(context_lens[b])
        if new == 0:
            continue
        # The cached keys any new token sees: all of them, or from the first new token's window on
        # (the rows before it may hold anything: an engine can give those blocks away).
        seen_from = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
        positions = torch.arange(seen_from, ctx, device=q.device)
        blocks = block_tables[b, positions // block_size].long()
        rows = positions % block_size
        prefix_k = token_major_k[blocks, rows].to(q.dtype) * (1.0 if k_scale is None else k_scale)
        prefix_v = v_cache[blocks, rows].to(q.dtype) * (1.0 if v_scale is None else v_scale)
        keys = torch.cat([prefix_k, k[first:last]]).repeat_interleave(group, dim=1)   # [keys, heads, d]
        values = torch.cat([prefix_v, v[first:last]]).repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q[first:last], keys) * scale             # [heads, new, keys]
        query_pos = ctx + torch.arange(new, device=q.device)[:, None]
        key_pos = torch.arange(seen_from, ctx + new, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:   # one more "key" per head: its logit is the sink, its value zero
            sink = sinks.to(scores.dtype)[:, None, None].expand(num_heads, new, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :keys.shape[0]]
        out[first:last] = torch.einsum("hij,jhd->ihd", probs, values)
        lse[:, first:last] = torch.logsumexp(scores, dim=-1).to(lse_dtype)
    return out, lse


# yaie: solution-only
@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b in float32 (FP32_DOT: upcast first; the interpreter's bf16 tl.dot is broken)."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


# yaie: solution-only
@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, v, p_scale, SCALE_P: tl.constexpr, FP32_DOT: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` [BLOCK_M, BLOCK_N] (base-2 units, masked ones = MASKED) and its
    values ``v`` [BLOCK_N, BLOCK_D] into the running (acc, l, m). With SCALE_P, ``p_scale`` (an fp8
    cache's ``v_scale``) multiplies the probabilities before ``p @ v``, not the sum ``l``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)      # finite - finite: never NaN (masked scores are -1e30, not -inf)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALE_P:
        p = p * p_scale
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], FP32_DOT, PRECISION)
    return acc, l_i, m_new


# yaie: solution-only
@triton.jit
def _prefix_tiles(acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, lo, hi, context_len, first_pos,
                  window, score_scale, v_scale,
                  stride_kb, stride_kh, stride_kt, stride_kx, stride_vb, stride_vt, stride_vh,
                  offs_m, offs_d, MASK: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, K_VEC: tl.constexpr,
                  COMPUTE_DTYPE: tl.constexpr, FP8: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Part (a): cached keys [lo, hi) of one sequence, read through its block table, into (acc, l, m).

    No causal mask is needed (every new token comes after the whole prefix): MASK=False is the fast path
    for tiles wholly inside the prefix that every row sees whole; MASK=True handles the prefix's ragged
    last tile and the tiles a sliding window's lower edge crosses. Cached key ``t`` is row
    ``t % BLOCK_SIZE`` of block ``table[t // BLOCK_SIZE]``; the block ids of the NEXT tile are loaded one
    iteration ahead, so a tile's K/V addresses never wait on a load of the same iteration and the
    software pipeliner can keep several tiles in flight (lesson 04's finding).

    K element (token t, dim d) lives at ``block * stride_kb + kv_head * stride_kh + (t % BLOCK_SIZE) *
    stride_kt + (d // K_VEC) * stride_kx + d % K_VEC``: with the token-major layout K_VEC = BLOCK_D and
    stride_kx is unused; with the vector layout K_VEC is 16 bytes' worth of elements.
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    if K_VEC == BLOCK_D:   # token-major K: the head dims are simply contiguous
        k_dim_offset = offs_d
    else:                  # vector layout: chunk c // K_VEC, element c % K_VEC of the token's 16 bytes
        k_dim_offset = (offs_d // K_VEC) * stride_kx + offs_d % K_VEC
    cols = lo + offs_n
    next_block = tl.load(table + cols // BLOCK_SIZE, mask=cols < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        block = next_block.to(tl.int64)
        ahead = cols + BLOCK_N
        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
        within = cols % BLOCK_SIZE
        k_ptrs = K_CACHE + (block * stride_kb + kv_head * stride_kh + within * stride_kt)[:, None] \
            + k_dim_offset[None, :]
        v_ptrs = V_CACHE + (block * stride_vb + kv_head * stride_vh + within * stride_vt)[:, None] + offs_d[None, :]
        if MASK:
            col_ok = cols < context_len       # never read past the prefix: those rows are not ours
            if WINDOWED:   # nor before the first row's window: an engine may have reused those blocks
                col_ok = col_ok & (cols > first_pos - window)
            k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k.to(COMPUTE_DTYPE)), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32),
                 FP32_DOT, PRECISION) * score_scale
        if MASK:
            keep = (cols < context_len)[None, :]
            if WINDOWED:   # query row i (position context_len + i) sees keys j > context_len + i - window
                keep = keep & (cols[None, :] > (context_len + offs_m)[:, None] - window)
            s = tl.where(keep, s, -1.0e30)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v.to(COMPUTE_DTYPE), v_scale, FP8, FP32_DOT,
                                             PRECISION)
    return acc, l_i, m_i


# yaie: solution-only
@triton.jit
def _new_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, q_len, window, score_scale,
               offs_m, offs_d, MASK: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Part (b): the sequence's own new keys [lo, hi), contiguous rows of ``k``/``v``, causal.

    Query row ``i`` sees new key ``j <= i`` (and ``j > i - window``). MASK=False for tiles every row
    of the block sees whole; MASK=True for the diagonal, the ragged end and the window's edge.
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]
        if MASK:
            col_ok = cols < q_len
            k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), FP32_DOT, PRECISION)
        s = s * score_scale
        if MASK:
            keep = (cols[None, :] <= offs_m[:, None]) & (cols < q_len)[None, :]
            if WINDOWED:
                keep = keep & (cols[None, :] > offs_m[:, None] - window)
            s = tl.where(keep, s, -1.0e30)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, 1.0, False, FP32_DOT, PRECISION)
    return acc, l_i, m_i


# yaie: solution-only
@triton.jit
def _prefix_prefill_kernel(
    Q, K, V, K_CACHE, V_CACHE, BLOCK_TABLES, CU_SEQLENS_Q, CONTEXT_LENS, SINKS, OUT, LSE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckb, stride_ckh, stride_ckt, stride_ckx, stride_cvb, stride_cvt, stride_cvh,
    stride_table, stride_ot, stride_oh, stride_lh,
    group_size, qk_scale_log2, k_scale, v_scale, window, tune_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_VEC: tl.constexpr, WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr,
    SKIP_DECODE: tl.constexpr, FP8: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: BLOCK_M new query rows of one head of one sequence. Grid: (query blocks, heads, batch)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)   # the longest (last) query blocks start first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(CU_SEQLENS_Q + seq)
    q_len = tl.load(CU_SEQLENS_Q + seq + 1) - q_start
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return                      # this sequence has fewer new tokens than the longest one
    if SKIP_DECODE and q_len == 1:
        return                      # a decode step: lesson 04's kernel handles it
    context_len = tl.load(CONTEXT_LENS + seq)
    kv_head = (head // group_size).to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if HAS_SINKS:   # the sink is one more logit in every row's softmax: it seeds the running max
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # (a) the cached prefix, keys 0 .. context_len - 1. Without a window every tile but the ragged last
    # one runs unmasked. With one, tiles before the first row's window are skipped, tiles the window's
    # edge crosses for some row are masked, and the tiles every row sees whole run unmasked.
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_table
    first_pos = context_len + start_m                     # absolute position of the block's first row
    full_end = (context_len // BLOCK_N) * BLOCK_N
    lo = 0
    fast_lo = 0
    if WINDOWED:
        k_lo = tl.maximum(first_pos - window + 1, 0)                  # the first row's first visible key
        lo = tl.minimum((k_lo // BLOCK_N) * BLOCK_N, full_end)
        seen_from = tl.maximum(first_pos + BLOCK_M - window, 0)       # from here on every row sees the key
        fast_lo = tl.minimum(tl.maximum((seen_from + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), full_end)
        acc, l_i, m_i = _prefix_tiles(
            acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, lo, fast_lo, context_len, first_pos, window,
            qk_scale_log2 * k_scale, v_scale, stride_ckb, stride_ckh, stride_ckt, stride_ckx,
            stride_cvb, stride_cvt, stride_cvh, offs_m, offs_d, True, WINDOWED, HEAD_DIM, BLOCK_D, BLOCK_N,
            BLOCK_SIZE, K_VEC, Q.dtype.element_ty, FP8, FP32_DOT, PRECISION)
    acc, l_i, m_i = _prefix_tiles(
        acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, fast_lo, full_end, context_len, first_pos, window,
        qk_scale_log2 * k_scale, v_scale, stride_ckb, stride_ckh, stride_ckt, stride_ckx,
        stride_cvb, stride_cvt, stride_cvh, offs_m, offs_d, False, WINDOWED, HEAD_DIM, BLOCK_D, BLOCK_N,
        BLOCK_SIZE, K_VEC, Q.dtype.element_ty, FP8, FP32_DOT, PRECISION)
    acc, l_i, m_i = _prefix_tiles(
        acc, l_i, m_i, q, K_CACHE, V_CACHE, table, kv_head, full_end, context_len, context_len, first_pos,
        window, qk_scale_log2 * k_scale, v_scale, stride_ckb, stride_ckh, stride_ckt, stride_ckx,
        stride_cvb, stride_cvt, stride_cvh, offs_m, offs_d, True, WINDOWED, HEAD_DIM, BLOCK_D, BLOCK_N,
        BLOCK_SIZE, K_VEC, Q.dtype.element_ty, FP8, FP32_DOT, PRECISION)

    # (b) the new tokens, causal: keys 0 .. start_m - 1 (rounded down to tiles) are seen by every row.
    k_base = K + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    new_full_end = tl.minimum((q_len // BLOCK_N) * BLOCK_N, ((start_m + 1) // BLOCK_N) * BLOCK_N)
    new_end = tl.minimum(q_len, start_m + BLOCK_M)
    new_lo = 0
    if WINDOWED:
        new_k_lo = tl.maximum(start_m - window + 1, 0)
        new_lo = tl.minimum((new_k_lo // BLOCK_N) * BLOCK_N, new_full_end)
        new_seen_from = tl.maximum(start_m + BLOCK_M - window, 0)
        new_fast_lo = tl.minimum(tl.maximum((new_seen_from + BLOCK_N - 1) // BLOCK_N * BLOCK_N, new_lo),
                                 new_full_end)
        acc, l_i, m_i = _new_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, new_lo, new_fast_lo,
                                   q_len, window, qk_scale_log2, offs_m, offs_d, True, WINDOWED, HEAD_DIM,
                                   BLOCK_D, BLOCK_N, FP32_DOT, PRECISION)
        new_lo = new_fast_lo
    acc, l_i, m_i = _new_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, new_lo, new_full_end,
                               q_len, window, qk_scale_log2, offs_m, offs_d, False, WINDOWED, HEAD_DIM,
                               BLOCK_D, BLOCK_N, FP32_DOT, PRECISION)
    acc, l_i, m_i = _new_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, new_full_end, new_end,
                               q_len, window, qk_scale_log2, offs_m, offs_d, True, WINDOWED, HEAD_DIM,
                               BLOCK_D, BLOCK_N, FP32_DOT, PRECISION)

    # Every real row has seen at least its own key, so l > 0 and the junk of fully masked tiles is gone.
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453      # m is in base-2 units: back to natural log
    tl.store(OUT + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + head.to(tl.int64) * stride_lh + q_rows, lse, mask=row_ok)


# yaie: solution-only
def _block_d(head_dim: int) -> int:
    """Head dims padded to a power of two (at least 16, the smallest tl.dot inner size)."""
    return max(16, triton.next_power_of_2(head_dim))


# yaie: solution-only
def _tune_bucket(n: int) -> int:
    """Query lengths rounded up to a power of two: the autotuner re-tunes once per bucket, not per length."""
    return 1 << max(n - 1, 0).bit_length()


# yaie: solution-only
def _fixed_config(block_d: int, exact_fp32: bool, max_query_len: int) -> dict:
    """Blocks without autotuning: small in the interpreter; on a GPU the autotuner's choices on the H100
    benchmark (bench/results/lesson05_h100.md): 128 x 128 tiles with 8 warps for long queries, 128 x 32
    with 4 warps for a few hundred new tokens; 64 query rows for very short ones."""
    if triton_interpreted():
        return dict(BLOCK_M=16, BLOCK_N=16)
    if exact_fp32 or block_d > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if max_query_len <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if max_query_len >= 1024:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3)


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _tuned_kernel():
    """The autotuned kernel (GPU, fp16/bf16, head_dim <= 128): lesson 06's forward configurations."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3),
                                  (64, 64, 4, 3)]]
    return triton.autotune(configs=configs, key=["HEAD_DIM", "tune_len", "WINDOWED", "FP8", "BLOCK_SIZE",
                                                 "group_size"])(_prefix_prefill_kernel)


# yaie: solution-only
def _use_autotune(exact_fp32: bool, block_d: int, max_query_len: int) -> bool:
    """Autotune on a GPU for fp16/bf16 with at least 128 new tokens, unless YAIE_PP_AUTOTUNE=0 (shorter
    prefills keep the fixed blocks: tuning costs a few compiles per length bucket, once per process)."""
    if triton_interpreted() or os.environ.get("YAIE_PP_AUTOTUNE", "1") == "0":
        return False
    return not exact_fp32 and block_d <= 128 and max_query_len >= 128


# yaie: task 4
def prefix_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             context_lens: torch.Tensor, max_query_len: int, *, scale: float | None = None,
                             sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                             k_scale: float | None = None, v_scale: float | None = None,
                             skip_decode: bool = False, out: torch.Tensor | None = None,
                             validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of new tokens over a cached, paged prefix, in one Triton kernel with an online softmax.

    For each sequence ``b`` of a ragged batch, its new query tokens attend to (a) its ``context_lens[b]``
    cached tokens, read through ``block_tables[b]`` from the paged cache, no mask, then (b) its own new
    tokens (``k``, ``v``), causal. Query ``i`` of sequence ``b`` sits at position ``context_lens[b] + i``.

    Args:
        q: ``[total_new, num_heads, head_dim]``, the new tokens of all sequences packed; sequence ``b``
            owns rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``. Last axis contiguous.
        k, v: ``[total_new, num_kv_heads, head_dim]``, the new tokens' keys and values, packed like q
            (whether they were also written into the cache does not matter: the kernel reads them here).
            ``num_heads`` must be a multiple of ``num_kv_heads`` (query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``).
        k_cache, v_cache: ONE layer's cache, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (lesson 03's
            layout), or for ``k_cache`` the 16-byte vector layout ``[num_blocks, num_kv_heads, head_dim // x,
            block_size, x]`` of :func:`to_vector_k_layout`. Same dtype as q, or ``torch.float8_e4m3fn``
            with ``k_scale`` / ``v_scale`` (on a GPU with float16 or bfloat16 q; in the Triton interpreter
            with float16 q).
        block_tables: int32 ``[batch, max_blocks]``: cached token ``t`` of sequence ``b`` is row
            ``t % block_size`` of block ``block_tables[b, t // block_size]``. Entries past the prefix may
            hold anything (they are never followed).
        cu_seqlens_q: int32 ``[batch + 1]`` offsets of the new tokens: 0, ..., ``total_new``. A sequence
            may have 0 new tokens (nothing is computed for it).
        context_lens: int32 ``[batch]``: cached tokens before the new ones (0 is allowed: a plain causal
            prefill).
        max_query_len: the largest number of new tokens of a sequence (a Python int: it sizes the grid
            without a device sync).
        scale: multiplier of the scores, default ``head_dim ** -0.5``.
        sliding_window: None, or ``w >= 1``: position ``p`` sees keys ``p - w < j <= p`` only (Mistral's rule,
            as lesson 06), cached keys included.
        sinks: optional float ``[num_heads]``: per-head attention-sink logits (natural-log units, not
            multiplied by ``scale``): each row's softmax denominator gets ``exp(sinks[h])`` more, with no
            value attached, so the outputs sum to less than 1 (gpt-oss).
        k_scale, v_scale: per-tensor scales of an fp8 cache (real value = stored * scale), default 1.
            Only with an fp8 cache. The new tokens' k and v are never scaled.
        skip_decode: True: sequences with exactly ONE new token are skipped (a decode step: lesson 04's
            kernel is faster for them); their rows of ``out`` are left as they were (zeros in a new
            ``out``; whatever the caller's ``out`` held, e.g. the decode kernel's results), and their
            ``lse`` is ``-inf``.
        out: optional ``[total_new, num_heads, head_dim]`` tensor of q's dtype and device, contiguous, to
            write into.
        validate: also check the *values* of ``cu_seqlens_q``, ``context_lens`` and ``block_tables`` (one
            device sync); an engine that builds them itself may pass False.

    Dtypes: q, k, v float16, bfloat16 or float32 (one dtype); the caches q's dtype or float8_e4m3fn. Head
    dims 1..256 (padded inside), any block size. On the CPU the kernel runs in the Triton interpreter.

    Returns:
        ``(out, lse)``: ``out`` ``[total_new, num_heads, head_dim]`` in q's dtype; ``lse`` float32
        ``[num_heads, total_new]`` (heads first, like lesson 06's varlen form): the natural log of each
        row's softmax denominator over the keys it sees, the sink included.

    Raises:
        ValueError: as :func:`check_prefix_prefill_inputs`; a bad ``out``; with ``validate``, offsets that
            do not start at 0, end at ``total_new`` or decrease, a query longer than ``max_query_len``,
            context lengths past what a block table row holds, used block ids outside the cache.
    """
    check_prefix_prefill_inputs(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                max_query_len, scale, sliding_window, sinks, k_scale, v_scale)
    total, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = v_cache.shape[0], v_cache.shape[1], v_cache.shape[2]
    if validate:
        check_prefix_prefill_values(block_tables, cu_seqlens_q, context_lens, total, max_query_len,
                                    num_blocks, block_size, sliding_window)
    if out is None:
        out = torch.zeros_like(q) if skip_decode else torch.empty_like(q)
    elif not (isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
              and out.device == q.device and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}")
    if skip_decode:   # the rows of skipped sequences keep these values
        lse = torch.full((num_heads, total), float("-inf"), device=q.device, dtype=torch.float32)
    else:
        lse = torch.empty((num_heads, total), device=q.device, dtype=torch.float32)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    batch = context_lens.shape[0]
    block_d = _block_d(head_dim)
    fp8 = k_cache.dtype in FP8_DTYPES
    if k_cache.dim() == 5:   # [blocks, kv_heads, head_dim // x, block_size, x]
        stride_ckb, stride_ckh, stride_ckx, stride_ckt = k_cache.stride()[:4]
        k_vec = k_cache.shape[4]
    else:                    # [blocks, block_size, kv_heads, head_dim]: one "vector" spans the padded row
        stride_ckb, stride_ckt, stride_ckh = k_cache.stride()[:3]
        stride_ckx, k_vec = 0, block_d
    exact_fp32 = q.dtype == torch.float32
    args = (q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
            sinks if sinks is not None else q, out, lse,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            stride_ckb, stride_ckh, stride_ckt, stride_ckx, *(v_cache.stride(i) for i in (0, 1, 2)),
            block_tables.stride(0), out.stride(0), out.stride(1), lse.stride(0),
            num_heads // num_kv_heads, scale * LOG2E, float(k_scale or 1.0), float(v_scale or 1.0),
            sliding_window or 0, _tune_bucket(max_query_len))
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, K_VEC=k_vec,
                WINDOWED=sliding_window is not None, HAS_SINKS=sinks is not None, SKIP_DECODE=bool(skip_decode),
                FP8=fp8, FP32_DOT=triton_interpreted() and q.dtype == torch.bfloat16,
                PRECISION="ieee" if exact_fp32 else "tf32")
    if _use_autotune(exact_fp32, block_d, max_query_len):
        def grid(config):
            return ((max_query_len + config["BLOCK_M"] - 1) // config["BLOCK_M"], num_heads, batch)
        _tuned_kernel()[grid](*args, **meta)
    else:
        config = _fixed_config(block_d, exact_fp32, max_query_len)
        grid = ((max_query_len + config["BLOCK_M"] - 1) // config["BLOCK_M"], num_heads, batch)
        _prefix_prefill_kernel[grid](*args, **meta, **config)
    return out, lse
