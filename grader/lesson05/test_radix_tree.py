"""Grader of lesson 05, part 1: the radix tree of cached prefixes (task 1) and its glue with lesson 03's
paged KV cache (task 2).

Two kinds of checks:

* hand-written cases with exact expectations (matched lengths, block ids, the shape of the tree after a
  split, the order of eviction, reference counts), and
* random programs of operations (``grader/programs.py``: fixed cases first, then hypothesis when it is
  installed, which shrinks a failing program to a short one) checked after every step against an independent shadow of
  what must hold: every block owned by the tree or a sequence, reference counts equal to owners, locked
  prefixes never evicted, cached data read back bit for bit, nothing leaked once every sequence ends.

The prefix-prefill kernel itself is graded in ``test_prefix_prefill.py`` (tasks 3-4); task 2 checks the
glue's attention against a float64 reference on a NaN-poisoned cache.
"""

from __future__ import annotations

import math

import torch

from grader.checks import GradingError, assert_close, expect_value_error, randn, task, tolerances
from grader.programs import run_programs
from yaie import ops
from yaie.switch import LessonProxy

L = LessonProxy(5)


def expect(condition: bool, what: str, expected, got, hint: str = "") -> None:
    if not condition:
        raise GradingError(f"{what}\n  expected: {expected}\n  got:      {got}" + (f"\n  hint:     {hint}" if hint else ""))


def examples(device: str, cpu: int, gpu: int) -> int:
    return gpu if device == "cuda" else cpu


def seq(*blocks: str) -> list[int]:
    """Token ids from short strings, one character per token: ``seq("abcd", "efgh")``."""
    return [ord(c) for c in "".join(blocks)]


# ================================================================ task 1: the radix tree

def tree_blocks(tree) -> dict[int, object]:
    """Block id -> owning node, from the nodes (each block must be owned once)."""
    owner = {}
    for node in tree.nodes():
        expect(len(node.tokens) == len(node.blocks) * tree.block_size,
               "every node's edge holds exactly block_size tokens per block", f"{len(node.blocks) * tree.block_size} tokens",
               f"{len(node.tokens)} tokens for blocks {node.blocks}")
        expect(len(node.blocks) > 0, "no node but the root has an empty edge", "at least one block", node)
        for b in node.blocks:
            expect(b not in owner, "a block must be owned by one node only", "distinct block ids", f"block {b} twice")
            owner[b] = node
    return owner


