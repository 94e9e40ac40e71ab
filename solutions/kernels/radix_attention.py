"""Lesson 05, part 1: radix prefix sharing over the paged KV cache.

Many requests to a server start with the same tokens: a system prompt, the instructions of a few-shot
task, the earlier turns of a chat. Their keys and values are the same too (the K/V of a token depends
only on the tokens before it), so once one request has computed them, every later request that starts
the same way can *reuse* those cache blocks and prefill only the tokens that differ. This module keeps
the books for that.

**The radix tree (task 1).** :class:`RadixAttentionBlock` stores every cached token sequence in a tree
whose edges are labelled with token ids. A path from the root spells a prefix; each node owns the
KV-cache blocks (lesson 03 block ids) of the tokens on its edge. The granularity is one **block**
(``block_size`` tokens, a page): only whole blocks are cached, because a block is the unit the paged
cache shares. Two prompts share a node up to the last whole block they have in common::

    "You are a helpful assistant. | Tell me a joke"      block_size 4, one letter = one token
    "You are a helpful assistant. | What is 2+2?"

          (root)
            |  [You_][are_][a_he][lpfu]...      blocks 3, 8, 1, 12, ...   <- shared by both
           / \\
    [Tell][_me_]..   [What][_is_]..             each request's own blocks

* ``match_prefix(tokens)``: walk down as long as whole blocks match; return the matched length and the
  blocks along the path (the caller reads them instead of recomputing).
* ``insert(tokens, blocks)``: add a computed sequence; where it leaves an existing edge in the middle,
  the edge is **split** at the block boundary into a parent (the shared part) and a child (the rest).
* ``lock(node)`` / ``unlock(node)``: a request that reads a cached prefix holds a lock (a reference count
  on the node and all its ancestors): a locked node is never evicted.
* ``evict(num_blocks)``: when the cache needs room, give back blocks of the **least recently used**
  unlocked leaves, from the end of their edges (a leaf's last block is the least shared one).

**The glue (task 2).** :class:`RadixAttentionWithPagedKVCache` connects the tree to lesson 03's
``KVCacheManager``, which already counts references per block (``fork`` and copy-on-write use them). A
block's reference count is the number of its owners: the tree (one reference for every block it caches)
plus every sequence whose block table holds it. A request's life:

1. ``allocate(seq_id, prompt)``: match the prompt, lock the matched node, start the sequence's block
   table with the shared blocks (one more reference each), allocate blocks for the rest, evicting
   unlocked cached prefixes when the free list runs short. Returns how many tokens are cached;
2. ``prefill_attention(...)``: attention of the new tokens only, over the cached prefix (read through
   the block table) and themselves: the prefix-prefill kernel of this lesson (``prefix_prefill.py``);
3. ``cache_sequence(seq_id, tokens)``: once tokens are computed, put their whole blocks into the tree
   (the tree takes a reference) so later requests find them;
4. ``free(seq_id, tokens)``: cache what was computed, unlock, drop the sequence's references. The blocks
   the tree holds stay cached until evicted.

Tasks: 1 the radix tree (``match_prefix``, ``insert`` with node splitting, ``lock``/``unlock``, ``evict``),
2 the glue (``match``, ``allocate``, ``append_slots``, ``cache_sequence``, ``release_lock``, ``free``,
``evict``/``make_room``, ``clear``, ``prefill_attention``). ``prefill_attention`` calls lesson 05b's kernel
(``prefix_prefill_attention``, the next notebook's task 4) through ``yaie.ops.lessons.call_in(5, 1, ...)``:
lesson 05's modules are numbered 0 (this one), 1 (``prefix_prefill``), 2 (``flashinfer``), so its check is
graded with task 4, once that kernel exists. ``locked_node(seq_id)`` tells ``cache_sequence`` which node a
sequence holds its lock on (the lock moves to the node its newly cached blocks end at).
"""

from __future__ import annotations

import heapq
import itertools

import torch

from yaie.ops import lessons     # the switch: lesson 05b's kernel, the student's or the reference

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/radix_attention_given.py
from yaie.kernels.radix_attention_given import (
    PrefixAllocation, PrefixCacheStats, PrefixMatch, RadixAttentionBlockGiven, RadixNode, check_token_ids,
    out_of_blocks_error,
)


