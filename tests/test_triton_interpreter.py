"""The Triton interpreter path that CPU-only machines (and CI) use for every Triton lesson."""

from __future__ import annotations

import os

import pytest
import torch

from yaie.device import has_cuda


@pytest.mark.skipif(has_cuda(), reason="this machine has a GPU; the interpreter is for CPU-only machines")
def test_triton_kernel_runs_in_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must switch the interpreter on first"
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x * alpha + y, mask=mask)

    n = 1000  # not a multiple of the block: the mask matters
    x, y = torch.randn(n), torch.randn(n)
    out = torch.full((n,), float("nan"))
    scaled_add[(triton.cdiv(n, 128),)](x, y, out, n, 0.5, BLOCK=128)
    torch.testing.assert_close(out, x.double().mul(0.5).add(y.double()).float())
