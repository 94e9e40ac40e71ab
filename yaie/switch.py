"""The switch: for each lesson, run the student's module (``yaie/...``) or the reference (``solutions/...``).

One mechanism serves the graders, the engine and the notebooks:

* the environment variable ``YAIE_SOLUTIONS``: unset, empty or ``none`` means "all mine";
  ``all`` means "all reference"; ``1,2,5`` or ``1-3,5`` picks lessons;
* the pytest option ``--solutions[=SPEC]`` of the graders, which sets that variable;
* :func:`use_solutions` for code (the engine's ``--solutions`` flag, a notebook cell).

Lesson modules are looked up on every call through :func:`module` or a :class:`LessonProxy`,
so a change of the switch, or a test's spy put on a module attribute, takes effect at once.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from types import ModuleType

ENV_VAR = "YAIE_SOLUTIONS"


@dataclass(frozen=True)
class Lesson:
    number: int
    title: str
    modules: tuple[str, ...]  # dotted names under ``yaie.`` and ``solutions.``
    notebook_dir: str          # folder under ``lessons/``

    @property
    def label(self) -> str:
        return f"lesson {self.number:02d}"


LESSONS: dict[int, Lesson] = {
    1: Lesson(1, "CPU kernels", ("kernels.cpu_kernels",), "01_cpu_kernels"),
    2: Lesson(2, "Triton RMSNorm, RoPE, SiLU-and-mul", ("kernels.gpu_elementwise",), "02_triton_elementwise"),
    3: Lesson(3, "Paged KV cache", ("kernels.kv_cache",), "03_paged_kv_cache"),
    4: Lesson(4, "Paged attention", ("kernels.paged_attention",), "04_paged_attention"),
    5: Lesson(5, "Radix prefix sharing, FlashInfer-style attention",
              ("kernels.radix_attention", "kernels.prefix_prefill", "kernels.flashinfer"), "05_radix_flashinfer"),
    6: Lesson(6, "FlashAttention", ("kernels.flash_attention",), "06_flash_attention"),
    7: Lesson(7, "Telescoping cache", ("kernels.telescoping",), "07_telescoping_cache"),
    8: Lesson(8, "Based linear attention", ("kernels.based",), "08_based_linear_attention"),
}


class LessonUnavailable(ImportError):
    """The lesson's module is not in this copy of the course (or the reference was removed)."""


def parse_spec(spec: str | None) -> frozenset[int]:
    """Parse a ``YAIE_SOLUTIONS`` value into the set of lessons that use the reference.

    ``None``, ``""``, ``"none"`` and ``"0"`` give the empty set; ``"all"`` gives every lesson;
    ``"1,2,5"`` and ``"1-3,5"`` pick lessons. Anything else raises ``ValueError``.
    """
    if spec is None:
        return frozenset()
    text = spec.strip().lower()
    if text in ("", "none", "0", "no", "false"):
        return frozenset()
    if text in ("all", "1-8", "yes", "true", "*"):
        return frozenset(LESSONS)
    chosen: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(
                f"{ENV_VAR}={spec!r}: cannot read {part!r}; use 'all', 'none', or lesson numbers "
                "such as '1,2,5' or '1-3'")
        lo = int(match.group(1))
        hi = int(match.group(2) or lo)
        for n in range(lo, hi + 1):
            if n not in LESSONS:
                raise ValueError(f"{ENV_VAR}={spec!r}: there is no lesson {n} (lessons are 1-{len(LESSONS)})")
            chosen.add(n)
    return frozenset(chosen)


def reference_lessons() -> frozenset[int]:
    """The lessons that currently run the reference solution."""
    return parse_spec(os.environ.get(ENV_VAR))


def use_solutions(spec: str | int | list[int] | None) -> None:
    """Set the switch from code: ``use_solutions("all")``, ``use_solutions([1, 2])``, ``use_solutions(None)``."""
    if spec is None:
        text = "none"
    elif isinstance(spec, int):
        text = str(spec)
    elif isinstance(spec, str):
        text = spec
    else:
        text = ",".join(str(int(n)) for n in spec)
    parse_spec(text)  # validate before changing anything
    os.environ[ENV_VAR] = text


def uses_reference(lesson: int) -> bool:
    return lesson in reference_lessons()


def module(lesson: int, which: int = 0) -> ModuleType:
    """The module that implements ``lesson`` now: the student's, or the reference if the switch says so.

    ``which`` picks among the lesson's modules (lesson 05 has three: the radix tree, the prefix-prefill
    kernel, the FlashInfer-style plan/run attention).
    """
    if lesson not in LESSONS:
        raise ValueError(f"there is no lesson {lesson} (lessons are 1-{len(LESSONS)})")
    info = LESSONS[lesson]
    package = "solutions" if uses_reference(lesson) else "yaie"
    name = f"{package}.{info.modules[which]}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and not name.startswith(err.name):
            raise  # a missing dependency inside the module, not the module itself
        if package == "solutions":
            raise LessonUnavailable(
                f"{info.label}: the reference solution ({name}) is not in this copy of the course; "
                f"unset {ENV_VAR} or leave lesson {lesson} out of it to run your own code") from err
        raise LessonUnavailable(f"{info.label}: module {name} does not exist yet") from err


class LessonProxy:
    """Attribute access that resolves through the switch on every call: ``L1 = LessonProxy(1); L1.cpu_rms_norm(x, w)``."""

    def __init__(self, lesson: int, which: int = 0):
        self._lesson = lesson
        self._which = which

    def __getattr__(self, name: str):
        return getattr(module(self._lesson, self._which), name)

    def __repr__(self) -> str:
        return f"<LessonProxy {LESSONS[self._lesson].label} -> {module(self._lesson, self._which).__name__}>"


def describe() -> str:
    """One line saying which lessons run the reference, for logs and the CLI."""
    ref = sorted(reference_lessons())
    if not ref:
        return "all lessons run your code (yaie/)"
    if len(ref) == len(LESSONS):
        return "all lessons run the reference solutions (solutions/)"
    return "reference solutions for lessons " + ",".join(map(str, ref)) + "; your code for the rest"
