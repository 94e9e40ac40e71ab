"""Experiment: faster boundary states for Based prefill at 1k-2k tokens (temporary, not a maintained tool)."""
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from solutions.kernels import based  # noqa: E402
from solutions.kernels.based import (_store_rows_t, _store_rows, _read_prefix_state_16bit, _store_orders01,  # noqa: E402
                                     _read_prefix_state, BasedState)

DEV = "cuda" if torch.cuda.is_available() else "cpu"



@triton.jit
def _state_body(
    pid_r, pid_v, bh, K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    seq_len, value_dim, heads, segment_len,
    GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """The state at every segment boundary, ``phi(K)^T V`` and ``sum phi(K)`` over the tokens before it.

    Grid: (1 + 16 / GROUPS row blocks, value blocks, batch * heads). A program owns some feature rows of
    the state of one (sequence, head) and walks the whole sequence, ``BLOCK_T`` tokens at a time, keeping
    its rows of the running sums in registers (float32): no two programs ever add into the same numbers.
    At the end of every segment but the last it stores its rows of the running state into
    ``PREFIX_KV [batch * heads, segments - 1, 273, value_dim]`` (float32, or the inputs' 16-bit dtype: that
    tensor) and ``PREFIX_K [batch * heads, segments - 1, 273]`` (float32); at the end of the sequence
    into the final ``STATE_KV [batch * heads, 273, value_dim]``, ``STATE_K [batch * heads, 273]`` (float32).

    Row block 0: the order-0 and order-1 rows 0..16 (``sum v``, ``sum k/2 v^T``) and the same entries of
    the normaliser (the count, ``sum k/2``).
    Row block ``r >= 1``: the order-2 rows of features ``a = (r - 1) GROUPS .. r GROUPS - 1``, i.e. state
    rows ``17 + 16 a + b`` for every ``b``: ``GROUPS * 16`` consecutive rows, and the same entries of the
    normaliser. Their features for a tile of tokens, ``k_a k_b`` as ``[BLOCK_T, GROUPS * 16]``, are built
    from two loads of k (the columns ``a`` and all 16 columns) as ``[BLOCK_T, GROUPS, 16]`` products, then
    one tensor-core product ``v^T @ feats``: the program keeps its rows transposed, ``[BLOCK_V, rows]``.
    The constant ``1 / (4 sqrt 2)`` is applied once, when the sums are stored. The segments' edges fall on
    tile edges (``segment_len`` is a multiple of ``BLOCK_T``), so one loop over the tiles serves every
    segment and Triton can pipeline its loads.
    """
    batch = (bh // heads).to(tl.int64)
    head = (bh % heads).to(tl.int64)
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    segments = tl.cdiv(seq_len, segment_len)
    prefix_kv = PREFIX_KV + bh.to(tl.int64) * (segments - 1) * (273 * value_dim)
    prefix_k = PREFIX_K + bh.to(tl.int64) * (segments - 1) * 273
    state_kv = STATE_KV + bh.to(tl.int64) * (273 * value_dim)
    state_k = STATE_K + bh.to(tl.int64) * 273
    order2_scale = 0.17677669529663687                    # 1 / (4 sqrt 2)

    offs_t = tl.arange(0, BLOCK_T)
    offs_f = tl.arange(0, 16)
    first_v = pid_v * BLOCK_V
    offs_v = first_v + tl.arange(0, BLOCK_V)
    v_ok = offs_v < value_dim
    if pid_r == 0:
        # Orders 0 and 1: sum v (row 0), sum (k/2) v^T (rows 1..16); the normaliser's count and sum k/2.
        s0 = tl.zeros([BLOCK_V], dtype=tl.float32)
        s1 = tl.zeros([16, BLOCK_V], dtype=tl.float32)
        z0 = tl.zeros([1], dtype=tl.float32)
        z1 = tl.zeros([16], dtype=tl.float32)
        for start in range(0, seq_len, BLOCK_T):
            tokens = start + offs_t
            t_ok = tokens < seq_len
            k = tl.load(k_base + tokens[:, None] * stride_ks + offs_f[None, :], mask=t_ok[:, None], other=0.0)
            v = tl.load(v_base + tokens[:, None] * stride_vs + offs_v[None, :],
                        mask=t_ok[:, None] & v_ok[None, :], other=0.0)
            k_t = tl.trans(k)
            s1 = tl.dot((k_t * 0.5).to(v.dtype), v, s1, input_precision=PRECISION)   # k/2: exact
            s0 += tl.sum(v.to(tl.float32), 0)
            z0 += tl.sum(t_ok.to(tl.float32), 0)
            z1 += tl.sum(k_t.to(tl.float32), 1) * 0.5
            boundary = start + BLOCK_T                            # segment_len is a multiple of BLOCK_T
            if (boundary % segment_len == 0) & (boundary < seq_len):      # the state before the next segment
                entry = boundary // segment_len - 1
                _store_orders01(prefix_kv, prefix_k + entry * 273, entry * 273, s0, s1, z0, z1,
                                first_v, value_dim, pid_v == 0)
        _store_orders01(state_kv, state_k, 0, s0, s1, z0, z1, first_v, value_dim, pid_v == 0)
    else:
        # Order 2: rows 17 + 16 a + b for the GROUPS features a of this block, b = 0..15, kept transposed
        # ([BLOCK_V, rows]): the features of a tile then enter the product as its second operand,
        # [BLOCK_T, GROUPS * 16], whose reshape from [BLOCK_T, GROUPS, 16] only merges the last two dims.
        first_a = (pid_r - 1) * GROUPS
        offs_a = first_a + tl.arange(0, GROUPS)
        first_row = 17 + first_a * 16
        offs_r = tl.arange(0, GROUPS * 16)
        kv_t = tl.zeros([BLOCK_V, GROUPS * 16], dtype=tl.float32)
        ksum = tl.zeros([GROUPS * 16], dtype=tl.float32)
        for start in range(0, seq_len, BLOCK_T):
            tokens = start + offs_t
            t_ok = tokens < seq_len
            # Tokens past the end read k = 0 and v = 0: they add nothing.
            k = tl.load(k_base + tokens[:, None] * stride_ks + offs_f[None, :], mask=t_ok[:, None], other=0.0)
            k_a = tl.load(k_base + tokens[:, None] * stride_ks + offs_a[None, :], mask=t_ok[:, None], other=0.0)
            v_t = tl.load(v_base + tokens[None, :] * stride_vs + offs_v[:, None],
                          mask=t_ok[None, :] & v_ok[:, None], other=0.0)
            # k_a k_b for every (a, b) of the block, in float32 (exact for 16-bit k); cast for the product.
            feats = tl.reshape(k_a.to(tl.float32)[:, :, None] * k.to(tl.float32)[:, None, :],
                               [BLOCK_T, GROUPS * 16])
            kv_t = tl.dot(v_t, feats.to(v_t.dtype), kv_t, input_precision=PRECISION)
            ksum += tl.sum(feats, 0)
            boundary = start + BLOCK_T                            # segment_len is a multiple of BLOCK_T
            if (boundary % segment_len == 0) & (boundary < seq_len):      # the state before the next segment
                entry = boundary // segment_len - 1
                _store_rows_t(prefix_kv, entry * 273 + first_row, first_v, value_dim, kv_t * order2_scale)
                if pid_v == 0:
                    tl.store(prefix_k + entry * 273 + first_row + offs_r, ksum * order2_scale)
        _store_rows_t(state_kv, first_row, first_v, value_dim, kv_t * order2_scale)
        if pid_v == 0:
            tl.store(state_k + first_row + offs_r, ksum * order2_scale)



@triton.jit
def _segment_body(
    pid_m, pid_v, bh, Q, K, V, O, PREFIX_KV, PREFIX_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    seq_len, value_dim, heads, segment_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    PREFIX_16BIT: tl.constexpr,
):
    """``BLOCK_M`` queries: the quadratic form over the keys of their own segment, the state before it.

    Grid: (query blocks, value blocks, batch * heads); ``segment_len`` is a multiple of ``BLOCK_M``.
    Inside the segment, flash attention's loop without its running maximum: the weights
    ``w = 1 + s + s^2/2`` are never below 1/2, so numerator and normaliser are summed as they come, in
    float32, and divided once at the end. Per key block: ``s = q k^T`` (a ``[BLOCK_M, 16]`` by
    ``[16, BLOCK_N]`` tensor-core product), ``w`` elementwise, ``num += w @ v``, ``den += sum(w)``. The keys
    of earlier segments arrive in one piece: ``phi(q) @ S`` with ``S`` the state at the segment's start
    (``PREFIX_KV [batch * heads, segments - 1, 273, value_dim]``: entry ``j`` sums segments ``0..j``;
    in the inputs' dtype when ``PREFIX_16BIT``, else float32).
    """
    # The last query blocks of a segment read the most key blocks: start them first.
    batch = (bh // heads).to(tl.int64)
    head = (bh % heads).to(tl.int64)
    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    o_base = O + batch * stride_ob + head * stride_oh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_f = tl.arange(0, 16)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_ok = offs_m < seq_len
    v_ok = offs_v < value_dim

    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_f[None, :], mask=m_ok[:, None], other=0.0)
    q = (q * 0.5).to(V.dtype.element_ty)              # (q/2).(k/2) = q.k/4 = s; exact (a power of two)
    num = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)

    segment = (pid_m * BLOCK_M) // segment_len
    seg_start = segment * segment_len
    if segment > 0:
        # Every key of the earlier segments, through the state after them.
        prefix = bh.to(tl.int64) * (tl.cdiv(seq_len, segment_len) - 1) + segment - 1
        if PREFIX_16BIT:
            num, den = _read_prefix_state_16bit(q, num, den, PREFIX_KV + prefix * (273 * value_dim),
                                                PREFIX_K + prefix * 273, offs_v, v_ok, value_dim)
        else:
            num, den = _read_prefix_state(q, num, den, PREFIX_KV + prefix * (273 * value_dim),
                                          PREFIX_K + prefix * 273, offs_v, v_ok, value_dim, PRECISION)

    # Key blocks of the segment wholly before this query block: every weight counts, no mask.
    for start in range(seg_start, pid_m * BLOCK_M, BLOCK_N):
        keys = start + offs_n
        k_t = tl.load(k_base + keys[None, :] * stride_ks + offs_f[:, None])                    # [16, BLOCK_N]
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_v[None, :], mask=v_ok[None, :], other=0.0)
        s = tl.dot(q, (k_t * 0.5).to(v.dtype), input_precision=PRECISION)                      # fp32
        w = 1.0 + s + 0.5 * s * s
        den += tl.sum(w, 1)
        num = tl.dot(w.to(v.dtype), v, num, input_precision=PRECISION)

    # The key blocks of the query block itself: the causal mask (key <= query). Keys past the end
    # read 0 and only ever meet query rows past the end, which are not stored.
    for start in range(pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M, BLOCK_N):
        keys = start + offs_n
        k_ok = keys < seq_len
        k_t = tl.load(k_base + keys[None, :] * stride_ks + offs_f[:, None], mask=k_ok[None, :], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_v[None, :],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        s = tl.dot(q, (k_t * 0.5).to(v.dtype), input_precision=PRECISION)
        w = tl.where(offs_m[:, None] >= keys[None, :], 1.0 + s + 0.5 * s * s, 0.0)
        den += tl.sum(w, 1)
        num = tl.dot(w.to(v.dtype), v, num, input_precision=PRECISION)

    out = num / den[:, None]
    tl.store(o_base + offs_m[:, None] * stride_os + offs_v[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & v_ok[None, :])



@triton.jit
def _fused_kernel(
    Q, K, V, O, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    seq_len, value_dim, heads, segment_len, n_state, state_rows, state_vblocks, m_blocks, m_offset,
    GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_VS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    PREFIX_16BIT: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_state:
        pid_r = pid % state_rows
        rest = pid // state_rows
        pid_v = rest % state_vblocks
        bh = rest // state_vblocks
        _state_body(pid_r, pid_v, bh, K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                    seq_len, value_dim, heads, segment_len, GROUPS, BLOCK_T, BLOCK_VS, PRECISION)
    else:
        p = pid - n_state
        local_m = p % m_blocks
        bh = p // m_blocks          # value blocks: 1 here (dv 64)
        pid_m = m_offset + m_blocks - 1 - local_m
        _segment_body(pid_m, 0, bh, Q, K, V, O, PREFIX_KV, PREFIX_K,
                      stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                      stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                      seq_len, value_dim, heads, segment_len, BLOCK_M, BLOCK_N, BLOCK_V, PRECISION, PREFIX_16BIT)


@triton.jit
def _segment_offset_kernel(
    Q, K, V, O, PREFIX_KV, PREFIX_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    seq_len, value_dim, heads, segment_len, m_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    PREFIX_16BIT: tl.constexpr,
):
    pid_m = m_offset + tl.num_programs(0) - 1 - tl.program_id(0)
    _segment_body(pid_m, tl.program_id(1), tl.program_id(2), Q, K, V, O, PREFIX_KV, PREFIX_K,
                  stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                  stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                  seq_len, value_dim, heads, segment_len, BLOCK_M, BLOCK_N, BLOCK_V, PRECISION, PREFIX_16BIT)


def fused_route(q, k, v, segment_len, bm=64, bn=64, groups=4, block_t=128, warps=4, streams=None):
    """Launch 1: the boundary/final states and the first segment's queries (independent); launch 2: the rest."""
    b, h, seq, _ = q.shape
    dv = v.shape[-1]
    segments = triton.cdiv(seq, segment_len)
    out = torch.empty(b, h, seq, dv, dtype=v.dtype, device=v.device)
    prefix_kv = torch.empty(b, h, max(segments - 1, 1), 273, dv, device=v.device, dtype=q.dtype)
    prefix_k = torch.empty(b, h, max(segments - 1, 1), 273, device=v.device, dtype=torch.float32)
    state = BasedState(torch.empty(b, h, 273, dv, device=v.device), torch.empty(b, h, 273, device=v.device))
    first_blocks = triton.cdiv(min(segment_len, seq), bm)
    total_blocks = triton.cdiv(seq, bm)
    args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2))
    if streams is None:
        rows = 1 + 16 // groups
        n_state = rows * b * h
        _fused_kernel[(n_state + first_blocks * b * h,)](
            q, k, v, out, prefix_kv, prefix_k, state.kv, state.k, *args,
            seq, dv, h, segment_len, n_state, rows, 1, first_blocks, 0,
            GROUPS=groups, BLOCK_T=min(block_t, segment_len), BLOCK_VS=64, BLOCK_M=bm, BLOCK_N=bn, BLOCK_V=64,
            PRECISION="tf32", PREFIX_16BIT=True, num_warps=warps)
    else:
        s1, s2 = streams
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            based._launch_prefix_state(k, v, prefix_kv, prefix_k, state.kv, state.k, segment_len)
        with torch.cuda.stream(s2):
            _segment_offset_kernel[(first_blocks, 1, b * h)](
                q, k, v, out, prefix_kv, prefix_k, *args, seq, dv, h, segment_len, 0,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_V=64, PRECISION="tf32", PREFIX_16BIT=True, num_warps=4)
        cur.wait_stream(s1)
        cur.wait_stream(s2)
    if total_blocks > first_blocks:
        _segment_offset_kernel[(total_blocks - first_blocks, 1, b * h)](
            q, k, v, out, prefix_kv, prefix_k, *args, seq, dv, h, segment_len, first_blocks,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_V=64, PRECISION="tf32", PREFIX_16BIT=True, num_warps=4)
    return out, state


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def main():
    quick = DEV == "cpu"
    B, H = (1, 2) if quick else (16, 16)
    lens = [300, 1024] if quick else [1024, 2048, 4096]
    dtype = torch.float16 if quick else torch.bfloat16
    fla = None
    try:
        import fla.ops.based as fb
        fla = fb.parallel_based
    except Exception as e:  # noqa: BLE001
        print("no fla", e)
    from triton.testing import do_bench
    streams = None if quick else (torch.cuda.Stream(), torch.cuda.Stream())
    for seq in lens:
        g = torch.Generator(device=DEV).manual_seed(seq)
        q = torch.randn(B, H, seq, 16, device=DEV, dtype=dtype, generator=g)
        k = torch.randn(B, H, seq, 16, device=DEV, dtype=dtype, generator=g)
        v = torch.randn(B, H, seq, 64, device=DEV, dtype=dtype, generator=g)
        ref_out, ref_state = based.based_prefill(q, k, v)
        if not quick:
            ms = do_bench(lambda: based.based_prefill(q, k, v), warmup=25, rep=100, return_mode="median")
            print(f"{seq} current: {ms:.4f}", flush=True)
            if fla is not None:
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                ms = do_bench(lambda: fla(qt, kt, vt), warmup=25, rep=100, return_mode="median")
                print(f"{seq} fla parallel_based: {ms:.4f}", flush=True)
        for seg in (256, 512, 1024, 2048):
            if seg > 2 * seq or (seg > seq and seg != triton.next_power_of_2(seq)):
                continue
            for mode in (("fused",) if quick else ("fused", "streams")):
                kw = dict(streams=streams if mode == "streams" else None)
                out, state = fused_route(q, k, v, seg, **kw)
                err = max(rel(out, ref_out), rel(state.kv, ref_state.kv), rel(state.k, ref_state.k))
                if quick:
                    print(f"{seq} {mode} seg {seg}: err {err:.1e}")
                    continue
                ms = do_bench(lambda: fused_route(q, k, v, seg, **kw), warmup=25, rep=100, return_mode="median")
                print(f"{seq} {mode} seg {seg}: {ms:.4f} ms err {err:.1e}{' MISMATCH' if err > 1e-2 else ''}",
                      flush=True)


if __name__ == "__main__":
    main()
