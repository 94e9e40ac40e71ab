"""Automatic prefix caching: lesson 05's radix tree over the engine's lesson 03 cache.

The engine (``LLM(..., prefix_caching=True)``, the default) keeps one
``RadixAttentionWithPagedKVCache`` beside each KV cache it keeps; the scheduler
(:mod:`yaie.engine.scheduler`) admits requests through it, so a request prefills only the tokens after
its longest cached prefix, and the forward pass reads that prefix from the shared blocks (lesson 05's
prefix-prefill kernel on CUDA, the gathered lesson 01 path on the CPU: :func:`yaie.ops.paged_attention`).

Lesson 05's classes are the student's or the reference, as the switch says. Like lesson 03's manager,
they keep state that lives as long as the cache, so they are probed as a whole before serving:

* auto mode (``YAIE_SOLUTIONS`` not set): a stubbed method sends the class to the reference (the class is the unit), with the
  usual one-line notice;
* strict mode: prefix caching is optional, so an unfinished lesson 05 turns it off (one notice line on
  stderr saying so) instead of stopping the engine; a lesson 05 that is not in this copy at all turns it
  off silently.
"""

from __future__ import annotations

import sys

import torch

from yaie import ops

_CLASS = "RadixAttentionWithPagedKVCache"


def _probe(cache_class, manager_class) -> None:
    """Run every method the scheduler uses once, on a tiny CPU cache of the engine's manager class."""
    manager = manager_class(num_blocks=6, block_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                            dtype=torch.float32, device="cpu")
    cache = cache_class(manager)
    cache.allocate("probe", [1, 2, 3])
    cache.cache_sequence("probe", [1, 2, 3])
    cache.match([1, 2, 3, 4])
    cache.allocate("probe-2", [1, 2, 3, 4])
    cache.release_lock("probe-2")
    cache.free("probe-2")
    cache.free("probe", [1, 2, 3])
    cache.make_room(manager.num_blocks)


def make_prefix_cache(manager):
    """Lesson 05's ``RadixAttentionWithPagedKVCache`` over ``manager`` (the class probed first, as a unit:
    auto mode takes an unfinished one from the reference), or None (prefix caching off, with a notice) when
    lesson 05 is unfinished in strict mode or in a copy without the reference; None, silently, when lesson
    05 is not in this copy at all."""
    if not ops.lessons.lesson_available(5, 0):
        return None

    def build(cache_class):
        _probe(cache_class, type(manager))
        return cache_class(manager)

    try:
        return ops.lessons.run_with_fallback(5, 0, _CLASS, build)
    except ops.KernelMissing as err:        # prefix caching is optional: off, and say why
        print(f"{str(err).splitlines()[0].rstrip('.')}; prefix caching is off", file=sys.stderr, flush=True)
        return None
