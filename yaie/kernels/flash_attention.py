# Lesson 06 exercises: replace each `raise NotImplementedError(...)` with your code.
# The given code these exercises use is in yaie/kernels/flash_attention_given.py: read it, do not edit it.
# Run `pytest grader/lesson06` to grade them; the notebook is lessons/06_flash_attention/.
# (Generated from solutions/kernels/flash_attention.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 06: FlashAttention, forward and backward, in Triton.

Standard attention builds the score matrix ``S = q k^T`` ([seq_q, seq_k] per head), its softmax ``P``
and then ``P v``. For 16k tokens and 32 heads, S alone is 16k * 16k * 32 * 2 bytes = 16 GiB: memory
grows as n^2 and the time goes into writing and re-reading S and P, not into the arithmetic.

FlashAttention never stores S or P. Each program owns a block of query rows and walks over the keys
block by block, keeping per row only

* ``m``   the largest score seen so far (for a numerically safe exp),
* ``l``   the sum of ``exp(score - m)`` over the keys seen so far,
* ``acc`` the sum of ``exp(score - m) * v`` over the keys seen so far ([BLOCK_M, head_dim]).

When a new block of keys brings a larger maximum ``m_new``, everything accumulated so far was scaled
by ``exp(-m)`` and must now be scaled by ``exp(-m_new)``: multiply ``l`` and ``acc`` by
``alpha = exp(m - m_new)`` and add the new block's terms. This is the *online softmax*. At the end
``out = acc / l`` is exactly ``softmax(S) v``, and ``lse = m + log(l)`` (the log of the softmax
denominator) is saved for the backward pass. Memory is O(n): q, k, v, out and one float per row.

The backward pass needs P again. Instead of storing it, it *recomputes* each tile from q, k and the
saved ``lse``: ``P = exp(S - lse)`` (one exp per score, no running max: ``lse`` already holds the
final normaliser). With ``dP = dout v^T`` and ``delta_i = sum_j P_ij dP_ij = dout_i . out_i``, the
softmax gradient is ``dS = P * (dP - delta)``, and then ``dq = scale * dS k``, ``dk = scale * dS^T q``,
``dv = P^T dout``. Recomputing costs one extra matmul per tile but saves the n^2 memory traffic,
which is the better deal on a GPU.

The kernels work in base 2 (``exp2``/``log2``, scores pre-multiplied by ``log2(e)``): exp2 is the
instruction the hardware has; the results are converted back to natural logs at the edges.

Layouts: the dense functions take ``[batch, heads, seq, head_dim]`` (like ``torch.nn.functional.
scaled_dot_product_attention``); the variable-length form takes token-major ``[total_tokens, heads,
head_dim]`` with cumulative offsets, the layout of an engine's batched prefill. One Triton kernel
serves both: it only needs the strides and, for varlen, where each sequence starts.

