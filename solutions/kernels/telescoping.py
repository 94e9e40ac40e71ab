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

# yaie: task 1
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
    if not isinstance(sizes, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, numbers.Integral)
                                                   for s in sizes):
        raise ValueError(f"sizes must be a list of ints (tokens per entry), got {type(sizes).__name__} "
                         f"{sizes!r:.80}")
    if len(sizes) < 2:
        raise ValueError(f"a merge needs at least 2 entries, got {len(sizes)}")
    if min(sizes) < 1:
        raise ValueError(f"every entry averages at least one token, got sizes {list(sizes)}")
    levels = [entry_level(s) for s in sizes]
    counts: dict[int, int] = {}
    for level in levels:
        counts[level] = counts.get(level, 0) + 1
    most = max(counts.values())
    if most < 2:
        return 0
    level = min(lv for lv, count in counts.items() if count == most)
    # Levels never increase from old to new, so one level's entries are neighbours: the first is the oldest.
    return levels.index(level)


# yaie: task 1
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
    capacity = check_count("capacity", capacity)
    for name, t in (("entries", entries), ("sizes", sizes), ("new_entry", new_entry)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if entries.dim() < 1 or entries.shape[1:] != new_entry.shape:
        raise ValueError(f"entries must be [k, *feature] with feature {tuple(new_entry.shape)} "
                         f"(the new entry's shape), got {tuple(entries.shape)}")
    if entries.dtype != new_entry.dtype or entries.device != new_entry.device:
        raise ValueError(f"entries and new_entry must share dtype and device, got {entries.dtype} on "
                         f"{entries.device} and {new_entry.dtype} on {new_entry.device}")
    if sizes.dtype != torch.int64 or sizes.shape != (entries.shape[0],):
        raise ValueError(f"sizes must be an int64 vector of {entries.shape[0]} counts, got "
                         f"{sizes.dtype} {tuple(sizes.shape)}")
    if entries.shape[0] > capacity:
        raise ValueError(f"the cache holds {entries.shape[0]} entries, more than its capacity {capacity}")
    if sizes.numel() and int(sizes.min()) < 1:
        raise ValueError("every entry averages at least one token (sizes >= 1)")
    entries = torch.cat([entries, new_entry.unsqueeze(0)])
    sizes = torch.cat([sizes, torch.ones(1, dtype=torch.int64, device=sizes.device)])
    if entries.shape[0] <= capacity:
        return entries, sizes
    counts = sizes.tolist()
    i = choose_merge(counts)
    # The weights as Python numbers: no copy to the entries' device (which would wait for the GPU), so
    # with sizes on the CPU a decode step never stalls the model's queue of kernels.
    s_old, s_new = counts[i], counts[i + 1]
    merged = (entries[i] * s_old + entries[i + 1] * s_new) / (s_old + s_new)
    entries = torch.cat([entries[:i], merged.unsqueeze(0), entries[i + 2:]])
    sizes = torch.cat([sizes[:i], sizes[i:i + 2].sum().reshape(1), sizes[i + 2:]])
    return entries, sizes


# ---------------------------------------------------------------- task 2: the index map

# yaie: task 2
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
    length, capacity = check_count("length", length), check_count("capacity", capacity)
    n = length + max(0, length - capacity)
    starts = list(range(length))
    ends = list(range(1, length + 1))
    index_map = torch.full((length, capacity), n, dtype=torch.int32)
    rows: list[int] = []      # the cache: buffer rows, oldest first
    sizes: list[int] = []
    for p in range(length):
        rows.append(p)        # the new token is buffer row p
        sizes.append(1)
        if len(rows) > capacity:
            i = choose_merge(sizes)
            starts.append(starts[rows[i]])
            ends.append(ends[rows[i + 1]])
            rows[i:i + 2] = [len(starts) - 1]
            sizes[i:i + 2] = [sizes[i] + sizes[i + 1]]
        index_map[p, :len(rows)] = torch.tensor(rows, dtype=torch.int32)
    return index_map, torch.tensor(starts, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64)


# yaie: task 2
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
    for name, t in (("x", x), ("starts", starts), ("ends", ends)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating-point tensor (keys or values), got {x.dtype}")
    if starts.dtype.is_floating_point or ends.dtype.is_floating_point or torch.bool in (starts.dtype, ends.dtype):
        raise ValueError(f"starts and ends must be integer tensors, got {starts.dtype} and {ends.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must be [b, l, *feature], got shape {tuple(x.shape)}")
    if starts.shape != ends.shape or starts.dim() != 1:
        raise ValueError(f"starts and ends must be vectors of one length, got {tuple(starts.shape)} "
                         f"and {tuple(ends.shape)}")
    length = x.shape[1]
    if starts.numel() and (int(starts.min()) < 0 or int(ends.max()) > length or bool((ends <= starts).any())):
        raise ValueError(f"every span must satisfy 0 <= start < end <= l = {length}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    # prefix[:, t] = sum of tokens 0..t-1 (prefix[:, 0] = 0).
    prefix = torch.cat([torch.zeros_like(xf[:, :1]), torch.cumsum(xf, dim=1)], dim=1)
    starts, ends = starts.to(x.device), ends.to(x.device)
    count = (ends - starts).to(work).reshape(1, -1, *([1] * (x.dim() - 2)))
    out = (prefix[:, ends] - prefix[:, starts]) / count
    return out.to(x.dtype)


# yaie: solution-only
def _normalise_map(index_map: torch.Tensor, n: int) -> torch.Tensor:
    """int32 contiguous map with every unused slot as exactly ``n`` (an int64 map may hold huge values).

    Made once per map tensor and version and kept on it (:func:`_kept`): a backward needs it twice (the
    gather and the buffer gradient), a model every layer and step, and the buffer gradient keeps its
    sorted order on it in turn (:func:`_rows_order_kept`).
    """
    return _kept(index_map, "_yaie_m", (n,), lambda: index_map.clamp(max=n).to(torch.int32).contiguous(),
                 exact=True)


# yaie: solution-only
def _options(dtype: torch.dtype, e: int, d: int) -> dict:
    return dict(
        BLOCK_E=max(16, triton.next_power_of_2(e)),      # tl.dot needs at least 16 rows
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        # The interpreter multiplies bf16 bit patterns as integers (triton issue 11584): upcast there.
        FP32_DOT=triton_interpreted() and dtype == torch.bfloat16,
    )


# yaie: solution-only
@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in float32."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


# yaie: solution-only
@triton.jit
def _gather_dot_kernel(a_ptr, buf_ptr, map_ptr, out_ptr, H, N, C, E, D,
                       sa_b, sa_l, sa_h, sa_e, sa_d, sb_b, sb_n, sb_h, sb_d,
                       so_b, so_l, so_h, so_e, so_c,
                       BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                       FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """out[b, l, h, :, cblock] = a[b, l, h] @ buf[b, M[l, cblock], h]^T: one position, one KV head per program.

    Axis 0 is the position: neighbouring programs read neighbouring rows of the map, which share most of
    their buffer rows, so the gathered rows are mostly found in L2.
    """
    l = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    rows = tl.load(map_ptr + l * C + offs_c, mask=offs_c < C, other=N)
    used = rows < N
    rows = tl.where(used, rows, 0).to(tl.int64)
    a = tl.load(a_ptr + b * sa_b + l * sa_l + h * sa_h + offs_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                mask=(offs_e[:, None] < E) & (offs_d[None, :] < D), other=0.0)
    bt = tl.load(buf_ptr + b * sb_b + rows[None, :] * sb_n + h * sb_h + offs_d[:, None] * sb_d,
                 mask=used[None, :] & (offs_d[:, None] < D), other=0.0)           # [BLOCK_D, BLOCK_C]
    acc = _dot(a, bt, tl.zeros((BLOCK_E, BLOCK_C), dtype=tl.float32), FP32_DOT, PRECISION)
    tl.store(out_ptr + b * so_b + l * so_l + h * so_h + offs_e[:, None] * so_e + offs_c[None, :] * so_c,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_e[:, None] < E) & (offs_c[None, :] < C))


# yaie: solution-only
@triton.jit
def _gather_dot_blocks_kernel(a_ptr, buf_ptr, map_ptr, out_ptr, H, N, L, C, E, D,
                              sa_b, sa_l, sa_h, sa_e, sa_d, sb_b, sb_n, sb_h, sb_d,
                              so_b, so_l, so_h, so_e, so_c,
                              BLOCK_L: tl.constexpr, GROUP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                              BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """out[b, l, h, :, c] = a[b, l, h] @ buf[b, M[l, c], h]^T for BLOCK_L positions and BLOCK_C slots.

    Gathering each position's own rows reads ``c`` buffer rows per position, the same rows again and
    again. Over a block of neighbouring positions of a stable-column map a slot holds at most two rows,
    the ones at the block's first and last position, so the block reads those two sets of rows once and
    multiplies all its (position, query head) pairs by each (``K = BLOCK_L * GROUP`` rows of ``a``);
    every output keeps the product with the row its slot holds. Outputs whose slot holds a third row
    inside the block (other maps) are computed position by position, as a per-position kernel would.
    """
    # Consecutive programs take the slot blocks of one block of positions: they share its rows in L2.
    pid = tl.program_id(0)
    pid_c, pid_l = pid % tl.cdiv(C, BLOCK_C), (pid // tl.cdiv(C, BLOCK_C)).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    l0 = pid_l * BLOCK_L
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    c_ok, d_ok = offs_c < C, offs_d < D
    offs_k = tl.arange(0, BLOCK_L * GROUP)                   # (position, query head) pairs of the block
    k_l, k_e = l0 + offs_k // GROUP, offs_k % GROUP
    k_ok = (k_l < L) & (k_e < E)
    rows = tl.load(map_ptr + k_l[:, None] * C + offs_c[None, :], mask=k_ok[:, None] & c_ok[None, :], other=N)
    first = tl.load(map_ptr + l0 * C + offs_c, mask=c_ok, other=N)
    last = tl.load(map_ptr + (tl.minimum(l0 + BLOCK_L, L) - 1) * C + offs_c, mask=c_ok, other=N)
    a = tl.load(a_ptr + b * sa_b + h * sa_h + k_l[:, None] * sa_l + k_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)                    # [K, BLOCK_D]
    buf_base = buf_ptr + b * sb_b + h * sb_h + offs_d[:, None] * sb_d
    zero = tl.zeros((BLOCK_L * GROUP, BLOCK_C), dtype=tl.float32)
    # Unused slots (row N) load zeros and so give 0.
    bt = tl.load(buf_base + last.to(tl.int64)[None, :] * sb_n, mask=d_ok[:, None] & (last < N)[None, :], other=0.0)
    at_last = _dot(a, bt, zero, FP32_DOT, PRECISION)                               # [K, BLOCK_C]
    bt = tl.load(buf_base + first.to(tl.int64)[None, :] * sb_n, mask=d_ok[:, None] & (first < N)[None, :], other=0.0)
    at_first = _dot(a, bt, zero, FP32_DOT, PRECISION)
    is_last, is_first = rows == last[None, :], rows == first[None, :]
    out = tl.where(is_last, at_last, at_first)
    out_base = out_ptr + b * so_b + h * so_h
    done = (is_last | is_first | (rows >= N)) & k_ok[:, None] & c_ok[None, :]
    tl.store(out_base + k_l[:, None] * so_l + k_e[:, None] * so_e + offs_c[None, :] * so_c,
             tl.where(rows < N, out, 0.0).to(out_ptr.dtype.element_ty), mask=done)
    # A third row: position by position (never, for a stable map over a block shorter than an entry lives).
    others = (rows < N) & ~is_last & ~is_first
    if tl.max(tl.max(others.to(tl.int32), axis=1), axis=0) > 0:
        offs_e = tl.arange(0, BLOCK_E)
        for i in range(BLOCK_L):
            l = l0 + i
            in_range = c_ok & ((offs_c * 0 + l) < L)                          # the position as a vector
            row = tl.load(map_ptr + l * C + offs_c, mask=in_range, other=N)
            other = (row < N) & (row != first) & (row != last)
            if tl.max(other.to(tl.int32), axis=0) > 0:
                ae = tl.load(a_ptr + b * sa_b + l * sa_l + h * sa_h + offs_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                             mask=(offs_e[:, None] < E) & d_ok[None, :], other=0.0)   # [BLOCK_E, BLOCK_D]
                bt = tl.load(buf_base + row.to(tl.int64)[None, :] * sb_n, mask=d_ok[:, None] & other[None, :],
                             other=0.0)                                               # [BLOCK_D, BLOCK_C]
                part = _dot(ae, bt, tl.zeros((BLOCK_E, BLOCK_C), dtype=tl.float32), FP32_DOT, PRECISION)
                tl.store(out_base + l * so_l + offs_e[:, None] * so_e + offs_c[None, :] * so_c,
                         part.to(out_ptr.dtype.element_ty), mask=(offs_e[:, None] < E) & other[None, :])


# yaie: solution-only
@triton.jit
def _gather_acc_kernel(p_ptr, buf_ptr, map_ptr, out_ptr, H, N, C, E, D,
                       sp_b, sp_l, sp_h, sp_e, sp_c, sb_b, sb_n, sb_h, sb_d,
                       so_b, so_l, so_h, so_e, so_d,
                       BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                       FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """out[b, l, h] = p[b, l, h] @ buf[b, M[l, :], h]: walk the cache slots block by block."""
    l = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_e = tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        rows = tl.load(map_ptr + l * C + offs_c, mask=offs_c < C, other=N)
        used = rows < N
        rows = tl.where(used, rows, 0).to(tl.int64)
        # Unused slots contribute nothing, whatever p holds there.
        p = tl.load(p_ptr + b * sp_b + l * sp_l + h * sp_h + offs_e[:, None] * sp_e + offs_c[None, :] * sp_c,
                    mask=(offs_e[:, None] < E) & used[None, :], other=0.0)
        v = tl.load(buf_ptr + b * sb_b + rows[:, None] * sb_n + h * sb_h + offs_d[None, :] * sb_d,
                    mask=used[:, None] & (offs_d[None, :] < D), other=0.0)        # [BLOCK_C, BLOCK_D]
        acc = _dot(p, v, acc, FP32_DOT, PRECISION)
    tl.store(out_ptr + b * so_b + l * so_l + h * so_h + offs_e[:, None] * so_e + offs_d[None, :] * so_d,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_e[:, None] < E) & (offs_d[None, :] < D))


# yaie: solution-only
@triton.jit
def _scatter_kernel(p_ptr, a_ptr, map_ptr, dbuf_ptr, H, N, L, C, E, D,
                    sp_b, sp_l, sp_h, sp_e, sp_c, sa_b, sa_l, sa_h, sa_e, sa_d,
                    sg_b, sg_n, sg_h, sg_d,
                    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dbuf[b, M[l, c], h] += p[b, l, h, :, c]^T @ a[b, l, h] for BLOCK_L positions and BLOCK_C slots.

    Many positions (and sometimes several slots of one row) add into one buffer row, so the adds are
    float32 atomics. But a slot usually holds the same row for many consecutive positions: the program
    walks its positions in order, sums each slot's contributions in registers while its row stays the
    same, and adds to memory only when the row changes (and at the end). With a map whose entries keep
    their column (:func:`stable_slots`) that is a few atomics per slot per BLOCK_L positions instead of
    one per position; any other map is still summed exactly, just with more atomics.
    """
    pid_l = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    dbuf_base = dbuf_ptr + b * sg_b + h * sg_h + offs_d[None, :] * sg_d
    acc = tl.zeros((BLOCK_C, BLOCK_D), dtype=tl.float32)
    held = tl.full((BLOCK_C,), N, dtype=tl.int32)          # the row each slot's sum belongs to (N: none)
    for i in range(BLOCK_L):
        l = pid_l * BLOCK_L + i
        l_ok = (offs_c * 0 + l) < L                            # the position as a vector (for the masks)
        rows = tl.load(map_ptr + l * C + offs_c, mask=(offs_c < C) & l_ok, other=N)
        rows = tl.minimum(rows, N)
        changed = rows != held
        flush = changed & (held < N)
        tl.atomic_add(dbuf_base + held.to(tl.int64)[:, None] * sg_n, acc, mask=flush[:, None] & d_ok)
        acc = tl.where(changed[:, None], 0.0, acc)
        held = rows
        used = rows < N
        pt = tl.load(p_ptr + b * sp_b + l * sp_l + h * sp_h + offs_c[:, None] * sp_c + offs_e[None, :] * sp_e,
                     mask=used[:, None] & (offs_e[None, :] < E), other=0.0)        # [BLOCK_C, BLOCK_E]
        a = tl.load(a_ptr + b * sa_b + l * sa_l + h * sa_h + offs_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                    mask=(offs_e[:, None] < E) & d_ok & (offs_e[:, None] * 0 + l < L), other=0.0)
        acc = _dot(pt, a, acc, FP32_DOT, PRECISION)
    tl.atomic_add(dbuf_base + held.to(tl.int64)[:, None] * sg_n, acc, mask=(held < N)[:, None] & d_ok)


# yaie: solution-only
@triton.jit
def _scatter_blocks_kernel(p_ptr, a_ptr, map_ptr, dbuf_ptr, H, N, L, C, E, D,
                           sp_b, sp_l, sp_h, sp_e, sp_c, sa_b, sa_l, sa_h, sa_e, sa_d,
                           sg_b, sg_n, sg_h, sg_d,
                           BLOCK_L: tl.constexpr, GROUP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dbuf[b, M[l, c], h] += p[b, l, h, :, c]^T @ a[b, l, h] for BLOCK_L positions and BLOCK_C slots.

    Many positions add into one buffer row, so the adds are float32 atomics; the work is to issue few.
    In a map whose entries keep their column (:func:`stable_slots`), a slot holds, over a few neighbouring
    positions, at most two rows: the one at the block's first position and the one at its last (an entry
    that dies and the one that takes its column). So the block is two matmuls that sum over all its
    (position, query head) pairs at once, ``K = BLOCK_L * GROUP`` deep, one per row, and one atomic add
    per slot and row. Contributions to any third row of a slot in the block (other maps: oldest-first
    order, random) are added position by position: slower, but exact for any map.
    """
    # Consecutive programs take the slot blocks of one block of positions: they share its rows in L2.
    pid = tl.program_id(0)
    pid_c, pid_l = pid % tl.cdiv(C, BLOCK_C), (pid // tl.cdiv(C, BLOCK_C)).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    l0 = pid_l * BLOCK_L
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    c_ok, d_ok = offs_c < C, offs_d < D
    # The K axis: every (position, query head) pair of the block; GROUP is e rounded up to a power of 2.
    offs_k = tl.arange(0, BLOCK_L * GROUP)
    k_l, k_e = l0 + offs_k // GROUP, offs_k % GROUP
    k_ok = (k_l < L) & (k_e < E)
    rows = tl.load(map_ptr + k_l[None, :] * C + offs_c[:, None], mask=c_ok[:, None] & k_ok[None, :], other=N)
    rows = tl.minimum(rows, N)                                                    # [BLOCK_C, K]; N: unused
    first = tl.minimum(tl.load(map_ptr + l0 * C + offs_c, mask=c_ok, other=N), N)
    last_l = tl.minimum(l0 + BLOCK_L, L) - 1
    last = tl.minimum(tl.load(map_ptr + last_l * C + offs_c, mask=c_ok, other=N), N)
    pt = tl.load(p_ptr + b * sp_b + h * sp_h + k_l[None, :] * sp_l + k_e[None, :] * sp_e + offs_c[:, None] * sp_c,
                 mask=c_ok[:, None] & k_ok[None, :], other=0.0)                   # [BLOCK_C, K]
    a = tl.load(a_ptr + b * sa_b + h * sa_h + k_l[:, None] * sa_l + k_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)                    # [K, BLOCK_D]
    dbuf_base = dbuf_ptr + b * sg_b + h * sg_h + offs_d[None, :] * sg_d
    zero = tl.zeros((BLOCK_C, BLOCK_D), dtype=tl.float32)
    # The row each slot holds at the block's last position ...
    to_last = rows == last[:, None]
    part = _dot(tl.where(to_last, pt, 0.0).to(pt.dtype), a, zero, FP32_DOT, PRECISION)
    tl.atomic_add(dbuf_base + last.to(tl.int64)[:, None] * sg_n, part, mask=(last < N)[:, None] & d_ok[None, :])
    # ... and the one it held at the first position, when that is another row (else nothing is added).
    to_first = rows == first[:, None]
    part = _dot(tl.where(to_first, pt, 0.0).to(pt.dtype), a, zero, FP32_DOT, PRECISION)
    tl.atomic_add(dbuf_base + first.to(tl.int64)[:, None] * sg_n, part,
                  mask=((first < N) & (first != last))[:, None] & d_ok[None, :])
    # Any other row: position by position (never, for a stable map over a block shorter than an entry lives).
    others = (rows < N) & ~to_last & ~to_first
    if tl.max(tl.max(others.to(tl.int32), axis=1), axis=0) > 0:
        offs_e = tl.arange(0, BLOCK_E)
        for i in range(BLOCK_L):
            l = l0 + i
            in_range = c_ok & ((offs_c * 0 + l) < L)                          # the position as a vector
            row = tl.minimum(tl.load(map_ptr + l * C + offs_c, mask=in_range, other=N), N)
            other = (row < N) & (row != first) & (row != last)
            if tl.max(other.to(tl.int32), axis=0) > 0:
                pe = tl.load(p_ptr + b * sp_b + l * sp_l + h * sp_h + offs_c[:, None] * sp_c + offs_e[None, :] * sp_e,
                             mask=other[:, None] & (offs_e[None, :] < E), other=0.0)  # [BLOCK_C, BLOCK_E]
                ae = tl.load(a_ptr + b * sa_b + l * sa_l + h * sa_h + offs_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                             mask=(offs_e[:, None] < E) & d_ok[None, :], other=0.0)   # [BLOCK_E, BLOCK_D]
                part = _dot(pe, ae, zero, FP32_DOT, PRECISION)
                tl.atomic_add(dbuf_base + row.to(tl.int64)[:, None] * sg_n, part, mask=other[:, None] & d_ok[None, :])


# yaie: solution-only
@triton.jit
def _scatter_rows_kernel(p_ptr, a_ptr, map_ptr, order_ptr, bounds_ptr, dbuf_ptr, H, N, C, E, D,
                         sp_b, sp_l, sp_h, sp_e, sp_c, sa_b, sa_l, sa_h, sa_e, sa_d,
                         sg_b, sg_n, sg_h, sg_d,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                         FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """dbuf[b, r, h] = sum over (l, c) with M[l, c] = r of p[b, l, h, :, c]^T @ a[b, l, h], for BLOCK_R rows r.

    The map inverted: where the atomic kernels go from positions to rows, this program owns BLOCK_R buffer
    rows and fetches what adds into them. The host sorted the map's entries (``l * C + c``) by row block,
    so this block's entries are ``order[bounds[i]:bounds[i + 1]]``. The program takes them BLOCK_K at a
    time; their (entry, query head) pairs are a ``K = BLOCK_K * GROUP`` deep axis: ``x`` gathers one row
    of ``a`` per pair ``[K, D]``, and ``s`` ``[BLOCK_R, K]`` holds ``p[l, e, c]`` in the block row its
    entry adds to, 0 in the others, so one ``tl.dot`` adds the chunk into all BLOCK_R rows at once (the
    products are exact: ``s`` holds p's own values). Every row is written once, by one program: no
    atomics, no zeroed float32 buffer, and the sums come out in the same order every run.
    """
    pid_r = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    lo = tl.load(bounds_ptr + pid_r)
    hi = tl.load(bounds_ptr + pid_r + 1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_k = tl.arange(0, BLOCK_K * GROUP)
    k_j, k_e = offs_k // GROUP, offs_k % GROUP               # (entry of the chunk, query head) pairs
    p_base = p_ptr + b * sp_b + h * sp_h
    a_base = a_ptr + b * sa_b + h * sa_h
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_K):
        ok = (j0 + k_j < hi) & (k_e < E)
        entry = tl.load(order_ptr + j0 + k_j, mask=ok, other=0)        # l * C + c
        row = tl.load(map_ptr + entry, mask=ok, other=N)
        l, c = (entry // C).to(tl.int64), entry % C
        pk = tl.load(p_base + l * sp_l + k_e * sp_e + c * sp_c, mask=ok, other=0.0)            # [K]
        s = tl.where(row[None, :] == offs_r[:, None], pk[None, :], 0.0).to(pk.dtype)          # [BLOCK_R, K]
        x = tl.load(a_base + l[:, None] * sa_l + k_e[:, None] * sa_e + offs_d[None, :] * sa_d,
                    mask=ok[:, None] & d_ok[None, :], other=0.0)                              # [K, BLOCK_D]
        if PRECISION == "ieee":
            # float32 dots are chains of FMAs: chained into acc, every product is rounded against the
            # whole running sum, and a row of the oldest-first map sums hundreds of entries (1e-4 off
            # where the sum cancels to about 1). Sum the chunk from 0, then add it.
            acc += _dot(s, x, tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32), FP32_DOT, PRECISION)
        else:
            acc = _dot(s, x, acc, FP32_DOT, PRECISION)
    tl.store(dbuf_ptr + b * sg_b + h * sg_h + offs_r.to(tl.int64)[:, None] * sg_n + offs_d[None, :] * sg_d,
             acc.to(dbuf_ptr.dtype.element_ty), mask=(offs_r < N)[:, None] & d_ok[None, :])


# yaie: solution-only
def _block_c(c: int) -> int:
    return min(64, max(16, triton.next_power_of_2(c)))


# yaie: solution-only
def _third_row_share(m: torch.Tensor, n: int, block_l: int) -> float:
    """The share of (block of ``block_l`` positions, slot) pairs in which the slot holds a row other than
    its rows at the block's first and last positions: work the blocked kernels do position by position."""
    blocks = m[:m.shape[0] // block_l * block_l].reshape(-1, block_l, m.shape[1])
    if blocks.shape[0] == 0:
        return 1.0
    first, last = blocks[:, :1], blocks[:, -1:]
    third = ((blocks < n) & (blocks != first) & (blocks != last)).any(dim=1)
    return float(third.float().mean())


# yaie: solution-only
def _kept(index_map: torch.Tensor, name: str, key: tuple, measure, exact: bool = False):
    """``measure()``, once per map tensor and ``key``: kept on the tensor as attribute ``name``.

    Measuring a map costs a device sync, so it is done once and kept, keyed by the tensor's version
    counter: a map edited in place is measured again. Two kinds of things are kept:

    * measures that only pick a kernel (``exact=False``): every choice gives the same sums, only the
      speed differs. A map edited inside ``torch.inference_mode`` keeps its measure (such tensors have no
      counter: they cannot be edited outside inference mode, and the engine builds its maps inside it);
    * tensors made from the map that the kernels read (``exact=True``: the normalised map, its sorted
      order). A stale one would give wrong sums, so inference tensors, which have no counter, get a new
      one at every call (they are never differentiated, so the backward's sorted order is not lost).

    Edits that bypass the counter (through ``.data``, or a kernel writing into the map) are not seen.
    """
    if exact and index_map.is_inference():
        return measure()
    key = (None if index_map.is_inference() else index_map._version, *key)
    cached = getattr(index_map, name, None)
    if cached is None or cached[0] != key:
        cached = (key, measure())
        setattr(index_map, name, cached)
    return cached[1]


# yaie: solution-only
def _blocks_plan(index_map: torch.Tensor, m: torch.Tensor, n: int, e: int,
                 most_third_rows: float = 0.1) -> tuple[int, int]:
    """``(block_l, GROUP)`` for the blocked kernels, or ``(0, GROUP)`` for the per-position ones.

    The blocked kernels' matmuls are ``K = block_l * GROUP`` deep (``GROUP``: e rounded up to a power of
    2): at least 16 (``tl.dot``), at most 128 (registers). Longer blocks share more work, but more slots
    then hold a third row inside a block, done position by position. So: the longest block in which at
    most ``most_third_rows`` of the (block, slot) pairs have a third row; none (per-position kernels) if
    even the shortest has more (a map whose entries move between columns: oldest-first order, random),
    if that shortest is under 4 positions (a block of 1 or 2 never holds a third row, but computes both
    rows of every slot: twice the per-position work) or if ``GROUP`` alone is over 128.
    Kept on the map as ``_yaie_blocks`` (:func:`_kept`).
    """
    group = triton.next_power_of_2(e)
    shortest = max(4, 16 // group)
    longest = max(shortest, min(8 if triton_interpreted() else 32, 128 // group))

    def measure() -> int:
        block_l = longest
        while block_l >= shortest and _third_row_share(m, n, block_l) > most_third_rows:
            block_l //= 2
        return block_l if block_l >= shortest and group <= 128 else 0

    return _kept(index_map, "_yaie_blocks", (n, group), measure), group


# yaie: solution-only
def _row_change_share(m: torch.Tensor) -> float:
    """The share of (position, slot) pairs whose row is not the one the slot held at the position before
    (the first position counts as a change): how often the atomic kernels must add to memory."""
    changes = m.shape[1] + int((m[1:] != m[:-1]).sum())
    return changes / m.numel()


# yaie: solution-only
def _rows_route(index_map: torch.Tensor, m: torch.Tensor, n: int, e: int,
                most_changes: float = 0.1) -> bool:
    """Whether the buffer gradient goes by rows (:func:`_scatter_rows`) rather than by atomics.

    The atomic kernels add a slot's sum to memory each time its row changes, and float32 atomics to
    scattered rows are slow. The kernel by rows costs a sort and one read of ``a``'s row per entry,
    whatever the map. So: by rows when more than ``most_changes`` of the (position, slot) pairs change
    rows. Measured on the H100 (l 16k, c 256, bf16; bench/results/lesson07_backward_h100.md): maps whose
    slots change rows every R positions took 6.5 ms by rows for any R, 30, 12, 8.8, 6.6 and 5.7 ms by
    per-position atomics for R = 1, 4, 8, 16, 32, and 8.8 and 8.1 ms blocked for R = 4 and 8 (4.4 and
    2.5 for R = 16 and 32): the crossover lies between 1/16 and 1/8 of the pairs. The telescoping map
    with stable columns changes 0.8% (blocked), the oldest-first one about a third (every merge shifts
    the columns after it), a random one all. Kept on the map as ``_yaie_rows`` (:func:`_kept`).
    """
    return _kept(index_map, "_yaie_rows", (n, most_changes), lambda: _row_change_share(m) > most_changes)


# yaie: solution-only
def _gather_dot(a: torch.Tensor, buf: torch.Tensor, index_map: torch.Tensor,
                blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """``blocks``: ``(block_l, GROUP)`` to force a variant (tests); default :func:`_blocks_plan`'s."""
    b, l, h, e, d = a.shape
    n, c = buf.shape[1], index_map.shape[1]
    m = _normalise_map(index_map, n)
    out = torch.empty(b, l, h, e, c, dtype=a.dtype, device=a.device)
    block_l, group = _blocks_plan(index_map, m, n, e) if blocks is None else blocks
    if not block_l:
        block_c = _block_c(c)
        grid = (l, triton.cdiv(c, block_c), b * h)
        _gather_dot_kernel[grid](a, buf, m, out, h, n, c, e, d, *a.stride(), *buf.stride(), *out.stride(),
                                 BLOCK_C=block_c, **_options(a.dtype, e, d))
        return out
    block_c = min(32, _block_c(c))              # two [K, BLOCK_C] float32 products live at once
    grid = (triton.cdiv(c, block_c) * triton.cdiv(l, block_l), b * h)
    _gather_dot_blocks_kernel[grid](a, buf, m, out, h, n, l, c, e, d, *a.stride(), *buf.stride(), *out.stride(),
                                    BLOCK_L=block_l, GROUP=group, BLOCK_C=block_c, **_options(a.dtype, e, d),
                                    num_warps=8)
    return out


# yaie: solution-only
def _gather_acc(p: torch.Tensor, buf: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    b, l, h, e, c = p.shape
    n, d = buf.shape[1], buf.shape[3]
    m = _normalise_map(index_map, n)
    out = torch.empty(b, l, h, e, d, dtype=p.dtype, device=p.device)
    grid = (l, b * h)
    _gather_acc_kernel[grid](p, buf, m, out, h, n, c, e, d, *p.stride(), *buf.stride(), *out.stride(),
                             BLOCK_C=_block_c(c), **_options(p.dtype, e, d))
    return out


# yaie: solution-only
def _rows_blocks(e: int, d: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_K)`` of :func:`_scatter_rows_kernel`: 16 buffer rows per program (the least M of
    ``tl.dot``: every row more multiplies one more row of mostly zeros) and enough entries per chunk for
    a K axis ``BLOCK_K * GROUP`` of 128 (64 for d over 128: registers; 32 under the interpreter)."""
    depth = 32 if triton_interpreted() else 128 if d <= 128 else 64
    return 16, max(1, depth // triton.next_power_of_2(e))


# yaie: solution-only
def _rows_order(m: torch.Tensor, n: int, block_r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The map inverted, for every (b, h) at once: ``(order, bounds)``, int32.

    ``order`` lists the map's used entries (``l * c_slots + c``) sorted by block of ``block_r`` buffer
    rows; block ``i``'s are ``order[bounds[i]:bounds[i + 1]]``. The sort is stable, so a block's entries
    stay in position order: entries of one position sit side by side and read the same row of ``a``.
    """
    blocks = triton.cdiv(n, block_r)
    key = torch.where(m < n, m // block_r, blocks).flatten()       # unused slots sort last, past every block
    key, order = torch.sort(key, stable=True)
    bounds = torch.searchsorted(key, torch.arange(blocks + 1, dtype=key.dtype, device=key.device))
    if m.numel() < 2**31:
        order = order.to(torch.int32)
    return order, bounds.to(torch.int32)


# yaie: solution-only
def _rows_order_kept(m: torch.Tensor, n: int, block_r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rows_order`, sorted once per map and kept on ``m`` (the normalised map, itself kept on the
    map tensor by :func:`_normalise_map`: an edited map gets a new ``m``, so a new order). The sort is
    about ten launches and 0.13 ms at l 4k (0.34 ms at 16k) on the H100; a model sorts each map once."""
    return _kept(m, "_yaie_order", (n, block_r), lambda: _rows_order(m, n, block_r), exact=True)


# yaie: solution-only
def _scatter_rows(p: torch.Tensor, a: torch.Tensor, m: torch.Tensor, n: int, dtype: torch.dtype,
                  block_r: int | None = None, block_k: int | None = None, **launch) -> torch.Tensor:
    """The buffer gradient by rows (no atomics). ``block_r``, ``block_k``, ``launch`` (``num_warps``,
    ``num_stages``): to try other tiles (bench); default :func:`_rows_blocks`'s, 4 warps, 2 stages (the
    fastest of a sweep on the H100: more warps, rows or entries per program only queue more loads on L2,
    which bounds it; bench/results/lesson07_backward_h100.md)."""
    b, l, h, e, c = p.shape
    d = a.shape[4]
    default_r, default_k = _rows_blocks(e, d)
    block_r, block_k = block_r or default_r, block_k or default_k
    order, bounds = _rows_order_kept(m, n, block_r)
    dbuf = torch.empty(b, n, h, d, dtype=dtype, device=p.device)    # every row is written, once
    options = _options(p.dtype, e, d)
    del options["BLOCK_E"]
    launch = {"num_warps": 4, "num_stages": 2, **launch}
    grid = (triton.cdiv(n, block_r), b * h)       # row blocks of one head together: its `a` stays in L2
    _scatter_rows_kernel[grid](p, a, m, order, bounds, dbuf, h, n, c, e, d, *p.stride(), *a.stride(),
                               *dbuf.stride(), BLOCK_R=block_r, BLOCK_K=block_k,
                               GROUP=triton.next_power_of_2(e), **options, **launch)
    return dbuf


# yaie: solution-only
def _scatter(p: torch.Tensor, a: torch.Tensor, index_map: torch.Tensor, n: int, dtype: torch.dtype,
             blocks: tuple[int, int] | None = None, rows: bool | None = None) -> torch.Tensor:
    """The buffer gradient. ``blocks``: ``(block_l, GROUP)`` forces the atomic kernels (``block_l`` 0:
    per position), ``rows=True`` the kernel by rows (tests, bench); by default :func:`_rows_route`
    picks, then (atomics) :func:`_blocks_plan`."""
    b, l, h, e, c = p.shape
    d = a.shape[4]
    m = _normalise_map(index_map, n)
    if rows or (rows is None and blocks is None and _rows_route(index_map, m, n, e)):
        return _scatter_rows(p, a, m, n, dtype)
    dbuf = torch.zeros(b, n, h, d, dtype=torch.float32, device=p.device)
    block_c = _block_c(c)
    block_l, group = _blocks_plan(index_map, m, n, e) if blocks is None else blocks
    if not block_l:
        positions = 4 if triton_interpreted() else 32
        grid = (triton.cdiv(l, positions), triton.cdiv(c, block_c), b * h)
        _scatter_kernel[grid](p, a, m, dbuf, h, n, l, c, e, d, *p.stride(), *a.stride(), *dbuf.stride(),
                              BLOCK_L=positions, BLOCK_C=block_c, **_options(p.dtype, e, d))
        return dbuf.to(dtype)
    grid = (triton.cdiv(c, block_c) * triton.cdiv(l, block_l), b * h)
    _scatter_blocks_kernel[grid](p, a, m, dbuf, h, n, l, c, e, d, *p.stride(), *a.stride(), *dbuf.stride(),
                                 BLOCK_L=block_l, GROUP=group, BLOCK_C=block_c, **_options(p.dtype, e, d),
                                 num_warps=8)
    return dbuf.to(dtype)


# ---------------------------------------------------------------- task 3: indexed matmul forward

# yaie: task 3
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
    check_indexed_inputs(q, k, index_map, "d")
    return _gather_dot(q, k, index_map)


# yaie: task 3
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
    check_indexed_inputs(p, v, index_map, "c")
    return _gather_acc(p, v, index_map)


# ---------------------------------------------------------------- task 4: backward and autograd

# yaie: task 4
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
    check_indexed_inputs(q, k, index_map, "d")
    want = (*q.shape[:4], index_map.shape[1])
    check_dout(dout, want, q)
    dq = _gather_acc(dout, k, index_map)
    dk = _scatter(dout, q, index_map, k.shape[1], k.dtype)
    return dq, dk


# yaie: task 4
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
    check_indexed_inputs(p, v, index_map, "c")
    want = (*p.shape[:4], v.shape[3])
    check_dout(dout, want, p)
    dp = _gather_dot(dout, v, index_map)
    dv = _scatter(p, dout, index_map, v.shape[1], v.dtype)
    return dp, dv


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
