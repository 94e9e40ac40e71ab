"""What the engine knows of one request, and what one step runs.

A :class:`Request` is created by :meth:`yaie.engine.core.EngineCore.add` and lives until it finishes or is
aborted; the scheduler moves it between its queues (``state``). A :class:`StepPlan` is what a scheduler
hands the runner for one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """One prompt in flight. ``request_id`` is its arrival number (smaller = older = served first)."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    state: str = "waiting"                 # waiting, running, swapped or finished
    num_preemptions: int = 0
    num_cached_tokens: int = 0             # of token_ids, read from the prefix cache at admission (not prefilled)
    num_computed_tokens: int = 0           # of token_ids, in the cache once the step just planned has run

    @property
    def prefilling(self) -> bool:
        """True while more than its last token is still to be fed (a chunked prefill in progress, or not
        admitted yet). A request with exactly its last token left decodes: that is one decode step."""
        return self.num_computed_tokens < len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def token_ids(self) -> list[int]:
        """Prompt + generated tokens: what a (re-)prefill feeds (a new list: a decode step reads
        ``num_tokens`` and ``last_token`` instead, which copy nothing)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def max_cached_tokens(self) -> int:
        """Most tokens this request holds in the cache when its steps run one after the other (the last
        generated token is never fed). A looked-ahead step may feed it one token more: the look-ahead only runs
        when every request's next slot fits in the free blocks."""
        return len(self.prompt_ids) + self.max_new_tokens - 1


@dataclass
class StepPlan:
    """What the next forward pass runs: decodes (one token each) then prefills (a chunk of tokens each:
    ``token_ids[start:end]`` for ``(start, end)`` in ``prefill_ranges``), and where each request's new tokens
    go (``decode_slots``, ``prefill_slots``): the cache slots reserved for them (int64 tensors, the paged KV
    cache) or the request's row (an int, the rows of a constant-size state)."""

    decodes: list[Request] = field(default_factory=list)
    decode_slots: list[torch.Tensor | int] = field(default_factory=list)
    prefills: list[Request] = field(default_factory=list)
    prefill_slots: list[torch.Tensor | int] = field(default_factory=list)
    prefill_ranges: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def sampled(self) -> list[Request]:
        """The requests that get a token from this step, in row order: every decode, and each prefill whose
        chunk reaches the end of its tokens (a partial chunk only fills the cache)."""
        return self.decodes + [r for r, (_, end) in zip(self.prefills, self.prefill_ranges)
                               if end == r.num_tokens]

    def add_decode(self, request: Request, where: torch.Tensor | int) -> None:
        self.decodes.append(request)
        self.decode_slots.append(where)

    def add_prefill(self, request: Request, where: torch.Tensor | int, start: int, end: int) -> None:
        self.prefills.append(request)
        self.prefill_slots.append(where)
        self.prefill_ranges.append((start, end))
