"""Grader of lesson 02: Triton RMSNorm, fused residual add + RMSNorm, RoPE on q and k, SiLU-and-mul.

On a machine with no GPU the kernels run in the Triton interpreter (small shapes, float32 and float16);
on a CUDA GPU the same checks run on the GPU, plus bfloat16 and the shapes of a real model (hidden 4096,
thousands of tokens). Every reference is written here in float64, independently of the solution: RMSNorm
row by row from its formula, RoPE as a complex multiplication, SiLU from the exponential.

The module's convention fixes the rounding (float32 math, one rounding to the storage dtype; the fused
add + RMSNorm normalises the sum as it stored it), so float16 and bfloat16 results are also compared bit
for bit with the float64 reference rounded once (``assert_correctly_rounded``): a second rounding on the
way stays inside any tolerance.
"""

from __future__ import annotations

import pytest
import torch

from grader.checks import (assert_close, assert_correctly_rounded, assert_unchanged, describe, expect_value_error,
                           randn, task, tolerances)
from yaie.switch import LessonProxy

L = LessonProxy(2)

# bfloat16 runs on the GPU only: the interpreter rounds bf16 differently from the GPU.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
GPU_DTYPES = [torch.float16, torch.bfloat16]


# ---------------------------------------------------------------- float64 references

def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double().cpu()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double().cpu()


def ref_tables(max_position: int, head_dim: int, base: float = 10000.0):
    """float32 cos/sin tables of the rotate-half layout, angles in float64 (as lesson 01 builds them)."""
    inv = torch.tensor([base ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)
    angle = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([angle.cos(), angle.cos()], -1).float(), torch.cat([angle.sin(), angle.sin()], -1).float()


def ref_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as complex multiplication (x_i + j x_{i+h}) * (cos + j sin), in float64."""
    half = x.shape[-1] // 2
    x = x.double().cpu()
    pos = positions.cpu().long()
    z = torch.complex(x[..., :half], x[..., half:])
    rot = torch.complex(cos.double().cpu()[pos, :half], sin.double().cpu()[pos, :half])[:, None, :]
    z = z * rot
    return torch.cat([z.real, z.imag], dim=-1)


def rope_term_sizes(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|x1 cos| + |x2 sin| and |x2 cos| + |x1 sin|: the size of the two products each rotated element sums
    (where they cancel, float32's error is relative to these, not to the small result)."""
    half = x.shape[-1] // 2
    x = x.double().cpu().abs()
    pos = positions.cpu().long()
    c, s = cos.double().cpu()[pos, None, :half].abs(), sin.double().cpu()[pos, None, :half].abs()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c + x2 * s, x2 * c + x1 * s], dim=-1)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.double().cpu()
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return gate / (1.0 + torch.exp(-gate)) * up


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return tolerances(dtype)


# ---------------------------------------------------------------- task 1: rms_norm

ROUND_ONCE_HINT = ("the module's convention: math in float32 (load, convert, compute), one rounding to the "
                   "output dtype at the store; a multiplication in the storage dtype (the weight before it is "
                   "converted, say) rounds twice")
RMS_HINT = ("one program per row: load the row (mask the tail when hidden is not a power of two), "
            "sum of squares in float32 divided by hidden (not BLOCK_SIZE), then x * rsqrt(mean + eps) * w")


@task(1, "rms_norm")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [1, 7, 64, 100, 257])
def test_rms_norm_matches_float64(dtype, hidden, device, seed):
    x = randn(6, hidden, dtype=dtype, device=device, seed=seed)
    w = randn(hidden, dtype=dtype, device=device, seed=seed + 1)
    before = x.clone()
    got = L.rms_norm(x, w, 1e-6)
    atol, rtol = _tol(dtype)
    assert_close(got, ref_rms_norm(x, w, 1e-6), name="rms_norm output", dtype=dtype, atol=atol, rtol=rtol,
                 case=describe(x=x, weight=w), hint=RMS_HINT)
    assert_unchanged(before, x, "input_tensor")
    if dtype in (torch.float16, torch.bfloat16):     # math in float32, rounded once: the spec fixes the rounding
        assert_correctly_rounded(got, ref_rms_norm(x, w, 1e-6), name="rms_norm output", case=describe(x=x, weight=w),
                                 hint=ROUND_ONCE_HINT)


