"""The engine behind the server: one background thread steps an engine core; requests join at any step.

``LLM.generate`` runs a fixed list of prompts to the end. A server gets its requests one by one, at any
time, and some of its clients leave early. :class:`AsyncEngine` is a thread that owns one
:class:`yaie.engine.core.EngineCore` for the server's whole life and drives the core's loop: coroutines
``await engine.submit([(prompt_ids, params), ...])`` from any asyncio loop and get a
:class:`yaie.engine.serving.RequestGroup` whose events arrive as the steps produce them; a group whose
consumer goes away is aborted (:meth:`RequestGroup.abort`), and the engine thread frees what it holds
before its next step. Each request keeps its own sampler and seed, so the server's answer for a seed equals
``LLM.generate``'s.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback

from yaie.engine.core import StepEvent
from yaie.engine.llm import LLM
from yaie.engine.sampling import SamplingParams
from yaie.engine.serving import (Event, EngineStats, RequestGroup, RATE_WINDOW_S, post_events, settle_group,
                                 wait_accepted)

ADMISSION_PREFILL_STEPS = 1.5   # the admission window, while decodes run: this many times a recent prompt step
ADMISSION_GAP_S = 0.001     # ... while idle: until no request has come for this long


class AsyncEngine:
    """One background thread that owns an engine core (:meth:`LLM.open_core`) and steps it while requests are
    unfinished: requests from every client share the running batch.

    ``start()`` before use (it returns once the CUDA graphs are recorded, ``warm_up``), ``shutdown()``
    after (both from any thread). ``submit`` is a coroutine.

    **Admission window** (off unless ``window_s`` > 0). A step that feeds prompts launches every kernel from
    Python, while a decode-only step replays a CUDA graph; admitting each arrival at the next step makes many
    slow steps of a few prompts each. With a window, arrivals are held back (not given to the scheduler) until
    the first of: the held prompts fill what the next step's token budget leaves, or the next step is eager
    anyway; decodes run and the oldest held request has waited what one more step with prompts would cost
    the running streams (:data:`ADMISSION_PREFILL_STEPS` times such a step's recent time), shared out over
    everyone that step would serve; the engine is idle and no request came for ``gap_s`` (or, when requests
    finished within ``window_s`` and fewer came since, one step with prompts' time); the oldest held request
    waited ``window_s``. Without CUDA graphs nothing is held. Why it is off by default: ``docs/server.md``.
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
        self.core = None    # the engine thread's EngineCore; read it only for tests and metrics
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
        return await wait_accepted(group)

    def abort_group(self, group: RequestGroup) -> None:
        with self._lock:
            self._aborts.append(group)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self.core = self.llm.open_core()
        except BaseException as err:     # noqa: BLE001 (handed to start()'s caller)
            self._start_error = err
            self._on_started()
            return
        with self.core.cpu_threads_set():
            self._loop()

    def _loop(self) -> None:
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
        room = self.llm.settings.max_num_batched_tokens - len(core.scheduler.running)    # tokens left beside the decodes
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
            post_events(loop, batch)

    def _resolve(self, group, error: BaseException | None) -> None:
        """The engine took the group (error None) or refused it."""
        settle_group(group, error)

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

    def _emit(self, events: list[StepEvent]) -> None:
        """Hand a step's events to their groups (one message or wake-up for all of them)."""
        deliveries = []
        for request, piece, _, finish_reason in events:
            logprobs = self.core.take_logprobs(request.request_id)     # taken even if nobody reads them
            owner = self._owner.get(request.request_id)
            if owner is None:           # its group was aborted
                continue
            group, index = owner
            if finish_reason is not None:
                del self._owner[request.request_id]
                self.stats.requests_finished += 1
                if self.window_s:
                    self._owed.append(time.monotonic())
            deliveries.append((group, Event(index, piece, finish_reason, len(request.output_ids), None,
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
        free = scheduler.num_free_blocks + self._evictable_blocks()
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
