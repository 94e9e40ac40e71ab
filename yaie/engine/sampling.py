"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded.

The order is the usual one: scale the logits by ``1 / temperature``, keep the ``top_k`` best, keep
the smallest set of tokens whose probabilities add up to ``top_p``, renormalise, draw.

The engine samples a whole step at once, on the logits' device (:func:`sample_batch`): each row's
temperature, top-k, top-p and place in its random stream are columns of one small table
(:class:`StepTable`). On CUDA one Triton kernel filters and draws every row
(:mod:`yaie.engine.sampling_kernel`, no sort); elsewhere the filters are one ``topk`` and one sort for the
batch with a mask per row, and one draw picks every row's token (:func:`sample_batch_reference`, also the
kernel's reference). Nothing in it reads the device: only the chosen ids go to the host, so a step
with sampled requests waits for the device no longer than a greedy one, and the next step may be launched
before they are read (the look-ahead of :mod:`yaie.engine.core`), for sampled rows as for greedy ones.

The draw is inverse transform sampling (:func:`draw`): one uniform number per row, and the token where the
row's cumulative probabilities (in vocabulary order, summed in float64) pass it. It needs one random
number per row, not noise the size of the logits (as the exponential race ``argmax(p / E)`` would,
``E ~ Exp(1)``, in float64 to be exact for rare tokens), and one pass over the probabilities.

Randomness is counter-based (:func:`uniforms`): token ``i`` of a request draws the ``i + 1``-th output of
SplitMix64 started at the request's key, ``u`` being the top 53 bits of ``mix64(key + (i + 1) * GAMMA)``
over 2**53 (:func:`mix64`, :func:`stream_state`), computed with int64 torch ops for every row at once on
the logits' device. The key is the request's seed, mixed (:func:`noise_key`). So a request's tokens depend
on its seed, its logits and the index of each token alone: not on the requests it is batched with or their
order, not on look-ahead or preemption. Its numbers do not depend on the device either (CPU and CUDA
compute the same ``u``; their logits, and so maybe a token, may differ in the last bits). A request without
a seed gets one when it is added, from torch's default CPU generator (so ``torch.manual_seed`` makes
unseeded runs repeatable too). The tokens a seed gives belong to this sampler; they are not promised to stay
the same when the sampler changes.

Every option runs on the device; there is no host path. (Log-probabilities are not the sampler's: the core
reads them from the step's logits, and does not look ahead over a step whose request wants them.)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch


MIN_TEMPERATURE = 1e-5   # temperatures below this sample greedily (see SamplingParams.greedy)
_NO_TOP_P = 2.0          # a row's top-p threshold when it has none: above any mass the sort can add up


SEED_RANGE = (-2**63, 2**64 - 1)     # any 64-bit integer, signed or not: a seed counts modulo 2**64


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x) -> bool:
    """An int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax), and so does anything below ``MIN_TEMPERATURE``; higher flattens the
    distribution.
    top_k: keep the k most likely tokens (0 or -1: all; tokens tied with the k-th stay too).
    top_p: nucleus mass in (0, 1]: keep the most likely tokens while the mass of those before them is below
    ``top_p`` (so the most likely token always stays; among tokens of equal probability the lower ids
    come first).
    max_tokens: tokens to generate at most (the model's context may stop it earlier).
    seed: a seed makes sampling reproducible for this request, alone or in any batch; its random numbers are
    the same on every device (see :mod:`yaie.engine.sampling`; the logits may differ). None: the request
    gets a seed when it is added, drawn from torch's default CPU generator.
    stop: strings that end generation (not included in the text); stop_token_ids: extra stop ids
    (the model's end-of-sequence ids stop it too unless ignore_eos).
    n: completions per prompt; completion ``i`` samples with ``seed + i`` (:meth:`choice`).
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) and self.stop is not None:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and not (is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 > SEED_RANGE[1]:
            raise ValueError(f"seed + n - 1 must be at most 2**64 - 1 (completion i samples with seed + i), got "
                             f"seed {self.seed} and n {self.n}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:       # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    def choice(self, i: int) -> "SamplingParams":
        """The parameters of completion ``i`` of ``n``: one completion, sampled with ``seed + i``, so each
        completion differs and all are reproducible (completion 0 keeps the seed)."""
        if not 0 <= i < self.n:
            raise ValueError(f"completion {i} of {self.n}: i must lie in [0, n)")
        seed = None if self.seed is None else self.seed + i
        return dataclasses.replace(self, seed=seed, n=1)

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / temperature overflows float32 and the softmax turns into NaN;
        # such a temperature means "take the most likely token" anyway.
        return self.temperature < MIN_TEMPERATURE


# ----------------------------------------------------------------------------- the random streams
GAMMA = 0x9E3779B97F4A7C15                        # SplitMix64's increment: 2**64 over the golden ratio, odd
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)   # the multipliers of its output function


def as_int64(x: int) -> int:
    """``x`` modulo 2**64 as the signed int64 with those bits (what an int64 tensor holds)."""
    x &= 2**64 - 1
    return x - 2**64 if x >= 2**63 else x


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical shift of int64 bits (torch's ``>>`` copies the sign bit in)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on an int64 tensor, its bits read as unsigned (products wrap modulo
    2**64, as int64 products do on the CPU and on CUDA): a bijection in which every output bit depends on
    every input bit."""
    z = (z ^ _shift_right(z, 30)) * as_int64(_MIX[0])
    z = (z ^ _shift_right(z, 27)) * as_int64(_MIX[1])
    return z ^ _shift_right(z, 31)


