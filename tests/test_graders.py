"""Every grader fails task by task, as "not implemented", on the stubs; the grader's options. (That the reference
passes every grader, part by part in the order of the notebooks: ``tests/test_notebooks.py``.)"""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, check_results_schema, run_pytest
from yaie.grade import available_lessons

LESSONS = available_lessons()


def test_there_are_graders():
    assert 1 in LESSONS, "grader/lesson01 is missing"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda n: f"lesson{n:02d}")
def test_stubs_fail_every_task_as_not_implemented(lesson, tmp_path):
    proc, data = run_pytest([f"grader/lesson{lesson:02d}"], tmp_path)
    assert proc.returncode == 1, f"the grader must fail on the stubs:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert data is not None, proc.stdout[-3000:]
    check_results_schema(data)
    assert data["score"] == 0
    for test in data["tests"]:
        assert test["extra_data"]["result"] == "not implemented", test
    out = proc.stdout
    assert f"lesson {lesson:02d}: 0/{len(data['tests'])} tasks passed" in out, out[-2000:]
    for test in data["tests"]:
        name = test["name"].split(": ", 1)[1]
        number = test["extra_data"]["task"]
        assert f"task {number} {name}: not implemented yet" in out, out[-2000:]
    assert "Traceback" not in out and "NotImplementedError\n" not in out, "stubs must not print tracebacks"


def test_tasks_are_addressable(tmp_path):
    proc, data = run_pytest(["grader/lesson01", "--solutions", "-k", "task2"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert [t["extra_data"]["task"] for t in data["tests"]] == [2]


def test_environment_variable_selects_lessons(tmp_path):
    proc, data = run_pytest(["grader/lesson01"], tmp_path, env_extra={"YAIE_SOLUTIONS": "1"})
    assert proc.returncode == 0 and data["score"] == data["max_score"], proc.stdout[-3000:]
    proc, data = run_pytest(["grader/lesson01"], tmp_path, env_extra={"YAIE_SOLUTIONS": "2-3"})
    assert proc.returncode == 1 and data["score"] == 0
    proc, _ = run_pytest(["grader/lesson01"], tmp_path, env_extra={"YAIE_SOLUTIONS": "lesson one"})
    assert proc.returncode == 4 and "cannot read" in (proc.stdout + proc.stderr)


def test_yaie_grade_prints_a_table():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "yaie.cli", "grade", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "CPU kernels" in proc.stdout and "0/4" in proc.stdout and "not implemented" in proc.stdout
