"""The engine's only door to the lesson kernels.

Every normalisation, rotary embedding and attention the model runs is one call here, and each call
looks the lesson module up *at call time* through :mod:`yaie.switch`, so the student's code is what
runs, a change of the switch takes effect at once, and a test's spy on a module attribute is seen.

Which lesson serves which op:

============================  =====================================  ==================================
op                            CPU tensors                            CUDA tensors
============================  =====================================  ==================================
rope_cache                    lesson 01 ``build_rope_cache``         lesson 01 (tables are built once)
rms_norm / add_rms_norm       lesson 01 ``cpu_rms_norm``             lesson 02 ``rms_norm`` /
                                                                     ``fused_add_rms_norm``
rope                          lesson 01 ``cpu_rope_embeddings``      lesson 02 ``apply_rope_qk``
silu_and_mul                  plain PyTorch                          lesson 02 ``silu_and_mul``
kv_cache_manager / write_kv   lesson 03 ``KVCacheManager``           lesson 03
rope_and_write_kv             rope, then write_kv                    lesson 02's fused
                                                                     ``apply_rope_qk_store_kv`` (the
                                                                     reference's, with lesson 03's
                                                                     reference class); else apart
paged_attention (decode)      gather + lesson 01                     lesson 04 ``paged_attention_forward``
paged_attention (prefill)     gather + lesson 01                     lesson 06
                              ``cpu_attention_forward``              ``flash_attention_varlen_forward``
  after a cached context      gather + lesson 01                     lesson 05 ``prefix_prefill_attention``
attention (one sequence)      lesson 01 ``cpu_attention_forward``    lesson 01
============================  =====================================  ==================================

Sliding-window layers (Mistral, some Qwen2) whose window is shorter than a context take the gather +
lesson 01 path on CUDA too: neither kernel has a window.

On CUDA, when lesson 02's, 04's or 06's module cannot be imported at all (``LessonUnavailable``), the
lesson 01 ops (plain PyTorch, which run on CUDA too) stand in.

Unfinished lessons. With ``YAIE_SOLUTIONS`` *not set at all* the engine runs in "auto" mode: it calls the
student's function, and where that raises ``NotImplementedError`` (an untouched stub) it switches that
lesson to the reference solution for the rest of the process, printing one notice line per lesson to
stderr. With ``YAIE_SOLUTIONS`` set (even to ``none``) the switch is obeyed strictly: a stub stops
generation with :class:`KernelMissing`, whose message says which lesson and function are missing and
how to run the reference instead. Lesson 03 is a class that holds the cache's state, so it is switched
as a whole, before serving: :func:`kv_cache_manager` probes every method the engine uses first.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys

import torch
import torch.nn.functional as F

from yaie import switch

# Lessons that auto mode switched to the reference in this process (after a stub raised).
_auto_reference: set[int] = set()


class KernelMissing(RuntimeError):
    """A lesson function the engine needs is not implemented (and the reference may not be used)."""


def _student_path(lesson: int, which: int = 0) -> str:
    return "yaie/" + switch.LESSONS[lesson].modules[which].replace(".", "/") + ".py"


def _auto_mode() -> bool:
    return os.environ.get(switch.ENV_VAR) is None


def _reference_module(lesson: int, which: int = 0):
    name = "solutions." + switch.LESSONS[lesson].modules[which]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise switch.LessonUnavailable(f"{switch.LESSONS[lesson].label}: the reference solution ({name}) "
                                       "is not in this copy of the course") from err


def lesson_module(lesson: int, which: int = 0):
    """The module that serves ``lesson`` now: the switch's choice, or the reference after an auto fallback.

    ``which`` picks among a lesson's modules (``switch.LESSONS[lesson].modules``; lesson 05 has three).
    """
    if lesson in _auto_reference and _auto_mode():
        return _reference_module(lesson, which)
    return switch.module(lesson, which)


def _missing_message(lesson: int, name: str, err: NotImplementedError, which: int = 0) -> str:
    label = switch.LESSONS[lesson].label
    detail = f" ({err})" if str(err) else ""
    return (f"{label}: {name} is not implemented yet in {_student_path(lesson, which)}{detail}.\n"
            f"Implement it (`pytest grader/lesson{lesson:02d}` checks it), or run the reference solution for "
            f"this lesson: YAIE_SOLUTIONS={lesson} in the environment, or `yaie generate --solutions {lesson}`; "
            f"unset YAIE_SOLUTIONS to let the engine use the reference wherever a lesson is unfinished.")


def _fallback(lesson: int, name: str, module, err: NotImplementedError, which: int = 0):
    """The module to use after ``module.name`` raised ``NotImplementedError``: the reference in auto mode
    (with one notice line), else :class:`KernelMissing`."""
    if module.__name__.startswith("solutions.") or not _auto_mode():
        raise KernelMissing(_missing_message(lesson, name, err, which)) from None
    try:
        reference = _reference_module(lesson, which)
    except switch.LessonUnavailable:
        raise KernelMissing(
            f"{switch.LESSONS[lesson].label}: {name} is not implemented yet in {_student_path(lesson, which)}, "
            "and this copy of the course has no reference solution to use instead: implement it "
            f"(`pytest grader/lesson{lesson:02d}` checks it).") from None
    _auto_reference.add(lesson)
    print(f"{switch.LESSONS[lesson].label}: {name} is not implemented yet in {_student_path(lesson, which)}; "
          f"using the reference for {switch.LESSONS[lesson].label}", file=sys.stderr, flush=True)
    return reference


def call(lesson: int, name: str, *args, **kwargs):
    """Call ``name`` of ``lesson``'s (first) module, handling unfinished stubs as the module docstring says."""
    return call_in(lesson, 0, name, *args, **kwargs)


