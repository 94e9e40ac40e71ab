"""Chunked prefill in the engine: long prompts cut into chunks of the step's token budget, fed beside the
running decodes.

The outputs must not change: every request's tokens equal those of the same requests with each prompt
prefilled whole (greedy and seeded sampling), for budgets that do not divide the prompts, with prefix
caching on and off, through preemption by recompute and by swap; while a long prompt is ingested, the
requests already running keep getting a token every step; and once every request ends nothing is held.
"""

import pytest

from yaie import cli
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.engine.scheduler import Scheduler
from yaie.model.paged import PagedStep
from yaie.model.testing import fresh_seed

pytestmark = pytest.mark.usefixtures("reference_lessons")

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
         "dog Max. One day, Lily and Max went to the park. They saw a big tree and a small pond. ")
PROMPTS = [
    "Tom had a red ball.",                                   # short: decodes while the long ones are ingested
    STORY + "Lily saw a duck in the pond and",
    "The little owl could not sleep, so",
    STORY * 2 + "Then it started to rain, and",               # about 100 tokens: many chunks
    STORY + "Max barked at a cat.",                          # shares a prefix with the second prompt
]


def make_params(seed: int) -> list[SamplingParams]:
    params = [SamplingParams(max_tokens=10 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    params[2] = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=seed, ignore_eos=True)
    return params


@pytest.fixture(scope="module")
def whole():
    """Every prompt prefilled whole in one step (chunking off), prefix caching off: the reference."""
    seed = fresh_seed()
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, chunked_prefill=False, prefix_caching=False)
    return seed, [o.token_ids for o in llm.generate(PROMPTS, make_params(seed))]


def spy_steps(monkeypatch) -> list[tuple[int, list[int]]]:
    """Record every step the model runs: (decodes, new tokens of each prefilling sequence)."""
    seen = []
    init = PagedStep.__init__

    def spy(self, manager, seq_ids, query_lens, num_decodes, *args, **kwargs):
        seen.append((num_decodes, list(query_lens[num_decodes:])))
        init(self, manager, seq_ids, query_lens, num_decodes, *args, **kwargs)

    monkeypatch.setattr(PagedStep, "__init__", spy)
    return seen


def check_nothing_leaked(llm) -> None:
    scheduler = llm.last_core.scheduler
    manager, cache = scheduler.manager, scheduler.prefix_cache
    assert manager.seq_ids() == [] and not scheduler.has_unfinished()
    assert manager.num_free_cpu_blocks == manager.num_cpu_blocks
    if cache is not None:
        cache.clear()
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("budget", [7, 13])
def test_chunked_prefill_gives_the_same_tokens(whole, monkeypatch, budget, prefix_caching):
    seed, want = whole
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, max_num_batched_tokens=budget,
              prefix_caching=prefix_caching)
    seen = spy_steps(monkeypatch)
    got = [o.token_ids for o in llm.generate(PROMPTS, make_params(seed))]
    assert got == want, f"budget {budget}, prefix caching {prefix_caching}"
    longest = max(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert longest > 4 * budget
    # Every step stays within the budget (decodes count), so prompts were cut into chunks ...
    assert all(decodes + sum(chunks) <= budget for decodes, chunks in seen), seen
    # ... fed beside running decodes: the long prompts did not stop the requests already decoding.
    assert sum(1 for decodes, chunks in seen if decodes and chunks) >= 4, seen
    check_nothing_leaked(llm)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_chunked_prefill_through_preemption(whole, monkeypatch, preemption):
    """A cache too small for every request: requests in the middle of their chunks and decoding ones are
    preempted (swap falls back to recompute for a half-fed prompt); the tokens do not change."""
    seed, want = whole
    mid_prefill = []
    preempt = Scheduler._preempt

    def spy(self, request, plan):
        mid_prefill.append(request.prefilling)
        preempt(self, request, plan)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=34, preemption=preemption,
              max_num_batched_tokens=11)
    got = [o.token_ids for o in llm.generate(PROMPTS, make_params(seed))]
    assert got == want, preemption
    stats = llm.last_core.scheduler.stats
    assert any(mid_prefill) and not all(mid_prefill), mid_prefill   # both kinds were preempted
    if preemption == "swap":
        assert stats.preempted_by_swap > 0 and stats.swapped_in == stats.preempted_by_swap, stats
    check_nothing_leaked(llm)


def test_a_long_prompt_is_ingested_while_a_request_decodes(monkeypatch):
    """The short request, admitted first, gets a token in every step while the long prompt goes in chunks
    of the budget less that decode; without chunking the long prompt is one step of all its tokens."""
    prompts = [PROMPTS[0], STORY * 3]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seen = spy_steps(monkeypatch)
    chunked = LLM(DEFAULT_MODEL, device="cpu", max_num_batched_tokens=16)
    outs = [o.token_ids for o in chunked.generate(prompts, params)]
    long_len = len(chunked.tokenizer.encode(prompts[1]))
    beside = [chunks for decodes, chunks in seen if decodes == 1 and chunks]
    assert beside and all(chunks == [15] for chunks in beside[:-1]), seen
    assert sum(sum(c) for c in beside) + 1 >= long_len      # all of it (its last token may be a decode)
    seen.clear()
    off = LLM(DEFAULT_MODEL, device="cpu", max_num_batched_tokens=16, chunked_prefill=False)
    assert [o.token_ids for o in off.generate(prompts, params)] == outs
    assert any(chunks == [long_len] for _, chunks in seen), "unchunked: the whole prompt in one step"


def test_budget_option_is_checked_and_on_the_cli(monkeypatch, capsys):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(DEFAULT_MODEL, device="cpu", max_num_batched_tokens=0)
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    assert cli.main(["generate", "Hi", "--max-num-batched-tokens", "0", "--device", "cpu"]) == 1
    assert "max_num_batched_tokens must be" in capsys.readouterr().err
    assert cli.main(["generate", "Once upon a time", "--max-tokens", "4", "--temperature", "0", "--device", "cpu",
                     "--max-num-batched-tokens", "3", "--no-chunked-prefill"]) == 0
