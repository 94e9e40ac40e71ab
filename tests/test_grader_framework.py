"""The grader plugin itself: messages that teach, timeouts, stubs as one line, results.json, GPU skips."""

from __future__ import annotations

import shutil
import textwrap

import torch

from tests.helpers import ROOT, check_results_schema, run_pytest

FAKE_GRADER = '''
import time

import pytest
import torch

from grader.checks import assert_close, expect_value_error, task


@task(1, "wrong_answer")
def test_wrong(seed):
    got = torch.ones(2, 3)
    assert_close(got, torch.zeros(2, 3, dtype=torch.float64), name="fake output", hint="think about it")


@task(2, "endless")
def test_endless():
    while True:
        time.sleep(0.01)


@task(3, "crash")
def test_crash():
    raise TypeError("boom")


@task(4, "stub")
def test_stub_a():
    raise NotImplementedError("lesson 01, task 4: implement stub in yaie/kernels/x.py")


@task(4, "stub")
def test_stub_b():
    raise NotImplementedError("lesson 01, task 4: implement stub in yaie/kernels/x.py")


@task(5, "silent")
def test_silent():
    expect_value_error(lambda: 1, what="a bad call")


@task(7, "half_done")
def test_half_done_wrong():
    assert_close(torch.ones(2), torch.zeros(2, dtype=torch.float64), name="first function", hint="look again")


@task(7, "half_done")
def test_half_done_stub():
    raise NotImplementedError("lesson 01, task 7: implement second in yaie/kernels/x.py")


@task(6, "fine")
def test_fine():
    assert torch.ones(1).item() == 1.0


@task(6, "fine")
@pytest.mark.gpu
def test_fine_on_gpu():
    assert torch.cuda.is_available()
'''


def test_messages_timeouts_and_results(tmp_path):
    lesson = tmp_path / "lesson01"
    lesson.mkdir()
    shutil.copy(ROOT / "grader" / "conftest.py", tmp_path / "conftest.py")
    (lesson / "test_fake.py").write_text(textwrap.dedent(FAKE_GRADER))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc, data = run_pytest([str(lesson), "--grader-timeout", "1", "--rootdir", str(tmp_path)], out_dir,
                            env_extra={"PYTHONPATH": str(ROOT)})
    out = proc.stdout
    assert proc.returncode == 1, out
    check_results_schema(data)
    by_task = {t["extra_data"]["task"]: t for t in data["tests"]}
    # a wrong answer: what, where, expected vs got, a hint, how to replay
    assert "fake output is wrong" in out and "worst at: index (0, 0): expected 0, got 1" in out
    assert "hint:     think about it" in out and "replay:   YAIE_SEED=" in out
    # an endless loop becomes a timeout
    assert "task 2 endless: timed out" in out and by_task[2]["extra_data"]["result"] == "timeout"
    # a crash names the error, not a wall of traceback
    assert "task 3 crash: check test_crash crashed" in out and "TypeError: boom" in out
    assert "Traceback" not in out
    # a stub: one line per task in the summary
    assert out.count("task 4 stub: not implemented yet") == 1
    assert by_task[4]["extra_data"]["result"] == "not implemented"
    # a missing ValueError is a failure with a hint
    assert "bad input must raise ValueError" in out and "the call returned normally" in out
    # partial and GPU handling
    if not torch.cuda.is_available():
        assert "1 GPU-only check skipped" in out
    assert by_task[6]["status"] == "passed" and by_task[6]["score"] == by_task[6]["max_score"] == 1.0
    # a wrong answer beside an unwritten function of the same task: reported as a failure, not hidden
    assert "task 7 half_done: failed (0/2 checks passed; messages above), 1 not implemented yet" in out
    assert "first function is wrong" in out and by_task[7]["extra_data"]["result"] == "failed"
    assert data["score"] == 1.0 and data["max_score"] == 7.0
    assert "lesson 01: 1/7 tasks passed" in out


