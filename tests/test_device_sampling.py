"""Sampling on the device with counter-based randomness (:mod:`yaie.engine.sampling`), and the engine core
looking ahead over sampled steps.

* the random streams: :func:`mix64` is SplitMix64's output function (its published test vector, and a
  Python model of it on 64-bit integers), a stream's state moves by ``GAMMA`` per token, the numbers are
  uniform, seeds count modulo 2**64;
* the draws: a request's stream of tokens follows the filtered distribution (chi-square, with the bound and
  the reference of ``tests/test_sampling.py``), top-k and top-p never give a token they drop, near-zero
  temperatures are the argmax, and a row's token depends on its seed, its token index and its logits alone
  (the same in a batch of any make-up, in any row);
* the core, over a stub runner whose logits depend on each sequence's last token and position only (so any
  difference between runs comes from the sampler or the core): sampled rows are looked ahead
  (``EngineCore.looked_ahead_steps``), as many steps as greedy ones; seeded outputs are the same alone,
  batched, with and without look-ahead, and on a run with log-probabilities, whose entries are those of the
  sampled tokens; unseeded requests repeat under ``torch.manual_seed``;
* the front ends: ``LLM.generate``, the server's ``AsyncEngine`` and ``yaie generate`` give the same text
  for a seed (a telescoping model: its rows look ahead on the CPU too).
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from tests.test_sampling import check_counts, reference_probs
from yaie.engine import SamplingParams
from yaie.engine.core import EngineCore
from yaie.engine.row_scheduler import RowScheduler
from yaie.engine.sampling import (GAMMA, SEED_RANGE, StepTable, as_int64, mix64, noise_key, sample_batch,
                                  stream_state, uniforms)
from yaie.model.testing import fresh_seed

U64 = 2**64


def splitmix64_mix(z: int) -> int:
    """SplitMix64's output function on a Python integer in [0, 2**64) (Steele, Lea and Flood 2014; Vigna)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % U64
    return z ^ (z >> 31)


def table(params, seeds, indices, vocab: int) -> StepTable:
    return StepTable(params, [noise_key(s) for s in seeds], indices, vocab, torch.device("cpu"))


# ----------------------------------------------------------------------------- the random streams
def test_mix64_is_splitmix64():
    """The published outputs of SplitMix64 seeded with 1234567, and random 64-bit values and the edges
    against the Python model: the int64 products wrap as they must."""
    states = torch.tensor([stream_state(1234567, i) for i in range(5)])
    assert [x % U64 for x in mix64(states).tolist()] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]
    rng = random.Random(fresh_seed())
    values = [rng.getrandbits(64) for _ in range(4000)] + [0, 1, 2**63 - 1, 2**63, U64 - 1]
    got = mix64(torch.tensor([as_int64(v) for v in values])).tolist()
    assert [g % U64 for g in got] == [splitmix64_mix(v) for v in values]


def test_a_stream_moves_by_gamma_per_token_and_seeds_count_modulo_2_64():
    key = noise_key(fresh_seed())
    assert [stream_state(key, i) % U64 for i in range(4)] == [(key + (i + 1) * GAMMA) % U64 for i in range(4)]
    first = table([SamplingParams()] * 3, [7, 8, 9], [0, 5, 11], 10)
    after = first.next().next()
    assert after.state.tolist() == [stream_state(noise_key(s), i + 2) for s, i in [(7, 0), (8, 5), (9, 11)]]
    assert after.temperature is first.temperature and after.top_k is first.top_k    # nothing uploaded again
    assert noise_key(-1) == noise_key(U64 - 1) and noise_key(SEED_RANGE[0]) == noise_key(2**63)
    assert len({noise_key(s) for s in range(1000)}) == 1000


def test_the_numbers_are_uniform():
    """200k numbers of consecutive tokens of a few keys, in 50 bins: chi-square within its far tail, and
    the mean of their product with the next token's near 1/4 (no correlation along a stream)."""
    keys = torch.tensor([noise_key(fresh_seed() + k) for k in range(4)])
    states = keys[:, None] + (torch.arange(1, 50_001)[None, :] * as_int64(GAMMA))
    u = uniforms(states.flatten()).view(4, -1)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    counts = torch.bincount((u.flatten() * 50).long(), minlength=50).double()
    check_counts(counts, torch.full((50,), 1 / 50, dtype=torch.float64), None, "uniform bins")
    lag = (u[:, 1:] * u[:, :-1]).mean().item()
    assert abs(lag - 0.25) < 0.005, lag


