"""Lesson 06's Hopper variant (``solutions/kernels/flash_attention_hopper.py``): same functions as the reference.

Forward and backward (both dq modes). On the CPU the fast kernels run in the Triton interpreter (float16;
tensor descriptors and atomics work there) on small ragged, grouped-query, causal and cached-context shapes;
on a GPU (``gpu`` marker) bfloat16 and float16 at the grader's GPU sizes and past the autotuning threshold.
The FlashAttention rule applies: the largest error against float64 may be at most twice PyTorch's own in that
dtype plus rounding. Outputs (out, dq, dk, dv) are NaN-poisoned before the kernels write them. Inputs the fast
kernels do not take must reach the reference and give its answer.
"""

from __future__ import annotations

from yaie.device import prepare_triton

prepare_triton()

import pytest  # noqa: E402
import torch  # noqa: E402

from solutions.kernels import flash_attention as ref  # noqa: E402
from solutions.kernels import flash_attention_hopper as fast  # noqa: E402
from yaie.model.testing import fresh_seed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and fast.is_hopper(torch.device("cuda"))

# (batch, heads, kv_heads, seq_q, seq_k, head_dim, causal): lengths off the block sizes on purpose.
CPU_CASES = [
    (1, 4, 2, 45, 45, 64, True),      # grouped-query, causal
    (1, 2, 1, 19, 50, 32, True),      # new tokens after a cached context
    (2, 2, 2, 33, 21, 16, False),     # seq_q > seq_k without a mask
    (1, 2, 2, 70, 40, 64, False),
    (1, 2, 2, 40, 130, 32, False),    # several full key blocks per program (the prefetching loop runs)
    (1, 2, 1, 100, 100, 16, True),
]
GPU_CASES = [
    (2, 8, 8, 300, 300, 128, True),
    (1, 8, 2, 513, 513, 64, False),
    (2, 4, 1, 128, 700, 128, True),
    (1, 4, 4, 1000, 1000, 64, True),
    (1, 4, 2, 2100, 2100, 128, True),   # past 1024 tokens: the autotuned path
    (1, 4, 4, 1500, 1500, 128, False),
]


@pytest.fixture
def seed() -> int:
    """Fresh random inputs for every run (pytest prints the value when a test fails)."""
    return fresh_seed()


@pytest.fixture
def poisoned(monkeypatch):
    """Every output buffer starts as NaN, so an element the kernel never writes fails the comparison."""
    monkeypatch.setattr(fast, "_new_output",
                        lambda q: torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device))