@task(1, "rms_norm")
def test_rms_norm_strided_rows_and_leading_dims(device, seed):
    wide = randn(2, 5, 96, device=device, seed=seed)
    x = wide[..., :80]                                   # rows of 80 elements, 96 apart: not contiguous
    w = randn(80, device=device, seed=seed + 1)
    got = L.rms_norm(x, w, 1e-5)
    assert_close(got, ref_rms_norm(x, w, 1e-5), name="rms_norm of a strided 3-D input", dtype=torch.float32,
                 case=describe(x=x) + ", eps=1e-5",
                 hint="flatten the leading dims into rows and pass the row stride (x.stride(-2)) to the kernel; "
                      "the output keeps the input's shape")


@task(1, "rms_norm")
def test_rms_norm_large_values_and_fp32_weight(device, seed):
    # Values near 300: their squares overflow float16 (max 65504) unless summed in float32.
    x = randn(4, 48, dtype=torch.float16, device=device, seed=seed, scale=300.0)
    w = randn(48, dtype=torch.float32, device=device, seed=seed + 1)
    got = L.rms_norm(x, w)
    assert_close(got, ref_rms_norm(x, w, 1e-6), name="rms_norm of large fp16 values", dtype=torch.float16,
                 case=describe(x=x, weight=w) + ", |x| ~ 300",
                 hint="convert the loaded values to float32 before squaring (x.to(tl.float32))")
    assert_correctly_rounded(got, ref_rms_norm(x, w, 1e-6), name="rms_norm of large fp16 values",
                             case=describe(x=x, weight=w) + ", |x| ~ 300, a float32 weight", hint=ROUND_ONCE_HINT)


@task(1, "rms_norm")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_rms_norm_llama_shape(dtype, device, seed):
    x = randn(3000, 4096, dtype=dtype, device=device, seed=seed)
    w = randn(4096, dtype=dtype, device=device, seed=seed + 1)
    got = L.rms_norm(x, w, 1e-5)
    atol, rtol = _tol(dtype)
    assert_close(got, ref_rms_norm(x, w, 1e-5), name="rms_norm at hidden 4096", dtype=dtype, atol=atol, rtol=rtol,
                 case=describe(x=x), hint=RMS_HINT)


@task(1, "rms_norm")
def test_rms_norm_rejects_bad_input(device, seed):
    x = randn(3, 16, device=device, seed=seed)
    w = randn(16, device=device, seed=seed)
    expect_value_error(L.rms_norm, x, randn(15, device=device, seed=seed), what="weight [15] for hidden 16")
    expect_value_error(L.rms_norm, x.to(torch.int32), w, what="an int32 input")
    expect_value_error(L.rms_norm, x.double(), w, what="a float64 input (float32, float16 and bfloat16 only)")
    expect_value_error(L.rms_norm, x, w, -1.0, what="epsilon = -1")
    expect_value_error(L.rms_norm, x, torch.ones(16, device="meta"), what="weight on another device")
    if device == "cuda":
        expect_value_error(L.rms_norm, x.cpu(), w.cpu(),
                           what="CPU tensors while Triton compiles for the GPU (no interpreter)")


# ---------------------------------------------------------------- task 2: fused_add_rms_norm

FUSED_HINT = ("residual += x (rounded to the residual's dtype), store it, then normalise that stored sum "
              "into x; both in place, one program per row")


ROUNDING_HINT = ("normalise exactly what you stored: new = (x + residual).to(dtype); store new; then compute the "
                 "norm from new (converted back to float32), not from the float32 sum x + residual")


