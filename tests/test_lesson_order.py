"""Every part in order: in the copy students get, with the parts up to and including one notebook written (here:
the reference's modules copied in as the student's code), that notebook's grader command passes with full marks.
Parts are the notebooks: 01, 02, 03, 04, 05a, 05b, 05c, 06, 07, 08. A check that needs a later part fails here.

Each part runs only its own tasks, so the walk is one pass of every grader over the reference: it is also the
course's proof that the reference passes every grader (``tests/test_graders.py`` proves the stubs fail them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import check_results_schema
from tests.test_student_copy import ROOT, copy, run_in  # noqa: F401 (copy is a fixture)

# (part, modules the notebook has the student write, its grader command's arguments)
PARTS = [
    ("01", ["cpu_kernels"], ["grader/lesson01"]),
    ("02", ["gpu_elementwise"], ["grader/lesson02"]),
    ("03", ["kv_cache"], ["grader/lesson03"]),
    ("04", ["paged_attention"], ["grader/lesson04"]),
    ("05a", ["radix_attention"], ["grader/lesson05", "-k", "task1 or task2"]),
    ("05b", ["prefix_prefill"], ["grader/lesson05", "-k", "task3 or task4"]),
    ("05c", ["flashinfer"], ["grader/lesson05", "-k", "task5 or task6 or task7 or task8"]),
    ("06", ["flash_attention"], ["grader/lesson06"]),
    ("07", ["telescoping"], ["grader/lesson07"]),
    ("08", ["based"], ["grader/lesson08"]),
]


@pytest.fixture(scope="module")
def course(copy, tmp_path_factory) -> Path:
    """A copy of the student copy that the parts are written into, one after the other."""
    return shutil.copytree(copy, tmp_path_factory.mktemp("order") / "course")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PARTS)), ids=[part for part, _, _ in PARTS])
def test_a_notebooks_grader_passes_with_the_parts_up_to_it_written(course, index, tmp_path):
    for _, modules, _ in PARTS[:index + 1]:          # every part up to this one (written again: idempotent)
        for module in modules:
            shutil.copy(ROOT / "solutions" / "kernels" / f"{module}.py", course / "yaie" / "kernels" / f"{module}.py")
    part, _, command = PARTS[index]
    results = tmp_path / "results.json"
    graded = run_in(course, "pytest", *command, "-q", "-p", "no:cacheprovider", "--results-json", str(results),
                    timeout=600)
    assert graded.returncode == 0, (f"part {part}: `pytest {' '.join(command)}` fails with the parts up to {part} "
                                    f"written:\n{graded.stdout[-4000:]}\n{graded.stderr[-2000:]}")
    assert "not implemented" not in graded.stdout.split("YAIE grade")[-1], graded.stdout[-3000:]
    data = json.loads(results.read_text())
    check_results_schema(data)
    assert data["score"] == data["max_score"] > 0, f"part {part}: {data['score']} of {data['max_score']}"