Sliding windows (task 5, the varlen form: the engine's prefill for Mistral-style layers): query ``p`` sees
keys ``p - w < j <= p``. A query block then visits only the key blocks its rows' windows touch, masking the
ones the window's edge crosses, so a prompt of ``n`` tokens costs ``n * w`` scores instead of ``n^2 / 2``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from yaie.device import triton_interpreted

# Given code (constants, validators, helpers; read it, do not edit it): yaie/kernels/flash_attention_given.py
from yaie.kernels.flash_attention_given import (
    LN2, LOG2E, MAX_HEAD_DIM, SUPPORTED_DTYPES, attention_reference, check_attention_inputs,
)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward: ``softmax(q k^T * scale) v`` without ever storing the score matrix.

    Args:
        q: ``[batch, num_heads, seq_q, head_dim]``.
        k, v: ``[batch, num_kv_heads, seq_k, head_dim]``; ``num_heads`` must be a multiple of
            ``num_kv_heads`` (grouped-query attention: query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``).
        causal: mask future keys. The last query aligns with the last key: query ``i`` sits at position
            ``seq_k - seq_q + i`` and sees keys ``0 .. seq_k - seq_q + i`` (as lesson 01's
            ``cpu_attention_forward``); ``seq_q > seq_k`` is then an error.
        scale: multiplier of the scores, default ``head_dim ** -0.5``.

    Dtypes: float16 or bfloat16 (float32 too, mainly for the CPU interpreter), the same for q, k, v.
    Any sequence lengths and any head_dim from 1 to 256 (padded inside to a power of two).
    On the CPU the kernel runs in the Triton interpreter.

    Returns:
        ``(out, lse)``: ``out`` like q; ``lse`` float32 ``[batch, num_heads, seq_q]``, the natural log
        of each row's softmax denominator, ``log(sum_j exp(scale * q_i . k_j))`` over the visible keys.

    Raises:
        ValueError: wrong ranks, dtypes or devices; mismatched batch, head_dim or k/v shapes; heads not
            divisible; empty tensors; a non-positive scale; causal with ``seq_q > seq_k``.
    """
    raise NotImplementedError('lesson 06, task 1: implement flash_attention_forward in yaie/kernels/flash_attention.py')


def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention backward: the gradients of ``out = flash_attention_forward(q, k, v)[0]``.

    Recomputes each tile of the probabilities from q, k and the saved ``lse`` instead of storing them.

    Args:
        dout: gradient of the loss with respect to ``out``, q's shape and dtype.
        q, k, v, causal, scale: exactly as given to :func:`flash_attention_forward`.
        out, lse: what :func:`flash_attention_forward` returned for them.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v. Under grouped-query attention ``dk``
        and ``dv`` of a KV head are summed over the query heads that share it.

    Raises:
        ValueError: everything :func:`flash_attention_forward` rejects; ``dout`` or ``out`` not of q's
            shape, dtype and device; ``lse`` not float32 ``[batch, num_heads, seq_q]``.
    """
    raise NotImplementedError('lesson 06, task 2: implement flash_attention_backward in yaie/kernels/flash_attention.py')


class FlashAttentionFunction(torch.autograd.Function):
    """``flash_attention`` as an autograd op: the forward saves (q, k, v, out, lse), not the scores."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                scale: float | None = None) -> torch.Tensor:
        """Run :func:`flash_attention_forward`, save what the backward needs on ``ctx``, return ``out``."""
        raise NotImplementedError('lesson 06, task 3: implement forward in yaie/kernels/flash_attention.py')

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        """Return ``(dq, dk, dv, None, None)`` from :func:`flash_attention_backward` (no gradient for causal, scale)."""
        raise NotImplementedError('lesson 06, task 3: implement backward in yaie/kernels/flash_attention.py')


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Differentiable FlashAttention: ``out`` of :func:`flash_attention_forward`, with a backward pass."""
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


def flash_attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                                   scale: float | None = None, sliding_window: int | None = None,
                                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention over a batch of sequences of different lengths, packed token by token.

    This is the engine's batched prefill: the prompts of a batch are concatenated, no padding.

    Args:
        q: ``[total_q, num_heads, head_dim]``; sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k, v: ``[total_k, num_kv_heads, head_dim]``, split by ``cu_seqlens_k`` the same way.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` cumulative offsets, starting at 0 and ending
            at ``total_q`` / ``total_k``, on q's device.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (they size the launch grid).
        causal: as :func:`flash_attention_forward`, per sequence (query ``i`` of a sequence sits at
            position ``len_k - len_q + i``: new tokens after a cached context, if ``len_k > len_q``).
        scale: default ``head_dim ** -0.5``.
        sliding_window: task 5. None: plain causal attention. An int ``w >= 1`` (needs ``causal``): the
            query at position ``p`` sees only keys ``p - w < j <= p`` (Mistral's rule, as Hugging Face
            applies it), and key blocks wholly before a query block's window are not visited. Until you do
            task 5, raise ``NotImplementedError("lesson 06, task 5: sliding window")`` when it is not None.
        validate: also check the offsets' *values* (start, end, order, ``max_seqlen_*``): they are read on
            the host, which waits for the GPU to finish everything queued before. The engine, whose offsets
            come from its scheduler, passes False on CUDA; shapes, dtypes and devices are always checked.

    Returns:
        ``(out, lse)``: ``out`` like q; ``lse`` float32 ``[num_heads, total_q]`` (heads first, like
        flash-attn's varlen API), natural log.

    Raises:
        ValueError: bad q, k, v (as the dense form, 3-D); offsets that are not int32 1-D on q's device;
            ``max_seqlen_q`` or ``max_seqlen_k`` below 1; offsets that (with ``validate``) do not start at
            0, end at the token counts, decrease, exceed ``max_seqlen_*``, or give a sequence queries
            without keys (or more queries than keys under ``causal``); a ``sliding_window`` that is not an
            int >= 1, or one without ``causal``.
    """
    raise NotImplementedError('lesson 06, task 4: implement flash_attention_varlen_forward in yaie/kernels/flash_attention.py')
