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

# The CPU runs the kernels in the Triton interpreter; a machine with a GPU runs the same checks there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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


def case(dtype, device=DEVICE, tokens=5, heads=4, kv_heads=2, head_dim=8, blocks=6, block_size=4, seed=None):
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
        "v ": dict(v=v[:, :1]),
        "k_cache": dict(k_cache=k_cache[:, :, :1]),
        "must match": dict(v_cache=v_cache.half()),
        "layout": dict(k_cache=k_cache.transpose(0, 1)),
    }
    if DEVICE == "cpu":     # values are checked on the host only (a GPU would have to sync)
        bad["slot_mapping must lie"] = dict(slot_mapping=torch.full_like(slots, k_cache.shape[0] * k_cache.shape[1]))
        bad["position_ids must lie"] = dict(position_ids=torch.full_like(positions, 64))
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
    return cls(num_blocks=6, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, device=DEVICE)


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
    (``use_gpu_kernels`` is forced on: the interpreter stands in for the GPU.)"""
    from yaie.kernels import gpu_elementwise as student02
    lessons = "all" if student_lesson is None else ",".join(str(n) for n in range(1, 9) if n != student_lesson)
    monkeypatch.setenv("YAIE_SOLUTIONS", lessons)
    monkeypatch.setattr(ops.layers, "use_gpu_kernels", lambda t: True)
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


# ----------------------------------------------------------------------------- one-row products (matvec)
def matvec_case(dtype, n=10, k=48, device=DEVICE, seed=None, bias=True):
    gen = torch.Generator().manual_seed(fresh_seed() if seed is None else seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)  # noqa: E731
    weight = make(n, k, scale=k ** -0.5)
    return dict(weight=weight, bias=make(n) if bias else None, x=make(1, k), gate_up=make(1, 2 * k),
                residual=make(1, k), norm_weight=make(k) + 1, eps=1e-5)


def linear64(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
# 48 and 1100: the row in one tile; 4100: several tiles (of 1024 columns), a partial last one
@pytest.mark.parametrize("k", [48, 1100, 4100])
def test_matvec_kernels_match_float64(dtype, bias, k):
    c = matvec_case(dtype, k=k, bias=bias)
    tol = TOL[dtype]
    torch.testing.assert_close(ref.matvec(c["x"], c["weight"], c["bias"]).double(),
                               linear64(c["x"], c["weight"], c["bias"]), **tol)
    g, u = c["gate_up"].double().chunk(2, -1)
    torch.testing.assert_close(ref.silu_and_mul_matvec(c["gate_up"], c["weight"], c["bias"]).double(),
                               linear64(torch.nn.functional.silu(g) * u, c["weight"], c["bias"]), **tol)
    x0, r0 = c["x"].clone(), c["residual"].clone()
    out, new_residual = ref.add_rms_norm_matvec(c["x"], c["residual"], c["norm_weight"], c["eps"], c["weight"],
                                                c["bias"])
    total = x0.double() + r0.double()
    normed = total / torch.sqrt(total.pow(2).mean(-1, keepdim=True) + c["eps"]) * c["norm_weight"].double()
    torch.testing.assert_close(out.double(), linear64(normed, c["weight"], c["bias"]), **tol)
    torch.testing.assert_close(new_residual.double(), total, **tol)
    assert torch.equal(c["x"], x0) and torch.equal(c["residual"], r0), "the inputs must be left unchanged"
    assert new_residual.data_ptr() not in (c["x"].data_ptr(), c["residual"].data_ptr())


def test_matvec_kernels_equal_the_unfused_ops_in_float32():
    """Against the reference's own ops (the rounding points of the fused kernels are theirs)."""
    c = matvec_case(torch.float32, n=33, k=40)
    want = ref.add_rms_norm_matvec_reference(c["x"], c["residual"], c["norm_weight"], c["eps"], c["weight"], c["bias"])
    got = ref.add_rms_norm_matvec(c["x"], c["residual"], c["norm_weight"], c["eps"], c["weight"], c["bias"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.silu_and_mul_matvec(c["gate_up"], c["weight"]),
                               ref.silu_and_mul_matvec_reference(c["gate_up"], c["weight"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.matvec(c["x"], c["weight"]), ref.matvec_reference(c["x"], c["weight"]),
                               atol=1e-5, rtol=1e-5)


def test_matvec_bad_inputs():
    c = matvec_case(torch.float32)
    x, w, b = c["x"], c["weight"], c["bias"]
    refused = [
        ("one contiguous row", lambda: ref.matvec(torch.cat([x, x]), w)),
        ("one contiguous row", lambda: ref.matvec(x[:, :-1], w)),
        ("dtypes must match", lambda: ref.matvec(x, w.half())),
        ("bias", lambda: ref.matvec(x, w, b[:-1])),
        ("weight", lambda: ref.matvec(x, w.t().contiguous().t())),
        ("one contiguous row", lambda: ref.silu_and_mul_matvec(x, w)),
        ("residual", lambda: ref.add_rms_norm_matvec(x, c["residual"][:, :-1], c["norm_weight"], 1e-5, w)),
        ("norm_weight", lambda: ref.add_rms_norm_matvec(x, c["residual"], c["norm_weight"][:-1], 1e-5, w)),
        ("epsilon", lambda: ref.add_rms_norm_matvec(x, c["residual"], c["norm_weight"], 0.0, w)),
    ]
    for match, call in refused:
        with pytest.raises(ValueError, match=match):
            call()


def _serve_lesson02(monkeypatch, student: bool):
    """Lesson 02 served by the reference, or by a student's finished module (the reference's math in the stub's
    functions); the ops take the GPU path on CPU tensors (the interpreter). Returns the stub module."""
    from yaie.kernels import gpu_elementwise as student02
    monkeypatch.setenv("YAIE_SOLUTIONS", "1,3-8" if student else "all")
    monkeypatch.setattr(ops.layers, "use_gpu_kernels", lambda t: True)
    ops.reset_auto_fallback()
    if student:
        monkeypatch.setattr(student02, "silu_and_mul", ref.silu_and_mul_reference)
        monkeypatch.setattr(student02, "fused_add_rms_norm", ref.fused_add_rms_norm_reference)
    return student02


@pytest.mark.parametrize("student_lesson02", [False, True])
def test_one_row_ops_use_the_fused_kernels_only_for_the_reference(monkeypatch, student_lesson02):
    """yaie.ops.linear / silu_and_mul_linear / add_rms_norm_linear: one row -> lesson 02's fused kernels where
    the module serving lesson 02 has them; a student's lesson 02 (no such kernels) gets cuBLAS and the student's
    own norm and SwiGLU kernels; more than one row always gets the ops apart. Same values either way."""
    _serve_lesson02(monkeypatch, student_lesson02)
    names = ["matvec", "silu_and_mul_matvec", "add_rms_norm_matvec"]
    calls = {name: _spy(monkeypatch, ref, name) for name in names}
    c = matvec_case(torch.float32)
    got = [ops.linear(c["x"], c["weight"], c["bias"]),
           ops.silu_and_mul_linear(c["gate_up"], c["weight"], c["bias"]),
           *ops.add_rms_norm_linear(c["x"].clone(), c["residual"].clone(), c["norm_weight"], c["eps"], c["weight"],
                                    c["bias"])]
    want = [ref.matvec_reference(c["x"], c["weight"], c["bias"]),
            ref.silu_and_mul_matvec_reference(c["gate_up"], c["weight"], c["bias"]),
            *ref.add_rms_norm_matvec_reference(c["x"], c["residual"], c["norm_weight"], c["eps"], c["weight"],
                                               c["bias"])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert all(len(calls[n]) == (0 if student_lesson02 else 1) for n in names), calls
    two_rows = torch.cat([c["x"], c["x"]])
    torch.testing.assert_close(ops.linear(two_rows, c["weight"]), two_rows @ c["weight"].T)
    assert all(len(calls[n]) == (0 if student_lesson02 else 1) for n in names), "two rows went to cuBLAS"
    # Operands the one-row kernels refuse (a weight with strided rows, a strided bias or norm weight) go to
    # the ops apart instead of raising: same values, no kernel call.
    strided_weight = c["weight"].t().contiguous().t()
    strided_bias = torch.stack([c["bias"], c["bias"]], 1)[:, 0]
    strided_norm = torch.stack([c["norm_weight"], c["norm_weight"]], 1)[:, 0]
    torch.testing.assert_close(ops.linear(c["x"], strided_weight, c["bias"]), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.silu_and_mul_linear(c["gate_up"], c["weight"], strided_bias), want[1],
                               atol=1e-5, rtol=1e-5)
    got = ops.add_rms_norm_linear(c["x"].clone(), c["residual"].clone(), strided_norm, c["eps"], c["weight"],
                                  c["bias"])
    for g, w in zip(got, want[2:]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert all(len(calls[n]) == (0 if student_lesson02 else 1) for n in names), "strided operands went apart"
    ops.reset_auto_fallback()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_matvec_kernels_bf16_on_the_gpu_at_model_shapes():
    for n, k in ((3072, 2048), (2048, 8192), (1000, 520)):
        c = matvec_case(torch.bfloat16, n=n, k=k, device="cuda")
        tol = dict(atol=2e-2, rtol=1.6e-2)
        torch.testing.assert_close(ref.matvec(c["x"], c["weight"], c["bias"]).double(),
                                   linear64(c["x"], c["weight"], c["bias"]), **tol)
        want = ref.silu_and_mul_matvec_reference(c["gate_up"], c["weight"], c["bias"]).double()
        torch.testing.assert_close(ref.silu_and_mul_matvec(c["gate_up"], c["weight"], c["bias"]).double(), want, **tol)
        got = ref.add_rms_norm_matvec(c["x"], c["residual"], c["norm_weight"], c["eps"], c["weight"], c["bias"])
        want = ref.add_rms_norm_matvec_reference(c["x"], c["residual"], c["norm_weight"], c["eps"], c["weight"],
                                                 c["bias"])
        torch.testing.assert_close(got[0].double(), want[0].double(), **tol)
        assert torch.equal(got[1], want[1])


def _product_chain(c, steps: int):
    """A decode step's pattern of one-row products: each reads what the one before wrote (and the residual
    the norm prologue wrote), so a product that read its input before the kernel before it had finished
    would show as a different result."""
    x, residual = c["x"], c["residual"]
    for _ in range(steps):
        h, residual = ref.add_rms_norm_matvec(x, residual, c["norm_weight"], c["eps"], c["weight"])
        gate_up = ref.matvec(h, c["gate_up_weight"])
        x = ref.silu_and_mul_matvec(gate_up, c["weight"])
    return x, residual


def _few_row_chain(c, steps: int):
    """A batched decode step's MLP pattern: the add + norm kernel, the fused gate/up product reading its
    output, cuBLAS's down product reading the product's."""
    x, residual = c["rows"], c["row_residual"]
    for _ in range(steps):
        h, residual = ref.fused_add_rms_norm(x.clone(), residual.clone(), c["norm_weight"], c["eps"])
        x = torch.nn.functional.linear(ref.skinny_matmul_silu_and_mul(h, c["gate_up_weight"]), c["weight"])
    return x, residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("chain", [_product_chain, _few_row_chain])
def test_chained_products_with_programmatic_launch_equal_the_products_without(monkeypatch, graphs, chain):
    """With programmatic dependent launch (YAIE_PDL=1, Hopper) each product may start before the one before it
    ends and waits for it inside the kernel: the chain must give the same bits as with YAIE_PDL=0, eagerly
    and replayed from a CUDA graph (where the engine runs it). One row (the one-row products) and 48 rows
    (the few-row gate/up product)."""
    from yaie.device import programmatic_launch
    k = 2048
    c = matvec_case(torch.bfloat16, n=k, k=k, device="cuda")
    c["gate_up_weight"] = torch.randn(2 * k, k, device="cuda").to(torch.bfloat16) * k ** -0.5
    c["rows"], c["row_residual"] = (torch.randn(48, k, device="cuda").to(torch.bfloat16) for _ in range(2))
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("YAIE_PDL", setting)
        if not graphs:
            results[setting] = chain(c, steps=8)
            continue
        chain(c, steps=8)                                 # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(c, steps=8)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results[setting] = [t.clone() for t in out]
    for got, want in zip(results["1"], results["0"]):
        assert torch.equal(got, want), "the chain under PDL differs from the chain without it"
    if torch.cuda.get_device_capability()[0] >= 9:
        monkeypatch.setenv("YAIE_PDL", "1")
        assert programmatic_launch(torch.device("cuda")), "Hopper with this Triton should launch with PDL"


# ----------------------------------------------------------------------------- few-row products
def skinny_case(dtype, rows, n, k, device=DEVICE, bias=True):
    """Input rows, a gate/up weight of ``2 n`` rows and its bias."""
    gen = torch.Generator().manual_seed(fresh_seed())
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)  # noqa: E731
    return make(rows, k), make(2 * n, k, scale=k ** -0.5), make(2 * n) if bias else None


def gate_up64(x, weight, bias):
    """The float64 reference: the product rounded to x's dtype (as the product apart stores it), then SwiGLU."""
    gate, up = linear64(x, weight, bias).to(x.dtype).double().chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [2, 5])
def test_skinny_gate_up_matches_float64(bias, rows):
    """A ragged last weight tile and K block (70 features, 100 columns in tiles of 32 x 16)."""
    x, weight, b = skinny_case(torch.float16, rows, n=70, k=100, bias=bias)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2)
    got = ref._launch_skinny(x, weight, b, True, config)
    torch.testing.assert_close(got.double(), gate_up64(x, weight, b), **TOL[torch.float16])
    torch.testing.assert_close(ref.skinny_matmul_silu_and_mul(x, weight, b).double(), gate_up64(x, weight, b),
                               **TOL[torch.float16])      # the default settings (another K block: other bits)
    torch.testing.assert_close(ref.skinny_matmul_silu_and_mul_reference(x, weight, b).double(),
                               gate_up64(x, weight, b), **TOL[torch.float16])
    plain = ref._launch_skinny(x, weight, b, False, config)      # the product alone (the benchmark's row)
    torch.testing.assert_close(plain.double(), linear64(x, weight, b), **TOL[torch.float16])


def test_skinny_gate_up_bad_inputs():
    x, weight, b = skinny_case(torch.float16, rows=3, n=8, k=16)
    refused = [
        ("float16 or bfloat16", lambda: ref.skinny_matmul_silu_and_mul(x.float(), weight.float())),
        ("1 to 64 rows", lambda: ref.skinny_matmul_silu_and_mul(x.repeat(22, 1), weight)),
        ("1 to 64 rows", lambda: ref.skinny_matmul_silu_and_mul(x[:, :-1], weight)),
        ("2 \\* intermediate", lambda: ref.skinny_matmul_silu_and_mul(x, weight[:-1])),
        ("dtypes must match", lambda: ref.skinny_matmul_silu_and_mul(x, weight.bfloat16())),
        ("bias", lambda: ref.skinny_matmul_silu_and_mul(x, weight, b[:-1])),
        ("weight", lambda: ref.skinny_matmul_silu_and_mul(x, weight.t().contiguous().t())),
    ]
    for match, call in refused:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("student_lesson02", [False, True])
def test_swiglu_mlp_uses_the_fused_gate_up_only_for_the_reference(monkeypatch, student_lesson02):
    """yaie.ops.swiglu_mlp: 2 to 64 half-precision rows -> lesson 02's fused gate/up product where the module
    serving lesson 02 has it; a student's lesson 02 (whose SiLU-and-mul then runs), float32, one row (the one-row
    products) or 65 rows -> not. Same values either way."""
    student02 = _serve_lesson02(monkeypatch, student_lesson02)
    calls = _spy(monkeypatch, ref, "skinny_matmul_silu_and_mul")
    student_calls = _spy(monkeypatch, student02, "silu_and_mul") if student_lesson02 else []
    hidden, inter = 32, 24
    for rows, dtype, fused in ((2, torch.float16, True), (64, torch.float16, True), (1, torch.float16, False),
                               (3, torch.float32, False), (65, torch.float16, False)):
        x, gate_up, b = skinny_case(dtype, rows, n=inter, k=hidden)
        residual = torch.randn_like(x)
        norm_weight = (torch.rand(hidden) + 0.5).to(dtype).to(x.device)
        down = (torch.randn(hidden, inter) * inter ** -0.5).to(dtype).to(x.device)
        before = len(calls)
        out, new_residual = ops.swiglu_mlp(x.clone(), residual.clone(), norm_weight, 1e-5, gate_up, b, down, None)
        total = x.double() + residual.double()
        h = (total / torch.sqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.double()).to(dtype)
        want = linear64(gate_up64(h, gate_up, b).to(dtype), down, None)
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(new_residual.double(), total, **TOL[dtype])
        assert len(calls) - before == (1 if fused and not student_lesson02 else 0), (rows, dtype, calls)
    if student_lesson02:      # every case runs the ops apart, with the student's silu_and_mul
        assert len(student_calls) == 5, student_calls
    assert ops.layers.FEW_ROWS == ref.SKINNY_MAX_ROWS, "the op's row limit is the kernel's"
    ops.reset_auto_fallback()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [2, 17, 64])
def test_skinny_gate_up_bf16_on_the_gpu_at_model_shapes(rows):
    """The engine's launch settings, bf16, the 1.1B and 8B models' gate/up products and a ragged one; the same
    bits on every call and from a CUDA graph."""
    tol = dict(atol=2e-2, rtol=1.6e-2)
    for n, k in ((8192, 2048), (14336, 4096), (1000, 520)):
        x, weight, b = skinny_case(torch.bfloat16, rows, n, k, device="cuda")
        got = ref.skinny_matmul_silu_and_mul(x, weight, b)
        torch.testing.assert_close(got.double(), gate_up64(x, weight, b), **tol)
        for _ in range(3):
            assert torch.equal(ref.skinny_matmul_silu_and_mul(x, weight, b), got), f"{n}x{k}: other bits"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = ref.skinny_matmul_silu_and_mul(x, weight, b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got), f"{n}x{k}: a CUDA graph's replay gave other bits"


def test_programmatic_launch_setting(monkeypatch):
    from yaie.device import programmatic_launch
    monkeypatch.setenv("YAIE_PDL", "1")
    assert not programmatic_launch(torch.device("cpu"))
    monkeypatch.setenv("YAIE_PDL", "yes")
    with pytest.raises(ValueError, match="YAIE_PDL must be 0"):
        programmatic_launch(torch.device("cpu"))


def test_engine_tokens_with_and_without_the_fused_kernels(monkeypatch):
    """The bundled model, greedy, batch 1 (one-row products): lesson 02's kernels (in the interpreter, as on a GPU)
    with the fused decode-step kernels give the ids of the same run with every op apart."""
    from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    monkeypatch.setattr(ops.layers, "use_gpu_kernels", lambda t: True)
    calls = _spy(monkeypatch, ref, "add_rms_norm_matvec")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm = LLM(DEFAULT_MODEL, device=DEVICE, dtype=torch.float32, block_size=8, num_blocks=16)
    fused = llm.generate("Once", params)[0].token_ids
    assert calls, "the one-row steps used the fused kernels"
    monkeypatch.setattr(ops.layers, "one_row_kernel", lambda x, name: None)
    monkeypatch.setattr(ops.kv, "fused_rope_write_kv", lambda manager, q: None)
    apart = llm.generate("Once", params)[0].token_ids
    assert fused == apart, (fused, apart)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_logits_with_the_few_row_product_are_as_close_as_without(tmp_path, monkeypatch):
    """A random Llama with MLP biases in bf16 on the GPU, 24 prompt tokens (24 rows: the few-row gate/up product
    runs): its logits against the same model in float32 are as close as those of the bf16 run with the ops
    apart (cuBLAS and the SiLU kernel). Wrong gate/up rows or biases would be far off."""
    from yaie.model.contiguous_cache import ContiguousKVCache
    from yaie.model.llama import LlamaModel
    from yaie.model.testing import save_random_model
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    ops.reset_auto_fallback()
    save_random_model("llama", tmp_path, seed=fresh_seed(), hidden_size=256, intermediate_size=512, mlp_bias=True)
    ids = torch.randint(0, 96, (24,), device="cuda")
    positions = torch.arange(24, device="cuda")

    def logits(dtype):
        model = LlamaModel.from_pretrained(tmp_path, device="cuda", dtype=dtype)
        cache = ContiguousKVCache.for_model(model.config, 24, dtype, "cuda")
        return model.logits(model.forward(ids, positions, cache)).double()

    calls = _spy(monkeypatch, ref, "skinny_matmul_silu_and_mul")
    fused = logits(torch.bfloat16)
    assert calls, "24 bf16 rows should run the few-row gate/up product"
    exact = logits(torch.float32)
    monkeypatch.setattr(ops.layers, "few_row_kernel", lambda x, name: None)
    apart = logits(torch.bfloat16)
    fused_error, apart_error = (fused - exact).abs().max().item(), (apart - exact).abs().max().item()
    assert fused_error <= 1.5 * apart_error + 1e-3, (fused_error, apart_error)
    ops.reset_auto_fallback()
