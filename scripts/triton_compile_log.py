"""A pytest plugin that times every Triton compile and says which test paid for it.

    python -m pytest grader/lesson05 --solutions -p scripts.triton_compile_log

At the end it prints the tests that spent the most time compiling, and the kernels compiled most often
(each with its distinct constexpr sets), so a slow GPU grader run shows which configurations to merge.
Set ``YAIE_COMPILE_LOG=path.json`` to also write every compile as JSON. GPU only in practice: the CPU
interpreter compiles nothing.
"""

from __future__ import annotations

import collections
import json
import os
import time

_events: list[dict] = []
_current = {"test": "(collection)"}


def _kernel_name(src) -> str:
    fn = getattr(src, "fn", None)
    return getattr(fn, "__name__", None) or getattr(fn, "name", None) or type(src).__name__


def _constexprs(src) -> str:
    values = getattr(src, "constants", None) or {}
    try:
        return ", ".join(f"{k}={v}" for k, v in sorted(values.items(), key=str) if not callable(v))[:300]
    except Exception:  # noqa: BLE001  (a log must never break the run it observes)
        return "?"


def _wrap(compile_fn):
    def timed_compile(src, *args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_fn(src, *args, **kwargs)
        finally:
            _events.append(dict(test=_current["test"], kernel=_kernel_name(src), constexprs=_constexprs(src),
                                seconds=time.perf_counter() - start))
    timed_compile.__wrapped__ = compile_fn
    return timed_compile


def pytest_configure(config):
    import triton.compiler
    import triton.compiler.compiler as compiler_module
    triton.compiler.compile = _wrap(triton.compiler.compile)
    compiler_module.compile = triton.compiler.compile


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    total = sum(e["seconds"] for e in _events)
    write(f"triton compiles: {len(_events)}, {total:.1f} s in all")
    per_test = collections.defaultdict(lambda: [0, 0.0])
    per_kernel = collections.defaultdict(lambda: [0, 0.0, set()])
    for e in _events:
        per_test[e["test"]][0] += 1
        per_test[e["test"]][1] += e["seconds"]
        entry = per_kernel[e["kernel"]]
        entry[0] += 1
        entry[1] += e["seconds"]
        entry[2].add(e["constexprs"])
    write("tests by compile time (compiles, seconds):")
    for test, (count, seconds) in sorted(per_test.items(), key=lambda kv: -kv[1][1])[:15]:
        write(f"  {seconds:7.1f} s {count:4d}  {test}")
    write("kernels by compile time (compiles, seconds, distinct constexpr sets):")
    for kernel, (count, seconds, sets) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:15]:
        write(f"  {seconds:7.1f} s {count:4d} {len(sets):4d}  {kernel}")
    path = os.environ.get("YAIE_COMPILE_LOG")
    if path:
        with open(path, "w") as f:
            json.dump(_events, f, indent=1)
