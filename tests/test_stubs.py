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


GIVEN = sorted((stubs.ROOT / "yaie" / "kernels").glob("*_given.py"))


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_there_are_given_modules():
    assert GIVEN, "yaie/kernels/*_given.py hold the code a student is given"


@pytest.mark.parametrize("given", GIVEN, ids=lambda p: p.name)
def test_given_module_stands_alone_and_both_lesson_modules_import_it(given):
    """A given module imports neither its lesson's solution nor its stub (no cycle); both import it, and each
    public name it defines is the same object on the solution and on the stub."""
    lesson_module = given.stem[: -len("_given")]
    dotted = f"yaie.kernels.{given.stem}"
    tree = ast.parse(given.read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [m for m in imported if m.startswith("solutions") or m.startswith(f"yaie.kernels.{lesson_module}")
                and m != dotted], f"{given.name} must not import its lesson module: {sorted(imported)}"
    given_mod = importlib.import_module(dotted)
    for package in ("solutions", "yaie"):
        path = stubs.ROOT / package / "kernels" / f"{lesson_module}.py"
        assert f"from {dotted} import" in path.read_text(), f"{path} must import {dotted}"
        module = importlib.import_module(f"{package}.kernels.{lesson_module}")
        for name in sorted(n for n in _top_level_names(tree) if not n.startswith("_")):
            assert getattr(module, name, None) is getattr(given_mod, name), f"{package}.kernels.{lesson_module}.{name}"
    stub_text = (stubs.ROOT / "yaie" / "kernels" / f"{lesson_module}.py").read_text()
    assert f"yaie/kernels/{given.name}" in stub_text.splitlines()[1], "the stub's header names its given module"


def test_marked_assignments_and_definitions_are_dropped_and_the_rest_kept(tmp_path, monkeypatch):
    """The generator on a small module: an unmarked constant is copied, a `# yaie: solution-only` assignment
    (with the comment lines below its marker) and definition are dropped, a task keeps its docstring and
    raises, and a task marker on an assignment is refused."""
    source = '''"""A lesson module."""

GIVEN = 1

# yaie: solution-only
# The reference's own cache: the stub has no use for it.
_CACHE: dict = {}


# yaie: solution-only
def _helper():
    return 2


# yaie: task 1
def exercise(x):
    """Double x."""
    return 2 * x
'''
    root = tmp_path / "solutions" / "kernels"
    root.mkdir(parents=True)
    (root / "demo.py").write_text(source)
    monkeypatch.setattr(stubs, "ROOT", tmp_path)
    text = stubs.generate(root / "demo.py", 2)
    assert "GIVEN = 1" in text
    assert "_CACHE" not in text and "own cache" not in text and "_helper" not in text
    assert '"""Double x."""' in text and "raise NotImplementedError('lesson 02, task 1" in text
    (root / "demo.py").write_text(source.replace("# yaie: solution-only\n# The", "# yaie: task 2\n# The"))
    with pytest.raises(ValueError, match="only a def can be a task"):
        stubs.generate(root / "demo.py", 2)
