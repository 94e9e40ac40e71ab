"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2), written for inference.

Layout: hidden states are token-major ``[num_tokens, hidden]``; queries, keys and values are
``[num_tokens, heads, head_dim]``. The matrix products are PyTorch's (``x @ W.T``, cuBLAS), except for
one row (a batch-1 decode step) on CUDA, where the reference's lesson 02 Triton kernels do them with the
norm or the SwiGLU gate before them fused in (:func:`yaie.ops.add_rms_norm_linear` and its siblings), and the
MLP's gate/up product for 2 to 64 rows, with the SwiGLU gate after it fused in (:func:`yaie.ops.swiglu_mlp`); every
normalisation, rotary embedding and attention goes through :mod:`yaie.ops`, i.e. through the lesson
kernels, so the student's code is what runs.

One layer, in the pre-norm residual form that lets a fused "add + RMSNorm" kernel (lesson 02) do the
residual add and the next norm in one pass::

    h, residual = add_rms_norm(x, residual, input_norm)   # residual += x; h = norm(residual)
    q, k, v = split(h @ Wqkv.T)                            # one product for the three projections
    q, k = rope(q, k, positions)                           # (paged cache: one kernel with the next line)
    attn = cache.attend(layer, q, k, v)                    # store k, v; attend over the context
    x = attn @ Wo.T
    h, residual = add_rms_norm(x, residual, post_attention_norm)
    x = silu_and_mul(h @ Wgate_up.T) @ Wdown.T            # SwiGLU MLP (ops.swiglu_mlp, with the line above)

Tensor parallelism (:mod:`yaie.model.sharding`, :mod:`yaie.model.parallel`): in a group of N ranks the model
holds its rank's shard: its attention heads and KV heads, its slice of the MLP features and of the
vocabulary. ``x`` after the output and down products is a partial sum, added up by one all-reduce each; the
embedding is looked up in the rank's vocabulary rows and all-reduced; the logits are all-gathered. With one
rank those collectives do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from yaie import ops
from yaie.model import parallel
from yaie.model.config import ModelConfig, load_config
from yaie.model.loader import load_weights
from yaie.model.sharding import load_shard


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: torch.Tensor              # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor          # [2 * intermediate, hidden]: gate rows first, then up
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    sliding_window: int | None
    conv: object = None            # a Based checkpoint's BaseConv layer: its weights (yaie.model.base_conv)


def _cat(*tensors):
    return None if tensors[0] is None else torch.cat(tensors, dim=0)


