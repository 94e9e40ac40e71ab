"""Lesson 08 beyond its grader: the reference's other paths (the chunked PyTorch algorithm, every chunk size,
the second kernel design, reads that stay inside the sequence), the memory figures the notebook shows,
the benchmark's pieces that run without a GPU (fla stays an optional, benchmark-only dependency), and the
bundled Based model in the engine (it generates; recurrent decode gives the parallel forward's logits;
constant memory per sequence).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from solutions.kernels import based as ref
from tests.helpers import ROOT
from yaie.device import triton_interpreted

# Tests that launch the kernels on CPU tensors, in Triton's interpreter. On a GPU machine the interpreter is off
# for the whole process (yaie.device.prepare_triton): there the gpu-marked tests check the same kernels on CUDA.
INTERPRETED = pytest.mark.skipif(not triton_interpreted(),
                                 reason="launches the kernels on CPU tensors, in the Triton interpreter")


def _qkv(seq: int, value_dim: int = 32, heads: int = 2, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, heads, seq, 16, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(1, heads, seq, value_dim, generator=gen).to(dtype)
    return q, k, v


def _exact(q, k, v):
    return ref.based_attention_reference(q.double(), k.double(), v.double())


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_pytorch_algorithm_equals_the_quadratic_form(chunk):
    q, k, v = _qkv(37, seed=chunk)
    out, state = ref.based_chunked_reference(q.double(), k.double(), v.double(), chunk_size=chunk)
    torch.testing.assert_close(out, _exact(q, k, v), atol=1e-12, rtol=1e-12)
    phi_k = ref.taylor_feature_map(k.double())
    torch.testing.assert_close(state.kv.double(), phi_k.transpose(-1, -2) @ v.double(), atol=1e-4, rtol=1e-6)


@INTERPRETED
@pytest.mark.parametrize("chunk", [16, 32, 64, 128, None])
def test_every_chunk_size_gives_the_same_answer(chunk):
    q, k, v = _qkv(150, seed=chunk or 0)
    out, state = ref.based_prefill(q, k, v, chunk_size=chunk)
    torch.testing.assert_close(out.double(), _exact(q, k, v), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state.k.double(), ref.taylor_feature_map(k.double()).sum(-2), atol=1e-3, rtol=1e-5)


@INTERPRETED
def test_second_kernel_design_order2_state_in_memory():
    """The "rows" kernel (order-2 state kept in the output state, 16 rows at a time) gives the same answer."""
    q, k, v = _qkv(40, value_dim=64)
    out = torch.empty_like(v)
    kv = torch.empty(1, 2, ref.EXPANDED_DIM, 64)
    ks = torch.empty(1, 2, ref.EXPANDED_DIM)
    ref._launch_prefill(q, k, v, out, kv, ks, 16, 64, 4, variant="rows")
    torch.testing.assert_close(out.double(), _exact(q, k, v), atol=2e-5, rtol=1e-4)
    phi_k = ref.taylor_feature_map(k.double())
    torch.testing.assert_close(kv.double(), phi_k.transpose(-1, -2) @ v.double(), atol=1e-3, rtol=1e-4)


@INTERPRETED
@pytest.mark.parametrize("seq,value_dim,segment,block_m,dtype,groups,p16,state_warps", [
    (1, 64, 128, 64, torch.float32, 8, None, 4), (129, 64, 128, 64, torch.float32, 4, None, 2),
    (300, 32, 64, 64, torch.float32, 16, None, 4), (300, 128, 128, 64, torch.float16, 8, None, 4),
    (300, 64, 64, 64, torch.float16, 2, True, 2), (513, 48, 128, 128, torch.float32, 8, None, 4),
    (136, 256, 64, 32, torch.float32, 1, None, 4)])
def test_segmented_route_equals_the_quadratic_form(seq, value_dim, segment, block_m, dtype, groups, p16,
                                                   state_warps):
    """The reference's default route with short segments: segment and block edges, partial segments,
    value blocks, row blocks of the state kernel, float16 with float32 boundary states and with 16-bit
    ones (the bfloat16 path's code); the states and the first segment in one launch (``state_warps`` 4,
    the queries' count) or in two (2); the state; the same output without it."""
    q, k, v = _qkv(seq, value_dim=value_dim, dtype=dtype, seed=seq)
    out = torch.full_like(v, float("nan"))
    state = ref._launch_segmented(q, k, v, out, segment, True, block_m, 32, 4, state_groups=groups,
                                  state_block_t=32, state_warps=state_warps, prefix_16bit=p16)
    fp32 = dtype == torch.float32
    tol = dict(atol=2e-5, rtol=1e-4) if fp32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), _exact(q, k, v), **tol)
    phi_k = ref.taylor_feature_map(k.double())
    tol = dict(atol=1e-3, rtol=1e-4) if fp32 else dict(atol=2e-2, rtol=1e-2)     # float16 operands of phi(k)
    torch.testing.assert_close(state.kv.double(), phi_k.transpose(-1, -2) @ v.double(), **tol)
    torch.testing.assert_close(state.k.double(), phi_k.sum(-2), atol=1e-4, rtol=1e-6)
    again = torch.full_like(v, float("nan"))
    assert ref._launch_segmented(q, k, v, again, segment, False, block_m, 32, 4, state_groups=groups,
                                 state_block_t=32, state_warps=state_warps, prefix_16bit=p16) is None
    torch.testing.assert_close(again, out, atol=0, rtol=0)


