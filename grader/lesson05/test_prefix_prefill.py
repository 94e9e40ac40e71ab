"""Grader of lesson 05, part 1: prefix prefill (task 3 the gather reference, task 4 the Triton kernel).

The reference is written here, independently of the solution: for every sequence, its cached keys and
values are read token by token through its block table into contiguous float64 tensors, the new tokens'
keys and values are appended, and attention is computed one query head at a time, with the causal rule
(query ``i`` sits at position ``context_len + i``), the optional window and the optional sink logit.

Every case builds a cache whose unused rows are NaN: blocks nobody owns, the padding entries of the block
tables (they point at a NaN block), the slots of a sequence's last block after its prefix (where an engine
writes the new tokens: the kernel takes those from ``k`` and ``v``), and, with a window, every cached row
that no new token sees. A kernel that reads one row it should not turns its output into NaN.

Batches are ragged: one new token (a decode step), a few, many; prefixes of 0 tokens and of many blocks.
On a CPU the kernel runs in the Triton interpreter: small shapes, float32 everywhere and float16 (the
interpreter's bf16 tl.dot is broken; fp8 caches with float16 q). On a GPU: bf16 (the engine's dtype), fp8
caches with bf16 and float16 q, float32 in one check, and the shapes of real models (see ``GPU_CASES`` for
why they all share one head size and block size). The float64 reference runs on the batch's device.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from grader.checks import GradingError, assert_close, expect_value_error, poisoned, randn, task, tolerances
from grader.edges import tile
from yaie.switch import LessonProxy

L = LessonProxy(5, 1)
# The reference kernel autotunes its tiles on a GPU (a few compiles per shape): too slow for a grader with many
# shapes and dtypes. Here it runs its fixed tiles; the benchmark checks every tuned choice against SDPA.
os.environ.setdefault("YAIE_PP_AUTOTUNE", "0")

# (context_lens, new tokens, num_heads, num_kv_heads, head_dim, block_size)
CPU_CASES = [
    ([0, 37, 21], [19, 1, 33], 4, 2, 32, 8),       # no prefix; a decode-length query; GQA 2:1
    ([50, 9], [12, 24], 4, 1, 80, 16),             # head_dim 80 (padded), multi-query
    ([70, 16, 5], [25, 3, 40], 2, 2, 96, 8),       # head_dim 96, a prefix of many blocks
]
# Why the GPU cases are what they are: on a GPU each distinct set of the kernel's constexprs (head_dim,
# block_size, the tiles max_query_len picks, dtype, window or not, sinks, fp8, skip_decode, the K layout) and
# of its int specialisations (Triton compiles an int argument that is 1, or divisible by 16, apart: the
# window, the GQA group, every stride) is a compile of several seconds; a run takes microseconds. So every GPU
# check of this file shares compiled variants: head_dim 64 (Llama-3.2-1B, gpt-oss), block_size 16, a longest
# query of 65..1023 new tokens (the 128 x 32 tiles of a prefill of a few hundred tokens), GQA groups other
# than 1 and 16, bf16 (the engine's dtype; the interpreter checks float32 everywhere). Each check then adds
# only what its point needs (a window, sinks, an fp8 cache, skip_decode with the vector K layout) and the later
# checks find the rest compiled. Lengths and head counts are free but for two strides: the total of new tokens
# (the lse's row stride) is never a multiple of 16 here, nor is a block table's width (Batch pads it). Head
# sizes 80 and 96 (padded) are the CPU cases'; on a GPU the float32 check pads one.
GPU_CASES = [
    ([0, 1000, 2047, 333], [700, 1, 300, 129], 32, 8, 64, 16),    # a Llama-3.2-1B-like layer, GQA 4:1
    ([4096, 17], [1, 1000], 16, 2, 64, 16),                        # a long prefix, GQA 8:1
    ([600, 1500, 64], [513, 77, 256], 12, 4, 64, 16),             # GQA 3:1
]
# float32 on a GPU: its exact ("ieee") dot products compile into FMA loops whose size grows with the head
# size (17 s at 128, 3 s at 8), so the float32 check runs the GPU batches at head_dim 8: padded to 16 inside
# (the GPU's one check of the padding), one compiled variant for the three.
GPU_FLOAT32_HEAD_DIM = 8
# (case index, window): windows that start inside the prefix, inside the new tokens, or hold one token. On a
# GPU the windows divisible by 16 and the others are two int specialisations: the tile-edge check needs one
# of each (a tile of 32 keys and 33), so these use nothing else.
CPU_WINDOWS = [(0, 10), (2, 30), (1, 1)]
GPU_WINDOWS = [(0, 512), (1, 4096), (2, 100)]


def cases(device: str):
    return GPU_CASES if device == "cuda" else CPU_CASES


def windows(device: str):
    return GPU_WINDOWS if device == "cuda" else CPU_WINDOWS


def logic_dtype(device: str) -> torch.dtype:
    """The dtype of the checks of the kernel's logic: float32 in the interpreter (exact), bf16 on a GPU (the
    engine's dtype: one compiled variant; the float32 path has a check of its own)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def half_dtype(device: str) -> torch.dtype:
    """A 16-bit dtype: float16 in the interpreter (its bf16 tl.dot is broken), bf16 on a GPU."""
    return torch.bfloat16 if device == "cuda" else torch.float16


