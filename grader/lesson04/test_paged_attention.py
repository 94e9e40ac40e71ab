"""Grader of lesson 04: paged-attention decode (the gather reference, the Triton kernel, split-K, sliding windows).

The reference is written here, independently of the solution: each sequence's keys and values are
gathered token by token through its block table into contiguous float64 tensors, then attention is
computed one query head at a time (query head h reads KV head h // group).

Every case builds a cache whose unused rows are NaN: padding entries of the block tables, the slots
after a sequence's last token, and blocks nobody owns. A kernel that reads one token too far turns
its output into NaN and fails.

On a CPU the kernel runs in the Triton interpreter: small shapes, float32 and float16 (the
interpreter's bf16 tl.dot is broken). On a GPU: bf16 and fp16, long contexts, and the shapes of
real models.
"""

from __future__ import annotations

import math

import pytest
import torch

from grader.checks import GradingError, assert_close, expect_value_error, randn, task, tolerances
from grader.edges import around, tile
from yaie.switch import LessonProxy
from yaie.switch import module as lesson_module

L = LessonProxy(4)

# (lengths, num_heads, num_kv_heads, head_dim, block_size): variable lengths in one batch, off the block size.
CPU_CASES = [
    ([37, 5, 64], 4, 2, 64, 16),        # GQA 2:1
    ([1, 70], 8, 1, 96, 8),             # head_dim 96 (padded), multi-query, a 1-token context
    ([100, 33], 6, 3, 128, 32),         # head_dim 128
    ([130], 4, 4, 64, 128),             # block_size 128, no grouping
    ([17, 40, 9], 8, 2, 32, 8),
]
GPU_CASES = [
    ([1000, 3, 4096, 517], 32, 8, 128, 16),     # a Llama-8B-like layer, GQA 4:1
    ([2000, 2049], 32, 4, 128, 16),             # GQA 8:1
    ([777, 1500, 64], 12, 4, 96, 32),           # head_dim 96
    ([3000, 100], 16, 16, 64, 128),             # block_size 128
    ([513, 8], 8, 2, 128, 8),                   # block_size 8
]


def cases(device: str):
    return GPU_CASES if device == "cuda" else CPU_CASES


def case_text(case, dtype, num_splits=None) -> str:
    lens, h, hk, d, bs = case
    text = f"context_lens {lens}, heads {h}/{hk} kv, head_dim {d}, block_size {bs}, {str(dtype).replace('torch.', '')}"
    return text + (f", num_splits={num_splits}" if num_splits is not None else "")


