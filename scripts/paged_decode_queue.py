"""Experiment (not course material yet): paged decode whose programs take their work from a queue.

Session 4's timeline (bench/README.md, lesson 04) showed that programs with identical work start together
but end over about 10% of the call, and the call lasts as long as the slowest one. This kernel tries
**guided self-scheduling** to even out the end:

* a persistent grid of ``PROGRAMS_PER_SM`` programs per multiprocessor;
* work items, handed out in order: first the *main* items (one per (sequence, KV head, split): the
  front of each split's range, as the solution kernel does), then the *tail* of every split cut into
  units of halving size (``T/2, T/4, ..., 1, 1`` tiles for a tail of ``T`` tiles), the largest units of
  every split before the smaller ones;
* program ``p`` starts with item ``p``; then it takes the next item from a counter in global memory
  (``atomic_add``), so a program that runs fast does more items, and the last items are one tile long;
* every item stores a partial result (normalised output and log-sum-exp) in a slot of its (sequence,
  KV head); the item that completes a (sequence, KV head) merges its slots (as the solution's fused merge).

The last program to leave resets the queue, so the counters are zero again for the next call (and the
call can be replayed from a CUDA graph). ``TIMELINE`` makes every program record its start, end,
multiprocessor and number of items.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from solutions.kernels import paged_attention as pa
from solutions.kernels.paged_attention import _merge_one


@triton.jit
def _attend_range(q, table, K_CACHE, V_CACHE, kv_head, start, end, limit,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2, offs_d, d_ok,
                  GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                  FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over tokens ``start .. end`` of one sequence (the solution kernel's loop): returns the
    running max ``m`` (log2 units), the sum ``l`` and the unnormalised output ``acc``."""
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    first = start + tl.arange(0, TILE_N)
    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < limit, other=0)
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        n_ok = offs_n < end
        block = next_block.to(tl.int64)
        ahead = offs_n + TILE_N
        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)
        within = offs_n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K_CACHE + block[:, None] * stride_kb + within[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_CACHE + block[:, None] * stride_vb + within[:, None] * stride_vt + kv_head * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(n_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _merge_slots(PART_OUT, PART_LSE, first_row, GROUP: tl.constexpr, GROUP_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, SLOTS: tl.constexpr):
    """Merge the ``SLOTS`` partial results of query-head rows ``first_row .. first_row + GROUP`` (unrolled:
    every slot's loads are issued at once). Only GROUP_M = next_pow2(GROUP) rows, not the 16 that
    ``tl.dot`` needs, so the unrolled loads fit in registers."""
    rows = tl.arange(0, GROUP_M)
    row_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = (first_row + rows).to(tl.int64)
    part_out = PART_OUT + (row * SLOTS)[:, None] * HEAD_DIM + offs_d[None, :]
    part_lse = PART_LSE + row * SLOTS
    top = tl.full([GROUP_M], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_M], tl.float32)
    acc = tl.zeros([GROUP_M, BLOCK_D], tl.float32)
    for s in tl.static_range(SLOTS):
        top, total, acc = _merge_one(top, total, acc, part_out + s * HEAD_DIM, part_lse + s, row_ok, d_ok)
    return acc / tl.where(total > 0, total, 1.0)[:, None], row, row_ok, d_ok


@triton.jit
def _queue_decode_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, CONTEXT_LENS, OUT, PART_OUT, PART_LSE, COUNTERS, QUEUE, TIMES,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    scale_log2, max_context_len, num_kv_heads, num_pairs, split_tokens, main_tokens, num_main, num_items,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TAIL_TILES: tl.constexpr, UNITS: tl.constexpr, UNIT_DIV: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    TIMELINE: tl.constexpr,
):
    SLOTS: tl.constexpr = NUM_SPLITS * (1 + UNITS)       # partial results per (sequence, KV head)
    programs = tl.num_programs(0)
    me = tl.program_id(0)
    if TIMELINE:
        t_begin = tl.extra.cuda.globaltimer()
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    done = tl.full([], 0, tl.int32)
    item = me
    while item < num_items:
        # Which piece of work is this? Main item i: split i % NUM_SPLITS of pair i // NUM_SPLITS. Tail item
        # t: pair t % num_pairs, unit u = t // num_pairs of that pair's NUM_SPLITS * UNITS tail units
        # (unit j of a split covers tiles [T - T/2^j, T - T/2^(j+1)) of its tail; the last one the last tile).
        is_main = item < num_main
        t = tl.maximum(item - num_main, 0)
        unit = t // num_pairs
        pair = tl.where(is_main, item // NUM_SPLITS, t % num_pairs)
        split = tl.where(is_main, item % NUM_SPLITS, unit // UNIT_DIV)
        j = unit % UNIT_DIV
        tile_lo = TAIL_TILES - (TAIL_TILES >> j)
        tile_hi = tl.where(j == UNITS - 1, TAIL_TILES, TAIL_TILES - (TAIL_TILES >> (j + 1)))
        start = split * split_tokens + tl.where(is_main, 0, main_tokens + tile_lo * TILE_N)
        stop = split * split_tokens + tl.where(is_main, main_tokens, main_tokens + tile_hi * TILE_N)
        slot = split * (1 + UNITS) + tl.where(is_main, 0, 1 + j)
        seq = pair // num_kv_heads
        kv_head = pair % num_kv_heads

        context_len = tl.load(CONTEXT_LENS + seq)
        end = tl.minimum(stop, context_len)
        heads = kv_head * GROUP + rows
        q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        table = BLOCK_TABLES + seq.to(tl.int64) * stride_table
        m, l, acc = _attend_range(q, table, K_CACHE, V_CACHE, kv_head, start, end, max_context_len,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale_log2,
                                  offs_d, d_ok, GROUP_PAD, BLOCK_D, BLOCK_SIZE, TILE_N, FP32_DOT, PRECISION)
        has_keys = l > 0
        out = acc / tl.where(has_keys, l, 1.0)[:, None]
        out_mask = row_ok[:, None] & d_ok[None, :]
        row = seq.to(tl.int64) * (num_kv_heads * GROUP) + heads
        if SLOTS == 1:
            tl.store(OUT + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=out_mask)
        else:
            tl.store(PART_OUT + (row * SLOTS + slot)[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=out_mask & has_keys[:, None])
            lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, l, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(PART_LSE + row * SLOTS + slot, lse, mask=row_ok)
            tl.debug_barrier()
            finished_before = tl.atomic_add(COUNTERS + pair, 1, sem="acq_rel", scope="gpu")
            if finished_before == SLOTS - 1:
                first_row = seq * (num_kv_heads * GROUP) + kv_head * GROUP
                merged, mrow, mrow_ok, md_ok = _merge_slots(PART_OUT, PART_LSE, first_row, GROUP, GROUP_M,
                                                            HEAD_DIM, BLOCK_D, SLOTS)
                tl.store(OUT + mrow[:, None] * HEAD_DIM + offs_d[None, :], merged.to(OUT.dtype.element_ty),
                         mask=mrow_ok[:, None] & md_ok[None, :])
                tl.store(COUNTERS + pair, 0)
        done += 1
        item = programs + tl.atomic_add(QUEUE, 1, sem="relaxed", scope="gpu")
    if TIMELINE:
        tl.store(TIMES + 4 * me, t_begin)
        tl.store(TIMES + 4 * me + 1, tl.extra.cuda.globaltimer())
        tl.store(TIMES + 4 * me + 2, tl.extra.cuda.smid().to(tl.int64))
        tl.store(TIMES + 4 * me + 3, done.to(tl.int64))
    # Every program has taken its last (empty) ticket before it counts itself out, so the last one out
    # may put the queue back to zero for the next call.
    left_before = tl.atomic_add(QUEUE + 1, 1, sem="acq_rel", scope="gpu")
    if left_before == programs - 1:
        tl.store(QUEUE, 0)
        tl.store(QUEUE + 1, 0)


def plan(max_context_len: int, num_splits: int, tile_n: int, tail_fraction: float) -> dict:
    """Token ranges of the items: whole tiles per split; a tail of ``T`` tiles (a power of two, about
    ``tail_fraction`` of a split, 0 for none) in ``log2(T) + 1`` units; the rest of the split is the main item."""
    split_tiles = -(-(-(-max_context_len // num_splits)) // tile_n)
    wanted = int(split_tiles * tail_fraction)
    tail_tiles = 1 << (wanted.bit_length() - 1) if wanted >= 1 and split_tiles > 1 else 0
    tail_tiles = min(tail_tiles, 1 << ((split_tiles - 1).bit_length() - 1)) if tail_tiles else 0   # main >= 1 tile
    units = tail_tiles.bit_length() if tail_tiles else 0      # T = 2^k -> k + 1 units
    return dict(split_tokens=split_tiles * tile_n, main_tokens=(split_tiles - tail_tiles) * tile_n,
                TAIL_TILES=tail_tiles, UNITS=units)


@functools.lru_cache(maxsize=None)
def _zeros(device: torch.device, stream: int, size: int, role: str) -> torch.Tensor:
    """Zeroed int32 counters kept between calls (every call leaves them at zero), one set per device, stream and
    role (``pairs``: one per (sequence, KV head); ``queue``: the next ticket and the programs that left)."""
    return torch.zeros(size, dtype=torch.int32, device=device)


def queue_decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale=None, num_splits=None,
                 tail_fraction=0.125, config=None, programs_per_sm=pa.PROGRAMS_PER_SM, times=None):
    """Paged decode (same arguments and result as ``paged_attention_forward(..., validate=False)``) with the
    work handed out by a queue. ``times``: int64 ``[programs * 4]`` to record a timeline into."""
    pa.check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, num_splits)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else float(scale)
    sms = pa._num_sms(q.device)
    if num_splits is None:
        num_splits = pa.choose_num_splits(batch, num_kv_heads, max_context_len, sms)
    block_d = pa._block_d(head_dim)
    settings = pa._decode_config(block_d, q.element_size(), min(batch * num_kv_heads * num_splits,
                                                                 programs_per_sm * sms), sms)
    settings.update(config or {})
    items = plan(max_context_len, num_splits, settings["TILE_N"], tail_fraction)
    pairs = batch * num_kv_heads
    num_main = pairs * num_splits
    num_items = num_main * (1 + items["UNITS"])
    grid = min(num_items, programs_per_sm * sms)
    slots = num_splits * (1 + items["UNITS"])
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if slots > 1:
        part_out = torch.empty((batch, num_heads, slots, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((batch, num_heads, slots), device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.device.type == "cuda" else 0
    counters = _zeros(q.device, stream, max(1024, triton.next_power_of_2(pairs)), "pairs")
    queue = _zeros(q.device, stream, 2, "queue")
    _queue_decode_kernel[(grid,)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, counters, queue,
        times if times is not None else counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        scale * pa.LOG2E, max_context_len, num_kv_heads, pairs, items["split_tokens"], items["main_tokens"],
        num_main, num_items,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), GROUP_M=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        TAIL_TILES=items["TAIL_TILES"], UNITS=items["UNITS"], UNIT_DIV=max(1, items["UNITS"]),
        FP32_DOT=pa.triton_interpreted() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIMELINE=times is not None, **settings,
    )
    return out
