"""The tensor-parallel group of this process: its rank, its size, and the three collectives the model uses.

One process runs one rank. :func:`join` makes this process rank ``rank`` of a group of ``world_size``
(``torch.distributed``: NCCL between GPUs, gloo on the CPU); :func:`leave` ends it. Outside a group (the
single-GPU engine) the rank is 0, the size 1, and every collective returns its input untouched: the model
calls them unconditionally and pays nothing.

The collectives are called from inside a forward pass, so on CUDA they queue work on the device and never
wait for it (they may be recorded into a CUDA graph). The all-reduce takes one of two paths
(:mod:`yaie.model.all_reduce`): NCCL's (gloo's on the CPU; the default), or, when ``YAIE_TP_ALL_REDUCE=one-shot``
asks for it, a one-shot kernel over symmetric memory for the small messages of decode steps;
:func:`all_reduce_path` says which.
"""

from __future__ import annotations

import datetime
import threading
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from yaie.model.all_reduce import AllReduce


LEAVE_WAIT_S = 10.0


class _Group:
    rank = 0
    world_size = 1
    all_reduce: AllReduce | None = None


_group = _Group()


# (torch >= 2.13 names it all_gather_single; the older name still works there, with a warning)
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rank() -> int:
    return _group.rank


def world_size() -> int:
    return _group.world_size


def join(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, start_timeout_s: float,
         check: Callable[[], None] | None = None) -> None:
    """Make this process rank ``rank`` of ``world_size``, meeting the others through ``init_file`` (a path no
    group has used yet) within ``start_timeout_s`` seconds; ``check`` is called about once a second while
    waiting (it may raise: a peer died). ``backend``: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU). A collective
    that waits more than ``timeout_s`` seconds for a peer raises ``RuntimeError`` (gloo; NCCL's watchdog ends
    the process). ``RuntimeError`` if this process is in a group already, or the others do not come."""
    if dist.is_initialized():
        raise RuntimeError("this process is a rank of a tensor-parallel group already (close that engine first)")
    store = dist.FileStore(init_file, world_size)
    # Every rank arrives first (processes start at their own pace), then the group forms at once: its own
    # timeout, the collectives', may be much shorter than a start.
    store.set(f"arrived/{rank}", "1")
    store.set_timeout(datetime.timedelta(seconds=1))
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            store.wait([f"arrived/{r}" for r in range(world_size)])
            break
        except RuntimeError:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tensor-parallel ranks did not all start within {start_timeout_s:g} s") from None
    store.set_timeout(datetime.timedelta(seconds=start_timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    _group.all_reduce = AllReduce(backend, device)          # sets up the one-shot path (a collective)
    _group.rank, _group.world_size = rank, world_size


def leave() -> None:
    """Leave the group (nothing when not in one); the process is a single rank again. NCCL's communicators
    are aborted, not destroyed (a destroy waits until every collective this process queued reports done, and
    those recorded into CUDA graphs never do), and the abort is given ``LEAVE_WAIT_S``: past that it is left
    to finish in a thread of its own, and this process cannot join another group."""
    if dist.is_initialized():
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)     # torch >= 2.5
        if dist.get_backend() == "nccl" and abort is not None:
            thread = threading.Thread(target=abort, name="yaie-tp-abort", daemon=True)
            thread.start()
            thread.join(LEAVE_WAIT_S)
            if thread.is_alive():
                warnings.warn(f"NCCL's abort did not return within {LEAVE_WAIT_S:g} s; left running",
                              RuntimeWarning, stacklevel=2)
        else:
            dist.destroy_process_group()
    _group.rank, _group.world_size = 0, 1
    if _group.all_reduce is not None:
        # Kept, not freed: the one-shot path's buffer is mapped into the other ranks, whose end is not awaited.
        _retired.append(_group.all_reduce)
        _group.all_reduce = None


_retired: list = []


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks: ``x`` summed in place or a new tensor (use the result)."""
    if _group.world_size > 1:
        return _group.all_reduce(x)
    return x


def all_reduce_path(x: torch.Tensor | None = None) -> str:
    """How the group sums ``x`` (default: a small message): ``"one-shot"``, ``"nccl"``, ``"gloo"`` or ``"skip"``;
    ``"none"`` outside a group."""
    if _group.all_reduce is None:
        return "none"
    return _group.all_reduce.name if x is None else _group.all_reduce.path_for(x)


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x [rows, n]`` side by side: ``[rows, world_size * n]``, rank 0's columns first."""
    if _group.world_size == 1:
        return x
    x = x.contiguous()
    rows, n = x.shape
    gathered = torch.empty(_group.world_size * rows, n, dtype=x.dtype, device=x.device)
    _gather_into(gathered, x)                          # rank r's rows at r * rows
    return gathered.view(_group.world_size, rows, n).permute(1, 0, 2).reshape(rows, -1)


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (every rank passes a tensor of the same shape and dtype)."""
    if _group.world_size > 1:
        dist.broadcast(x, src=0)
    return x
