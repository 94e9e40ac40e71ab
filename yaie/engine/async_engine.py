"""The engine behind the server: one background thread steps the scheduler; requests join at any step.

``LLM.generate`` runs a fixed list of prompts to the end. A server gets its requests one by one, at any
time, and some of its clients leave early. Here:

* :class:`StepEngine` is the engine one step at a time: :meth:`~StepEngine.add` a request, run one
  :meth:`~StepEngine.step` (one forward pass over the running batch, as ``LLM.generate`` does),
  :meth:`~StepEngine.abort` a request (its blocks are freed before the next step). One KV cache and one
  scheduler serve every request for the engine's whole life. Not thread-safe: one thread drives it.
* :class:`AsyncEngine` is that thread. Coroutines ``await engine.submit([(prompt_ids, params), ...])``
  from any asyncio loop and get a :class:`RequestGroup` whose events (text pieces, then the finish)
  arrive as the steps produce them: requests from different clients share the batch (continuous
  batching across clients). A group whose consumer goes away is aborted with
  :meth:`RequestGroup.abort`; the engine thread frees its blocks before its next step.

A Based or telescoping model (lessons 08, 07) keeps a constant-size state per sequence, not KV-cache
blocks: :class:`AsyncEngine` drives a :class:`yaie.engine.slot_engine.SlotEngine` over its rows instead.

Each request keeps its own sampler and seed (as in ``LLM.generate``), so a request's text does not depend
on who else is in the batch: the server's answer for a seed equals ``LLM.generate``'s. Steps are pipelined
as ``LLM.generate``'s: a step's kernels are queued first, then the previous step's text is decoded and
handed out while they run.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from yaie.engine.llm import DEFAULT_MODEL, LLM, _read_generation_config, _Text
from yaie.engine.sampling import SamplingParams
from yaie.engine.scheduler import Request, Scheduler
from yaie.model.config import load_config
from yaie.model.tokenizer import Tokenizer

RATE_WINDOW_S = 10.0        # tokens/s in the metrics: generated tokens over the last 10 seconds
ADMISSION_PREFILL_STEPS = 1.5   # ... while decodes run: this many times what a step with prompts took lately
ADMISSION_GAP_S = 0.001     # ... while idle: until no request has come for this long


class RequestRecords:
    """What a step engine keeps of its unfinished requests, beside its scheduler: the requests and their texts
    by id, the last step's events not handed out yet, and the log-probabilities asked for. Shared by
    :class:`StepEngine` (the paged KV cache) and :class:`yaie.engine.slot_engine.SlotEngine` (rows of a
    constant-size state); each defines ``abort``."""

    def __init__(self):
        self.requests: dict[int, Request] = {}      # unfinished requests by id
        self.texts: dict[int, _Text] = {}
        self._late: list[tuple[Request, _Text]] = []     # the last step's requests, their text not decoded yet
        self.logprobs: dict[int, tuple[int, list]] = {}  # request id -> (k, entries not taken yet)
        self._next_id = 0

    def take_logprobs(self, request_id: int) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
        """The log-probabilities gathered since the last call for a request that asked for them (else
        None): per generated token, ``(token id, its log-probability, [(id, log-probability)] of the k most
        likely tokens)``, from the model's distribution (log-softmax of the logits, before temperature and
        top-p/top-k)."""
        entry = self.logprobs.get(request_id)
        if entry is None:
            return None
        taken = list(entry[1])
        entry[1].clear()
        if request_id not in self.requests:      # finished (or aborted): nothing more will come
            del self.logprobs[request_id]
        return taken

    def _gather_logprobs(self, batch: list[Request], logits, tokens: list[int]) -> None:
        """Each sampled token's log-probability and the top k, for the requests of ``batch`` that asked
        (one log-softmax over their rows, one copy to the host)."""
        rows = [i for i, r in enumerate(batch) if r is not None and r.request_id in self.logprobs]
        if not rows:
            return
        k = max(self.logprobs[batch[i].request_id][0] for i in rows)
        log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen_ids = torch.tensor([tokens[i] for i in rows], device=log_probs.device)
        chosen = log_probs.gather(1, chosen_ids[:, None])[:, 0].tolist()
        top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for row, i in enumerate(rows):
            request = batch[i]
            if tokens[i] in self.texts[request.request_id].stop_ids:     # ends the request, no text: no entry
                continue
            want, entries = self.logprobs[request.request_id]
            entries.append((tokens[i], chosen[row], list(zip(top_ids[row][:want], top_values[row][:want]))))

    def flush(self) -> list[tuple[Request, str, _Text]]:
        """The events of the last step's tokens (their text decoded now); ``[]`` when given already."""
        late, self._late = self._late, []
        return [(request, text.piece(), text) for request, text in late]

    def _forget(self, request_id: int) -> Request | None:
        """Take an unfinished request out of the engine's records (its text, logprobs, last step's event), not
        out of the scheduler; the request, or None if it had finished already."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            del self.texts[request_id]
            self.logprobs.pop(request_id, None)
            self._late = [(r, text) for r, text in self._late if r.request_id != request_id]
        return request

    def abort_all(self) -> list[int]:
        ids = list(self.requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request and free what it holds now; False if it had finished already. Each
        engine frees its own kind of memory (KV-cache blocks, a row)."""
        raise NotImplementedError(f"{type(self).__name__} defines abort")


