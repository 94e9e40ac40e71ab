"""The sampling kernel (:mod:`yaie.engine.sampling_kernel`) against float64, on the Triton interpreter and on a GPU.

Each row's token must be the float64 inverse-transform draw with the row's own number: the first token, in
vocabulary order, whose cumulative probability (after temperature, top-k and top-p, renormalised) exceeds
``u``. Float32 sums may move a draw or a top-p cut that lies within a rounding of a boundary, so a token is
also accepted when ``u`` lies within ``SLACK`` of its interval, or when top-p moved by ``SLACK`` keeps it.
The kernel's ``u`` must equal :func:`yaie.engine.sampling.uniforms` bit for bit, greedy rows must take the
first maximum, and the torch sampler (the CPU's) must agree with the kernel on nearly every row.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from yaie.engine.sampling import SamplingParams, StepTable, noise_key, sample_batch_reference, uniforms
from yaie.engine import sampling_kernel
from yaie.engine.sampling_kernel import sample_rows
from yaie.model.testing import fresh_seed

SLACK = 1e-5


def float64_probs(logits: torch.Tensor, params: SamplingParams, top_p: float | None = None) -> torch.Tensor:
    """One row's probabilities ``[vocab]`` in float64, as :class:`SamplingParams` documents them (tokens by
    decreasing logit, equal ones by id; top-k keeps ties with the k-th; top-p keeps a token while the mass
    before it is below top_p)."""
    top_p = params.top_p if top_p is None else top_p
    scaled = logits.double() / params.temperature
    order = torch.sort(-scaled, stable=True).indices          # descending, equal values by id
    keep = torch.isfinite(scaled)
    if 0 < params.top_k < len(scaled):
        keep &= scaled >= scaled[order[params.top_k - 1]]
    probs = torch.where(keep, torch.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1:
        ordered = probs[order]
        before = torch.cumsum(ordered, 0) - ordered
        drop = torch.zeros_like(keep)
        drop[order] = before >= top_p
        probs = torch.where(drop, 0.0, probs)
        probs /= probs.sum()
    return probs


def acceptable(logits: torch.Tensor, params: SamplingParams, u: float) -> set[int]:
    """The tokens a float32 sampler may return for this row and number (see the module's docstring)."""
    if params.greedy:
        return {int(logits.argmax())}
    tokens = set()
    for top_p in {params.top_p, min(params.top_p + SLACK, 1.0), max(params.top_p - SLACK, SLACK)}:
        cdf = torch.cumsum(float64_probs(logits, params, top_p), 0)
        for v in (u - SLACK, u, u + SLACK):
            token = int(torch.searchsorted(cdf, torch.tensor([min(max(v, 0.0), 1 - 1e-12)], dtype=cdf.dtype),
                                           right=True)[0])
            tokens.add(min(token, int((cdf < cdf[-1]).sum())))
    return tokens


def random_params(rng: random.Random, vocab: int, count: int) -> list[SamplingParams]:
    choices = []
    for _ in range(count):
        choices.append(SamplingParams(
            temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]),
            top_k=rng.choice([0, 0, 1, 5, vocab // 3, vocab + 7]),
            top_p=rng.choice([1.0, 1.0, 0.95, 0.5, 0.05])))
    return choices


def random_logits(gen: torch.Generator, rows: int, vocab: int, device="cpu") -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, : vocab // 4] = logits[:, : vocab // 4].round()     # many ties
    logits[0, 5:9] = -math.inf                                       # tokens a model masks
    return logits.to(device)


def run(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]):
    table = StepTable(params, [noise_key(s) for s in seeds], indices, logits.shape[1], logits.device)
    u = torch.full((len(params),), -1.0, dtype=torch.float64, device=logits.device)
    tokens = sample_rows(logits, table.temperature, table.top_k, table.top_p, table.greedy,
                         table.state, u)
    return tokens, u, table


