"""The serving state of Based models (lesson 08): one row per sequence, the same bytes at any length.

:class:`BasedRows` holds the state of up to ``capacity`` sequences at once, one row each:

* Based layers: a lesson 08 ``BasedState`` with a batch dimension, ``kv [rows, heads, 273, head_dim]`` and
  ``k [rows, heads, 273]`` (float32). A prompt runs through lesson 08's prefill (``based_prefill``; on a CPU
  its PyTorch twin ``based_chunked_reference``), whose final state is copied into the sequence's row; a
  decode step updates every row at once with ``based_decode_step``.
* Window layers: a ring of ``window`` key/value slots per sequence, laid out as pages of a lesson 03 paged
  cache (the token at position ``p`` lives in slot ``p mod window``). Keys are rotated (RoPE) before they
  are written, so the ring's order does not matter to softmax. A decode step writes each row's new key and
  value into its ring and attends over its first ``min(p + 1, window)`` slots with lesson 04's paged decode
  kernel; a prompt attends through lesson 06's varlen kernel with its window. On a CPU, lesson 01's
  attention stands in for both kernels.
* BaseConv layers (public checkpoints): the last ``k - 1`` inputs per channel, ``[rows, inner, k - 1]``.

The decode step has fixed shapes, so on CUDA it is recorded as a CUDA graph per batch bucket and replayed.
:class:`BasedCache` is one sequence's cache for :meth:`yaie.model.based.BasedModel.forward` (tests, logit
checks).
"""

from __future__ import annotations

import sys

import torch

from yaie import ops
from yaie.model import base_conv
from yaie.model.graphs import buckets, upload

LESSON = 8
PREFILL_BLOCK = 1024       # window-layer prompt attention on a CPU: queries per block
EXTEND_CHUNK = 64          # a Based layer continuing a sequence: tokens per exact causal tile
RING_BLOCK_SIZES = (16, 32, 8, 64, 128)   # tokens per ring page, in order of preference (lesson 04 takes 8..128)


def _lesson():
    # Through ops, so an unfinished stub falls back to the reference in auto mode, as everywhere else.
    return ops.LessonCalls(LESSON)


def ring_block_size(window: int) -> int:
    """Tokens per page of a window ring: a size lesson 04's kernel takes that divides ``window`` (so a ring
    is whole pages), else the window itself (one page per ring)."""
    return next((size for size in RING_BLOCK_SIZES if window % size == 0), window)