class StepEngine(RequestRecords):
    """``LLM``'s generation loop cut into calls: add requests, step, abort (see the module docstring)."""

    def __init__(self, llm: LLM):
        cfg = llm.config
        if cfg.telescoping_capacity or cfg.based_layers:
            kind = "a Based (lesson 08)" if cfg.based_layers else "a telescoping (lesson 07)"
            raise ValueError(f"this is {kind} model: it keeps a constant-size state per sequence, outside the "
                             "paged KV cache that this step engine schedules; serve it with "
                             "yaie.engine.slot_engine.SlotEngine (AsyncEngine and yaie serve pick it)")
        self.llm = llm
        self._cache = llm._cache_for_run()          # held (in use) until close()
        graphs = self._cache.graphs
        self.scheduler = Scheduler(self._cache.manager, llm.preemption, llm.max_num_seqs,
                                   llm.max_num_batched_tokens, reserved_blocks=1 if graphs is not None else 0,
                                   prefix_cache=self._cache.prefix_cache, chunked_prefill=llm.chunked_prefill)
        llm.last_scheduler, llm.last_graphs = self.scheduler, graphs
        super().__init__()
        self._pending = None        # a looked-ahead step (LLM._look_ahead), launched, its tokens not read yet
        self.prefill_steps = 0      # steps that fed prompt tokens (on CUDA: launched eagerly, no graph)

    @property
    def manager(self):
        return self.scheduler.manager

    @property
    def graphs(self):
        """The CUDA-graph runner of decode-only steps, or None (no graphs: every step launches eagerly)."""
        return self._cache.graphs

    def next_step_is_eager(self) -> bool:
        """Whether the next step launches its kernels from Python whatever is admitted before it: something
        waits or is swapped out (the step plans a prefill or a swap-in), a running request is still
        prefilling (its next chunk goes in), there are no CUDA graphs, or the batch is beyond them."""
        scheduler, graphs = self.scheduler, self._cache.graphs
        running = scheduler.running
        return bool(graphs is None or scheduler.waiting or scheduler.swapped
                    or (running and not graphs.fits(len(running))) or any(r.prefilling for r in running))

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, logprobs: int | None = None) -> Request:
        """Queue a request (it joins the batch at the next step). ValueError if it can never fit in the
        cache; the prompt is taken as checked (``LLM._prompt_ids``). ``logprobs``: None, or k >= 0 to get
        each generated token's log-probability and the k most likely tokens' (:meth:`take_logprobs`)."""
        room = self.llm.config.max_position_embeddings - len(prompt_ids)
        request = Request(self._next_id, list(prompt_ids), min(params.max_tokens, room))
        self.scheduler.add(request)
        self._next_id += 1
        self.requests[request.request_id] = request
        self.texts[request.request_id] = _Text(self.llm, params)
        if logprobs is not None:
            self.logprobs[request.request_id] = (logprobs, [])
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def warm_up(self) -> int:
        """Record the decode step's CUDA graph of every batch bucket now, before any client comes: a
        recording takes a while, and in a running batch it would stall every stream. One round of dummy
        one-token requests per bucket (a prefill, then one decode step of exactly that many). Returns the
        buckets warmed (0 without graphs)."""
        graphs = self._cache.graphs
        if graphs is None:
            return 0
        warmed = 0
        for size in graphs.buckets:
            if size > min(self.scheduler.usable_blocks, self.scheduler.max_num_seqs):
                break
            for _ in range(size):
                self.add([0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            while self.has_unfinished():
                self.step()
            self.flush()
            warmed += 1
        return warmed

    def step(self, during: Callable[[list], None] | None = None) -> list[tuple[Request, str, _Text]]:
        """One forward pass over the running batch, pipelined as ``LLM.generate`` runs it: the device gets
        the step's kernels first, and the host decodes the *previous* step's new text while they run.
        When the next step can only be the same decodes (greedy or sampled, without logprobs), it is
        launched too before this step's tokens are read (``LLM._look_ahead``): the device goes on without
        waiting for the host.

        Returns the previous step's events, ``(request, new text, its _Text)``, one per request that
        sampled a token then (:meth:`flush` gives the last step's). With ``during``, they are handed to it
        instead, still while the device works (the engine loop sends them to the server then), and the
        call returns ``[]``. A request whose token ended it (``text.finish_reason`` set) gave its blocks
        back in this call, before the next step is planned."""
        graphs = self._cache.graphs
        try:
            pending = self._pending
            if pending is None:
                plan = self.scheduler.schedule()
                if plan.empty:
                    raise RuntimeError("the scheduler planned an empty step with requests left (a bug)")
                self.prefill_steps += bool(plan.prefills)
                pending = self.llm._start(self.manager, plan, graphs, self.texts)    # queued, not waited for
            # Not when a request wants log-probabilities: they are read from this step's logits, which the
            # next step's graph replay would overwrite.
            wanted = any(r is not None and r.request_id in self.logprobs for r in pending.requests)
            following = None if wanted else self.llm._look_ahead(self.scheduler, pending, graphs, self.texts)
        except BaseException:
            self._pending = None
            raise
        self._pending = None
        events = self.flush()
        if during is not None:
            during(events)
            events = []
        tokens = pending.tokens()
        if self.logprobs:                # only steps with a request that asked for them do this work
            self._gather_logprobs(pending.requests, pending.logits, tokens)
        for request, token in zip(pending.requests, tokens):
            if request is None:          # ended (or aborted) before this looked-ahead step was read
                continue
            text = self.texts[request.request_id]
            kept = text.accept(request, token)
            if text.finish_reason is not None:
                # Its blocks go back before the next step is planned; when the looked-ahead step already
                # runs with it, that step fed this token too (a stop id's K/V count as computed).
                fed = following is not None and following.drop(request)
                self.scheduler.finish(request, [] if kept or not fed else [token])
                del self.requests[request.request_id], self.texts[request.request_id]
            self._late.append((request, text))
        if following is not None and any(r is not None for r in following.requests):
            self._pending = following
        return events

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request and free its blocks now; False if it had finished already."""
        request = self._forget(request_id)
        if request is None:
            return False
        if self._pending is not None:    # launched with it, not read yet: its row is ignored
            self._pending.drop(request)
            if all(r is None for r in self._pending.requests):
                self._pending = None
        self.scheduler.abort(request)
        return True

    def close(self) -> None:
        """Abort what is left and give the KV cache back to the ``LLM`` (kept for its next run)."""
        self.abort_all()
        self._cache.in_use = False


@dataclass
class Event:
    """What one request's consumer sees: ``text`` is new text; the last event has ``finish_reason`` set
    ("stop", "length" or "abort"), or ``error`` when the engine failed. ``logprobs``: for a request that
    asked, the new tokens' entries (:meth:`StepEngine.take_logprobs`)."""
    index: int
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    error: str | None = None
    logprobs: list | None = None


class RequestGroup:
    """The requests of one HTTP call (several prompts, ``n`` choices), their events in one asyncio queue."""

    def __init__(self, engine: "AsyncEngine", items: list[tuple[list[int], SamplingParams]],
                 logprobs: int | None = None):
        self.engine = engine
        self.items = items
        self.logprobs = logprobs              # every request of the group: None, or the top k to return
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = self.loop.create_future()
        self.request_ids: list[int] = []      # set by the engine thread, in the order of items
        self.unfinished = len(items)
        self.aborted = False

    def abort(self) -> None:
        """Cancel every request of the group that is still running (its blocks are freed before the
        engine's next step). Safe to call more than once, from the loop's thread."""
        if not self.aborted and self.unfinished:
            self.aborted = True
            self.engine._abort(self)

    async def batches(self):
        """Lists of events, until every request of the group has finished: all that arrived since the last
        list (one per step when the consumer keeps up; more when it fell behind, or with several choices),
        so a consumer writes one message per wake-up, not one per token."""
        while self.unfinished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            out = []
            for event in batch:
                if event is None:         # the consumer's own wake-up (its client left): stop here
                    return
                if event.finish_reason is not None or event.error is not None:
                    self.unfinished -= 1
                out.append(event)
            yield out

    async def events(self):
        """Events until every request of the group has finished, one at a time."""
        async for batch in self.batches():
            for event in batch:
                yield event


@dataclass
class EngineStats:
    """Counters the engine thread updates after every step; read by the metrics endpoint."""
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    steps: int = 0
    prefill_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    preemptions: int = 0
    recent: collections.deque = field(default_factory=collections.deque)   # (time, tokens) per step

    def tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in list(self.recent) if now - t <= RATE_WINDOW_S]
        return sum(n for _, n in recent) / RATE_WINDOW_S


class AsyncEngine:
    """One background thread that owns a :class:`StepEngine` (a :class:`yaie.engine.slot_engine.SlotEngine` for
    models with a constant-size state per sequence) and steps it while requests are unfinished.

    ``start()`` before use (it returns once the CUDA graphs are recorded, ``warm_up``), ``shutdown()``
    after (both from any thread). ``submit`` is a coroutine.

    **Admission window** (off unless ``window_s`` > 0: see the measurement below). With CUDA graphs a
    decode-only step replays a graph (on an H100, ~2 ms for 64 requests of the 1B model), while a step
    that feeds prompt tokens launches every kernel from Python (~10-15 ms of host time, however few the
    tokens). Requests from many clients do not arrive together:
    each one goes through the HTTP server on its own, a fraction of a millisecond apart, and clients whose
    requests were prefilled in different steps finish, and come back, at different times. Let each
    arrival into the batch at the next step and the prompts of 64 clients go in over many slow steps of
    a few prompts each, every one of them costing every running stream a slow step, where
    ``LLM.generate`` prefills them in the fewest steps the token budget allows. So arrivals are held back
    (not given to the scheduler yet) until the first of these:

    * the held prompts fill what the next step's token budget leaves, or the next step launches eagerly
      anyway (a prompt is still being prefilled, something waits in the scheduler, no graphs);
    * decodes run, and the oldest held request has waited what one more step with prompts would cost
      the running streams (:data:`ADMISSION_PREFILL_STEPS` times such a step's recent time), shared out
      over everyone that step would serve (times running / (running + held)): one arrival beside 60
      running streams waits for the next ones, 15 arrivals beside one running stream go at once. So
      clients that finished a step or two apart, and come back as far apart, share one prefill step;
    * the engine is idle and no request has come for ``gap_s`` (the burst is over: a lone client's
      request waits 1 ms), unless requests finished in the last ``window_s`` and fewer have come since
      (their clients are likely on their way back, one request after another): then as long as one more
      step with prompts takes, as above;
    * the oldest held request has waited ``window_s``.

    ``window_s`` 0 (the default) admits every request at the next step. Without CUDA graphs every step
    launches eagerly and costs by its tokens: nothing is held whatever ``window_s`` says. Measured on an
    H100 (the 1B model, closed-loop clients, 128-token prompts, a 50 ms window beside none), the window
    cuts the steps with prompts and the inter-token p99 (``bench/results/serve_window_h100.md``, 64 clients: 29
    vs 35 steps, 17 vs 23 ms), but not reliably the time: 2% more tokens per second there, with a later
    first token; at commits 52c0f4d and 2ada0f2, 6 to 9 points more overhead at 16 clients, and at 64
    once 9 points more, once 12 fewer. A held request's client waits, and groups of clients that come
    back apart by more than the hold stay apart, each round holding again. Hence off by default, a
    setting to measure on one's own traffic (vLLM's scheduler has a delay of the same kind, off by
    default too).
    """

    def __init__(self, llm: LLM, warm_up: bool = True, window_s: float = 0.0, gap_s: float = ADMISSION_GAP_S):
        if not window_s >= 0:
            raise ValueError(f"the admission window must be >= 0 seconds, got {window_s!r}")
        self.llm = llm
        self.warm_up = warm_up          # record every CUDA graph before serving (core.warm_up)
        self.window_s, self.gap_s = window_s, min(gap_s, window_s)
        self._held: list = []           # arrived groups not given to the scheduler yet (the admission window)
        self._held_tokens = 0
        self._first_held_at = self._last_held_at = 0.0
        self._prefill_step_s: float | None = None    # a running mean of how long steps with prompts took
        self._owed: collections.deque = collections.deque()   # finish times of requests whose clients may be back
        self.stats = EngineStats()
        self.core = None    # the engine thread's StepEngine (or SlotEngine); read it only for tests and metrics
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[RequestGroup] = []
        self._aborts: list[RequestGroup] = []
        self._stopping = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._owner: dict[int, tuple[RequestGroup, int]] = {}   # request id -> (group, index in group)
        self._evictable, self._evictable_key, self._evictable_at = 0, None, 0.0

    # ------------------------------------------------------------------ life
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="yaie-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------------ the coroutine side
    async def submit(self, items: list[tuple[list[int], SamplingParams]], logprobs: int | None = None) -> RequestGroup:
        """Queue requests; returns once the engine thread has taken them (at its next step).
        ValueError when one can never fit in the cache (then none of them runs). ``logprobs``: None, or k
        to get each token's log-probability and the top k (``Event.logprobs``)."""
        group = RequestGroup(self, items, logprobs)
        with self._lock:
            if self._stopping or not self.alive:
                raise RuntimeError("the engine is shutting down")
            self._inbox.append(group)
        self._wake.set()
        return await _accepted(group)

    def _abort(self, group: RequestGroup) -> None:
        with self._lock:
            self._aborts.append(group)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        llm = self.llm
        if llm.device.type == "cpu" and llm.cpu_threads:
            torch.set_num_threads(llm.cpu_threads)
        try:
            from yaie.engine.slot_engine import SlotEngine, serves_by_rows
            # Based and telescoping models: rows of a constant-size state, not the paged KV cache.
            self.core = SlotEngine(llm) if serves_by_rows(llm.config) else StepEngine(llm)
        except BaseException as err:     # noqa: BLE001 (handed to start()'s caller)
            self._start_error = err
            self._on_started()
            return
        self.stats.blocks_total = self.core.scheduler.usable_blocks
        try:
            if self.warm_up:
                self.core.warm_up()
        except Exception:  # noqa: BLE001 (graphs that cannot record: the engine runs those steps eagerly)
            traceback.print_exc()
            self.core.abort_all()
        self._on_started()
        try:
            while True:
                inbox, aborts, stopping = self._collect()
                for group in aborts:
                    self._abort_now(group)
                self._hold(inbox)
                if stopping:
                    break
                wait = self._admission_wait()
                if wait == 0:
                    self._admit_held()
                if not self.core.has_unfinished():
                    self._emit(self.core.flush())      # the last step's text
                    self._update_stats()
                    self._idle(wait)
                    continue
                self._step()
        finally:
            for group in self._live_groups():
                self._fail(group, "the server is shutting down")
            for group in self._held + self._collect()[0]:
                self._resolve(group, RuntimeError("the engine is shutting down"))
            self._held = []
            self.core.close()
            self._update_stats()

    # The admission window (see the class docstring).
    def _hold(self, groups: list) -> None:
        if not groups:
            return
        now = time.monotonic()
        if not self._held:
            self._first_held_at = now
        self._last_held_at = now
        self._held += groups
        self._held_tokens += sum(len(ids) for group in groups for ids, _ in group.items)
        for _ in range(min(len(self._owed), sum(len(group.items) for group in groups))):
            self._owed.popleft()         # a client back (or a new one: either way, one fewer awaited)

    def _admission_wait(self) -> float | None:
        """None when nothing is held; 0 when the held groups go to the scheduler now; else how long they
        may wait for more arrivals at most."""
        if not self._held:
            return None
        core = self.core
        room = self.llm.max_num_batched_tokens - len(core.scheduler.running)    # tokens left beside the decodes
        if self.window_s <= 0 or self._held_tokens >= room or core.next_step_is_eager():
            return 0.0
        # What one more step with prompts costs (before any was timed: the whole window).
        step = self.window_s if self._prefill_step_s is None else ADMISSION_PREFILL_STEPS * self._prefill_step_s
        running = len(core.scheduler.running)
        if running:
            # Shared out over everyone it would serve: a few held beside many running wait longer.
            held = sum(len(group.items) for group in self._held)
            due = self._first_held_at + min(self.window_s, step * running / (running + held))
        else:
            now = time.monotonic()
            while self._owed and now - self._owed[0] > self.window_s:
                self._owed.popleft()
            if self._owed:
                # Requests finished just now and fewer have come since: their clients are likely on their
                # way (one request after another).
                due = self._first_held_at + min(self.window_s, step)
            else:                           # go once the burst is over (a lone client waits gap_s)
                due = min(self._first_held_at + self.window_s, self._last_held_at + self.gap_s)
        return max(due - time.monotonic(), 0.0)

    def _admit_held(self) -> None:
        held, self._held, self._held_tokens = self._held, [], 0
        for group in held:
            self._accept(group)

    # The engine loop's ways in and out: overridden by the child process's loop (_ChildEngine).
    def _on_started(self) -> None:
        """The engine is ready (or ``_start_error`` says why not)."""
        self._started.set()

    def _collect(self) -> tuple[list, list, bool]:
        """New groups, groups to abort, and whether to stop."""
        self._wake.clear()
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            return inbox, aborts, self._stopping

    def _idle(self, timeout: float | None = None) -> None:
        """Nothing to run: sleep until a request, an abort or the stop comes (or ``timeout`` seconds pass:
        held requests are due then)."""
        self._wake.wait(timeout=1.0 if timeout is None else timeout)

    def _deliver(self, events: list[tuple["RequestGroup", Event]]) -> None:
        """Hand one step's events to their groups' asyncio loops: one wake-up per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for group, event in events:
            by_loop.setdefault(group.loop, []).append((group.queue, event))
        for loop, batch in by_loop.items():
            _post(loop, batch)

    def _resolve(self, group, error: BaseException | None) -> None:
        """The engine took the group (error None) or refused it."""
        _resolve(group, error)

    def _accept(self, group: RequestGroup) -> None:
        if group.aborted:
            self._resolve(group, None)
            return
        requests = []
        try:
            for index, (prompt_ids, params) in enumerate(group.items):
                requests.append(self.core.add(prompt_ids, params, group.logprobs))
                self._owner[requests[-1].request_id] = (group, index)
        except ValueError as err:
            for request in requests:
                self.core.abort(request.request_id)
                del self._owner[request.request_id]
            self._resolve(group, err)
            return
        group.request_ids = [r.request_id for r in requests]
        self.stats.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self._resolve(group, None)

    def _abort_now(self, group: RequestGroup) -> None:
        if any(held is group for held in self._held):     # never reached the scheduler: nothing to free
            self._held = [held for held in self._held if held is not group]
            self._held_tokens -= sum(len(ids) for ids, _ in group.items)
            self.stats.requests_aborted += len(group.items)
            self._resolve(group, None)
            return
        for request_id in group.request_ids:
            if request_id in self._owner:
                del self._owner[request_id]
                if self.core.abort(request_id):
                    self.stats.requests_aborted += 1

    def _step(self) -> None:
        start, prefill_steps = time.monotonic(), self.core.prefill_steps
        try:
            self.core.step(during=self._emit)    # the last step's text goes out while the device runs this one
        except Exception as err:  # noqa: BLE001 (a failed step fails its requests, not the server)
            message = f"the engine failed: {type(err).__name__}: {err}"
            traceback.print_exc()
            for group in self._live_groups():
                self._fail(group, message)
            return
        if self.core.prefill_steps > prefill_steps:     # this call launched a step with prompts and waited for it
            took = time.monotonic() - start
            self._prefill_step_s = took if self._prefill_step_s is None else 0.75 * self._prefill_step_s + 0.25 * took
        self._update_stats()

    def _emit(self, events: list[tuple[Request, str, _Text]]) -> None:
        """Hand a step's events to their groups (one message or wake-up for all of them)."""
        deliveries = []
        for request, piece, text in events:
            logprobs = self.core.take_logprobs(request.request_id)     # taken even if nobody reads them
            owner = self._owner.get(request.request_id)
            if owner is None:           # its group was aborted
                continue
            group, index = owner
            if text.finish_reason is not None:
                del self._owner[request.request_id]
                self.stats.requests_finished += 1
                if self.window_s:
                    self._owed.append(time.monotonic())
            deliveries.append((group, Event(index, piece, text.finish_reason, len(request.output_ids), None,
                                            logprobs)))
        if events:
            self.stats.generation_tokens += len(events)
            self.stats.recent.append((time.monotonic(), len(events)))
        if deliveries:
            self._deliver(deliveries)

    def _live_groups(self) -> list[RequestGroup]:
        groups = {id(g): g for g, _ in self._owner.values()}
        return list(groups.values())

    def _fail(self, group: RequestGroup, message: str) -> None:
        batch = []
        for request_id in group.request_ids:
            owner = self._owner.pop(request_id, None)
            if owner is not None:
                self.core.abort(request_id)
                self.stats.requests_failed += 1
                batch.append((group, Event(owner[1], error=message)))
        if batch:
            self._deliver(batch)

    def _update_stats(self) -> None:
        s, scheduler = self.stats, self.core.scheduler
        s.running, s.swapped = len(scheduler.running), len(scheduler.swapped)
        s.waiting = len(scheduler.waiting) + sum(len(group.items) for group in self._held)
        free = self.core.manager.num_free_blocks + self._evictable_blocks()
        s.blocks_used = scheduler.usable_blocks - min(scheduler.usable_blocks, free)
        s.steps, s.prefill_steps = scheduler.stats.steps, self.core.prefill_steps
        s.preemptions = scheduler.stats.preempted_by_recompute + scheduler.stats.preempted_by_swap
        now = time.monotonic()
        while s.recent and now - s.recent[0][0] > RATE_WINDOW_S:
            s.recent.popleft()

    def _evictable_blocks(self) -> int:
        """Blocks of cached prefixes held by no request (evictable: free for the metrics). Counting them
        walks the whole prefix tree, which grows with every prompt served, so it is recounted only when
        requests came, went or finished, when the engine goes idle, or a quarter second after the last
        count, not at every step."""
        tree = self.core.scheduler.prefix_cache
        if tree is None:
            return 0
        s, now = self.stats, time.monotonic()
        key = (s.prompt_tokens, s.requests_finished, s.requests_aborted, s.requests_failed, s.running == 0)
        if key != self._evictable_key or now - self._evictable_at > 0.25:
            self._evictable = tree.tree.num_evictable_blocks
            self._evictable_key, self._evictable_at = key, now
        return self._evictable


async def _accepted(group):
    """Wait until the engine has taken ``group`` in (or refused it); a client that leaves meanwhile aborts it."""
    try:
        await asyncio.shield(group.accepted)
    except asyncio.CancelledError:
        group.abort()
        raise
    return group


def _post(loop: asyncio.AbstractEventLoop, batch: list) -> None:
    """Hand events to an asyncio loop from the engine thread (one wake-up per step, not per token)."""
    try:
        loop.call_soon_threadsafe(_put_all, batch)
    except RuntimeError:      # that loop is closed: its clients are gone
        pass


def _put_all(batch: list) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


def _resolve(group: RequestGroup, error: BaseException | None) -> None:
    def settle():
        if not group.accepted.done():
            if error is None:
                group.accepted.set_result(None)
            else:
                group.accepted.set_exception(error)
    try:
        group.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


# ----------------------------------------------------------------------------- the engine in a process of its own
STAT_FIELDS = ("running", "waiting", "swapped", "blocks_total", "blocks_used", "steps", "prefill_steps",
               "prompt_tokens", "generation_tokens", "requests_finished", "requests_aborted", "requests_failed",
               "preemptions")


class ProcessEngine:
    """:class:`AsyncEngine`'s interface (``start``, ``submit``, ``shutdown``, ``alive``, ``stats``) with the
    engine loop in a child process of its own.

    Why: an engine step is Python-heavy (scheduling, sampling, detokenizing, for every request), and so is
    HTTP (a JSON chunk and a socket write per token per stream). In one process the two share one GIL, so
    every token served takes host time from the engine, whose steps are bound by host time at small and
    medium batches. Here the child runs the same loop (:class:`_ChildEngine`), reading requests from a
    pipe and writing each step's events back in one message (sent while the device runs the next step,
    with the engine's counters riding along); this process only checks and tokenizes requests, routes
    events to their groups and speaks HTTP.
    """

    def __init__(self, llm_args: dict, warm_up: bool = True, window_s: float = 0.0):
        if not window_s >= 0:
            raise ValueError(f"the admission window must be >= 0 seconds, got {window_s!r}")
        self.llm_args = llm_args          # LLM(**llm_args) in the child
        self.warm_up = warm_up
        self.window_s = window_s          # the child's admission window (AsyncEngine)
        self.stats = EngineStats()
        self.core = None                  # in the child process
        self._groups: dict[int, RequestGroup] = {}
        self._next_gid = 0
        self._send_lock = threading.Lock()
        self._stopping = self._dead = False
        self._proc = self._conn = self._reader = None

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self) -> None:
        """Start the child and wait until its engine is ready (model loaded, CUDA graphs recorded)."""
        context = multiprocessing.get_context("spawn")    # a fresh interpreter: no CUDA state is inherited
        self._conn, child_end = context.Pipe()
        self._proc = context.Process(target=_child_main, name="yaie-engine", daemon=True,
                                     args=(child_end, self.llm_args, self.warm_up, self.window_s))
        self._proc.start()
        child_end.close()
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(10)
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready") from None
        if message[0] == "failed":
            self._proc.join(10)
            raise RuntimeError(f"the engine process could not start: {message[1]}")
        self.stats.blocks_total = message[1]
        self._reader = threading.Thread(target=self._read, name="yaie-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._send(("stop",))
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        if self._reader is not None:
            self._reader.join(5)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and not (self._stopping or self._dead)

    def _gone(self) -> str:
        """Why no request can run: the server stops it, or the engine process died under it."""
        if self._stopping or self._proc is None:
            return "the engine is shutting down"
        code = "" if self._proc.exitcode is None else f" (exit code {self._proc.exitcode})"
        return f"the engine process stopped{code}; nothing can run until the server is restarted"

    async def submit(self, items: list[tuple[list[int], SamplingParams]], logprobs: int | None = None) -> RequestGroup:
        """As :meth:`AsyncEngine.submit`."""
        if not self.alive:
            raise RuntimeError(self._gone())
        group = RequestGroup(self, items, logprobs)
        group.gid, group.remaining = self._next_gid, len(items)
        self._next_gid += 1
        self._groups[group.gid] = group
        self._send(("submit", group.gid, items, logprobs))
        if self._dead:        # the reader failed the groups it saw before this one came: none will answer it
            self._groups.pop(group.gid, None)
            raise RuntimeError(self._gone())
        return await _accepted(group)

    def _abort(self, group: RequestGroup) -> None:
        self._groups.pop(group.gid, None)
        self._send(("abort", group.gid))

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError, AttributeError):   # the child is gone: the reader fails its groups
                pass

    def _read(self) -> None:
        """The reader thread: the child's messages, routed to their groups' asyncio loops."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "stats":
                for name, value in message[1].items():
                    setattr(self.stats, name, value)
            elif kind == "accepted":
                _, gid, error = message
                group = self._groups.get(gid)
                if group is not None:
                    if error is not None:
                        self._groups.pop(gid, None)
                        error = (ValueError if error[0] == "ValueError" else RuntimeError)(error[1])
                    _resolve(group, error)
            elif kind == "events":
                self._route(message[1])
                for name, value in (message[2] or {}).items():
                    setattr(self.stats, name, value)
        self._dead = True            # the child is gone: nothing more will come for anyone
        for group in list(self._groups.values()):
            if group.accepted.done():
                _post(group.loop, [(group.queue, Event(0, error="the engine process stopped"))] * group.remaining)
            else:
                _resolve(group, RuntimeError("the engine process stopped"))
        self._groups.clear()
        if not self._stopping:       # it died under the server: say so in the server's log
            self._proc.join(5)
            print(f"yaie serve: {self._gone()}", file=sys.stderr, flush=True)

    def _route(self, events: list[tuple]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for gid, index, text, finish_reason, num_tokens, error, logprobs in events:
            group = self._groups.get(gid)
            if group is None:        # aborted by its consumer
                continue
            if finish_reason is not None or error is not None:
                group.remaining -= 1
                if not group.remaining:
                    self._groups.pop(gid, None)
            by_loop.setdefault(group.loop, []).append((group.queue, Event(index, text, finish_reason, num_tokens,
                                                                          error, logprobs)))
        for loop, batch in by_loop.items():
            _post(loop, batch)
        self.stats.recent.append((time.monotonic(), len(events)))
        while self.stats.recent and time.monotonic() - self.stats.recent[0][0] > RATE_WINDOW_S:
            self.stats.recent.popleft()


@dataclass
class _RemoteGroup:
    """The child's record of a parent's RequestGroup."""
    gid: int
    items: list
    logprobs: int | None = None
    aborted: bool = False
    request_ids: list = field(default_factory=list)
    remaining: int = 0


class _ChildEngine(AsyncEngine):
    """The engine loop of :class:`ProcessEngine`'s child: requests and aborts from a pipe, events back."""

    def __init__(self, llm: LLM, conn, warm_up: bool, window_s: float = 0.0):
        super().__init__(llm, warm_up, window_s)
        self.conn = conn
        self._remote: dict[int, _RemoteGroup] = {}
        self._last_stats: dict | None = None
        self._stats_due: dict | None = None     # counters changed since the last message that carried them

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except OSError:                   # the server process is gone; _collect sees it and stops
            pass

    def _on_started(self) -> None:
        if self._start_error is not None:
            self._send(("failed", f"{type(self._start_error).__name__}: {self._start_error}"))
        else:
            self._send(("ready", self.stats.blocks_total))

    def _collect(self) -> tuple[list, list, bool]:
        inbox, aborts, stopping = [], [], False
        try:
            while self.conn.poll(0):
                kind, *rest = self.conn.recv()
                if kind == "submit":
                    group = _RemoteGroup(rest[0], rest[1], rest[2], remaining=len(rest[1]))
                    self._remote[group.gid] = group
                    inbox.append(group)
                elif kind == "abort" and rest[0] in self._remote:
                    group = self._remote.pop(rest[0])
                    group.aborted = True
                    aborts.append(group)
                elif kind == "stop":
                    stopping = True
        except (EOFError, OSError):
            stopping = True
        return inbox, aborts, stopping

    def _idle(self, timeout: float | None = None) -> None:
        if self._stats_due is not None:         # the counters as the engine goes idle
            self._send(("stats", self._stats_due))
            self._stats_due = None
        try:
            self.conn.poll(1.0 if timeout is None else timeout)
        except (EOFError, OSError):
            pass

    def _resolve(self, group: _RemoteGroup, error: BaseException | None) -> None:
        if error is not None or group.aborted:
            self._remote.pop(group.gid, None)
        self._send(("accepted", group.gid, None if error is None else (type(error).__name__, str(error))))

    def _deliver(self, events: list) -> None:
        rows = []
        for group, event in events:
            rows.append((group.gid, event.index, event.text, event.finish_reason, event.num_tokens, event.error,
                         event.logprobs))
            if event.finish_reason is not None or event.error is not None:
                group.remaining -= 1
                if not group.remaining:
                    self._remote.pop(group.gid, None)
        self._send(("events", rows, self._stats_due))     # one message per step: the counters ride along
        self._stats_due = None

    def _update_stats(self) -> None:
        super()._update_stats()
        snapshot = {name: getattr(self.stats, name) for name in STAT_FIELDS}
        if snapshot != self._last_stats:
            self._last_stats = self._stats_due = snapshot


def _child_main(conn, llm_args: dict, warm_up: bool, window_s: float = 0.0) -> None:
    """The engine process: load the model, then run the loop until the server says stop (or is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C goes to the server, which stops the engine
    try:
        llm = LLM(**llm_args)
    except BaseException as err:  # noqa: BLE001 (reported to the server process, which exits with it)
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    _ChildEngine(llm, conn, warm_up, window_s)._run()


class Frontend:
    """A model's tokenizer, config and generation defaults, without its weights: what the server process
    needs to check and tokenize requests while a :class:`ProcessEngine` holds the model. Its prompt checks
    and sampling defaults are ``LLM``'s own methods."""

    def __init__(self, model: str | Path | None = None, block_size: int = 16):
        self.model_dir = Path(model) if model is not None else DEFAULT_MODEL
        self.config = load_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.generation_config = _read_generation_config(self.model_dir)
        self.block_size = block_size

    default_sampling_params = LLM.default_sampling_params
    _prompt_ids = LLM._prompt_ids
