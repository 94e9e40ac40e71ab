"""The server's engine in a process of its own: :class:`ProcessEngine`, and :class:`Frontend` for the server.

Why: an engine step is Python-heavy (scheduling, sampling, detokenizing, for every request), and so is HTTP
(a JSON chunk and a socket write per token per stream). In one process the two share one GIL, so every
token served takes host time from the engine. Here a child process runs the engine loop of
:class:`yaie.engine.async_engine.AsyncEngine` (:class:`_ChildEngine`), reading requests from a pipe and
writing each step's events back in one message; the server's process only checks and tokenizes requests,
routes events to their groups and speaks HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from yaie.engine.async_engine import AsyncEngine
from yaie.engine.llm import DEFAULT_MODEL, LLM, read_generation_config
from yaie.engine.sampling import SamplingParams
from yaie.engine.settings import EngineSettings
from yaie.engine.serving import (Event, EngineStats, RequestGroup, RATE_WINDOW_S, post_events, settle_group,
                                 wait_accepted)
from yaie.model.config import load_config
from yaie.model.tokenizer import Tokenizer


# The counters the child sends the server: every field of EngineStats but the rate window, which the
# server keeps itself (from the events it routes).
STAT_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats) if f.name != "recent")


class ProcessEngine:
    """:class:`AsyncEngine`'s interface (``start``, ``submit``, ``shutdown``, ``alive``, ``stats``) with the
    engine loop in a child process of its own (see the module docstring). ``llm_args``: ``LLM(**llm_args)``
    in the child."""

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
                self._proc.kill()                         # it ignores SIGTERM (see _child_main)
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
        return await wait_accepted(group)

    def abort_group(self, group: RequestGroup) -> None:
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
                    settle_group(group, error)
            elif kind == "events":
                self._route(message[1])
                for name, value in (message[2] or {}).items():
                    setattr(self.stats, name, value)
        self._dead = True            # the child is gone: nothing more will come for anyone
        for group in list(self._groups.values()):
            if group.accepted.done():
                post_events(group.loop, [(group.queue, Event(0, error="the engine process stopped"))] * group.remaining)
            else:
                settle_group(group, RuntimeError("the engine process stopped"))
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
            post_events(loop, batch)
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
    # Ctrl-C and SIGTERM (also when sent to the whole process group) go to the server, which drains its
    # requests and then stops the engine through the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = LLM(**llm_args)
    except BaseException as err:  # noqa: BLE001 (reported to the server process, which exits with it)
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    _ChildEngine(llm, conn, warm_up, window_s)._run()


class Frontend:
    """A model's tokenizer, config and generation defaults, without its weights: what the server process
    needs to check and tokenize requests while a :class:`ProcessEngine` holds the model."""

    def __init__(self, model: str | Path | None = None, block_size: int = 16):
        self.model_dir = Path(model) if model is not None else DEFAULT_MODEL
        self.settings = EngineSettings(block_size=block_size)     # what the server reads of the engine's
        self.config = load_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.generation_config = read_generation_config(self.model_dir)

    default_sampling_params = LLM.default_sampling_params