class BasedRows:
    """The serving state of up to ``capacity`` sequences of a Based model, one row each (module docstring).

    Rows ``0 .. n - 1`` hold the decoding sequences (the engine keeps them packed with :meth:`move`), so a
    decode step of ``n`` sequences reads leading slices of every buffer, never a gather. Rows
    ``capacity .. capacity + spare_rows - 1`` are never decoded nor touched by a graph's padding: a prompt
    fed in chunks over several steps grows there, then moves down to a decoding row.

    Args:
        model: the :class:`yaie.model.based.BasedModel`.
        capacity: rows that decode (sequences at once).
        spare_rows: rows beyond them, for prompts being prefilled in chunks.
        use_kernels: the GPU kernels (lessons 04, 06, 08); default: on CUDA. Off: PyTorch stand-ins.
        graphs: replay decode steps from CUDA graphs, one per batch bucket (needs CUDA). Default: on CUDA.
        capture: False runs the graphs' fixed-buffer, bucket-padded steps eagerly (CPU tests of that path).
    """

    def __init__(self, model, capacity: int, use_kernels: bool | None = None, graphs: bool | None = None,
                 capture: bool = True, spare_rows: int = 0):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(spare_rows, int) or spare_rows < 0:
            raise ValueError(f"spare_rows must be an int >= 0, got {spare_rows!r}")
        cfg = model.config
        self.model, self.config, self.capacity = model, cfg, capacity
        self.rows = rows = capacity + spare_rows
        self.device, self.dtype = model.device, model.dtype
        cuda = self.device.type == "cuda"
        self.use_kernels = cuda if use_kernels is None else bool(use_kernels)
        self.static = cuda if graphs is None else bool(graphs)
        if self.static and capture and not cuda:
            raise ValueError("CUDA graphs need a CUDA device (capture=False runs their steps eagerly)")
        self.capture = self.static and capture
        based = _lesson()
        self.states = {n: based.empty_state(rows, cfg.num_heads, cfg.head_dim, self.device)
                       for n in cfg.based_layers}
        # BaseConv layers (public Based checkpoints): the last k - 1 inputs per channel, [rows, inner, k - 1].
        conv = cfg.based_gpt
        self.conv_states = {n: torch.zeros(rows, conv["conv_inner"], conv["conv_kernel"] - 1, dtype=self.dtype,
                                           device=self.device) for n in cfg.based_conv_layers}
        window_layers = [n for n in range(cfg.num_layers) if n not in cfg.based_layers and n not in self.conv_states]
        self.window_index = {n: i for i, n in enumerate(window_layers)}   # model layer -> ring layer
        self.window = self.block_size = 0
        self.manager = self.tables = self.slots = None
        if window_layers:
            windows = {cfg.sliding_windows[n] for n in window_layers}
            if len(windows) != 1 or None in windows:
                raise ValueError(f"the non-Based layers of a Based model need one sliding window, got {windows}")
            self.window = windows.pop()
            self.block_size = ring_block_size(self.window)
            pages = self.window // self.block_size
            # Lesson 03's paged cache: each row's ring is one "sequence" of `window` tokens.
            self.manager = ops.kv_cache_manager(rows * pages, self.block_size, len(window_layers),
                                                cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
            rings = [("ring", r) for r in range(rows)]
            for ring in rings:
                self.manager.allocate(ring, self.window)
            for cache in (*self.manager.k_cache, *self.manager.v_cache):
                cache.zero_()      # the PyTorch path weighs unwritten slots by 0, and 0 * NaN garbage is NaN
            self.tables = self.manager.block_table(rings).to(torch.int32).contiguous()   # [rows, pages]
            # The cache slot of each ring entry, [rows, window] (int64): a decode step looks its slots up here.
            self.slots = (self.tables.to(torch.int64)[:, :, None] * self.block_size
                          + torch.arange(self.block_size, device=self.device)).flatten(1)
        self.ids = torch.zeros(2, rows, dtype=torch.int64, device=self.device)   # decode input: tokens, positions
        self.last_rows: int | None = None         # rows of the last decode step, while unchanged (decode_next)
        self.buckets = buckets(capacity)
        self.graphs: dict[int, tuple] = {}        # bucket -> (graph or None, its logits buffer)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.failed: str | None = None            # why recording failed: then steps run eagerly

    # ------------------------------------------------------------------ memory
    def row_nbytes(self) -> int:
        """Bytes one sequence holds: its rows of the Based states and its rings, whatever its length."""
        total = sum((s.kv[0].numel() + s.k[0].numel()) * s.kv.element_size() for s in self.states.values())
        total += sum(c[0].numel() * c.element_size() for c in self.conv_states.values())
        if self.manager is not None:
            pages = self.window // self.block_size           # c[0]: one page of one layer's keys or values
            total += sum(c[0].numel() * c.element_size() * pages for c in (*self.manager.k_cache, *self.manager.v_cache))
        return total

    # ------------------------------------------------------------------ the engine's calls
    def prefill(self, row: int, token_ids: list[int]) -> torch.Tensor:
        """Run a prompt into row ``row`` (replacing what the row held); the logits of its last token ``[1, vocab]``."""
        return self._feed(row, token_ids, 0, _Prefill(self, row))

    def extend(self, row: int, token_ids: list[int], start: int) -> torch.Tensor:
        """Feed more tokens of the sequence in row ``row`` (its positions ``start ..``, after the ``start``
        tokens it read already); the logits of the last one ``[1, vocab]``."""
        if not isinstance(start, int) or start < 1:
            raise ValueError(f"extend continues a sequence: start must be an int >= 1, got {start!r}")
        return self._feed(row, token_ids, start, _Extend(self, row, start))

    def _feed(self, row: int, token_ids: list[int], start: int, cache) -> torch.Tensor:
        if not 0 <= row < self.rows:
            raise ValueError(f"row {row} is outside 0..{self.rows - 1}")
        if not token_ids:
            raise ValueError("no tokens to feed")
        self.last_rows = None
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        return self.model.logits(self.model.forward(ids, positions, cache)[-1:])

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step of rows ``0 .. n - 1`` (``n = len(tokens)``): row ``i`` reads ``tokens[i]`` at
        ``positions[i]``. Returns the logits ``[n, vocab]`` (float32)."""
        n = len(tokens)
        if not 1 <= n <= self.capacity or len(positions) != n:
            raise ValueError(f"a decode step takes 1..{self.capacity} rows with one position each, got "
                             f"{n} tokens and {len(positions)} positions")
        upload(self.ids[:, :n], [tokens, positions])      # queued from pinned memory: no wait for the device
        self.last_rows = n
        return self._run(n)

    def decode_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decode step right after the last one (the engine's look-ahead):
        the same rows ``0 .. n - 1``, each one position further, reading ``tokens`` (int64 ``[n]`` on the
        device: the last step's picks, not read by the host). Only device work is queued (the token ids
        copied into the step's input buffer, the positions advanced there), so on CUDA the host launches it
        while the last step still runs. Allowed only while nothing changed the rows since that step (no
        :meth:`prefill`, no :meth:`move`); else ``ValueError``. Returns the logits ``[n, vocab]``."""
        n = self.last_rows
        if n is None:
            raise ValueError("decode_next continues the last decode step's rows, but no decode step ran since "
                             "the rows last changed (a prefill or move): call decode")
        if tuple(tokens.shape) != (n,):
            raise ValueError(f"decode_next takes one token per row of the last decode step ({n} rows), got "
                             f"tokens of shape {tuple(tokens.shape)}")
        self.ids[0, :n].copy_(tokens)
        self.ids[1, :n].add_(1)
        return self._run(n)

    def _run(self, n: int) -> torch.Tensor:
        """The decode step of rows ``0 .. n - 1`` from the input buffer ``ids``: a CUDA graph's replay (or its
        fixed-buffer step run eagerly), else the plain step."""
        if self.static and self.failed is None:
            bucket = next(b for b in self.buckets if b >= n)
            entry = self.graphs.get(bucket) or self._record(bucket, n)
            if entry is not None:
                graph, logits = entry
                if graph is None:                 # capture=False: the same fixed-buffer step, eagerly
                    logits = self._step(bucket)
                else:
                    graph.replay()
                return logits[:n]
        return self._step(n)

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence moves to row ``dst`` (the engine packs running rows after one ends): its
        Based states are copied; its ring pages change rows in the block table (no key is copied). Device
        copies only, queued behind any step already launched (which reads the rows as they were)."""
        if not (0 <= src < self.rows and 0 <= dst < self.rows):
            raise ValueError(f"rows {src} and {dst} must lie in 0..{self.rows - 1}")
        self.last_rows = None
        for state in self.states.values():
            state.kv[dst].copy_(state.kv[src])
            state.k[dst].copy_(state.k[src])
        for conv in self.conv_states.values():
            conv[dst].copy_(conv[src])
        if self.tables is not None:        # a swap by copies: an index list from the host would wait for the device
            for table in (self.tables, self.slots):
                held = table[dst].clone()
                table[dst].copy_(table[src])
                table[src].copy_(held)

    # ------------------------------------------------------------------ decode step, graphs
    def _step(self, rows: int) -> torch.Tensor:
        tokens, positions = self.ids[0, :rows], self.ids[1, :rows]
        return self.model.logits(self.model.forward(tokens, positions, _Decode(self, positions)))

    def _record(self, bucket: int, live: int) -> tuple | None:
        """Record the decode step of ``bucket`` rows. Rows past the live ones are free: whatever the step
        does to them is overwritten by the next prompt admitted there. The warm-up runs (which compile
        kernels outside the recording) change the live rows' states and rings: they are saved and restored."""
        if not self.capture:
            self.graphs[bucket] = (None, None)
            return self.graphs[bucket]
        saved = self._save(live)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                logits = self._step(bucket)
        except Exception as err:  # noqa: BLE001 - any failure: say so once, run eagerly from now on
            torch.cuda.synchronize(self.device)
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"yaie: recording a CUDA graph of the Based decode step failed ({self.failed}); decoding "
                  "without graphs from now on", file=sys.stderr, flush=True)
            return None
        finally:
            self._restore(saved)
        self.graphs[bucket] = (graph, logits)
        return self.graphs[bucket]

    def _save(self, rows: int) -> list:
        saved = [(s.kv[:rows].clone(), s.k[:rows].clone()) for s in self.states.values()]
        if self.manager is not None:
            saved += [c.clone() for c in (*self.manager.k_cache, *self.manager.v_cache)]
        return saved + [c[:rows].clone() for c in self.conv_states.values()]

    def _restore(self, saved: list) -> None:
        for (kv, k), state in zip(saved, self.states.values()):
            state.kv[:kv.shape[0]].copy_(kv)
            state.k[:k.shape[0]].copy_(k)
        if self.manager is not None:
            for copy, cache in zip(saved[len(self.states):], (*self.manager.k_cache, *self.manager.v_cache)):
                cache.copy_(copy)
        for copy, conv in zip(saved[len(saved) - len(self.conv_states):], self.conv_states.values()):
            conv[:copy.shape[0]].copy_(copy)

    # ------------------------------------------------------------------ the layers
    def ring_slots(self, rows: int | slice, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots (int64) of the tokens at ``positions`` of the sequences in ``rows`` (one row for all
        positions, or a slice of rows, one position each): ring entry ``p mod window`` of the row's ``slots``."""
        ring = positions % self.window
        slots = self.slots[rows]
        return slots[ring] if slots.dim() == 1 else slots.gather(1, ring.unsqueeze(1)).squeeze(1)

    def prefill_window(self, layer: int, row: int, q, k, v) -> torch.Tensor:
        """A window layer over a whole prompt (``[t, heads, d]``, RoPE applied); its last keys go to the ring."""
        t, w = q.shape[0], self.window
        if self.use_kernels:
            cu = torch.tensor([0, t], dtype=torch.int32, device=q.device)
            out, _ = ops.call(6, "flash_attention_varlen_forward", q, k, v, cu, cu, t, t, causal=True,
                              sliding_window=w)
        else:
            outs = []
            for start in range(0, t, PREFILL_BLOCK):     # blocks of queries: no t x t matrix
                end = min(start + PREFILL_BLOCK, t)
                lo = max(0, start - (w - 1))             # the first key the block's first query sees
                outs.append(ops.attention(q[start:end], k[lo:end], v[lo:end], sliding_window=w))
            out = torch.cat(outs)
        kept = min(t, w)
        positions = torch.arange(t - kept, t, device=q.device)
        ops.write_kv(self.manager, self.window_index[layer], self.ring_slots(row, positions), k[-kept:], v[-kept:])
        return out

    def decode_window(self, layer: int, q, k, v, slots: torch.Tensor, context_lens: torch.Tensor,
                      rope: tuple | None = None) -> torch.Tensor:
        """A window layer, one token per row (``q [rows, heads, d]``): write each row's key and value at its
        ring slot, then attend over the ring's first ``context_lens`` slots. ``rope``: ``(cos, sin,
        positions)`` when ``q, k`` are not rotated yet; the rotation and the write are then one kernel on
        CUDA (:func:`yaie.ops.rope_and_write_kv`)."""
        index, rows = self.window_index[layer], q.shape[0]
        if rope is None:
            ops.write_kv(self.manager, index, slots, k, v)
        else:
            q, k = ops.rope_and_write_kv(self.manager, index, slots, q, k, v, *rope)
        k_cache, v_cache = self.manager.k_cache[index], self.manager.v_cache[index]
        if self.use_kernels:
            return ops.call(4, "paged_attention_forward", q, k_cache, v_cache, self.tables[:rows], context_lens,
                            self.window, validate=False)
        # PyTorch: gather each row's ring, mask the slots not written yet, lesson 01's attention.
        ring = self.slots[:rows]                                                # [rows, window]
        keys = k_cache.flatten(0, 1)[ring].transpose(1, 2)                      # [rows, kv_heads, window, d]
        values = v_cache.flatten(0, 1)[ring].transpose(1, 2)
        seen = torch.arange(self.window, device=q.device) < context_lens[:, None]
        out = ops.call(1, "cpu_attention_forward", q[:, :, None], keys, values, seen[:, None, None, :])
        return out[:, :, 0]

    def continue_window(self, layer: int, row: int, start: int, q, k, v) -> torch.Tensor:
        """A window layer, several tokens after a prefill (positions ``start ..``): the ring's keys put back
        in position order, the new ones after them, exact windowed attention, then the ring updated."""
        t, w = q.shape[0], self.window
        index = self.window_index[layer]
        old = torch.arange(max(0, start - (w - 1)), start, device=q.device)
        slots = self.ring_slots(row, old)
        keys = torch.cat([self.manager.k_cache[index].flatten(0, 1)[slots], k])
        values = torch.cat([self.manager.v_cache[index].flatten(0, 1)[slots], v])
        out = ops.attention(q, keys, values, sliding_window=w)
        kept = min(t, w)
        new = torch.arange(start + t - kept, start + t, device=q.device)
        ops.write_kv(self.manager, index, self.ring_slots(row, new), k[-kept:], v[-kept:])
        return out

    def prefill_linear(self, layer: int, row: int, q, k, v) -> torch.Tensor:
        """A Based layer over a whole prompt (``q, k [t, heads, 16]``, ``v [t, heads, d]``): lesson 08's prefill;
        its final state becomes the row's."""
        based = _lesson()
        qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, k, v))     # [1, heads, t, .] views
        prefill = based.based_prefill if self.use_kernels else based.based_chunked_reference
        out, state = prefill(qb, kb, vb)
        self.states[layer].kv[row].copy_(state[0][0])
        self.states[layer].k[row].copy_(state[1][0])
        return out[0].transpose(0, 1).to(q.dtype)

    def continue_linear(self, layer: int, row: int, q, k, v) -> torch.Tensor:
        """A Based layer, several tokens after the row's earlier ones (``q, k [t, heads, 16]``, ``v [t, heads,
        d]``): the chunked algorithm of lesson 08 started from the row's state instead of zeros, in PyTorch
        (float32), with lesson 08's feature map. The row's state moves past the new tokens."""
        feature_map, state = _lesson().taylor_feature_map, self.states[layer]
        kv, ks = state.kv[row], state.k[row]                 # [heads, 273, d], [heads, 273]: views, updated in place
        q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))   # [heads, t, .]
        out = torch.empty_like(v)
        for start in range(0, q.shape[1], EXTEND_CHUNK):
            end = min(start + EXTEND_CHUNK, q.shape[1])
            fq, fk, vc = feature_map(q[:, start:end]), feature_map(k[:, start:end]), v[:, start:end]
            tile = (fq @ fk.transpose(-1, -2)).tril()          # this chunk's exact causal weights
            num = fq @ kv + tile @ vc                          # earlier tokens through the state, then the tile
            den = (fq * ks[:, None, :]).sum(-1) + tile.sum(-1)
            out[:, start:end] = num / den[..., None]
            kv += fk.transpose(-1, -2) @ vc
            ks += fk.sum(-2)
        return out.transpose(0, 1)

    def decode_linear(self, layer: int, q, k, v) -> torch.Tensor:
        """A Based layer, one token per row (``q, k [rows, heads, 16]``, ``v [rows, heads, d]``): lesson 08's
        recurrent step, in place on the leading ``rows`` rows of the state (views: nothing is copied)."""
        based, rows, state = _lesson(), q.shape[0], self.states[layer]
        return based.based_decode_step(q, k, v, based.BasedState(state.kv[:rows], state.k[:rows]))


    def prefill_conv(self, layer: int, row: int, x: torch.Tensor, weights) -> torch.Tensor:
        """A BaseConv layer over a whole prompt (``x [t, hidden]``); its last inputs become the row's state."""
        out, state = base_conv.base_conv_block(x, weights)
        self.conv_states[layer][row].copy_(state)
        return out

    def continue_conv(self, layer: int, row: int, x: torch.Tensor, weights) -> torch.Tensor:
        """A BaseConv layer, several tokens after the row's earlier ones."""
        out, state = base_conv.base_conv_block(x, weights, self.conv_states[layer][row])
        self.conv_states[layer][row].copy_(state)
        return out

    def decode_conv(self, layer: int, x: torch.Tensor, weights) -> torch.Tensor:
        """A BaseConv layer, one token per row (``x [rows, hidden]``): the leading rows' states step in place."""
        return base_conv.base_conv_block_step(x, weights, self.conv_states[layer][:x.shape[0]])


