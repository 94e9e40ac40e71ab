"""Attention: of one sequence over a contiguous context, and of one engine step over the paged KV cache.

An engine step's attention is computed by the first backend, in the ordered lists below, that accepts the
step (and the layer's sliding window, if any):

* ``STEP_BACKENDS`` take every row of the step at once; one may still decline once it has run (``None``),
  and the step's rows then go to the lists below;
* else the step's decode rows go to the first of ``DECODE_BACKENDS`` that accepts and its prefill rows to
  the first of ``PREFILL_BACKENDS`` that accepts (a step's decodes and prefills may go to different kernels).

Each backend's ``run`` reaches its lesson through :mod:`yaie.ops.lessons` at call time. A test may spy on a
backend by replacing its ``run`` (``monkeypatch.setattr(CASCADE_DECODE, "run", spy)``). A decode step whose
RoPE and cache write go through :func:`rope_and_paged_attention` may skip ``PAGED_DECODE.run``: where the
reference serves lessons 02 to 04, one fused kernel does all three (:func:`fused_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from yaie.ops import kv, lessons, plan_run


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context (lesson 01, on every device).

    Args:
        q: ``[q_len, num_heads, head_dim]``, the newest ``q_len`` tokens (a prompt, or 1 token in decode).
        k, v: ``[kv_len, num_kv_heads, head_dim]``, the context from position 0, the new tokens last.
        sliding_window: if set, a query at position ``p`` sees only keys at ``p - window < j <= p``
            (Mistral's rule, as Hugging Face applies it).
        scale: the softmax scale; default ``1 / sqrt(head_dim)``.

    Returns ``[q_len, num_heads, head_dim]``. Serves :class:`yaie.engine.kv_cache.ContiguousKVCache` and the
    gathered backends of :func:`paged_attention`.
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    if sliding_window is not None and kv_len > sliding_window:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        mask = (key_pos <= query_pos) & (key_pos > query_pos - sliding_window)
    else:
        mask = "causal"
    out = lessons.call(1, "cpu_attention_forward", q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                       v.transpose(0, 1).unsqueeze(0), mask, scale)
    return out[0].transpose(0, 1)


@dataclass
class Backend:
    """One way to compute a step's attention (or that of its decode or prefill rows).

    ``accepts(step, sliding_window)`` says whether it serves them; ``run(q, k, v, step, layer,
    sliding_window, scale)`` computes the output rows for the rows of ``q, k, v`` it is given.
    """
    name: str
    accepts: Callable[..., bool]
    run: Callable[..., torch.Tensor | None]


# ----------------------------------------------------------------------------- whole-step backends (lesson 05)
def _cascade_decode(q, k, v, step, layer, sliding_window, scale):
    return plan_run.cascade_decode(q, k, v, step, layer, scale)


def _plan_run(q, k, v, step, layer, sliding_window, scale):
    """Plan/run over the step; None, after turning plan/run off for good (one notice), where lesson 05 is
    unfinished in strict mode and plan/run was the default rather than asked for (``YAIE_PLAN_RUN=1``)."""
    try:
        return plan_run.plan_run_attention(q, step, layer, scale)
    except lessons.KernelMissing as err:
        if step.plan_run_forced:
            raise
        plan_run.default_plan_run_off(str(err).splitlines()[0])
        step.plan_run = False
        return None


CASCADE_DECODE = Backend(
    "lesson 05 cascade decode (a CUDA-graph decode step whose sequences share their first blocks)",
    accepts=lambda step, window: step.cascade is not None and window is None,
    run=_cascade_decode)
PLAN_RUN = Backend(
    "lesson 05 plan/run, one launch for decodes and prefills together",
    accepts=lambda step, window: step.plan_run and window is None and plan_run.plan_run_available(),
    run=_plan_run)

STEP_BACKENDS = (CASCADE_DECODE, PLAN_RUN)


# ----------------------------------------------------------------------------- decode rows
def _decode_arguments(step, layer: int, sliding_window: int | None) -> tuple[tuple, dict]:
    """Lesson 04's arguments after ``q`` for the step's decode rows: (caches, block tables, context lengths,
    their bound), and the keywords (``validate=False``, the window)."""
    decodes = step.num_decodes
    # The window goes to the kernel whatever the contexts, so a decode step records the same kernel call at
    # every length (CUDA graphs); a window longer than a context cuts nothing.
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    return ((step.manager.k_cache[layer], step.manager.v_cache[layer], step.block_tables[:decodes],
             step.context_lens[:decodes], max(step.context_lens_list[:decodes])), dict(validate=False, **window))


def _paged_decode(q, k, v, step, layer, sliding_window, scale):
    """Lesson 04 over the decode rows: each sequence's blocks read through its block table."""
    args, keywords = _decode_arguments(step, layer, sliding_window)
    return lessons.call(4, "paged_attention_forward", q, *args, scale=scale, **keywords)