# ----------------------------------------------------------------------------- the draws
LOGITS = torch.tensor([2.0, 1.4, 1.1, 0.9, 0.6, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, -3.0])


@pytest.mark.parametrize("params,wrong", [
    (SamplingParams(temperature=0.8), SamplingParams(temperature=0.92)),
    (SamplingParams(temperature=1.2, top_k=5), SamplingParams(temperature=1.2, top_k=6)),
    (SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0, top_p=0.8)),
], ids=["t", "top_k", "top_p"])
def test_one_request_stream_follows_the_distribution(params, wrong):
    """One request's 20000 tokens (one key, token indices 0..19999, the same logits every step): the
    counts fit the filtered distribution and reject a nearby wrong one."""
    seed, draws = fresh_seed(), 20000
    tokens = sample_batch(LOGITS.expand(draws, -1), table([params] * draws, [seed] * draws, range(draws), 12))
    counts = torch.bincount(tokens, minlength=12).double()
    check_counts(counts, reference_probs(LOGITS, params), reference_probs(LOGITS, wrong), f"seed={seed}")


def test_top_k_and_top_p_never_give_a_dropped_token():
    """Rows of random logits over 40 tokens, each with its own top-k and top-p, many draws each: every token
    drawn is one the float64 reference keeps."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    kinds = [SamplingParams(temperature=t, top_k=k, top_p=p) for t in (0.5, 1.0, 3.0) for k in (0, 1, 3, 10)
             for p in (1.0, 0.9, 0.3)]
    logits = torch.randn(len(kinds), 40, generator=gen) * 2
    draws = 300
    tokens = sample_batch(logits.repeat(draws, 1), table(kinds * draws, [seed + i for i in range(len(kinds) * draws)],
                                                         [0] * (len(kinds) * draws), 40)).view(draws, len(kinds))
    for r, params in enumerate(kinds):
        kept = reference_probs(logits[r], params) > 0
        assert kept[tokens[:, r]].all(), f"seed={seed}, {params}: drew {sorted(set(tokens[:, r].tolist()))}"


def test_near_zero_temperatures_are_the_argmax():
    """Temperature 0, below ``MIN_TEMPERATURE`` (greedy), and 1e-3 over logits 0.1 apart (sampled, but the
    best token has all the mass): the argmax, row by row, beside rows that do sample."""
    seed = fresh_seed()
    logits = torch.randn(60, 500, generator=torch.Generator().manual_seed(seed)) * 0.1
    logits[torch.arange(60), logits.argmax(dim=-1)] += 0.05      # the best 0.05 ahead: e**-50 at t = 1e-3
    cold = [SamplingParams(temperature=t) for t in (0, 1e-7, 1e-3)] * 20
    params = [p if i % 4 else SamplingParams(temperature=1.5) for i, p in enumerate(cold)]
    tokens = sample_batch(logits, table(params, [seed + i for i in range(60)], [3] * 60, 500))
    cold_rows = [i for i in range(60) if i % 4]
    assert torch.equal(tokens[cold_rows], logits[cold_rows].argmax(dim=-1)), f"seed={seed}"


def test_a_seeded_row_depends_on_its_seed_index_and_logits_alone():
    """The same request's tokens (its seed, its token index, its logits) alone, in batches of other sizes
    and make-ups, and in another row; and again in a second run."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    vocab, steps = 300, 16
    mine = [torch.randn(vocab, generator=gen) * 2 for _ in range(steps)]
    params = SamplingParams(temperature=1.1, top_k=40, top_p=0.92, seed=seed)

    def run(batch_size: int, row: int) -> list[int]:
        out = []
        for i, logits in enumerate(mine):
            others = torch.randn(batch_size, vocab, generator=gen) * 3
            others[row] = logits
            kinds = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0),
                     SamplingParams(temperature=1.4, top_p=0.5, seed=seed + 1), SamplingParams(temperature=2.0)]
            batch = [kinds[j % 4] for j in range(batch_size)]
            batch[row] = params
            indices = torch.randint(0, 100, (batch_size,), generator=gen).tolist()
            indices[row] = i
            out.append(int(sample_batch(others, table(batch, [p.seed for p in batch], indices, vocab))[row]))
        return out

    alone = run(1, 0)
    assert len(set(alone)) > 3, "the row really samples"
    for batch_size, row in [(2, 1), (5, 0), (7, 4), (33, 17)]:
        assert run(batch_size, row) == alone, f"seed={seed}: batch {batch_size}, row {row}"
    assert run(1, 0) == alone


# ----------------------------------------------------------------------------- the core over a stub runner
VOCAB = 64


