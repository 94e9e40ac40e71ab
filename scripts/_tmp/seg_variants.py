"""Temporary probe: variants of the Based route's second launch (later segments' queries), 1k tokens."""
import os, sys, json
sys.path.insert(0, os.getcwd())
DEV = os.environ.get("DEV", "cuda")
if DEV == "cpu":
    from yaie.device import prepare_triton; prepare_triton()
import torch, triton
import triton.language as tl
import solutions.kernels.based as based


@triton.jit
def _half(pid_m, q_base, k_base, v_base, o_base, p0, p1, p2, P_K, offs_v, v_ok,
          stride_qs, stride_ks, stride_vs, stride_os, seq_len, segment_len,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr):
    inv_sqrt2 = 0.7071067811865476
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_f = tl.arange(0, 16)
    m_ok = offs_m < seq_len
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_f[None, :], mask=m_ok[:, None], other=0.0)
    qf = q.to(tl.float32) * 0.5
    qh = qf.to(q.dtype)
    if FMA:
        qs = (qf * 0.5).to(q.dtype)            # q/4: s = (q/4).k, k unscaled
    else:
        qs = qh
    # state before the segment
    q_scaled = qf * inv_sqrt2
    q2 = tl.reshape(q_scaled[:, :, None] * qf[:, None, :], [BLOCK_M, 256])
    num = tl.zeros([BLOCK_M, 64], dtype=tl.float32) + p0.to(tl.float32)[None, :]
    num = tl.dot(qh, p1, num)
    num = tl.dot(q2.to(q.dtype), p2, num)
    z2 = tl.load(P_K + 17 + offs_f[:, None] * 16 + offs_f[None, :])
    den = tl.load(P_K) + tl.sum(qf * tl.load(P_K + 1 + offs_f)[None, :], 1)
    den += tl.sum(tl.dot(q_scaled, z2, input_precision="ieee") * qf, 1)
    segment = (pid_m * BLOCK_M) // segment_len
    seg_start = segment * segment_len
    for start in range(seg_start, pid_m * BLOCK_M, BLOCK_N):
        keys = start + offs_n
        k_t = tl.load(k_base + keys[None, :] * stride_ks + offs_f[:, None])
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_v[None, :])
        if FMA:
            s = tl.dot(qs, k_t)
            w = tl.fma(s, tl.fma(s, 0.5, 1.0), 1.0)
        else:
            s = tl.dot(qs, (k_t * 0.5).to(v.dtype))
            w = 1.0 + s + 0.5 * s * s
        den += tl.sum(w, 1)
        num = tl.dot(w.to(v.dtype), v, num)
    for start in range(pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M, BLOCK_N):
        keys = start + offs_n
        k_ok = keys < seq_len
        k_t = tl.load(k_base + keys[None, :] * stride_ks + offs_f[:, None], mask=k_ok[None, :], other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_v[None, :], mask=k_ok[:, None], other=0.0)
        if FMA:
            s = tl.dot(qs, k_t)
            w = tl.where(offs_m[:, None] >= keys[None, :], tl.fma(s, tl.fma(s, 0.5, 1.0), 1.0), 0.0)
        else:
            s = tl.dot(qs, (k_t * 0.5).to(v.dtype))
            w = tl.where(offs_m[:, None] >= keys[None, :], 1.0 + s + 0.5 * s * s, 0.0)
        den += tl.sum(w, 1)
        num = tl.dot(w.to(v.dtype), v, num)
    out = num / den[:, None]
    tl.store(o_base + offs_m[:, None] * stride_os + offs_v[None, :], out.to(o_base.dtype.element_ty),
             mask=m_ok[:, None])


