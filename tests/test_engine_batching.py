"""Continuous batching in the engine: many requests at once through a cache too small for them all.

Every output must equal, token for token, the same request run alone in a large cache, for swap and
for recompute preemption, greedy and seeded sampling alike (each request has its own random stream); and
once all finish, every block of the lesson 03 cache is free again.
"""

import functools

import pytest

import solutions.kernels.kv_cache as lesson03
import yaie.kernels.kv_cache as student03
from yaie import ops
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.model.testing import fresh_seed, single_thread

PROMPTS = [
    "Once upon a time, there was a little fox named",
    "One day, Tom and Mia went to the park. Tom had a blue kite",
    "Lily was afraid of the dark.",
    "Ben found a shiny red ball under the big tree.",
    "The little owl could not sleep.",
    "Sam wanted to fly like a bird, so",
    "A small dog named Max lived on a farm.",
]


pytestmark = pytest.mark.usefixtures("reference_lessons")


@pytest.fixture(scope="module")
def alone():
    """Each request run by itself (a cache far larger than it needs): the outputs batching must reproduce."""
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        llm = LLM(DEFAULT_MODEL, device="cpu")
        seed = fresh_seed()
        params = mixed_params(seed)
        return seed, params, [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]


def mixed_params(seed: int) -> list[SamplingParams]:
    """Greedy for most, seeded sampling for two; different lengths so requests end at different steps."""
    params = [SamplingParams(max_tokens=24 + 4 * i, temperature=0, ignore_eos=i % 2 == 0) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=seed)
    params[4] = SamplingParams(max_tokens=26, temperature=0.8, top_k=20, seed=seed + 1, ignore_eos=True)
    return params


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_more_requests_than_the_cache_holds(preemption, alone):
    seed, params, want = alone
    # 20 blocks of 4 tokens = 80 slots; one request needs up to ~14 blocks, all seven together ~80.
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=20, preemption=preemption)
    got = [out.token_ids for out in llm.generate(PROMPTS, params)]
    stats, manager = llm.last_core.scheduler.stats, llm.last_core.scheduler.manager
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"seed={seed} {preemption}: request {i} differs from running alone:\n{g}\n{w}"
    assert stats.max_running >= 3, stats                    # requests really ran together
    preempted = stats.preempted_by_swap + stats.preempted_by_recompute
    assert preempted > 0, stats                             # and the cache really ran out
    if preemption == "swap":
        assert stats.preempted_by_swap > 0 and stats.swapped_in == stats.preempted_by_swap, stats
    # No block leaked, on the device or the host: what is not free is cached prefixes, unlocked.
    held = manager.num_blocks - manager.num_free_blocks
    assert llm.last_core.scheduler.prefix_cache.clear() == held
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.num_free_cpu_blocks == manager.num_cpu_blocks and manager.seq_ids() == []


def test_batched_outputs_do_not_depend_on_batch_order(alone):
    seed, params, want = alone
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=8)
    order = [3, 0, 6, 2, 5, 1, 4]
    got = llm.generate([PROMPTS[i] for i in order], [params[i] for i in order])
    assert [g.token_ids for g in got] == [want[i] for i in order], f"seed={seed}"


def test_lesson03_cache_is_what_runs(monkeypatch):
    """Spies on the reference KVCacheManager: the engine allocates, appends, writes and frees through it."""
    monkeypatch.setenv("YAIE_SOLUTIONS", "1,3")
    names = ["allocate", "append_slots", "write_kv", "block_table", "free", "swap_out", "swap_in"]
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(lesson03.KVCacheManager, name)

        @functools.wraps(real)
        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(lesson03.KVCacheManager, name, spy)
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=12, preemption="swap")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:3], params)
    layers = llm.config.num_layers
    steps = llm.last_core.scheduler.stats.steps
    # Once per layer per step, plus once by the probe that checks the class before serving (ops).
    assert calls["write_kv"] == layers * steps + 1, calls
    assert calls["allocate"] >= 3 + 1 and calls["free"] >= 3 + 1 and calls["append_slots"] > 0
    assert calls["swap_out"] > 0 and calls["swap_in"] > 0, calls


def test_stream_and_generate_agree():
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=["zzz"])
    full = llm.generate(PROMPTS[0], params)[0]
    assert "".join(llm.stream(PROMPTS[0], params)) == full.text


@pytest.mark.parametrize("kwargs,what", [
    (dict(num_blocks=0), "num_blocks"), (dict(block_size=0), "block_size"), (dict(preemption="drop"), "preemption"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks"), (dict(max_num_seqs=0), "max_num_seqs"),
])
def test_bad_engine_options(kwargs, what):
    with pytest.raises(ValueError, match=what):
        LLM(DEFAULT_MODEL, device="cpu", **kwargs)


def test_request_larger_than_the_cache_is_refused():
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(PROMPTS[:2], [SamplingParams(), "greedy"])


def test_unfinished_lesson03_in_auto_mode_falls_back_once(monkeypatch, capsys, alone):
    """The student's stub KVCacheManager: auto mode finds it before serving and uses the reference."""
    seed, params, want = alone
    monkeypatch.delenv("YAIE_SOLUTIONS")            # auto mode: every unfinished lesson falls back
    with pytest.raises(NotImplementedError):
        student03.KVCacheManager(4, 2, 1, 1, 1).allocate(0, 1)    # this copy's lesson 03 is the stub
    out = LLM(DEFAULT_MODEL, device="cpu").generate(PROMPTS[0], params[0])[0]
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lesson 03")]
    assert notices == ["lesson 03: KVCacheManager is not implemented yet in yaie/kernels/kv_cache.py; "
                       "using the reference for it"], notices
    assert out.token_ids == want[0]


def test_unfinished_lesson03_in_strict_mode_names_it(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "1,2,4-8")       # lesson 03: the student's stub
    with pytest.raises(ops.KernelMissing, match="lesson 03: KVCacheManager is not implemented yet"):
        LLM(DEFAULT_MODEL, device="cpu").generate("Once", SamplingParams(max_tokens=2))
