# Lesson 05 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/prefix_prefill_given.py: read it, do not edit it.
# Run `pytest grader/lesson05` to grade them; the notebook is lessons/05_radix_flashinfer/.
# (Generated from solutions/kernels/prefix_prefill.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 05, part 1: the prefix-prefill kernel (new tokens attending to a cached, paged prefix).

With prefix caching (the radix tree of this lesson) a request often arrives with most of its prompt
already in the paged KV cache of lesson 03: a system prompt, the earlier turns of a chat. Only the NEW
tokens need a prefill. Each new query token must attend to

(a) the sequence's cached prefix (``context_len`` tokens), read through its block table: every new token
    comes after all of them, so no mask is needed there;
(b) the new tokens themselves (their keys and values are passed in, packed), under a causal mask.

One program handles ``BLOCK_M`` new query rows of one head of one sequence and folds both parts into ONE
online softmax (lesson 06): running max ``m``, running sum ``l``, running ``acc``. So the prefix is never
gathered into a contiguous copy, and the output is exact attention over ``context + new`` tokens::

    new tokens of sequence b:  q, k, v rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    query i of sequence b sits at absolute position  p = context_lens[b] + i
    it sees:   cached keys 0 .. context_lens[b] - 1   (through block_tables[b])
               new keys    0 .. i                      (p's own key included)

Features (those of a production prefix-prefill kernel):

* grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
* any head size up to 256 (80, 96, ...): padded to a power of two inside, the padding reads 0;
* a sliding window ``w``: position ``p`` sees keys ``p - w < j <= p`` only; tiles wholly before a query
  block's window are not even read. Masked scores get a LARGE NEGATIVE NUMBER, not ``-inf``: a row whose
  first tiles are all masked then keeps a finite running max, ``exp2(m - m_new)`` never becomes
  ``exp2(-inf + inf) = NaN``, and the junk such a row summed is multiplied by ``exp2(-1e30 - real) = 0``
  as soon as it meets its first visible key (every row sees at least its own key);
* attention sinks (gpt-oss): a learned logit per head that joins every row's softmax denominator
  without contributing a value. The kernel starts each row with ``m = sink, l = 1`` (the sink seeds
  the running max) instead of ``m = -big, l = 0``;
* an fp8 (e4m3) K/V cache with per-tensor scales (``real = stored * scale``): ``k_scale`` is folded into
  the score scale, ``v_scale`` into the probabilities, so no dequantized copy of a tile is made;
* ``skip_decode``: sequences with exactly one new token are left to the decode kernel (lesson 04);
* a K-cache layout whose innermost vector is 16 bytes (see :func:`to_vector_k_layout`).

The output is exact, so it also returns the log-sum-exp of every row: lesson 05 part 2 merges attention
states computed over different key sets (cascade attention) with it.

Tasks: 3 the naive reference (gather the prefix, attention with masks), 4 the Triton kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/prefix_prefill_given.py
from yaie.kernels.prefix_prefill_given import (
    FP8_DTYPES, LN2, LOG2E, MASKED, MAX_HEAD_DIM, SUPPORTED_DTYPES, VECTOR_BYTES, check_prefix_prefill_inputs,
    check_prefix_prefill_values, from_vector_k_layout, to_vector_k_layout, vector_width,
)


def prefix_prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             context_lens: torch.Tensor, *, scale: float | None = None,
                             sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                             k_scale: float | None = None,
                             v_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive prefix prefill: gather each sequence's cached prefix, append its new keys, masked attention.

    Same arguments and meaning as :func:`prefix_prefill_attention` (without ``max_query_len`` and the
    launch options), one sequence at a time:

    1. gather the prefix: cached token ``t`` is row ``t % block_size`` of block
       ``block_tables[b, t // block_size]``, for ``t < context_lens[b]`` (a 5-D ``k_cache`` is in the
       vector layout: :func:`from_vector_k_layout` undoes it); an fp8 cache is converted to q's dtype and
       multiplied by ``k_scale`` / ``v_scale`` (default 1);
    2. keys = prefix + the sequence's new ``k`` rows (values alike); query ``i`` sits at position
       ``context_len + i`` and sees key ``j`` when ``j <= context_len + i`` (and, with a window ``w``,
       ``j > context_len + i - w``);
    3. scores ``scale * q . k`` (query head ``h`` reads KV head ``h // group``), softmax over the visible
       keys plus, with ``sinks``, one extra logit ``sinks[h]`` per head (it takes probability mass but
       has no value), then ``p @ v``.

    Computes in q's dtype: call it on float64 copies to get a reference. ``skip_decode`` does not exist
    here: every sequence is computed.

    Returns:
        ``(out, lse)``: ``out`` ``[total_new, num_heads, head_dim]`` in q's dtype; ``lse``
        ``[num_heads, total_new]`` (float32, float64 for float64 inputs): ``log`` of each row's softmax
        denominator, the sink included.

    Raises:
        ValueError: as :func:`check_prefix_prefill_inputs` and :func:`check_prefix_prefill_values`.
    """
    raise NotImplementedError('lesson 05, task 3: implement prefix_prefill_reference in yaie/kernels/prefix_prefill.py')


def prefix_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             context_lens: torch.Tensor, max_query_len: int, *, scale: float | None = None,
                             sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                             k_scale: float | None = None, v_scale: float | None = None,
                             skip_decode: bool = False, out: torch.Tensor | None = None,
                             validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of new tokens over a cached, paged prefix, in one Triton kernel with an online softmax.

    For each sequence ``b`` of a ragged batch, its new query tokens attend to (a) its ``context_lens[b]``
    cached tokens, read through ``block_tables[b]`` from the paged cache, no mask, then (b) its own new
    tokens (``k``, ``v``), causal. Query ``i`` of sequence ``b`` sits at position ``context_lens[b] + i``.

    Args:
        q: ``[total_new, num_heads, head_dim]``, the new tokens of all sequences packed; sequence ``b``
            owns rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``. Last axis contiguous.
        k, v: ``[total_new, num_kv_heads, head_dim]``, the new tokens' keys and values, packed like q
            (whether they were also written into the cache does not matter: the kernel reads them here).
            ``num_heads`` must be a multiple of ``num_kv_heads`` (query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``).
        k_cache, v_cache: ONE layer's cache, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (lesson 03's
            layout), or for ``k_cache`` the 16-byte vector layout ``[num_blocks, num_kv_heads, head_dim // x,
            block_size, x]`` of :func:`to_vector_k_layout`. Same dtype as q, or ``torch.float8_e4m3fn``
            with ``k_scale`` / ``v_scale`` (on a GPU with float16 or bfloat16 q; in the Triton interpreter
            with float16 q).
        block_tables: int32 ``[batch, max_blocks]``: cached token ``t`` of sequence ``b`` is row
            ``t % block_size`` of block ``block_tables[b, t // block_size]``. Entries past the prefix may
            hold anything (they are never followed).
        cu_seqlens_q: int32 ``[batch + 1]`` offsets of the new tokens: 0, ..., ``total_new``. A sequence
            may have 0 new tokens (nothing is computed for it).
        context_lens: int32 ``[batch]``: cached tokens before the new ones (0 is allowed: a plain causal
            prefill).
        max_query_len: the largest number of new tokens of a sequence (a Python int: it sizes the grid
            without a device sync).
        scale: multiplier of the scores, default ``head_dim ** -0.5``.
        sliding_window: None, or ``w >= 1``: position ``p`` sees keys ``p - w < j <= p`` only (Mistral's rule,
            as lesson 06), cached keys included.
        sinks: optional float ``[num_heads]``: per-head attention-sink logits (natural-log units, not
            multiplied by ``scale``): each row's softmax denominator gets ``exp(sinks[h])`` more, with no
            value attached, so the outputs sum to less than 1 (gpt-oss).
        k_scale, v_scale: per-tensor scales of an fp8 cache (real value = stored * scale), default 1.
            Only with an fp8 cache. The new tokens' k and v are never scaled.
        skip_decode: True: sequences with exactly ONE new token are skipped (a decode step: lesson 04's
            kernel is faster for them); their rows of ``out`` are left as they were (zeros in a new
            ``out``; whatever the caller's ``out`` held, e.g. the decode kernel's results), and their
            ``lse`` is ``-inf``.
        out: optional ``[total_new, num_heads, head_dim]`` tensor of q's dtype and device, contiguous, to
            write into.
        validate: also check the *values* of ``cu_seqlens_q``, ``context_lens`` and ``block_tables`` (one
            device sync); an engine that builds them itself may pass False.

    Dtypes: q, k, v float16, bfloat16 or float32 (one dtype); the caches q's dtype or float8_e4m3fn. Head
    dims 1..256 (padded inside), any block size. On the CPU the kernel runs in the Triton interpreter.

    Returns:
        ``(out, lse)``: ``out`` ``[total_new, num_heads, head_dim]`` in q's dtype; ``lse`` float32
        ``[num_heads, total_new]`` (heads first, like lesson 06's varlen form): the natural log of each
        row's softmax denominator over the keys it sees, the sink included.

    Raises:
        ValueError: as :func:`check_prefix_prefill_inputs`; a bad ``out``; with ``validate``, offsets that
            do not start at 0, end at ``total_new`` or decrease, a query longer than ``max_query_len``,
            context lengths past what a block table row holds, used block ids outside the cache.
    """
    raise NotImplementedError('lesson 05, task 4: implement prefix_prefill_attention in yaie/kernels/prefix_prefill.py')