class StubRunner:
    """A runner over rows whose "model" gives a sequence's logits from its last token and position alone
    (a fixed random table), so a request's output depends on its own tokens and sampler only. A looked-ahead
    step takes its input ids from the device, as the real runners do."""

    def __init__(self, rows: int, look_ahead: bool = True):
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=4096),
                                     device=torch.device("cpu"))
        self.rows, self.look_ahead = rows, look_ahead
        self.table = torch.randn(997, VOCAB, generator=torch.Generator().manual_seed(5)) * 2.5
        self.positions: torch.Tensor | None = None     # the last decode step's, for a looked-ahead step

    def new_scheduler(self) -> RowScheduler:
        return RowScheduler(self.rows, lambda src, dst: None, 4096)

    def can_look_ahead(self, num_decodes: int) -> bool:
        return self.look_ahead

    def release(self) -> None:
        pass

    def logits(self, last: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.table[(last * 31 + positions * 7) % len(self.table)]

    def execute(self, plan, device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        out = []
        if plan.decodes:
            if device_tokens is not None:
                last, self.positions = device_tokens, self.positions + 1
            else:
                last = torch.tensor([r.last_token for r in plan.decodes])
                self.positions = torch.tensor([r.num_tokens - 1 for r in plan.decodes])
            out.append(self.logits(last, self.positions))
        for request, (start, end) in zip(plan.prefills, plan.prefill_ranges):
            if end == request.num_tokens:
                out.append(self.logits(torch.tensor([request.prompt_ids[end - 1]]), torch.tensor([end - 1])))
        return torch.cat(out) if out else None


class StubTokenizer:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def run_core(prompts, params, rows: int = 8, look_ahead: bool = True, logprobs: int | None = None):
    """Every prompt through one core; (each request's tokens, the core, each request's logprobs or None)."""
    core = EngineCore(StubRunner(rows, look_ahead), StubTokenizer(), eos_token_ids=[])
    requests = [core.add(p, sp, logprobs=logprobs) for p, sp in zip(prompts, params)]
    entries: dict[int, list] = {r.request_id: [] for r in requests}
    while core.has_unfinished():
        core.step()
        for r in requests:
            entries[r.request_id] += core.take_logprobs(r.request_id) or []
    core.flush()
    return [list(r.output_ids) for r in requests], core, [entries[r.request_id] for r in requests]


PROMPTS = [[3, 9, 4], [11], [5, 5, 5, 5, 2], [8, 1], [40, 41], [17, 2, 33]]


def mixed_params(seed: int, sampled_only: bool = False) -> list[SamplingParams]:
    kinds = [SamplingParams(temperature=1.0, seed=seed, max_tokens=30),
             SamplingParams(temperature=0.8, top_k=8, seed=seed + 1, max_tokens=24),
             SamplingParams(temperature=1.3, top_p=0.8, seed=seed + 2, max_tokens=27),
             SamplingParams(temperature=0, max_tokens=21),
             SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=seed + 3, max_tokens=33),
             SamplingParams(temperature=1.1, seed=seed + 4, max_tokens=18)]
    return [p for p in kinds if not (sampled_only and p.greedy)]


def test_sampled_rows_are_looked_ahead_like_greedy_ones():
    """All-sampled requests: most decode steps are launched before the step before was read, as many as
    for the same requests greedy."""
    seed = fresh_seed()
    params = [SamplingParams(temperature=1.2, top_p=0.9, seed=seed + i, max_tokens=25 + i, ignore_eos=True)
              for i in range(4)]
    greedy = [SamplingParams(temperature=0, max_tokens=p.max_tokens) for p in params]
    _, sampled_core, _ = run_core(PROMPTS[:4], params)
    _, greedy_core, _ = run_core(PROMPTS[:4], greedy)
    assert sampled_core.looked_ahead_steps == greedy_core.looked_ahead_steps >= 20
    _, eager_core, _ = run_core(PROMPTS[:4], params, look_ahead=False)
    assert eager_core.looked_ahead_steps == 0


def test_seeded_outputs_do_not_depend_on_the_batch_or_the_look_ahead():
    seed = fresh_seed()
    params = mixed_params(seed)
    alone = [run_core([p], [sp], look_ahead=False)[0][0] for p, sp in zip(PROMPTS, params)]
    together, core, _ = run_core(PROMPTS, params)
    assert core.looked_ahead_steps > 10
    assert together == alone, f"seed={seed}"
    # Two rows at a time: requests wait, join and leave at other steps; and the order reversed.
    assert run_core(PROMPTS, params, rows=2)[0] == alone, f"seed={seed}"
    assert run_core(PROMPTS[::-1], params[::-1], rows=3)[0] == alone[::-1], f"seed={seed}"
    assert len({tuple(a) for a in alone}) == len(alone)


def test_logprobs_are_those_of_the_sampled_tokens():
    """With log-probabilities wanted the steps are not looked ahead, the tokens stay the same, and each
    entry is the model's log-softmax at that token (the stub's logits, recomputed here) with the top k."""
    seed = fresh_seed()
    params = mixed_params(seed, sampled_only=True)
    want, _, _ = run_core(PROMPTS[:5], params)
    got, core, entries = run_core(PROMPTS[:5], params, logprobs=3)
    assert got == want and core.looked_ahead_steps == 0, f"seed={seed}"
    runner = StubRunner(1)
    for prompt, tokens, taken in zip(PROMPTS, got, entries):
        assert [e[0] for e in taken] == tokens
        context = prompt + tokens
        for i, (token, logprob, top) in enumerate(taken):
            position = len(prompt) + i - 1
            logits = runner.logits(torch.tensor([context[position]]), torch.tensor([position]))[0]
            log_probs = torch.log_softmax(logits, dim=0)
            assert abs(logprob - log_probs[token].item()) < 1e-5
            assert [t for t, _ in top] == log_probs.topk(3).indices.tolist()


def test_unseeded_requests_repeat_under_torch_manual_seed():
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3
    runs = []
    for _ in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            runs.append(run_core(PROMPTS[:3], params)[0])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) == 3, "each request gets a seed of its own"


