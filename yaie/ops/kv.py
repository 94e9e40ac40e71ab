"""Lesson 03's paged KV cache in the engine: the manager (probed before serving) and the writes into it."""

from __future__ import annotations

import torch

from yaie.ops import layers, lessons


def _probe_kv_manager(cls, swap: bool) -> None:
    """Run every manager method the engine uses once, on a tiny CPU cache.

    A student's class may construct fine and still have stubbed methods; finding that *before* serving
    lets auto mode take the whole class from the reference (it owns all the cache's state: switching
    halfway through a generation would lose the cache).
    """
    manager = cls(num_blocks=4, block_size=2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu", num_cpu_blocks=4 if swap else 0)
    slots = manager.allocate("probe", 3)
    manager.write_kv(0, slots, torch.randn(3, 1, 2), torch.randn(3, 1, 2))
    manager.append_slots("probe", 1)
    manager.block_table(["probe"])
    manager.context_lens(["probe"])
    if swap:
        manager.swap_out("probe")
        manager.swap_in("probe")
    manager.free("probe")


def kv_cache_manager(num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str, num_cpu_blocks: int = 0,
                     swap: bool = False):
    """A lesson 03 ``KVCacheManager``: the student's, or the reference as the switch and auto mode say.

    The class is probed first (every method the engine uses, once); ``swap`` says whether the engine will
    swap (then lesson 03 task 4 is needed too). A stubbed method sends the whole class to the reference in
    auto mode and raises :class:`yaie.ops.KernelMissing` in strict mode.
    """
    def build(cls):
        _probe_kv_manager(cls, swap)
        return cls(num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype=dtype, device=device,
                   num_cpu_blocks=num_cpu_blocks)

    return lessons.run_with_fallback(3, 0, "KVCacheManager", build)


def write_kv(manager, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new keys ``k`` and values ``v`` ``[tokens, kv_heads, head_dim]`` at ``slot_mapping [tokens]`` of
    ``layer``'s cache (lesson 03's ``write_kv``; the manager was probed).

    On CUDA the slot range check is skipped (``validate=False``): it would read the slots back to the host,
    one GPU sync per layer per step, and the engine's slots come from the manager itself.
    """
    if slot_mapping.is_cuda:
        manager.write_kv(layer, slot_mapping, k, v, validate=False)
    else:
        manager.write_kv(layer, slot_mapping, k, v)


def fused_rope_write_kv(manager, q: torch.Tensor):
    """Lesson 02's reference-only ``apply_rope_qk_store_kv`` where it may stand in for ``rope`` + ``write_kv``,
    else None: on CUDA, where the reference serves ``apply_rope_qk`` and the manager is the reference's
    lesson 03 class (the fused kernel writes the cache itself). A student's RoPE or manager keeps the two
    ops apart, so their code is what runs."""
    if not layers.use_gpu_kernels(q) or not type(manager).__module__.startswith("solutions."):
        return None
    return lessons.reference_only(2, "apply_rope_qk_store_kv", ("apply_rope_qk",))


def rope_and_write_kv(manager, layer: int, slot_mapping: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`yaie.ops.rope` of ``q, k``, then :func:`write_kv` of the rotated ``k`` and ``v``: returns ``(q, k)``.

    One launch on CUDA where :func:`fused_rope_write_kv` allows it; the two ops apart otherwise.
    """
    fused = fused_rope_write_kv(manager, q)
    if fused is not None:
        return fused(q, k, v, cos, sin, positions, manager.k_cache[layer], manager.v_cache[layer], slot_mapping)
    q, k = layers.rope(q, k, cos, sin, positions)
    write_kv(manager, layer, slot_mapping, k, v)
    return q, k
