"""The all-reduce after each row-parallel product: NCCL's (the reference), and a one-shot one for small messages.

**The reference** is ``dist.all_reduce``: NCCL between GPUs, gloo on the CPU. It suits any size, and for a large
message (a long prompt's prefill) it is near the link's bandwidth.

**Why another.** At batch 1 a decode step of the Llama-3-8B shape over 2 GPUs sums 65 rows of 4096 bf16 values
(8 KB: the embedding's and 2 per layer). The bytes cross NVLink in well under a microsecond; what a step pays
is NCCL's fixed cost per call (its protocol's rounds of flags between the GPUs), 65 times, each on the step's
critical path: every layer waits for the sum before it goes on.

**One-shot.** Once, when the group forms, each rank allocates a buffer of the same size in *symmetric memory*
(``torch.distributed._symmetric_memory``): ``symm_mem.empty`` allocates it, ``symm_mem.rendezvous`` maps every
rank's buffer into every other rank's address space (CUDA IPC). Then an all-reduce of ``x`` is one kernel on
each rank (``torch.ops.symm_mem.one_shot_all_reduce_copy``)::

    1. copy x into this rank's buffer
    2. barrier: set a flag in each peer's signal pad, wait for each peer's flag in ours
    3. read x from every rank's buffer (loads from the peers' memory over NVLink), add, write the sum
    4. barrier again, so that no rank overwrites its buffer (the next all-reduce) while a peer still reads it

Every rank reads the whole message from every peer, so the bytes moved grow with the ranks and the message:
it is the path for small messages only; above ``ONE_SHOT_MAX_BYTES`` NCCL takes over. The kernel is recorded
into the decode steps' CUDA graphs like any other. It reads from the peers: nothing here uses NVLink multicast
(``multimem`` instructions), which the lent machines forbid (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set
below if it is not set already). With 2 ranks both compute a + b, the same bits; with more, each rank adds
in its own order (rounding may differ in the last bit between ranks; NCCL's ring gives every rank the same).

**Why NCCL is the default:** on 2 H100s the one-shot path made the collectives alone faster but not the
engine's step (measured in docs/tensor_parallel.md); it is there to read, to measure and to build on.

**Which path** (``YAIE_TP_ALL_REDUCE``, read when the group forms; the workers inherit it): ``nccl`` (the
default) is ``dist.all_reduce``, gloo's on the CPU. ``one-shot`` sets up the buffer on GPUs and sums a bf16 or
float32 message of at most ``ONE_SHOT_MAX_BYTES`` there, anything else with NCCL (:meth:`AllReduce.path_for`:
every rank takes the same path, since each sees the same shapes); where symmetric memory does not work on
every rank (on the CPU, an older torch, a second group in one process), NCCL or gloo. ``skip`` sums nothing
(wrong output: only to time a step without its all-reduces).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

ENV_VAR = "YAIE_TP_ALL_REDUCE"
CHOICES = ("nccl", "one-shot", "skip")
DEFAULT = "nccl"
ONE_SHOT_MAX_BYTES = 1 << 20         # 128 rows of 4096 bf16: decode batches; a prefill's rows go to NCCL (a
                                     # choice, not a measured crossover)
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)     # what torch's one-shot kernel adds

_one_shot_tried = False              # symmetric memory is set up for the first group of a process only


class AllReduce:
    """The sum over the ranks of this process's group, made by every rank right after the group forms.

    Args:
        backend: the group's, ``"nccl"`` or ``"gloo"``.
        device: this rank's device (the one-shot buffer's, on CUDA).
        requested: ``"nccl"``, ``"one-shot"`` or ``"skip"`` (see the module docstring); default:
            ``YAIE_TP_ALL_REDUCE``, else ``DEFAULT``.
    """

    def __init__(self, backend: str, device: torch.device, requested: str | None = None):
        requested = requested or os.environ.get(ENV_VAR) or DEFAULT
        if requested not in CHOICES:
            raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {requested!r}")
        self.backend, self.requested = backend, requested
        self.buffer: torch.Tensor | None = None
        if backend == "nccl" and requested == "one-shot":
            self.buffer = one_shot_buffer(device, ONE_SHOT_MAX_BYTES)
        self.group_name = dist.group.WORLD.group_name if self.buffer is not None else None

    @property
    def name(self) -> str:
        """The path a small message takes: ``"one-shot"``, ``"nccl"``, ``"gloo"`` or ``"skip"``."""
        return "skip" if self.requested == "skip" else "one-shot" if self.buffer is not None else self.backend

    def path_for(self, x: torch.Tensor) -> str:
        """The path that sums ``x``."""
        if self.requested == "skip":
            return "skip"
        if (self.buffer is not None and x.dtype in ONE_SHOT_DTYPES and x.is_contiguous()
                and x.nbytes <= self.buffer.nbytes and x.nbytes % 16 == 0):
            return "one-shot"
        return self.backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x`` itself, summed in place (NCCL, gloo), or a new tensor
        (one-shot). Use the result."""
        path = self.path_for(x)
        if path == "one-shot":
            staging = self.buffer[:x.nbytes].view(x.dtype)          # this rank's buffer, as x's dtype
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x.view(-1), "sum",
                                                               self.group_name).view(x.shape)
        if path != "skip":
            dist.all_reduce(x)                                      # the reference
        return x


def one_shot_buffer(device: torch.device, nbytes: int) -> torch.Tensor | None:
    """This rank's ``nbytes`` of symmetric memory, mapped into every other rank's, after one trial sum (a
    collective: every rank of the group calls it); None on every rank when any rank cannot have it (a torch
    without the one-shot op, no peer access, a group after the first in this process). The ranks agree after
    each stage, so none waits in a rendezvous that another skipped."""
    global _one_shot_tried
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")     # the one-shot path never needs it
    buffer, symm_mem = None, None
    if not _one_shot_tried:
        _one_shot_tried = True
        try:
            import torch.distributed._symmetric_memory as symm_mem
            torch.ops.symm_mem.one_shot_all_reduce_copy                    # noqa: B018 - present in this torch?
            buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        except Exception:                                              # noqa: BLE001 - then NCCL, on every rank
            buffer = None
    if not _on_every_rank(buffer is not None, device):
        return None
    ok = False
    try:
        name = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)   # needed by older torch, deprecated since
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        symm_mem.rendezvous(buffer, name)
        # A trial: rank r gives r + 1 everywhere; the sum is 1 + 2 + ... + world_size.
        world = dist.get_world_size()
        trial = torch.full((8,), float(dist.get_rank() + 1), device=device)
        total = torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[:trial.nbytes].view(torch.float32), trial,
                                                            "sum", name)
        ok = bool((total == world * (world + 1) / 2).all())
    except Exception:                                                  # noqa: BLE001
        ok = False
    return buffer if _on_every_rank(ok, device) else None


def _on_every_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (one small all-reduce: the minimum)."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
