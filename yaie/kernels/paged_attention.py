# Lesson 04 exercises: replace each `raise NotImplementedError(...)` with your code.
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
import math

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

LOG2E = 1.4426950408889634   # exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453     # log(x) == log2(x) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2          # decode programs per multiprocessor the split heuristic aims at (one wave)


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, max_context_len: int, scale: float | None = None,
                       num_splits: int | None = None, sliding_window: int | None = None,
                       for_kernel: bool = True) -> None:
    """Raise ``ValueError`` unless the arguments are valid for :func:`paged_attention_forward`.

    Checks ranks, shapes, dtypes and devices only: no values (that would need a device sync);
    :func:`check_paged_values` checks the values. ``for_kernel=False`` (the PyTorch reference) also
    accepts float64 and CPU tensors without the Triton interpreter.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [batch, num_heads, head_dim] (one token per sequence), got {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head_dim axis (stride 1)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    allowed = SUPPORTED_DTYPES if for_kernel else (*SUPPORTED_DTYPES, torch.float64)
    if q.dtype not in allowed:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q and the caches must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if for_kernel and q.device.type == "cpu" and not triton_interpreted():
        raise ValueError("CPU tensors need the Triton interpreter: call yaie.device.prepare_triton() "
                         "before importing triton (or set TRITON_INTERPRET=1)")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors must be on a CUDA GPU or the CPU, got {q.device}")
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the cache's {cache_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if batch == 0 or num_blocks == 0 or block_size == 0 or num_kv_heads == 0:
        raise ValueError(f"empty tensors are not allowed: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables must have at least one column")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"context_lens must be int32 [batch={batch}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if not isinstance(max_context_len, int) or isinstance(max_context_len, bool) or max_context_len < 1:
        raise ValueError(f"max_context_len must be an int >= 1, got {max_context_len!r}")
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_context_len {max_context_len} exceeds what a block table row holds "
                         f"({block_tables.shape[1]} blocks x {block_size} tokens)")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or isinstance(sliding_window, bool)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_paged_values(k_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       max_context_len: int) -> None:
    """Raise ``ValueError`` on context lengths outside ``0..max_context_len`` or block ids outside the cache
    (only the blocks a sequence uses are checked; padding may hold anything). One small device sync."""
    lens = context_lens.long()
    low, high = torch.aminmax(lens)
    if int(low) < 0 or int(high) > max_context_len:
        raise ValueError(f"context_lens must lie in 0..max_context_len={max_context_len}, "
                         f"got min {int(low)}, max {int(high)}")
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    used_blocks = (lens + block_size - 1) // block_size
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns[None, :] < used_blocks[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_tables[{row}, {col}] = {int(block_tables[row, col])} is not a block id "
                         f"(the cache has {num_blocks} blocks)")


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


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    """Multiprocessors of a CUDA device, asked once: the query costs host time on every decode step."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the device the kernel runs on; 8 for the CPU interpreter (any small number)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int | None = None,
                      min_tokens_per_split: int = 512) -> int:
    """The split-K heuristic: about ``PROGRAMS_PER_SM`` (2) programs per multiprocessor, a power of two, at
    least ``min_tokens_per_split`` tokens per split.

    Without splitting there are ``batch * num_kv_heads`` programs; ``2 * num_sms / programs`` splits
    bring that to about 2 per multiprocessor: one wave of programs that each keep 2 tiles of K/V in
    flight (3 pipeline stages, see ``_decode_config``), enough to keep the memory busy. Rounded DOWN to a
    power of two so the programs never spill into a second wave. A split must keep enough tokens that its
    fixed costs (loading q, writing a partial result, the merge) stay small. Returns 1 (no split) ..
    ``MAX_SPLITS``; with 1 there is no merge at all.

    Measured on the H200 (bench/results/lesson04_tune_h200.json, "sweep": every split count with 2, 3
    and 4 stages at 9 shapes): the fastest setting put about 2 programs on each multiprocessor with 3
    stages at all 7 shapes with at most 2 * num_sms (sequence, KV head) pairs; one program more per
    multiprocessor than fits in a wave costs up to 20%.
    """
    if num_sms is None:
        num_sms = _num_sms(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    programs = max(1, batch * num_kv_heads)
    wanted = max(1, PROGRAMS_PER_SM * num_sms // programs)
    longest = max(1, max_context_len // min_tokens_per_split)
    splits = min(wanted, longest, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)     # the largest power of two <= splits


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
