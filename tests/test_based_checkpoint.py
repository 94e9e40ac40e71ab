"""Lesson 08: the public Based checkpoints' format (github.com/HazyResearch/based; ``hazyresearch/based-360m``).

No network here, so every test writes a tiny synthetic checkpoint in that format (config.json shaped like
the published training config, tensors under the original names, random weights) and checks YAIE against
an independent float64 model of the format, written below from the original project's architecture:

* per layer ``x += mixer(rms_norm(x, norm1))``, then ``x += fc2(a * silu(b))`` with ``a, b = fc1(rms_norm(x, norm2))``
  halves in that order; a final ``transformer.ln_f``; ``lm_head`` tied to the word embedding by default;
* BaseConv (the layers in neither list): ``u, g = in_proj(x)``; ``silu(causal depthwise conv1d(u)) * g``;
  ``out_proj``;
* LinearAttention (``alt_mixer_layers``): Taylor features ``[1, x / d^(1/4), (x x^T) / (sqrt 2 sqrt d)]``,
  ``d = feature_map.input_dim``, normalised by ``phi(q) . sum phi(k) + 1e-12``;
* SlidingAttention (``alt_mixer_2_layers``): ``Wqkv`` rows ``(3, heads, head_dim)``, non-interleaved RoPE
  on q and k, softmax over keys ``i - window_size // 2 <= j <= i`` (flash-attn ``window_size=(w // 2, 0)``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from yaie.model import base_conv
from yaie.model.config import ModelLoadError, load_config

HIDDEN, HEADS, INNER, FEATURE, WINDOW_SIZE, VOCAB, PAD = 32, 2, 48, 16, 8, 61, 8


# ----------------------------------------------------------------------------- a synthetic checkpoint
def public_config(layers: int, linear: list[int], sliding: list[int], **overrides) -> dict:
    """config.json as the published training config writes it (reference/based-360m.yaml, tiny sizes)."""
    cfg = {
        "_target_": "based.models.gpt.GPT2MixerConfig", "vocab_size": VOCAB, "pad_vocab_size_multiple": PAD,
        "n_embd": HIDDEN, "n_head": HEADS, "n_layer": layers, "n_inner": INNER, "n_positions": 2048,
        "max_position_embeddings": 0, "layer_norm_epsilon": 1e-5, "rms_norm": True, "residual_in_fp32": True,
        "activation_function": "swiglu", "rotary_emb_fraction": 1, "rotary_emb_base": 10000.0,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False, "qkv_proj_bias": False, "out_proj_bias": False,
        "alt_mixer_layers": linear, "alt_mixer_2_layers": sliding,
        "mixer": {"_target_": "based.models.mixers.convolution.BaseConv", "l_max": 2048, "use_bias": True,
                  "expand_proj": 4, "kernel_sizes": 3},
        "alt_mixer": {"_target_": "based.models.mixers.linear_attention.LinearAttention", "l_max": 2048,
                      "feature_dim": FEATURE, "num_heads": HEADS,
                      "feature_map": {"_target_": "based.models.mixers.linear_attention.TaylorExp",
                                      "input_dim": FEATURE}},
        "alt_mixer_2": {"_target_": "based.models.mixers.slide_attention.SlidingAttention",
                        "window_size": WINDOW_SIZE, "num_heads": HEADS, "causal": True},
    }
    cfg.update(overrides)
    return cfg


def public_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the original names and shapes (float32, as a checkpoint stores them)."""
    gen = torch.Generator().manual_seed(seed)
    h, inner = cfg["n_embd"], cfg["mixer"]["expand_proj"] * cfg["n_embd"] // 2
    rows = -(-cfg["vocab_size"] // cfg["pad_vocab_size_multiple"]) * cfg["pad_vocab_size_multiple"]

    def rand(*shape, scale=None):
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=gen) * scale

    embedding = rand(rows, h, scale=1.0)
    embedding[cfg["vocab_size"]:] = 0        # the padding rows: no token, logit 0 (trained ones end up far below)
    t = {"transformer.embeddings.word_embeddings.weight": embedding,
         "transformer.ln_f.weight": 1 + 0.1 * rand(h, scale=1.0)}
    for n in range(cfg["n_layer"]):
        p = f"transformer.layers.{n}."
        m = p + "mixer."
        t.update({p + "norm1.weight": 1 + 0.1 * rand(h, scale=1.0), p + "norm2.weight": 1 + 0.1 * rand(h, scale=1.0),
                  p + "mlp.fc1.weight": rand(2 * cfg["n_inner"], h), p + "mlp.fc2.weight": rand(h, cfg["n_inner"])})
        if n in cfg["alt_mixer_2_layers"]:
            t.update({m + "Wqkv.weight": rand(3 * h, h), m + "out_proj.weight": rand(h, h)})
        elif n in cfg["alt_mixer_layers"]:
            feat = HEADS * FEATURE
            t.update({m + "proj_q.weight": rand(feat, h), m + "proj_k.weight": rand(feat, h),
                      m + "proj_v.weight": rand(h, h), m + "out_proj.weight": rand(h, h)})
        else:
            t.update({m + "in_proj.weight": rand(2 * inner, h), m + "in_proj.bias": rand(2 * inner, scale=0.1),
                      m + "conv.conv.weight": rand(inner, 1, 3, scale=0.6),
                      m + "out_proj.weight": rand(h, inner), m + "out_proj.bias": rand(h, scale=0.1)})
    return t


