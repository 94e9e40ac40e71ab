"""The batched sampler (:mod:`yaie.engine.sampling`): each row's tokens follow its exact filtered
distribution (temperature, top-k, top-p, computed here in float64 one token at a time), in a batch of
rows with different parameters; greedy rows stay the argmax; a seeded row gives the same tokens alone or
in any batch; and the engine samples on the device, looking ahead over sampled decode steps too.
(``tests/test_device_sampling.py``: the random streams, and the core over a stub runner.)

The distribution checks draw many rows at once and bound a chi-square statistic far in its tail (a
correct sampler fails about once in 10**7 runs); each also shows that the same counts reject a slightly
wrong distribution (the filter off by one token, another temperature), so the bound is not loose
enough to pass anything.
"""

import math

import pytest
import torch

from yaie.device import triton_interpreted
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.engine.sampling import StepTable, filter_logits, filtered_probs, noise_key, sample, sample_batch
from yaie.model.testing import fresh_seed, single_thread

TAIL_Z = 5.3    # the chi-square bound's normal quantile: about 6e-8 of a correct sampler's runs exceed it


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None],
                indices: list[int] | None = None) -> torch.Tensor:
    """The batched sampler over ``logits`` ``[B, vocab]``, row ``i`` token ``indices[i]`` (default 0) of a
    request with ``seeds[i]`` (None: a seed drawn from torch's default generator)."""
    table = StepTable(params, [noise_key(s) for s in seeds], indices or [0] * len(params), logits.shape[-1],
                      logits.device)
    return sample_batch(logits, table)


# ----------------------------------------------------------------------------- the reference
def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float64, one token at a time, as :class:`SamplingParams` documents it: the tokens by decreasing
    logit (equal ones by id), the first ``top_k`` of them and every token tied with the k-th, then those
    whose predecessors' mass (after top-k) is below ``top_p``."""
    if params.greedy:
        out = torch.zeros(len(logits), dtype=torch.float64)
        out[int(logits.argmax())] = 1.0
        return out
    scaled = logits.double() / params.temperature
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i].item(), i))
    keep = order
    if 0 < params.top_k < len(order):
        kth = scaled[order[params.top_k - 1]].item()
        keep = [i for i in order if scaled[i].item() >= kth]
    probs = torch.softmax(scaled[keep], dim=0).tolist()
    kept, mass = [], 0.0
    for token, p in zip(keep, probs):
        if mass >= params.top_p:
            break
        kept.append(token)
        mass += p
    out = torch.zeros(len(scaled), dtype=torch.float64)
    out[kept] = torch.softmax(scaled[kept], dim=0)
    return out


