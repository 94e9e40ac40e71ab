"""Prototype: batch-1 decode attention and the output product in one kernel (scratch)."""
import torch
import triton
import triton.language as tl

from solutions.kernels.paged_attention import _rope_rotate
from solutions.kernels import gpu_elementwise as l02


@triton.jit
def _attention_group(Q, K_NEW, V_NEW, K_CACHE, V_CACHE, TABLE, CONTEXT_LENS, COS, SIN, POSITIONS, SLOTS, ATTN,
                     kv_head, stride_kb, stride_kt, stride_kh, stride_cos, scale_log2,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    context_len = tl.load(CONTEXT_LENS)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    position = tl.load(POSITIONS).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    first = offs_d < half
    partner = tl.where(first, offs_d + half, offs_d - half)
    cos = tl.load(COS + position * stride_cos + offs_d % half)
    sin = tl.load(SIN + position * stride_cos + offs_d % half)
    q = _rope_rotate(Q, heads[:, None] * HEAD_DIM + offs_d[None, :], heads[:, None] * HEAD_DIM + partner[None, :],
                     row_ok[:, None], first[None, :], cos[None, :], sin[None, :]).to(Q.dtype.element_ty)
    slot = tl.load(SLOTS).to(tl.int64)
    k_new = _rope_rotate(K_NEW + kv_head * HEAD_DIM, offs_d, partner, offs_d < HEAD_DIM, first, cos, sin)
    v_new = tl.load(V_NEW + kv_head * HEAD_DIM + offs_d)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    tl.store(K_CACHE + block * stride_kb + within * stride_kt + kv_head * stride_kh + offs_d,
             k_new.to(K_CACHE.dtype.element_ty))
    tl.store(V_CACHE + block * stride_kb + within * stride_kt + kv_head * stride_kh + offs_d, v_new)
    tl.debug_barrier()
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first_n = tl.arange(0, TILE_N)
    next_block = tl.load(TABLE + first_n // BLOCK_SIZE, mask=first_n < context_len, other=0)
    for tile_start in range(0, context_len, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        n_ok = offs_n < context_len
        blk = next_block.to(tl.int64)
        ahead = offs_n + TILE_N
        next_block = tl.load(TABLE + ahead // BLOCK_SIZE, mask=ahead < context_len, other=0)
        w = offs_n % BLOCK_SIZE
        k = tl.load(K_CACHE + blk[:, None] * stride_kb + w[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V_CACHE + blk[:, None] * stride_kb + w[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k))
        scores = tl.where(n_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(ATTN + heads[:, None] * HEAD_DIM + offs_d[None, :], out.to(ATTN.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attention_output_kernel(Q, K_NEW, V_NEW, K_CACHE, V_CACHE, TABLE, CONTEXT_LENS, COS, SIN, POSITIONS, SLOTS,
                             ATTN, W, OUT, COUNTERS, N, K, stride_kb, stride_kt, stride_kh, stride_cos, scale_log2,
                             NUM_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TRIGGER: tl.constexpr,
                             SLEEP: tl.constexpr = 0, PDL: tl.constexpr = False):
    # Roles by ticket (the order programs start in): tickets 0 .. NUM_KV - 1 attend for one KV head each;
    # the others compute BLOCK_N rows of the output product once every head's attention is stored.
    ticket = tl.atomic_add(COUNTERS, 1, sem="relaxed")
    if ticket < NUM_KV:
        if PDL:
            tl.extra.cuda.gdc_wait()
        _attention_group(Q, K_NEW, V_NEW, K_CACHE, V_CACHE, TABLE, CONTEXT_LENS, COS, SIN, POSITIONS, SLOTS, ATTN,
                         ticket, stride_kb, stride_kt, stride_kh, stride_cos, scale_log2,
                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, TILE_N)
        tl.debug_barrier()
        tl.atomic_add(COUNTERS + 1, 1, sem="release")
    else:
        rows = (ticket - NUM_KV) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = W + rows[:, None].to(tl.int64) * K
        cols = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0,
                          eviction_policy="evict_first")
        if PDL:
            if TRIGGER:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if SLEEP > 0:
            done = tl.load(COUNTERS + 1, volatile=True)
            while done < NUM_KV:
                tl.inline_asm_elementwise("nanosleep.u32 200; mov.u32 $0, 0;", "=r,r", [done], dtype=tl.int32,
                                          is_pure=False, pack=1)
                done = tl.load(COUNTERS + 1, volatile=True)
            done = tl.atomic_add(COUNTERS + 1, 0, sem="acquire")
        else:
            done = tl.atomic_add(COUNTERS + 1, 0, sem="acquire")
            while done < NUM_KV:
                done = tl.atomic_add(COUNTERS + 1, 0, sem="acquire")
        vec = tl.load(ATTN + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = w_first.to(tl.float32) * vec[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            c = k0 + tl.arange(0, BLOCK_K)
            vec = tl.load(ATTN + c, mask=c < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + c[None, :], mask=row_ok[:, None] & (c < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc += w.to(tl.float32) * vec[None, :]
        tl.store(OUT + rows, tl.sum(acc, axis=1).to(OUT.dtype.element_ty), mask=row_ok)
    finished = tl.atomic_add(COUNTERS + 2, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:
        tl.store(COUNTERS, 0)
        tl.store(COUNTERS + 1, 0)
        tl.store(COUNTERS + 2, 0)


def attention_output(q, k, v, cos, sin, positions, k_cache, v_cache, slots, table, lens, w_o, counters, attn, out,
                     trigger=True, block_k=None, warps=8, sleep=0):
    """Batch 1: q [1, heads, d], k/v [1, kv, d] before RoPE; returns out [1, hidden] = attn @ w_o.T."""
    heads, d = q.shape[1], q.shape[2]
    kv = k.shape[1]
    n, kk = w_o.shape
    block_n = 4
    block_k = block_k or min(2048, triton.next_power_of_2(kk))
    tile_n = 64 if w_o.is_cuda else 16
    grid = (kv + (n + block_n - 1) // block_n,)
    _attention_output_kernel[grid](
        q, k, v, k_cache, v_cache, table, lens, cos, sin, positions, slots, attn, w_o, out, counters, n, kk,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0), d ** -0.5 * 1.4426950408889634,
        NUM_KV=kv, GROUP=heads // kv, GROUP_PAD=max(16, triton.next_power_of_2(heads // kv)), HEAD_DIM=d,
        BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n, BLOCK_N=block_n, BLOCK_K=block_k, TRIGGER=trigger, SLEEP=sleep,
        num_warps=warps, num_stages=3, **l02._pdl_options(w_o.device))
    return out


@triton.jit
def _matvec_rows_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, out_ptr, res_out_ptr, N, K, epsilon,
                        PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    # Persistent one-row product for K <= BLOCK_K: program p takes row blocks p, p + P, ...
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    blocks = tl.cdiv(N, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_first = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                      mask=(rows < N)[:, None] & col_ok[None, :], other=0.0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    inv_rms = 0.0
    if PROLOGUE == 2:
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        h = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_out_ptr + cols, h, mask=cols < tl.where(pid == 0, K, 0))
        h = h.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + epsilon)
    vec = l02._matvec_input(x_ptr, res_ptr, norm_w_ptr, cols, col_ok, K, inv_rms, PROLOGUE)
    out = tl.sum(w_first.to(tl.float32) * vec[None, :], axis=1)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)
    for blk in range(pid + P, blocks, P):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                    mask=(rows < N)[:, None] & col_ok[None, :], other=0.0, eviction_policy="evict_first")
        out = tl.sum(w.to(tl.float32) * vec[None, :], axis=1)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def matvec_rows(prologue, x, weight, out, per_sm, warps=4, stages=3, residual=None, norm_weight=None, res_out=None,
                eps=1e-5):
    n, k = weight.shape
    block_n = 4
    blocks = (n + block_n - 1) // block_n
    sms = torch.cuda.get_device_properties(weight.device).multi_processor_count if weight.is_cuda else 4
    grid = (min(blocks, per_sm * sms),)
    block_k = triton.next_power_of_2(k)
    _matvec_rows_kernel[grid](x, x if residual is None else residual, x if norm_weight is None else norm_weight,
                              weight, out, out if res_out is None else res_out, n, k, eps, PROLOGUE=prologue,
                              BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                              **l02._pdl_options(weight.device))
    return out, res_out