class LlamaModel:
    """Weights plus the forward pass; the KV cache is passed in (see :mod:`yaie.model.contiguous_cache`).

    In a tensor-parallel group (:func:`yaie.model.parallel.world_size` > 1), ``weights`` are this rank's
    shard (:func:`yaie.model.sharding.load_shard`); ``num_heads`` and ``num_kv_heads`` are its own heads."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        world = parallel.world_size()
        self.num_heads, self.num_kv_heads = config.num_heads // world, config.num_kv_heads // world
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.vocab_start = parallel.rank() * self.embed.shape[0]     # the first vocabulary row held here
        self.layers = [self._layer(weights, n) for n in range(config.num_layers)]
        # RoPE tables for every position the model may see, built once by lesson 01 (task 1).
        self.cos, self.sin = ops.rope_cache(config.max_position_embeddings, config.head_dim, config.rope_theta,
                                            config.rope_scaling, device=self.device)

    def _layer(self, w: dict[str, torch.Tensor], n: int) -> LayerWeights:
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        get = w.get
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"], post_attention_norm=w[p + "post_attention_layernorm.weight"],
            qkv=_cat(w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]),
            qkv_bias=_cat(get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")),
            o=w[a + "o_proj.weight"], o_bias=get(a + "o_proj.bias"),
            gate_up=_cat(w[m + "gate_proj.weight"], w[m + "up_proj.weight"]),
            gate_up_bias=_cat(get(m + "gate_proj.bias"), get(m + "up_proj.bias")),
            down=w[m + "down_proj.weight"], down_bias=get(m + "down_proj.bias"),
            sliding_window=self.config.sliding_windows[n],
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, config: ModelConfig | None = None) -> "LlamaModel":
        """Load a Hugging Face folder. ``dtype=None``: float32 on the CPU (bf16/fp16 checkpoints are
        upcast: the CPU is slow and inexact in half precision), the stored dtype on a GPU. ``config``: the
        folder's :func:`load_config`, when the caller has read it already."""
        config = config or load_config(model_dir)
        device = torch.device(device)
        if dtype is None and device.type == "cpu":
            dtype = torch.float32
        world = parallel.world_size()
        if world > 1:
            return cls(config, load_shard(model_dir, config, parallel.rank(), world, dtype=dtype, device=device))
        return cls(config, load_weights(model_dir, config, dtype=dtype, device=device))

    def _attention_block(self, layer: LayerWeights, n: int, h: torch.Tensor, positions: torch.Tensor,
                         cache) -> torch.Tensor:
        """The attention half of layer ``n`` from its normalised input ``h``; returns its output projection."""
        return self._attention(layer, n, ops.linear(h, layer.qkv, layer.qkv_bias), positions, cache)

    def _attention(self, layer: LayerWeights, n: int, qkv: torch.Tensor, positions: torch.Tensor,
                   cache) -> torch.Tensor:
        """The attention half of layer ``n`` from its q, k, v projection ``qkv`` (this rank's heads); the
        output projection summed over the ranks."""
        cfg = self.config
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        # Views into the fused output; the lesson 02 RoPE kernel rotates in place through them.
        q = q.reshape(-1, self.num_heads, cfg.head_dim)
        k = k.reshape(-1, self.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, self.num_kv_heads, cfg.head_dim)
        # The cache stores k, v and runs attention: a PagedStep (the engine: lesson 03's blocks, lessons
        # 04/06 on CUDA; it rotates q, k itself, so the rotation, the cache write and, in a decode step, the
        # attention can be one kernel) or a ContiguousKVCache (one sequence, lesson 01; tests and logit checks).
        if hasattr(cache, "rope_and_attend"):
            attn = cache.rope_and_attend(n, q, k, v, self.cos, self.sin, positions, layer.sliding_window)
        else:
            q, k = ops.rope(q, k, self.cos, self.sin, positions)
            attn = cache.attend(n, q, k, v, layer.sliding_window)
        return parallel.all_reduce(ops.linear(attn.reshape(-1, q_size), layer.o, layer.o_bias))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Run a step's new tokens; returns the final hidden states ``[num_tokens, hidden]``.

        ``token_ids`` and ``positions`` are int64 ``[num_tokens]``. ``cache`` is either a
        :class:`yaie.model.paged.PagedStep` (the engine: several sequences, tokens packed as it says, slots
        already reserved) or a :class:`yaie.model.contiguous_cache.ContiguousKVCache` of one sequence whose
        ``positions`` continue it. The tokens' keys and values are stored in the cache.
        """
        eps = self.config.rms_norm_eps
        # Each norm goes with the product after it (ops.add_rms_norm_linear: one kernel for a batch-1 decode
        # step on CUDA, the two ops otherwise); a subclass with its own attention block gets the normalised h.
        fuse_qkv = type(self)._attention_block is LlamaModel._attention_block
        x = self.embed_tokens(token_ids)
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        residual = x
        for n, layer in enumerate(self.layers):
            if h is not None:
                x = self._attention_block(layer, n, h, positions, cache)
            else:
                qkv, residual = ops.add_rms_norm_linear(x, residual, layer.input_norm, eps, layer.qkv, layer.qkv_bias)
                x = self._attention(layer, n, qkv, positions, cache)
            x, residual = ops.swiglu_mlp(x, residual, layer.post_attention_norm, eps, layer.gate_up,
                                         layer.gate_up_bias, layer.down, layer.down_bias)
            x = parallel.all_reduce(x)
            if fuse_qkv and n + 1 < len(self.layers):
                h = None                      # the next layer's qkv product does this add + norm
            else:
                next_norm = self.layers[n + 1].input_norm if n + 1 < len(self.layers) else self.final_norm
                h, residual = ops.add_rms_norm(x, residual, next_norm, eps)
        return h

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``token_ids`` ``[num_tokens, hidden]``. In a tensor-parallel group each rank
        looks up the ids in its vocabulary rows (zeros for the others) and one all-reduce adds them up."""
        if parallel.world_size() == 1:
            return F.embedding(token_ids, self.embed)
        rows = self.embed.shape[0]
        local = token_ids - self.vocab_start
        held = ((local >= 0) & (local < rows)).unsqueeze(1).to(self.dtype)
        return parallel.all_reduce(F.embedding(local.clamp(0, rows - 1), self.embed) * held)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output scores in float32, ``[num_tokens, vocab_size]`` (every rank's vocabulary slice gathered)."""
        scores = ops.linear(hidden, self.lm_head)
        if parallel.world_size() > 1:
            scores = parallel.all_gather_last(scores)[:, :self.config.vocab_size].contiguous()
        return scores.float()
