"""Every notebook as a student first opens it: in the copy students get, the parts before it written and its own
still stubs, it runs top to bottom with no traceback, and each unfinished exercise prints its one "not implemented
yet" line. (Its grader cell is left out here: ``tests/test_graders.py`` runs every grader on the stubs.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_notebooks import IDS, PARTS, run_in_copy, students_copy
from tests.test_student_copy import copy  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def course(copy, tmp_path_factory) -> tuple[Path, Path]:
    return students_copy(copy, tmp_path_factory, "first_open")


@pytest.mark.parametrize("index", range(len(PARTS)), ids=IDS)
def test_notebook_opened_before_its_part_is_written_says_what_to_write(course, index, monkeypatch):
    path, text = run_in_copy(course, index, index, monkeypatch, grader_cell=False)
    assert "not implemented yet" in text, f"{path.name} never says which task to write: {text[-2000:]}"
