"""Lesson 03: the paged KV cache.

During decoding every layer keeps the keys and values of all earlier tokens of every running sequence.
Storing each sequence's cache as one contiguous tensor sized for its maximum length wastes most of the
memory (sequences end early, lengths are unknown in advance) and fragments it. A *paged* cache cuts the
memory into fixed-size **blocks** of ``block_size`` tokens, like pages of virtual memory:

* each sequence owns a list of block ids, its **block table**; logical token ``t`` of the sequence lives
  in physical block ``table[t // block_size]`` at offset ``t % block_size``;
* a sequence grows by one block at a time, so at most ``block_size - 1`` slots per sequence are wasted;
* blocks are **reference counted**, so sequences can share them: ``fork`` gives a child the parent's
  blocks (parallel sampling, beam search) and only the block that is written next is copied
  (**copy-on-write**);
* when the device runs out of blocks, a whole sequence can be **swapped** to host memory and back.

Layout, one tensor pair per layer::

    k_cache[layer], v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

Token-major inside a block: one token's vector of one head is ``head_dim`` contiguous elements, so a
kernel reads it with wide, coalesced loads. A **slot** is ``block_id * block_size + offset``; viewing a
layer's cache as ``[num_blocks * block_size, num_kv_heads, head_dim]`` the slot is the row index.

The cache tensors are *views into one preallocated byte arena* (:class:`MemoryPool`): the memory is
reserved once when the engine starts, and serving never calls the device allocator.

Tasks (in order): 1 the memory pool, 2 block bookkeeping (allocate, append, free, tables),
3 writing K/V, block copies and fork with copy-on-write, 4 swapping to and from host memory.
"""

from __future__ import annotations


import torch

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/kv_cache_given.py
from yaie.kernels.kv_cache_given import (
    DEFAULT_ALIGNMENT, FreeBlocks, KVCacheBlock, KVCacheManagerGiven, OutOfBlocks, PAGE_BYTES, PoolExhausted,
    SUPPORTED_DTYPES, cdiv, check_count, resolve_device,
)


# ---------------------------------------------------------------------------------------------------
# Task 1: the memory pool
# ---------------------------------------------------------------------------------------------------

