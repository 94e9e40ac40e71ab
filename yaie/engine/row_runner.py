"""The runner of models that keep a constant-size state per sequence: Based (lesson 08), telescoping (lesson 07).

Each sequence holds one *row* of the model's state, whatever its length: a row of a
:class:`yaie.model.based_rows.BasedRows` (Based: batched, CUDA graphs per batch bucket) or a
:class:`yaie.model.telescoping.TelescopingKVCache` of its own (:class:`SequenceRows`: telescoping caches do
not batch, so a decode step runs one forward pass per row). Both take the same calls: ``prefill(row, ids)``,
``extend(row, ids, start)``, ``decode(tokens, positions)`` of rows ``0 .. n - 1``, ``decode_next(device
tokens)`` (the same rows one token further), ``move(src, dst)``. Its scheduler is
:class:`yaie.engine.row_scheduler.RowScheduler`.
"""

from __future__ import annotations

from typing import Callable

import torch

from yaie.engine.request import StepPlan
from yaie.engine.row_scheduler import RowScheduler
from yaie.engine.runner import Runner
from yaie.engine.settings import EngineSettings
from yaie.model.based_rows import BasedRows
from yaie.model.telescoping import TelescopingKVCache


def has_rows(config) -> bool:
    """Whether a model keeps a constant-size state per sequence (Based or telescoping) instead of KV blocks."""
    return bool(config.based_layers or config.telescoping_capacity)


class RowRunner(Runner):
    """Args:
        model: a Based or telescoping model.
        settings: the engine's resolved :class:`EngineSettings`.
        capacity: rows that decode at once (at most ``settings.max_num_seqs``).
        kept: see :class:`yaie.engine.runner.Runner`.
    """

    def __init__(self, model, settings: EngineSettings, capacity: int, kept: bool = True):
        super().__init__(kept)
        cfg = model.config
        if not has_rows(cfg):
            raise ValueError("this model keeps its keys and values in the paged KV cache: it runs on a PagedRunner")
        self.model, self.settings, self.capacity = model, settings, capacity
        self.key = settings.runner_key()
        # With chunked prefill one row more: the staging row, where a long prompt grows chunk by chunk.
        spare = 1 if settings.chunked_prefill else 0
        self.staging_row = capacity if spare else None
        if cfg.based_layers:
            self.rows = BasedRows(model, capacity, graphs=settings.cuda_graphs, capture=settings.graph_capture,
                                   spare_rows=spare)
        else:
            self.rows = SequenceRows(model, capacity + spare,
                                     lambda: TelescopingKVCache(cfg, cfg.telescoping_capacity, model.device))

    def new_scheduler(self) -> RowScheduler:
        return RowScheduler(self.capacity, self.rows.move, self.settings.max_num_batched_tokens, self.staging_row)

    def reusable(self, key: tuple, rows: int) -> bool:
        """Whether a run of ``rows`` sequences may use this runner again (the same settings and kernels, rows
        enough). Rows hold nothing between runs: a prompt replaces what its row held."""
        return key == self.key and rows <= self.capacity

    def can_look_ahead(self, num_decodes: int) -> bool:
        return True        # decode_next feeds the rows from the device, graphs or not

    def warm_up_sizes(self, usable: int) -> list[int]:
        """The batch sizes whose decode graphs a warm-up records (each at most ``usable`` rows)."""
        static = getattr(self.rows, "static", False)
        return [b for b in self.rows.buckets if b <= usable] if static else []

    def next_step_is_eager(self, scheduler: RowScheduler) -> bool:
        """Whether the next step launches kernels from Python whatever is admitted before it: a prompt is
        prefilled (waiting with a row free, or staged), or decode steps replay no CUDA graph."""
        return bool(not getattr(self.rows, "capture", False) or scheduler.staged is not None
                    or (scheduler.waiting and scheduler.num_free_blocks > 0))

    def execute(self, plan: StepPlan, device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Queue one step: the decode of the running rows first (a graph's bucket pads the rows above them,
        so a prompt prefilled there before would be overwritten), then each prompt chunk into its row. The
        logits ``[len(plan.sampled), vocab]``, or None when no row samples. ``device_tokens``: the decodes'
        input ids on the device (a looked-ahead step: the same rows one token further)."""
        logits = []
        if plan.decodes:
            if device_tokens is not None:
                logits.append(self.rows.decode_next(device_tokens))
            else:
                logits.append(self.rows.decode([r.last_token for r in plan.decodes],
                                               [r.num_tokens - 1 for r in plan.decodes]))
        for request, row, (start, end) in zip(plan.prefills, plan.prefill_slots, plan.prefill_ranges):
            ids = request.prompt_ids[start:end]
            out = self.rows.prefill(row, ids) if start == 0 else self.rows.extend(row, ids, start)
            if end == request.num_tokens:
                logits.append(out)
        if not logits:
            return None
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def row_nbytes(self) -> int:
        """Bytes one sequence holds, at any length."""
        return self.rows.row_nbytes()

    def close(self) -> None:
        """Nothing to give back: the rows go with the runner."""


class SequenceRows:
    """Rows over a model whose per-sequence caches do not batch (telescoping): each row holds a cache of its
    own (``make_cache()``), and a decode step runs one forward pass per row. The calls of
    :class:`yaie.model.based_rows.BasedRows`."""

    def __init__(self, model, rows: int, make_cache: Callable[[], object]):
        self.model, self.device, self.make_cache = model, model.device, make_cache
        self.caches: list = [None] * rows
        self._positions: list[int] | None = None       # the last decode step's, while the rows are unchanged

    def prefill(self, row: int, token_ids: list[int]) -> torch.Tensor:
        self._positions = None
        self.caches[row] = self.make_cache()
        return self._forward(row, torch.tensor(token_ids, device=self.device), 0)

    def extend(self, row: int, token_ids: list[int], start: int) -> torch.Tensor:
        self._positions = None
        return self._forward(row, torch.tensor(token_ids, device=self.device), start)

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        if len(tokens) != len(positions) or not 1 <= len(tokens) <= len(self.caches):
            raise ValueError(f"a decode step takes 1..{len(self.caches)} rows with one position each, got "
                             f"{len(tokens)} tokens and {len(positions)} positions")
        self._positions = list(positions)
        ids = torch.tensor(tokens, device=self.device)
        return torch.cat([self._forward(row, ids[row:row + 1], p) for row, p in enumerate(positions)])

    def decode_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decode step after the last one: the same rows one position further, ``tokens`` on the device."""
        if self._positions is None or tuple(tokens.shape) != (len(self._positions),):
            raise ValueError("decode_next continues the last decode step's rows, unchanged since: call decode")
        self._positions = [p + 1 for p in self._positions]
        return torch.cat([self._forward(row, tokens[row:row + 1], p) for row, p in enumerate(self._positions)])

    def move(self, src: int, dst: int) -> None:
        self._positions = None
        self.caches[dst] = self.caches[src]

    def row_nbytes(self) -> int:
        """Bytes of the first row's cache (every cache is the same size once it holds ``capacity`` entries)."""
        return self.caches[0].nbytes() if self.caches[0] is not None else 0

    def _forward(self, row: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        return self.model.logits(self.model.forward(ids, positions, self.caches[row])[-1:])