def call_in(lesson: int, which: int, name: str, *args, **kwargs):
    """Call ``name`` of module ``which`` of ``lesson`` (lesson 05: 0 radix tree, 1 prefix prefill,
    2 plan/run attention), handling unfinished stubs like :func:`call`."""
    module = lesson_module(lesson, which)
    try:
        return getattr(module, name)(*args, **kwargs)
    except NotImplementedError as err:
        reference = _fallback(lesson, name, module, err, which)
        return getattr(reference, name)(*args, **kwargs)


class LessonCalls:
    """Every function of a lesson's module, called through :func:`call_in`: ``LessonCalls(7).telescoping_step(...)``.

    Model code that uses many functions of one lesson (the telescoping and Based models) reaches them this
    way, so an unfinished stub falls back to the reference in auto mode (with one notice) or raises
    :class:`KernelMissing`, exactly as the engine's other lesson calls do. Non-function attributes
    (given classes such as lesson 08's ``BasedState``) come from the module that serves the lesson now.
    """

    def __init__(self, lesson: int, which: int = 0):
        self._lesson = lesson
        self._which = which

    def __getattr__(self, name: str):
        attr = getattr(lesson_module(self._lesson, self._which), name)
        if not inspect.isfunction(attr):
            return attr
        return functools.partial(call_in, self._lesson, self._which, name)


def selection() -> tuple:
    """What decides which module each lesson runs right now: the switch's setting and auto mode's
    fallbacks so far. Equal values mean the same kernels (the engine's CUDA graphs are keyed by it)."""
    return os.environ.get(switch.ENV_VAR), frozenset(_auto_reference)


def describe() -> str:
    """One line saying which lessons run the reference now (auto-mode fallbacks included)."""
    if not _auto_mode():
        return switch.describe()
    if not _auto_reference:
        return "auto mode: your code (yaie/), the reference only where a lesson is unfinished"
    lessons = ",".join(str(n) for n in sorted(_auto_reference))
    return f"auto mode: the reference for unfinished lesson(s) {lessons}, your code elsewhere"


def reset_auto_fallback() -> None:
    """Forget auto-mode fallbacks (tests; a notebook after finishing a lesson)."""
    _auto_reference.clear()


def _gpu_lesson_available() -> bool:
    """True when lesson 02's module imports (the student's or the reference, as the switch says)."""
    try:
        lesson_module(2)
    except switch.LessonUnavailable:
        return False
    return True


