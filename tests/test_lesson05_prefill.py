"""Course-side checks of lesson 05's prefix-prefill kernel (``solutions/kernels/prefix_prefill.py``).

* the engine sends a prefill that continues a cached context to the kernel (a spy on ``ops.call_in``),
  reading the paged cache directly, and the model's greedy tokens and logits stay those of a
  whole-prompt prefill (lesson 06) and of the gather + lesson 01 path;
* the kernel and the reference agree where the grader does not look: a sequence of 0 new tokens, one
  whose prefix ends exactly on a block edge, a tiny window with sinks (rows whose first tiles are all
  masked), and what the 16-byte layout helpers do;
* the bad-input messages name the problem.

CPU only (the Triton interpreter), tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

from yaie import ops
from yaie.model.paged import PagedStep
from yaie.model.testing import fresh_seed, single_thread


@pytest.fixture(autouse=True)
def _reference_lessons(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")


def _pp():
    from solutions.kernels import prefix_prefill
    return prefix_prefill


# ---------------------------------------------------------------- the engine path

def _greedy(llm, chunks: list[list[int]], use_kernels: bool, new_tokens: int, block_size: int = 8):
    """Prefill a prompt in ``chunks`` (each after the previous one is cached), then decode greedily.

    Returns (generated token ids, logits of the prompt's last token). Runs on ``llm.device`` (the GPU
    script calls it on CUDA too)."""
    cfg = llm.config
    dev = llm.device
    manager = ops.kv_cache_manager(64, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                   llm.model.dtype, dev)
    manager.allocate(0, 0)
    seen = 0
    for chunk in chunks:
        step = PagedStep(manager, [0], [len(chunk)], 0, manager.append_slots(0, len(chunk)), use_kernels=use_kernels)
        hidden = llm.model.forward(torch.tensor(chunk, device=dev), torch.arange(seen, seen + len(chunk), device=dev),
                                   step)
        seen += len(chunk)
    first_logits = llm.model.logits(hidden[-1:])[0]
    tokens = [int(first_logits.argmax())]
    for _ in range(new_tokens - 1):
        step = PagedStep(manager, [0], [1], 1, manager.append_slots(0, 1), use_kernels=use_kernels)
        hidden = llm.model.forward(torch.tensor(tokens[-1:], device=dev), torch.tensor([seen], device=dev), step)
        seen += 1
        tokens.append(int(llm.model.logits(hidden)[0].argmax()))
    manager.free(0)
    return tokens, first_logits


def test_engine_prefills_after_a_cached_context_through_the_kernel(monkeypatch, tmp_path):
    """A prompt prefilled as 19 + 14 tokens (the second step continues a cached context of 19: 2 blocks
    and 3 tokens) gives the tokens and logits of the same prompt in one prefill, and its second step
    runs lesson 05's kernel once per layer, with the paged cache itself (no gathered copy)."""
    pytest.importorskip("transformers")
    from yaie.engine import LLM
    from yaie.model.testing import save_random_model

    seed = fresh_seed()
    save_random_model("llama", tmp_path, seed=seed)
    with single_thread():
        llm = LLM(tmp_path, device="cpu")
        gen = torch.Generator().manual_seed(seed)
        prompt = [1] + torch.randint(3, llm.config.vocab_size, (32,), generator=gen).tolist()
        calls = []
        real_call_in = ops.lessons.call_in

        def spy(lesson, which, name, *args, **kwargs):
            if lesson != 1:
                calls.append((lesson, which, name, args))
            return real_call_in(lesson, which, name, *args, **kwargs)

        monkeypatch.setattr(ops.lessons, "call_in", spy)
        whole, whole_logits = _greedy(llm, [prompt], True, 4)
        assert [c[2] for c in calls if c[2] != "paged_attention_forward"] == \
            ["flash_attention_varlen_forward"] * llm.config.num_layers, "a whole prompt goes to lesson 06"
        calls.clear()
        split, split_logits = _greedy(llm, [prompt[:19], prompt[19:]], True, 4)
        prefix_calls = [c for c in calls if c[2] == "prefix_prefill_attention"]
        assert len(prefix_calls) == llm.config.num_layers, [c[:3] for c in calls]
        assert all(c[:2] == (5, 1) for c in prefix_calls)
        for _, _, _, args in prefix_calls:
            k_cache, context_lens = args[3], args[7]
            assert k_cache.dim() == 4 and k_cache.shape[0] == 64, "the kernel must get the paged cache itself"
            assert context_lens.tolist() == [19]
        gathered, gathered_logits = _greedy(llm, [prompt[:19], prompt[19:]], False, 4)
    assert split == whole == gathered, f"seed={seed}: {split} vs {whole} vs {gathered}"
    assert torch.allclose(split_logits, whole_logits, atol=1e-4, rtol=1e-4), f"seed={seed}"
    assert torch.allclose(split_logits, gathered_logits, atol=1e-4, rtol=1e-4), f"seed={seed}"


