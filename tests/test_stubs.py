"""Stubs are generated from the solutions and stay in step: same signatures, same docstrings, each task raises."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from yaie.tools import stubs

PAIRS = stubs.pairs()


def test_committed_stubs_are_current():
    assert stubs.stale() == [], "run `python -m yaie.tools.stubs` and commit the regenerated stubs"


def _marked_functions(path):
    """(qualified name, task number) of every `# yaie: task N` definition."""
    lines = path.read_text().splitlines(keepends=True)
    found = []

    def walk(nodes, prefix=""):
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                kind, task, _ = stubs._marker_above(lines, first)
                if kind == "task":
                    found.append((prefix + node.name, task))
    walk(ast.parse(path.read_text()).body)
    return found


def _resolve(module, qualname):
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("lesson,solution,stub", PAIRS, ids=lambda p: getattr(p, "name", p))
def test_stub_and_solution_agree(lesson, solution, stub):
    rel = solution.relative_to(stubs.ROOT / "solutions").with_suffix("")
    sol_mod = importlib.import_module("solutions." + ".".join(rel.parts))
    stub_mod = importlib.import_module("yaie." + ".".join(rel.parts))
    marked = _marked_functions(solution)
    assert marked, f"{solution} has no `# yaie: task N` marker"
    for qualname, number in marked:
        sol_fn, stub_fn = _resolve(sol_mod, qualname), _resolve(stub_mod, qualname)
        assert inspect.signature(sol_fn) == inspect.signature(stub_fn), qualname
        assert inspect.getdoc(sol_fn) == inspect.getdoc(stub_fn), qualname
        assert len(inspect.getdoc(stub_fn)) > 80, f"{qualname}: the docstring must state shapes, dtypes, errors"
        source = inspect.getsource(stub_fn)
        assert f"lesson {lesson:02d}, task {number}:" in source, f"{qualname}: stub must name its lesson and task"