@INTERPRETED
@pytest.mark.parametrize("value_dim,groups,fuse,state_block_v", [(64, 8, True, None), (40, 4, False, None),
                                                                (96, 8, True, 64), (16, 4, True, None)])
def test_split_state_products_give_the_same_route(value_dim, groups, fuse, state_block_v):
    """``state_split``: the state programs' order-2 product in two halves of the value block (a partial
    second half at d_v 40 and 96; none at d_v 16, where the split falls back to one product), in the first
    launch or in a launch of its own: the same output and state as the quadratic form."""
    q, k, v = _qkv(300, value_dim=value_dim, seed=value_dim)
    out = torch.full_like(v, float("nan"))
    state = ref._launch_segmented(q, k, v, out, 64, True, 64, 32, 4, state_groups=groups, state_block_t=32,
                                  state_split=True, state_block_v=state_block_v, fuse=fuse)
    torch.testing.assert_close(out.double(), _exact(q, k, v), atol=2e-5, rtol=1e-4)
    phi_k = ref.taylor_feature_map(k.double())
    torch.testing.assert_close(state.kv.double(), phi_k.transpose(-1, -2) @ v.double(), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(state.k.double(), phi_k.sum(-2), atol=1e-4, rtol=1e-6)


@INTERPRETED
@pytest.mark.parametrize("groups,block_t", [(8, 32), (4, 64), (16, 16), (1, 32)])
def test_boundary_state_kernel_writes_every_prefix(groups, block_t):
    """Step 1 of the default route: the state after each segment but the last (phi(K)^T V and sum phi(K)
    over all tokens before the boundary) and the final state, after a partial last segment."""
    q, k, v = _qkv(150, value_dim=40, seed=5)
    prefix_kv = torch.full((1, 2, 2, 273, 40), float("nan"))
    prefix_k = torch.full((1, 2, 2, 273), float("nan"))
    final = ref.BasedState(torch.full((1, 2, 273, 40), float("nan")), torch.full((1, 2, 273), float("nan")))
    ref._launch_prefix_state(k, v, prefix_kv, prefix_k, final.kv, final.k, 64, groups, block_t)
    phi_k = ref.taylor_feature_map(k.double())
    for j, end in enumerate([64, 128, 150]):
        exact_kv = phi_k[:, :, :end].transpose(-1, -2) @ v[:, :, :end].double()
        exact_k = phi_k[:, :, :end].sum(-2)
        got_kv, got_k = (prefix_kv[:, :, j], prefix_k[:, :, j]) if j < 2 else final
        torch.testing.assert_close(got_kv.double(), exact_kv, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got_k.double(), exact_k, atol=1e-4, rtol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        ref._launch_prefix_state(k, v, prefix_kv, prefix_k, final.kv, final.k, 64, 3)
    with pytest.raises(ValueError, match="multiple of block_t"):
        ref._launch_prefix_state(k, v, prefix_kv, prefix_k, final.kv, final.k, 96, 4, 64)


@INTERPRETED
def test_default_route_is_the_segmented_one(monkeypatch):
    """chunk_size=None: the segmented route at DEFAULT_SEGMENT; the same answers as the chunked kernel."""
    q, k, v = _qkv(140, value_dim=32, seed=3)
    calls = []
    for name in ("_launch_segmented", "_launch_prefill"):
        real = getattr(ref, name)
        monkeypatch.setattr(ref, name,
                            lambda *a, _real=real, _name=name, **kw: (calls.append(_name), _real(*a, **kw))[1])
    monkeypatch.setattr(ref, "DEFAULT_SEGMENT", 128)      # two segments
    out_s, state_s = ref.based_prefill(q, k, v)
    out_c, state_c = ref.based_prefill(q, k, v, chunk_size=16)
    assert calls == ["_launch_segmented", "_launch_prefill"]
    torch.testing.assert_close(out_s, out_c, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state_s.kv, state_c.kv, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state_s.k, state_c.k, atol=1e-4, rtol=1e-5)
    assert ref.based_prefill(q, k, v, return_state=False)[1] is None


@pytest.mark.gpu
@pytest.mark.parametrize("seq,segment,value_dim,groups", [(1000, 256, 64, 8), (777, 128, 128, 4), (2049, 512, 64, 16),
                                                          (300, 128, 96, 2), (200, 256, 64, 4)])
def test_segmented_route_bfloat16_gpu(seq, segment, value_dim, groups):
    """bfloat16 on the GPU: the boundary states kept in bfloat16 and read by one long product."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(seq, value_dim=value_dim, heads=3, seed=seq))
    out = torch.full_like(v, float("nan"))
    state = ref._launch_segmented(q, k, v, out, segment, True, state_groups=groups)
    exact = _exact(q.cpu(), k.cpu(), v.cpu())
    torch.testing.assert_close(out.double().cpu(), exact, atol=2e-2, rtol=1.6e-2)
    phi_k = ref.taylor_feature_map(k.double().cpu())
    torch.testing.assert_close(state.kv.double().cpu(), phi_k.transpose(-1, -2) @ v.double().cpu(),
                               atol=1e-2 * seq ** 0.5, rtol=2e-2)


@INTERPRETED
def test_prefill_reads_nothing_past_the_sequence():
    """Inputs that are the first rows of longer NaN-padded buffers: a read past the end would show as NaN."""
    q, k, v = _qkv(21, value_dim=48)
    pad = lambda t: torch.cat([t, torch.full_like(t, float("nan"))], 2)[:, :, :21]   # noqa: E731
    for chunk in (16, None):                    # the chunked kernel; the quadratic and state kernels
        out, state = ref.based_prefill(pad(q), pad(k), pad(v), chunk_size=chunk)
        assert torch.isfinite(out).all() and torch.isfinite(state.kv).all() and torch.isfinite(state.k).all()
        torch.testing.assert_close(out.double(), _exact(q, k, v), atol=2e-5, rtol=1e-4)


def test_decode_only_grows_nothing():
    """Decoding 50 tokens leaves the state's size unchanged and matches the quadratic form at every step."""
    q, k, v = _qkv(50, value_dim=16)
    state = ref.empty_state(1, 2, 16)
    outs = [ref.based_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state) for t in range(50)]
    torch.testing.assert_close(torch.stack(outs, 2).double(), _exact(q, k, v), atol=1e-5, rtol=1e-5)
    assert state.kv.shape == (1, 2, 273, 16) and state.k.shape == (1, 2, 273)



# ---------------------------------------------------------------- the fused decode kernel (interpreter)

def _decode_case(heads: int, value_dim: int, dtype, steps: int, seed: int, prefix: int = 5):
    """Batch 2: a state after ``prefix`` tokens (the chunked algorithm), then ``steps`` tokens to decode."""
    q, k, v = (torch.cat(pair, 0) for pair in zip(_qkv(prefix + steps, value_dim, heads, dtype, seed),
                                                   _qkv(prefix + steps, value_dim, heads, dtype, seed + 1)))
    _, state = ref.based_chunked_reference(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix])
    return q, k, v, state