def inputs(case, dtype, seed, strided_q=False):
    b, h, hk, sq, sk, d, _ = case
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    if strided_q:   # the engine's [batch, seq, heads, head_dim] seen as [batch, heads, seq, head_dim]
        q = torch.randn(b, sq, h, d, device=DEVICE, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, h, sq, d, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(b, hk, sk, d, device=DEVICE, generator=gen).to(dtype)
    v = torch.randn(b, hk, sk, d, device=DEVICE, generator=gen).to(dtype)
    return q, k, v


def max_err(got, exact) -> float:
    got = got.detach().double()
    return float("inf") if torch.isnan(got).any() else float((got - exact).abs().max())


def check_flash_rule(got, exact, lowp, what):
    """Largest |got - exact| <= 2 x largest |torch in that dtype - exact| + the rounding of exact."""
    err = max_err(got, exact)
    bound = 2 * max_err(lowp, exact) + float((exact.to(got.dtype).double() - exact).abs().max())
    assert err <= bound, f"{what}: largest error {err:.3g} > allowed {bound:.3g} (FlashAttention rule)"


OPTIONS = {"plain": (32, 32, 4, 1), "prefetch_s": (32, 32, 4, 1, False, True),
           "persistent": (32, 32, 4, 1, False, False, True)}


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter cases; GPU cases below")
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_fast_kernel_matches_float64_in_the_interpreter(poisoned, seed, index, option):
    case = CPU_CASES[index]
    causal = case[-1]
    q, k, v = inputs(case, torch.float16, seed, strided_q=index == 0)
    assert fast.fast_path_reason(q, k, v) is None, "these inputs must take the fast kernel"
    # (The interpreter keeps its 32 x 32 blocks; the configuration's switches apply.)
    out, lse = fast.forward_with_config(q, k, v, causal, None, OPTIONS[option])
    exact, exact_lse = ref.attention_reference(q.double(), k.double(), v.double(), causal)
    lowp, _ = ref.attention_reference(q.float(), k.float(), v.float(), causal)
    check_flash_rule(out, exact, lowp.half(), f"out, case {case}")
    assert max_err(lse, exact_lse) < 1e-4, f"lse, case {case}"


def grads_and_references(case, dtype, seed, mode, strided_q=False):
    """(fast grads, float64 grads, grads of PyTorch's own attention in ``dtype``) for one case."""
    causal = case[-1]
    q, k, v = inputs(case, dtype, seed, strided_q=strided_q)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    dout = torch.randn(q.shape, device=DEVICE, generator=gen).to(dtype)
    assert fast.fast_path_reason(q, k, v, "dense", dout) is None, "these inputs must take the fast kernels"
    out, lse = ref.attention_reference(q.float(), k.float(), v.float(), causal)
    got = fast.flash_attention_backward(dout, q, k, v, out.to(dtype), lse, causal=causal, dq_mode=mode)
    exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    exact = torch.autograd.grad(ref.attention_reference(*exact_leaves, causal)[0], exact_leaves, dout.double())
    low_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    low = torch.autograd.grad(ref.attention_reference(*low_leaves, causal)[0], low_leaves, dout)
    return got, exact, low


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter cases; GPU cases below")
@pytest.mark.parametrize("mode", fast.DQ_MODES)
@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_fast_backward_matches_float64_in_the_interpreter(poisoned, seed, index, mode):
    case = CPU_CASES[index]
    got, exact, low = grads_and_references(case, torch.float16, seed, mode, strided_q=index == 0)
    for name, g, e, lo in zip(("dq", "dk", "dv"), got, exact, low):
        check_flash_rule(g, e, lo, f"{name}, case {case}, dq mode {mode}")


def varlen_inputs(lens_q, lens_k, heads, kv_heads, head_dim, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, head_dim, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), kv_heads, head_dim, device=DEVICE, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), kv_heads, head_dim, device=DEVICE, generator=gen).to(dtype)

    def offsets(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k, v, offsets(lens_q), offsets(lens_k)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_matches_each_sequence(poisoned, seed, causal):
    if DEVICE == "cuda" and not ON_HOPPER:
        pytest.skip("the fast kernels run on Hopper GPUs only")
    scale_up = 8 if DEVICE == "cuda" else 1
    lens_k = [40 * scale_up, 7 * scale_up, 33 * scale_up, 1]
    lens_q = [40 * scale_up, 3 * scale_up, 20 * scale_up, 1]     # whole prompts, and new tokens after a context
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 64, dtype, seed)
    out, lse = fast.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[rq], k[rk], v[rk]))
        exact, exact_lse = ref.attention_reference(qs.double(), ks.double(), vs.double(), causal)
        lowp, _ = ref.attention_reference(qs.float(), ks.float(), vs.float(), causal)
        check_flash_rule(out[rq].transpose(0, 1)[None], exact, lowp.to(dtype), f"sequence {b} of {lens_q}/{lens_k}")
        assert max_err(lse[:, rq][None], exact_lse) < 1e-4, f"lse of sequence {b}"


