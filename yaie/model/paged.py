"""One engine step over the paged KV cache: which sequences run, where their tokens go, what they read.

The engine builds a :class:`PagedStep` per forward pass and hands it to the model as its ``cache``; each
layer calls :meth:`PagedStep.rope_and_attend`, which rotates the layer's new queries and keys, writes the
keys and values into the lesson 03 cache and runs attention through :func:`yaie.ops.paged_attention`.
Everything that is the same for all layers (block tables, lengths, offsets) is built once here, on the
host, and copied to the device once.

Token order inside a step: first one token per *decoding* sequence, then the tokens of each *prefilling*
sequence, packed (no padding)::

    q rows:  [d0, d1, d2 | p0 p0 p0 p0 p0 | p1 p1 p1]     num_decodes = 3, two prefills
"""

from __future__ import annotations

import os
from functools import cached_property

import torch

from yaie import ops


class PagedStep:
    """Args:
        manager: the lesson 03 ``KVCacheManager`` holding every sequence's blocks.
        seq_ids: the sequences of this step, decodes first.
        query_lens: new tokens per sequence (1 for a decode).
        num_decodes: how many of ``seq_ids`` (the first ones) decode.
        slot_mapping: int64 ``[num_tokens]`` on the cache's device: the cache slot of every new token.
        use_kernels: run lessons 04 (decode) and 06 (prefill); default: on CUDA.
        plan_run: with ``use_kernels``, run the whole step (decodes and prefills together) through lesson
            05's plan/run attention instead of lesson 04 for the decodes and lessons 05/06 for the prefills:
            planned once for the step, one launch per layer (:func:`yaie.ops.paged_attention`). Default: for a
            step that mixes decodes and prefill chunks; a prefill-only step keeps lesson 06's FlashAttention
            (why: docs/engine.md, "Prefix caching"). The environment variable ``YAIE_PLAN_RUN=1`` plans every eager step, ``0`` none.
    """

    plan_run = False          # CUDA-graph steps (StaticDecodeStep) never plan
    plan_run_forced = False   # YAIE_PLAN_RUN=1 (or plan_run=True): a missing lesson 05 is an error, no fallback
    # Cascade decode (a StaticDecodeStep whose sequences share their first blocks): the shared prefix's
    # buffers and plans, each sequence's own blocks after them and its tokens there; None otherwise.
    cascade = None
    own_tables: torch.Tensor | None = None
    own_context_lens: torch.Tensor | None = None

    def __init__(self, manager, seq_ids: list, query_lens: list[int], num_decodes: int,
                 slot_mapping: torch.Tensor, use_kernels: bool | None = None, plan_run: bool | None = None):
        if len(seq_ids) != len(query_lens) or not seq_ids:
            raise ValueError("a step needs one query length per sequence and at least one sequence")
        if any(n != 1 for n in query_lens[:num_decodes]):
            raise ValueError("decoding sequences feed exactly one token each")
        self.manager = manager
        self.seq_ids = list(seq_ids)
        self.query_lens = list(query_lens)
        self.num_decodes = num_decodes
        self.num_prefills = len(seq_ids) - num_decodes
        self.slot_mapping = slot_mapping
        self.device = manager.device
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        if plan_run is None:
            setting = os.environ.get("YAIE_PLAN_RUN", "")
            if setting not in ("", "0", "1"):
                raise ValueError(f"YAIE_PLAN_RUN must be 1 (plan every eager step), 0 (none) or unset (the steps "
                                 f"that mix decodes and prefills), got {setting!r}")
            self.plan_run_forced = setting == "1"
            plan_run = setting == "1" or (setting != "0" and num_decodes > 0 and self.num_prefills > 0
                                          and ops.default_plan_run())
        else:
            self.plan_run_forced = bool(plan_run)
        self.plan_run = bool(plan_run) and self.use_kernels
        self.attention_plans: dict = {}       # lesson 05 plans of this step, by (heads, head_dim, scale)
        # Tokens each sequence holds once this step's tokens are written (cached context + new tokens).
        self.context_lens_list = [manager.num_tokens(s) for s in self.seq_ids]
        self._slots: dict[int, torch.Tensor] = {}     # context_slots, per sequence, built on first use
        self.query_starts = [0]
        for n in self.query_lens:
            self.query_starts.append(self.query_starts[-1] + n)

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    @property
    def last_token_rows(self) -> list[int]:
        """The row of each sequence's last new token: the one whose logits pick the next token."""
        return [end - 1 for end in self.query_starts[1:]]

    # ------------------------------------------------------------------ for the kernels (built once a step)
    @cached_property
    def block_tables(self) -> torch.Tensor:
        return self.manager.block_table(self.seq_ids)

    @cached_property
    def context_lens(self) -> torch.Tensor:
        return self.manager.context_lens(self.seq_ids)

    @cached_property
    def _prefill_lens(self) -> tuple[list[int], list[int]]:
        return self.query_lens[self.num_decodes:], self.context_lens_list[self.num_decodes:]

    @property
    def prefills_start_empty(self) -> bool:
        """True when every prefill starts at position 0 (nothing of it cached before this step)."""
        q_lens, k_lens = self._prefill_lens
        return q_lens == k_lens

    def _offsets(self, lengths: list[int]) -> torch.Tensor:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        return torch.tensor(offsets, dtype=torch.int32).to(self.device)

    @cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self._offsets(self._prefill_lens[0])

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        return self.cu_seqlens_q if self.prefills_start_empty else self._offsets(self._prefill_lens[1])

    @property
    def max_prefill_query(self) -> int:
        return max(self._prefill_lens[0])

    @property
    def max_prefill_context(self) -> int:
        return max(self._prefill_lens[1])

    def context_slots(self, i: int) -> torch.Tensor:
        """Cache slots of every token of sequence ``i`` (positions ``0 .. len - 1``), int64 on the device."""
        if i not in self._slots:
            size = self.manager.block_size
            blocks = torch.tensor(self.manager.block_ids(self.seq_ids[i]), dtype=torch.int64)
            positions = torch.arange(self.context_lens_list[i])
            self._slots[i] = (blocks[positions // size] * size + positions % size).to(self.device)
        return self._slots[i]

    # ------------------------------------------------------------------ what the model calls
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        """Write this layer's new ``k, v`` into the paged cache, then attend; ``[num_tokens, heads, head_dim]``."""
        ops.write_kv(self.manager, layer, self.slot_mapping, k, v)
        return ops.paged_attention(q, k, v, self, layer, sliding_window)

    def rope_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, positions: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
        """Rotate ``q, k`` by ``positions`` (RoPE), then as :meth:`attend`
        (:func:`yaie.ops.rope_and_paged_attention`: where the reference serves lessons 02 to 04, one kernel for
        a decode step's three)."""
        return ops.rope_and_paged_attention(q, k, v, cos, sin, positions, self, layer, sliding_window)


class StaticDecodeStep(PagedStep):
    """A decode-only step over FIXED buffers, for a CUDA graph (:mod:`yaie.engine.cuda_graphs`).

    A CUDA graph replays the kernels it recorded with the same arguments: the same tensors, the same Python
    numbers. So everything that changes from step to step lives in tensors that are overwritten before each
    replay (``block_tables``, ``context_lens``, ``slot_mapping``), and everything the kernels are given as a
    number is fixed for the graph's life: ``batch`` rows (real sequences first, padding after: context
    length 0, a scratch slot to write to) and ``bound``, an upper bound of every context length the graph
    will see, which lesson 04 sizes its splits by.

    Args:
        manager: the lesson 03 cache the graph reads and writes.
        block_tables: int32 ``[batch, max_blocks]``, context_lens: int32 ``[batch]``, slot_mapping: int64
            ``[batch]``, all on the cache's device.
        bound: tokens, at most ``max_blocks * block_size``.
        cascade: the shared prefix of a cascade step (its ``pages`` blocks lead every row's table), or None.
    """

    def __init__(self, manager, block_tables: torch.Tensor, context_lens: torch.Tensor, slot_mapping: torch.Tensor,
                 bound: int, cascade=None):
        batch = block_tables.shape[0]
        self.manager = manager
        self.seq_ids = [None] * batch
        self.query_lens = [1] * batch
        self.num_decodes, self.num_prefills = batch, 0
        self.slot_mapping = slot_mapping
        self.device = manager.device
        self.use_kernels = True
        if not 1 <= bound <= block_tables.shape[1] * manager.block_size:
            raise ValueError(f"bound {bound} must lie in 1..{block_tables.shape[1] * manager.block_size}")
        # ops.paged_attention passes max(context_lens_list) to lesson 04 as its context bound.
        self.context_lens_list = [bound] * batch
        self._slots = {}
        self.query_starts = list(range(batch + 1))
        self.__dict__["block_tables"] = block_tables      # the cached_property values, fixed
        self.__dict__["context_lens"] = context_lens
        if cascade is not None:
            # Each sequence's own part: its blocks after the shared ones, the tokens there before its new one.
            self.cascade = cascade
            self.own_tables = block_tables[:, cascade.pages:].contiguous()     # rows packed, as kernels expect
            self.own_context_lens = (context_lens - 1 - cascade.pages * manager.block_size).clamp_min(0).to(torch.int32)
