"""Load a Llama-family checkpoint from a local Hugging Face folder.

Reads ``model.safetensors``, or the shards listed in ``model.safetensors.index.json``, or (failing
both) every ``*.safetensors`` file of the folder. Every tensor the model needs is checked for presence
and shape before use; errors name the file and the problem (:class:`ModelLoadError`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from yaie.model.config import ModelConfig, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model reads (Hugging Face names) and its shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h), p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
        if n in cfg.based_layers:   # lesson 08: q and k of a Based layer are based_feature_dim wide per head
            feat = cfg.num_heads * cfg.based_feature_dim
            shapes.update({p + "self_attn.q_proj.weight": (feat, h), p + "self_attn.k_proj.weight": (feat, h),
                           p + "self_attn.v_proj.weight": (q_out, h)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)})
    return shapes


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {err}") from None
        located = {}
        for name, shard in weight_map.items():
            path = model_dir / shard
            if not path.is_file():
                raise ModelLoadError(f"{path}: shard listed in {INDEX_FILE} (for {name}) is missing")
            located[name] = path
        return located
    files = [model_dir / "model.safetensors"] if (model_dir / "model.safetensors").is_file() \
        else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no model.safetensors, {INDEX_FILE} or *.safetensors file "
                             "(only safetensors checkpoints are supported)")
    located = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                located[name] = path
    return located


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read and check every tensor of :func:`expected_shapes`; ``dtype=None`` keeps the stored dtype.

    Raises :class:`ModelLoadError` for a missing tensor or a shape that disagrees with config.json.
    """
    model_dir = Path(model_dir)
    located = weight_files(model_dir)
    by_file: dict[Path, list[str]] = {}
    for name in expected_shapes(cfg):
        if name not in located:
            where = INDEX_FILE if (model_dir / INDEX_FILE).is_file() else "the *.safetensors files"
            hint = " (config.json says tie_word_embeddings is false)" if name == "lm_head.weight" else ""
            raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing from {where}{hint}")
        by_file.setdefault(located[name], []).append(name)
    shapes = expected_shapes(cfg)
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                found = tuple(f.get_slice(name).get_shape())
                if found != shapes[name]:
                    raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(found)} but config.json "
                                         f"implies {list(shapes[name])}")
                tensor = f.get_tensor(name)
                weights[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    return weights
