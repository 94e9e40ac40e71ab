"""The graders' pytest plugin: task-level grading, teaching messages, timeouts, a score summary.

Loaded by ``grader/conftest.py``. What it adds to pytest:

* ``--solutions``: grade the reference solutions instead of your code (sets ``YAIE_SOLUTIONS=all``;
  pick lessons with the environment variable, e.g. ``YAIE_SOLUTIONS=1,2``);
* ``--results-json PATH``: write a Gradescope-style ``results.json``;
* ``--grader-timeout SECONDS``: per-test time limit (default 120; a test may set its own with
  ``@pytest.mark.grader_timeout(300)``);
* ``-k task2`` selects the checks of task 2;
* an untouched stub shows as one "not implemented yet" line per task; a wrong answer shows the
  check's message (expected, got, where, hint); a crash shows the line of your code that raised.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from grader.checks import GradingError, fresh_seed
from yaie.switch import ENV_VAR, LESSONS, parse_spec

STATUS_KEY = pytest.StashKey[dict]()
SEED_KEY = pytest.StashKey[int]()


class GraderTimeout(Exception):
    """A test ran past its time limit."""


@dataclass
class TaskResult:
    lesson: int
    number: int
    name: str
    points: float
    checks: dict[str, str] = field(default_factory=dict)    # nodeid -> passed/failed/not implemented/timeout/skipped
    messages: list[str] = field(default_factory=list)

    def counted(self) -> dict[str, str]:
        return {k: v for k, v in self.checks.items() if v != "skipped"}

    @property
    def status(self) -> str:
        counted = self.counted()
        if not counted:
            return "skipped"
        if all(v == "passed" for v in counted.values()):
            return "passed"
        # "Not implemented" only while nothing of the task has run to an answer: a wrong answer beside an
        # unwritten function of the same task is a failure, so its messages are not hidden behind the stub.
        if all(v == "not implemented" for v in counted.values()):
            return "not implemented"
        if any(v == "timeout" for v in counted.values()):
            return "timeout"
        if all(v in ("passed", "not implemented") for v in counted.values()):
            return "incomplete"          # nothing wrong so far: some checks only reached an unwritten function
        return "failed"

    @property
    def score(self) -> float:
        counted = self.counted()
        if not counted:
            return 0.0
        return self.points * sum(v == "passed" for v in counted.values()) / len(counted)


# ---------------------------------------------------------------- options and configuration

def pytest_addoption(parser):
    group = parser.getgroup("yaie", "YAIE grader")
    group.addoption("--solutions", action="store_true", default=False,
                    help=f"grade the reference solutions instead of your code (sets {ENV_VAR}=all)")
    group.addoption("--results-json", metavar="PATH", default=None,
                    help="write a Gradescope-style results.json to PATH")
    group.addoption("--grader-timeout", metavar="SECONDS", type=float, default=120.0,
                    help="time limit per test (default 120 s)")


def pytest_configure(config):
    config.addinivalue_line("markers", "yaie_task(number, name, points): a check of a lesson task")
    config.addinivalue_line("markers", "grader_timeout(seconds): this test's time limit")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped with a note elsewhere")
    if config.getoption("--solutions"):
        os.environ[ENV_VAR] = "all"
    try:
        parse_spec(os.environ.get(ENV_VAR))
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    config.stash[STATUS_KEY] = {}
    config.pluginmanager.register(_QuickFailureReports(), "yaie-quick-failure-reports")
    # The graders call hypothesis inside their checks (grader/programs.py), without its pytest integration,
    # whose end-of-run summary alone imports all of hypothesis: most of a second on every grader run.
    hypothesis_plugin = config.pluginmanager.get_plugin("hypothesispytest")
    if hypothesis_plugin is not None and hasattr(hypothesis_plugin, "pytest_sessionstart"):
        hypothesis_plugin.pytest_sessionstart(None)      # its own start-of-session bookkeeping, done once
        config.pluginmanager.unregister(hypothesis_plugin)


def _lesson_of(path: Path) -> int | None:
    for part in reversed(path.parts):
        match = re.fullmatch(r"lesson(\d+)", part)
        if match:
            return int(match.group(1))
    return None


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        mark = item.get_closest_marker("yaie_task")
        if mark is not None:
            item.extra_keyword_matches.add(f"task{mark.kwargs['number']}")
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (runs on a GPU machine; skipped here)"))


@pytest.fixture
def device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"`` (Triton kernels then run in the interpreter)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed for this test; a failure message tells how to replay it."""
    value = fresh_seed()
    request.node.stash[SEED_KEY] = value
    return value


# ---------------------------------------------------------------- timeouts

