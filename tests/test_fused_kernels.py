"""The reference's fused kernels for the engine's decode step, against float64 references, and the ops that pick them.

``apply_rope_qk_store_kv`` (lesson 02's module, not an exercise) rotates q and k and writes k and v into
lesson 03's paged cache in one launch; ``yaie.ops.rope_and_write_kv`` uses it only where the reference
serves lessons 02 and 03, and keeps the two ops apart for a student's module. On the CPU the kernels run in
the Triton interpreter (tiny shapes).
"""

from __future__ import annotations

import pytest
import torch

from solutions.kernels import gpu_elementwise as ref
from solutions.kernels import kv_cache as ref03
from yaie import ops
from yaie.model.testing import fresh_seed

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def tables(max_position: int, head_dim: int):
    inv = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64 (the independent reference)."""
    x = x.double()
    half = x.shape[-1] // 2
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s


def case(dtype, device="cpu", tokens=5, heads=4, kv_heads=2, head_dim=8, blocks=6, block_size=4, seed=None):
    gen = torch.Generator().manual_seed(fresh_seed() if seed is None else seed)
    # q, k, v as views of one fused projection output (as the model makes them): strided rows.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))
    cos, sin = tables(64, head_dim)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    # Poisoned caches: every slot not written must stay NaN.
    k_cache = torch.full((blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    moved = [t.to(device) for t in (q, k, v, cos, sin, positions, k_cache, v_cache, slots)]
    return moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_store_kv_matches_float64(dtype):
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = case(dtype)
    want_q, want_k = rope64(q, cos, sin, positions), rope64(k, cos, sin, positions)
    want_v = v.double().clone()
    out_q, out_k = ref.apply_rope_qk_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q.double(), want_q, **TOL[dtype])
    torch.testing.assert_close(k.double(), want_k, **TOL[dtype])
    rows_k, rows_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    torch.testing.assert_close(rows_k[slots].double(), want_k, **TOL[dtype])
    assert torch.equal(rows_k[slots], k), "the cache holds exactly the rotated k written back to k"
    torch.testing.assert_close(rows_v[slots].double(), want_v, atol=0, rtol=0)
    untouched = torch.ones(rows_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert rows_k[untouched].isnan().all() and rows_v[untouched].isnan().all(), "slots not in the mapping changed"


def test_rope_store_kv_equals_its_torch_reference_and_the_two_ops():
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = case(torch.float32, tokens=7, heads=6, kv_heads=3,
                                                                  head_dim=12)
    want = ref.apply_rope_qk_store_kv_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    # The two ops apart: lesson 02's RoPE, then lesson 03's write_kv on a manager holding the same cache.
    q2, k2 = q.clone(), k.clone()
    ref.apply_rope_qk(q2, k2, cos, sin, positions)
    ref.apply_rope_qk_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    for got, expected in zip((q, k, k_cache, v_cache), want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def test_rope_store_kv_with_strided_heads_takes_the_copy_path():
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = case(torch.float32)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)        # same values, last-dim stride != 1
    want = ref.apply_rope_qk_store_kv_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    ref.apply_rope_qk_store_kv(q_t, k, v, cos, sin, positions, k_cache, v_cache, slots)
    for got, expected in zip((q_t, k, k_cache, v_cache), want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_rope_store_kv_empty_and_bad_inputs():
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = case(torch.float32)
    empty = [t[:0] for t in (q, k, v)]
    assert ref.apply_rope_qk_store_kv(*empty, cos, sin, positions[:0], k_cache, v_cache, slots[:0])[0] is empty[0]
    before = [t.clone() for t in (q, k, k_cache, v_cache)]
    bad = {
        "slot_mapping": dict(slot_mapping=slots.float()),
        "slot_mapping must lie": dict(slot_mapping=torch.full_like(slots, k_cache.shape[0] * k_cache.shape[1])),
        "v ": dict(v=v[:, :1]),
        "k_cache": dict(k_cache=k_cache[:, :, :1]),
        "must match": dict(v_cache=v_cache.half()),
        "layout": dict(k_cache=k_cache.transpose(0, 1)),
        "position_ids must lie": dict(position_ids=torch.full_like(positions, 64)),
    }
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, position_ids=positions, k_cache=k_cache, v_cache=v_cache,
                slot_mapping=slots)
    for match, change in bad.items():
        with pytest.raises(ValueError, match=match):
            ref.apply_rope_qk_store_kv(**{**args, **change})
    for t, b in zip((q, k, k_cache, v_cache), before):
        assert torch.equal(t, b) or torch.equal(t.isnan(), b.isnan()) and torch.equal(t.nan_to_num(), b.nan_to_num()), \
            "a refused call changed a tensor"


def test_out_of_range_slot_on_the_kernel_path_is_skipped():
    """The GPU path does not read slots back: the kernel skips a slot outside the cache (launched directly)."""
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = case(torch.float32, tokens=3)
    slots[1] = k_cache.shape[0] * k_cache.shape[1] + 5
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    head_dim, half = q.shape[2], q.shape[2] // 2
    ref._rope_qk_store_kv_kernel[(3,)](
        q, k, v, cos, sin, positions, slots, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        q.shape[1], k.shape[1], half, head_dim, cos.shape[0], num_slots,
        BLOCK_Q_HEADS=4, BLOCK_K_HEADS=2, BLOCK_HALF=4, BLOCK_D=8, num_warps=1)
    written = (~k_cache.flatten(0, 1).isnan().all(-1).all(-1)).sum()
    assert written == 2, "only the two in-range slots are written"


# ----------------------------------------------------------------------------- the op that picks the kernel
def _manager(cls, dtype=torch.float32):
    return cls(num_blocks=6, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu")


class StudentManager(ref03.KVCacheManager):
    """A finished student's lesson 03 (the reference's methods, in a class of the student's own module)."""


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("student_lesson", [None, 2, 3])
def test_rope_and_write_kv_fuses_only_for_the_reference(monkeypatch, student_lesson):
    """Where the reference serves lessons 02 and 03 the fused kernel runs; a student's lesson 02 (which has no
    fused kernel) or lesson 03 (whose write_kv must run) gets the two ops apart. Same results either way.
    (``_use_gpu_kernels`` is forced on: the interpreter stands in for the GPU.)"""
    from yaie.kernels import gpu_elementwise as student02
    lessons = "all" if student_lesson is None else ",".join(str(n) for n in range(1, 9) if n != student_lesson)
    monkeypatch.setenv("YAIE_SOLUTIONS", lessons)
    monkeypatch.setattr(ops, "_use_gpu_kernels", lambda t: True)
    ops.reset_auto_fallback()
    fused = _spy(monkeypatch, ref, "apply_rope_qk_store_kv")
    apart = _spy(monkeypatch, ref, "apply_rope_qk")
    q, k, v, cos, sin, positions, _, _, _ = case(torch.float32)
    want_q, want_k = rope64(q, cos, sin, positions), rope64(k, cos, sin, positions)
    if student_lesson == 2:   # the stub raises: stand in a student's finished RoPE (the reference's math)
        monkeypatch.setattr(student02, "apply_rope_qk", lambda *a: ref.apply_rope_qk_reference(*a))
    manager = _manager(StudentManager if student_lesson == 3 else ref03.KVCacheManager)
    slots = manager.allocate("s", q.shape[0])
    out_q, out_k = ops.rope_and_write_kv(manager, 1, slots, q, k, v, cos, sin, positions)
    assert (fused, apart) == ((["apply_rope_qk_store_kv"], []) if student_lesson is None
                              else ([], [] if student_lesson == 2 else ["apply_rope_qk"])), (fused, apart)
    torch.testing.assert_close(out_q.double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k.double(), want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(manager.k_cache[1].flatten(0, 1)[slots].double(), want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(manager.v_cache[1].flatten(0, 1)[slots], v)
    ops.reset_auto_fallback()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rope_store_kv_bf16_on_the_gpu_at_model_shapes():
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = case(torch.bfloat16, "cuda", tokens=37, heads=32,
                                                                  kv_heads=8, head_dim=64, blocks=16, block_size=16)
    want_q, want_k = rope64(q, cos, sin, positions), rope64(k, cos, sin, positions)
    want_v = v.double().clone()
    ref.apply_rope_qk_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    torch.testing.assert_close(q.double(), want_q, **TOL[torch.bfloat16])
    torch.testing.assert_close(k_cache.flatten(0, 1)[slots].double(), want_k, **TOL[torch.bfloat16])
    assert torch.equal(v_cache.flatten(0, 1)[slots].double(), want_v)
    assert k_cache.isnan().sum() == k_cache.numel() - 37 * 8 * 64
