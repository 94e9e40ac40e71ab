"""The KV cache of one sequence: keys and values of every token seen, per layer.

Version 0 is contiguous: one preallocated ``[capacity, kv_heads, head_dim]`` buffer per layer for K
and for V. Lesson 03 replaces it with a paged cache (fixed-size blocks from a shared pool); the model
only calls :meth:`append` and :meth:`get`, so the swap touches this file alone.
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

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of all cached keys and values of ``layer``: ``[num_cached, kv_heads, head_dim]`` each."""
        n = self.lengths[layer]
        return self.keys[layer, :n], self.values[layer, :n]
