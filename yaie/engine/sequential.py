"""The generation loops of models whose cache lives outside the paged KV cache (telescoping, Based).

Such a model keeps a small, constant-size state per sequence instead of blocks, so the scheduler and its
paged cache have nothing to manage. Two loops:

* :func:`run_one_at_a_time` (telescoping): the sequences run one after another, each with a cache of its own;
* :func:`run_batched` (Based): the sequences live in the rows of one batched state and decode together,
  one forward pass per step for all of them; a prompt is prefilled into a free row, a sequence that ends
  frees its row (the last running row moves into it, so the running rows stay ``0 .. n - 1``). While the
  rows stay the same, each step is launched before the last one's tokens reach the host, its input ids
  taken from the device (a look-ahead, as :meth:`yaie.engine.llm.LLM._look_ahead` does for the paged engine).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable

import torch


def _requests(llm, prompt_ids: list[list[int]], params: list) -> list:
    """``(Request, _Text)`` of every prompt, all checked before any work: a prompt with no room left under
    ``max_position_embeddings`` raises ``ValueError``."""
    from yaie.engine.llm import _Text
    from yaie.engine.scheduler import Request

    limit = llm.config.max_position_embeddings
    requests = []
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        room = limit - len(ids)
        if room < 1:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; the model takes at most {limit}")
        requests.append((Request(i, list(ids), min(p.max_tokens, room)), _Text(llm, p)))
    return requests


def run_one_at_a_time(llm, prompt_ids: list[list[int]], params: list, make_cache: Callable[[], object]):
    """Events ``(request, text piece, its _Text)`` as :meth:`yaie.engine.llm.LLM._run` yields them.

    ``make_cache()`` gives a fresh cache for each sequence (the model's ``forward`` takes it as its
    ``cache``); ``llm.last_caches`` keeps them (for tests and memory measurements).
    """
    from yaie.engine.llm import _sample_rows

    model = llm.model
    llm.last_caches = []
    for request, text in _requests(llm, prompt_ids, params):
        ids = request.prompt_ids
        cache = make_cache()
        llm.last_caches.append(cache)
        request.state = "running"
        feed = torch.tensor(ids, dtype=torch.int64, device=llm.device)   # the prompt first, then one token
        position = 0
        while True:
            positions = torch.arange(position, position + feed.numel(), device=llm.device)
            hidden = model.forward(feed, positions, cache)
            token = _sample_rows(model.logits(hidden[-1:]), [text])[0]
            position += feed.numel()
            piece = text.push(request, token)
            if text.finish_reason is not None:
                request.state = "finished"
                yield request, piece, text
                break
            yield request, piece, text
            feed = torch.tensor([token], dtype=torch.int64, device=llm.device)


class SequenceRecord:
    """What one sequence of :func:`run_batched` held: ``nbytes()`` (its row of the batched state, the same
    at any length) and ``len()`` (tokens it read). ``llm.last_caches`` lists them, in prompt order."""

    def __init__(self, nbytes: int):
        self._nbytes = nbytes
        self.tokens = 0

    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return self.tokens


def run_batched(llm, prompt_ids: list[list[int]], params: list, slots, look_ahead: bool = True):
    """Events ``(request, text piece, its _Text)`` as :meth:`yaie.engine.llm.LLM._run` yields them, every
    running sequence decoding in the same steps.

    ``slots`` holds the sequences' states in rows (:class:`yaie.model.based.BasedSlots`): ``capacity``
    rows, ``prefill(row, ids)`` (a prompt into a row; the logits of its last token), ``decode(tokens,
    positions)`` (one token for each of rows ``0 .. n - 1``; their logits), ``decode_next(device_tokens)``
    (the same rows again, one position further), ``move(src, dst)`` and ``row_nbytes()``. Prompts wait
    until a row is free; each request samples with its own parameters (and generator), so its tokens do
    not depend on what it is batched with.

    A decode step's tokens are picked on the device. With ``look_ahead`` (the default), when the next step
    can only be the same rows again, it is launched before this step's tokens reach the host, fed from the
    device (:func:`_look_ahead`): the host turns one step's tokens into text while the device runs the
    next. ``look_ahead=False`` reads every step's tokens before launching the next (the same tokens).
    """
    from yaie.engine.llm import _sample_rows

    waiting = deque(_requests(llm, prompt_ids, params))
    llm.last_caches = [SequenceRecord(slots.row_nbytes()) for _ in prompt_ids]
    previous = torch.get_num_threads()
    if llm.device.type == "cpu" and llm.cpu_threads:
        torch.set_num_threads(llm.cpu_threads)
    try:
        running: list = []            # row r holds running[r] = (request, text)
        pending = None                # a launched decode step whose tokens the host has not read yet
        while waiting or running:
            if pending is None:
                while waiting and len(running) < slots.capacity:        # admit prompts into free rows
                    request, text = waiting.popleft()
                    request.state = "running"
                    logits = slots.prefill(len(running), request.prompt_ids)
                    llm.last_caches[request.request_id].tokens = len(request.prompt_ids)
                    piece = text.push(request, _sample_rows(logits, [text])[0])
                    if text.finish_reason is None:
                        running.append((request, text))
                    else:
                        request.state = "finished"
                    yield request, piece, text
                if not running:
                    continue
                pending = _launch(slots, running)
            following = _look_ahead(slots, running, pending, bool(waiting)) if look_ahead else None
            ended = []
            for request, text, token in zip(pending.requests, pending.texts, pending.tokens()):
                if request is None:       # it ended with the step before: this looked-ahead row is discarded
                    continue
                llm.last_caches[request.request_id].tokens += 1
                piece = text.push(request, token)
                if text.finish_reason is not None:
                    request.state = "finished"
                    ended.append(request)
                    if following is not None:
                        following.drop(request)      # the step after fed it this token: its row is discarded
                yield request, piece, text
            _free_rows(slots, running, ended)
            pending = following
    finally:
        torch.set_num_threads(previous)


def _launch(slots, running: list, device_tokens: torch.Tensor | None = None, table=None):
    """Queue one decode step of the running rows and the pick of its tokens on the device, without waiting
    (a :class:`yaie.engine.llm._Launched`: its tokens go to pinned host memory behind an event, so reading
    them waits for this step alone). ``device_tokens``: the rows' input ids on the device (a looked-ahead
    step, ``slots.decode_next``); else each request's last token and position, from the host. ``table``:
    the last step's :class:`yaie.engine.sampling.StepTable` when it sampled the same requests in the same rows."""
    from yaie.engine.llm import _device_tokens, _Launched

    requests, texts = [r for r, _ in running], [t for _, t in running]
    if device_tokens is None:
        logits = slots.decode([r.last_token for r in requests], [r.num_tokens - 1 for r in requests])
    else:
        logits = slots.decode_next(device_tokens)
    tokens, table = _device_tokens(logits, texts, table)
    launched = _Launched(requests, texts, logits, tokens, decode_only=True)
    launched.table = table
    return launched