def write_checkpoint(path, cfg: dict, tensors: dict, fmt: str = "safetensors") -> None:
    """``safetensors``: the embedding saved once as ``lm_head.weight`` (tied, as a safetensors export keeps
    one name of shared tensors). ``bin``: ``pytorch_model.bin`` with the training code's ``model.`` prefix."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        out = dict(tensors)
        out["lm_head.weight"] = out.pop("transformer.embeddings.word_embeddings.weight")
        save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    else:
        torch.save({"model." + k: v for k, v in tensors.items()}, path / "pytorch_model.bin")


# ----------------------------------------------------------------------------- the float64 reference model
def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_conv(x, t, m):
    inner = t[m + "in_proj.weight"].shape[0] // 2
    u, g = F.linear(x, t[m + "in_proj.weight"], t[m + "in_proj.bias"]).split(inner, -1)
    conv = t[m + "conv.conv.weight"]
    c = F.conv1d(u.T[None], conv, padding=conv.shape[-1] - 1, groups=inner)[0, :, :x.shape[0]].T
    return F.linear(F.silu(c) * g, t[m + "out_proj.weight"], t[m + "out_proj.bias"])


def taylor(x, d):
    outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)
    return torch.cat([torch.ones_like(x[..., :1]), x / d ** 0.25, outer / (math.sqrt(2) * math.sqrt(d))], -1)


def ref_linear(x, t, m, d=FEATURE):
    n = x.shape[0]
    q = F.linear(x, t[m + "proj_q.weight"]).view(n, HEADS, -1).transpose(0, 1)
    k = F.linear(x, t[m + "proj_k.weight"]).view(n, HEADS, -1).transpose(0, 1)
    v = F.linear(x, t[m + "proj_v.weight"]).view(n, HEADS, -1).transpose(0, 1)
    fq, fk = taylor(q, d), taylor(k, d)
    y = (fq @ fk.transpose(-1, -2)).tril() @ v
    y = y / ((fq * fk.cumsum(1)).sum(-1, keepdim=True) + 1e-12)
    return F.linear(y.transpose(0, 1).reshape(n, -1), t[m + "out_proj.weight"])


def rope(x, base):          # x [heads, n, dim]; rotate the two halves (non-interleaved)
    dim, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :dim // 2], x[..., dim // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def ref_sliding(x, t, m, base, window_size):
    n = x.shape[0]
    qkv = F.linear(x, t[m + "Wqkv.weight"]).view(n, 3, HEADS, -1).permute(1, 2, 0, 3)   # [3, heads, n, d]
    q, k, v = rope(qkv[0], base), rope(qkv[1], base), qkv[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    scores = scores.masked_fill(~((j <= i) & (i - j <= window_size // 2)), float("-inf"))
    y = scores.softmax(-1) @ v
    return F.linear(y.transpose(0, 1).reshape(n, -1), t[m + "out_proj.weight"])


def reference_logits(cfg: dict, tensors: dict, ids: torch.Tensor) -> torch.Tensor:
    """The whole public-format model over a sequence, float64, no cache: ``[n, padded vocab]``."""
    t = {k: v.double() for k, v in tensors.items()}
    eps, inner = cfg["layer_norm_epsilon"], cfg["n_inner"]
    x = t["transformer.embeddings.word_embeddings.weight"][ids]
    for n in range(cfg["n_layer"]):
        p = f"transformer.layers.{n}."
        h = rms_norm(x, t[p + "norm1.weight"], eps)
        if n in cfg["alt_mixer_2_layers"]:
            x = x + ref_sliding(h, t, p + "mixer.", cfg["rotary_emb_base"], cfg["alt_mixer_2"]["window_size"])
        elif n in cfg["alt_mixer_layers"]:
            x = x + ref_linear(h, t, p + "mixer.")
        else:
            x = x + ref_conv(h, t, p + "mixer.")
        a, b = F.linear(rms_norm(x, t[p + "norm2.weight"], eps), t[p + "mlp.fc1.weight"]).split(inner, -1)
        x = x + F.linear(a * F.silu(b), t[p + "mlp.fc2.weight"])
    x = rms_norm(x, t["transformer.ln_f.weight"], eps)
    return x @ t["transformer.embeddings.word_embeddings.weight"].T


# ----------------------------------------------------------------------------- config.json
def test_config_json_of_the_public_format_is_read(tmp_path):
    cfg = public_config(5, linear=[1], sliding=[2])
    write_checkpoint(tmp_path, cfg, public_tensors(cfg, seed=0))
    c = load_config(tmp_path)
    assert c.checkpoint_format == "based_gpt" and c.model_type == "based"
    assert c.based_layers == [1] and c.based_conv_layers == [0, 3, 4]
    # flash-attn window (w // 2, 0): a query sees itself and w // 2 earlier tokens
    assert c.sliding_windows == [None, None, WINDOW_SIZE // 2 + 1, None, None]
    assert c.vocab_size == 64 and c.hidden_size == HIDDEN and c.intermediate_size == INNER
    assert c.num_heads == c.num_kv_heads == HEADS and c.head_dim == HIDDEN // HEADS
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5 and c.based_feature_dim == FEATURE
    assert c.based_gpt["conv_inner"] == 2 * HIDDEN and c.based_gpt["conv_kernel"] == 3


@pytest.mark.parametrize("change, message", [
    ({"rms_norm": False}, "RMSNorm"),
    ({"activation_function": "gelu_new"}, "swiglu"),
    ({"rotary_emb_fraction": 0.5}, "rotary"),
    ({"mixer": None}, "full attention"),
    ({"alt_mixer_layers": [7]}, "outside"),
])
def test_config_json_settings_this_engine_does_not_run_are_refused(tmp_path, change, message):
    cfg = public_config(3, linear=[1], sliding=[2], **change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_config(tmp_path)


def test_config_json_with_linear_heads_unlike_the_window_heads_is_refused(tmp_path):
    cfg = public_config(3, linear=[1], sliding=[2])
    cfg["alt_mixer"]["num_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_heads"):
        load_config(tmp_path)


# ----------------------------------------------------------------------------- the BaseConv layer kind
@pytest.mark.parametrize("length", [1, 2, 3, 17])
def test_short_conv_equals_conv1d_and_keeps_the_last_inputs(length):
    gen = torch.Generator().manual_seed(length)
    u, taps, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((length, 6), (6, 3), (6,)))
    out, state = base_conv.short_conv(u, taps, bias)
    expected = F.conv1d(u.T[None], taps[:, None], bias, padding=2, groups=6)[0, :, :length].T
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    last = torch.cat([torch.zeros(2, 6, dtype=torch.float64), u])[-2:].T   # zeros before the sequence
    assert state.shape == (6, 2) and torch.equal(state, last)


@pytest.mark.parametrize("prompt", [1, 2, 5])
def test_conv_layer_prefill_then_steps_equal_the_whole_sequence(prompt):
    """Prompt through base_conv_block, then one token at a time (two sequences batched through
    base_conv_block_step): the outputs equal one pass over the whole sequence (float64)."""
    gen = torch.Generator().manual_seed(prompt)
    h, inner, n = 8, 10, 9
    w = base_conv.BaseConvWeights(*(torch.randn(*s, generator=gen, dtype=torch.float64) for s in
                                    ((2 * inner, h), (2 * inner,), (inner, 3), (inner,), (h, inner), (h,))))
    xs = torch.randn(2, n, h, generator=gen, dtype=torch.float64)
    whole = torch.stack([base_conv.base_conv_block(x, w)[0] for x in xs])
    firsts, states = zip(*(base_conv.base_conv_block(x[:prompt], w) for x in xs))
    state = torch.stack(states)                              # [2, inner, k - 1], constant size
    steps = [base_conv.base_conv_block_step(xs[:, t], w, state) for t in range(prompt, n)]
    got = torch.cat([torch.stack(firsts), torch.stack(steps, dim=1)], dim=1)
    torch.testing.assert_close(got, whole, atol=1e-12, rtol=1e-12)
    assert state.shape == (2, inner, 2)
    # more than one token after a state (a chunked prompt) gives the same as well
    out, _ = base_conv.base_conv_block(xs[0, prompt:], w, states[0])
    torch.testing.assert_close(out, whole[0, prompt:], atol=1e-12, rtol=1e-12)


def test_conv_bad_input_is_a_value_error():
    taps = torch.randn(4, 3)
    with pytest.raises(ValueError, match="channels"):
        base_conv.short_conv(torch.randn(5, 6), taps)
    with pytest.raises(ValueError, match="state"):
        base_conv.short_conv(torch.randn(5, 4), taps, state=torch.zeros(4, 3))
    state = torch.zeros(2, 4, 2)
    with pytest.raises(ValueError, match="state"):
        base_conv.short_conv_step(torch.randn(3, 4), taps, None, state)
    assert not state.any()                                   # nothing written on a refusal


# ----------------------------------------------------------------------------- loading the weights
def test_loader_checks_names_and_shapes(tmp_path):
    from yaie.model.loader import load_weights

    cfg = public_config(3, linear=[1], sliding=[2])
    tensors = public_tensors(cfg, seed=1)
    broken = {k: v for k, v in tensors.items() if k != "transformer.layers.1.mixer.proj_k.weight"}
    write_checkpoint(tmp_path / "missing", cfg, broken)
    with pytest.raises(ModelLoadError, match="proj_k"):
        load_weights(tmp_path / "missing", load_config(tmp_path / "missing"))
    wrong = dict(tensors, **{"transformer.layers.0.mixer.conv.conv.weight": torch.randn(2 * HIDDEN, 1, 4)})
    write_checkpoint(tmp_path / "shape", cfg, wrong)
    with pytest.raises(ModelLoadError, match=r"conv.conv.weight.*\[64, 1, 4\]"):
        load_weights(tmp_path / "shape", load_config(tmp_path / "shape"))
    layernorm = dict(tensors, **{"transformer.ln_f.bias": torch.zeros(HIDDEN)})
    write_checkpoint(tmp_path / "ln", cfg, layernorm)
    with pytest.raises(ModelLoadError, match="LayerNorm"):
        load_weights(tmp_path / "ln", load_config(tmp_path / "ln"))


def test_loader_maps_onto_the_engine_layout(tmp_path):
    """fc1 = [value; gate] becomes gate_proj (second half) and up_proj (first half); Wqkv splits in q, k, v;
    the conv taps lose their middle dim; the tied embedding is read from lm_head.weight."""
    from yaie.model.loader import load_weights

    cfg = public_config(3, linear=[1], sliding=[2])
    t = public_tensors(cfg, seed=2)
    write_checkpoint(tmp_path, cfg, t)
    w = load_weights(tmp_path, load_config(tmp_path))
    fc1 = t["transformer.layers.2.mlp.fc1.weight"]
    assert torch.equal(w["model.layers.2.mlp.gate_proj.weight"], fc1[INNER:])
    assert torch.equal(w["model.layers.2.mlp.up_proj.weight"], fc1[:INNER])
    wqkv = t["transformer.layers.2.mixer.Wqkv.weight"]
    assert torch.equal(w["model.layers.2.self_attn.k_proj.weight"], wqkv[HIDDEN:2 * HIDDEN])
    assert torch.equal(w["model.layers.0.conv.conv.weight"], t["transformer.layers.0.mixer.conv.conv.weight"][:, 0])
    assert torch.equal(w["model.embed_tokens.weight"], t["transformer.embeddings.word_embeddings.weight"])
    assert "lm_head.weight" not in w


# ----------------------------------------------------------------------------- the model against the reference
def _yaie_model(path):
    from yaie.model.based import BasedModel

    return BasedModel.from_pretrained(path)   # float32 on the CPU (the window cache holds fp16/bf16/fp32)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_attention_layers_give_the_reference_logits(tmp_path, fmt, monkeypatch):
    """A checkpoint of linear and sliding-window layers only (the layer kinds the engine's Based model runs
    without BaseConv): prefill logits, then prefill + decode, against the float64 reference."""
    from yaie.model.based_rows import BasedCache
    from yaie.model.testing import single_thread

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    cfg = public_config(3, linear=[0, 2], sliding=[1])
    tensors = public_tensors(cfg, seed=3)
    write_checkpoint(tmp_path, cfg, tensors, fmt)
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(3))
    expected = reference_logits(cfg, tensors, ids)
    with single_thread():
        model = _yaie_model(tmp_path)
        got = model.logits(model.forward(ids, torch.arange(14), BasedCache(model.config, "cpu"))).double()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        cache, prompt = BasedCache(model.config, "cpu"), 5       # past the window (5) during decode
        steps = [model.logits(model.forward(ids[:prompt], torch.arange(prompt), cache))]
        for t in range(prompt, 14):
            steps.append(model.logits(model.forward(ids[t:t + 1], torch.arange(t, t + 1), cache)))
    torch.testing.assert_close(torch.cat(steps).double(), expected, atol=1e-4, rtol=1e-4)


def test_a_bin_file_that_is_not_a_state_dict_is_refused(tmp_path):
    from yaie.model.loader import load_weights

    cfg = public_config(3, linear=[1], sliding=[2])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        load_weights(tmp_path, load_config(tmp_path))


# ----------------------------------------------------------------------------- all three layer kinds
MIXED = dict(layers=5, linear=[1], sliding=[3])          # BaseConv in layers 0, 2 and 4


def test_all_layer_kinds_give_the_reference_logits(tmp_path, monkeypatch):
    """BaseConv, linear and sliding-window layers: prefill logits; prompt + one token at a time; prompt +
    a block of tokens + single tokens (each layer kind carries its state across calls)."""
    from yaie.model.based_rows import BasedCache
    from yaie.model.testing import single_thread

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    cfg = public_config(MIXED["layers"], linear=MIXED["linear"], sliding=MIXED["sliding"])
    tensors = public_tensors(cfg, seed=4)
    write_checkpoint(tmp_path, cfg, tensors)
    n = 16
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(4))
    expected = reference_logits(cfg, tensors, ids)
    with single_thread():
        model = _yaie_model(tmp_path)
        assert model.config.based_conv_layers == [0, 2, 4]
        got = model.logits(model.forward(ids, torch.arange(n), BasedCache(model.config, "cpu"))).double()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for cuts in ([2], [6, 11]):          # prompt of 2 (shorter than the conv's k - 1 = 2 + 1), blocks
            cache, start, outs = BasedCache(model.config, "cpu"), 0, []
            for end in [*cuts, *range(cuts[-1] + 1, n + 1)]:
                outs.append(model.logits(model.forward(ids[start:end], torch.arange(start, end), cache)))
                start = end
            torch.testing.assert_close(torch.cat(outs).double(), expected, atol=1e-4, rtol=1e-4)
        sizes = []
        for length in (4, 12):               # constant memory: the conv state is [inner, k - 1] per layer
            cache = BasedCache(model.config, "cpu")
            model.forward(ids[:length], torch.arange(length), cache)
            sizes.append(cache.nbytes())
        assert sizes[0] == sizes[1]


@pytest.mark.parametrize("fixed_buffers", [False, True])
def test_batched_serving_rows_give_the_reference_logits(tmp_path, monkeypatch, fixed_buffers):
    """Two sequences in the rows of one BasedRows (the engine's batched path; ``fixed_buffers``: the CUDA
    graphs' bucket-padded step run eagerly): every decode step's logits equal the reference's."""
    from yaie.model.based_rows import BasedRows
    from yaie.model.testing import single_thread

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    cfg = public_config(MIXED["layers"], linear=MIXED["linear"], sliding=MIXED["sliding"])
    tensors = public_tensors(cfg, seed=5)
    write_checkpoint(tmp_path, cfg, tensors)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (13, 11)]
    prompts = [3, 7]
    expected = [reference_logits(cfg, tensors, s) for s in seqs]
    with single_thread():
        model = _yaie_model(tmp_path)
        slots = BasedRows(model, 2, graphs=fixed_buffers, capture=False)
        for row, (seq, p) in enumerate(zip(seqs, prompts)):
            first = slots.prefill(row, seq[:p].tolist())
            torch.testing.assert_close(first[0].double(), expected[row][p - 1], atol=1e-4, rtol=1e-4)
        for step in range(4):
            pos = [p + step for p in prompts]
            logits = slots.decode([int(s[q]) for s, q in zip(seqs, pos)], pos).double()
            for row in range(2):
                torch.testing.assert_close(logits[row], expected[row][pos[row]], atol=1e-4, rtol=1e-4)


def test_the_engine_serves_a_public_format_checkpoint(tmp_path, monkeypatch):
    """LLM(folder) on the converted checkpoint (plus a tokenizer.json, which the published folders lack:
    they use GPT-2's): greedy generation picks the reference model's greedy tokens."""
    from yaie.engine import LLM, SamplingParams
    from yaie.model.testing import single_thread, write_tokenizer

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    cfg = public_config(MIXED["layers"], linear=MIXED["linear"], sliding=MIXED["sliding"])
    tensors = public_tensors(cfg, seed=6)
    write_checkpoint(tmp_path, cfg, tensors)
    write_tokenizer(tmp_path, VOCAB)
    prompts = [[5, 9, 17, 3, 40], [7, 8]]
    with single_thread():
        llm = LLM(tmp_path, device="cpu")
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(reference_logits(cfg, tensors, torch.tensor(ids))[-1].argmax()))
        assert out.token_ids == ids[len(prompt):]