def test_inputs_the_fast_kernels_do_not_take_get_the_reference(seed):
    case = (1, 2, 2, 20, 20, 40, True)
    q, k, v = inputs(case, torch.float16, seed)
    assert "head_dim 40" in fast.fast_path_reason(q, k, v)
    assert "dtype" in fast.fast_path_reason(q.float(), k.float(), v.float())
    q32, k32, v32 = inputs((1, 2, 2, 20, 20, 32, True), torch.float32, seed)
    for args in ((q, k, v), (q32, k32, v32)):
        out, lse = fast.flash_attention_forward(*args, causal=True)
        want, want_lse = ref.flash_attention_forward(*args, causal=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # A sliding window is the reference's too.
    q, k, v, cu_q, cu_k = varlen_inputs([9, 12], [9, 12], 2, 2, 32, torch.float16, seed)
    out, _ = fast.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 12, 12, causal=True, sliding_window=4)
    want, _ = ref.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 12, 12, causal=True, sliding_window=4)
    assert torch.equal(out, want)
    # The backward of an unsupported head dim is the reference's, bit for bit.
    q, k, v = inputs(case, torch.float16, seed)
    out, lse = ref.flash_attention_forward(q, k, v, causal=True)
    dout = torch.randn_like(q)
    got = fast.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    want = ref.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_scratch_allocator_is_set_in_the_launching_thread():
    """Autograd runs the backward in its own thread; Triton's allocator is per thread (seen failing on an H100)."""
    import threading

    from triton.runtime import _allocation

    from yaie.device import triton_scratch, use_triton_scratch

    seen = []

    def launch_side():
        use_triton_scratch()
        seen.append(_allocation._allocator.get())

    use_triton_scratch()             # a launch in this thread first, as the forward pass does
    worker = threading.Thread(target=launch_side)
    worker.start()
    worker.join()
    assert seen == [triton_scratch]


def test_the_copy_engine_check_names_what_it_cannot_address():
    """yaie.device.tma_addressable, which lessons 06 and 08's Hopper kernels ask before they take their fast path."""
    from yaie.device import tma_addressable

    t = torch.randn(2, 3, 8, 64).to(torch.bfloat16)
    assert tma_addressable(t) and tma_addressable(t, 2)
    assert not tma_addressable(t.transpose(-1, -2))              # the last dim not contiguous
    assert not tma_addressable(t[..., 1:])                       # the base 2 bytes past an aligned one
    odd = torch.randn(2, 3, 8, 68).to(torch.bfloat16)[..., :62]  # rows 136 bytes apart: not a multiple of 16
    assert not tma_addressable(odd) and not tma_addressable(odd, 1)
    rows_ok = torch.randn(3, 8, 64).to(torch.bfloat16)[1:]       # 2 x 8 x 64 at an aligned offset
    assert tma_addressable(rows_ok, 1)
    # Only the named strides count: a batch stride that breaks the rule is ignored with row_dims=1.
    padded = torch.randn(2 * 8 * 64 + 1, dtype=torch.bfloat16).as_strided((2, 8, 64), (8 * 64 + 1, 64, 1))
    assert tma_addressable(padded, 1) and not tma_addressable(padded)


def test_configurations_parse():
    assert fast.parse_config("128,64,8,3") == (128, 64, 8, 3, False, False, False)
    assert fast.parse_config("128,128,8,3,1") == (128, 128, 8, 3, True, False, False)
    assert fast.parse_config("128,128,8,3,0,1") == (128, 128, 8, 3, False, True, False)
    assert fast.parse_config("128,128,8,3,0,0,1") == (128, 128, 8, 3, False, False, True)
    for bad in ("128,64,8", "128,64,8,3,0,1,1,1", "a,b,c,d"):
        with pytest.raises(ValueError):
            fast.parse_config(bad)
    assert fast.parse_backward_config("atomic,64,128,8,2") == ("atomic", 64, 128, 8, 2)
    assert fast.parse_backward_config("kernel, 64, 128, 8, 3") == ("kernel", 64, 128, 8, 3)
    for bad in ("fast,64,128,8,2", "kernel,64,128,8", "atomic,64,128,8,x"):
        with pytest.raises(ValueError):
            fast.parse_backward_config(bad)


def test_bad_input_raises_value_error(seed):
    q, k, v = inputs((1, 4, 2, 8, 8, 16, False), torch.float16, seed)
    with pytest.raises(ValueError):
        fast.flash_attention_forward(q[0], k, v)
    with pytest.raises(ValueError):
        fast.flash_attention_forward(q, k, v[:, :, :4])
    with pytest.raises(ValueError):
        fast.flash_attention_forward(q, k, v, scale=0.0)
    out, lse = ref.flash_attention_forward(q, k, v)
    with pytest.raises(ValueError):
        fast.flash_attention_backward(out[:, :, :4], q, k, v, out, lse)      # dout of the wrong shape
    with pytest.raises(ValueError):
        fast.flash_attention_backward(out, q, k, v, out, lse, dq_mode="fast")
    q, k, v, cu_q, cu_k = varlen_inputs([3, 5], [4, 6], 2, 2, 16, torch.float16, seed)
    with pytest.raises(ValueError):
        fast.flash_attention_varlen_forward(q, k, v, cu_q.long(), cu_k, 5, 6)
    with pytest.raises(ValueError):
        fast.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, causal=False, sliding_window=2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the fast kernels run on Hopper GPUs only")
