# Lesson 02 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/gpu_elementwise_given.py: read it, do not edit it.
# Run `pytest grader/lesson02` to grade them; the notebook is lessons/02_triton_elementwise/.
# (Generated from solutions/kernels/gpu_elementwise.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 02: the first Triton kernels, RMSNorm, RoPE and SiLU-and-mul, the per-token ops of a Llama layer.

Each exercise comes in three pieces that sit side by side:

* a plain-PyTorch reference (``*_reference``), given to you: slow, obviously right, the yardstick;
* a Triton kernel (``@triton.jit``) that does the work, one program per row (or per token);
* a short launcher, the function the engine calls: it checks the inputs, picks the block size and
  the grid, and launches the kernel.

Why bother with kernels for such simple ops? They do almost no arithmetic per byte, so their speed is
set by memory bandwidth alone; PyTorch eager runs them as several kernels, each of which reads and
writes the whole tensor. One fused kernel reads each input once and writes each output once.

Conventions (as in lesson 01): math in float32 whatever the storage dtype (fp32, fp16, bf16); the
result is rounded to the storage dtype once; bad input raises ``ValueError`` before any launch.
Tensors must live on a CUDA GPU, or on the CPU when the Triton interpreter is on
(``TRITON_INTERPRET=1``, which ``yaie.device.prepare_triton()`` sets on a machine with no GPU).
"""

from __future__ import annotations

import torch

from yaie.device import prepare_triton, triton_interpreted

try:
    prepare_triton()  # must run before `import triton` on a machine with no GPU
except RuntimeError:
    pass  # triton was imported earlier without the interpreter; launches on CPU tensors will say so

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/gpu_elementwise_given.py
from yaie.kernels.gpu_elementwise_given import (
    MAX_HIDDEN, SUPPORTED_DTYPES, apply_rope_qk_reference, as_rows, check_devices, check_float_tensor,
    check_same_dtype, fused_add_rms_norm_reference, rms_norm_launch_config, rms_norm_reference, rope_reference,
    silu_and_mul_reference,
)


# ----------------------------------------------------------------------------- RMSNorm

def rms_norm(input_tensor: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension with a Triton kernel: ``x / sqrt(mean(x^2) + epsilon) * weight``.

    Args:
        input_tensor: ``[..., hidden]``, float32/float16/bfloat16, any hidden size in ``[1, MAX_HIDDEN]``
            (not only powers of two); rows may be strided (e.g. a slice ``x[:, :hidden]`` of a wider matrix).
        weight: ``[hidden]``, float32/float16/bfloat16 (it need not match the input's dtype).
        epsilon: ``>= 0``, added to the mean of squares under the square root.

    Returns:
        A new tensor of the input's shape and dtype (contiguous). The input is not modified.
        The mean of squares and the scaling are computed in float32 and rounded once, at the store
        (float16 and bfloat16 results are graded bit for bit).

    Raises:
        ValueError: not a float32/float16/bfloat16 tensor, rank 0, hidden out of range, weight of the
            wrong shape, ``epsilon < 0``, tensors on different devices, or CPU tensors while Triton
            compiles for the GPU (see :func:`check_devices`).

    Launch one program per row (the grid is the number of rows); each loads its whole row once.
    """
    raise NotImplementedError('lesson 02, task 1: implement rms_norm in yaie/kernels/gpu_elementwise.py')


# ----------------------------------------------------------------------------- fused residual add + RMSNorm

