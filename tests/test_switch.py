"""The student/reference switch."""

from __future__ import annotations

import pytest

from yaie import switch


@pytest.mark.parametrize("spec,expected", [
    (None, set()), ("", set()), ("none", set()), ("0", set()),
    ("all", set(switch.LESSONS)), ("1", {1}), ("1,2,5", {1, 2, 5}), ("1-3,5", {1, 2, 3, 5}), (" 2 , 4 ", {2, 4}),
])
def test_parse_spec(spec, expected):
    assert switch.parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["one", "1-", "9", "0-2", "1;2"])
def test_parse_spec_rejects_nonsense(spec):
    with pytest.raises(ValueError, match="YAIE_SOLUTIONS"):
        switch.parse_spec(spec)


def test_module_follows_the_switch(monkeypatch):
    monkeypatch.delenv(switch.ENV_VAR, raising=False)
    assert switch.module(1).__name__ == "yaie.kernels.cpu_kernels"
    monkeypatch.setenv(switch.ENV_VAR, "1")
    assert switch.module(1).__name__ == "solutions.kernels.cpu_kernels"
    proxy = switch.LessonProxy(1)
    monkeypatch.setenv(switch.ENV_VAR, "none")
    with pytest.raises(NotImplementedError, match="lesson 01, task 3"):
        proxy.cpu_rms_norm(None, None)
    switch.use_solutions([1])
    assert proxy.cpu_rms_norm.__module__ == "solutions.kernels.cpu_kernels"
    with pytest.raises(ValueError):
        switch.use_solutions("bogus")
    assert switch.reference_lessons() == {1}, "a rejected spec must leave the switch as it was"


def test_missing_lesson_module_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(switch, "LESSONS", {**switch.LESSONS, 9: switch.Lesson(9, "x", ("kernels.nope",), "09_x")})
    monkeypatch.setenv(switch.ENV_VAR, "none")
    with pytest.raises(switch.LessonUnavailable, match="does not exist"):
        switch.module(9)
    with pytest.raises(ValueError, match="no lesson 42"):
        switch.module(42)