def check_rows(logits, params, tokens, u, table, what):
    assert torch.equal(u[~table.greedy].cpu(), uniforms(table.state)[~table.greedy].cpu()), \
        f"{what}: the kernel's uniform numbers differ from yaie.engine.sampling.uniforms"
    for row, p in enumerate(params):
        allowed = acceptable(logits[row].float().cpu(), p, float(u[row]))
        assert int(tokens[row]) in allowed, (
            f"{what}, row {row} ({p.temperature=}, {p.top_k=}, {p.top_p=}, u={float(u[row]):.6f}): the kernel "
            f"picked {int(tokens[row])}, float64 says {sorted(allowed)}")


# (vocab, the longest row kept in registers): resident rows, one of a power of two, and rows walked in tiles
# (what a 128k vocabulary gets on a GPU).
SHAPES = [(300, None), (1024, None), (1500, 512), (700, 256)]


@pytest.mark.parametrize("vocab, resident", SHAPES)
def test_tokens_are_the_float64_draws(vocab, resident, monkeypatch):
    if resident:
        monkeypatch.setattr(sampling_kernel, "RESIDENT_VOCAB", resident)
    seed = fresh_seed()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    params = random_params(rng, vocab, 12)
    logits = random_logits(gen, len(params), vocab)
    tokens, u, table = run(logits, params, [rng.getrandbits(64) for _ in params], list(range(len(params))))
    check_rows(logits, params, tokens, u, table, f"seed {seed}, vocab {vocab}, {resident=}")
    # The torch sampler (the CPU's) uses the same numbers and keeps the same tokens.
    same = (tokens == sample_batch_reference(logits, table)).float().mean()
    assert same >= 0.9, f"seed {seed}: the kernel and sample_batch_reference agree on {same:.0%} of rows"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_and_a_row_stride(dtype):
    seed = fresh_seed()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    wide = random_logits(gen, 6, 400).to(dtype)
    logits = wide[:, :300]                        # rows 400 apart: the kernel reads the stride
    params = random_params(rng, 300, 6)
    tokens, u, table = run(logits, params, [7 * i for i in range(6)], [3] * 6)
    check_rows(logits, params, tokens, u, table, f"seed {seed}, {dtype}")


def test_greedy_rows_take_the_first_maximum_and_a_row_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(fresh_seed())
    logits = torch.randn(5, 2100, generator=gen)
    logits[1, 2050] = logits[1, 1030] = logits[1, 7] = 50.0     # ties across tiles: the first one wins
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9),
              SamplingParams(top_k=3, temperature=0.5), SamplingParams(temperature=1e-7)]
    tokens, u, table = run(logits, params, [11, 12, 13, 14, 15], [0, 1, 2, 3, 4])
    assert tokens[[0, 1, 4]].tolist() == [int(logits[0].argmax()), 7, int(logits[4].argmax())]
    assert u[[0, 1, 4]].tolist() == [-1.0, -1.0, -1.0], "greedy rows draw no number"
    for row in (2, 3):
        alone, _, _ = run(logits[row:row + 1], params[row:row + 1], [11 + row], [row])
        assert int(alone[0]) == int(tokens[row]), f"row {row} alone picked {int(alone[0])}, in a batch {int(tokens[row])}"


def test_masked_and_dropped_tokens_are_never_drawn():
    """Over 16 numbers, a top-p of 0.3 on a row with masked tokens only draws what float64 keeps."""
    gen = torch.Generator().manual_seed(fresh_seed())
    row = torch.randn(1, 200, generator=gen) * 2
    row[0, ::3] = -math.inf
    params = [SamplingParams(temperature=0.8, top_p=0.3)] * 16
    logits = row.expand(16, 200).contiguous()
    tokens, u, table = run(logits, params, list(range(16)), [0] * 16)
    kept = float64_probs(row[0], params[0]) > 0
    assert kept[tokens].all(), f"drawn tokens outside the nucleus: {tokens[~kept[tokens]].tolist()}"
    check_rows(logits, params, tokens, u, table, "top-p 0.3 with masked tokens")


