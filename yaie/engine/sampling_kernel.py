"""The sampler of :mod:`yaie.engine.sampling` as one Triton kernel: a program per row, no sort.

:func:`sample_rows` picks every row's token in one launch (plus a ``topk`` when some row has a top-k). It
keeps the same tokens as :func:`yaie.engine.sampling.filter_logits` and draws as
:func:`yaie.engine.sampling.draw`, with the row's number from :func:`yaie.engine.sampling.uniforms`, so a
seeded request gets the same token from either, except where float rounding puts the cut or the draw on the
other side of a boundary (their sums run in different orders).

A program walks its row of logits several times (they stay in the L2 cache between walks):

1. the maximum of the scaled logits ``s = x / temperature`` (and, for a greedy row, the first index that holds
   it: the row's token, and the program stops);
2. for a top-p row, the mass ``Z = sum(exp(s - max))`` of the tokens top-k keeps, and the top-p cut without
   sorting: the smallest value ``w`` such that the tokens above it hold less than ``top_p * Z``. A sorted
   row keeps exactly the tokens above ``w``, and as many of those equal to ``w`` (lowest ids first) as keep the
   mass before each under ``top_p * Z``. ``w`` is found by bisection over the floats' order: each walk sums the
   mass above ``PIVOTS`` candidate values at once, so the interval shrinks ``PIVOTS + 1`` times a walk (8
   walks for 16 pivots cover all 2**32 float32 values);
3. the total mass of the kept tokens, in float64 (the same sums the draw makes, so the last token's
   cumulative sum is that total exactly);
4. the draw: the first kept token whose cumulative mass, in vocabulary order, exceeds ``u * total``.

The row's uniform number is SplitMix64 of its state, computed in the kernel on uint64 (products wrap modulo
2**64 as :func:`yaie.engine.sampling.mix64`'s int64 products do).
"""

from __future__ import annotations

import torch

from yaie.device import prepare_triton

