"""Lesson 02: the given code of the Triton element-wise exercises (``yaie/kernels/gpu_elementwise.py``).

Read it, do not edit it: the exercise module imports these names (``gpu_elementwise.rms_norm_reference``
works as before), and the graders and the engine rely on them as they are.

* constants: the dtypes the kernels take, ``MAX_HIDDEN`` (the longest RMSNorm row one program holds);
* the input checks the tasks call: :func:`check_float_tensor`, :func:`check_devices`, :func:`check_same_dtype`,
  and :func:`as_rows` (a 2-D view the kernels can stride through) and :func:`rms_norm_launch_config`;
* the naive references the kernels are checked against (not tasks): :func:`rms_norm_reference`,
  :func:`fused_add_rms_norm_reference`, :func:`rope_reference`, :func:`apply_rope_qk_reference`,
  :func:`silu_and_mul_reference`.
"""

from __future__ import annotations

import torch

from yaie.device import prepare_triton, triton_interpreted

try:
    prepare_triton()  # must run before `import triton` on a machine with no GPU
except RuntimeError:
    pass  # triton was imported earlier without the interpreter; launches on CPU tensors will say so

import triton  # noqa: E402

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# One RMSNorm row is held in registers by one program; past this many elements a row no longer fits
# (no Llama-family model comes close: Llama 3 405B has hidden 16384).
MAX_HIDDEN = 65536


# ----------------------------------------------------------------------------- input checks (given)

def check_float_tensor(name: str, tensor, min_dim: int = 1) -> None:
    """``tensor`` must be a float32/float16/bfloat16 tensor with at least ``min_dim`` dimensions."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(tensor.shape)}")


def check_devices(**tensors: torch.Tensor) -> None:
    """All tensors on one device, and one that Triton can run on now (CUDA, or CPU when interpreting)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    device = devices.pop()
    if device.type == "cpu" and not triton_interpreted():
        raise ValueError(
            "these are CPU tensors, but Triton is compiling for the GPU: move them to 'cuda', or run on the "
            "CPU with the Triton interpreter (TRITON_INTERPRET=1 before triton is imported), or use lesson 01's "
            "CPU kernels")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels here run on CUDA (or the CPU interpreter), not on {device}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        listing = ", ".join(f"{name} is {t.dtype}" for name, t in tensors.items())
        raise ValueError(f"dtypes must match: {listing}")


def as_rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[..., n]`` as a 2-D view ``[rows, n]`` with its last dim contiguous, or ``None`` if no such view exists.

    A view shares memory with ``tensor``, so a kernel that writes through it writes ``tensor``. The
    rows may be strided (e.g. every other row, or the left half of a wider matrix): the kernels take
    the row stride as an argument.
    """
    try:
        rows = tensor.view(-1, tensor.shape[-1])
    except RuntimeError:
        return None
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        return None
    return rows


def rms_norm_launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for one program per row of ``hidden`` elements.

    The block is the next power of two (Triton blocks are powers of two; a mask hides the padding).
    Warps grow with the block so that each thread holds 8-16 elements: enough for wide (16-byte) loads,
    few enough to stay in registers. (For hidden 4096 in bf16 that is 8 warps, the fastest of 4/8/16
    measured on an H200: bench/results/lesson02_sweep_*.md.)
    """
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    return block, num_warps


# ----------------------------------------------------------------------------- naive references (given)

def rms_norm_reference(input_tensor: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Plain PyTorch RMSNorm, computed in float32: ``x / sqrt(mean(x^2) + eps) * weight``."""
    x = input_tensor.float()
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x * inv_rms * weight.float()).to(input_tensor.dtype)


def fused_add_rms_norm_reference(input_tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch residual add + RMSNorm, *out of place*: returns ``(rms_norm(residual + x), residual + x)``.

    The sum is rounded to the storage dtype first (it is what the residual stream stores), and the
    norm is taken of that rounded sum, exactly as two separate ops would.
    """
    new_residual = (residual.float() + input_tensor.float()).to(residual.dtype)
    return rms_norm_reference(new_residual, weight, epsilon), new_residual


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch rotate-half RoPE of ``x [num_tokens, num_heads, head_dim]``, out of place, float32 math."""
    half = x.shape[-1] // 2
    xf = x.float()
    c = cos[position_ids].unsqueeze(1)   # [num_tokens, 1, head_dim]: one row per token, shared by its heads
    s = sin[position_ids].unsqueeze(1)
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * c + rotated * s).to(x.dtype)


def apply_rope_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch RoPE of q and k, out of place: returns new ``(q_rotated, k_rotated)``."""
    return rope_reference(q, cos, sin, position_ids), rope_reference(k, cos, sin, position_ids)


def silu_and_mul_reference(input_tensor: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch SwiGLU gate: ``silu(x[..., :d]) * x[..., d:]`` in float32, ``d = x.shape[-1] // 2``."""
    d = input_tensor.shape[-1] // 2
    x = input_tensor.float()
    return (torch.nn.functional.silu(x[..., :d]) * x[..., d:]).to(input_tensor.dtype)