def _gathered_attention(q, step, layer, seqs: range, sliding_window, scale) -> torch.Tensor:
    """Per sequence of ``seqs`` (whose rows ``q`` holds), gather its keys and values from the blocks and
    attend with lesson 01 (:func:`attention`)."""
    k_rows = step.manager.k_cache[layer].flatten(0, 1)      # [num_blocks * block_size, kv_heads, head_dim]
    v_rows = step.manager.v_cache[layer].flatten(0, 1)
    out = torch.empty_like(q)
    first_row = step.query_starts[seqs.start]
    for i in seqs:
        start, end = step.query_starts[i] - first_row, step.query_starts[i + 1] - first_row
        slots = step.context_slots(i)
        out[start:end] = attention(q[start:end], k_rows[slots], v_rows[slots], sliding_window, scale)
    return out


def _gathered_decodes(q, k, v, step, layer, sliding_window, scale):
    return _gathered_attention(q, step, layer, range(step.num_decodes), sliding_window, scale)


PAGED_DECODE = Backend(
    "lesson 04 paged_attention_forward",
    accepts=lambda step, window: step.use_kernels and lessons.lesson_available(4),
    run=_paged_decode)
GATHERED_DECODE = Backend("gather the blocks, lesson 01 cpu_attention_forward",
                          accepts=lambda step, window: True, run=_gathered_decodes)

DECODE_BACKENDS = (PAGED_DECODE, GATHERED_DECODE)


# ----------------------------------------------------------------------------- prefill rows
def _prefix_prefill(q, k, v, step, layer, sliding_window, scale):
    """Lesson 05's ``prefix_prefill_attention`` over the prefill rows: each prefill's cached tokens read from
    the paged cache through its block table (no gather), its new tokens from ``k, v``."""
    first = step.num_decodes
    cached = [total - new for total, new in zip(step.context_lens_list[first:], step.query_lens[first:])]
    prefix_lens = torch.tensor(cached, dtype=torch.int32).to(step.device)
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    out, _ = lessons.call_in(5, 1, "prefix_prefill_attention", q, k, v, step.manager.k_cache[layer],
                             step.manager.v_cache[layer], step.block_tables[first:], step.cu_seqlens_q, prefix_lens,
                             step.max_prefill_query, scale=scale, validate=False, **window)
    return out


def _varlen_prefill(q, k, v, step, layer, sliding_window, scale):
    """Lesson 06 over the packed prefill rows: no gather when every prefill starts at position 0 (the
    engine's whole-prompt prefills), else over each prefill's context gathered from the blocks."""
    if step.prefills_start_empty:
        keys, values = k, v
    else:
        slots = torch.cat([step.context_slots(i) for i in range(step.num_decodes, len(step.seq_ids))])
        keys = step.manager.k_cache[layer].flatten(0, 1)[slots]
        values = step.manager.v_cache[layer].flatten(0, 1)[slots]
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    # On CUDA the offsets' values are not read back (validate=False): that copy would wait for the GPU twice
    # per layer, and the scheduler built them.
    out, _ = lessons.call(6, "flash_attention_varlen_forward", q, keys, values, step.cu_seqlens_q,
                          step.cu_seqlens_k, step.max_prefill_query, step.max_prefill_context, causal=True,
                          scale=scale, validate=not q.is_cuda, **window)
    return out


def _gathered_prefills(q, k, v, step, layer, sliding_window, scale):
    return _gathered_attention(q, step, layer, range(step.num_decodes, len(step.seq_ids)), sliding_window, scale)


PREFIX_PREFILL = Backend(
    "lesson 05 prefix_prefill_attention (prefills after a cached context)",
    accepts=lambda step, window: (step.use_kernels and not step.prefills_start_empty
                                  and lessons.lesson_available(5, 1)),
    run=_prefix_prefill)
VARLEN_PREFILL = Backend(
    "lesson 06 flash_attention_varlen_forward",
    accepts=lambda step, window: step.use_kernels and lessons.lesson_available(6),
    run=_varlen_prefill)
GATHERED_PREFILL = Backend("gather the blocks, lesson 01 cpu_attention_forward",
                           accepts=lambda step, window: True, run=_gathered_prefills)

PREFILL_BACKENDS = (PREFIX_PREFILL, VARLEN_PREFILL, GATHERED_PREFILL)


