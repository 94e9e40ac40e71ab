"""Auto mode falls back per function (a class where the tasks build one class); strict mode does not."""

import pytest
import torch

import solutions.kernels.cpu_kernels as reference
import solutions.kernels.kv_cache as reference03
import yaie.kernels.cpu_kernels as student
import yaie.kernels.kv_cache as student03
from yaie import ops
from yaie.model.testing import fresh_seed

ROPE_NOTICE = ("lesson 01: build_rope_cache is not implemented yet in yaie/kernels/cpu_kernels.py; "
               "using the reference for it")


@pytest.fixture(autouse=True)
def _auto_mode(monkeypatch):
    monkeypatch.delenv("YAIE_SOLUTIONS", raising=False)
    ops.reset_auto_fallback()
    yield
    ops.reset_auto_fallback()


def count_calls(monkeypatch, module, name, function):
    """Put ``function`` at ``module.name``, counting its calls: a student's written task, or a spy."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def notices(capsys, lesson):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"lesson {lesson:02d}")]


def test_a_written_function_runs_beside_a_stubbed_one(monkeypatch, capsys):
    """cpu_rms_norm written, build_rope_cache still the stub: the stub's task runs from the reference, with
    one notice naming it, and the student's cpu_rms_norm keeps running."""
    x, w = torch.randn(3, 8), torch.randn(8)
    want = reference.cpu_rms_norm(x, w, 1e-6)
    written = count_calls(monkeypatch, student, "cpu_rms_norm", reference.cpu_rms_norm)
    reference_norm = count_calls(monkeypatch, reference, "cpu_rms_norm", reference.cpu_rms_norm)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), want)
    before = ops.selection()
    cos, sin = ops.rope_cache(16, 8)
    want_cos, want_sin = reference.build_rope_cache(16, 8)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    ops.rope_cache(16, 8)                                  # the reference from now on: no second notice
    assert notices(capsys, 1) == [ROPE_NOTICE]
    assert ops.selection() != before, "CUDA graphs are keyed by the selection: a fallback must change it"
    ops.rms_norm(x, w, 1e-6)
    assert len(written) == 2 and reference_norm == [], "the student's cpu_rms_norm must keep running"
    assert ops.describe() == "auto mode: the reference for lesson 01 build_rope_cache; your code elsewhere"


def test_describe_and_selection_follow_each_fallback(monkeypatch, capsys):
    monkeypatch.setattr(student, "cpu_rms_norm", reference.cpu_rms_norm)
    first = ops.selection()
    assert ops.describe() == "auto mode: your code (yaie/), the reference only for functions that are still stubs"
    cos, sin = ops.rope_cache(16, 8)
    second = ops.selection()
    ops.rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), cos, sin, torch.arange(3))   # cpu_rope_embeddings: a stub
    third = ops.selection()
    assert len({first, second, third}) == 3
    assert ops.describe() == ("auto mode: the reference for lesson 01 build_rope_cache, lesson 01 "
                              "cpu_rope_embeddings; your code elsewhere")
    assert len(notices(capsys, 1)) == 2
    ops.reset_auto_fallback()
    assert ops.selection() == first


def test_lesson_calls_and_reference_only_kernels_follow_each_function(monkeypatch):
    written = count_calls(monkeypatch, student, "cpu_rms_norm", reference.cpu_rms_norm)
    lesson01 = ops.LessonCalls(1)
    lesson01.cpu_rms_norm(torch.randn(2, 4), torch.ones(4))
    assert ops.lessons.reference_only(1, "cpu_rms_norm", ("build_rope_cache",)) is None, "before the fallback"
    cos, _ = lesson01.build_rope_cache(8, 4)
    assert torch.equal(cos, reference.build_rope_cache(8, 4)[0])
    lesson01.cpu_rms_norm(torch.randn(2, 4), torch.ones(4))
    assert len(written) == 2, "the student's cpu_rms_norm must keep running beside the fallback"
    assert ops.lessons.reference_only(1, "cpu_rms_norm", ("build_rope_cache",)) is reference.cpu_rms_norm
    assert ops.lessons.reference_only(1, "cpu_rms_norm", ("build_rope_cache", "cpu_rms_norm")) is None
    with pytest.raises(ValueError, match="name the lesson functions it stands in for"):
        ops.lessons.reference_only(1, "cpu_rms_norm", ())


class HalfWrittenManager(reference03.KVCacheManager):
    """A student's lesson 03 class with every task done but ``free``."""

    def free(self, seq_id):
        raise NotImplementedError("lesson 03, task 2: implement free in yaie/kernels/kv_cache.py")


