"""The server's step engine for models that keep a constant-size state per sequence (lessons 07 and 08).

:class:`yaie.engine.async_engine.StepEngine` schedules lesson 03's paged KV cache: blocks, preemption,
prefix caching. A Based model (lesson 08) has no such cache: each sequence holds one *row* of a
:class:`yaie.model.based.BasedSlots` (its Based states and the rings of its window layers), the same
bytes at any length. So there is nothing to page, preempt or share, and the scheduling reduces to rows:

* a request waits (first come, first served) until a row is free; then its whole prompt is prefilled into
  that row (``BasedSlots.prefill``), and its first token is sampled from the prompt's last logits;
* every step decodes all the rows that were running before it in one forward pass (``BasedSlots.decode``,
  rows ``0 .. n - 1``: one CUDA graph per batch bucket on a GPU), then prefills the prompts admitted in it;
* a request that ends (or whose client leaves) frees its row at once: the last running row moves into it
  (``BasedSlots.move``), so the running rows stay ``0 .. n - 1``.

The decode runs before the step's prefills because a graph's bucket pads the batch with the free rows above
the running ones and writes them: a prompt prefilled there first would be overwritten. Prompts enter a step
up to ``max_num_batched_tokens`` tokens (one at least), so a burst of prompts does not stall the running
streams for all of them at once.

Tokens are sampled as :func:`yaie.engine.sequential.run_batched` samples them (``LLM.generate``): each
request with its own parameters and its own seeded generator (:func:`yaie.engine.llm._device_tokens`), so a
request's tokens do not depend on what it was batched with and the server's answer for a seed is
``LLM.generate``'s. A step's tokens are picked on the device and read once; the previous step's text is
decoded while the device runs (the ``during`` hook, as in ``StepEngine``). There is no look-ahead here:
``run_batched`` launches the next decode step before a step's tokens reach the host, this engine waits for
them first (the same tokens; on a GPU, host time between steps at small batches).

A telescoping model (lesson 07) keeps a cache per sequence that does not batch: it is served through the
same engine with one row (:class:`OneSequenceRows`), one sequence at a time, the others waiting.

:class:`SlotEngine` has the interface :class:`yaie.engine.async_engine.AsyncEngine` drives (``add``,
``step``, ``flush``, ``abort``, ``abort_all``, ``close``, ``has_unfinished``, ``warm_up``,
``next_step_is_eager``, ``take_logprobs``) and a :class:`RowScheduler` as its ``scheduler``, which the
engine loop reads for its metrics: there, the KV-cache "blocks" are rows (one per running sequence).
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from yaie.engine.async_engine import RequestRecords
from yaie.engine.llm import _device_tokens, _Text
from yaie.engine.sampling import SamplingParams
from yaie.engine.scheduler import Request
from yaie.engine.sequential import free_row


def serves_by_rows(config) -> bool:
    """Whether a model keeps a constant-size state per sequence (Based or telescoping): served by
    :class:`SlotEngine`, whose memory per request is a row, not KV-cache blocks."""
    return bool(config.based_layers or config.telescoping_capacity)


@dataclass
class RowStats:
    """What the metrics read from a scheduler's counters. Rows are never preempted."""
    steps: int = 0
    preempted_by_recompute: int = 0
    preempted_by_swap: int = 0


class RowScheduler:
    """The rows of a :class:`SlotEngine`: ``running[r]`` holds row ``r``; ``waiting`` the requests with no row
    yet, oldest first. Named as :class:`yaie.engine.scheduler.Scheduler`'s fields where the engine loop reads
    them (its metrics): ``usable_blocks`` and ``num_free_blocks`` count rows; nothing is swapped or cached."""

    prefix_cache = None
    swapped: tuple = ()

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.stats = RowStats()

    @property
    def usable_blocks(self) -> int:
        return self.capacity

    @property
    def num_free_blocks(self) -> int:
        return self.capacity - len(self.running)

    @property
    def max_num_seqs(self) -> int:
        return self.capacity

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


