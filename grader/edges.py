"""Cases on the edges of a kernel's tiles: sizes read from the kernel, so the cases follow it.

A kernel cuts its work into tiles (``BLOCK_N`` keys, a chunk of tokens, a segment); the bugs that
survive random lengths sit where a length or a window edge falls exactly on a tile edge (an empty last
tile, a state stored one tile past the end, a first tile skipped). :func:`tile` reads the size from the
module under test when it defines it, else from the reference in ``solutions/`` (absent in the students'
copy), else takes the given default; :func:`around` gives the lengths just before, on and after edges.
"""

from __future__ import annotations

import importlib
from typing import Callable

from yaie.switch import LESSONS
from yaie.switch import module as lesson_module


def tile(lesson: int, which: int, read: Callable, default: int) -> int:
    """``read(module)`` of the module under test, else of the reference module, else ``default``."""
    candidates = []
    try:
        candidates.append(lesson_module(lesson, which))
    except Exception:  # noqa: BLE001 - a module that does not import is reported by the checks themselves
        pass
    try:
        candidates.append(importlib.import_module(f"solutions.{LESSONS[lesson].modules[which]}"))
    except ImportError:
        pass
    for mod in candidates:
        try:
            value = read(mod)
        except Exception:  # noqa: BLE001 - the module does not have it (a student's own kernel)
            continue
        if isinstance(value, int) and value > 0:
            return value
    return default


def around(*sizes: int) -> list[int]:
    """Lengths just before, on and just after each size (positive, sorted, without repeats)."""
    return sorted({n for s in sizes for n in (s - 1, s, s + 1) if n > 0})
