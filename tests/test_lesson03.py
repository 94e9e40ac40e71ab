"""Lesson 03 beyond its grader: deterministic property tests of the reference KV cache and memory pool.

The grader runs random programs with fresh randomness; here hypothesis is derandomized (the same
examples on every CI run) and runs more of them, with every operation at once, on the reference. Also
the paths the grader does not reach: a shared pool carved by two managers, the manager leaving its
arena untouched on bad input, and the arena as the only allocation.
"""

from __future__ import annotations

import pytest
import torch

from grader.lesson03.programs import ProgramRunner, run_programs
from solutions.kernels import kv_cache as ref

ALL_OPS = ("allocate", "append", "fork", "append", "free", "swap_out", "swap_in")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_random_programs_keep_every_invariant(dtype):
    pytest.importorskip("hypothesis")

    def body(pick):
        ProgramRunner(ref, pick, "cpu", dtype, ALL_OPS, with_data=True, max_steps=30).run()

    run_programs(body, seed=0, examples=60, derandomize=True)


def test_random_programs_without_hypothesis_fallback(monkeypatch):
    """The graders still run their programs when hypothesis is missing (Python's random instead)."""
    import builtins

    real_import = builtins.__import__

    def no_hypothesis(name, *args, **kwargs):
        if name == "hypothesis" or name.startswith("hypothesis."):
            raise ImportError("hypothesis hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hypothesis)
    calls = []

    def body(pick):
        calls.append(pick(0, 10))
        ProgramRunner(ref, pick, "cpu", torch.float16, ALL_OPS, with_data=True).run()

    run_programs(body, seed=123, examples=15, derandomize=False)
    assert len(calls) == 15


def test_pool_random_programs_coalesce_fully():
    pytest.importorskip("hypothesis")

    def body(pick):
        pool = ref.MemoryPool(pick(1, 32) * 128)
        live = []
        for _ in range(pick(1, 40)):
            if live and pick(0, 1):
                pool.free(live.pop(pick(0, len(live) - 1)))
            else:
                try:
                    live.append(pool.allocate(pick(1, 900), alignment=1 << pick(0, 8)))
                except ref.PoolExhausted:
                    pass
            ranges = pool.free_ranges
            assert all(a + sa < b for (a, sa), (b, _) in zip(ranges, ranges[1:]))
            assert pool.free_bytes + sum(size for _, size in pool.allocations.values()) == pool.capacity
        for handle in live:
            pool.free(handle)
        assert pool.free_ranges == [(0, pool.capacity)]

    run_programs(body, seed=0, examples=80, derandomize=True)


def test_two_managers_share_one_pool_without_overlap():
    pool = ref.MemoryPool(1 << 20)
    a = ref.KVCacheManager(8, 4, 2, 2, 16, torch.float16, pool=pool)
    b = ref.KVCacheManager(8, 4, 2, 2, 16, torch.float16, pool=pool)
    for t in a.k_cache + a.v_cache:
        t.fill_(1)
    for t in b.k_cache + b.v_cache:
        t.fill_(2)
    assert all(bool((t == 1).all()) for t in a.k_cache + a.v_cache)
    assert pool.used_bytes >= 2 * 2 * 2 * 8 * 4 * 2 * 16 * 2


def test_bad_input_leaves_the_cache_untouched():
    m = ref.KVCacheManager(4, 4, 1, 1, 8, torch.float32)
    slots = m.allocate("s", 16)                               # every block
    k = torch.randn(16, 1, 8)
    m.write_kv(0, slots, k, k)
    before = m.k_cache[0].clone()
    bad = slots.clone()
    bad[-1] = 99                                              # one slot out of range: nothing written
    with pytest.raises(ValueError):
        m.write_kv(0, bad, k * 2, k * 2)
    assert torch.equal(m.k_cache[0], before)
    with pytest.raises(ValueError):
        m.copy_blocks([(0, 1), (2, 1)])                       # a destination twice
    assert torch.equal(m.k_cache[0], before)
    with pytest.raises(ref.OutOfBlocks):
        m.append_slots("s", 1)
    assert m.num_tokens("s") == 16 and m.num_free_blocks == 0


def test_cuda_device_is_resolved_to_an_index():
    assert ref.resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        assert ref.resolve_device("cuda").index is not None


class _SmallPages:
    """The reference lesson with 3-block pages, so that random programs cross page boundaries."""

    def __getattr__(self, name):
        return getattr(ref, name)

    class KVCacheManager(ref.KVCacheManager):
        def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype=torch.float16, **kw):
            block_bytes = block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
            super().__init__(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype=dtype,
                             page_bytes=3 * block_bytes, **kw)
            assert self._free.blocks_per_page == 3