@INTERPRETED
@pytest.mark.parametrize("heads,value_dim,dtype", [(2, 16, torch.float32), (4, 64, torch.float16),
                                                   (3, 100, torch.float32), (2, 64, torch.bfloat16)])
def test_fused_decode_equals_the_float64_reference(heads, value_dim, dtype):
    """Step after step, the fused kernel's output and state equal the PyTorch step in float64, in place."""
    q, k, v, state = _decode_case(heads, value_dim, dtype, steps=3, seed=value_dim)
    exact = ref.BasedState(state.kv.double(), state.k.double())
    pointers = (state.kv.data_ptr(), state.k.data_ptr())
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # a 16-bit output
    for t in range(5, q.shape[2]):
        x = (q[:, :, t], k[:, :, t], v[:, :, t])
        out = ref._launch_decode(*x, state)
        want = ref.based_decode_reference(*(y.double() for y in x), exact)
        assert out.dtype == dtype and out.shape == (2, heads, value_dim)
        torch.testing.assert_close(out.double(), want, **tol)
        torch.testing.assert_close(state.kv.double(), exact.kv, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(state.k.double(), exact.k, atol=1e-4, rtol=1e-5)
    assert (state.kv.data_ptr(), state.k.data_ptr()) == pointers


@INTERPRETED
def test_fused_decode_reads_views_as_the_engine_passes_them():
    """q, k, v split from one projection row per sequence (strided views) and a state that is the leading
    rows of a larger one: the kernel equals the PyTorch step, and the rows past the batch stay untouched."""
    heads, value_dim = 2, 24
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, heads * (16 + 16 + value_dim), generator=gen)
    q, k, v = qkv.split([heads * 16, heads * 16, heads * value_dim], -1)
    q, k, v = q.reshape(2, heads, 16), k.reshape(2, heads, 16), v.reshape(2, heads, value_dim)
    rows = ref.BasedState(torch.rand(3, heads, 273, value_dim, generator=gen),
                          torch.rand(3, heads, 273, generator=gen) + 1)
    naive = ref.BasedState(rows.kv.clone(), rows.k.clone())
    out = ref._launch_decode(q, k, v, ref.BasedState(rows.kv[:2], rows.k[:2]))
    want = ref.based_decode_reference(q, k, v, ref.BasedState(naive.kv[:2], naive.k[:2]))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows.kv, naive.kv, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(rows.k, naive.k, atol=1e-5, rtol=1e-6)
    assert torch.equal(rows.kv[2], naive.kv[2]) and torch.equal(rows.k[2], naive.k[2])