def case_text(case, dtype, **extra) -> str:
    ctx, new, h, hk, d, bs = case
    text = (f"context_lens {ctx}, new tokens {new}, heads {h}/{hk} kv, head_dim {d}, block_size {bs}, "
            f"{str(dtype).replace('torch.', '')}")
    return text + "".join(f", {k}={v}" for k, v in extra.items() if v is not None)


class Batch:
    """One ragged batch: the packed new tokens, a paged cache holding each prefix, and the contiguous
    float64 copies the reference uses."""

    def __init__(self, case, dtype, device, seed, window=None, cache_dtype=None, spare_blocks=3):
        ctx, new, h, hk, d, bs = case
        self.case, self.window = case, window
        cache_dtype = cache_dtype or dtype
        # Each sequence owns the blocks of its prefix AND of its new tokens (an engine allocates them
        # before the step); only the prefix rows hold data, the rest stays NaN.
        per_seq = [math.ceil((c + n) / bs) for c, n in zip(ctx, new)]
        num_blocks = sum(per_seq) + spare_blocks
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        spare = order[-1]
        # Padding entries after each row's blocks; a width that is never a multiple of 16 keeps the table's
        # row stride (an int argument) on one compiled variant on a GPU.
        width = max(per_seq) + 1
        if width % 16 == 0:
            width += 1
        tables = torch.full((len(ctx), width), spare, dtype=torch.int32)
        k_cache = torch.full((num_blocks, bs, hk, d), float("nan"), dtype=torch.float64)
        v_cache = torch.full_like(k_cache, float("nan"))
        self.prefix_k, self.prefix_v = [], []
        for b, c in enumerate(ctx):
            for j in range(per_seq[b]):
                tables[b, j] = order.pop(0)
            pk = randn(c, hk, d, dtype=torch.float64, seed=seed + 3 * b + 1)
            pv = randn(c, hk, d, dtype=torch.float64, seed=seed + 3 * b + 2)
            if cache_dtype in (torch.float8_e4m3fn,):
                # fp8: the cache stores value / scale; the reference uses exactly what the cache holds.
                pk = (pk / self.K_SCALE).to(cache_dtype).to(torch.float64) * self.K_SCALE
                pv = (pv / self.V_SCALE).to(cache_dtype).to(torch.float64) * self.V_SCALE
            else:
                pk, pv = pk.to(cache_dtype).to(torch.float64), pv.to(cache_dtype).to(torch.float64)
            self.prefix_k.append(pk)
            self.prefix_v.append(pv)
            first_seen = 0 if window is None else max(0, c - window + 1)   # rows before it: never seen
            t = torch.arange(first_seen, c)
            blocks, rows = tables[b, t // bs].long(), t % bs
            k_cache[blocks, rows], v_cache[blocks, rows] = pk[first_seen:], pv[first_seen:]
        if cache_dtype in (torch.float8_e4m3fn,):
            self.k_cache = (k_cache / self.K_SCALE).to(cache_dtype).to(device)
            self.v_cache = (v_cache / self.V_SCALE).to(cache_dtype).to(device)
        else:
            self.k_cache, self.v_cache = k_cache.to(cache_dtype).to(device), v_cache.to(cache_dtype).to(device)
        total = sum(new)
        self.q = randn(total, h, d, dtype=dtype, device=device, seed=seed + 1000)
        self.k = randn(total, hk, d, dtype=dtype, device=device, seed=seed + 1001)
        self.v = randn(total, hk, d, dtype=dtype, device=device, seed=seed + 1002)
        self.block_tables = tables.to(device)
        self.cu_seqlens_q = torch.tensor([0] + [sum(new[:i + 1]) for i in range(len(new))], dtype=torch.int32,
                                         device=device)
        self.context_lens = torch.tensor(ctx, dtype=torch.int32, device=device)
        self.max_query_len = max(new)

    K_SCALE, V_SCALE = 0.05, 0.03

    def args(self):
        return (self.q, self.k, self.v, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q,
                self.context_lens)

    def reference(self, scale=None, sinks=None):
        """float64 (out [total, heads, d], lse [heads, total]) on the CPU, one sequence at a time: its prefix
        and new keys side by side, every query's visible keys picked by position. Computed on the batch's
        device (float64 on a CPU takes seconds at the GPU cases' sizes)."""
        ctx, new, h, hk, d, bs = self.case
        scale = d ** -0.5 if scale is None else scale
        dev = self.q.device
        q, k, v = (t.detach().double() for t in (self.q, self.k, self.v))
        kv_of_head = torch.arange(h, device=dev) // (h // hk)              # query head -> its KV head
        out = torch.zeros(q.shape, dtype=torch.float64, device=dev)
        lse = torch.zeros(h, q.shape[0], dtype=torch.float64, device=dev)
        start = 0
        for b, (c, n) in enumerate(zip(ctx, new)):
            if n == 0:
                continue
            keys = torch.cat([self.prefix_k[b].to(dev), k[start:start + n]])[:, kv_of_head]     # [c + n, h, d]
            values = torch.cat([self.prefix_v[b].to(dev), v[start:start + n]])[:, kv_of_head]
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n], keys) * scale     # [h, n, c + n]
            query_pos = torch.arange(c, c + n, device=dev)[:, None]
            key_pos = torch.arange(c + n, device=dev)[None, :]
            seen = key_pos <= query_pos
            if self.window is not None:
                seen &= key_pos > query_pos - self.window
            scores = scores.masked_fill(~seen, float("-inf"))
            if sinks is not None:
                scores = torch.cat([scores, sinks.double().to(dev)[:, None, None].expand(h, n, 1)], dim=-1)
            weights = torch.softmax(scores, dim=-1)[..., :c + n]
            out[start:start + n] = torch.einsum("hqk,khd->qhd", weights, values)
            lse[:, start:start + n] = torch.logsumexp(scores, dim=-1)
            start += n
        return out.cpu(), lse.cpu()


