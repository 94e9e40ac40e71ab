"""Prototype, measured by scripts/bench_decode_chain.py: a batch-1 Llama decode layer as ONE Gluon kernel (Hopper).

One program per SM. Each program's share of the layer's weights is a fixed list of tiles (8 rows x 1024 columns,
16 KB) across the layer's four products (q/k/v, output, gate/up, down), streamed by TMA through a ring of S
shared-memory stages. Loads of weights depend on nothing computed in the step, so the ring keeps S - 1 tiles in
flight across the grid-wide barriers that separate the products (and across the attention): the memory never
waits for a barrier. Each product's input vector (normed row, attention output, SiLU-and-mul) is built once per
program into shared memory after its barrier, and every tile reads its columns from there.

The attention runs in one program per query head (32): the keys and values already in the cache are copied into
its shared memory at the kernel's start (cp.async), so after the barrier only the step's own q/k/v are read.

With WS=True a producer warp (warp specialisation) issues the copies as soon as a slot is free, so the stream
does not stop while the other warps multiply or wait at a barrier. :func:`decode_layers` runs several layers in
one launch (each product's weights stacked along the rows, a grid-wide barrier between layers).

Rows are handed out in units of 8 (every program gets the same number of units within one, so the products stay
balanced): q/k/v 384 units, output 256, gate/up 1024 pairs (8 gate rows and the 8 matching up rows), down 256.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_sync_threads = getattr(gl, "thread_barrier", None) or gl.barrier

ROWS, BOX = 8, 256          # a TMA box: 8 rows x 256 columns (4 KB)
FLAG_AT = gl.constexpr(4096)  # the flags of BARRIER 2, after the counters (a counters tensor of 8192 int32)
COUNTERS = 8192
EPOCH_AT = gl.constexpr(8000)  # the launch count, for the flags of LL words


@gluon.jit
def _stamp(times_ptr, i, TIMING: gl.constexpr):
    if TIMING:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
        zero = gl.zeros([32 * 8], gl.int32, layout=lay)
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [zero], dtype=gl.int64, is_pure=False,
                                      pack=1)
        idx = gl.arange(0, 32 * 8, layout=lay)
        gl.store(times_ptr + gl.program_id(0) * 16 + i + 0 * idx, t, mask=idx == 0)


@gluon.jit
def _arrive(counter):
    _sync_threads()                                   # every thread's stores issued before the release
    gl.atomic_add(counter, 1, sem="release", scope="gpu")


@gluon.jit
def _wait(counter, n):
    seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < n:
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    _sync_threads()


@gluon.jit
def _grid_sync(counters, b, n, BARRIER: gl.constexpr, SPACE: gl.constexpr):
    # Grid-wide barrier number b. BARRIER 0: arrive with a release atomic, poll the same counter with acquire
    # atomics (read-modify-writes, serialised at the counter's L2 slice behind the arrivals). 1: poll with plain
    # volatile loads, then one acquire atomic (it reads the last value of the counter's modification order, so it
    # synchronises with every release increment). 2: the last program to arrive (its acq_rel increment returns
    # n - 1) sets a flag in another cache line with a release exchange; the others poll that flag with loads, so
    # no poll waits behind an arrival. Counters (and flags, FLAG_AT ints after them) lie SPACE ints apart.
    counter = counters + b * SPACE
    flag = counters + FLAG_AT + b * SPACE
    if BARRIER == 0:
        _arrive(counter)
        _wait(counter, n)
    elif BARRIER == 1:
        _arrive(counter)
        seen = gl.load(counter, volatile=True)
        while seen < n:
            seen = gl.load(counter, volatile=True)
        gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        _sync_threads()
    else:
        _sync_threads()
        if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n - 1:
            gl.atomic_xchg(flag, 1, sem="release", scope="gpu")
        else:
            seen = gl.load(flag, volatile=True)
            while seen == 0:
                seen = gl.load(flag, volatile=True)
            gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        _sync_threads()


@gluon.jit
def _issue(t_all, bars, ring, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD,
           S: gl.constexpr, NB: gl.constexpr, SA: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr,
           SE: gl.constexpr, INTER: gl.constexpr, per_layer=0, QKV: gl.constexpr = 0, HIDDEN: gl.constexpr = 0,
           FUSE: gl.constexpr = False):
    # Tile t_all of this program's list: NB boxes of one unit's 8 rows, columns stage * NB * BOX onwards. With
    # per_layer (the tiles of one layer) the list runs over layers whose weights are stacked along the rows.
    slot = t_all % S
    bar = bars.index(slot)
    mbarrier.expect(bar, NB * 8 * 256 * 2)
    layer = 0
    t = t_all
    if per_layer > 0:
        layer = t_all // per_layer
        t = t_all % per_layer
    if t < nA:
        row = (a0 + t // SA) * 8 + layer * QKV
        col = (t % SA) * (NB * 256)
        for b in gl.static_range(NB):
            _tma_load(dq, [row, col + b * 256], bar, ring.index(slot * NB + b))
    elif t < nA + nC:
        i = t - nA
        row = (c0 + i // SC) * 8 + layer * HIDDEN
        col = (i % SC) * (NB * 256)
        for b in gl.static_range(NB):
            _tma_load(do, [row, col + b * 256], bar, ring.index(slot * NB + b))
    elif t < nA + nC + nD:
        i = t - nA - nC
        within = i % (2 * SD)
        row = (d0 + i // (2 * SD)) * 8 + (within >= SD).to(gl.int32) * INTER + layer * (2 * INTER)
        col = (within % SD) * (NB * 256)
        for b in gl.static_range(NB):
            _tma_load(dgu, [row, col + b * 256], bar, ring.index(slot * NB + b))
    elif FUSE:   # dd: the down product's weight transposed, [INTER, HIDDEN] a layer; the rows of this program's units
        i = t - nA - nC - nD
        row = (d0 + i // SA) * 8 + layer * INTER
        col = (i % SA) * (NB * 256)
        for b in gl.static_range(NB):
            _tma_load(dd, [row, col + b * 256], bar, ring.index(slot * NB + b))
    else:
        i = t - nA - nC - nD
        row = (e0 + i // SE) * 8 + layer * HIDDEN
        col = (i % SE) * (NB * 256)
        for b in gl.static_range(NB):
            _tma_load(dd, [row, col + b * 256], bar, ring.index(slot * NB + b))


@gluon.jit
def _consume(t, acc, bars, ring, vec, stage, S: gl.constexpr, NB: gl.constexpr, L: gl.constexpr):
    slot = t % S
    mbarrier.wait(bars.index(slot), (t // S) & 1)
    for b in gl.static_range(NB):
        w = ring.index(slot * NB + b).load(L).to(gl.float32)
        v = vec.index(stage * NB + b).load(L).to(gl.float32)      # [1, 256]
        acc += w * v
    return acc


@gluon.jit
def _step_tile(t, total, acc, bars, ring, vec, stage, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD,
               S: gl.constexpr, NB: gl.constexpr, SA: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr,
               SE: gl.constexpr, INTER: gl.constexpr, L: gl.constexpr):
    _sync_threads()                     # every warp is done with the slot the next issue refills
    if t + S - 1 < total:
        _issue(t + S - 1, bars, ring, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD, S, NB, SA, SC, SD, SE, INTER)
    return _consume(t, acc, bars, ring, vec, stage, S, NB, L)


@gluon.jit
def _vector_offsets(N: gl.constexpr, L: gl.constexpr):
    # An N-vector as [N / 256, 256] (row r: the columns of chunk r).
    r = gl.arange(0, N // 256, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, L))
    return gl.expand_dims(r, 1) * 256 + gl.expand_dims(c, 0)


@gluon.jit
def _take_tile(t, total, acc, bars, empty, ring, vec, stage, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD,
               S: gl.constexpr, NB: gl.constexpr, SA: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr,
               SE: gl.constexpr, INTER: gl.constexpr, L: gl.constexpr, WS: gl.constexpr):
    if WS:   # a producer warp refills the slot once every consumer warp has read it
        acc = _consume(t, acc, bars, ring, vec, stage, S, NB, L)
        _sync_threads()
        mbarrier.arrive(empty.index(t % S), count=1)
    else:
        acc = _step_tile(t, total, acc, bars, ring, vec, stage, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD,
                         S, NB, SA, SC, SD, SE, INTER, L)
    return acc


@gluon.jit
def _take_down_t(t, bars, empty, ring, part, act8, col_block, S: gl.constexpr, NB: gl.constexpr, LD: gl.constexpr):
    # A tile of the transposed down weight: 8 rows (this program's activations act8, [8, 1]) x NB * 256 output
    # columns. part[c] += sum_r w[r, c] * act[r]; each thread holds one column's 8 rows, so the sum stays in it.
    slot = t % S
    mbarrier.wait(bars.index(slot), (t // S) & 1)
    for b in gl.static_range(NB):
        w = ring.index(slot * NB + b).load(LD).to(gl.float32)
        p = part.index(col_block * NB + b)
        p.store(p.load(gl.SliceLayout(0, LD)) + gl.sum(w * act8, axis=0))
    _sync_threads()
    mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def _producer(bars, empty, ring, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD, total, n_layers,
              S: gl.constexpr, NB: gl.constexpr, SA: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr,
              SE: gl.constexpr, INTER: gl.constexpr, QKV: gl.constexpr, HIDDEN: gl.constexpr, FUSE: gl.constexpr):
    # The warp-specialised producer: every tile of the program's list (all layers), as soon as its slot is free.
    for t in range(total * n_layers):
        if t >= S:
            mbarrier.wait(empty.index(t % S), ((t // S) - 1) & 1)
        _issue(t, bars, ring, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD, S, NB, SA, SC, SD, SE, INTER, total,
               QKV, HIDDEN, FUSE)


@gluon.jit
def _norm_to_smem(x_ptr, res_ptr, res_out_ptr, n_ptr, vec, eps, HIDDEN: gl.constexpr, L: gl.constexpr):
    # vec[:HIDDEN] = bf16(rms_norm(bf16(x + res)) * n); program 0 stores bf16(x + res) (the new residual).
    offs = _vector_offsets(HIDDEN, L)
    x = gl.load(x_ptr + offs).to(gl.bfloat16).to(gl.float32)       # an fp32 sum (FUSE) rounded as a product's
    h = (x + gl.load(res_ptr + offs).to(gl.float32)).to(gl.bfloat16)
    if gl.program_id(0) == 0:
        gl.store(res_out_ptr + offs, h)
    hf = h.to(gl.float32)
    inv_rms = 1.0 / gl.sqrt(gl.sum(gl.sum(hf * hf, axis=1), axis=0) / HIDDEN + eps)
    normed = (hf * inv_rms * gl.load(n_ptr + offs).to(gl.float32)).to(gl.bfloat16)
    vec.slice(0, HIDDEN // 256, dim=0).store(normed)


@gluon.jit
def _store_ll(ptr, values, flag):
    # LL words (as NCCL's LL protocol): each value as fp32 bits in the low half of a 64-bit word and the flag in the
    # high half, stored at once. A reader that sees the flag sees the value: no fence, no barrier.
    bits = values.to(gl.float32).to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF
    gl.store(ptr, bits | (flag.to(gl.int64) << 32))


@gluon.jit
def _load_ll(ptr, flag):
    # Poll LL words until every flag is this one (re-reading only the words not yet there); the fp32 values.
    w = gl.load(ptr, volatile=True)
    missing = gl.sum(gl.sum(((w >> 32).to(gl.int32) != flag).to(gl.int32), axis=1), axis=0)
    while missing > 0:
        w = gl.load(ptr, mask=(w >> 32).to(gl.int32) != flag, other=w, volatile=True)
        missing = gl.sum(gl.sum(((w >> 32).to(gl.int32) != flag).to(gl.int32), axis=1), axis=0)
    return (w & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def _norm_ll_to_smem(x_ll, res_ptr, res_out_ptr, n_ptr, vec, eps, flag, HIDDEN: gl.constexpr, L: gl.constexpr):
    # _norm_to_smem with x read from LL words (polled until this flag).
    offs = _vector_offsets(HIDDEN, L)
    x = _load_ll(x_ll + offs, flag).to(gl.bfloat16).to(gl.float32)
    h = (x + gl.load(res_ptr + offs).to(gl.float32)).to(gl.bfloat16)
    if gl.program_id(0) == 0:
        gl.store(res_out_ptr + offs, h)
    hf = h.to(gl.float32)
    inv_rms = 1.0 / gl.sqrt(gl.sum(gl.sum(hf * hf, axis=1), axis=0) / HIDDEN + eps)
    normed = (hf * inv_rms * gl.load(n_ptr + offs).to(gl.float32)).to(gl.bfloat16)
    vec.slice(0, HIDDEN // 256, dim=0).store(normed)


@gluon.jit
def _copy_to_smem(src_ptr, vec, N: gl.constexpr, L: gl.constexpr):
    vec.slice(0, N // 256, dim=0).store(gl.load(src_ptr + _vector_offsets(N, L)))


@gluon.jit
def _prefetch_context(k_cache, v_cache, table_ptr, lens_ptr, k_smem, v_smem, stride_kb, stride_kt, stride_kh,
                      kv_head, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, KV_BOUND: gl.constexpr,
                      KL2: gl.constexpr, first_token=0):
    # The keys and values already in the cache (every token but the step's own) do not depend on the step:
    # copy them into shared memory now (cp.async), while the q/k/v product runs, so that the attention after
    # the barrier reads them from there instead of waiting on memory that the weight stream keeps busy.
    t = first_token + gl.arange(0, KV_BOUND, layout=gl.SliceLayout(1, KL2))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, KL2))
    ok = t < gl.load(lens_ptr) - 1
    blk = gl.load(table_ptr + t // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
    off = gl.expand_dims(blk * stride_kb + (t % BLOCK_SIZE) * stride_kt + kv_head * stride_kh, 1) \
        + gl.expand_dims(d, 0)
    mask = gl.expand_dims(ok, 1) & gl.expand_dims(d < HEAD_DIM, 0)
    async_copy.async_copy_global_to_shared(k_smem, k_cache + off, mask=mask)
    async_copy.async_copy_global_to_shared(v_smem, v_cache + off, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _attend(qkv_ptr, attn_ptr, k_cache, v_cache, k_smem, v_smem, cos, sin, slot, old,
            stride_kb, stride_kt, stride_kh, scale_log2, head,
            Q_SIZE: gl.constexpr, KV_SIZE: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
            BLOCK_SIZE: gl.constexpr, KV_BOUND: gl.constexpr, P3: gl.constexpr, times_ptr, TIMING: gl.constexpr):
    # RoPE, K/V write and attention of one query head (GROUP query heads share a KV head): the step's own token from registers,
    # the others from shared memory (:func:`_prefetch_context`).
    QL: gl.constexpr = gl.SliceLayout(1, P3)        # [1, HEAD_DIM]
    KL: gl.constexpr = gl.SliceLayout(0, P3)        # [64 tokens, HEAD_DIM]
    SL: gl.constexpr = gl.SliceLayout(2, P3)        # [1, 64 tokens]
    half: gl.constexpr = HEAD_DIM // 2
    kv_head = head // GROUP
    g = gl.arange(0, 1, layout=gl.SliceLayout(1, QL))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, QL))
    heads = head + g
    first = d < half
    partner = gl.where(first, d + half, d - half)
    q_off = gl.expand_dims(heads, 1) * HEAD_DIM
    qx = gl.load(qkv_ptr + q_off + gl.expand_dims(d, 0)).to(gl.float32)
    qp = gl.load(qkv_ptr + q_off + gl.expand_dims(partner, 0)).to(gl.float32)
    q = gl.where(gl.expand_dims(first, 0), qx * gl.expand_dims(cos, 0) - qp * gl.expand_dims(sin, 0),
                 qx * gl.expand_dims(cos, 0) + qp * gl.expand_dims(sin, 0))
    q = q.to(gl.bfloat16).to(gl.float32)
    k_ptr = qkv_ptr + Q_SIZE + kv_head * HEAD_DIM
    kx = gl.load(k_ptr + d).to(gl.float32)
    kp = gl.load(k_ptr + partner).to(gl.float32)
    k_new = gl.where(first, kx * cos - kp * sin, kx * cos + kp * sin).to(gl.bfloat16)
    v_new = gl.load(qkv_ptr + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + d)
    cache_off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kv_head * stride_kh + d
    gl.store(k_cache + cache_off, k_new)
    gl.store(v_cache + cache_off, v_new)
    _stamp(times_ptr, 14, TIMING)

    # The step's own token starts the running softmax: m = its score, l = 1, acc = its value.
    m = gl.sum(q * gl.expand_dims(k_new.to(gl.float32), 0), axis=1) * scale_log2
    l = gl.full([1], 1.0, gl.float32, layout=gl.SliceLayout(1, QL))
    acc = gl.zeros([1, HEAD_DIM], gl.float32, layout=QL) + gl.expand_dims(v_new.to(gl.float32), 0)
    m = gl.convert_layout(m, gl.SliceLayout(1, SL))
    l = gl.convert_layout(l, gl.SliceLayout(1, SL))
    async_copy.wait_group(0)
    _sync_threads()
    _stamp(times_ptr, 15, TIMING)
    for ti in gl.static_range(KV_BOUND // 64):
        k = k_smem.slice(ti * 64, 64, dim=0).load(KL).to(gl.float32)
        v = v_smem.slice(ti * 64, 64, dim=0).load(KL).to(gl.float32)
        ok_kv = gl.expand_dims(ti * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, KL)) < old, 1)
        v = gl.where(ok_kv, v, 0.0)
        s = gl.sum(gl.expand_dims(q, 1) * gl.expand_dims(k, 0), axis=2)
        ok = gl.expand_dims(ti * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, SL)) < old, 0)
        s = gl.where(ok, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l = l * alpha + gl.sum(p, axis=1)
        p = p.to(gl.bfloat16).to(gl.float32)
        pv = gl.sum(gl.expand_dims(p, 2) * gl.expand_dims(v, 0), axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, QL)), 1) + pv
        m = m_new
    out = acc / gl.expand_dims(gl.convert_layout(l, gl.SliceLayout(1, QL)), 1)
    gl.store(attn_ptr + q_off + gl.expand_dims(d, 0), out.to(gl.bfloat16))


@gluon.jit
def _attend_split(qkv_ptr, part_ptr, k_cache, v_cache, k_smem, v_smem, cos, sin, slot, old,
                  stride_kb, stride_kt, stride_kh, scale_log2, head, split,
                  Q_SIZE: gl.constexpr, KV_SIZE: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_SIZE: gl.constexpr, NSPLIT: gl.constexpr, P3: gl.constexpr):
    # One query head over one split of 64 cached tokens (in shared memory), plus the step's own token in the split
    # that holds its position. Writes the unnormalised partial (acc, running max m, running sum l) to part_ptr:
    # acc [heads * NSPLIT, HEAD_DIM], then m and l [heads * NSPLIT] each.
    QL: gl.constexpr = gl.SliceLayout(1, P3)
    KL: gl.constexpr = gl.SliceLayout(0, P3)
    SL: gl.constexpr = gl.SliceLayout(2, P3)
    half: gl.constexpr = HEAD_DIM // 2
    kv_head = head // GROUP
    g = gl.arange(0, 1, layout=gl.SliceLayout(1, QL))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, QL))
    first = d < half
    partner = gl.where(first, d + half, d - half)
    q_off = gl.expand_dims(head + g, 1) * HEAD_DIM
    qx = gl.load(qkv_ptr + q_off + gl.expand_dims(d, 0)).to(gl.float32)
    qp = gl.load(qkv_ptr + q_off + gl.expand_dims(partner, 0)).to(gl.float32)
    q = gl.where(gl.expand_dims(first, 0), qx * gl.expand_dims(cos, 0) - qp * gl.expand_dims(sin, 0),
                 qx * gl.expand_dims(cos, 0) + qp * gl.expand_dims(sin, 0))
    q = q.to(gl.bfloat16).to(gl.float32)
    k_ptr = qkv_ptr + Q_SIZE + kv_head * HEAD_DIM
    kx = gl.load(k_ptr + d).to(gl.float32)
    kp = gl.load(k_ptr + partner).to(gl.float32)
    k_new = gl.where(first, kx * cos - kp * sin, kx * cos + kp * sin).to(gl.bfloat16)
    v_new = gl.load(qkv_ptr + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + d)
    has_new = split == old // 64
    if has_new:
        cache_off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kv_head * stride_kh + d
        gl.store(k_cache + cache_off, k_new)
        gl.store(v_cache + cache_off, v_new)
    s_new = gl.sum(q * gl.expand_dims(k_new.to(gl.float32), 0), axis=1) * scale_log2      # [1]
    m = gl.convert_layout(gl.where(has_new, s_new, float("-inf")), gl.SliceLayout(1, SL))
    l = gl.convert_layout(gl.where(has_new, 1.0, 0.0) + 0.0 * s_new, gl.SliceLayout(1, SL))
    acc = gl.where(has_new, gl.expand_dims(v_new.to(gl.float32), 0), 0.0) + 0.0 * q
    async_copy.wait_group(0)
    _sync_threads()
    k = k_smem.load(KL).to(gl.float32)
    v = v_smem.load(KL).to(gl.float32)
    tok = split * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, KL))
    v = gl.where(gl.expand_dims(tok < old, 1), v, 0.0)
    sc = gl.sum(gl.expand_dims(q, 1) * gl.expand_dims(k, 0), axis=2)
    ok = gl.expand_dims(split * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, SL)) < old, 0)
    sc = gl.where(ok, sc * scale_log2, float("-inf"))
    m_new = gl.maximum(m, gl.max(sc, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)       # a split with no token at all stays empty
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(sc - gl.expand_dims(m_safe, 1))
    l = l * alpha + gl.sum(p, axis=1)
    p = p.to(gl.bfloat16).to(gl.float32)
    pv = gl.sum(gl.expand_dims(p, 2) * gl.expand_dims(v, 0), axis=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, QL)), 1) + pv
    row = head * NSPLIT + split
    gl.store(part_ptr + row * HEAD_DIM + gl.expand_dims(d, 0) + 0 * q_off, acc)
    ml_ptr = part_ptr + (Q_SIZE // HEAD_DIM) * NSPLIT * HEAD_DIM
    ms = gl.arange(0, 1, layout=gl.SliceLayout(1, SL))
    gl.store(ml_ptr + row + ms, m_new)
    gl.store(ml_ptr + (Q_SIZE // HEAD_DIM) * NSPLIT + row + ms, l)


@gluon.jit
def _merge_to_smem(part_ptr, vec, Q_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, NSPLIT: gl.constexpr,
                   L: gl.constexpr):
    # vec[:Q_SIZE] = the attention output, each head's splits merged (log-sum-exp weights), rounded to bf16.
    r = gl.arange(0, Q_SIZE // 256, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, L))
    col = gl.expand_dims(r, 1) * 256 + gl.expand_dims(c, 0)        # [Q_SIZE / 256, 256]
    head = col // HEAD_DIM
    d = col % HEAD_DIM
    ml_ptr = part_ptr + (Q_SIZE // HEAD_DIM) * NSPLIT * HEAD_DIM
    l_ptr = ml_ptr + (Q_SIZE // HEAD_DIM) * NSPLIT
    top = gl.full([Q_SIZE // 256, 256], float("-inf"), gl.float32, layout=L)
    for sp in gl.static_range(NSPLIT):
        top = gl.maximum(top, gl.load(ml_ptr + head * NSPLIT + sp))
    num = gl.zeros([Q_SIZE // 256, 256], gl.float32, layout=L)
    den = gl.zeros([Q_SIZE // 256, 256], gl.float32, layout=L)
    for sp in gl.static_range(NSPLIT):
        w = gl.exp2(gl.load(ml_ptr + head * NSPLIT + sp) - top)
        num += w * gl.load(part_ptr + (head * NSPLIT + sp) * HEAD_DIM + d)
        den += w * gl.load(l_ptr + head * NSPLIT + sp)
    vec.slice(0, Q_SIZE // 256, dim=0).store((num / den).to(gl.bfloat16))


@gluon.jit
def _layer_body(part_ptr, x_ptr, res_ptr, n1_ptr, n2_ptr, k_cache, v_cache, qkv_buf, attn_buf, o_buf, act_buf, res_a, res_b,
                out_ptr, counters, stride_kb, stride_kt, stride_kh, scale_log2, eps, bars, empty, ring, vec, vec_chunks,
                k_smem, v_smem, cos, sin, slot, old, table_ptr, lens_ptr, stride_kl, n_layers, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD, nE, total, times_ptr,
                HIDDEN: gl.constexpr, INTER: gl.constexpr, Q_SIZE: gl.constexpr, KV_SIZE: gl.constexpr,
                KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, KV_BOUND: gl.constexpr,
                S: gl.constexpr, NB: gl.constexpr, SA: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr,
                SE: gl.constexpr, L: gl.constexpr, P3: gl.constexpr, KL2: gl.constexpr, TIMING: gl.constexpr, WS: gl.constexpr,
                SPLIT: gl.constexpr, BARRIER: gl.constexpr, SPACE: gl.constexpr, FUSE: gl.constexpr, acc_ptr, part, LL: gl.constexpr, o_ll, epoch):
    # The layer's phases (the module docstring), in the kernel's warps (the default partition with WS).
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    HEADS: gl.constexpr = Q_SIZE // HEAD_DIM
    OUT_ROWS: gl.constexpr = gl.SliceLayout(1, L)
    rows8 = gl.arange(0, 8, layout=OUT_ROWS)
    LD: gl.constexpr = gl.BlockedLayout([8, 1], [1, 32], [1, 8], [0, 1])      # [8, 256], a column a thread
    LV: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    if FUSE:
        for j in gl.static_range(HIDDEN // 256):
            part.index(j).store(gl.zeros([256], gl.float32, LV))
        _sync_threads()
    for layer in range(n_layers):
        base = layer * total
        x_src = x_ptr
        if FUSE:   # layer l reads the sum in acc[l] and adds its down product into acc[l + 1], zeroed here first
            x_src = acc_ptr + layer * HIDDEN
            if pid == 0:
                gl.store(acc_ptr + (layer + 1) * HIDDEN + _vector_offsets(HIDDEN, L), gl.zeros([HIDDEN // 256, 256], gl.float32, L))
        n1 = n1_ptr + layer * HIDDEN
        n2 = n2_ptr + layer * HIDDEN
        kc = k_cache + layer * stride_kl
        vc = v_cache + layer * stride_kl
        NSPLIT: gl.constexpr = KV_BOUND // 64
        if SPLIT:
            if pid < HEADS * NSPLIT:
                _prefetch_context(kc, vc, table_ptr, lens_ptr, k_smem, v_smem, stride_kb, stride_kt, stride_kh,
                                  (pid // NSPLIT) // (HEADS // KV_HEADS), HEAD_DIM, BLOCK_SIZE, 64, KL2,
                                  (pid % NSPLIT) * 64)
        else:
            if pid < HEADS:
                _prefetch_context(kc, vc, table_ptr, lens_ptr, k_smem, v_smem, stride_kb, stride_kt, stride_kh,
                                  pid // (HEADS // KV_HEADS), HEAD_DIM, BLOCK_SIZE, KV_BOUND, KL2)
        _stamp(times_ptr, 0, TIMING)
        acc = gl.zeros([8, 256], gl.float32, layout=L)
        # A: rms_norm(x + residual) -> q/k/v rows.
        _norm_to_smem(x_src, res_ptr, res_a, n1, vec, eps, HIDDEN, L)
        _sync_threads()
        _stamp(times_ptr, 1, TIMING)
        for i in range(nA):
            stage = i % SA
            acc = acc * (stage != 0).to(gl.float32)
            acc = _take_tile(base + i, total, acc, bars, empty, ring, vec_chunks, stage, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD,
                             S, NB, SA, SC, SD, SE, INTER, L, WS)
            if stage == SA - 1:
                gl.store(qkv_buf + (a0 + i // SA) * 8 + rows8, gl.sum(acc, axis=1).to(gl.bfloat16))
        _stamp(times_ptr, 2, TIMING)
        # B: attention (one program per query head) while the output product's first tiles stream in.
        _grid_sync(counters, layer * 5 + 0, G, BARRIER, SPACE)
        _stamp(times_ptr, 3, TIMING)
        if SPLIT:
            if pid < HEADS * NSPLIT:
                _attend_split(qkv_buf, part_ptr, kc, vc, k_smem, v_smem, cos, sin, slot, old,
                              stride_kb, stride_kt, stride_kh, scale_log2, pid // NSPLIT, pid % NSPLIT,
                              Q_SIZE, KV_SIZE, Q_SIZE // HEAD_DIM // KV_HEADS, HEAD_DIM, BLOCK_SIZE, NSPLIT, P3)
        elif pid < HEADS:
            _attend(qkv_buf, attn_buf, kc, vc, k_smem, v_smem, cos, sin, slot, old,
                    stride_kb, stride_kt, stride_kh, scale_log2, pid,
                    Q_SIZE, KV_SIZE, Q_SIZE // HEAD_DIM // KV_HEADS, HEAD_DIM, BLOCK_SIZE, KV_BOUND, P3, times_ptr, TIMING)
        _stamp(times_ptr, 4, TIMING)
        _grid_sync(counters, layer * 5 + 1, G, BARRIER, SPACE)
        _stamp(times_ptr, 5, TIMING)

        # C: output product.
        if SPLIT:
            _merge_to_smem(part_ptr, vec, Q_SIZE, HEAD_DIM, NSPLIT, L)
        else:
            _copy_to_smem(attn_buf, vec, Q_SIZE, L)
        _sync_threads()
        _stamp(times_ptr, 6, TIMING)
        for i in range(nC):
            stage = i % SC
            acc = acc * (stage != 0).to(gl.float32)
            acc = _take_tile(base + nA + i, total, acc, bars, empty, ring, vec_chunks, stage, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD,
                             S, NB, SA, SC, SD, SE, INTER, L, WS)
            if stage == SC - 1:
                if LL:    # the output product's rows as LL words: the norm below polls them, no barrier
                    _store_ll(o_ll + (c0 + i // SC) * 8 + rows8, gl.sum(acc, axis=1).to(gl.bfloat16),
                              epoch * 64 + layer * 4 + 1)
                else:
                    gl.store(o_buf + (c0 + i // SC) * 8 + rows8, gl.sum(acc, axis=1).to(gl.bfloat16))
        _stamp(times_ptr, 7, TIMING)
        # D: rms_norm(o + r1) -> gate/up rows, SiLU-and-mul.
        if LL:
            _stamp(times_ptr, 8, TIMING)
            _norm_ll_to_smem(o_ll, res_a, res_b, n2, vec, eps, epoch * 64 + layer * 4 + 1, HIDDEN, L)
        else:
            _grid_sync(counters, layer * 5 + 2, G, BARRIER, SPACE)
            _stamp(times_ptr, 8, TIMING)
            _norm_to_smem(o_buf, res_a, res_b, n2, vec, eps, HIDDEN, L)
        _sync_threads()
        _stamp(times_ptr, 9, TIMING)
        gate = gl.zeros([8], gl.float32, layout=OUT_ROWS)
        for i in range(nD):
            within = i % (2 * SD)
            stage = within % SD
            acc = acc * (stage != 0).to(gl.float32)
            acc = _take_tile(base + nA + nC + i, total, acc, bars, empty, ring, vec_chunks, stage, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC,
                             nD, S, NB, SA, SC, SD, SE, INTER, L, WS)
            if within == SD - 1:
                gate = gl.sum(acc, axis=1).to(gl.bfloat16).to(gl.float32)
            if within == 2 * SD - 1:
                up = gl.sum(acc, axis=1).to(gl.bfloat16).to(gl.float32)
                gl.store(act_buf + (d0 + i // (2 * SD)) * 8 + rows8, (gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16))
        _stamp(times_ptr, 10, TIMING)
        if FUSE:
            # E: this program's activations times its rows of the transposed down weight: a partial sum over every
            # output, added into acc[layer + 1] with atomics. No barrier: the rows are the program's own.
            _sync_threads()                       # the act rows this program stored are visible to all its warps
            _stamp(times_ptr, 11, TIMING)
            _stamp(times_ptr, 12, TIMING)
            SH: gl.constexpr = HIDDEN // (NB * 256)
            for i in range(nE):
                act8 = gl.load(act_buf + (d0 + i // SH) * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, LD)))
                _take_down_t(base + nA + nC + nD + i, bars, empty, ring, part,
                             gl.expand_dims(act8.to(gl.float32), 1), i % SH, S, NB, LD)
            cols = gl.arange(0, 256, layout=LV)
            for j in gl.static_range(HIDDEN // 256):
                gl.atomic_add(acc_ptr + (layer + 1) * HIDDEN + j * 256 + cols, part.index(j).load(LV), sem="relaxed",
                              scope="gpu")
                part.index(j).store(gl.zeros([256], gl.float32, LV))
            _sync_threads()
        else:
            # E: down product.
            _grid_sync(counters, layer * 5 + 3, G, BARRIER, SPACE)
            _stamp(times_ptr, 11, TIMING)
            _copy_to_smem(act_buf, vec, INTER, L)
            _sync_threads()
            _stamp(times_ptr, 12, TIMING)
            for i in range(nE):
                stage = i % SE
                acc = acc * (stage != 0).to(gl.float32)
                acc = _take_tile(base + nA + nC + nD + i, total, acc, bars, empty, ring, vec_chunks, stage, dq, do, dgu, dd, a0, c0, d0, e0,
                                 nA, nC, nD, S, NB, SA, SC, SD, SE, INTER, L, WS)
                if stage == SE - 1:
                    gl.store(out_ptr + (e0 + i // SE) * 8 + rows8, gl.sum(acc, axis=1).to(gl.bfloat16))


        _stamp(times_ptr, 13, TIMING)
        if layer + 1 < n_layers:          # the next layer's norm reads every program's rows of this one
            _grid_sync(counters, layer * 5 + 4, G, BARRIER, SPACE)


@gluon.jit
def _decode_layer_kernel(
    part_ptr, dq, do, dgu, dd, x_ptr, res_ptr, n1_ptr, n2_ptr,
    k_cache, v_cache, table_ptr, lens_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
    qkv_buf, attn_buf, o_buf, act_buf, res_a, res_b, out_ptr, counters,
    stride_kb, stride_kt, stride_kh, stride_cos, scale_log2, eps, stride_kl, n_layers,
    HIDDEN: gl.constexpr, INTER: gl.constexpr, Q_SIZE: gl.constexpr, KV_SIZE: gl.constexpr,
    KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    S: gl.constexpr, NB: gl.constexpr, KV_BOUND: gl.constexpr, times_ptr=None, TIMING: gl.constexpr = False,
    WS: gl.constexpr = False, SPLIT: gl.constexpr = False, BARRIER: gl.constexpr = 0, SPACE: gl.constexpr = 1,
    FUSE: gl.constexpr = False, acc_ptr=None, LL: gl.constexpr = False, o_ll=None,
):
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    QKV: gl.constexpr = Q_SIZE + 2 * KV_SIZE
    SA: gl.constexpr = HIDDEN // (NB * 256)      # tiles a unit of each product
    SC: gl.constexpr = Q_SIZE // (NB * 256)
    SD: gl.constexpr = HIDDEN // (NB * 256)
    SE: gl.constexpr = INTER // (NB * 256)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])           # an [8, 256] box
    P3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, 8, 1], [2, 1, 0])       # [1 head, 64 tokens, d]
    KL2: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    OUT_ROWS: gl.constexpr = gl.SliceLayout(1, L)

    # This program's units of 8 rows in each product.
    a0 = pid * (QKV // 8) // G
    a1 = (pid + 1) * (QKV // 8) // G
    c0 = pid * (HIDDEN // 8) // G
    c1 = (pid + 1) * (HIDDEN // 8) // G
    d0 = pid * (INTER // 8) // G
    d1 = (pid + 1) * (INTER // 8) // G
    e0 = pid * (HIDDEN // 8) // G
    e1 = (pid + 1) * (HIDDEN // 8) // G
    nA = (a1 - a0) * SA
    nC = (c1 - c0) * SC
    nD = (d1 - d0) * 2 * SD
    nE = (e1 - e0) * SE
    if FUSE:
        nE = (d1 - d0) * SA           # the down^T rows of this program's gate/up units, SA tiles each
    total = nA + nC + nD + nE

    W_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, 256], gl.bfloat16)
    ring = gl.allocate_shared_memory(gl.bfloat16, [S * NB, 8, 256], W_SHARED)
    VEC_SHARED: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    vec = gl.allocate_shared_memory(gl.bfloat16, [INTER // 256, 256], VEC_SHARED)
    vec_chunks = vec._reinterpret(gl.bfloat16, [INTER // 256, 1, 256], VEC_SHARED)     # chunk i: [1, 256]
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(bars.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for j in gl.static_range(S - 1):
        if (j < total) & (not WS):
            _issue(j, bars, ring, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD, S, NB, SA, SC, SD, SE, INTER)

    KV_SHARED: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PART_ROWS: gl.constexpr = HIDDEN // 256 if FUSE else 1
    part = gl.allocate_shared_memory(gl.float32, [PART_ROWS, 256], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # FUSE: partial down sums
    KV_ROWS: gl.constexpr = 64 if SPLIT else KV_BOUND         # a split's tokens, or the whole bound
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [KV_ROWS, HEAD_DIM], KV_SHARED)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [KV_ROWS, HEAD_DIM], KV_SHARED)
    # What the attention needs that the step does not compute, read before the weight stream fills the memory
    # system (under it, every dependent load waits behind the megabytes in flight).
    d_rope = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, P3)))
    position = gl.load(pos_ptr).to(gl.int64)
    cos = gl.load(cos_ptr + position * stride_cos + d_rope % (HEAD_DIM // 2))
    sin = gl.load(sin_ptr + position * stride_cos + d_rope % (HEAD_DIM // 2))
    slot = gl.load(slot_ptr).to(gl.int64)
    old = gl.load(lens_ptr) - 1
    HEADS: gl.constexpr = Q_SIZE // HEAD_DIM
    epoch = gl.load(counters + EPOCH_AT)       # this launch's number: LL flags differ from every earlier launch's
    if WS:
        gl.warp_specialize([(_layer_body, (part_ptr, x_ptr, res_ptr, n1_ptr, n2_ptr, k_cache, v_cache, qkv_buf, attn_buf, o_buf, act_buf, res_a, res_b,
                 out_ptr, counters, stride_kb, stride_kt, stride_kh, scale_log2, eps, bars, empty, ring, vec, vec_chunks,
                 k_smem, v_smem, cos, sin, slot, old, table_ptr, lens_ptr, stride_kl, n_layers, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC,
                 nD, nE, total, times_ptr,
                 HIDDEN, INTER, Q_SIZE, KV_SIZE, KV_HEADS, HEAD_DIM, BLOCK_SIZE, KV_BOUND, S, NB, SA, SC, SD, SE, L, P3, KL2,
                 TIMING, WS, SPLIT, BARRIER, SPACE, FUSE, acc_ptr, part, LL, o_ll, epoch)),
                            (_producer, (bars, empty, ring, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC, nD, total,
                                         n_layers, S, NB, SA, SC, SD, SE, INTER, QKV, HIDDEN, FUSE))], [1], [48])
    else:
        _layer_body(part_ptr, x_ptr, res_ptr, n1_ptr, n2_ptr, k_cache, v_cache, qkv_buf, attn_buf, o_buf, act_buf, res_a, res_b,
                 out_ptr, counters, stride_kb, stride_kt, stride_kh, scale_log2, eps, bars, empty, ring, vec, vec_chunks,
                 k_smem, v_smem, cos, sin, slot, old, table_ptr, lens_ptr, stride_kl, n_layers, dq, do, dgu, dd, a0, c0, d0, e0, nA, nC,
                 nD, nE, total, times_ptr,
                 HIDDEN, INTER, Q_SIZE, KV_SIZE, KV_HEADS, HEAD_DIM, BLOCK_SIZE, KV_BOUND, S, NB, SA, SC, SD, SE, L, P3, KL2,
                 TIMING, WS, SPLIT, BARRIER, SPACE, FUSE, acc_ptr, part, LL, o_ll, epoch)
    for s in gl.static_range(S):
        mbarrier.invalidate(bars.index(s))
        mbarrier.invalidate(empty.index(s))
    # Every program has left every barrier once the done-counter reaches G: the last one resets them all.
    if gl.atomic_add(counters + n_layers * 5 * SPACE, 1, sem="acq_rel", scope="gpu") == G - 1:
        idx = gl.arange(0, 256, layout=gl.BlockedLayout([1], [32], [8], [0]))
        gl.store(counters + idx * SPACE, gl.zeros_like(idx), mask=idx <= n_layers * 5)
        gl.store(counters + FLAG_AT + idx * SPACE, gl.zeros_like(idx), mask=idx <= n_layers * 5)
        gl.store(counters + EPOCH_AT, epoch + 1)


DEFAULTS = dict(S=8, NB=4, KV_BOUND=256, WS=False, SPLIT=False, BARRIER=0, SPACE=1, FUSE=False, LL=False, num_warps=8, programs=None, times=None)


def descriptors(layer):
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, BOX], gl.bfloat16)
    if "down_t" not in layer:        # the down product's weight transposed, for FUSE (stacked: each layer's, by rows)
        layer["down_t"] = layer["down"].t().contiguous()
    return [TensorDescriptor.from_tensor(layer[name], [ROWS, BOX], layout)
            for name in ("qkv", "o", "gate_up", "down", "down_t")]


def _launch(x, residual, descs, n1, n2, k_cache, v_cache, stride_kl, n_layers, table, lens, positions, slots, cos, sin,
            bufs, counters, eps, sizes, inter, settings):
    s = dict(DEFAULTS, **settings)
    q_size, kv_size, heads, kv_heads, head_dim = sizes
    if s["FUSE"]:
        if not s["WS"]:
            raise ValueError("FUSE takes the producer warp (WS=True)")
        if bufs.get("acc") is None or bufs["acc"].shape[0] < n_layers + 1:
            bufs["acc"] = torch.empty(n_layers + 1, x.shape[-1], device=x.device, dtype=torch.float32)
        bufs["acc"][0].copy_(x.view(-1))
    descs = descs[:3] + [descs[4]] if s["FUSE"] else descs[:4]
    if "o_ll" not in bufs:       # LL words start at flag 0, which no launch writes
        bufs["o_ll"] = torch.zeros(x.shape[-1], device=x.device, dtype=torch.int64)
    if n_layers > 1 and not s["WS"]:
        raise ValueError("several layers in one launch need the producer warp (WS=True)")
    programs = s["programs"] or torch.cuda.get_device_properties(x.device).multi_processor_count
    if s["SPLIT"] and programs < heads * s["KV_BOUND"] // 64:
        raise ValueError("the split attention needs a program per (head, 64 tokens)")
    if "part" not in bufs:
        bufs["part"] = torch.empty(heads * (s["KV_BOUND"] // 64) * (head_dim + 2), device=x.device,
                                   dtype=torch.float32)
    _decode_layer_kernel[(programs,)](
        bufs["part"], *descs, x, residual, n1, n2,
        k_cache, v_cache, table, lens, positions, slots, cos, sin,
        bufs["qkv"], bufs["attn"], bufs["o"], bufs["act"], bufs["res_a"], bufs["res_b"], bufs["out"], counters,
        k_cache.stride(-4), k_cache.stride(-3), k_cache.stride(-2), cos.stride(0),
        head_dim ** -0.5 * 1.4426950408889634, eps, stride_kl, n_layers,
        HIDDEN=x.shape[-1], INTER=inter, Q_SIZE=q_size, KV_SIZE=kv_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[-3], S=s["S"], NB=s["NB"], KV_BOUND=s["KV_BOUND"], times_ptr=s["times"],
        TIMING=s["times"] is not None, WS=s["WS"], SPLIT=s["SPLIT"], BARRIER=s["BARRIER"], SPACE=s["SPACE"],
        FUSE=s["FUSE"], acc_ptr=bufs.get("acc"), LL=s["LL"], o_ll=bufs["o_ll"], num_warps=s["num_warps"])
    if s["FUSE"]:
        return bufs["acc"][n_layers].to(x.dtype).view(1, -1), bufs["res_b"]
    return bufs["out"], bufs["res_b"]


def decode_layer(x, residual, layer, k_cache, v_cache, table, lens, positions, slots, cos, sin, bufs, counters,
                 eps, sizes, **settings):
    """One batch-1 decode layer in one launch; returns ``(x_out, new_residual)`` (views of ``bufs``)."""
    if "descs" not in layer:
        layer["descs"] = descriptors(layer)
    return _launch(x, residual, layer["descs"], layer["n1"], layer["n2"], k_cache, v_cache, 0, 1, table, lens,
                   positions, slots, cos, sin, bufs, counters, eps, sizes, layer["down"].shape[1], settings)


def decode_layers(x, residual, stacked, k_cache, v_cache, n_layers, table, lens, positions, slots, cos, sin, bufs,
                  counters, eps, sizes, **settings):
    """The first ``n_layers`` layers in ONE launch (grid-wide barriers between layers too). ``stacked``: each
    product's weights of every layer stacked along the rows (``qkv``, ``o``, ``gate_up``, ``down``) and the norms
    ``n1``, ``n2`` as ``[layers, hidden]``; ``k_cache``/``v_cache`` ``[layers, blocks, block, kv_heads, d]``."""
    if "descs" not in stacked:
        stacked["descs"] = descriptors(stacked)
    bufs["out"].copy_(x)                # every layer reads the one before from these buffers
    bufs["res_b"].copy_(residual)
    return _launch(bufs["out"], bufs["res_b"], stacked["descs"], stacked["n1"], stacked["n2"], k_cache, v_cache,
                   k_cache.stride(0), n_layers, table, lens, positions, slots, cos, sin, bufs, counters, eps, sizes,
                   stacked["down"].shape[1], settings)