class OneSequenceRows:
    """One row over a model whose per-sequence cache does not batch (telescoping, lesson 07): the
    ``BasedSlots`` calls :class:`SlotEngine` makes, each sequence in a cache of its own (``make_cache()``),
    as :func:`yaie.engine.sequential.run_one_at_a_time` runs it."""

    capacity = 1

    def __init__(self, model, device: torch.device, make_cache: Callable[[], object]):
        self.model, self.device, self.make_cache = model, device, make_cache
        self.cache = None

    def prefill(self, row: int, token_ids: list[int]) -> torch.Tensor:
        if row != 0:
            raise ValueError(f"row {row} is outside 0..0")
        self.cache = self.make_cache()
        return self._forward(token_ids, list(range(len(token_ids))))

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        if len(tokens) != 1 or len(positions) != 1:
            raise ValueError(f"a decode step takes 1..1 rows with one position each, got {len(tokens)} tokens "
                             f"and {len(positions)} positions")
        return self._forward(tokens, positions)

    def move(self, src: int, dst: int) -> None:
        raise ValueError("one row: there is no other row to move")    # never called: the only row is the last

    def row_nbytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    def _forward(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        hidden = self.model.forward(torch.tensor(tokens, dtype=torch.int64, device=self.device),
                                    torch.tensor(positions, dtype=torch.int64, device=self.device), self.cache)
        return self.model.logits(hidden[-1:])


def make_rows(llm):
    """The rows a server over ``llm`` holds: a :class:`yaie.model.based.BasedSlots` of ``max_num_seqs`` rows
    (CUDA graphs as ``llm.cuda_graphs`` says), or one :class:`OneSequenceRows` for a telescoping model."""
    if llm.config.based_layers:
        from yaie.model.based import BasedSlots
        return BasedSlots(llm.model, llm.max_num_seqs, graphs=llm.cuda_graphs)
    if llm.config.telescoping_capacity:
        from yaie.model.telescoping import new_cache
        return OneSequenceRows(llm.model, llm.device, lambda: new_cache(llm))
    raise ValueError("this model keeps its keys and values in the paged KV cache: serve it with StepEngine")


class SlotEngine(RequestRecords):
    """Requests over the rows of a constant-state model, one step at a time (see the module docstring).
    Not thread-safe: one thread drives it. ``rows``: default :func:`make_rows` (tests pass their own)."""

    def __init__(self, llm, rows=None):
        if not serves_by_rows(llm.config):
            raise ValueError("this model keeps its keys and values in the paged KV cache: serve it with StepEngine")
        self.llm = llm
        self.rows = rows if rows is not None else make_rows(llm)
        self.scheduler = RowScheduler(self.rows.capacity)
        super().__init__()
        self.prefill_steps = 0      # steps that prefilled prompts
        self._table, self._table_batch = None, []     # the last step's StepTable (None: all greedy) and its rows

    @property
    def manager(self) -> RowScheduler:
        """The metrics' ``num_free_blocks``: free rows."""
        return self.scheduler

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def next_step_is_eager(self) -> bool:
        """Whether the next step launches its kernels from Python whatever is admitted before it: a prompt
        waits for a row that is free (it is prefilled eagerly), or the decode steps replay no CUDA graph."""
        scheduler = self.scheduler
        return bool(not getattr(self.rows, "capture", False)
                    or (scheduler.waiting and len(scheduler.running) < scheduler.capacity))

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, logprobs: int | None = None) -> Request:
        """Queue a request (it takes a row at the next step one is free). ``ValueError`` for a prompt the
        model cannot read (empty, token ids outside the vocabulary, no room left in the context): checked
        here, before it is queued, so that a bad prompt fails alone and never in a step beside others."""
        cfg = self.llm.config
        ids = self.llm._prompt_ids(list(prompt_ids))[1]      # LLM.generate's checks: ids, vocabulary, context
        room = cfg.max_position_embeddings - len(ids)
        if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= cfg.vocab_size):
            raise ValueError(f"logprobs must be None or an int in [0, {cfg.vocab_size}], got {logprobs!r}")
        request = Request(self._next_id, ids, min(params.max_tokens, room))
        self._next_id += 1
        self.scheduler.waiting.append(request)
        self.requests[request.request_id] = request
        self.texts[request.request_id] = _Text(self.llm, params)
        if logprobs is not None:
            self.logprobs[request.request_id] = (logprobs, [])
        return request

    def warm_up(self) -> int:
        """Record the decode step's CUDA graph of every batch bucket before any client comes (a recording
        stalls every stream of a running batch): dummy one-token requests fill the rows bucket by bucket, each
        bucket's graph recorded by a decode step of exactly its rows, then they are aborted. Returns the
        buckets warmed (0 when the decode steps do not run from fixed buffers)."""
        if not getattr(self.rows, "static", False):
            return 0
        buckets = [b for b in getattr(self.rows, "buckets", ()) if b <= self.scheduler.capacity]
        dummy = SamplingParams(max_tokens=self.llm.config.max_position_embeddings, temperature=0, ignore_eos=True)
        for size in buckets:
            while len(self.requests) < size:
                self.add([0], dummy)
            while self.scheduler.waiting:
                self.step()
            self.step()
        self.abort_all()
        return len(buckets)

    def step(self, during: Callable[[list], None] | None = None) -> list[tuple[Request, str, _Text]]:
        """One step: a decode of the running rows, then the prompts admitted into free rows, their tokens
        picked on the device; while the device works, the previous step's text is decoded and handed out
        (to ``during`` when given, which the call then returns ``[]`` for; else returned); then this step's
        tokens are read and taken. A request that ended frees its row before the call returns. Events as
        :meth:`StepEngine.step` gives them: ``(request, new text, its _Text)``."""
        scheduler, rows = self.scheduler, self.rows
        decodes = list(scheduler.running)
        logits = []
        if decodes:
            logits.append(rows.decode([r.last_token for r in decodes], [r.num_tokens - 1 for r in decodes]))
        prefills = self._admit()
        for request in prefills:
            logits.append(rows.prefill(scheduler.running.index(request), request.prompt_ids))
        batch = decodes + prefills
        if not batch:
            raise RuntimeError("a step with nothing to run (no running row, no prompt admitted): a bug")
        scheduler.stats.steps += 1
        self.prefill_steps += bool(prefills)
        step_logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        # The sampled rows' parameters go up to the device once while the batch stays the same.
        same = len(batch) == len(self._table_batch) and all(map(operator.is_, batch, self._table_batch))
        device_tokens, self._table = _device_tokens(step_logits, [self.texts[r.request_id] for r in batch],
                                                    self._table if same else None)
        self._table_batch = batch
        events = self.flush()
        if during is not None:
            during(events)
            events = []
        tokens = device_tokens.tolist()
        if self.logprobs:
            self._gather_logprobs(batch, step_logits, tokens)
        for request, token in zip(batch, tokens):
            text = self.texts[request.request_id]
            text.accept(request, token)
            self._late.append((request, text))
            if text.finish_reason is not None:
                # Its row goes first, while the request is still known: if freeing fails, the engine loop's
                # failure path still finds it (abort), and no row stays held by a request nobody knows.
                self._free(request)
                request.state = "finished"
                del self.requests[request.request_id], self.texts[request.request_id]
        return events

    def _admit(self) -> list[Request]:
        """Prompts that take free rows in this step, oldest first: up to ``max_num_batched_tokens`` prompt
        tokens (the first one whatever its length)."""
        scheduler, budget = self.scheduler, self.llm.max_num_batched_tokens
        admitted, tokens = [], 0
        while scheduler.waiting and len(scheduler.running) < scheduler.capacity:
            size = len(scheduler.waiting[0].prompt_ids)
            if admitted and tokens + size > budget:
                break
            request = scheduler.waiting.popleft()
            request.state = "running"
            scheduler.running.append(request)     # its row: its index
            admitted.append(request)
            tokens += size
        return admitted

    def _free(self, request: Request) -> None:
        """Give ``request``'s row back (the last running row moves into it) or take it out of the queue."""
        scheduler = self.scheduler
        for row, running in enumerate(scheduler.running):
            if running is request:
                free_row(self.rows, scheduler.running, row)
                return
        for i, waiting in enumerate(scheduler.waiting):
            if waiting is request:
                del scheduler.waiting[i]
                return

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request and free its row now; False if it had finished already."""
        request = self._forget(request_id)
        if request is None:
            return False
        self._free(request)
        request.state = "finished"
        return True

    def close(self) -> None:
        """Abort what is left (the rows stay allocated until the engine is dropped)."""
        self.abort_all()
