"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded.

The order is the usual one: scale the logits by ``1 / temperature``, keep the ``top_k`` best, keep
the smallest set of tokens whose probabilities add up to ``top_p``, renormalise, draw.

The engine samples a whole step at once, on the logits' device (:func:`sample_batch`): each row's
temperature, top-k and top-p are columns of one small table, the filters are one ``topk`` and one sort
for the batch with a mask per row, and one draw picks every row's token. Only the chosen ids go to the
host, so a step with sampled requests waits for the device no longer than a greedy one, and the next
step may be launched before they are read (the look-ahead of :mod:`yaie.engine.core`).

The draw is inverse transform sampling (:func:`draw`): one uniform number per row, and the token where the
row's cumulative probabilities (in vocabulary order, summed in float64) pass it. It needs one random
number per row, not noise the size of the logits (as the exponential race ``argmax(p / E)`` would,
``E ~ Exp(1)``, in float64 to be exact for rare tokens), and one pass over the probabilities.

Seeds: a request with a seed draws its uniform number from its own generator on the logits' device, one
per token, so its tokens depend on its seed and its logits alone, not on the requests it is batched
with; requests without one share the device's default generator. The tokens a
seed gives belong to this sampler (and to the device: CPU and CUDA generators differ); they are not
promised to stay the same when the sampler changes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch


MIN_TEMPERATURE = 1e-5   # temperatures below this sample greedily (see SamplingParams.greedy)
_NO_TOP_P = 2.0          # a row's top-p threshold when it has none: above any mass the sort can add up


