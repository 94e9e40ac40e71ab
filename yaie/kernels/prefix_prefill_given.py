"""Lesson 05, part 1: the given code of the prefix-prefill exercises (``yaie/kernels/prefix_prefill.py``).

Read it, do not edit it: the exercise module imports these names, so ``prefix_prefill.MASKED`` or
``prefix_prefill.check_prefix_prefill_inputs`` work as before, and the graders rely on them as they are.

* constants: ``LOG2E``, ``LN2`` (for ``exp2`` / ``log2``), the dtypes and head sizes the kernel takes,
  ``MASKED`` (the score of a masked key: a large negative number, not ``-inf``);
* the 16-byte vector K-cache layout: :func:`vector_width`, :func:`to_vector_k_layout`,
  :func:`from_vector_k_layout`;
* the validators both tasks call: :func:`check_prefix_prefill_inputs` (ranks, shapes, dtypes, devices; no
  device sync) and :func:`check_prefix_prefill_values` (offsets, lengths, block ids; one copy to the host).
"""

from __future__ import annotations

import math

import torch

from yaie.device import triton_interpreted

LOG2E = 1.4426950408889634   # exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453     # log(x) == log2(x) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)
MAX_HEAD_DIM = 256
VECTOR_BYTES = 16            # one 128-bit load instruction (LDG.128) per thread
MASKED = -1.0e30             # score of a masked key (not -inf: see the docstring of yaie/kernels/prefix_prefill.py)


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
