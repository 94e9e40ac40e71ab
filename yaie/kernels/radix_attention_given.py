"""Lesson 05, part 0: the given code of the radix-tree exercises (``yaie/kernels/radix_attention.py``).

Read it, do not edit it: the exercise module imports these names (``radix_attention.RadixNode``,
``radix_attention.PrefixMatch`` work as before), and the graders and the engine rely on them as they are.

* the tree's records: :class:`RadixNode` (one node, its edge of whole blocks) and :class:`PrefixMatch` (what a
  match found), and :class:`RadixAttentionBlockGiven`, the given queries ``RadixAttentionBlock`` inherits;
* the prefix cache's records: :class:`PrefixCacheStats` (hit statistics) and :class:`PrefixAllocation`
  (what allocating a new sequence did);
* small helpers: ``check_token_ids`` (token ids as a list, checked), ``out_of_blocks_error`` (the
  manager's own ``OutOfBlocks`` class).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# ---------------------------------------------------------------------------------------------------
# The radix tree's records (task 1)
# ---------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class RadixNode:
    """One node of the tree: the edge from its parent, labelled with whole blocks of token ids.

    Attributes:
        tokens: the token ids on the edge into this node (a multiple of ``block_size`` of them; the root's
            edge is empty).
        blocks: the KV-cache block ids of those tokens, one per ``block_size`` tokens, in order.
        parent: the node above (``None`` for the root, and for a node removed from the tree).
        children: child nodes keyed by the first block of their edge (a tuple of ``block_size`` token ids):
            two children never start with the same block.
        lock_count: how many locks are held on this node or on nodes below it (0: evictable).
        last_access: the tree's clock at the last match or insert that went through this node (LRU).
    """

    tokens: tuple[int, ...] = ()
    blocks: list[int] = field(default_factory=list)
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:   # short: the tree is recursive
        return (f"RadixNode({len(self.tokens)} tokens, blocks {self.blocks}, {len(self.children)} children, "
                f"locks {self.lock_count})")


@dataclass
class PrefixMatch:
    """What :meth:`RadixAttentionBlock.match_prefix` found.

    Attributes:
        num_tokens: length of the cached prefix (a multiple of ``block_size``).
        blocks: its block ids, in order (``num_tokens // block_size`` of them).
        node: the node where the prefix ends (the root when nothing matched): lock it to keep the prefix.
    """

    num_tokens: int
    blocks: list[int]
    node: RadixNode


def check_token_ids(token_ids, what: str = "tokens") -> list[int]:
    """A list of non-negative int token ids (a 1-D integer tensor is accepted too)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError(f"{what} must be a 1-D integer tensor or a list of ints, got a "
                             f"{token_ids.dim()}-D {token_ids.dtype} tensor")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(f"{what} must be a list of int token ids, got {type(token_ids).__name__}")
    token_ids = list(token_ids)
    # The common case in one pass at C speed (an engine checks thousands of ids per request); the loop
    # below only runs to name the offending id.
    if set(map(type, token_ids)) <= {int} and (not token_ids or min(token_ids) >= 0):
        return token_ids
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"{what} must hold non-negative int token ids, got {t!r}")
    return token_ids


class RadixAttentionBlockGiven:
    """The given methods of ``RadixAttentionBlock`` (``yaie/kernels/radix_attention.py``), which inherits them:
    queries and small helpers. The exercise's ``__init__`` sets the state they use: ``block_size``, ``root``
    (a :class:`RadixNode` with an empty edge) and ``_owner`` (block id -> the node that owns it).
    """

    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the tree owns."""
        return len(self._owner)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks of unlocked nodes: what :meth:`evict` could give back now (all of an unlocked node's
        descendants are unlocked too, so eviction can reach them leaf by leaf)."""
        return sum(n.num_blocks for n in self.nodes() if n.lock_count == 0)

    def cached_blocks(self) -> list[int]:
        """Every block id the tree owns."""
        return list(self._owner)

    def owns(self, block_id: int) -> bool:
        return block_id in self._owner

    def _key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        """The block of tokens starting at ``start``: how children are looked up."""
        return tuple(tokens[start:start + self.block_size])

    def _check_node(self, node) -> None:
        """``node`` must be a node of this tree (the root included) that was not removed."""
        if not isinstance(node, RadixNode):
            raise ValueError(f"expected a RadixNode (from match_prefix), got {type(node).__name__}")
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            raise ValueError("this node is not in the tree (it was evicted, or belongs to another tree)")


# ---------------------------------------------------------------------------------------------------
# The prefix cache's records (task 2)
# ---------------------------------------------------------------------------------------------------


@dataclass
class PrefixCacheStats:
    """Hit statistics: how many prompt tokens came from the cache instead of being computed."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0       # tokens reused (not prefilled)
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class PrefixAllocation:
    """What :meth:`RadixAttentionWithPagedKVCache.allocate` did for a new sequence.

    Attributes:
        num_cached: tokens read from the cache (a multiple of ``block_size``, less than the prompt).
        slot_mapping: int64 ``[len(tokens) - num_cached]`` on the cache's device: the slots of the new
            tokens (positions ``num_cached ..``), to write their K/V to.
    """

    num_cached: int
    slot_mapping: torch.Tensor


def out_of_blocks_error(manager) -> type:
    """The ``OutOfBlocks`` class of the manager's own module (the student's or the reference)."""
    import importlib
    return getattr(importlib.import_module(type(manager).__module__), "OutOfBlocks", RuntimeError)
