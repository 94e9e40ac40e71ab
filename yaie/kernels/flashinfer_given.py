"""Lesson 05, part 2: the given code of the FlashInfer-style exercises (``yaie/kernels/flashinfer.py``).

Read it, do not edit it: the exercise module imports these names (``flashinfer.choose_kv_chunk`` works as
before), and the graders rely on them as they are.

* constants: ``LOG2E``, ``LN2`` (for ``exp2`` / ``log2``), the dtypes and head sizes the kernels take, the
  split-KV heuristic's ``PROGRAMS_PER_SM`` and ``MIN_CHUNK``, ``WORK_FIELDS`` (int32 numbers per work item),
  ``NO_MASK`` (the position of a query that sees every key);
* the input checks the tasks call (``check_indptr``, ``check_sizes``, ``check_states``, ...): they read
  no values unless their docstring says so;
* the split-KV heuristic: :func:`num_sms` and :func:`choose_kv_chunk`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from yaie.device import triton_interpreted


LOG2E = 1.4426950408889634   # exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453     # log(x) == log2(x) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
PROGRAMS_PER_SM = 2          # programs per multiprocessor the split heuristic aims at (lesson 04's choice)
MIN_CHUNK = 256              # the fewest keys a split-KV chunk gets from the heuristic
WORK_FIELDS = 8              # int32 numbers per work item of the reference's work list
NO_MASK = 1 << 30            # the "position" of a query that sees every key (no causal mask)


# ---------------------------------------------------------------- input checks (given)

def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_indptr_layout(name: str, t, length: int | None = None) -> None:
    """A 1-D int32 offsets tensor of ``length`` (if given) >= 2 entries: checks that read no values."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1] of offsets, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.numel() < 2:
        raise ValueError(f"{name} must hold batch + 1 >= 2 offsets (at least one request), got {t.numel()}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries (batch + 1), got {t.numel()}")


def check_offset_values(name: str, values: np.ndarray) -> None:
    """Offsets read on the host (a numpy array) must start at 0 and never decrease."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(values[0])}")
    if np.any(values[1:] < values[:-1]):
        raise ValueError(f"{name} must not decrease, got {values.tolist()}")


def check_indptr(name: str, t, length: int | None = None) -> list[int]:
    """A 1-D int32 offsets tensor starting at 0 and never decreasing; returns it as a list (one copy)."""
    check_indptr_layout(name, t, length)
    values = t.tolist()
    check_offset_values(name, np.asarray(values))
    return values


def check_sizes(num_heads, num_kv_heads, head_dim, scale) -> None:
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be None or a positive finite number, got {scale!r}")


def check_causal_lengths(q_lens, kv_lens, causal) -> None:
    """Under ``causal`` every request needs ``q_len <= kv_len`` (lists or numpy arrays of lengths)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if not causal:
        return
    bad = np.flatnonzero(np.asarray(q_lens) > np.asarray(kv_lens))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"request {b} has {int(q_lens[b])} queries but {int(kv_lens[b])} keys: under causal=True "
                         f"the queries are the last q_len tokens of the keys, so q_len <= kv_len")


def check_tensor(name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last (head_dim) axis")


def check_device(device: torch.device) -> None:
    if device.type == "cpu" and not triton_interpreted():
        raise ValueError("CPU tensors need the Triton interpreter: call yaie.device.prepare_triton() before "
                         "importing triton (or set TRITON_INTERPRET=1)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors must be on a CUDA GPU or the CPU, got {device}")


def check_states(o: torch.Tensor, lse: torch.Tensor, o_name: str, lse_name: str, o_rank: int) -> None:
    check_tensor(o_name, o, o_rank, "attention outputs")
    if o.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{o_name} must be float16, bfloat16 or float32, got {o.dtype}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
        raise ValueError(f"{lse_name} must be a float32 tensor (natural-log log-sum-exp), got "
                         f"{getattr(lse, 'dtype', type(lse).__name__)}")
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"{lse_name} must have shape {list(o.shape[:-1])} (o's shape without head_dim), "
                         f"got {list(lse.shape)}")
    if lse.device != o.device:
        raise ValueError(f"{o_name} and {lse_name} must be on one device, got {o.device} and {lse.device}")
    if o.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {o.shape[-1]}")
    check_device(o.device)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (asked once); 8 for the CPU interpreter (any small number)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_kv_chunk(tile_kv_lens, num_kv_heads: int, sms: int, granule: int = 64,
                    min_chunk: int = MIN_CHUNK) -> int:
    """The split-KV heuristic: about how many keys one program should take so that the batch's work shares
    out evenly over one wave of ``PROGRAMS_PER_SM`` programs per multiprocessor.

    Every KV head of every tile reads its keys: ``num_kv_heads * sum(tile_kv_lens)`` key reads in all, over
    ``PROGRAMS_PER_SM * sms`` programs at a time. A tile much longer than that share would still be running
    when the others are done (a straggler), so it is cut into about ``length / chunk`` chunks. Returns the
    chunk (a multiple of ``granule``, at least ``min_chunk``: a chunk's fixed costs, loading q and writing a
    partial state to merge, must stay small); a tile splits into ``max(1, round(length / chunk))`` equal
    chunks. A batch of many short tiles gets a chunk longer than any tile: nothing is split.
    ``tile_kv_lens``: a list or a 1-D array of key counts.
    """
    lens = np.asarray(tile_kv_lens, dtype=np.int64)
    longest = int(lens.max()) if lens.size else 0
    target = PROGRAMS_PER_SM * sms
    share = -(-num_kv_heads * int(lens.sum()) // target)             # key reads per program, ideally
    chunk = max(min_chunk, -(-share // granule) * granule)
    return chunk if chunk < longest else max(longest, 1)