def _use_gpu_kernels(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and _gpu_lesson_available()


# ----------------------------------------------------------------------------- tables
def rope_cache(max_position: int, head_dim: int, base: float = 10000.0, rope_scaling: dict | None = None,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables ``[max_position, head_dim]`` (float32, rotate-half layout), lesson 01 task 1."""
    return call(1, "build_rope_cache", max_position, head_dim, base, rope_scaling, device)


# ----------------------------------------------------------------------------- normalisation
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; a new tensor."""
    if _use_gpu_kernels(x):
        return call(2, "rms_norm", x, weight, eps)
    return call(1, "cpu_rms_norm", x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``.

    The lesson 02 kernel does it in one pass and in place (``x`` and ``residual`` are overwritten), so
    callers must not use ``x`` or ``residual`` afterwards except through the returned tensors.
    """
    if _use_gpu_kernels(x):
        return call(2, "fused_add_rms_norm", x, residual, weight, eps)
    residual = x + residual
    return call(1, "cpu_rms_norm", residual, weight, eps), residual


# ----------------------------------------------------------------------------- rotary embeddings
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [tokens, heads, head_dim]`` and ``k [tokens, kv_heads, head_dim]`` by ``positions [tokens]``.

    May work in place (lesson 02 does): use the returned tensors.
    """
    if _use_gpu_kernels(q):
        return call(2, "apply_rope_qk", q, k, cos, sin, positions)
    return (call(1, "cpu_rope_embeddings", q, cos, sin, positions),
            call(1, "cpu_rope_embeddings", k, cos, sin, positions))


# ----------------------------------------------------------------------------- activation
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (the SwiGLU MLP's gate and up halves)."""
    if _use_gpu_kernels(x):
        return call(2, "silu_and_mul", x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- attention
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context.

    Args:
        q: ``[q_len, num_heads, head_dim]``, the newest ``q_len`` tokens (a prompt, or 1 token in decode).
        k, v: ``[kv_len, num_kv_heads, head_dim]``, the context from position 0, the new tokens last.
        sliding_window: if set, a query at position ``p`` sees only keys at ``p - window < j <= p``
            (Mistral's rule, as Hugging Face applies it).

    Returns ``[q_len, num_heads, head_dim]``.

    The attention of ONE sequence over a contiguous context (lesson 01 on every device): the
    :class:`yaie.engine.kv_cache.ContiguousKVCache` path, and the naive gather path of
    :func:`paged_attention`.
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    if sliding_window is not None and kv_len > sliding_window:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        mask = (key_pos <= query_pos) & (key_pos > query_pos - sliding_window)
    else:
        mask = "causal"
    out = call(1, "cpu_attention_forward", q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
               v.transpose(0, 1).unsqueeze(0), mask, scale)
    return out[0].transpose(0, 1)


def attention_prefill(q, k, v, sliding_window=None, scale=None):
    """Prefill: ``q_len`` prompt tokens over the context (see :func:`attention`)."""
    return attention(q, k, v, sliding_window, scale)


def attention_decode(q, k, v, sliding_window=None, scale=None):
    """Decode: one new token over the cached context (see :func:`attention`)."""
    return attention(q, k, v, sliding_window, scale)


# ----------------------------------------------------------------------------- the paged KV cache (lesson 03)
def _probe_kv_manager(cls, swap: bool) -> None:
    """Run every manager method the engine uses once, on a tiny CPU cache.

    A student's class may construct fine and still have stubbed methods; finding that *before*
    serving starts lets auto mode switch lesson 03 as a whole (one manager class owns all the state:
    switching halfway through a generation would lose the cache).
    """
    manager = cls(num_blocks=4, block_size=2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu", num_cpu_blocks=4 if swap else 0)
    slots = manager.allocate("probe", 3)
    manager.write_kv(0, slots, torch.randn(3, 1, 2), torch.randn(3, 1, 2))
    manager.append_slots("probe", 1)
    manager.block_table(["probe"])
    manager.context_lens(["probe"])
    if swap:
        manager.swap_out("probe")
        manager.swap_in("probe")
    manager.free("probe")


def kv_cache_manager(num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str, num_cpu_blocks: int = 0,
                     swap: bool = False):
    """A lesson 03 ``KVCacheManager`` (the student's, or the reference as the switch and auto mode say).

    The class is probed first (:func:`_probe_kv_manager`); ``swap`` says whether the engine will swap
    (then lesson 03 task 4 is needed too).
    """
    module = lesson_module(3)
    try:
        _probe_kv_manager(module.KVCacheManager, swap)
    except NotImplementedError as err:
        module = _fallback(3, "KVCacheManager", module, err)
    return module.KVCacheManager(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype=dtype,
                                 device=device, num_cpu_blocks=num_cpu_blocks)


def _kernel_lesson_available(lesson: int) -> bool:
    try:
        lesson_module(lesson)
    except switch.LessonUnavailable:
        return False
    return True


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, layer: int,
                    sliding_window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of one engine step over the paged KV cache (the new keys and values are already in it).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``: first one query per decoding sequence
            (``step.num_decodes`` rows), then the new tokens of each prefilling sequence, packed.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the same tokens' keys and values (the prefill
            kernel reads them directly when a prefill has no cached context before it).
        step: a :class:`yaie.model.paged.PagedStep` (block tables, lengths, offsets of this step).
        layer: which layer's cache to read.

    Which kernel runs (each looked up through the switch at call time):

    * ``step.use_kernels`` (CUDA tensors, by default): decode rows go to lesson 04's
      ``paged_attention_forward`` (it reads the blocks through the block table); prefill rows go to
      lesson 06's ``flash_attention_varlen_forward`` over the packed new tokens; prefills that continue a
      cached context go to lesson 05's ``prefix_prefill_attention``, which reads the context through the
      block tables (without lesson 05: lesson 06 over the context gathered from the blocks). A
      sliding-window layer passes its window to each (lesson 04 task 4, lesson 06 task 5);
    * otherwise each sequence's K/V is gathered from its blocks and lesson 01's ``cpu_attention_forward``
      runs on it (:func:`attention`);
    * ``step.cascade`` (a CUDA-graph decode step whose sequences share their first blocks,
      :mod:`yaie.engine.cuda_graphs`): cascade decode through lesson 05 (:func:`_cascade_decode`);
    * ``step.plan_run`` (a step mixing decodes and prefills; every eager step with ``YAIE_PLAN_RUN=1``; not
      for sliding-window layers): lesson 05's
      ``FlashInferPagedAttention`` runs decodes and prefills together in one launch per layer, planned once
      per step (:func:`_plan_run_attention`); when all the step's sequences start with the same cached blocks
      (``CASCADE_MIN_SHARED_TOKENS`` or more), its ``CascadeAttention`` reads those once for all of them.
    """
    if getattr(step, "cascade", None) is not None and sliding_window is None:
        return _cascade_decode(q, k, v, step, layer, scale)
    if step.plan_run and sliding_window is None and _plan_run_available():
        try:
            return _plan_run_attention(q, step, layer, scale)
        except KernelMissing as err:
            if getattr(step, "plan_run_forced", False):
                raise
            default_plan_run_off(str(err).splitlines()[0])    # strict mode, lesson 05 unfinished: lessons 04/06
            step.plan_run = False
    out = None
    decodes = step.num_decodes
    if decodes:
        if step.use_kernels and _kernel_lesson_available(4):
            # The window goes to the kernel whatever the contexts, so a decode step records the same
            # kernel call at every length (CUDA graphs); a window longer than a context cuts nothing.
            window = {} if sliding_window is None else {"sliding_window": sliding_window}
            decoded = call(4, "paged_attention_forward", q[:decodes], step.manager.k_cache[layer],
                           step.manager.v_cache[layer], step.block_tables[:decodes],
                           step.context_lens[:decodes], max(step.context_lens_list[:decodes]),
                           scale=scale, validate=False, **window)
            if not step.num_prefills and decoded.shape == q.shape and decoded.dtype == q.dtype:
                return decoded       # a decode-only step: the kernel's output is the answer (no copy kernel)
            out = torch.empty_like(q)
            out[:decodes] = decoded
        else:
            out = torch.empty_like(q)
            _gathered_attention(out, q, step, layer, range(decodes), sliding_window, scale)
    if step.num_prefills:
        if step.use_kernels and _kernel_lesson_available(6):
            prefilled = _varlen_prefill(q[decodes:], k[decodes:], v[decodes:], step, layer, scale, sliding_window)
            if out is None and prefilled.shape == q.shape and prefilled.dtype == q.dtype:
                return prefilled     # a prefill-only step: no copy either
            out = torch.empty_like(q) if out is None else out
            out[decodes:] = prefilled
        else:
            out = torch.empty_like(q) if out is None else out
            _gathered_attention(out, q, step, layer, range(decodes, len(step.seq_ids)), sliding_window, scale)
    return out


def _gathered_attention(out, q, step, layer, seqs, sliding_window, scale) -> None:
    """The naive path: per sequence, gather its keys and values from the blocks, attend with lesson 01."""
    k_rows = step.manager.k_cache[layer].flatten(0, 1)      # [num_blocks * block_size, kv_heads, head_dim]
    v_rows = step.manager.v_cache[layer].flatten(0, 1)
    for i in seqs:
        start, end = step.query_starts[i], step.query_starts[i + 1]
        slots = step.context_slots(i)
        out[start:end] = attention(q[start:end], k_rows[slots], v_rows[slots], sliding_window, scale)


def _varlen_prefill(q, k, v, step, layer, scale, sliding_window=None) -> torch.Tensor:
    """Lesson 06 over the prefills of a step: the new tokens are packed, so no gather when they start at
    position 0 (the engine's whole-prompt prefills). Prefills after a cached context (prefix caching) go to
    lesson 05's prefix-prefill kernel, which reads the context through the block tables; without lesson 05
    in this copy of the course, lesson 06 reads that context gathered from the blocks."""
    if not step.prefills_start_empty and _prefix_prefill_available():
        return _prefix_prefill(q, k, v, step, layer, scale, sliding_window)
    if step.prefills_start_empty:
        keys, values = k, v
    else:
        slots = torch.cat([step.context_slots(i) for i in range(step.num_decodes, len(step.seq_ids))])
        keys = step.manager.k_cache[layer].flatten(0, 1)[slots]
        values = step.manager.v_cache[layer].flatten(0, 1)[slots]
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    # On CUDA the offsets' values are not read back (validate=False): that copy would wait for the GPU twice
    # per layer, and the scheduler built them.
    out, _ = call(6, "flash_attention_varlen_forward", q, keys, values, step.cu_seqlens_q, step.cu_seqlens_k,
                  step.max_prefill_query, step.max_prefill_context, causal=True, scale=scale,
                  validate=not q.is_cuda, **window)
    return out


def _prefix_prefill_available() -> bool:
    try:
        lesson_module(5, 1)
    except switch.LessonUnavailable:
        return False
    return True


def _prefix_prefill(q, k, v, step, layer, scale, sliding_window=None) -> torch.Tensor:
    """Lesson 05's ``prefix_prefill_attention`` over the prefills of a step: each prefill's cached tokens are
    read from the paged cache through its block table (no gather), its new tokens from ``k, v``."""
    first = step.num_decodes
    cached = [total - new for total, new in zip(step.context_lens_list[first:], step.query_lens[first:])]
    prefix_lens = torch.tensor(cached, dtype=torch.int32).to(step.device)
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    out, _ = call_in(5, 1, "prefix_prefill_attention", q, k, v, step.manager.k_cache[layer],
                     step.manager.v_cache[layer], step.block_tables[first:], step.cu_seqlens_q, prefix_lens,
                     step.max_prefill_query, scale=scale, validate=False, **window)
    return out


def _plan_run_available() -> bool:
    try:
        lesson_module(5, 2)
    except switch.LessonUnavailable:
        return False
    return True


def _plan_run_attention(q, step, layer, scale) -> torch.Tensor:
    """Lesson 05's plan/run attention over a whole step. The first layer plans (the step's page table in
    CSR form: every sequence's blocks, its new tokens the last ``query_len`` of its keys, causal); every
    layer runs that plan on its own cache: one launch for the decodes and the prefills together."""
    key = (q.shape[1], q.shape[2], scale)
    wrapper = step.attention_plans.get(key)
    if wrapper is not None:
        out, _ = wrapper.run(q, step.manager.k_cache[layer], step.manager.v_cache[layer])
        return out
    module = lesson_module(5, 2)
    try:
        wrapper, out = _plan_step(module, q, step, layer, scale)
    except NotImplementedError as err:
        module = _fallback(5, "FlashInferPagedAttention", module, err, 2)
        wrapper, out = _plan_step(module, q, step, layer, scale)
    step.attention_plans[key] = wrapper
    return out


CASCADE_MIN_SHARED_TOKENS = 256   # a shared prefix shorter than this is read per sequence (no cascade)

_default_plan_run_off: str | None = None    # why mixed steps stopped going to lesson 05's plan/run by default


def default_plan_run() -> bool:
    """Whether steps that mix decodes and prefills go to lesson 05's plan/run unless told otherwise: yes,
    until lesson 05's ``FlashInferPagedAttention`` turned out missing (strict mode, unfinished lesson 05)."""
    return _default_plan_run_off is None


def default_plan_run_off(reason: str) -> None:
    """Send mixed steps to lessons 04 and 06 from now on (one notice)."""
    global _default_plan_run_off
    if _default_plan_run_off is None:
        _default_plan_run_off = reason
        print(f"{reason}\nmixed prefill + decode steps run lessons 04 and 06 instead of lesson 05's plan/run",
              file=sys.stderr, flush=True)


def cascade_decode_available(config) -> bool:
    """Whether decode steps may run as cascades: lesson 05 is there and no layer has a sliding window."""
    return _plan_run_available() and not any(w is not None for w in getattr(config, "sliding_windows", []))


def _cascade_decode(q, k, v, step, layer, scale) -> torch.Tensor:
    """Decode attention of a step whose sequences all start with the same ``step.cascade.pages`` blocks.

    Level 0: the queries of every sequence attend to the shared blocks in ONE multi-query pass (lesson 05's
    ``FlashInferPagedAttention``, no causal mask: every query comes after them), so those blocks are read
    once per step, not once per sequence. Level 1: each sequence's query attends to its own blocks after the
    shared ones plus its new token (lesson 05's ``prefix_prefill_attention``: the new token is its one query).
    ``merge_state`` joins the two states exactly. The plan is made on the first call for these sizes (the
    CUDA-graph warm-up), after which every call only launches kernels (what a graph can record)."""
    cascade = step.cascade
    k_cache, v_cache = step.manager.k_cache[layer], step.manager.v_cache[layer]
    key = (q.shape[1], q.shape[2], scale)
    shared = cascade.plans.get(key)
    if shared is None:
        shared = cascade.plans[key] = _plan_shared_prefix(q, k_cache, cascade, scale)
    o_shared, lse_shared = shared.run(q, k_cache, v_cache)
    if cascade.cu_seqlens is None:               # one new token per sequence: 0, 1, ..., batch (made in the warm-up)
        cascade.cu_seqlens = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    cu_seqlens = cascade.cu_seqlens
    o_own, lse_own = call_in(5, 1, "prefix_prefill_attention", q, k, v, k_cache, v_cache, step.own_tables,
                             cu_seqlens, step.own_context_lens, 1, scale=scale, validate=False)
    # prefix_prefill's lse is heads-first, merge_state's token-major.
    out, _ = call_in(5, 2, "merge_state", o_shared, lse_shared, o_own, lse_own.t().contiguous())
    return out


def _plan_shared_prefix(q, k_cache, cascade, scale):
    """Lesson 05's plan of the cascade's level 0: one "request" made of every query row, over the shared
    pages (``cascade.page_ids``, a buffer the plan keeps and the graph runner refills), not causal."""
    batch, size = q.shape[0], k_cache.shape[1]

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    def plan(module):
        wrapper = module.FlashInferPagedAttention()
        wrapper.plan(i32([0, batch]), i32([0, cascade.pages]), cascade.page_ids, i32([size]), q.shape[1],
                     k_cache.shape[2], q.shape[2], size, causal=False, scale=scale)
        return wrapper

    module = lesson_module(5, 2)
    try:
        return plan(module)
    except NotImplementedError as err:
        return plan(_fallback(5, "FlashInferPagedAttention", module, err, 2))


def _shared_pages(step, tables: list[list[int]], size: int) -> int:
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


def _plan_step(module, q, step, layer, scale):
    """Plan the step with ``module``'s ``FlashInferPagedAttention`` and run it for ``layer``: (wrapper, out).
    When every sequence starts with the same cached blocks (long enough), lesson 05's ``CascadeAttention``
    instead: those blocks are read once for all the step's queries (level 0), the rest per sequence."""
    size = step.manager.block_size
    pages = [-(-n // size) for n in step.context_lens_list]
    tables = [step.manager.block_ids(seq)[:n] for seq, n in zip(step.seq_ids, pages)]
    shared = _shared_pages(step, tables, size)
    indices = [b for table in tables for b in table[shared:]]
    last = [total - (n - 1) * size if n else 0 for total, n in zip(step.context_lens_list, pages)]
    kv_indptr = [0]
    for n in pages:
        kv_indptr.append(kv_indptr[-1] + n - shared)

    def i32(values, device="cpu"):
        return torch.tensor(values, dtype=torch.int32).to(device)

    k_cache, v_cache = step.manager.k_cache[layer], step.manager.v_cache[layer]
    sizes = (q.shape[1], k_cache.shape[2], q.shape[2], size)
    if shared:
        wrapper = module.CascadeAttention()
        wrapper.plan([i32([0, step.query_starts[-1]]), i32(step.query_starts)], [i32([0, shared]), i32(kv_indptr)],
                     [i32(tables[0][:shared], step.device), i32(indices, step.device)], [i32([size]), i32(last)],
                     *sizes, causal=True, scale=scale)
    else:
        wrapper = module.FlashInferPagedAttention()
        wrapper.plan(i32(step.query_starts), i32(kv_indptr), i32(indices, step.device), i32(last), *sizes,
                     causal=True, scale=scale)
    out, _ = wrapper.run(q, k_cache, v_cache)
    return wrapper, out


def write_kv(manager, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new keys and values in the paged cache (lesson 03's ``write_kv``; its manager was probed).

    On CUDA the slot range check is skipped (``validate=False``): it would read the slots back to the host,
    one GPU sync per layer per step, and the engine's slots come from the manager itself.
    """
    if slot_mapping.is_cuda:
        manager.write_kv(layer, slot_mapping, k, v, validate=False)
    else:
        manager.write_kv(layer, slot_mapping, k, v)


def _fused_rope_write_kv(manager, q: torch.Tensor):
    """Lesson 02's ``apply_rope_qk_store_kv`` when it may stand in for ``rope`` + ``write_kv``, else None.

    Only the reference has the fused kernel, and it writes the cache itself: so it runs only where the
    module serving lesson 02 has it AND the manager is the reference's lesson 03 class. A student's lesson 02
    or 03 keeps the two ops apart, so their code is what runs.
    """
    if not _use_gpu_kernels(q) or not type(manager).__module__.startswith("solutions."):
        return None
    return getattr(lesson_module(2), "apply_rope_qk_store_kv", None)


def rope_and_write_kv(manager, layer: int, slot_mapping: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope` of ``q, k``, then :func:`write_kv` of the rotated ``k`` and ``v``: returns ``(q, k)``.

    One launch on CUDA where the reference serves lessons 02 and 03 (:func:`_fused_rope_write_kv`);
    the two ops apart otherwise.
    """
    fused = _fused_rope_write_kv(manager, q)
    if fused is not None:
        return fused(q, k, v, cos, sin, positions, manager.k_cache[layer], manager.v_cache[layer], slot_mapping)
    q, k = rope(q, k, cos, sin, positions)
    write_kv(manager, layer, slot_mapping, k, v)
    return q, k


# ----------------------------------------------------------------------------- one-row products (batch-1 decode)
def _one_row_kernel(x: torch.Tensor, name: str):
    """Lesson 02's Triton ``name`` for a one-row product on CUDA where the module serving lesson 02 has it (the
    reference: not an exercise), else None. More rows go to cuBLAS: it is fast there."""
    if x.dim() != 2 or x.shape[0] != 1 or not _use_gpu_kernels(x):
        return None
    return getattr(lesson_module(2), name, None)


def _one_row_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      *vectors: torch.Tensor) -> bool:
    """The layouts the one-row kernels read: ``x`` (and a residual) one contiguous row, ``weight`` 2-D with
    contiguous rows, ``bias`` and the norm weight contiguous. Anything else (a transposed or strided view of
    a weight, say) goes to the ops apart, which take any strides, rather than to the kernel's ValueError."""
    return (x.is_contiguous() and weight.dim() == 2 and weight.stride(1) == 1
            and (bias is None or bias.is_contiguous()) and all(t.is_contiguous() for t in vectors))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: PyTorch's (cuBLAS); one row on CUDA: lesson 02's ``matvec`` where it exists."""
    kernel = _one_row_kernel(x, "matvec")
    if kernel is not None and _one_row_operands(x, weight, bias):
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)``; one row on CUDA: lesson 02's fused ``silu_and_mul_matvec``
    where it exists, else the two ops."""
    kernel = _one_row_kernel(x, "silu_and_mul_matvec")
    if kernel is not None and _one_row_operands(x, weight, bias):
        return kernel(x, weight, bias)
    return F.linear(silu_and_mul(x), weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h, residual = add_rms_norm(x, residual, norm_weight, eps)``, then ``(linear(h, weight, bias), residual)``.

    One row on CUDA: lesson 02's fused ``add_rms_norm_matvec`` where it exists (the normalised row is never
    stored), else the two ops. As :func:`add_rms_norm`, use only the returned tensors afterwards.
    """
    kernel = _one_row_kernel(x, "add_rms_norm_matvec")
    if kernel is not None and _one_row_operands(x, weight, bias, residual, norm_weight):
        return kernel(x, residual, norm_weight, eps, weight, bias)
    h, residual = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), residual
