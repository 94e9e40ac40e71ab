"""Lesson 06's benchmark logic on a machine without a GPU: shapes, the SDPA backend names and the ratio lines.

Nothing is timed here (benchmarks never run in the test suite); rows carry made-up times.
"""

from __future__ import annotations

import pytest
import torch

from yaie.bench import lesson06
from yaie.bench.harness import Row


def test_shapes_keep_16k_tokens_per_batch_and_filter_head_dims():
    all_shapes = lesson06.shapes(False)
    assert len(all_shapes) == 6
    assert all(b * s == 16384 for b, _, s, _ in all_shapes)
    assert {d for *_, d in lesson06.shapes(False, (128,))} == {128}
    assert lesson06.shapes(True, (64,)) == [(4, 32, 4096, 64)]


def test_head_dims_from_env():
    assert lesson06.head_dims_from_env(None) == (128, 64)
    assert lesson06.head_dims_from_env("128") == (128,)
    assert lesson06.head_dims_from_env("64, 128") == (64, 128)
    for bad in ("96", "abc", ","):
        with pytest.raises(ValueError):
            lesson06.head_dims_from_env(bad)


def test_backend_names_follow_pytorchs_enum():
    from torch.nn.attention import SDPBackend

    assert lesson06.backend_name(int(SDPBackend.CUDNN_ATTENTION.value)) == "cudnn"
    assert lesson06.backend_name(int(SDPBackend.FLASH_ATTENTION.value)) == "flash"
    assert lesson06.backend_name(int(SDPBackend.EFFICIENT_ATTENTION.value)) == "efficient"
    assert lesson06.backend_name(99) == "backend 99"


def test_default_backend_is_read_and_confirmed_on_the_cpu():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, True))
    name = lesson06.sdpa_default_backend(q, k, v, True)
    # The name is PyTorch's choice, and forcing that backend reproduced the default's bits (no "?").
    assert name == lesson06.backend_name(choice)


def test_ratio_lines_compare_with_the_default():
    rows = [Row("lesson06", kernel, impl, "b1", "bf16", ms, flops=10 ** 12)
            for kernel in ("flash_attention_forward", "flash_attention_backward")
            for impl, ms in (("yaie triton", 1.0), ("torch SDPA default (cudnn)", 0.8), ("torch SDPA flash", 1.6))]
    lines = lesson06.ratio_lines(rows, lesson06.DEFAULT)
    assert len(lines) == 4
    assert "yaie triton" in lines[0] and "0.80x torch SDPA default (cudnn)" in lines[0]
    assert "torch SDPA flash" in lines[1] and "0.50x" in lines[1]
    assert lines[2].lstrip().startswith("backward")
    assert lesson06.ratio_lines(rows, "no such impl") == []


def test_best_configs_rank_by_total_time_and_drop_failures():
    a, b, c = (128, 128, 8, 2, False), (128, 64, 8, 3, True), (128, 64, 8, 4, False)
    rows = [
        {"config": a, "ms": 1.0, "status": "ok"}, {"config": a, "ms": 2.0, "status": "ok"},
        {"config": b, "ms": 0.5, "status": "ok"}, {"config": b, "ms": 1.0, "status": "ok"},
        {"config": c, "ms": 0.1, "status": "ok"}, {"config": c, "ms": None, "status": "error"},
        {"config": None, "ms": 0.01, "status": "ok"},          # a baseline row
    ]
    assert lesson06.best_configs(rows) == [b, a]
    assert lesson06.best_configs(rows, 1) == [b]
    assert lesson06.config_text(b) == "128,64,8,3,1"