HINT = ("query i of a sequence sits at position context_len + i: it sees every cached token (through the "
        "block table, rows t < context_len only: the rest is NaN) and the new keys 0..i")
WINDOW_HINT = ("with a window w, position p sees keys p - w < j <= p, cached ones included; never load a cached "
               "row no query of the block sees (they are NaN here)")
SINK_HINT = "a sink is one more logit per head in the softmax denominator, with no value: start m = sink, l = 1"


def check(got, batch, dtype, *, name, case, hint, scale=None, sinks=None, lse_atol=None, rows=None):
    """Compare (out, lse) with the float64 reference (``rows``: only those rows of the packed tokens)."""
    if not (isinstance(got, tuple) and len(got) == 2):
        raise GradingError(f"{name} must return (out, lse), got {type(got).__name__}")
    out, lse = got
    ref_out, ref_lse = batch.reference(scale=scale, sinks=sinks)
    atol, rtol = tolerances(dtype)
    if dtype == torch.float32:
        atol, rtol = 2e-5, 1e-5
    if rows is not None:
        out, ref_out, lse, ref_lse = out[rows], ref_out[rows], lse[:, rows], ref_lse[:, rows]
    assert_close(out, ref_out, name=f"{name}: out", dtype=dtype, case=case, atol=atol, rtol=rtol, hint=hint)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close(lse, ref_lse, name=f"{name}: lse", dtype=lse_dtype, case=case,
                 atol=lse_atol or (1e-4 if dtype == torch.float32 else 2e-2), rtol=1e-5,
                 hint="lse = log of the softmax denominator in natural log: (m + log2(l)) * ln(2) in base-2 units")


# ================================================================ task 3: the reference

@task(3, "prefix_prefill_reference")
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_reference_matches_float64(seed, case_index):
    case = CPU_CASES[case_index]
    batch = Batch(case, torch.float64, "cpu", seed)
    got = L.prefix_prefill_reference(*batch.args())
    check(got, batch, torch.float64, name="prefix_prefill_reference", case=case_text(case, torch.float64),
          hint=HINT, lse_atol=1e-10)


