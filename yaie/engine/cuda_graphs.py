"""CUDA graphs of the engine's decode step: one recorded forward pass per batch size, replayed each step.

Why: at small batch a decode step is a few hundred small kernels (per layer: two norms, RoPE, the KV
write, paged attention, SiLU, four matrix products), each costing the host 5-40 us to launch, while the
GPU needs only a few microseconds for most of them. The GPU waits for the host. A CUDA graph records the
kernels of one step once; a replay launches all of them with one call.

The price: a graph replays exactly what it recorded, so

* the inputs live in fixed buffers, overwritten before each replay (token ids, positions, cache slots,
  block tables, context lengths); the outputs (logits) land in a fixed buffer too;
* the batch size is fixed: one graph per *bucket* (1, 2, 4, 8, ... up to the engine's ``max_num_seqs``),
  and a step of ``n`` sequences runs the smallest bucket ``>= n`` with ``bucket - n`` padding rows. A
  padding row has context length 0 (attention reads nothing) and writes its key and value into a scratch
  block that no sequence owns;
* every number the kernels receive is fixed: lesson 04's kernel gets the whole block table's length as
  its context bound and sizes its split-K ranges by it (a short context then leaves most splits empty);
* nothing in the step may wait for the GPU (no ``.item()``, no value checks on the host): the engine's
  kernels are called with ``validate=False`` on CUDA already.

Graphs are recorded lazily, the first time a bucket is needed, and live as long as the ``generate`` call
(the KV cache they write into is made per call). Only decode-only steps replay a graph; a step with a
prefill runs eagerly. If recording fails (a student kernel that syncs, say), the engine says so once and
runs eagerly.
"""

from __future__ import annotations

import sys

import torch

from yaie.model.paged import StaticDecodeStep

SCRATCH_SEQ = "__yaie_cuda_graph_scratch__"   # the cache "sequence" that owns the padding rows' block


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below ``max_batch``, then ``max_batch`` itself."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


class _Graph:
    """One bucket's graph and the fixed buffers it reads and writes."""

    def __init__(self, batch: int, max_blocks: int, scratch_slot: int, device: torch.device):
        self.batch = batch
        self.ids = torch.zeros(2, batch, dtype=torch.int64, device=device)          # token ids, positions
        self.slots = torch.full((batch,), scratch_slot, dtype=torch.int64, device=device)
        self.tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Replays recorded decode steps of ``model`` over ``manager``'s cache.

    Args:
        model: the :class:`yaie.model.llama.LlamaModel`.
        manager: the lesson 03 ``KVCacheManager`` of this ``generate`` call. One of its blocks is taken for
            the padding rows (give the scheduler one block fewer: ``reserved_blocks=1``); :meth:`close`
            gives it back.
        max_batch: the largest step (the engine's ``max_num_seqs``).
        capture: False runs the same fixed-buffer step eagerly instead of recording it (tests on the CPU).
    """

    def __init__(self, model, manager, max_batch: int, capture: bool = True):
        self.model, self.manager, self.capture = model, manager, capture
        self.buckets = buckets(max_batch)
        block_size = manager.block_size
        self.max_blocks = -(-model.config.max_position_embeddings // block_size)
        self.scratch_slot = int(manager.allocate(SCRATCH_SEQ, 1)[0])
        self.graphs: dict[int, _Graph] = {}   # each with its own memory pool: a few MB of activations
        self.failed: str | None = None       # why recording failed; then every step runs eagerly

    @staticmethod
    def supported(model, device: torch.device) -> bool:
        """Graphs need CUDA, and no sliding-window layer (those attend through a gather on the host)."""
        return device.type == "cuda" and not any(w is not None for w in model.config.sliding_windows)

    def fits(self, num_decodes: int) -> bool:
        return self.failed is None and 1 <= num_decodes <= self.buckets[-1]

    def close(self) -> None:
        """Drop the graphs and give the scratch block back (the cache is about to be dropped too)."""
        self.graphs.clear()
        if self.manager.has_seq(SCRATCH_SEQ):
            self.manager.free(SCRATCH_SEQ)

    # ------------------------------------------------------------------ one step
    def run(self, seq_ids: list, token_ids: list[int], positions: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(seq_ids), vocab]`` (float32) of one decode step; None if recording failed."""
        n = len(seq_ids)
        bucket = next(b for b in self.buckets if b >= n)
        graph = self.graphs.get(bucket) or self._record(bucket)
        if graph is None:
            return None
        pad = bucket - n
        graph.ids.copy_(torch.tensor([token_ids + [0] * pad, positions + [0] * pad], dtype=torch.int64),
                        non_blocking=True)
        graph.slots[:n].copy_(slots)
        graph.slots[n:].fill_(self.scratch_slot)
        table = self.manager.block_table(seq_ids)
        graph.tables[:n, :table.shape[1]].copy_(table)     # columns past a row's length are never followed
        graph.lens[:n].copy_(self.manager.context_lens(seq_ids))
        graph.lens[n:].zero_()
        if self.capture:
            graph.graph.replay()
        else:
            graph.logits = self._forward(graph)
        return graph.logits[:n]

    def _forward(self, graph: _Graph) -> torch.Tensor:
        step = StaticDecodeStep(self.manager, graph.tables, graph.lens, graph.slots)
        return self.model.logits(self.model.forward(graph.ids[0], graph.ids[1], step))

    def _record(self, bucket: int) -> _Graph | None:
        graph = _Graph(bucket, self.max_blocks, self.scratch_slot, self.manager.device)
        if not self.capture:
            self.graphs[bucket] = graph
            return graph
        try:
            # Warm up on the stream the graph is recorded on: Triton compiles its kernels and lesson 04
            # allocates its per-stream split counters here, not inside the recording. Every row is
            # padding (context 0, scratch slot), so the warm-up changes nothing a sequence owns.
            stream = torch.cuda.Stream(self.manager.device)
            stream.wait_stream(torch.cuda.current_stream(self.manager.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(graph)
            torch.cuda.current_stream(self.manager.device).wait_stream(stream)
            graph.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.graph, stream=stream):
                graph.logits = self._forward(graph)
        except Exception as err:  # noqa: BLE001 - any failure: say so once, run eagerly from now on
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"yaie: recording a CUDA graph of the decode step failed ({self.failed}); decoding without "
                  "graphs from now on", file=sys.stderr, flush=True)
            torch.cuda.synchronize(self.manager.device)
            return None
        self.graphs[bucket] = graph
        return graph
