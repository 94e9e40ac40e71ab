"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded.

The order is the usual one: scale the logits by ``1 / temperature``, keep the ``top_k`` best, keep
the smallest set of tokens whose probabilities add up to ``top_p``, renormalise, draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


MIN_TEMPERATURE = 1e-5   # temperatures below this sample greedily (see SamplingParams.greedy)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax), and so does anything below ``MIN_TEMPERATURE``; higher flattens the
    distribution.
    top_k: keep the k most likely tokens (0 or -1: all). top_p: nucleus mass in (0, 1].
    max_tokens: tokens to generate at most (the model's context may stop it earlier).
    seed: a seed makes sampling reproducible for this request; None draws from torch's global RNG.
    stop: strings that end generation (not included in the text); stop_token_ids: extra stop ids
    (the model's end-of-sequence ids stop it too unless ignore_eos).
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:       # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / temperature overflows float32 and the softmax turns into NaN;
        # such a temperature means "take the most likely token" anyway.
        return self.temperature < MIN_TEMPERATURE


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[vocab]`` after temperature, top-k and top-p (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # A token stays if the mass of the tokens before it is below top_p (so the best always stays).
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from ``logits [vocab]``."""
    if params.greedy:
        return int(logits.argmax())
    probs = filtered_probs(logits, params).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