def _look_ahead(slots, running: list, pending, prompts_wait: bool):
    """Launch the step after ``pending`` before its tokens reach the host, or None.

    Why it is correct. It runs only when that step can only be ``pending``'s rows again, in the same order:

    * ``pending`` ran exactly the running rows and nothing moved since (no row of it was dropped: a drop
      means a row ended, and ending rows are what ``move`` follows), so ``decode_next`` feeds row ``i``
      the token ``pending`` picked for row ``i``, one position further;
    * no prompt waits: a row freed by this step would take a prompt before the next step (a look-ahead
      would change when it is admitted);
    * some row does not end by length with this step (else the step would be wasted).

    A row may still end with ``pending``'s token (a stop id, a stop string, its length): the looked-ahead
    step has then fed it one token too many. That row's work is thrown away: the caller drops its row
    from the looked-ahead step (its token is never read); what the step wrote touched that row alone (its
    Based states, its ring pages, its own generator's draw); and the ``move`` that packs the rows after it
    is queued behind the looked-ahead step, so the row moved down carries the state that step gave it,
    which is the state its own request expects (it was fed its true token). The step after a drop is
    launched from the host again (the rows changed: ``decode_next`` refuses them).

    Rows without a seed share the device's default generator: a discarded row's draw moves that shared
    stream (their tokens were never independent of the batch). Seeded and greedy rows get the tokens
    they get without a look-ahead."""
    requests = [r for r, _ in running]
    if (prompts_wait or len(pending.requests) != len(requests)
            or not all(map(operator.is_, pending.requests, requests))
            or all(len(r.output_ids) + 1 >= r.max_new_tokens for r in requests)):
        return None
    return _launch(slots, running, pending.device_tokens, pending.table)


def free_row(slots, running: list, row: int) -> None:
    """Free ``row`` keeping the running rows ``0 .. n - 1`` packed: the last running row's sequence moves into
    it (``slots.move``; ``running[i]`` is what row ``i`` holds), then the last entry goes."""
    last = len(running) - 1
    if row != last:
        slots.move(last, row)
        running[row] = running[last]
    running.pop()


def _free_rows(slots, running: list, ended: list) -> None:
    """Take the ended requests out of their rows (:func:`free_row`). Rows are found by request (a
    looked-ahead step reads its rows in launch order), then freed highest first, so a row moved down is never
    one that ended."""
    rows = sorted((i for i, (r, _) in enumerate(running) if any(r is e for e in ended)), reverse=True)
    for row in rows:
        free_row(slots, running, row)
