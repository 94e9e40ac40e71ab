"""Every lesson notebook is stored without outputs, and runs top to bottom in the copy students get, in the
order students take them."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest

from tests.helpers import ROOT
from tests.test_student_copy import copy  # noqa: F401 (a fixture)

NOTEBOOKS = sorted((ROOT / "lessons").glob("*/*.ipynb"))


def test_every_lesson_with_a_grader_has_a_notebook():
    from yaie.grade import available_lessons
    from yaie.switch import LESSONS

    for lesson in available_lessons():
        folder = ROOT / "lessons" / LESSONS[lesson].notebook_dir
        assert list(folder.glob("*.ipynb")), f"lesson {lesson:02d} has a grader but no notebook in {folder}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_notebook_is_stored_without_outputs(path):
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), \
        f"{path.name}: every cell needs an id of its own (cell {ids.index(None) if None in ids else '?'})"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, \
                f"{path.name}: clear the outputs before committing (jupyter nbconvert --clear-output --inplace)"


# The parts in the order students take them: (notebook, modules it has the student write, the later tasks'
# functions one of its demos previews, which say they wait for them).
PARTS = [
    ("01_cpu_kernels/01_cpu_kernels.ipynb", ["cpu_kernels"], ()),
    ("02_triton_elementwise/02_triton_elementwise.ipynb", ["gpu_elementwise"], ()),
    ("03_paged_kv_cache/03_paged_kv_cache.ipynb", ["kv_cache"], ()),
    ("04_paged_attention/04_paged_attention.ipynb", ["paged_attention"], ()),
    ("05_radix_flashinfer/05a_radix_tree.ipynb", ["radix_attention"], ("prefix_prefill_attention",)),
    ("05_radix_flashinfer/05b_prefix_prefill.ipynb", ["prefix_prefill"], ("flash_attention_varlen_forward",)),
    ("05_radix_flashinfer/05c_plan_run_cascade.ipynb", ["flashinfer"], ()),
    ("06_flash_attention/06_flash_attention.ipynb", ["flash_attention"], ()),
    ("07_telescoping_cache/07_telescoping_cache.ipynb", ["telescoping"], ()),
    ("08_based_linear_attention/08_based_linear_attention.ipynb", ["based"], ()),
]


def test_the_parts_are_the_notebooks():
    assert sorted(ROOT / "lessons" / notebook for notebook, _, _ in PARTS) == NOTEBOOKS


def students_copy(copy, tmp_path_factory, name: str) -> tuple[Path, Path]:
    """A copy of the student copy that parts are written into, one after the other, and a folder whose
    ``solutions`` package cannot be imported: on ``PYTHONPATH`` before the editable install of this repository,
    it keeps the notebooks' kernels and the graders they start from finding this repository's reference."""
    course = shutil.copytree(copy, tmp_path_factory.mktemp(name) / "course")
    hidden = tmp_path_factory.mktemp("no_reference") / "solutions"
    hidden.mkdir()
    (hidden / "__init__.py").write_text(
        'raise ModuleNotFoundError("the student copy has no reference solutions", name="solutions")\n')
    return course, hidden.parent


@pytest.fixture(scope="module")
def course(copy, tmp_path_factory) -> tuple[Path, Path]:
    return students_copy(copy, tmp_path_factory, "written")


def run_in_copy(course: tuple[Path, Path], parts: int, index: int, monkeypatch,
                grader_cell: bool = True) -> tuple[Path, str]:
    """Write the first ``parts`` parts into the copy and put the stubs back in the others (so the copy does not
    depend on which tests ran before), run notebook ``index`` there top to bottom (a cell that raises fails the
    test with its traceback), and return its path and printed text. ``grader_cell=False`` leaves out the
    grader's cell."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    course, no_reference = course
    for number, (_, modules, _) in enumerate(PARTS):
        source = ROOT / ("solutions" if number < parts else "yaie") / "kernels"    # the reference, or the stubs
        for module in modules:
            shutil.copy(source / f"{module}.py", course / "yaie" / "kernels" / f"{module}.py")
    path = course / "lessons" / PARTS[index][0]
    monkeypatch.delenv("YAIE_SOLUTIONS", raising=False)
    monkeypatch.setenv("PYTHONPATH", f"{no_reference}{os.pathsep}{course}")
    # One thread per kernel: the notebooks' tensors are tiny, and on a loaded 2-core machine torch's
    # thread pool can spin for minutes (seen once here).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # A cell's reply could get lost between the kernel and the client, both then waiting idle (seen on notebooks
    # 03, 06 and 07, in about one suite run of three here, each costing 2 minutes). The likely cause: the test
    # workers start kernels at the same time, and jupyter_client picks a kernel's TCP ports by opening and
    # closing them, so two kernels started together can be given the same port. The kernel therefore talks to
    # its client over Unix sockets in a folder of its own (transport "ipc", an absolute path: the kernel runs
    # in the notebook's folder). Should a cell still run past its time limit, it gets one fresh kernel and a
    # second run of the whole notebook. The limit is about 4x the slowest cell alone (27.5 s: notebook 07's
    # grader cell, on this 2-core machine).
    for attempt in (1, 2):
        nb = nbformat.read(path, as_version=4)
        if not grader_cell:
            graders = [cell for cell in nb.cells if cell.cell_type == "code" and "run_grader(" in cell.source]
            assert len(graders) == 1, f"{path.name}: {len(graders)} grader cells"
            nb.cells.remove(graders[0])
        sockets = Path(tempfile.mkdtemp(prefix="yaie-kernel-")) / "kernel"
        # (Unix sockets where there are some; TCP elsewhere.)
        channels = dict(transport="ipc", ip=str(sockets)) if os.name == "posix" else {}
        try:
            NotebookClient(nb, timeout=120, kernel_name="python3",
                           km=KernelManager(kernel_name="python3", **channels),
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            break
        except CellTimeoutError:
            if attempt == 2:
                raise
        finally:
            shutil.rmtree(sockets.parent, ignore_errors=True)
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    return path, text


IDS = [Path(notebook).stem[:3].rstrip("_") for notebook, _, _ in PARTS]


@pytest.mark.parametrize("index", range(len(PARTS)), ids=IDS)
def test_notebook_runs_in_the_students_copy_with_the_parts_up_to_it_written(course, index, monkeypatch):
    """Notebook by notebook, in the copy students get, with the parts up to and including this one written (the
    reference's modules copied in as the student's code): the notebook runs top to bottom and its last cell,
    the part's grader, gives full marks. A cell that needs a later part fails here. The walk is one pass of
    every grader over the reference: the course's proof that the reference passes every grader
    (``tests/test_graders.py`` proves the stubs fail them)."""
    path, text = run_in_copy(course, index + 1, index, monkeypatch)
    previews = PARTS[index][2]
    missing = [line for line in text.splitlines() if "not implemented yet" in line or "reference solution" in line]
    waits = [line for line in missing if any(name in line for name in previews)]
    assert missing == waits, (f"{path.name} needs a part not written yet, or the reference the copy lacks: "
                              f"{[line for line in missing if line not in waits]}")
    assert all(any(name in line for line in waits) for name in previews), \
        f"{path.name} no longer waits for {previews}: take them out of PARTS"
    score = re.search(rf"lesson {path.parent.name[:2]}: (\d+)/(\d+) tasks passed", text)
    assert score and score.group(1) == score.group(2) != "0", \
        f"the part's grader (the last cell) must give full marks with the parts up to it written: {text[-3000:]}"
