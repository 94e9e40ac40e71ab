"""The copy students get (``scripts/make_student_copy.py``) is a course of its own: its README speaks of what is
there, its two quick-start commands do what the README says, and the engine's advice works there (no reference
solution to fall back to). Each command runs in the copy with this repository's own packages hidden."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Runs a module of the copy with the editable install of this repository (which would find its solutions/)
# taken off the import machinery.
HIDE_THIS_REPO = ("import runpy, sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                  "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("student") / "course"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_student_copy.py"), str(dest), "--worktree"],
                   check=True, capture_output=True)
    return dest


def run_in(copy: Path, module: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    env.pop("YAIE_SOLUTIONS", None)
    return subprocess.run([sys.executable, "-c", HIDE_THIS_REPO, module, *args], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_copy_has_no_reference_and_a_readme_of_its_own(copy):
    assert not (copy / "solutions").exists() and not (copy / "tests").exists()
    assert (copy / "grader" / "lesson01").is_dir() and (copy / "lessons").is_dir()
    readme = (copy / "README.md").read_text()
    for absent in ("solutions/", "CONTRIBUTING", "--solutions", "tests/", "LESSONS"):
        assert absent not in readme, f"the copy's README mentions {absent!r}"
    assert "| 01 | CPU kernels |" in readme and "| 08 | Based linear attention |" in readme
    assert 'yaie generate "Once upon a time"' in readme and "python -m pytest" in readme
    assert 'testpaths = ["grader"]' in (copy / "pyproject.toml").read_text()
    leftover = [p.name for p in (copy / "scripts").glob("*") if "from solutions" in p.read_text(errors="replace")]
    assert not leftover, f"scripts of the copy import the reference: {leftover}"


def test_generate_names_the_first_function_to_write_and_runs_once_it_is_written(copy, tmp_path):
    first = run_in(copy, "yaie.cli", "generate", "Once upon a time", "--max-tokens", "4")
    assert first.returncode == 1, first.stderr[-2000:]
    message = first.stderr.strip()
    assert message.count("\n") == 0, message
    assert "lesson 01" in message and "implement it" in message and "YAIE_SOLUTIONS" not in message
    written = shutil.copytree(copy, tmp_path / "written")
    for module in ("cpu_kernels", "kv_cache"):                   # lessons 01 and 03, as a student wrote them
        shutil.copy(ROOT / "solutions" / "kernels" / f"{module}.py", written / "yaie" / "kernels" / f"{module}.py")
    second = run_in(written, "yaie.cli", "generate", "Once upon a time", "--max-tokens", "4")
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.startswith("Once upon a time") and len(second.stdout.strip()) > len("Once upon a time")
    assert "prefix caching is off" in second.stderr             # lesson 05 is optional: a notice, not an error


def test_pytest_in_the_copy_runs_the_graders(copy):
    collected = run_in(copy, "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert "grader/lesson01" in collected.stdout and "grader/lesson08" in collected.stdout
