# Lesson 05 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/flashinfer_given.py: read it, do not edit it.
# Run `pytest grader/lesson05` to grade them; the notebook is lessons/05_radix_flashinfer/.
# (Generated from solutions/kernels/flashinfer.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 05, part 2: FlashInfer-style attention. Plan once per step, run every layer; merge attention states.

**The batch in compressed sparse rows (CSR).** An engine step mixes requests: some prefill a chunk of new
tokens (many queries), most decode one token (one query). Their queries are packed token by token, and two
offset arrays say who owns what::

    q:                 [total_q, num_heads, head_dim]    request b owns rows qo_indptr[b] : qo_indptr[b+1]
    qo_indptr:         int32 [batch + 1]
    kv_indptr:         int32 [batch + 1]                 request b owns pages kv_indices[kv_indptr[b] : kv_indptr[b+1]]
    kv_indices:        int32 [kv_indptr[-1]]             physical page (lesson 03 block) ids, in order
    kv_last_page_len:  int32 [batch]                     tokens in the request's last page (1..block_size;
                                                         0 for a request without pages)
    k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim]   (one layer, lesson 03's layout)

so request b has ``kv_len = (pages - 1) * block_size + kv_last_page_len[b]`` keys (0 without pages), and its
token ``t`` is row ``t % block_size`` of page ``kv_indices[kv_indptr[b] + t // block_size]``. With
``causal=True`` the queries are the LAST ``q_len`` tokens of the request's keys: query ``i`` sits at position
``kv_len - q_len + i`` and sees keys ``0 .. kv_len - q_len + i`` (a decode's one query sees them all).

**Plan / run.** Everything that depends only on the batch's shape is worked out once per step, on the host,
by :meth:`FlashInferPagedAttention.plan`: the *work list*. One work item is "this tile of query rows of
request b, against keys ``kv_lo .. kv_hi`` of it". Query heads that share a KV head (grouped-query attention,
``group = num_heads // num_kv_heads``) are packed into the rows of one tile, so each K/V tile read from
memory serves the whole group. A decode (1 token x group heads) gets a narrow tile (16 rows); a prefill chunk
gets wide tiles (128 rows on a GPU, 64 above head dim 128). When the work items are too few to fill the GPU (a small batch with long
contexts), the key range of each tile is cut into chunks handled by separate programs (split-KV, lesson 04's
split-K), and their partial results are merged afterwards. :meth:`~FlashInferPagedAttention.run` then does
no host work but checks and launches: ONE Triton launch over the work list x KV heads (plus one merge
launch when something was split), the same for every layer.

**Attention states and their merge.** The attention of a query over a set of keys ``I`` is the *state*
``(o_I, lse_I)``: the normalised output ``o_I = sum_{j in I} softmax_I(s)_j v_j`` and the log-sum-exp of
the scores ``lse_I = log(sum_{j in I} exp(s_j))`` (natural log, scores already scaled). The states of two
disjoint key sets merge exactly::

    lse = log(exp(lse_A) + exp(lse_B)),   o = exp(lse_A - lse) * o_A + exp(lse_B - lse) * o_B

An empty key set has ``lse = -inf``: weight 0, the identity of the merge (and its ``o`` is never read).
The merge is associative and commutative, so a query's keys can be cut into any pieces, computed anywhere
(split-KV chunks, a shared prefix and a private suffix), and put back together. Layouts: ``o`` is
``[n, num_heads, head_dim]`` (any float dtype), ``lse`` float32 ``[n, num_heads]`` (token-major, as
FlashInfer; lesson 06's varlen ``lse`` is heads-first).

**Cascade attention.** When many requests share a prefix (a system prompt, the parallel samples of one
prompt), a per-request kernel reads the prefix's K/V once per request. Cascade attention reads it ONCE: the
queries of all the requests that share it form one multi-query "request" over the shared pages (no causal
mask: every query comes after the prefix), each request's own suffix is a normal request of a second level,
and the two states are merged. Decode turns from memory bound (every request streaming the whole prefix)
into a small matrix product over the prefix.

**The order of the work list is a schedule.** Programs start in work-list order, so the plan decides what
runs beside what. Prefill tiles are compute bound, decode tiles memory bound: interleaved, the decodes'
reads hide under the prefills' matrix products; one kind after the other, they do not (see
:func:`_work_order` for the rule and its measurements).

Measured on an H100 (``bench/results/lesson05_plan_run_h100.md``, bf16, 32 query heads over 8 KV heads of
128): a mixed step (32 decodes at 4k + 2 prefills of 1k new tokens over 2k cached) in one launch 0.387 ms
against 0.439 ms for lesson 04 and the prefix-prefill kernel launched apart (1.13x; longest first instead of
interleaved: 0.435 ms). Cascade decode of 64 requests over an 8k-token shared prefix: 0.074 ms against
lesson 04's 0.337 ms with both replayed from CUDA graphs (4.5x), as the engine runs it. Launched from Python
the cascade's time is mostly the host's (two launches, 0.12-0.13 ms, against 67 us of GPU work): 0.083 and
0.144 ms in two calls, against 0.331 ms (4.0x and 2.3x).

Tasks: 5 merging attention states (a float64 reference, a two-state and a many-state Triton kernel),
6 :class:`FlashInferPagedAttention` (reference, plan, run), 7 :class:`FlashInferAttention` (the same over
contiguous ragged K/V), 8 :class:`CascadeAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/flashinfer_given.py
from yaie.kernels.flashinfer_given import (
    LN2, LOG2E, MAX_HEAD_DIM, MIN_CHUNK, NO_MASK, PROGRAMS_PER_SM, SUPPORTED_DTYPES, WORK_FIELDS,
    check_causal_lengths, check_device, check_indptr, check_indptr_layout, check_offset_values, check_sizes,
    check_states, check_tensor, is_int, choose_kv_chunk, num_sms,
)


# ================================================================ task 5: merging attention states

def merge_state_reference(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of two attention states in float64 (the math of :func:`merge_state`, in PyTorch).

    ``o_a``/``o_b`` ``[..., head_dim]``, ``lse_a``/``lse_b`` ``[...]`` (natural log). Returns
    ``(o, lse)`` in float64 on the CPU: ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a +
    exp(lse_b - lse) o_b``; an empty state (``lse = -inf``) weighs 0 even if its ``o`` is NaN; two empty
    states give ``o = 0``, ``lse = -inf``.
    """
    raise NotImplementedError('lesson 05, task 5: implement merge_state_reference in yaie/kernels/flashinfer.py')


def merge_state(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the attention states of two disjoint key sets into the state of their union, in Triton.

    Args:
        o_a, o_b: ``[n, num_heads, head_dim]`` normalised outputs (float16, bfloat16 or float32, one dtype
            and shape), last axis contiguous.
        lse_a, lse_b: float32 ``[n, num_heads]``: the natural-log log-sum-exp of each state's (scaled)
            scores; ``-inf`` marks an empty state (no keys), whose output is ignored (it may be NaN).

    Returns:
        ``(o, lse)``: ``o`` ``[n, num_heads, head_dim]`` in ``o_a``'s dtype, ``lse`` float32 ``[n, num_heads]``,
        with ``lse = log(exp(lse_a) + exp(lse_b))`` and ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``
        (computed in float32, subtracting the larger lse first). Two empty states give 0 and ``-inf``.

    Raises:
        ValueError: wrong ranks, shapes, dtypes or devices.
    """
    raise NotImplementedError('lesson 05, task 5: implement merge_state in yaie/kernels/flashinfer.py')


def merge_states(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge many attention states per token (the states of disjoint key sets), in Triton.

    Args:
        o: ``[n, num_states, num_heads, head_dim]`` normalised outputs (float16, bfloat16 or float32),
            last axis contiguous.
        lse: float32 ``[n, num_states, num_heads]``, natural log; ``-inf`` marks an empty state.

    Returns:
        ``(o, lse)``: ``[n, num_heads, head_dim]`` in ``o``'s dtype and float32 ``[n, num_heads]``: the state
        of the union of the key sets, ``lse = logsumexp_s(lse_s)``, ``o = sum_s exp(lse_s - lse) o_s`` (an
        online log-sum-exp over the states, in float32). Zero states, or all empty, give 0 and ``-inf``.

    Raises:
        ValueError: wrong ranks, shapes, dtypes or devices.
    """
    raise NotImplementedError('lesson 05, task 5: implement merge_states in yaie/kernels/flashinfer.py')


# ================================================================ the plan/run kernel (tasks 6 and 7)

# ================================================================ task 6: paged plan/run

def paged_attention_reference_csr(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                                  kv_last_page_len: torch.Tensor, causal: bool = False,
                                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive form of :class:`FlashInferPagedAttention`: gather each request's keys, plain attention.

    Same CSR arguments as :meth:`FlashInferPagedAttention.plan` (see the module docstring), q
    ``[total_q, num_heads, head_dim]``, caches ``[num_blocks, block_size, num_kv_heads, head_dim]``. Computes
    in the inputs' dtype (pass float64 copies for a reference). Rows of a request without keys get
    ``o = 0`` and ``lse = -inf``.

    Returns:
        ``(out, lse)``: ``out`` like q, ``lse`` ``[total_q, num_heads]`` (natural log) in q's dtype.
    """
    raise NotImplementedError('lesson 05, task 6: implement paged_attention_reference_csr in yaie/kernels/flashinfer.py')


class FlashInferPagedAttention:
    """Attention of a ragged batch (prefill chunks and decodes, any mix) over a paged KV cache: plan once
    per engine step, run once per layer.

    ``config`` (optional) overrides the launch settings (``NARROW_M``, ``WIDE_M``, ``BLOCK_N``,
    ``num_warps``, ``num_stages``): for benchmarks and experiments.
    """

    def __init__(self, config: dict | None = None):
        self.config = config
        self._plan = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int, causal: bool = False, scale: float | None = None,
             kv_chunk_size: int | None = None) -> None:
        """Work out the step's work list on the host and put it on the device (once per engine step).

        Args:
            qo_indptr: int32 ``[batch + 1]``: request ``b`` owns query rows ``qo_indptr[b] : qo_indptr[b+1]``
                (0 rows: the request is skipped).
            kv_indptr: int32 ``[batch + 1]``: request ``b`` owns pages ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]``.
            kv_indices: int32 ``[kv_indptr[-1]]``: physical page ids (>= 0) on the device the cache lives on
                (the kernel reads them there; the work list goes to the same device). Keep this tensor and
                read it in every ``run``, not a copy: a caller may overwrite its values in place between runs
                (other pages, as many) and the next run follows them (the engine's CUDA graphs do).
            kv_last_page_len: int32 ``[batch]``: tokens in each request's last page, ``1..block_size``
                (0 for a request with no pages).
            num_heads, num_kv_heads, head_dim, block_size: the sizes ``run`` will get (grouped-query
                attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``; head_dim
                1..256, padded to a power of two inside, so 96 works).
            causal: each request's queries are the LAST ``q_len`` of its ``kv_len`` keys (query ``i`` sees
                keys ``0 .. kv_len - q_len + i``); needs ``q_len <= kv_len``. False: every query sees every key.
            scale: score multiplier, default ``head_dim ** -0.5``.
            kv_chunk_size: keys per split-KV chunk; ``None`` lets :func:`choose_kv_chunk` decide (split only
                when the tiles are too few to fill the GPU).

        The work list: each request's queries are cut into tiles (a decode's group of heads fills a narrow
        tile of 16 rows; prefill tokens x heads fill wide ones); each tile's keys into chunks; the items put
        in launch order (the reference: decode and prefill items interleaved when prefills are most of the
        work, else longest first). Reads the index tensors on the host (one copy for all of them, one device
        sync when they live on the GPU): that is the point of planning. Host time is part of every engine
        step: build the work list with array operations, not Python loops over tiles or rows.

        Raises:
            ValueError: offsets that are not int32 1-D, do not start at 0, decrease or disagree in length;
                ``kv_indices`` not of length ``kv_indptr[-1]`` or holding negative ids; a last-page length
                outside ``1..block_size`` (or not 0 without pages); bad sizes; ``causal`` with
                ``q_len > kv_len``; a ``kv_chunk_size`` that is not an int >= 1.
        """
        raise NotImplementedError('lesson 05, task 6: implement plan in yaie/kernels/flashinfer.py')

    def run(self, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned batch for one layer: one Triton launch (+ one merge launch when the plan
        split some tile's keys). No host work beyond checking shapes and launching: no device sync.

        Args:
            q: ``[total_q, num_heads, head_dim]`` (rows as in ``qo_indptr``), float16/bfloat16/float32,
                last axis contiguous.
            k_cache, v_cache: one layer's cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` in q's
                dtype, on the plan's device; only the pages the plan names are read.

        Returns:
            ``(out, lse)``: ``out`` ``[total_q, num_heads, head_dim]`` in q's dtype; ``lse`` float32
            ``[total_q, num_heads]``, natural log of each row's softmax denominator (``-inf``: no keys).

        Raises:
            ValueError: no plan yet; shapes, dtypes or devices that differ from the plan's; a cache with
                fewer blocks than the largest planned page id.
        """
        raise NotImplementedError('lesson 05, task 6: implement run in yaie/kernels/flashinfer.py')


# ================================================================ task 7: contiguous ragged plan/run

def ragged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                               kv_indptr: torch.Tensor, causal: bool = False,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive form of :class:`FlashInferAttention`: per request, plain attention over its K/V rows.

    q ``[total_q, num_heads, head_dim]``, k/v ``[total_kv, num_kv_heads, head_dim]``; request ``b`` owns
    query rows ``qo_indptr[b]:qo_indptr[b+1]`` and key rows ``kv_indptr[b]:kv_indptr[b+1]``. Computes in
    the inputs' dtype. Returns ``(out, lse)`` like :func:`paged_attention_reference_csr`.
    """
    raise NotImplementedError('lesson 05, task 7: implement ragged_attention_reference in yaie/kernels/flashinfer.py')


class FlashInferAttention:
    """Plan/run attention of a ragged batch over contiguous K/V (each request's keys are consecutive rows
    of ``[total_kv, num_kv_heads, head_dim]`` tensors): the same work list as the paged form, no pages."""

    def __init__(self, config: dict | None = None):
        self.config = config
        self._plan = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, causal: bool = False, scale: float | None = None,
             kv_chunk_size: int | None = None, device: str | torch.device | None = None) -> None:
        """Build the work list once (host side) for :meth:`run`.

        Args:
            qo_indptr, kv_indptr: int32 ``[batch + 1]`` offsets of each request's query rows and K/V rows.
            num_heads, num_kv_heads, head_dim, causal, scale, kv_chunk_size: as
                :meth:`FlashInferPagedAttention.plan` (causal: ``q_len <= kv_len`` per request).
            device: where ``run``'s tensors will live (default: ``kv_indptr``'s device).

        Raises:
            ValueError: as :meth:`FlashInferPagedAttention.plan` for the offsets and sizes.
        """
        raise NotImplementedError('lesson 05, task 7: implement plan in yaie/kernels/flashinfer.py')

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned batch: q ``[total_q, num_heads, head_dim]``, k/v ``[total_kv,
        num_kv_heads, head_dim]`` (one dtype, last axis contiguous). One launch (+ merge); no sync.

        Returns:
            ``(out, lse)`` as :meth:`FlashInferPagedAttention.run`.

        Raises:
            ValueError: no plan yet; shapes, dtypes or devices that differ from the plan's.
        """
        raise NotImplementedError('lesson 05, task 7: implement run in yaie/kernels/flashinfer.py')


# ================================================================ task 8: cascade attention

class CascadeAttention:
    """Multi-level cascade attention over a paged cache: level 0 holds the pages shared by groups of
    requests, the last level each request's own pages. Every level describes the SAME query rows in the CSR
    form of :meth:`FlashInferPagedAttention.plan`; a query row's attention is the merge (task 5) of its
    states over every level's keys.

    A level groups the query rows by its own ``qo_indptr``: for a prefix shared by the whole batch, level 0
    has ``qo_indptr = [0, total_q]`` (every query of every request in one multi-query "request") and the
    prefix's pages, so they are read once for all; level 1 has the per-request ``qo_indptr`` and suffixes.

    The reference puts every level's tiles into ONE work list: one launch computes all the states (each
    query row's states land in consecutive partial rows) and one merge launch combines them. (Running one
    :class:`FlashInferPagedAttention` per level and :func:`merge_state` on their outputs is the same math in
    more launches, with each level's output rounded to q's dtype before the merge.)
    """

    def __init__(self, config: dict | None = None):
        self.config = config
        self._plan = None

    def plan(self, qo_indptr: list[torch.Tensor], kv_indptr: list[torch.Tensor], kv_indices: list[torch.Tensor],
             kv_last_page_len: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int, causal: bool = False, scale: float | None = None) -> None:
        """Plan every level (lists of the same length, one entry per level, outermost first).

        Level ``l``'s CSR arguments are those of :meth:`FlashInferPagedAttention.plan`; all levels cover the
        same ``total_q`` query rows. Keys of earlier levels come before the last level's keys, so every query
        sees them whole: only the LAST level is causal (when ``causal``), queries aligned to its end. A
        group of a level may have no pages (its state is empty, ``lse = -inf``).

        Raises:
            ValueError: lists of different lengths or empty; levels with different ``total_q``; anything
                :meth:`FlashInferPagedAttention.plan` rejects.
        """
        raise NotImplementedError('lesson 05, task 8: implement plan in yaie/kernels/flashinfer.py')

    def run(self, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every query row over the union of all levels' keys: ``(out, lse)`` as
        :meth:`FlashInferPagedAttention.run` (reference: one launch for all levels' states, one merge launch).

        Raises:
            ValueError: no plan yet, or what :meth:`FlashInferPagedAttention.run` rejects.
        """
        raise NotImplementedError('lesson 05, task 8: implement run in yaie/kernels/flashinfer.py')