@triton.jit
def _seg_variant_kernel(
    Q, K, V, O, PREFIX_KV, PREFIX_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    seq_len, heads, segment_len, first_block,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIR: tl.constexpr, FMA: tl.constexpr,
):
    bh = tl.program_id(1)
    batch = (bh // heads).to(tl.int64)
    head = (bh % heads).to(tl.int64)
    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    o_base = O + batch * stride_ob + head * stride_oh
    value_dim = 64
    offs_v = tl.arange(0, 64)
    v_ok = offs_v < value_dim
    offs_f = tl.arange(0, 16)
    offs_2 = tl.arange(0, 256)
    # program i covers PAIR consecutive query blocks, last ones first
    blocks = tl.num_programs(0) * PAIR
    first_m = first_block + blocks - PAIR * (1 + tl.program_id(0))
    segment = (first_m * BLOCK_M) // segment_len
    prefix = bh.to(tl.int64) * (tl.cdiv(seq_len, segment_len) - 1) + segment - 1
    P_KV = PREFIX_KV + prefix * (273 * value_dim)
    P_K = PREFIX_K + prefix * 273
    p0 = tl.load(P_KV + offs_v)
    p1 = tl.load(P_KV + (1 + offs_f[:, None]) * value_dim + offs_v[None, :])
    p2 = tl.load(P_KV + (17 + offs_2[:, None]) * value_dim + offs_v[None, :])
    for i in tl.static_range(PAIR):
        _half(first_m + PAIR - 1 - i, q_base, k_base, v_base, o_base, p0, p1, p2, P_K, offs_v, v_ok,
              stride_qs, stride_ks, stride_vs, stride_os, seq_len, segment_len, BLOCK_M, BLOCK_N, FMA)


B, H, T, DV, SEG = (16, 16, 1024, 64, 256) if DEV == "cuda" else (1, 2, 1024, 64, 256)
torch.manual_seed(0)
q = torch.randn(B, H, T, 16, device=DEV, dtype=torch.bfloat16)
k = torch.randn(B, H, T, 16, device=DEV, dtype=torch.bfloat16)
v = torch.randn(B, H, T, DV, device=DEV, dtype=torch.bfloat16)
out = torch.empty_like(v)
segments = T // SEG
prefix_kv = torch.empty(B, H, segments - 1, 273, DV, device=DEV, dtype=torch.bfloat16)
prefix_k = torch.empty(B, H, segments - 1, 273, device=DEV, dtype=torch.float32)
skv = torch.empty(B, H, 273, DV, device=DEV, dtype=torch.float32)
sk = torch.empty(B, H, 273, device=DEV, dtype=torch.float32)
based._launch_prefix_state(k, v, prefix_kv, prefix_k, skv, sk, SEG, 8, 128, 4, None, True)
based._launch_segmented(q, k, v, out, SEG, True)
ref = out.clone()
strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2))
first = SEG // 64


def base():
    based._based_segment_kernel[(T // 64 - first, 1, B * H)](
        q, k, v, out, prefix_kv, prefix_k, *strides, T, DV, H, SEG, first,
        BLOCK_M=64, BLOCK_N=64, BLOCK_V=64, PRECISION="tf32", PREFIX_16BIT=True, num_warps=4)


def variant(pair, fma, stages, maxnreg):
    extra = {"num_stages": stages}
    if maxnreg:
        extra["maxnreg"] = maxnreg
    def fn():
        _seg_variant_kernel[((T // 64 - first) // pair, B * H)](
            q, k, v, out, prefix_kv, prefix_k, *strides, T, H, SEG, first,
            BLOCK_M=64, BLOCK_N=64, PAIR=pair, FMA=fma, num_warps=4, **extra)
    return fn


rows = []
if DEV == "cpu":
    ref = based.based_attention_reference(q.double(), k.double(), v.double()).to(ref.dtype)
    print("prefix nan", prefix_kv.isnan().any().item())
    out.zero_(); base(); d = (out.float() - ref.float())[:, :, SEG:]; print("base", d.abs().max().item() / ref.float().abs().max().item())
    for pair in (1, 2, 4):
        for fma in (False, True):
            out.zero_(); variant(pair, fma, 2, None)()
            d = (out.float() - ref.float())[:, :, SEG:]; print(pair, fma, d.abs().max().item() / ref.float().abs().max().item(), out.isnan().any().item(), ref.isnan().any().item())
    sys.exit()
t_base = triton.testing.do_bench(base, warmup=200, rep=1000)
rows.append({"name": "base", "us": round(1000 * t_base, 2)})
print(rows[-1], flush=True)
for pair in (1, 2, 4):
    for fma in (False, True):
        for stages in (2, 3):
            for maxnreg in (None, 96):
                if maxnreg and pair > 1:
                    continue
                fn = variant(pair, fma, stages, maxnreg)
                try:
                    out.zero_()
                    fn(); torch.cuda.synchronize()
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    t = triton.testing.do_bench(fn, warmup=200, rep=1000)
                    t2 = triton.testing.do_bench(base, warmup=50, rep=500)
                    rows.append({"pair": pair, "fma": fma, "stages": stages, "maxnreg": maxnreg,
                                 "us": round(1000 * t, 2), "base_us_after": round(1000 * t2, 2), "maxrel": err})
                except Exception as e:  # noqa: BLE001
                    rows.append({"pair": pair, "fma": fma, "stages": stages, "maxnreg": maxnreg, "error": str(e)[:200]})
                print(rows[-1], flush=True)
if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "seg_variants.json"), "w"), indent=1)