def test_a_class_is_the_unit_of_fallback(monkeypatch, capsys):
    """One stubbed method of lesson 03's class sends the whole class to the reference (it holds the cache's
    state), once, named by the class; lesson 01's functions stay the student's."""
    monkeypatch.setattr(student03, "KVCacheManager", HalfWrittenManager)
    written = count_calls(monkeypatch, student, "cpu_rms_norm", reference.cpu_rms_norm)
    for _ in range(2):
        manager = ops.kv_cache_manager(8, 4, 1, 1, 4, torch.float32, "cpu")
        assert type(manager) is reference03.KVCacheManager
    assert notices(capsys, 3) == ["lesson 03: KVCacheManager is not implemented yet in yaie/kernels/kv_cache.py; "
                                  "using the reference for it"]
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    assert len(written) == 1
    assert ops.describe() == "auto mode: the reference for lesson 03 KVCacheManager; your code elsewhere"


def test_a_finished_class_is_the_students(monkeypatch, capsys):
    class Finished(reference03.KVCacheManager):
        pass

    monkeypatch.setattr(student03, "KVCacheManager", Finished)
    assert type(ops.kv_cache_manager(8, 4, 1, 1, 4, torch.float32, "cpu")) is Finished
    assert notices(capsys, 3) == [] and ops.describe().startswith("auto mode: your code")


def test_lesson05_plan_run_classes_fall_back_as_classes(capsys):
    """A mixed step through plan/run, with lesson 05's FlashInferPagedAttention the student's stub: that class
    runs from the reference (one notice naming it) and gives float64 attention; then the same step through
    lessons 04 and 06 adds their functions, one by one, to what runs from the reference."""
    from tests.test_ops_paged import build_step, reference as attention64

    step, q, k, v, full_k, full_v = build_step(fresh_seed(), [5, 0], [1, 6], 1, use_kernels=True)
    step.plan_run = True
    got = step.attend(0, q, k, v)                          # writes the new keys and values, then attends
    lesson05 = notices(capsys, 5)
    assert lesson05 == ["lesson 05: FlashInferPagedAttention is not implemented yet in yaie/kernels/flashinfer.py; "
                        "using the reference for it"], lesson05
    for i in range(2):
        rows = slice(step.query_starts[i], step.query_starts[i + 1])
        assert (got[rows].double() - attention64(q[rows], full_k[i], full_v[i])).abs().max() < 1e-4
    step.plan_run = False
    torch.testing.assert_close(ops.paged_attention(q, k, v, step, 0), got, atol=1e-5, rtol=1e-5)
    assert ops.describe() == ("auto mode: the reference for lesson 03 KVCacheManager, lesson 04 "
                              "paged_attention_forward, lesson 05 FlashInferPagedAttention, lesson 06 "
                              "flash_attention_varlen_forward; your code elsewhere")


def test_strict_mode_still_stops_at_a_stub(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "none")
    written = count_calls(monkeypatch, student, "cpu_rms_norm", reference.cpu_rms_norm)
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    with pytest.raises(ops.KernelMissing, match="lesson 01: build_rope_cache is not implemented yet in "
                                                "yaie/kernels/cpu_kernels.py") as err:
        ops.rope_cache(16, 8)
    assert "YAIE_SOLUTIONS=1" in str(err.value) and len(written) == 1
    with pytest.raises(ops.KernelMissing, match="lesson 03: KVCacheManager is not implemented yet"):
        ops.kv_cache_manager(8, 4, 1, 1, 4, torch.float32, "cpu")
    assert ops.describe() == "all lessons run your code (yaie/)"
    assert ops.selection() == ("none", frozenset())
    assert ops.lessons.reference_only(1, "cpu_rms_norm", ("build_rope_cache",)) is None
    monkeypatch.setenv("YAIE_SOLUTIONS", "1")
    assert ops.lessons.reference_only(1, "cpu_rms_norm", ("build_rope_cache",)) is reference.cpu_rms_norm


def test_a_call_to_no_such_lesson_function_is_a_value_error():
    with pytest.raises(ValueError, match="lesson 01: yaie.kernels.cpu_kernels has no 'cpu_rms_nrom'"):
        ops.call(1, "cpu_rms_nrom", torch.ones(2, 4), torch.ones(4))
    with pytest.raises(ValueError, match="lesson 05 has modules 0-2, not 3"):
        ops.call_in(5, 3, "merge_state")
    with pytest.raises(ValueError, match="no lesson 42"):
        ops.call(42, "cpu_rms_norm")
