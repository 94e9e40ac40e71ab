"""The model configuration the engine needs, read from a Hugging Face ``config.json``.

One dataclass covers the Llama family: Llama 2 and 3 (rope scaling), Mistral (sliding window) and
Qwen2 (bias on the q/k/v projections). Both spellings of the RoPE settings are read: the older
``rope_theta`` + ``rope_scaling`` keys and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file and the problem."""


# architecture name in config.json -> model_type it implies
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False            # Qwen2; Llama with attention_bias
    o_bias: bool = False              # Llama with attention_bias
    mlp_bias: bool = False
    sliding_windows: list = field(default_factory=list)   # per layer: None or the window size
    bos_token_id: int | None = None
    eos_token_ids: list = field(default_factory=list)
    telescoping_capacity: int | None = None   # lesson 07: constant-size telescoping caches of this many entries
    based_layers: list = field(default_factory=list)   # lesson 08: layers of Based linear attention (the rest windowed)
    based_feature_dim: int = 16                        # lesson 08: width of a Based layer's q and k per head
    based_conv_layers: list = field(default_factory=list)   # lesson 08: BaseConv layers (public Based checkpoints)
    checkpoint_format: str = "hf"      # "based_gpt": the public Based checkpoints' names (see _based_gpt_settings)
    based_gpt: dict = field(default_factory=dict)      # what the loader needs to convert a "based_gpt" checkpoint

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def need(key):
            if raw.get(key) is None:
                raise ModelLoadError(f"{source}: the required key {key!r} is missing")
            return raw[key]

        if _is_based_gpt(raw):   # lesson 08: the public Based checkpoints' own format
            return cls(**_based_gpt_settings(raw, source))
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if known:
            model_type = SUPPORTED_ARCHITECTURES[known[0]]
        elif archs or model_type not in SUPPORTED_ARCHITECTURES.values():
            what = ", ".join(archs) if archs else f"model_type {model_type!r}"
            raise ModelLoadError(f"{source}: unsupported architecture {what}; this engine runs "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={kv_heads}")
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        theta, scaling = _rope_settings(raw)
        layers = int(need("num_hidden_layers"))
        attention_bias = bool(raw.get("attention_bias") or False)
        eos = raw.get("eos_token_id")
        based = _based_settings(raw, layers, source)   # lesson 08: its windows replace the family's
        windows = based.pop("sliding_windows", None) or _sliding_windows(raw, model_type, layers)
        return cls(
            model_type=model_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2", o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias") or False), sliding_windows=windows,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [int(eos)],
            telescoping_capacity=int(raw["telescoping_capacity"]) if raw.get("telescoping_capacity") else None,
            **based,
        )


def _based_settings(raw: dict, layers: int, source: str) -> dict:
    """Lesson 08: ``based_layers`` (Based linear attention) and the sliding window of the other layers."""
    based = [int(n) for n in raw.get("based_layers") or []]
    if not based:
        return {}
    if any(not 0 <= n < layers for n in based):
        raise ModelLoadError(f"{source}: based_layers {based} must be layer numbers below {layers}")
    if len(based) < layers and not raw.get("sliding_window"):
        raise ModelLoadError(f"{source}: a Based model's other layers need a sliding_window")
    return dict(based_layers=based, based_feature_dim=int(raw.get("based_feature_dim") or 16),
                sliding_windows=[None if n in based else int(raw["sliding_window"]) for n in range(layers)])


def _is_based_gpt(raw: dict) -> bool:
    """A config.json of the public Based checkpoints (github.com/HazyResearch/based): GPT-2 keys plus
    ``alt_mixer_layers`` / ``alt_mixer_2_layers``."""
    return "n_embd" in raw and ("alt_mixer_layers" in raw or "alt_mixer_2_layers" in raw)


