"""Experiment (session 6): paged decode whose warps each own their own keys ("lanes").

In the solution kernel the four warps of a program share every tile: each warp computes a quarter of the
tile's scores, so the row max and row sum of the online softmax, and the probabilities ``p`` that the
second product needs in full, cross warps through shared memory: 9 ``bar.sync`` per 64-key tile
(session 5's PTX). Here the tile is cut into ``LANES`` slices of ``LANE_N`` keys and the products are
*batched* ``tl.dot`` over the slices (``[LANES, GROUP_PAD, D] x [LANES, D, LANE_N]``). For a 3-D dot Triton
puts the warps on the batch axis, so with ``num_warps == LANES`` each warp runs a whole online softmax over
its own keys: reductions are shuffles inside the warp and ``p`` never leaves its registers. The lanes'
running states ``(m, l, acc)`` are merged once, after the loop, by the same log-sum-exp rule as the splits.

Cost: each warp keeps a full ``[GROUP_PAD, D]`` accumulator (4x the registers of the shared one).
Same arguments and results as ``solutions.kernels.paged_attention._launch_decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solutions.kernels import paged_attention as pa
from solutions.kernels.paged_attention import _merge_rows

LAST = {}    # "kernel": the compiled kernel of the last launch (its PTX, registers and shared memory)


@triton.jit
def _lanes_decode_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, CONTEXT_LENS, OUT, PART_OUT, PART_LSE, COUNTERS,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    scale_log2, tokens_per_split, max_context_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, LANES: tl.constexpr, LANE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FUSE_MERGE: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: one sequence, one KV head, one split; its tiles of ``LANES * LANE_N`` keys are cut into
    ``LANES`` slices with a running softmax state each."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    context_len = tl.load(CONTEXT_LENS + seq)
    end = tl.minimum(start + tokens_per_split, context_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = tl.broadcast_to(q[None, :, :], (LANES, GROUP_PAD, BLOCK_D))     # every lane (warp) its own copy
    if FP32_DOT:
        q = q.to(tl.float32)

    m = tl.full([LANES, GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([LANES, GROUP_PAD], tl.float32)
    acc = tl.zeros([LANES, GROUP_PAD, BLOCK_D], tl.float32)
    # Key j of lane w in a tile: tile_start + w * LANE_N + j (each lane a contiguous slice of the tile).
    slot = tl.arange(0, LANES)[:, None] * LANE_N + tl.arange(0, LANE_N)[None, :]    # [LANES, LANE_N]
    TILE_N: tl.constexpr = LANES * LANE_N
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_table
    first = start + slot
    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + slot
        n_ok = offs_n < end
        block = next_block.to(tl.int64)
        ahead = offs_n + TILE_N
        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)
        within = offs_n % BLOCK_SIZE
        kv_mask = n_ok[:, :, None] & d_ok[None, None, :]
        k_rows = block * stride_kb + within * stride_kt + kv_head * stride_kh
        v_rows = block * stride_vb + within * stride_vt + kv_head * stride_vh
        k = tl.load(K_CACHE + k_rows[:, :, None] + offs_d[None, None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_CACHE + v_rows[:, :, None] + offs_d[None, None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k, (0, 2, 1)), input_precision=PRECISION)     # [LANES, GROUP_PAD, LANE_N]
        scores = tl.where(n_ok[:, None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 2))
        # A lane whose keys so far are all masked (the context's end) keeps m = -inf: shift by 0 there,
        # so that exp2(-inf - shift) is 0 and not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(scores - shift[:, :, None])
        l = l * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # Merge the lanes (once per program): weights exp2(m_w - max_w m_w), a lane without keys weighs 0.
    m_all = tl.max(m, 0)
    top = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp2(m - top[None, :])
    l_all = tl.sum(l * weight, 0)
    acc_all = tl.sum(acc * weight[:, :, None], 0)

    has_keys = l_all > 0
    out = acc_all / tl.where(has_keys, l_all, 1.0)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    row = seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads
    out_ptrs = OUT + row[:, None] * HEAD_DIM + offs_d[None, :]
    if NUM_SPLITS > 1:
        part_out = PART_OUT + (row * NUM_SPLITS)[:, None] * HEAD_DIM + offs_d[None, :]
        part_lse = PART_LSE + row * NUM_SPLITS
        tl.store(part_out + split * HEAD_DIM, out, mask=out_mask)
        lse = tl.where(has_keys, (m_all + tl.log2(tl.where(has_keys, l_all, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(part_lse + split, lse, mask=row_ok)
        if FUSE_MERGE:
            tl.debug_barrier()
            counter = COUNTERS + seq * tl.num_programs(1) + kv_head
            finished_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if finished_before == NUM_SPLITS - 1:
                merged = _merge_rows(part_out, part_lse, HEAD_DIM, row_ok, d_ok, NUM_SPLITS)
                tl.store(out_ptrs, merged.to(OUT.dtype.element_ty), mask=out_mask)
                tl.store(counter, 0)
    else:
        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)


def lanes_decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, num_splits,
                 lanes=4, lane_n=16, num_stages=3, num_warps=None):
    """Launch the lane kernel (split merge fused in); ``num_warps`` defaults to ``lanes`` (one warp each)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    tile_n = lanes * lane_n
    per_split = (max_context_len + num_splits - 1) // num_splits
    tokens_per_split = (per_split + tile_n - 1) // tile_n * tile_n
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((batch, num_heads, num_splits), device=q.device, dtype=torch.float32)
        counters = pa._split_counters(q.device, batch * num_kv_heads)
    else:
        part_out = part_lse = counters = out
    interpreted = pa.triton_interpreted()
    LAST["kernel"] = _lanes_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        scale * pa.LOG2E, tokens_per_split, max_context_len,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=pa._block_d(head_dim), BLOCK_SIZE=block_size, LANES=lanes, LANE_N=lane_n, NUM_SPLITS=num_splits,
        FUSE_MERGE=num_splits > 1, FP32_DOT=interpreted and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=1 if interpreted else (num_warps or lanes), num_stages=1 if interpreted else num_stages,
    )
    return out