def _check_fused(x, res, w, eps, case):
    dtype = x.dtype
    x0, res0 = x.clone(), res.clone()
    out = L.fused_add_rms_norm(x, res, w, eps)
    if not (isinstance(out, tuple) and len(out) == 2 and out[0] is x and out[1] is res):
        from grader.checks import GradingError
        raise GradingError("fused_add_rms_norm must return (input_tensor, residual): the same two tensors it was "
                           f"given, updated in place\n  case:     {case}\n  got:      {type(out).__name__}")
    atol, rtol = _tol(dtype)
    ref_res = x0.double().cpu() + res0.double().cpu()
    assert_close(res, ref_res, name="residual after the call (residual + input)", dtype=dtype, atol=atol, rtol=rtol,
                 case=case, hint="write residual + input back into residual")
    # Normalise the sum as it is stored (rounded to the dtype), as two separate ops would.
    ref_out = ref_rms_norm(ref_res.to(dtype), w, eps)
    assert_close(x, ref_out, name="input_tensor after the call (rms_norm of the new residual)", dtype=dtype,
                 atol=atol, rtol=rtol, case=case, hint=FUSED_HINT)
    # The tolerances above let a different rounding order through (normalising the float32 sum instead of
    # the stored one is off by less than one unit in the last place). The spec fixes the rounding: bits.
    assert_correctly_rounded(res, ref_res, name="residual after the call (residual + input)", case=case,
                             rel_margin=0.0, hint="compute residual + input in float32 and round it once to the dtype")
    if dtype in (torch.float16, torch.bfloat16):
        assert_correctly_rounded(x, ref_out, name="input_tensor after the call (rms_norm of the stored residual)",
                                 case=case, hint=ROUNDING_HINT)


@task(2, "fused_add_rms_norm")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [5, 64, 200])
def test_fused_add_rms_norm_in_place(dtype, hidden, device, seed):
    x = randn(7, hidden, dtype=dtype, device=device, seed=seed)
    res = randn(7, hidden, dtype=dtype, device=device, seed=seed + 1)
    w = randn(hidden, dtype=dtype, device=device, seed=seed + 2)
    _check_fused(x, res, w, 1e-6, describe(input_tensor=x, residual=res, weight=w))


@task(2, "fused_add_rms_norm")
def test_fused_add_rms_norm_strided_views(device, seed):
    # Both tensors are column slices of wider buffers: the kernel must write through the views.
    xbuf = randn(2, 4, 40, device=device, seed=seed)
    rbuf = randn(2, 4, 48, device=device, seed=seed + 1)
    x, res = xbuf[..., :24], rbuf[..., 8:32]
    w = randn(24, device=device, seed=seed + 2)
    xpad, rpad_lo, rpad_hi = xbuf[..., 24:].clone(), rbuf[..., :8].clone(), rbuf[..., 32:].clone()
    _check_fused(x, res, w, 1e-5, describe(input_tensor=x, residual=res) + " (views of wider buffers)")
    assert_unchanged(xpad, xbuf[..., 24:], "the part of input's buffer outside the view")
    assert_unchanged(rpad_lo, rbuf[..., :8], "the part of residual's buffer before the view")
    assert_unchanged(rpad_hi, rbuf[..., 32:], "the part of residual's buffer after the view")


@task(2, "fused_add_rms_norm")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_fused_add_rms_norm_llama_shape(dtype, device, seed):
    x = randn(2500, 4096, dtype=dtype, device=device, seed=seed)
    res = randn(2500, 4096, dtype=dtype, device=device, seed=seed + 1)
    w = randn(4096, dtype=dtype, device=device, seed=seed + 2)
    _check_fused(x, res, w, 1e-5, describe(input_tensor=x, residual=res))


@task(2, "fused_add_rms_norm")
def test_fused_add_rms_norm_rejects_bad_input(device, seed):
    x = randn(3, 16, device=device, seed=seed)
    res = randn(3, 16, device=device, seed=seed + 1)
    w = randn(16, device=device, seed=seed + 2)
    expect_value_error(L.fused_add_rms_norm, x, randn(3, 15, device=device, seed=seed), w,
                       what="residual [3, 15] for input [3, 16]")
    expect_value_error(L.fused_add_rms_norm, x, res.half(), w, what="float32 input with a float16 residual")
    expect_value_error(L.fused_add_rms_norm, x, res, randn(8, device=device, seed=seed), what="weight [8] for hidden 16")
    expect_value_error(L.fused_add_rms_norm, x, x, w, what="the same tensor as input and residual")


# ---------------------------------------------------------------- task 3: apply_rope_qk

ROPE_HINT = ("one program per token: load its position, cos[p] and sin[p], then for every head "
             "out[:h] = x1*cos - x2*sin, out[h:] = x2*cos + x1*sin (h = head_dim // 2), stored through q's and "
             "k's strides")


def _fused_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, device, seed):
    """q and k as views into one [num_tokens, (q + 2 kv) * head_dim] buffer, like a fused qkv projection."""
    qkv = randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device, seed=seed)
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    return qkv, q, k


