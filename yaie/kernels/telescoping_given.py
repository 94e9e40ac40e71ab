"""Lesson 07: the given code of the telescoping-cache exercises (``yaie/kernels/telescoping.py``).

Read it, do not edit it: the exercise module imports these names (``telescoping.entry_level`` works as
before), and the graders rely on them as they are.

* constants: the dtypes, head sizes and group sizes the kernels take;
* small helpers of the merge rule and the buffer: :func:`entry_level`, :func:`check_count`,
  :func:`span_sizes`, :func:`stable_slots` (the column order the backward's scatter kernel likes);
* the naive gather references of the indexed products, :func:`indexed_qk_reference` and
  :func:`indexed_pv_reference` (not tasks: the kernels of tasks 3 and 4 are checked against them);
* the input checks the kernels call: :func:`check_indexed_inputs` (its map check, :func:`check_map_entries`,
  reads the map once per tensor and version), :func:`check_dout`.
"""

from __future__ import annotations

import numbers

import torch

from yaie.device import triton_interpreted


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GROUP = 16          # e, query heads per KV head: padded to 16 rows for tl.dot


# ---------------------------------------------------------------- helpers of the merge rule and the buffer

def entry_level(size: int) -> int:
    """The level of an entry averaging ``size`` tokens: ``floor(log2(size))`` (1 -> 0, 2..3 -> 1, 4..7 -> 2)."""
    return int(size).bit_length() - 1


def check_count(name: str, value) -> int:
    """``value`` as an int if it is an integer of at least 1 (not a bool, float or string); else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def span_sizes(index_map: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Tokens averaged by every cache slot: float32 ``[l, c]``, 0 for unused slots (``index_map >= n``)."""
    n = starts.numel()
    sizes = torch.cat([(ends - starts).float(), torch.zeros(1)]).to(index_map.device)
    return sizes[index_map.long().clamp(max=n)]


def stable_slots(index_map: torch.Tensor, n: int) -> torch.Tensor:
    """The same caches with every entry kept in one column for as long as it lives.

    Attention over a cache does not depend on the order of its entries, so any column order per row
    is as good as oldest-first. In this one an entry that stays in the cache from one position to the
    next keeps its column; a new entry takes a column that an entry leaving the cache freed (or the
    first unused one). Neighbouring rows then agree in almost every column, which lets the backward's
    scatter kernel sum a column's gradient in registers over many positions before it adds to memory.
    Returns an int32 ``[l, c]`` map on the CPU; unused slots hold ``n``.
    """
    rows = index_map.clamp(max=n).to(torch.int32).cpu().tolist()
    c = index_map.shape[1]
    out = torch.full((len(rows), c), n, dtype=torch.int32)
    column: dict[int, int] = {}
    placed = [n] * c
    for p, row in enumerate(rows):
        alive = {r for r in row if r < n}
        free = [j for j in range(c) if placed[j] not in alive or placed[j] == n]
        for j in free:
            column.pop(placed[j], None)
            placed[j] = n
        free.reverse()                          # pop() hands out the lowest free column first
        for r in row:
            if r < n and r not in column:
                j = free.pop()
                column[r] = j
                placed[j] = r
        out[p] = torch.tensor(placed, dtype=torch.int32)
    return out


# ---------------------------------------------------------------- naive references (gather + matmul)

