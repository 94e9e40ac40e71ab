"""Lesson 05's plan/run attention over a whole engine step, and cascade decode over shared blocks.

Plan/run: the first layer of a step plans (the step's page table in CSR form: every sequence's blocks, its
new tokens the last ``query_len`` of its keys, causal) and every layer runs that plan on its own cache, one
launch for the step's decodes and prefills together. When every sequence starts with the same cached blocks,
``CascadeAttention`` reads those once for all the step's queries.

Cascade decode: a CUDA-graph decode step (which cannot plan per step) whose sequences share their first
blocks; the plan of the shared level is made once, in the graph's warm-up.

Lesson 05's classes are the unit of auto mode's fallback (:func:`yaie.ops.lessons.run_with_fallback`).
"""

from __future__ import annotations

import sys

import torch

from yaie.ops import lessons

CASCADE_MIN_SHARED_TOKENS = 256   # a shared prefix shorter than this is read per sequence (no cascade)

# Why steps that mix decodes and prefills stopped going to plan/run by default (None: they still do).
default_off_reason: str | None = None


def default_plan_run() -> bool:
    """Whether steps that mix decodes and prefills go to lesson 05's plan/run unless told otherwise: yes,
    until lesson 05's ``FlashInferPagedAttention`` turned out missing (strict mode, unfinished lesson 05)."""
    return default_off_reason is None


def default_plan_run_off(reason: str) -> None:
    """Send mixed steps to lessons 04 and 06 from now on; the first time, one notice line on stderr."""
    global default_off_reason
    if default_off_reason is None:
        default_off_reason = reason
        print(f"{reason}\nmixed prefill + decode steps run lessons 04 and 06 instead of lesson 05's plan/run",
              file=sys.stderr, flush=True)


def plan_run_available() -> bool:
    """True when lesson 05's plan/run module (``kernels.flashinfer``) imports."""
    return lessons.lesson_available(5, 2)


def cascade_decode_available(config) -> bool:
    """Whether decode steps may run as cascades: lesson 05 is there and no layer has a sliding window."""
    return plan_run_available() and not any(w is not None for w in getattr(config, "sliding_windows", []))


def _i32(values, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)


def plan_run_attention(q: torch.Tensor, step, layer: int, scale: float | None) -> torch.Tensor:
    """Attention of every row of ``step`` (``q [num_tokens, heads, head_dim]``) over ``layer``'s cache, through
    lesson 05's plan/run: planned on the step's first call for these sizes, run on every call."""
    key = (q.shape[1], q.shape[2], scale)
    wrapper = step.attention_plans.get(key)
    if wrapper is None:
        wrapper, out = _plan_step(q, step, layer, scale)
        step.attention_plans[key] = wrapper
        return out
    out, _ = wrapper.run(q, step.manager.k_cache[layer], step.manager.v_cache[layer])
    return out


def shared_pages(step, tables: list[list[int]], size: int) -> int:
    """Leading pages that are the SAME blocks in every sequence of the step (a cached system prompt, the
    parallel samples of one prompt), never a sequence's last page (it may be partly filled), and leaving
    each sequence's new tokens after them; 0 when that is shorter than ``CASCADE_MIN_SHARED_TOKENS``."""
    if len(tables) < 2:
        return 0
    shared = 0
    limit = min(len(t) for t in tables) - 1
    while shared < limit and all(t[shared] == tables[0][shared] for t in tables):
        shared += 1
    while shared and any(q > total - shared * size for q, total in zip(step.query_lens, step.context_lens_list)):
        shared -= 1
    return shared if shared * size >= CASCADE_MIN_SHARED_TOKENS else 0