@task(3, "prefix_prefill_reference")
def test_reference_window_sinks_scale(seed):
    case_index, window = CPU_WINDOWS[0]
    case = CPU_CASES[case_index]
    batch = Batch(case, torch.float64, "cpu", seed, window=window)
    sinks = randn(case[2], dtype=torch.float64, seed=seed + 7, scale=2.0)
    got = L.prefix_prefill_reference(*batch.args(), scale=0.3, sliding_window=window, sinks=sinks)
    check(got, batch, torch.float64, name="prefix_prefill_reference(window, sinks, scale=0.3)",
          case=case_text(case, torch.float64, window=window), scale=0.3, sinks=sinks, hint=WINDOW_HINT + "; "
          + SINK_HINT, lse_atol=1e-10)


@task(3, "prefix_prefill_reference")
def test_reference_fp8_cache_and_vector_layout(seed):
    case = CPU_CASES[1]
    batch = Batch(case, torch.float64, "cpu", seed, cache_dtype=torch.float8_e4m3fn)
    got = L.prefix_prefill_reference(*batch.args(), k_scale=Batch.K_SCALE, v_scale=Batch.V_SCALE)
    check(got, batch, torch.float64, name="prefix_prefill_reference(fp8 cache)", case=case_text(case, torch.float64),
          hint="convert the fp8 cache to q's dtype, then multiply by k_scale / v_scale", lse_atol=1e-10)
    plain = Batch(case, torch.float64, "cpu", seed)
    plain.k_cache = L.to_vector_k_layout(plain.k_cache)
    got = L.prefix_prefill_reference(*plain.args())
    check(got, plain, torch.float64, name="prefix_prefill_reference(5-D vector K layout)",
          case=case_text(case, torch.float64), hint="a 5-D k_cache: undo the layout with from_vector_k_layout",
          lse_atol=1e-10)


@task(3, "prefix_prefill_reference")
def test_reference_bad_input(seed):
    batch = Batch(([9, 4], [3, 5], 4, 2, 16, 8), torch.float64, "cpu", seed)
    q, k, v, kc, vc, bt, cu, cl = batch.args()
    f = L.prefix_prefill_reference
    expect_value_error(f, q[:, :3], k, v, kc, vc, bt, cu, cl, what="3 query heads over 2 KV heads")
    expect_value_error(f, q, k, v, kc, vc, bt, cu.long(), cl, what="int64 cu_seqlens_q")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl[:1], what="context_lens of the wrong length")
    expect_value_error(f, q, k[:-1], v[:-1], kc, vc, bt, cu, cl, what="k with fewer tokens than q")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl, sliding_window=0, what="sliding_window=0")


# ================================================================ task 4: the kernel

@task(4, "prefix_prefill_attention")
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_kernel_float32(device, seed, case_index):
    case = cases(device)[case_index]
    if device == "cuda":            # exact float32 dot products on a GPU: a small head size (GPU_FLOAT32_HEAD_DIM)
        case = (*case[:4], GPU_FLOAT32_HEAD_DIM, case[5])
    batch = Batch(case, torch.float32, device, seed)
    out = poisoned(*batch.q.shape, dtype=torch.float32, device=device)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, out=out)
    check(got, batch, torch.float32, name="prefix_prefill_attention", case=case_text(case, torch.float32),
          hint=HINT + "; pad head dims to a power of two and mask them")


@task(4, "prefix_prefill_attention")
@pytest.mark.parametrize("case_index", [0, 2])
def test_kernel_low_precision(device, seed, case_index):
    """A 16-bit dtype: float16 in the interpreter, bf16 on a GPU (float16 on a GPU: the fp8 check with float16
    q and the radix glue's prefill_attention)."""
    case = cases(device)[case_index]
    dtype = half_dtype(device)
    batch = Batch(case, dtype, device, seed)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len)
    check(got, batch, dtype, name="prefix_prefill_attention", case=case_text(case, dtype),
          hint="keep the scores, the running max and sum and the output in float32; cast once at the end")


@task(4, "prefix_prefill_attention")
@pytest.mark.parametrize("window_index", [0, 1, 2])
def test_kernel_sliding_window(device, seed, window_index):
    case_index, window = windows(device)[window_index]
    case = cases(device)[case_index]
    dtype = logic_dtype(device)
    batch = Batch(case, dtype, device, seed, window=window)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, sliding_window=window)
    check(got, batch, dtype, name=f"prefix_prefill_attention(sliding_window={window})",
          case=case_text(case, dtype, window=window), hint=WINDOW_HINT)


