"""Prototype, measured by scripts/bench_decode_chain.py: a batch-1 Llama decode layer as ONE Triton kernel.

One program per SM; the layer's five dependencies are grid-wide barriers (a counter in global memory) instead
of kernel boundaries, and before each barrier every program issues the loads of its first tile of the next
product's weights, so the memory keeps streaming while the programs wait. Phases:

    A  r1 = x + residual, h = rms_norm(r1) * n1, qkv rows            (every program its rows)
    B  RoPE, K/V write, attention over the paged cache               (one program per KV head)
    C  o rows of W_o @ attn
    D  r2 = o + r1, h = rms_norm(r2) * n2, gate/up rows, silu(g) * u
    E  down rows of W_down @ act                                     -> (x_out, r2)

The norm's sum of squares is computed by every program from the whole row (a few KB from the L2 cache), so
it needs no barrier of its own. Roundings follow the engine's kernels (each product rounded to bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solutions.kernels.paged_attention import _rope_rotate


@triton.jit
def _grid_barrier(counter, num_programs):
    # Every thread's stores are issued before thread 0 releases them; the acquire makes the other programs'
    # stores visible here.
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < num_programs:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(times_ptr, i, TIMING: tl.constexpr):
    if TIMING:
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(times_ptr + tl.program_id(0) * 16 + i, t)


@triton.jit
def _load_tile(w_ptr, stride_w, rows, row_ok, k0, K, BLOCK_K: tl.constexpr):
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                   mask=row_ok[:, None] & (cols < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _vec_chunk(cols, x_ptr, res_ptr, n_ptr, inv_rms, NORM: tl.constexpr):
    x = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
    if NORM:
        r = tl.load(res_ptr + cols, cache_modifier=".cg").to(tl.float32)
        h = (x + r).to(tl.bfloat16).to(tl.float32)
        x = (h * inv_rms * tl.load(n_ptr + cols).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _rows_product(w_first, w_ptr, stride_w, rows, row_ok, K, x_ptr, res_ptr, n_ptr, inv_rms,
                  NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    # sum_k w[rows, k] * vec[k]; w_first holds columns [0, BLOCK_K), loaded earlier. Each iteration loads the
    # next tile before it uses the current one (two tiles in flight).
    acc = tl.sum(tl.zeros_like(w_first).to(tl.float32), axis=1)
    w = w_first
    for k0 in range(0, K, BLOCK_K):
        nxt = _load_tile(w_ptr, stride_w, rows, row_ok, k0 + BLOCK_K, K, BLOCK_K)
        vec = _vec_chunk(k0 + tl.arange(0, BLOCK_K), x_ptr, res_ptr, n_ptr, inv_rms, NORM)
        acc += tl.sum(w.to(tl.float32) * vec[None, :], axis=1)
        w = nxt
    return acc


@triton.jit
def _add_norm_scale(x_ptr, res_ptr, res_out_ptr, eps, HIDDEN: tl.constexpr):
    # 1 / rms of bf16(x + res) over the whole row; program 0 stores the sum (the new residual).
    cols = tl.arange(0, HIDDEN)
    h = (tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
         + tl.load(res_ptr + cols, cache_modifier=".cg").to(tl.float32)).to(tl.bfloat16)
    tl.store(res_out_ptr + cols, h, mask=cols < tl.where(tl.program_id(0) == 0, HIDDEN, 0))
    h = h.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)


@triton.jit
def _attend(qkv_ptr, attn_ptr, k_cache, v_cache, table_ptr, lens_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
            stride_kb, stride_kt, stride_kh, stride_cos, scale_log2, kv_head,
            Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    rows = tl.arange(0, 16)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    first = offs_d < half
    partner = tl.where(first, offs_d + half, offs_d - half)
    position = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_ptr + position * stride_cos + offs_d % half)
    sin = tl.load(sin_ptr + position * stride_cos + offs_d % half)
    q = _rope_rotate(qkv_ptr, heads[:, None] * HEAD_DIM + offs_d[None, :],
                     heads[:, None] * HEAD_DIM + partner[None, :], row_ok[:, None], first[None, :],
                     cos[None, :], sin[None, :]).to(tl.bfloat16)
    k_new = _rope_rotate(qkv_ptr + Q_SIZE + kv_head * HEAD_DIM, offs_d, partner, offs_d < HEAD_DIM, first, cos, sin)
    v_new = tl.load(qkv_ptr + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + offs_d)
    slot = tl.load(slot_ptr).to(tl.int64)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    tl.store(k_cache + block * stride_kb + within * stride_kt + kv_head * stride_kh + offs_d, k_new.to(tl.bfloat16))
    tl.store(v_cache + block * stride_kb + within * stride_kt + kv_head * stride_kh + offs_d, v_new)
    tl.debug_barrier()

    context_len = tl.load(lens_ptr)
    m = tl.full([16], float("-inf"), tl.float32)
    l = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    for tile_start in range(0, context_len, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        n_ok = offs_n < context_len
        blk = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = blk[:, None] * stride_kb + (offs_n % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh \
            + offs_d[None, :]
        k = tl.load(k_cache + off, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_cache + off, mask=n_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k))
        scores = tl.where(n_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(attn_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :], out.to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit
def _decode_layer_kernel(
    x_ptr, res_ptr, w_qkv, w_o, w_gu, w_down, n1_ptr, n2_ptr,
    k_cache, v_cache, table_ptr, lens_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
    qkv_buf, attn_buf, o_buf, act_buf, res_a, res_b, out_ptr, counters,
    stride_kb, stride_kt, stride_kh, stride_cos, scale_log2, eps,
    r_qkv, r_o, r_gu, r_down,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    BR_QKV: tl.constexpr, BK_QKV: tl.constexpr, BR_O: tl.constexpr, BK_O: tl.constexpr,
    BR_GU: tl.constexpr, BK_GU: tl.constexpr, BR_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
    times_ptr=None, TIMING: tl.constexpr = False,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    QKV: tl.constexpr = Q_SIZE + 2 * KV_SIZE

    _stamp(times_ptr, 0, TIMING)
    # A: norm + q/k/v rows.
    rows = pid * r_qkv + tl.arange(0, BR_QKV)
    row_ok = (tl.arange(0, BR_QKV) < r_qkv) & (rows < QKV)
    w = _load_tile(w_qkv, HIDDEN, rows, row_ok, 0, HIDDEN, BK_QKV)
    inv_rms = _add_norm_scale(x_ptr, res_ptr, res_a, eps, HIDDEN)
    acc = _rows_product(w, w_qkv, HIDDEN, rows, row_ok, HIDDEN, x_ptr, res_ptr, n1_ptr, inv_rms, True, BK_QKV)
    tl.store(qkv_buf + rows, acc.to(tl.bfloat16), mask=row_ok)
    _stamp(times_ptr, 1, TIMING)

    # The output product's first tile streams in while the barrier and the attention wait.
    rows = pid * r_o + tl.arange(0, BR_O)
    row_ok = (tl.arange(0, BR_O) < r_o) & (rows < HIDDEN)
    w = _load_tile(w_o, Q_SIZE, rows, row_ok, 0, Q_SIZE, BK_O)
    _grid_barrier(counters + 0, grid)
    _stamp(times_ptr, 2, TIMING)

    # B: attention, one program per KV head.
    if pid < KV_HEADS:
        _attend(qkv_buf, attn_buf, k_cache, v_cache, table_ptr, lens_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                stride_kb, stride_kt, stride_kh, stride_cos, scale_log2, pid,
                Q_SIZE, KV_SIZE, Q_SIZE // HEAD_DIM // KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N)
    _stamp(times_ptr, 3, TIMING)
    _grid_barrier(counters + 1, grid)
    _stamp(times_ptr, 4, TIMING)

    # C: output product.
    acc = _rows_product(w, w_o, Q_SIZE, rows, row_ok, Q_SIZE, attn_buf, attn_buf, attn_buf, 0.0, False, BK_O)
    tl.store(o_buf + rows, acc.to(tl.bfloat16), mask=row_ok)
    _stamp(times_ptr, 5, TIMING)

    rows = pid * r_gu + tl.arange(0, BR_GU)
    row_ok = (tl.arange(0, BR_GU) < r_gu) & (rows < INTER)
    wg = _load_tile(w_gu, HIDDEN, rows, row_ok, 0, HIDDEN, BK_GU)
    wu = _load_tile(w_gu, HIDDEN, rows + INTER, row_ok, 0, HIDDEN, BK_GU)
    _grid_barrier(counters + 2, grid)
    _stamp(times_ptr, 6, TIMING)

    # D: norm + gate/up rows, SiLU-and-mul.
    inv_rms = _add_norm_scale(o_buf, res_a, res_b, eps, HIDDEN)
    g = _rows_product(wg, w_gu, HIDDEN, rows, row_ok, HIDDEN, o_buf, res_a, n2_ptr, inv_rms, True, BK_GU)
    u = _rows_product(wu, w_gu, HIDDEN, rows + INTER, row_ok, HIDDEN, o_buf, res_a, n2_ptr, inv_rms, True, BK_GU)
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    tl.store(act_buf + rows, (g * tl.sigmoid(g) * u).to(tl.bfloat16), mask=row_ok)
    _stamp(times_ptr, 7, TIMING)

    rows = pid * r_down + tl.arange(0, BR_DOWN)
    row_ok = (tl.arange(0, BR_DOWN) < r_down) & (rows < HIDDEN)
    w = _load_tile(w_down, INTER, rows, row_ok, 0, INTER, BK_DOWN)
    _grid_barrier(counters + 3, grid)
    _stamp(times_ptr, 8, TIMING)

    # E: down product.
    acc = _rows_product(w, w_down, INTER, rows, row_ok, INTER, act_buf, act_buf, act_buf, 0.0, False, BK_DOWN)
    tl.store(out_ptr + rows, acc.to(tl.bfloat16), mask=row_ok)
    _stamp(times_ptr, 9, TIMING)

    # Every program has left every barrier once the done-counter reaches the grid: the last one resets them.
    if tl.atomic_add(counters + 4, 1, sem="acq_rel", scope="gpu") == grid - 1:
        tl.store(counters + tl.arange(0, 8), tl.zeros([8], tl.int32), mask=tl.arange(0, 8) < 5)


DEFAULTS = dict(BK_QKV=512, BK_O=1024, BK_GU=256, BK_DOWN=1024, num_warps=16, programs=None, times=None)


def decode_layer(x, residual, layer, k_cache, v_cache, table, lens, positions, slots, cos, sin, bufs, counters,
                 eps, sizes, **settings):
    """One batch-1 decode layer in one launch; returns ``(x_out, new_residual)`` (views of ``bufs``)."""
    s = dict(DEFAULTS, **settings)
    q_size, kv_size, heads, kv_heads, head_dim = sizes
    hidden = x.shape[-1]
    inter = layer["down"].shape[1]
    programs = s["programs"] or torch.cuda.get_device_properties(x.device).multi_processor_count

    def rows(n):
        r = triton.cdiv(n, programs)
        return r, triton.next_power_of_2(r)
    r_qkv, br_qkv = rows(q_size + 2 * kv_size)
    r_o, br_o = rows(hidden)
    r_gu, br_gu = rows(inter)
    r_down, br_down = rows(hidden)
    _decode_layer_kernel[(programs,)](
        x, residual, layer["qkv"], layer["o"], layer["gate_up"], layer["down"], layer["n1"], layer["n2"],
        k_cache, v_cache, table, lens, positions, slots, cos, sin,
        bufs["qkv"], bufs["attn"], bufs["o"], bufs["act"], bufs["res_a"], bufs["res_b"], bufs["out"], counters,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
        head_dim ** -0.5 * 1.4426950408889634, eps, r_qkv, r_o, r_gu, r_down,
        HIDDEN=hidden, INTER=inter, Q_SIZE=q_size, KV_SIZE=kv_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], TILE_N=64,
        BR_QKV=br_qkv, BK_QKV=s["BK_QKV"], BR_O=br_o, BK_O=s["BK_O"], BR_GU=br_gu, BK_GU=s["BK_GU"],
        BR_DOWN=br_down, BK_DOWN=s["BK_DOWN"], times_ptr=s["times"], TIMING=s["times"] is not None,
        num_warps=s["num_warps"], num_stages=1)
    return bufs["out"], bufs["res_b"]
