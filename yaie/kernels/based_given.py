"""Lesson 08: the given code of the Based linear-attention exercises (``yaie/kernels/based.py``).

Read it, do not edit it: the exercise module imports these names (``based.BasedState``, ``based.empty_state``
work as before), and the graders and the engine rely on them as they are.

* constants: the feature width ``FEATURE_DIM`` (16) and the Taylor features' ``EXPANDED_DIM`` (273), the
  dtypes and value widths the kernels take, the default chunk and segment lengths;
* the recurrent state: :class:`BasedState`, :func:`empty_state`, :func:`state_bytes`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


FEATURE_DIM = 16                                       # d: the width of q and k the kernel is built for
EXPANDED_DIM = 1 + FEATURE_DIM + FEATURE_DIM ** 2      # 273 Taylor features
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_VALUE_DIM = 256
DEFAULT_CHUNK = 32                                     # H100: chunks of 16 and 32 time alike, 64, 128 slower
DEFAULT_SEGMENT = 256                                  # the default route: the quadratic form inside segments this long


class BasedState(NamedTuple):
    """The recurrent state of Based attention for a batch of sequences (float32).

    ``kv [batch, heads, 273, d_v]``: ``sum_j phi(k_j) v_j^T`` (the numerator state);
    ``k  [batch, heads, 273]``:      ``sum_j phi(k_j)`` (the normaliser state).
    Row 0 holds the order-0 sums (``sum v`` and the token count), rows 1-16 the order-1 sums
    (``sum k v^T / 2``, ``sum k / 2``), rows 17-272 the order-2 sums (``sum (k x k) v^T / (4 sqrt 2)``, ...).
    """

    kv: torch.Tensor
    k: torch.Tensor


def empty_state(batch: int, heads: int, value_dim: int, device: str | torch.device = "cpu") -> BasedState:
    """The state before any token: zeros (float32)."""
    return BasedState(torch.zeros(batch, heads, EXPANDED_DIM, value_dim, dtype=torch.float32, device=device),
                      torch.zeros(batch, heads, EXPANDED_DIM, dtype=torch.float32, device=device))


def state_bytes(heads: int, value_dim: int, bytes_per_number: int = 4) -> int:
    """Bytes of one sequence's state in one layer: ``heads * 273 * (d_v + 1)`` numbers, whatever its length."""
    return heads * EXPANDED_DIM * (value_dim + 1) * bytes_per_number
