"""Lesson 04 beyond its grader: the split-K heuristic, every split count giving one answer, the merge kernel's
edge cases, and a CPU smoke run of the benchmark's input builder."""

from __future__ import annotations

import warnings

import pytest
import torch

from solutions.kernels import paged_attention as ref

with warnings.catch_warnings():   # the grader's task marks are registered by the grader's plugin only
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    from grader.lesson04.test_paged_attention import build_paged, ref_decode


@pytest.mark.parametrize("batch,kv_heads,ctx,sms,expected", [
    (32, 8, 4096, 132, 1),      # 256 programs already make about 2 per SM: no split
    (32, 4, 4096, 132, 2),      # 128 -> 256 programs
    (8, 4, 4096, 132, 8),       # 32 -> 256 (8.25 rounded down to a power of two)
    (128, 8, 4096, 132, 1),     # enough programs: no split
    (8, 8, 1024, 132, 2),       # capped by 512 tokens per split
    (1, 1, 100_000, 132, 64),   # capped by MAX_SPLITS
    (4, 2, 300, 132, 1),        # short context: no split
])
def test_split_heuristic(batch, kv_heads, ctx, sms, expected):
    splits = ref.choose_num_splits(batch, kv_heads, ctx, num_sms=sms)
    assert splits == expected
    assert splits & (splits - 1) == 0
    assert batch * kv_heads * splits <= max(batch * kv_heads, ref.PROGRAMS_PER_SM * sms)   # never a 2nd wave


def test_split_heuristic_counts_this_machines_multiprocessors_by_default():
    """Without ``num_sms`` the heuristic asks the device (8 for the CPU interpreter)."""
    import torch

    from yaie.kernels import paged_attention_given as given
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for batch, ctx in ((1, 4096), (4, 100_000)):
        assert given.choose_num_splits(batch, 8, ctx) == given.choose_num_splits(batch, 8, ctx,
                                                                                 num_sms=given.num_sms(device))


def test_every_split_count_gives_the_same_answer():
    case = ([45, 3, 20], 4, 2, 32, 8)
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, "cpu", seed=1234)
    expected = ref_decode(q, ks, vs)
    for splits in (1, 2, 5, 16, 64):     # 64 splits of a 45-token context: most splits are empty
        got = ref.paged_attention_forward(q, kc, vc, bt, cl, 45, num_splits=splits)
        torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


def test_zero_length_context_gives_zero_and_validate_can_be_off():
    case = ([0, 9], 2, 1, 16, 8)
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, "cpu", seed=7)
    for splits in (1, 3):
        got = ref.paged_attention_forward(q, kc, vc, bt, cl, 9, num_splits=splits, validate=False)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        torch.testing.assert_close(got.double(), ref_decode(q, ks, vs), atol=2e-5, rtol=1e-5)


def test_merge_with_one_split_is_the_identity():
    part = torch.randn(2, 3, 1, 16)
    lse = torch.randn(2, 3, 1)
    torch.testing.assert_close(ref.merge_split_results(part, lse), part[:, :, 0])


def test_reference_accepts_float64_but_the_kernel_does_not():
    case = ([5], 2, 2, 8, 8)
    q, kc, vc, bt, cl, _, _ = build_paged(case, torch.float64, "cpu", seed=3)
    ref.paged_attention_reference(q, kc, vc, bt, cl)
    with pytest.raises(ValueError):
        ref.paged_attention_forward(q, kc, vc, bt, cl, 5)


def test_bench_shapes_and_bytes():
    from yaie.bench import lesson04

    shapes = lesson04.shapes(quick=False)
    assert {kv for _, kv, _ in shapes} == {8, 4}
    assert min(c for _, _, c in shapes) == 1024 and max(c for _, _, c in shapes) == 32768
    assert lesson04.kv_bytes(1, 1, 1) == 2 * 128 * 2


def test_fused_merge_matches_the_merge_kernel_and_leaves_its_counters_at_zero():
    """The split merge fused into the decode kernel (the last split to finish merges) gives the answer of
    the separate merge kernel, on empty contexts and empty splits too, call after call: every call must
    put the counters it used back to 0, or the next call would merge too early or never."""
    case = ([0, 1, 37, 64, 5], 4, 2, 16, 8)
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, "cpu", seed=11)
    expected = ref_decode(q, ks, vs)
    scale = q.shape[-1] ** -0.5
    capacity = bt.shape[1] * kc.shape[1]         # max_context_len may be any bound up to what a row holds
    for splits, max_len in ((2, 64), (3, 64), (8, 64), (3, capacity), (8, capacity), (20, capacity)):   # 20: not unrolled
        separate = ref._launch_decode(q, kc, vc, bt, cl, max_len, scale, splits, fuse_merge=False)
        for _ in range(2):
            fused = ref._launch_decode(q, kc, vc, bt, cl, max_len, scale, splits)
            torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(fused.double(), expected, atol=2e-5, rtol=1e-5)
            assert int(ref._split_counters(q.device, q.shape[0] * kc.shape[2]).abs().sum()) == 0
