"""Lesson 03: the given code of the paged-KV-cache exercises (``yaie/kernels/kv_cache.py``).

Read it, do not edit it: the exercise module imports these names (``kv_cache.OutOfBlocks``,
``kv_cache.FreeBlocks`` work as before), and the graders and the engine rely on them as they are.

* constants: the cache dtypes, ``DEFAULT_ALIGNMENT`` of the memory pool, ``PAGE_BYTES`` (the GPU's large page);
* the errors the tasks raise: :class:`OutOfBlocks` (the manager) and :class:`PoolExhausted` (the pool);
* :func:`resolve_device`, :class:`KVCacheBlock` (one block's reference count) and :class:`FreeBlocks` (the
  manager's free list, grouped by page), and the small checks the manager's constructor uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_ALIGNMENT = 256     # bytes: enough for any dtype and for 128-byte aligned vector loads
PAGE_BYTES = 2 << 20        # the GPU's large memory page: block placement matters at this scale (see FreeBlocks)


class OutOfBlocks(RuntimeError):
    """Not enough free blocks (device or host) for the request. The manager is left exactly as it was."""


class PoolExhausted(RuntimeError):
    """The memory pool has no free range large enough for the request. The pool is left as it was."""


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cuda"`` -> ``cuda:0`` (the current GPU): tensors report an index, so compare with one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class KVCacheBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V cache.

    ``ref_count`` is the number of sequences whose block table holds this block (0: the block is free).
    ``on_host`` says whether the id counts in the device cache (False) or the host swap space (True).
    """

    block_id: int
    ref_count: int = 0
    on_host: bool = False

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FreeBlocks:
    """The free device blocks, grouped by **page**: ``blocks_per_page`` consecutive block ids, whose bytes
    share one 2 MiB stretch of each layer's cache (given code: the manager's free list).

    Where a sequence's blocks lie matters to the decode kernel of lesson 04. Measured on an H200
    (bench/README.md, lessons 03 and 04): blocks shuffled only *within* each 2 MiB decode as fast as blocks in
    order, while 64-token runs scattered over random pages are as slow as a full shuffle, 0.1-1.8% slower
    (the GPU translates an address per page, and a program that wanders over many pages waits for more
    translations). A plain stack of free ids scatters a long-running server's sequences over the whole
    cache. So :meth:`pop` takes ``near``, the sequence's last block: it hands out a free block from that
    block's page when there is one, otherwise one from the page with the most free blocks (room to grow
    there). A new sequence therefore starts on an empty page if there is one, and a growing one stays on
    its pages. Within a page the most recently freed block goes first.

    ``len()`` is the number of free blocks; ``append(block_id)`` gives one back. Costs O(1) per call, plus a
    scan of at most ``blocks_per_page`` buckets when a sequence has to move to another page.
    """

    def __init__(self, num_blocks: int, blocks_per_page: int):
        self.blocks_per_page = max(1, blocks_per_page)
        pages = _cdiv(num_blocks, self.blocks_per_page)
        # Per page, a stack of its free ids (lowest id on top, so a fresh cache fills in order).
        self._stacks = [list(range(min(num_blocks, (p + 1) * self.blocks_per_page) - 1, p * self.blocks_per_page - 1, -1))
                        for p in range(pages)]
        # _buckets[n]: the pages with exactly n free blocks (insertion-ordered dicts used as sets).
        self._buckets: list[dict[int, None]] = [{} for _ in range(self.blocks_per_page + 1)]
        for page, stack in enumerate(self._stacks):
            self._buckets[len(stack)][page] = None
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def _take_from(self, page: int) -> int:
        stack = self._stacks[page]
        del self._buckets[len(stack)][page]
        block_id = stack.pop()
        self._buckets[len(stack)][page] = None
        self._count -= 1
        return block_id

    def pop(self, near: int | None = None) -> int:
        """A free block id: from ``near``'s page if it has one, else from the page with the most free blocks.
        Raises ``IndexError`` when none is free (the manager checks room first)."""
        if self._count == 0:
            raise IndexError("no free block")
        if near is not None and self._stacks[near // self.blocks_per_page]:
            return self._take_from(near // self.blocks_per_page)
        for free in range(self.blocks_per_page, 0, -1):      # the emptiest page
            if self._buckets[free]:
                return self._take_from(next(iter(self._buckets[free])))
        raise AssertionError("unreachable: the count says a block is free")

    def append(self, block_id: int) -> None:
        page = block_id // self.blocks_per_page
        stack = self._stacks[page]
        del self._buckets[len(stack)][page]
        stack.append(block_id)
        self._buckets[len(stack)][page] = None
        self._count += 1


def _check_count(name: str, value, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