@INTERPRETED
def test_decode_step_runs_the_kernel_and_bad_input_leaves_the_state_untouched(monkeypatch):
    """based_decode_step on the kernel's route (CUDA's, here in the interpreter): one launch for a good step;
    a bad call raises ValueError before anything is written."""
    monkeypatch.setattr(ref, "_decode_kernel_runs", lambda q: True)
    launches = []
    real = ref._launch_decode
    monkeypatch.setattr(ref, "_launch_decode", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    q, k, v, state = _decode_case(2, 32, torch.float32, steps=1, seed=7)
    x = (q[:, :, 5], k[:, :, 5], v[:, :, 5])
    before = ref.BasedState(state.kv.clone(), state.k.clone())
    bad = [(x[0], x[1], x[2][..., :16], state),                                   # v narrower than the state
           (x[0], x[1], x[2], ref.empty_state(2, 3, 32)),                           # other heads
           (x[0], x[1], x[2], ref.BasedState(state.kv.double(), state.k.double())),  # a float64 state
           (q[:, :, 5:7], k[:, :, 5:7], v[:, :, 5:7], state),                      # two tokens
           (x[0], x[1].half(), x[2], state)]                                        # mixed dtypes
    for args in bad:
        with pytest.raises(ValueError):
            ref.based_decode_step(*args)
    assert not launches and torch.equal(state.kv, before.kv) and torch.equal(state.k, before.k)
    out = ref.based_decode_step(*x, state)
    assert launches == [1]
    torch.testing.assert_close(out, ref.based_decode_reference(*x, before), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("value_dim,dtype", [(32, torch.bfloat16), (64, torch.float16), (100, torch.float32),
                                             (256, torch.bfloat16)])
def test_decode_step_on_cuda_runs_the_kernel_and_equals_the_pytorch_step(value_dim, dtype):
    """On a GPU based_decode_step is the fused kernel: 16 steps (batch 2, 4 heads) equal the PyTorch step's in
    float64."""
    q, k, v, state = _decode_case(4, value_dim, dtype, steps=16, seed=value_dim)
    q, k, v = (x.cuda() for x in (q, k, v))
    assert ref._decode_kernel_runs(q)
    exact = ref.BasedState(state.kv.double().cuda(), state.k.double().cuda())
    state = ref.BasedState(state.kv.cuda(), state.k.cuda())
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for t in range(5, q.shape[2]):
        x = (q[:, :, t], k[:, :, t], v[:, :, t])
        out = ref.based_decode_step(*x, state)
        torch.testing.assert_close(out.double(), ref.based_decode_reference(*(y.double() for y in x), exact), **tol)
    torch.testing.assert_close(state.kv.double(), exact.kv, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(state.k.double(), exact.k, atol=1e-3, rtol=1e-5)

def test_state_and_kv_cache_memory_figures():
    # One layer of 16 heads, d_v = 64: 273 * 65 float32 numbers per head, whatever the length.
    assert ref.state_bytes(16, 64) == 16 * 273 * 65 * 4
    # A bf16 KV cache of the same heads at head_dim 64 overtakes it after ~277 tokens.
    kv_cache_per_token = 2 * 16 * 64 * 2
    assert math.ceil(ref.state_bytes(16, 64) / kv_cache_per_token) == 278


def test_weights_are_never_negative():
    """1 + s + s^2/2 = ((1 + s)^2 + 1) / 2 >= 1/2: the normaliser cannot vanish."""
    s = torch.linspace(-50, 50, 10001, dtype=torch.float64)
    assert float((1 + s + s * s / 2).min()) == pytest.approx(0.5)


def test_benchmark_pieces_without_a_gpu():
    from yaie.bench import lesson08

    assert lesson08.lengths(False) == [1024, 2048, 4096, 8192, 16384]
    assert lesson08.based_flops(1, 1, 10, 64) == 4 * 10 * 273 * 64
    assert lesson08.sdpa_flops(1, 1, 8, 64) == 4 * 64 * 64 // 2
    fla, why = lesson08.load_fla()
    assert (fla is None) == (why is not None)


def test_fla_is_a_benchmark_only_extra():
    text = (ROOT / "pyproject.toml").read_text()      # (tomllib is Python 3.11+; the course supports 3.10)
    main = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    bench = re.search(r"^bench = \[(.*?)^\]", text, re.S | re.M).group(1)
    assert "fla" not in main and '"fla-core"' in bench


# ---------------------------------------------------------------- the Based model in the engine

BASED_MODEL = ROOT / "yaie" / "assets" / "tiny-based"


@pytest.fixture(scope="module")
def based_llm():
    from yaie.engine import LLM
    from yaie.model.testing import single_thread

    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        yield LLM(BASED_MODEL, device="cpu")


def test_bundled_based_model_is_small_and_a_based_model(based_llm):
    assert sum(p.stat().st_size for p in BASED_MODEL.iterdir()) <= 10 * 2**20
    cfg = based_llm.config
    assert cfg.based_layers and type(based_llm.model).__name__ == "BasedModel"
    assert all((w is None) == (n in cfg.based_layers) for n, w in enumerate(cfg.sliding_windows))


def test_engine_generates_from_the_bundled_based_model(based_llm, monkeypatch):
    """Greedy generation through the engine (prefill, then the recurrent state) picks the same tokens as
    greedy decoding that reruns the whole sequence through a fresh prefill at every step."""
    from yaie.engine import SamplingParams
    from yaie.model.based_rows import BasedCache

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    prompt = "Once upon a time, there was a little cat named Mia."
    out = based_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(out.text.split()) >= 5, out.text
    model, ids = based_llm.model, based_llm.tokenizer.encode(prompt)
    for _ in range(24):
        seq = torch.tensor(ids)
        hidden = model.forward(seq, torch.arange(len(ids)), BasedCache(model.config, "cpu"))
        ids.append(int(model.logits(hidden[-1:]).argmax()))
    assert based_llm.tokenizer.decode(ids[-24:]) == out.text


def test_recurrent_decode_logits_equal_the_parallel_forward(based_llm, monkeypatch):
    """Prompt in one prefill (the chunked algorithm), then token by token (the recurrent state, the window
    ring): the logits of every position equal those of one forward over the whole sequence."""
    from yaie.model.based_rows import BasedCache

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    model = based_llm.model
    story = ("Once upon a time, there was a little dog named Sam. Sam liked to run in the big park with his red "
             "ball, and every day he met a bird who sang a happy song for him and his friends. ")
    ids = torch.tensor(based_llm.tokenizer.encode(story * 2))
    n = ids.numel()
    assert n > model.config.sliding_windows[1] + 8     # the window ring wraps during the test
    whole = model.logits(model.forward(ids, torch.arange(n), BasedCache(model.config, "cpu")))
    cache = BasedCache(model.config, "cpu")
    steps = [model.logits(model.forward(ids[:7], torch.arange(7), cache))]
    for t in range(7, n):
        steps.append(model.logits(model.forward(ids[t:t + 1], torch.arange(t, t + 1), cache)))
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-4, rtol=1e-4)


def test_based_layers_match_the_quadratic_form(based_llm, monkeypatch):
    """The prefill's Based layer output equals the quadratic form (an independent check of the engine path)."""
    from yaie.model.based import based_parallel
    from yaie.model.based_rows import BasedCache

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(40, 8, 16, generator=gen) for _ in range(2))
    v = torch.randn(40, 8, 32, generator=gen)
    out = BasedCache(based_llm.config, "cpu").attend_linear(0, q, k, v)
    torch.testing.assert_close(out, based_parallel(q, k, v), atol=1e-5, rtol=1e-5)


def test_memory_per_sequence_is_constant(based_llm, monkeypatch):
    from yaie.engine import SamplingParams

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    window = max(w for w in based_llm.config.sliding_windows if w)
    sizes = []
    for prompt_len in (window + 1, 4 * window):    # past the window, the window layers keep `window` tokens
        ids = list(range(5, 5 + prompt_len))
        based_llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        sizes.append(based_llm.state_bytes_per_sequence())
    assert sizes[0] == sizes[1] > 0


def test_config_errors_name_the_problem():
    from yaie.model.config import ModelConfig, ModelLoadError

    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=2, based_layers=[0, 5], sliding_window=8)
    with pytest.raises(ModelLoadError, match="based_layers"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_dict({**raw, "based_layers": [0], "sliding_window": None})
    cfg = ModelConfig.from_dict({**raw, "based_layers": [0]})
    assert cfg.sliding_windows == [None, 8] and cfg.based_feature_dim == 16