@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    mark = item.get_closest_marker("grader_timeout")
    limit = float(mark.args[0]) if mark else item.config.getoption("--grader-timeout")
    usable = limit > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        return (yield)

    def on_alarm(signum, frame):
        raise GraderTimeout(f"stopped after {limit:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- reports that teach

def _task_label(item) -> str:
    mark = item.get_closest_marker("yaie_task")
    if mark is None:
        return item.name
    return f"task {mark.kwargs['number']} {mark.kwargs['name']}"


def _student_frame(excinfo) -> str:
    """The deepest traceback line inside the lesson code (yaie/ or solutions/), if any."""
    found = ""
    for frame in traceback.extract_tb(excinfo.tb):
        norm = frame.filename.replace("\\", "/")
        if "/yaie/kernels/" in norm or "/solutions/" in norm:
            rel = norm[norm.rfind("/yaie/kernels/") + 1:] if "/yaie/kernels/" in norm else norm[norm.rfind("/solutions/") + 1:]
            found = f"{rel}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return found


class _QuickFailureReports:
    """Builds the report of a failure the plugin rewrites anyway (a stub, a check's message, a timeout, a crash
    shown as one line) without pytest's traceback formatting: pytest reads the source of every frame for it,
    about 0.1 s a failure, most of a grader's run on the stubs."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        from _pytest.reports import TestReport

        if call.when == "teardown" or call.excinfo is None or not isinstance(call.excinfo.value, Exception):
            return None
        err = call.excinfo.value
        rewritten = isinstance(err, (NotImplementedError, GradingError, GraderTimeout))
        if not rewritten and item.config.getoption("tbstyle") == "long":
            return None                       # --tb=long: pytest's own traceback, formatted as usual
        sections = [(f"Captured {key} {when}", content) for when, key, content in item._report_sections]
        return TestReport(item.nodeid, item.location, {x: 1 for x in item.keywords}, "failed",
                          f"{type(err).__name__}: {err}", call.when, sections, call.duration, call.start, call.stop,
                          user_properties=item.user_properties)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    report.yaie_status = None
    if report.when == "call" or (report.when == "setup" and not report.passed):
        label = _task_label(item)
        seed = item.stash.get(SEED_KEY, None)
        replay = (f"\n  replay:   YAIE_SEED={seed} pytest {item.nodeid}" if seed is not None else "")
        if report.passed:
            report.yaie_status = "passed"
        elif report.skipped:
            report.yaie_status = "skipped"
        elif call.excinfo is not None:
            err = call.excinfo.value
            if isinstance(err, NotImplementedError):
                report.yaie_status = "not implemented"
                report.longrepr = f"{label}: not implemented yet ({err})"
            elif isinstance(err, GraderTimeout):
                report.yaie_status = "timeout"
                report.longrepr = (f"{label}: timed out ({err}) in {item.name}\n"
                                   "  hint:     an endless loop? a loop over every element in Python? "
                                   "On a CPU, keep Triton grids small.")
            elif isinstance(err, GradingError):
                report.yaie_status = "failed"
                report.longrepr = f"{label}: check {item.name} failed\n{err}{replay}"
            else:
                report.yaie_status = "failed"
                if item.config.getoption("tbstyle") != "long":  # --tb=long keeps pytest's full traceback
                    where = _student_frame(call.excinfo)
                    if isinstance(err, SyntaxError):  # the lesson module does not even import
                        where = f"{err.filename}:{err.lineno}: {(err.text or '').strip()}"
                    report.longrepr = (f"{label}: check {item.name} crashed\n"
                                       f"  error:    {type(err).__name__}: {err}\n"
                                       + (f"  at:       {where}\n" if where else "")
                                       + "  hint:     run this check alone with -k and --tb=long for the full traceback"
                                       + (f"\n{err.yaie_context}" if getattr(err, "yaie_context", "") else "")
                                       + replay)
    return report


def pytest_report_teststatus(report, config):
    status = getattr(report, "yaie_status", None)
    if status == "not implemented":
        return "not implemented", "N", "NOT IMPLEMENTED"
    if status == "timeout":
        return "failed", "T", "TIMEOUT"
    return None


def pytest_runtest_logreport(report):
    status = getattr(report, "yaie_status", None)
    if status is None:
        return
    _RESULTS[report.nodeid] = (status, str(report.longrepr) if report.longrepr and status != "passed" else "")


_RESULTS: dict[str, tuple[str, str]] = {}
_ITEMS: dict[str, tuple[int | None, int, str, float]] = {}


def pytest_collection_finish(session):
    for item in session.items:
        mark = item.get_closest_marker("yaie_task")
        if mark is not None:
            _ITEMS[item.nodeid] = (_lesson_of(Path(str(item.path))), mark.kwargs["number"],
                                   mark.kwargs["name"], float(mark.kwargs.get("points", 1.0)))


# ---------------------------------------------------------------- summary and results.json

def _task_results() -> list[TaskResult]:
    tasks: dict[tuple[int, int], TaskResult] = {}
    for nodeid, (lesson, number, name, points) in _ITEMS.items():
        if nodeid not in _RESULTS:
            continue  # deselected (-k) or not run
        key = (lesson or 0, number)
        result = tasks.setdefault(key, TaskResult(lesson or 0, number, name, points))
        status, message = _RESULTS[nodeid]
        result.checks[nodeid] = status
        if message and message not in result.messages:
            result.messages.append(message)
    return [tasks[k] for k in sorted(tasks)]


def _waiting_on(result: TaskResult) -> str:
    """When every stub that raised belongs to other tasks (the task's code, or the given code it runs, calls
    another task's unfinished function), say which, so a finished function is not only reported as unwritten."""
    named = {int(m.group(1)) for message in result.messages
             for m in re.finditer(rf"lesson 0?{result.lesson}, task (\d+)", message)}
    if not named or result.number in named:
        return ""
    tasks = " and ".join(f"task {n}" for n in sorted(named))
    return f" (or waiting for {tasks}: what ran stopped at {tasks}'s stub; do that task first)"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = _task_results()
    if not results:
        return
    write = terminalreporter.write_line
    terminalreporter.section("YAIE grade", sep="=", bold=True)
    by_lesson: dict[int, list[TaskResult]] = defaultdict(list)
    for r in results:
        by_lesson[r.lesson].append(r)
    reference = parse_spec(os.environ.get(ENV_VAR))
    for lesson, tasks in sorted(by_lesson.items()):
        title = LESSONS[lesson].title if lesson in LESSONS else ""
        whose = "reference solutions" if lesson in reference else "your code"
        write(f"lesson {lesson:02d}  {title}  ({whose})")
        for r in tasks:
            counted = r.counted()
            passed = sum(v == "passed" for v in counted.values())
            if r.status == "passed":
                detail = f"passed ({passed}/{len(counted)} checks)"
            elif r.status == "not implemented":
                detail = "not implemented yet" + _waiting_on(r)
            elif r.status == "skipped":
                detail = "skipped (every check needs a GPU)"
            elif r.status == "timeout":
                detail = f"timed out ({passed}/{len(counted)} checks passed)"
            elif r.status == "incomplete":
                unwritten = sum(v == "not implemented" for v in counted.values())
                detail = (f"{passed}/{len(counted)} checks passed, {unwritten} not implemented yet"
                          + _waiting_on(r))
            else:
                detail = f"failed ({passed}/{len(counted)} checks passed; messages above)"
                unwritten = sum(v == "not implemented" for v in counted.values())
                if unwritten:
                    detail += f", {unwritten} not implemented yet" + _waiting_on(r)
            skipped = sum(v == "skipped" for v in r.checks.values())
            if skipped:
                detail += f", {skipped} GPU-only check{'s' if skipped > 1 else ''} skipped"
            write(f"  task {r.number} {r.name}: {detail}")
        done = sum(r.status == "passed" for r in tasks)
        gradable = sum(r.status != "skipped" for r in tasks)
        write(f"lesson {lesson:02d}: {done}/{gradable} tasks passed")
    path = config.getoption("--results-json")
    if path:
        write_results_json(Path(path), results)
        write(f"results written to {path}")


def write_results_json(path: Path, results: list[TaskResult]) -> None:
    """Gradescope's format: total score, and one entry per task with score, max_score, status, output."""
    tests = []
    for r in results:
        counted = r.counted()
        tests.append({
            "name": f"lesson {r.lesson:02d} task {r.number}: {r.name}",
            "score": round(r.score, 4),
            "max_score": r.points if counted else 0.0,
            "status": "passed" if r.status == "passed" else "failed",
            "output": "\n\n".join(r.messages) if r.messages else (
                "passed" if r.status == "passed" else r.status),
            "extra_data": {"lesson": r.lesson, "task": r.number, "result": r.status,
                           "checks": len(counted), "checks_passed": sum(v == "passed" for v in counted.values())},
        })
    payload = {
        "score": round(sum(t["score"] for t in tests), 4),
        "max_score": sum(t["max_score"] for t in tests),
        "output": f"{sum(r.status == 'passed' for r in results)}/{len(results)} tasks passed",
        "tests": tests,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