def _plan_step(q, step, layer, scale):
    """Plan the step with ``FlashInferPagedAttention``, or ``CascadeAttention`` when its sequences share
    enough leading blocks (those are then level 0), and run it for ``layer``: ``(wrapper, out)``."""
    size = step.manager.block_size
    pages = [-(-n // size) for n in step.context_lens_list]
    tables = [step.manager.block_ids(seq)[:n] for seq, n in zip(step.seq_ids, pages)]
    shared = shared_pages(step, tables, size)
    indices = [b for table in tables for b in table[shared:]]
    last = [total - (n - 1) * size if n else 0 for total, n in zip(step.context_lens_list, pages)]
    kv_indptr = [0]
    for n in pages:
        kv_indptr.append(kv_indptr[-1] + n - shared)
    k_cache, v_cache = step.manager.k_cache[layer], step.manager.v_cache[layer]
    sizes = (q.shape[1], k_cache.shape[2], q.shape[2], size)

    def plan_and_run(cls):
        wrapper = cls()
        if shared:      # two levels: the shared pages for every query row, then each sequence's own pages
            wrapper.plan([_i32([0, step.query_starts[-1]]), _i32(step.query_starts)],
                         [_i32([0, shared]), _i32(kv_indptr)],
                         [_i32(tables[0][:shared], step.device), _i32(indices, step.device)],
                         [_i32([size]), _i32(last)], *sizes, causal=True, scale=scale)
        else:
            wrapper.plan(_i32(step.query_starts), _i32(kv_indptr), _i32(indices, step.device), _i32(last), *sizes,
                         causal=True, scale=scale)
        out, _ = wrapper.run(q, k_cache, v_cache)
        return wrapper, out

    name = "CascadeAttention" if shared else "FlashInferPagedAttention"
    return lessons.run_with_fallback(5, 2, name, plan_and_run)


def cascade_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, layer: int,
                   scale: float | None) -> torch.Tensor:
    """Decode attention of a step whose sequences all start with the same ``step.cascade.pages`` blocks.

    ``q, k, v``: one row per sequence. Level 0: every sequence's query attends to the shared blocks in ONE
    multi-query pass (``FlashInferPagedAttention``, no causal mask: every query comes after them), so those
    blocks are read once per step. Level 1: each query attends to its own blocks after the shared ones plus
    its new token (``prefix_prefill_attention``, the token its one query; ``step.own_tables``,
    ``step.own_context_lens``). ``merge_state`` joins the two states exactly. The plan is made on the first
    call for these sizes (the CUDA-graph warm-up); later calls only launch kernels (what a graph records).
    """
    cascade = step.cascade
    k_cache, v_cache = step.manager.k_cache[layer], step.manager.v_cache[layer]
    key = (q.shape[1], q.shape[2], scale)
    shared = cascade.plans.get(key)
    if shared is None:
        shared = cascade.plans[key] = _plan_shared_prefix(q, k_cache, cascade, scale)
    o_shared, lse_shared = shared.run(q, k_cache, v_cache)
    if cascade.cu_seqlens is None:               # one new token per sequence: 0, 1, ..., batch (made in the warm-up)
        cascade.cu_seqlens = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    o_own, lse_own = lessons.call_in(5, 1, "prefix_prefill_attention", q, k, v, k_cache, v_cache, step.own_tables,
                                     cascade.cu_seqlens, step.own_context_lens, 1, scale=scale, validate=False)
    # prefix_prefill's lse is heads-first, merge_state's token-major.
    out, _ = lessons.call_in(5, 2, "merge_state", o_shared, lse_shared, o_own, lse_own.t().contiguous())
    return out


def _plan_shared_prefix(q, k_cache, cascade, scale):
    """The plan of the cascade's level 0: one "request" made of every query row, over the shared pages
    (``cascade.page_ids``, a buffer the plan keeps and the graph runner refills), not causal."""
    batch, size = q.shape[0], k_cache.shape[1]

    def plan(cls):
        wrapper = cls()
        wrapper.plan(_i32([0, batch]), _i32([0, cascade.pages]), cascade.page_ids, _i32([size]), q.shape[1],
                     k_cache.shape[2], q.shape[2], size, causal=False, scale=scale)
        return wrapper

    return lessons.run_with_fallback(5, 2, "FlashInferPagedAttention", plan)