def _check_rope(qkv, q, k, cos, sin, pos, case):
    dtype, head_dim = q.dtype, q.shape[-1]
    v_cols = slice((q.shape[1] + k.shape[1]) * head_dim, None)
    q0, k0, v0 = q.clone(), k.clone(), qkv[:, v_cols].clone()
    out = L.apply_rope_qk(q, k, cos, sin, pos)
    if not (isinstance(out, tuple) and len(out) == 2 and out[0] is q and out[1] is k):
        from grader.checks import GradingError
        raise GradingError("apply_rope_qk must rotate q and k in place and return (q, k), the same tensors\n"
                           f"  case:     {case}\n  got:      {type(out).__name__}")
    atol, rtol = _tol(dtype)
    assert_close(q, ref_rope(q0, pos, cos, sin), name="q after apply_rope_qk", dtype=dtype, atol=atol, rtol=rtol,
                 case=case, hint=ROPE_HINT)
    assert_close(k, ref_rope(k0, pos, cos, sin), name="k after apply_rope_qk", dtype=dtype, atol=atol, rtol=rtol,
                 case=case, hint=ROPE_HINT + "; k has its own number of heads (grouped-query attention)")
    if dtype in (torch.float16, torch.bfloat16):     # math in float32, rounded once: the spec fixes the rounding
        for name, got, before in (("q", q, q0), ("k", k, k0)):
            assert_correctly_rounded(got, ref_rope(before, pos, cos, sin), name=f"{name} after apply_rope_qk",
                                     case=case, hint=ROUND_ONCE_HINT, magnitude=rope_term_sizes(before, pos, cos, sin))
    assert_unchanged(v0, qkv[:, v_cols], "the v part of the fused qkv buffer (outside q and k)")


@task(3, "apply_rope_qk")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 10), (2, 2, 64)])
def test_rope_ragged_batch(dtype, q_heads, kv_heads, head_dim, device, seed):
    # A ragged batch: a 5-token prefill, a 3-token prefill continuing at 40, and two decode steps.
    pos = torch.tensor([0, 1, 2, 3, 4, 40, 41, 42, 17, 99], device=device)
    qkv, q, k = _fused_qkv(len(pos), q_heads, kv_heads, head_dim, dtype, device, seed)
    cos, sin = ref_tables(100, head_dim)
    _check_rope(qkv, q, k, cos.to(device), sin.to(device), pos,
                describe(q=q, k=k) + f", positions {pos.tolist()}")


@task(3, "apply_rope_qk")
def test_rope_int32_positions_random(device, seed):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 512, (9,), generator=gen, dtype=torch.int32).to(device)
    qkv, q, k = _fused_qkv(9, 4, 4, 32, torch.float32, device, seed)
    cos, sin = ref_tables(512, 32, base=500000.0)
    _check_rope(qkv, q, k, cos.to(device), sin.to(device), pos, describe(q=q, k=k) + ", random int32 positions")


@task(3, "apply_rope_qk")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_rope_llama_shape(dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 8192, (3000,), generator=gen).to(device)
    qkv, q, k = _fused_qkv(3000, 32, 8, 128, dtype, device, seed)
    cos, sin = ref_tables(8192, 128, base=500000.0)
    _check_rope(qkv, q, k, cos.to(device), sin.to(device), pos, describe(q=q, k=k))


@task(3, "apply_rope_qk")
def test_rope_rejects_bad_input(device, seed):
    qkv, q, k = _fused_qkv(4, 2, 1, 8, torch.float32, device, seed)
    cos, sin = (t.to(device) for t in ref_tables(16, 8))
    pos = torch.arange(4, device=device)
    expect_value_error(L.apply_rope_qk, q, k, cos, sin, pos[:3], what="3 positions for 4 tokens")
    expect_value_error(L.apply_rope_qk, q, k, cos, sin, pos.float(), what="float position_ids")
    expect_value_error(L.apply_rope_qk, q, k.half(), cos, sin, pos, what="q float32 but k float16")
    expect_value_error(L.apply_rope_qk, q, k[:3], cos, sin, pos, what="q with 4 tokens, k with 3")
    expect_value_error(L.apply_rope_qk, q, k, cos.double(), sin.double(), pos, what="float64 cos/sin tables")
    expect_value_error(L.apply_rope_qk, q, k, cos[:, :6], sin[:, :6], pos, what="tables of width 6 for head_dim 8")
    expect_value_error(L.apply_rope_qk, q.reshape(4, 16), k, cos, sin, pos, what="a 2-D q")
    odd = randn(4, 2, 7, device=device, seed=seed)
    expect_value_error(L.apply_rope_qk, odd, odd[:, :1].clone(), cos[:, :7], sin[:, :7], pos, what="odd head_dim 7")
    if device == "cpu":
        expect_value_error(L.apply_rope_qk, q, k, cos, sin, torch.tensor([0, 1, 2, 16]),
                           what="position 16 outside a 16-row table")


