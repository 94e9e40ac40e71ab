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

Each request keeps its own sampler and seed (as in ``LLM.generate``), so a request's text does not depend
on who else is in the batch: the server's answer for a seed equals ``LLM.generate``'s.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Sequence

import torch

from yaie.engine.llm import LLM, _Text
from yaie.engine.sampling import SamplingParams
from yaie.engine.scheduler import Request, Scheduler

RATE_WINDOW_S = 10.0        # tokens/s in the metrics: generated tokens over the last 10 seconds


class StepEngine:
    """``LLM``'s generation loop cut into calls: add requests, step, abort (see the module docstring)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._cache = llm._cache_for_run()          # held (in use) until close()
        graphs = self._cache.graphs
        self.scheduler = Scheduler(self._cache.manager, llm.preemption, llm.max_num_seqs,
                                   llm.max_num_batched_tokens, reserved_blocks=1 if graphs is not None else 0,
                                   prefix_cache=self._cache.prefix_cache)
        llm.last_scheduler, llm.last_graphs = self.scheduler, graphs
        self.requests: dict[int, Request] = {}      # unfinished requests by id
        self.texts: dict[int, _Text] = {}
        self._next_id = 0

    @property
    def manager(self):
        return self.scheduler.manager

    def add(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request (it joins the batch at the next step). ValueError if it can never fit in the
        cache; the prompt is taken as checked (``LLM._prompt_ids``)."""
        room = self.llm.config.max_position_embeddings - len(prompt_ids)
        request = Request(self._next_id, list(prompt_ids), min(params.max_tokens, room))
        self.scheduler.add(request)
        self._next_id += 1
        self.requests[request.request_id] = request
        self.texts[request.request_id] = _Text(self.llm, params)
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
            warmed += 1
        return warmed

    def step(self) -> list[tuple[Request, str, _Text]]:
        """One forward pass; one event ``(request, new text, its _Text)`` per request in the batch.
        A finished request (``text.finish_reason`` set) has given its blocks back already."""
        plan = self.scheduler.schedule()
        if plan.empty:
            raise RuntimeError("the scheduler planned an empty step with requests left (a bug)")
        batch = plan.decodes + plan.prefills
        tokens = self.llm._forward(self.manager, plan, [self.texts[r.request_id] for r in batch],
                                   self._cache.graphs)
        events = []
        for request, token in zip(batch, tokens):
            text = self.texts[request.request_id]
            piece = text.push(request, token)
            if text.finish_reason is not None:
                self.scheduler.finish(request)
                del self.requests[request.request_id], self.texts[request.request_id]
            events.append((request, piece, text))
        return events

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request and free its blocks now; False if it had finished already."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        del self.texts[request_id]
        self.scheduler.abort(request)
        return True

    def abort_all(self) -> list[int]:
        ids = list(self.requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def close(self) -> None:
        """Abort what is left and give the KV cache back to the ``LLM`` (kept for its next run)."""
        self.abort_all()
        self._cache.in_use = False


@dataclass
class Event:
    """What one request's consumer sees: ``text`` is new text; the last event has ``finish_reason`` set
    ("stop", "length" or "abort"), or ``error`` when the engine failed."""
    index: int
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    error: str | None = None


class RequestGroup:
    """The requests of one HTTP call (several prompts, ``n`` choices), their events in one asyncio queue."""

    def __init__(self, engine: "AsyncEngine", items: list[tuple[list[int], SamplingParams]]):
        self.engine = engine
        self.items = items
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

    async def events(self):
        """Events until every request of the group has finished."""
        while self.unfinished:
            event = await self.queue.get()
            if event is None:         # the consumer's own wake-up (its client left): stop here
                return
            if event.finish_reason is not None or event.error is not None:
                self.unfinished -= 1
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
    """One background thread that owns a :class:`StepEngine` and steps it while requests are unfinished.

    ``start()`` before use (it returns once the CUDA graphs are recorded, ``warm_up``), ``shutdown()``
    after (both from any thread). ``submit`` is a coroutine.
    """

    def __init__(self, llm: LLM, warm_up: bool = True):
        self.llm = llm
        self.warm_up = warm_up          # record every CUDA graph before serving (StepEngine.warm_up)
        self.stats = EngineStats()
        self.core: StepEngine | None = None     # the engine thread's; read it only for tests and metrics
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[RequestGroup] = []
        self._aborts: list[RequestGroup] = []
        self._stopping = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._owner: dict[int, tuple[RequestGroup, int]] = {}   # request id -> (group, index in group)

    # ------------------------------------------------------------------ life
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
    async def submit(self, items: list[tuple[list[int], SamplingParams]]) -> RequestGroup:
        """Queue requests; returns once the engine thread has taken them (at its next step).
        ValueError when one can never fit in the cache (then none of them runs)."""
        group = RequestGroup(self, items)
        with self._lock:
            if self._stopping or not self.alive:
                raise RuntimeError("the engine is shutting down")
            self._inbox.append(group)
        self._wake.set()
        try:
            await asyncio.shield(group.accepted)
        except asyncio.CancelledError:
            group.abort()
            raise
        return group

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
            self.core = StepEngine(llm)
        except BaseException as err:     # noqa: BLE001 (handed to start()'s caller)
            self._start_error = err
            self._started.set()
            return
        self.stats.blocks_total = self.core.scheduler.usable_blocks
        try:
            if self.warm_up:
                self.core.warm_up()
        except Exception:  # noqa: BLE001 (graphs that cannot record: the engine runs those steps eagerly)
            traceback.print_exc()
            self.core.abort_all()
        self._started.set()
        try:
            while True:
                self._wake.clear()
                with self._lock:
                    stopping = self._stopping
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for group in aborts:
                    self._abort_now(group)
                for group in inbox:
                    self._accept(group)
                if stopping:
                    break
                if not self.core.has_unfinished():
                    self._update_stats()
                    self._wake.wait(timeout=1.0)
                    continue
                self._step()
        finally:
            for group in self._live_groups():
                self._fail(group, "the server is shutting down")
            with self._lock:
                for group in self._inbox:
                    _resolve(group, RuntimeError("the engine is shutting down"))
                self._inbox = []
            self.core.close()
            self._update_stats()

    def _accept(self, group: RequestGroup) -> None:
        if group.aborted:
            _resolve(group, None)
            return
        requests = []
        try:
            for index, (prompt_ids, params) in enumerate(group.items):
                requests.append(self.core.add(prompt_ids, params))
                self._owner[requests[-1].request_id] = (group, index)
        except ValueError as err:
            for request in requests:
                self.core.abort(request.request_id)
                del self._owner[request.request_id]
            _resolve(group, err)
            return
        group.request_ids = [r.request_id for r in requests]
        self.stats.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        _resolve(group, None)

    def _abort_now(self, group: RequestGroup) -> None:
        for request_id in group.request_ids:
            if request_id in self._owner:
                del self._owner[request_id]
                if self.core.abort(request_id):
                    self.stats.requests_aborted += 1

    def _step(self) -> None:
        try:
            events = self.core.step()
        except Exception as err:  # noqa: BLE001 (a failed step fails its requests, not the server)
            message = f"the engine failed: {type(err).__name__}: {err}"
            traceback.print_exc()
            for group in self._live_groups():
                self._fail(group, message)
            return
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for request, piece, text in events:
            owner = self._owner.get(request.request_id)
            if owner is None:
                continue
            group, index = owner
            event = Event(index, piece, text.finish_reason, len(request.output_ids))
            if text.finish_reason is not None:
                del self._owner[request.request_id]
                self.stats.requests_finished += 1
            deliveries.setdefault(group.loop, []).append((group.queue, event))
        for loop, batch in deliveries.items():
            _post(loop, batch)
        self.stats.generation_tokens += len(events)
        self.stats.recent.append((time.monotonic(), len(events)))
        self._update_stats()

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
                batch.append((group.queue, Event(owner[1], error=message)))
        if batch:
            _post(group.loop, batch)

    def _update_stats(self) -> None:
        s, scheduler = self.stats, self.core.scheduler
        s.running, s.waiting, s.swapped = len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped)
        free = self.core.manager.num_free_blocks
        if scheduler.prefix_cache is not None:     # unlocked cached prefixes: held by no request, evictable
            free += scheduler.prefix_cache.tree.num_evictable_blocks
        s.blocks_used = scheduler.usable_blocks - min(scheduler.usable_blocks, free)
        s.steps = scheduler.stats.steps
        s.preemptions = scheduler.stats.preempted_by_recompute + scheduler.stats.preempted_by_swap
        now = time.monotonic()
        while s.recent and now - s.recent[0][0] > RATE_WINDOW_S:
            s.recent.popleft()


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
