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
