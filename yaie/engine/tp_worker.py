"""A tensor-parallel worker: ranks 1 .. N-1 of the engine, each in a process of its own.

A worker holds its shard of the model and of the KV cache (its KV heads, every block) and runs the same
forward passes as rank 0, in the same order, on the same inputs: rank 0 sends each step's
:class:`yaie.engine.paged_runner.StepInputs` (without the slots) and the block tables that changed
(:mod:`yaie.engine.tp_runner`); the worker's :class:`WorkerRunner` runs them through the very code rank 0
runs (:meth:`PagedRunner.run`: eager steps, the same CUDA graphs recorded and replayed at the same steps),
so the two meet at every collective. The worker keeps no scheduler: its cache manager's bookkeeping (which
blocks a sequence holds, how many tokens) answers from the tables rank 0 sent (:class:`MirroredTables`); its
storage and ``write_kv`` are lesson 03's, the student's where the switch says so.

Messages (pickled, one pipe per worker): ``("open", runner_id, settings, solutions, scratch_block)``,
``("step", runner_id, inputs, tables, num_device_tokens)``, ``("close", runner_id)``, ``("stop",)``.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback

import torch

from yaie import switch
from yaie.engine.cuda_graphs import SCRATCH_SEQ
from yaie.engine.paged_runner import PagedRunner, StepInputs
from yaie.model import parallel
from yaie.model.llama import LlamaModel

PARENT_POLL_S = 1.0


class MirroredTables:
    """The cache manager's bookkeeping, as rank 0's manager holds it for the sequences of the step being run:
    each one's block ids (``load``) and tokens (its last position + 1), and the CUDA graphs' scratch block."""

    def __init__(self, manager, scratch_block: int | None):
        self.manager, self.block_size = manager, manager.block_size
        self.tables: dict = {}
        self.lens: dict = {}
        if scratch_block is not None:
            self.tables[SCRATCH_SEQ], self.lens[SCRATCH_SEQ] = [scratch_block], 1

    def install(self) -> None:
        """Answer the manager's bookkeeping calls from here (the storage stays the manager's)."""
        for name in ("num_tokens", "block_ids", "block_table", "context_lens", "allocate", "has_seq", "free"):
            setattr(self.manager, name, getattr(self, name))

    def load(self, inputs: StepInputs, changed: dict) -> None:
        """The tables of this step's sequences: those sent now, the others as last sent."""
        scratch = {SCRATCH_SEQ: self.tables[SCRATCH_SEQ]} if SCRATCH_SEQ in self.tables else {}
        self.tables = scratch | {s: changed[s] if s in changed else self.tables[s] for s in inputs.seq_ids}
        ends = [0]
        for n in inputs.query_lens:
            ends.append(ends[-1] + n)
        self.lens = {SCRATCH_SEQ: 1} if scratch else {}
        self.lens.update((s, inputs.positions[end - 1] + 1) for s, end in zip(inputs.seq_ids, ends[1:]))

    def slots(self, inputs: StepInputs) -> torch.Tensor:
        """The cache slot of every new token of the step (lesson 03's rule), int64 on the cache's device."""
        size, slots, row = self.block_size, [], 0
        for seq, n in zip(inputs.seq_ids, inputs.query_lens):
            table = self.tables[seq]
            slots += [table[p // size] * size + p % size for p in inputs.positions[row:row + n]]
            row += n
        return torch.tensor(slots, dtype=torch.int64).to(self.manager.device)

    # ------------------------------------------------------------------ the manager's calls
    def num_tokens(self, seq) -> int:
        return self.lens[seq]

    def block_ids(self, seq) -> list[int]:
        return list(self.tables[seq])

    def block_table(self, seq_ids) -> torch.Tensor:
        width = max(1, max(len(self.tables[s]) for s in seq_ids))
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32).to(self.manager.device)

    def context_lens(self, seq_ids) -> torch.Tensor:
        return torch.tensor([self.lens[s] for s in seq_ids], dtype=torch.int32).to(self.manager.device)

    def allocate(self, seq, num_tokens: int) -> torch.Tensor:
        if seq != SCRATCH_SEQ or SCRATCH_SEQ not in self.tables:
            raise RuntimeError("a tensor-parallel worker allocates no blocks: rank 0 sends its tables")
        return torch.arange(num_tokens, dtype=torch.int64, device=self.manager.device) \
            + self.tables[SCRATCH_SEQ][0] * self.block_size

    def has_seq(self, seq) -> bool:
        return seq in self.tables

    def free(self, seq) -> None:
        self.tables.pop(seq, None)
        self.lens.pop(seq, None)


class WorkerRunner(PagedRunner):
    """Rank 0's :class:`PagedRunner` on this rank's shard, without a scheduler or prefix cache: its manager
    answers from the tables rank 0 sends (:class:`MirroredTables`)."""

    def __init__(self, model, settings, scratch_block: int | None):
        self._scratch_block = scratch_block
        super().__init__(model, settings)

    def _new_manager(self):
        manager = super()._new_manager()
        self.tables = MirroredTables(manager, self._scratch_block)
        self.tables.install()
        return manager

    def step(self, inputs: StepInputs, changed: dict, device_tokens: torch.Tensor | None) -> None:
        self.tables.load(inputs, changed)
        inputs.slots = [self.tables.slots(inputs)]
        self.run(inputs, device_tokens)


def worker_main(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, start_timeout_s: float,
                model_dir: str, dtype: torch.dtype | None, device_type: str, pipe, progress, parent_pid: int) -> None:
    """The worker process: join the group, load this rank's shard, then run what rank 0 sends until it says
    stop or its pipe closes. An exception is sent to rank 0 (its traceback) and ends the process."""
    _watch_parent(parent_pid)
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cpu":
            torch.set_num_threads(1)
        parallel.join(rank, world_size, init_file, backend, timeout_s, start_timeout_s)
        model = LlamaModel.from_pretrained(model_dir, device=device, dtype=dtype)
        pipe.send_bytes(pickle.dumps(("ready",)))
        _serve(pipe, model, progress, rank)
    except BaseException:                     # noqa: BLE001 - any failure goes to rank 0, then the process ends
        try:
            pipe.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except (OSError, ValueError):
            pass
        os._exit(1)
    # Ended without leaving the group: rank 0 stops it (parallel.leave), and nothing here needs tearing down
    # (an NCCL teardown can wait on collectives recorded into CUDA graphs).
    os._exit(0)


def _serve(pipe, model, progress, rank: int) -> None:
    runners: dict[int, WorkerRunner] = {}
    while True:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):          # rank 0 is gone
            return
        kind = message[0]
        if kind == "step":
            _, runner_id, inputs, changed, num_device_tokens = message
            device_tokens = None
            if num_device_tokens:
                device_tokens = parallel.broadcast(torch.empty(num_device_tokens, dtype=torch.int64,
                                                               device=model.device))
            runners[runner_id].step(inputs, changed, device_tokens)
            progress[rank] += 1
        elif kind == "open":
            _, runner_id, settings, solutions, scratch_block = message
            _follow_switch(solutions)
            runners[runner_id] = WorkerRunner(model, settings, scratch_block)
        elif kind == "close":
            runner = runners.pop(message[1], None)
            if runner is not None:
                runner.close()
        elif kind == "stop":
            return


def _follow_switch(solutions: str | None) -> None:
    """Rank 0's lesson switch (``YAIE_SOLUTIONS``) as it stands when it opens a runner."""
    if solutions is None:
        os.environ.pop(switch.ENV_VAR, None)
    else:
        os.environ[switch.ENV_VAR] = solutions


def _watch_parent(parent_pid: int) -> None:
    """End this process when rank 0's process is gone (it may have been killed in a collective)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="yaie-tp-parent-watch", daemon=True).start()