SEED_RANGE = (-2**63, 2**64 - 1)     # what torch.Generator.manual_seed takes


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
    seed: a seed makes sampling reproducible for this request, alone or in any batch, on one kind of device
    (see :mod:`yaie.engine.sampling`); None draws from torch's default generator of the device.
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


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator on ``device`` (the logits' device), seeded; None without a seed."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------- the batched sampler
class StepTable:
    """The sampling parameters of one step's rows, as tensors on the logits' device.

    ``greedy`` ``[B]`` bool; ``temperature`` ``[B]`` float32 (1 for greedy rows); ``top_k`` ``[B]`` int64
    (0: no limit, also for a k of at least the vocabulary); ``top_p`` ``[B]`` float32 (``_NO_TOP_P``: no
    limit). ``max_top_k`` and ``any_top_p`` are known on the host, so filtering never reads the device;
    ``generators`` (None for greedy rows) and ``shared`` (whether a sampled row has none) are the draw's.
    The table goes up in one copy, queued from pinned memory on CUDA (a copy from pageable memory would
    wait for the step's forward pass). A step that samples the same requests as the last one (a
    looked-ahead step) uses the last one's table again.
    """

    def __init__(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 vocab_size: int, device: torch.device):
        rows = [_row(p, vocab_size) for p in params]
        self.size = len(rows)
        self.generators = [None if p.greedy else g for p, g in zip(params, generators)]
        self.shared = any(g is None and not p.greedy for p, g in zip(params, generators))
        self.max_top_k = int(max(row[1] for row in rows))
        self.any_top_p = any(row[2] < 1 for row in rows)
        host = torch.tensor(rows, dtype=torch.float64)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        self.temperature = table[:, 0].float()
        self.top_k = table[:, 1].long()
        self.top_p = table[:, 2].float()
        self.greedy = table[:, 3].bool()


def _row(p: SamplingParams, vocab_size: int) -> tuple[float, float, float, float]:
    """(temperature, top_k, top_p, greedy) of one row; a greedy row filters nothing (its token is the argmax)."""
    if p.greedy:
        return (1.0, 0.0, _NO_TOP_P, 1.0)
    top_k = p.top_k if 0 < p.top_k < vocab_size else 0
    return (float(p.temperature), float(top_k), float(p.top_p) if p.top_p < 1 else _NO_TOP_P, 0.0)


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


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None], shared: bool = True) -> torch.Tensor:
    """One token id per row of ``probs`` ``[B, vocab]`` (float32, >= 0, some mass in every row), int64 on
    its device, by inverse transform sampling: ``u`` uniform in [0, 1), the first token whose cumulative
    probability exceeds ``u`` times the row's total. Row ``i`` draws its ``u`` from ``generators[i]`` when it
    has one (one launch per such row), the others together from the device's default generator (one launch
    for the whole batch, skipped when ``shared`` is False: then rows without a generator keep ``u = 0``
    and their ids mean nothing; the caller ignores them)."""
    uniform = torch.zeros(probs.shape[0], dtype=torch.float64, device=probs.device)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if shared and len(seeded) < len(generators):
        uniform.uniform_()
    for i, generator in seeded:
        uniform[i].uniform_(generator=generator)
    # Float64 sums: in float32 a token of probability under ~1e-7 of the mass before it would add nothing
    # to the sum and never be drawn (a 128k vocabulary has many such tokens).
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniform[:, None] * total, right=True)[:, 0]
    # u * total rounds up to total about once in 2**53 draws (searchsorted then says vocab): the last token
    # with mass is the farthest a draw may go. (A token of zero probability never starts a new sum.)
    last = (cdf < total).sum(dim=-1)
    return torch.minimum(tokens, last)


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None], table: StepTable | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, vocab]``: int64 ``[B]`` on the logits' device, not read by
    the host. Greedy rows (temperature below ``MIN_TEMPERATURE``) take the argmax of their logits; the
    others draw from their filtered probabilities (:func:`filter_logits`, :func:`draw`). ``generators``:
    each row's own generator (on the logits' device) or None. ``table``: the rows' :class:`StepTable` made
    from them already (then they are not read again)."""
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"sample_batch needs logits [B, vocab] and B params and generators; got logits "
                         f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators")
    if table is not None and table.size != logits.shape[0]:
        raise ValueError(f"sample_batch got a table of {table.size} rows for {logits.shape[0]} rows of logits")
    greedy_tokens = logits.argmax(dim=-1)
    if table is None:
        if all(p.greedy for p in params):
            return greedy_tokens
        table = StepTable(params, generators, logits.shape[-1], logits.device)
    probs = torch.softmax(filter_logits(logits, table), dim=-1)
    return torch.where(table.greedy, greedy_tokens, draw(probs, table.generators, table.shared))


# ----------------------------------------------------------------------------- one row
def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[vocab]`` after temperature, top-k and top-p (float32), as the batched sampler
    computes them for a sampled row (a greedy one puts all the mass on its argmax): ``logits`` ``[vocab]``."""
    if params.greedy:
        return torch.zeros(logits.shape, device=logits.device).index_fill_(0, logits.argmax().view(1), 1.0)
    table = StepTable([params], [None], logits.shape[-1], logits.device)
    return torch.softmax(filter_logits(logits[None], table), dim=-1)[0]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from ``logits [vocab]`` (the batched sampler on one row; reads it on the host)."""
    return int(sample_batch(logits[None], [params], [generator])[0])


# ----------------------------------------------------------------------------- one step's rows
def pick_tokens(logits: torch.Tensor, states: Sequence, table: StepTable | None = None
                ) -> tuple[torch.Tensor, StepTable | None]:
    """One token per row of ``logits`` ``[B, vocab]``, int64 on its device, not read by the host: greedy
    rows by argmax, sampled rows by :func:`sample_batch` (each with its own generator); and the rows'
    :class:`StepTable` (None when all are greedy). ``states``: each row's ``params``, ``generator`` and
    ``greedy`` (:class:`yaie.engine.output.OutputState`). ``table``: the same rows' table, made before."""
    if table is None and all(state.greedy for state in states):
        return logits.argmax(dim=-1), None
    params, generators = [s.params for s in states], [s.generator for s in states]
    table = table or StepTable(params, generators, logits.shape[-1], logits.device)
    return sample_batch(logits, params, generators, table), table
