"""The runner of models whose keys and values live in the paged KV cache (Llama, Qwen2, Mistral).

A runner owns the memory a model kind keeps per sequence and runs one planned step on it. This one owns
lesson 03's ``KVCacheManager``, lesson 05's prefix cache over it (automatic prefix caching) and the CUDA
graphs of decode steps; :meth:`PagedRunner.execute` turns a :class:`yaie.engine.request.StepPlan` into one
forward pass: a graph replay for a decode-only step that fits a bucket, else a :class:`PagedStep` launched
eagerly. Its scheduler is :class:`yaie.engine.scheduler.Scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yaie import ops
from yaie.engine.cuda_graphs import SCRATCH_SEQ, DecodeGraphs
from yaie.engine.prefix_cache import make_prefix_cache
from yaie.engine.request import StepPlan
from yaie.engine.runner import Runner
from yaie.engine.scheduler import Scheduler
from yaie.engine.settings import EngineSettings
from yaie.model.paged import PagedStep


@dataclass
class StepInputs:
    """What one forward pass over the paged cache reads, drawn from a :class:`StepPlan`: the step's sequences
    (decodes first, then prefill chunks), new tokens per sequence, the packed token ids and positions, the
    cache slots of the new tokens (one tensor per sequence, not joined yet: a graph replay computes them
    itself) and the rows whose logits are returned (every sequence whose chunk reaches its last token)."""

    seq_ids: list
    query_lens: list[int]
    num_decodes: int
    token_ids: list[int]
    positions: list[int]
    slots: list[torch.Tensor]
    logit_rows: list[int]

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.seq_ids)

    @classmethod
    def of(cls, plan: StepPlan) -> "StepInputs":
        # A prefill feeds its chunk: the tokens after its cached prefix (a prefix-cache hit, or the chunks of
        # earlier steps), up to the end of its tokens or of the step's budget. (A decode reads its last token
        # and length, not ``token_ids``: that would copy its whole context.)
        decodes, prefills, ranges = plan.decodes, plan.prefills, plan.prefill_ranges
        token_ids = [r.last_token for r in decodes]
        positions = [r.num_tokens - 1 for r in decodes]
        logit_rows = list(range(len(decodes)))
        row = len(decodes)
        for r, (start, end) in zip(prefills, ranges):
            token_ids += r.token_ids[start:end]
            positions += range(start, end)
            row += end - start
            if end == r.num_tokens:   # logits only where a token is sampled, not after a partial chunk
                logit_rows.append(row - 1)
        return cls([r.request_id for r in decodes + prefills],
                   [1] * len(decodes) + [end - start for start, end in ranges], len(decodes), token_ids, positions,
                   plan.decode_slots + plan.prefill_slots, logit_rows)


class PagedRunner(Runner):
    """Args:
        model: a :class:`yaie.model.llama.LlamaModel`.
        settings: the engine's resolved :class:`EngineSettings`.
        kept: see :class:`yaie.engine.runner.Runner`.
    """

    def __init__(self, model, settings: EngineSettings, kept: bool = True):
        super().__init__(kept)
        self.model, self.settings = model, settings
        self.device = model.device
        self.key = settings.runner_key()
        graphs = settings.cuda_graphs
        self.manager = self._new_manager()
        self.graphs = DecodeGraphs(model, self.manager, settings.max_num_seqs, capture=settings.graph_capture) \
            if graphs else None
        self.prefix_cache = make_prefix_cache(self.manager) if settings.prefix_caching else None

    def _new_manager(self):
        """Lesson 03's cache for this model's KV heads (this rank's, in a tensor-parallel group). One block more
        than ``num_blocks`` with CUDA graphs: their scratch block, which padding rows write into."""
        s, cfg, model = self.settings, self.model.config, self.model
        return ops.kv_cache_manager(
            s.num_blocks + (1 if s.cuda_graphs else 0), s.block_size, cfg.num_layers, model.num_kv_heads,
            cfg.head_dim, model.dtype, self.device, s.num_cpu_blocks,
            swap=s.preemption == "swap" and s.num_cpu_blocks > 0)

    def new_scheduler(self) -> Scheduler:
        s = self.settings
        return Scheduler(self.manager, s.preemption, s.max_num_seqs, s.max_num_batched_tokens,
                         reserved_blocks=1 if self.graphs is not None else 0, prefix_cache=self.prefix_cache,
                         chunked_prefill=s.chunked_prefill)

    def reusable(self, key: tuple, rows: int) -> bool:
        """Whether the next run may use this runner again: the same settings and kernels (recorded graphs
        replay the kernels they recorded), and the last run gave every block back."""
        try:
            clean = set(self.manager.seq_ids()) <= {SCRATCH_SEQ}
        except NotImplementedError:          # a student's cache without seq_ids yet: start afresh
            return False
        return key == self.key and clean and self.manager.num_free_cpu_blocks == self.settings.num_cpu_blocks

    def can_look_ahead(self, num_decodes: int) -> bool:
        """Whether a step of ``num_decodes`` decodes can be launched from tokens on the device (a graph)."""
        return self.graphs is not None and self.graphs.fits(num_decodes)

    def warm_up_sizes(self, usable: int) -> list[int]:
        """The batch sizes whose decode graphs a warm-up records (each at most ``usable`` requests)."""
        return [] if self.graphs is None else [b for b in self.graphs.buckets if b <= usable]

    def next_step_is_eager(self, scheduler: Scheduler) -> bool:
        """Whether the next step launches its kernels from Python whatever is admitted before it: a prompt
        waits or is swapped out, a running request is still prefilling, no graphs, or the batch is beyond
        them."""
        running = scheduler.running
        return bool(self.graphs is None or scheduler.waiting or scheduler.swapped
                    or (running and not self.graphs.fits(len(running))) or any(r.prefilling for r in running))

    def execute(self, plan: StepPlan, device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Queue one forward pass over the plan's decodes and prefill chunks, without waiting for it: the
        logits ``[len(plan.sampled), vocab]``, or None when no request of the step samples a token.
        ``device_tokens``: the decodes' input ids, on the device (a looked-ahead step)."""
        return self.run(StepInputs.of(plan), device_tokens)

    def run(self, inputs: StepInputs, device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`execute` of a plan's :class:`StepInputs`: a graph replay for a decode-only step that fits a
        bucket, else the step launched eagerly."""
        graphs = self.graphs
        if graphs is not None and inputs.decode_only and graphs.fits(inputs.num_decodes):
            logits = self._replay(inputs, device_tokens)
            if logits is not None:        # None: recording failed, this step (and the next) runs eagerly
                return logits
        return self._eager(inputs, device_tokens)

    def _replay(self, inputs: StepInputs, device_tokens: torch.Tensor | None) -> torch.Tensor | None:
        seq_ids = inputs.seq_ids
        if device_tokens is not None and self.graphs.continues(seq_ids):
            # The last step's sequences, one token further: the buffers advance on the device.
            logits = self.graphs.run_next(seq_ids, device_tokens)
            if logits is not None:
                return logits
        return self.graphs.run(seq_ids, inputs.token_ids, inputs.positions, device_tokens)

    def _eager(self, inputs: StepInputs, device_tokens: torch.Tensor | None) -> torch.Tensor | None:
        step = PagedStep(self.manager, inputs.seq_ids, inputs.query_lens, inputs.num_decodes, torch.cat(inputs.slots))
        tokens = torch.tensor(inputs.token_ids, device=self.device)
        if device_tokens is not None:
            tokens[:len(device_tokens)] = device_tokens       # the decodes come first
        hidden = self.model.forward(tokens, torch.tensor(inputs.positions, device=self.device), step)
        if not inputs.logit_rows:
            return None
        return self.model.logits(hidden[torch.tensor(inputs.logit_rows, device=self.device)])

    def close(self) -> None:
        """Drop the graphs (they hold the cache's addresses); the cache goes with the runner."""
        if self.graphs is not None:
            self.graphs.close()

