"""Shared helpers of the course tests: run a grader in a subprocess and read its results.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(args: list[str], tmp_path: Path, env_extra: dict | None = None, timeout: float = 1200):
    """``python -m pytest ARGS --results-json tmp/results.json``; returns (process, results or None)."""
    results = tmp_path / "results.json"
    env = dict(os.environ)
    env.pop("YAIE_SOLUTIONS", None)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                           "--results-json", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    data = json.loads(results.read_text()) if results.exists() else None
    return proc, data


def check_results_schema(data: dict) -> None:
    """Gradescope's results.json: score, max_score, tests[name, score, max_score, status, output]."""
    assert isinstance(data, dict), data
    assert isinstance(data["score"], (int, float)) and isinstance(data["max_score"], (int, float))
    assert 0 <= data["score"] <= data["max_score"] + 1e-9
    assert isinstance(data["tests"], list) and data["tests"], "no tests in results.json"
    for test in data["tests"]:
        assert set(test) >= {"name", "score", "max_score", "status", "output"}, test
        assert isinstance(test["name"], str) and test["name"]
        assert test["status"] in ("passed", "failed"), test
        assert 0 <= test["score"] <= test["max_score"] + 1e-9, test
        assert isinstance(test["output"], str)
    assert abs(sum(t["score"] for t in data["tests"]) - data["score"]) < 1e-3


def fail_once(fn, message: str):
    """``fn`` wrapped to raise ``RuntimeError(message)`` at its first call and call through after; the
    arguments of every call are kept in ``.calls`` (a fault injected into one engine step)."""
    def wrapper(*args, **kwargs):
        wrapper.calls.append(args)
        if len(wrapper.calls) == 1:
            raise RuntimeError(message)
        return fn(*args, **kwargs)

    wrapper.calls = []
    return wrapper
