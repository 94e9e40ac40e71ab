"""Helpers every lesson's grader uses: task marks, random inputs, comparisons that teach.

A failed check raises :class:`GradingError` whose message says what was expected, what came back,
where, and a hint; the grader plugin (``grader/framework.py``) prints that message instead of a
traceback.
"""

from __future__ import annotations

import os
from typing import Callable

import pytest
import torch


class GradingError(AssertionError):
    """A check failed; the message is written for the student."""


def task(number: int, name: str, points: float = 1.0):
    """Mark a grader test as one check of task ``number`` (``name`` is the function the task is about).

    All tests of one task together decide it: the task passes when every one of its checks passes.
    ``pytest -k task2`` selects them.
    """
    return pytest.mark.yaie_task(number=number, name=name, points=points)


def fresh_seed() -> int:
    """A new random seed per test, unless ``YAIE_SEED`` fixes one (to replay a failure)."""
    fixed = os.environ.get("YAIE_SEED")
    return int(fixed) if fixed else int.from_bytes(os.urandom(4), "little") % (2**31)


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values times ``scale``, drawn in float32 on the CPU from ``seed`` (so the same
    seed gives the same numbers on any device), then cast and moved."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def poisoned(*shape: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor full of NaN (floats) or -1 (integers): whatever a kernel fails to write stands out."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing a kernel's output in ``dtype`` with a float64 reference."""
    return {
        torch.float64: (1e-10, 1e-10),
        torch.float32: (1e-5, 1e-5),
        torch.float16: (1e-2, 1e-3),
        torch.bfloat16: (1e-2, 1.6e-2),
    }[dtype]


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def describe(**tensors: torch.Tensor) -> str:
    """``q [2, 4, 8, 16] float16, k [...]``: a short description of a case for messages."""
    parts = []
    for name, t in tensors.items():
        strided = "" if t.is_contiguous() else " (non-contiguous)"
        parts.append(f"{name} {list(t.shape)} {str(t.dtype).replace('torch.', '')}{strided}")
    return ", ".join(parts)


