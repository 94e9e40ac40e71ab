"""The contiguous KV cache of ONE sequence: keys and values of every token seen, per layer.

The engine keeps its KV in lesson 03's paged cache (:mod:`yaie.model.paged`). This contiguous cache is
the simplest thing the model can run against: one preallocated
``[capacity, kv_heads, head_dim]`` buffer per layer for K and for V, attention by lesson 01. Tests and
the GPU checks use it to get one sequence's logits (compared with transformers') without a scheduler.
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.lengths = [0] * num_layers    # tokens stored, per layer (a forward pass fills layer by layer)
        self.capacity = capacity

    @classmethod
    def for_model(cls, config, capacity: int, dtype, device) -> "ContiguousKVCache":
        return cls(config.num_layers, capacity, config.num_kv_heads, config.head_dim, dtype, device)

    def __len__(self) -> int:
        """Tokens cached (in the last layer, i.e. by completed forward passes)."""
        return self.lengths[-1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [num_tokens, kv_heads, head_dim]`` after the tokens already in ``layer``."""
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[0]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} tokens do not fit in {self.capacity}")
        self.keys[layer, start:end] = k
        self.values[layer, start:end] = v
        self.lengths[layer] = end

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        """What the model calls per layer: append ``k, v``, then attend ``q`` over the whole context."""
        from yaie import ops
        self.append(layer, k, v)
        keys, values = self.get(layer)
        return ops.attention(q, keys, values, sliding_window=sliding_window)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of all cached keys and values of ``layer``: ``[num_cached, kv_heads, head_dim]`` each."""
        n = self.lengths[layer]
        return self.keys[layer, :n], self.values[layer, :n]
