"""Lesson 02 beyond its grader: the reference's fallback paths, its guards, and the benchmark's code on a CPU.

The grader (grader/lesson02) checks the exercises as students see them; here are the paths it does not
reach: inputs whose last dim is not contiguous (work on a copy, write back), empty inputs, the RoPE kernel's
NaN for out-of-range positions (the GPU path, launched directly), the refusal of CPU tensors when Triton
compiles for a GPU, and a small run of ``yaie/bench/lesson02.py`` through the interpreter.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

from solutions.kernels import gpu_elementwise as ref
from yaie.kernels import gpu_elementwise_given as given


def f64_rms(x, w, eps=1e-6):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def tables(max_position, head_dim):
    inv = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def test_transposed_inputs_take_the_copy_path():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(24, 5, generator=gen)
    x = base.t()                                       # [5, 24] with last-dim stride 5
    w = torch.randn(24, generator=gen)
    torch.testing.assert_close(ref.rms_norm(x, w), f64_rms(x, w).float(), atol=1e-5, rtol=1e-5)

    res_base = torch.randn(24, 5, generator=gen)
    res = res_base.t()
    x0, res0 = x.clone(), res.clone()
    out_x, out_res = ref.fused_add_rms_norm(x, res, w)
    assert out_x is x and out_res is res
    torch.testing.assert_close(res, x0 + res0)
    torch.testing.assert_close(x, f64_rms(x0 + res0, w).float(), atol=1e-5, rtol=1e-5)
    # the results went back into the original buffers
    torch.testing.assert_close(base.t(), x)

    y = torch.randn(10, 3, generator=gen).t()          # [3, 10], d = 5
    want = torch.nn.functional.silu(y[:, :5].double()) * y[:, 5:].double()
    torch.testing.assert_close(ref.silu_and_mul(y), want.float(), atol=1e-5, rtol=1e-5)


def test_rope_with_non_contiguous_head_dim():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(8, 3, 4, generator=gen).permute(2, 1, 0)     # [4 tokens, 3 heads, 8] last-dim stride 12
    k = torch.randn(4, 1, 8, generator=gen)
    cos, sin = tables(16, 8)
    pos = torch.tensor([3, 0, 15, 7])
    want_q, want_k = ref.apply_rope_qk_reference(q.clone(), k.clone(), cos, sin, pos)
    ref.apply_rope_qk(q, k, cos, sin, pos)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)


def test_empty_inputs():
    w = torch.randn(16)
    assert ref.rms_norm(torch.empty(0, 16), w).shape == (0, 16)
    x, r = torch.empty(0, 16), torch.empty(0, 16)
    assert ref.fused_add_rms_norm(x, r, w)[0] is x
    assert ref.silu_and_mul(torch.empty(2, 0, 8)).shape == (2, 0, 4)
    cos, sin = tables(4, 8)
    q, k = torch.empty(0, 2, 8), torch.empty(0, 1, 8)
    assert ref.apply_rope_qk(q, k, cos, sin, torch.empty(0, dtype=torch.int64))[0] is q


def test_hidden_above_the_single_tile_limit_is_refused():
    with pytest.raises(ValueError, match="hidden size"):
        ref.rms_norm(torch.empty(1, ref.MAX_HIDDEN + 1), torch.empty(ref.MAX_HIDDEN + 1))


def test_cpu_tensors_refused_when_triton_compiles_for_a_gpu(monkeypatch):
    monkeypatch.setattr(ref, "triton_interpreted", lambda: False)
    monkeypatch.setattr(given, "triton_interpreted", lambda: False)    # check_devices is given code
    with pytest.raises(ValueError, match="CPU tensors"):
        ref.rms_norm(torch.randn(2, 8), torch.randn(8))
    with pytest.raises(ValueError, match="CPU tensors"):
        ref.silu_and_mul(torch.randn(2, 8))


def test_rope_kernel_writes_nan_for_positions_outside_the_table():
    # The GPU path checks no positions on the host (a sync); the kernel must make the error loud itself.
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cos, sin = tables(16, 8)
    pos = torch.tensor([1, 16, -2])
    want_q0 = ref.rope_reference(q[:1], cos, sin, pos[:1])
    ref._rope_qk_kernel[(3,)](q, k, cos, sin, pos, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), sin.stride(0), 2, 1, 4, 16,
                              BLOCK_Q_HEADS=2, BLOCK_K_HEADS=1, BLOCK_HALF=4)
    torch.testing.assert_close(q[:1], want_q0, atol=1e-5, rtol=1e-5)
    assert torch.isnan(q[1:]).all() and torch.isnan(k[1:]).all()


def test_benchmark_code_runs_on_a_cpu(monkeypatch):
    """The lesson 02 benchmark's cases, checks and sweep, shrunk and run through the interpreter."""
    import yaie.bench.lesson02 as lesson02
    from yaie import switch

    monkeypatch.setenv(switch.ENV_VAR, "2")
    monkeypatch.setattr(lesson02, "DEVICE", "cpu")
    monkeypatch.setattr(lesson02, "token_counts", lambda quick: [4])
    monkeypatch.setattr(lesson02, "HIDDEN", 64)
    monkeypatch.setattr(lesson02, "Q_HEADS", 4)
    monkeypatch.setattr(lesson02, "KV_HEADS", 2)
    monkeypatch.setattr(lesson02, "HEAD_DIM", 16)
    monkeypatch.setattr(lesson02, "MAX_POSITION", 1024)
    monkeypatch.setattr(lesson02, "_compiled", lambda fn: fn)

    def one_call_ms(fn, warmup_ms=0, rep_ms=0):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(lesson02, "bench_ms", one_call_ms)
    rows = lesson02.run(types.SimpleNamespace(quick=True))
    kernels = {r.kernel for r in rows}
    assert kernels == {"rms_norm", "fused_add_rms_norm", "apply_rope_qk", "silu_and_mul"}
    impls = {r.impl for r in rows}
    assert impls == {"triton (reference)", "torch eager", "torch.compile", "copy_ of the same bytes"}
    rms = next(r for r in rows if r.kernel == "rms_norm")
    assert rms.bytes_moved == (2 * 4 * 64 + 64) * 2
    assert all(r.gbps is not None and r.gbps > 0 for r in rows)
