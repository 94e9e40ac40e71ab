"""Based models (lesson 08): Taylor linear attention layers beside exact sliding-window attention layers.

A Based model here is a Llama decoder (:class:`yaie.model.llama.LlamaModel`: the same norms, MLP and
weight names) whose ``config.json`` lists ``"based_layers"``: those layers use Based linear attention,
the others exact softmax attention over the last ``"sliding_window"`` tokens (with RoPE), the pairing
of the Based architecture (Arora et al., 2024): the linear layers recall over the whole context
through a fixed-size state, the window layers keep the last few tokens exact.

A Based layer projects each token to ``q, k [heads, 16]`` (``q_proj``/``k_proj`` have
``heads * based_feature_dim`` rows; no RoPE) and ``v [heads, head_dim]``, and computes
``out_i = sum_j w_ij v_j / sum_j w_ij`` with ``w = 1 + s + s^2/2``, ``s = q.k / 4``, over ``j <= i``.

Serving keeps **constant memory per sequence** (:class:`BasedCache`):

* Based layers: the state ``[heads, 273, head_dim]`` + ``[heads, 273]`` (float32). The prompt runs
  through lesson 08's prefill (:func:`based_prefill`: the chunked kernel, or the quadratic tile kernel
  for prompts of up to 2048 tokens; on a CPU its PyTorch twin ``based_chunked_reference``, the
  interpreter being too slow for an engine), which returns the state;
  each generated token updates it with :func:`based_decode_step`.
* Window layers: a ring of the last ``window`` keys and values; attention through :func:`yaie.ops.attention`
  (lesson 01's kernel, the window as a mask), the prompt in blocks of queries so no ``n x n`` matrix is built.

The engine (:class:`yaie.engine.llm.LLM`) hands Based models to :func:`run_based`: one sequence at a time,
each with its own :class:`BasedCache`.
"""

from __future__ import annotations

import torch

from yaie import ops
from yaie.model.llama import LayerWeights, LlamaModel, _linear

LESSON = 8
PREFILL_BLOCK = 1024       # window-layer prompt attention: queries per block


def _lesson():
    # Through ops, so an unfinished stub falls back to the reference in auto mode, as everywhere else.
    return ops.LessonCalls(LESSON)


class BasedModel(LlamaModel):
    """A Llama decoder whose ``config.based_layers`` run Based linear attention (see the module docstring)."""

    def _attention_block(self, layer: LayerWeights, n: int, h: torch.Tensor, positions: torch.Tensor,
                         cache) -> torch.Tensor:
        cfg = self.config
        if n not in cfg.based_layers:
            return super()._attention_block(layer, n, h, positions, cache)   # RoPE + sliding-window attention
        heads, feat, d = cfg.num_heads, cfg.based_feature_dim, cfg.head_dim
        q, k, v = _linear(h, layer.qkv, layer.qkv_bias).split([heads * feat, heads * feat, heads * d], dim=-1)
        out = cache.attend_linear(n, q.reshape(-1, heads, feat), k.reshape(-1, heads, feat), v.reshape(-1, heads, d))
        return _linear(out.reshape(-1, heads * d), layer.o, layer.o_bias)


def based_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Based attention of one sequence in the quadratic form, float32: ``q, k [t, heads, 16]``,
    ``v [t, heads, d]`` -> ``[t, heads, d]``. For checks (the engine never builds the ``t x t`` weights)."""
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    w = (1 + s + 0.5 * s * s).tril()
    return ((w @ v) / w.sum(-1, keepdim=True)).transpose(0, 1)


class BasedCache:
    """What one sequence keeps between steps, for every layer: a Based state or a window of keys/values.

    ``attend`` (window layers) and ``attend_linear`` (Based layers) are what :class:`BasedModel` calls.
    ``use_kernels``: the prompt of a Based layer through lesson 08's Triton kernel (default: on CUDA).
    """

    def __init__(self, config, device: torch.device | str, use_kernels: bool | None = None):
        self.config = config
        self.device = torch.device(device)
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.tokens = [0] * config.num_layers

    def __len__(self) -> int:
        """Tokens read (by completed forward passes)."""
        return self.tokens[-1]

    def nbytes(self) -> int:
        """Bytes held for this sequence: the Based states and the windows of keys and values."""
        tensors = [t for state in self.states.values() for t in state] + list(self.keys.values()) + \
            list(self.values.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        """A window layer: ``q [t, heads, d]``, ``k, v [t, kv_heads, d]`` -> ``[t, heads, d]``; keeps the last
        ``sliding_window`` keys and values."""
        if sliding_window is None:
            raise ValueError(f"layer {layer} of a Based model must be a Based layer or a sliding-window layer")
        w = int(sliding_window)
        old_k = self.keys.get(layer, k[:0])
        old_v = self.values.get(layer, v[:0])
        keys, values = torch.cat([old_k, k]), torch.cat([old_v, v])
        first_new = old_k.shape[0]                       # keys[first_new + i] is new token i
        outs = []
        for start in range(0, q.shape[0], PREFILL_BLOCK):
            end = min(start + PREFILL_BLOCK, q.shape[0])
            lo = max(0, first_new + start - (w - 1))     # the first key the block's first query sees
            outs.append(ops.attention(q[start:end], keys[lo:first_new + end], values[lo:first_new + end],
                                      sliding_window=w))
        self.keys[layer], self.values[layer] = keys[-w:].clone(), values[-w:].clone()
        self.tokens[layer] += q.shape[0]
        return torch.cat(outs)

    def attend_linear(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A Based layer: ``q, k [t, heads, 16]``, ``v [t, heads, d]`` -> ``[t, heads, d]``; updates the state."""
        based = _lesson()
        state = self.states.get(layer)
        if state is None:
            qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, k, v))     # [1, heads, t, .] views
            if self.use_kernels:
                out, state = based.based_prefill(qb, kb, vb)
            else:
                out, state = based.based_chunked_reference(qb, kb, vb)
            self.states[layer] = based.BasedState(*state)
            out = out[0].transpose(0, 1)
        else:
            outs = [based.based_decode_step(q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), state)
                    for i in range(q.shape[0])]      # one token at a time: [1, heads, .] as batch 1
            out = torch.cat(outs)
        self.tokens[layer] += q.shape[0]
        return out.to(q.dtype)


def run_based(llm, prompt_ids: list[list[int]], params: list):
    """The engine's generation loop for Based models: events ``(request, text piece, its _Text)`` as
    :meth:`yaie.engine.llm.LLM._run` yields them. Sequences run one after another, each with its own
    constant-size :class:`BasedCache`; ``llm.last_caches`` keeps them (for tests and memory figures)."""
    from yaie.engine.sequential import run_one_at_a_time

    return run_one_at_a_time(llm, prompt_ids, params, lambda: BasedCache(llm.config, llm.device))
