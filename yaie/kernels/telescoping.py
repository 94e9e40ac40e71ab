# Lesson 07 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/telescoping_given.py: read it, do not edit it.
# Run `pytest grader/lesson07` to grade them; the notebook is lessons/07_telescoping_cache/.
# (Generated from solutions/kernels/telescoping.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 07: the telescoping cache and its indexed matmul kernels (Triton).

A full KV cache grows by one entry per generated token. A *telescoping* cache keeps a constant number of
entries ``c`` per head: the recent tokens exactly, older ones as averages over spans that get longer the
further back they lie (1, 1, 1, ..., 2, 2, 4, 4, 8, ...). Memory per sequence stops growing.

**The merge rule (recurrent form, task 1).** The cache is a list of entries, oldest first; entry ``i``
averages the keys (or values) of ``sizes[i]`` consecutive tokens. An entry's *level* is
``floor(log2(size))``: exact tokens are level 0, averages of 2 tokens level 1, of 4 tokens level 2...
After reading a token:

1. append it as a new entry of size 1;
2. if the cache now holds ``c + 1`` entries, merge one adjacent pair into their size-weighted average:
   the two *oldest* entries of the level that holds the *most* entries (ties: the lowest level). If every
   level holds a single entry (possible only after about ``2**c`` tokens), merge the two oldest entries.

The schedule depends on the number of tokens read and nothing else (never on the data), so every head,
layer and sequence of the same length merges at the same place. Sizes never grow from old to new, so
the entries of one level sit side by side and their two oldest are neighbours; the merged entry keeps
its place in time order. The rule keeps the levels about equally full: with ``c = 256`` after 16k tokens
the cache holds about 25 exact tokens, then about 25 pairs, 25 spans of 4, ... The spans double with
distance.

**The index map (parallel form, task 2).** Training and prefill need the cache of *every* position at
once. Each step creates at most two entries (the new token, one merged span), so all the caches of a
sequence of ``l`` tokens together use only ``n = l + max(0, l - c)`` distinct averages: the buffer,
tokens first (buffer row ``p`` is token ``p``), then the merged spans in the order they were made.
``M[l, j]`` is the buffer row of entry ``j`` in the cache of position ``l`` (tokens ``0..l``); unused
slots hold ``n``. The map depends on ``(l, c)`` only; the buffer is a difference of prefix sums.

**The indexed matmuls (tasks 3 and 4).** With ``Q [b, l, h, e, d]`` (``e`` query heads per KV head) and
a key buffer ``K [b, n, h, d]``, attention scores are ``S[b,l,h,e,c] = sum_d Q[b,l,h,e,d] K[b,M[l,c],h,d]``.
Gathering ``K[:, M]`` first would build a ``[b, l, h, c, d]`` tensor: 34 GB for b=4, l=16k, h=8, c=256,
d=128 in bf16, most of it copies of the same rows. The kernels follow the map while they load and never
build it. Three kernels cover the forward and backward of both products:

* gather-dot:        ``out[l,e,c] = sum_d a[l,e,d] * buf[M[l,c], d]``    (Q K^T forward; dP of P V)
* gather-accumulate: ``out[l,e,d] = sum_c p[l,e,c] * buf[M[l,c], d]``    (P V forward; dQ of Q K^T)
* scatter-add:       ``dbuf[M[l,c], d] += sum_e p[l,e,c] * a[l,e,d]``    (dK of Q K^T; dV of P V)

In the scatter many ``(l, c)`` pairs hit one buffer row, so it adds with atomics, in float32. The tasks'
kernels work one position at a time (a ``[e, d] x [d, c]`` product per position and slot block). The map
the model uses keeps every entry in one column while it lives (:func:`stable_slots`), so over a block of
neighbouring positions a slot holds one or two rows; for such maps the reference solution adds *blocked*
variants of gather-dot and scatter-add that treat a block of positions as one matmul per row
(``K = positions x e`` deep), reading (or adding to) each slot's rows once per block instead of once per
position, and picks them for maps of that kind (a "going further" of the lesson: the tasks do not need
them). Maps whose slots change rows often (oldest-first order, random) would need an atomic add per slot and
position; for those the reference inverts the map instead: it sorts the map's entries by buffer row once per
map (kept on the map tensor), and each program sums the entries of its own block of rows with ``tl.dot``,
without atomics.
Empty slots (``M >= n``) give 0 in the forward products and receive no gradient.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/telescoping_given.py
from yaie.kernels.telescoping_given import (
    MAX_GROUP, MAX_HEAD_DIM, SUPPORTED_DTYPES, check_count, check_dout, check_indexed_inputs, check_map_entries,
    entry_level, indexed_pv_reference, indexed_qk_reference, span_sizes, stable_slots,
)


