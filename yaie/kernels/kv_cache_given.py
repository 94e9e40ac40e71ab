"""Lesson 03: the given code of the paged-KV-cache exercises (``yaie/kernels/kv_cache.py``).

Read it, do not edit it: the exercise module imports these names (``kv_cache.OutOfBlocks``,
``kv_cache.FreeBlocks`` work as before), and the graders and the engine rely on them as they are.

* constants: the cache dtypes, ``DEFAULT_ALIGNMENT`` of the memory pool, ``PAGE_BYTES`` (the GPU's large page);
* the errors the tasks raise: :class:`OutOfBlocks` (the manager) and :class:`PoolExhausted` (the pool);
* :func:`resolve_device`, :class:`KVCacheBlock` (one block's reference count) and :class:`FreeBlocks` (the
  manager's free list, grouped by page), and the small checks the manager's constructor uses;
* :class:`KVCacheManagerGiven`: the given methods ``KVCacheManager`` inherits (queries, checks, reference
  counts, slot numbers); they read the state that ``KVCacheManager.__init__`` sets.
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


def cdiv(a: int, b: int) -> int:
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
        pages = cdiv(num_blocks, self.blocks_per_page)
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


def check_count(name: str, value, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class KVCacheManagerGiven:
    """The given methods of ``KVCacheManager`` (``yaie/kernels/kv_cache.py``), which inherits them: queries,
    input checks, reference counts of blocks, slot numbers. The exercise's ``__init__`` sets the state they use:

    ``block_size``, ``num_blocks``, ``num_cpu_blocks``, ``device``; ``blocks`` / ``cpu_blocks`` (a
    :class:`KVCacheBlock` per device / host block id); ``_free`` (:class:`FreeBlocks`, the free device blocks);
    ``_cpu_free`` (a stack of free host block ids); ``_tables`` (seq id -> device block ids of a resident
    sequence), ``_lens`` (seq id -> tokens held), ``_swapped`` (seq id -> host block ids of a swapped-out
    sequence); ``_slot_ids`` (every slot id on the device, made on first use by :meth:`_all_slots`).
    """

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits in the free device blocks now."""
        return cdiv(check_count("num_tokens", num_tokens), self.block_size) <= len(self._free)

    def has_seq(self, seq_id) -> bool:
        return seq_id in self._lens

    def is_swapped(self, seq_id) -> bool:
        return seq_id in self._swapped

    def seq_ids(self) -> list:
        """Every known sequence, resident or swapped out."""
        return list(self._lens)

    def num_tokens(self, seq_id) -> int:
        """Tokens the sequence holds (slots handed out by ``allocate``/``append_slots``)."""
        self._check_known(seq_id)
        return self._lens[seq_id]

    def block_ids(self, seq_id) -> list[int]:
        """The device block ids of a resident sequence, in logical order (a copy)."""
        self._check_resident(seq_id)
        return list(self._tables[seq_id])

    def _check_known(self, seq_id) -> None:
        if seq_id not in self._lens:
            raise ValueError(f"unknown sequence id {seq_id!r}")

    def _check_resident(self, seq_id) -> None:
        self._check_known(seq_id)
        if seq_id in self._swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out to host memory: swap_in first")

    def _resident_list(self, seq_ids, what: str) -> list:
        """``seq_ids`` as a list, checked: not empty, every one known and on the device."""
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError(f"{what} needs at least one sequence id")
        for seq_id in seq_ids:
            self._check_resident(seq_id)
        return seq_ids

    def _take_blocks(self, count: int, near: int | None = None) -> list[int]:
        """Pop ``count`` free device blocks and set their reference count to 1 (caller checked room).

        ``near``: the block the new ones follow (a sequence's last block), so they are taken from its page
        when it has room (:class:`FreeBlocks`); each new block is then ``near`` for the next one.
        """
        ids = []
        for _ in range(count):
            near = self._free.pop(near)
            self.blocks[near].ref_count = 1
            ids.append(near)
        return ids

    def _release(self, block_id: int) -> None:
        """Drop one reference to a device block; it becomes free when nobody holds it."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free.append(block_id)

    def add_references(self, block_ids) -> None:
        """One more owner for each device block: an owner outside the sequences, such as lesson 05's tree of
        cached prefixes. Give each back with :meth:`drop_references`."""
        self._hold(block_ids)

    def _hold(self, block_ids) -> None:
        for block_id in block_ids:                    # check them all first: nothing changes on an error
            if self.blocks[block_id].ref_count < 1:
                raise ValueError(f"block {block_id} is free: only a block in use can get another owner")
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1

    def drop_references(self, block_ids) -> None:
        """One owner less for each device block; a block nobody owns goes back to the free list."""
        for block_id in block_ids:
            self._release(block_id)

    def adopt(self, seq_id, block_ids: list[int], num_tokens: int) -> None:
        """Start ``seq_id`` on blocks already in use (a cached prefix): its first ``num_tokens`` tokens are
        theirs, and it becomes one more owner of each. ``append_slots`` continues after them.

        Raises:
            ValueError: the id is in use, a block is free, or ``num_tokens`` does not fit the blocks.
        """
        if seq_id in self._lens:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not (len(block_ids) - 1) * self.block_size < num_tokens <= len(block_ids) * self.block_size:
            raise ValueError(f"{num_tokens} tokens do not fill the last of {len(block_ids)} blocks of "
                             f"{self.block_size}")
        self._hold(block_ids)
        self._tables[seq_id] = list(block_ids)
        self._lens[seq_id] = num_tokens

    def _slots(self, table: list[int], start: int, count: int) -> torch.Tensor:
        """Slot indices (int64, on the cache's device) of logical tokens ``start .. start+count-1``.

        Tokens that fall in one block have consecutive slots: they are returned as a slice of one device
        tensor holding every slot id (made once), which costs neither a copy nor a kernel. A decode step
        asks for one slot per sequence; building each from a Python list instead would be a
        host-to-device copy per sequence per step (tens of microseconds each on a GPU). The slice shares
        memory with that tensor: read it, never write into it.
        """
        size = self.block_size
        offset = start % size
        if 0 < count and offset + count <= size:
            first = table[start // size] * size + offset
            return self._all_slots()[first:first + count]
        positions = torch.arange(start, start + count)
        ids = torch.tensor(table, dtype=torch.int64)
        slots = ids[positions // size] * size + positions % size
        return slots.to(self.device)

    def _all_slots(self) -> torch.Tensor:
        """``arange(num_blocks * block_size)`` on the cache's device, made on first use."""
        if self._slot_ids is None:
            self._slot_ids = torch.arange(self.num_blocks * self.block_size, dtype=torch.int64, device=self.device)
        return self._slot_ids

    def _out_of_blocks(self, needed: int, what: str) -> OutOfBlocks:
        return OutOfBlocks(f"{what} needs {needed} free device blocks, only {len(self._free)} of "
                           f"{self.num_blocks} are free (block_size {self.block_size}); free or swap out a "
                           "sequence and retry")

    def append_slot(self, seq_id) -> torch.Tensor:
        """``append_slots(seq_id, 1)``: the one slot of the next decoded token (int64 ``[1]``)."""
        return self.append_slots(seq_id, 1)

    def _check_block_ids(self, block_ids, limit: int, where: str) -> list[int]:
        ids = list(block_ids)
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < limit for b in ids):
            raise ValueError(f"{where}: block ids must be ints in 0..{limit - 1}, got {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{where}: block ids must be distinct, got {ids}")
        return ids
