"""The engine's only door to the lesson kernels.

Every normalisation, rotary embedding and attention the model runs is one call here, and each call looks
the lesson module up *at call time* through :mod:`yaie.switch`, so the student's code is what runs and a
change of the switch takes effect at once.

Which lesson serves which op:

============================  =====================================  ==================================
op                            CPU tensors                            CUDA tensors
============================  =====================================  ==================================
rope_cache                    lesson 01 ``build_rope_cache``         lesson 01 (tables are built once)
rms_norm / add_rms_norm       lesson 01 ``cpu_rms_norm``             lesson 02 ``rms_norm`` /
                                                                     ``fused_add_rms_norm``
rope                          lesson 01 ``cpu_rope_embeddings``      lesson 02 ``apply_rope_qk``
silu_and_mul                  plain PyTorch                          lesson 02 ``silu_and_mul``
linear and its fused forms    PyTorch                                PyTorch; one row: lesson 02's
                                                                     reference-only one-row kernels
kv_cache_manager / write_kv   lesson 03 ``KVCacheManager``           lesson 03
rope_and_write_kv             rope, then write_kv                    lesson 02's fused
                                                                     ``apply_rope_qk_store_kv`` (the
                                                                     reference's, with lesson 03's
                                                                     reference class); else apart
paged_attention (decode)      gather + lesson 01                     lesson 04 ``paged_attention_forward``
paged_attention (prefill)     gather + lesson 01                     lesson 06
                              ``cpu_attention_forward``              ``flash_attention_varlen_forward``
  after a cached context      gather + lesson 01                     lesson 05 ``prefix_prefill_attention``
  a step mixing both          as above, per kind of row              lesson 05 ``FlashInferPagedAttention``
                                                                     (``CascadeAttention`` over shared
                                                                     blocks)
  decode over shared blocks   as decode                              lesson 05 cascade (CUDA graphs)
rope_and_paged_attention      rope_and_write_kv, paged_attention     a decode step for lesson 04: the
                                                                     reference's ``paged_decode_with_rope``
                                                                     (RoPE, cache write and attention in
                                                                     one kernel, with lessons 02 to 04 the
                                                                     reference's); else the two above
attention (one sequence)      lesson 01 ``cpu_attention_forward``    lesson 01
============================  =====================================  ==================================

Sliding-window layers (Mistral, some Qwen2) pass their window to lessons 04, 05 (prefix prefill) and 06;
lesson 05's plan/run and cascade take no window, so those layers go to the per-row kernels. On CUDA, when a
lesson's module cannot be imported at all (``LessonUnavailable``), the next path in line stands in (lesson
01's ops, plain PyTorch, run on CUDA too).

Unfinished lessons: with ``YAIE_SOLUTIONS`` not set at all, each function that is still a stub runs from the
reference, the rest of its lesson stays the student's; with it set, a stub raises :class:`KernelMissing`
(:mod:`yaie.ops.lessons` says how).

The package, one idea a module:

* :mod:`yaie.ops.lessons`: which module serves a lesson function now (the switch, auto mode's fallbacks);
* :mod:`yaie.ops.layers`: RoPE tables, norms, RoPE, SiLU-and-mul, linear layers;
* :mod:`yaie.ops.kv`: lesson 03's cache manager and the writes into it;
* :mod:`yaie.ops.attention_backends`: attention, and the ordered backends of a paged step;
* :mod:`yaie.ops.plan_run`: lesson 05's plan/run and cascade decode.

The names below are re-exported here for callers (``ops.rms_norm(...)``). A test's spy goes on the module
that defines a name (``monkeypatch.setattr(ops.lessons, "call_in", spy)``): the other modules call it
through that module, never through this one.
"""

from yaie.ops import attention_backends, kv, layers, lessons, plan_run
from yaie.ops.attention_backends import attention, paged_attention, rope_and_paged_attention
from yaie.ops.kv import kv_cache_manager, rope_and_write_kv, write_kv
from yaie.ops.layers import (add_rms_norm, add_rms_norm_linear, linear, rms_norm, rope, rope_cache, silu_and_mul,
                             silu_and_mul_linear, swiglu_mlp)
from yaie.ops.lessons import (KernelMissing, LessonCalls, auto_mode, call, call_in, describe, fallback,
                              lesson_module, ran, reset_auto_fallback, selection, student_path)
from yaie.ops.plan_run import CASCADE_MIN_SHARED_TOKENS, cascade_decode_available, default_plan_run

__all__ = [
    "attention_backends", "kv", "layers", "lessons", "plan_run",
    "attention", "paged_attention", "rope_and_paged_attention",
    "kv_cache_manager", "rope_and_write_kv", "write_kv",
    "add_rms_norm", "add_rms_norm_linear", "linear", "rms_norm", "rope", "rope_cache", "silu_and_mul",
    "silu_and_mul_linear", "swiglu_mlp",
    "KernelMissing", "LessonCalls", "auto_mode", "call", "call_in", "describe", "fallback", "lesson_module", "ran",
    "reset_auto_fallback", "selection", "student_path",
    "CASCADE_MIN_SHARED_TOKENS", "cascade_decode_available", "default_plan_run",
]