def high_states(count: int) -> torch.Tensor:
    """``count`` int64 states whose uniform number lies above 0.97: such a draw takes the last kept token."""
    states = torch.arange(4000, dtype=torch.int64)
    return states[uniforms(states) > 0.97][:count]


@pytest.mark.parametrize("top_p, kept", [(0.695, [0, 1]), (0.705, [0, 1, 2]), (0.3, [0])])
def test_top_p_keeps_the_tokens_whose_mass_before_is_below_it(top_p, kept):
    """Probabilities 0.4, 0.3, 0.2, 0.1: the mass before each token is 0, 0.4, 0.7, 0.9."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(3, 4).contiguous()
    params = [SamplingParams(top_p=top_p)] * 3
    table = StepTable(params, [0] * 3, [0] * 3, 4, logits.device)
    tokens = sample_rows(logits, table.temperature, table.top_k, table.top_p, table.greedy, high_states(3))
    assert tokens.tolist() == [kept[-1]] * 3, f"top-p {top_p} keeps {kept}: a draw above 0.97 takes {kept[-1]}"


@pytest.mark.parametrize("resident", [None, 1024])
def test_top_p_keeps_tied_tokens_lowest_ids_first_across_tiles(resident, monkeypatch):
    """Four equal tokens (ids 7, 1030, 2050, 2099; the rest masked) and top-p 0.6: the mass before them is
    0, 1/4, 1/2, 3/4, so the first three stay; a high draw takes id 2050, a low one id 7."""
    if resident:
        monkeypatch.setattr(sampling_kernel, "RESIDENT_VOCAB", resident)
    logits = torch.full((2, 2100), -math.inf)
    logits[:, [7, 1030, 2050, 2099]] = 1.5
    params = [SamplingParams(top_p=0.6)] * 2
    table = StepTable(params, [0] * 2, [0] * 2, 2100, logits.device)
    states = torch.arange(4000, dtype=torch.int64)
    low = states[uniforms(states) < 0.03][:1]
    tokens = sample_rows(logits, table.temperature, table.top_k, table.top_p, table.greedy,
                         torch.cat([high_states(1), low]))
    assert tokens.tolist() == [2050, 7]


def test_bad_inputs_raise():
    logits = torch.randn(2, 10)
    table = StepTable([SamplingParams()] * 2, [1, 2], [0, 0], 10, logits.device)
    args = (table.temperature, table.top_k, table.top_p, table.greedy, table.state)
    with pytest.raises(ValueError, match=r"float logits \[B, vocab\]"):
        sample_rows(logits[0], *args)
    with pytest.raises(ValueError, match=r"float logits"):
        sample_rows(logits.long(), *args)
    with pytest.raises(ValueError, match=r"temperature must be \[3\]"):
        sample_rows(torch.randn(3, 10), *args)
    assert sample_rows(torch.randn(0, 10), *(a[:0] for a in args)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_on_cuda_tokens_are_the_float64_draws_and_repeat(vocab):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = fresh_seed()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    params = random_params(rng, vocab, 64)
    logits = random_logits(gen, 64, vocab, "cuda").bfloat16()
    seeds = [rng.getrandbits(64) for _ in params]
    tokens, u, table = run(logits, params, seeds, list(range(64)))
    check_rows(logits, params, tokens, u, table, f"CUDA, seed {seed}, vocab {vocab}")
    again, _, _ = run(logits, params, seeds, list(range(64)))
    assert torch.equal(tokens, again), "the same inputs gave other tokens"
    same = (tokens == sample_batch_reference(logits, table)).float().mean()
    assert same >= 0.95, f"seed {seed}: the kernel and the torch sampler agree on {same:.0%} of rows"
