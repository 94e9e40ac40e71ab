"""Which part of each Llama weight a tensor-parallel rank keeps, and loading only that part.

With ``world_size`` ranks, rank ``r`` keeps (Hugging Face names, ``[out, in]`` matrices)::

    q_proj, k_proj, v_proj   rows of its attention heads (query heads r*H/N .., KV heads r*KV/N ..)   column-parallel
    gate_proj, up_proj       rows r*I/N .. (r+1)*I/N of the MLP's intermediate features               column-parallel
    o_proj, down_proj        the matching columns; their bias on rank 0 only                         row-parallel
    embed_tokens, lm_head    vocabulary rows r*V' .. (r+1)*V', V' = ceil(V/N), zero rows past V        vocab-parallel
    norms                    whole

A column-parallel product gives each rank its own slice of the outputs (its heads, its features) with no
communication; the row-parallel product after it gives each rank a partial sum of the full output, which
one all-reduce adds up. So a layer communicates twice: after the attention output and after the MLP.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from yaie.model.config import ModelConfig, ModelLoadError
from yaie.model.loader import INDEX_FILE, expected_shapes, weight_files

COLUMN = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
ROW = ("self_attn.o_proj.", "mlp.down_proj.")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """``ValueError`` unless the model splits evenly over ``world_size`` ranks (an int >= 1): its attention
    heads, its KV heads and its MLP width; and it is a Llama-family model of full-attention layers."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return
    if config.based_layers or config.telescoping_capacity:
        raise ValueError("tensor parallelism runs Llama-family models over the paged KV cache only "
                         "(not Based or telescoping models)")
    for what, count in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                        ("MLP features (intermediate_size)", config.intermediate_size)):
        if count % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} does not divide the model's {count} {what}")


def vocab_rows(config: ModelConfig, world_size: int) -> int:
    """Vocabulary rows each rank holds (the last rank's end is padded with zero rows)."""
    return -(-config.vocab_size // world_size)


def shard_range(name: str, config: ModelConfig, rank: int, world_size: int) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the part of tensor ``name`` that rank ``rank`` keeps; None: the whole tensor.
    ``(0, 0, 0)`` for a row-parallel bias off rank 0 (not kept). Vocabulary ranges may run past the table
    (:func:`shard` pads them)."""
    d = config.head_dim
    if name in VOCAB:
        rows = vocab_rows(config, world_size)
        return 0, rank * rows, (rank + 1) * rows
    part = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
    if part.startswith(ROW):
        if part.endswith("bias"):
            return None if rank == 0 else (0, 0, 0)
        width = (config.num_heads * d if part.startswith("self_attn") else config.intermediate_size) // world_size
        return 1, rank * width, (rank + 1) * width
    if part.startswith(COLUMN):
        if part.startswith("self_attn.q_proj."):
            width = config.num_heads // world_size * d
        elif part.startswith("self_attn."):
            width = config.num_kv_heads // world_size * d
        else:
            width = config.intermediate_size // world_size
        return 0, rank * width, (rank + 1) * width
    return None


def shard(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, world_size: int) -> torch.Tensor | None:
    """Rank ``rank``'s part of the whole tensor ``name`` (a new tensor), or None when the rank keeps none."""
    where = shard_range(name, config, rank, world_size)
    if where is None:
        return tensor.clone()
    dim, start, stop = where
    if stop == 0:
        return None
    end = min(stop, tensor.shape[dim])
    part = tensor.narrow(dim, min(start, end), max(0, end - start))
    return _pad_rows(part, stop - start) if dim == 0 else part.contiguous().clone()


def _pad_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    if part.shape[0] == rows:
        return part.contiguous().clone()
    padded = torch.zeros((rows,) + tuple(part.shape[1:]), dtype=part.dtype, device=part.device)
    padded[:part.shape[0]] = part
    return padded


def load_shard(model_dir: str | Path, config: ModelConfig, rank: int, world_size: int,
               dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of every tensor the model reads (see the module docstring), read from the
    safetensors files slice by slice: a rank never holds the whole model. Raises :class:`ModelLoadError` for a
    missing tensor or a shape that disagrees with config.json, as :func:`yaie.model.loader.load_weights`."""
    model_dir = Path(model_dir)
    if config.checkpoint_format == "based_gpt":
        raise ModelLoadError(f"{model_dir}: tensor parallelism reads Hugging Face Llama-family checkpoints only")
    located, shapes = weight_files(model_dir), expected_shapes(config)
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in located:
            where = INDEX_FILE if (model_dir / INDEX_FILE).is_file() else "the *.safetensors files"
            raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing from {where}")
        by_file.setdefault(located[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                found = tuple(piece.get_shape())
                if found != shapes[name]:
                    raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(found)} but config.json "
                                         f"implies {list(shapes[name])}")
                tensor = _read_part(piece, shard_range(name, config, rank, world_size), found)
                if tensor is not None:
                    weights[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    return weights


def _read_part(piece, where: tuple[int, int, int] | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if where is None:
        return piece[:]
    dim, start, stop = where
    if stop == 0:
        return None
    end = min(stop, shape[dim])
    part = piece[min(start, end):end] if dim == 0 else piece[:, start:end]
    return _pad_rows(part, stop - start) if dim == 0 else part