def noise_key(seed: int | None) -> int:
    """A request's key, an int64: its seed modulo 2**64 through :func:`mix64` (so seeds ``s`` and ``s + 1``,
    the completions of one prompt, start unrelated streams). Without a seed, one drawn from torch's default
    CPU generator."""
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_())
    return int(mix64(torch.tensor(as_int64(seed))))


def stream_state(key: int, index: int) -> int:
    """The state from which token ``index`` of the request with ``key`` draws: ``key + (index + 1) * GAMMA``
    modulo 2**64, as an int64 (SplitMix64's state after ``index + 1`` steps)."""
    return as_int64(key + (index + 1) * GAMMA)


def uniforms(states: torch.Tensor) -> torch.Tensor:
    """One number in [0, 1) per int64 state, float64 on its device: the top 53 bits of ``mix64(state)``
    (a multiple of 2**-53: every float64 of that grid equally likely)."""
    return _shift_right(mix64(states), 11).double() * 2.0**-53


# ----------------------------------------------------------------------------- the batched sampler
class StepTable:
    """The sampling parameters of one step's rows, as tensors on the logits' device.

    ``greedy`` ``[B]`` bool; ``temperature`` ``[B]`` float32 (1 for greedy rows); ``top_k`` ``[B]`` int64
    (0: no limit, also for a k of at least the vocabulary); ``top_p`` ``[B]`` float32 (``_NO_TOP_P``: no
    limit); ``state`` ``[B]`` int64, where each row's random stream stands for this step's token
    (:func:`stream_state`; meaningless for greedy rows). ``max_top_k`` and ``any_top_p`` are known on the
    host, so filtering never reads the device. The table goes up in one copy, queued from pinned memory on
    CUDA (a copy from pageable memory would wait for the step's forward pass). The step after it over the
    same rows (a looked-ahead step) takes :meth:`next`: nothing is uploaded.

    Args:
        params: each row's sampling parameters.
        keys: each row's key (:func:`noise_key`; any int for a greedy row).
        indices: the index, in its request's output, of the token each row samples.
        vocab_size: the logits' last dimension.
        device: the logits' device.
    """

    def __init__(self, params: Sequence[SamplingParams], keys: Sequence[int], indices: Sequence[int],
                 vocab_size: int, device: torch.device):
        rows = [_row(p, vocab_size) for p in params]
        self.size = len(rows)
        self.max_top_k = max(row[1] for row in rows)
        self.any_top_p = any(row[2] < 1 for row in rows)
        # Flat lists (torch reads them faster than tuples); one upload, the floats as their bits.
        floats = torch.tensor([x for row in rows for x in (row[0], row[2])], dtype=torch.float64).view(-1, 2)
        ints = torch.tensor([x for row, key, index in zip(rows, keys, indices, strict=True)
                             for x in (row[1], row[3], stream_state(key, index))], dtype=torch.int64).view(-1, 3)
        host = torch.cat([floats.view(torch.int64), ints], dim=1)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        as_floats = table[:, :2].view(torch.float64)
        self.temperature = as_floats[:, 0].float()
        self.top_p = as_floats[:, 1].float()
        self.top_k = table[:, 2]
        self.greedy = table[:, 3].bool()
        self.state = table[:, 4]

    def next(self) -> StepTable:
        """The table of the same rows for their next tokens: the states one step on, on the device."""
        following = copy.copy(self)
        following.state = self.state + as_int64(GAMMA)
        return following


def _row(p: SamplingParams, vocab_size: int) -> tuple[float, int, float, int]:
    """(temperature, top_k, top_p, greedy) of one row; a greedy row filters nothing (its token is the argmax)."""
    if p.greedy:
        return (1.0, 0, _NO_TOP_P, 1)
    top_k = p.top_k if 0 < p.top_k < vocab_size else 0
    return (float(p.temperature), top_k, float(p.top_p) if p.top_p < 1 else _NO_TOP_P, 0)


