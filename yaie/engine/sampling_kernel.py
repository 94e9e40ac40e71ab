"""The sampler of :mod:`yaie.engine.sampling` as one Triton kernel: a program per row, no sort.

:func:`sample_rows` picks every row's token in one launch, top-k and top-p included. It
keeps the same tokens as :func:`yaie.engine.sampling.filter_logits` and draws as
:func:`yaie.engine.sampling.draw`, with the row's number from :func:`yaie.engine.sampling.uniforms`, so a
seeded request gets the same token from either, except where float rounding puts the cut or the draw on the
other side of a boundary (their sums run in different orders).

A program owns one row. Up to ``RESIDENT_VOCAB`` tokens the row stays in the program's registers for the
bisections; a longer row is walked in tiles of a scratch row (L2-resident), which holds its scaled logits for
top-k's bisection and then its masses. Every row's masses go to the scratch row, which the draw reads back in
tiles:

1. the maximum of the scaled logits ``s = x / temperature`` and the first index that holds it (a greedy row's
   token: its program stops there);
2. for a top-k row, the k-th largest scaled logit, by bisection over the floats' order keys (an int32 per
   float32 whose signed order is the floats' order), counting the tokens at or above each candidate; then
   each kept token's mass ``e = exp(s - max)`` (in (0, 1], the maximum's is 1; 0 for dropped tokens), and
   their sum ``Z``;
3. for a top-p row, the cut without sorting: the smallest mass ``c`` such that the tokens heavier than ``c``
   hold less than ``top_p * Z``. A sorted row keeps exactly those tokens, and of the tokens of mass ``c``
   (lowest ids first) as many as keep the mass before each under ``top_p * Z``. Non-negative float32s order
   as their bits do as int32s, so ``c`` is found by bisection over those integers: each walk over the row
   sums the mass above the middle of the interval and halves it (30 walks cover the 2**30 floats in [0, 1]);
4. the kept tokens' total mass in float64, then the draw: the first kept token whose cumulative mass, in
   vocabulary order, exceeds ``u * total``. The total is a sum of tile sums, and the draw adds the same tile
   sums in the same order to find the tile where the cumulative mass passes ``u * total``: only that tile
   takes a prefix sum.

A walk over a resident row is a few instructions per register and one reduction, where the torch sampler
sorts the row. The row's uniform number is SplitMix64 of its state, computed in the kernel on uint64
(products wrap modulo 2**64 as :func:`yaie.engine.sampling.mix64`'s int64 products do).
"""

from __future__ import annotations

import torch

from yaie.device import prepare_triton

prepare_triton()  # must run before `import triton` on a machine with no GPU

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

RESIDENT_VOCAB = 32768     # rows up to this long stay in registers (32 warps: 32 values a thread)


@triton.jit
def _uniform(state):
    """The top 53 bits of SplitMix64's output for an int64 state, over 2**53: a float64 in [0, 1)."""
    z = state.to(tl.uint64, bitcast=True)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _order_key(s):
    """An int32 per float32 whose signed order is the floats' order (-0.0 just below +0.0; no NaN)."""
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    """The float32 of an order key (the map is its own inverse on the bits)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest(scaled_row_ptr, vocab, k, resident, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """The k-th largest scaled logit of the row (equal values counted each), by bisection over order keys:
    at least k keys are >= ``low``, fewer than k are >= ``high``. ``resident``: the row, if it is one tile;
    else the scaled logits are read from ``scaled_row_ptr`` (the scratch row)."""
    lanes = tl.arange(0, BLOCK)
    low = tl.full((), -2147483648, tl.int64)
    high = tl.full((), 2147483648, tl.int64)
    while high - low > 1:
        middle = (low + (high - low) // 2).to(tl.int32)
        count = tl.full((), 0, tl.int32)
        for tile in range(TILES):
            offs = tile * BLOCK + lanes
            s = _scratch_tile(scaled_row_ptr, offs, vocab, resident, TILES)
            count += tl.sum(((_order_key(s) >= middle) & (offs < vocab)).to(tl.int32))
        enough = count >= k
        low = tl.where(enough, middle.to(tl.int64), low)
        high = tl.where(enough, high, middle.to(tl.int64))
    return _from_order_key(low.to(tl.int32))


@triton.jit
def _scaled_tile(row_ptr, offs, vocab, temperature):
    """A tile of scaled logits (``-inf`` past the vocabulary). ``div_rn`` rounds as torch's float32 division
    does, so the reference's values come back bit for bit."""
    x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, temperature)


