"""CUDA graphs of the engine's decode step: one recorded forward pass per batch size, replayed each step.

Why: at small batch a decode step is a few hundred small kernels (per layer: two norms, RoPE, the KV
write, paged attention, SiLU, four matrix products), each costing the host 5-40 us to launch, while the
GPU needs only a few microseconds for most of them. The GPU waits for the host. A CUDA graph records the
kernels of one step once; a replay launches all of them with one call.

The price: a graph replays exactly what it recorded, so

* the inputs live in fixed buffers, overwritten before each replay (token ids, positions, context
  lengths, block tables; the cache slots are computed from them inside the graph); the outputs (logits) land in a fixed buffer too;
* the batch size is fixed: one graph per *bucket* (1, 2, 4, 8, ... up to the engine's ``max_num_seqs``),
  and a step of ``n`` sequences runs the smallest bucket ``>= n`` with ``bucket - n`` padding rows. A
  padding row has context length 0 (attention reads nothing) and writes its key and value into a scratch
  block that no sequence owns;
* every number the kernels receive is fixed: lesson 04's kernel sizes its split-K ranges by the context
  bound it is given, so a graph is recorded per (batch bucket, context bound), the bound being the
  step's longest context rounded up to a power of two;
* nothing in the step may wait for the GPU (no ``.item()``, no value checks on the host): the engine's
  kernels are called with ``validate=False`` on CUDA already.

Graphs are recorded lazily, the first time a (bucket, bound) is needed, and live as long as the KV cache
they write into (the engine keeps both from one ``generate`` call to the next). Only decode-only steps replay a graph; a step with a
prefill runs eagerly. If recording fails (a student kernel that syncs, say), the engine says so once and
runs eagerly.
"""

from __future__ import annotations

import sys

import torch

from yaie.model.paged import StaticDecodeStep

SCRATCH_SEQ = "__yaie_cuda_graph_scratch__"   # the cache "sequence" that owns the padding rows' block
MIN_BOUND = 1024   # smallest context bound: below 2 * 512 tokens lesson 04 does not split anyway


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below ``max_batch``, then ``max_batch`` itself."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


class _Buffers:
    """The fixed inputs of one batch bucket's graphs (each context bound of that bucket reads the same ones).

    ``ids`` rows: token ids, positions, context lengths, filled from the host with one copy per step. The
    slot each new token's K/V goes to is computed inside the graph from the block table and the position
    (``table[pos // block_size] * block_size + pos % block_size``, lesson 03's slot rule), so no slot
    tensor travels per sequence. A padding row has context length 0 and its table's first block is the
    scratch block: it writes there and reads nothing.
    """

    def __init__(self, batch: int, max_blocks: int, scratch_block: int, device: torch.device):
        self.ids = torch.zeros(3, batch, dtype=torch.int64, device=device)
        self.tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.tables[:, 0] = scratch_block


