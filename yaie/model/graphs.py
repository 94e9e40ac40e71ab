"""Two helpers for steps that replay from CUDA graphs: the batch sizes that get a graph, and a host-to-device
copy that does not wait for the device.

Used by the engine's decode graphs (:mod:`yaie.engine.cuda_graphs`) and by the Based model's rows
(:class:`yaie.model.based_rows.BasedRows`), which record their own decode step.
"""

from __future__ import annotations

import torch


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below ``max_batch``, then ``max_batch`` itself. A step of
    ``n`` rows runs the smallest bucket ``>= n``, padded."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


def upload(dst: torch.Tensor, values: list) -> None:
    """Copy ``values`` (nested lists of ints in ``dst``'s shape) into ``dst`` without waiting for the device.

    A copy from pageable host memory waits for the kernels queued before it; one from pinned memory is only
    queued. Torch's pinned-memory allocator keeps the buffer until the copy has run."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)
