"""Grader of lesson 03: the memory pool, the paged KV-cache manager, fork with copy-on-write, swapping.

Two kinds of checks:

* hand-written cases with exact expectations (slot numbers, block counts, bytes), and
* random programs of operations (``grader/lesson03/programs.py``) checked after every step against
  an independent model of what each sequence must hold: block invariants, bit-exact data, nothing
  leaked, and ``OutOfBlocks`` changing nothing. Each test runs its fixed cases first (programs written
  down to reach a state random ones rarely reach: a sequence swapped back in to device blocks whose ids
  are not its host blocks' ids, say), then fresh programs from ``hypothesis``, which shrinks a failing
  program to a short one (``grader/programs.py``).

Everything here is bookkeeping and copies, so the same checks run on the CPU and on a GPU (bf16 too).
"""

from __future__ import annotations

import pytest
import torch

from grader.checks import GradingError, expect_value_error, randn, task
from grader.lesson03.programs import ProgramRunner, run_programs, snapshot
from yaie.switch import LessonProxy

L = LessonProxy(3)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]


def make_manager(device, dtype=torch.float16, num_blocks=16, block_size=4, num_layers=2, num_kv_heads=2,
                 head_dim=8, num_cpu_blocks=8):
    return L.KVCacheManager(num_blocks=num_blocks, block_size=block_size, num_layers=num_layers,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                            num_cpu_blocks=num_cpu_blocks)


def expect(condition: bool, what: str, expected, got, hint: str = "") -> None:
    if not condition:
        raise GradingError(f"{what}\n  expected: {expected}\n  got:      {got}" + (f"\n  hint:     {hint}" if hint else ""))


def examples(device: str, cpu: int, gpu: int) -> int:
    return gpu if device == "cuda" else cpu


# ================================================================ task 1: the memory pool

def check_pool_ranges(pool) -> None:
    """Free ranges sorted, not touching, not overlapping any allocation; everything adds up."""
    ranges = list(pool.free_ranges)
    for (a, sa), (b, _) in zip(ranges, ranges[1:]):
        expect(a + sa < b, "free ranges must be sorted and never touch (touching ranges must be merged)",
               "start + size < next start", ranges, "after a free, merge with the free range on each side")
    taken = sorted(pool.allocations.values())
    spans = sorted(ranges + taken)
    position = 0
    for start, size in spans:
        expect(start == position and size > 0, "free ranges and allocations must tile the arena exactly",
               f"a range starting at {position}", f"{(start, size)} in {spans}")
        position = start + size
    expect(position == pool.capacity, "free ranges and allocations must cover the arena", pool.capacity, position)


