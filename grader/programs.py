"""Random programs of operations for the graders of lessons 03 and 05: fixed cases first, then fresh ones.

``run_programs(body, seed, examples, fixed=...)`` calls ``body(pick)`` once per program; ``pick(lo, hi)``
draws an int in ``[lo, hi]`` and ``pick.log("free(3)")`` records the operation a program runs. The order:

1. the **fixed cases** (lists of draws written down beside the test: programs that reach states random
   programs rarely reach, and past failures). They run without hypothesis, so an unfinished method
   fails at once as "not implemented" (no search, no shrinking over a stub);
2. ``examples`` fresh programs: from ``hypothesis`` when it is installed (it shrinks a failing program to
   a short one), else from Python's ``random`` seeded by the test's seed.

Whatever happens inside hypothesis, the student sees the failure of *their* code, never one of
hypothesis's own errors ("Flaky", "Inconsistent data generation", an exception group): the message of
the failing check (what was expected, what came back), the operations of the failing program, and its
draws as a fixed case that replays it with ``YAIE_PROGRAM=...``. A ``NotImplementedError`` stops the
search at once.
"""

from __future__ import annotations

import os
import random
from typing import Callable, Sequence

from grader.checks import GradingError

PROGRAM_ENV = "YAIE_PROGRAM"


class Pick:
    """``pick(lo, hi)`` draws an int; the draws and the logged operations are kept for the report."""

    def __init__(self, draw: Callable[[int, int], int]):
        self._draw = draw
        self.draws: list[int] = []
        self.trace: list[str] = []

    def __call__(self, lo: int, hi: int) -> int:
        value = int(self._draw(lo, hi))
        self.draws.append(value)
        return value

    def log(self, operation: str) -> None:
        self.trace.append(operation)


def replay(draws: Sequence[int]) -> Callable[[int, int], int]:
    """A draw function that returns ``draws`` in order (clamped into ``[lo, hi]``), then ``lo`` for ever."""
    it = iter(list(draws))

    def draw(lo: int, hi: int) -> int:
        value = next(it, lo)
        return min(max(value, lo), hi)

    return draw


class _Failure:
    def __init__(self, err: BaseException, pick: Pick):
        self.err, self.draws, self.trace = err, list(pick.draws), list(pick.trace)


def _where() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.rsplit(" (", 1)[0] if current else "<this test>"


def _report(failure: _Failure, label: str) -> BaseException:
    """The failure as the student sees it: the check's message, the program, a fixed case that replays it."""
    err = failure.err
    lines = []
    if failure.trace and not any(op in str(err) for op in failure.trace[-1:]):
        lines.append(f"  ran:      {' ; '.join(failure.trace)}")
    lines.append(f"  program:  {label}; replay it alone (its draws are a fixed case): "
                 f"{PROGRAM_ENV}={','.join(map(str, failure.draws))} pytest {_where()}")
    context = "\n".join(lines)
    if isinstance(err, GradingError):
        new = GradingError(f"{err}\n{context}")
        new.__cause__ = None
        return new.with_traceback(err.__traceback__)
    # A crash or a stub: keep the exception (the plugin names the line of the student's code), add context.
    if not isinstance(err, NotImplementedError):
        err.yaie_context = context
    return err


def _run_one(body, draw, label: str) -> None:
    pick = Pick(draw)
    try:
        body(pick)
    except Exception as err:  # noqa: BLE001 - every failure is reported with its program
        raise _report(_Failure(err, pick), label) from None


def run_programs(body: Callable[[Pick], None], seed: int, examples: int, fixed: Sequence[Sequence[int]] = (),
                 derandomize: bool | None = None) -> None:
    """Run the ``fixed`` cases, then ``examples`` random programs (see the module docstring)."""
    chosen = os.environ.get(PROGRAM_ENV)
    if chosen:
        _run_one(body, replay([int(v) for v in chosen.replace(" ", "").split(",") if v]), f"the program {PROGRAM_ENV} gave")
        return
    for number, case in enumerate(fixed):
        _run_one(body, replay(case), f"fixed case {number + 1} of {len(fixed)}")
    if derandomize is None:
        derandomize = os.environ.get("YAIE_HYPOTHESIS_DERANDOMIZE", "") == "1"
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError:
        rng = random.Random(0 if derandomize else seed)
        for _ in range(examples):
            _run_one(body, rng.randint, f"a random program (seed {seed})")
        return

    failures: list[_Failure] = []
    stub: list[Exception] = []          # a NotImplementedError, or the grader's time limit

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False)
    @given(st.data())
    def program(data):
        if stub:
            return                      # an unfinished method: nothing more to learn, stop drawing
        pick = Pick(lambda lo, hi: data.draw(st.integers(lo, hi)))
        try:
            body(pick)
        except NotImplementedError as err:
            stub.append(err)
            return
        except Exception as err:  # noqa: BLE001 - recorded, then hypothesis shrinks it
            if type(err).__name__ == "GraderTimeout":     # the time limit fired once: shrinking would run on
                stub.append(err)                         # without one, so stop here
                return
            failures.append(_Failure(err, pick))
            raise

    try:
        program()
    except Exception as err:  # noqa: BLE001 - ours, or one of hypothesis's own errors
        if stub:
            raise stub[0] from None
        ours = next((f for f in reversed(failures) if f.err is err), None)
        if ours is not None:
            raise _report(ours, "the shortest failing program hypothesis found") from None
        if not failures:
            if type(err).__module__.startswith("hypothesis"):
                raise GradingError(
                    "the random programs could not run to the end: the same program drew different operations "
                    "when it ran again, so your code answered differently to the same calls\n"
                    "  hint:     look for state kept between objects (class attributes, module globals) or "
                    "results that depend on the order of a set") from None
            raise
        # Hypothesis could not replay its failure (Flaky, inconsistent draws...): report the shortest
        # failure it saw, replayed from its draws outside hypothesis.
        shortest = min(failures, key=lambda f: (len(f.draws), f.draws))
        _run_one(body, replay(shortest.draws), "a failing random program, replayed")   # raises if it replays
        raise GradingError(
            f"{shortest.err}\n  ran:      {' ; '.join(shortest.trace)}\n"
            "  note:     this program failed once but passed when it ran again: the result depends on "
            "something besides the program (state kept in class attributes or module globals, the order "
            "of a set or dict of objects, uninitialised memory)") from None
    if stub:
        raise stub[0]
