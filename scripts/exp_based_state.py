"""Experiment: faster boundary states for Based prefill at 1k-2k tokens (temporary, not a maintained tool)."""
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from solutions.kernels import based  # noqa: E402
from solutions.kernels.based import (_store_rows_t, _store_rows, _read_prefix_state_16bit,  # noqa: E402
                                     _read_prefix_state, BasedState)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _state_v2(
    K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    seq_len, value_dim, heads, segment_len, part_len, parts,
    GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    WRITE_STATE: tl.constexpr, ATOMIC: tl.constexpr, GRAM: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bp = tl.program_id(2)
    bh = pid_bp // parts
    part = pid_bp % parts
    batch = (bh // heads).to(tl.int64)
    head = (bh % heads).to(tl.int64)
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    segments = tl.cdiv(seq_len, segment_len)
    prefix_kv = PREFIX_KV + bh.to(tl.int64) * (segments - 1) * (273 * value_dim)
    prefix_k = PREFIX_K + bh.to(tl.int64) * (segments - 1) * 273
    state_kv = STATE_KV + bh.to(tl.int64) * (273 * value_dim)
    state_k = STATE_K + bh.to(tl.int64) * 273
    order2_scale = 0.17677669529663687
    first_tok = part * part_len
    last_tok = tl.minimum(first_tok + part_len, seq_len)

    offs_t = tl.arange(0, BLOCK_T)
    offs_f = tl.arange(0, 16)
    first_v = pid_v * BLOCK_V
    offs_v = first_v + tl.arange(0, BLOCK_V)
    v_ok = offs_v < value_dim
    if pid_r == 0:
        s0 = tl.zeros([BLOCK_V], dtype=tl.float32)
        s1 = tl.zeros([16, BLOCK_V], dtype=tl.float32)
        z0 = tl.zeros([1], dtype=tl.float32)
        z1 = tl.zeros([16], dtype=tl.float32)
        z2 = tl.zeros([16, 16], dtype=tl.float32)
        for start in range(first_tok, last_tok, BLOCK_T):
            tokens = start + offs_t
            t_ok = tokens < seq_len
            k = tl.load(k_base + tokens[:, None] * stride_ks + offs_f[None, :], mask=t_ok[:, None], other=0.0)
            v = tl.load(v_base + tokens[:, None] * stride_vs + offs_v[None, :],
                        mask=t_ok[:, None] & v_ok[None, :], other=0.0)
            k_t = tl.trans(k)
            s1 = tl.dot((k_t * 0.5).to(v.dtype), v, s1, input_precision=PRECISION)
            if GRAM:
                z2 = tl.dot(k_t, k, z2, input_precision=PRECISION)      # Gram: sum_t k_a k_b, exact products
            s0 += tl.sum(v.to(tl.float32), 0)
            z0 += tl.sum(t_ok.to(tl.float32), 0)
            z1 += tl.sum(k_t.to(tl.float32), 1) * 0.5
            boundary = start + BLOCK_T
            if (boundary % segment_len == 0) & (boundary < seq_len):
                entry = boundary // segment_len - 1
                _store_rows(prefix_kv, entry * 273, first_v, value_dim, s0[None, :])
                _store_rows(prefix_kv, entry * 273 + 1, first_v, value_dim, s1)
                if pid_v == 0:
                    pk = prefix_k + entry * 273
                    tl.store(pk + tl.arange(0, 1), z0)
                    tl.store(pk + 1 + offs_f, z1)
                    if GRAM:
                        tl.store(pk + 17 + offs_f[:, None] * 16 + offs_f[None, :], z2 * order2_scale)
        if WRITE_STATE:
            if ATOMIC:
                rows1 = 1 + offs_f
                tl.atomic_add(state_kv + offs_v, s0, mask=v_ok, sem="relaxed")
                tl.atomic_add(state_kv + rows1[:, None] * value_dim + offs_v[None, :], s1, mask=v_ok[None, :],
                              sem="relaxed")
                if pid_v == 0:
                    tl.atomic_add(state_k + tl.arange(0, 1), z0, sem="relaxed")
                    tl.atomic_add(state_k + rows1, z1, sem="relaxed")
                    if GRAM:
                        tl.atomic_add(state_k + 17 + offs_f[:, None] * 16 + offs_f[None, :], z2 * order2_scale,
                                      sem="relaxed")
            else:
                _store_rows(state_kv, 0, first_v, value_dim, s0[None, :])
                _store_rows(state_kv, 1, first_v, value_dim, s1)
                if pid_v == 0:
                    tl.store(state_k + tl.arange(0, 1), z0)
                    tl.store(state_k + 1 + offs_f, z1)
                    if GRAM:
                        tl.store(state_k + 17 + offs_f[:, None] * 16 + offs_f[None, :], z2 * order2_scale)
    else:
        first_a = (pid_r - 1) * GROUPS
        offs_a = first_a + tl.arange(0, GROUPS)
        first_row = 17 + first_a * 16
        offs_r = tl.arange(0, GROUPS * 16)
        kv_t = tl.zeros([BLOCK_V, GROUPS * 16], dtype=tl.float32)
        ksum = tl.zeros([GROUPS * 16], dtype=tl.float32)
        for start in range(first_tok, last_tok, BLOCK_T):
            tokens = start + offs_t
            t_ok = tokens < seq_len
            k = tl.load(k_base + tokens[:, None] * stride_ks + offs_f[None, :], mask=t_ok[:, None], other=0.0)
            k_a = tl.load(k_base + tokens[:, None] * stride_ks + offs_a[None, :], mask=t_ok[:, None], other=0.0)
            v_t = tl.load(v_base + tokens[None, :] * stride_vs + offs_v[:, None],
                          mask=t_ok[None, :] & v_ok[:, None], other=0.0)
            feats = tl.reshape(k_a.to(tl.float32)[:, :, None] * k.to(tl.float32)[:, None, :],
                               [BLOCK_T, GROUPS * 16])
            kv_t = tl.dot(v_t, feats.to(v_t.dtype), kv_t, input_precision=PRECISION)
            if not GRAM:
                ksum += tl.sum(feats, 0)
            boundary = start + BLOCK_T
            if (boundary % segment_len == 0) & (boundary < seq_len):
                entry = boundary // segment_len - 1
                _store_rows_t(prefix_kv, entry * 273 + first_row, first_v, value_dim, kv_t * order2_scale)
                if not GRAM:
                    if pid_v == 0:
                        tl.store(prefix_k + entry * 273 + first_row + offs_r, ksum * order2_scale)
        if WRITE_STATE:
            if ATOMIC:
                cols = first_v + tl.arange(0, BLOCK_V)
                rows = first_row + offs_r
                tl.atomic_add(state_kv + rows[None, :] * value_dim + cols[:, None], kv_t * order2_scale,
                              mask=(cols < value_dim)[:, None], sem="relaxed")
                if not GRAM:
                    if pid_v == 0:
                        tl.atomic_add(state_k + first_row + offs_r, ksum * order2_scale, sem="relaxed")
            else:
                _store_rows_t(state_kv, first_row, first_v, value_dim, kv_t * order2_scale)
                if not GRAM:
                    if pid_v == 0:
                        tl.store(state_k + first_row + offs_r, ksum * order2_scale)


@triton.jit
def _segment_v2(
    Q, K, V, O, PREFIX_KV, PREFIX_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    seq_len, value_dim, heads, segment_len, seg_per_part,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_v = tl.program_id(1)
    bh = tl.program_id(2)
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
    q = (q * 0.5).to(V.dtype.element_ty)
    num = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    segment = (pid_m * BLOCK_M) // segment_len
    seg_start = segment * segment_len
    part = segment // seg_per_part
    base = bh.to(tl.int64) * (tl.cdiv(seq_len, segment_len) - 1)
    for pp in range(0, part):                       # totals of earlier parts
        entry = base + (pp + 1) * seg_per_part - 1
        num, den = _read_prefix_state_16bit(q, num, den, PREFIX_KV + entry * (273 * value_dim),
                                            PREFIX_K + entry * 273, offs_v, v_ok, value_dim)
    if segment % seg_per_part != 0:                 # own part's earlier segments
        entry = base + segment - 1
        num, den = _read_prefix_state_16bit(q, num, den, PREFIX_KV + entry * (273 * value_dim),
                                            PREFIX_K + entry * 273, offs_v, v_ok, value_dim)
    for start in range(seg_start, pid_m * BLOCK_M, BLOCK_N):
        keys = start + offs_n
        k_t = tl.load(k_base + keys[None, :] * stride_ks + offs_f[:, None])
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_v[None, :], mask=v_ok[None, :], other=0.0)
        s = tl.dot(q, (k_t * 0.5).to(v.dtype), input_precision=PRECISION)
        w = 1.0 + s + 0.5 * s * s
        den += tl.sum(w, 1)
        num = tl.dot(w.to(v.dtype), v, num, input_precision=PRECISION)
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


def route_v2(q, k, v, segment_len=256, parts=1, return_state=True, groups=4, block_t=128, warps=4, stages=None,
             bm=64, bn=64, seg_warps=4, gram=True, do_state=True, do_segment=True, bufs=None):
    b, h, seq, _ = q.shape
    dv = v.shape[-1]
    segments = triton.cdiv(seq, segment_len)
    spp = triton.cdiv(segments, parts)
    part_len = spp * segment_len
    parts = triton.cdiv(seq, part_len)
    atomic = parts > 1
    if bufs is None:
        out = torch.empty(b, h, seq, dv, dtype=v.dtype, device=v.device)
        prefix_kv = torch.empty(b, h, max(segments - 1, 1), 273, dv, device=v.device, dtype=q.dtype)
        prefix_k = torch.empty(b, h, max(segments - 1, 1), 273, device=v.device, dtype=torch.float32)
        alloc = torch.zeros if atomic else torch.empty
        state = BasedState(alloc(b, h, 273, dv, device=v.device, dtype=torch.float32),
                           alloc(b, h, 273, device=v.device, dtype=torch.float32)) if return_state else None
    else:
        out, prefix_kv, prefix_k, state = bufs
    if do_state and (segments > 1 or return_state):
        skv, sk = (state.kv, state.k) if return_state else (prefix_k, prefix_k)
        block_v = min(64, max(16, triton.next_power_of_2(dv)))
        extra = {} if stages is None else {"num_stages": stages}
        _state_v2[(1 + 16 // groups, triton.cdiv(dv, block_v), b * h * parts)](
            k, v, prefix_kv, prefix_k, skv, sk,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            seq, dv, h, segment_len, part_len, parts,
            GROUPS=groups, BLOCK_T=min(block_t, segment_len), BLOCK_V=block_v, PRECISION="tf32",
            WRITE_STATE=return_state, ATOMIC=atomic, GRAM=gram, num_warps=warps, **extra)
    if not do_segment:
        return out, state
    block_v = min(128, max(16, triton.next_power_of_2(dv)))
    _segment_v2[(triton.cdiv(seq, bm), triton.cdiv(dv, block_v), b * h)](
        q, k, v, out, prefix_kv, prefix_k,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        seq, dv, h, segment_len, spp, BLOCK_M=bm, BLOCK_N=bn, BLOCK_V=block_v, PRECISION="tf32",
        num_warps=seg_warps)
    return out, state


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def main():
    quick = DEV == "cpu"
    B, H = (1, 2) if quick else (16, 16)
    lens = [300, 1024] if quick else [int(x) for x in os.environ.get("LENS", "1024,2048,4096,8192").split(",")]
    dtype = torch.float16 if quick else torch.bfloat16
    fla = None
    try:
        import fla.ops.based as fb
        fla = fb.parallel_based
    except Exception as e:  # noqa: BLE001
        print("no fla", e)
    if DEV == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    from triton.testing import do_bench
    for seq in lens:
        g = torch.Generator(device=DEV).manual_seed(seq)
        q = torch.randn(B, H, seq, 16, device=DEV, dtype=dtype, generator=g)
        k = torch.randn(B, H, seq, 16, device=DEV, dtype=dtype, generator=g)
        v = torch.randn(B, H, seq, 64, device=DEV, dtype=dtype, generator=g)
        ref_out, ref_state = based.based_prefill(q, k, v)
        if not quick:
            ms0 = do_bench(lambda: based.based_prefill(q, k, v), warmup=25, rep=100, return_mode="median")
            print(f"{seq} current (first): {ms0:.4f}", flush=True)
        if quick:
            r, _ = based.based_chunked_reference(q.float(), k.float(), v.float())
            print("cur vs fp32 ref", rel(ref_out, r))
        configs = {}
        for gram in (False, True):
            for parts in (1, 2, 4):
                configs[f"v2 state-only gram={gram} parts{parts}"] = dict(parts=parts, gram=gram, do_segment=False)
        configs["v2 segment-only"] = dict(do_state=False)
        configs["v2 full gram=False parts1"] = dict(gram=False)
        configs["v2 full gram=True parts1"] = dict(gram=True)
        configs["v2 full gram=True parts2"] = dict(gram=True, parts=2)
        for name, kw in configs.items():
            out, state = route_v2(q, k, v, **kw)
            full = kw.get("do_state", True) and kw.get("do_segment", True)
            err = rel(out, ref_out) if kw.get("do_segment", True) else 0.0
            if state is not None and kw.get("do_state", True):
                err = max(err, rel(state.kv, ref_state.kv), rel(state.k, ref_state.k))
            if quick:
                print(f"{seq} {name}: err {err:.1e}")
                continue
            bufs = None
            if not full:     # preallocated: time the kernel alone
                _, st = route_v2(q, k, v, **dict(kw, do_state=True, do_segment=True))
                seg = 256
                nseg = -(-seq // seg)
                bufs = (torch.empty_like(v), torch.empty(B, H, max(nseg - 1, 1), 273, 64, device=DEV, dtype=q.dtype),
                        torch.empty(B, H, max(nseg - 1, 1), 273, device=DEV), st)
                route_v2(q, k, v, **dict(kw, bufs=None))
            ms = do_bench(lambda: route_v2(q, k, v, bufs=bufs, **kw), warmup=25, rep=100, return_mode="median")
            print(f"{seq} {name}: {ms:.4f} ms err {err:.1e}{' MISMATCH' if err > 1e-2 else ''}", flush=True)
        if not quick:
            nseg = -(-seq // 256)
            pkv = torch.empty(B, H, max(nseg - 1, 1), 273, 64, device=DEV, dtype=q.dtype)
            pk = torch.empty(B, H, max(nseg - 1, 1), 273, device=DEV)
            skv = torch.empty(B, H, 273, 64, device=DEV)
            sk = torch.empty(B, H, 273, device=DEV)
            ms = do_bench(lambda: based._launch_prefix_state(k, v, pkv, pk, skv, sk, 256), warmup=25, rep=100,
                          return_mode="median")
            print(f"{seq} current state kernel alone: {ms:.4f} ms err {max(rel(skv, ref_state.kv), rel(sk, ref_state.k)):.1e}", flush=True)
            o2 = torch.empty_like(v)
            def seg_only():
                based._based_segment_kernel[(triton.cdiv(seq, 64), 1, B * H)](
                    q, k, v, o2, pkv, pk, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                    k.stride(2), v.stride(0), v.stride(1), v.stride(2), o2.stride(0), o2.stride(1), o2.stride(2),
                    seq, 64, H, 256, BLOCK_M=64, BLOCK_N=64, BLOCK_V=64, PRECISION="tf32", PREFIX_16BIT=True,
                    num_warps=4)
            ms = do_bench(seg_only, warmup=25, rep=100, return_mode="median")
            print(f"{seq} current segment kernel alone: {ms:.4f} ms err {rel(o2, ref_out):.1e}", flush=True)
        if quick:
            continue
        first_ms = do_bench(lambda: based.based_prefill(q, k, v), warmup=25, rep=100, return_mode="median")
        print(f"{seq} current (again): {first_ms:.4f}")
        base_ms = do_bench(lambda: based.based_prefill(q, k, v), warmup=25, rep=100, return_mode="median")
        base_oo = do_bench(lambda: based.based_prefill(q, k, v, return_state=False), warmup=25, rep=100,
                           return_mode="median")
        out1 = torch.empty_like(v)
        single = triton.next_power_of_2(seq)
        one_seg = do_bench(lambda: based._launch_segmented(q, k, v, out1, single, False), warmup=25, rep=100,
                           return_mode="median")
        print(f"{seq} current: {base_ms:.4f} ms, output only {base_oo:.4f}, single segment output-only "
              f"{one_seg:.4f} (err {rel(out1, ref_out):.1e})", flush=True)
        if fla is not None:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            fo = fla(qt, kt, vt).transpose(1, 2)
            fms = do_bench(lambda: fla(qt, kt, vt), warmup=25, rep=100, return_mode="median")
            print(f"{seq} fla parallel_based: {fms:.4f} ms err {rel(fo, ref_out):.1e}", flush=True)


if __name__ == "__main__":
    main()
