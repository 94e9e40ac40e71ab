"""The per-token layer ops: RoPE tables, RMSNorm, rotary embeddings, SiLU-and-mul, and the linear layers.

On CPU tensors these run lesson 01 (or plain PyTorch); on CUDA tensors lesson 02's Triton kernels, unless
lesson 02's module cannot be imported at all, where the lesson 01 ops (plain PyTorch, which run on CUDA
too) stand in. Lesson functions are reached through :mod:`yaie.ops.lessons` at call time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from yaie.ops import lessons

# The lesson 02 functions the engine calls. Lesson 02's reference-only ``matvec`` stands in for cuBLAS, not
# for one of them, so it runs only where the reference serves all of them (the whole lesson).
LESSON02_FUNCTIONS = ("rms_norm", "fused_add_rms_norm", "apply_rope_qk", "silu_and_mul")

# Lesson 02's reference-only one-row kernels, and the lesson functions each one replaces.
ONE_ROW_KERNELS = {
    "matvec": LESSON02_FUNCTIONS,
    "silu_and_mul_matvec": ("silu_and_mul",),
    "add_rms_norm_matvec": ("fused_add_rms_norm",),
}

# Lesson 02's reference-only few-row gate/up product with SiLU-and-mul (2 to 64 rows in half precision: a decode
# step of that many sequences, or a short prefill), and the lesson function it replaces.
FEW_ROWS = 64            # the most rows the kernel takes (its SKINNY_MAX_ROWS)
FEW_ROW_KERNELS = {"skinny_matmul_silu_and_mul": ("silu_and_mul",)}


def use_gpu_kernels(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is on CUDA and lesson 02's module (the student's or the reference) imports."""
    return tensor.is_cuda and lessons.lesson_available(2)


def rope_cache(max_position: int, head_dim: int, base: float = 10000.0, rope_scaling: dict | None = None,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables ``[max_position, head_dim]`` (float32, rotate-half layout), lesson 01 task 1."""
    return lessons.call(1, "build_rope_cache", max_position, head_dim, base, rope_scaling, device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; a new tensor."""
    if use_gpu_kernels(x):
        return lessons.call(2, "rms_norm", x, weight, eps)
    return lessons.call(1, "cpu_rms_norm", x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``.

    The lesson 02 kernel does it in one pass and in place (``x`` and ``residual`` are overwritten), so
    callers must not use ``x`` or ``residual`` afterwards except through the returned tensors.
    """
    if use_gpu_kernels(x):
        return lessons.call(2, "fused_add_rms_norm", x, residual, weight, eps)
    residual = x + residual
    return lessons.call(1, "cpu_rms_norm", residual, weight, eps), residual


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [tokens, heads, head_dim]`` and ``k [tokens, kv_heads, head_dim]`` by ``positions [tokens]``.

    May work in place (lesson 02 does): use the returned tensors.
    """
    if use_gpu_kernels(q):
        return lessons.call(2, "apply_rope_qk", q, k, cos, sin, positions)
    return (lessons.call(1, "cpu_rope_embeddings", q, cos, sin, positions),
            lessons.call(1, "cpu_rope_embeddings", k, cos, sin, positions))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (the SwiGLU MLP's gate and up halves)."""
    if use_gpu_kernels(x):
        return lessons.call(2, "silu_and_mul", x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- one-row products (batch-1 decode)
def one_row_kernel(x: torch.Tensor, name: str):
    """Lesson 02's reference-only kernel ``name`` (a key of ``ONE_ROW_KERNELS``) for a one-row product on
    CUDA, where the reference serves every function it replaces; else None. More rows go to cuBLAS."""
    if x.dim() != 2 or x.shape[0] != 1 or not use_gpu_kernels(x):
        return None
    return lessons.reference_only(2, name, ONE_ROW_KERNELS[name])


def _one_row_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      *vectors: torch.Tensor) -> bool:
    """The layouts the one- and few-row kernels read: ``x`` (and a residual) contiguous, ``weight`` 2-D with
    contiguous rows, ``bias`` and the norm weight contiguous. Anything else (a transposed or strided view of
    a weight, say) goes to the ops apart, which take any strides, rather than to the kernel's ValueError."""
    return (x.is_contiguous() and weight.dim() == 2 and weight.stride(1) == 1
            and (bias is None or bias.is_contiguous()) and all(t.is_contiguous() for t in vectors))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: PyTorch's (cuBLAS); one row on CUDA: lesson 02's ``matvec`` where it may run."""
    kernel = one_row_kernel(x, "matvec")
    if kernel is not None and _one_row_operands(x, weight, bias):
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)``; one row on CUDA: lesson 02's fused ``silu_and_mul_matvec``
    where it may run, else the two ops."""
    kernel = one_row_kernel(x, "silu_and_mul_matvec")
    if kernel is not None and _one_row_operands(x, weight, bias):
        return kernel(x, weight, bias)
    return F.linear(silu_and_mul(x), weight, bias)


def few_row_kernel(x: torch.Tensor, name: str):
    """Lesson 02's reference-only kernel ``name`` (a key of ``FEW_ROW_KERNELS``) for a product of 2 to
    ``FEW_ROWS`` half-precision rows on CUDA, where the reference serves the function it replaces; else None."""
    if x.dim() != 2 or not 2 <= x.shape[0] <= FEW_ROWS or x.dtype not in (torch.float16, torch.bfloat16) \
            or not use_gpu_kernels(x):
        return None
    return lessons.reference_only(2, name, FEW_ROW_KERNELS[name])


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h, residual = add_rms_norm(x, residual, norm_weight, eps)``, then ``(linear(h, weight, bias), residual)``.

    One row on CUDA: lesson 02's fused ``add_rms_norm_matvec`` where it may run (the normalised row is never
    stored), else the two ops. As :func:`add_rms_norm`, use only the returned tensors afterwards.
    """
    kernel = one_row_kernel(x, "add_rms_norm_matvec")
    if kernel is not None and _one_row_operands(x, weight, bias, residual, norm_weight):
        return kernel(x, residual, norm_weight, eps, weight, bias)
    h, residual = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), residual


def swiglu_mlp(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
               down_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama layer's MLP half with the add + norm before it: ``h, residual = add_rms_norm(x, residual,
    norm_weight, eps)``, then ``(linear(silu_and_mul(linear(h, gate_up, gate_up_bias)), down, down_bias),
    residual)``. ``gate_up`` is the gate rows then the up rows.

    One row on CUDA: the norm fused into the gate/up product and the gate into the down product
    (:func:`add_rms_norm_linear`, :func:`silu_and_mul_linear`). 2 to ``FEW_ROWS`` half-precision rows: lesson
    02's ``skinny_matmul_silu_and_mul`` where it may run (the gate/up product never stored). Else the ops apart.
    As :func:`add_rms_norm`, use only the returned tensors afterwards.
    """
    kernel = few_row_kernel(x, "skinny_matmul_silu_and_mul")
    if kernel is not None and _one_row_operands(x, gate_up, gate_up_bias):
        h, residual = add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(kernel(h, gate_up, gate_up_bias), down, down_bias), residual
    projected, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, gate_up_bias)
    return silu_and_mul_linear(projected, down, down_bias), residual