def filter_logits(logits: torch.Tensor, table: StepTable) -> torch.Tensor:
    """Scaled, filtered logits ``[B, vocab]`` (float32): ``logits / temperature`` per row, ``-inf`` where
    top-k or top-p drops a token. ``logits``: ``[B, vocab]``, any float dtype, on ``table``'s device."""
    scaled = logits.float() / table.temperature[:, None]
    if table.max_top_k:
        # The k-th largest value of each row (one topk for the batch, as deep as the deepest row needs);
        # rows without a limit compare with -inf. Ties with the k-th value stay.
        best = torch.topk(scaled, table.max_top_k, dim=-1).values
        kth = best.gather(1, (table.top_k - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((table.top_k == 0)[:, None], float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if table.any_top_p:
        probs = torch.softmax(scaled, dim=-1)
        # Stable: among equal probabilities the lower ids come first, so the cut does not depend on the sort.
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # A token stays if the mass of the tokens before it is below top_p (so the best always stays).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= table.top_p[:, None]
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token id per row of ``probs`` ``[B, vocab]`` (float32, >= 0, some mass in every row), int64 on
    its device, by inverse transform sampling: the first token whose cumulative probability exceeds ``u``
    times the row's total. ``u``: ``[B]`` float64 in [0, 1), one per row."""
    # Float64 sums: in float32 a token of probability under ~1e-7 of the mass before it would add nothing
    # to the sum and never be drawn (a 128k vocabulary has many such tokens).
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u[:, None] * total, right=True)[:, 0]
    # u * total rounds up to total about once in 2**53 draws (searchsorted then says vocab): the last token
    # with mass is the farthest a draw may go. (A token of zero probability never starts a new sum.)
    last = (cdf < total).sum(dim=-1)
    return torch.minimum(tokens, last)


def sample_batch(logits: torch.Tensor, table: StepTable) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, vocab]``: int64 ``[B]`` on the logits' device, not read by
    the host. Greedy rows (temperature below ``MIN_TEMPERATURE``) take the argmax of their logits; the
    others draw from their filtered probabilities (:func:`filter_logits`) with their stream's number
    (:func:`uniforms`, :func:`draw`). ``table``: the rows' :class:`StepTable`.

    On CUDA one Triton kernel does it all (:func:`yaie.engine.sampling_kernel.sample_rows`: no sort, one
    launch); elsewhere the torch ops of :func:`sample_batch_reference`. Both keep the same tokens and draw
    with the same number, so they agree but where rounding puts a cut or a draw on the other side of a
    boundary."""
    if logits.dim() != 2 or table.size != logits.shape[0]:
        raise ValueError(f"sample_batch needs logits [B, vocab] and a table of B rows; got logits "
                         f"{tuple(logits.shape)} and {table.size} rows")
    if logits.is_cuda:
        from yaie.engine.sampling_kernel import sample_rows   # imports triton: only where a GPU runs it
        return sample_rows(logits, table.temperature, table.top_k, table.top_p, table.greedy,
                           table.state)
    return sample_batch_reference(logits, table)


def sample_batch_reference(logits: torch.Tensor, table: StepTable) -> torch.Tensor:
    """:func:`sample_batch` in torch ops on any device (the CPU's sampler, and the reference of the kernel):
    a ``topk`` and a sort over the batch, a float64 cumulative sum and a search."""
    probs = torch.softmax(filter_logits(logits, table), dim=-1)
    return torch.where(table.greedy, logits.argmax(dim=-1), draw(probs, uniforms(table.state)))


# ----------------------------------------------------------------------------- one row
def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[vocab]`` after temperature, top-k and top-p (float32), as the batched sampler
    computes them for a sampled row (a greedy one puts all the mass on its argmax): ``logits`` ``[vocab]``."""
    if params.greedy:
        return torch.zeros(logits.shape, device=logits.device).index_fill_(0, logits.argmax().view(1), 1.0)
    table = StepTable([params], [0], [0], logits.shape[-1], logits.device)
    return torch.softmax(filter_logits(logits[None], table), dim=-1)[0]


def sample(logits: torch.Tensor, params: SamplingParams, index: int = 0) -> int:
    """Token ``index`` of a request with ``params`` (its seed: ``params.seed``; None draws one), from
    ``logits [vocab]``: the batched sampler on one row, read on the host."""
    table = StepTable([params], [noise_key(params.seed)], [index], logits.shape[-1], logits.device)
    return int(sample_batch(logits[None], table)[0])


# ----------------------------------------------------------------------------- one step's rows
def pick_tokens(logits: torch.Tensor, requests: Sequence, states: Sequence, table: StepTable | None = None
                ) -> tuple[torch.Tensor, StepTable | None]:
    """One token per row of ``logits`` ``[B, vocab]``, int64 on its device, not read by the host: greedy
    rows by argmax, sampled rows by :func:`sample_batch`; and the rows' :class:`StepTable` (None when all
    are greedy). ``requests``: the rows' requests (row ``i`` samples token ``len(requests[i].output_ids)``
    of its request); ``states``: their ``params``, ``key`` and ``greedy``
    (:class:`yaie.engine.output.OutputState`). ``table``: the rows' table for this step, made before (a
    looked-ahead step's: :meth:`StepTable.next` of the step before's); then ``requests`` is not read."""
    if table is None:
        if all(state.greedy for state in states):
            return logits.argmax(dim=-1), None
        table = StepTable([s.params for s in states], [s.key for s in states],
                          [len(r.output_ids) for r in requests], logits.shape[-1], logits.device)
    return sample_batch(logits, table), table
