"""Lesson 04: paged-attention decode in Triton.

In a decode step every running sequence brings ONE new query token per head, and it must attend to all
of its earlier tokens, whose keys and values sit in the paged KV cache of lesson 03::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
    block_tables:     int32 [batch, max_blocks_per_seq]   logical block j of sequence b -> physical block
    context_lens:     int32 [batch]                       tokens of each sequence (they differ)

Logical token ``t`` of sequence ``b`` is row ``t % block_size`` of physical block
``block_tables[b, t // block_size]``. The kernel never builds a contiguous copy of a sequence's cache: it
follows the block table while it loads.

Decode is **memory bound**: per token of context each KV head reads ``2 * head_dim`` numbers (K and V) and
does about as many multiply-adds per query head. With grouped-query attention (GQA) ``group =
num_heads // num_kv_heads`` query heads share one KV head, so the kernel gives one program a whole group:
it loads each K/V tile once and uses it for every query head of the group (a ``[group, head_dim] x
[head_dim, tile]`` product, padded to 16 rows for ``tl.dot``).

**Split-K (flash-decoding).** With a small batch there are few (sequence, KV head) programs: too few to
keep the GPU's memory system busy on a long context. Then the context is cut into ``num_splits``
ranges of whole tiles (``max_context_len / num_splits`` tokens each, rounded up) handled by separate
programs. Each writes its normalised partial output ``o_i`` and the log-sum-exp ``lse_i`` of its scores;
a second kernel merges them exactly::

    out = sum_i exp(lse_i - lse) * o_i,    lse = log(sum_i exp(lse_i))

(the same rescaling as the online softmax of lesson 06, applied once per split).

The merge can run as a kernel of its own (:func:`merge_split_results`, task 3: clear, and what the grader
asks for) or fused into the decode kernel: every split bumps a per-(sequence, KV head) counter when its
partial result is stored, and the split that finishes LAST merges them all. That saves a launch: 2.6 to
8 us per call on the H200 benchmark shapes, up to 10% of a short decode step (bench/results/lesson04_h200.md,
rows "merge as a 2nd kernel").

**Sliding windows** (Mistral, Gemma 2/3, gpt-oss: some or all layers attend only to the last ``w``
tokens). The newest token of a sequence of ``n`` tokens then sees positions ``max(0, n - w) .. n - 1``, and
the blocks before those are never read: decode over a window costs ``w`` tokens of K/V, however long the
context. The split ranges share out the window (``min(max_context_len, w)`` tokens), starting at each
sequence's first visible token; the loop itself does not change, because it already works out each key's
block from its position.

Tasks: 1 the naive gather + PyTorch reference, 2 the Triton decode kernel and its launcher (one split),
3 merging split results by log-sum-exp and the split-K path, 4 sliding windows (in the reference and the
kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/paged_attention_given.py
from yaie.kernels.paged_attention_given import (
    LN2, LOG2E, MAX_HEAD_DIM, MAX_SPLITS, PROGRAMS_PER_SM, SUPPORTED_DTYPES, num_sms, check_paged_inputs,
    check_paged_values, choose_num_splits,
)


# yaie: task 1
def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The naive paged decode: gather each sequence's K and V from its blocks, then plain attention.

    Same arguments as :func:`paged_attention_forward` (without ``max_context_len``): q
    ``[batch, num_heads, head_dim]``, caches ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    ``block_tables`` int32 ``[batch, max_blocks]``, ``context_lens`` int32 ``[batch]``. Query head ``h``
    reads KV head ``h // (num_heads // num_kv_heads)``. Computes in the inputs' dtype (call it on float64
    copies to get a reference). A sequence with context length 0 gets a zero output.

    ``sliding_window`` (task 4): None attends to the whole context; an int ``w >= 1`` attends to the last
    ``w`` tokens only (positions ``max(0, n - w) .. n - 1`` of a sequence of ``n`` tokens). Until you do
    task 4, raise ``NotImplementedError("lesson 04, task 4: sliding window")`` when it is not None.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: as :func:`check_paged_inputs` (with ``max_context_len`` = the longest context).
    """
    max_len = max(1, int(context_lens.max())) if isinstance(context_lens, torch.Tensor) and context_lens.numel() else 1
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, max_len, scale,
                       sliding_window=sliding_window, for_kernel=False)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = torch.zeros_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        if length == 0:
            continue
        first = 0 if sliding_window is None else max(0, length - sliding_window)
        positions = torch.arange(first, length, device=q.device)    # the tokens this query sees
        blocks = block_tables[b, positions // block_size].long()
        rows = positions % block_size
        k = k_cache[blocks, rows].repeat_interleave(group, dim=1)     # [tokens seen, num_heads, head_dim]
        v = v_cache[blocks, rows].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b], k) * scale          # [num_heads, tokens seen]
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out


