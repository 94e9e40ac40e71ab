"""Temporary probe: the Based boundary-state kernel with the order-2 features gathered from a transposed k.

S[rows, v] += F^T[rows, tokens] @ V[tokens, v], F^T[(a, b), t] = kT[a, t] * kT[b, t]: both factors are loaded as
[rows, tokens] tiles from kT [B*H, 16, T] (contiguous along tokens; the L1 cache serves the repeated rows), so
no broadcast goes through shared memory; the normaliser's order-2 rows come from a Gram product kT @ k.
"""
import os, sys, json
sys.path.insert(0, os.getcwd())
DEV = os.environ.get("DEV", "cuda")
if DEV == "cpu":
    from yaie.device import prepare_triton; prepare_triton()
import torch, triton
import triton.language as tl
import solutions.kernels.based as based


@triton.jit
def _order2_gather_program(pid_r, bh, K, KT, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                           stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                           seq_len, value_dim, heads, segment_len,
                           GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, F32_PRODUCT: tl.constexpr):
    batch = (bh // heads).to(tl.int64)
    head = (bh % heads).to(tl.int64)
    k_base = K + batch * stride_kb + head * stride_kh
    kt_base = KT + bh.to(tl.int64) * 16 * seq_len
    v_base = V + batch * stride_vb + head * stride_vh
    segments = tl.cdiv(seq_len, segment_len)
    prefix_kv = PREFIX_KV + bh.to(tl.int64) * (segments - 1) * (273 * value_dim)
    prefix_k = PREFIX_K + bh.to(tl.int64) * (segments - 1) * 273
    state_kv = STATE_KV + bh.to(tl.int64) * (273 * value_dim)
    state_k = STATE_K + bh.to(tl.int64) * 273
    order2_scale = 0.17677669529663687
    ROWS: tl.constexpr = GROUPS * 16
    first_a = (pid_r - 1) * GROUPS
    first_row = 17 + first_a * 16
    offs_r = tl.arange(0, ROWS)
    a_of_r = first_a + offs_r // 16
    b_of_r = offs_r % 16
    offs_t = tl.arange(0, BLOCK_T)
    offs_f = tl.arange(0, 16)
    offs_v = tl.arange(0, BLOCK_V)
    kv = tl.zeros([ROWS, BLOCK_V], dtype=tl.float32)
    gram = tl.zeros([16, 16], dtype=tl.float32)
    g_rows = tl.arange(0, 16)                       # Gram rows this program stores: its GROUPS features a
    g_ok = (g_rows >= first_a) & (g_rows < first_a + GROUPS)
    for start in range(0, seq_len, BLOCK_T):
        tokens = start + offs_t
        ka = tl.load(kt_base + a_of_r[:, None] * seq_len + tokens[None, :])
        kb = tl.load(kt_base + b_of_r[:, None] * seq_len + tokens[None, :])
        if F32_PRODUCT:
            feats = (ka.to(tl.float32) * kb.to(tl.float32)).to(ka.dtype)
        else:
            feats = ka * kb
        v = tl.load(v_base + tokens[:, None] * stride_vs + offs_v[None, :])
        kv = tl.dot(feats, v, kv)
        kt16 = tl.load(kt_base + offs_f[:, None] * seq_len + tokens[None, :])
        k16 = tl.load(k_base + tokens[:, None] * stride_ks + offs_f[None, :])
        gram = tl.dot(kt16, k16, gram)
        boundary = start + BLOCK_T
        if (boundary % segment_len == 0) & (boundary < seq_len):
            entry = boundary // segment_len - 1
            based._store_rows(prefix_kv, entry * 273 + first_row, 0, value_dim, kv * order2_scale)
            tl.store(prefix_k + entry * 273 + 17 + g_rows[:, None] * 16 + offs_f[None, :], gram * order2_scale,
                     mask=g_ok[:, None])
    based._store_rows(state_kv, first_row, 0, value_dim, kv * order2_scale)
    tl.store(state_k + 17 + g_rows[:, None] * 16 + offs_f[None, :], gram * order2_scale, mask=g_ok[:, None])


@triton.jit(do_not_specialize=["seq_len"])
def _state_gather_kernel(K, KT, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                         stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                         seq_len, value_dim, heads, segment_len,
                         GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                         F32_PRODUCT: tl.constexpr):
    pid_r = tl.program_id(0)
    bh = tl.program_id(2)
    if pid_r == 0:
        based._prefix_state_program(0, 0, bh, K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                                    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                                    seq_len, value_dim, heads, segment_len, GROUPS, 128, BLOCK_V, "tf32", True)
    else:
        _order2_gather_program(pid_r, bh, K, KT, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                               stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                               seq_len, value_dim, heads, segment_len, GROUPS, BLOCK_T, BLOCK_V, F32_PRODUCT)


def launch(k, kt, v, prefix_kv, prefix_k, kv, ks, seg, groups, block_t, warps, f32, stages=None):
    B, H, T, _ = k.shape
    extra = {"num_stages": stages} if stages else {}
    _state_gather_kernel[(1 + 16 // groups, 1, B * H)](
        k, kt, v, prefix_kv, prefix_k, kv, ks, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), T, v.shape[-1], H, seg, GROUPS=groups, BLOCK_T=block_t, BLOCK_V=64, F32_PRODUCT=f32,
        num_warps=warps, **extra)


def main():
    B, H, T = (16, 16, int(os.environ.get("SEQ", "1024"))) if DEV == "cuda" else (1, 2, 512)
    SEG = 256
    torch.manual_seed(0)
    k = torch.randn(B, H, T, 16, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(B, H, T, 64, device=DEV, dtype=torch.bfloat16)
    segs = T // SEG

    def bufs():
        return (torch.zeros(B, H, segs - 1, 273, 64, device=DEV, dtype=torch.bfloat16),
                torch.zeros(B, H, segs - 1, 273, device=DEV), torch.zeros(B, H, 273, 64, device=DEV),
                torch.zeros(B, H, 273, device=DEV))
    ref = bufs()
    based._launch_prefix_state(k, v, *ref, SEG, 8, 128, 4, None, True)
    kt = k.transpose(-1, -2).contiguous()
    configs = [(8, 64, 4, True, 2), (8, 64, 4, False, 2), (8, 64, 4, True, 1), (8, 64, 4, True, 3), (8, 32, 4, True, 2),
               (4, 64, 4, True, 2), (4, 128, 4, True, 2), (16, 64, 8, True, 2), (8, 64, 8, True, 2)]
    if DEV == "cpu":
        configs = configs[:2]
    rows = []
    for groups, block_t, warps, f32, stages in configs:
        got = bufs()
        try:
            launch(k, kt, v, *got, SEG, groups, block_t, warps, f32, stages)
            if DEV == "cuda":
                torch.cuda.synchronize()
            err = [((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(got, ref)]
            row = {"groups": groups, "block_t": block_t, "warps": warps, "f32": f32, "stages": stages, "maxrel": [round(e, 6) for e in err]}
            if DEV == "cuda":
                row["us"] = round(1000 * triton.testing.do_bench(
                    lambda: launch(k, kt, v, *got, SEG, groups, block_t, warps, f32, stages), warmup=200, rep=1000), 2)
                row["committed_us"] = round(1000 * triton.testing.do_bench(
                    lambda: based._launch_prefix_state(k, v, *ref, SEG, 8, 128, 4, None, True), warmup=100, rep=500), 2)
                row["transpose_us"] = round(1000 * triton.testing.do_bench(
                    lambda: k.transpose(-1, -2).contiguous(), warmup=100, rep=500), 2)
        except Exception as e:  # noqa: BLE001
            row = {"groups": groups, "block_t": block_t, "warps": warps, "f32": f32, "error": str(e)[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"state_gather_{T}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
