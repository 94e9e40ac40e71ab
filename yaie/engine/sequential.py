"""The generation loops of models whose cache lives outside the paged KV cache (telescoping, Based).

Such a model keeps a small, constant-size state per sequence instead of blocks, so the scheduler and its
paged cache have nothing to manage. Two loops:

* :func:`run_one_at_a_time` (telescoping): the sequences run one after another, each with a cache of its own;
* :func:`run_batched` (Based): the sequences live in the rows of one batched state and decode together,
  one forward pass per step for all of them; a prompt is prefilled into a free row, a sequence that ends
  frees its row (the last running row moves into it, so the running rows stay ``0 .. n - 1``).
"""

from __future__ import annotations

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


def run_batched(llm, prompt_ids: list[list[int]], params: list, slots):
    """Events ``(request, text piece, its _Text)`` as :meth:`yaie.engine.llm.LLM._run` yields them, every
    running sequence decoding in the same steps.

    ``slots`` holds the sequences' states in rows (:class:`yaie.model.based.BasedSlots`): ``capacity``
    rows, ``prefill(row, ids)`` (a prompt into a row; the logits of its last token), ``decode(tokens,
    positions)`` (one token for each of rows ``0 .. n - 1``; their logits), ``move(src, dst)`` and
    ``row_nbytes()``. Prompts wait until a row is free; each request samples with its own parameters (and
    generator), so its tokens do not depend on what it is batched with.
    """
    from yaie.engine.llm import _sample_rows

    waiting = deque(_requests(llm, prompt_ids, params))
    llm.last_caches = [SequenceRecord(slots.row_nbytes()) for _ in prompt_ids]
    previous = torch.get_num_threads()
    if llm.device.type == "cpu" and llm.cpu_threads:
        torch.set_num_threads(llm.cpu_threads)
    try:
        running: list = []            # row r holds running[r] = (request, text)
        while waiting or running:
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
            logits = slots.decode([r.last_token for r, _ in running], [r.num_tokens - 1 for r, _ in running])
            tokens = _sample_rows(logits, [t for _, t in running])
            ended = []
            for row, ((request, text), token) in enumerate(zip(running, tokens)):
                llm.last_caches[request.request_id].tokens += 1
                piece = text.push(request, token)
                if text.finish_reason is not None:
                    request.state = "finished"
                    ended.append(row)
                yield request, piece, text
            for row in reversed(ended):          # highest first: a moved row is never one that ended
                last = len(running) - 1
                if row != last:
                    slots.move(last, row)
                    running[row] = running[last]
                running.pop()
    finally:
        torch.set_num_threads(previous)