@task(1, "MemoryPool")
def test_pool_allocations_are_aligned_disjoint_and_usable(device, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = L.MemoryPool(1 << 16, device)
    expect(pool.arena.numel() == 1 << 16 and pool.arena.dtype == torch.uint8, "the arena is one uint8 tensor",
           f"{1 << 16} uint8", f"{pool.arena.numel()} {pool.arena.dtype}")
    handles = []
    for i in range(12):
        size = int(torch.randint(1, 3000, (1,), generator=gen))
        alignment = [1, 16, 256, 512][i % 4]
        handle = pool.allocate(size, alignment=alignment)
        expect(handle % alignment == 0, f"allocate({size}, alignment={alignment}) must return an aligned offset",
               f"a multiple of {alignment}", handle)
        handles.append((handle, size))
        check_pool_ranges(pool)
    spans = sorted(handles)
    for (a, sa), (b, _) in zip(spans, spans[1:]):
        expect(a + sa <= b, "allocations must not overlap", f"{(a, sa)} ends before {b}", "overlap")
    # Every allocation is usable through view() and shares the arena: fill each with its own number.
    for i, (handle, size) in enumerate(handles):
        pool.view(handle, (size,), torch.uint8).fill_(i + 1)
    for i, (handle, size) in enumerate(handles):
        got = pool.arena[handle:handle + size]
        expect(bool((got == i + 1).all()), f"allocation {i} lost its bytes (views overlap, or view copies)",
               f"all {i + 1}", got[:8].tolist())
    # view() reinterprets the bytes without copying: a float32 view starts at the allocation's address.
    handle = pool.allocate(64, alignment=256)
    floats = pool.view(handle, (4, 4), torch.float32)
    expect(floats.data_ptr() == pool.arena.data_ptr() + handle and floats.dtype == torch.float32,
           "view must return a tensor into the arena at the handle's offset (no copy)",
           f"address arena + {handle}", f"address arena + {floats.data_ptr() - pool.arena.data_ptr()}")


@task(1, "MemoryPool")
def test_pool_free_coalesces_neighbours(device):
    pool = L.MemoryPool(4096, device)
    a, b, c = (pool.allocate(1000, alignment=8) for _ in range(3))
    pool.free(a)
    pool.free(c)
    check_pool_ranges(pool)
    pool.free(b)   # b sits between two free ranges: all three must merge into one
    expect(list(pool.free_ranges) == [(0, 4096)], "freeing everything must leave one free range",
           [(0, 4096)], list(pool.free_ranges), "merge the freed range with the free ranges before AND after it")
    big = pool.allocate(4096, alignment=1)
    expect(big == 0, "after coalescing the whole arena fits one allocation", 0, big)


@task(1, "MemoryPool")
def test_pool_exhausted_changes_nothing(device):
    pool = L.MemoryPool(2048, device)
    pool.allocate(1500)
    before = (list(pool.free_ranges), dict(pool.allocations))
    with pytest.raises(L.PoolExhausted):
        pool.allocate(1000)
    expect((list(pool.free_ranges), dict(pool.allocations)) == before, "a failed allocate must change nothing",
           before, (pool.free_ranges, pool.allocations))


@task(1, "MemoryPool")
def test_pool_bad_input(device):
    pool = L.MemoryPool(1024, device)
    expect_value_error(pool.allocate, 0, what="size 0")
    expect_value_error(pool.allocate, 16, alignment=3, what="alignment that is not a power of two")
    handle = pool.allocate(64)
    expect_value_error(pool.view, handle, (100,), torch.float32, what="a view larger than the allocation")
    pool.free(handle)
    expect_value_error(pool.free, handle, what="double free")
    expect_value_error(pool.free, 12345, what="a handle that was never allocated")
    expect_value_error(L.MemoryPool, 0, device, what="capacity 0")


@task(1, "MemoryPool")
def test_default_pool_functions(device):
    L.init_memory_pool(8192, device)
    handles = [L.memory_pool_allocate(1000) for _ in range(4)]
    expect(len(set(handles)) == 4, "memory_pool_allocate returns distinct handles", "4 distinct", handles)
    for h in handles:
        L.memory_pool_free(h)
    expect_value_error(L.memory_pool_free, handles[0], what="double free through memory_pool_free")


@task(1, "MemoryPool")
def test_pool_random_programs(device, seed):
    L.MemoryPool(1024, device)   # fails fast on an unfinished pool

    def body(pick):
        pool = L.MemoryPool(pick(1, 64) * 64, device)
        live = []
        for _ in range(pick(1, 30)):
            if live and pick(0, 2) == 0:
                pool.free(live.pop(pick(0, len(live) - 1)))
            else:
                size, alignment = pick(1, 700), 1 << pick(0, 9)
                before = (list(pool.free_ranges), dict(pool.allocations))
                try:
                    live.append(pool.allocate(size, alignment=alignment))
                except L.PoolExhausted:
                    expect((list(pool.free_ranges), dict(pool.allocations)) == before,
                           "PoolExhausted must change nothing", before, (pool.free_ranges, pool.allocations))
            check_pool_ranges(pool)
        for handle in live:
            pool.free(handle)
        expect(list(pool.free_ranges) == [(0, pool.capacity)], "nothing may leak once everything is freed",
               [(0, pool.capacity)], list(pool.free_ranges))

    # allocate 100, 60 (aligned 16), free the first, 90 into the hole, 200 (aligned 256) that does not fit
    run_programs(body, seed, examples(device, 60, 30), fixed=[[4, 5, 100, 0, 1, 60, 4, 0, 0, 1, 90, 0, 1, 200, 8]])


# ================================================================ task 2: block bookkeeping

@task(2, "KVCacheManager bookkeeping")
def test_cache_layout_comes_from_the_pool(device):
    m = make_manager(device, torch.bfloat16, num_blocks=6, block_size=8, num_layers=3, num_kv_heads=2, head_dim=16)
    m.allocate("warm-up", 1)   # the bookkeeping task must be started for this check to count
    for name, caches in (("k_cache", m.k_cache), ("v_cache", m.v_cache)):
        expect(len(caches) == 3, f"{name} holds one tensor per layer", 3, len(caches))
        for t in caches:
            expect(tuple(t.shape) == (6, 8, 2, 16) and t.dtype == torch.bfloat16 and t.is_contiguous(),
                   f"{name}[layer] is [num_blocks, block_size, num_kv_heads, head_dim], contiguous",
                   "(6, 8, 2, 16) bfloat16", f"{tuple(t.shape)} {t.dtype}")
            start = m.pool.arena.data_ptr()
            expect(start <= t.data_ptr() < start + m.pool.capacity, f"{name} must be a view into the pool's arena",
                   "an address inside the arena", "memory elsewhere")


@task(2, "KVCacheManager bookkeeping")
def test_allocate_append_free(device):
    m = make_manager(device, num_blocks=10, block_size=4)
    slots = m.allocate("a", 6)
    ids = m.block_ids("a")
    expect(len(ids) == 2, "6 tokens in blocks of 4 need 2 blocks", 2, ids)
    expected = [ids[t // 4] * 4 + t % 4 for t in range(6)]
    expect(slots.tolist() == expected and slots.device.type == torch.device(device).type,
           "allocate returns the slot of every token", expected, slots.tolist(),
           "slot = block_id * block_size + offset")
    expect(m.num_free_blocks == 8, "num_free_blocks after taking 2 of 10", 8, m.num_free_blocks)
    new = m.append_slots("a", 1)
    expect(new.tolist() == [ids[1] * 4 + 2] and len(m.block_ids("a")) == 2,
           "appending a 7th token fills the last block's free slot", [ids[1] * 4 + 2], new.tolist())
    new = m.append_slots("a", 3)
    expect(len(m.block_ids("a")) == 3 and m.num_tokens("a") == 10, "tokens 8-10 need a third block",
           "3 blocks, 10 tokens", f"{len(m.block_ids('a'))} blocks, {m.num_tokens('a')} tokens")
    expect(new.tolist()[0] == ids[1] * 4 + 3, "the 8th token goes in the last slot of block 2", ids[1] * 4 + 3,
           new.tolist()[0])
    m.allocate("b", 0)
    expect(m.block_ids("b") == [] and m.num_tokens("b") == 0, "allocate(seq, 0) takes no block", [], m.block_ids("b"))
    m.append_slot("b")
    expect(len(m.block_ids("b")) == 1, "the first appended token takes a block", 1, len(m.block_ids("b")))
    m.free("a")
    m.free("b")
    expect(m.num_free_blocks == 10, "free returns every block", 10, m.num_free_blocks)
    m.allocate("a", 40)   # the id can be reused, and the whole cache is usable again
    expect(m.num_free_blocks == 0, "40 tokens fill all 10 blocks", 0, m.num_free_blocks)


@task(2, "KVCacheManager bookkeeping")
def test_block_table_and_context_lens(device):
    m = make_manager(device, num_blocks=12, block_size=4)
    m.allocate(7, 9)
    m.allocate(3, 2)
    table = m.block_table([3, 7])
    lens = m.context_lens([3, 7])
    expect(table.dtype == torch.int32 and tuple(table.shape) == (2, 3) and table.device.type == torch.device(device).type,
           "block_table is int32 [batch, longest table] on the cache's device", "int32 (2, 3)",
           f"{table.dtype} {tuple(table.shape)} on {table.device}")
    expect(table[0, :1].tolist() == m.block_ids(3) and table[1].tolist() == m.block_ids(7),
           "row i holds seq_ids[i]'s blocks in logical order", [m.block_ids(3), m.block_ids(7)], table.tolist())
    expect(lens.dtype == torch.int32 and lens.tolist() == [2, 9], "context_lens is int32 [batch]", [2, 9],
           f"{lens.tolist()} {lens.dtype}")


@task(2, "KVCacheManager bookkeeping")
def test_out_of_blocks_changes_nothing(device):
    m = make_manager(device, num_blocks=4, block_size=4)
    m.allocate("a", 10)
    before = snapshot(m)
    with pytest.raises(L.OutOfBlocks):
        m.allocate("b", 9)        # needs 3 blocks, 1 free: all or nothing
    expect(snapshot(m) == before and not m.has_seq("b"), "a failed allocate must change nothing", before, snapshot(m))
    expect(m.can_allocate(4) and not m.can_allocate(5), "can_allocate(4) True, can_allocate(5) False", (True, False),
           (m.can_allocate(4), m.can_allocate(5)))
    with pytest.raises(L.OutOfBlocks):
        m.append_slots("a", 7)    # 17 tokens need 5 blocks
    expect(snapshot(m) == before, "a failed append_slots must change nothing", before, snapshot(m))
    assert issubclass(L.OutOfBlocks, RuntimeError)


@task(2, "KVCacheManager bookkeeping")
def test_bookkeeping_bad_input(device):
    m = make_manager(device)
    m.allocate("a", 3)
    expect_value_error(m.allocate, "a", 2, what="allocating an id that is in use")
    expect_value_error(m.allocate, "b", -1, what="a negative token count")
    expect_value_error(m.append_slots, "zzz", 1, what="an unknown sequence")
    expect_value_error(m.append_slots, "a", 0, what="appending 0 tokens")
    expect_value_error(m.block_table, ["a", "zzz"], what="block_table of an unknown sequence")
    expect_value_error(m.context_lens, [], what="context_lens of no sequence")
    m.free("a")
    expect_value_error(m.free, "a", what="double free")
    expect_value_error(L.KVCacheManager, 4, 4, 1, 1, 8, torch.int32, device, what="an integer cache dtype")


@task(2, "KVCacheManager bookkeeping")
def test_bookkeeping_random_programs(device, seed):
    make_manager(device)   # fails fast on unfinished code

    def body(pick):
        ProgramRunner(L, pick, device, torch.float16, ("allocate", "append", "append", "free"),
                      with_data=False).run()

    # block_size 4, 3 blocks: allocate 9, append 3 (fills the cache), allocate 1 (no room), free, allocate 12
    run_programs(body, seed, examples(device, 40, 15), fixed=[[1, 3, 5, 0, 9, 1, 0, 3, 0, 1, 3, 0, 0, 12]])


# ================================================================ task 3: data, block copies, fork

def rows_of(m, seq_id, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows of every token of a sequence, gathered through its block table ([tokens, H, D])."""
    ids = torch.tensor(m.block_ids(seq_id), dtype=torch.long, device=m.k_cache[layer].device)
    t = torch.arange(m.num_tokens(seq_id), device=ids.device)
    return m.k_cache[layer][ids[t // m.block_size], t % m.block_size], m.v_cache[layer][ids[t // m.block_size], t % m.block_size]


@task(3, "write_kv, copy_blocks, fork")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_write_kv_stores_rows_at_their_slots(device, seed, dtype):
    m = make_manager(device, dtype, num_blocks=10, block_size=4, num_kv_heads=3, head_dim=8)
    slots = m.allocate("a", 7)
    k, v = (randn(7, 3, 8, dtype=dtype, device=device, seed=seed + i) for i in range(2))
    m.write_kv(1, slots, k, v)
    got_k, got_v = rows_of(m, "a", 1)
    expect(torch.equal(got_k, k) and torch.equal(got_v, v), "write_kv must store token t's K/V at its slot",
           "the rows written", "different rows", "view the layer as [num_blocks * block_size, H, D]: a slot is a row")
    more = m.append_slots("a", 2)
    k2, v2 = (randn(2, 3, 8, dtype=dtype, device=device, seed=seed + 5 + i) for i in range(2))
    m.write_kv(1, more, k2, v2, validate=False)   # the engine's call: no range check, same rows
    got_k, _ = rows_of(m, "a", 1)
    expect(torch.equal(got_k, torch.cat([k, k2])), "appended tokens land after the earlier ones", "9 rows", "mismatch",
           "write_kv(..., validate=False) must store exactly what validate=True stores; it only skips the range check")


@task(3, "write_kv, copy_blocks, fork")
def test_copy_blocks_copies_every_layer(device, seed):
    m = make_manager(device, torch.float32, num_blocks=6, block_size=4, num_layers=3)
    for layer in range(3):
        m.k_cache[layer].copy_(randn(*m.k_cache[layer].shape, device=device, seed=seed + layer))
        m.v_cache[layer].copy_(randn(*m.v_cache[layer].shape, device=device, seed=seed + 10 + layer))
    before = [(k.clone(), v.clone()) for k, v in zip(m.k_cache, m.v_cache)]
    m.copy_blocks([(0, 3), (2, 5)])
    for layer, (k, v) in enumerate(before):
        for src, dst in ((0, 3), (2, 5)):
            expect(torch.equal(m.k_cache[layer][dst], k[src]) and torch.equal(m.v_cache[layer][dst], v[src]),
                   f"copy_blocks must copy block {src} to {dst} in layer {layer}, K and V", "equal", "different")
        for untouched in (0, 1, 2, 4):
            expect(torch.equal(m.k_cache[layer][untouched], k[untouched]), f"block {untouched} must not change",
                   "unchanged", "changed")
    expect_value_error(m.copy_blocks, [(0, 99)], what="a block id out of range")


@task(3, "write_kv, copy_blocks, fork")
def test_fork_shares_blocks_and_copies_on_write(device, seed):
    m = make_manager(device, torch.float16, num_blocks=10, block_size=4, num_layers=2)
    slots = m.allocate("parent", 6)          # blocks: [full, half full]
    k, v = (randn(6, 2, 8, dtype=torch.float16, device=device, seed=seed + i) for i in range(2))
    for layer in range(2):
        m.write_kv(layer, slots, k, v)
    m.fork("parent", "child")
    expect(m.block_ids("child") == m.block_ids("parent"), "fork shares the parent's blocks", m.block_ids("parent"),
           m.block_ids("child"))
    expect([m.blocks[b].ref_count for b in m.block_ids("parent")] == [2, 2], "shared blocks have ref_count 2",
           [2, 2], [m.blocks[b].ref_count for b in m.block_ids("parent")])
    free_before = m.num_free_blocks
    slot = m.append_slots("child", 1)
    parent_ids, child_ids = m.block_ids("parent"), m.block_ids("child")
    expect(child_ids[0] == parent_ids[0] and child_ids[1] != parent_ids[1],
           "appending into a shared, partly filled block must copy it first (copy-on-write)",
           "first block still shared, second one new", f"parent {parent_ids}, child {child_ids}")
    expect(m.num_free_blocks == free_before - 1 and m.blocks[parent_ids[1]].ref_count == 1,
           "the copy takes one block; the original goes back to one owner", "1 block taken, ref_count 1",
           f"{free_before - m.num_free_blocks} taken, ref_count {m.blocks[parent_ids[1]].ref_count}")
    new_k = randn(1, 2, 8, dtype=torch.float16, device=device, seed=seed + 7)
    m.write_kv(0, slot, new_k, new_k)
    child_k, _ = rows_of(m, "child", 0)
    parent_k, _ = rows_of(m, "parent", 0)
    expect(torch.equal(child_k, torch.cat([k, new_k])), "the child keeps the shared tokens and adds its own",
           "parent's 6 rows + the new row", "different rows", "copy the shared block with copy_blocks before writing")
    expect(torch.equal(parent_k, k), "the parent's tokens must not change when the child writes",
           "unchanged", "changed")
    m.free("parent")
    m.free("child")
    expect(m.num_free_blocks == 10, "nothing leaks once both are freed", 10, m.num_free_blocks)


@task(3, "write_kv, copy_blocks, fork")
def test_write_kv_and_fork_bad_input(device):
    m = make_manager(device, torch.float16, num_kv_heads=2, head_dim=8)
    slots = m.allocate("a", 3)
    good = torch.zeros(3, 2, 8, dtype=torch.float16, device=device) + 1
    expect_value_error(m.write_kv, 5, slots, good, good, what="a layer out of range")
    expect_value_error(m.write_kv, 0, slots, good.float(), good.float(), what="k/v of the wrong dtype")
    expect_value_error(m.write_kv, 0, slots, good[:, :1], good[:, :1], what="k/v with the wrong number of heads")
    expect_value_error(m.write_kv, 0, slots[:2], good, good, what="more rows than slots")
    expect_value_error(m.write_kv, 0, slots + 10_000, good, good, what="slots out of range")
    expect_value_error(m.fork, "zzz", "b", what="forking an unknown sequence")
    expect_value_error(m.fork, "a", "a", what="forking into an id that is in use")


@task(3, "write_kv, copy_blocks, fork")
def test_data_random_programs_with_fork(device, seed):
    make_manager(device)

    def body(pick):
        ProgramRunner(L, pick, device, torch.float16, ("allocate", "append", "fork", "append", "fork", "free"),
                      with_data=True).run()

    # block_size 4: allocate 6, fork, the child appends into the shared half-full block, free the parent, append
    run_programs(body, seed, examples(device, 60, 15), fixed=[[1, 6, 5, 0, 6, 1, 2, 0, 1, 1, 1, 2, 5, 0, 1, 0, 3, 3]])


# ================================================================ task 4: swapping

@task(4, "swapping")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swap_blocks_round_trip_is_bit_identical(device, seed, dtype):
    m = make_manager(device, dtype, num_blocks=8, block_size=4, num_cpu_blocks=5)
    for layer in range(m.num_layers):
        m.k_cache[layer].copy_(randn(*m.k_cache[layer].shape, dtype=dtype, device=device, seed=seed + layer))
        m.v_cache[layer].copy_(randn(*m.v_cache[layer].shape, dtype=dtype, device=device, seed=seed + 9 + layer))
    original = [(m.k_cache[i][[1, 4, 6]].clone(), m.v_cache[i][[1, 4, 6]].clone()) for i in range(m.num_layers)]
    cpu_ids = m.swap_blocks_to_cpu([1, 4, 6])
    expect(len(cpu_ids) == 3 and len(set(cpu_ids)) == 3 and m.num_free_cpu_blocks == 2,
           "swap_blocks_to_cpu takes one host block per block", "3 distinct ids, 2 host blocks left",
           f"{cpu_ids}, {m.num_free_cpu_blocks} left")
    for layer in range(m.num_layers):
        m.k_cache[layer][[1, 4, 6]] = 0   # the device copies may be overwritten now
        expect(m.cpu_k_cache[layer].device.type == "cpu", "host blocks live in CPU memory", "cpu",
               m.cpu_k_cache[layer].device)
        if device == "cuda":
            expect(m.cpu_k_cache[layer].is_pinned(), "with CUDA the host cache is pinned (page-locked) memory",
                   "pinned", "pageable", "torch.empty(..., pin_memory=True)")
    back = m.swap_blocks_from_cpu(cpu_ids)
    expect(m.num_free_cpu_blocks == 5, "swap_blocks_from_cpu frees the host blocks", 5, m.num_free_cpu_blocks)
    for layer, (k, v) in enumerate(original):
        got_k, got_v = m.k_cache[layer][back], m.v_cache[layer][back]
        expect(torch.equal(got_k.view(torch.uint8), k.view(torch.uint8))
               and torch.equal(got_v.view(torch.uint8), v.view(torch.uint8)),
               f"the round trip must be bit identical (layer {layer}, {dtype})", "the same bits", "different bits")


@task(4, "swapping")
def test_swap_out_and_in_a_sequence(device, seed):
    m = make_manager(device, torch.bfloat16, num_blocks=6, block_size=4, num_cpu_blocks=6)
    slots = m.allocate("a", 10)
    k, v = (randn(10, 2, 8, dtype=torch.bfloat16, device=device, seed=seed + i) for i in range(2))
    for layer in range(2):
        m.write_kv(layer, slots, k, v)
    m.swap_out("a")
    expect(m.is_swapped("a") and m.num_free_blocks == 6 and m.num_free_cpu_blocks == 3,
           "swap_out moves the blocks to the host", "swapped, 6 device and 3 host blocks free",
           f"{m.is_swapped('a')}, {m.num_free_blocks}, {m.num_free_cpu_blocks}")
    expect_value_error(m.block_table, ["a"], what="block_table of a swapped-out sequence")
    m.allocate("filler", 16)          # 4 of 6 device blocks: 'a' needs 3, only 2 are free
    before = snapshot(m)
    with pytest.raises(L.OutOfBlocks):
        m.swap_in("a")
    expect(snapshot(m) == before and m.is_swapped("a"), "a failed swap_in must change nothing (still swapped out)",
           before, snapshot(m))
    m.free("filler")
    m.swap_in("a")
    expect(not m.is_swapped("a") and m.num_tokens("a") == 10, "swap_in brings the sequence back",
           "resident, 10 tokens", f"swapped={m.is_swapped('a')}, {m.num_tokens('a')} tokens")
    for layer in range(2):
        got_k, got_v = rows_of(m, "a", layer)
        expect(torch.equal(got_k, k) and torch.equal(got_v, v), "data comes back bit identical after a swap",
               "equal", "different")
    m.free("a")
    expect(m.num_free_blocks == 6 and m.num_free_cpu_blocks == 6, "nothing leaks", (6, 6),
           (m.num_free_blocks, m.num_free_cpu_blocks))


@task(4, "swapping")
def test_swap_in_reads_the_host_blocks_not_the_device_ids(device, seed):
    """Host and device ids that differ: 4 device blocks, 8 host blocks, two full sequences swapped out.

    The two sequences take all 8 host blocks, so at most one of them can have host ids equal to the
    device ids it comes back to: a swap-in that reads host block ``device_id`` instead of the host block
    the sequence was copied to gives at least one of them the other's data (or stale rows).
    """
    m = make_manager(device, torch.float16, num_blocks=4, block_size=4, num_cpu_blocks=8)
    data = {}
    for name in ("x", "y"):
        slots = m.allocate(name, 16)
        k, v = (randn(16, 2, 8, dtype=torch.float16, device=device, seed=seed + 10 * len(data) + i) for i in range(2))
        for layer in range(2):
            m.write_kv(layer, slots, k, v)
        data[name] = (k, v)
        m.swap_out(name)
    for layer in range(2):                     # the device blocks may hold anything now
        m.k_cache[layer].fill_(float("nan"))
        m.v_cache[layer].fill_(float("nan"))
    for name in ("y", "x"):
        m.swap_in(name)
        k, v = data[name]
        for layer in range(2):
            got_k, got_v = rows_of(m, name, layer)
            if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
                bad = int((got_k != k).flatten(1).any(1).float().argmax()) if not torch.equal(got_k, k) else 0
                raise GradingError(
                    f"sequence {name!r} does not come back bit identical after swap_in (layer {layer})\n"
                    f"  case:     4 device blocks, 8 host blocks; 'x' and 'y' (16 tokens each, block_size 4) swapped "
                    f"out in turn, then swapped in, 'y' first; device blocks now {m.block_ids(name)}\n"
                    f"  expected: the rows written before swap_out\n"
                    f"  got:      different rows from token {bad} on\n"
                    "  hint:     copy host block cpu_ids[i] into the new device block ids[i]: a device id is not a "
                    "host id (the two pools hand out ids independently)")
        m.free(name)
    expect(m.num_free_blocks == 4 and m.num_free_cpu_blocks == 8, "nothing leaks", (4, 8),
           (m.num_free_blocks, m.num_free_cpu_blocks))


@task(4, "swapping")
def test_swap_out_of_host_blocks_changes_nothing(device):
    m = make_manager(device, num_blocks=8, block_size=4, num_cpu_blocks=2)
    m.allocate("a", 12)               # 3 blocks, only 2 host blocks
    before = snapshot(m)
    with pytest.raises(L.OutOfBlocks):
        m.swap_out("a")
    expect(snapshot(m) == before and not m.is_swapped("a"), "a failed swap_out must change nothing", before, snapshot(m))
    expect_value_error(m.swap_in, "a", what="swap_in of a resident sequence")
    expect_value_error(m.swap_out, "zzz", what="swap_out of an unknown sequence")
    expect_value_error(m.swap_blocks_to_cpu, [1, 1], what="the same block twice")
    expect_value_error(m.swap_blocks_to_cpu, [99], what="a block id out of range")


@task(4, "swapping")
def test_swap_random_programs(device, seed):
    make_manager(device)

    def body(pick):
        ProgramRunner(L, pick, device, torch.bfloat16,
                      ("allocate", "append", "fork", "append", "free", "swap_out", "swap_in", "swap_in"), with_data=True).run()

    # 4 device and 8 host blocks: two 4-block sequences swapped out, the second swapped back in: its host
    # blocks are not the device blocks it comes back to
    run_programs(body, seed, examples(device, 30, 10), fixed=[[1, 4, 8, 5, 0, 13, 1, 5, 0, 0, 13, 2, 5, 0, 6, 1]])

