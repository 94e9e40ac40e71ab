"""CUDA graphs of the engine's decode step: one recorded forward pass per batch size, replayed each step.

Why: at small batch a decode step is a few hundred small kernels (per layer: two norms, RoPE, the KV
write, paged attention, SiLU, four matrix products), each costing the host 5-40 us to launch, while the
GPU needs only a few microseconds for most of them. The GPU waits for the host. A CUDA graph records the
kernels of one step once; a replay launches all of them with one call.

The price: a graph replays exactly what it recorded, so

* the inputs live in fixed buffers, overwritten before each replay (token ids, positions, context
  lengths, block tables; the cache slots are computed from them inside the graph); the outputs (logits)
  land in a fixed buffer too;
* the batch size is fixed: one graph per *bucket* (1, 2, 4, 8, ... up to the engine's ``max_num_seqs``),
  and a step of ``n`` sequences runs the smallest bucket ``>= n`` with ``bucket - n`` padding rows. A
  padding row has context length 0 (attention reads nothing) and writes its key and value into a scratch
  block that no sequence owns;
* every number the kernels receive is fixed: lesson 04's kernel sizes its split-K ranges by the context
  bound it is given, so a graph is recorded per (batch bucket, context bound), the bound being the
  step's longest context rounded up to a power of two;
* nothing in the step may wait for the GPU (no ``.item()``, no value checks on the host): the engine's
  kernels are called with ``validate=False`` on CUDA already.

**Cascade decode** (lesson 05): when every sequence of a step starts with the same cached blocks (a
shared system prompt, the samples of one prompt) and they hold ``CASCADE_MIN_SHARED_TOKENS`` or more, the
step records as a cascade: per layer, all the step's queries attend to those shared blocks in one
multi-query pass (lesson 05's ``FlashInferPagedAttention``, planned while warming up, never inside the
recording), each sequence's own blocks after them go to lesson 05's prefix-prefill kernel (with the new
token as its one query), and lesson 05's ``merge_state`` joins the two. The shared blocks are read once
per step instead of once per sequence. The shared length is rounded down to a multiple of the granule,
``CASCADE_MIN_SHARED_TOKENS`` rounded up to whole blocks (so a handful of graphs serves a run, at most
``MAX_CASCADE_LENGTHS`` lengths), and is part of the graph's key;
the shared blocks' ids live in a fixed buffer like the rest (lesson 05's ``run`` reads the ids at every
call, task 6). Padding rows of a cascade step attend to the shared blocks too: wasted but harmless work.

Graphs are recorded lazily, the first time a (bucket, bound, shared length) is needed, and live as long
as the KV cache they write into (the engine keeps both from one ``generate`` call to the next). Only
decode-only steps replay a graph; a step with a prefill runs eagerly. If recording fails (a student
kernel that syncs, say), the engine says so once and runs eagerly (a failed cascade recording turns only
the cascade off).
"""

from __future__ import annotations

import sys

import torch

from yaie import ops
from yaie.model.graphs import buckets, upload
from yaie.model.paged import StaticDecodeStep

SCRATCH_SEQ = "__yaie_cuda_graph_scratch__"   # the cache "sequence" that owns the padding rows' block
# Smallest context bound: lesson 04 splits no context under 2 * 512 tokens (docs/engine.md, "CUDA graphs").
MIN_BOUND = 512
CASCADE_MIN_SHARED_TOKENS = ops.CASCADE_MIN_SHARED_TOKENS   # and the granule of a cascade graph's shared length
MAX_CASCADE_LENGTHS = 8   # distinct shared lengths that get cascade graphs; other steps record plain ones


