# Lesson 04 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/paged_attention_given.py: read it, do not edit it.
# Run `pytest grader/lesson04` to grade them; the notebook is lessons/04_paged_attention/.
# (Generated from solutions/kernels/paged_attention.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 04: paged-attention decode in Triton.

In a decode step every running sequence brings ONE new query token per head, and it must attend to all
of its earlier tokens, whose keys and values sit in the paged KV cache of lesson 03::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
    block_tables:     int32 [batch, max_blocks_per_seq]   logical block j of sequence b -> physical block
    context_lens:     int32 [batch]                       tokens of each sequence (they differ)

Logical token ``t`` of sequence ``b`` is row ``t % block_size`` of physical block
``block_tables[b, t // block_size]``. The kernel never builds a contiguous copy of a sequence's cache: it
follows the block table while it loads.

Decode is **memory bound**: per token of context each KV head reads ``2 * head_dim`` numbers (K and V) and
does about as many multiply-adds per query head. With grouped-query attention (GQA) ``group =
num_heads // num_kv_heads`` query heads share one KV head, so the kernel gives one program a whole group:
it loads each K/V tile once and uses it for every query head of the group (a ``[group, head_dim] x
[head_dim, tile]`` product, padded to 16 rows for ``tl.dot``).

**Split-K (flash-decoding).** With a small batch there are few (sequence, KV head) programs: too few to
keep the GPU's memory system busy on a long context. Then the context is cut into ``num_splits``
ranges of whole tiles (``max_context_len / num_splits`` tokens each, rounded up) handled by separate
programs. Each writes its normalised partial output ``o_i`` and the log-sum-exp ``lse_i`` of its scores;
a second kernel merges them exactly::

    out = sum_i exp(lse_i - lse) * o_i,    lse = log(sum_i exp(lse_i))

(the same rescaling as the online softmax of lesson 06, applied once per split).

The merge can run as a kernel of its own (:func:`merge_split_results`, task 3: clear, and what the grader
asks for) or fused into the decode kernel: every split bumps a per-(sequence, KV head) counter when its
partial result is stored, and the split that finishes LAST merges them all. That saves a launch: 2.6 to
8 us per call on the H200 benchmark shapes, up to 10% of a short decode step (bench/results/lesson04_h200.md,
rows "merge as a 2nd kernel").

**Sliding windows** (Mistral, Gemma 2/3, gpt-oss: some or all layers attend only to the last ``w``
tokens). The newest token of a sequence of ``n`` tokens then sees positions ``max(0, n - w) .. n - 1``, and
the blocks before those are never read: decode over a window costs ``w`` tokens of K/V, however long the
context. The split ranges share out the window (``min(max_context_len, w)`` tokens), starting at each
sequence's first visible token; the loop itself does not change, because it already works out each key's
block from its position.

Tasks: 1 the naive gather + PyTorch reference, 2 the Triton decode kernel and its launcher (one split),
3 merging split results by log-sum-exp and the split-K path, 4 sliding windows (in the reference and the
kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/paged_attention_given.py
from yaie.kernels.paged_attention_given import (
    LN2, LOG2E, MAX_HEAD_DIM, MAX_SPLITS, PROGRAMS_PER_SM, SUPPORTED_DTYPES, num_sms, check_paged_inputs,
    check_paged_values, choose_num_splits,
)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The naive paged decode: gather each sequence's K and V from its blocks, then plain attention.

    Same arguments as :func:`paged_attention_forward` (without ``max_context_len``): q
    ``[batch, num_heads, head_dim]``, caches ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    ``block_tables`` int32 ``[batch, max_blocks]``, ``context_lens`` int32 ``[batch]``. Query head ``h``
    reads KV head ``h // (num_heads // num_kv_heads)``. Computes in the inputs' dtype (call it on float64
    copies to get a reference). A sequence with context length 0 gets a zero output.

    ``sliding_window`` (task 4): None attends to the whole context; an int ``w >= 1`` attends to the last
    ``w`` tokens only (positions ``max(0, n - w) .. n - 1`` of a sequence of ``n`` tokens). Until you do
    task 4, raise ``NotImplementedError("lesson 04, task 4: sliding window")`` when it is not None.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: as :func:`check_paged_inputs` (with ``max_context_len`` = the longest context).
    """
    raise NotImplementedError('lesson 04, task 1: implement paged_attention_reference in yaie/kernels/paged_attention.py')


def merge_split_results(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Merge the partial results of split-K decode into the exact attention output.

    Split ``i`` attended to its own range of keys and produced its *normalised* output ``o_i`` and the
    natural-log log-sum-exp of its scores ``lse_i``. Then, with ``lse = log(sum_i exp(lse_i))``::

        out = sum_i exp(lse_i - lse) * o_i

    A split without keys has ``lse_i = -inf`` and weight 0 (whatever its ``o_i`` holds, even NaN); a row
    whose splits are all empty gets 0.

    Args:
        part_out: float32 ``[batch, num_heads, num_splits, head_dim]``.
        part_lse: float32 ``[batch, num_heads, num_splits]``.
        out: optional ``[batch, num_heads, head_dim]`` tensor to write into (its dtype wins).
        out_dtype: dtype of a new output (default float32).

    Returns:
        ``[batch, num_heads, head_dim]``.

    Raises:
        ValueError: wrong ranks, shapes, dtypes or devices.
    """
    raise NotImplementedError('lesson 04, task 3: implement merge_split_results in yaie/kernels/paged_attention.py')


def paged_attention_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
                            scale: float | None = None, num_splits: int | None = None,
                            validate: bool = True, sliding_window: int | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache: one new query token per sequence, in Triton.

    Args:
        q: ``[batch, num_heads, head_dim]``, the new token's query of every sequence (any strides with a
            contiguous last axis).
        k_cache, v_cache: ONE layer's cache, ``[num_blocks, block_size, num_kv_heads, head_dim]``, last axis
            contiguous (lesson 03's layout). ``num_heads`` must be a multiple of ``num_kv_heads``
            (grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
        block_tables: int32 ``[batch, max_blocks_per_seq]``: logical block ``j`` of sequence ``b`` is
            physical block ``block_tables[b, j]``; entries past a sequence's length may hold anything (they
            may be loaded with the others, but the blocks they name are never read).
        context_lens: int32 ``[batch]``: tokens of each sequence, 0 .. ``max_context_len`` (the lengths
            differ; 0 gives a zero output).
        max_context_len: an upper bound of ``context_lens`` (a Python int, so no sync is needed to plan).
            It also sizes the split ranges: a loose bound leaves splits empty.
        scale: multiplier of the scores, default ``head_dim ** -0.5``.
        num_splits: split-K factor: each sequence's context is cut into this many ranges handled in
            parallel and merged by log-sum-exp (:func:`merge_split_results`); 1 disables it; ``None``
            picks one with :func:`choose_num_splits`.
        validate: also check the *values* of ``context_lens`` and ``block_tables`` (one device sync); an
            engine that builds them itself may pass False.
        sliding_window: task 4. None: attend to the whole context. An int ``w >= 1``: each sequence attends
            to its last ``w`` tokens only (positions ``max(0, n - w) .. n - 1`` of ``n``), and the blocks
            before them are never read; the split ranges share out ``min(max_context_len, w)`` tokens.
            Until you do task 4, raise ``NotImplementedError("lesson 04, task 4: sliding window")`` when it
            is not None.

    Dtypes: float16, bfloat16 or float32, the same for q and the caches. Head dims 1..256 (padded to a
    power of two inside: 96 works), block sizes 8..128 (any size works). On the CPU the kernel runs in
    the Triton interpreter.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: as :func:`check_paged_inputs`; with ``validate``, context lengths outside
            ``0..max_context_len`` or used block ids outside the cache.
    """
    raise NotImplementedError('lesson 04, task 2: implement paged_attention_forward in yaie/kernels/paged_attention.py')
