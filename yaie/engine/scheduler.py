"""Continuous batching: which requests run in the next forward pass, and who gives way when blocks run out.

Every request is in exactly one queue:

* ``waiting``: not in the cache (new, or preempted by *recompute*): it needs a prefill of all its tokens;
* ``running``: its K/V are in the device blocks; it decodes one token per step;
* ``swapped``: preempted by *swap*: its blocks are in host memory (lesson 03 ``swap_out``); it comes back
  with ``swap_in`` and goes on decoding, nothing recomputed.

One step (:meth:`Scheduler.schedule`), oldest request first everywhere (first come, first served):

1. every running request reserves the slot of its next token (``append_slots``). When the cache has no
   free block for it, the **newest** running request is preempted, again until the slot fits (it may be
   the request itself). The oldest request therefore always makes progress: no livelock.
2. if nobody was preempted in this step, swapped requests come back (oldest first) while their blocks
   and one more fit (with chunked prefill, also while the step's token budget lasts: each decodes a token);
3. then, if no request is still swapped out, waiting requests are admitted (prefill) while their tokens
   fit in the free blocks and in the step's token budget.

Chunked prefill (``chunked_prefill=True``, the engine's default): ``max_num_batched_tokens`` bounds the
tokens of a whole step, decodes included. Decodes come first (one token each, always scheduled); what is
left of the budget goes to prefills, oldest first, each fed as a *chunk* of at most what is left: a long
prompt is cut into pieces, one per step, ingested beside the running decodes instead of stopping them for
a whole-prompt step. A request whose prompt is only partly in the cache is ``running`` (it holds its
blocks, its chunks are reserved step by step: ``Request.num_computed_tokens``), but it samples no token
until its last chunk has run. A chunk continues a cached context, like a prefix-cache hit, so the
attention that runs is the same (on CUDA lesson 05: its prefix-prefill kernel, or its plan/run attention
when decodes share the step). Without chunking, the budget
counts prefill tokens only and a prompt longer than it still runs whole, alone.

Prefix caching (lesson 05, ``prefix_cache``): an admitted request reads the longest cached prefix of its
tokens from the radix tree and prefills only the rest (``Request.num_cached_tokens``); after its prefill
its prompt goes into the tree, and when it finishes (or is preempted by recompute) everything it computed
does. When blocks run out, unlocked cached prefixes are evicted (least recently used first) before any
request is preempted.

Preemption policies: ``"recompute"`` frees the victim's blocks and puts it back at the head of the
waiting queue: it is re-prefilled later over prompt + tokens generated so far (cheap for short
sequences, needs no host memory). ``"swap"`` copies its blocks to host memory (when the host has room;
otherwise it falls back to recompute). Either way the request's generated tokens and its sampler state
stay with it, so its output is the same as if it had run alone.

The scheduler only keeps books (queues, the lesson 03 manager); the engine core (:mod:`yaie.engine.core`)
has the plan run and calls :meth:`Scheduler.finish`. :class:`yaie.engine.row_scheduler.RowScheduler` keeps
the same interface over the rows of a constant-size state.
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass

from yaie.engine.request import Request, StepPlan
from yaie.engine.settings import PREEMPTION_MODES


@dataclass
class SchedulerStats:
    steps: int = 0
    max_running: int = 0
    preempted_by_swap: int = 0
    preempted_by_recompute: int = 0
    swapped_in: int = 0


class Scheduler:
    """Args:
        manager: the lesson 03 ``KVCacheManager`` (request ids are its sequence ids).
        preemption: ``"recompute"`` or ``"swap"``.
        max_num_seqs: at most this many requests run at once.
        max_num_batched_tokens: with ``chunked_prefill``, tokens per step (decodes, then prefill chunks in
            what is left); without, prefill tokens per step, a single longer prompt still running whole.
        chunked_prefill: cut prompts into chunks that fit the step's budget (see the module docstring).
        reserved_blocks: blocks of the cache that no request may count on (the CUDA-graph runner's scratch
            block): a request is refused if it needs more than ``manager.num_blocks - reserved_blocks``.
        prefix_cache: lesson 05's ``RadixAttentionWithPagedKVCache`` over ``manager`` (automatic prefix
            caching), or None: every request prefills all its tokens.
    """

    def __init__(self, manager, preemption: str = "recompute", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, reserved_blocks: int = 0, prefix_cache=None,
                 chunked_prefill: bool = False):
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}")
        self.manager = manager
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = bool(chunked_prefill)
        self.usable_blocks = manager.num_blocks - reserved_blocks
        # The manager's own OutOfBlocks (the student's or the reference module, whichever built it).
        self.out_of_blocks = importlib.import_module(type(manager).__module__).OutOfBlocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.stats = SchedulerStats()
        self.prefix_cache = prefix_cache
        self._prefilled: list[Request] = []     # the last step's prefills: their prompts go into the tree next

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    # ------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        """Queue a new request. ValueError if it could never fit in the cache, even alone."""
        size = self.manager.block_size
        need = -(-request.max_cached_tokens // size)
        if need > self.usable_blocks:
            raise ValueError(f"request {request.request_id} needs up to {request.max_cached_tokens} tokens "
                             f"({need} blocks of {size}) in the KV cache, which has {self.usable_blocks} "
                             "blocks: give the engine more blocks (num_blocks) or ask for fewer tokens")
        _insert_by_age(self.waiting, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, request: Request, fed: list[int] | None = None) -> None:
        """A running request is done: give its blocks back. ``fed``: token ids fed to the cache after its own
        (a step planned before the request was known to end fed its last sampled token, a stop id)."""
        self.running.remove(request)
        self._free(request, cache=True, fed=fed or [])
        request.state = "finished"

    def _free(self, request: Request, cache: bool, fed: list[int] = ()) -> None:
        """Give a request's blocks back; with a prefix cache, first put what it computed into the tree
        (``cache``: its K/V are written, or queued to be: a looked-ahead step still running writes them
        before any later step, on the same stream, reads or reuses the blocks)."""
        request.num_computed_tokens = 0
        if self.prefix_cache is None:
            self.manager.free(request.request_id)
        else:
            self.prefix_cache.free(request.request_id, request.token_ids + list(fed) if cache else None)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request (its client went away), from whichever queue holds it; its blocks,
        on the device or swapped out to the host, are given back at once."""
        for queue in (self.waiting, self.running, self.swapped):
            for i, queued in enumerate(queue):
                if queued is request:
                    del queue[i]
                    break
        if self.manager.has_seq(request.request_id):   # a waiting request holds no blocks
            self._free(request, cache=False)
        request.state = "finished"

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._cache_prefills()
        budget = self._schedule_running(plan)
        if not plan.preempted:
            # A swapped-in request decodes in this step: with chunked prefill, only while the budget lasts.
            self._swap_in(plan, budget - len(plan.decodes) if self.chunked_prefill else None)
            if not self.swapped:
                self._admit(plan, budget - len(plan.decodes) if self.chunked_prefill else self.max_num_batched_tokens)
        self.stats.steps += 1
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        return plan

    def can_continue(self, requests: list[Request]) -> bool:
        """Whether the next step can only be ``requests``' decodes again, in this order (the engine's
        look-ahead plans it before their tokens are known): they are exactly the running requests, nothing
        waits or is swapped out, no prompt waits to enter the prefix cache, and the free blocks cover a new
        block for each, so nobody is preempted."""
        running = self.running
        return (not self.waiting and not self.swapped and not self._prefilled
                and len(running) == len(requests) and all(map(operator.is_, running, requests))
                and self.manager.num_free_blocks >= len(requests))

    def schedule_decodes(self) -> StepPlan:
        """:meth:`schedule` for a step that :meth:`can_continue` allows. The plan and the books are those
        :meth:`schedule` gives then: one slot per running request, in order; only the per-request tests are
        skipped (at batch 256 they are a good part of the host's work per step). Falls back to
        :meth:`schedule` when the queues or the free blocks say otherwise."""
        if self.waiting or self.swapped or self._prefilled or self.manager.num_free_blocks < len(self.running):
            return self.schedule()
        append_slots = self.manager.append_slots
        plan = StepPlan(decodes=list(self.running),
                        decode_slots=[append_slots(request.request_id, 1) for request in self.running])
        for request in self.running:
            request.num_computed_tokens += 1
        self.stats.steps += 1
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        return plan

    def _cache_prefills(self) -> None:
        """The prompts prefilled by the last step are computed now: put them into the prefix cache, so the
        requests admitted from now on share them."""
        if self.prefix_cache is not None:
            for request in self._prefilled:
                if request.state == "running":
                    self.prefix_cache.cache_sequence(request.request_id, request.token_ids)
        self._prefilled = []

    def _evict_cached(self, num_blocks: int) -> bool:
        """Evict unlocked cached prefixes until ``num_blocks`` blocks are free; False without a prefix cache."""
        return self.prefix_cache is not None and self.prefix_cache.make_room(num_blocks)

    def _schedule_running(self, plan: StepPlan) -> int:
        """Reserve the slots of every running request's next tokens: one for a decode, the next chunk for a
        request whose chunked prefill is under way (while the step's budget lasts). Returns the budget of
        the step less those chunks (the caller takes the decodes off, once swap-ins are known)."""
        # Whether each request is prefilling, found once: it changes only when its tokens are reserved below.
        flags = [request.prefilling for request in self.running]
        batch = list(zip(self.running, flags))
        decodes = flags.count(False)
        budget = self.max_num_batched_tokens - decodes     # decodes always run; chunks get what is left
        append_slots = self.manager.append_slots
        for request, prefilling in batch:         # oldest first; victims are taken from the end
            if request.state != "running":
                continue                          # preempted earlier in this loop
            wanted = 1
            if prefilling:
                wanted = min(request.num_tokens - request.num_computed_tokens, budget)
                if wanted <= 0:
                    continue                      # no budget left in this step: its next chunk waits
            while True:
                n = wanted
                if prefilling:                    # a smaller chunk rather than preempting anyone
                    self._evict_cached(self._blocks_needed(request, wanted))
                    n = min(wanted, max(1, self._room(request)))
                try:
                    slots = append_slots(request.request_id, n)
                except self.out_of_blocks:
                    if self._evict_cached(self.manager.num_free_blocks + 1):
                        continue                  # a cached prefix made room: nobody is preempted
                    victim = self.running[-1]
                    self._preempt(victim, plan)
                    if victim is request:
                        break
                    continue
                start = request.num_computed_tokens
                if prefilling:
                    plan.add_prefill(request, slots, start, start + n)
                    self._prefilled.append(request)
                    budget -= n
                else:
                    plan.decodes.append(request)
                    plan.decode_slots.append(slots)
                request.num_computed_tokens = start + n
                break
        return budget + decodes

    def _blocks_needed(self, request: Request, tokens: int) -> int:
        """Free blocks ``request`` needs to append ``tokens`` (beyond the free slots of its last block)."""
        size = self.manager.block_size
        held = self.manager.num_tokens(request.request_id)
        return max(0, -(-(held + tokens) // size) - len(self.manager.block_ids(request.request_id)))

    def _room(self, request: Request) -> int:
        """Tokens ``request`` can append now: the free slots of its last block and of the free blocks."""
        size = self.manager.block_size
        slack = len(self.manager.block_ids(request.request_id)) * size - self.manager.num_tokens(request.request_id)
        return slack + self.manager.num_free_blocks * size

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        plan.preempted.append(request)
        seq = request.request_id
        # A request in the middle of a chunked prefill is recomputed: swapped-in requests decode.
        if (self.preemption == "swap" and not request.prefilling
                and len(self.manager.block_ids(seq)) <= self.manager.num_free_cpu_blocks):
            if self.prefix_cache is not None:
                self.prefix_cache.release_lock(seq)   # its blocks go to the host; the tree keeps its own
            self.manager.swap_out(seq)
            request.state = "swapped"
            _insert_by_age(self.swapped, request)
            self.stats.preempted_by_swap += 1
        else:
            self._free(request, cache=True)       # with a prefix cache, its re-prefill will mostly be a hit
            request.state = "waiting"
            _insert_by_age(self.waiting, request)
            self.stats.preempted_by_recompute += 1

    def _swap_in(self, plan: StepPlan, budget: int | None) -> None:
        """Bring swapped-out requests back, oldest first, while seats, blocks and ``budget`` tokens (None: no
        limit) last; each decodes one token in this step."""
        size = self.manager.block_size
        while self.swapped and len(self.running) < self.max_num_seqs and (budget is None or budget > 0):
            request = self.swapped[0]
            tokens = self.manager.num_tokens(request.request_id)
            # Its blocks come back, plus room for the slot it decodes into right away.
            need = -(-(tokens + 1) // size)
            if need > self.manager.num_free_blocks and not self._evict_cached(need):
                return
            self.manager.swap_in(request.request_id)
            self.swapped.pop(0)
            request.state = "running"
            _insert_by_age(self.running, request)
            plan.decodes.append(request)
            plan.decode_slots.append(self.manager.append_slots(request.request_id, 1))
            request.num_computed_tokens += 1
            self.stats.swapped_in += 1
            if budget is not None:
                budget -= 1

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting requests while their prefills fit the free blocks and ``budget`` tokens. The first
        prefill of a step (none running yet) may exceed the budget: with chunked prefill it gets its first
        chunk; without, it runs whole, however long."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.chunked_prefill and budget <= 0:
                return
            tokens = request.token_ids
            cached = self.prefix_cache.match(tokens) if self.prefix_cache is not None else 0
            new_tokens = len(tokens) - cached
            if plan.prefills and new_tokens > budget:
                # Only a step's first prefill is cut to the budget; a later one waits for the next step,
                # where it may find the prompts of this step in the prefix cache (a shared system prompt).
                return
            if self.chunked_prefill:
                new_tokens = min(new_tokens, budget)
            end = cached + new_tokens
            if self.prefix_cache is not None:
                # The cached prefix of tokens[:end] is the one of tokens (end > cached): the same blocks.
                try:
                    found = self.prefix_cache.allocate(request.request_id, tokens[:end])   # evicts if it must
                except self.out_of_blocks:
                    return
                # It counted tokens[:end] as the prompt; the rest of the prompt comes in later chunks.
                self.prefix_cache.stats.prompt_tokens += len(tokens) - end
                request.num_cached_tokens, slots = found.num_cached, found.slot_mapping
            else:
                if not self.manager.can_allocate(end):
                    return
                slots = self.manager.allocate(request.request_id, end)
                request.num_cached_tokens = 0
            plan.add_prefill(request, slots, request.num_cached_tokens, end)
            request.num_computed_tokens = end
            self._prefilled.append(request)
            self.waiting.pop(0)
            request.state = "running"
            _insert_by_age(self.running, request)
            budget -= len(slots)


def _insert_by_age(queue: list[Request], request: Request) -> None:
    """Keep a queue ordered by arrival (a preempted request goes back ahead of younger ones)."""
    position = len(queue)
    while position > 0 and queue[position - 1].request_id > request.request_id:
        position -= 1
    queue.insert(position, request)