class _Buffers:
    """The fixed inputs of one batch bucket's graphs (each context bound of that bucket reads the same ones).

    ``ids`` rows: token ids, positions, context lengths, filled from the host with one copy per step (a
    looked-ahead step, the same sequences one token further, adds one to them on the device instead:
    :meth:`DecodeGraphs.run_next`). The
    slot each new token's K/V goes to is computed inside the graph from the block table and the position
    (``table[pos // block_size] * block_size + pos % block_size``, lesson 03's slot rule), so no slot
    tensor travels per sequence. A padding row has context length 0 and its table's first block is the
    scratch block: it writes there and reads nothing.
    """

    def __init__(self, batch: int, max_blocks: int, scratch_block: int, device: torch.device):
        self.ids = torch.zeros(3, batch, dtype=torch.int64, device=device)
        self.tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.scratch_block = scratch_block
        self.rows: list[list[int]] = []      # what each row of ``tables`` holds (host copy), set by reset()
        self.reset()

    def reset(self) -> None:
        """Every row padding: context length 0, the scratch block first in its table."""
        self.ids.zero_()
        self.tables[:, 0] = self.scratch_block
        self.rows = [[self.scratch_block]] * self.tables.shape[0]

    def load_tables(self, tables: list[list[int]]) -> None:
        """Make ``tables`` (one list of block ids per sequence) the first rows, padding rows after them.
        Only rows that changed since the last step are written: a sequence's table grows by a block once
        every ``block_size`` steps, so most steps copy nothing; when some did change, one copy of the
        rows from the first changed one to the last. (Columns past a row's length are never followed.)"""
        wanted = tables + [[self.scratch_block]] * (len(self.rows) - len(tables))
        changed = [i for i, (row, held) in enumerate(zip(wanted, self.rows)) if row != held]
        if not changed:
            return
        first, last = changed[0], changed[-1] + 1
        width = max(len(row) for row in wanted[first:last])
        upload(self.tables[first:last, :width], [row + [0] * (width - len(row)) for row in wanted[first:last]])
        self.rows[first:last] = wanted[first:last]


