"""The worker processes of a tensor-parallel engine, as rank 0 sees them: started, told each step, stopped.

Rank 0 is the process that made the ``LLM``: it runs the engine core and sends every other rank, through a
pipe of its own, what to run next (:mod:`yaie.engine.tp_runner`). Ranks 1 .. N-1 are processes that the
engine spawns itself (``torch.multiprocessing``, a fresh interpreter each: no CUDA state is inherited, the
environment is, ``YAIE_SOLUTIONS`` included); each runs :func:`yaie.engine.tp_worker.worker_main`.

Failure: a worker that raises sends its traceback and exits; one that dies, or stops answering, is found
at the next step (its process is checked before each message) or by the collective that waits for it,
which raises after the group's timeout. Either way rank 0 raises a ``RuntimeError`` naming the rank, and
every worker is ended: none outlives the engine. A worker also ends on its own when rank 0's pipe closes
(rank 0 exited) or its parent process is gone.

On GPUs a collective that waits for a dead rank never returns to Python: NCCL's watchdog ends the process
after the timeout. The one-shot all-reduce (:mod:`yaie.model.all_reduce`) has no watchdog of its own (its
kernel spins until the peers arrive), so :meth:`WorkerGroup.watch` stands in for it.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from yaie.model import parallel

READY_POLL_S = 0.5
WATCH_POLL_S = 1.0
STOP_WAIT_S = 5.0
START_TIMEOUT_S = 600.0      # at least, for every rank to start and load its shard (the timeout if longer)


class WorkerGroup:
    """Ranks 1 .. ``world_size`` - 1, started now; this process joins the group as rank 0.

    Args:
        model_dir, dtype: what each worker loads (its shard of the model, as rank 0 does).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL; rank r on GPU r).
        world_size: ranks in all, >= 2.
        timeout_s: how long a rank waits for the others in a collective (a start waits at least
            ``START_TIMEOUT_S``: every rank imports torch and loads its shard).
    """

    def __init__(self, model_dir, dtype: torch.dtype | None, device: torch.device, world_size: int,
                 timeout_s: float):
        from yaie.engine.tp_worker import worker_main

        if parallel.world_size() > 1:
            raise RuntimeError("a tensor-parallel engine is open in this process already: close() it first")
        self.world_size, self.timeout_s, self.device = world_size, timeout_s, device
        self.start_timeout_s = max(timeout_s, START_TIMEOUT_S)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.steps = 0                                   # step messages sent
        self.broken: str | None = None                   # why the group cannot run any more
        self.last_step: torch.cuda.Event | None = None   # marks the end of rank 0's last step on the GPU
        self.watching = False
        self.runners: list = []                          # rank 0's open runners (yaie.engine.tp_runner)
        self._dir = tempfile.mkdtemp(prefix="yaie-tp-")
        context = mp.get_context("spawn")
        self.progress = context.Array("q", world_size, lock=False)   # steps each worker has finished
        self.pipes, self.procs = [], []
        init_file = os.path.join(self._dir, "rendezvous")
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=worker_main, name=f"yaie-tp-rank{rank}", daemon=True,
                                   args=(rank, world_size, init_file, self.backend, timeout_s,
                                         self.start_timeout_s, str(model_dir), dtype,
                                         device.type, theirs, self.progress, os.getpid()))
            proc.start()
            theirs.close()
            self.pipes.append(ours)
            self.procs.append(proc)
        atexit.register(self.stop)
        try:
            parallel.join(0, world_size, init_file, self.backend, timeout_s, self.start_timeout_s,
                          check=lambda: self._raise_if_dead("starting"))
        except RuntimeError as err:
            raise (err if self.broken else self.failure(err, "joining the group")) from None

    def wait_ready(self) -> None:
        """Wait until every worker has loaded its shard; ``RuntimeError`` naming a rank that failed."""
        waiting = dict(zip(range(1, self.world_size), self.pipes))
        deadline = time.monotonic() + self.start_timeout_s
        while waiting:
            for rank, pipe in list(waiting.items()):
                if pipe.poll():
                    message = self._receive(rank, pipe)
                    if message != ("ready",):
                        raise self.failure(None, "loading the model")
                    del waiting[rank]
            self._raise_if_dead("loading the model")
            if waiting and time.monotonic() > deadline:
                raise self.failure(None, f"loading the model (ranks {sorted(waiting)} not ready after "
                                         f"{self.start_timeout_s:g} s)")
            if waiting:
                wait(list(waiting.values()) + [p.sentinel for p in self.procs], READY_POLL_S)

    def launched(self) -> None:
        """Rank 0 has queued a step's kernels (CUDA): mark their end, for :meth:`watch`."""
        if self.device.type == "cuda":
            self.last_step = torch.cuda.Event()
            self.last_step.record()

    def watch(self, gpu_busy=None) -> None:
        """Stand in for NCCL's watchdog: a thread that ends this process, saying why, when a worker has died
        or not finished a step (``progress``) for ``timeout_s`` while rank 0's GPU still runs its last step
        (``gpu_busy()``; default: the mark of :meth:`launched` not reached). Then rank 0 waits on a collective
        that never completes, blocked in a read of the step's result, and cannot raise; a rank 0 whose GPU is
        idle finds the failure itself, at its next step. Once per group (later calls do nothing)."""
        if self.watching:
            return
        self.watching = True

        def busy() -> bool:
            return self.last_step is not None and not self.last_step.query()

        def run():
            since = None
            while self.procs and not self.broken:
                time.sleep(WATCH_POLL_S)
                procs = list(self.procs)
                failed = [r for r, proc in enumerate(procs, start=1)
                          if not proc.is_alive() or self.progress[r] < self.steps]
                if not failed or not (gpu_busy or busy)():
                    since = None
                    continue
                since = since or time.monotonic()
                if time.monotonic() - since > self.timeout_s and self.procs and not self.broken:
                    print(f"yaie: tensor-parallel rank(s) {failed} died or did not finish step {self.steps} "
                          f"within {self.timeout_s:g} s while rank 0 waited for them on the GPU; ending this "
                          f"process (as NCCL's watchdog would)", file=sys.stderr, flush=True)
                    os._exit(1)
        threading.Thread(target=run, name="yaie-tp-watchdog", daemon=True).start()

    def send(self, message) -> None:
        """Send every worker ``message`` (pickled once); ``RuntimeError`` if one is gone."""
        if self.broken:
            raise RuntimeError(self.broken)
        self._raise_if_dead("between steps")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(data)
            except (OSError, ValueError):
                raise self.failure(None, "receiving a step") from None
        if message[0] == "step":
            self.steps += 1

    def failure(self, err: BaseException | None, during: str) -> RuntimeError:
        """The error to raise when the group broke while ``during``: which rank, and why (its traceback, its
        exit code, or that it did not finish its step); every worker is ended first."""
        time.sleep(0.2)                        # a worker that raised has its message on the way
        reasons = []
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs), start=1):
            why = self._why(rank, pipe, proc)
            if why:
                reasons.append(f"tensor-parallel rank {rank} {why}")
        if not reasons:
            reasons.append(f"a tensor-parallel collective failed on rank 0 ({type(err).__name__}: {err})"
                           if err is not None else "the tensor-parallel group failed")
        self.broken = f"{'; '.join(reasons)} ({during}); the engine's workers were stopped"
        self.stop(ask=False)
        return RuntimeError(self.broken)

    def _why(self, rank: int, pipe, proc) -> str | None:
        try:
            if pipe.poll():
                message = pickle.loads(pipe.recv_bytes())
                if message[0] == "error":
                    return f"failed:\n{message[1]}"
        except (EOFError, OSError):
            pass
        if not proc.is_alive():
            return f"exited (exit code {proc.exitcode})"
        if self.progress[rank] < self.steps:
            return f"did not finish step {self.steps} within {self.timeout_s:g} s (hung)"
        return None

    def _raise_if_dead(self, during: str) -> None:
        if any(not proc.is_alive() for proc in self.procs):
            raise self.failure(None, during)

    def _receive(self, rank: int, pipe):
        try:
            return pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            return ("gone",)

    def stop(self, ask: bool = True) -> None:
        """End every worker (asked first, unless ``ask`` is False; killed if it does not end within
        ``STOP_WAIT_S``) and leave the group; safe to call twice."""
        if not self.procs:
            return
        # Rank 0's runners first: their CUDA graphs hold the group's NCCL collectives, and a communicator that
        # graphs still use does not end (a worker closes its runners when told, before it stops).
        for runner in list(self.runners):
            try:
                runner.close()
            except RuntimeError:               # a worker was gone: the group is stopped already
                pass
        for pipe in self.pipes if ask else []:
            try:
                pipe.send_bytes(pickle.dumps(("stop",)))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (STOP_WAIT_S if ask else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for pipe in self.pipes:
            pipe.close()
        self.procs, self.pipes = [], []
        self.broken = self.broken or "the tensor-parallel workers were stopped"
        parallel.leave()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.stop)
