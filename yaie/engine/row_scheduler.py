"""Continuous batching over rows: the scheduler of models that keep a constant-size state per sequence.

A Based model (lesson 08) or a telescoping one (lesson 07) has no paged KV cache: each running sequence
holds one *row* of a batched state, the same bytes at any length. So there is nothing to page, preempt or
share, and the books are rows:

* ``running[r]`` holds row ``r``; the running rows stay packed ``0 .. n - 1`` (a decode step reads leading
  slices of the state, and a CUDA graph's bucket pads the rows above them);
* a waiting prompt that fits what is left of the step's token budget takes the next row and is prefilled
  whole in this step; a longer one (with chunked prefill) is fed in chunks, one per step, in the *staging
  row*, a row no decode step touches, and moves down to its running row once its last chunk has run. At
  most one prompt is staged at a time, and it holds a running row's place, so that row is free for it;
* a request that ends (or is aborted) frees its row at once: the last running row moves into it.

Rows move through ``move(src, dst)``, the runner's (the scheduler keeps books, the runner owns the state).
The interface is :class:`yaie.engine.scheduler.Scheduler`'s, which the engine core drives; ``usable_blocks``
and ``num_free_blocks`` count rows.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Callable

from yaie.engine.request import Request, StepPlan
from yaie.engine.scheduler import SchedulerStats


class RowScheduler:
    """Args:
        capacity: rows that decode (sequences running at once).
        move: ``move(src, dst)`` moves a sequence's state from row ``src`` to row ``dst``.
        max_num_batched_tokens: tokens per step: the decodes (one each), then prompt tokens in what is left.
        staging_row: the row where a prompt grows chunk by chunk (never decoded), or None: no chunked
            prefill, a prompt longer than the budget runs whole, alone in its step's prefills.
    """

    prefix_cache = None
    swapped: tuple = ()

    def __init__(self, capacity: int, move: Callable[[int, int], None], max_num_batched_tokens: int = 2048,
                 staging_row: int | None = None):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}")
        self.capacity, self.move = capacity, move
        self.max_num_batched_tokens = max_num_batched_tokens
        self.staging_row = staging_row
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.staged: Request | None = None       # the prompt growing in the staging row
        self.stats = SchedulerStats()     # the paged scheduler's counters: rows are never preempted

    # ------------------------------------------------------------------ what the metrics read
    @property
    def max_num_seqs(self) -> int:
        return self.capacity

    @property
    def usable_blocks(self) -> int:
        return self.capacity

    @property
    def num_free_blocks(self) -> int:
        return self.capacity - len(self.running) - (self.staged is not None)

    # ------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        """Queue a request (first come, first served)."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.staged)

    def finish(self, request: Request, fed: list[int] | None = None) -> None:
        """A request is done: its row is freed now (``fed`` is for the paged cache's books: rows keep none)."""
        self._free(request)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request from wherever it is; its row is freed now."""
        self._free(request)

    def _free(self, request: Request) -> None:
        request.state = "finished"
        if request is self.staged:
            self.staged = None
            return
        for row, running in enumerate(self.running):
            if running is request:
                last = len(self.running) - 1
                if row != last:                  # keep the rows packed: the last one moves into the gap
                    self.move(last, row)
                    self.running[row] = self.running[last]
                self.running.pop()
                return
        for i, waiting in enumerate(self.waiting):
            if waiting is request:
                del self.waiting[i]
                return

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        """Decodes of every running row, then prompt tokens in what is left of the budget: the staged
        prompt's next chunk first, then waiting prompts into free rows (the first one of a step whatever its
        length when nothing is staged)."""
        self._promote()
        plan = StepPlan()
        for row, request in enumerate(self.running):
            plan.add_decode(request, row)
        budget = self.max_num_batched_tokens - len(plan.decodes)
        if self.staged is not None:
            budget -= self._next_chunk(plan, budget)
        while self.waiting and self.num_free_blocks > 0 and budget > 0:
            request = self.waiting[0]
            size = len(request.prompt_ids)
            if size <= budget or (not plan.prefills and self.staging_row is None):
                self.waiting.popleft()
                request.state = "running"
                request.num_computed_tokens = size
                plan.add_prefill(request, len(self.running), 0, size)
                self.running.append(request)
                budget -= size
            elif self.staging_row is not None and self.staged is None:
                self.waiting.popleft()
                request.state = "running"
                self.staged = request
                budget -= self._next_chunk(plan, budget)
            else:
                break
        self.stats.steps += 1
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        return plan

    def _next_chunk(self, plan: StepPlan, budget: int) -> int:
        """Plan the staged prompt's next chunk (at least one token); returns its length."""
        request = self.staged
        start = request.num_computed_tokens
        end = min(len(request.prompt_ids), start + max(budget, 1))
        plan.add_prefill(request, self.staging_row, start, end)
        request.num_computed_tokens = end
        return end - start

    def _promote(self) -> None:
        """The staged prompt whose last chunk ran (and which did not end with its first token) moves down to
        the next running row: it decodes from this step on."""
        request = self.staged
        if request is not None and request.num_computed_tokens == len(request.prompt_ids):
            self.move(self.staging_row, len(self.running))
            self.running.append(request)
            self.staged = None

    def can_continue(self, requests: list) -> bool:
        """Whether the next step can only be ``requests``' decodes again, in these rows: they are exactly the
        running rows, and no prompt waits or is staged (it would join the next step)."""
        return (not self.waiting and self.staged is None and len(self.running) == len(requests)
                and all(map(operator.is_, self.running, requests)))

    def schedule_decodes(self) -> StepPlan:
        """The plan :meth:`schedule` gives when :meth:`can_continue` holds: every running row decodes."""
        if not self.can_continue(self.running):
            return self.schedule()
        plan = StepPlan(decodes=list(self.running), decode_slots=list(range(len(self.running))))
        self.stats.steps += 1
        return plan