class DecodeGraphs:
    """Replays recorded decode steps of ``model`` over ``manager``'s cache.

    Args:
        model: the :class:`yaie.model.llama.LlamaModel`.
        manager: the lesson 03 ``KVCacheManager``. One of its blocks is taken for the padding rows (give the
            scheduler one block fewer: ``reserved_blocks=1``); :meth:`close` gives it back.
        max_batch: the largest step (the engine's ``max_num_seqs``).
        capture: False runs the same fixed-buffer steps eagerly instead of recording them (CPU tests).

    A graph is recorded per (batch bucket, context bound): the bound is the longest context of the step
    rounded up to a power of two (at least ``MIN_BOUND``, at most the block table's length), so lesson 04
    sizes its splits about as it would for the step itself: a 2k context in a model that allows 128k is
    not cut into 4k-token splits that leave all but one empty. Contexts grow through a handful of
    bounds, so a run records a handful of graphs. They share one memory pool: replays never overlap, and
    each replay's logits are read before the next replay.
    """

    def __init__(self, model, manager, max_batch: int, capture: bool = True):
        self.model, self.manager, self.capture = model, manager, capture
        self.buckets = buckets(max_batch)
        self.max_blocks = -(-model.config.max_position_embeddings // manager.block_size)
        self.capacity = self.max_blocks * manager.block_size
        self.scratch_block = int(manager.allocate(SCRATCH_SEQ, 1)[0]) // manager.block_size
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, int], tuple] = {}    # (bucket, bound) -> (CUDAGraph or None, logits)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None       # why recording failed (or "closed"); then steps run eagerly

    @staticmethod
    def supported(model, device: torch.device) -> bool:
        """Graphs need CUDA. (Sliding-window layers decode through lesson 04's kernel with its window, task
        4, so their decode steps record like any other.)"""
        return device.type == "cuda"

    def fits(self, num_decodes: int) -> bool:
        return self.failed is None and 1 <= num_decodes <= self.buckets[-1]

    def bound(self, longest: int) -> int:
        """The context bound of a step whose longest context is ``longest`` tokens."""
        bound = MIN_BOUND
        while bound < longest:
            bound *= 2
        return min(bound, self.capacity)

    def close(self) -> None:
        """Drop the graphs, give the scratch block back, and refuse further steps."""
        self.graphs.clear()
        self.buffers.clear()
        self.failed = "closed"
        if self.manager.has_seq(SCRATCH_SEQ):
            self.manager.free(SCRATCH_SEQ)

    # ------------------------------------------------------------------ one step
    def run(self, seq_ids: list, token_ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """Logits ``[len(seq_ids), vocab]`` (float32) of one decode step; None if recording failed. Each
        sequence's slot for its new token must be reserved already (``append_slots``)."""
        n = len(seq_ids)
        bucket = next(b for b in self.buckets if b >= n)
        bound = self.bound(max(positions) + 1)         # a decode's context ends at its new token
        entry = self.graphs.get((bucket, bound)) or self._record(bucket, bound)
        if entry is None:
            return None
        buf, pad = self.buffers[bucket], [0] * (bucket - n)
        lens = [p + 1 for p in positions]
        buf.ids.copy_(torch.tensor([token_ids + pad, positions + pad, lens + pad], dtype=torch.int64))
        table = self.manager.block_table(seq_ids)
        buf.tables[:n, :table.shape[1]].copy_(table)       # columns past a row's length are never followed
        if pad:                                            # earlier, larger steps left their rows here
            buf.tables[n:, 0].fill_(self.scratch_block)
        graph, logits = entry
        if graph is None:                                  # capture=False: the same step, eagerly
            logits = self._forward(buf, bound)
        else:
            graph.replay()
        return logits[:n]

    def _forward(self, buf: _Buffers, bound: int) -> torch.Tensor:
        size = self.manager.block_size
        tokens, positions, lens = buf.ids
        blocks = buf.tables.gather(1, (positions // size).unsqueeze(1)).squeeze(1).to(torch.int64)
        slots = blocks * size + positions % size
        step = StaticDecodeStep(self.manager, buf.tables, lens.to(torch.int32), slots, bound)
        return self.model.logits(self.model.forward(tokens, positions, step))

    def _record(self, bucket: int, bound: int) -> tuple | None:
        device = self.manager.device
        buf = self.buffers.get(bucket)
        if buf is None:
            buf = self.buffers[bucket] = _Buffers(bucket, self.max_blocks, self.scratch_block, device)
        # Until the first replay every row is padding (context 0, writing into the scratch block): the
        # warm-up and the recording change nothing a sequence owns.
        buf.ids.zero_()
        buf.tables[:, 0] = self.scratch_block
        if not self.capture:
            self.graphs[(bucket, bound)] = (None, None)
            return self.graphs[(bucket, bound)]
        try:
            # Warm up on the stream the graph is recorded on: Triton compiles its kernels and lesson 04
            # allocates its per-stream split counters here, not inside the recording.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(buf, bound)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                logits = self._forward(buf, bound)
        except Exception as err:  # noqa: BLE001 - any failure: say so once, run eagerly from now on
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"yaie: recording a CUDA graph of the decode step failed ({self.failed}); decoding without "
                  "graphs from now on", file=sys.stderr, flush=True)
            torch.cuda.synchronize(device)
            return None
        self.graphs[(bucket, bound)] = (graph, logits)
        return self.graphs[(bucket, bound)]