def test_random_programs_keep_every_invariant_with_small_pages():
    """The same invariants when the page-local free list has to move sequences between pages."""
    pytest.importorskip("hypothesis")

    def body(pick):
        ProgramRunner(_SmallPages(), pick, "cpu", torch.float32, ALL_OPS, with_data=True, max_steps=30).run()

    run_programs(body, seed=1, examples=60, derandomize=True)


def test_free_blocks_hands_out_near_blocks_then_the_emptiest_page():
    free = ref.FreeBlocks(10, 4)                       # pages {0-3}, {4-7}, {8, 9}
    assert len(free) == 10
    first = free.pop()                                 # a fresh cache: the first full page, lowest id first
    assert first == 0
    assert free.pop() == 4                             # no hint: the emptiest page (page 1 has 4 free)
    assert [free.pop(near=0) for _ in range(3)] == [1, 2, 3]
    assert free.pop(near=3) == 5                       # page 0 is full: the emptiest page is page 1 (3 free)
    free.append(2)
    assert free.pop(near=1) == 2                       # a freed block goes back to its page
    taken = [free.pop() for _ in range(len(free))]
    assert sorted(taken) == [6, 7, 8, 9] and len(free) == 0
    with pytest.raises(IndexError):
        free.pop()


def test_growing_sequences_stay_on_their_own_pages():
    """Eight sequences that grow one block at a time in turn (decode), in a cache of 4-block pages: each
    keeps to its own pages. (A stack of free ids would interleave them, block by block.)"""
    per_page = 4
    block_bytes = 4 * 1 * 8 * 4
    m = ref.KVCacheManager(64, 4, 1, 1, 8, dtype=torch.float32, page_bytes=per_page * block_bytes)
    for s in range(8):
        m.allocate(s, 4)                                 # one full block each
    for _ in range(7):                                   # then 7 more blocks each, one block in turn
        for s in range(8):
            m.append_slots(s, 4)
    for s in range(8):
        pages = [b // per_page for b in m.block_ids(s)]
        moves = sum(a != b for a, b in zip(pages, pages[1:]))
        # 8 blocks on 2 pages, and the sequence moves to its second page once, when its first is full.
        assert len(pages) == 8 and len(set(pages)) == 2 and moves == 1, (s, m.block_ids(s))
    for s in range(8):
        m.free(s)
    assert m.num_free_blocks == 64


def test_blocks_owned_outside_the_sequences():
    """add_references / drop_references / adopt: the given calls lesson 05's prefix tree owns blocks with."""
    m = ref.KVCacheManager(6, 4, 1, 1, 8, torch.float32)
    m.allocate("a", 8)                                   # two blocks
    blocks = m.block_ids("a")
    m.add_references(blocks)                             # a second owner (the tree)
    m.adopt("b", blocks, 8)                              # a third: a sequence that starts on them
    assert [m.blocks[b].ref_count for b in blocks] == [3, 3] and m.num_tokens("b") == 8
    assert m.append_slots("b", 1).numel() == 1 and len(m.block_ids("b")) == 3 and m.num_free_blocks == 3
    with pytest.raises(ValueError, match="already allocated"):
        m.adopt("b", blocks, 8)
    with pytest.raises(ValueError, match="do not fill"):
        m.adopt("c", blocks, 4)
    free_block = next(i for i, blk in enumerate(m.blocks) if blk.ref_count == 0)
    with pytest.raises(ValueError, match="is free"):
        m.adopt("c", [blocks[0], free_block], 8)
    assert m.blocks[blocks[0]].ref_count == 3 and not m.has_seq("c")      # nothing changed on the error
    m.free("a"), m.free("b")
    m.drop_references(blocks)
    assert m.num_free_blocks == 6
