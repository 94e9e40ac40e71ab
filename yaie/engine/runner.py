"""What every runner shares (:class:`yaie.engine.paged_runner.PagedRunner`, :class:`yaie.engine.row_runner.RowRunner`):
one engine core holds it at a time, and its ``LLM`` keeps it between runs."""

from __future__ import annotations


class Runner:
    """Args:
        kept: whether the ``LLM`` keeps this runner for later runs; one made for a single run, while the kept
            one was held, closes when that run releases it.
    """

    def __init__(self, kept: bool = True):
        self.in_use = False
        self.kept = kept

    def acquire(self) -> None:
        self.in_use = True

    def release(self) -> None:
        """The run that held this runner ended; a runner that is not kept closes now."""
        self.in_use = False
        if not self.kept:
            self.close()

    def close(self) -> None:
        """Give back what the runner holds (its subclass says what)."""