# yaie: solution-only
@triton.jit
def _rope_rotate(ptr, offsets, partner_offsets, mask, first, cos, sin):
    # Rotate-half RoPE of the vectors at ptr + offsets, in float32: element i is paired with element
    # i + half (partner_offsets), out = x * cos - partner * sin in the first half, x * cos + partner * sin
    # in the second: the expressions of lesson 02's RoPE kernel, so the rounded results agree with it.
    x = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + partner_offsets, mask=mask, other=0.0).to(tl.float32)
    return tl.where(first, x * cos - partner * sin, x * cos + partner * sin)


# yaie: solution-only
# Lengths and the window are plain values: Triton would otherwise compile a new kernel when one of them
# happens to be 1 or a multiple of 16, and it gains nothing from knowing that here.
@triton.jit(do_not_specialize=["window", "tokens_per_split", "max_context_len", "max_position", "num_slots"])
def _paged_decode_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, CONTEXT_LENS, OUT, PART_OUT, PART_LSE, COUNTERS,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table, window,
    scale_log2, tokens_per_split, max_context_len,
    K_NEW, V_NEW, COS, SIN, POSITIONS, SLOTS, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos,
    max_position, num_slots,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSE_MERGE: tl.constexpr,
    WINDOWED: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr = False,
):
    """One program: one sequence, one KV head (all its GROUP query heads), one range of the context.

    OUT ``[batch, num_heads, HEAD_DIM]``, PART_OUT ``[batch, num_heads, num_splits, HEAD_DIM]`` and PART_LSE
    ``[batch, num_heads, num_splits]`` are the launcher's own contiguous buffers: their strides follow from
    the sizes, so they are not passed. ROPE (:func:`paged_decode_with_rope`): Q holds the new tokens' queries
    before RoPE, K_NEW and V_NEW their keys and values, not yet in the cache; the K_NEW ... num_slots
    arguments are unused without it.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # This split's tokens: split * tokens_per_split onwards (a whole number of tiles, worked out on the host
    # from max_context_len). Where a split STARTS does not depend on this sequence's length, so the first
    # block ids below are requested at the same time as the length, not after it: one memory round trip
    # less before the first K/V bytes arrive. A sequence shorter than the others leaves its last splits
    # empty; the batch's longest sequence, which sets the kernel's time, is split evenly.
    start = split * tokens_per_split
    context_len = tl.load(CONTEXT_LENS + seq)
    if WINDOWED:   # task 4: the splits share out the last `window` tokens, from the first one the query sees
        start += tl.maximum(context_len - window, 0)
    end = tl.minimum(start + tokens_per_split, context_len)

    rows = tl.arange(0, GROUP_PAD)                      # query heads of the group, padded for tl.dot
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM                            # head dims that are not a power of two
    q_offsets = heads[:, None] * stride_qh + offs_d[None, :]
    if ROPE:
        # The step's RoPE and cache write, done here instead of in a kernel of their own: rotate the
        # group's queries (every program of the sequence does, they are a few hundred bytes), and the
        # program whose range holds the new token (the sequence's last) rotates its key and stores it and
        # its value in the cache, before the loop below reads them back.
        position = tl.load(POSITIONS + seq).to(tl.int64)
        valid = (position >= 0) & (position < max_position)
        position = tl.where(valid, position, 0)            # never read outside the table
        half: tl.constexpr = HEAD_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        # The rotate-half table repeats its angles (cos[p, i] == cos[p, i + half]): read the first half.
        cos = tl.load(COS + position * stride_cos + offs_d % half, mask=d_ok, other=0.0)
        sin = tl.load(SIN + position * stride_cos + offs_d % half, mask=d_ok, other=0.0)
        q_ptr = Q + seq.to(tl.int64) * stride_qb
        q = _rope_rotate(q_ptr, q_offsets, heads[:, None] * stride_qh + partner[None, :],
                         row_ok[:, None] & d_ok[None, :], first[None, :], cos[None, :], sin[None, :])
        # A position outside the table has no angle: NaN, so the mistake shows (as lesson 02's RoPE).
        q = tl.where(valid, q, float("nan")).to(Q.dtype.element_ty)
        newest = context_len - 1
        if (start <= newest) & (newest < end):
            slot = tl.load(SLOTS + seq).to(tl.int64)
            slot_ok = (slot >= 0) & (slot < num_slots)
            store_ok = offs_d < tl.where(slot_ok, HEAD_DIM, 0)      # a slot outside the cache is never written
            slot = tl.where(slot_ok, slot, 0)
            k_ptr = K_NEW + seq.to(tl.int64) * stride_knb + kv_head * stride_knh
            k_new = _rope_rotate(k_ptr, offs_d, partner, d_ok, first, cos, sin)
            k_new = tl.where(valid, k_new, float("nan")).to(K_CACHE.dtype.element_ty)
            v_new = tl.load(V_NEW + seq.to(tl.int64) * stride_vnb + kv_head * stride_vnh + offs_d, mask=d_ok)
            block = slot // BLOCK_SIZE
            within = slot % BLOCK_SIZE
            tl.store(K_CACHE + block * stride_kb + within * stride_kt + kv_head * stride_kh + offs_d, k_new,
                     mask=store_ok)
            tl.store(V_CACHE + block * stride_vb + within * stride_vt + kv_head * stride_vh + offs_d, v_new,
                     mask=store_ok)
        # Every thread's stores are visible to the whole program after the barrier: the loop's loads of the
        # newest token's K/V read what was just stored.
        tl.debug_barrier()
    else:
        q = tl.load(Q + seq.to(tl.int64) * stride_qb + q_offsets, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)   # running max of the scores (log2 units)
    l = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)      # running sum of exp2(score - m) * v
    # Follow the block table: token t is row t % BLOCK_SIZE of block table[t // BLOCK_SIZE]. The block ids
    # are read one tile AHEAD: then a tile's K/V addresses do not hang on a load of the same iteration,
    # and Triton's software pipeliner can keep num_stages - 1 tiles of K and V in flight (with the ids
    # read in the same iteration it kept one K/V buffer, whatever num_stages said).
    table = BLOCK_TABLES + seq.to(tl.int64) * stride_table
    first = start + tl.arange(0, TILE_N)
    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)
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
        if FP32_DOT:   # the interpreter's bf16 tl.dot is broken: upcast there
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(n_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))        # finite: every tile has a valid token
        alpha = tl.exp2(m - m_new)                      # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    has_keys = l > 0                                    # an empty split (or context) has no keys
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    row = seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads     # (sequence, head) row of the outputs
    out_ptrs = OUT + row[:, None] * HEAD_DIM + offs_d[None, :]
    if NUM_SPLITS > 1:
        part_out = PART_OUT + (row * NUM_SPLITS)[:, None] * HEAD_DIM + offs_d[None, :]   # this row's split 0
        part_lse = PART_LSE + row * NUM_SPLITS
        tl.store(part_out + split * HEAD_DIM, out, mask=out_mask)
        lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, l, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(part_lse + split, lse, mask=row_ok)
        if FUSE_MERGE:
            # The last split of this (sequence, KV head) to finish merges them all, so no second kernel
            # is launched (a few microseconds saved on a 30-80 us decode step). The barrier orders every
            # thread's stores before the counter moves; the counter's acquire-release makes them visible
            # to whichever program finishes last, and that program puts the counter back to 0.
            tl.debug_barrier()
            counter = COUNTERS + seq * tl.num_programs(1) + kv_head
            finished_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if finished_before == NUM_SPLITS - 1:
                merged = _merge_rows(part_out, part_lse, HEAD_DIM, row_ok, d_ok, NUM_SPLITS)
                tl.store(out_ptrs, merged.to(OUT.dtype.element_ty), mask=out_mask)
                tl.store(counter, 0)
    else:
        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)


# yaie: solution-only
@triton.jit
def _merge_rows(part_out, part_lse, stride_ps, row_ok, d_ok, NUM_SPLITS: tl.constexpr):
    """Merge the split results of some rows (query heads) by an online log-sum-exp over the splits.

    ``part_out``: pointers ``[ROWS, BLOCK_D]`` to split 0's normalised outputs (split ``s`` lies
    ``s * stride_ps`` further on); ``part_lse``: pointers ``[ROWS]`` to split 0's log-sum-exp (split ``s``
    at ``+ s``). Returns ``sum_s exp(lse_s - lse) * o_s`` as float32 ``[ROWS, BLOCK_D]``: the running max
    and rescaling of lesson 06's online softmax, one split at a time.

    ``NUM_SPLITS`` is a constexpr, and up to 16 splits the loop is unrolled at compile time: then no load
    waits for the previous split's arithmetic, and the compiler issues every split's loads at once. In
    the fused merge this runs at the very end of the kernel, where a loop that waited for each split's
    load in turn would add one memory round trip per split to every decode step. (Past 16 splits the
    unrolled loads would need more registers than a thread has: a plain loop.) The loads bypass L1
    (``.cg``): other programs, possibly on other multiprocessors, wrote these values.
    """
    top = tl.full(row_ok.shape, float("-inf"), tl.float32)    # largest lse so far
    total = tl.zeros(row_ok.shape, tl.float32)                 # sum of exp(lse_s - top)
    acc = tl.zeros(part_out.shape, tl.float32)                 # sum of exp(lse_s - top) * o_s
    if NUM_SPLITS <= 16:
        for s in tl.static_range(NUM_SPLITS):
            top, total, acc = _merge_one(top, total, acc, part_out + s * stride_ps, part_lse + s, row_ok, d_ok)
    else:
        for s in range(NUM_SPLITS):
            top, total, acc = _merge_one(top, total, acc, part_out + s * stride_ps, part_lse + s, row_ok, d_ok)
    return acc / tl.where(total > 0, total, 1.0)[:, None]


# yaie: solution-only
@triton.jit
def _merge_one(top, total, acc, part_out, part_lse, row_ok, d_ok):
    """One split into the running merge: ``(top, total, acc)`` as in :func:`_merge_rows`."""
    lse = tl.load(part_lse, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_out, mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
    new_top = tl.maximum(top, lse)
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)   # no keys yet: keep every weight 0
    alpha = tl.exp(top - shift)
    weight = tl.exp(lse - shift)                                # an empty split (lse = -inf) weighs 0
    part = tl.where(weight[:, None] > 0, part, 0.0)             # and its unwritten output is never read
    return new_top, total * alpha + weight, acc * alpha[:, None] + weight[:, None] * part


# yaie: solution-only
@triton.jit
def _merge_splits_kernel(
    PART_OUT, PART_LSE, OUT, num_heads,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One program per (sequence, BLOCK_H query heads): the standalone merge of :func:`merge_split_results`."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    part_out = PART_OUT + seq * stride_pb + heads[:, None] * stride_ph + offs_d[None, :]
    part_lse = PART_LSE + seq * stride_lb + heads * stride_lh
    out = _merge_rows(part_out, part_lse, stride_ps, row_ok, d_ok, NUM_SPLITS)
    tl.store(OUT + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# yaie: solution-only
def _decode_config(block_d: int, itemsize: int, programs: int, num_sms: int) -> dict:
    """Launch settings: small tiles in the interpreter (fast on a CPU), wide tiles on a GPU.

    The pipeline depth depends on the wave: with 16-bit K/V, a 3-stage program (about 70 KB of shared
    memory at head_dim 128) fits about 2 times on a multiprocessor, a 2-stage one (about 38 KB) twice as
    often. When every program fits in ONE wave of ``PROGRAMS_PER_SM`` per multiprocessor, the deeper
    pipeline keeps more bytes in flight per program and wins; when they do not, 3 stages would leave
    multiprocessors with room for fewer programs and add a second, mostly empty wave (measured on the
    H200: bench/results/lesson04_tune_h200.json, "sweep"). float32 tiles are twice as big: 2 stages.
    """
    if triton_interpreted():
        return dict(TILE_N=16, num_warps=1, num_stages=1)
    one_wave = programs <= PROGRAMS_PER_SM * num_sms
    return dict(TILE_N=64 if block_d <= 128 else 32, num_warps=4, num_stages=3 if one_wave and itemsize <= 2 else 2)


# yaie: solution-only
def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


# yaie: solution-only
def _split_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), for the fused merge; kept between calls.

    Every call leaves them at zero again (the merging program resets its counter), so they are allocated
    once, not per call. One set per device and stream: two decode calls running at once on different
    streams must not share counters.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _zeroed_counters(device, stream, max(1024, triton.next_power_of_2(count)))


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _zeroed_counters(device: torch.device, stream: int, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)


# yaie: solution-only
def _launch_decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, num_splits,
                   config=None, fuse_merge=True, sliding_window=None, rope=None):
    """Run the decode kernel (with the split merge fused in, or as a second kernel when ``fuse_merge`` is
    False); ``config`` overrides the launch settings; ``sliding_window`` None or the window (checked);
    ``rope`` None or the checked ``(k, v, cos, sin, position_ids, slot_mapping)`` of
    :func:`paged_decode_with_rope`."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)     # contiguous: the kernel relies on it
    use_splits = num_splits > 1
    settings = _decode_config(block_d, q.element_size(), batch * num_kv_heads * num_splits, num_sms(q.device))
    settings.update(config or {})
    tile_n = settings["TILE_N"]
    # Whole tiles per split. Plain integer arithmetic: triton.cdiv is a constexpr function, and calling it
    # costs microseconds of host time on every decode step (measured: docs/decode_kernel_findings.md, "Host time").
    # With a sliding window no sequence reads more than `sliding_window` tokens: the splits share out those.
    span = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    per_split = (span + num_splits - 1) // num_splits
    tokens_per_split = (per_split + tile_n - 1) // tile_n * tile_n
    if use_splits:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((batch, num_heads, num_splits), device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out            # unused pointers
    fused = use_splits and fuse_merge
    counters = _split_counters(q.device, batch * num_kv_heads) if fused else out
    meta = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, FUSE_MERGE=fused, WINDOWED=sliding_window is not None,
                FP32_DOT=triton_interpreted() and q.dtype == torch.bfloat16,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROPE=rope is not None, **settings)
    if rope is None:
        rope_args = (q, q, q, q, context_lens, context_lens, 0, 0, 0, 0, 0, 0, 0)     # unused pointers
    else:
        k, v, cos, sin, position_ids, slot_mapping = rope
        rope_args = (k, v, cos, sin, position_ids, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     cos.stride(0), cos.shape[0], k_cache.shape[0] * k_cache.shape[1])
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), sliding_window or 0,
        scale * LOG2E, tokens_per_split, max_context_len,
        *rope_args,
        **meta,
    )
    if use_splits and not fused:
        _launch_merge(part_out, part_lse, out)   # our own buffers: no need to check them again
    return out