def chi_square_bound(df: int) -> float:
    """The chi-square quantile at ``TAIL_Z`` standard deviations (Wilson and Hilferty's approximation)."""
    a = 2 / (9 * df)
    return df * (1 - a + TAIL_Z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of ``counts`` against ``probs`` (inf when a token of probability 0 was drawn)."""
    n = counts.sum().item()
    if (counts[probs == 0] > 0).any():
        return math.inf
    expected = probs[probs > 0] * n
    return (((counts[probs > 0] - expected) ** 2) / expected).sum().item()


def check_counts(counts: torch.Tensor, want: torch.Tensor, wrong: torch.Tensor | None, what: str) -> None:
    """``counts`` fit ``want`` (no dropped token drawn, chi-square within the bound) and reject ``wrong``."""
    support = int((want > 0).sum())
    dropped = counts[want == 0].sum().item()
    assert dropped == 0, (f"{what}: {dropped} draws of tokens the filter drops "
                          f"(counts {counts.tolist()}, want {want.tolist()})")
    if support > 1:
        stat, bound = chi_square(counts, want), chi_square_bound(support - 1)
        assert stat < bound, (f"{what}: chi-square {stat:.1f} over the bound {bound:.1f} (df {support - 1}); "
                              f"counts {counts.tolist()}, expected {(want * counts.sum()).tolist()}")
    if wrong is not None:
        stat, bound = chi_square(counts, wrong), chi_square_bound(max(int((wrong > 0).sum()) - 1, 1))
        assert stat > bound, f"{what}: the draws do not tell the wrong distribution apart ({stat:.1f} <= {bound:.1f})"


# ----------------------------------------------------------------------------- distributions
LOGITS = torch.tensor([2.0, 1.4, 1.1, 0.9, 0.6, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, -3.0])
TIED = torch.tensor([1.0, 2.0, 0.5, 2.0, 0.5, 0.5, -1.0, 0.5, -1.5, -2.0, 0.0, -0.5])   # 2 tied best, 4 tied 4th
FLAT = torch.tensor([0.0] * 8 + [-math.inf] * 4)             # 8 tokens of mass 1/8 each, 4 masked by the model

# (name, logits, the parameters, a nearby wrong distribution's parameters)
CASES = [
    ("temperature 0.7", LOGITS, SamplingParams(temperature=0.7), SamplingParams(temperature=0.8)),
    ("temperature 2", LOGITS, SamplingParams(temperature=2.0), SamplingParams(temperature=1.7)),
    ("top_k 4", LOGITS, SamplingParams(temperature=1.3, top_k=4), SamplingParams(temperature=1.3, top_k=5)),
    ("top_p 0.6", LOGITS, SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0, top_p=0.7)),
    ("top_k 6, top_p 0.8", LOGITS, SamplingParams(temperature=0.9, top_k=6, top_p=0.8),
     SamplingParams(temperature=0.9, top_k=6, top_p=0.9)),
    ("top_k ties", TIED, SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=1.0, top_k=3)),
    ("top_p ties", FLAT, SamplingParams(temperature=1.0, top_p=0.375), SamplingParams(temperature=1.0, top_p=0.5)),
    ("top_p 1", LOGITS, SamplingParams(temperature=1.1, top_p=1.0), SamplingParams(temperature=1.1, top_p=0.99)),
    ("top_k >= vocab", LOGITS, SamplingParams(temperature=1.0, top_k=12), SamplingParams(temperature=1.0, top_k=11)),
]


def test_reference_follows_the_documented_rules():
    """The float64 reference itself, on cases worked out by hand."""
    keep = lambda logits, p: (reference_probs(logits, p) > 0).nonzero().flatten().tolist()   # noqa: E731
    assert keep(TIED, SamplingParams(top_k=1)) == [1, 3]                  # ties with the k-th stay
    assert keep(TIED, SamplingParams(top_k=3)) == [0, 1, 3]
    assert keep(TIED, SamplingParams(top_k=4)) == [0, 1, 2, 3, 4, 5, 7]
    assert keep(FLAT, SamplingParams(top_p=0.375)) == [0, 1, 2]          # exact mass: the cut is before the 4th
    assert keep(FLAT, SamplingParams(top_p=0.376)) == [0, 1, 2, 3]
    assert keep(LOGITS, SamplingParams(top_p=1e-9)) == [0]               # the best always stays
    assert keep(LOGITS, SamplingParams(top_k=12)) == list(range(12))


@pytest.mark.parametrize("name,logits,params,wrong", CASES, ids=[c[0] for c in CASES])
def test_filtered_probs_equal_the_reference(name, logits, params, wrong):
    got = filtered_probs(logits, params).double()
    want = reference_probs(logits, params)
    assert torch.allclose(got, want, atol=1e-6), f"{name}: got {got.tolist()}, want {want.tolist()}"


def test_rows_of_one_batch_follow_their_own_distributions():
    """Every case at once, rows interleaved with greedy rows, 24000 draws of each: each row is filtered
    with its own parameters (one topk and one sort for the batch) and drawn once."""
    seed = fresh_seed()
    draws = 24000
    greedy = SamplingParams(temperature=0)
    kinds = [(c[1], c[2]) for c in CASES] + [(LOGITS.flip(0), greedy)]
    logits = torch.stack([logits for logits, _ in kinds] * draws)           # row r is kind r % len(kinds)
    params = [p for _, p in kinds] * draws
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokens = sample_rows(logits, params, [None] * len(params))
    assert tokens.dtype == torch.int64 and tokens.shape == (len(params),)
    for k, (name, case_logits, case_params, wrong) in enumerate(CASES):
        counts = torch.bincount(tokens[k::len(kinds)], minlength=len(case_logits)).double()
        check_counts(counts, reference_probs(case_logits, case_params), reference_probs(case_logits, wrong),
                     f"seed={seed} {name}")
    assert (tokens[len(CASES)::len(kinds)] == int(LOGITS.flip(0).argmax())).all(), "greedy rows are the argmax"


def test_seeded_rows_follow_the_distribution():
    """Rows of consecutive seeds (as the completions of one prompt have) draw correctly too."""
    seed = fresh_seed()
    draws = 3000
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    tokens = sample_rows(LOGITS.expand(draws, -1), [params] * draws, [seed + i for i in range(draws)])
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    check_counts(counts, reference_probs(LOGITS, params), reference_probs(LOGITS, SamplingParams(temperature=1.2)),
                 f"seed={seed}")


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.5, top_k=1),
                                    SamplingParams(temperature=3.0, top_p=1e-6),
                                    SamplingParams(temperature=0), SamplingParams(temperature=1e-40)],
                         ids=["k=1", "tiny p", "t=0", "t below MIN_TEMPERATURE"])
def test_a_single_token_left_is_always_drawn(params):
    seed = fresh_seed()
    logits = torch.randn(2000, 300, generator=torch.Generator().manual_seed(seed)) * 3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokens = sample_rows(logits, [params] * len(logits), [None] * len(logits))
    assert torch.equal(tokens, logits.argmax(dim=-1)), f"seed={seed}"


def test_k_1_with_a_tie_draws_both_best_tokens():
    tokens = sample_rows(TIED.expand(4000, -1), [SamplingParams(top_k=1)] * 4000, [fresh_seed()] + [None] * 3999)
    counts = torch.bincount(tokens, minlength=len(TIED))
    assert counts[[1, 3]].sum() == 4000 and counts[1] > 1700 and counts[3] > 1700, counts.tolist()


def test_top_p_1_is_not_cut_by_rounding():
    """A row without top-p keeps every token, even where the mass before a token rounds to 1 in float32
    (here 0.5 + 0.5 before a token of probability 1e-13: a threshold of exactly 1 would drop it), in a
    batch where another row's top-p sorts the rows."""
    logits = torch.tensor([[0.0, 0.0, -30.0]] * 2)
    table = StepTable([SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)], [0, 0], [0, 0], 3, torch.device("cpu"))
    filtered = filter_logits(logits, table)
    assert torch.isfinite(filtered[0]).all(), filtered
    assert torch.isfinite(filtered[1]).tolist() == [True, False, False], filtered     # ties: the lower id first