prepare_triton()  # must run before `import triton` on a machine with no GPU

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _order_key(s):
    """An int32 per float32 whose signed order is the floats' order (for s without -0.0 or NaN)."""
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    """The float32 of an order key (the map is its own inverse on the bits)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled_tile(row_ptr, offs, vocab, temperature, kth):
    """A tile of scaled logits and which of them top-k keeps (in the vocabulary and >= the k-th scaled value).
    ``div_rn`` rounds as torch's float32 division does, so the reference's values come back bit for bit;
    ``+ 0.0`` turns -0.0 into +0.0 (one order key per value)."""
    inside = offs < vocab
    x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, temperature) + 0.0
    return s, inside & (s >= kth)


@triton.jit
def _uniform(state):
    """The top 53 bits of SplitMix64's output for an int64 state, over 2**53: a float64 in [0, 1)."""
    z = state.to(tl.uint64, bitcast=True)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _sample_kernel(logits_ptr, row_stride, vocab, temperature_ptr, kth_ptr, top_p_ptr, greedy_ptr, state_ptr,
                   state_stride, token_ptr, u_ptr,
                   BLOCK: tl.constexpr, PIVOTS: tl.constexpr, PIVOT_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    kth = tl.math.div_rn(tl.load(kth_ptr + row), temperature)      # -inf: no top-k
    lanes = tl.arange(0, BLOCK)

    # 1. The maximum of the kept scaled logits, and the first index holding it (a greedy row's token).
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    lowest = tl.full((), float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        s, kept = _scaled_tile(row_ptr, offs, vocab, temperature, kth)
        tile_best = tl.max(tl.where(kept, s, float("-inf")))
        tile_index = tl.min(tl.where(kept & (s == tile_best), offs, vocab))
        best_index = tl.where(tile_best > best, tile_index, best_index)
        best = tl.maximum(best, tile_best)
        lowest = tl.minimum(lowest, tl.min(tl.where(kept, s, float("inf"))))
    if tl.load(greedy_ptr + row) != 0:
        tl.store(token_ptr + row, best_index.to(tl.int64))
    else:
        state = tl.load(state_ptr + row * state_stride)
        token, u = _draw(row_ptr, vocab, temperature, kth, top_p, best, lowest, state, BLOCK, PIVOTS, PIVOT_BLOCK)
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(u_ptr + row, u)


@triton.jit
def _draw(row_ptr, vocab, temperature, kth, top_p, best, lowest, state,
          BLOCK: tl.constexpr, PIVOTS: tl.constexpr, PIVOT_BLOCK: tl.constexpr):
    """A sampled row's token and its uniform number (steps 2 to 4 of the module's docstring)."""
    lanes = tl.arange(0, BLOCK)
    # 2. The top-p cut. Without one, every kept token stays: no key lies at or below cut_key.
    cut_key = tl.full((), -2147483648, tl.int64)
    ties_kept = tl.full((), 0, tl.int64)
    if top_p < 1.0:
        mass = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            s, kept = _scaled_tile(row_ptr, offs, vocab, temperature, kth)
            mass += tl.where(kept, tl.exp(s - best), 0.0)
        wanted = top_p * tl.sum(mass)
        # Bisection over order keys. Invariant: the mass above `high` is below `wanted` (nothing lies above
        # the maximum); the mass above `low` is not (everything kept lies above it).
        low = _order_key(lowest).to(tl.int64) - 1
        high = _order_key(best).to(tl.int64)
        mass_above_high = tl.full((), 0.0, tl.float32)
        steps = (tl.arange(0, PIVOTS) + 1).to(tl.int64)
        pivot_lanes = tl.arange(0, PIVOT_BLOCK)
        while high - low > 1:
            pivots = low + (steps * (high - low)) // (PIVOTS + 1)
            pivots_32 = pivots.to(tl.int32)            # between two order keys: within int32
            above = tl.zeros([PIVOTS], tl.float32)
            for start in range(0, vocab, PIVOT_BLOCK):
                offs = start + pivot_lanes
                s, kept = _scaled_tile(row_ptr, offs, vocab, temperature, kth)
                e = tl.where(kept, tl.exp(s - best), 0.0)
                key = _order_key(s)
                above += tl.sum(tl.where(key[:, None] > pivots_32[None, :], e[:, None], 0.0), axis=0)
            light = above < wanted                       # monotone: false for low pivots, true for high ones
            new_high = tl.min(tl.where(light, pivots, high))
            mass_above_high = tl.where(new_high < high,
                                       tl.max(tl.where(light & (pivots == new_high), above, 0.0)), mass_above_high)
            low = tl.max(tl.where(light, low, pivots))
            high = new_high
        cut_key = high
        # Tokens equal to the cut, lowest ids first: the r-th stays while mass_above + r * its mass < wanted.
        cut_mass = tl.exp(_from_order_key(high.to(tl.int32)) - best)
        room = tl.minimum((wanted - mass_above_high) / cut_mass, vocab * 1.0)
        ties_kept = tl.math.ceil(room).to(tl.int64)

    # 3. and 4. The kept tokens' total mass (float64), then the draw, both with the same sums.
    total = tl.full((), 0.0, tl.float64)
    last_kept = tl.full((), -1, tl.int32)
    ties_before = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        s, kept, e = _kept_tile(row_ptr, offs, vocab, temperature, kth, best, cut_key, ties_kept, ties_before)
        ties_before += tl.sum((kept & (_order_key(s).to(tl.int64) == cut_key)).to(tl.int64))
        total = tl.max(total + tl.cumsum(e.to(tl.float64), axis=0))
        last_kept = tl.maximum(last_kept, tl.max(tl.where(kept & (e > 0), offs, -1)))
    u = _uniform(state)
    target = u * total
    token = vocab
    cumulative = tl.full((), 0.0, tl.float64)
    ties_before = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        s, kept, e = _kept_tile(row_ptr, offs, vocab, temperature, kth, best, cut_key, ties_kept, ties_before)
        ties_before += tl.sum((kept & (_order_key(s).to(tl.int64) == cut_key)).to(tl.int64))
        sums = cumulative + tl.cumsum(e.to(tl.float64), axis=0)
        token = tl.minimum(token, tl.min(tl.where(sums > target, offs, vocab)))
        cumulative = tl.max(sums)
    # u * total may round up to total (about once in 2**53 draws): then the last token with mass.
    return tl.where(token < vocab, token, last_kept), u


@triton.jit
def _kept_tile(row_ptr, offs, vocab, temperature, kth, best, cut_key, ties_kept, ties_before):
    """Scaled logits, which tokens survive top-k and top-p, and their masses ``exp(s - best)`` (0 if not).
    ``ties_before``: tokens equal to the cut in the tiles before this one."""
    s, kept = _scaled_tile(row_ptr, offs, vocab, temperature, kth)
    key = _order_key(s).to(tl.int64)
    tie = kept & (key == cut_key)
    rank = ties_before + tl.cumsum(tie.to(tl.int64), axis=0) - 1
    kept = kept & ((key > cut_key) | (tie & (rank < ties_kept)))
    return s, kept, tl.where(kept, tl.exp(s - best), 0.0)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, max_top_k: int,
                top_p: torch.Tensor, greedy: torch.Tensor, state: torch.Tensor,
                uniforms_out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, vocab]`` (float32, float16 or bfloat16, rows contiguous), int64
    ``[B]`` on its device: greedy rows take their first maximum, the others draw from their filtered
    distribution. The columns are those of :class:`yaie.engine.sampling.StepTable`: ``temperature``
    float32 ``[B]`` (> 0), ``top_k`` int64 ``[B]`` (0: none; ``max_top_k`` its largest value, known on the
    host), ``top_p`` float32 ``[B]`` (>= 1: none), ``greedy`` bool ``[B]``, ``state`` int64 ``[B]`` (the
    stream's state for this token). ``uniforms_out``: a float64 ``[B]`` tensor for each sampled row's number
    (the tests read it); greedy rows leave theirs untouched.

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
    temperature, top_p = temperature.contiguous(), top_p.contiguous()   # state may be a column of a table
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    kth = torch.full((rows,), float("-inf"), device=logits.device)
    if max_top_k:
        # The k-th largest raw logit: dividing by a positive temperature keeps the order, so the kernel's
        # x / temperature of it is the k-th largest scaled logit, as the reference finds it.
        best = torch.topk(logits, max_top_k, dim=-1).values.float()
        kth = torch.where(top_k > 0, best.gather(1, (top_k - 1).clamp(min=0)[:, None])[:, 0], kth)
    if uniforms_out is None:
        uniforms_out = torch.empty(rows, dtype=torch.float64, device=logits.device)
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, temperature, kth, top_p, greedy.to(torch.int8),
                            state, state.stride(0), tokens, uniforms_out, BLOCK=1024, PIVOTS=16, PIVOT_BLOCK=256)
    return tokens