def fused_add_rms_norm(input_tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, in place and in one pass over memory (as between two layers).

    ``residual += input_tensor``, then ``input_tensor = rms_norm(residual, weight, epsilon)``: after
    the call ``residual`` holds the sum (rounded to its dtype) and ``input_tensor`` holds the normalised
    sum. Each row is read once and written once; no temporary tensor.

    The rounding is part of the specification, as two separate ops would do it: the sum is computed in
    float32 and rounded once to the dtype, and the norm is taken of exactly those stored values (not of the
    float32 sum), in float32, then rounded once. For float16 and bfloat16 the result is checked bit for bit.

    Args:
        input_tensor: ``[..., hidden]``, float32/float16/bfloat16; rows may be strided.
        residual: same shape, dtype and device as ``input_tensor``, and a different tensor.
        weight: ``[hidden]``, float32/float16/bfloat16.
        epsilon: ``>= 0``.

    Returns:
        ``(input_tensor, residual)``: the same tensor objects, modified in place.

    Raises:
        ValueError: as :func:`rms_norm`, plus a residual of another shape, dtype or device, or the
            same memory passed as both tensors.
    """
    raise NotImplementedError('lesson 02, task 2: implement fused_add_rms_norm in yaie/kernels/gpu_elementwise.py')


# ----------------------------------------------------------------------------- RoPE on q and k

def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys, in place, one Triton program per token.

    With ``h = head_dim // 2``, each head vector ``x`` of a token at position ``p`` becomes
    ``x[:h] * cos[p, :h] - x[h:] * sin[p, :h]`` (first half) and ``x[h:] * cos[p, h:] + x[:h] * sin[p, h:]``
    (second half): the rotate-half layout of Llama / Hugging Face, computed in float32 and rounded once,
    at the store (float16 and bfloat16 results are graded bit for bit).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k: ``[num_tokens, num_kv_heads, head_dim]``; same dtype
            (float32/float16/bfloat16), even ``head_dim``. Either may be a strided view, e.g. a slice of a
            fused qkv projection's output, as long as its last dim is contiguous; the rotation is
            written through the view.
        cos, sin: float32 ``[max_position, head_dim]`` from lesson 01's ``build_rope_cache`` (the two
            halves of a row hold the same angles).
        position_ids: int32/int64 ``[num_tokens]``: each token's own position, so a ragged batch of
            sequences (positions 0..5, then 0..2, then 517) is one call.

    Returns:
        ``(q, k)``, the same tensor objects, rotated in place.

    Raises:
        ValueError: wrong ranks, q/k disagreeing on tokens, head_dim or dtype, odd head_dim, tables not
            float32 ``[max_position, head_dim]``, position_ids not an integer ``[num_tokens]``, tensors on
            different devices or CPU tensors while Triton compiles for the GPU; and, when
            ``position_ids`` is on the CPU, a position outside ``[0, max_position)``.

    Out-of-range positions on a GPU: checking them on the host needs ``position_ids.max().item()``,
    which waits for the GPU (tens of microseconds, longer than this kernel at 4k tokens, and not
    allowed inside a CUDA graph). So the check is done where it is free: on CPU position_ids here,
    and in the kernel, which never reads outside the table and writes NaN into the q and k of a
    token whose position is out of range, so the error shows downstream instead of a silent
    wrong answer.
    """
    raise NotImplementedError('lesson 02, task 3: implement apply_rope_qk in yaie/kernels/gpu_elementwise.py')


# ----------------------------------------------------------------------------- SiLU-and-mul

def silu_and_mul(input_tensor: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gate of a Llama MLP in one kernel: ``silu(x[..., :d]) * x[..., d:]``.

    Args:
        input_tensor: ``[..., 2 * d]`` (the fused gate and up projections), float32/float16/bfloat16,
            ``d >= 1``; rows may be strided.

    Returns:
        A new ``[..., d]`` tensor of the input's dtype, where ``silu(g) = g * sigmoid(g)``; the math is
        done in float32 and rounded once (float16 and bfloat16 results are graded bit for bit).

    Raises:
        ValueError: not a float32/float16/bfloat16 tensor, rank 0, an odd or zero last dim, or CPU
            tensors while Triton compiles for the GPU.
    """
    raise NotImplementedError('lesson 02, task 4: implement silu_and_mul in yaie/kernels/gpu_elementwise.py')
