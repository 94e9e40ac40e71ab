"""Small helpers the lesson notebooks share."""

from __future__ import annotations

from typing import Callable


def try_it(check: Callable[[], object]):
    """Run an exercise check cell; an unfinished task prints one line instead of a traceback.

    The stub's ``NotImplementedError`` already names the lesson, the task and the file to edit; a demo
    that needs another lesson's unfinished code (an earlier lesson, or a later task it previews) says which
    (``KernelMissing``), in one line too.
    """
    from yaie.ops import KernelMissing
    from yaie.switch import LessonUnavailable

    try:
        return check()
    except NotImplementedError as err:
        print(f"not implemented yet: {err}")
    except (KernelMissing, LessonUnavailable) as err:
        print(f"needs code that is not written yet: {str(err).splitlines()[0]}")
    return None
