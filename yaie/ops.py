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
attention                     lesson 01 ``cpu_attention_forward``    lesson 01 for now (lessons 04 and 06
                                                                     plug in at :func:`attention`)
============================  =====================================  ==================================

On CUDA, when lesson 02's module cannot be imported at all (``LessonUnavailable``), the lesson 01 ops
(plain PyTorch, which run on CUDA too) stand in.

Unfinished lessons. With ``YAIE_SOLUTIONS`` *not set at all* the engine runs in "auto" mode: it calls the
student's function, and where that raises ``NotImplementedError`` (an untouched stub) it switches that
lesson to the reference solution for the rest of the process, printing one notice line per lesson to
stderr. With ``YAIE_SOLUTIONS`` set (even to ``none``) the switch is obeyed strictly: a stub stops
generation with :class:`KernelMissing`, whose message says which lesson and function are missing and
how to run the reference instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.nn.functional as F

from yaie import switch

# Lessons that auto mode switched to the reference in this process (after a stub raised).
_auto_reference: set[int] = set()


class KernelMissing(RuntimeError):
    """A lesson function the engine needs is not implemented (and the reference may not be used)."""


def _student_path(lesson: int) -> str:
    return "yaie/" + switch.LESSONS[lesson].modules[0].replace(".", "/") + ".py"


def _auto_mode() -> bool:
    return os.environ.get(switch.ENV_VAR) is None


def _reference_module(lesson: int):
    name = "solutions." + switch.LESSONS[lesson].modules[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise switch.LessonUnavailable(f"{switch.LESSONS[lesson].label}: the reference solution ({name}) "
                                       "is not in this copy of the course") from err


def lesson_module(lesson: int):
    """The module that serves ``lesson`` now: the switch's choice, or the reference after an auto fallback."""
    if lesson in _auto_reference and _auto_mode():
        return _reference_module(lesson)
    return switch.module(lesson)


def _missing_message(lesson: int, name: str, err: NotImplementedError) -> str:
    label = switch.LESSONS[lesson].label
    detail = f" ({err})" if str(err) else ""
    return (f"{label}: {name} is not implemented yet in {_student_path(lesson)}{detail}.\n"
            f"Implement it (`pytest grader/lesson{lesson:02d}` checks it), or run the reference solution for "
            f"this lesson: YAIE_SOLUTIONS={lesson} in the environment, or `yaie generate --solutions {lesson}`; "
            f"unset YAIE_SOLUTIONS to let the engine use the reference wherever a lesson is unfinished.")


def call(lesson: int, name: str, *args, **kwargs):
    """Call ``name`` of ``lesson``'s module, handling unfinished stubs as the module docstring says."""
    module = lesson_module(lesson)
    try:
        return getattr(module, name)(*args, **kwargs)
    except NotImplementedError as err:
        if module.__name__.startswith("solutions.") or not _auto_mode():
            raise KernelMissing(_missing_message(lesson, name, err)) from None
        try:
            reference = _reference_module(lesson)
        except switch.LessonUnavailable:
            raise KernelMissing(
                f"{switch.LESSONS[lesson].label}: {name} is not implemented yet in {_student_path(lesson)}, "
                "and this copy of the course has no reference solution to use instead: implement it "
                f"(`pytest grader/lesson{lesson:02d}` checks it).") from None
        _auto_reference.add(lesson)
        print(f"{switch.LESSONS[lesson].label}: {name} is not implemented yet in {_student_path(lesson)}; "
              f"using the reference for {switch.LESSONS[lesson].label}", file=sys.stderr, flush=True)
        return getattr(reference, name)(*args, **kwargs)


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

    This is the one place where the attention kernel is chosen: lesson 01 on every device for now;
    lesson 06 (FlashAttention) will take prefill and lesson 04 (paged attention) decode on CUDA.
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
