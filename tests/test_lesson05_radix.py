"""Lesson 05, part 1, beyond its grader: the grader's checks catch the mistakes students make.

Each test breaks the reference in one typical way (an eviction that ignores locks, a split that drops
the lock count, LRU by insertion time only, a glue that forgets the tree's reference) and runs the
grader's own check functions on it: they must fail with a teaching message (``GradingError``), not pass
and not crash. The property programs run derandomized here (the same programs on every CI run).
"""

from __future__ import annotations

import pytest

import solutions.kernels.radix_attention as ref
from grader.checks import GradingError
from grader.lesson05 import test_radix_tree as grader

pytestmark = pytest.mark.usefixtures("reference_lessons")


@pytest.fixture(autouse=True)
def derandomized(monkeypatch):
    monkeypatch.setenv("YAIE_HYPOTHESIS_DERANDOMIZE", "1")


def evict_ignoring_locks(self, num_blocks):
    """Evict leaves whatever their locks say."""
    freed = []
    while len(freed) < num_blocks:
        leaves = [n for n in self.nodes() if not n.children]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: n.last_access)
        for b in reversed(leaf.blocks):
            freed.append(b)
            del self._owner[b]
        del leaf.parent.children[tuple(leaf.tokens[:self.block_size])]
        leaf.parent = None
    return freed


def test_reference_passes_the_grader_checks():
    grader.test_random_programs_on_the_tree("cpu", seed=1)
    grader.test_random_programs_share_blocks_correctly("cpu", seed=2)


def test_eviction_that_ignores_locks_is_caught(monkeypatch):
    monkeypatch.setattr(ref.RadixAttentionBlock, "evict", evict_ignoring_locks)
    with pytest.raises(GradingError, match="lock"):
        grader.test_locks_protect_prefixes()


def test_split_that_drops_the_lock_count_is_caught(monkeypatch):
    real = ref.RadixAttentionBlock._split

    def split(self, node, num_blocks):
        upper = real(self, node, num_blocks)
        upper.lock_count = 0
        return upper

    monkeypatch.setattr(ref.RadixAttentionBlock, "_split", split)
    with pytest.raises(GradingError, match="inherits the lock count"):
        grader.test_diverging_sequence_splits_the_edge()


def test_lru_by_insertion_only_is_caught(monkeypatch):
    real = ref.RadixAttentionBlock.match_prefix

    def match_without_touching(self, tokens):
        times = {id(n): n.last_access for n in self.nodes()}
        found = real(self, tokens)
        for n in self.nodes():
            n.last_access = times.get(id(n), n.last_access)
        return found

    monkeypatch.setattr(ref.RadixAttentionBlock, "match_prefix", match_without_touching)
    with pytest.raises(GradingError, match="evict"):
        grader.test_evicts_least_recently_used_leaves_first()


def test_glue_that_forgets_the_trees_reference_is_caught(monkeypatch):
    from solutions.kernels.kv_cache import KVCacheManager      # the tree's own references go through it
    monkeypatch.setattr(KVCacheManager, "add_references", lambda self, blocks: None)
    with pytest.raises(GradingError, match="ref_count"):
        grader.test_second_request_reuses_the_cached_prompt("cpu")


def test_glue_that_reuses_the_last_token_is_caught(monkeypatch):
    def match(self, tokens):
        return self.tree.match_prefix(list(tokens)).num_tokens

    monkeypatch.setattr(ref.RadixAttentionWithPagedKVCache, "match", match)
    with pytest.raises(GradingError, match="last token"):
        grader.test_second_request_reuses_the_cached_prompt("cpu")


def test_match_is_a_question_that_changes_nothing():
    """The scheduler asks match() every step for a waiting request: no split, no LRU refresh."""
    manager, cache = grader.make_cache("cpu", num_blocks=16, block_size=4)
    tokens = list(range(1, 17))                               # 4 blocks, one edge in the tree
    cache.allocate("a", tokens)
    cache.free("a", tokens)
    before = [(tuple(n.tokens), n.last_access, n.lock_count) for n in cache.tree.nodes()]
    assert cache.match(tokens[:9] + [99, 98]) == 8            # ends inside the 4-block edge
    after = [(tuple(n.tokens), n.last_access, n.lock_count) for n in cache.tree.nodes()]
    assert after == before


def test_prefill_attention_with_bad_input_writes_nothing():
    import torch
    manager, cache = grader.make_cache("cpu", num_blocks=16, block_size=4, dtype=torch.float32,
                                       num_kv_heads=2, head_dim=16)
    cache.allocate("a", list(range(1, 11)))
    for t in (manager.k_cache[0], manager.v_cache[0]):
        t.fill_(7.0)
    q = torch.randn(10, 4, 8)                                 # head_dim 8, the cache holds 16
    k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    with pytest.raises(ValueError):
        cache.prefill_attention(0, ["a"], [10], q, k, v)
    assert bool((manager.k_cache[0] == 7.0).all()) and bool((manager.v_cache[0] == 7.0).all())