def _based_gpt_settings(raw: dict, source: str) -> dict:
    """Lesson 08: the public Based format (``hazyresearch/based-360m``, ``based-1b``) as a Based model here.

    Its layers: ``alt_mixer_2_layers`` sliding-window softmax attention (RoPE; flash-attn
    ``window_size=(w // 2, 0)``: a query sees itself and the ``w // 2`` tokens before it, so the window
    here is ``w // 2 + 1``), ``alt_mixer_layers`` Taylor linear attention (the lesson's Based layers),
    every other layer a BaseConv (:mod:`yaie.model.base_conv`). Norms are RMSNorm; the MLP is SwiGLU.
    Settings the original code takes with another meaning, or that this engine does not run, are
    refused with the key named. Defaults follow the original classes (GPT2Config, BaseConv,
    SlidingAttention), except where a key is absent that every published config sets (``rotary_emb_fraction``
    1, ``activation_function`` swiglu): those take the published value.
    """
    def need(key, where=raw, name=None):
        if where.get(key) is None:
            raise ModelLoadError(f"{source}: the required key {name or key!r} is missing (Based format)")
        return where[key]

    def refuse(what):
        raise ModelLoadError(f"{source}: {what}; this engine runs the published Based configuration")

    hidden, heads, layers = int(need("n_embd")), int(need("n_head")), int(need("n_layer"))
    head_dim = hidden // heads
    if hidden % heads:
        refuse(f"n_embd={hidden} is not a multiple of n_head={heads}")
    if raw.get("activation_function", "swiglu") != "swiglu":
        refuse(f"activation_function {raw['activation_function']!r} (only swiglu)")
    if raw.get("rms_norm") is False:
        refuse("rms_norm is false (LayerNorm); only RMSNorm is supported")
    if raw.get("prenorm") is False or raw.get("parallel_block"):
        refuse("prenorm false or parallel_block true")
    if float(raw.get("rotary_emb_fraction", 1)) != 1 or raw.get("rotary_emb_interleaved") or \
            raw.get("rotary_emb_scale_base") is not None:
        refuse("rotary embeddings other than full-width, non-interleaved RoPE "
               "(rotary_emb_fraction 1, rotary_emb_interleaved false, no rotary_emb_scale_base)")
    if raw.get("scale_attn_weights") is False or raw.get("scale_attn_by_inverse_layer_idx"):
        refuse("attention scaled other than by 1/sqrt(head_dim)")
    mixer, linear, window = raw.get("mixer"), need("alt_mixer"), need("alt_mixer_2")
    if mixer is None:
        refuse("no 'mixer' (the other layers would be full attention)")
    if int(linear.get("num_heads", 16)) != heads or int(linear.get("head_dim") or head_dim) != head_dim:
        refuse(f"alt_mixer num_heads/head_dim differ from the attention layers' ({heads} heads of {head_dim})")
    feature_dim = int(linear.get("feature_dim", 16))
    feature_map = linear.get("feature_map") or {}
    if not str(feature_map.get("_target_", "TaylorExp")).endswith("TaylorExp") or \
            int(feature_map.get("input_dim", feature_dim)) != feature_dim or feature_map.get("scale_dim"):
        refuse("alt_mixer.feature_map must be TaylorExp with input_dim = feature_dim")
    if window.get("window_size", 128) is None:
        refuse("alt_mixer_2.window_size is null")
    window_size = int(window.get("window_size", 128))

    windowed = {int(n) for n in raw.get("alt_mixer_2_layers") or []}
    based = sorted({int(n) for n in raw.get("alt_mixer_layers") or []} - windowed)   # alt_mixer_2 wins a tie
    if any(not 0 <= n < layers for n in windowed | set(based)):
        refuse(f"alt_mixer_layers / alt_mixer_2_layers name layers outside 0..{layers - 1}")
    conv = [n for n in range(layers) if n not in windowed and n not in based]
    expand = int(mixer.get("expand_proj", 2))
    multiple = int(raw.get("pad_vocab_size_multiple") or 1)
    vocab = -(-int(need("vocab_size")) // multiple) * multiple    # the embedding's rows (padded)
    eos = raw.get("eos_token_id")
    return dict(
        model_type="based", vocab_size=vocab, hidden_size=hidden, intermediate_size=int(need("n_inner")),
        num_layers=layers, num_heads=heads, num_kv_heads=int(raw.get("n_head_kv") or heads), head_dim=head_dim,
        # No layer limits the position (linear attention has none, the window layers see only distances
        # <= window under RoPE): the table is sized for long serving.
        max_position_embeddings=max(int(raw.get("n_positions") or 0), int(mixer.get("l_max") or 0), 32768),
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), rope_theta=float(raw.get("rotary_emb_base", 10000.0)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        sliding_windows=[window_size // 2 + 1 if n in windowed else None for n in range(layers)],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [int(eos)],
        based_layers=based, based_feature_dim=feature_dim, based_conv_layers=conv, checkpoint_format="based_gpt",
        based_gpt=dict(conv_inner=expand * hidden // 2, conv_kernel=int(mixer.get("kernel_size", 3)),
                       conv_proj_bias=bool(mixer.get("use_bias", True)),
                       qkv_bias=bool(raw.get("qkv_proj_bias", True)), out_bias=bool(raw.get("out_proj_bias", True)),
                       fc1_bias=bool(raw.get("mlp_fc1_bias", True)), fc2_bias=bool(raw.get("mlp_fc2_bias", True))),
    )


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from either spelling; scaling is None for plain RoPE."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(raw.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    scaling = raw.get("rope_scaling") or params or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return theta, None
        if kind not in ("linear", "llama3"):
            raise ModelLoadError(f"config.json: rope scaling type {kind!r} is not supported "
                                 "(supported: default, linear, llama3)")
    return theta, scaling


def _sliding_windows(raw: dict, model_type: str, layers: int) -> list:
    """Per layer, the attention window or None (full attention), as transformers decides it."""
    window = raw.get("sliding_window")
    if model_type == "mistral":
        return [window] * layers
    if model_type == "qwen2":
        types = raw.get("layer_types")
        if types is None:
            use = raw.get("use_sliding_window", False)
            first = raw.get("max_window_layers", layers)
            types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(layers)]
        return [window if t == "sliding_attention" else None for t in types]
    return [None] * layers


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory (expected a Hugging Face model folder)")
    if not path.is_file():
        raise ModelLoadError(f"{path}: config.json is missing; a model folder needs config.json, "
                             "*.safetensors and tokenizer.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None
    return ModelConfig.from_dict(raw, source=str(path))