def indexed_qk_reference(q: torch.Tensor, k: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """``out[b,l,h,e,c] = sum_d q[b,l,h,e,d] * k[b, M[l,c], h, d]`` by gathering ``k[:, M]`` first.

    Builds the ``[b, l, c, h, d]`` gathered tensor the kernels avoid. Unused slots (``M >= n``) give 0.
    Computes in the inputs' dtype (call it on float64 copies for a reference).
    """
    n = k.shape[1]
    used = index_map < n
    gathered = k[:, index_map.long().clamp(max=n - 1)]              # [b, l, c, h, d]
    gathered = gathered * used[None, :, :, None, None].to(k.dtype)
    return torch.einsum("blhed,blchd->blhec", q, gathered)


def indexed_pv_reference(p: torch.Tensor, v: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """``out[b,l,h,e,d] = sum_c p[b,l,h,e,c] * v[b, M[l,c], h, d]`` by gathering ``v[:, M]`` first."""
    n = v.shape[1]
    used = index_map < n
    gathered = v[:, index_map.long().clamp(max=n - 1)]              # [b, l, c, h, d]
    gathered = gathered * used[None, :, :, None, None].to(v.dtype)
    return torch.einsum("blhec,blchd->blhed", p, gathered)


# ---------------------------------------------------------------- input checks

def check_indexed_inputs(x: torch.Tensor, buf: torch.Tensor, index_map: torch.Tensor, x_last: str) -> None:
    """Raise ``ValueError`` unless ``x`` and ``buf`` with ``index_map`` are valid kernel inputs.

    ``x`` is ``[b, l, h, e, d]`` (``x_last="d"``: q, or the gradient of a P V output) or ``[b, l, h, e, c]``
    (``x_last="c"``: p, or the gradient of the scores); ``buf`` is ``[b, n, h, d]``; ``index_map`` an
    integer ``[l, c]`` with entries ``>= 0`` (``>= n`` marks an unused slot).
    """
    for name, t in (("x", x), ("buffer", buf), ("index_map", index_map)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 5:
        raise ValueError(f"the query-side tensor must be 5-D [b, l, h, e, {x_last}], got shape {tuple(x.shape)}")
    if buf.dim() != 4:
        raise ValueError(f"the buffer must be 4-D [b, n, h, d], got shape {tuple(buf.shape)}")
    if index_map.dim() != 2:
        raise ValueError(f"index_map must be 2-D [l, c], got shape {tuple(index_map.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or x.dtype != buf.dtype:
        raise ValueError(f"inputs must share one dtype among float16, bfloat16, float32, got {x.dtype} and {buf.dtype}")
    if index_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index_map must be int32 or int64, got {index_map.dtype}")
    if not (x.device == buf.device == index_map.device):
        raise ValueError(f"inputs must be on one device, got {x.device}, {buf.device}, {index_map.device}")
    if x.device.type == "cpu" and not triton_interpreted():
        raise ValueError("CPU tensors need the Triton interpreter: call yaie.device.prepare_triton() "
                         "before importing triton (or set TRITON_INTERPRET=1)")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors must be on a CUDA GPU or the CPU, got {x.device}")
    b, l, h, e = x.shape[:4]
    if buf.shape[0] != b or buf.shape[2] != h:
        raise ValueError(f"batch and KV heads must match: x {tuple(x.shape)}, buffer {tuple(buf.shape)}")
    if index_map.shape[0] != l:
        raise ValueError(f"index_map has {index_map.shape[0]} rows, the input has l = {l} positions")
    c, d = index_map.shape[1], buf.shape[3]
    if x.shape[4] != (d if x_last == "d" else c):
        want = f"d = {d} (the buffer's)" if x_last == "d" else f"c = {c} (the index map's columns)"
        raise ValueError(f"the last dim of {tuple(x.shape)} must be {want}")
    if not 1 <= e <= MAX_GROUP:
        raise ValueError(f"e (query heads per KV head) must be 1..{MAX_GROUP}, got {e}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be 1..{MAX_HEAD_DIM}, got {d}")
    if min(x.shape) == 0 or min(buf.shape) == 0 or c == 0:
        raise ValueError(f"empty tensors are not allowed: x {tuple(x.shape)}, buffer {tuple(buf.shape)}, "
                         f"index_map {tuple(index_map.shape)}")
    check_map_entries(index_map)


def check_map_entries(index_map: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``index_map`` has a negative entry (a kernel would read before the buffer).

    Finding the minimum means reading a number back from the GPU: the host waits until the GPU has run
    everything queued before it (a device sync), and while the host then queues the next kernels the GPU
    idles. A model calls the kernels with the same map again and again (every layer, every step), so a
    map found valid is marked so on the tensor, with its version counter (PyTorch bumps it at every
    in-place edit, ``index_map[0, 0] = -1`` too): the same map, unedited, is not read again, and the
    kernels' calls queue without a wait. An edited map is checked again. Inference tensors (made inside
    ``torch.inference_mode``) have no version counter: they are checked at every call. Edits that bypass
    the counter (through ``.data``, or by a kernel writing into the map's memory) are not seen.
    """
    counted = not index_map.is_inference()
    if counted and getattr(index_map, "_yaie_checked", None) == index_map._version:
        return
    if int(index_map.min()) < 0:
        raise ValueError("index_map has negative entries: buffer rows are 0..n-1 (n or more = unused slot)")
    if counted:
        index_map._yaie_checked = index_map._version


def check_dout(dout, want: tuple[int, ...], like: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``dout`` is a tensor of shape ``want`` with ``like``'s dtype and device."""
    if not isinstance(dout, torch.Tensor):
        raise ValueError(f"dout must be a torch.Tensor, got {type(dout).__name__}")
    if tuple(dout.shape) != want or dout.dtype != like.dtype or dout.device != like.device:
        raise ValueError(f"dout must be {list(want)} {like.dtype} on {like.device}, got {list(dout.shape)} "
                         f"{dout.dtype} on {dout.device}")
