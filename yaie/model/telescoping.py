"""Telescoping-attention models (lesson 07): a Llama decoder whose attention sees a constant-size cache.

The weights and the layer are the Llama ones (:class:`yaie.model.llama.LlamaModel`); only the cache
differs. A model is telescoping when its ``config.json`` holds ``"telescoping_capacity": c``: every layer
attends, at every position, to ``c`` entries per KV head (recent tokens exact, older spans averaged, the
spans doubling with distance; an entry averaging ``s`` tokens gets ``+ log(s)`` on its score). The
merge rule and the kernels are lesson 07's, reached through the switch, so the student's code runs.

* Prefill (a sequence's first tokens) runs the *parallel* form: every position's cache read through the
  index map by the indexed matmul kernels (on a CPU: their gather references). The cache the sequence
  keeps afterwards is the last position's row of the map, read from the buffer of span averages.
* Decode runs the *recurrent* form: append the new token's key and value, merge one pair when over
  ``c`` (:func:`telescoping_step`), attend over the ``c`` entries. The state per sequence is
  ``layers x 2 x c x kv_heads x head_dim`` floats plus the sizes, whatever the length generated.

The engine serves a telescoping model with one :class:`TelescopingKVCache` per sequence
(:class:`yaie.engine.row_runner.SequenceRows`), each sequence through the same Llama forward.
"""

from __future__ import annotations

import torch

from yaie import ops

LESSON = 7


def _lesson():
    # Through ops, so an unfinished stub falls back to the reference in auto mode, as everywhere else.
    return ops.LessonCalls(LESSON)


def attend_entries(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sizes: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One position's attention over its cache. q ``[heads, d]``; keys, values ``[k, kv_heads, d]``;
    sizes int64 ``[k]`` (any device). Float32 math; returns ``[heads, d]`` float32."""
    kv_heads = keys.shape[1]
    group = q.shape[0] // kv_heads
    qf = q.float().reshape(kv_heads, group, -1)
    bias = sizes.to(torch.float32).log()
    if bias.device != keys.device:
        # Pinned and non_blocking: the copy joins the GPU's queue of kernels instead of waiting for it
        # to drain (sizes stay on the CPU for the merge rule; a plain copy would stall every layer).
        bias = bias.pin_memory().to(keys.device, non_blocking=True) if keys.is_cuda else bias.to(keys.device)
    scores = torch.einsum("hed,khd->hek", qf, keys.float()) * scale + bias
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hek,khd->hed", weights, values.float()).reshape(q.shape[0], -1)


class TelescopingKVCache:
    """The constant-size cache of one sequence, for every layer: ``attend`` is what the Llama layer calls.

    Entries are kept in float32 (the merges average averages; bf16 would round at every merge).
    """

    def __init__(self, config, capacity: int, device: torch.device | str):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.num_layers = config.num_layers
        self.scale = config.head_dim ** -0.5
        self.device = torch.device(device)
        empty = torch.zeros(0, config.num_kv_heads, config.head_dim, dtype=torch.float32, device=self.device)
        self.keys = [empty] * self.num_layers
        self.values = [empty] * self.num_layers
        # Sizes stay on the CPU: the merge rule reads them there every step, without a device sync.
        self.sizes = [torch.zeros(0, dtype=torch.int64)] * self.num_layers
        self.tokens = [0] * self.num_layers
        self._prompt_spans: tuple[int, torch.Tensor, torch.Tensor] | None = None   # (t, starts, ends), all layers

    def __len__(self) -> int:
        """Tokens read (by completed forward passes), not entries held."""
        return self.tokens[-1]

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (keys, values, sizes of every layer)."""
        return sum(t.numel() * t.element_size() for group in (self.keys, self.values, self.sizes) for t in group)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        """Read the new tokens' ``k, v [t, kv_heads, d]`` into the cache; attention output ``[t, heads, d]``."""
        if sliding_window is not None:
            raise ValueError("telescoping models have no sliding-window layers")
        if self.tokens[layer] == 0 and k.shape[0] > 1:
            out = self._prefill(layer, q, k, v)
        else:
            out = torch.stack([self._decode(layer, q[i], k[i], v[i]) for i in range(k.shape[0])])
        self.tokens[layer] += k.shape[0]
        return out.to(q.dtype)

    def _prefill(self, layer: int, q, k, v) -> torch.Tensor:
        """The parallel form over the prompt, then keep the last position's cache."""
        tele = _lesson()
        t = k.shape[0]
        out = tele.telescoping_attention(q[None], k[None], v[None], self.capacity, scale=self.scale,
                                         use_kernels=q.device.type == "cuda")[0]
        span_starts, span_ends = self._last_position_spans(t)
        self.keys[layer] = tele.telescoping_buffer(k[None].float(), span_starts, span_ends)[0]
        self.values[layer] = tele.telescoping_buffer(v[None].float(), span_starts, span_ends)[0]
        self.sizes[layer] = (span_ends - span_starts).cpu()
        return out

    def _last_position_spans(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token spans ``[start, end)`` of the cache entries after ``t`` prompt tokens, oldest first. The same
        for every layer: the index map (a Python loop over positions) is built once per prompt."""
        if self._prompt_spans is None or self._prompt_spans[0] != t:
            index_map, starts, ends = _lesson().telescoping_index_map(t, self.capacity)
            rows = index_map[t - 1, :min(t, self.capacity)].long()
            self._prompt_spans = (t, starts[rows], ends[rows])
        return self._prompt_spans[1], self._prompt_spans[2]

    def _decode(self, layer: int, q, k, v) -> torch.Tensor:
        """The recurrent form: one token in (one merge when full), attention over the entries."""
        tele = _lesson()
        before = self.sizes[layer]
        self.keys[layer], self.sizes[layer] = tele.telescoping_step(self.keys[layer], before, k.float(),
                                                                    self.capacity)
        self.values[layer], _ = tele.telescoping_step(self.values[layer], before, v.float(), self.capacity)
        return attend_entries(q, self.keys[layer], self.values[layer], self.sizes[layer], self.scale)
