"""Rank 0's runner of a tensor-parallel engine: :class:`PagedRunner` on rank 0's shard, telling the workers.

Rank 0 owns everything a step is planned from (the scheduler, the prefix cache, lesson 03's bookkeeping of
blocks) and its shard of the cache's storage; each worker (:mod:`yaie.engine.tp_worker`) owns its shard of
the storage only. Before each forward pass rank 0 sends every worker the step's
:class:`yaie.engine.paged_runner.StepInputs` (sequences, token ids, positions, which rows get logits) and the
block tables that changed since the last step; the decodes' input ids of a looked-ahead step, which live on
rank 0's device, are broadcast over the group. Then all ranks run the same forward pass, rank 0 included, and
meet at each all-reduce. The block tables are the same on every rank: a block id names the same tokens
everywhere, each rank holding its heads of them.

What reaches a worker's storage is only what forward passes write, and that is all a block ever holds here.
Lesson 03 could write a block outside a forward pass in two ways: swapping (refused with tensor parallelism:
``preemption="recompute"``) and copy-on-write (``append_slots`` copies a sequence's last block when it is
partly filled and shared). The engine never shares a partly filled block: the prefix cache holds whole blocks
only (lesson 05's ``cache_sequence``), so a hit gives a sequence whole blocks and its next token goes to a
block of its own; nothing forks. So no block copy has to be repeated on the workers
(``tests/test_tensor_parallel.py`` checks that rank 0 makes none).
"""

from __future__ import annotations

import itertools
import os

import torch

from yaie import switch
from yaie.ops import KernelMissing
from yaie.engine.paged_runner import PagedRunner, StepInputs
from yaie.engine.settings import EngineSettings
from yaie.engine.tp_group import WorkerGroup
from yaie.model import parallel

_runner_ids = itertools.count()


class TensorParallelRunner(PagedRunner):
    """Args:
        model: rank 0's shard (:class:`yaie.model.llama.LlamaModel` in a group).
        settings: the engine's resolved settings.
        workers: the other ranks (:class:`yaie.engine.tp_group.WorkerGroup`).
    """

    def __init__(self, model, settings: EngineSettings, workers: WorkerGroup, kept: bool = True):
        super().__init__(model, settings, kept)
        self.workers = workers
        self.runner_id = next(_runner_ids)
        self._sent: dict = {}          # the tables the workers hold: sequence id -> block ids
        workers.runners.append(self)   # closed before the group ends (WorkerGroup.stop)
        scratch = self.graphs.scratch_block if self.graphs is not None else None
        workers.send(("open", self.runner_id, settings, os.environ.get(switch.ENV_VAR), scratch))
        if parallel.all_reduce_path() == "one-shot":
            workers.watch()            # its all-reduce has no watchdog of its own (yaie/model/all_reduce.py)

    def run(self, inputs: StepInputs, device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Tell the workers, then run rank 0's part (:meth:`PagedRunner.run`); a rank that fails or hangs
        raises ``RuntimeError`` naming it. After any error the workers are ended."""
        block_ids = self.manager.block_ids
        tables = {s: block_ids(s) for s in inputs.seq_ids}
        changed = {s: t for s, t in tables.items() if self._sent.get(s) != t}
        self._sent = tables
        message = StepInputs(inputs.seq_ids, inputs.query_lens, inputs.num_decodes, inputs.token_ids,
                             inputs.positions, [], inputs.logit_rows)
        self.workers.send(("step", self.runner_id, message, changed,
                           0 if device_tokens is None else len(device_tokens)))
        try:
            if device_tokens is not None:
                parallel.broadcast(device_tokens.contiguous())
            logits = super().run(inputs, device_tokens)
            self.workers.launched()
            return logits
        except BaseException as err:
            # The ranks are out of step now: the workers are ended whatever failed. A collective's error is
            # told as what went wrong on which rank; rank 0's own (a lesson's KernelMissing, a kernel's
            # ValueError, an interrupt) goes up as it is.
            failure = self.workers.failure(err, f"step {self.workers.steps}")
            if isinstance(err, RuntimeError) and not isinstance(err, KernelMissing):
                raise failure from None
            raise

    def close(self) -> None:
        """Drop the graphs here and the workers' runner of this one (again: nothing)."""
        if self not in self.workers.runners:
            return
        self.workers.runners.remove(self)
        super().close()
        if not self.workers.broken:
            self.workers.send(("close", self.runner_id))
