"""The course's own tests. The Triton interpreter must be chosen before anything imports triton."""

from yaie.device import prepare_triton

prepare_triton()


import pytest  # noqa: E402


@pytest.fixture
def reference_lessons(monkeypatch):
    """Engine tests run on the reference solutions, single-threaded, with auto mode's memory cleared."""
    from yaie import ops
    from yaie.model.testing import single_thread

    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    ops.reset_auto_fallback()
    with single_thread():
        yield
    ops.reset_auto_fallback()
