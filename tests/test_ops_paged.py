"""``ops.paged_attention`` through a ``PagedStep``: decodes and prefills in one step, over lesson 03's cache.

Both paths are checked against float64 attention on the same keys and values laid out contiguously:
the gather + lesson 01 path (the CPU engine) and the kernel path that the engine takes on CUDA
(lesson 04 for decodes, lesson 06 for prefills), run here in the Triton interpreter in float32.
"""

import math

import pytest
import torch

from yaie import ops
from yaie.model.paged import PagedStep
from yaie.model.testing import fresh_seed

HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.fixture(autouse=True)
def _reference_lessons(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")


def reference(q, k, v, window=None):
    """Float64 causal attention of the last ``len(q)`` positions over ``k, v`` (GQA by repetition)."""
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    qpos = torch.arange(n_k - n_q, n_k).unsqueeze(1)
    kpos = torch.arange(n_k).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_step(seed, cached, new, num_decodes, use_kernels, block_size=8):
    """A cache holding ``cached[i]`` tokens of sequence ``i`` already; this step adds ``new[i]`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    manager = ops.kv_cache_manager(64, block_size, 1, KV_HEADS, DIM, torch.float32, "cpu")
    full_k, full_v, slot_list = [], [], []
    for i, (c, n) in enumerate(zip(cached, new)):
        full_k.append(torch.randn(c + n, KV_HEADS, DIM, generator=gen))
        full_v.append(torch.randn(c + n, KV_HEADS, DIM, generator=gen))
        manager.allocate(i, 0)
        if c:
            manager.write_kv(0, manager.append_slots(i, c), full_k[i][:c], full_v[i][:c])
        slot_list.append(manager.append_slots(i, n))
    step = PagedStep(manager, list(range(len(new))), list(new), num_decodes, torch.cat(slot_list),
                     use_kernels=use_kernels)
    q = torch.randn(sum(new), HEADS, DIM, generator=gen)
    k_new = torch.cat([full_k[i][c:] for i, c in enumerate(cached)])
    v_new = torch.cat([full_v[i][c:] for i, c in enumerate(cached)])
    return step, q, k_new, v_new, full_k, full_v


@pytest.mark.parametrize("use_kernels", [False, True], ids=["gather+lesson01", "lesson04+lesson06"])
@pytest.mark.parametrize("cached,new,num_decodes", [
    ([5, 17, 0, 0], [1, 1, 9, 3], 2),      # two decodes, two whole-prompt prefills
    ([30, 0], [1, 12], 1),                  # one decode, one prefill
    ([0, 0, 0], [4, 11, 1], 0),             # prefills only (one of one token)
    ([3, 20, 8], [1, 1, 1], 3),             # decodes only
    ([0, 6], [1, 5], 1),                    # a prefill that continues a cached context (gathered)
])
def test_paged_step_matches_float64(use_kernels, cached, new, num_decodes):
    seed = fresh_seed()
    step, q, k_new, v_new, full_k, full_v = build_step(seed, cached, new, num_decodes, use_kernels)
    got = step.attend(0, q, k_new, v_new)
    for i in range(len(new)):
        rows = slice(step.query_starts[i], step.query_starts[i + 1])
        want = reference(q[rows], full_k[i], full_v[i])
        err = (got[rows].double() - want).abs().max().item()
        assert err < 1e-4, f"seed={seed} sequence {i}: max error {err}"


@pytest.mark.parametrize("use_kernels", [False, True], ids=["gather+lesson01", "lesson04+lesson06"])
@pytest.mark.parametrize("window", [4, 1, 11, 40])
def test_sliding_window(monkeypatch, use_kernels, window):
    """On the kernel path a windowed layer passes its window to lesson 04 (decodes, task 4) and to the
    prefill kernel (lesson 05 here, as one prefill continues a cached context); contexts 30 and 10 + 1, a
    prompt of 12, and a prompt of 7 after 9 cached tokens."""
    seed = fresh_seed()
    step, q, k_new, v_new, full_k, full_v = build_step(seed, [30, 10, 0, 9], [1, 1, 12, 7], 2, use_kernels=use_kernels)
    calls = []
    real_call_in = ops.lessons.call_in

    def spy(lesson, which, name, *args, **kwargs):     # lessons.call goes through lessons.call_in too
        calls.append((lesson, name, kwargs.get("sliding_window")))
        return real_call_in(lesson, which, name, *args, **kwargs)

    monkeypatch.setattr(ops.lessons, "call_in", spy)
    got = step.attend(0, q, k_new, v_new, sliding_window=window)
    for i in range(4):
        rows = slice(step.query_starts[i], step.query_starts[i + 1])
        err = (got[rows].double() - reference(q[rows], full_k[i], full_v[i], window=window)).abs().max().item()
        assert err < 1e-4, f"seed={seed} window {window} sequence {i}: max error {err}"
    kernels = [c for c in calls if c[0] != 1]
    if not use_kernels:
        assert kernels == [], calls
    else:
        # The prompt of 7 after 9 cached tokens makes the step's prefills continue a context: lesson 05.
        assert kernels == [(4, "paged_attention_forward", window), (5, "prefix_prefill_attention", window)], calls


def test_bad_step():
    manager = ops.kv_cache_manager(4, 4, 1, 1, 4, torch.float32, "cpu")
    manager.allocate(0, 2)
    with pytest.raises(ValueError, match="one query length per sequence"):
        PagedStep(manager, [0], [2, 1], 0, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="exactly one token"):
        PagedStep(manager, [0], [2], 1, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("setting,mixed,prefill_only,decode_only", [
    ("", True, False, False),          # default: one plan/run launch for a step that mixes both kinds
    ("1", True, True, True),
    ("0", False, False, False),
])
def test_which_steps_plan(monkeypatch, setting, mixed, prefill_only, decode_only):
    monkeypatch.setenv("YAIE_PLAN_RUN", setting)
    manager = ops.kv_cache_manager(16, 4, 1, 2, 8, torch.float32, "cpu")
    for seq, n in (("a", 5), ("b", 9)):
        manager.allocate(seq, n)

    def planned(seqs, lens, decodes, use_kernels=True):
        return PagedStep(manager, seqs, lens, decodes, torch.zeros(sum(lens), dtype=torch.int64),
                         use_kernels=use_kernels).plan_run

    assert planned(["a", "b"], [1, 9], 1) == mixed
    assert planned(["b"], [9], 0) == prefill_only
    assert planned(["a", "b"], [1, 1], 2) == decode_only
    assert not planned(["a", "b"], [1, 9], 1, use_kernels=False)     # gathered CPU attention never plans


def test_a_bad_plan_run_setting_is_refused(monkeypatch):
    monkeypatch.setenv("YAIE_PLAN_RUN", "yes")
    manager = ops.kv_cache_manager(16, 4, 1, 2, 8, torch.float32, "cpu")
    manager.allocate("a", 5)
    with pytest.raises(ValueError, match="YAIE_PLAN_RUN"):
        PagedStep(manager, ["a"], [5], 0, torch.zeros(5, dtype=torch.int64), use_kernels=True)


def test_mixed_steps_fall_back_to_lessons_04_and_06_when_lesson_05_is_unfinished(monkeypatch, capsys):
    """Strict mode (YAIE_SOLUTIONS set) with lesson 05 left to the student's stubs: the default plan/run of a
    mixed step turns itself off with one notice and the step runs lessons 04 and 06, same output; with
    YAIE_PLAN_RUN=1 the missing lesson is an error."""
    monkeypatch.setattr(ops.plan_run, "default_off_reason", None)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    manager = ops.kv_cache_manager(16, 4, 1, 2, 8, torch.float32, "cpu")
    for t in (manager.k_cache[0], manager.v_cache[0]):
        t.copy_(torch.randn(t.shape, generator=gen))
    manager.allocate("a", 6)
    slots = torch.cat([manager.append_slots("a", 1), manager.allocate("b", 5)])
    q = torch.randn(6, 4, 8, generator=gen)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)

    def attend(**kw):
        step = PagedStep(manager, ["a", "b"], [1, 5], 1, slots, use_kernels=True, **kw)
        return ops.paged_attention(q, k, v, step, 0)

    want = attend(plan_run=False)
    monkeypatch.setenv("YAIE_SOLUTIONS", "1-4,6")          # lesson 05: the stubs, strictly
    got = attend()
    assert "lesson 05" in capsys.readouterr().err and not ops.default_plan_run()
    torch.testing.assert_close(got, want)
    assert not PagedStep(manager, ["a", "b"], [1, 5], 1, slots, use_kernels=True).plan_run   # off from now on
    monkeypatch.setenv("YAIE_PLAN_RUN", "1")
    with pytest.raises(ops.KernelMissing):
        attend()
