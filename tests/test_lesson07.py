"""Lesson 07 beyond its grader: the reference's recurrent and parallel forms agree, properties of the merge
rule, the scatter kernel on maps with and without stable columns, telescoping attention against exact
attention, and the telescoping model: recurrent decode = parallel forward, generation through the engine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import triton

from solutions.kernels import telescoping as ref
from tests.helpers import ROOT
from yaie.device import triton_interpreted


def recurrent_caches(x: torch.Tensor, capacity: int):
    """The reference's merge rule run token by token: (entries, sizes) after every token."""
    entries = torch.zeros(0, *x.shape[1:], dtype=x.dtype)
    sizes = torch.zeros(0, dtype=torch.int64)
    out = []
    for token in x:
        entries, sizes = ref.telescoping_step(entries, sizes, token, capacity)
        out.append((entries, sizes))
    return out


@pytest.mark.parametrize("length,capacity", [(70, 6), (40, 1), (25, 30), (200, 16)])
def test_recurrent_and_parallel_forms_of_the_reference_agree(length, capacity):
    x = torch.randn(length, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    index_map, starts, ends = ref.telescoping_index_map(length, capacity)
    buf = ref.telescoping_buffer(x[None], starts, ends)[0]
    n = starts.numel()
    assert n == length + max(0, length - capacity)
    for p, (entries, sizes) in enumerate(recurrent_caches(x, capacity)):
        k = entries.shape[0]
        assert k == min(p + 1, capacity)
        rows = index_map[p, :k].long()
        torch.testing.assert_close(buf[rows], entries, atol=1e-12, rtol=1e-12)
        assert torch.equal(ends[rows] - starts[rows], sizes)
        assert bool((index_map[p, k:] == n).all())


def test_spans_double_with_distance():
    """After many tokens: sizes never grow from old to new, all but the oldest are powers of two, and the
    levels hold about the same number of entries (the rule keeps them balanced)."""
    index_map, starts, ends = ref.telescoping_index_map(4000, 64)
    sizes = (ends - starts)[index_map[-1].long()].tolist()
    assert sizes == sorted(sizes, reverse=True)
    assert all(s & (s - 1) == 0 for s in sizes[1:])
    assert sizes[-1] == 1 and sum(sizes) == 4000
    levels = [s.bit_length() - 1 for s in sizes]
    counts = [levels.count(lv) for lv in sorted(set(levels))]
    assert max(counts) - min(counts[:-1] or counts) <= 2, counts     # the oldest level may be partly filled


def test_stable_slots_keep_columns():
    index_map, starts, _ = ref.telescoping_index_map(300, 16)
    n = starts.numel()
    stable = ref.stable_slots(index_map, n)
    for p in range(300):
        assert sorted(stable[p].tolist()) == sorted(index_map[p].tolist())
    for p in range(1, 300):
        alive = set(stable[p].tolist()) & set(stable[p - 1].tolist()) - {n}
        for r in alive:      # an entry that stays keeps its column
            assert stable[p].tolist().index(r) == stable[p - 1].tolist().index(r)


def _map(kind: str, length: int, capacity: int) -> tuple[torch.Tensor, int]:
    index_map, starts, _ = ref.telescoping_index_map(length, capacity)
    n = starts.numel()
    if kind == "stable":
        index_map = ref.stable_slots(index_map, n)
    elif kind == "random":
        index_map = torch.randint(0, n + 2, (length, capacity), generator=torch.Generator().manual_seed(0))
    return index_map, n


@pytest.mark.parametrize("blocks", [(8, 4), (4, 4), (0, 4)], ids=["blocks of 8", "blocks of 4", "per-position"])
@pytest.mark.parametrize("kind,length,capacity", [("stable", 37, 8), ("stable", 60, 24), ("oldest-first", 37, 8),
                                                   ("random", 37, 8)])
def test_gather_dot_and_scatter_on_any_map(kind, length, capacity, blocks):
    """Both variants of the two kernels, whatever the map. The blocked ones treat the rows a slot holds at
    a block's first and last position as two matmuls and any third row position by position (c = 24:
    entries outlive a block, only the matmuls run; c = 8 and the other maps: every path)."""
    index_map, n = _map(kind, length, capacity)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, length, 2, 3, 16, generator=gen)
    k = torch.randn(1, n, 2, 16, generator=gen)
    dout = torch.randn(1, length, 2, 3, capacity, generator=gen)
    leaves = [q.double().requires_grad_(True), k.double().requires_grad_(True)]
    scores = ref.indexed_qk_reference(*leaves, index_map)
    want = torch.autograd.grad(scores, leaves, dout.double())
    torch.testing.assert_close(ref._gather_dot(q, k, index_map, blocks=blocks).double(), scores.detach(),
                               atol=5e-5, rtol=1e-5)
    got_dk = ref._scatter(dout, q, index_map, n, torch.float32, blocks=blocks)
    torch.testing.assert_close(got_dk.double(), want[1], atol=5e-5, rtol=1e-5)