class MemoryPool:
    """A first-fit allocator over ONE preallocated byte arena (``torch.uint8`` of ``capacity_bytes``).

    ``allocate`` returns an integer **handle**: the byte offset of the allocation inside the arena (the
    device address is ``pool.arena.data_ptr() + handle``). ``view`` turns a handle into a typed tensor
    that shares the arena's memory. ``free`` gives the range back and merges it with free neighbours
    (coalescing), so that freeing everything always leaves one free range of ``capacity_bytes``.

    Bookkeeping (given): ``self.free_ranges`` is a list of ``(offset, size)`` sorted by offset, never
    two touching; ``self.allocations`` maps a handle to ``(start, size)``, the range taken from the free
    list (``start <= handle``: the bytes skipped for alignment belong to the allocation).
    """

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu"):
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity = capacity_bytes
        self.device = resolve_device(device)
        # The one and only device allocation of the pool's life.
        self.arena = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        self.free_ranges: list[tuple[int, int]] = [(0, capacity_bytes)]
        self.allocations: dict[int, tuple[int, int]] = {}

    @property
    def free_bytes(self) -> int:
        """Bytes in free ranges (not all usable by one request when fragmented)."""
        return sum(size for _, size in self.free_ranges)

    @property
    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes

    @property
    def largest_free(self) -> int:
        """The largest single free range: the biggest request that can still succeed (alignment 1)."""
        return max((size for _, size in self.free_ranges), default=0)

    # yaie: task 1
    def allocate(self, size: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
        """Reserve ``size`` bytes starting at a multiple of ``alignment``; return the handle (byte offset).

        First fit: take the first free range (lowest offset) that holds ``size`` bytes after rounding its
        start up to ``alignment``. The range is cut in up to three: the alignment gap (kept by the
        allocation, freed with it), the ``size`` bytes, and the remainder (stays free).

        Raises:
            ValueError: ``size`` not a positive int, or ``alignment`` not a positive power of two.
            PoolExhausted: no free range is large enough (the pool is unchanged).
        """
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"size must be a positive int (bytes), got {size!r}")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        for index, (start, free_size) in enumerate(self.free_ranges):
            handle = -(-start // alignment) * alignment          # round the start up
            end = handle + size
            if end > start + free_size:
                continue
            rest = start + free_size - end
            self.free_ranges[index:index + 1] = [(end, rest)] if rest else []
            self.allocations[handle] = (start, end - start)
            return handle
        raise PoolExhausted(
            f"memory pool: no free range holds {size} bytes aligned to {alignment} "
            f"({self.free_bytes} bytes free in {len(self.free_ranges)} ranges, the largest {self.largest_free})")

    # yaie: task 1
    def free(self, handle: int) -> None:
        """Give an allocation back and merge it with the free ranges just before and after it.

        Raises:
            ValueError: ``handle`` is not a live allocation (never allocated, or already freed).
        """
        if handle not in self.allocations:
            raise ValueError(f"memory pool: {handle!r} is not a live allocation (double free or a wrong handle)")
        start, size = self.allocations.pop(handle)
        ranges = self.free_ranges
        # Insert in offset order, then merge with the neighbour on each side if they touch.
        index = 0
        while index < len(ranges) and ranges[index][0] < start:
            index += 1
        ranges.insert(index, (start, size))
        if index + 1 < len(ranges) and start + size == ranges[index + 1][0]:
            ranges[index] = (start, size + ranges[index + 1][1])
            del ranges[index + 1]
        if index > 0 and ranges[index - 1][0] + ranges[index - 1][1] == start:
            ranges[index - 1] = (ranges[index - 1][0], ranges[index - 1][1] + ranges[index][1])
            del ranges[index]

    # yaie: task 1
    def view(self, handle: int, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` over the allocation's bytes (no copy, no new memory).

        Raises:
            ValueError: unknown handle; the tensor would not fit in the allocation; the handle is not a
                multiple of the dtype's size.
        """
        if handle not in self.allocations:
            raise ValueError(f"memory pool: {handle!r} is not a live allocation")
        start, size = self.allocations[handle]
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must not have negative sizes, got {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * itemsize
        if handle + nbytes > start + size:
            raise ValueError(f"a {shape} {dtype} tensor needs {nbytes} bytes; allocation {handle} has "
                             f"{start + size - handle}")
        if handle % itemsize:
            raise ValueError(f"offset {handle} is not aligned to {dtype}'s {itemsize} bytes")
        return self.arena[handle:handle + nbytes].view(dtype).view(shape)


_default_pool: MemoryPool | None = None


def init_memory_pool(capacity_bytes: int, device: str | torch.device = "cpu") -> MemoryPool:
    """Create (or replace) the default pool used by :func:`memory_pool_allocate` / :func:`memory_pool_free`."""
    global _default_pool
    _default_pool = MemoryPool(capacity_bytes, device)
    return _default_pool


def default_memory_pool() -> MemoryPool:
    """The default pool; ``ValueError`` if :func:`init_memory_pool` was not called."""
    if _default_pool is None:
        raise ValueError("no default memory pool: call init_memory_pool(capacity_bytes, device) first")
    return _default_pool


def memory_pool_allocate(size: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Allocate ``size`` bytes from the default pool; returns the handle (a byte offset in its arena)."""
    return default_memory_pool().allocate(size, alignment)


def memory_pool_free(ptr: int) -> None:
    """Free a handle returned by :func:`memory_pool_allocate`."""
    default_memory_pool().free(ptr)


# ---------------------------------------------------------------------------------------------------
# Tasks 2-4: blocks and the manager
# ---------------------------------------------------------------------------------------------------

class KVCacheManager(KVCacheManagerGiven):
    """Block bookkeeping and storage of the paged KV cache of a whole model.

    Args:
        num_blocks: device blocks (each ``block_size`` tokens in every layer).
        block_size: tokens per block, 1 to 1024 (the kernels of lesson 04 take 8 to 128).
        num_layers, num_kv_heads, head_dim: the model's shape.
        dtype: float16, bfloat16 or float32.
        device: where the cache lives ("cuda" or "cpu").
        num_cpu_blocks: host blocks for swapping (pinned memory when CUDA is present).
        pool: a :class:`MemoryPool` on ``device`` to carve the caches from; default: a new pool sized
            exactly for them.
        page_bytes: the stretch of one layer's cache within which the free list keeps a sequence's blocks
            together (:class:`FreeBlocks`); default 2 MiB, the GPU's large page.

    Attributes (read them, do not change them from outside):
        k_cache, v_cache: lists (one per layer) of ``[num_blocks, block_size, num_kv_heads, head_dim]``
            tensors, views into the pool's arena.
        cpu_k_cache, cpu_v_cache: the same on the host with ``num_cpu_blocks`` blocks.
        blocks, cpu_blocks: ``KVCacheBlock`` per device / host block id.

    Every public method checks its input first and raises ``ValueError`` (bad input) or
    :class:`OutOfBlocks` (no room) *before* changing anything: an error never leaves a half-done update.

    The given methods (queries such as ``num_free_blocks`` and ``block_ids``, checks, ``_take_blocks`` /
    ``_release`` and the other reference-count helpers, ``_slots``) are inherited from
    ``KVCacheManagerGiven`` in ``yaie/kernels/kv_cache_given.py``; ``__init__`` below sets the state they use.
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu", num_cpu_blocks: int = 0,
                 pool: MemoryPool | None = None, page_bytes: int = PAGE_BYTES):
        check_count("num_blocks", num_blocks, 1)
        check_count("block_size", block_size, 1)
        if block_size > 1024:
            raise ValueError(f"block_size must be at most 1024, got {block_size}")
        check_count("num_layers", num_layers, 1)
        check_count("num_kv_heads", num_kv_heads, 1)
        check_count("head_dim", head_dim, 1)
        check_count("num_cpu_blocks", num_cpu_blocks, 0)
        check_count("page_bytes", page_bytes, 1)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, resolve_device(device)
        self.num_cpu_blocks = num_cpu_blocks

        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        nbytes = num_blocks * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if pool is None:
            per_tensor = cdiv(nbytes, DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
            pool = MemoryPool(2 * num_layers * per_tensor, self.device)
        elif pool.device != self.device:
            raise ValueError(f"the pool is on {pool.device}, the cache must be on {self.device}")
        self.pool = pool
        self._handles = [pool.allocate(nbytes) for _ in range(2 * num_layers)]
        self.k_cache = [pool.view(h, shape, dtype) for h in self._handles[0::2]]
        self.v_cache = [pool.view(h, shape, dtype) for h in self._handles[1::2]]

        pin = self.device.type == "cuda" and torch.cuda.is_available()
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.cpu_k_cache = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_v_cache = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.cpu_blocks = [KVCacheBlock(i, on_host=True) for i in range(num_cpu_blocks)]
        # Device blocks: a free list that keeps each sequence on few 2 MiB pages (FreeBlocks). Host blocks: a
        # stack (the most recently freed goes first; placement in pinned memory does not matter).
        block_bytes = nbytes // num_blocks                   # one block of one layer's K (or V)
        self._free = FreeBlocks(num_blocks, page_bytes // block_bytes)
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self._tables: dict[object, list[int]] = {}       # seq id -> device block ids (resident sequences)
        self._lens: dict[object, int] = {}               # seq id -> tokens stored (resident and swapped)
        self._swapped: dict[object, list[int]] = {}      # seq id -> host block ids (swapped-out sequences)
        self._slot_ids: torch.Tensor | None = None       # every slot id on the device (_all_slots), made on first use

    # ------------------------------------------------------------------ task 2: bookkeeping

    # yaie: task 2
    def allocate(self, seq_id, num_tokens: int) -> torch.Tensor:
        """Register a new sequence and give it blocks for its first ``num_tokens`` tokens (all or nothing).

        Args:
            seq_id: any hashable id not in use.
            num_tokens: tokens to reserve (the prompt); 0 is allowed (no block yet).

        Returns:
            The slot mapping of the tokens: int64 ``[num_tokens]`` on the cache's device; token ``t``
            goes to slot ``table[t // block_size] * block_size + t % block_size``. Callers only read it
            (the reference may return a view of a tensor it shares between calls: see ``_slots``).

        Raises:
            ValueError: ``seq_id`` already in use; ``num_tokens`` not an int >= 0.
            OutOfBlocks: fewer than ``ceil(num_tokens / block_size)`` free blocks (nothing changes).
        """
        if seq_id in self._lens:
            raise ValueError(f"sequence {seq_id!r} is already allocated (free it first)")
        check_count("num_tokens", num_tokens)
        needed = cdiv(num_tokens, self.block_size)
        if needed > len(self._free):
            raise self._out_of_blocks(needed, f"allocate({seq_id!r}, {num_tokens})")
        self._tables[seq_id] = self._take_blocks(needed)
        self._lens[seq_id] = num_tokens
        return self._slots(self._tables[seq_id], 0, num_tokens)

    # yaie: task 2
    def append_slots(self, seq_id, n: int = 1) -> torch.Tensor:
        """Reserve ``n`` more token slots at the end of a resident sequence (all or nothing).

        New blocks are taken only when the last block is full. If the last block is partly filled and
        *shared* (``ref_count > 1``, after a ``fork``), it is first copied to a new block that this
        sequence owns alone (copy-on-write, with :meth:`copy_blocks`): the other owners keep their data.

        Returns:
            The slot mapping of the new tokens: int64 ``[n]`` on the cache's device (read it only, as
            ``allocate``'s).

        Raises:
            ValueError: unknown or swapped-out sequence; ``n`` not an int >= 1.
            OutOfBlocks: not enough free blocks for the growth plus a copy-on-write (nothing changes).
        """
        self._check_resident(seq_id)
        check_count("n", n, 1)
        table, length = self._tables[seq_id], self._lens[seq_id]
        grow = cdiv(length + n, self.block_size) - len(table)
        copy_last = length % self.block_size != 0 and self.blocks[table[-1]].ref_count > 1
        needed = grow + int(copy_last)
        if needed > len(self._free):
            raise self._out_of_blocks(needed, f"append_slots({seq_id!r}, {n})")
        if copy_last:
            (fresh,) = self._take_blocks(1, near=table[-1])
            self.copy_blocks([(table[-1], fresh)])
            self._release(table[-1])
            table[-1] = fresh
        table.extend(self._take_blocks(grow, near=table[-1] if table else None))   # on the same page if it can
        self._lens[seq_id] = length + n
        return self._slots(table, length, n)

    # yaie: task 2
    def free(self, seq_id) -> None:
        """End a sequence: drop its references to its blocks (device or host); shared blocks stay with
        their other owners. The id can be allocated again afterwards.

        Raises:
            ValueError: unknown sequence id (never allocated, or already freed).
        """
        self._check_known(seq_id)
        if seq_id in self._swapped:
            for cpu_id in self._swapped.pop(seq_id):
                self.cpu_blocks[cpu_id].ref_count = 0
                self._cpu_free.append(cpu_id)
        else:
            for block_id in reversed(self._tables.pop(seq_id)):
                self._release(block_id)
        del self._lens[seq_id]

    # yaie: task 2
    def block_table(self, seq_ids) -> torch.Tensor:
        """The block tables of resident sequences as the kernels read them.

        Returns:
            int32 ``[len(seq_ids), max_blocks]`` on the cache's device, row ``i`` the block ids of
            ``seq_ids[i]`` in logical order, padded with 0 (padding is never read: the kernels stop at
            ``context_lens``). ``max_blocks`` is the longest table (at least 1).

        Raises:
            ValueError: empty list; unknown or swapped-out sequence.
        """
        seq_ids = self._resident_list(seq_ids, "block_table")
        width = max(1, max(len(self._tables[s]) for s in seq_ids))
        rows = [self._tables[s] + [0] * (width - len(self._tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32).to(self.device)

    # yaie: task 2
    def context_lens(self, seq_ids) -> torch.Tensor:
        """Tokens held by each sequence: int32 ``[len(seq_ids)]`` on the cache's device.

        Raises:
            ValueError: empty list; unknown or swapped-out sequence.
        """
        seq_ids = self._resident_list(seq_ids, "context_lens")
        return torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32).to(self.device)

    # ------------------------------------------------------------------ task 3: data, copies, fork

    # yaie: task 3
    def write_kv(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 validate: bool = True) -> None:
        """Store the keys and values of new tokens of one layer at their slots.

        Args:
            layer: 0 .. num_layers - 1.
            slot_mapping: integer ``[num_tokens]`` (from ``allocate``/``append_slots``), on the cache's
                device, every entry in ``0 .. num_blocks * block_size - 1``.
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype, on its device.
            validate: also check that every slot is in range. Reading the slot values back costs a
                device-to-host sync on a GPU, once per layer per step; an engine whose slots come from
                ``allocate``/``append_slots`` passes ``False``. The shape, dtype and device checks always run.

        Raises:
            ValueError: bad layer; wrong ranks, shapes, dtypes or devices; with ``validate``, slots out of range.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in 0..{self.num_layers - 1}, got {layer!r}")
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 \
                or slot_mapping.dtype not in (torch.int32, torch.int64):
            raise ValueError("slot_mapping must be a 1-D int32 or int64 tensor")
        expected = (slot_mapping.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim] = {list(expected)}, got {shape}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} must be {self.dtype} (the cache's dtype), got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if slot_mapping.device != self.device:
            raise ValueError(f"slot_mapping must be on {self.device}, got {slot_mapping.device}")
        if slot_mapping.numel() == 0:
            return
        if validate:
            # One check of the whole range: a device-to-host sync on a GPU (the engine skips it).
            low, high = torch.aminmax(slot_mapping)
            if int(low) < 0 or int(high) >= self.num_blocks * self.block_size:
                raise ValueError(f"slot_mapping has slots out of range 0..{self.num_blocks * self.block_size - 1} "
                                 f"(min {int(low)}, max {int(high)})")
        rows = slot_mapping.long()
        # [num_blocks, block_size, H, D] seen as [slots, H, D]: a slot is a row.
        self.k_cache[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, rows, k)
        self.v_cache[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, rows, v)

    # yaie: task 3
    def copy_blocks(self, pairs) -> None:
        """The block-copy op: for each ``(src, dst)`` device block id pair, copy block ``src`` into block
        ``dst`` in every layer's K and V cache. Does not change reference counts or tables.

        Raises:
            ValueError: a pair that is not two block ids in range; a destination used twice or also a source.
        """
        pairs = [tuple(p) for p in pairs]
        for pair in pairs:
            if len(pair) != 2 or not all(isinstance(b, int) and 0 <= b < self.num_blocks for b in pair):
                raise ValueError(f"copy_blocks: each pair must be (src, dst) block ids in 0..{self.num_blocks - 1}, "
                                 f"got {pair!r}")
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts) or set(dsts) & {s for s, _ in pairs}:
            raise ValueError("copy_blocks: destinations must be distinct and not also sources")
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor(dsts, dtype=torch.int64, device=self.device)
        for cache in (*self.k_cache, *self.v_cache):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    # yaie: task 3
    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` a new sequence that shares all of ``parent_id``'s blocks and length
        (each block's ``ref_count`` goes up by one; no data is copied until one of them appends).

        Raises:
            ValueError: unknown or swapped-out parent; ``child_id`` already in use.
        """
        self._check_resident(parent_id)
        if child_id in self._lens:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        table = list(self._tables[parent_id])
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self._tables[child_id] = table
        self._lens[child_id] = self._lens[parent_id]

    # ------------------------------------------------------------------ task 4: swapping

    # yaie: task 4
    def swap_blocks_to_cpu(self, block_ids) -> list[int]:
        """Copy device blocks (every layer's K and V) into newly taken host blocks; return their ids,
        in the same order. Device blocks and their reference counts are not changed (the caller releases
        them). Host blocks are pinned memory on CUDA, so the copies are asynchronous DMA transfers; the
        method waits for them before it returns.

        Raises:
            ValueError: ids not distinct ints in range.
            OutOfBlocks: fewer free host blocks than ids (nothing changes).
        """
        ids = self._check_block_ids(block_ids, self.num_blocks, "swap_blocks_to_cpu")
        if len(ids) > len(self._cpu_free):
            raise OutOfBlocks(f"swap_blocks_to_cpu needs {len(ids)} free host blocks, only "
                              f"{len(self._cpu_free)} of {self.num_cpu_blocks} are free")
        cpu_ids = [self._cpu_free.pop() for _ in ids]
        for cpu_id in cpu_ids:
            self.cpu_blocks[cpu_id].ref_count = 1
        for device_caches, host_caches in ((self.k_cache, self.cpu_k_cache), (self.v_cache, self.cpu_v_cache)):
            for device_cache, host_cache in zip(device_caches, host_caches):
                for block_id, cpu_id in zip(ids, cpu_ids):   # one contiguous block per copy
                    host_cache[cpu_id].copy_(device_cache[block_id], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return cpu_ids

    # yaie: task 4
    def swap_blocks_from_cpu(self, block_ids) -> list[int]:
        """Copy host blocks back into newly taken device blocks (``ref_count`` 1); free the host blocks;
        return the device ids, in the same order.

        Raises:
            ValueError: ids not distinct ints in range, or not taken host blocks.
            OutOfBlocks: fewer free device blocks than ids (nothing changes).
        """
        cpu_ids = self._check_block_ids(block_ids, self.num_cpu_blocks, "swap_blocks_from_cpu")
        if any(self.cpu_blocks[c].is_free for c in cpu_ids):
            raise ValueError(f"swap_blocks_from_cpu: host blocks {cpu_ids} include free ones")
        if len(cpu_ids) > len(self._free):
            raise self._out_of_blocks(len(cpu_ids), "swap_blocks_from_cpu")
        ids = self._take_blocks(len(cpu_ids))
        for device_caches, host_caches in ((self.k_cache, self.cpu_k_cache), (self.v_cache, self.cpu_v_cache)):
            for device_cache, host_cache in zip(device_caches, host_caches):
                for block_id, cpu_id in zip(ids, cpu_ids):
                    device_cache[block_id].copy_(host_cache[cpu_id], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the host blocks may be reused as soon as we return
        for cpu_id in cpu_ids:
            self.cpu_blocks[cpu_id].ref_count = 0
            self._cpu_free.append(cpu_id)
        return ids

    # yaie: task 4
    def swap_out(self, seq_id) -> None:
        """Move a resident sequence to host memory: its blocks are copied to host blocks and its device
        references dropped (blocks it shared stay on the device for their other owners; the host copy is
        the sequence's own). Afterwards ``is_swapped(seq_id)`` is True and ``block_table`` refuses it.

        Raises:
            ValueError: unknown or already swapped-out sequence.
            OutOfBlocks: not enough free host blocks (nothing changes).
        """
        self._check_resident(seq_id)
        table = self._tables[seq_id]
        self._swapped[seq_id] = self.swap_blocks_to_cpu(table)   # raises before any change
        del self._tables[seq_id]
        for block_id in reversed(table):
            self._release(block_id)

    # yaie: task 4
    def swap_in(self, seq_id) -> None:
        """Bring a swapped-out sequence back to (new) device blocks; its data comes back bit for bit.

        Raises:
            ValueError: unknown sequence, or one that is not swapped out.
            OutOfBlocks: not enough free device blocks (nothing changes; it stays swapped out).
        """
        self._check_known(seq_id)
        if seq_id not in self._swapped:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        self._tables[seq_id] = self.swap_blocks_from_cpu(self._swapped[seq_id])
        del self._swapped[seq_id]