def assert_close(got, expected: torch.Tensor, *, name: str, atol: float | None = None,
                 rtol: float | None = None, dtype: torch.dtype | None = None, case: str = "",
                 hint: str = "") -> None:
    """Check ``got`` against a (float64) reference and explain any difference.

    ``dtype``: the dtype ``got`` must have (default: not checked). ``atol``/``rtol`` default to
    :func:`tolerances` of ``got``'s dtype. An element passes when ``|got - expected| <= atol + rtol * |expected|``.
    """
    lines: list[str] = []
    context = [f"  case:     {case}"] if case else []
    hint_line = [f"  hint:     {hint}"] if hint else []

    def fail(*what: str) -> None:
        raise GradingError("\n".join([f"{name} is wrong", *context, *what, *hint_line]))

    if not isinstance(got, torch.Tensor):
        fail(f"  expected: a torch.Tensor of shape {list(expected.shape)}", f"  got:      {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        fail(f"  expected: shape {list(expected.shape)}", f"  got:      shape {list(got.shape)}")
    if dtype is not None and got.dtype != dtype:
        fail(f"  expected: dtype {dtype} (the input's dtype)", f"  got:      dtype {got.dtype}",
             "  (compute in float32 if you like, but cast the result back with .to(input.dtype))")
    if got.device.type != expected.device.type and expected.device.type != "cpu":
        fail(f"  expected: a tensor on {expected.device}", f"  got:      a tensor on {got.device}")
    if atol is None or rtol is None:
        default_atol, default_rtol = tolerances(got.dtype) if got.dtype.is_floating_point else (0.0, 0.0)
        atol = default_atol if atol is None else atol
        rtol = default_rtol if rtol is None else rtol

    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if got.numel() == 0:
        return
    nan = torch.isnan(g) & ~torch.isnan(e)
    if nan.any():
        first = _index(int(nan.flatten().nonzero()[0]), tuple(g.shape))
        fail(f"  got:      {int(nan.sum())} NaN values of {g.numel()}, the first at index {first}"
             f" (expected {_fmt(float(e[first]))})",
             "  (NaN often means an element was never written, a division by zero, or exp() overflow)")
    err = (g - e).abs()
    err = torch.where(torch.isnan(err) & torch.isnan(g) & torch.isnan(e), torch.zeros_like(err), err)
    err = torch.where(torch.isinf(g) & torch.isinf(e) & (g == e), torch.zeros_like(err), err)
    allowed = atol + rtol * e.abs()
    bad = err > allowed
    if bad.any():
        worst = int(torch.nan_to_num(err - allowed, nan=float("inf")).flatten().argmax())
        where = _index(worst, tuple(g.shape))
        lines = [
            f"  mismatch: {int(bad.sum())} of {g.numel()} elements differ by more than "
            f"atol={atol:g} + rtol={rtol:g} * |expected|",
            f"  worst at: index {where}: expected {_fmt(float(e[where]))}, got {_fmt(float(g[where]))}"
            f" (error {_fmt(float(err[where]))})",
            f"  largest error anywhere: {_fmt(float(torch.nan_to_num(err, nan=float('inf')).max()))}",
        ]
        fail(*lines)


def expect_value_error(fn: Callable, *args, what: str, **kwargs) -> None:
    """``fn(*args, **kwargs)`` must raise ``ValueError`` because of ``what`` (e.g. "weight of the wrong shape")."""
    try:
        fn(*args, **kwargs)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any other exception is the student's bug to see
        raise GradingError(
            f"bad input must raise ValueError\n  case:     {what}\n"
            f"  got:      {type(err).__name__}: {err}\n"
            "  hint:     check the inputs at the top of the function and raise ValueError with a message "
            "that says what is wrong") from None
    raise GradingError(
        f"bad input must raise ValueError\n  case:     {what}\n  got:      the call returned normally\n"
        "  hint:     a silent wrong answer is worse than an error: validate shapes, dtypes and devices first")


def assert_unchanged(before: torch.Tensor, after: torch.Tensor, name: str) -> None:
    """Inputs that the function must not modify."""
    if not torch.equal(before, after):
        raise GradingError(f"{name} was modified in place\n  hint:     work on a copy (x.float() makes one "
                           "for fp16/bf16 inputs but not for float32 ones!)")


def assert_correctly_rounded(got, exact: torch.Tensor, *, name: str, case: str = "", hint: str = "",
                             rel_margin: float = 1e-5, magnitude: torch.Tensor | None = None) -> None:
    """Bit-exact check: ``got`` must be ``exact`` (a float64 reference) rounded to ``got``'s dtype.

    For results the specification fixes down to the rounding (computed in float32 from given low-precision
    values, rounded once), where a tolerance would let a different rounding order through. Float32 math
    differs from float64 in its last bits, so where ``exact`` lies within ``rel_margin`` times its size (or
    times ``magnitude``, the size of the terms it sums, where they cancel) of the midpoint between two
    representable values, either neighbour passes; everywhere else the bits must match.
    """
    context = [f"  case:     {case}"] if case else []
    hint_line = [f"  hint:     {hint}"] if hint else []
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(exact.shape):
        raise GradingError("\n".join([f"{name} is wrong", *context, f"  expected: shape {list(exact.shape)}",
                                      f"  got:      {getattr(got, 'shape', type(got).__name__)}", *hint_line]))
    dtype = got.dtype
    e = exact.detach().to("cpu", torch.float64)
    g = got.detach().to("cpu")
    size = e.abs() if magnitude is None else torch.maximum(e.abs(), magnitude.detach().to("cpu", torch.float64))
    lo = (e - rel_margin * size).to(dtype).double()
    hi = (e + rel_margin * size).to(dtype).double()
    gd = g.double()
    bad = ~((gd >= lo) & (gd <= hi))
    if not bad.any():
        return
    want = e.to(dtype)
    first = _index(int(bad.flatten().nonzero()[0]), tuple(g.shape))
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4 else torch.int64
    ulps = (g.view(bits).long() - want.view(bits).long()).abs()
    raise GradingError("\n".join([
        f"{name} is not bit-exact", *context,
        f"  mismatch: {int(bad.sum())} of {g.numel()} elements are not the exact result rounded to "
        f"{str(dtype).replace('torch.', '')} (off by up to {int(ulps[bad].max())} in the last place)",
        f"  first at: index {first}: expected {_fmt(float(want[first]))} (exact {float(e[first]):.10g}), "
        f"got {_fmt(float(g[first]))}",
        "  (a tolerance cannot see this: the result is close, but not computed from the values the "
        "specification fixes)", *hint_line]))