def test_blocked_kernels_are_picked_for_stable_maps_only():
    longest = 8 if triton_interpreted() else 32             # the longest block tried
    for kind, length, capacity, e, want in (("stable", 300, 32, 4, longest), ("stable", 40, 8, 4, 0),
                                            ("oldest-first", 300, 32, 4, 0), ("random", 300, 32, 4, 0),
                                            ("random", 300, 32, 16, 0), ("stable", 300, 32, 256, 0)):
        index_map, n = _map(kind, length, capacity)
        m = ref._normalise_map(index_map, n)
        group = triton.next_power_of_2(e)
        assert ref._blocks_plan(index_map, m, n, e=e) == (want, group), (kind, length, capacity, e)
        assert index_map._yaie_blocks[1] == want          # kept on the tensor: measured once


def test_kernels_take_a_map_made_in_inference_mode():
    """The engine builds its maps under torch.inference_mode (such tensors have no version counter)."""
    with torch.inference_mode():
        index_map, n = _map("stable", 60, 24)
        q, k = torch.randn(1, 60, 2, 2, 16), torch.randn(1, n, 2, 16)
        got = ref.indexed_qk_forward(q, k, index_map)
    torch.testing.assert_close(got, ref.indexed_qk_reference(q, k, index_map), atol=5e-5, rtol=1e-5)


def test_inputs_of_the_wrong_kind_get_a_value_error():
    x = torch.randn(3, 4)
    sizes = torch.ones(3, dtype=torch.int64)
    _, starts, ends = ref.telescoping_index_map(6, 2)
    for call, words in [
        (lambda: ref.telescoping_step(x, sizes, x[0], 4.0), "capacity must be an int"),
        (lambda: ref.telescoping_step(x, sizes, x[0], True), "capacity must be an int"),
        (lambda: ref.telescoping_step(x, [1, 1, 1], x[0], 4), "sizes must be a torch.Tensor"),
        (lambda: ref.telescoping_index_map(6, "2"), "capacity must be an int"),
        (lambda: ref.telescoping_index_map(0, 2), "length must be at least 1"),
        (lambda: ref.telescoping_buffer(7, starts, ends), "x must be a torch.Tensor"),
        (lambda: ref.telescoping_buffer(torch.ones(1, 6, dtype=torch.int64), starts, ends), "floating-point"),
        (lambda: ref.telescoping_buffer(torch.randn(1, 6), starts.float(), ends), "integer tensors"),
        (lambda: ref.choose_merge(torch.tensor([2, 1])), "sizes must be a list of ints"),
        (lambda: ref.choose_merge([1, 1.0]), "sizes must be a list of ints"),
        (lambda: ref.indexed_qk_backward([0.0], torch.randn(1, 2, 1, 1, 16), torch.randn(1, 3, 1, 16),
                                         torch.zeros(2, 2, dtype=torch.int32)), "dout must be a torch.Tensor"),
    ]:
        with pytest.raises(ValueError, match=words):
            call()