def build_paged(case, dtype, device, seed, spare_blocks: int = 3):
    """A paged cache holding random K/V for each sequence in shuffled blocks; everything else is NaN.

    Returns (q, k_cache, v_cache, block_tables, context_lens, contiguous K list, contiguous V list).
    """
    lens, h, hk, d, bs = case
    batch = len(lens)
    per_seq = [math.ceil(n / bs) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.full((num_blocks, bs, hk, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    # Padding entries point at a spare (NaN) block: reading past a sequence's blocks shows up as NaN.
    spare = order[-1]
    tables = torch.full((batch, max(max(per_seq), 1) + 1), spare, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lens):
        k = randn(n, hk, d, dtype=dtype, device=device, seed=seed + 2 * b + 1)
        v = randn(n, hk, d, dtype=dtype, device=device, seed=seed + 2 * b + 2)
        ks.append(k)
        vs.append(v)
        for j in range(per_seq[b]):
            block = order.pop(0)
            tables[b, j] = block
            rows = slice(j * bs, min((j + 1) * bs, n))
            k_cache[block, : rows.stop - rows.start] = k[rows]
            v_cache[block, : rows.stop - rows.start] = v[rows]
    q = randn(batch, h, d, dtype=dtype, device=device, seed=seed)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables.to(device), context_lens, ks, vs


def ref_decode(q, ks, vs, scale=None) -> torch.Tensor:
    """float64 attention of each sequence's one query over its contiguous K/V, head by head."""
    batch, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(batch, h, d, dtype=torch.float64)
    for b in range(batch):
        k, v = ks[b].double().cpu(), vs[b].double().cpu()
        if k.shape[0] == 0:
            continue
        group = h // k.shape[1]
        for head in range(h):
            scores = k[:, head // group] @ q[b, head].double().cpu() * scale      # [n]
            weights = torch.softmax(scores, dim=0)
            out[b, head] = weights @ v[:, head // group]
    return out


def lowp_bound(out, exact, q, ks, vs, dtype) -> None:
    """fp16/bf16: the course tolerances, or twice the error of the same math done by PyTorch in dtype."""
    atol, rtol = tolerances(dtype)
    torch_err = 0.0
    for b in range(q.shape[0]):
        if ks[b].shape[0] == 0:
            continue
        k, v = ks[b].transpose(0, 1), vs[b].transpose(0, 1)                     # [hk, n, d]
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        s = (k @ q[b].unsqueeze(-1)).squeeze(-1) * q.shape[-1] ** -0.5       # in dtype
        lowp = (torch.softmax(s.float(), -1).to(dtype).unsqueeze(1) @ v).squeeze(1)
        torch_err = max(torch_err, float((lowp.double().cpu() - exact[b]).abs().max()))
    return max(atol, 2 * torch_err), rtol


# ================================================================ task 1: the reference

@task(1, "paged_attention_reference")
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_reference_matches_float64(seed, case_index):
    case = CPU_CASES[case_index]
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float64, "cpu", seed)
    got = L.paged_attention_reference(q, kc, vc, bt, cl)
    assert_close(got, ref_decode(q, ks, vs), name="paged_attention_reference", dtype=torch.float64,
                 case=case_text(case, torch.float64), atol=1e-10, rtol=1e-10,
                 hint="token t of sequence b is row t % block_size of block block_tables[b, t // block_size]; "
                      "stop at context_lens[b] (the rest of the cache is NaN)")


@task(1, "paged_attention_reference")
def test_reference_scale_and_empty_context(seed):
    case = ([0, 12], 4, 2, 16, 8)
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float64, "cpu", seed)
    got = L.paged_attention_reference(q, kc, vc, bt, cl, scale=0.3)
    assert_close(got, ref_decode(q, ks, vs, scale=0.3), name="paged_attention_reference with scale=0.3",
                 case=case_text(case, torch.float64), atol=1e-10, rtol=1e-10,
                 hint="a context of length 0 gives a zero output; scale multiplies the scores")


# ================================================================ task 2: the kernel (one split)

@task(2, "paged_attention_forward")
@pytest.mark.parametrize("case_index", range(5))
def test_forward_float32_matches_float64(device, seed, case_index):
    case = cases(device)[case_index]
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), num_splits=1)
    assert_close(got, ref_decode(q, ks, vs), name="paged_attention_forward output", dtype=torch.float32,
                 case=case_text(case, torch.float32, 1), atol=2e-5, rtol=1e-5,
                 hint="online softmax over the context tile by tile; mask tokens >= context_len (NaN otherwise); "
                      "mask head dims >= head_dim when padding to a power of two")


@task(2, "paged_attention_forward")
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_forward_low_precision(device, seed, dtype, case_index):
    case = cases(device)[case_index]
    q, kc, vc, bt, cl, ks, vs = build_paged(case, dtype, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), num_splits=1)
    exact = ref_decode(q, ks, vs)
    atol, rtol = lowp_bound(got, exact, q, ks, vs, dtype)
    assert_close(got, exact, name="paged_attention_forward output", dtype=dtype, case=case_text(case, dtype, 1),
                 atol=atol, rtol=rtol, hint="accumulate scores, the running max/sum and the output in float32")


@task(2, "paged_attention_forward")
def test_forward_strided_q_and_scale(device, seed):
    case = cases(device)[0]
    _, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, device, seed)
    batch, h, d = len(case[0]), case[1], case[3]
    wide = randn(batch, 2 * h, d, device=device, seed=seed + 99)
    q = wide[:, ::2]          # every other head: a non-contiguous q
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), scale=0.05, num_splits=1)
    assert_close(got, ref_decode(q, ks, vs, scale=0.05), name="paged_attention_forward (strided q, scale 0.05)",
                 case=case_text(case, torch.float32, 1), atol=2e-5, rtol=1e-5,
                 hint="use q.stride() rather than assuming a contiguous q; apply the given scale")