@task(3, "apply_rope_qk")
@pytest.mark.gpu
def test_rope_out_of_range_position_is_loud(device, seed):
    # On the GPU a host check would need a sync; the kernel must still never give a silent wrong answer:
    # raise ValueError, or leave NaN in the q and k rows of the bad token.
    qkv, q, k = _fused_qkv(4, 2, 1, 8, torch.float32, device, seed)
    cos, sin = (t.to(device) for t in ref_tables(16, 8))
    pos = torch.tensor([0, 1, 16, 3], device=device)
    try:
        L.apply_rope_qk(q, k, cos, sin, pos)
    except ValueError:
        return
    if not (torch.isnan(q[2]).all() and torch.isnan(k[2]).all()):
        from grader.checks import GradingError
        raise GradingError("a position outside the cos/sin table gave finite numbers: a silent wrong answer\n"
                           "  case:     position 16 with a 16-row table, on the GPU\n"
                           "  hint:     raise ValueError, or (no host sync) mask the table loads and write NaN "
                           "for that token")


# ---------------------------------------------------------------- task 4: silu_and_mul

SILU_HINT = ("gate = x[..., :d], up = x[..., d:]; out = gate * sigmoid(gate) * up in float32, "
             "rounded once to the input's dtype; mask the columns past d")


@task(4, "silu_and_mul")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [1, 5, 64, 1500])
def test_silu_and_mul_matches_float64(dtype, d, device, seed):
    x = randn(5, 2 * d, dtype=dtype, device=device, seed=seed, scale=2.0)
    before = x.clone()
    got = L.silu_and_mul(x)
    atol, rtol = _tol(dtype)
    assert_close(got, ref_silu_and_mul(x), name="silu_and_mul output", dtype=dtype, atol=atol, rtol=rtol,
                 case=describe(x=x), hint=SILU_HINT)
    assert_unchanged(before, x, "input_tensor")
    if dtype in (torch.float16, torch.bfloat16):     # "in float32, rounded once": the spec fixes the rounding
        assert_correctly_rounded(got, ref_silu_and_mul(x), name="silu_and_mul output", case=describe(x=x),
                                 hint="keep silu(gate) in float32 and multiply by up in float32; round once, at "
                                      "the store (rounding silu(gate) to the dtype first rounds twice)")


@task(4, "silu_and_mul")
def test_silu_and_mul_strided_3d_and_extremes(device, seed):
    wide = randn(2, 3, 50, device=device, seed=seed, scale=40.0)   # |gate| up to ~150: exp(-gate) overflows
    x = wide[..., :44]
    got = L.silu_and_mul(x)
    assert_close(got, ref_silu_and_mul(x), name="silu_and_mul of a strided 3-D input with large values",
                 dtype=torch.float32, case=describe(x=x) + ", |x| up to ~150",
                 hint="the output is [..., d]; silu(g) = g / (1 + exp(-g)) is 0 (not NaN) when exp(-g) is inf")


@task(4, "silu_and_mul")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_silu_and_mul_llama_shape(dtype, device, seed):
    x = randn(2048, 2 * 14336, dtype=dtype, device=device, seed=seed)
    got = L.silu_and_mul(x)
    atol, rtol = _tol(dtype)
    assert_close(got, ref_silu_and_mul(x), name="silu_and_mul at intermediate size 14336", dtype=dtype,
                 atol=atol, rtol=rtol, case=describe(x=x), hint=SILU_HINT)


@task(4, "silu_and_mul")
def test_silu_and_mul_rejects_bad_input(device, seed):
    expect_value_error(L.silu_and_mul, randn(3, 7, device=device, seed=seed), what="odd last dim 7")
    expect_value_error(L.silu_and_mul, randn(3, 8, device=device, seed=seed).to(torch.int64), what="int64 input")
    expect_value_error(L.silu_and_mul, randn(3, 0, device=device, seed=seed), what="empty last dim")