class _Cascade:
    """The shared prefix of a bucket's cascade graphs: ``pages`` blocks, whose ids live in ``page_ids``
    (int32, on the device, overwritten before a replay when they change; ``host_ids`` is what it holds),
    and the lesson 05 plans of its multi-query pass, made in the warm-up (:func:`yaie.ops.paged_attention`)."""

    def __init__(self, pages: int, device: torch.device):
        self.pages = pages
        self.page_ids = torch.zeros(pages, dtype=torch.int32, device=device)
        self.host_ids: list[int] | None = None
        self.plans: dict = {}
        self.cu_seqlens: torch.Tensor | None = None    # the level-1 query offsets of the bucket's batch

    def load(self, ids: list[int]) -> None:
        if ids != self.host_ids:
            upload(self.page_ids, ids)
            self.host_ids = list(ids)


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
    bounds, so a run records a handful of graphs. They share one memory pool (replays never overlap: one
    stream). A replay's logits live in the graph's output buffer until the next replay of it; the engine
    queues the step's token picks (argmax or the batched sampler, on the device) right after a replay, so
    a looked-ahead replay may follow before the host reads them (logprobs read the logits first: no
    look-ahead for them).
    """

    def __init__(self, model, manager, max_batch: int, capture: bool = True):
        self.model, self.manager, self.capture = model, manager, capture
        self.buckets = buckets(max_batch)
        self.max_blocks = -(-model.config.max_position_embeddings // manager.block_size)
        self.capacity = self.max_blocks * manager.block_size
        self.scratch_block = int(manager.allocate(SCRATCH_SEQ, 1)[0]) // manager.block_size
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, int, int], tuple] = {}   # (bucket, bound, shared pages) -> (graph, logits)
        self.cascades: dict[tuple[int, int], _Cascade] = {}     # (bucket, shared pages) -> its prefix buffers
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # The last step run from the buffers: (bucket, bound, shared pages, sequence ids, positions), for run_next.
        self._last: tuple | None = None
        self.failed: str | None = None       # why recording failed (or "closed"); then steps run eagerly
        # Cascade decode needs lesson 05 and layers without a sliding window; a failed cascade recording
        # turns it off (with a note) and the plain graphs go on.
        self.no_cascade: str | None = None if ops.cascade_decode_available(model.config) else "unavailable"
        self.cascade_pages = -(-CASCADE_MIN_SHARED_TOKENS // manager.block_size)   # the granule, in pages

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
        self._last = None
        self.failed = "closed"
        if self.manager.has_seq(SCRATCH_SEQ):
            self.manager.free(SCRATCH_SEQ)

    # ------------------------------------------------------------------ one step
    def run(self, seq_ids: list, token_ids: list[int], positions: list[int],
            device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``[len(seq_ids), vocab]`` (float32) of one decode step; None if recording failed. Each
        sequence's slot for its new token must be reserved already (``append_slots``). ``device_tokens``:
        the input token ids on the device instead of ``token_ids`` (the last step's picks)."""
        n = len(seq_ids)
        self._last = None
        bucket = next(b for b in self.buckets if b >= n)
        bound = self.bound(max(positions) + 1)         # a decode's context ends at its new token
        tables = [self.manager.block_ids(s) for s in seq_ids]
        shared = self.shared_pages(tables)
        entry = self.graphs.get((bucket, bound, shared))
        if entry is None:
            if shared:            # the real page ids before the warm-up, where lesson 05 plans
                self._cascade(bucket, shared).load(tables[0][:shared])
            entry = self._record(bucket, bound, shared)
        if entry is None:
            return None
        if isinstance(entry[0], str):                  # ("plain", entry): the cascade recording failed
            shared, entry = 0, entry[1]
        buf, pad = self.buffers[bucket], [0] * (bucket - n)
        lens = [p + 1 for p in positions]
        upload(buf.ids, [token_ids + pad, positions + pad, lens + pad])
        if device_tokens is not None:
            buf.ids[0, :n].copy_(device_tokens)
        buf.load_tables(tables)
        if shared:
            self.cascades[(bucket, shared)].load(tables[0][:shared])
        self._last = (bucket, bound, shared, list(seq_ids), positions)
        return self._replay(entry, buf, bound, self.cascades.get((bucket, shared)))[:n]

    def _replay(self, entry: tuple, buf: _Buffers, bound: int, cascade: _Cascade | None) -> torch.Tensor:
        graph, logits = entry
        if graph is None:                                  # capture=False: the same step, eagerly
            return self._forward(buf, bound, cascade)
        graph.replay()
        return logits

    def continues(self, seq_ids: list) -> bool:
        """Whether the last step run from the buffers decoded ``seq_ids``, in this order (see :meth:`run_next`)."""
        return self._last is not None and self._last[3] == seq_ids

    def run_next(self, seq_ids: list, device_tokens: torch.Tensor) -> torch.Tensor | None:
        """:meth:`run` for the step right after the last one, when it decodes the same sequences in the same
        order (:meth:`continues`), each one token further, its input ids on the device, and no block table
        changed but by a new block where a sequence's new token opens one (the engine's looked-ahead steps:
        nothing is admitted, preempted, swapped or forked in between). The buffers hold the last step's
        positions and lengths: they are advanced on the device (one kernel) instead of copied from the host,
        and only the tables of sequences whose new token opens a block are read from the manager. A step
        that needs a graph recorded first, a cascade, or whose tables changed otherwise goes through
        :meth:`run`."""
        bucket, _, shared, _, previous = self._last
        positions = [p + 1 for p in previous]
        if shared:                                           # the shared blocks may change: the general path
            return self.run(seq_ids, [0] * len(seq_ids), positions, device_tokens)
        size, buf = self.manager.block_size, self.buffers[bucket]
        tables = buf.rows[:len(seq_ids)]
        for i in [i for i, p in enumerate(positions) if p % size == 0]:    # a new block for this token
            table = self.manager.block_ids(seq_ids[i])
            if table[:-1] != tables[i]:
                tables = None                                # changed otherwise: the general path
                break
            tables[i] = table
        bound = self.bound(max(positions) + 1)
        entry = self.graphs.get((bucket, bound, 0))
        if tables is None or entry is None or isinstance(entry[0], str):
            return self.run(seq_ids, [0] * len(seq_ids), positions, device_tokens)
        buf.ids[1:, :len(seq_ids)] += 1                      # positions and context lengths, one token further
        buf.ids[0, :len(seq_ids)].copy_(device_tokens)
        buf.load_tables(tables)
        self._last = (bucket, bound, 0, self._last[3], positions)
        return self._replay(entry, buf, bound, None)[:len(seq_ids)]

    def shared_pages(self, tables: list[list[int]]) -> int:
        """Leading blocks that every sequence's table holds alike (never a sequence's last block, which its
        new token is in), rounded down to the cascade granule; 0 when too short, or no cascade."""
        if self.no_cascade or len(tables) < 2:
            return 0
        first = tables[0]
        pages = min(map(len, tables)) - 1
        for table in tables[1:]:
            if table[:pages] != first[:pages]:
                pages = next(i for i, (a, b) in enumerate(zip(table, first)) if a != b)
                if pages < self.cascade_pages:
                    return 0
        pages -= pages % self.cascade_pages
        lengths = {p for _, p in self.cascades}
        if pages and pages not in lengths and len(lengths) >= MAX_CASCADE_LENGTHS:
            return 0
        return pages

    def _forward(self, buf: _Buffers, bound: int, cascade: _Cascade | None = None) -> torch.Tensor:
        size = self.manager.block_size
        tokens, positions, lens = buf.ids
        blocks = buf.tables.gather(1, (positions // size).unsqueeze(1)).squeeze(1).to(torch.int64)
        slots = blocks * size + positions % size
        step = StaticDecodeStep(self.manager, buf.tables, lens.to(torch.int32), slots, bound, cascade)
        return self.model.logits(self.model.forward(tokens, positions, step))

    def _cascade(self, bucket: int, shared: int) -> _Cascade:
        cascade = self.cascades.get((bucket, shared))
        if cascade is None:
            cascade = self.cascades[(bucket, shared)] = _Cascade(shared, self.manager.device)
        return cascade

    def _record(self, bucket: int, bound: int, shared: int = 0) -> tuple | None:
        device = self.manager.device
        buf = self.buffers.get(bucket)
        if buf is None:
            buf = self.buffers[bucket] = _Buffers(bucket, self.max_blocks, self.scratch_block, device)
        cascade = self._cascade(bucket, shared) if shared else None
        # Until the first replay every row is padding (context 0, writing into the scratch block): the
        # warm-up and the recording change nothing a sequence owns.
        buf.reset()
        if not self.capture:
            self.graphs[(bucket, bound, shared)] = (None, None)
            return self.graphs[(bucket, bound, shared)]
        try:
            # Warm up on the stream the graph is recorded on: Triton compiles its kernels, lesson 04
            # allocates its per-stream split counters and lesson 05 plans here, not inside the recording.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(buf, bound, cascade)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                logits = self._forward(buf, bound, cascade)
        except Exception as err:  # noqa: BLE001 - any failure: say so once, run eagerly from now on
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            torch.cuda.synchronize(device)
            if shared:             # only the cascade failed, maybe: no more cascades, try the plain graph
                self.no_cascade = reason
                print(f"yaie: recording a cascade decode graph failed ({reason}); decoding without cascade "
                      "from now on", file=sys.stderr, flush=True)
                plain = self.graphs.get((bucket, bound, 0)) or self._record(bucket, bound, 0)
                if plain is None:
                    return None
                self.graphs[(bucket, bound, shared)] = ("plain", plain)
                return self.graphs[(bucket, bound, shared)]
            self.failed = reason
            print(f"yaie: recording a CUDA graph of the decode step failed ({self.failed}); decoding without "
                  "graphs from now on", file=sys.stderr, flush=True)
            return None
        self.graphs[(bucket, bound, shared)] = (graph, logits)
        return self.graphs[(bucket, bound, shared)]