@task(2, "paged_attention_forward")
def test_forward_bad_input(device, seed):
    case = ([9, 4], 4, 2, 16, 8)
    q, kc, vc, bt, cl, _, _ = build_paged(case, torch.float32, device, seed)
    f = L.paged_attention_forward
    expect_value_error(f, q[0], kc, vc, bt, cl, 9, what="q without a batch axis")
    expect_value_error(f, q.half(), kc, vc, bt, cl, 9, what="q and the cache in different dtypes")
    expect_value_error(f, q[:, :3], kc, vc, bt, cl, 9, what="3 query heads over 2 KV heads")
    expect_value_error(f, q, kc, vc[:, :, :1], bt, cl, 9, what="k_cache and v_cache of different shapes")
    expect_value_error(f, q, kc, vc, bt.long(), cl, 9, what="int64 block tables")
    expect_value_error(f, q, kc, vc, bt, cl[:1], 9, what="context_lens of the wrong length")
    expect_value_error(f, q, kc, vc, bt, cl, 5, what="context_lens larger than max_context_len")
    expect_value_error(f, q, kc, vc, bt, cl, 10_000, what="max_context_len beyond the block table's capacity")
    bad_table = bt.clone()
    bad_table[0, 0] = kc.shape[0] + 5
    expect_value_error(f, q, kc, vc, bad_table, cl, 9, what="a block id outside the cache")
    expect_value_error(f, q, kc, vc, bt, cl, 9, num_splits=0, what="num_splits=0")


# ================================================================ task 3: split-K

def ref_merge(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """float64: weights exp(lse_i - logsumexp(lse)), ignoring splits with lse = -inf."""
    o, lse = part_out.double().cpu(), part_lse.double().cpu()
    total = torch.logsumexp(lse, dim=-1, keepdim=True)                      # -inf when every split is empty
    weights = torch.where(torch.isinf(total), torch.zeros_like(lse), torch.exp(lse - total))
    o = torch.where(weights[..., None] > 0, o, torch.zeros_like(o))         # an empty split may hold NaN
    return (weights[..., None] * o).sum(-2)


@task(3, "merge_split_results")
def test_merge_matches_float64(device, seed):
    batch, heads, splits, d = 3, 4, 5, 48
    part_out = randn(batch, heads, splits, d, device=device, seed=seed)
    part_lse = randn(batch, heads, splits, device=device, seed=seed + 1, scale=4.0)
    part_lse[0, 1, 2] = float("-inf")        # an empty split...
    part_out[0, 1, 2] = float("nan")         # ...whose output was never written
    part_lse[2, 3, :] = float("-inf")        # a row with no keys at all
    got = L.merge_split_results(part_out, part_lse)
    assert_close(got, ref_merge(part_out, part_lse), name="merge_split_results", atol=1e-5, rtol=1e-5,
                 case=f"part_out [{batch}, {heads}, {splits}, {d}], lse scale 4, some splits empty",
                 hint="out = sum_i exp(lse_i - lse) o_i with lse = logsumexp(lse_i); subtract the max before exp; "
                      "an empty split (lse -inf) weighs 0 even if its o_i is NaN; no keys at all -> 0")
    half = L.merge_split_results(part_out, part_lse, out_dtype=torch.float16)
    if half.dtype != torch.float16:
        raise GradingError(f"merge_split_results(out_dtype=float16) returned {half.dtype}")
    expect_value_error(L.merge_split_results, part_out, part_lse[:, :, :2], what="lse with fewer splits than outputs")


@task(3, "merge_split_results")
@pytest.mark.parametrize("num_splits", [2, 3, 7, None])
def test_split_k_forward_matches_float64(device, seed, num_splits):
    case = cases(device)[2 if device == "cpu" else 0]
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), num_splits=num_splits)
    assert_close(got, ref_decode(q, ks, vs), name="paged_attention_forward output with split-K",
                 dtype=torch.float32, case=case_text(case, torch.float32, num_splits), atol=2e-5, rtol=1e-5,
                 hint="each split handles its own range of the context and writes o_i (normalised) and lse_i; "
                      "a split beyond a short context is empty (lse -inf)")


@task(3, "merge_split_results")
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp16", "bf16"])
def test_split_k_low_precision(device, seed, dtype):
    case = cases(device)[1]
    q, kc, vc, bt, cl, ks, vs = build_paged(case, dtype, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), num_splits=4)
    exact = ref_decode(q, ks, vs)
    atol, rtol = lowp_bound(got, exact, q, ks, vs, dtype)
    assert_close(got, exact, name="paged_attention_forward output with 4 splits", dtype=dtype,
                 case=case_text(case, dtype, 4), atol=atol, rtol=rtol,
                 hint="keep the partial outputs and lse in float32; cast once at the end")


