"""Load a Llama-family checkpoint from a local Hugging Face folder.

Reads ``model.safetensors``, or the shards listed in ``model.safetensors.index.json``, or (failing
both) every ``*.safetensors`` file of the folder. Every tensor the model needs is checked for presence
and shape before use; errors name the file and the problem (:class:`ModelLoadError`).
"""

from __future__ import annotations

import contextlib

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from yaie.model.config import ModelConfig, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"



@contextlib.contextmanager
def open_safetensors(path: Path):
    """``safe_open`` of one file; a file it cannot read (truncated, corrupt) is a :class:`ModelLoadError`
    naming it, not the library's own error."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({err}); copy or download it "
                             "again") from None

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
        with open_safetensors(path) as f:
            for name in f.keys():
                located[name] = path
    return located


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read and check every tensor of :func:`expected_shapes`; ``dtype=None`` keeps the stored dtype.

    Raises :class:`ModelLoadError` for a missing tensor or a shape that disagrees with config.json.
    """
    if cfg.checkpoint_format == "based_gpt":   # lesson 08: the public Based checkpoints' names
        return load_based_gpt_weights(model_dir, cfg, dtype=dtype, device=device)
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
        with open_safetensors(path) as f:
            for name in names:
                found = tuple(f.get_slice(name).get_shape())
                if found != shapes[name]:
                    raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(found)} but config.json "
                                         f"implies {list(shapes[name])}")
                tensor = f.get_tensor(name)
                weights[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    return weights


# ----------------------------------------------------------------------------- lesson 08: public Based checkpoints
BIN_FILE = "pytorch_model.bin"
EMBEDDING = "transformer.embeddings.word_embeddings.weight"


def _based_gpt_index(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], object]:
    """Every tensor of the checkpoint (a leading ``model.``, as the training code saves it, dropped): its
    shape, and a ``read(names)`` giving the tensors. Safetensors files first, else ``pytorch_model.bin``."""
    if not any(model_dir.glob("*.safetensors")) and (model_dir / BIN_FILE).is_file():
        state = _load_bin(model_dir / BIN_FILE)
        tensors = {_strip_model(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
        return {k: tuple(v.shape) for k, v in tensors.items()}, lambda names: {n: tensors[n] for n in names}
    by_file: dict[Path, list[str]] = {}
    for stored, path in weight_files(model_dir).items():
        by_file.setdefault(path, []).append(stored)
    shapes, located = {}, {}
    for path, names in by_file.items():
        with open_safetensors(path) as f:
            for stored in names:
                shapes[_strip_model(stored)] = tuple(f.get_slice(stored).get_shape())
                located[_strip_model(stored)] = (path, stored)

    def read(names):
        wanted: dict[Path, list[str]] = {}
        for name in names:
            wanted.setdefault(located[name][0], []).append(name)
        out = {}
        for path, group in wanted.items():
            with open_safetensors(path) as f:
                out.update({name: f.get_tensor(located[name][1]) for name in group})
        return out
    return shapes, read


def _load_bin(path: Path) -> dict:
    """A ``pytorch_model.bin`` state dict, read as data only (``weights_only``: no code in it runs)."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:     # the legacy (non-zip) format cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a pickle with more than tensors, a truncated file, ...
        raise ModelLoadError(f"{path}: not a loadable state dict of tensors ({err})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]           # a training checkpoint: the weights sit under state_dict
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


def _strip_model(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def based_gpt_shapes(cfg: ModelConfig, found: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The public Based names this model reads and their shapes (the original project's names:
    ``transformer.layers.{i}.mixer.*``, ``mlp.fc1``/``fc2``, ``norm1``/``norm2``). ``found`` (the
    checkpoint's names) picks between spellings: the embedding as ``lm_head.weight`` alone when tied,
    the convolution as ``conv`` or ``conv1``, its bias when the checkpoint has one."""
    g, h, d, i = cfg.based_gpt, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    shapes = {"transformer.ln_f.weight": (h,)}
    if EMBEDDING in found or not cfg.tie_word_embeddings:
        shapes[EMBEDDING] = (cfg.vocab_size, h)
    if "lm_head.weight" in found or not cfg.tie_word_embeddings or EMBEDDING not in found:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
        if cfg.tie_word_embeddings:
            shapes.pop(EMBEDDING, None)     # tied: one copy is enough (safetensors keeps only one)
    for n in range(cfg.num_layers):
        p = f"transformer.layers.{n}."
        m = p + "mixer."
        shapes.update({p + "norm1.weight": (h,), p + "norm2.weight": (h,),
                       p + "mlp.fc1.weight": (2 * i, h), p + "mlp.fc2.weight": (h, i)})
        if g["fc1_bias"]:
            shapes[p + "mlp.fc1.bias"] = (2 * i,)
        if g["fc2_bias"]:
            shapes[p + "mlp.fc2.bias"] = (h,)
        if n in cfg.based_layers:       # LinearAttention: no biases
            feat = heads * cfg.based_feature_dim
            shapes.update({m + "proj_q.weight": (feat, h), m + "proj_k.weight": (feat, h),
                           m + "proj_v.weight": (heads * d, h), m + "out_proj.weight": (h, heads * d)})
        elif n in cfg.based_conv_layers:
            inner, k = g["conv_inner"], g["conv_kernel"]
            conv = m + ("conv1.conv." if m + "conv1.conv.weight" in found else "conv.conv.")
            shapes.update({m + "in_proj.weight": (2 * inner, h), conv + "weight": (inner, 1, k),
                           m + "out_proj.weight": (h, inner)})
            if g["conv_proj_bias"]:
                shapes.update({m + "in_proj.bias": (2 * inner,), m + "out_proj.bias": (h,)})
            if conv + "bias" in found:   # present when trained with the causal-conv1d kernel
                shapes[conv + "bias"] = (inner,)
        else:                           # SlidingAttention: Wqkv rows are q, k, v, each (heads, head_dim)
            shapes.update({m + "Wqkv.weight": ((heads + 2 * kv) * d, h), m + "out_proj.weight": (h, heads * d)})
            if g["qkv_bias"]:
                shapes[m + "Wqkv.bias"] = ((heads + 2 * kv) * d,)
            if g["out_bias"]:
                shapes[m + "out_proj.bias"] = (h,)
    return shapes


def load_based_gpt_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None,
                           device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Lesson 08: read a public Based checkpoint (see :func:`based_gpt_shapes`), check every tensor, and
    return it under this engine's names: a Llama layer's for the norms, MLP and attention layers
    (``mlp.fc1``'s halves swapped into gate-then-up order; ``Wqkv`` split into q, k, v), and
    ``model.layers.{i}.conv.*`` for BaseConv layers (taps ``[inner, k]``, see :mod:`yaie.model.base_conv`)."""
    model_dir = Path(model_dir)
    found, read = _based_gpt_index(model_dir)
    if "transformer.embeddings.position_embeddings.weight" in found:
        raise ModelLoadError(f"{model_dir}: the checkpoint has learned position embeddings "
                             "(max_position_embeddings > 0); the Based format here uses RoPE only")
    if any(k.endswith(("norm1.bias", "norm2.bias")) or k == "transformer.ln_f.bias" for k in found):
        raise ModelLoadError(f"{model_dir}: the norms have biases (LayerNorm); only RMSNorm is supported")
    shapes = based_gpt_shapes(cfg, found)
    for name, shape in shapes.items():
        if name not in found:
            raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing (Based format; config.json "
                                 f"decides which tensors exist)")
        if found[name] != shape:
            hint = " (check pad_vocab_size_multiple)" if name in (EMBEDDING, "lm_head.weight") else ""
            raise ModelLoadError(f"{model_dir}: tensor {name!r} has shape {list(found[name])} but config.json "
                                 f"implies {list(shape)}{hint}")
    raw = read(list(shapes))
    w = {name: t.to(device=device, dtype=dtype or t.dtype) for name, t in raw.items()}
    return _based_gpt_to_llama_names(cfg, w)


def _based_gpt_to_llama_names(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    embed = w.get(EMBEDDING, w.get("lm_head.weight"))
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": w["transformer.ln_f.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = w["lm_head.weight"]
    for n in range(cfg.num_layers):
        p, m, y = f"transformer.layers.{n}.", f"transformer.layers.{n}.mixer.", f"model.layers.{n}."
        out[y + "input_layernorm.weight"] = w[p + "norm1.weight"]
        out[y + "post_attention_layernorm.weight"] = w[p + "norm2.weight"]
        # fc1 = [value half; gate half] (the original computes value * silu(gate)); here gate rows come first.
        for suffix in ("weight", "bias"):
            fc1 = w.get(p + "mlp.fc1." + suffix)
            if fc1 is not None:
                out[y + "mlp.gate_proj." + suffix], out[y + "mlp.up_proj." + suffix] = fc1[i:], fc1[:i]
            if p + "mlp.fc2." + suffix in w:
                out[y + "mlp.down_proj." + suffix] = w[p + "mlp.fc2." + suffix]
        if n in cfg.based_layers:
            names = (("proj_q", "q_proj"), ("proj_k", "k_proj"), ("proj_v", "v_proj"), ("out_proj", "o_proj"))
            for theirs, ours in names:
                out[y + f"self_attn.{ours}.weight"] = w[m + theirs + ".weight"]
        elif n in cfg.based_conv_layers:
            conv = m + ("conv1.conv." if m + "conv1.conv.weight" in w else "conv.conv.")
            out[y + "conv.conv.weight"] = w[conv + "weight"].reshape(cfg.based_gpt["conv_inner"], -1)  # taps [inner, k]
            for part in ("in_proj.", "out_proj."):
                for suffix in ("weight", "bias"):
                    if m + part + suffix in w:
                        out[y + "conv." + part + suffix] = w[m + part + suffix]
            if conv + "bias" in w:
                out[y + "conv.conv.bias"] = w[conv + "bias"]
        else:
            sizes = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
            for suffix in ("weight", "bias"):
                if m + "Wqkv." + suffix in w:
                    q, k, v = w[m + "Wqkv." + suffix].split(sizes)
                    for ours, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                        out[y + f"self_attn.{ours}.{suffix}"] = t
                if m + "out_proj." + suffix in w:
                    out[y + f"self_attn.o_proj.{suffix}"] = w[m + "out_proj." + suffix]
    return out
