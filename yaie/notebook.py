"""Small helpers the lesson notebooks share."""

from __future__ import annotations

from typing import Callable


def try_it(check: Callable[[], object]):
    """Run an exercise check cell; an unfinished task prints one line instead of a traceback.

    The stub's ``NotImplementedError`` already names the lesson, the task and the file to edit.
    """
    try:
        return check()
    except NotImplementedError as err:
        print(f"not implemented yet: {err}")
        return None