def tile_n(device: str, head_dim: int) -> int:
    """Keys per tile of the decode kernel (the module's ``_decode_config``, as the reference has it)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return tile(4, 0, lambda m: m._decode_config(block_d, 4, 1, 8)["TILE_N"], 64 if device == "cuda" else 16)


EDGE_HINT = ("a context that fills its last tile (or block) exactly has no partial tile: the loop must stop "
             "there, not run one tile more (those rows are NaN) or one less")


@task(3, "merge_split_results")
@pytest.mark.parametrize("num_splits", [1, 2, None])
def test_contexts_on_tile_edges(device, seed, num_splits):
    """Contexts of exactly 1 and 2 tiles of keys, one key less and one more; 2 splits cut them on a tile edge."""
    tn = tile_n(device, 32)
    lens = around(tn, 2 * tn)
    case = (lens, 4, 2, 32, tn)
    q, kc, vc, bt, cl, ks, vs = build_paged(case, torch.float32, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(lens), num_splits=num_splits)
    assert_close(got, ref_decode(q, ks, vs), name="paged_attention_forward output (contexts on tile edges)",
                 dtype=torch.float32, case=case_text(case, torch.float32, num_splits) + f"; tiles of {tn} keys",
                 atol=2e-5, rtol=1e-5, hint=EDGE_HINT)


def small_split_heuristic(monkeypatch):
    """Make the module's split heuristic split at CPU shapes (it wants 512 keys a split: CPU contexts never
    split); returns the split counts it chose."""
    mod = lesson_module(4)
    real = mod.choose_num_splits
    chosen: list[int] = []

    def small(batch, num_kv_heads, max_context_len, num_sms=None, min_tokens_per_split=512):
        splits = real(batch, num_kv_heads, max_context_len, num_sms, min_tokens_per_split=8)
        chosen.append(splits)
        return splits

    monkeypatch.setattr(mod, "choose_num_splits", small)
    return chosen


@task(3, "merge_split_results")
@pytest.mark.parametrize("window", [None, 40], ids=["whole context", "window 40"])
def test_split_k_by_the_heuristic(device, seed, window, monkeypatch):
    """num_splits=None splitting, as on a GPU: the heuristic forced to split at CPU shapes."""
    chosen = small_split_heuristic(monkeypatch)
    case = cases(device)[0]
    q, kc, vc, bt, cl, ks, vs = (build_paged(case, torch.float32, device, seed) if window is None
                                 else build_windowed(case, window, torch.float32, device, seed))
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), sliding_window=window)
    if not chosen:
        raise GradingError("paged_attention_forward(num_splits=None) never called choose_num_splits\n"
                           f"  case:     {case_text(case, torch.float32)}\n"
                           "  hint:     with num_splits None, ask choose_num_splits(batch, num_kv_heads, span, "
                           "num_sms) (span: the window when there is one, else max_context_len)")
    assert_close(got, ref_decode(q, ks, vs), name=f"paged_attention_forward with {chosen[-1]} splits (chosen)",
                 dtype=torch.float32, case=case_text(case, torch.float32, chosen[-1])
                 + (f", sliding_window={window}" if window else ""), atol=2e-5, rtol=1e-5,
                 hint="each split handles its own range (of the window's keys, with a window) and writes o_i and "
                      "lse_i; a split beyond a short context is empty (lse -inf)")


# ================================================================ task 4: sliding windows

# (case, window): windows that start inside a block and a tile, cover a whole short context, or hold one token.
CPU_WINDOW_CASES = [
    (CPU_CASES[0], 20),     # contexts 37, 5, 64: windows from 17, from 0 (shorter than the window), from 44
    (CPU_CASES[2], 48),     # block_size 32: the window starts mid-block
    (CPU_CASES[1], 1),      # only the newest token: the output is its V
]
# On a GPU every window case has the heads, head_dim and block size of the first (a Llama-8B-like layer): each
# distinct set of them is a Triton compile of its own for every split count, and what a window case checks is
# where its window starts, which the lengths decide (head_dim 96, GQA 8:1 and other block sizes are checked
# without a window above, and with one on the CPU).
GPU_WINDOW_CASES = [
    (GPU_CASES[0], 1000),                               # contexts 3..4096
    (([2000, 2049], 32, 8, 128, 16), 4096),             # contexts 2000 and 2049 inside a Mistral-sized window
    (([777, 1500, 64], 32, 8, 128, 16), 100),           # a short window: whole blocks of every context skipped
]


def window_cases(device: str):
    return GPU_WINDOW_CASES if device == "cuda" else CPU_WINDOW_CASES


def build_windowed(case, window, dtype, device, seed):
    """``build_paged``, then every cache row before a sequence's window set to NaN (a kernel must never read
    it), and the K/V lists cut to what the newest token sees."""
    q, kc, vc, bt, cl, ks, vs = build_paged(case, dtype, device, seed)
    bs = case[4]
    for b, n in enumerate(case[0]):
        for t in range(max(0, n - window)):
            block = int(bt[b, t // bs])
            kc[block, t % bs] = float("nan")
            vc[block, t % bs] = float("nan")
    seen_k = [k[max(0, k.shape[0] - window):] for k in ks]
    seen_v = [v[max(0, v.shape[0] - window):] for v in vs]
    return q, kc, vc, bt, cl, seen_k, seen_v


WINDOW_HINT = ("the newest token of a sequence of n tokens sees positions max(0, n - window) .. n - 1; start each "
               "sequence's loop (and its split ranges) there, and never load the rows before it (they are NaN)")


@task(4, "sliding window")
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_window_reference_matches_float64(seed, case_index):
    case, window = CPU_WINDOW_CASES[case_index]
    q, kc, vc, bt, cl, ks, vs = build_windowed(case, window, torch.float64, "cpu", seed)
    got = L.paged_attention_reference(q, kc, vc, bt, cl, sliding_window=window)
    assert_close(got, ref_decode(q, ks, vs), name=f"paged_attention_reference(sliding_window={window})",
                 dtype=torch.float64, case=case_text(case, torch.float64), atol=1e-10, rtol=1e-10, hint=WINDOW_HINT)


@task(4, "sliding window")
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_window_forward_matches_float64(device, seed, case_index, num_splits):
    case, window = window_cases(device)[case_index]
    q, kc, vc, bt, cl, ks, vs = build_windowed(case, window, torch.float32, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), num_splits=num_splits, sliding_window=window)
    assert_close(got, ref_decode(q, ks, vs), name=f"paged_attention_forward(sliding_window={window})",
                 dtype=torch.float32, case=case_text(case, torch.float32, num_splits), atol=2e-5, rtol=1e-5,
                 hint=WINDOW_HINT + "; with splits, split the window's tokens, not the whole context")


@task(4, "sliding window")
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp16", "bf16"])
def test_window_forward_low_precision(device, seed, dtype):
    case, window = window_cases(device)[0]
    q, kc, vc, bt, cl, ks, vs = build_windowed(case, window, dtype, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(case[0]), sliding_window=window)
    exact = ref_decode(q, ks, vs)
    atol, rtol = lowp_bound(got, exact, q, ks, vs, dtype)
    assert_close(got, exact, name=f"paged_attention_forward(sliding_window={window})", dtype=dtype,
                 case=case_text(case, dtype), atol=atol, rtol=rtol, hint=WINDOW_HINT)


@task(4, "sliding window")
@pytest.mark.parametrize("num_splits", [1, 2, None])
def test_window_starts_on_a_tile_edge(device, seed, num_splits):
    """A window of 2 tiles: its first key falls exactly on a tile (and block) edge, one key before or after
    it, at 0, or before the context's start."""
    tn = tile_n(device, 32)
    window = 2 * tn
    lens = [3 * tn, 4 * tn, 3 * tn + 1, 3 * tn - 1, 2 * tn, tn]       # first visible keys tn, 2tn, tn+1, tn-1, 0, 0
    case = (lens, 4, 2, 32, tn)
    q, kc, vc, bt, cl, ks, vs = build_windowed(case, window, torch.float32, device, seed)
    got = L.paged_attention_forward(q, kc, vc, bt, cl, max(lens), num_splits=num_splits, sliding_window=window)
    assert_close(got, ref_decode(q, ks, vs), name=f"paged_attention_forward(sliding_window={window})",
                 dtype=torch.float32, case=case_text(case, torch.float32, num_splits)
                 + f"; tiles of {tn} keys, first visible keys {[max(0, n - window) for n in lens]}",
                 atol=2e-5, rtol=1e-5,
                 hint=WINDOW_HINT + "; when the first visible key is a tile's first key, start at that tile "
                      "(the tile before it is all NaN) and mask nothing in it")


@task(4, "sliding window")
def test_window_bad_input(device, seed):
    case = ([9, 4], 4, 2, 16, 8)
    q, kc, vc, bt, cl, _, _ = build_paged(case, torch.float32, device, seed)
    for bad in (0, -3, 2.5, True):
        expect_value_error(L.paged_attention_forward, q, kc, vc, bt, cl, 9, sliding_window=bad,
                           what=f"sliding_window={bad!r}")
    expect_value_error(L.paged_attention_reference, q.cpu().double(), kc.cpu().double(), vc.cpu().double(),
                       bt.cpu(), cl.cpu(), sliding_window=0, what="sliding_window=0 (reference)")
