"""Generate the student stubs in ``yaie/`` from the reference solutions in ``solutions/``.

One source of truth: an exercise is written once, in ``solutions/``, with its full signature and
docstring. Markers on the line(s) just above a ``def`` or ``class`` (above its decorators) say what
the stub keeps:

* ``# yaie: task N``        keep the signature and docstring, replace the body with
                            ``raise NotImplementedError("lesson LL, task N: ...")``;
* ``# yaie: solution-only`` drop the definition from the stub (private helpers, Triton kernels), or a
                            module-level assignment (the reference's own constants and caches);
* no marker                 copy as it is (imports, constants, code given to the student).

Classes without a marker are copied with each of their methods treated the same way.

Given code a student need not edit (validators, helpers, constants, references that are not tasks) lives
in a hand-written module beside the stub, ``yaie/kernels/<module>_given.py``; the solution imports it
(``from yaie.kernels.<module>_given import ...``), that import is copied, and the stub's header names it.

    python -m yaie.tools.stubs           # rewrite every stub
    python -m yaie.tools.stubs --check   # exit 1 if a committed stub differs from its generated form
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from yaie.switch import LESSONS

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^\s*#\s*yaie:\s*(task\s+(\d+)|solution-only)\s*$")

HEADER = (
    "# Lesson {lesson:02d} exercises: replace each `raise NotImplementedError(...)` with your code.\n"
    "# Run `pytest grader/lesson{lesson:02d}` to grade them; the notebook is lessons/{notebook}/.\n"
    "# (Generated from {source} by `python -m yaie.tools.stubs`; instructors edit the solution.)\n"
)
GIVEN_HEADER = "# The given code these exercises use is in {given}: read it, do not edit it.\n"
GIVEN_IMPORT = re.compile(r"^from (yaie\.kernels\.\w+_given) import", re.MULTILINE)


def _marker_above(lines: list[str], first_line: int) -> tuple[str | None, int | None, int]:
    """Find a marker comment directly above line ``first_line`` (1-based). Returns (kind, task, marker_line)."""
    idx = first_line - 2
    while idx >= 0 and lines[idx].strip().startswith("#"):
        match = MARKER.match(lines[idx])
        if match:
            if match.group(2):
                return "task", int(match.group(2)), idx + 1
            return "solution-only", None, idx + 1
        idx -= 1
    return None, None, first_line


def _stub_body(node: ast.FunctionDef, lines: list[str], message: str) -> list[str]:
    """The lines of ``node`` up to the end of its docstring, then a NotImplementedError."""
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str)
    if not has_doc:
        raise ValueError(f"line {node.lineno}: task function {node.name!r} needs a docstring (the stub keeps it)")
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    kept = lines[start - 1: body[0].end_lineno]
    indent = " " * body[0].col_offset
    return kept + [f"{indent}raise NotImplementedError({message!r})\n"]


def _transform(nodes: list[ast.stmt], lines: list[str], lo: int, hi: int, lesson: int, where: str) -> list[str]:
    """Rewrite source lines ``lo..hi`` (1-based, inclusive) that hold ``nodes``."""
    out: list[str] = []
    cursor = lo
    for node in nodes:
        assignment = isinstance(node, (ast.Assign, ast.AnnAssign))
        if not assignment and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        first = node.decorator_list[0].lineno if not assignment and node.decorator_list else node.lineno
        kind, task, marker_line = _marker_above(lines, first)
        if assignment and kind != "solution-only":
            if kind == "task":
                raise ValueError(f"{where}:{node.lineno}: only a def can be a task")
            continue  # copied verbatim with the surrounding text
        if kind is None and not isinstance(node, ast.ClassDef):
            continue  # copied verbatim with the surrounding text
        if kind is None:  # an unmarked class: treat its methods one by one
            out.extend(lines[cursor - 1: node.body[0].lineno - 1])
            out.extend(_transform(node.body, lines, node.body[0].lineno, node.end_lineno, lesson, where))
            cursor = node.end_lineno + 1
            continue
        out.extend(lines[cursor - 1: marker_line - 1])
        if kind == "task":
            if isinstance(node, ast.ClassDef):
                raise ValueError(f"{where}:{node.lineno}: mark the methods of class {node.name}, not the class")
            message = f"lesson {lesson:02d}, task {task}: implement {node.name} in {where}"
            out.extend(_stub_body(node, lines, message))
        else:
            # Drop the definition and the blank lines after it, so the stub reads cleanly.
            nxt = node.end_lineno
            while nxt < len(lines) and nxt < hi and not lines[nxt].strip():
                nxt += 1
            cursor = nxt + 1
            continue
        cursor = node.end_lineno + 1
    out.extend(lines[cursor - 1: hi])
    return out


def generate(solution_path: Path, lesson: int) -> str:
    """The stub text for one solution module."""
    source = solution_path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    rel = solution_path.relative_to(ROOT / "solutions")
    where = f"yaie/{rel.as_posix()}"
    body = _transform(tree.body, lines, 1, len(lines), lesson, where)
    header = HEADER.format(lesson=lesson, notebook=LESSONS[lesson].notebook_dir, source=f"solutions/{rel.as_posix()}")
    first, rest = header.split("\n", 1)
    for dotted in dict.fromkeys(GIVEN_IMPORT.findall(source)):  # name the given module(s) right below line 1
        first += "\n" + GIVEN_HEADER.format(given=Path(*dotted.split(".")).with_suffix(".py").as_posix()).rstrip("\n")
    header = first + "\n" + rest
    text = header + "".join(body)
    text = re.sub(r"\n{4,}", "\n\n\n", text).rstrip("\n") + "\n"   # a dropped last block leaves no blank tail
    ast.parse(text)  # the stub must stay valid Python
    return text


def pairs() -> list[tuple[int, Path, Path]]:
    """(lesson, solution file, stub file) for every lesson module present in ``solutions/``."""
    found = []
    for number, info in LESSONS.items():
        for dotted in info.modules:
            rel = Path(*dotted.split(".")).with_suffix(".py")
            sol = ROOT / "solutions" / rel
            if sol.exists():
                found.append((number, sol, ROOT / "yaie" / rel))
    return found


def stale() -> list[Path]:
    """Stub files whose committed text differs from the generated text."""
    return [stub for lesson, sol, stub in pairs()
            if not stub.exists() or stub.read_text() != generate(sol, lesson)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale stubs instead of writing them")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"stale stub: {path.relative_to(ROOT)} (run python -m yaie.tools.stubs)")
        return 1 if bad else 0
    for lesson, sol, stub in pairs():
        text = generate(sol, lesson)
        if not stub.exists() or stub.read_text() != text:
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text(text)
            print(f"wrote {stub.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