def check_tree_shape(tree) -> None:
    """Parents and children agree; children keyed by their first block; no two children start alike."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            expect(child.parent is node, "a child's parent must be the node that holds it", "parent link",
                   f"{child!r} has parent {child.parent!r}")
            expect(tuple(key) == tuple(child.tokens[:tree.block_size]),
                   "children are keyed by the first block of their edge", tuple(child.tokens[:tree.block_size]), key)
            stack.append(child)


@task(1, "RadixAttentionBlock")
def test_insert_then_match_returns_the_blocks():
    tree = L.RadixAttentionBlock(4)
    found = tree.match_prefix(seq("abcd", "efgh"))
    expect(found.num_tokens == 0 and list(found.blocks) == [] and found.node is tree.root,
           "match_prefix on an empty tree", "(0, [], root)", (found.num_tokens, found.blocks, found.node))
    taken = tree.insert(seq("abcd", "efgh", "ij"), [7, 3])
    expect(list(taken) == [7, 3], "insert returns the blocks the tree took", [7, 3], taken,
           "a new sequence: the tree takes all its whole blocks (the partial 'ij' is not cached)")
    for tokens, want_tokens, want_blocks in [(seq("abcd", "efgh", "ij"), 8, [7, 3]), (seq("abcd", "efgh"), 8, [7, 3]),
                                             (seq("abcd", "efg"), 4, [7]), (seq("abcd", "xxxx"), 4, [7]),
                                             (seq("abc"), 0, []), (seq("zbcd"), 0, [])]:
        found = tree.match_prefix(tokens)
        expect((found.num_tokens, list(found.blocks)) == (want_tokens, want_blocks),
               f"match_prefix({''.join(map(chr, tokens))!r}) after inserting 'abcdefghij' with blocks [7, 3] "
               "(block_size 4)", (want_tokens, want_blocks), (found.num_tokens, list(found.blocks)),
               "only whole blocks match: walk block by block while the next block_size tokens are equal")
    # An inserted prefix of something cached takes nothing.
    expect(list(tree.insert(seq("abcd"), [9])) == [], "inserting a prefix that is already cached",
           "[] (the tree keeps its own block 7)", tree.insert(seq("abcd"), [9]))
    expect(sorted(tree.cached_blocks()) == [3, 7], "the tree's blocks after inserting a cached prefix",
           [3, 7], sorted(tree.cached_blocks()))
    check_tree_shape(tree)


@task(1, "RadixAttentionBlock")
def test_diverging_sequence_splits_the_edge():
    tree = L.RadixAttentionBlock(2)
    tree.insert(seq("ab", "cd", "ef", "gh"), [10, 11, 12, 13])
    long_node = tree.match_prefix(seq("ab", "cd", "ef", "gh")).node
    tree.lock(long_node)
    taken = tree.insert(seq("ab", "cd", "xy", "zz"), [10, 11, 20, 21])
    expect(list(taken) == [20, 21], "insert of a sequence that leaves a cached edge after 2 blocks", [20, 21], taken,
           "the first two blocks are cached already (the tree keeps 10, 11); the rest is a new leaf")
    check_tree_shape(tree)
    top = tree.root.children
    expect(len(top) == 1, "after the split the root has one child (the shared 'abcd')", 1, len(top))
    shared = next(iter(top.values()))
    expect(list(shared.blocks) == [10, 11] and len(shared.children) == 2,
           "the split node holds the shared blocks and has two children", "blocks [10, 11], 2 children",
           f"blocks {shared.blocks}, {len(shared.children)} children",
           "cut the edge at the block where the sequences differ; the new upper node takes the shared part")
    kids = sorted(list(c.blocks) for c in shared.children.values())
    expect(kids == [[12, 13], [20, 21]], "the two children after the split", [[12, 13], [20, 21]], kids)
    expect(long_node.parent is shared and list(long_node.blocks) == [12, 13],
           "the node a request holds keeps its own (lower) part after a split", "blocks [12, 13] below the split",
           long_node, "keep the old node object as the lower part, so locks and references to it stay valid")
    expect(shared.lock_count == 1, "the new upper node inherits the lock count (a lock below it)", 1, shared.lock_count)
    evicted = sorted(tree.evict(10))
    expect(evicted == [20, 21], "evict(10) with 'abcdefgh' locked", [20, 21], evicted,
           "the locked path (and the shared part above it) must stay")
    found = tree.match_prefix(seq("ab", "cd", "xy"))
    expect(found.num_tokens == 4, "match after the diverging branch was evicted", 4, found.num_tokens)
    tree.unlock(long_node)
    evicted = tree.evict(10)
    expect(evicted[:2] == [13, 12] and sorted(evicted) == [10, 11, 12, 13],
           "evict(10) once nothing is locked: every block, deepest first", "[13, 12, 11, 10]", evicted)
    expect(tree.nodes() == [] and tree.num_cached_blocks == 0, "an empty tree after evicting everything",
           "no nodes", tree.nodes())


@task(1, "RadixAttentionBlock")
def test_evicts_least_recently_used_leaves_first():
    tree = L.RadixAttentionBlock(1)
    tree.insert([1, 2, 3], [1, 2, 3])        # oldest
    tree.insert([4, 5], [4, 5])
    tree.insert([6, 7], [6, 7])
    tree.match_prefix([1, 2])               # 1, 2 used again; the match splits off [3], which is not
    got = tree.evict(3)
    expect(got == [3, 5, 4], "evict(3) after inserting [1,2,3], [4,5], [6,7] and matching [1,2]",
           "[3, 5, 4]: leaf [3] was last used by the first insert, then the branch [4, 5]; blocks leave from "
           "the end of a leaf", got,
           "order leaves by last_access (a split keeps the old time on the lower part); take blocks from the "
           "end of the leaf's edge")
    # A match makes a prefix recent again: the branch inserted later goes first.
    tree = L.RadixAttentionBlock(1)
    tree.insert([1, 2], [1, 2])
    tree.insert([4, 5], [4, 5])
    tree.match_prefix([1, 2, 9])
    got = tree.evict(2)
    expect(got == [5, 4], "evict(2) after inserting [1,2] then [4,5] and matching [1,2,9]", "[5, 4]", got,
           "match_prefix sets last_access on every node of the path it walks: [1, 2] is the most recently used")
    # Partial eviction of a leaf trims its edge from the end, and what is left still matches.
    tree = L.RadixAttentionBlock(2)
    tree.insert(seq("aa", "bb", "cc"), [0, 1, 2])
    got = tree.evict(1)
    expect(got == [2], "evict(1) of a three-block leaf", "[2] (its last block)", got)
    found = tree.match_prefix(seq("aa", "bb", "cc"))
    expect((found.num_tokens, list(found.blocks)) == (4, [0, 1]), "match after trimming the leaf", (4, [0, 1]),
           (found.num_tokens, list(found.blocks)))
    expect(tree.evict(0) == [], "evict(0)", [], tree.evict(0))


@task(1, "RadixAttentionBlock")
def test_locks_protect_prefixes():
    tree = L.RadixAttentionBlock(2)
    tree.insert(seq("ab", "cd"), [1, 2])
    tree.insert(seq("ab", "xy"), [1, 3])
    node = tree.match_prefix(seq("ab", "cd")).node
    tree.lock(node)
    tree.lock(node)
    expect(sorted(tree.evict(5)) == [3], "evict with 'abcd' locked twice", [3], "other blocks")
    tree.unlock(node)
    expect(tree.evict(5) == [], "evict with 'abcd' still locked once", [], "blocks of a locked prefix",
           "lock counts: a node is evictable only when its count is back to 0")
    tree.unlock(node)
    expect(sorted(tree.evict(5)) == [1, 2], "evict after the last unlock", [1, 2], "something else")
    root = tree.root
    tree.lock(root)
    tree.unlock(root)


@task(1, "RadixAttentionBlock")
def test_tree_rejects_bad_input():
    expect_value_error(L.RadixAttentionBlock, 0, what="block_size 0")
    tree = L.RadixAttentionBlock(2)
    tree.insert([1, 2, 3, 4], [5, 6])
    expect_value_error(tree.match_prefix, [1.5, 2.0], what="float token ids")
    expect_value_error(tree.match_prefix, [1, -2], what="a negative token id")
    expect_value_error(tree.insert, [1, 2, 3, 4], [7], what="one block for two blocks of tokens")
    expect_value_error(tree.insert, [9, 9, 8, 8], [7, 7], what="the same block id twice")
    expect_value_error(tree.insert, [9, 9, 8, 8], [5, 7], what="a block the tree already caches for other tokens")
    expect_value_error(tree.evict, -1, what="evict(-1)")
    other = L.RadixAttentionBlock(2)
    other.insert([1, 2], [0])
    expect_value_error(tree.lock, other.match_prefix([1, 2]).node, what="locking a node of another tree")
    expect_value_error(tree.unlock, tree.match_prefix([1, 2]).node, what="unlocking a node that is not locked")
    expect(sorted(tree.cached_blocks()) == [5, 6], "bad input must change nothing", [5, 6], sorted(tree.cached_blocks()))


@task(1, "RadixAttentionBlock")
def test_random_programs_on_the_tree(device, seed):
    """Random inserts, matches, locks and evictions against a shadow of what the tree must hold."""

    def body(pick):
        size = pick(1, 3)
        tree = L.RadixAttentionBlock(size)
        next_block = [0]
        owned: set[int] = set()           # shadow: blocks the tree owns
        locks: list = []                   # (node, blocks of its path) held
        sequences: list[list[int]] = []
        for _ in range(pick(5, 25)):
            op = pick(0, 4)
            if op <= 1:                    # insert a sequence, often one that shares a prefix
                if sequences and pick(0, 1):
                    base = sequences[pick(0, len(sequences) - 1)]
                    tokens = base[:pick(0, len(base))] + [pick(0, 3) for _ in range(pick(0, 3 * size))]
                else:
                    tokens = [pick(0, 3) for _ in range(pick(0, 4 * size))]
                before = tree.match_prefix(tokens)
                count = len(tokens) // size
                blocks = list(range(next_block[0], next_block[0] + count))
                next_block[0] += count
                pick.log(f"insert({tokens}, {blocks})")
                taken = list(tree.insert(tokens, blocks))
                expect(taken == blocks[before.num_tokens // size:], "insert takes exactly the blocks past the cached prefix",
                       blocks[before.num_tokens // size:], taken)
                owned.update(taken)
                found = tree.match_prefix(tokens)
                want = list(before.blocks) + taken
                expect((found.num_tokens, list(found.blocks)) == (count * size, want),
                       "match_prefix right after insert returns what was inserted",
                       (count * size, want), (found.num_tokens, list(found.blocks)))
                sequences.append(tokens)
            elif op == 2 and sequences:    # lock what a request would read
                found = tree.match_prefix(sequences[pick(0, len(sequences) - 1)])
                pick.log(f"lock(match_prefix(...).node holding {list(found.blocks)})")
                tree.lock(found.node)
                locks.append((found.node, list(found.blocks)))
            elif op == 3 and locks:
                node, held = locks.pop(pick(0, len(locks) - 1))
                pick.log(f"unlock(node holding {held})")
                tree.unlock(node)
            else:
                protected = {b for _, blocks in locks for b in blocks}
                count = pick(0, 6)
                pick.log(f"evict({count})")
                freed = list(tree.evict(count))
                expect(not set(freed) & protected, "evict must never take a block of a locked prefix",
                       "none of " + str(sorted(protected)), freed)
                expect(set(freed) <= owned and len(set(freed)) == len(freed),
                       "evict returns distinct blocks the tree owned", sorted(owned), freed)
                owned -= set(freed)
            owners = tree_blocks(tree)
            expect(set(owners) == owned, "the tree's blocks after the step", sorted(owned), sorted(owners))
            expect(sorted(tree.cached_blocks()) == sorted(owned), "cached_blocks()", sorted(owned),
                   sorted(tree.cached_blocks()))
            for node, blocks in locks:
                expect(node.lock_count >= 1 and all(owners.get(b) is not None for b in blocks),
                       "a locked prefix stays in the tree", blocks, node)
            check_tree_shape(tree)
        for node, _ in locks:
            tree.unlock(node)
        freed = tree.evict(len(owned) + 1)
        expect(sorted(freed) == sorted(owned) and tree.num_cached_blocks == 0,
               "nothing leaked: with every lock released, evict gives back every block", sorted(owned), sorted(freed))

    # block_size 2: insert 'aabbcc', insert 'aabbdd' (a split), lock 'aabbcc', evict 6, unlock, evict 6
    run_programs(body, seed, examples(device, 25, 60),
                 fixed=[[2, 6, 0, 6, 0, 0, 1, 1, 2, 2, 0, 1, 0, 4, 2, 3, 3, 2, 0, 4, 6, 3, 0, 4, 6]])


# ================================================================ task 2: the glue with lesson 03's cache

def make_cache(device, num_blocks=12, block_size=4, dtype=torch.float32, num_layers=1, num_kv_heads=2, head_dim=8):
    manager = ops.kv_cache_manager(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device)
    return manager, L.RadixAttentionWithPagedKVCache(manager)


def check_owners(cache, live: dict) -> None:
    """Reference counts equal owners (the tree + every live sequence's table); free blocks are owned by nobody."""
    manager, tree = cache.manager, cache.tree
    owners = [0] * manager.num_blocks
    for b in tree.cached_blocks():
        owners[b] += 1
    for seq_id in live:
        for b in manager.block_ids(seq_id):
            owners[b] += 1
    counts = [blk.ref_count for blk in manager.blocks]
    expect(counts == owners, "each block's ref_count must equal its owners (1 for the tree + the tables holding it)",
           owners, counts, "share a cached block with manager.blocks[b].ref_count += 1; evicting drops the tree's one")
    free = sum(1 for c in counts if c == 0)
    expect(manager.num_free_blocks == free, "the free list holds exactly the blocks nobody owns", free,
           manager.num_free_blocks)


@task(2, "RadixAttentionWithPagedKVCache")
def test_second_request_reuses_the_cached_prompt(device):
    manager, cache = make_cache(device)
    prompt = seq("You ", "are ", "kind", ". Hi")           # 16 tokens, 4 blocks
    first = cache.allocate("a", prompt)
    expect(first.num_cached == 0 and first.slot_mapping.numel() == 16, "allocate on an empty cache",
           "0 cached, 16 slots", (first.num_cached, first.slot_mapping.numel()))
    expect(cache.cache_sequence("a", prompt) == 16, "cache_sequence of a 16-token sequence", 16, "another count")
    check_owners(cache, {"a": 1})
    second = cache.allocate("b", seq("You ", "are ", "kind", ". Bye!"))
    expect(second.num_cached == 12, "a prompt that shares 3 whole blocks and diverges in the 4th", 12, second.num_cached)
    expect(manager.block_ids("b")[:3] == manager.block_ids("a")[:3], "the new sequence's table starts with the cached blocks",
           manager.block_ids("a")[:3], manager.block_ids("b")[:3])
    expect(second.slot_mapping.numel() == 6, "slots for the new tokens only", 6, second.slot_mapping.numel())
    check_owners(cache, {"a": 1, "b": 1})
    same = cache.allocate("c", prompt)
    expect(same.num_cached == 12, "the same 16-token prompt again: its last token is always computed",
           "12 (3 whole blocks of tokens[:-1])", same.num_cached,
           "match tokens[:-1]: the last token's logits pick the next token, so it must be run")
    expect(cache.match(prompt) == 12, "match(prompt) of the cached 16-token prompt: its last token is always computed",
           12, cache.match(prompt), "match tokens[:-1]")
    cache.free("a", prompt)
    cache.free("b")
    cache.free("c")
    check_owners(cache, {})
    stats = cache.stats
    expect((stats.requests, stats.cached_tokens) == (3, 24), "stats after three requests", "3 requests, 24 tokens reused",
           (stats.requests, stats.cached_tokens))
    expect(cache.clear() == 4 and manager.num_free_blocks == manager.num_blocks, "nothing leaked after clear()",
           f"{manager.num_blocks} free", manager.num_free_blocks)


@task(2, "RadixAttentionWithPagedKVCache")
def test_eviction_makes_room_but_spares_prefixes_in_use(device):
    manager, cache = make_cache(device, num_blocks=6, block_size=2)
    a = seq("aa", "bb", "cc")
    cache.allocate("a", a)
    cache.free("a", a)                       # 3 cached blocks, unlocked
    b = seq("xx", "yy", "zz", "w")
    cache.allocate("b", b)                   # needs 4 blocks: 3 free + 1 evicted
    expect(manager.num_free_blocks == 0 and cache.tree.num_cached_blocks == 2, "allocate evicts the LRU cached blocks it needs",
           "0 free, 2 still cached", (manager.num_free_blocks, cache.tree.num_cached_blocks))
    check_owners(cache, {"b": 1})
    cache.free("b", b)
    c = seq("aa", "bb", "q")
    got = cache.allocate("c", c)
    expect(got.num_cached == 4, "the surviving cached prefix is still reused", 4, got.num_cached)
    try:                                     # shares the prefix 'c' holds, needs 4 more blocks: only 3 can be evicted
        cache.allocate("d", seq("aa", "bb", "mm", "nn", "oo", "pp", "r"))
    except Exception as err:  # noqa: BLE001 - the manager's OutOfBlocks, whichever module made it
        expect(type(err).__name__ == "OutOfBlocks", "a request that cannot fit even after evicting",
               "OutOfBlocks", type(err).__name__)
    else:
        raise GradingError("allocate must raise OutOfBlocks when the locked prefixes leave too few blocks\n"
                           "  hint:     evict what you can (make_room), then let the manager's OutOfBlocks through")
    expect(not manager.has_seq("d"), "a failed allocate must not leave the sequence behind", "no sequence 'd'", "'d' exists")
    shared = cache.locked_node("c")
    expect(shared is not None and shared.lock_count == 1,
           "after a failed allocate over the prefix 'aabb', only 'c' may hold a lock on it", "lock_count 1",
           shared, "unlock the node you locked before letting OutOfBlocks through")
    expect(cache.match(c) == 4, "the prefix in use by 'c' must survive the failed allocation", 4, cache.match(c))
    check_owners(cache, {"c": 1})
    cache.free("c", c)
    cache.clear()
    expect(manager.num_free_blocks == manager.num_blocks, "nothing leaked", manager.num_blocks, manager.num_free_blocks)


def _cached_prefix_held_by_a_fork(device):
    """8 blocks of 2 tokens: 'aabbcc' cached and still held by a fork of the request that computed it (the
    least recently used prefix: evicting it frees nothing), then 'xxyy' cached by nobody but the tree.
    Two blocks are free."""
    manager, cache = make_cache(device, num_blocks=8, block_size=2)
    a = seq("aa", "bb", "cc", "d")
    cache.allocate("a", a)                  # 4 blocks
    cache.cache_sequence("a", a)            # the tree takes the 3 whole ones
    manager.fork("a", "a2")                 # a second sample of the same prompt shares all 4
    cache.free("a", a)                      # the parent ends: 'aabbcc' is unlocked, but a2 still holds its blocks
    b = seq("xx", "yy", "z")
    cache.allocate("b", b)
    cache.free("b", b)                      # 'xxyy' cached, held by the tree only
    expect(manager.num_free_blocks == 2, "free blocks after the set-up (4 held by the fork, 2 by the tree)", 2,
           manager.num_free_blocks)
    return manager, cache, a


MAKE_ROOM_HINT = ("evicting a block the tree caches frees it only when nobody else holds it: a fork of the "
                  "request that cached it keeps it. Evict, look at manager.num_free_blocks, and evict again "
                  "until enough blocks are free or the tree has nothing left to evict")


@task(2, "RadixAttentionWithPagedKVCache")
def test_make_room_keeps_evicting_until_blocks_are_free(device):
    """Eviction in more than one round: the least recently used cached blocks are still held by a fork."""
    manager, cache, a = _cached_prefix_held_by_a_fork(device)
    case = ("8 blocks of 2 tokens; 'aabbcc' cached, least recently used, and still held by a fork 'a2' of the "
            "request that cached it; 'xxyy' cached by the tree only; 2 blocks free")
    ok = cache.make_room(4)
    expect(ok is True and manager.num_free_blocks >= 4, f"make_room(4) must free blocks until 4 are free\n  case:     {case}",
           "True, at least 4 free blocks (evict 'aabbcc', which frees nothing, then 'xxyy')",
           f"{ok!r}, {manager.num_free_blocks} free blocks", MAKE_ROOM_HINT)
    check_owners(cache, {"a2": a})
    expect(cache.match(a) == 0 and cache.match(seq("xx", "yy", "z")) == 0, "both prefixes were evicted to make room",
           "match() 0 for both", (cache.match(a), cache.match(seq("xx", "yy", "z"))))
    manager.free("a2")
    expect(manager.num_free_blocks == 8, "nothing leaked", 8, manager.num_free_blocks)

    manager, cache, a = _cached_prefix_held_by_a_fork(device)
    c = seq("mm", "nn", "oo", "p")          # 4 new blocks: only 'xxyy' can free the 2 missing
    try:
        got = cache.allocate("c", c)
    except Exception as err:  # noqa: BLE001 - the manager's OutOfBlocks, whichever module made it
        raise GradingError(f"allocate of a 7-token prompt (4 blocks) raised {type(err).__name__}\n  case:     {case}\n"
                           "  expected: it fits once the tree evicts 'aabbcc' (frees nothing) and 'xxyy' (frees 2)\n"
                           f"  got:      {type(err).__name__}: {err}\n  hint:     {MAKE_ROOM_HINT}") from None
    expect(got.num_cached == 0 and len(manager.block_ids("c")) == 4, "allocate after making room", "4 new blocks",
           manager.block_ids("c"))
    check_owners(cache, {"a2": a, "c": c})
    cache.free("c")
    manager.free("a2")
    cache.clear()
    expect(manager.num_free_blocks == 8, "nothing leaked", 8, manager.num_free_blocks)

    manager, cache, a = _cached_prefix_held_by_a_fork(device)
    d = seq("mm", "nn")                     # the 2 free blocks; then 4 more tokens need 2 more
    cache.allocate("d", d)
    try:
        cache.append_slots("d", 4)
    except Exception as err:  # noqa: BLE001 - the manager's OutOfBlocks, whichever module made it
        raise GradingError(f"append_slots('d', 4) raised {type(err).__name__}\n  case:     {case}; 'd' took the 2 "
                           "free blocks\n  expected: 2 more blocks once the tree evicts 'aabbcc' (frees nothing) and "
                           f"'xxyy' (frees 2)\n  got:      {type(err).__name__}: {err}\n  hint:     {MAKE_ROOM_HINT}") from None
    expect(manager.num_tokens("d") == 8 and len(manager.block_ids("d")) == 4, "append_slots after evicting",
           "8 tokens in 4 blocks", (manager.num_tokens("d"), manager.block_ids("d")))
    check_owners(cache, {"a2": a, "d": d})
    cache.free("d")
    manager.free("a2")
    cache.clear()
    expect(manager.num_free_blocks == 8, "nothing leaked", 8, manager.num_free_blocks)


@task(2, "RadixAttentionWithPagedKVCache")
def test_glue_rejects_bad_input(device):
    manager, cache = make_cache(device)
    cache.allocate("a", [1, 2, 3, 4, 5])
    expect_value_error(cache.allocate, "a", [1, 2], what="a sequence id already in the cache")
    expect_value_error(cache.allocate, "z", [], what="an empty prompt")
    expect_value_error(cache.allocate, "z", [1.0, 2.0], what="float token ids")
    expect_value_error(cache.cache_sequence, "a", [1, 2, 3], what="fewer token ids than the sequence holds")
    expect_value_error(cache.free, "nobody", what="an unknown sequence")
    expect_value_error(cache.make_room, -1, what="make_room(-1)")
    expect(manager.seq_ids() == ["a"], "bad input must change nothing", ["a"], manager.seq_ids())


@task(2, "RadixAttentionWithPagedKVCache")
def test_random_programs_share_blocks_correctly(device, seed):
    """Random requests over a small cache: owners, locks and the data a shared prefix reads, after every step."""

    def body(pick):
        size = pick(1, 3)
        manager, cache = make_cache(device, num_blocks=pick(6, 12), block_size=size, num_kv_heads=1, head_dim=2)
        k_rows = manager.k_cache[0].view(-1, 1, 2)
        k_rows.fill_(float("nan"))          # never written: NaN, not what an earlier program left there
        live: dict[str, list[int]] = {}     # seq id -> its tokens (all computed)
        forks: dict[str, list[int]] = {}    # forks made with the manager (the tree does not know them)
        prompts: list[list[int]] = []
        counter = [0]

        def value(tokens: list[int], p: int) -> float:
            """What position p's key holds: a function of the tokens up to p (as real K/V are)."""
            return float(hash(tuple(tokens[:p + 1])) % 100003)

        for _ in range(pick(4, 16)):
            op = pick(0, 4)
            if op <= 1:                     # a new request, often continuing an earlier prompt
                if prompts and pick(0, 2):
                    base = prompts[pick(0, len(prompts) - 1)]
                    tokens = base[:pick(1, len(base))] + [pick(0, 2) for _ in range(pick(0, 2 * size))]
                else:
                    tokens = [pick(0, 2) for _ in range(pick(1, 4 * size))]
                seq_id = f"s{counter[0]}"
                counter[0] += 1
                before = cache.match(tokens)
                pick.log(f"allocate({seq_id!r}, {tokens})")
                try:
                    got = cache.allocate(seq_id, tokens)
                except Exception as err:  # noqa: BLE001
                    if type(err).__name__ != "OutOfBlocks":
                        raise
                    expect(not manager.has_seq(seq_id), "OutOfBlocks must not leave the sequence behind", "no sequence", seq_id)
                    check_owners(cache, {**live, **forks})
                    # It may fail only if evicting everything evictable (all but the prefix it matched, which
                    # it holds locked meanwhile) could not make room: clear the cache and count.
                    matched = list(cache.tree.match_prefix(tokens[:-1]).blocks)
                    tree_only = sum(1 for b in matched if manager.blocks[b].ref_count == 1)
                    pick.log("clear()")
                    cache.clear()
                    needed = -(-len(tokens) // size) - len(matched)
                    room = manager.num_free_blocks - tree_only
                    expect(room < needed, f"allocate({seq_id!r}) raised OutOfBlocks, but evicting every unlocked "
                           "cached prefix makes room", f"{needed} new blocks fit in the {room} blocks evicting frees",
                           "OutOfBlocks",
                           "a block evicted from the tree frees nothing while a sequence (a fork) still holds it: "
                           "evict again until enough blocks are free or nothing is left to evict")
                    check_owners(cache, {**live, **forks})
                    continue
                expect(got.num_cached == before and got.num_cached % size == 0 and got.num_cached < len(tokens),
                       "allocate reuses the whole blocks match() reported, never the last token", before, got.num_cached)
                slots = manager._slots(manager.block_ids(seq_id), 0, len(tokens)).cpu()
                cached_vals = k_rows[slots[:got.num_cached].to(k_rows.device), 0, 0].cpu().tolist()
                want = [value(tokens, p) for p in range(got.num_cached)]
                expect(cached_vals == want, "a reused prefix must read the K/V its tokens were computed with",
                       want, cached_vals, "the shared blocks must be the ones match_prefix returned, in order")
                new = torch.tensor([value(tokens, p) for p in range(got.num_cached, len(tokens))])
                kv = new.view(-1, 1, 1).expand(-1, 1, 2).to(device=device, dtype=torch.float32).contiguous()
                manager.write_kv(0, got.slot_mapping, kv, kv)
                live[seq_id] = tokens
                prompts.append(tokens)
                if pick(0, 1):
                    pick.log(f"cache_sequence({seq_id!r}, ...)")
                    cache.cache_sequence(seq_id, tokens)
            elif op == 4 and live:          # a fork (a second sample of a prompt), or the end of one
                if forks and pick(0, 1):
                    child = list(forks)[pick(0, len(forks) - 1)]
                    pick.log(f"manager.free({child!r})")
                    manager.free(child)
                    del forks[child]
                else:
                    parent = list(live)[pick(0, len(live) - 1)]
                    child = f"{parent}f{counter[0]}"
                    counter[0] += 1
                    pick.log(f"manager.fork({parent!r}, {child!r})")
                    manager.fork(parent, child)
                    forks[child] = live[parent]
            elif op == 2 and live:
                seq_id = list(live)[pick(0, len(live) - 1)]
                tokens = live.pop(seq_id)
                keep = pick(0, 1)
                pick.log(f"free({seq_id!r}{', tokens' if keep else ''})")
                cache.free(seq_id, tokens if keep else None)
            else:
                count = pick(0, 4)
                pick.log(f"evict({count})")
                cache.evict(count)
            check_owners(cache, {**live, **forks})
            for seq_id in live:
                node = cache.locked_node(seq_id)
                if node is not None:
                    expect(node.lock_count >= 1 and (node is cache.tree.root or node.parent is not None),
                           "the prefix a live request reads stays locked in the tree", "a locked node in the tree", node)
        for child in list(forks):
            manager.free(child)
        for seq_id, tokens in list(live.items()):
            cache.free(seq_id, tokens)
        check_owners(cache, {})
        cache.clear()
        expect(manager.num_free_blocks == manager.num_blocks and cache.tree.num_cached_blocks == 0,
               "nothing leaked once every request ended and the cache was cleared",
               f"{manager.num_blocks} free blocks", manager.num_free_blocks)

    # block_size 2, 6 blocks. 1: a 7-token request, cached; one sharing its first 2 blocks; free both; evict 2;
    # a new 8-token request, cached. 2: a 6-token request, cached, forked, freed (its 3 blocks stay with the
    # fork); a 4-token request, cached, freed; a 6-token one needs 2 of the 3 cached blocks nobody else holds.
    run_programs(body, seed, examples(device, 20, 50),
                 fixed=[[2, 6, 6, 0, 7, 0, 0, 1, 1, 2, 2, 0, 1, 1, 1, 0, 4, 1, 1, 0, 2, 0, 1, 2, 0, 0, 3, 2,
                         0, 0, 8, 2, 2, 2, 2, 1, 1, 1, 1, 1],
                        [2, 6, 6, 0, 6, 0, 0, 1, 1, 2, 2, 1, 4, 0, 2, 0, 1, 0, 0, 4, 1, 0, 1, 0, 1, 2, 0, 1,
                         0, 0, 6, 2, 1, 2, 1, 2, 1, 0]])


@task(4, "prefix_prefill_attention")
def test_prefill_attention_over_a_cached_prefix(device, seed):
    """The glue's ``prefill_attention`` (task 2) over a ragged batch (prefixes of 0 and several blocks, query
    lengths 1, short and long) against float64. It runs notebook 05b's kernel, so it is graded with task 4:
    notebook 05a's tasks pass without it."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    heads, kv_heads, dim, size = 4, 2, 16, 4
    manager, cache = make_cache(device, num_blocks=24, block_size=size, dtype=dtype, num_kv_heads=kv_heads, head_dim=dim)
    for cache_tensor in (manager.k_cache[0], manager.v_cache[0]):
        cache_tensor.fill_(float("nan"))                   # what nobody owns must never be read
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 50, (12,), generator=gen).tolist()
    keys, values = {}, {}

    def run(seq_ids, prompts):
        """Allocate, prefill the new tokens, return the output and the float64 reference."""
        lens, q_rows, k_rows, v_rows, refs = [], [], [], [], []
        for i, (s, tokens) in enumerate(zip(seq_ids, prompts)):
            got = cache.allocate(s, tokens)
            n = len(tokens) - got.num_cached
            lens.append(n)
            q = randn(n, heads, dim, dtype=dtype, device=device, seed=seed + 11 * len(keys) + i)
            k = randn(n, kv_heads, dim, dtype=dtype, device=device, seed=seed + 13 * len(keys) + i + 1)
            v = randn(n, kv_heads, dim, dtype=dtype, device=device, seed=seed + 17 * len(keys) + i + 2)
            prefix = tuple(tokens[:got.num_cached])
            k_all = torch.cat([keys[prefix], k]) if prefix else k
            v_all = torch.cat([values[prefix], v]) if prefix else v
            keys[tuple(tokens)], values[tuple(tokens)] = k_all, v_all
            for p in range(size, len(tokens) + 1, size):
                keys.setdefault(tuple(tokens[:p]), k_all[:p])
                values.setdefault(tuple(tokens[:p]), v_all[:p])
            refs.append(reference(q, k_all, v_all))
            q_rows.append(q), k_rows.append(k), v_rows.append(v)
        out = cache.prefill_attention(0, seq_ids, lens, torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows))
        return out, torch.cat(refs), lens

    def reference(q, k, v):
        n, total = q.shape[0], k.shape[0]
        kk = k.double().repeat_interleave(heads // kv_heads, 1)
        vv = v.double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), kk) / math.sqrt(dim)
        visible = torch.arange(total, device=q.device)[None, :] <= torch.arange(total - n, total, device=q.device)[:, None]
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv)

    # First a plain prefill (no prefix), then requests that reuse 0, 1 and 3 blocks, with 1, short and long tails.
    out, ref, _ = run(["base"], [shared + [7, 8]])
    assert_close(out, ref, name="prefill_attention (no cached prefix)", case="one sequence of 14 new tokens",
                 hint="write the new K/V into the cache, then call prefix_prefill_attention with context_lens 0")
    cache.cache_sequence("base", shared + [7, 8])
    prompts = [shared[:4] + [99], shared + [1], [60, 61, 62, 63, 64, 65, 66, 67, 68], shared[:9] + [5, 6, 7, 8, 9, 10, 11]]
    out, ref, lens = run(["one", "two", "three", "four"], prompts)
    expect(lens == [1, 1, 9, 8], "new tokens per request after matching the cached 'base' prompt",
           [1, 1, 9, 8], lens)
    atol, rtol = tolerances(dtype)
    assert_close(out, ref, name="prefill_attention over cached prefixes", atol=atol, rtol=rtol,
                 case=f"query lengths {lens}, cached prefixes [4, 12, 0, 8] tokens, block_size {size}",
                 hint="context_lens are the cached tokens before the new ones; block tables come from the manager")
    # The written K/V are where later decode steps read them.
    slots = manager._slots(manager.block_ids("four"), 0, len(prompts[3]))
    stored = manager.k_cache[0].view(-1, kv_heads, dim)[slots]
    assert_close(stored, keys[tuple(prompts[3])].double(), name="K in the cache after prefill_attention", atol=0, rtol=0,
                 hint="write the new keys at the sequence's slots of positions num_cached .. len - 1")
    for s in ["base", "one", "two", "three", "four"]:
        cache.free(s)
    expect_value_error(cache.prefill_attention, 0, [], [], out, out, out, what="no sequence")
