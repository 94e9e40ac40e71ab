# Lesson 01 exercises: replace each `raise NotImplementedError(...)` with your code.
# Run `pytest grader/lesson01` to grade them; the notebook is lessons/01_cpu_kernels/.
# (Generated from solutions/kernels/cpu_kernels.py by `python -m yaie.tools.stubs`; instructors edit the solution.)
"""Lesson 01: CPU kernels, the plain-PyTorch versions of the ops every Llama layer runs.

These are the engine's CPU path and the yardstick every later GPU kernel is compared with:
RoPE tables, rotary embeddings, RMSNorm and attention (causal, grouped-query, continuing a cache).

Conventions used throughout the course:
* math in float32 whatever the input dtype (fp16 and bf16 lose too much in sums of squares and softmax),
  results cast back to the input dtype once, at the end;
* inputs are never modified; outputs are new tensors;
* bad input raises ``ValueError`` saying what is wrong, before any work is done.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def build_rope_cache(max_position: int, head_dim: int, base: float = 10000.0,
                     rope_scaling: dict | None = None, device: torch.device | str | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the cos/sin tables of rotary position embeddings (RoPE), rotate-half layout.

    Pair ``i`` (``0 <= i < head_dim // 2``) of a head vector turns by the angle
    ``p * inv_freq[i]`` at position ``p``, with ``inv_freq[i] = base ** (-2 i / head_dim)``.
    In the rotate-half layout (Llama, Hugging Face) the pair is (element ``i``, element
    ``i + head_dim // 2``), so the tables repeat the angles: ``cos[p, i] = cos[p, i + head_dim // 2]
    = cos(p * inv_freq[i])``, and the same for ``sin``.

    Args:
        max_position: number of positions (rows), ``>= 1``.
        head_dim: size of one head vector, even, ``>= 2``.
        base: the RoPE base ("rope_theta" in a Hugging Face config), ``> 0``.
        rope_scaling: ``None``; ``{"rope_type": "linear", "factor": f}`` (frequencies divided by f); or
            Llama 3's ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}``: wavelengths ``2 pi / inv_freq`` longer than
            ``original / low_freq_factor`` get ``inv_freq / factor``, shorter than
            ``original / high_freq_factor`` stay, and in between blend with
            ``s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``
            as ``(1 - s) * inv_freq / factor + s * inv_freq``. The key ``"type"`` is accepted for ``"rope_type"``.
        device: where to put the tables (default CPU).

    Returns:
        ``(cos, sin)``, each float32 of shape ``[max_position, head_dim]``. Compute the angles in
        float64 before the cos/sin: float32 angles at position 100k are off by ~1e-2 radians.

    Raises:
        ValueError: ``max_position < 1``, ``head_dim`` odd or ``< 2``, ``base <= 0``, or an unknown
            ``rope_scaling`` type.
    """
    raise NotImplementedError('lesson 01, task 1: implement build_rope_cache in yaie/kernels/cpu_kernels.py')


def cpu_rope_embeddings(input_tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        position_ids: torch.Tensor) -> torch.Tensor:
    """Rotate query or key vectors by their positions (RoPE, rotate-half layout).

    With ``h = head_dim // 2``, ``x1 = x[..., :h]`` and ``x2 = x[..., h:]`` at position ``p``::

        out[..., :h] = x1 * cos[p, :h] - x2 * sin[p, :h]
        out[..., h:] = x2 * cos[p, h:] + x1 * sin[p, h:]

    i.e. ``out = x * cos[p] + rotate_half(x) * sin[p]`` with ``rotate_half(x) = cat(-x2, x1)``.

    Args:
        input_tensor: ``[..., num_heads, head_dim]``, float32/float16/bfloat16, any strides; for the
            engine ``[num_tokens, num_heads, head_dim]``, for a padded batch ``[batch, seq, heads, dim]``.
        cos, sin: float32 ``[max_position, head_dim]`` from :func:`build_rope_cache`.
        position_ids: integer tensor of shape ``input_tensor.shape[:-2]``: each token's own position
            (so a ragged batch, or a decode step at position 517, works). Same device as the input.

    Returns:
        A new tensor, same shape and dtype as ``input_tensor``; the input is not modified. The
        rotation is computed in float32 and cast back once, at the end (graded bit for bit).

    Raises:
        ValueError: rank < 2, ``head_dim`` odd or different from the tables', tables of different
            shapes, ``position_ids`` of the wrong shape or not integer, a position outside
            ``[0, max_position)``, or tensors on different devices.
    """
    raise NotImplementedError('lesson 01, task 2: implement cpu_rope_embeddings in yaie/kernels/cpu_kernels.py')


def cpu_rms_norm(input_tensor: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, then a learned per-channel scale.

    ``out = x / sqrt(mean(x ** 2, dim=-1) + epsilon) * weight``, computed in float32 (the product with the
    weight too) and cast back to the input's dtype once, at the end: float16 and bfloat16 results are
    graded bit for bit.

    Args:
        input_tensor: ``[..., hidden]``, float32/float16/bfloat16, any strides, at least one element
            per row.
        weight: ``[hidden]``, floating point, same device.
        epsilon: small positive number added under the square root (keeps all-zero rows finite).

    Returns:
        A new tensor of the input's shape and dtype.

    Raises:
        ValueError: rank 0, ``hidden == 0``, ``weight`` not ``[hidden]``, tensors on different devices,
            non-float dtypes, or ``epsilon < 0``.
    """
    raise NotImplementedError('lesson 01, task 3: implement cpu_rms_norm in yaie/kernels/cpu_kernels.py')


def cpu_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | str | None = None, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention, ``softmax(q k^T * scale + mask) v``, with grouped-query heads.

    Args:
        q: ``[batch, num_heads, q_len, head_dim]``.
        k, v: ``[batch, num_kv_heads, kv_len, head_dim]``; ``num_heads`` must be a multiple of
            ``num_kv_heads``: query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``
            (grouped-query attention; ``num_kv_heads == 1`` is multi-query attention).
        mask: ``None`` (every query sees every key); ``"causal"``; or a bool tensor broadcastable to
            ``[batch, num_heads, q_len, kv_len]``, True where a query may attend. ``"causal"`` aligns the
            last query with the last key: query ``i`` sits at position ``kv_len - q_len + i`` and sees
            keys ``0 .. kv_len - q_len + i``. With ``q_len == kv_len`` that is the usual lower triangle;
            with ``q_len < kv_len`` it is a block of new tokens continuing a cached context (decode is
            ``q_len == 1``: every key visible). ``q_len > kv_len`` is an error under ``"causal"``.
        scale: multiplier of the scores, default ``head_dim ** -0.5``.

    Dtypes: float32, float16 or bfloat16, the same for q, k, v; scores, softmax and the weighted
    sum are computed in float32 and the output is cast back to q's dtype. A query row whose mask
    hides every key gets zeros (not NaN).

    Returns:
        ``[batch, num_heads, q_len, head_dim]`` in q's dtype.

    Raises:
        ValueError: a tensor not 4-D; k and v of different shapes; batch or head_dim mismatch;
            ``num_heads`` not a multiple of ``num_kv_heads``; mixed dtypes or devices; a mask that
            is not None, "causal" or a bool tensor of a broadcastable shape; ``q_len > kv_len`` with
            "causal".
    """
    raise NotImplementedError('lesson 01, task 4: implement cpu_attention_forward in yaie/kernels/cpu_kernels.py')