# ----------------------------------------------------------------------------- seeds and greedy rows
def test_a_seeded_row_gives_the_same_tokens_alone_or_in_any_batch():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    steps = [torch.randn(6, 500, generator=gen) * 2 for _ in range(12)]
    params = SamplingParams(temperature=1.1, top_p=0.9, top_k=50, seed=seed)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.4),
              SamplingParams(temperature=0.8, top_p=0.5, seed=seed + 1), SamplingParams(temperature=0, top_k=3)]
    alone = [int(sample_rows(step[:1], [params], [seed], [i])[0]) for i, step in enumerate(steps)]
    for position in (0, 2, 5):
        batch = others[:position] + [params] + others[position:]
        got = []
        for i, step in enumerate(steps):
            # The seeded row's logits at ``position``, the others' logits around it.
            logits = torch.cat([step[1:position + 1], step[:1], step[position + 1:]])
            got.append(int(sample_rows(logits, batch, [p.seed for p in batch], [i] * len(batch))[position]))
        assert got == alone, f"seed={seed}, position {position}: {got} vs alone {alone}"
    assert len(set(alone)) > 3, "the seeded row really samples"


def test_greedy_rows_are_the_argmax_in_a_sampled_batch():
    seed = fresh_seed()
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(seed)) * 30   # wide: no float ties
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=2.0, top_p=0.99) for i in range(8)]
    tokens = sample_rows(logits, params, [None] * 8)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1)), f"seed={seed}"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="sample_batch needs logits"):
        sample_rows(torch.zeros(3, 10), [SamplingParams()] * 2, [None] * 2)
    with pytest.raises(ValueError, match="sample_batch needs logits"):
        sample_rows(torch.zeros(10), [SamplingParams()], [None])


def test_sample_draws_one_row():
    seed = fresh_seed()
    params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
    a = [sample(LOGITS, params) for _ in range(3)]
    assert a[0] == a[1] == a[2] and a[0] in (0, 1, 2), f"seed={seed}: {a}"


# ----------------------------------------------------------------------------- the engine
uses_reference_lessons = pytest.mark.usefixtures("reference_lessons")

PROMPTS = [
    "Once upon a time, there was a little fox named",
    "Lily was afraid of the dark.",
    "Ben found a shiny red ball under the big tree.",
    "The little owl could not sleep.",
]


def engine_params(seed: int) -> list[SamplingParams]:
    """Mixed: greedy, seeded with top-p, seeded with top-k, seeded at a plain temperature."""
    return [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=seed + 1),
            SamplingParams(max_tokens=22, temperature=1.3, seed=seed + 2, stop=[" the"])]