# ----------------------------------------------------------------------------- the front ends
def test_the_api_the_server_and_the_cli_give_the_same_text_for_a_seed(reference_lessons, capsys):
    """``LLM.generate``, the server's engine thread (``AsyncEngine``) and ``yaie generate`` on the tiny
    telescoping model (whose rows look ahead on the CPU): one seed, one text; the core looked ahead."""
    from yaie.engine import LLM
    from yaie.engine.async_engine import AsyncEngine
    from yaie.engine.cli import main as cli_main
    from yaie.engine.llm import DEFAULT_MODEL

    model = DEFAULT_MODEL.parent / "tiny-telescoping"
    prompt, seed = "Once upon a time, there was a little fox named", fresh_seed()
    llm = LLM(model, device="cpu")
    params = llm.default_sampling_params(max_tokens=24, temperature=1.0, top_k=30, top_p=0.95, seed=seed)
    others = [llm.default_sampling_params(max_tokens=30, temperature=1.3, seed=seed + 9), SamplingParams(temperature=0)]
    api = llm.generate([prompt, "Lily was afraid of the dark.", "Tom had a red kite."], [params] + others)[0].text

    engine = AsyncEngine(llm, warm_up=False)
    engine.start()
    try:
        async def serve():
            group = await engine.submit([(llm.tokenizer.encode(prompt), params)])
            return "".join([event.text async for event in group.events()])
        served = asyncio.run(asyncio.wait_for(serve(), 60))
        assert engine.core.looked_ahead_steps > 5
    finally:
        engine.shutdown()

    capsys.readouterr()
    assert cli_main([prompt, "--model", str(model), "--device", "cpu", "--max-tokens", "24", "--temperature", "1.0",
                     "--top-k", "30", "--top-p", "0.95", "--seed", str(seed)]) == 0
    cli = capsys.readouterr().out
    assert api == served, f"seed={seed}"
    assert cli == prompt + api + "\n", f"seed={seed}"


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
def test_on_cuda_the_streams_equal_the_cpu_ones_and_nothing_syncs():
    """CUDA's int64 products wrap as the CPU's: the same numbers for the same states; and a step's table,
    its draw and the looked-ahead step's table never wait for the device (sync debug mode: an error)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = fresh_seed()
    states = torch.tensor([stream_state(noise_key(seed + k), i) for k in range(64) for i in range(64)])
    assert torch.equal(uniforms(states.cuda()).cpu(), uniforms(states))
    params = [SamplingParams(temperature=1.0 + 0.1 * (i % 3), top_k=i % 7, top_p=0.9, seed=seed + i) for i in range(64)]
    logits = torch.randn(64, 32000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = StepTable(params, [noise_key(p.seed) for p in params], [0] * 64, 32000, logits.device)
        tokens = [sample_batch(logits, first), sample_batch(logits, first.next())]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    on_cpu = StepTable(params, [noise_key(p.seed) for p in params], [0] * 64, 32000, torch.device("cpu"))
    assert torch.equal(on_cpu.next().state, first.next().state.cpu())
    assert all(t.shape == (64,) for t in tokens)