def test_engine_falls_back_to_lesson06_without_lesson05(monkeypatch):
    """Without lesson 05 in the course copy, a continued prefill gathers its context for lesson 06."""
    from tests.test_ops_paged import build_step, reference

    seed = fresh_seed()
    step, q, k_new, v_new, full_k, full_v = build_step(seed, [0, 9], [12, 7], 0, use_kernels=True)
    monkeypatch.setattr(ops.attention_backends.PREFIX_PREFILL, "accepts", lambda step, window: False)
    names = []
    real_call_in = ops.lessons.call_in

    def spy(lesson, which, name, *args, **kwargs):
        names.append(name)
        return real_call_in(lesson, which, name, *args, **kwargs)

    monkeypatch.setattr(ops.lessons, "call_in", spy)
    got = step.attend(0, q, k_new, v_new)
    assert names == ["flash_attention_varlen_forward"]
    for i in range(2):
        rows = slice(step.query_starts[i], step.query_starts[i + 1])
        assert (got[rows].double() - reference(q[rows], full_k[i], full_v[i])).abs().max() < 1e-4, f"seed={seed}"


# ---------------------------------------------------------------- kernel corners

def _batch(seed, ctx, new, heads=4, kv_heads=2, dim=16, block_size=8, dtype=torch.float32):
    """Random q, k, v and a shuffled paged cache (NaN where no sequence owns a row)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [max(1, -(-c // block_size)) for c in ctx]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(ctx), max(per_seq)), order[-1], dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for b, c in enumerate(ctx):
        for j in range(per_seq[b]):
            tables[b, j] = order.pop(0)
        for t in range(c):
            block = int(tables[b, t // block_size])
            k_cache[block, t % block_size] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
            v_cache[block, t % block_size] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
    total = sum(new)
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, k_cache, v_cache, tables, cu, torch.tensor(ctx, dtype=torch.int32)


def _compare(args, max_query_len, **kwargs):
    pp = _pp()
    out, lse = pp.prefix_prefill_attention(*args, max_query_len, **kwargs)
    as64 = [t.double() if t.is_floating_point() else t for t in args]
    extra = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ref_out, ref_lse = pp.prefix_prefill_reference(*as64, **extra)
    assert (out.double() - ref_out).abs().max() < 2e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-4
    return out, lse


def test_zero_new_tokens_and_block_edges():
    """A sequence with no new tokens, prefixes ending exactly on a block and a tile edge (16, 32)."""
    seed = fresh_seed()
    args = _batch(seed, [16, 5, 32], [9, 0, 17])
    _compare(args, 17)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_tiny_windows_with_sinks(window):
    """Windows shorter than a tile: most tiles a row visits are fully masked for it, so its running max
    starts from the sink or from the large negative mask value (never -inf: no NaN)."""
    seed = fresh_seed()
    args = _batch(seed, [40, 3], [20, 18])
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed)) * 3
    out, _ = _compare(args, 20, sliding_window=window, sinks=sinks)
    assert torch.isfinite(out).all()


def test_vector_layout_helpers():
    pp = _pp()
    k_cache = torch.randn(3, 8, 2, 32, dtype=torch.float16)
    split = pp.to_vector_k_layout(k_cache)
    assert split.shape == (3, 2, 4, 8, 8)                       # 8 halves = 16 bytes
    assert split.element_size() * split.shape[-1] == 16
    assert torch.equal(split[1, 0, 2, 5], k_cache[1, 5, 0, 16:24])
    assert torch.equal(pp.from_vector_k_layout(split), k_cache)
    assert pp.vector_width(torch.float8_e4m3fn) == 16 and pp.vector_width(torch.float32) == 4
    with pytest.raises(ValueError, match="multiple of 8"):
        pp.to_vector_k_layout(torch.zeros(1, 8, 1, 12, dtype=torch.float16))


def test_bad_inputs_name_the_problem():
    pp = _pp()
    seed = fresh_seed()
    q, k, v, kc, vc, bt, cu, cl = _batch(seed, [9, 4], [3, 5])
    f = pp.prefix_prefill_attention
    with pytest.raises(ValueError, match="max_query_len"):
        f(q, k, v, kc, vc, bt, cu, cl, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        f(q[:, :3], k, v, kc, vc, bt, cu, cl, 5)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        f(q, k, v, kc.double(), vc.double(), bt, cu, cl, 5)
    with pytest.raises(ValueError, match="fp8 KV cache needs a CUDA GPU"):
        f(q, k, v, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), bt, cu, cl, 5)
    with pytest.raises(ValueError, match="block_tables"):
        f(q, k, v, kc, vc, bt.long(), cu, cl, 5)
    with pytest.raises(ValueError, match="out must be"):
        f(q, k, v, kc, vc, bt, cu, cl, 5, out=torch.empty(3, 4, 16))
    before = q.clone()
    with pytest.raises(ValueError, match="sinks"):
        f(q, k, v, kc, vc, bt, cu, cl, 5, sinks=torch.zeros(2))
    assert torch.equal(q, before)