# ---------------------------------------------------------------- task 1: the merge rule

def choose_merge(sizes: list[int]) -> int:
    """Where the merge rule merges: entries ``i`` and ``i + 1`` of a cache that has one entry too many.

    Args:
        sizes: the span lengths of the cache's entries, oldest first, after the new token was appended
            (so its last element is 1). At least 2 entries; sizes never increase from old to new.

    Returns:
        ``i``: the index of the older entry of the pair to merge. The pair is the two oldest entries of
        the level (``floor(log2(size))``) that holds the most entries, ties going to the lowest level;
        if no level holds two entries, the two oldest entries (``i = 0``).

    Raises:
        ValueError: ``sizes`` not a list (or tuple) of ints, fewer than two entries, or a size below 1.
    """
    raise NotImplementedError('lesson 07, task 1: implement choose_merge in yaie/kernels/telescoping.py')


def telescoping_step(entries: torch.Tensor, sizes: torch.Tensor, new_entry: torch.Tensor,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the telescoping cache: append ``new_entry``, then merge if over capacity.

    Args:
        entries: ``[k, *feature]`` the cache before the step, oldest first (``k <= capacity``; ``k = 0``
            for an empty cache). Any float dtype; the feature shape is anything (``[d]``, ``[h, d]``).
        sizes: int64 ``[k]``: how many tokens each entry averages (on ``entries``' device or the CPU).
        new_entry: ``[*feature]`` the new token's key (or value), same dtype and device as ``entries``.
        capacity: ``c >= 1``, the most entries the cache keeps.

    Returns:
        ``(entries, sizes)``: new tensors (the inputs are not modified) with ``min(k + 1, c)`` entries.
        When ``k + 1 > c`` the pair ``i, i + 1`` chosen by :func:`choose_merge` becomes one entry, the
        size-weighted mean ``(s_i * x_i + s_{i+1} * x_{i+1}) / (s_i + s_{i+1})`` with size
        ``s_i + s_{i+1}``, in the place of entry ``i``; the order of the others is kept.

    Raises:
        ValueError: ``capacity`` not an int ``>= 1``, an input that is not a tensor, more than ``capacity``
            entries, shapes, dtypes or devices that do not match, or ``sizes`` that is not an int64 vector
            of ``k`` positive counts.
    """
    raise NotImplementedError('lesson 07, task 1: implement telescoping_step in yaie/kernels/telescoping.py')


# ---------------------------------------------------------------- task 2: the index map

def telescoping_index_map(length: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parallel form of the merge rule: every position's cache as rows of a shared buffer.

    Args:
        length: ``l >= 1`` tokens.
        capacity: ``c >= 1`` entries per cache.

    Returns:
        ``(index_map, starts, ends)`` on the CPU:

        * ``index_map``: int32 ``[l, c]``. Row ``p`` is the cache after reading tokens ``0..p`` (what the
          merge rule of task 1 holds after ``p + 1`` steps), oldest entry first: ``index_map[p, j]`` is the
          buffer row of entry ``j``, and ``n`` marks an unused slot (the first ``min(p + 1, c)`` are used).
        * ``starts``, ``ends``: int64 ``[n]``: buffer row ``r`` averages tokens ``starts[r] <= t < ends[r]``.
          Rows ``0..l-1`` are the tokens themselves (``starts[r] = r``, ``ends[r] = r + 1``); rows from
          ``l`` on are the merged spans, in the order the rule made them. ``n = l + max(0, l - c)``.

    Raises:
        ValueError: ``length`` or ``capacity`` not an int ``>= 1``.
    """
    raise NotImplementedError('lesson 07, task 2: implement telescoping_index_map in yaie/kernels/telescoping.py')


def telescoping_buffer(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The buffer of span averages: ``out[:, r] = mean(x[:, starts[r]:ends[r]])`` for every row ``r``.

    Args:
        x: ``[b, l, *feature]`` (keys or values of a batch of sequences), any float dtype, any device.
        starts, ends: int64 ``[n]`` from :func:`telescoping_index_map` (``0 <= start < end <= l``).

    Returns:
        ``[b, n, *feature]`` in ``x``'s dtype, computed in float32 (float64 for float64 input) from prefix
        sums, in parallel over all rows: ``(S[end] - S[start]) / (end - start)`` with ``S[t]`` the sum of
        the first ``t`` tokens. Differentiable (autograd flows back to ``x``).

    Raises:
        ValueError: an input that is not a tensor, ``x`` not floating point or with fewer than 2 dims,
        ``starts``/``ends`` not integer vectors of one length, or a span outside ``[0, l]`` or empty.
    """
    raise NotImplementedError('lesson 07, task 2: implement telescoping_buffer in yaie/kernels/telescoping.py')


# ---------------------------------------------------------------- task 3: indexed matmul forward

def indexed_qk_forward(q: torch.Tensor, k: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """Scores of every position against its telescoping cache, without gathering the cache (Triton).

    Args:
        q: ``[b, l, h, e, d]`` queries: ``h`` KV heads, ``e`` query heads each (GQA), float16, bfloat16
            or float32, any strides, on a CUDA GPU or (interpreter) the CPU.
        k: ``[b, n, h, d]`` the key buffer (same dtype and device).
        index_map: int32 or int64 ``[l, c]``: ``k`` row of cache slot ``c`` of position ``l``; entries
            ``>= n`` are unused slots.

    Returns:
        ``[b, l, h, e, c]`` in ``q``'s dtype: ``out[b,l,h,e,c] = sum_d q[b,l,h,e,d] * k[b, M[l,c], h, d]``
        (accumulated in float32), 0 where the slot is unused. The gathered ``[b, l, c, h, d]`` keys are
        never built.

    Raises:
        ValueError: shapes that do not match (batch, heads, l, d), a negative index, a dtype other than
            the three, mixed dtypes or devices, ``e`` above 16 or ``d`` above 256, empty tensors.
    """
    raise NotImplementedError('lesson 07, task 3: implement indexed_qk_forward in yaie/kernels/telescoping.py')


def indexed_pv_forward(p: torch.Tensor, v: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """Attention weights times the values of every position's cache, without gathering it (Triton).

    Args:
        p: ``[b, l, h, e, c]`` weights of each cache slot (e.g. a softmax of :func:`indexed_qk_forward`'s
            scores), float16, bfloat16 or float32.
        v: ``[b, n, h, d]`` the value buffer (same dtype and device).
        index_map: int32 or int64 ``[l, c]``, as in :func:`indexed_qk_forward`.

    Returns:
        ``[b, l, h, e, d]`` in ``p``'s dtype: ``out[b,l,h,e,d] = sum_c p[b,l,h,e,c] * v[b, M[l,c], h, d]``,
        where unused slots add nothing whatever ``p`` holds there.

    Raises:
        ValueError: as :func:`indexed_qk_forward` (``p``'s last dim must be ``c``).
    """
    raise NotImplementedError('lesson 07, task 3: implement indexed_pv_forward in yaie/kernels/telescoping.py')


# ---------------------------------------------------------------- task 4: backward and autograd

def indexed_qk_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        index_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`indexed_qk_forward` (Triton).

    Args:
        dout: ``[b, l, h, e, c]`` gradient of the scores (same dtype as ``q``).
        q, k, index_map: the forward's inputs.

    Returns:
        ``(dq, dk)``: ``dq[b,l,h,e,d] = sum_c dout[b,l,h,e,c] * k[b,M[l,c],h,d]`` (``[b, l, h, e, d]``),
        and ``dk[b,r,h,d] = sum over (l, c) with M[l,c] = r of sum_e dout[b,l,h,e,c] * q[b,l,h,e,d]``
        (``[b, n, h, d]``; rows no slot uses get 0), both in the inputs' dtype, accumulated in float32.
        Unused slots receive and pass no gradient.

    Raises:
        ValueError: as the forward, and a ``dout`` of another shape than ``[b, l, h, e, c]``.
    """
    raise NotImplementedError('lesson 07, task 4: implement indexed_qk_backward in yaie/kernels/telescoping.py')


def indexed_pv_backward(dout: torch.Tensor, p: torch.Tensor, v: torch.Tensor,
                        index_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`indexed_pv_forward` (Triton).

    Args:
        dout: ``[b, l, h, e, d]`` gradient of the output (same dtype as ``p``).
        p, v, index_map: the forward's inputs.

    Returns:
        ``(dp, dv)``: ``dp[b,l,h,e,c] = sum_d dout[b,l,h,e,d] * v[b,M[l,c],h,d]`` (0 at unused slots), and
        ``dv[b,r,h,d] = sum over (l, c) with M[l,c] = r of sum_e p[b,l,h,e,c] * dout[b,l,h,e,d]``, in the
        inputs' dtype, accumulated in float32.

    Raises:
        ValueError: as the forward, and a ``dout`` of another shape than ``[b, l, h, e, d]``.
    """
    raise NotImplementedError('lesson 07, task 4: implement indexed_pv_backward in yaie/kernels/telescoping.py')


class IndexedQK(torch.autograd.Function):
    """Autograd for :func:`indexed_qk_forward`: ``IndexedQK.apply(q, k, index_map)``."""

    @staticmethod
    def forward(ctx, q, k, index_map):
        ctx.save_for_backward(q, k, index_map)
        return indexed_qk_forward(q, k, index_map)

    @staticmethod
    def backward(ctx, dout):
        q, k, index_map = ctx.saved_tensors
        dq, dk = indexed_qk_backward(dout.contiguous(), q, k, index_map)
        return dq, dk, None


class IndexedPV(torch.autograd.Function):
    """Autograd for :func:`indexed_pv_forward`: ``IndexedPV.apply(p, v, index_map)``."""

    @staticmethod
    def forward(ctx, p, v, index_map):
        ctx.save_for_backward(p, v, index_map)
        return indexed_pv_forward(p, v, index_map)

    @staticmethod
    def backward(ctx, dout):
        p, v, index_map = ctx.saved_tensors
        dp, dv = indexed_pv_backward(dout.contiguous(), p, v, index_map)
        return dp, dv, None


def indexed_qk(q: torch.Tensor, k: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """:func:`indexed_qk_forward` that autograd can differentiate (through tasks 3 and 4)."""
    return IndexedQK.apply(q, k, index_map)


def indexed_pv(p: torch.Tensor, v: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """:func:`indexed_pv_forward` that autograd can differentiate (through tasks 3 and 4)."""
    return IndexedPV.apply(p, v, index_map)


# ---------------------------------------------------------------- attention over the telescoping cache

_MAPS: dict = {}
MAX_KEPT_MAPS = 16     # a server sees many prompt lengths: keep the most recently used maps only


def telescoping_maps(length: int, capacity: int, device) -> tuple[torch.Tensor, ...]:
    """``(index_map, starts, ends, bias)`` for ``(length, capacity)`` on ``device``, built once and kept
    (the ``MAX_KEPT_MAPS`` most recently used ones).

    ``index_map`` has :func:`stable_slots` columns; ``bias`` is float32 ``[l, c]``: ``log(size)`` of each
    slot's span, ``-inf`` for unused slots (what a score needs added so that a span of ``s`` tokens weighs
    like ``s`` tokens, and an unused slot like nothing).
    """
    key = (int(length), int(capacity), str(torch.device(device)))
    if key not in _MAPS:
        index_map, starts, ends = telescoping_index_map(length, capacity)
        index_map = stable_slots(index_map, starts.numel())
        sizes = span_sizes(index_map, starts, ends)
        bias = torch.where(sizes > 0, sizes.clamp(min=1).log(), torch.full_like(sizes, float("-inf")))
        _MAPS[key] = tuple(t.to(device) for t in (index_map, starts, ends, bias))
        while len(_MAPS) > MAX_KEPT_MAPS:
            del _MAPS[next(iter(_MAPS))]            # dicts keep insertion order: the least recently used
    else:
        _MAPS[key] = _MAPS.pop(key)                 # used again: move it to the end
    return _MAPS[key]


def telescoping_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, capacity: int,
                          scale: float | None = None, use_kernels: bool = True) -> torch.Tensor:
    """Causal attention where position ``l`` sees its telescoping cache instead of all earlier tokens.

    Args:
        q: ``[b, l, h * e, d]``; k, v: ``[b, l, h, d]`` (token-major, as a model's projections give them;
            query head ``j`` reads KV head ``j // e``).
        capacity: ``c``, entries per cache. scale: default ``d ** -0.5``.
        use_kernels: the Triton kernels of tasks 3 and 4 (``False``: the gather references, plain PyTorch).

    An entry averaging ``s`` tokens stands for ``s`` tokens: its score gets ``+ log(s)``, so a span of
    identical keys weighs exactly as much as the tokens it replaced. Differentiable. Computes in ``q``'s
    dtype (``k`` and ``v`` are cast to it) and returns ``[b, l, h * e, d]`` in it. Raises ``ValueError`` on
    shapes that do not fit together.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q must be [b, l, h * e, d] and k, v [b, l, h, d] with the same b, l, d, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, l, hq, d = q.shape
    h = k.shape[2]
    if h == 0 or hq % h:
        raise ValueError(f"the {hq} query heads must be a multiple of the {h} KV heads (at least one)")
    e = hq // h
    scale = d ** -0.5 if scale is None else scale
    index_map, starts, ends, bias = telescoping_maps(l, capacity, q.device)
    k_buf = telescoping_buffer(k, starts, ends).to(q.dtype)       # the kernels take one dtype
    v_buf = telescoping_buffer(v, starts, ends).to(q.dtype)
    qk, pv = (indexed_qk, indexed_pv) if use_kernels else (indexed_qk_reference, indexed_pv_reference)
    scores = qk(q.reshape(b, l, h, e, d), k_buf, index_map).float() * scale + bias[None, :, None, None, :]
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    return pv(weights, v_buf, index_map).reshape(b, l, hq, d)
