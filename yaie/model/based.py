"""Based models (lesson 08): Taylor linear attention layers beside exact sliding-window attention layers.

A Based model is a Llama decoder (:class:`yaie.model.llama.LlamaModel`: the same norms, MLP and weight
names) whose ``config.json`` lists ``"based_layers"``: those layers use Based linear attention, the others
exact softmax attention over the last ``"sliding_window"`` tokens (with RoPE). The linear layers recall
over the whole context through a fixed-size state; the window layers keep the last few tokens exact.

A Based layer projects each token to ``q, k [heads, 16]`` (``q_proj``/``k_proj`` have
``heads * based_feature_dim`` rows; no RoPE) and ``v [heads, head_dim]``, and computes
``out_i = sum_j w_ij v_j / sum_j w_ij`` with ``w = 1 + s + s^2/2``, ``s = q.k / 4``, over ``j <= i``.

The per-sequence state lives in the ``cache`` that :meth:`BasedModel.forward` is given: rows of a batched
state for serving (:class:`yaie.model.based_rows.BasedRows`) or one sequence's
(:class:`yaie.model.based_rows.BasedCache`). The public Based checkpoints add a third layer kind,
``config.based_conv_layers``: BaseConv, a gated short convolution (:mod:`yaie.model.base_conv`).
"""

from __future__ import annotations

import dataclasses

import torch

from yaie import ops
from yaie.model import base_conv
from yaie.model.llama import LayerWeights, LlamaModel

class BasedModel(LlamaModel):
    """A Llama decoder whose ``config.based_layers`` run Based linear attention (see the module docstring)."""

    def _layer(self, w: dict[str, torch.Tensor], n: int) -> LayerWeights:
        if n not in self.config.based_conv_layers:
            return super()._layer(w, n)
        # A BaseConv layer (public Based checkpoints): norms and MLP as a Llama layer's, no attention
        # weights (None), the convolution's weights beside them (yaie/model/base_conv.py).
        p = f"model.layers.{n}.self_attn."
        layer = super()._layer({**w, **{p + f"{x}_proj.weight": None for x in "qkvo"}}, n)
        return dataclasses.replace(layer, conv=base_conv.BaseConvWeights.from_weights(w, f"model.layers.{n}.conv."))

    def _attention_block(self, layer: LayerWeights, n: int, h: torch.Tensor, positions: torch.Tensor,
                         cache) -> torch.Tensor:
        cfg = self.config
        if n in cfg.based_conv_layers:
            return cache.convolve(n, h, layer.conv)          # BaseConv: a constant-size state per sequence
        if n not in cfg.based_layers:
            return super()._attention_block(layer, n, h, positions, cache)   # RoPE + sliding-window attention
        heads, feat, d = cfg.num_heads, cfg.based_feature_dim, cfg.head_dim
        # ops.linear: cuBLAS, or for one row on CUDA lesson 02's one-row kernel (as the other layers' products).
        q, k, v = ops.linear(h, layer.qkv, layer.qkv_bias).split([heads * feat, heads * feat, heads * d], dim=-1)
        out = cache.attend_linear(n, q.reshape(-1, heads, feat), k.reshape(-1, heads, feat), v.reshape(-1, heads, d))
        return ops.linear(out.reshape(-1, heads * d), layer.o, layer.o_bias)


def based_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Based attention of one sequence in the quadratic form: ``q, k [t, heads, 16]``, ``v [t, heads, d]``
    -> ``[t, heads, d]``, in float32 (float64 for float64 inputs). For checks (the engine never builds the
    ``t x t`` weights)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = (x.to(compute).transpose(0, 1) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    w = (1 + s + 0.5 * s * s).tril()
    return ((w @ v) / w.sum(-1, keepdim=True)).transpose(0, 1)
