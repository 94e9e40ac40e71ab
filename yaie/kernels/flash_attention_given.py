"""Lesson 06: the given code of the FlashAttention exercises (``yaie/kernels/flash_attention.py``).

Read it, do not edit it: the exercise module imports these names (``flash_attention.attention_reference``
works as before), and the graders rely on them as they are.

* constants: ``LOG2E``, ``LN2`` (for ``exp2`` / ``log2``), the dtypes and head sizes the kernels take;
* :func:`attention_reference`: the naive attention the kernels must reproduce (not a task);
* :func:`check_attention_inputs`: the input check the tasks call.
"""

from __future__ import annotations

import torch

from yaie.device import triton_interpreted


LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453     # ln(2):   log(x) == log2(x) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive attention the kernels must reproduce: builds the full score matrix (O(n^2) memory).

    Same arguments and results as :func:`flash_attention_forward` (``[batch, heads, seq, head_dim]``,
    grouped-query heads, causal aligned to the last key). Computes in the inputs' dtype unless they
    are upcast first (the graders call it on float64 copies to get the reference). Returns
    ``(out, lse)`` with ``lse`` in natural log, float32 for low-precision inputs.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    seq_q, seq_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)          # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        # Query i sits at position seq_k - seq_q + i and sees keys up to that position.
        rows = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
        cols = torch.arange(seq_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    lse_dtype = lse.dtype if lse.dtype in (torch.float32, torch.float64) else torch.float32
    return out, lse.to(lse_dtype)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           scale: float | None, layout: str = "dense") -> None:
    """Raise ``ValueError`` unless q, k, v are valid inputs for the kernels of this lesson.

    ``layout="dense"``: 4-D ``[batch, heads, seq, head_dim]``; ``layout="varlen"``: 3-D
    ``[tokens, heads, head_dim]`` (the offsets are checked by the varlen function).
    """
    rank = 4 if layout == "dense" else 3
    names = "[batch, heads, seq, head_dim]" if layout == "dense" else "[tokens, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {names}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not triton_interpreted():
        raise ValueError("CPU tensors need the Triton interpreter: call yaie.device.prepare_triton() "
                         "before importing triton (or set TRITON_INTERPRET=1)")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors must be on a CUDA GPU or the CPU, got {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]   # the heads axis is 1 in both layouts
    head_dim = q.shape[-1]
    if layout == "dense" and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got {head_dim} and {k.shape[-1]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if any(s == 0 for s in q.shape) or any(s == 0 for s in k.shape):
        raise ValueError(f"empty tensors are not allowed: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if layout == "dense" and causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs seq_q <= seq_k (the queries are the last tokens), "
                         f"got seq_q={q.shape[2]}, seq_k={k.shape[2]}")
    if scale is not None:
        scale = float(scale)
        if not (scale > 0 and scale < float("inf")):
            raise ValueError(f"scale must be a positive finite number, got {scale}")