def kernel_tiles(device: str, head_dim: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the kernel at this shape, 16-bit dtypes (the module's ``_fixed_config``, as the
    reference has it)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    default = 64 if device == "cuda" else 16
    return tuple(tile(5, 1, lambda m: m._fixed_config(block_d, False, max_query_len)[name], default)
                 for name in ("BLOCK_M", "BLOCK_N"))


def edge_lengths(device: str, head_dim: int) -> tuple[list[int], list[int], int, int]:
    """(context_lens, new tokens, BLOCK_M, BLOCK_N): prefixes of whole key tiles (and one less), queries of
    whole query tiles (and one more or less), at the tiles the kernel picks for the longest of them (the tiles
    depend on max_query_len: a few rounds until they stop changing)."""
    block_m, block_n = kernel_tiles(device, head_dim, 64)
    for _ in range(4):
        ctx = [2 * block_n, block_n, 0, 3 * block_n, block_n - 1]
        new = [block_m, 2 * block_m, block_m + 1, 1, block_m - 1]
        tiles = kernel_tiles(device, head_dim, max(new))
        if tiles == (block_m, block_n):
            break
        block_m, block_n = tiles
    return ctx, new, block_m, block_n


@task(4, "prefix_prefill_attention")
@pytest.mark.parametrize("window", [None, "tile", "tile+1"])
def test_kernel_tile_edges(device, seed, window):
    """Prefixes and query lengths of whole tiles (and one more or less); a window of one key tile (the last row
    of a query tile then sees whole key tiles from a tile edge on) and of one key more (the first row's window
    then starts on a tile's first key). On a GPU in bf16 at head_dim 64: GPU_CASES' compiled variants."""
    dtype, head_dim = logic_dtype(device), (64 if device == "cuda" else 32)
    ctx, new, block_m, block_n = edge_lengths(device, head_dim)
    w = {None: None, "tile": block_n, "tile+1": block_n + 1}[window]
    case = (ctx, new, 4, 2, head_dim, min(block_n, 16))
    batch = Batch(case, dtype, device, seed, window=w)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, sliding_window=w)
    check(got, batch, dtype, name="prefix_prefill_attention" + (f"(sliding_window={w})" if w else ""),
          case=case_text(case, dtype, window=w) + f"; tiles of {block_m} queries x {block_n} keys",
          hint=(WINDOW_HINT if w else HINT) + "; a prefix or a query block that ends exactly on a tile edge has no "
               "partial tile, and a window whose first key is a tile's first key starts at that tile")


@task(4, "prefix_prefill_attention")
def test_kernel_sinks_with_window_and_strided_q(device, seed):
    case_index, window = windows(device)[0]
    case = cases(device)[case_index]
    dtype = logic_dtype(device)
    batch = Batch(case, dtype, device, seed, window=window)
    h, hk = case[2], case[3]
    # q, k, v as slices of one fused projection [tokens, h + 2 hk, d]: strided along the token axis.
    qkv = randn(batch.q.shape[0], h + 2 * hk, case[4], dtype=dtype, device=device, seed=seed + 55)
    batch.q, batch.k, batch.v = qkv[:, :h], qkv[:, h:h + hk], qkv[:, h + hk:]
    sinks = randn(h, device=device, seed=seed + 9, scale=2.0)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, sliding_window=window, sinks=sinks,
                                     scale=0.1)
    check(got, batch, dtype, name="prefix_prefill_attention(sinks, window, scale=0.1, strided q/k/v)",
          case=case_text(case, dtype, window=window), scale=0.1, sinks=sinks,
          hint=SINK_HINT + "; use the strides of q, k, v (slices of a fused qkv projection)")


