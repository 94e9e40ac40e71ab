"""The engine core: requests in, one step at a time, text out. Every front end drives it the same way::

    core.add(prompt_ids, params)           # LLM.generate / LLM.stream, the server's engine thread
    while core.has_unfinished():
        events = core.step()               # one forward pass over the running batch
    events += core.flush()                 # the last step's text

What differs between model kinds is the *runner* (:mod:`yaie.engine.paged_runner`: the paged KV cache;
:mod:`yaie.engine.row_runner`: rows of a constant-size state) and its scheduler; everything else is here,
written once: admission and continuous batching (the scheduler's plan), sampling on the device, stop ids
and strings, logprobs, abort, and the pipelining of steps:

* a step's forward pass and token picks are queued on the device first; the previous step's text is
  decoded while they run (``during``), then this step's tokens are read;
* look-ahead: when the next step can only be the same decodes again (the scheduler's ``can_continue``), it
  is launched before this step's tokens reach the host, its input ids taken from the device. Greedy and
  sampled rows alike: every token is picked on the device (:func:`yaie.engine.sampling.pick_tokens`). Not
  while a request of the step wants log-probabilities (they are read from the step's logits, which the next
  step may overwrite). A request that turns out to end with this step's token ran one step too many: its row
  of the looked-ahead step is dropped.

Not thread-safe: one thread drives a core.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable, NamedTuple, Sequence

import torch

from yaie.engine.launched_step import LaunchedStep
from yaie.engine.output import OutputState
from yaie.engine.request import Request, StepPlan
from yaie.engine.prompts import check_token_ids
from yaie.engine.sampling import SamplingParams, pick_tokens

LOOK_AHEAD_TOKEN = -1   # what a request holds in place of the token being sampled while the next step is planned



class StepEvent(NamedTuple):
    """What a step hands out for each request that sampled a token."""
    request: Request
    text: str               # the text that became final with this token ("" for a request that does not stream)
    state: OutputState      # its output state (it may have moved on since: read ``finish_reason`` here)
    finish_reason: str | None   # set on the request's last event: "stop" or "length"


class EngineCore:
    """Args:
        runner: a :class:`yaie.engine.paged_runner.PagedRunner` or :class:`yaie.engine.row_runner.RowRunner`
            (the core makes its scheduler, ``runner.new_scheduler()``, and calls ``runner.release()`` on close).
        tokenizer: the model's tokenizer (text of the outputs).
        eos_token_ids: the model's end-of-sequence ids.
        cpu_threads: torch threads while the core steps on the CPU (None: torch's own setting).
    """

    def __init__(self, runner, tokenizer, eos_token_ids: Sequence[int], cpu_threads: int | None = None):
        self.runner, self.tokenizer, self.eos_token_ids = runner, tokenizer, list(eos_token_ids)
        self.config = runner.model.config
        self.device = runner.model.device
        self.cpu_threads = cpu_threads
        self.scheduler = runner.new_scheduler()
        self.requests: dict[int, Request] = {}        # unfinished requests by id
        self.states: dict[int, OutputState] = {}
        self.logprobs: dict[int, tuple[int, list]] = {}   # request id -> (k, entries not taken yet)
        self._late: list[tuple[Request, OutputState]] = []   # the last step's requests, their text not decoded
        self._pending: LaunchedStep | None = None    # a looked-ahead step, launched, its tokens not read yet
        self._next_id = 0
        self.prefill_steps = 0      # steps that fed prompt tokens (launched eagerly)
        self.looked_ahead_steps = 0     # steps launched before the tokens of the step before were read

    # ------------------------------------------------------------------ requests
    def add(self, prompt_ids: Sequence[int], params: SamplingParams, logprobs: int | None = None,
            streams: bool = True) -> Request:
        """Queue a request; it joins the batch at the next step. ``ValueError`` for a prompt the model cannot
        read (not ints, outside the vocabulary, no room in the context) or that can never fit in the cache,
        checked before it is queued. ``logprobs``: None, or k >= 0 to get each generated token's
        log-probability and the k most likely ones (:meth:`take_logprobs`). ``streams``: whether its text
        is wanted piece by piece (else events carry ``""`` and only the final text is decoded)."""
        cfg = self.config
        ids = check_token_ids(prompt_ids, cfg)
        if logprobs is not None and not (type(logprobs) is int and 0 <= logprobs <= cfg.vocab_size):
            raise ValueError(f"logprobs must be None or an int in [0, {cfg.vocab_size}], got {logprobs!r}")
        request = Request(self._next_id, ids, min(params.max_tokens, cfg.max_position_embeddings - len(ids)))
        self.scheduler.add(request)
        self._next_id += 1
        self.requests[request.request_id] = request
        self.states[request.request_id] = OutputState(params, self.tokenizer, self.eos_token_ids, streams)
        if logprobs is not None:
            self.logprobs[request.request_id] = (logprobs, [])
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request and free what it holds now; False if it had finished already."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        del self.states[request_id]
        self.logprobs.pop(request_id, None)
        self._late = [(r, state) for r, state in self._late if r is not request]
        if self._pending is not None:    # launched with it, not read yet: its row is ignored
            self._pending.drop(request)
            if self._pending.empty:
                self._pending = None
        self.scheduler.abort(request)
        return True

    def abort_all(self) -> list[int]:
        ids = list(self.requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def close(self) -> None:
        """Abort what is left and give the runner back to its owner."""
        self.abort_all()
        self.runner.release()

    # ------------------------------------------------------------------ steps
    def step(self, during: Callable[[list], None] | None = None) -> list[StepEvent]:
        """One forward pass over the running batch. Returns the *previous* step's events (its text decoded
        while this step runs on the device; :meth:`flush` gives the last step's); with ``during`` they are
        handed to it instead, still while the device works, and the call returns ``[]``. A request whose
        token ended it gave back what it held before the call returns; its last event has ``finish_reason``."""
        try:
            pending = self._pending
            if pending is None:
                plan = self.scheduler.schedule()
                if plan.empty:
                    raise RuntimeError("the scheduler planned an empty step with requests left (a bug)")
                self.prefill_steps += bool(plan.prefills)
                pending = self._launch(plan)
            # Not while a request wants log-probabilities: they are read from this step's logits, which the
            # next step's graph replay would overwrite.
            wanted = self.logprobs and any(r is not None and r.request_id in self.logprobs for r in pending.requests)
            following = None if wanted else self._look_ahead(pending)
        except BaseException:
            self._pending = None
            raise
        self._pending = None
        events = self.flush()
        if during is not None:
            during(events)
            events = []
        tokens = pending.tokens()
        if self.logprobs:
            self._gather_logprobs(pending.requests, pending.logits, tokens)
        for request, token in zip(pending.requests, tokens):
            if request is None:          # ended (or aborted) before this looked-ahead step was read
                continue
            state = self.states[request.request_id]
            kept = state.accept(request, token)
            if state.finish_reason is not None:
                # What it holds goes back before the next step is planned; when the looked-ahead step runs
                # with it, that step fed this token too (a stop id's K/V count as computed).
                fed = following is not None and following.drop(request)
                self.scheduler.finish(request, [] if kept or not fed else [token])
                del self.requests[request.request_id], self.states[request.request_id]
            self._late.append((request, state))
        if following is not None and not following.empty:
            self._pending = following
        return events

    def flush(self) -> list[StepEvent]:
        """The events of the last step's tokens (their text decoded now); ``[]`` when given already."""
        late, self._late = self._late, []
        return [StepEvent(request, state.piece(), state, state.finish_reason) for request, state in late]

    def _launch(self, plan: StepPlan, device_tokens: torch.Tensor | None = None, table=None) -> LaunchedStep:
        """Queue a step and the pick of its tokens on the device, without waiting. ``device_tokens``: the
        decodes' input ids on the device (a looked-ahead step); ``table``: the sampled rows' parameters for
        this step (a looked-ahead step: those of the step before, one token on)."""
        sampled = plan.sampled
        states = [self.states[r.request_id] for r in sampled]
        logits = self.runner.execute(plan, device_tokens)
        tokens, table = pick_tokens(logits, sampled, states, table) if logits is not None else (None, None)
        return LaunchedStep(list(sampled), states, logits, tokens, decode_only=not plan.prefills, table=table)

    def _look_ahead(self, pending: LaunchedStep) -> LaunchedStep | None:
        """Plan and launch the step after ``pending`` before its tokens reach the host, or None: only when it
        can only be ``pending``'s decodes again (the scheduler's ``can_continue``), its runner can feed them
        from the device, and some request does not end by length now. Each request holds a placeholder token
        while the step is planned, so its length counts the token being sampled."""
        requests = pending.requests
        if (pending.device_tokens is None or not pending.decode_only
                or not self.runner.can_look_ahead(len(requests))
                or not self.scheduler.can_continue(requests)
                or all(len(r.output_ids) + 1 >= r.max_new_tokens for r in requests)):
            return None
        for request in requests:
            request.output_ids.append(LOOK_AHEAD_TOKEN)
        try:
            plan = self.scheduler.schedule_decodes()
            if plan.prefills or len(plan.decodes) != len(requests) or not all(
                    map(operator.is_, plan.decodes, requests)):
                raise RuntimeError("a looked-ahead step planned other work than the same decodes (a bug)")
            table = None if pending.table is None else pending.table.next()
            following = self._launch(plan, pending.device_tokens, table)
            self.looked_ahead_steps += 1
            return following
        finally:
            for request in requests:
                request.output_ids.pop()

    # ------------------------------------------------------------------ log-probabilities
    def take_logprobs(self, request_id: int) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
        """The log-probabilities gathered since the last call for a request that asked (else None): per
        generated token, ``(token id, its log-probability, [(id, log-probability)] of the k most likely)``,
        from the model's distribution (log-softmax of the logits, before temperature, top-k and top-p)."""
        entry = self.logprobs.get(request_id)
        if entry is None:
            return None
        taken = list(entry[1])
        entry[1].clear()
        if request_id not in self.requests:      # finished (or aborted): nothing more will come
            del self.logprobs[request_id]
        return taken

    def _gather_logprobs(self, batch: list, logits: torch.Tensor, tokens: list[int]) -> None:
        """Each sampled token's log-probability and the top k, for the requests of ``batch`` that asked (one
        log-softmax over their rows, one copy to the host)."""
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
            if tokens[i] in self.states[request.request_id].stop_ids:   # ends the request, no text: no entry
                continue
            want, entries = self.logprobs[request.request_id]
            entries.append((tokens[i], chosen[row], list(zip(top_ids[row][:want], top_values[row][:want]))))

    # ------------------------------------------------------------------ serving
    def warm_up(self) -> int:
        """Record the decode step's CUDA graph of every batch bucket now, before any client comes (a recording
        takes a while, and in a running batch it would stall every stream): per bucket, that many dummy
        one-token requests (a prefill, then one decode step of exactly that many). Returns the buckets warmed."""
        sizes = self.runner.warm_up_sizes(min(self.scheduler.usable_blocks, self.scheduler.max_num_seqs))
        dummy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        for size in sizes:
            for _ in range(size):
                self.add([0], dummy, streams=False)
            while self.has_unfinished():
                self.step()
            self.flush()
        return len(sizes)

    def next_step_is_eager(self) -> bool:
        """Whether the next step launches its kernels from Python whatever is admitted before it (no graph
        replay): the server's admission window reads it."""
        return self.runner.next_step_is_eager(self.scheduler)

    @contextlib.contextmanager
    def cpu_threads_set(self):
        """Torch's thread count set to ``cpu_threads`` while the core steps on the CPU (restored after)."""
        previous = torch.get_num_threads()
        if self.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)