@uses_reference_lessons
@pytest.mark.skipif(torch.cuda.is_available() and not triton_interpreted(),
                    reason="a CPU engine runs lesson 04's kernel in the Triton interpreter (off on a GPU machine)")
def test_engine_samples_on_the_device_and_looks_ahead_over_sampled_steps(monkeypatch):
    """Seeded requests give the same tokens alone and batched, with and without the CUDA-graph path (run
    eagerly on the CPU), whose decode steps are looked ahead now that sampled tokens stay on the device
    (each looked-ahead step with the sampling table of the step before it, one token on)."""
    from yaie.engine.core import EngineCore as Engine
    from yaie.engine.sampling import GAMMA, as_int64
    seed = fresh_seed()
    params = engine_params(seed)
    with single_thread():
        plain = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256)
        alone = [plain.generate(p, sp)[0] for p, sp in zip(PROMPTS, params)]
        batched = plain.generate(PROMPTS, params)
        llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256)
        llm.settings.cuda_graphs = True
        llm.settings.graph_capture = False
        ahead, tables = [], []
        real = Engine._look_ahead

        def look_ahead(self, pending):
            ahead.append(real(self, pending))
            if ahead[-1] is not None:
                tables.append((pending.table, ahead[-1].table))
            return ahead[-1]
        monkeypatch.setattr(Engine, "_look_ahead", look_ahead)
        looked = llm.generate(PROMPTS, params)
    for i in range(len(PROMPTS)):
        assert batched[i].token_ids == alone[i].token_ids, f"seed={seed}: request {i} batched vs alone"
        assert looked[i].token_ids == alone[i].token_ids, f"seed={seed}: request {i} looked ahead vs alone"
        assert looked[i].text == alone[i].text
    assert sum(a is not None for a in ahead) >= 10, "sampled decode steps were looked ahead"
    # A looked-ahead step samples the same rows: it uses its predecessor's parameter table, uploaded once,
    # its random states one step on.
    assert all(before is not None and after.temperature is before.temperature and after.top_p is before.top_p
               for before, after in tables)
    assert all(torch.equal(after.state, before.state + as_int64(GAMMA)) for before, after in tables)
    assert len({tuple(o.token_ids) for o in alone[1:]}) == 3


# ----------------------------------------------------------------------------- on the GPU
def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_on_cuda_rows_follow_their_distributions_without_a_host_sync():
    """The batched sampler on CUDA: each case's draws follow the float64 reference, greedy rows are the
    argmax, a seeded row gives the same tokens alone and in the batch, and nothing in it waits for the
    device (torch's sync debug mode turns a synchronizing call into an error)."""
    _cuda_or_skip()
    seed = fresh_seed()
    draws = 24000
    kinds = [(c[1], c[2]) for c in CASES] + [(LOGITS.flip(0), SamplingParams(temperature=0))]
    logits = torch.stack([logits for logits, _ in kinds] * draws).cuda()
    params = [p for _, p in kinds] * draws
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.cuda.manual_seed(seed)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sample_rows(logits, params, [None] * len(params))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    tokens = tokens.cpu()
    for k, (name, case_logits, case_params, wrong) in enumerate(CASES):
        counts = torch.bincount(tokens[k::len(kinds)], minlength=len(case_logits)).double()
        check_counts(counts, reference_probs(case_logits, case_params), reference_probs(case_logits, wrong),
                     f"cuda, seed={seed} {name}")
    assert (tokens[len(CASES)::len(kinds)] == int(LOGITS.flip(0).argmax())).all(), "greedy rows are the argmax"


@pytest.mark.gpu
def test_on_cuda_a_seeded_row_gives_the_same_tokens_alone_or_batched():
    _cuda_or_skip()
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    steps = [(torch.randn(5, 32000, generator=gen) * 2).cuda() for _ in range(8)]
    params = SamplingParams(temperature=1.1, top_p=0.95, seed=seed)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=40),
              SamplingParams(temperature=0.9, top_p=0.5, seed=seed + 1), SamplingParams(temperature=1.3)]
    batch = others[:2] + [params] + others[2:]
    alone = [int(sample_rows(step[:1], [params], [seed], [i])[0]) for i, step in enumerate(steps)]
    batched = [int(sample_rows(torch.cat([step[1:3], step[:1], step[3:]]), batch, [p.seed for p in batch],
                               [i] * len(batch))[2]) for i, step in enumerate(steps)]
    assert batched == alone, f"seed={seed}: {batched} vs alone {alone}"