# ---------------------------------------------------------------------------------------------------
# Task 1: the radix tree
# ---------------------------------------------------------------------------------------------------

class RadixAttentionBlock(RadixAttentionBlockGiven):
    """A radix tree of cached token sequences whose nodes own KV-cache blocks (page = one block).

    Args:
        block_size: tokens per KV-cache block (lesson 03's ``block_size``); only whole blocks are cached.

    The tree only keeps books: it never touches the cache's tensors or reference counts. Whoever inserts
    blocks hands them to the tree (the tree now owns them); whoever evicts gets them back (the caller
    frees them). Every block id is owned by at most one node.

    The given queries (``nodes``, ``num_cached_blocks``, ``num_evictable_blocks``, ``cached_blocks``, ``owns``)
    and helpers (``_key``, ``_check_node``) are inherited from ``RadixAttentionBlockGiven`` in
    ``yaie/kernels/radix_attention_given.py``; ``__init__`` below sets the state they use.
    """

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.root = RadixNode()
        self._clock = itertools.count(1)     # logical time for least-recently-used eviction
        self._owner: dict[int, RadixNode] = {}   # block id -> the node that owns it

    # ------------------------------------------------------------------ task 1
    # yaie: task 1
    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node``'s edge after its first ``num_blocks`` blocks; return the new upper node.

        A new node takes the first ``num_blocks`` blocks (and their tokens) and sits between ``node`` and its
        parent; ``node`` keeps the rest of its edge, its children, and stays the same object (whoever
        holds it, a request's lock for instance, still holds the same tokens). The new node inherits
        ``node``'s ``lock_count`` and ``last_access`` (every lock below ``node`` is below it too).

        Raises:
            ValueError: ``num_blocks`` not in ``1 .. node.num_blocks - 1``.
        """
        if not 1 <= num_blocks < node.num_blocks:
            raise ValueError(f"a split needs 1 <= num_blocks < {node.num_blocks}, got {num_blocks}")
        cut = num_blocks * self.block_size
        upper = RadixNode(tokens=node.tokens[:cut], blocks=node.blocks[:num_blocks], parent=node.parent,
                          lock_count=node.lock_count, last_access=node.last_access)
        node.parent.children[self._key(list(node.tokens), 0)] = upper   # same first block: same key
        node.tokens, node.blocks = node.tokens[cut:], node.blocks[num_blocks:]
        node.parent = upper
        upper.children[self._key(list(node.tokens), 0)] = node
        for block_id in upper.blocks:
            self._owner[block_id] = upper
        return upper

    # yaie: task 1
    def _walk(self, tokens: list[int]) -> tuple[list[tuple[RadixNode, int]], int]:
        """Follow ``tokens`` down from the root without changing anything, one whole block at a time.

        Returns:
            ``(path, num_tokens)``: ``path`` lists the nodes entered below the root (the root itself is not
            in it), each with how many of its blocks matched (every node but the last matched its whole
            edge; the last may match only part of it), and ``num_tokens`` is the length matched (a multiple
            of ``block_size``).
        """
        path, node, pos = [], self.root, 0
        while pos + self.block_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            matched = 0
            while (matched < child.num_blocks and pos + self.block_size <= len(tokens)
                   and tuple(tokens[pos:pos + self.block_size])
                   == child.tokens[matched * self.block_size:(matched + 1) * self.block_size]):
                matched += 1
                pos += self.block_size
            path.append((child, matched))
            if matched < child.num_blocks:
                break
            node = child
        return path, pos

    # yaie: task 1
    def match_prefix(self, tokens) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` in whole blocks, and its blocks.

        Walks down from the root one block at a time. If the match ends inside an edge, that edge is
        split there (:meth:`_split`) so the returned ``node`` ends exactly at the prefix (the blocks the
        tree owns do not change). Every node on the path gets the current clock as ``last_access``.

        Args:
            tokens: list of int token ids (or a 1-D integer tensor); a partial last block never matches.

        Returns:
            :class:`PrefixMatch` ``(num_tokens, blocks, node)``; ``(0, [], root)`` when nothing is cached.

        Raises:
            ValueError: ``tokens`` is not a sequence of non-negative ints.
        """
        tokens = check_token_ids(tokens)
        path, matched_tokens = self._walk(tokens)
        now = next(self._clock)
        node, blocks = self.root, []
        for child, matched in path:
            if matched < child.num_blocks:
                child = self._split(child, matched)
            blocks.extend(child.blocks)
            child.last_access = now
            node = child
        return PrefixMatch(matched_tokens, blocks, node)

    # yaie: task 1
    def insert(self, tokens, blocks) -> list[int]:
        """Cache a computed sequence: ``tokens`` whose whole blocks are in cache blocks ``blocks``.

        The part already in the tree stays as it is (the tree keeps its own blocks for it); the rest becomes
        a new leaf below the node where the match ends (splitting an edge if it ends inside one, even when
        nothing is left to add). The tree takes ownership of the blocks of that new leaf only.

        Args:
            tokens: list of int token ids; only whole blocks count (tokens after the last whole block are
                ignored).
            blocks: list of int block ids, exactly ``len(tokens) // block_size`` of them, distinct.

        Returns:
            The block ids the tree took (a suffix of ``blocks``, maybe empty): the caller now shares them
            with the tree. The others (the part that was cached already) remain the caller's alone.

        Raises:
            ValueError: bad tokens; wrong number of blocks; block ids not distinct non-negative ints; a
                block the tree would take that it already owns elsewhere. Nothing changes then.
        """
        tokens = check_token_ids(tokens)
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.tolist()
        blocks = list(blocks)
        whole = len(tokens) // self.block_size
        if len(blocks) != whole:
            raise ValueError(f"insert needs one block per whole block of tokens: {len(tokens)} tokens with "
                             f"block_size {self.block_size} make {whole} blocks, got {len(blocks)} block ids")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
            raise ValueError(f"block ids must be non-negative ints, got {blocks}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block ids must be distinct, got {blocks}")
        tokens = tokens[:whole * self.block_size]
        _, cached = self._walk(tokens)
        new_blocks = blocks[cached // self.block_size:]
        taken = [b for b in new_blocks if b in self._owner]
        if taken:
            raise ValueError(f"blocks {taken} are already cached in the tree for other tokens: a block can hold "
                             "one prefix only")
        parent = self.match_prefix(tokens).node        # splits the edge where the match ends, touches the path
        if new_blocks:
            leaf = RadixNode(tokens=tuple(tokens[cached:]), blocks=new_blocks, parent=parent,
                             last_access=parent.last_access if parent is not self.root else next(self._clock))
            parent.children[self._key(tokens, cached)] = leaf
            for block_id in new_blocks:
                self._owner[block_id] = leaf
        return new_blocks

    # yaie: task 1
    def lock(self, node: RadixNode) -> None:
        """Protect the prefix that ends at ``node`` from eviction: ``lock_count`` + 1 on ``node`` and on
        every ancestor, the root included. Locking the root is allowed (and protects nothing).

        Raises:
            ValueError: ``node`` is not a node of this tree.
        """
        self._check_node(node)
        while node is not None:
            node.lock_count += 1
            node = node.parent

    # yaie: task 1
    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node`` (``lock_count`` - 1 on it and every ancestor).

        Raises:
            ValueError: ``node`` is not a node of this tree, or is not locked.
        """
        self._check_node(node)
        if node.lock_count < 1:
            raise ValueError(f"unlock of a node that is not locked ({node!r}): every unlock needs a lock before it")
        while node is not None:
            node.lock_count -= 1
            node = node.parent

    # yaie: task 1
    def evict(self, num_blocks: int) -> list[int]:
        """Give back up to ``num_blocks`` blocks, least recently used first; return their ids.

        Only unlocked leaves are evicted, the least recently used leaf first (``last_access``; leaves of equal
        time in any order). A leaf gives blocks from the end of its edge. The returned list holds each leaf's
        blocks deepest first (the last block of the edge first), leaf after leaf. A leaf whose edge becomes
        empty is removed from the tree (its ``parent`` set to ``None``), and its parent may become an
        evictable leaf in turn. Fewer blocks come back when fewer are evictable.

        Raises:
            ValueError: ``num_blocks`` is not an int >= 0.
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        order = itertools.count()            # tie-break for equal times (nodes do not compare)
        heap = [(n.last_access, next(order), n) for n in self.nodes() if not n.children and n.lock_count == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_blocks - len(freed), leaf.num_blocks)
            gone = leaf.blocks[leaf.num_blocks - take:]
            freed.extend(reversed(gone))     # deepest first
            for block_id in gone:
                del self._owner[block_id]
            if take < leaf.num_blocks:       # a shorter edge: the key (its first block) is unchanged
                leaf.blocks = leaf.blocks[:leaf.num_blocks - take]
                leaf.tokens = leaf.tokens[:leaf.num_blocks * self.block_size]
                continue
            parent = leaf.parent
            del parent.children[self._key(list(leaf.tokens), 0)]
            leaf.parent, leaf.blocks, leaf.tokens = None, [], ()
            if parent is not self.root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed


# ---------------------------------------------------------------------------------------------------
# Task 2: the tree on top of lesson 03's paged KV cache
# ---------------------------------------------------------------------------------------------------

# Lesson 03's manager shares blocks between *sequences* (``fork``); a cached prefix is shared between a
# sequence and the tree. The manager's given ``add_references``, ``drop_references`` and ``adopt`` (a
# sequence that starts on blocks in use) are what the tree uses to own blocks beside the sequences.


class RadixAttentionWithPagedKVCache:
    """Automatic prefix caching on top of a lesson 03 ``KVCacheManager``.

    Args:
        manager: the paged KV cache (lesson 03). Its sequences that this object did not allocate are left
            alone; the blocks the tree caches count one reference each for the tree.
        tree: a :class:`RadixAttentionBlock` with the manager's ``block_size``; default a new one.

    Invariant (the grader checks it after every call): for every device block, ``ref_count`` equals
    ``(1 if the tree caches it) + (number of block tables that hold it)``; a free block is in neither.
    Blocks of a sequence that this object allocated and that the tree caches are locked until it is freed.

    Attributes:
        manager, tree, stats (:class:`PrefixCacheStats`).
    """

    def __init__(self, manager, tree: RadixAttentionBlock | None = None):
        self.manager = manager
        self.tree = tree if tree is not None else RadixAttentionBlock(manager.block_size)
        if self.tree.block_size != manager.block_size:
            raise ValueError(f"the tree's block_size {self.tree.block_size} differs from the cache's "
                             f"{manager.block_size}")
        self._locks: dict[object, RadixNode] = {}     # seq id -> the node this sequence keeps locked
        self.stats = PrefixCacheStats()
        self._out_of_blocks = out_of_blocks_error(manager)

    def locked_node(self, seq_id) -> RadixNode | None:
        """The node a sequence keeps locked (``None`` if it holds no lock)."""
        return self._locks.get(seq_id)

    def _lock(self, seq_id, node: RadixNode) -> None:
        """Make ``node`` the one lock of ``seq_id`` (lock the new node before unlocking the old one)."""
        self.tree.lock(node)
        old = self._locks.pop(seq_id, None)
        if old is not None:
            self.tree.unlock(old)
        self._locks[seq_id] = node

    # ------------------------------------------------------------------ task 2: bookkeeping
    # yaie: task 2
    def match(self, tokens) -> int:
        """Tokens a new sequence with these ``tokens`` would read from the cache: the cached whole-block
        prefix of ``tokens[:-1]`` (the last token is always computed: its logits pick the next token).

        A question, not a use: it changes nothing (no edge is split, no ``last_access`` refreshed; the
        tree's read-only ``_walk``), so a scheduler may ask it every step for a request that keeps waiting.

        Raises:
            ValueError: ``tokens`` empty or not a sequence of non-negative ints.
        """
        tokens = check_token_ids(tokens)
        if not tokens:
            raise ValueError("tokens must not be empty")
        return self.tree._walk(tokens[:-1])[1]

    # yaie: task 2
    def make_room(self, num_blocks: int) -> bool:
        """Evict unlocked cached prefixes (least recently used first) until ``num_blocks`` blocks are free.

        Returns:
            True when ``manager.num_free_blocks >= num_blocks`` afterwards.
        Raises:
            ValueError: ``num_blocks`` not an int >= 0.
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        while self.manager.num_free_blocks < num_blocks:
            if not self.evict(num_blocks - self.manager.num_free_blocks):
                return False
        return True

    # yaie: task 2
    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` blocks from the tree (:meth:`RadixAttentionBlock.evict`) and drop the
        tree's reference to each (a block nobody else holds becomes free). Returns the evicted ids.

        Raises:
            ValueError: ``num_blocks`` not an int >= 0.
        """
        freed = self.tree.evict(num_blocks)
        self.manager.drop_references(freed)
        self.stats.evicted_blocks += len(freed)
        return freed

    # yaie: task 2
    def allocate(self, seq_id, tokens) -> PrefixAllocation:
        """Start a sequence for prompt ``tokens``, reusing the longest cached prefix.

        Matches ``tokens[:-1]`` (see :meth:`match`), locks the matched node, starts the sequence's block
        table with the matched blocks (one more reference each), and reserves slots for the other tokens,
        evicting unlocked prefixes first when the free blocks are too few (:meth:`make_room`).

        Returns:
            :class:`PrefixAllocation` ``(num_cached, slot_mapping)`` of the new tokens.

        Raises:
            ValueError: ``seq_id`` already in the cache; ``tokens`` empty or not token ids.
            OutOfBlocks (the manager's): not enough blocks even after evicting; the sequence is not
                created, the lock is released (evictions already done stay done).
        """
        tokens = check_token_ids(tokens)
        if not tokens:
            raise ValueError("tokens must not be empty")
        if self.manager.has_seq(seq_id):
            raise ValueError(f"sequence {seq_id!r} is already in the cache (free it first)")
        found = self.tree.match_prefix(tokens[:-1])
        self.tree.lock(found.node)                       # before evicting: our prefix must stay
        size = self.manager.block_size
        needed = -(-len(tokens) // size) - len(found.blocks)
        self.make_room(needed)
        try:
            self.manager.adopt(seq_id, found.blocks, found.num_tokens)
            slots = self.manager.append_slots(seq_id, len(tokens) - found.num_tokens)
        except self._out_of_blocks:
            if self.manager.has_seq(seq_id):
                self.manager.free(seq_id)                 # drops the references to the shared blocks again
            self.tree.unlock(found.node)
            raise
        self._locks[seq_id] = found.node
        self.stats.requests += 1
        self.stats.prompt_tokens += len(tokens)
        self.stats.cached_tokens += found.num_tokens
        return PrefixAllocation(found.num_tokens, slots)

    # yaie: task 2
    def append_slots(self, seq_id, n: int = 1) -> torch.Tensor:
        """``manager.append_slots(seq_id, n)``, evicting unlocked prefixes when the free blocks run out.

        Raises:
            ValueError: as the manager's ``append_slots``.
            OutOfBlocks: not enough blocks even after evicting everything evictable (nothing changes).
        """
        while True:
            try:
                return self.manager.append_slots(seq_id, n)
            except self._out_of_blocks:
                if not self.evict(1 + n // self.manager.block_size):
                    raise

    # yaie: task 2
    def cache_sequence(self, seq_id, tokens) -> int:
        """Put the computed whole blocks of a resident sequence into the tree.

        The sequence holds ``manager.num_tokens(seq_id)`` computed tokens; ``tokens`` are their ids (more are
        allowed: a sampled token not yet fed). Its whole blocks are inserted; the blocks the tree takes get
        one more reference (the tree's). The sequence's lock moves to the node of its whole blocks, so what
        it reads stays cached while it runs.

        Returns:
            Tokens of the sequence now in the tree (a multiple of ``block_size``).
        Raises:
            ValueError: unknown or swapped-out sequence; fewer ``tokens`` than the sequence holds; bad tokens.
        """
        tokens = check_token_ids(tokens)
        computed = self.manager.num_tokens(seq_id)
        table = self.manager.block_ids(seq_id)            # ValueError if unknown or swapped out
        if len(tokens) < computed:
            raise ValueError(f"sequence {seq_id!r} holds {computed} tokens, got only {len(tokens)} token ids")
        whole = computed // self.manager.block_size
        prefix = tokens[:whole * self.manager.block_size]
        taken = self.tree.insert(prefix, table[:whole])
        self.manager.add_references(taken)
        self._lock(seq_id, self.tree.match_prefix(prefix).node)
        return len(prefix)

    # yaie: task 2
    def release_lock(self, seq_id) -> None:
        """Forget the lock of ``seq_id`` (before it is swapped out to host memory, or freed). No error if it
        holds none."""
        node = self._locks.pop(seq_id, None)
        if node is not None:
            self.tree.unlock(node)

    # yaie: task 2
    def free(self, seq_id, tokens=None) -> None:
        """End a sequence: cache its computed blocks first (when ``tokens`` are given and it is resident),
        release its lock, drop its references (``manager.free``). Blocks the tree holds stay cached.

        Raises:
            ValueError: unknown sequence; ``tokens`` shorter than the sequence.
        """
        if not self.manager.has_seq(seq_id):
            raise ValueError(f"unknown sequence id {seq_id!r}")
        if tokens is not None and not self.manager.is_swapped(seq_id):
            self.cache_sequence(seq_id, tokens)
        self.release_lock(seq_id)
        self.manager.free(seq_id)

    # yaie: task 2
    def clear(self) -> int:
        """Evict every unlocked cached prefix (:meth:`evict` of all the tree's blocks); the prefixes that live
        sequences hold locked stay. Returns how many blocks the tree gave back."""
        return len(self.evict(self.tree.num_cached_blocks))

    # ------------------------------------------------------------------ task 2: attention
    # yaie: task 2
    def prefill_attention(self, layer: int, seq_ids, query_lens, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Attention of the new tokens of a batch of prefilling sequences over their cached prefixes.

        Sequence ``seq_ids[i]`` holds ``manager.num_tokens(seq_ids[i])`` tokens, of which the last
        ``query_lens[i]`` are new (after :meth:`allocate`: ``len(tokens) - num_cached``); their rows of
        ``q, k, v`` are packed sequence after sequence. The new keys and values are written into the cache
        (``manager.write_kv`` at the sequence's slots, for the decode steps that follow), then lesson 05's
        ``prefix_prefill_attention`` (task 4, called through :func:`yaie.ops.lessons.call_in`; keep its output, not
        its log-sum-exp) attends each new query to its sequence's cached tokens, read through the block
        table, and causally to the new tokens.

        Args:
            layer: which layer's cache.
            seq_ids: resident sequences. query_lens: ints, ``1 .. manager.num_tokens(s)`` each.
            q: ``[total_new, num_heads, head_dim]``; k, v: ``[total_new, num_kv_heads, head_dim]`` in the
                cache's dtype, on its device; ``total_new = sum(query_lens)``.
            scale: softmax scale; default ``1 / sqrt(head_dim)``.

        Returns:
            ``[total_new, num_heads, head_dim]``.
        Raises:
            ValueError: empty or mismatched ``seq_ids`` / ``query_lens``; a query length out of range; rows
                of ``q`` not ``sum(query_lens)``; as ``write_kv`` and the kernel for shapes, dtypes, devices.
        """
        seq_ids, query_lens = list(seq_ids), list(query_lens)
        if not seq_ids or len(seq_ids) != len(query_lens):
            raise ValueError(f"need one query length per sequence and at least one sequence, got "
                             f"{len(seq_ids)} sequences and {len(query_lens)} query lengths")
        held = [self.manager.num_tokens(s) for s in seq_ids]     # ValueError for an unknown sequence
        for seq_id, n, total in zip(seq_ids, query_lens, held):
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= total:
                raise ValueError(f"query length of sequence {seq_id!r} must be an int in 1..{total} "
                                 f"(the tokens it holds), got {n!r}")
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != sum(query_lens):
            shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be [total_new, num_heads, head_dim] with total_new = sum(query_lens) = "
                             f"{sum(query_lens)}, got {shape}")
        size = self.manager.block_size
        slots = []
        for seq_id, n, total in zip(seq_ids, query_lens, held):
            table = torch.tensor(self.manager.block_ids(seq_id), dtype=torch.int64)
            positions = torch.arange(total - n, total)
            slots.append(table[positions // size] * size + positions % size)
        cu_seqlens_q = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        context_lens = torch.tensor([t - n for t, n in zip(held, query_lens)], dtype=torch.int32).to(q.device)
        args = (q, k, v, self.manager.k_cache[layer], self.manager.v_cache[layer], self.manager.block_table(seq_ids),
                cu_seqlens_q, context_lens, max(query_lens))
        # Every check the kernel would make, BEFORE the cache is written: bad input changes nothing.
        lessons.call_in(5, 1, "check_prefix_prefill_inputs", *args, scale=scale)
        self.manager.write_kv(layer, torch.cat(slots).to(self.manager.device), k, v)
        out, _ = lessons.call_in(5, 1, "prefix_prefill_attention", *args, scale=scale)
        return out