class _Prefill:
    """The cache :meth:`BasedModel.forward` gets for one prompt going into row ``row``."""

    def __init__(self, owner: BasedRows, row: int):
        self.owner, self.row = owner, row

    def attend(self, layer, q, k, v, sliding_window=None):
        return self.owner.prefill_window(layer, self.row, q, k, v)

    def attend_linear(self, layer, q, k, v):
        return self.owner.prefill_linear(layer, self.row, q, k, v)

    def convolve(self, layer, x, weights):
        return self.owner.prefill_conv(layer, self.row, x, weights)


class _Extend:
    """The cache :meth:`BasedModel.forward` gets for more tokens of the sequence in row ``row`` (positions
    ``start ..``): a prompt fed in chunks."""

    def __init__(self, owner: BasedRows, row: int, start: int):
        self.owner, self.row, self.start = owner, row, start

    def attend(self, layer, q, k, v, sliding_window=None):
        return self.owner.continue_window(layer, self.row, self.start, q, k, v)

    def attend_linear(self, layer, q, k, v):
        return self.owner.continue_linear(layer, self.row, q, k, v).to(q.dtype)

    def convolve(self, layer, x, weights):
        return self.owner.continue_conv(layer, self.row, x, weights)


class _Decode:
    """The cache :meth:`BasedModel.forward` gets for one decode step of the leading rows: the ring slots and
    context lengths come from the positions on the device (no host value: the step can be a CUDA graph)."""

    def __init__(self, owner: BasedRows, positions: torch.Tensor):
        self.owner = owner
        rows = positions.shape[0]
        if owner.manager is not None:
            self.ring_slots = owner.ring_slots(slice(0, rows), positions)
            self.context_lens = (positions + 1).clamp(max=owner.window).to(torch.int32)

    def rope_and_attend(self, layer, q, k, v, cos, sin, positions, sliding_window=None):
        # The model leaves RoPE to the cache (as with a paged step): one kernel rotates and writes to the ring.
        return self.owner.decode_window(layer, q, k, v, self.ring_slots, self.context_lens, (cos, sin, positions))

    def attend_linear(self, layer, q, k, v):
        return self.owner.decode_linear(layer, q, k, v)

    def convolve(self, layer, x, weights):
        return self.owner.decode_conv(layer, x, weights)


