"""Grader of lesson 01: CPU kernels (RoPE tables, rotary embeddings, RMSNorm, attention).

Every reference here is written independently of the solution, in float64: RoPE as a complex
multiplication, attention head by head with explicit loops over the KV groups. The course's convention
(float32 math, one cast back at the end) fixes the rounding: float16 and bfloat16 RoPE and RMSNorm results
are compared bit for bit with the float64 reference rounded once.
"""

from __future__ import annotations

import math

import pytest
import torch

from grader.checks import (assert_close, assert_correctly_rounded, assert_unchanged, describe,
                           expect_value_error, randn, task, tolerances)
from yaie.switch import LessonProxy

L = LessonProxy(1)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


# ---------------------------------------------------------------- float64 references

def ref_inv_freq(head_dim: int, base: float, scaling: dict | None = None) -> list[float]:
    """One frequency at a time, in Python floats (float64)."""
    freqs = []
    for i in range(head_dim // 2):
        f = 1.0 / (base ** (2 * i / head_dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "linear":
            f = f / scaling["factor"]
        elif kind == "llama3":
            wavelength = 2 * math.pi / f
            orig = scaling["original_max_position_embeddings"]
            lo, hi, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
            if wavelength > orig / lo:
                f = f / factor
            elif wavelength >= orig / hi:
                s = (orig / wavelength - lo) / (hi - lo)
                f = (1 - s) * f / factor + s * f
        freqs.append(f)
    return freqs


def ref_tables(max_position: int, head_dim: int, base: float = 10000.0, scaling=None):
    inv = torch.tensor(ref_inv_freq(head_dim, base, scaling), dtype=torch.float64)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def ref_rope(x: torch.Tensor, positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE as complex multiplication: (x_i + j x_{i+h}) * exp(j p w_i)."""
    half = head_dim // 2
    x = x.double()
    z = torch.complex(x[..., :half], x[..., half:])
    inv = torch.tensor(ref_inv_freq(head_dim, base), dtype=torch.float64)
    angle = positions.double()[..., None, None] * inv            # broadcast over heads
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def rope_from_tables(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(exact, sizes): RoPE in float64 of the tables the function is given, and |x1 c| + |x2 s|, |x2 c| + |x1 s|,
    the size of the two products each element sums (where they cancel, float32's error is relative to these)."""
    half = x.shape[-1] // 2
    x = x.double()
    c, s = cos.double()[positions.long(), None, :half], sin.double()[positions.long(), None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    exact = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    sizes = torch.cat([(x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()], -1)
    return exact, sizes


ROUND_ONCE_HINT = ("the course's convention: math in float32 whatever the input dtype, cast back once at the end; "
                   "an operation in float16/bfloat16 on the way (the weight multiplied before the cast, say) "
                   "rounds twice")


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def ref_attention(q, k, v, allowed: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """Head by head, query head h reading KV head h // group; fully masked rows give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(b, hq, lq, d, dtype=torch.float64)
    for h in range(hq):
        s = q[:, h] @ k[:, h // group].transpose(-1, -2) * scale          # [b, lq, lk]
        if allowed is not None:
            m = allowed.expand(b, hq, lq, lk)[:, h]
            s = s.masked_fill(~m, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)                        # empty rows -> 0
        out[:, h] = p @ v[:, h // group]
    return out


def causal(lq: int, lk: int) -> torch.Tensor:
    return torch.tensor([[j <= lk - lq + i for j in range(lk)] for i in range(lq)])


# ---------------------------------------------------------------- task 1: RoPE tables

@task(1, "build_rope_cache")
@pytest.mark.parametrize("max_position,head_dim,base", [(1, 2, 10000.0), (37, 64, 10000.0), (16, 96, 500000.0)])
def test_rope_tables_match_float64(max_position, head_dim, base):
    cos, sin = L.build_rope_cache(max_position, head_dim, base=base)
    ref_cos, ref_sin = ref_tables(max_position, head_dim, base)
    case = f"max_position={max_position}, head_dim={head_dim}, base={base}"
    hint = "angle[p, i] = p * base ** (-2 * (i % (head_dim // 2)) / head_dim); both halves repeat the angles"
    assert_close(cos, ref_cos, name="cos table", dtype=torch.float32, atol=1e-6, rtol=1e-6, case=case, hint=hint)
    assert_close(sin, ref_sin, name="sin table", dtype=torch.float32, atol=1e-6, rtol=1e-6, case=case, hint=hint)


@task(1, "build_rope_cache")
def test_rope_tables_far_positions():
    cos, sin = L.build_rope_cache(131072, 8, base=10000.0)
    ref_cos, ref_sin = ref_tables(131072, 8)
    hint = "compute the angles in float64: in float32, p * inv_freq at p ~ 1e5 is off by ~1e-2 radians"
    assert_close(cos, ref_cos, name="cos table at large positions", atol=1e-5, rtol=0, case="131072 positions",
                 hint=hint)
    assert_close(sin, ref_sin, name="sin table at large positions", atol=1e-5, rtol=0, case="131072 positions",
                 hint=hint)


@task(1, "build_rope_cache")
@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
], ids=["linear", "llama3-small-context", "llama3-8192"])
def test_rope_tables_scaling(scaling):
    cos, sin = L.build_rope_cache(300, 128, base=500000.0, rope_scaling=scaling)
    ref_cos, ref_sin = ref_tables(300, 128, 500000.0, scaling)
    hint = ("llama3: wavelength = 2*pi/inv_freq; > original/low_freq_factor: divide by factor; "
            "< original/high_freq_factor: keep; in between: blend")
    assert_close(cos, ref_cos, name="cos table with rope_scaling", atol=1e-6, rtol=1e-6, case=str(scaling), hint=hint)
    assert_close(sin, ref_sin, name="sin table with rope_scaling", atol=1e-6, rtol=1e-6, case=str(scaling), hint=hint)


@task(1, "build_rope_cache")
def test_rope_tables_reject_bad_input():
    expect_value_error(L.build_rope_cache, 16, 7, what="odd head_dim=7 (RoPE rotates pairs)")
    expect_value_error(L.build_rope_cache, 0, 8, what="max_position=0")
    expect_value_error(L.build_rope_cache, 16, 8, rope_scaling={"rope_type": "yarn-ish"},
                       what="unknown rope_scaling type")


# ---------------------------------------------------------------- task 2: rotary embeddings

def _tables(max_position: int, head_dim: int):
    c, s = ref_tables(max_position, head_dim)
    return c.float(), s.float()


@task(2, "cpu_rope_embeddings")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_token_major(dtype, seed):
    num_tokens, heads, head_dim, max_pos = 11, 3, 32, 64
    x = randn(num_tokens, heads, head_dim, dtype=dtype, seed=seed)
    pos = torch.randint(0, max_pos, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    cos, sin = _tables(max_pos, head_dim)
    before = x.clone()
    got = L.cpu_rope_embeddings(x, cos, sin, pos)
    atol, rtol = tolerances(dtype)
    assert_close(got, ref_rope(x, pos, head_dim), name="rotated vectors", dtype=dtype, atol=atol, rtol=rtol,
                 case=describe(x=x) + ", random positions per token",
                 hint="out = x * cos[p] + rotate_half(x) * sin[p], rotate_half(x) = cat(-x2, x1); "
                      "index the tables by each token's own position")
    assert_unchanged(before, x, "input_tensor")
    if dtype in (torch.float16, torch.bfloat16):     # float32 math, one rounding: the spec fixes the bits
        exact, sizes = rope_from_tables(x, pos, cos, sin)
        assert_correctly_rounded(got, exact, name="rotated vectors", case=describe(x=x), hint=ROUND_ONCE_HINT,
                                 magnitude=sizes)


@task(2, "cpu_rope_embeddings")
def test_rope_batch_layout_and_strides(seed):
    # [batch, seq, heads, head_dim] taken as a strided slice of a fused projection.
    fused = randn(2, 5, 3 * 4, 16, seed=seed)
    x = fused[:, :, 4:8, :]                                   # non-contiguous view: the "k" part
    pos = torch.arange(5).repeat(2, 1) + torch.tensor([[0], [100]])   # second sequence continues at 100
    cos, sin = _tables(128, 16)
    got = L.cpu_rope_embeddings(x, cos, sin, pos)
    assert_close(got, ref_rope(x, pos, 16), name="rotated vectors", dtype=torch.float32,
                 case=describe(x=x) + ", positions [batch, seq]",
                 hint="position_ids has the input's shape without the last two dims; works for any leading dims")


@task(2, "cpu_rope_embeddings")
def test_rope_single_token_far_position(seed):
    x = randn(1, 8, 128, seed=seed)
    pos = torch.tensor([4095])
    cos, sin = _tables(4096, 128)
    got = L.cpu_rope_embeddings(x, cos, sin, pos)
    assert_close(got, ref_rope(x, pos, 128), name="rotated vector", case="one token at position 4095, 8 heads",
                 hint="a decode step is one token at a late position")


@task(2, "cpu_rope_embeddings")
def test_rope_rejects_bad_input(seed):
    x = randn(4, 2, 8, seed=seed)
    cos, sin = _tables(16, 8)
    pos = torch.arange(4)
    expect_value_error(L.cpu_rope_embeddings, x, cos, sin, torch.tensor([0, 1, 2, 16]),
                       what="position 16 outside a 16-row table")
    expect_value_error(L.cpu_rope_embeddings, x, cos, sin, torch.arange(3), what="3 positions for 4 tokens")
    expect_value_error(L.cpu_rope_embeddings, x, cos, sin, pos.float(), what="float position_ids")
    expect_value_error(L.cpu_rope_embeddings, randn(4, 2, 6, seed=seed), cos, sin, pos,
                       what="head_dim 6 but tables of width 8")
    expect_value_error(L.cpu_rope_embeddings, randn(8, seed=seed), cos, sin, pos, what="a 1-D input")


# ---------------------------------------------------------------- task 3: RMSNorm

@task(3, "cpu_rms_norm")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 96), (4, 1000)], ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_float64(shape, dtype, seed):
    x = randn(*shape, dtype=dtype, seed=seed)
    w = randn(shape[-1], dtype=dtype, seed=seed + 1)
    before = x.clone()
    got = L.cpu_rms_norm(x, w, 1e-6)
    atol, rtol = tolerances(dtype)
    assert_close(got, ref_rms_norm(x, w, 1e-6), name="cpu_rms_norm output", dtype=dtype, atol=atol, rtol=rtol,
                 case=describe(x=x, weight=w),
                 hint="x / sqrt(mean(x**2 over the last dim) + eps) * weight, in float32, cast back at the end")
    assert_unchanged(before, x, "input_tensor")
    if dtype in (torch.float16, torch.bfloat16):     # float32 math, one rounding: the spec fixes the bits
        assert_correctly_rounded(got, ref_rms_norm(x, w, 1e-6), name="cpu_rms_norm output",
                                 case=describe(x=x, weight=w), hint=ROUND_ONCE_HINT)


@task(3, "cpu_rms_norm")
def test_rms_norm_large_fp16_values(seed):
    x = randn(4, 256, dtype=torch.float16, seed=seed, scale=600.0)     # x**2 ~ 3.6e5 > fp16 max 65504
    w = randn(256, dtype=torch.float16, seed=seed + 1)
    got = L.cpu_rms_norm(x, w, 1e-6)
    assert_close(got, ref_rms_norm(x, w, 1e-6), name="cpu_rms_norm on large fp16 values", dtype=torch.float16,
                 case=describe(x=x) + " with |x| up to ~2000",
                 hint="squares of fp16 values above 256 overflow fp16: upcast to float32 before squaring")


@task(3, "cpu_rms_norm")
def test_rms_norm_strided_rows_and_epsilon(seed):
    base = randn(6, 130, seed=seed)
    x = base[::2, 1:129]                           # every other row, an offset slice: non-contiguous
    w = randn(128, seed=seed + 1)
    got = L.cpu_rms_norm(x, w, 0.5)
    assert_close(got, ref_rms_norm(x, w, 0.5), name="cpu_rms_norm on strided rows with epsilon=0.5",
                 dtype=torch.float32, case=describe(x=x),
                 hint="use the epsilon argument (not a constant), inside the square root")


@task(3, "cpu_rms_norm")
def test_rms_norm_rejects_bad_input(seed):
    x = randn(3, 8, seed=seed)
    expect_value_error(L.cpu_rms_norm, x, randn(7, seed=seed), what="weight of shape [7] for hidden size 8")
    expect_value_error(L.cpu_rms_norm, x.to(torch.int32), torch.ones(8, dtype=torch.int32), what="int32 input")
    expect_value_error(L.cpu_rms_norm, x, randn(8, seed=seed).to("meta"),
                       what="weight on another device (meta) than the input (cpu)")


# ---------------------------------------------------------------- task 4: attention

ATTENTION_CASES = {
    # name: (batch, heads, kv_heads, q_len, kv_len, head_dim, mask)
    "no-mask": (2, 4, 4, 5, 7, 16, None),
    "causal-square": (2, 4, 4, 9, 9, 16, "causal"),
    "causal-continuation": (1, 4, 4, 3, 10, 32, "causal"),
    "decode-q1": (3, 4, 4, 1, 13, 16, "causal"),
    "gqa-4:1": (2, 8, 2, 6, 6, 16, "causal"),
    "mqa": (1, 6, 1, 4, 8, 8, "causal"),
    "length-1": (1, 2, 2, 1, 1, 8, "causal"),
}


@task(4, "cpu_attention_forward")
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_matches_float64(name, seed):
    b, hq, hk, lq, lk, d, mask = ATTENTION_CASES[name]
    q = randn(b, hq, lq, d, seed=seed)
    k = randn(b, hk, lk, d, seed=seed + 1)
    v = randn(b, hk, lk, d, seed=seed + 2)
    got = L.cpu_attention_forward(q, k, v, mask=mask)
    allowed = causal(lq, lk) if mask == "causal" else None
    hints = {
        "causal-continuation": "with q_len < kv_len the queries are the LAST q_len positions: "
                               "query i sees keys 0 .. kv_len - q_len + i",
        "decode-q1": "one query at the end of the context sees every key",
        "gqa-4:1": "query head h reads KV head h // (num_heads // num_kv_heads)",
        "mqa": "one KV head serves every query head",
    }
    assert_close(got, ref_attention(q, k, v, allowed), name=f"attention output ({name})", dtype=torch.float32,
                 case=describe(q=q, k=k, v=v) + f", mask={mask!r}",
                 hint=hints.get(name, "softmax(q @ k^T * head_dim**-0.5 + mask) @ v, softmax over keys"))


@task(4, "cpu_attention_forward")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_attention_low_precision_inputs(dtype, seed):
    q = randn(2, 4, 8, 64, dtype=dtype, seed=seed)
    k = randn(2, 2, 8, 64, dtype=dtype, seed=seed + 1)
    v = randn(2, 2, 8, 64, dtype=dtype, seed=seed + 2)
    got = L.cpu_attention_forward(q, k, v, mask="causal")
    atol, rtol = tolerances(dtype)
    assert_close(got, ref_attention(q, k, v, causal(8, 8)), name="attention output", dtype=dtype,
                 atol=atol, rtol=rtol, case=describe(q=q, k=k, v=v),
                 hint="accumulate scores, softmax and the weighted sum in float32; cast the output to q's dtype")


@task(4, "cpu_attention_forward")
def test_attention_large_scores_and_custom_scale(seed):
    # Scores in the thousands: a naive exp() overflows. q and k are whole numbers so every score (and
    # every score times 0.5) is exact in float32: a float32 score of ~1e4 would otherwise carry a rounding
    # error of ~1e-3 that no correct kernel can avoid, and the check would fail on unlucky seeds.
    q = randn(1, 2, 5, 16, seed=seed, scale=40.0).round()
    k = randn(1, 2, 5, 16, seed=seed + 1, scale=40.0).round()
    v = randn(1, 2, 5, 16, seed=seed + 2)
    got = L.cpu_attention_forward(q, k, v, mask="causal", scale=0.5)
    assert_close(got, ref_attention(q, k, v, causal(5, 5), scale=0.5), name="attention with huge scores",
                 dtype=torch.float32, case=describe(q=q, k=k) + ", |scores| ~ 1e4, scale=0.5",
                 hint="subtract each row's max score before exp(); use the scale argument when given")


@task(4, "cpu_attention_forward")
def test_attention_bool_mask_and_strides(seed):
    # q/k/v as [batch, heads, seq, dim] views of token-major [batch, seq, heads, dim] tensors.
    q = randn(2, 6, 4, 16, seed=seed).transpose(1, 2)
    k = randn(2, 6, 2, 16, seed=seed + 1).transpose(1, 2)
    v = randn(2, 6, 2, 16, seed=seed + 2).transpose(1, 2)
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(2, 1, 6, 6, generator=gen) > 0.4        # a padding-style mask, broadcast over heads
    allowed[0, 0, 3, :] = False                                   # one query that sees nothing
    got = L.cpu_attention_forward(q, k, v, mask=allowed)
    assert_close(got, ref_attention(q, k, v, allowed), name="attention with a bool mask", dtype=torch.float32,
                 case=describe(q=q, k=k, v=v) + ", mask [2, 1, 6, 6] with an all-False row",
                 hint="True means 'may attend'; a row with no visible key must give zeros, not NaN")


@task(4, "cpu_attention_forward")
def test_attention_rejects_bad_input(seed):
    q = randn(1, 4, 3, 8, seed=seed)
    k = randn(1, 2, 3, 8, seed=seed)
    expect_value_error(L.cpu_attention_forward, q[0], k[0], k[0], what="3-D q/k/v")
    expect_value_error(L.cpu_attention_forward, randn(1, 3, 3, 8, seed=seed), k, k,
                       what="3 query heads over 2 KV heads")
    expect_value_error(L.cpu_attention_forward, q, k.half(), k.half(), what="q float32 but k/v float16")
    expect_value_error(L.cpu_attention_forward, randn(1, 4, 5, 8, seed=seed), k, k, mask="causal",
                       what="causal with q_len=5 > kv_len=3")
    expect_value_error(L.cpu_attention_forward, q, k, k, mask=torch.ones(2, 2, dtype=torch.bool),
                       what="a [2, 2] mask for 3 queries x 3 keys")
    expect_value_error(L.cpu_attention_forward, q, k, randn(1, 2, 4, 8, seed=seed), what="k and v lengths differ")