def test_a_task_that_calls_an_unfinished_task_says_which():
    """A finished function that calls a later task's stub is not reported as unwritten."""
    from grader.framework import TaskResult, _waiting_on

    def result(number, *messages):
        return TaskResult(8, number, "x", 1.0, {"a": "not implemented"}, list(messages))

    calls_task4 = "task 2 based_prefill: not implemented yet (lesson 08, task 4: implement check_based_inputs in ...)"
    assert "waiting for task 4" in _waiting_on(result(2, calls_task4))
    own_stub = "task 2 based_prefill: not implemented yet (lesson 08, task 2: implement based_prefill in ...)"
    assert _waiting_on(result(2, own_stub, calls_task4)) == ""
    assert _waiting_on(result(2, "lesson 07, task 4: another lesson's stub")) == ""


def test_a_task_whose_other_checks_wait_for_a_later_task_is_incomplete_not_failed():
    """Checks that passed beside checks that only reached another task's stub: nothing failed, so the task is
    "incomplete" (no "messages above" when there are none), and the summary says what it waits for."""
    from grader.framework import TaskResult

    waiting = "task 4 check_based_inputs: not implemented yet (lesson 08, task 2: implement based_prefill in ...)"
    r = TaskResult(8, 4, "check_based_inputs", 1.0, {"a": "passed", "b": "not implemented"}, [waiting])
    assert r.status == "incomplete" and r.score == 0.5
    r.checks["c"] = "failed"
    assert r.status == "failed"


PROGRAM_GRADER = '''
import pytest

from grader.checks import GradingError, task
from grader.programs import run_programs


@task(1, "crash_in_a_program")
def test_crash(seed):
    def body(pick):
        for _ in range(pick(1, 4)):
            n = pick(0, 9)
            pick.log(f"append({n})")
            if n >= 5:
                {}[n]                      # the student's code crashes
    run_programs(body, seed, 30, fixed=[[2, 1, 7]])


@task(2, "random_failure")
def test_random(seed):
    def body(pick):
        n = pick(0, 100)
        pick.log(f"allocate({n})")
        if n % 7 == 3:
            raise GradingError(f"allocate({n}) took the wrong blocks\\n  expected: 1 block\\n  got:      2 blocks")
    run_programs(body, seed, 200)


@task(3, "endless_program")
@pytest.mark.grader_timeout(2)
def test_endless(seed):
    import time

    def body(pick):
        if pick(0, 100) > 50:
            while True:
                time.sleep(0.01)
    run_programs(body, seed, 50)
'''


def test_random_programs_report_the_program_not_hypothesis(tmp_path):
    """A program that crashes or fails: the plugin shows the operations and a fixed case to replay it, no
    traceback and none of hypothesis's own errors."""
    lesson = tmp_path / "lesson01"
    lesson.mkdir()
    shutil.copy(ROOT / "grader" / "conftest.py", tmp_path / "conftest.py")
    (lesson / "test_programs.py").write_text(textwrap.dedent(PROGRAM_GRADER))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc, data = run_pytest([str(lesson), "--rootdir", str(tmp_path)], out_dir,
                            env_extra={"PYTHONPATH": str(ROOT)}, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, out
    # an endless program is stopped once: hypothesis does not go on shrinking it without a time limit
    assert "task 3 endless_program: timed out" in out, out
    assert "task 1 crash_in_a_program: check test_crash crashed" in out and "KeyError: 7" in out, out
    assert "ran:      append(1) ; append(7)" in out and "fixed case 1 of 1" in out and "YAIE_PROGRAM=2,1,7" in out, out
    assert "took the wrong blocks" in out and "expected: 1 block" in out and "YAIE_PROGRAM=" in out, out
    for word in ("Traceback", "Flaky", "Inconsistent", "Falsifying", "ExceptionGroup"):
        assert word not in out, out


def test_tb_long_keeps_pytests_traceback_of_a_crash(tmp_path):
    """Failures the plugin rewrites skip pytest's traceback formatting (it is most of a stub run); a crash
    under --tb=long still gets pytest's full traceback, source lines included."""
    lesson = tmp_path / "lesson01"
    lesson.mkdir()
    shutil.copy(ROOT / "grader" / "conftest.py", tmp_path / "conftest.py")
    (lesson / "test_programs.py").write_text(textwrap.dedent(PROGRAM_GRADER))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc, _ = run_pytest([str(lesson), "--rootdir", str(tmp_path), "--tb=long", "-k", "task1"], out_dir,
                         env_extra={"PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 1 and "KeyError" in proc.stdout, proc.stdout
    assert "{}[n]" in proc.stdout and "def body(pick):" in proc.stdout, proc.stdout
