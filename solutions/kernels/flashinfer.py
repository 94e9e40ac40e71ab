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

# yaie: task 5
def merge_state_reference(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of two attention states in float64 (the math of :func:`merge_state`, in PyTorch).

    ``o_a``/``o_b`` ``[..., head_dim]``, ``lse_a``/``lse_b`` ``[...]`` (natural log). Returns
    ``(o, lse)`` in float64 on the CPU: ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a +
    exp(lse_b - lse) o_b``; an empty state (``lse = -inf``) weighs 0 even if its ``o`` is NaN; two empty
    states give ``o = 0``, ``lse = -inf``.
    """
    oa, ob = o_a.detach().double().cpu(), o_b.detach().double().cpu()
    la, lb = lse_a.detach().double().cpu(), lse_b.detach().double().cpu()
    lse = torch.logaddexp(la, lb)
    empty = torch.isinf(lse) & (lse < 0)
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    wa = torch.where(empty, torch.zeros_like(la), torch.exp(la - safe))[..., None]
    wb = torch.where(empty, torch.zeros_like(lb), torch.exp(lb - safe))[..., None]
    oa = torch.where(wa > 0, oa, torch.zeros_like(oa))      # never read an empty state's output
    ob = torch.where(wb > 0, ob, torch.zeros_like(ob))
    return wa * oa + wb * ob, lse


# yaie: solution-only
@triton.jit
def _merge_two_kernel(OA, LA, OB, LB, OUT, LSE_OUT, rows,
                      stride_oa, stride_ob, stride_out,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program merges BLOCK_R (token, head) rows; the outputs are viewed as [rows, head_dim]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    offs_d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    r64 = r.to(tl.int64)
    la = tl.load(LA + r64, mask=r_ok, other=float("-inf"))
    lb = tl.load(LB + r64, mask=r_ok, other=float("-inf"))
    top = tl.maximum(la, lb)
    shift = tl.where(top == float("-inf"), 0.0, top)     # both empty: keep both weights 0
    wa = tl.exp(la - shift)
    wb = tl.exp(lb - shift)
    oa = tl.load(OA + r64[:, None] * stride_oa + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(OB + r64[:, None] * stride_ob + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    oa = tl.where(wa[:, None] > 0, oa, 0.0)              # an empty state's output may be anything, even NaN
    ob = tl.where(wb[:, None] > 0, ob, 0.0)
    total = wa + wb
    out = (wa[:, None] * oa + wb[:, None] * ob) / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, shift + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(OUT + r64[:, None] * stride_out + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE_OUT + r64, lse, mask=r_ok)


# yaie: task 5
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
    check_states(o_a, lse_a, "o_a", "lse_a", 3)
    check_states(o_b, lse_b, "o_b", "lse_b", 3)
    if o_a.shape != o_b.shape or o_a.dtype != o_b.dtype or o_a.device != o_b.device:
        raise ValueError(f"o_a and o_b must share shape, dtype and device, got {list(o_a.shape)} {o_a.dtype} "
                         f"{o_a.device} and {list(o_b.shape)} {o_b.dtype} {o_b.device}")
    n, heads, head_dim = o_a.shape
    out = torch.empty((n, heads, head_dim), device=o_a.device, dtype=o_a.dtype)
    lse = torch.empty((n, heads), device=o_a.device, dtype=torch.float32)
    rows = n * heads
    if rows == 0:
        return out, lse
    # Rows (token, head) must be evenly spaced to be addressed as one axis: true when the head axis is dense.
    oa = o_a if o_a.stride(0) == heads * o_a.stride(1) else o_a.contiguous()
    ob = o_b if o_b.stride(0) == heads * o_b.stride(1) else o_b.contiguous()
    la, lb = lse_a.contiguous(), lse_b.contiguous()
    block_r = 16
    _merge_two_kernel[((rows + block_r - 1) // block_r,)](
        oa, la, ob, lb, out, lse, rows, oa.stride(1), ob.stride(1), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_R=block_r)
    return out, lse


# yaie: solution-only
@triton.jit
def _merge_many_kernel(PART_O, PART_LSE, OUT, LSE_OUT, ITEMS, num_heads, num_states,
                       stride_pi, stride_ps, stride_ph, stride_li, stride_ls, stride_lh,
                       stride_ot, stride_oh, stride_lt,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                       VARLEN: tl.constexpr):
    """One program: one output token, BLOCK_H heads; an online log-sum-exp over its states.

    Fixed count (``VARLEN=False``): token ``i``'s states are ``PART[i, s]``, ``s < num_states``.
    Variable (``VARLEN=True``, the split merge of :meth:`FlashInferPagedAttention.run`): ``ITEMS[i]`` holds
    (destination token, first partial row, number of rows); the rows are consecutive.
    """
    item = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if VARLEN:
        token = tl.load(ITEMS + item * 3).to(tl.int64)
        first = tl.load(ITEMS + item * 3 + 1).to(tl.int64)
        count = tl.load(ITEMS + item * 3 + 2)
        base_o = PART_O + first * stride_ps
        base_l = PART_LSE + first * stride_ls
    else:
        token = item.to(tl.int64)
        count = num_states
        base_o = PART_O + token * stride_pi
        base_l = PART_LSE + token * stride_li
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)     # the largest lse so far
    total = tl.zeros([BLOCK_H], tl.float32)                 # sum of exp(lse_s - top)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)          # sum of exp(lse_s - top) * o_s
    for s in range(0, count):
        lse_s = tl.load(base_l + s * stride_ls + heads * stride_lh, mask=h_ok, other=float("-inf"))
        o_s = tl.load(base_o + s * stride_ps + heads[:, None] * stride_ph + offs_d[None, :], mask=mask,
                      other=0.0).to(tl.float32)
        new_top = tl.maximum(top, lse_s)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        alpha = tl.exp(top - shift)
        weight = tl.exp(lse_s - shift)
        o_s = tl.where(weight[:, None] > 0, o_s, 0.0)
        total = total * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * o_s
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(OUT + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=mask)
    tl.store(LSE_OUT + token * stride_lt + heads, lse, mask=h_ok)


# yaie: task 5
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
    check_states(o, lse, "o", "lse", 4)
    n, num_states, heads, head_dim = o.shape
    out = torch.empty((n, heads, head_dim), device=o.device, dtype=o.dtype)
    merged = torch.empty((n, heads), device=o.device, dtype=torch.float32)
    if n * heads == 0:
        return out, merged
    block_h = 16
    _merge_many_kernel[(n, (heads + block_h - 1) // block_h)](
        o, lse, out, merged, lse, heads, num_states,
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        out.stride(0), out.stride(1), merged.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_H=block_h, VARLEN=False)
    return out, merged


# ================================================================ the plan/run kernel (tasks 6 and 7)

# yaie: solution-only
@dataclass
class _Plan:
    """What :meth:`plan` worked out: sizes, and the work list on the device.

    ``work`` int32 ``[num_work, WORK_FIELDS]``, one row per work item:
    (first query row, query tokens in the tile, position of its first query (``NO_MASK``: no causal mask),
    first key, end key, page-table offset (paged) or first K/V row (contiguous), which of the rows' partial
    states this is (-1: the only state, written to the output), offset into ``part_rows``).
    ``merges`` int32 ``[num_merges, 3]``: (query row, first partial row, number of partial rows).
    ``work``, ``narrow``, ``merges``, ``part_rows``, ``merge_first`` and ``merge_count`` are views of ONE
    device buffer (one copy per plan), each starting on a 16-byte boundary (see :func:`_make_plan`).
    ``counters`` (split plans with ``fuse_merge``) go back to zero at the end of every run; two runs of one
    plan at once on different streams would share them.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int          # page size (0: contiguous K/V)
    total_q: int
    total_kv: int            # contiguous: K/V rows; paged: highest page id + 1 needed
    scale: float
    config: dict
    work: torch.Tensor
    narrow: torch.Tensor     # int32 [num_work]: 1 where the tile is a narrow (decode) tile
    merges: torch.Tensor | None
    part_rows: torch.Tensor | None   # int32 [levels * total_q]: first partial row of each (level, query row)
    num_partial_rows: int
    work_host: np.ndarray    # the work list on the host, int64 [num_work, WORK_FIELDS]
    splits: np.ndarray       # per tile (level by level), how many chunks its keys were cut into
    kinds: int               # 1: narrow tiles only, 2: wide only, 3: both (which branches the kernel compiles)
    order: str               # the work order used: "longest" or "interleave"
    merge_first: torch.Tensor | None  # int32 [total_q]: each query row's first partial row
    merge_count: torch.Tensor | None  # int32 [total_q]: each query row's number of states
    counters: torch.Tensor | None    # int32 [total_q * num_heads] zeros: the fused merge's counters (fuse_merge)

    @property
    def host_work(self) -> list[tuple]:
        """The work list as Python tuples, in launch order (for pictures and tests)."""
        return [tuple(row) for row in self.work_host.tolist()]

    @property
    def num_splits(self) -> list[int]:
        return self.splits.tolist()


# yaie: solution-only
def _block_d(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16, the smallest tl.dot size): 96 -> 128."""
    return max(16, triton.next_power_of_2(head_dim))


# yaie: solution-only
@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b in float32 (FP32_DOT upcasts first: the interpreter's bf16 tl.dot is broken)."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


# yaie: solution-only
@triton.jit
def _attend_range(acc, l_i, m_i, q, pos, K, V, KV_INDICES, page_base, kv_head,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  lo, hi, scale_log2, offs_d,
                  MASK: tl.constexpr, PAGED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, FP32_DOT: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Fold keys ``lo .. hi-1`` of one request into the running (acc, l, m) of a tile of query rows.

    ``MASK=True``: keys past ``hi`` (a ragged last tile) and keys after a row's position ``pos`` get the
    score ``MASKED`` (the plan gives rows without a causal mask a position past every key). ``MASK=False``
    (the caller promises whole tiles that every row sees): no masks at all, the fast path of the long part
    of a prefill's keys. Masked scores are a large negative number, not -inf: the running max of a row that
    has seen no visible key yet stays finite, so ``exp2(m - m_new)`` is never ``exp2(-inf + inf) = NaN``
    (no extra ``where`` per tile); what such a row summed is multiplied by ``exp2(MASKED - real) = 0`` at
    its first visible key, and a row that never sees one is recognised at the end by ``m == -1e30``.

    Paged: key ``t`` is row ``t % PAGE_SIZE`` of page ``KV_INDICES[page_base + t // PAGE_SIZE]``, and the
    page ids are read one tile AHEAD so a tile's K/V addresses are known before its iteration starts
    (lesson 04: this lets Triton's pipeliner keep several K/V tiles in flight). Contiguous: key ``t`` is row
    ``page_base + t`` of K and V.
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    kh = kv_head.to(tl.int64)
    if PAGED:
        first = lo + offs_n
        next_page = tl.load(KV_INDICES + page_base + first // PAGE_SIZE, mask=first < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        t = start + offs_n
        if PAGED:
            page = next_page.to(tl.int64)
            ahead = t + BLOCK_N
            next_page = tl.load(KV_INDICES + page_base + ahead // PAGE_SIZE, mask=ahead < hi, other=0)
            within = (t % PAGE_SIZE).to(tl.int64)
            k_ptrs = K + page[:, None] * stride_kb + within[:, None] * stride_kt + kh * stride_kh + offs_d[None, :]
            v_ptrs = V + page[:, None] * stride_vb + within[:, None] * stride_vt + kh * stride_vh + offs_d[None, :]
        else:
            row = (page_base + t).to(tl.int64)
            k_ptrs = K + row[:, None] * stride_kt + kh * stride_kh + offs_d[None, :]
            v_ptrs = V + row[:, None] * stride_vt + kh * stride_vh + offs_d[None, :]
        if MASK:
            n_ok = t < hi
            k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), FP32_DOT, PRECISION) * scale_log2
        if MASK:
            s = tl.where(n_ok[None, :] & (t[None, :] <= pos[:, None]), s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], FP32_DOT, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# yaie: solution-only
@triton.jit
def _attend_tile(Q, K, V, KV_INDICES, OUT, LSE, PART_O, PART_LSE, PART_ROWS, MERGE_FIRST, MERGE_COUNT, COUNTERS,
                 w, kv_head,
                 stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_ot, stride_oh, stride_lt, num_heads, scale_log2,
                 row0, TILE_M: tl.constexpr, M: tl.constexpr, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 PAGED: tl.constexpr, FAST_PATH: tl.constexpr, FUSE_MERGE: tl.constexpr, FP32_DOT: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One work item for one KV head: rows ``row0 .. row0 + M - 1`` of a tile of TILE_M packed rows (query
    token r // GROUP, query head kv_head * GROUP + r % GROUP) against the keys ``kv_lo .. kv_hi`` of its
    request. (M < TILE_M: the tile in several passes, for float32, whose tiles take twice the registers.)

    ``FAST_PATH`` (wide tiles): the keys every row of the tile sees, whole ``BLOCK_N`` tiles from ``kv_lo``
    up to the first row's position, run without masks; only the rest (the causal diagonal, the ragged end)
    is masked. A narrow (decode) tile is memory bound: one masked loop, one copy of the code less to compile.
    """
    q_start = tl.load(w + 0)
    q_len = tl.load(w + 1)
    q_pos0 = tl.load(w + 2)
    kv_lo = tl.load(w + 3)
    kv_hi = tl.load(w + 4)
    page_base = tl.load(w + 5)
    slot = tl.load(w + 6)
    rows_at = tl.load(w + 7)

    rows = row0 + tl.arange(0, M)
    tok = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (tok < q_len) & (rows < (TILE_M // GROUP) * GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(Q + tok64[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok, other=0.0)
    pos = q_pos0 + tok                                   # causal: each row's position among the keys

    m_i = tl.full([M], -1.0e30, tl.float32)              # MASKED: no visible key yet
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BLOCK_D], tl.float32)
    masked_lo = kv_lo
    if FAST_PATH:
        # Every row sees the keys up to the first row's position (q_pos0; NO_MASK: all of them).
        seen = tl.maximum(tl.minimum(kv_hi, q_pos0 + 1), kv_lo)
        masked_lo = kv_lo + ((seen - kv_lo) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, pos, K, V, KV_INDICES, page_base, kv_head,
                                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                      kv_lo, masked_lo, scale_log2, offs_d, False, PAGED, HEAD_DIM, BLOCK_D,
                                      BLOCK_N, PAGE_SIZE, FP32_DOT, PRECISION)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, pos, K, V, KV_INDICES, page_base, kv_head,
                                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  masked_lo, kv_hi, scale_log2, offs_d, True, PAGED, HEAD_DIM, BLOCK_D,
                                  BLOCK_N, PAGE_SIZE, FP32_DOT, PRECISION)

    # The state of this tile over its keys: normalised output and natural-log lse (-inf: no visible key,
    # the running max never left MASKED; what such a row summed is junk and is dropped).
    has_keys = m_i > -5.0e29
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, (m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    mask = row_ok[:, None] & d_ok
    if slot < 0:             # the only state of these rows: the final answer
        tl.store(OUT + tok64[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=mask)
        tl.store(LSE + tok64 * stride_lt + heads, lse, mask=row_ok)
    else:                    # one of several states of these rows, merged by _merge_many_kernel or below
        part = (tl.load(PART_ROWS + rows_at + q_start + tok, mask=row_ok, other=0) + slot).to(tl.int64)
        tl.store(PART_O + (part * num_heads + heads)[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)
        tl.store(PART_LSE + part * num_heads + heads, lse, mask=row_ok)
        if FUSE_MERGE:
            _merge_if_last(OUT, LSE, PART_O, PART_LSE, MERGE_FIRST, MERGE_COUNT, COUNTERS, q_start + tok, heads,
                           row_ok, offs_d,
                           stride_ot, stride_oh, stride_lt, num_heads, HEAD_DIM)


# yaie: solution-only
@triton.jit
def _merge_if_last(OUT, LSE, PART_O, PART_LSE, MERGE_FIRST, MERGE_COUNT, COUNTERS, token, heads, row_ok, offs_d,
                   stride_ot, stride_oh, stride_lt, num_heads, HEAD_DIM: tl.constexpr):
    """The split merge fused into the plan/run kernel (lesson 04's trick, per query row): every program that
    wrote a partial state of a (token, head) row bumps that row's counter; the program that brings it to
    the row's number of states merges them all (an online log-sum-exp, as _merge_many_kernel) and puts the
    counter back to 0 for the next run. No second launch: on a step of a few tens of microseconds (the
    cascade decode) a launch's host time is as long as the GPU work. Opt-in (``config={"fuse_merge":
    True}``) because it is slower where measured (H100, cascade decode of 64 requests over an 8k prefix,
    ``lesson05_plan_run_recheck_h100.log``): 0.105 ms against 0.074 ms with the merge launch, from CUDA
    graphs; the last program of each row waits on the others' stores, and the counters cost atomics.

    The first barrier orders every thread's partial stores before the counters move (release); the second
    makes the counters' acquire hold for every thread of the program before any of them reads the other
    programs' partial rows (loaded past the L1 cache, ``.cg``)."""
    tl.debug_barrier()
    count = tl.load(MERGE_COUNT + token, mask=row_ok, other=0)              # states of the row's token
    counter = COUNTERS + token.to(tl.int64) * num_heads + heads
    before = tl.atomic_add(counter, 1, mask=row_ok, sem="acq_rel", scope="gpu")
    last = row_ok & (before == count - 1)
    tl.debug_barrier()
    if tl.max(last.to(tl.int32), axis=0) > 0:
        first = tl.load(MERGE_FIRST + token, mask=last, other=0)
        d_ok = offs_d[None, :] < HEAD_DIM
        top = tl.full(heads.shape, float("-inf"), tl.float32)            # the largest lse so far
        total = tl.zeros(heads.shape, tl.float32)                         # sum of exp(lse_s - top)
        acc = tl.zeros([heads.shape[0], offs_d.shape[0]], tl.float32)    # sum of exp(lse_s - top) * o_s
        for s in range(0, tl.max(tl.where(last, count, 0), axis=0)):
            ok = last & (s < count)
            row = (first + s).to(tl.int64) * num_heads + heads
            lse_s = tl.load(PART_LSE + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o_s = tl.load(PART_O + row[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & d_ok, other=0.0,
                          cache_modifier=".cg")
            new_top = tl.maximum(top, lse_s)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            alpha = tl.exp(top - shift)
            weight = tl.exp(lse_s - shift)
            total = total * alpha + weight
            acc = acc * alpha[:, None] + weight[:, None] * tl.where(weight[:, None] > 0, o_s, 0.0)
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tok64 = token.to(tl.int64)
        tl.store(OUT + tok64[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=last[:, None] & d_ok)
        tl.store(LSE + tok64 * stride_lt + heads, lse, mask=last)
        tl.store(counter, 0, mask=last)


# yaie: solution-only
@triton.jit
def _plan_run_kernel(Q, K, V, KV_INDICES, WORK, NARROW, OUT, LSE, PART_O, PART_LSE, PART_ROWS, MERGE_FIRST,
                     MERGE_COUNT, COUNTERS,
                     stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     stride_ot, stride_oh, stride_lt, num_heads, num_kv_heads, scale_log2,
                     NARROW_M: tl.constexpr, WIDE_M: tl.constexpr, WIDE_PASS: tl.constexpr, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_N: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, KINDS: tl.constexpr, PAGED: tl.constexpr, FUSE_MERGE: tl.constexpr,
                     FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """A 1-D grid of (work item, KV head) pairs, the KV heads of one item side by side: programs start in
    the order of the plan's work list, which is how the plan decides what runs beside what. A decode's
    tile is narrow (NARROW_M rows x BLOCK_N keys per step), a prefill's wide (WIDE_M x WIDE_N, in passes of
    WIDE_PASS rows): one launch runs both, each program taking the branch its work item asks for.

    ``KINDS``: 3 when the plan has both kinds of tile, 1 narrow only, 2 wide only. A kernel's registers are
    those of its heaviest branch, for every program: a batch of decodes alone compiles without the wide
    branch, so its programs do not carry the wide tile's registers."""
    pid = tl.program_id(0)
    item = pid // num_kv_heads
    kv_head = pid - item * num_kv_heads
    w = WORK + item * 8
    if KINDS == 3:
        narrow = tl.load(NARROW + item) != 0
    else:
        narrow = KINDS == 1
    if narrow:
        _attend_tile(Q, K, V, KV_INDICES, OUT, LSE, PART_O, PART_LSE, PART_ROWS, MERGE_FIRST, MERGE_COUNT, COUNTERS,
                     w, kv_head,
                     stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     stride_ot, stride_oh, stride_lt, num_heads, scale_log2,
                     0, NARROW_M, NARROW_M, GROUP, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, False, FUSE_MERGE,
                     FP32_DOT, PRECISION)
    elif WIDE_PASS == WIDE_M:        # 16-bit types: the whole wide tile at once
        _attend_tile(Q, K, V, KV_INDICES, OUT, LSE, PART_O, PART_LSE, PART_ROWS, MERGE_FIRST, MERGE_COUNT, COUNTERS,
                     w, kv_head,
                     stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     stride_ot, stride_oh, stride_lt, num_heads, scale_log2,
                     0, WIDE_M, WIDE_M, GROUP, HEAD_DIM, BLOCK_D, WIDE_N, PAGE_SIZE, PAGED, True, FUSE_MERGE,
                     FP32_DOT, PRECISION)
    else:                            # float32: a loop over passes of WIDE_PASS rows (not unrolled: one copy)
        for row0 in range(0, WIDE_M, WIDE_PASS):
            _attend_tile(Q, K, V, KV_INDICES, OUT, LSE, PART_O, PART_LSE, PART_ROWS, MERGE_FIRST, MERGE_COUNT,
                         COUNTERS, w, kv_head,
                         stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         stride_ot, stride_oh, stride_lt, num_heads, scale_log2,
                         row0, WIDE_M, WIDE_PASS, GROUP, HEAD_DIM, BLOCK_D, WIDE_N, PAGE_SIZE, PAGED, True,
                         FUSE_MERGE, FP32_DOT, PRECISION)


# yaie: solution-only
def _tile_config(group: int, head_dim: int, override: dict | None = None) -> dict:
    """Launch settings. Narrow tiles hold one decode token's group of heads (at least 16 rows, tl.dot's
    smallest) and step through 64 keys at a time (memory bound: big loads). Wide tiles hold a prefill
    chunk's tokens x heads: 128 rows x 32 keys (compute bound: the prefix-prefill kernel's choice for
    prefills of a few hundred tokens, which fits 4 warps' registers); 64 x 32 for head dims above 128.
    ``order``: the work list's order (see :func:`_work_order`); ``fuse_merge`` (off by default: slower
    where measured, see :func:`_merge_if_last`): split rows are merged by the last program that wrote one of
    their states instead of a second launch. Small tiles in the interpreter (fast on a CPU). ``override``
    may set any of these keys; anything else is refused (ValueError)."""
    narrow = max(16, triton.next_power_of_2(group))
    if triton_interpreted():
        config = dict(NARROW_M=narrow, WIDE_M=max(32, narrow), BLOCK_N=16, WIDE_N=16, num_warps=1, num_stages=1)
    elif head_dim <= 128:
        config = dict(NARROW_M=narrow, WIDE_M=max(128, narrow), BLOCK_N=64, WIDE_N=32, num_warps=4, num_stages=3)
    else:
        config = dict(NARROW_M=narrow, WIDE_M=max(64, narrow), BLOCK_N=32, WIDE_N=32, num_warps=4, num_stages=3)
    config.update(order="auto", fuse_merge=False)
    unknown = sorted(set(override or {}) - set(config))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; the keys are {sorted(config)}")
    config.update(override or {})
    if config["order"] not in ("auto", "longest", "interleave"):
        raise ValueError(f"config order must be 'auto', 'longest' or 'interleave', got {config['order']!r}")
    for key in ("NARROW_M", "WIDE_M", "BLOCK_N", "WIDE_N"):
        value = config[key]
        if not is_int(value) or value < 16 or value & (value - 1):
            raise ValueError(f"config {key} must be a power of two >= 16 (tl.dot's smallest tile), got {value!r}")
    if config["NARROW_M"] < group:
        raise ValueError(f"config NARROW_M ({config['NARROW_M']}) must hold a decode's {group} query heads")
    for key in ("num_warps", "num_stages"):
        if not is_int(config[key]) or config[key] < 1:
            raise ValueError(f"config {key} must be an int >= 1, got {config[key]!r}")
    if not isinstance(config["fuse_merge"], bool):
        raise ValueError(f"config fuse_merge must be True or False, got {config['fuse_merge']!r}")
    return config


# yaie: solution-only
def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranges ``0..counts[0]-1, 0..counts[1]-1, ...`` laid end to end, as (owner, index) arrays:
    ``owner[j]`` is which range element ``j`` belongs to, ``index[j]`` its place in it. The one idiom that
    turns the plan's nested loops (tiles of a request, chunks of a tile, rows of a tile) into array ops."""
    owner = np.repeat(np.arange(counts.size), counts)
    index = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, index


# yaie: solution-only
def _chunks(length, chunk: int, exact: bool):
    """(number of chunks, keys per chunk) of tiles of ``length`` keys (an int or an array): ``exact`` (a
    chunk size the caller asked for) cuts every ``chunk`` keys; otherwise ``max(1, round(length / chunk))``
    equal chunks (round half to even, as Python's ``round``)."""
    lengths = np.asarray(length, dtype=np.int64)
    if exact:
        count = np.maximum(1, -(-lengths // chunk))
        size = np.full_like(lengths, chunk)
    else:
        count = np.maximum(1, np.round(lengths / chunk).astype(np.int64))
        size = np.where(lengths > 0, -(-lengths // count), chunk)
    if lengths.ndim == 0:
        return int(count), int(size)
    return count, size


# yaie: solution-only
def _tiles(q_lens, kv_lens, q_starts, bases, causal, group, narrow_m, wide_m) -> dict:
    """Cut every request's queries into tiles, as arrays (one entry per tile): first query row ``q0``,
    tokens ``n``, first position ``pos0``, end key ``hi`` (the first key is 0), page base ``base``, ``narrow``.
    A request of ``q_len * group <= narrow_m`` rows (a decode) gets one narrow tile; longer ones wide tiles
    of ``wide_m // group`` tokens. Rows without a causal mask get a position past every key (the kernel
    masks ``key > position``); a causal tile's keys end at its last query's position."""
    keep = q_lens > 0                                  # a request without queries: nothing to compute
    q_lens, kv_lens, q_starts, bases = q_lens[keep], kv_lens[keep], q_starts[keep], bases[keep]
    narrow = q_lens * group <= narrow_m
    per_tile = np.where(narrow, narrow_m // group, wide_m // group)
    request, index = _expand(-(-q_lens // per_tile))
    t0 = index * per_tile[request]                     # the tile's first query within its request
    n = np.minimum(per_tile[request], q_lens[request] - t0)
    if causal:
        pos0 = kv_lens[request] - q_lens[request] + t0
        hi = np.minimum(kv_lens[request], pos0 + n)    # no key after the tile's last query
    else:
        pos0 = np.full(request.size, NO_MASK, dtype=np.int64)
        hi = kv_lens[request]
    return dict(q0=q_starts[request] + t0, n=n, pos0=pos0, hi=hi, base=bases[request], narrow=narrow[request])


# yaie: solution-only
def _work_order(work: np.ndarray, narrow: np.ndarray, order: str, slots: float) -> tuple[np.ndarray, str]:
    """The launch order of the work items (programs start in this order), and which order it is.

    ``longest``: longest first (a wide tile's key costs 4 narrow ones), so the heaviest programs start in
    the first wave and the short ones fill the gaps. ``interleave``: narrow (decode, memory-bound) and wide
    (prefill, compute-bound) items alternate in proportion, each kind longest first, so the two kinds share
    the multiprocessors instead of running one after the other: the decodes' reads hide under the prefills'
    matrix products. ``auto``: interleave when the wide items are most of the work and no item costs more
    than a program slot's share of it (``slots`` items run at a time); else longest first. Measured on an
    H100 (bench/results/lesson05_plan_run_h100.md, variant rows): with 2 prefills of 1k tokens over 2k
    beside 32 decodes, interleaving is 11% faster than longest first; with 2 prefills of 512 over 512, where
    the decodes are most of the work, longest first (decodes first) is 8% faster. A cascade's shared prefix,
    cut into a few long chunks, must start first or end last, alone.
    """
    cost = (work[:, 4] - work[:, 3]) * np.where(narrow != 0, 1, 4)
    longest = np.argsort(-cost, kind="stable")
    if order == "auto":
        wide_share = cost[narrow == 0].sum() >= cost[narrow != 0].sum()
        order = "interleave" if cost.size and wide_share and cost.max() * slots <= cost.sum() else "longest"
    if order == "longest":
        return longest, order
    rank = np.zeros(cost.size)
    for kind in (0, 1):
        members = longest[(narrow[longest] != 0) == kind]
        rank[members] = (np.arange(members.size) + 0.5) / max(members.size, 1)
    return np.lexsort((np.arange(cost.size), narrow != 0, rank)), order


# yaie: solution-only
def _make_plan(levels, num_heads, num_kv_heads, head_dim, block_size, total_q, total_kv, scale, kv_chunk_size,
               config, device) -> _Plan:
    """Build the work list of one or more levels (each a list of tiles over the same query rows), with array
    operations only (numpy; no loop over tiles or rows), and copy it to the device in one transfer.

    Every tile's keys are cut into chunks (``kv_chunk_size``, or :func:`choose_kv_chunk`); a query row
    then has one state per chunk of each level. A row with a single state is written straight to the output;
    the others get consecutive partial rows (``PART_ROWS[level * total_q + row]`` is the first one of
    ``row``'s states of that level) and an entry of the merge list.
    """
    group = num_heads // num_kv_heads
    config = _tile_config(group, head_dim, config)
    tiles = [_tiles(*level, group, config["NARROW_M"], config["WIDE_M"]) for level in levels]
    sms = num_sms(device)
    if kv_chunk_size is None:
        chunk = choose_kv_chunk(np.concatenate([t["hi"] for t in tiles]), num_kv_heads, sms, config["BLOCK_N"])
    else:
        chunk = kv_chunk_size
    states = np.zeros(total_q, dtype=np.int64)         # states of each query row, over all levels
    for t in tiles:
        t["count"], t["size"] = _chunks(t["hi"], chunk, kv_chunk_size is not None)
        tile_of_row, offset = _expand(t["n"])
        t["rows"] = t["q0"][tile_of_row] + offset      # the query rows of the tiles, tile after tile
        t["per_row"] = np.zeros(total_q, dtype=np.int64)
        t["per_row"][t["rows"]] = t["count"][tile_of_row]
        states += t["per_row"]
    # Partial rows, token-major: row i's states are consecutive; level by level, chunk by chunk.
    split = states > 1
    first_row = np.zeros(total_q, dtype=np.int64)
    first_row[split] = np.cumsum(states[split]) - states[split]
    merges = np.stack([np.flatnonzero(split), first_row[split], states[split]], axis=1)
    part_rows, taken = [], np.zeros(total_q, dtype=np.int64)
    for t in tiles:                                    # a row's first partial row of each level
        part_rows.append(first_row + np.where(t["per_row"] > 0, taken, 0))
        taken += t["per_row"]
    work, narrow = [np.zeros((0, WORK_FIELDS), dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for index, t in enumerate(tiles):
        if not t["n"].size:
            continue
        direct = np.maximum.reduceat(states[t["rows"]], np.cumsum(t["n"]) - t["n"]) == 1   # all rows: 1 state
        tile, c = _expand(t["count"])
        lo = c * t["size"][tile]
        work.append(np.stack([t["q0"][tile], t["n"][tile], t["pos0"][tile], lo,
                              np.minimum(t["hi"][tile], lo + t["size"][tile]), t["base"][tile],
                              np.where(direct[tile], -1, c), np.full(tile.size, index * total_q)], axis=1))
        narrow.append(t["narrow"][tile].astype(np.int64))
    work, narrow = np.concatenate(work), np.concatenate(narrow)
    order, order_used = _work_order(work, narrow, config["order"], PROGRAMS_PER_SM * sms / num_kv_heads)
    work, narrow = work[order], narrow[order]
    # One host-to-device copy: work list, kinds, merge list, partial-row tables in one int32 buffer. Each
    # piece starts on a 16-byte boundary: Triton specializes a kernel on the alignment of its pointers, and
    # views at odd offsets would compile other copies of the kernel for some plans.
    num_work, num_merges = work.shape[0], merges.shape[0]
    pieces = [work.ravel(), narrow]
    if num_merges:
        pieces += [merges.ravel(), np.concatenate(part_rows), first_row, states]
    sizes = np.array([piece.size for piece in pieces])
    starts = np.cumsum(-(-sizes // 4) * 4) - (-(-sizes // 4) * 4)
    host = np.zeros(int(starts[-1] + sizes[-1]), dtype=np.int32)
    for piece, start in zip(pieces, starts):
        host[start: start + piece.size] = piece
    packed = torch.from_numpy(host).to(device)
    views = [packed[start: start + size] for start, size in zip(starts, sizes)]
    fused = bool(num_merges) and bool(config["fuse_merge"])
    return _Plan(num_heads, num_kv_heads, head_dim, block_size, total_q, total_kv,
                 head_dim ** -0.5 if scale is None else float(scale), config,
                 views[0].view(num_work, WORK_FIELDS), views[1],
                 views[2].view(num_merges, 3) if num_merges else None, views[3] if num_merges else None,
                 int(states[split].sum()), work, np.concatenate([t["count"] for t in tiles]),
                 int(narrow.any()) + 2 * int((narrow == 0).any()), order_used,
                 views[4] if num_merges else None, views[5] if num_merges else None,
                 torch.zeros(total_q * num_heads, dtype=torch.int32, device=device) if fused else None)


# yaie: solution-only
def _run_plan(plan: _Plan, q, k, v, kv_indices, paged: bool):
    """Launch the plan: one program per (work item, KV head), then the merge of split tiles if any."""
    total_q, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if q.is_contiguous() else torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty((total_q, num_heads), device=q.device, dtype=torch.float32)
    num_work = plan.work.shape[0]
    if num_work == 0:
        return out, lse
    if plan.num_partial_rows:
        part_o = torch.empty((plan.num_partial_rows, num_heads, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((plan.num_partial_rows, num_heads), device=q.device, dtype=torch.float32)
    else:   # never written: unused pointers, float32 as a split plan's (one compiled kernel for both kinds of plan)
        part_o, part_lse = lse, lse
    cfg = plan.config
    if paged:
        strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    else:
        strides = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1))
    fused = plan.counters is not None
    wide_m = cfg["WIDE_M"]
    wide_pass = wide_m if q.element_size() <= 2 or wide_m <= 64 or wide_m % 64 else 64   # float32: 64-row passes
    _plan_run_kernel[(num_work * plan.num_kv_heads,)](
        q, k, v, kv_indices, plan.work, plan.narrow, out, lse, part_o, part_lse,
        plan.part_rows if plan.part_rows is not None else plan.work,
        plan.merge_first if fused else plan.work, plan.merge_count if fused else plan.work,
        plan.counters if fused else plan.work,
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1), lse.stride(0),
        num_heads, plan.num_kv_heads, plan.scale * LOG2E,
        NARROW_M=cfg["NARROW_M"], WIDE_M=wide_m, WIDE_PASS=wide_pass, GROUP=num_heads // plan.num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_N=cfg["BLOCK_N"], WIDE_N=cfg["WIDE_N"],
        PAGE_SIZE=max(plan.block_size, 1), KINDS=plan.kinds, PAGED=paged, FUSE_MERGE=fused,
        FP32_DOT=triton_interpreted() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"] if q.element_size() <= 2 else min(cfg["num_stages"], 2))   # fp32 tiles: 2x smem
    if plan.merges is not None and not fused:
        block_h = 16
        _merge_many_kernel[(plan.merges.shape[0], (num_heads + block_h - 1) // block_h)](
            part_o, part_lse, out, lse, plan.merges, num_heads, 0,
            0, part_o.stride(0), part_o.stride(1), 0, part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_H=block_h, VARLEN=True)
    return out, lse


# yaie: solution-only
def _check_run_inputs(plan: _Plan | None, q, k, v, paged: bool) -> None:
    """Shape/dtype/device checks of run() against the plan: host Python only, no device sync."""
    if plan is None:
        raise ValueError("call plan(...) before run(...)")
    check_tensor("q", q, 3, "[total_q, num_heads, head_dim]")
    rank, layout = (4, "[num_blocks, block_size, num_kv_heads, head_dim]") if paged else \
        (3, "[total_kv, num_kv_heads, head_dim]")
    check_tensor("k", k, rank, layout)
    check_tensor("v", v, rank, layout)
    if tuple(q.shape) != (plan.total_q, plan.num_heads, plan.head_dim):
        raise ValueError(f"q must be [total_q, num_heads, head_dim] = {[plan.total_q, plan.num_heads, plan.head_dim]} "
                         f"as planned, got {list(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}")
    if paged:
        expected = (k.shape[0], plan.block_size, plan.num_kv_heads, plan.head_dim)
        if tuple(k.shape) != expected:
            raise ValueError(f"the caches must be [num_blocks, block_size={plan.block_size}, num_kv_heads="
                             f"{plan.num_kv_heads}, head_dim={plan.head_dim}] as planned, got {list(k.shape)}")
        if plan.total_kv > k.shape[0]:
            raise ValueError(f"the plan reads page {plan.total_kv - 1} but the cache has {k.shape[0]} blocks")
    elif tuple(k.shape) != (plan.total_kv, plan.num_kv_heads, plan.head_dim):
        raise ValueError(f"k and v must be [total_kv, num_kv_heads, head_dim] = "
                         f"{[plan.total_kv, plan.num_kv_heads, plan.head_dim]} as planned, got {list(k.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype of float16, bfloat16, float32; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == plan.work.device):
        raise ValueError(f"q, k, v and the plan must be on one device, got {q.device}, {k.device}, {v.device}, "
                         f"plan on {plan.work.device}")
    check_device(q.device)


# yaie: solution-only
def _host_copies(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The values of small int tensors on the host, as int64 numpy arrays. CPU tensors are read in place;
    GPU ones are packed into one buffer and copied in ONE transfer (one device sync for all, not one each)."""
    out: list = [None] * len(tensors)
    on_gpu: dict = {}
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            out[i] = t.numpy().astype(np.int64)
        else:
            on_gpu.setdefault(t.device, []).append(i)
    for indices in on_gpu.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices]).cpu().numpy().astype(np.int64)
        ends = np.cumsum([tensors[i].numel() for i in indices])
        for i, piece in zip(indices, np.split(flat, ends[:-1])):
            out[i] = piece
    return out


# yaie: solution-only
def _check_paged_layout(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, block_size) -> None:
    """The checks of one CSR description of a paged batch that read no values (no device sync)."""
    check_indptr_layout("qo_indptr", qo_indptr)
    check_indptr_layout("kv_indptr", kv_indptr, qo_indptr.numel())
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dtype != torch.int32 or kv_indices.dim() != 1:
        raise ValueError("kv_indices must be a 1-D int32 tensor of page ids")
    if not isinstance(kv_last_page_len, torch.Tensor) or kv_last_page_len.dtype != torch.int32 \
            or tuple(kv_last_page_len.shape) != (qo_indptr.numel() - 1,):
        raise ValueError(f"kv_last_page_len must be int32 [batch = {qo_indptr.numel() - 1}]")
    check_device(kv_indices.device)


# yaie: solution-only
def _paged_level(qo, kvp, ids, last, block_size, causal, page_offset=0):
    """Check the values of one CSR description of a paged batch (numpy arrays read by :func:`_host_copies`).
    Returns ((q_lens, kv_lens, first query rows, first entries in kv_indices + page_offset, causal),
    total_q, highest page id + 1)."""
    check_offset_values("qo_indptr", qo)
    check_offset_values("kv_indptr", kvp)
    if ids.size != kvp[-1]:
        raise ValueError(f"kv_indices must hold kv_indptr[-1] = {int(kvp[-1])} page ids, got {ids.size}")
    pages = np.diff(kvp)
    bad = np.flatnonzero(np.where(pages > 0, (last < 1) | (last > block_size), last != 0))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"kv_last_page_len[{b}] = {int(last[b])}: must be 1..block_size={block_size} for a request "
                         f"with pages, 0 without ({int(pages[b])} pages)")
    if ids.size and ids.min() < 0:
        raise ValueError(f"kv_indices holds a negative page id ({int(ids.min())})")
    q_lens = np.diff(qo)
    kv_lens = np.where(pages > 0, (pages - 1) * block_size + last, 0)
    check_causal_lengths(q_lens, kv_lens, causal)
    return (q_lens, kv_lens, qo[:-1], kvp[:-1] + page_offset, causal), int(qo[-1]), \
        (int(ids.max()) + 1 if ids.size else 0)


# ================================================================ task 6: paged plan/run

# yaie: task 6
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
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
    for b in range(len(qo) - 1):
        pages = kv_indices[kvp[b]:kvp[b + 1]].long()
        kv_len = (len(pages) - 1) * block_size + last[b] if len(pages) else 0
        ql = qo[b + 1] - qo[b]
        if ql == 0 or kv_len == 0:
            continue
        k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)   # [kv_len, heads, d]
        v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qo[b]:qo[b + 1]], k) * scale
        if causal:
            position = torch.arange(kv_len - ql, kv_len, device=q.device)
            hidden = torch.arange(kv_len, device=q.device)[None, :] > position[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        lse[qo[b]:qo[b + 1]] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    return out, lse


class FlashInferPagedAttention:
    """Attention of a ragged batch (prefill chunks and decodes, any mix) over a paged KV cache: plan once
    per engine step, run once per layer.

    ``config`` (optional) overrides the launch settings (``NARROW_M``, ``WIDE_M``, ``BLOCK_N``,
    ``num_warps``, ``num_stages``): for benchmarks and experiments.
    """

    def __init__(self, config: dict | None = None):
        self.config = config
        self._plan = None

    # yaie: task 6
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
        check_sizes(num_heads, num_kv_heads, head_dim, scale)
        if kv_chunk_size is not None and (not is_int(kv_chunk_size) or kv_chunk_size < 1):
            raise ValueError(f"kv_chunk_size must be None or an int >= 1, got {kv_chunk_size!r}")
        _check_paged_layout(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, block_size)
        values = _host_copies([qo_indptr, kv_indptr, kv_indices, kv_last_page_len])   # one sync at most
        level, total_q, pages_needed = _paged_level(*values, block_size, causal)
        self._plan = _make_plan([level], num_heads, num_kv_heads, head_dim, block_size, total_q, pages_needed,
                                scale, kv_chunk_size, self.config, kv_indices.device)
        self._kv_indices = kv_indices

    # yaie: task 6
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
        _check_run_inputs(self._plan, q, k_cache, v_cache, paged=True)
        return _run_plan(self._plan, q, k_cache, v_cache, self._kv_indices, paged=True)


# ================================================================ task 7: contiguous ragged plan/run

# yaie: task 7
def ragged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                               kv_indptr: torch.Tensor, causal: bool = False,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive form of :class:`FlashInferAttention`: per request, plain attention over its K/V rows.

    q ``[total_q, num_heads, head_dim]``, k/v ``[total_kv, num_kv_heads, head_dim]``; request ``b`` owns
    query rows ``qo_indptr[b]:qo_indptr[b+1]`` and key rows ``kv_indptr[b]:kv_indptr[b+1]``. Computes in
    the inputs' dtype. Returns ``(out, lse)`` like :func:`paged_attention_reference_csr`.
    """
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
    for b in range(len(qo) - 1):
        ql, kl = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        if ql == 0 or kl == 0:
            continue
        kb = k[kvp[b]:kvp[b + 1]].repeat_interleave(group, dim=1)
        vb = v[kvp[b]:kvp[b + 1]].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qo[b]:qo[b + 1]], kb) * scale
        if causal:
            position = torch.arange(kl - ql, kl, device=q.device)
            scores = scores.masked_fill(torch.arange(kl, device=q.device)[None, :] > position[:, None], float("-inf"))
        out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vb)
        lse[qo[b]:qo[b + 1]] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    return out, lse


class FlashInferAttention:
    """Plan/run attention of a ragged batch over contiguous K/V (each request's keys are consecutive rows
    of ``[total_kv, num_kv_heads, head_dim]`` tensors): the same work list as the paged form, no pages."""

    def __init__(self, config: dict | None = None):
        self.config = config
        self._plan = None

    # yaie: task 7
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
        check_indptr_layout("qo_indptr", qo_indptr)
        check_indptr_layout("kv_indptr", kv_indptr, qo_indptr.numel())
        check_sizes(num_heads, num_kv_heads, head_dim, scale)
        if kv_chunk_size is not None and (not is_int(kv_chunk_size) or kv_chunk_size < 1):
            raise ValueError(f"kv_chunk_size must be None or an int >= 1, got {kv_chunk_size!r}")
        device = torch.device(device) if device is not None else kv_indptr.device
        check_device(device)
        qo, kvp = _host_copies([qo_indptr, kv_indptr])
        check_offset_values("qo_indptr", qo)
        check_offset_values("kv_indptr", kvp)
        q_lens, kv_lens = np.diff(qo), np.diff(kvp)
        check_causal_lengths(q_lens, kv_lens, causal)
        self._plan = _make_plan([(q_lens, kv_lens, qo[:-1], kvp[:-1], causal)], num_heads, num_kv_heads, head_dim,
                                0, int(qo[-1]), int(kvp[-1]), scale, kv_chunk_size, self.config, device)

    # yaie: task 7
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned batch: q ``[total_q, num_heads, head_dim]``, k/v ``[total_kv,
        num_kv_heads, head_dim]`` (one dtype, last axis contiguous). One launch (+ merge); no sync.

        Returns:
            ``(out, lse)`` as :meth:`FlashInferPagedAttention.run`.

        Raises:
            ValueError: no plan yet; shapes, dtypes or devices that differ from the plan's.
        """
        _check_run_inputs(self._plan, q, k, v, paged=False)
        return _run_plan(self._plan, q, k, v, self._plan.work, paged=False)


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

    # yaie: task 8
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
        lists = (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        if not all(isinstance(x, (list, tuple)) for x in lists) or len({len(x) for x in lists}) != 1 \
                or not qo_indptr:
            raise ValueError("qo_indptr, kv_indptr, kv_indices and kv_last_page_len must be lists of one "
                             "length (>= 1), one entry per level")
        check_sizes(num_heads, num_kv_heads, head_dim, scale)
        for args in zip(*lists):
            _check_paged_layout(*args, block_size)
        values = _host_copies([t for args in zip(*lists) for t in args])    # every level: one sync at most
        levels, totals, pages_needed, offset = [], set(), 0, 0
        for i, args in enumerate(zip(*lists)):
            level, total_q, needed = _paged_level(*values[4 * i: 4 * i + 4], block_size,
                                                  causal and i == len(qo_indptr) - 1, page_offset=offset)
            levels.append(level)
            totals.add(total_q)
            pages_needed = max(pages_needed, needed)
            offset += args[2].numel()
        if len(totals) != 1:
            raise ValueError(f"every level must cover the same query rows: qo_indptr[-1] differs ({sorted(totals)})")
        devices = {t.device for t in kv_indices}
        if len(devices) != 1:
            raise ValueError(f"every level's kv_indices must be on one device, got {sorted(map(str, devices))}")
        # One work list for all levels: one launch computes every level's states, one merge combines them.
        self._kv_indices = torch.cat(list(kv_indices))
        self._plan = _make_plan(levels, num_heads, num_kv_heads, head_dim, block_size, totals.pop(), pages_needed,
                                scale, None, self.config, self._kv_indices.device)

    # yaie: task 8
    def run(self, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every query row over the union of all levels' keys: ``(out, lse)`` as
        :meth:`FlashInferPagedAttention.run` (reference: one launch for all levels' states, one merge launch).

        Raises:
            ValueError: no plan yet, or what :meth:`FlashInferPagedAttention.run` rejects.
        """
        _check_run_inputs(self._plan, q, k_cache, v_cache, paged=True)
        return _run_plan(self._plan, q, k_cache, v_cache, self._kv_indices, paged=True)