class BasedCache:
    """One sequence's cache for :meth:`BasedModel.forward` (tests, logit checks): a :class:`BasedRows` of one
    row. The first forward is the prompt (the prefill path), then one token per call (the decode step),
    or several (each Based layer steps token by token; each window layer attends over its ring and the
    new tokens).

    ``use_kernels``: the GPU kernels (default: on CUDA).
    """

    def __init__(self, config, device: torch.device | str, use_kernels: bool | None = None):
        self.config = config
        self.device = torch.device(device)
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        self.rows: BasedRows | None = None
        self.tokens = [0] * config.num_layers

    def __len__(self) -> int:
        """Tokens read (by completed forward passes)."""
        return self.tokens[-1]

    def nbytes(self) -> int:
        """Bytes held for this sequence: its Based states and its window rings (0 before the first forward)."""
        return self.rows.row_nbytes() if self.rows is not None else 0

    def _rows(self, dtype: torch.dtype) -> BasedRows:
        if self.rows is None:
            model = _Shape(self.config, self.device, dtype)
            self.rows = BasedRows(model, 1, use_kernels=self.use_kernels, graphs=False)
        return self.rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        """A window layer: ``q [t, heads, d]``, ``k, v [t, kv_heads, d]`` (RoPE applied) -> ``[t, heads, d]``."""
        if sliding_window is None:
            raise ValueError(f"layer {layer} of a Based model must be a Based layer or a sliding-window layer")
        rows, start, t = self._rows(k.dtype), self.tokens[layer], q.shape[0]
        if start == 0:
            out = rows.prefill_window(layer, 0, q, k, v)
        elif t == 1:
            step = _Decode(rows, torch.tensor([start], device=q.device))
            out = rows.decode_window(layer, q, k, v, step.ring_slots, step.context_lens)
        else:
            out = rows.continue_window(layer, 0, start, q, k, v)
        self.tokens[layer] += t
        return out

    def attend_linear(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A Based layer: ``q, k [t, heads, 16]``, ``v [t, heads, d]`` -> ``[t, heads, d]``; updates the state."""
        rows = self._rows(v.dtype)
        if self.tokens[layer] == 0:
            out = rows.prefill_linear(layer, 0, q, k, v)
        else:                               # one token at a time: [1, heads, .] as a batch of one row
            out = torch.cat([rows.decode_linear(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(q.shape[0])])
        self.tokens[layer] += q.shape[0]
        return out

    def convolve(self, layer: int, x: torch.Tensor, weights) -> torch.Tensor:
        """A BaseConv layer: ``x [t, hidden]`` -> ``[t, hidden]``; updates its state (the last inputs)."""
        rows = self._rows(x.dtype)
        if self.tokens[layer] == 0:
            out = rows.prefill_conv(layer, 0, x, weights)
        elif x.shape[0] == 1:
            out = rows.decode_conv(layer, x, weights)
        else:
            out = rows.continue_conv(layer, 0, x, weights)
        self.tokens[layer] += x.shape[0]
        return out


class _Shape:
    """What :class:`BasedRows` reads of a model when it only serves layer calls (:class:`BasedCache`)."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        self.config, self.device, self.dtype = config, device, dtype