# yaie: solution-only
def _launch_merge(part_out, part_lse, out):
    """Launch the merge kernel on checked tensors (one program per sequence and 16 query heads)."""
    batch, num_heads, num_splits, head_dim = part_out.shape
    block_h = 16
    _merge_splits_kernel[(batch, (num_heads + block_h - 1) // block_h)](
        part_out, part_lse, out, num_heads,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_H=block_h, NUM_SPLITS=num_splits,
    )
    return out


# yaie: task 3
def merge_split_results(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Merge the partial results of split-K decode into the exact attention output.

    Split ``i`` attended to its own range of keys and produced its *normalised* output ``o_i`` and the
    natural-log log-sum-exp of its scores ``lse_i``. Then, with ``lse = log(sum_i exp(lse_i))``::

        out = sum_i exp(lse_i - lse) * o_i

    A split without keys has ``lse_i = -inf`` and weight 0 (whatever its ``o_i`` holds, even NaN); a row
    whose splits are all empty gets 0.

    Args:
        part_out: float32 ``[batch, num_heads, num_splits, head_dim]``.
        part_lse: float32 ``[batch, num_heads, num_splits]``.
        out: optional ``[batch, num_heads, head_dim]`` tensor to write into (its dtype wins).
        out_dtype: dtype of a new output (default float32).

    Returns:
        ``[batch, num_heads, head_dim]``.

    Raises:
        ValueError: wrong ranks, shapes, dtypes or devices.
    """
    for name, t, rank in (("part_out", part_out, 4), ("part_lse", part_lse, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a {rank}-D float32 tensor")
    batch, num_heads, num_splits, head_dim = part_out.shape
    if tuple(part_lse.shape) != (batch, num_heads, num_splits):
        raise ValueError(f"part_lse must be [batch, num_heads, num_splits] = {[batch, num_heads, num_splits]}, "
                         f"got {list(part_lse.shape)}")
    if part_out.device != part_lse.device:
        raise ValueError("part_out and part_lse must be on one device")
    if not 1 <= num_splits <= MAX_SPLITS or not 1 <= head_dim <= MAX_HEAD_DIM or batch * num_heads == 0:
        raise ValueError(f"unsupported sizes: {num_splits} splits (1..{MAX_SPLITS}), head_dim {head_dim}, "
                         f"batch {batch}, heads {num_heads}")
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), device=part_out.device, dtype=out_dtype or torch.float32)
    elif tuple(out.shape) != (batch, num_heads, head_dim) or out.device != part_out.device or out.stride(-1) != 1:
        raise ValueError(f"out must be [batch, num_heads, head_dim] = {[batch, num_heads, head_dim]} on "
                         f"{part_out.device} with a contiguous last axis")
    part_out = part_out if part_out.stride(-1) == 1 else part_out.contiguous()
    part_lse = part_lse if part_lse.stride(-1) == 1 else part_lse.contiguous()
    return _launch_merge(part_out, part_lse, out)


# yaie: task 2
def paged_attention_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
                            scale: float | None = None, num_splits: int | None = None,
                            validate: bool = True, sliding_window: int | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache: one new query token per sequence, in Triton.

    Args:
        q: ``[batch, num_heads, head_dim]``, the new token's query of every sequence (any strides with a
            contiguous last axis).
        k_cache, v_cache: ONE layer's cache, ``[num_blocks, block_size, num_kv_heads, head_dim]``, last axis
            contiguous (lesson 03's layout). ``num_heads`` must be a multiple of ``num_kv_heads``
            (grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
        block_tables: int32 ``[batch, max_blocks_per_seq]``: logical block ``j`` of sequence ``b`` is
            physical block ``block_tables[b, j]``; entries past a sequence's length may hold anything (they
            may be loaded with the others, but the blocks they name are never read).
        context_lens: int32 ``[batch]``: tokens of each sequence, 0 .. ``max_context_len`` (the lengths
            differ; 0 gives a zero output).
        max_context_len: an upper bound of ``context_lens`` (a Python int, so no sync is needed to plan).
            It also sizes the split ranges: a loose bound leaves splits empty.
        scale: multiplier of the scores, default ``head_dim ** -0.5``.
        num_splits: split-K factor: each sequence's context is cut into this many ranges handled in
            parallel and merged by log-sum-exp (:func:`merge_split_results`); 1 disables it; ``None``
            picks one with :func:`choose_num_splits`.
        validate: also check the *values* of ``context_lens`` and ``block_tables`` (one device sync); an
            engine that builds them itself may pass False.
        sliding_window: task 4. None: attend to the whole context. An int ``w >= 1``: each sequence attends
            to its last ``w`` tokens only (positions ``max(0, n - w) .. n - 1`` of ``n``), and the blocks
            before them are never read; the split ranges share out ``min(max_context_len, w)`` tokens.
            Until you do task 4, raise ``NotImplementedError("lesson 04, task 4: sliding window")`` when it
            is not None.

    Dtypes: float16, bfloat16 or float32, the same for q and the caches. Head dims 1..256 (padded to a
    power of two inside: 96 works), block sizes 8..128 (any size works). On the CPU the kernel runs in
    the Triton interpreter.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: as :func:`check_paged_inputs`; with ``validate``, context lengths outside
            ``0..max_context_len`` or used block ids outside the cache.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, num_splits,
                       sliding_window)
    q, scale, num_splits = _plan_decode(q, k_cache, block_tables, context_lens, max_context_len, scale, num_splits,
                                        validate, sliding_window)
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, num_splits,
                          sliding_window=sliding_window)


# yaie: solution-only
def _plan_decode(q, k_cache, block_tables, context_lens, max_context_len, scale, num_splits, validate,
                 sliding_window):
    """After the shape checks: the values checked (with ``validate``), q with a contiguous last axis, the
    scale, and the split count (chosen when None). Returns ``(q, scale, num_splits)``."""
    if validate:
        check_paged_values(k_cache, block_tables, context_lens, max_context_len)
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    span = max_context_len if sliding_window is None else min(max_context_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], span, num_sms(q.device))
    return q, scale, num_splits


# yaie: solution-only
# ----------------------------------------------------------------------------- RoPE and the cache write fused in
def paged_decode_with_rope_reference(q, k, v, cos, sin, position_ids, k_cache, v_cache, slot_mapping, block_tables,
                                     context_lens, scale=None, sliding_window=None):
    """Plain PyTorch :func:`paged_decode_with_rope`, out of place: lesson 02's reference of RoPE and the cache
    write, then :func:`paged_attention_reference`. Returns ``(out, k_cache, v_cache)``, the caches new tensors."""
    from solutions.kernels.gpu_elementwise import apply_rope_qk_store_kv_reference     # the reference's lesson 02
    q_rot, _, k_out, v_out = apply_rope_qk_store_kv_reference(q, k, v, cos, sin, position_ids.long(), k_cache,
                                                              v_cache, slot_mapping)
    out = paged_attention_reference(q_rot, k_out, v_out, block_tables, context_lens, scale, sliding_window)
    return out, k_out, v_out


# yaie: solution-only
def _check_rope_store_inputs(q, k, v, cos, sin, position_ids, k_cache, v_cache, slot_mapping) -> None:
    """Lesson 02's checks of the same inputs (``apply_rope_qk_store_kv``), and what this kernel adds: k and v
    with a contiguous last axis (lesson 02 copies other layouts), cos and sin of one layout (one stride)."""
    from solutions.kernels.gpu_elementwise import check_rope_store_inputs     # the reference's lesson 02
    check_rope_store_inputs(q, k, v, cos, sin, position_ids, k_cache, v_cache, slot_mapping)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last axis")
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must have one layout, got strides {cos.stride()} and {sin.stride()}")


# yaie: solution-only
def paged_decode_with_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           position_ids: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           max_context_len: int, scale: float | None = None, validate: bool = True,
                           sliding_window: int | None = None) -> torch.Tensor:
    """A decode step's RoPE, cache write and attention in ONE launch: lesson 02's ``apply_rope_qk_store_kv``
    then :func:`paged_attention_forward`.

    Not an exercise: the reference's fusion for the engine's decode steps (``yaie.model.paged``, where the
    reference serves lessons 02, 03 and 04). In a decode step RoPE and the cache write are one small kernel
    per layer whose cost is its launch and latency, not its bytes; here the decode kernel does them: each
    program rotates its group's queries, and the program whose range of the context holds the new token
    rotates its key and stores it and its value before it reads the cache.

    Args:
        q: ``[batch, num_heads, head_dim]``, the new tokens' queries BEFORE RoPE (not changed).
        k, v: ``[batch, num_kv_heads, head_dim]``, their keys (before RoPE, not changed) and values, q's
            dtype, contiguous last axis (views of the fused q/k/v product are fine).
        cos, sin: float32 ``[max_position, head_dim]`` rotate-half tables (lesson 01's), one shape.
        position_ids: int ``[batch]``: each new token's position.
        k_cache, v_cache: one layer's cache (as :func:`paged_attention_forward`); the new tokens' keys and
            values are stored at ``slot_mapping`` (int ``[batch]``).
        block_tables, context_lens, max_context_len, scale, validate, sliding_window: as
            :func:`paged_attention_forward`, with each new token the LAST of its sequence's context
            (``context_lens[b] - 1``), as in a decode step; a sequence of length 0 stores nothing.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: as :func:`paged_attention_forward`; k or v not ``[batch, num_kv_heads, head_dim]`` in q's
            dtype; an odd head_dim; cos/sin not float32 tables of one shape; position_ids or slot_mapping
            not integer ``[batch]``; tensors on different devices; and, for CPU tensors, positions outside
            the table or slots outside the cache. On a GPU those are not read back to the host (a sync per
            layer, not allowed in a CUDA graph): as lesson 02's RoPE, a position outside the table gives NaN
            and a slot outside the cache is skipped.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, None, sliding_window)
    _check_rope_store_inputs(q, k, v, cos, sin, position_ids, k_cache, v_cache, slot_mapping)
    q, scale, num_splits = _plan_decode(q, k_cache, block_tables, context_lens, max_context_len, scale, None,
                                        validate, sliding_window)
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, num_splits,
                          sliding_window=sliding_window, rope=(k, v, cos, sin, position_ids, slot_mapping))
