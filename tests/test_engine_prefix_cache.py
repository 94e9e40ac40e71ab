"""Automatic prefix caching in the engine (lesson 05's radix tree over the lesson 03 cache).

Requests that start like something still cached prefill only their new tokens; the outputs must not
change: greedy tokens equal with caching on and off and equal to transformers', through preemption by
recompute and by swap with eviction of cached prefixes, and once every request ends nothing is held but
cached prefixes, which give every block back when cleared.
"""

import pytest
import torch

from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.engine.prefix_cache import make_prefix_cache
from yaie.model.paged import PagedStep
from yaie.model.testing import fresh_seed, hf_greedy, save_random_model

pytestmark = pytest.mark.usefixtures("reference_lessons")

SYSTEM = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
          "dog. One day, ")
ENDINGS = ["she saw a big red ball.", "her mom gave her a cake.", "it started to rain and", "a bird sang.",
           "they went to the park.", "Lily found a key."]
PROMPTS = [SYSTEM + e for e in ENDINGS]


def spy_prefill_lengths(monkeypatch) -> list[list[int]]:
    """Record the query lengths of every prefill the model runs (new tokens per prefilling sequence)."""
    seen = []
    init = PagedStep.__init__

    def spy(self, manager, seq_ids, query_lens, num_decodes, *args, **kwargs):
        seen.append(list(query_lens[num_decodes:]))
        init(self, manager, seq_ids, query_lens, num_decodes, *args, **kwargs)

    monkeypatch.setattr(PagedStep, "__init__", spy)
    return seen


def check_nothing_leaked(llm) -> None:
    scheduler = llm.last_core.scheduler
    manager, cache = scheduler.manager, scheduler.prefix_cache
    assert manager.seq_ids() == []
    # Every block is free or cached (unlocked); clearing the cache frees them all.
    assert manager.num_free_blocks + cache.tree.num_evictable_blocks == manager.num_blocks
    assert cache.tree.num_evictable_blocks == cache.tree.num_cached_blocks
    cache.clear()
    assert manager.num_free_blocks == manager.num_blocks


def test_shared_prefix_prefills_only_new_tokens_and_outputs_do_not_change(monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    off = LLM(DEFAULT_MODEL, device="cpu", block_size=4, prefix_caching=False)
    want = [o.token_ids for o in off.generate(PROMPTS, params)]
    assert off.prefix_cache_stats() is None
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, max_num_batched_tokens=48)
    seen = spy_prefill_lengths(monkeypatch)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    stats = llm.prefix_cache_stats()
    lengths = [len(llm.tokenizer.encode(p)) for p in PROMPTS]
    shared = len(llm.tokenizer.encode(SYSTEM)) // 4 * 4 - 4     # at least the whole blocks before the endings
    assert stats.cached_tokens >= shared * (len(PROMPTS) - 1), stats
    prefills = [n for step in seen for n in step]
    assert sum(prefills) == sum(lengths) - stats.cached_tokens    # only the new tokens went through the model
    # A second call reuses the first call's cache: every prompt is now a hit, the output the same again.
    seen.clear()
    again = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert again == want
    assert max(n for step in seen for n in step) <= 4             # the partial last block at most (+ 1 token)
    check_nothing_leaked(llm)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_eviction_and_preemption_with_a_small_cache(preemption):
    """A cache too small for all requests: cached prefixes are evicted, requests preempted, outputs unchanged."""
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    params[2] = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=fresh_seed(), ignore_eos=True)
    off = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=40, preemption=preemption, prefix_caching=False)
    want = [o.token_ids for o in off.generate(PROMPTS, params)]
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=40, preemption=preemption)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want, preemption
    sched = llm.last_core.scheduler
    assert sched.stats.preempted_by_recompute + sched.stats.preempted_by_swap > 0, sched.stats
    assert llm.prefix_cache_stats().evicted_blocks > 0 and llm.prefix_cache_stats().cached_tokens > 0
    assert sched.manager.num_free_cpu_blocks == sched.manager.num_cpu_blocks
    check_nothing_leaked(llm)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cached_prefixes_match_transformers(tmp_path, kind):
    """Random checkpoints (Mistral: every layer a window of 8, shorter than the cached prefix): prompts sharing
    a long prefix, greedy, equal to transformers' greedy."""
    pytest.importorskip("transformers")
    seed = fresh_seed()
    hf = save_random_model(kind, tmp_path, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prefix = [1] + torch.randint(3, 96, (21,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 96, (n,), generator=gen).tolist() for n in (1, 3, 6)] + [prefix[:9]]
    llm = LLM(tmp_path, device="cpu", block_size=4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = llm.generate(prompts[0], params)[0].token_ids          # caches the prefix
    rest = [o.token_ids for o in llm.generate(prompts[1:], params)]
    assert llm.prefix_cache_stats().cached_tokens == 20 + 20 + 8   # 5 whole blocks twice, then 2 blocks
    want = [hf_greedy(hf, ids, 10, []) for ids in prompts]
    assert [first] + rest == want, f"{kind} seed={seed}"


def test_prefix_caching_off_in_strict_mode_when_lesson05_is_unfinished(monkeypatch, capsys):
    monkeypatch.setenv("YAIE_SOLUTIONS", "1-4,6-8")            # lesson 05: the student's stub
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4 and llm.prefix_cache_stats() is None
    err = capsys.readouterr().err
    assert "lesson 05: RadixAttentionWithPagedKVCache is not implemented yet" in err and "prefix caching is off" in err


def test_unfinished_lesson05_in_auto_mode_uses_the_reference(monkeypatch, capsys):
    from yaie import ops
    monkeypatch.delenv("YAIE_SOLUTIONS")
    import solutions.kernels.kv_cache as lesson03
    manager = lesson03.KVCacheManager(8, 4, 1, 1, 2, dtype=torch.float32)
    cache = make_prefix_cache(manager)
    assert type(cache).__module__ == "solutions.kernels.radix_attention"
    assert "lesson 05: RadixAttentionWithPagedKVCache is not implemented yet" in capsys.readouterr().err
    ops.reset_auto_fallback()


def test_cli_flag_and_summary(capsys):
    from yaie import cli
    assert cli.main(["generate", "Once upon a time", "--max-tokens", "3", "--device", "cpu"]) == 0
    assert "prefix cache: 0 of" in capsys.readouterr().err
    assert cli.main(["generate", "Once upon a time", "--max-tokens", "3", "--device", "cpu",
                     "--no-prefix-caching"]) == 0
    assert "prefix caching off" in capsys.readouterr().err
