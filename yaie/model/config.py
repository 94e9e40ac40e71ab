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

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def need(key):
            if raw.get(key) is None:
                raise ModelLoadError(f"{source}: the required key {key!r} is missing")
            return raw[key]

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