# ----------------------------------------------------------------------------- the step
def first_accepting(backends: tuple[Backend, ...], step, sliding_window: int | None) -> Backend:
    """The first of ``backends`` that accepts ``step`` (the lists end with one that accepts every step)."""
    for backend in backends:
        if backend.accepts(step, sliding_window):
            return backend
    raise ValueError(f"no attention backend accepts this step (tried {', '.join(b.name for b in backends)})")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, layer: int,
                    sliding_window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of one engine step over the paged KV cache (the new keys and values are already in it).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``: first one query per decoding sequence
            (``step.num_decodes`` rows), then the new tokens of each prefilling sequence, packed.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the same tokens' keys and values (the prefill
            kernels read them directly where a prefill has no cached context before it).
        step: a :class:`yaie.model.paged.PagedStep` (block tables, lengths, offsets; ``use_kernels``,
            ``plan_run``, ``cascade`` say which backends may take it).
        layer: which layer's cache to read.
        sliding_window: the layer's window, if any (Mistral's rule; see :func:`attention`).
        scale: the softmax scale; default ``1 / sqrt(head_dim)``.

    Returns ``[num_tokens, num_heads, head_dim]``. The backends, in order, are listed in the module docstring.
    """
    for backend in STEP_BACKENDS:
        if backend.accepts(step, sliding_window):
            out = backend.run(q, k, v, step, layer, sliding_window, scale)
            if out is not None:
                return out
    decodes = step.num_decodes
    parts = []
    if decodes:
        backend = first_accepting(DECODE_BACKENDS, step, sliding_window)
        parts.append((slice(0, decodes), backend.run(q[:decodes], k[:decodes], v[:decodes], step, layer,
                                                     sliding_window, scale)))
    if step.num_prefills:
        backend = first_accepting(PREFILL_BACKENDS, step, sliding_window)
        parts.append((slice(decodes, None), backend.run(q[decodes:], k[decodes:], v[decodes:], step, layer,
                                                        sliding_window, scale)))
    return _join(q, parts)


def _join(q: torch.Tensor, parts: list[tuple[slice, torch.Tensor]]) -> torch.Tensor:
    """The step's output from its decode and prefill parts; a part that is the whole step is returned as it
    is (no copy kernel: a decode-only step inside a CUDA graph stays one launch)."""
    if len(parts) == 1 and parts[0][1].shape == q.shape and parts[0][1].dtype == q.dtype:
        return parts[0][1]
    out = torch.empty_like(q)
    for rows, part in parts:
        out[rows] = part
    return out


# ----------------------------------------------------------------------------- RoPE, the cache write and attention
def fused_decode(q: torch.Tensor, step, sliding_window: int | None):
    """Lesson 04's reference-only ``paged_decode_with_rope`` where it may stand in for RoPE, the cache write and
    the step's attention, else None: a decode-only step that no step backend accepts and whose decode rows go
    to lesson 04's paged decode, where the reference also serves lesson 02's RoPE and lesson 03's manager
    (:func:`yaie.ops.kv.fused_rope_write_kv`). A student's lesson 02, 03 or 04 keeps the ops apart."""
    if step.num_prefills or kv.fused_rope_write_kv(step.manager, q) is None:
        return None
    if any(backend.accepts(step, sliding_window) for backend in STEP_BACKENDS) \
            or first_accepting(DECODE_BACKENDS, step, sliding_window) is not PAGED_DECODE:
        return None
    return lessons.reference_only(4, "paged_decode_with_rope", ("paged_attention_forward",))


def rope_and_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, positions: torch.Tensor, step, layer: int,
                             sliding_window: int | None = None) -> torch.Tensor:
    """Rotate ``q, k`` by ``positions`` (RoPE), store ``k, v`` at the step's slots of ``layer``'s cache, then
    :func:`paged_attention` (arguments as there; ``cos, sin`` lesson 01's tables). One kernel for all three in a
    decode step where :func:`fused_decode` allows it; RoPE and the cache write in one kernel where
    :func:`yaie.ops.kv.rope_and_write_kv` allows it; else the ops apart. ``q`` and ``k`` may be rotated in
    place: do not use them afterwards."""
    kernel = fused_decode(q, step, sliding_window)
    if kernel is not None:
        (k_cache, v_cache, *tables), keywords = _decode_arguments(step, layer, sliding_window)
        return kernel(q, k, v, cos, sin, positions, k_cache, v_cache, step.slot_mapping, *tables, **keywords)
    q, k = kv.rope_and_write_kv(step.manager, layer, step.slot_mapping, q, k, v, cos, sin, positions)
    return paged_attention(q, k, v, step, layer, sliding_window)
