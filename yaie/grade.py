"""Run the graders and print a per-lesson score table: ``yaie grade`` and ``run_grader(n)`` in notebooks.

Each lesson's grader runs in its own ``pytest`` process (so a crash or a hang in one lesson cannot take
the others down), writes a ``results.json``, and this module reads those back for the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from yaie.switch import ENV_VAR, LESSONS, describe, parse_spec

ROOT = Path(__file__).resolve().parents[1]


def grader_dir(lesson: int) -> Path:
    return ROOT / "grader" / f"lesson{lesson:02d}"


def available_lessons() -> list[int]:
    return [n for n in LESSONS if grader_dir(n).is_dir()]


TASK_COLUMN = 44                      # characters of a task's name in yaie grade's list
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def run_grader(lesson: int | list[int], solutions: bool = False, extra_args: list[str] | None = None,
               quiet: bool = False) -> dict:
    """Grade one lesson (or several, in one process) in a fresh pytest process; print its report; return the
    parsed results.json.

    ``solutions=True`` grades the reference instead of your code. From a notebook:
    ``from yaie.grade import run_grader; run_grader(1)``.
    """
    lessons = [lesson] if isinstance(lesson, int) else list(lesson)
    for n in lessons:
        if not grader_dir(n).is_dir():
            raise ValueError(f"there is no grader for lesson {n} yet (looked in {grader_dir(n)})")
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "pytest", *map(str, map(grader_dir, lessons)), "-q", "-p", "no:cacheprovider",
               "--color=no", "--results-json", str(results)]
        if solutions:
            cmd.append("--solutions")
        cmd += list(extra_args or [])
        # No colour codes: a notebook shows them as raw escape sequences (Jupyter sets FORCE_COLOR).
        env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE")}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**env, "NO_COLOR": "1"})
        if not quiet:
            # The results file is this function's own temporary file: not worth a line in the report.
            shown = ANSI_ESCAPE.sub("", proc.stdout.replace(f"results written to {results}\n", ""))
            print(shown[-20000:], end="")
            if proc.returncode not in (0, 1) and proc.stderr:
                print(proc.stderr[-5000:], end="", file=sys.stderr)
        if not results.exists():
            return {"score": 0.0, "max_score": 0.0, "tests": [], "error": (proc.stdout + proc.stderr)[-3000:]}
        return json.loads(results.read_text())


def by_lesson(report: dict, lessons: list[int]) -> dict[int, dict]:
    """One results.json of several lessons, split into one per lesson (each test names its lesson)."""
    split = {}
    for n in lessons:
        tests = [t for t in report.get("tests", []) if t.get("extra_data", {}).get("lesson") == n]
        split[n] = {"score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
                    "tests": tests}
        if not tests:
            split[n]["error"] = report.get("error") or "no task of this lesson was collected (see --verbose)"
    return split


def score_table(results: dict[int, dict]) -> str:
    """The per-lesson table ``yaie grade`` prints."""
    lines = [f"{'lesson':<8}{'topic':<50}{'tasks':>8}{'score':>12}", "-" * 78]
    total = max_total = 0.0
    for lesson, res in sorted(results.items()):
        tests = res.get("tests", [])
        passed = sum(t["status"] == "passed" for t in tests)
        label = f"{passed}/{len(tests)}" if tests else "error"
        lines.append(f"{lesson:02d}{'':<6}{LESSONS[lesson].title:<50}{label:>8}"
                     f"{res.get('score', 0.0):>7.1f}/{res.get('max_score', 0.0):<4.0f}")
        total += res.get("score", 0.0)
        max_total += res.get("max_score", 0.0)
    lines += ["-" * 78, f"{'total':<58}{'':>8}{total:>7.1f}/{max_total:<4.0f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="yaie grade", description="grade your lessons and print a score table")
    parser.add_argument("lessons", nargs="*", type=int, help="lesson numbers (default: every lesson with a grader)")
    parser.add_argument("--solutions", action="store_true", help="grade the reference solutions instead")
    parser.add_argument("--verbose", "-v", action="store_true", help="print each grader's full report too")
    parser.add_argument("--results-json", metavar="PATH", help="write every lesson's results into one JSON file")
    args = parser.parse_args(argv)
    try:
        parse_spec(os.environ.get(ENV_VAR))
    except ValueError as err:
        print(f"yaie grade: {err}", file=sys.stderr)
        return 2
    lessons = args.lessons or available_lessons()
    missing = [n for n in lessons if not grader_dir(n).is_dir()]
    if missing:
        print(f"yaie grade: no grader for lesson(s) {missing}; graders exist for {available_lessons()}", file=sys.stderr)
        return 2
    if args.solutions:
        os.environ[ENV_VAR] = "all"
    print(f"grading lessons {', '.join(f'{n:02d}' for n in lessons)}: {describe()}", flush=True)
    results = by_lesson(run_grader(lessons, quiet=not args.verbose), lessons)
    for n in lessons:
        res = results[n]
        if not args.verbose:
            for test in res.get("tests", []):
                state = test["extra_data"]["result"] if "extra_data" in test else test["status"]
                name = test["name"].split(": ", 1)[-1]
                if len(name) > TASK_COLUMN:             # keep the states in one column: cut long names
                    name = name[:TASK_COLUMN - 3] + "..."
                print(f"  lesson {n:02d} {name:<{TASK_COLUMN}} {state}")
            if "error" in res:
                print(f"  lesson {n:02d}: the grader did not run:\n{res['error']}")
    print()
    print(score_table(results))
    if args.results_json:
        Path(args.results_json).write_text(json.dumps({f"lesson{n:02d}": r for n, r in results.items()}, indent=2))
    return 0
