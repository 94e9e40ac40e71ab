"""BaseConv, the gated short convolution of the public Based checkpoints (lesson 08).

The Based models published by Hazy Research (``hazyresearch/based-360m``, ``based-1b``) mix three layer
kinds: Taylor linear attention, sliding-window softmax attention, and, in most layers, this one::

    u, g = split(x @ W_in.T + b_in)          # [t, 2 * inner] -> two halves of `inner` channels
    c[t] = sum_j taps[:, j] * u[t - (k-1) + j]   # depthwise causal convolution, kernel k (3), no mixing
    out  = (silu(c) * g) @ W_out.T + b_out   #   across channels; u before the prompt counts as zero

The convolution looks back ``k - 1`` tokens, so serving keeps, per sequence and layer, only the last
``k - 1`` values of ``u`` per channel: ``[inner, k - 1]``, constant memory however long the context.

* :func:`short_conv` runs a block of tokens (a prompt, or more tokens after a state) and returns the
  output and the new state.
* :func:`short_conv_step` runs one token per sequence (decode, batched), updating the state **in place**
  (a fixed buffer, as a captured CUDA graph needs).
* :func:`base_conv_block` / :func:`base_conv_block_step` are the whole layer (projections included).

Taps are stored ``[inner, k]``, oldest input first: ``taps[:, k-1]`` multiplies the current token (the
checkpoint's ``nn.Conv1d`` weight ``[inner, 1, k]`` with the middle dim dropped; ``Conv1d`` is a
cross-correlation, so no flip).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BaseConvWeights:
    """One BaseConv layer: ``in_proj [2 * inner, hidden]``, ``taps [inner, k]``, ``out_proj [hidden, inner]``."""

    in_proj: torch.Tensor
    in_proj_bias: torch.Tensor | None
    taps: torch.Tensor
    conv_bias: torch.Tensor | None
    out_proj: torch.Tensor
    out_proj_bias: torch.Tensor | None

    @property
    def inner(self) -> int:
        return self.taps.shape[0]

    @property
    def kernel_size(self) -> int:
        return self.taps.shape[1]

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], prefix: str) -> "BaseConvWeights":
        """Read ``{prefix}in_proj.weight``, ``{prefix}conv.weight`` ... (the names :mod:`yaie.model.loader`
        gives a converted Based checkpoint; biases may be absent)."""
        return cls(in_proj=w[prefix + "in_proj.weight"], in_proj_bias=w.get(prefix + "in_proj.bias"),
                   taps=w[prefix + "conv.weight"], conv_bias=w.get(prefix + "conv.bias"),
                   out_proj=w[prefix + "out_proj.weight"], out_proj_bias=w.get(prefix + "out_proj.bias"))

    def new_state(self, *batch: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zero state ``[*batch, inner, k - 1]`` (a sequence before its first token)."""
        return self.taps.new_zeros(*batch, self.inner, self.kernel_size - 1, dtype=dtype)


def _check_taps(taps: torch.Tensor, channels: int, what: str) -> None:
    if taps.dim() != 2 or taps.shape[1] < 1:
        raise ValueError(f"{what}: taps must be [channels, kernel_size], got {list(taps.shape)}")
    if taps.shape[0] != channels:
        raise ValueError(f"{what}: the input has {channels} channels but taps has {taps.shape[0]} rows")


def short_conv(u: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None = None,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one sequence's new tokens.

    Args:
        u: ``[t, channels]`` (t >= 1), the new tokens in order.
        taps: ``[channels, k]``, oldest input first.
        bias: ``[channels]`` or None (added to every output).
        state: ``[channels, k - 1]``, the inputs just before ``u`` (oldest first); None = the sequence
            starts here (zeros, as the checkpoint's zero padding).

    Returns ``(out [t, channels], new_state [channels, k - 1])``: the new state holds the last ``k - 1``
    inputs (zeros where the sequence is shorter). Computed in ``u``'s dtype; ``state`` is not modified.
    """
    if u.dim() != 2 or u.shape[0] < 1:
        raise ValueError(f"short_conv: u must be [tokens >= 1, channels], got {list(u.shape)}")
    t, channels = u.shape
    _check_taps(taps, channels, "short_conv")
    k = taps.shape[1]
    if state is None:
        before = u.new_zeros(k - 1, channels)
    elif tuple(state.shape) != (channels, k - 1):
        raise ValueError(f"short_conv: state must be [channels, k - 1] = {[channels, k - 1]}, "
                         f"got {list(state.shape)}")
    else:
        before = state.to(u.dtype).transpose(0, 1)
    padded = torch.cat([before, u])                      # [k - 1 + t, channels]; padded[i + k - 1] is u[i]
    taps = taps.to(u.dtype)
    out = sum(taps[:, j] * padded[j:j + t] for j in range(k))   # k shifted copies: k is tiny (3)
    if bias is not None:
        out = out + bias.to(u.dtype)
    return out, padded[t:].transpose(0, 1).contiguous()  # the last k - 1 inputs


def short_conv_step(u: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
                    state: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: ``u [batch, channels]``, ``state [batch, channels, k - 1]``.

    Returns ``out [batch, channels]`` and shifts ``u`` into ``state`` **in place** (oldest input out).
    """
    if u.dim() != 2:
        raise ValueError(f"short_conv_step: u must be [batch, channels], got {list(u.shape)}")
    _check_taps(taps, u.shape[1], "short_conv_step")
    k = taps.shape[1]
    if tuple(state.shape) != (u.shape[0], u.shape[1], k - 1):
        raise ValueError(f"short_conv_step: state must be [batch, channels, k - 1] = "
                         f"{[u.shape[0], u.shape[1], k - 1]}, got {list(state.shape)}")
    window = torch.cat([state.to(u.dtype), u.unsqueeze(-1)], dim=-1)    # [batch, channels, k], newest last
    out = (window * taps.to(u.dtype)).sum(-1)
    if bias is not None:
        out = out + bias.to(u.dtype)
    state.copy_(window[..., 1:])
    return out


def _gate_and_project(x: torch.Tensor, w: BaseConvWeights, convolve) -> torch.Tensor:
    z = F.linear(x, w.in_proj, w.in_proj_bias)
    if z.shape[-1] != 2 * w.inner:
        raise ValueError(f"BaseConv: in_proj gives {z.shape[-1]} channels, expected 2 * {w.inner}")
    u, g = z.split(w.inner, dim=-1)          # the first half is convolved, the second half gates it
    return F.linear(F.silu(convolve(u)) * g, w.out_proj, w.out_proj_bias)


def base_conv_block(x: torch.Tensor, w: BaseConvWeights,
                    state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer over one sequence's new tokens: ``x [t, hidden]`` -> ``(out [t, hidden], new_state)``.

    ``state`` as in :func:`short_conv` (None: the prompt starts the sequence)."""
    new_state = []

    def convolve(u):
        out, s = short_conv(u, w.taps, w.conv_bias, state)
        new_state.append(s)
        return out

    return _gate_and_project(x, w, convolve), new_state[0]


def base_conv_block_step(x: torch.Tensor, w: BaseConvWeights, state: torch.Tensor) -> torch.Tensor:
    """One token per sequence: ``x [batch, hidden]`` -> ``[batch, hidden]``; ``state [batch, inner, k - 1]``
    is updated in place."""
    return _gate_and_project(x, w, lambda u: short_conv_step(u, w.taps, w.conv_bias, state))
