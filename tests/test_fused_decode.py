"""Lesson 04's reference-only ``paged_decode_with_rope`` (RoPE, the cache write and paged decode in one kernel)
against float64 and against the ops apart, and ``yaie.ops.rope_and_paged_attention``, which picks it.

On the CPU the kernels run in the Triton interpreter (tiny shapes); a machine with a GPU runs the same checks
there, and the bf16 model shapes.
"""

from __future__ import annotations

import pytest
import torch

from solutions.kernels import gpu_elementwise as ref02
from solutions.kernels import paged_attention as ref04
from tests.test_fused_kernels import rope64, tables
from tests.test_ops_paged import build_step, reference
from yaie import ops
from yaie.model.testing import fresh_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def decode_case(dtype, lens, heads=4, kv_heads=2, head_dim=16, block_size=4, blocks=40, device=DEVICE, seed=None,
                bound=None):
    """A decode step of ``len(lens)`` sequences: sequence b holds ``lens[b]`` tokens once its new one is stored
    (0: a padding row), its blocks at random places (tables of ``bound`` tokens, default the longest); q, k, v
    views of one fused projection output; RoPE tables longer than every position."""
    gen = torch.Generator().manual_seed(fresh_seed() if seed is None else seed)
    batch = len(lens)
    bound = max(max(lens), 1) if bound is None else bound
    per_seq = -(-bound // block_size)
    block_tables = torch.randperm(blocks, generator=gen)[:batch * per_seq].reshape(batch, per_seq).int()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    newest = (context_lens - 1).clamp(min=0).long()
    positions = newest + torch.randint(0, 3, (batch,), generator=gen)     # a position need not be the length
    slots = block_tables.long().gather(1, (newest // block_size)[:, None])[:, 0] * block_size + newest % block_size
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.reshape(batch, -1, head_dim) for t in (q, k, v))
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    cos, sin = tables(bound + 3, head_dim)
    return [t.to(device) for t in (q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables,
                                   context_lens)]


def attention64(q, k_cache, v_cache, block_tables, context_lens, window=None):
    """Float64 decode attention, each sequence's keys gathered through its table (independent of lesson 04)."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(context_lens[b])
        if n == 0:
            continue
        tokens = torch.arange(0 if window is None else max(0, n - window), n)
        blocks = block_tables[b].cpu().long()[tokens // block_size]
        keys = k_cache.cpu().double()[blocks, tokens % block_size].repeat_interleave(heads // kv_heads, 1)
        values = v_cache.cpu().double()[blocks, tokens % block_size].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[b].cpu().double(), keys) * head_dim ** -0.5
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


def stored64(c, dtype):
    """The caches once the step's keys (rotated in float64, rounded to the cache's dtype) and values are
    stored, and which cache rows the step writes."""
    q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables, context_lens = c
    k_want, v_want = k_cache.clone(), v_cache.clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b in range(q.shape[0]):
        if int(context_lens[b]):
            slot = int(slots[b])
            k_want.view(-1, *k_cache.shape[2:])[slot] = rope64(k[b:b + 1], cos, sin, positions[b:b + 1])[0].to(dtype)
            v_want.view(-1, *v_cache.shape[2:])[slot] = v[b]
            written.view(-1)[slot] = True
    return k_want, v_want, written


def assert_caches(k_cache, v_cache, k_want, v_want, written, dtype):
    """The written key rows as float64 RoPE rounded (within a rounding), the values exact, every other row unchanged."""
    torch.testing.assert_close(k_cache[written].double(), k_want[written].double(), **TOL[dtype])
    assert torch.equal(k_cache[~written], k_want[~written]), "a key row the step does not write changed"
    assert torch.equal(v_cache, v_want), "the value rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits,window,head_dim", [(1, None, 16), (3, None, 16), (3, 5, 16), (3, None, 12)])
def test_fused_decode_matches_float64(dtype, splits, window, head_dim):
    """Ragged contexts (a padding row of length 0 among them), a split count that leaves ranges empty, a window,
    a head dim that is not a power of two; the output against float64 RoPE + attention over the caches as they
    should be after the step, and the caches themselves: the new rows stored, every other row unchanged."""
    c = decode_case(dtype, lens=[5, 17, 0, 1, 9], head_dim=head_dim)
    q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables, context_lens = c
    k_want, v_want, written = stored64(c, dtype)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    got = ref04._launch_decode(q, k_cache, v_cache, block_tables, context_lens, 17, head_dim ** -0.5, splits,
                               sliding_window=window, rope=(k, v, cos, sin, positions, slots))
    want = attention64(rope64(q, cos, sin, positions).to(dtype), k_want, v_want, block_tables, context_lens, window)
    torch.testing.assert_close(got.double().cpu(), want, **TOL[dtype])
    assert_caches(k_cache, v_cache, k_want, v_want, written, dtype)
    assert torch.equal(q, q_before) and torch.equal(k, k_before) and torch.equal(v, v_before), "inputs written"


def assert_same(got, want, dtype):
    """The same bits in the interpreter; on a GPU within a rounding (the compiler may fuse a multiply-add in
    one kernel's RoPE and not in the other's)."""
    if got.is_cuda:
        torch.testing.assert_close(got, want, **TOL[dtype])
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_equals_the_ops_apart(dtype):
    """The same results as lesson 02's RoPE + cache write kernel followed by lesson 04's decode, for the output
    and the caches; and its PyTorch reference agrees with the fused kernel."""
    c = decode_case(dtype, lens=[7, 30, 2])
    q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables, context_lens = c
    k1, v1 = k_cache.clone(), v_cache.clone()
    fused = ref04.paged_decode_with_rope(q, k, v, cos, sin, positions, k1, v1, slots, block_tables, context_lens, 30)
    q2, k2, k3, v3 = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    ref02.apply_rope_qk_store_kv(q2, k2, v, cos, sin, positions, k3, v3, slots)
    apart = ref04.paged_attention_forward(q2, k3, v3, block_tables, context_lens, 30)
    assert_same(fused, apart, dtype)
    assert_same(k1, k3, dtype)
    assert torch.equal(v1, v3)
    out, k4, v4 = ref04.paged_decode_with_rope_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots,
                                                         block_tables, context_lens)
    torch.testing.assert_close(out, fused, **TOL[dtype])
    torch.testing.assert_close(k4, k1, **TOL[dtype])        # PyTorch's float32 RoPE may round other ways
    assert torch.equal(v4, v1)


def test_fused_decode_refuses_bad_inputs():
    """Shapes, dtypes, layouts and tables (lesson 02's checks, and the layouts this kernel needs); and on the
    CPU the values too: a position outside the table, a slot outside the cache (on a GPU those give NaN and
    are skipped: the GPU test below)."""
    c = decode_case(torch.float32, lens=[6, 3])
    q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables, context_lens = c
    far = slots.clone()
    far[1] = k_cache.shape[0] * k_cache.shape[1]
    call = lambda **changed: ref04.paged_decode_with_rope(**dict(dict(   # noqa: E731
        q=q, k=k, v=v, cos=cos, sin=sin, position_ids=positions, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slots, block_tables=block_tables, context_lens=context_lens, max_context_len=6), **changed))
    refused = [
        ("must agree on num_tokens", dict(k=k[:1])),
        ("dtypes must match", dict(v=v.half())),
        ("cos must be a float32", dict(cos=cos.double())),
        ("cos must be \\[max_position, 16\\]", dict(cos=cos[:, :8], sin=sin[:, :8])),     # not head_dim wide
        ("cos must be \\[max_position, 16\\]", dict(cos=cos[:0], sin=sin[:0])),
        ("must have the same shape", dict(sin=sin[:-1])),
        ("position_ids must be an int", dict(position_ids=positions.float())),
        ("position_ids must lie in", dict(position_ids=positions + cos.shape[0])),
        ("slot_mapping must be an int", dict(slot_mapping=slots[:1])),
        ("slot_mapping must lie in", dict(slot_mapping=far)),
        ("k and v must have a contiguous last axis", dict(v=v.transpose(1, 2).contiguous().transpose(1, 2))),
        ("one layout", dict(sin=torch.cat([sin, sin], 1)[:, :16])),     # rows 32 apart, cos's 16
        ("head_dim must be even", dict(q=q[..., :15], k=k[..., :15], v=v[..., :15], k_cache=k_cache[..., :15],
                               v_cache=v_cache[..., :15], cos=cos[:, :15], sin=sin[:, :15])),
        ("context_lens", dict(context_lens=torch.tensor([7, 3], dtype=torch.int32))),     # validate: past the bound
    ]
    before = k_cache.clone(), v_cache.clone()
    for match, changed in refused:
        with pytest.raises(ValueError, match=match):
            call(**changed)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a refused call wrote the cache"


@pytest.fixture
def reference_lessons(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    # The kernels' path on the CPU: lesson 02's kernels run in the interpreter as they would on a GPU.
    monkeypatch.setattr(ops.layers, "use_gpu_kernels", lambda t: True)
    yield
    ops.reset_auto_fallback()


@pytest.mark.parametrize("window", [None, 6])
def test_rope_and_paged_attention_fuses_a_decode_step(monkeypatch, reference_lessons, window):
    """A decode step of the engine (lesson 03's reference cache, lesson 04 on): one launch of the fused kernel,
    the same bits as the ops apart, the float64 result."""
    seed = fresh_seed()
    cached = [3, 20, 8]
    calls = []
    real = ref04.paged_decode_with_rope
    monkeypatch.setattr(ref04, "paged_decode_with_rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = {}
    for fused in (True, False):
        step, q, k_new, v_new, full_k, full_v = build_step(seed, cached, [1, 1, 1], 3, use_kernels=True)
        cos, sin = tables(64, q.shape[-1])
        positions = torch.tensor(cached)
        if not fused:
            monkeypatch.setattr(ops.attention_backends, "fused_decode", lambda q, step, window: None)
        out = ops.rope_and_paged_attention(q.clone(), k_new.clone(), v_new, cos, sin, positions, step, 0, window)
        stored = step.manager.k_cache[0].flatten(0, 1)[step.slot_mapping]     # the new tokens' rows
        results[fused] = stored, out
        if fused:
            assert calls == [1], "the decode step should run the fused kernel once"
            for i, n in enumerate(cached):
                keys = torch.cat([full_k[i][:n].double(), rope64(k_new[i:i + 1], cos, sin, positions[i:i + 1])])
                want = reference(rope64(q[i:i + 1], cos, sin, positions[i:i + 1]), keys, full_v[i], window=window)
                err = (results[fused][1][i:i + 1].double() - want).abs().max().item()
                assert err < 1e-4, f"seed={seed} sequence {i}: max error {err}"
    assert calls == [1], "the ops apart ran the fused kernel"
    assert torch.equal(results[True][1], results[False][1]) and torch.equal(results[True][0], results[False][0])


def test_fused_decode_is_only_for_a_decode_step_of_the_reference(monkeypatch, reference_lessons):
    """Prefill rows, lesson 05's cascade, the gather path (no kernels) or a student's lesson 04 keep the ops
    apart."""
    step, q, *_ = build_step(fresh_seed(), [3, 5], [1, 1], 2, use_kernels=True)
    assert ops.attention_backends.fused_decode(q, step, None) is ref04.paged_decode_with_rope
    mixed, q_mixed, *_ = build_step(fresh_seed(), [3, 0], [1, 4], 1, use_kernels=True)
    assert ops.attention_backends.fused_decode(q_mixed, mixed, None) is None
    gather, q_gather, *_ = build_step(fresh_seed(), [3, 5], [1, 1], 2, use_kernels=False)
    assert ops.attention_backends.fused_decode(q_gather, gather, None) is None
    monkeypatch.setattr(step, "cascade", object())
    assert ops.attention_backends.fused_decode(q, step, None) is None
    monkeypatch.setattr(step, "cascade", None)
    monkeypatch.setenv("YAIE_SOLUTIONS", "1,2,3,5,6")           # lesson 04 is the student's
    assert ops.attention_backends.fused_decode(q, step, None) is None


def poison_new_rows(c):
    """NaN in the step's new cache rows, so a program that reads one before it is stored shows."""
    k_cache, v_cache, slots = c[6], c[7], c[8]
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[slots.long()] = float("nan")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,longest", [(1, 300), (1, 4000), (64, 300)])
def test_fused_decode_bf16_on_the_gpu_at_model_shapes(batch, longest):
    """bf16, the 1.1B and 8B models' heads (32 query, 8 KV, head dims 64 and 128), blocks of 16, split counts as
    the engine picks them (batch 1 at 4000 tokens: many splits, the new token in the last): the new rows are NaN
    before the step, so only the program that stores them may read them; the ops apart's results; the same
    bits from a CUDA graph, whose replay stores the rows again."""
    gen = torch.Generator().manual_seed(fresh_seed())
    for head_dim in (64, 128):
        lens = torch.randint(longest // 2, longest, (batch,), generator=gen).tolist()
        blocks = batch * (-(-longest // 16)) + 4
        c = decode_case(torch.bfloat16, lens, heads=32, kv_heads=8, head_dim=head_dim, block_size=16,
                        blocks=blocks, device="cuda", bound=longest)
        q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables, context_lens = c
        poison_new_rows(c)
        k2, v2, q2, kk = k_cache.clone(), v_cache.clone(), q.clone(), k.clone()
        ref02.apply_rope_qk_store_kv(q2, kk, v, cos, sin, positions, k2, v2, slots)
        apart = ref04.paged_attention_forward(q2, k2, v2, block_tables, context_lens, longest, validate=False)

        def fused():
            return ref04.paged_decode_with_rope(q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables,
                                                context_lens, longest, validate=False)
        eager = fused()
        assert torch.isfinite(eager).all(), f"head_dim {head_dim}: a program read a new row before it was stored"
        assert_same(eager, apart, torch.bfloat16)
        assert_same(k_cache, k2, torch.bfloat16)
        assert torch.equal(v_cache, v2), head_dim
        stored = k_cache.clone(), v_cache.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = fused()
        poison_new_rows(c)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), f"head_dim {head_dim}: a CUDA graph's replay gave other bits"
        assert torch.equal(k_cache, stored[0]) and torch.equal(v_cache, stored[1]), "the replay's stores"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_decode_on_the_gpu_skips_bad_slots_and_gives_nan_for_bad_positions():
    """No values are read back on a GPU: a slot outside the cache is not written, and a position outside the
    RoPE table gives that sequence a NaN key and output (as lesson 02's RoPE); the other sequences as usual."""
    c = decode_case(torch.bfloat16, lens=[40, 25, 33], device="cuda")
    q, k, v, cos, sin, positions, k_cache, v_cache, slots, block_tables, context_lens = c
    k_want = stored64(c, torch.bfloat16)[0].view(-1, *k_cache.shape[2:])
    before = k_cache.clone().view(-1, *k_cache.shape[2:])
    far, wild = slots.clone(), positions.clone()
    far[1] = k_cache.shape[0] * k_cache.shape[1]
    wild[2] = cos.shape[0]
    out = ref04.paged_decode_with_rope(q, k, v, cos, sin, wild, k_cache, v_cache, far, block_tables, context_lens,
                                       40, validate=False)
    rows = k_cache.view(-1, *k_cache.shape[2:])
    torch.testing.assert_close(rows[slots[0]].double(), k_want[slots[0]].double(), **TOL[torch.bfloat16])
    assert torch.isnan(rows[slots[2]]).all(), "a position outside the table gives a NaN key"
    others = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
    others[slots[[0, 2]]] = False
    assert torch.equal(rows[others], before[others]), "the skipped slot, or another row, was written"
    assert torch.isfinite(out[:2]).all() and torch.isnan(out[2]).all()
