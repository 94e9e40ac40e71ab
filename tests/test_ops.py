"""yaie.ops (the engine's door to the lesson kernels) and the KV cache, against float64 definitions."""

import math

import pytest
import torch

import solutions.kernels.cpu_kernels as reference
from yaie import ops
from yaie.engine import ContiguousKVCache
from yaie.model.testing import fresh_seed


@pytest.fixture(autouse=True)
def _reference_lessons(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    ops.reset_auto_fallback()


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def naive_attention(q, k, v, window=None):
    """Token-major float64 loops: query i (the last q_len of kv_len positions) over its visible keys."""
    q_len, heads, dim = q.shape
    kv_len, kv_heads, _ = k.shape
    out = torch.zeros(q_len, heads, dim, dtype=torch.float64)
    for i in range(q_len):
        pos = kv_len - q_len + i
        first = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = torch.stack([q[i, h].double() @ k[j, g].double() / math.sqrt(dim) for j in range(first, pos + 1)])
            weights = torch.softmax(scores, dim=0)
            out[i, h] = sum(w * v[j, g].double() for w, j in zip(weights, range(first, pos + 1)))
    return out


@pytest.mark.parametrize("q_len,kv_len,window", [(7, 7, None), (1, 9, None), (3, 11, None), (10, 10, 4), (1, 12, 5)])
def test_attention_token_major(q_len, kv_len, window):
    seed = fresh_seed()
    q, k, v = randn(q_len, 4, 8, seed=seed), randn(kv_len, 2, 8, seed=seed + 1), randn(kv_len, 2, 8, seed=seed + 2)
    got = ops.attention(q, k, v, sliding_window=window)
    assert got.shape == (q_len, 4, 8)
    assert torch.allclose(got.double(), naive_attention(q, k, v, window), atol=1e-5), f"seed={seed}"


def test_norms_rope_and_activation_match_float64():
    seed = fresh_seed()
    x, res, w = randn(5, 32, seed=seed), randn(5, 32, seed=seed + 1), randn(32, seed=seed + 2)

    def norm64(t):
        t = t.double()
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()

    assert torch.allclose(ops.rms_norm(x, w, 1e-5).double(), norm64(x), atol=1e-5)
    normed, summed = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.allclose(summed, x + res) and torch.allclose(normed.double(), norm64(x + res), atol=1e-5)

    gate_up = randn(5, 2 * 16, seed=seed + 3)
    g, u = gate_up.double().chunk(2, dim=-1)
    assert torch.allclose(ops.silu_and_mul(gate_up).double(), g / (1 + torch.exp(-g)) * u, atol=1e-6)

    # RoPE: pair (i, i + d/2) of the vector at position p turns by p * 10000^(-2i/d), as a complex number.
    q, k = randn(5, 4, 16, seed=seed + 4), randn(5, 2, 16, seed=seed + 5)
    positions = torch.tensor([0, 3, 4, 9, 30])
    cos, sin = ops.rope_cache(64, 16)
    rq, rk = ops.rope(q, k, cos, sin, positions)
    for src, got in ((q, rq), (k, rk)):
        z = torch.complex(src[..., :8].double(), src[..., 8:].double())
        angle = positions.double()[:, None, None] * 10000.0 ** (-torch.arange(8, dtype=torch.float64) * 2 / 16)
        turned = z * torch.exp(1j * angle)
        want = torch.cat([turned.real, turned.imag], dim=-1)
        assert torch.allclose(got.double(), want, atol=1e-5), f"seed={seed}"


def test_ops_call_lesson01_on_cpu(monkeypatch):
    called = []
    for name in ("cpu_rms_norm", "cpu_rope_embeddings", "cpu_attention_forward", "build_rope_cache"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _r=real, _n=name, **kw: called.append(_n) or _r(*a, **kw))
    x = torch.randn(3, 8)
    ops.rms_norm(x, torch.ones(8), 1e-6)
    ops.add_rms_norm(x, x.clone(), torch.ones(8), 1e-6)
    cos, sin = ops.rope_cache(16, 8)
    ops.rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), cos, sin, torch.arange(3))
    ops.attention(torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    assert called == ["cpu_rms_norm", "cpu_rms_norm", "build_rope_cache", "cpu_rope_embeddings",
                      "cpu_rope_embeddings", "cpu_attention_forward"]


def test_describe(monkeypatch):
    assert ops.describe() == "all lessons run the reference solutions (solutions/)"
    monkeypatch.delenv("YAIE_SOLUTIONS")
    assert ops.describe().startswith("auto mode")


def test_contiguous_kv_cache():
    cache = ContiguousKVCache(num_layers=2, capacity=5, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    k1, v1, k2, v2 = (torch.randn(n, 2, 4) for n in (3, 3, 2, 2))
    for layer in range(2):
        cache.append(layer, k1, v1)
    assert len(cache) == 3
    for layer in range(2):
        cache.append(layer, k2, v2)
    keys, values = cache.get(1)
    assert torch.equal(keys, torch.cat([k1, k2])) and torch.equal(values, torch.cat([v1, v2])) and len(cache) == 5
    with pytest.raises(ValueError, match="KV cache full"):
        cache.append(0, k2, v2)
    with pytest.raises(ValueError, match="capacity"):
        ContiguousKVCache(1, 0, 1, 4, torch.float32, "cpu")
