"""Variants of the lesson 02 kernels that the sweep (``python -m yaie.bench.lesson02 --sweep``) times
against the reference ones. Each tests one idea; the notes in ``bench/README.md`` say what came out.

* ``rms_norm_persistent``: a fixed grid of a few programs per SM, each looping over rows; the weight is
  loaded once per program instead of once per row, and no program is launched per row.
* ``rms_norm_evict_first``: the one-row-per-program kernel with streaming hints: x is read once and the
  output written once, so ask the cache to drop them first and keep the weight.
* ``silu_and_mul_rows``: the earlier 2-D grid ``(rows, column blocks)`` whose launch order walks down a
  column of blocks (row after row) rather than along memory.
* ``silu_and_mul_plain``: the flat row-major grid with the plain ``g / (1 + exp(-g))`` formula.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_persistent(x_ptr, w_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride, epsilon,
                        BLOCK_SIZE: tl.constexpr):
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        # (int32 offsets: fine for the sweep's shapes; the reference kernels use int64)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + epsilon)
        tl.store(out_ptr + row * out_row_stride + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_evict_first(x_ptr, w_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, epsilon,
                         BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + epsilon)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask,
             eviction_policy="evict_first")


@triton.jit
def silu_and_mul_rows(x_ptr, out_ptr, d, x_row_stride, out_row_stride, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(gate))
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(out_ptr + row * out_row_stride + cols, (gate * sigmoid * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_plain(x_ptr, out_ptr, d, x_row_stride, out_row_stride, n_col_blocks, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