@task(4, "prefix_prefill_attention")
def test_kernel_skip_decode_and_vector_layout(device, seed):
    case = cases(device)[0]                    # its second sequence has ONE new token
    dtype = logic_dtype(device)
    batch = Batch(case, dtype, device, seed)
    batch.k_cache = L.to_vector_k_layout(batch.k_cache)
    marker = torch.full(batch.q.shape, 7.0, dtype=dtype, device=device)
    out = marker.clone()
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, skip_decode=True, out=out)
    if not (isinstance(got, tuple) and got[0] is out):
        raise GradingError("prefix_prefill_attention(out=...) must write into out and return it as (out, lse)")
    cu = batch.cu_seqlens_q.tolist()
    decode_rows = [r for b, n in enumerate(case[1]) if n == 1 for r in range(cu[b], cu[b + 1])]
    other_rows = [r for b, n in enumerate(case[1]) if n != 1 for r in range(cu[b], cu[b + 1])]
    if not torch.equal(out[decode_rows], marker[decode_rows]):
        raise GradingError("skip_decode=True must leave the rows of one-token sequences untouched\n"
                           f"  case:     {case_text(case, dtype)}, rows {decode_rows}\n"
                           "  hint:     return early in the program of a sequence whose query length is 1")
    lse = got[1][:, decode_rows]
    if not bool(torch.all(lse == float("-inf"))):
        raise GradingError("skip_decode=True: the lse of skipped rows must be -inf (no keys were attended)")
    check(got, batch, dtype, name="prefix_prefill_attention(skip_decode, vector K layout)",
          case=case_text(case, dtype), rows=other_rows,
          hint="K element (token t, dim c) of the 5-D layout is k_cache[block, kv_head, c // x, t % bs, c % x]")


@task(4, "prefix_prefill_attention")
@pytest.mark.gpu
@pytest.mark.parametrize("case_index", [0, 1])
def test_kernel_fp8_cache(device, seed, case_index):
    case = cases(device)[case_index]
    batch = Batch(case, torch.bfloat16, device, seed, cache_dtype=torch.float8_e4m3fn)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, k_scale=Batch.K_SCALE,
                                     v_scale=Batch.V_SCALE)
    check(got, batch, torch.bfloat16, name="prefix_prefill_attention(fp8 cache)",
          case=case_text(case, torch.bfloat16, k_scale=Batch.K_SCALE, v_scale=Batch.V_SCALE),
          hint="convert the fp8 tiles to q's dtype; multiply the scores by k_scale and p by v_scale (not l)")


@task(4, "prefix_prefill_attention")
def test_kernel_fp8_cache_fp16(device, seed):
    """The fp8 scales on any device: float16 q over an e4m3 cache (the interpreter runs fp8 with float16 dots)."""
    case = cases(device)[0]
    batch = Batch(case, torch.float16, device, seed, cache_dtype=torch.float8_e4m3fn)
    got = L.prefix_prefill_attention(*batch.args(), batch.max_query_len, k_scale=Batch.K_SCALE,
                                     v_scale=Batch.V_SCALE)
    check(got, batch, torch.float16, name="prefix_prefill_attention(fp8 cache, float16 q)",
          case=case_text(case, torch.float16, k_scale=Batch.K_SCALE, v_scale=Batch.V_SCALE),
          hint="convert the fp8 tiles to q's dtype; multiply the scores by k_scale and p by v_scale (not l); "
               "the new tokens' k and v are never scaled")


@task(4, "prefix_prefill_attention")
def test_kernel_bad_input(device, seed):
    batch = Batch(([9, 4], [3, 5], 4, 2, 16, 8), torch.float32, device, seed)
    q, k, v, kc, vc, bt, cu, cl = batch.args()
    f = L.prefix_prefill_attention
    expect_value_error(f, q[:, :3], k, v, kc, vc, bt, cu, cl, 5, what="3 query heads over 2 KV heads")
    expect_value_error(f, q.half(), k, v, kc, vc, bt, cu, cl, 5, what="q in float16, k and v in float32")
    expect_value_error(f, q, k, v, kc.half(), vc.half(), bt, cu, cl, 5, what="a float16 cache with float32 q")
    expect_value_error(f, q, k, v, kc, vc[:, :, :1], bt, cu, cl, 5, what="v_cache with one KV head")
    expect_value_error(f, q, k, v, kc, vc, bt.long(), cu, cl, 5, what="int64 block tables")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl, 4, what="max_query_len below the longest query (5)")
    expect_value_error(f, q, k, v, kc, vc, bt, cu.flip(0), cl, 5, what="decreasing cu_seqlens_q")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl + 1000, 5, what="context_lens past the block table")
    bad_table = bt.clone()
    bad_table[0, 0] = kc.shape[0] + 5
    expect_value_error(f, q, k, v, kc, vc, bad_table, cu, cl, 5, what="a block id outside the cache")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl, 5, sinks=torch.zeros(3, device=device),
                       what="sinks with 3 entries for 4 heads")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl, 5, k_scale=0.5, what="k_scale without an fp8 cache")
    expect_value_error(f, q, k, v, kc, vc, bt, cu, cl, 5, sliding_window=-2, what="sliding_window=-2")