@pytest.mark.parametrize("index, dtype", [(i, torch.bfloat16) for i in range(len(GPU_CASES))]
                         + [(i, torch.float16) for i in (0, 1)], ids=lambda x: str(x).replace("torch.", ""))
def test_fast_kernel_flash_rule_on_hopper(poisoned, seed, index, dtype):
    case = GPU_CASES[index]
    causal = case[-1]
    q, k, v = inputs(case, dtype, seed, strided_q=index == 1)
    assert fast.fast_path_reason(q, k, v) is None
    out, lse = fast.flash_attention_forward(q, k, v, causal=causal)
    exact, exact_lse = ref.attention_reference(q.double(), k.double(), v.double(), causal)
    lowp, _ = ref.attention_reference(q, k, v, causal)
    check_flash_rule(out, exact, lowp, f"out, case {case}, {dtype}")
    assert max_err(lse, exact_lse) < 1e-3, f"lse, case {case}, {dtype}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the fast kernels run on Hopper GPUs only")
@pytest.mark.parametrize("option, config", [("prefetch_s", (128, 64, 8, 3, False, True)),
                                            ("persistent", (128, 128, 8, 2, False, False, True))], ids=str)
@pytest.mark.parametrize("index", [0, 4])
def test_options_on_hopper(poisoned, seed, index, option, config):
    case = GPU_CASES[index]
    causal = case[-1]
    q, k, v = inputs(case, torch.bfloat16, seed)
    out, lse = fast.forward_with_config(q, k, v, causal, None, config)
    exact, exact_lse = ref.attention_reference(q.double(), k.double(), v.double(), causal)
    lowp, _ = ref.attention_reference(q, k, v, causal)
    check_flash_rule(out, exact, lowp, f"out with {option}, case {case}")
    assert max_err(lse, exact_lse) < 1e-3, f"lse with {option}, case {case}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the fast kernels run on Hopper GPUs only")
@pytest.mark.parametrize("mode", fast.DQ_MODES)
@pytest.mark.parametrize("index, dtype", [(i, torch.bfloat16) for i in (0, 1, 4)] + [(5, torch.float16)],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_fast_backward_flash_rule_on_hopper(poisoned, seed, index, dtype, mode):
    case = GPU_CASES[index]
    got, exact, low = grads_and_references(case, dtype, seed, mode, strided_q=index == 1)
    for name, g, e, lo in zip(("dq", "dk", "dv"), got, exact, low):
        check_flash_rule(g, e, lo, f"{name}, case {case}, {dtype}, dq mode {mode}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the fast kernels run on Hopper GPUs only")
def test_autograd_uses_the_fast_forward_and_backward(seed, monkeypatch):
    q, k, v = inputs((1, 4, 2, 300, 300, 128, True), torch.bfloat16, seed)
    dout = torch.randn_like(q)
    calls = []
    monkeypatch.setattr(ref, "flash_attention_backward", lambda *a, **kw: calls.append("reference"))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fast.flash_attention(*leaves, causal=True, dq_mode="atomic")
    grads = torch.autograd.grad(out, leaves, dout)
    assert not calls, "the Hopper backward must not fall back to the reference for these inputs"
    exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    exact_out, _ = ref.attention_reference(*exact_leaves, True)
    exact_grads = torch.autograd.grad(exact_out, exact_leaves, dout.double())
    low_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    low_out, _ = ref.attention_reference(*low_leaves, True)
    low_grads = torch.autograd.grad(low_out, low_leaves, dout)
    check_flash_rule(out, exact_out.detach(), low_out.detach(), "out")
    for name, got, exact, low in zip(("dq", "dk", "dv"), grads, exact_grads, low_grads):
        check_flash_rule(got, exact, low, name)
