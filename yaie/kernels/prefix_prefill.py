# Lesson 05 exercises: replace each `raise NotImplementedError(...)` with your code.
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
import math
import os

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

LOG2E = 1.4426950408889634   # exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453     # log(x) == log2(x) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)
MAX_HEAD_DIM = 256
VECTOR_BYTES = 16            # one 128-bit load instruction (LDG.128) per thread
MASKED = -1.0e30             # score of a masked key (see the module docstring: not -inf)


def vector_width(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one 16-byte vector: 8 for fp16/bf16, 4 for fp32, 16 for fp8."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return VECTOR_BYTES // itemsize


def to_vector_k_layout(k_cache: torch.Tensor) -> torch.Tensor:
    """Rearrange a K cache into the "16-byte vector" layout ``[num_blocks, num_kv_heads, head_dim // x,
    block_size, x]`` with ``x = vector_width(dtype)`` (a contiguous copy).

    Why: the score tile ``q . k^T`` reads K *transposed*, column by column of keys. In lesson 03's layout
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` neighbouring tokens of one KV head lie
    ``num_kv_heads * head_dim`` elements apart. In this layout one block of one KV head is one contiguous
    ``head_dim * block_size`` run, and each token contributes ``x`` consecutive elements, exactly 16 bytes
    (one vector load per thread), with the next token's ``x`` elements right after them: a warp reads
    whole 128-byte lines. It is the layout vLLM's paged kernels use for their K cache; V keeps the
    token-major layout (it is read row by row in ``p @ v``).

    Measured (bench/results/lesson05_h100.md): in THIS kernel the layout is 2.2 to 2.7x slower than lesson
    03's. A Triton program loads a whole ``[BLOCK_N, head_dim]`` tile, and its threads split the tile along
    the head dimension first: in lesson 03's layout a token's 256 bytes (head_dim 128, bf16) are contiguous,
    so a warp's 16-byte loads fill whole lines; in the vector layout the 16 chunks of one token lie
    ``block_size * 16`` bytes apart, and each load instruction touches 16 different lines. The layout pays
    off for kernels whose threads walk tokens, not head dims, as vLLM's CUDA decode kernel does.

    Raises:
        ValueError: not a 4-D cache, or ``head_dim`` not a multiple of ``x``.
    """
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be a 4-D tensor [num_blocks, block_size, num_kv_heads, head_dim]")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    x = vector_width(k_cache.dtype)
    if head_dim % x:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {x} ({VECTOR_BYTES} bytes of {k_cache.dtype})")
    split = k_cache.reshape(num_blocks, block_size, num_kv_heads, head_dim // x, x)
    return split.permute(0, 2, 3, 1, 4).contiguous()


def from_vector_k_layout(k_cache: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_vector_k_layout`: back to ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 5:
        raise ValueError("expected a 5-D K cache [num_blocks, num_kv_heads, head_dim // x, block_size, x]")
    num_blocks, num_kv_heads, chunks, block_size, x = k_cache.shape
    return k_cache.permute(0, 3, 1, 2, 4).reshape(num_blocks, block_size, num_kv_heads, chunks * x)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prefix_prefill_inputs(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                max_query_len=None, scale=None, sliding_window=None, sinks=None,
                                k_scale=None, v_scale=None, for_kernel=True) -> None:
    """Raise ``ValueError`` unless the arguments are valid for :func:`prefix_prefill_attention`.

    Checks ranks, shapes, dtypes and devices only (no values: that would need a device sync; see
    :func:`check_prefix_prefill_values`). ``for_kernel=False`` (the reference) also accepts float64
    and CPU tensors without the Triton interpreter, and ``max_query_len=None``.
    """
    named = (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
             ("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [total_new_tokens, heads, head_dim], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head_dim axis (stride 1)")
    allowed = SUPPORTED_DTYPES if for_kernel else (*SUPPORTED_DTYPES, torch.float64)
    if q.dtype not in allowed:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    total, num_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != total or k.shape[2] != head_dim:
        raise ValueError(f"k and v must be [total_new_tokens={total}, num_kv_heads, head_dim={head_dim}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    num_kv_heads = k.shape[1]
    if total == 0 or num_heads == 0 or num_kv_heads == 0:
        raise ValueError(f"empty tensors are not allowed: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")

    # The caches: V token-major (lesson 03); K token-major or in the 16-byte vector layout.
    if v_cache.dim() != 4 or v_cache.stride(-1) != 1:
        raise ValueError(f"v_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim] with a contiguous "
                         f"last axis, got {tuple(v_cache.shape)}")
    num_blocks, block_size = v_cache.shape[0], v_cache.shape[1]
    if tuple(v_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"v_cache must be [num_blocks, block_size, num_kv_heads={num_kv_heads}, "
                         f"head_dim={head_dim}], got {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dim() == 4:
        expected = tuple(v_cache.shape)
    elif k_cache.dim() == 5:   # any vector width x works; to_vector_k_layout picks 16 bytes' worth
        x = k_cache.shape[4]
        if x == 0 or head_dim % x:
            raise ValueError(f"a 5-D k_cache [num_blocks, num_kv_heads, head_dim // x, block_size, x] needs x "
                             f"to divide head_dim ({head_dim}), got shape {tuple(k_cache.shape)}")
        expected = (num_blocks, num_kv_heads, head_dim // x, block_size, x)
    else:
        raise ValueError(f"k_cache must be 4-D (like v_cache) or 5-D (to_vector_k_layout), got {tuple(k_cache.shape)}")
    if tuple(k_cache.shape) != expected:
        raise ValueError(f"k_cache must have shape {expected}, got {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache must have a contiguous last axis (stride 1)")
    if num_blocks == 0 or block_size == 0:
        raise ValueError(f"empty caches are not allowed: {tuple(v_cache.shape)}")
    fp8 = k_cache.dtype in FP8_DTYPES
    if fp8:
        if for_kernel and q.device.type != "cuda" and q.dtype != torch.float16:
            raise ValueError("an fp8 KV cache needs a CUDA GPU (float16 or bfloat16 q, k, v), or float16 q, k, v "
                             "in the Triton interpreter (whose bfloat16 dot products are wrong)")
        if q.dtype == torch.float32 and for_kernel:
            raise ValueError("with an fp8 cache, q, k, v must be float16 or bfloat16")
    elif k_cache.dtype != q.dtype:
        raise ValueError(f"the caches must have q's dtype ({q.dtype}) or be float8_e4m3fn, got {k_cache.dtype}")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is None:
            continue
        if not fp8:
            raise ValueError(f"{name} is only for an fp8 cache (the cache is {k_cache.dtype})")
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite float, got {value!r}")

    batch = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if context_lens.dtype != torch.int32 or context_lens.dim() != 1 or batch < 1:
        raise ValueError(f"context_lens must be int32 [batch >= 1], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (batch + 1,):
        raise ValueError(f"cu_seqlens_q must be int32 [batch + 1 = {batch + 1}], got "
                         f"{cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks >= 1], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,) or not sinks.is_floating_point():
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a float tensor [num_heads={num_heads}], got {shape}")
    tensors = [t for _, t in named] + ([sinks] if sinks is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors must be on a CUDA GPU or the CPU, got {q.device}")
    if for_kernel and q.device.type == "cpu" and not triton_interpreted():
        raise ValueError("CPU tensors need the Triton interpreter: call yaie.device.prepare_triton() "
                         "before importing triton (or set TRITON_INTERPRET=1)")
    if max_query_len is not None and (not _is_int(max_query_len) or max_query_len < 1):
        raise ValueError(f"max_query_len must be an int >= 1, got {max_query_len!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_prefix_prefill_values(block_tables, cu_seqlens_q, context_lens, total_new, max_query_len,
                                num_blocks, block_size, sliding_window=None) -> None:
    """Raise ``ValueError`` on bad offsets, lengths or block ids (one small copy to the host).

    ``cu_seqlens_q`` must start at 0, never decrease and end at ``total_new``; no sequence may have more
    than ``max_query_len`` new tokens (None: no bound); ``context_lens`` must lie in 0 .. what a block
    table row holds; the block ids a prefix uses must name blocks of the cache (padding may hold
    anything, and so may the entries of blocks wholly before a sliding window: no query sees them).
    """
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != total_new:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at the number of new tokens ({total_new}), "
                         f"got {cu[0]} .. {cu[-1]}")
    lens_q = [b - a for a, b in zip(cu, cu[1:])]
    if min(lens_q) < 0:
        raise ValueError(f"cu_seqlens_q must not decrease, got {cu}")
    if max_query_len is not None and max(lens_q) > max_query_len:
        raise ValueError(f"max_query_len={max_query_len} is below the longest query ({max(lens_q)} new tokens)")
    lens = context_lens.long()
    capacity = block_tables.shape[1] * block_size
    low, high = (int(x) for x in torch.aminmax(lens))
    if low < 0 or high > capacity:
        raise ValueError(f"context_lens must lie in 0..{capacity} (block table columns x block_size), "
                         f"got min {low}, max {high}")
    used_blocks = (lens + block_size - 1) // block_size
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns[None, :] < used_blocks[:, None]
    if sliding_window is not None:   # the first new token (position context_len) sees keys > context_len - w
        first_seen = (lens - sliding_window + 1).clamp(min=0) // block_size
        used &= columns[None, :] >= first_seen[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_tables[{row}, {col}] = {int(block_tables[row, col])} is not a block id "
                         f"(the cache has {num_blocks} blocks)")


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