def test_telescoping_attention_is_exact_attention_while_nothing_merges():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 20, 4, 16, generator=gen), torch.randn(2, 20, 2, 16, generator=gen), \
        torch.randn(2, 20, 2, 16, generator=gen)
    full = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                          v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(ref.telescoping_attention(q, k, v, capacity=20), full, atol=1e-5, rtol=1e-5)
    # With merges and one key for every token, exact attention is the running mean of the values; the
    # log(size) bias makes the telescoping cache give it exactly (an average of s tokens weighs as s tokens).
    k_same = k[:, :1].expand(-1, 20, -1, -1).contiguous()
    running_mean = v.cumsum(1) / torch.arange(1, 21).view(1, 20, 1, 1)
    for use_kernels in (False, True):
        tele = ref.telescoping_attention(q, k_same, v, capacity=5, use_kernels=use_kernels)
        torch.testing.assert_close(tele, running_mean.repeat_interleave(2, 2), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the model and the engine

TELESCOPING_MODEL = ROOT / "yaie" / "assets" / "tiny-telescoping"


def _model_dir(tmp_path):
    """The shipped telescoping model, or (before it exists) the tiny-stories weights with a telescoping
    config: the cache's logic does not depend on how the weights were trained."""
    if (TELESCOPING_MODEL / "config.json").is_file():
        return TELESCOPING_MODEL
    target = tmp_path / "tele"
    shutil.copytree(ROOT / "yaie" / "assets" / "tiny-stories", target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(telescoping_capacity=8, max_position_embeddings=4096)
    (target / "config.json").write_text(json.dumps(cfg))
    return target


@pytest.fixture
def solutions_on(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")


def test_model_decode_equals_parallel_forward(tmp_path, solutions_on):
    from yaie.model.llama import LlamaModel
    from yaie.model.telescoping import TelescopingKVCache

    path = _model_dir(tmp_path)
    model = LlamaModel.from_pretrained(path)
    capacity = model.config.telescoping_capacity
    assert capacity
    length = capacity + 11        # past the capacity: merges happen
    ids = torch.randint(3, 200, (length,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(length)
    parallel = TelescopingKVCache(model.config, capacity, "cpu")
    last_parallel = model.logits(model.forward(ids, positions, parallel)[-1:])
    recurrent = TelescopingKVCache(model.config, capacity, "cpu")
    for i in range(length):
        hidden = model.forward(ids[i:i + 1], positions[i:i + 1], recurrent)
    torch.testing.assert_close(model.logits(hidden), last_parallel, atol=1e-4, rtol=1e-4)
    mixed = TelescopingKVCache(model.config, capacity, "cpu")       # prefill, then decode the rest
    model.forward(ids[:-4], positions[:-4], mixed)
    hidden = model.forward(ids[-4:], positions[-4:], mixed)
    torch.testing.assert_close(model.logits(hidden[-1:]), last_parallel, atol=1e-4, rtol=1e-4)
    assert parallel.nbytes() == recurrent.nbytes() == mixed.nbytes()
    assert all(t.shape[0] == capacity for t in recurrent.keys)


def test_engine_generates_with_a_constant_size_cache(tmp_path, solutions_on):
    from yaie.engine.llm import LLM
    from yaie.engine.sampling import SamplingParams

    llm = LLM(_model_dir(tmp_path), device="cpu")
    capacity = llm.config.telescoping_capacity
    out = llm.generate(["Once upon a time", "The dog"], SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]
    assert all(o.outputs[0].text for o in out)
    sizes = []
    for tokens in (capacity + 5, capacity + 40):
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        cache = llm.last_core.runner.rows.caches[0]       # the first row's cache, as the request left it
        assert all(k.shape[0] == capacity for k in cache.keys)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1], "the cache must not grow with the generated length"