@triton.jit
def _scaled_row_tile(row_ptr, offs, vocab, temperature, resident, TILES: tl.constexpr):
    """A tile of the row's scaled logits: the registers' copy for a resident row, else loaded and divided."""
    if TILES == 1:
        s = resident
    else:
        s = _scaled_tile(row_ptr, offs, vocab, temperature)
    return s


@triton.jit
def _scratch_tile(scratch_row_ptr, offs, vocab, resident, TILES: tl.constexpr):
    """A tile of what the scratch row holds (the scaled logits, later the masses): the registers' copy for a
    resident row, else the scratch row's (0 past the vocabulary)."""
    if TILES == 1:
        t = resident
    else:
        t = tl.load(scratch_row_ptr + offs, mask=offs < vocab, other=0.0)
    return t


@triton.jit
def _sample_kernel(logits_ptr, row_stride, vocab, temperature_ptr, top_k_ptr, top_k_stride, top_p_ptr,
                   greedy_ptr, state_ptr, state_stride, mass_ptr, token_ptr, u_ptr,
                   BLOCK: tl.constexpr, TILES: tl.constexpr, DRAW_BLOCK: tl.constexpr,
                   STORE_U: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    mass_row_ptr = mass_ptr + row.to(tl.int64) * vocab
    temperature = tl.load(temperature_ptr + row)
    lanes = tl.arange(0, BLOCK)

    # 1. The maximum of the scaled logits, and the first index holding it (a greedy row's token).
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    resident = tl.zeros([BLOCK], tl.float32)
    for tile in range(TILES):
        offs = tile * BLOCK + lanes
        s = _scaled_tile(row_ptr, offs, vocab, temperature)
        tile_best = tl.max(s)
        tile_index = tl.min(tl.where((offs < vocab) & (s == tile_best), offs, vocab))
        best_index = tl.where(tile_best > best, tile_index, best_index)
        best = tl.maximum(best, tile_best)
        resident = s
    if tl.load(greedy_ptr + row) != 0:
        tl.store(token_ptr + row, best_index.to(tl.int64))
    else:
        # Top-k keeps the tokens >= the k-th largest value (the maximum always stays).
        top_k = tl.load(top_k_ptr + row * top_k_stride).to(tl.int32)
        kth = tl.full((), float("-inf"), tl.float32)
        if top_k > 0:
            if TILES > 1:
                # The scaled logits go to the scratch row once (the masses overwrite them below): each walk of
                # the bisection then reads them back instead of dividing every logit again, which is what
                # a walk over a long row otherwise spends its time on.
                for tile in range(TILES):
                    offs = tile * BLOCK + lanes
                    tl.store(mass_row_ptr + offs, _scaled_tile(row_ptr, offs, vocab, temperature), mask=offs < vocab)
                tl.debug_barrier()
            kth = _kth_largest(mass_row_ptr, vocab, top_k, resident, BLOCK, TILES)
            if TILES > 1:
                tl.debug_barrier()     # every read of the scaled logits comes before the masses' stores
        # 2. The masses and their sum, into the scratch row (a resident row also keeps its one tile in
        # registers for the bisection).
        total_mass = tl.full((), 0.0, tl.float32)
        e = tl.zeros([BLOCK], tl.float32)
        for tile in range(TILES):
            offs = tile * BLOCK + lanes
            s = _scaled_row_tile(row_ptr, offs, vocab, temperature, resident, TILES)
            e = tl.where((offs < vocab) & (s >= kth), tl.exp(s - best), 0.0)     # top-k keeps s >= kth
            tl.store(mass_row_ptr + offs, e, mask=offs < vocab)
            total_mass += tl.sum(e)
        tl.debug_barrier()         # the scratch row's stores are seen by every thread of the program
        cut, ties_kept = _top_p_cut(mass_row_ptr, vocab, e, total_mass, tl.load(top_p_ptr + row), BLOCK, TILES)
        state = tl.load(state_ptr + row * state_stride)
        u = _uniform(state)
        token = _draw(mass_row_ptr, vocab, cut, ties_kept, u, DRAW_BLOCK)
        tl.store(token_ptr + row, token.to(tl.int64))
        if STORE_U:
            tl.store(u_ptr + row, u)


@triton.jit
def _top_p_cut(mass_row_ptr, vocab, resident, total_mass, top_p, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """``(cut, ties_kept)``: the row keeps the tokens whose mass's bits, as an int32, exceed ``cut``, and the
    first ``ties_kept`` of those equal to it. Without top-p (``top_p >= 1``) every token of mass > 0 stays."""
    lanes = tl.arange(0, BLOCK)
    cut = tl.full((), 0, tl.int32)                 # the bits of mass 0.0: every kept token lies above
    ties_kept = tl.full((), 0, tl.int32)
    if top_p < 1.0:
        wanted = top_p * total_mass
        # Invariant: the mass above `high` is below `wanted` (none lies above 1.0, the maximum's mass); the
        # mass above `low` is not (it is all of Z, summed as Z was).
        low = tl.full((), -1, tl.int32)
        high = tl.full((), 0x3F800000, tl.int32)   # the bits of 1.0
        above_high = tl.full((), 0.0, tl.float32)
        while high - low > 1:
            middle = low + (high - low) // 2
            above = tl.full((), 0.0, tl.float32)
            for tile in range(TILES):
                offs = tile * BLOCK + lanes
                e = _scratch_tile(mass_row_ptr, offs, vocab, resident, TILES)
                above += tl.sum(tl.where(e.to(tl.int32, bitcast=True) > middle, e, 0.0))
            light = above < wanted
            above_high = tl.where(light, above, above_high)
            high = tl.where(light, middle, high)
            low = tl.where(light, low, middle)
        cut = high
        # Tokens of the cut's mass, lowest ids first: the r-th stays while above + r * its mass < wanted.
        cut_mass = cut.to(tl.float32, bitcast=True)
        room = tl.minimum((wanted - above_high) / cut_mass, vocab * 1.0)
        ties_kept = tl.math.ceil(room).to(tl.int32)
    return cut, ties_kept


@triton.jit
def _kept_masses(mass_row_ptr, offs, vocab, cut, ties_kept, ties_before):
    """A tile of the scratch row's masses with the tokens top-p drops set to 0, and how many tokens of the
    cut's mass it holds. ``ties_before``: tokens of the cut's mass in the tiles before this one."""
    e = tl.load(mass_row_ptr + offs, mask=offs < vocab, other=0.0)
    key = e.to(tl.int32, bitcast=True)
    tie = (key == cut) & (e > 0)
    ties = tl.sum(tie.to(tl.int32))
    # Ranking the ties takes a prefix sum over the tile; only the tile that holds the last kept tie needs it.
    if ties_before + ties <= ties_kept:
        kept = (key > cut) | tie
    elif ties_before >= ties_kept:
        kept = key > cut
    else:
        rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        kept = (key > cut) | (tie & (rank < ties_kept))
    return tl.where(kept, e, 0.0), ties


@triton.jit
def _draw(mass_row_ptr, vocab, cut, ties_kept, u, BLOCK: tl.constexpr):
    """The first token whose cumulative kept mass (float64, vocabulary order) exceeds ``u`` times the total,
    from the scratch row in tiles of ``BLOCK``. The total is a sum of tile sums; the second walk adds the same
    tile sums in the same order until the tile where the running sum passes ``u * total``, and takes a prefix
    sum inside that tile only (a prefix sum costs a program several times what a sum does)."""
    lanes = tl.arange(0, BLOCK)
    total = tl.full((), 0.0, tl.float64)
    last_kept = tl.full((), -1, tl.int32)
    ties_before = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        kept, ties = _kept_masses(mass_row_ptr, offs, vocab, cut, ties_kept, ties_before)
        ties_before += ties
        total += tl.sum(kept.to(tl.float64))
        last_kept = tl.maximum(last_kept, tl.max(tl.where(kept > 0, offs, -1)))
    target = u * total
    token = tl.full((), vocab, tl.int32)
    cumulative = tl.full((), 0.0, tl.float64)
    ties_before = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        kept, ties = _kept_masses(mass_row_ptr, offs, vocab, cut, ties_kept, ties_before)
        ties_before += ties
        tile_mass = tl.sum(kept.to(tl.float64))
        if (token == vocab) & (cumulative + tile_mass > target):
            sums = cumulative + tl.cumsum(kept.to(tl.float64), axis=0)
            # A kept token only: the prefix sum may round below the tile's sum and leave the crossing to
            # the next tile, whose running sum starts above the target.
            token = tl.min(tl.where((sums > target) & (kept > 0), offs, vocab))
        cumulative += tile_mass
    # u * total may round up to total (about once in 2**53 draws): then the last token with mass.
    return tl.where(token < vocab, token, last_kept)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, greedy: torch.Tensor, state: torch.Tensor,
                uniforms_out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, vocab]`` (float32, float16 or bfloat16, rows contiguous), int64
    ``[B]`` on its device: greedy rows take their first maximum, the others draw from their filtered
    distribution. The columns are those of :class:`yaie.engine.sampling.StepTable`: ``temperature``
    float32 ``[B]`` (> 0), ``top_k`` int64 ``[B]`` (0: none), ``top_p`` float32 ``[B]`` (>= 1: none),
    ``greedy`` bool ``[B]``, ``state`` int64 ``[B]`` (the stream's state for this token). ``uniforms_out``: a
    float64 ``[B]`` tensor for each sampled row's number (the tests read it); greedy rows leave theirs untouched.

    Raises ValueError for a shape, dtype or device the kernel does not take; logits are expected finite or
    -inf, with a finite value in every row."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"sample_rows needs float logits [B, vocab], got {logits.dtype} {tuple(logits.shape)}")
    rows, vocab = logits.shape
    columns = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "greedy": greedy, "state": state}
    for name, column in columns.items():
        if column.shape != (rows,) or column.device != logits.device:
            raise ValueError(f"sample_rows: {name} must be [{rows}] on {logits.device}, got "
                             f"{tuple(column.shape)} on {column.device}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature, top_p = temperature.contiguous(), top_p.contiguous()   # top_k, state: columns of a table
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    block = min(triton.next_power_of_2(vocab), RESIDENT_VOCAB)
    tiles = triton.cdiv(vocab, block)
    # The masses go to a scratch row: the draw reads them back in small tiles, and so does the bisection
    # for a row longer than RESIDENT_VOCAB.
    scratch = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, temperature, top_k, top_k.stride(0), top_p, greedy,
                            state, state.stride(0), scratch, tokens, tokens if uniforms_out is None else uniforms_out,
                            BLOCK=block, TILES=tiles, DRAW_BLOCK=min(block, 8192),
                            STORE_U=uniforms_out is not None, num_warps=max(4, min(32, block // 1024)))
    return tokens
