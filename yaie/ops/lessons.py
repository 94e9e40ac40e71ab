"""Which module serves a lesson function now: the switch's choice, and auto mode's per-function fallbacks.

Every lesson call of the engine goes through :func:`call_in` (or :func:`call`, :class:`LessonCalls`,
:func:`run_with_fallback`), which looks the module up *at call time*, so the student's code is what runs,
a change of the switch takes effect at once, and a test's spy on a module attribute is seen.

Auto mode (``YAIE_SOLUTIONS`` not set at all): the student's function runs, and where it raises
``NotImplementedError`` (an untouched stub) that one function runs from the reference from then on, with
one notice line on stderr; every other function of the lesson stays the student's. Where a lesson's tasks
build one class together (lesson 03's ``KVCacheManager``; lesson 05's ``RadixAttentionWithPagedKVCache``,
``FlashInferPagedAttention``, ``CascadeAttention``), the class is the unit: a stubbed method sends the whole
class to the reference. Strict mode (``YAIE_SOLUTIONS`` set, even to ``none``): a stub raises
:class:`KernelMissing`, whose message names the lesson and function and says how to run the reference.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from types import ModuleType
from typing import Callable

from yaie import switch

# (lesson, module index, name) that auto mode runs from the reference in this process (after a stub raised).
_fallbacks: set[tuple[int, int, str]] = set()
_ran: set[tuple[int, int, str]] = set()        # every (lesson, module, name) called through here so far


class KernelMissing(RuntimeError):
    """A lesson function the engine needs is not implemented (and the reference may not be used)."""


def auto_mode() -> bool:
    """True when ``YAIE_SOLUTIONS`` is not set at all: unfinished functions fall back to the reference."""
    return os.environ.get(switch.ENV_VAR) is None


def student_path(lesson: int, which: int = 0) -> str:
    """The student's file of module ``which`` of ``lesson``, e.g. ``yaie/kernels/cpu_kernels.py``."""
    return "yaie/" + switch.LESSONS[lesson].modules[which].replace(".", "/") + ".py"


def reference_module(lesson: int, which: int = 0) -> ModuleType:
    """The reference solution's module ``which`` of ``lesson``; ``LessonUnavailable`` if this copy has none."""
    name = "solutions." + switch.LESSONS[lesson].modules[which]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise switch.LessonUnavailable(f"{switch.LESSONS[lesson].label}: the reference solution ({name}) "
                                       "is not in this copy of the course") from err


def lesson_module(lesson: int, which: int = 0) -> ModuleType:
    """The module the switch picks for ``lesson`` (the student's, or the reference's where the switch says
    so). ``which`` picks among a lesson's modules (``switch.LESSONS[lesson].modules``; lesson 05 has three).
    Auto mode's fallbacks are per function: :func:`serving_module` applies them."""
    if lesson in switch.LESSONS and not 0 <= which < len(switch.LESSONS[lesson].modules):
        raise ValueError(f"{switch.LESSONS[lesson].label} has modules 0-{len(switch.LESSONS[lesson].modules) - 1}, "
                         f"not {which}")
    return switch.module(lesson, which)


def lesson_available(lesson: int, which: int = 0, reference: bool = False) -> bool:
    """True when the module the switch picks for ``lesson`` (with ``reference``: the reference solution's)
    can be imported in this copy of the course."""
    try:
        reference_module(lesson, which) if reference else lesson_module(lesson, which)
    except switch.LessonUnavailable:
        return False
    return True


def serving_module(lesson: int, name: str, which: int = 0) -> ModuleType:
    """The module whose ``name`` runs now: the reference after auto mode fell back for ``name``, else the
    switch's module."""
    if auto_mode() and (lesson, which, name) in _fallbacks:
        return reference_module(lesson, which)
    return lesson_module(lesson, which)


def reference_only(lesson: int, name: str, stands_in_for: tuple[str, ...], which: int = 0):
    """The reference's ``name``, a kernel that is not an exercise (a fusion of lesson functions), or None.

    It may run only where the reference runs every lesson function in ``stands_in_for`` (non-empty), so a
    student's finished function is never skipped; None too where this copy has no reference.
    """
    if not stands_in_for:
        raise ValueError(f"reference_only({lesson}, {name!r}): name the lesson functions it stands in for")
    served = switch.uses_reference(lesson) or (
        auto_mode() and all((lesson, which, function) in _fallbacks for function in stands_in_for))
    if not served:
        return None
    try:
        return getattr(reference_module(lesson, which), name, None)
    except switch.LessonUnavailable:
        return None


def _missing_message(lesson: int, name: str, err: NotImplementedError, which: int) -> str:
    label = switch.LESSONS[lesson].label
    detail = f" ({err})" if str(err) else ""
    if not lesson_available(lesson, which, reference=True):     # a copy of the course without the reference
        return (f"{label}: {name} is not implemented yet in {student_path(lesson, which)}{detail}; implement it "
                f"(`pytest grader/lesson{lesson:02d}` checks it).")
    return (f"{label}: {name} is not implemented yet in {student_path(lesson, which)}{detail}.\n"
            f"Implement it (`pytest grader/lesson{lesson:02d}` checks it), or run the reference solution for "
            f"this lesson: YAIE_SOLUTIONS={lesson} in the environment, or `yaie generate --solutions {lesson}`; "
            f"unset YAIE_SOLUTIONS to let the engine use the reference wherever a function is unfinished.")


