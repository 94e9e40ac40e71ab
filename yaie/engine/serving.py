"""What the server's engines hand to the HTTP side: request groups, their events, the counters.

A :class:`RequestGroup` is the requests of one HTTP call (several prompts, ``n`` choices); its events
(:class:`Event`: text pieces, then the finish) arrive in one asyncio queue, posted from the engine's thread
(:class:`yaie.engine.async_engine.AsyncEngine`) or from the reader of an engine process
(:class:`yaie.engine.process_engine.ProcessEngine`). :class:`EngineStats` are the counters ``/metrics`` reads.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from yaie.engine.sampling import SamplingParams

RATE_WINDOW_S = 10.0        # tokens/s in the metrics: generated tokens over the last 10 seconds


@dataclass
class Event:
    """What one request's consumer sees: ``text`` is new text; the last event has ``finish_reason`` set
    ("stop", "length" or "abort"), or ``error`` when the engine failed. ``logprobs``: for a request that
    asked, the new tokens' entries (:meth:`yaie.engine.core.EngineCore.take_logprobs`)."""
    index: int
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    error: str | None = None
    logprobs: list | None = None


class RequestGroup:
    """The requests of one HTTP call (several prompts, ``n`` choices), their events in one asyncio queue."""

    def __init__(self, engine, items: list[tuple[list[int], SamplingParams]],
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
            self.engine.abort_group(self)

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


async def wait_accepted(group):
    """Wait until the engine has taken ``group`` in (or refused it); a client that leaves meanwhile aborts it."""
    try:
        await asyncio.shield(group.accepted)
    except asyncio.CancelledError:
        group.abort()
        raise
    return group


def post_events(loop: asyncio.AbstractEventLoop, batch: list) -> None:
    """Hand events to an asyncio loop from the engine thread (one wake-up per step, not per token)."""
    try:
        loop.call_soon_threadsafe(_put_all, batch)
    except RuntimeError:      # that loop is closed: its clients are gone
        pass


def _put_all(batch: list) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


def settle_group(group: RequestGroup, error: BaseException | None) -> None:
    """Tell ``group``'s loop (from another thread) that the engine took it in (``error`` None) or refused it."""
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
