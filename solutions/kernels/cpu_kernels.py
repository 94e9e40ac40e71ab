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


# yaie: solution-only
def _check_float(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")


# yaie: solution-only
def _rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float64, [head_dim // 2]) with optional linear or Llama 3 scaling."""
    # Pair i of the rotate-half layout turns at angle position * base^(-2i / head_dim).
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        # Positions are squeezed by `factor`: the same as dividing every frequency by it.
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        # Llama 3 keeps high frequencies (short wavelengths) as they are, divides low frequencies
        # (wavelengths longer than the original context) by `factor`, and blends smoothly in between.
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        original = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = original / low
        high_freq_wavelen = original / high
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        between = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        return torch.where(between, blended, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (use None, 'linear' or 'llama3')")


# yaie: task 1
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
    if int(max_position) < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 2 (RoPE rotates pairs), got {head_dim}")
    if base <= 0:
        raise ValueError(f"base must be > 0, got {base}")
    inv_freq = _rope_inv_freq(head_dim, float(base), rope_scaling)
    positions = torch.arange(int(max_position), dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)      # [max_position, head_dim // 2]
    angles = torch.cat([angles, angles], dim=-1)   # rotate-half: both halves share an angle
    return angles.cos().float().to(device), angles.sin().float().to(device)


# yaie: task 2
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
    _check_float("input_tensor", input_tensor)
    if input_tensor.dim() < 2:
        raise ValueError(f"input_tensor must be [..., num_heads, head_dim], got shape {tuple(input_tensor.shape)}")
    head_dim = input_tensor.shape[-1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] != head_dim:
        raise ValueError(f"cos and sin must both be [max_position, {head_dim}], "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point \
            or position_ids.dtype == torch.bool:
        raise ValueError("position_ids must be an integer tensor")
    if tuple(position_ids.shape) != tuple(input_tensor.shape[:-2]):
        raise ValueError(f"position_ids must have shape {tuple(input_tensor.shape[:-2])} (the input's shape "
                         f"without its last two dims), got {tuple(position_ids.shape)}")
    devices = {input_tensor.device, cos.device, sin.device, position_ids.device}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if position_ids.numel() and (position_ids.min() < 0 or position_ids.max() >= cos.shape[0]):
        raise ValueError(f"position_ids must lie in [0, {cos.shape[0]}) (the table's length), got "
                         f"[{int(position_ids.min())}, {int(position_ids.max())}]")

    x = input_tensor.float()
    # Gather each token's row of the tables, then broadcast it over the heads axis.
    c = cos.float()[position_ids].unsqueeze(-2)
    s = sin.float()[position_ids].unsqueeze(-2)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * c + rotated * s).to(input_tensor.dtype)


# yaie: task 3
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
    _check_float("input_tensor", input_tensor)
    _check_float("weight", weight)
    if input_tensor.dim() == 0 or input_tensor.shape[-1] == 0:
        raise ValueError(f"input_tensor must be [..., hidden] with hidden >= 1, got shape {tuple(input_tensor.shape)}")
    hidden = input_tensor.shape[-1]
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},) to match the input's last dim, got {tuple(weight.shape)}")
    if weight.device != input_tensor.device:
        raise ValueError(f"input_tensor is on {input_tensor.device} but weight is on {weight.device}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")

    x = input_tensor.float()
    # mean of squares in float32: in fp16 the squares of values ~300 already overflow.
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x * inv_rms * weight.float()).to(input_tensor.dtype)


# yaie: solution-only
def _expand_kv_heads(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[b, kv_heads, n, d] -> [b, num_heads, n, d]: each KV head serves num_heads // kv_heads query heads."""
    group = num_heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


# yaie: solution-only
def _check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the {q.shape[1]} query heads must split evenly over the {k.shape[1]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


# yaie: solution-only
def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean [q_len, kv_len], True where query i may see key j: j <= (kv_len - q_len) + i."""
    offset = kv_len - q_len  # the queries are the last q_len positions of the context
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    return cols <= rows + offset


# yaie: task 4
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
    _check_attention_inputs(q, k, v)
    batch, num_heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    scale = head_dim ** -0.5 if scale is None else float(scale)

    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or a bool tensor, got the string {mask!r}")
        if q_len > kv_len:
            raise ValueError(f"causal attention needs q_len <= kv_len (queries are the last tokens), "
                             f"got q_len={q_len}, kv_len={kv_len}")
        allowed = causal_mask(q_len, kv_len, device=q.device)
    elif mask is None:
        allowed = None
    elif isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        try:
            torch.broadcast_shapes(mask.shape, (batch, num_heads, q_len, kv_len))
        except RuntimeError:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to "
                             f"[batch, num_heads, q_len, kv_len] = {[batch, num_heads, q_len, kv_len]}") from None
        allowed = mask.to(q.device)
    else:
        raise ValueError("mask must be None, 'causal' or a bool tensor (True = may attend)")

    qf = q.float()
    kf = _expand_kv_heads(k.float(), num_heads)
    vf = _expand_kv_heads(v.float(), num_heads)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale        # [b, h, q_len, kv_len]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # Subtracting the row max keeps exp() from overflowing; a fully masked row has max -inf, so
    # clamp it to 0 and let that row's weights all be exp(-inf) = 0.
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.matmul(weights, vf).to(q.dtype)