def fallback(lesson: int, name: str, module: ModuleType, err: NotImplementedError, which: int = 0) -> ModuleType:
    """The module to take ``name`` from after ``module.name`` raised ``NotImplementedError``.

    Auto mode: the reference, which serves ``name`` (a function, or a class as a unit) from then on; the
    first time, one notice line on stderr. Strict mode, a reference that raised, or a copy of the course
    without the reference: :class:`KernelMissing` naming the function.
    """
    if module.__name__.startswith("solutions.") or not auto_mode():
        raise KernelMissing(_missing_message(lesson, name, err, which)) from None
    label, path = switch.LESSONS[lesson].label, student_path(lesson, which)
    try:
        reference = reference_module(lesson, which)
    except switch.LessonUnavailable:
        raise KernelMissing(
            f"{label}: {name} is not implemented yet in {path}, and this copy of the course has no reference "
            f"solution to use instead: implement it (`pytest grader/lesson{lesson:02d}` checks it).") from None
    if (lesson, which, name) not in _fallbacks:
        _fallbacks.add((lesson, which, name))
        print(f"{label}: {name} is not implemented yet in {path}; using the reference for it",
              file=sys.stderr, flush=True)
    return reference


def run_with_fallback(lesson: int, which: int, name: str, use: Callable):
    """``use(attribute)`` with ``name`` of module ``which`` of ``lesson`` as it serves now.

    Where ``use`` raises ``NotImplementedError`` (a stubbed function, or a stubbed method of a class that is
    the unit), :func:`fallback` decides: ``use`` runs again on the reference's ``name``, or
    :class:`KernelMissing` is raised.
    """
    module = serving_module(lesson, name, which)
    if not hasattr(module, name):
        raise ValueError(f"{switch.LESSONS[lesson].label}: {module.__name__} has no {name!r}")
    try:
        result = use(getattr(module, name))
    except NotImplementedError as err:
        result = use(getattr(fallback(lesson, name, module, err, which), name))
    _ran.add((lesson, which, name))
    return result


def call_in(lesson: int, which: int, name: str, *args, **kwargs):
    """Call function ``name`` of module ``which`` of ``lesson`` (lesson 05: 0 radix tree, 1 prefix prefill,
    2 plan/run attention), falling back per function as the module docstring says."""
    return run_with_fallback(lesson, which, name, lambda function: function(*args, **kwargs))


def call(lesson: int, name: str, *args, **kwargs):
    """Call function ``name`` of ``lesson``'s first module (through :func:`call_in`)."""
    return call_in(lesson, 0, name, *args, **kwargs)


class LessonCalls:
    """Every function of a lesson's module, called through :func:`call_in`: ``LessonCalls(7).telescoping_step(...)``.

    Model code that uses many functions of one lesson (the telescoping and Based models) reaches them this
    way, so an unfinished stub falls back to the reference in auto mode (with one notice) or raises
    :class:`KernelMissing`, exactly as the engine's other lesson calls do. Other attributes (given classes
    such as lesson 08's ``BasedState``) come from the module that serves that name now.
    """

    def __init__(self, lesson: int, which: int = 0):
        self._lesson = lesson
        self._which = which

    def __getattr__(self, name: str):
        attr = getattr(serving_module(self._lesson, name, self._which), name)
        if not inspect.isfunction(attr):
            return attr
        return functools.partial(call_in, self._lesson, self._which, name)


def selection() -> tuple:
    """What decides which code runs right now: the switch's setting and auto mode's fallbacks so far.
    Equal values mean the same kernels (the engine's CUDA graphs are keyed by it)."""
    return os.environ.get(switch.ENV_VAR), frozenset(_fallbacks)


def describe() -> str:
    """One line saying what runs from the reference now (auto mode: each function it fell back for)."""
    if not auto_mode():
        return switch.describe()
    if not _fallbacks:
        return "auto mode: your code (yaie/), the reference only for functions that are still stubs"
    names = ", ".join(f"{switch.LESSONS[lesson].label} {name}" for lesson, _, name in sorted(_fallbacks))
    return f"auto mode: the reference for {names}; your code elsewhere"


def ran() -> str:
    """The lessons whose code ran so far, for a run summary (whose code it was, :func:`describe` says):
    ``"lessons run: 01, 03, 05"``."""
    lessons = sorted({lesson for lesson, _, _ in _ran})
    return "lessons run: " + (", ".join(f"{n:02d}" for n in lessons) if lessons else "none yet")


def reset_auto_fallback() -> None:
    """Forget auto mode's fallbacks and which lessons ran (tests; a notebook after finishing a task)."""
    _fallbacks.clear()
    _ran.clear()
