"""Grader of lesson 05, part 2: merging attention states (task 5), plan/run attention over a paged cache
(task 6) and over contiguous ragged K/V (task 7), cascade attention (task 8).

The reference is written here, independently of the solution: each request's keys and values are gathered
token by token (through its pages) into contiguous float64 tensors and attention is computed one request at
a time, query head ``h`` reading KV head ``h // group``, with the causal rule of the lesson (query ``i`` of a
request with ``q_len`` queries and ``kv_len`` keys sits at position ``kv_len - q_len + i``). The log-sum-exp
is the natural log of each row's softmax denominator; a row without keys has output 0 and lse ``-inf``.

Every paged case builds a cache whose unused rows are NaN: blocks nobody owns and the slots of a request's
last page after its last token. A kernel that reads one row too far turns its output into NaN.

Batches are ragged: decodes (one query) beside prefill chunks (tens to hundreds of queries), contexts of
many pages and requests without keys. On a CPU the kernels run in the Triton interpreter: small shapes,
float32 everywhere and float16. On a GPU: bf16 (the engine's dtype) at the sizes of real models, where the
split planner splits on its own, and float32 in one check (see ``GPU_CASES`` for why the GPU cases all share
one head size, GQA group and page size).
"""

from __future__ import annotations

import math

import pytest
import torch

from grader.checks import GradingError, assert_close, expect_value_error, randn, task, tolerances
from grader.edges import tile
from yaie.switch import LessonProxy
from yaie.switch import module as lesson_module

L = LessonProxy(5, 2)

# (q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size): with causal=True q_len <= kv_len.
CPU_CASES = [
    ([1, 5, 40, 1, 3], [9, 17, 40, 33, 3], 4, 2, 32, 8),      # decodes beside prefills, GQA 2:1
    ([1, 1, 70], [70, 1, 90], 6, 2, 64, 16),                  # GQA 3:1, a 1-token context, prefill over a prefix
    ([2, 25], [30, 25], 4, 1, 96, 8),                         # head_dim 96 (padded), multi-query
]
# Why the GPU cases are what they are: on a GPU each distinct set of the plan/run kernel's constexprs (the
# GQA group, head_dim, page size, the tiles these pick, whether the batch has decode tiles, prefill tiles or
# both, paged or contiguous K/V, dtype) and of its int specialisations (Triton compiles an int argument that
# is 1, or divisible by 16, apart: num_heads, num_kv_heads, the strides) is a compile of several seconds; a
# run takes microseconds. So every GPU check of this file shares compiled variants: GQA 4:1 with num_heads a
# multiple of 16 (num_kv_heads 4 or 8), head_dim 64 (Llama-3.2-1B; the merge checks too), block_size 16,
# decodes beside prefills in every batch, bf16 (the engine's dtype; the interpreter checks float32
# everywhere), and the later checks find them compiled. The lengths are free (they are not compiled in):
# contexts of thousands of keys, so the split planner splits on its own. Head size 96 (padded) and other
# groups are the CPU cases'; on a GPU the float32 check pads one.
GPU_CASES = [
    ([1] * 12 + [300, 700], [4096, 3, 1000, 517] * 3 + [2348, 700], 32, 8, 64, 16),   # Llama-3.2-1B-like mix
    ([1, 129, 1, 64], [2049, 1000, 1, 64], 16, 4, 64, 16),                           # few requests, long contexts
    ([1, 1, 200], [777, 1500, 300], 16, 4, 64, 16),                                  # a prefill chunk over a prefix
]
# float32 on a GPU: its exact ("ieee") dot products compile into FMA loops whose size grows with the head
# size (about 10 s at 128, 3 s at 8), so the float32 check runs the GPU batches at head_dim 8: padded to 16
# inside (the GPU's one check of the padding), one compiled variant for all of them.
GPU_FLOAT32_HEAD_DIM = 8


def cases(device: str):
    return GPU_CASES if device == "cuda" else CPU_CASES


def logic_dtype(device: str) -> torch.dtype:
    """The dtype of the checks of the plan's logic: float32 in the interpreter (exact), bf16 on a GPU (the
    engine's dtype: one compiled variant; the float32 path has a check of its own)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def half_dtype(device: str) -> torch.dtype:
    """A 16-bit dtype: float16 in the interpreter (its bf16 tl.dot is broken), bf16 on a GPU."""
    return torch.bfloat16 if device == "cuda" else torch.float16


def case_text(case, dtype, causal=None, chunk=None) -> str:
    ql, kl, h, hk, d, bs = case
    text = (f"q_lens {ql}, kv_lens {kl}, heads {h}/{hk} kv, head_dim {d}, block_size {bs}, "
            f"{str(dtype).replace('torch.', '')}")
    if causal is not None:
        text += f", causal={causal}"
    if chunk is not None:
        text += f", kv_chunk_size={chunk}"
    return text


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def offsets(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class Batch:
    """A ragged batch in CSR form over a NaN-poisoned paged cache, with each request's K/V kept contiguous."""

    def __init__(self, case, dtype, device, seed, spare_blocks: int = 3, layout_seed: int | None = None):
        q_lens, kv_lens, h, hk, d, bs = case
        self.case, self.dtype, self.device = case, dtype, device
        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        pages = [math.ceil(n / bs) for n in kv_lens]
        num_blocks = sum(pages) + spare_blocks
        self.k_cache = torch.full((num_blocks, bs, hk, d), float("nan"), dtype=dtype, device=device)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(
            seed if layout_seed is None else layout_seed)).tolist()
        self.ks, self.vs, indices, last = [], [], [], []
        for b, n in enumerate(kv_lens):
            k = randn(n, hk, d, dtype=dtype, device=device, seed=seed + 2 * b + 1)
            v = randn(n, hk, d, dtype=dtype, device=device, seed=seed + 2 * b + 2)
            self.ks.append(k)
            self.vs.append(v)
            for j in range(pages[b]):
                block = order.pop(0)
                indices.append(block)
                rows = min(bs, n - j * bs)
                self.k_cache[block, :rows] = k[j * bs: j * bs + rows]
                self.v_cache[block, :rows] = v[j * bs: j * bs + rows]
            last.append(n - (pages[b] - 1) * bs if pages[b] else 0)
        self.q = randn(sum(q_lens), h, d, dtype=dtype, device=device, seed=seed)
        self.qo_indptr = i32(offsets(q_lens), device)
        self.kv_indptr = i32(offsets(pages), device)
        self.kv_indices = i32(indices, device)
        self.kv_last_page_len = i32(last, device)
        self.pages = pages

    def csr(self):
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def sizes(self):
        _, _, h, hk, d, bs = self.case
        return h, hk, d, bs

    def contiguous_kv(self):
        """The same keys and values as [total_kv, num_kv_heads, head_dim] tensors plus their offsets."""
        return (torch.cat(self.ks), torch.cat(self.vs), i32(offsets(self.kv_lens), self.device))


def ref_attention(q, q_lens, ks, vs, causal, scale=None):
    """float64 (out, lse) of each request's queries over its own keys (on q's device, returned on the CPU)."""
    total_q, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(total_q, h, d, dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, h), float("-inf"), dtype=torch.float64, device=q.device)
    start = 0
    for ql, k, v in zip(q_lens, ks, vs):
        rows = slice(start, start + ql)
        start += ql
        kl = k.shape[0]
        if ql == 0 or kl == 0:
            continue
        group = h // k.shape[1]
        qd = q[rows].double()
        kd = k.double().repeat_interleave(group, dim=1)        # [kl, h, d]
        vd = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", qd, kd) * scale   # [h, ql, kl]
        if causal:
            pos = torch.arange(kl - ql, kl, device=q.device)
            scores = scores.masked_fill(torch.arange(kl, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[rows] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), vd)
        lse[rows] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    return out.cpu(), lse.cpu()


def lowp_atol(dtype, q, q_lens, ks, vs, exact_out, causal) -> float:
    """fp16/bf16: the course tolerance, or twice the error of the same math in PyTorch with the
    probabilities rounded to the dtype (what a kernel feeding P to a 16-bit matrix product does)."""
    atol, _ = tolerances(dtype)
    worst, start = 0.0, 0
    h = q.shape[1]
    for ql, k, v in zip(q_lens, ks, vs):
        rows = slice(start, start + ql)
        start += ql
        kl = k.shape[0]
        if ql == 0 or kl == 0:
            continue
        group = h // k.shape[1]
        kd, vd = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        s = torch.einsum("ihd,jhd->hij", q[rows].float(), kd) * q.shape[-1] ** -0.5
        if causal:
            pos = torch.arange(kl - ql, kl, device=s.device)
            s = s.masked_fill(torch.arange(kl, device=s.device)[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(s, -1).to(dtype).float()
        low = torch.einsum("hij,jhd->ihd", p, vd)
        worst = max(worst, float((low.double().cpu() - exact_out[rows]).abs().max()))
    return max(atol, 2 * worst)


# ================================================================ task 5: merging attention states

def ref_merge(states) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 merge of a list of (o, lse): weights exp(lse_i - logsumexp), empty states ignored."""
    lses = torch.stack([lse.double().cpu() for _, lse in states])                  # [S, n, h]
    outs = torch.stack([o.double().cpu() for o, _ in states])                      # [S, n, h, d]
    total = torch.logsumexp(lses, dim=0)
    empty = torch.isinf(total)
    w = torch.where(empty[None], torch.zeros_like(lses), torch.exp(lses - torch.where(empty, 0.0, total)[None]))
    outs = torch.where(w[..., None] > 0, outs, torch.zeros_like(outs))
    return (w[..., None] * outs).sum(0), total


def random_states(n, h, d, dtype, device, seed, count=2):
    """``count`` random states; some rows empty in one state (lse -inf, o NaN), one row empty in all."""
    states = []
    for i in range(count):
        o = randn(n, h, d, dtype=dtype, device=device, seed=seed + 10 * i)
        lse = randn(n, h, device=device, seed=seed + 10 * i + 1, scale=4.0)
        lse[i % n, (i + 1) % h] = float("-inf")
        o[i % n, (i + 1) % h] = float("nan")        # an empty state's output is never read
        lse[n - 1, 0] = float("-inf")               # a row without keys anywhere
        o[n - 1, 0] = float("nan")
        states.append((o, lse))
    return states


MERGE_HINT = ("lse = log(exp(lse_a) + exp(lse_b)) computed as m + log(exp(lse_a - m) + exp(lse_b - m)) with "
              "m the larger; o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b; an lse of -inf weighs 0 even if "
              "its o is NaN; both empty -> o = 0, lse = -inf")


@task(5, "merge_state")
def test_merge_reference_matches_float64(seed):
    (oa, la), (ob, lb) = random_states(5, 3, 16, torch.float64, "cpu", seed)
    got_o, got_lse = L.merge_state_reference(oa, la.double(), ob, lb.double())
    exp_o, exp_lse = ref_merge([(oa, la), (ob, lb)])
    assert_close(got_o, exp_o, name="merge_state_reference output", atol=1e-10, rtol=1e-10, hint=MERGE_HINT)
    assert_close(got_lse, exp_lse, name="merge_state_reference lse", atol=1e-10, rtol=1e-10, hint=MERGE_HINT)


@task(5, "merge_state")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp32", "fp16", "bf16"])
def test_merge_state_matches_float64(device, seed, dtype):
    n, h, d = (7, 4, 96) if device == "cpu" else (1000, 32, 64)      # GPU: GPU_CASES' head size
    (oa, la), (ob, lb) = random_states(n, h, d, dtype, device, seed)
    got_o, got_lse = L.merge_state(oa, la, ob, lb)
    exp_o, exp_lse = ref_merge([(oa, la), (ob, lb)])
    case = f"o [{n}, {h}, {d}] {str(dtype).replace('torch.', '')}, lse scale 4, some states empty"
    assert_close(got_o, exp_o, name="merge_state output", dtype=dtype, case=case, hint=MERGE_HINT,
                 **({} if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)))
    assert_close(got_lse, exp_lse, name="merge_state lse", dtype=torch.float32, case=case, atol=1e-5, rtol=1e-5,
                 hint="return lse in float32, natural log")


@task(5, "merge_state")
def test_merge_identities(device, seed):
    """Merging with an empty state is the identity; the order of the states does not matter; merging
    pairwise equals merging all at once."""
    n, h, d = (6, 4, 32) if device == "cpu" else (6, 32, 64)     # GPU: the merge kernels compiled for the checks around
    a, b, c = random_states(n, h, d, torch.float32, device, seed, count=3)
    a_o = torch.nan_to_num(a[0], nan=0.5)   # the identity check needs a state whose every row is real...
    a_lse = a[1].clone()
    a_lse[torch.isinf(a_lse)] = 1.0
    empty_o = torch.full_like(a_o, float("nan"))                      # ...and a state with no keys at all
    empty_lse = torch.full_like(a_lse, float("-inf"))
    for first, second, where in (((a_o, a_lse), (empty_o, empty_lse), "merge(a, empty)"),
                                 ((empty_o, empty_lse), (a_o, a_lse), "merge(empty, a)")):
        o, lse = L.merge_state(*first, *second)
        assert_close(o, a_o, name=f"{where} output", atol=1e-6, rtol=1e-6,
                     hint="an empty state (lse = -inf) must leave the other state unchanged, NaN output and all")
        assert_close(lse, a_lse, name=f"{where} lse", atol=1e-6, rtol=1e-6)
    ab = L.merge_state(*a, *b)
    ba = L.merge_state(*b, *a)
    assert_close(ab[0], ba[0], name="merge(a, b) vs merge(b, a) output", atol=1e-6, rtol=1e-6,
                 hint="the merge is symmetric: subtract the larger lse, whichever argument holds it")
    assert_close(ab[1], ba[1], name="merge(a, b) vs merge(b, a) lse", atol=1e-6, rtol=1e-6)
    pairwise = L.merge_state(*ab, *c)
    together = L.merge_states(torch.stack([a[0], b[0], c[0]], 1), torch.stack([a[1], b[1], c[1]], 1))
    assert_close(pairwise[0], together[0], name="merge(merge(a, b), c) vs merge_states([a, b, c]) output",
                 atol=1e-5, rtol=1e-5, hint="the merge is associative: any grouping gives the same state")
    assert_close(pairwise[1], together[1], name="merge(merge(a, b), c) vs merge_states([a, b, c]) lse",
                 atol=1e-5, rtol=1e-5)


@task(5, "merge_state")
def test_merge_of_split_keys_is_exact_attention(device, seed):
    """Attention over keys 0..n-1 equals the merge of attention over any split of them into two sets."""
    h, d, n = (4, 32, 37) if device == "cpu" else (32, 64, 37)   # GPU: the merge kernel compiled for the checks above
    q = randn(3, h, d, device=device, seed=seed)
    k = randn(n, h, d, device=device, seed=seed + 1)
    v = randn(n, h, d, device=device, seed=seed + 2)
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 3].tolist()
    rest = [j for j in range(n) if j not in chosen]
    full_o, full_lse = ref_attention(q, [3], [k], [v], causal=False)
    states = []
    for keys in (chosen, rest):
        o, lse = ref_attention(q, [3], [k[keys]], [v[keys]], causal=False)
        states.append((o.float().to(device), lse.float().to(device)))
    o, lse = L.merge_state(*states[0], *states[1])
    assert_close(o, full_o, name="merge_state of two key subsets' attention", atol=2e-5, rtol=1e-5,
                 case=f"{n} keys cut at random into {len(chosen)} + {len(rest)}",
                 hint="the merged state must be the attention over the union of the keys: " + MERGE_HINT)
    assert_close(lse, full_lse, name="merged lse vs the lse over all keys", atol=2e-5, rtol=1e-5)


@task(5, "merge_state")
@pytest.mark.parametrize("num_states", [1, 3, 6])
def test_merge_states_matches_float64(device, seed, num_states):
    n, h, d = (5, 3, 64) if device == "cpu" else (777, 32, 64)
    states = random_states(n, h, d, torch.float32, device, seed, count=num_states)
    o = torch.stack([s[0] for s in states], 1)
    lse = torch.stack([s[1] for s in states], 1)
    got_o, got_lse = L.merge_states(o, lse)
    exp_o, exp_lse = ref_merge(states)
    case = f"o [{n}, {num_states}, {h}, {d}] float32"
    assert_close(got_o, exp_o, name="merge_states output", dtype=torch.float32, atol=1e-5, rtol=1e-5, case=case,
                 hint="an online log-sum-exp over the states: keep the largest lse so far and rescale")
    assert_close(got_lse, exp_lse, name="merge_states lse", atol=1e-5, rtol=1e-5, case=case)


@task(5, "merge_state")
def test_merge_bad_input(device, seed):
    (oa, la), (ob, lb) = random_states(4, 2, 16, torch.float32, device, seed)
    expect_value_error(L.merge_state, oa, la, ob[:3], lb[:3], what="states of different lengths")
    expect_value_error(L.merge_state, oa, la.double(), ob, lb, what="a float64 lse")
    expect_value_error(L.merge_state, oa, la[:, :1], ob, lb, what="lse with the wrong number of heads")
    expect_value_error(L.merge_state, oa, la, ob.half(), lb, what="outputs of different dtypes")
    expect_value_error(L.merge_states, oa, la, what="merge_states without a states axis")


# ================================================================ task 6: paged plan/run

PAGED_HINT = ("token t of request b is row t % block_size of page kv_indices[kv_indptr[b] + t // block_size]; the "
              "request has (pages - 1) * block_size + kv_last_page_len[b] keys (the rest of its last page is NaN); "
              "pack the query heads of one KV head into a tile's rows")
CAUSAL_HINT = "causal: query i of a request sits at position kv_len - q_len + i and sees keys 0 .. that position"


def check_plan_run(batch, got, causal, what):
    """Against float64; fp16/bf16 batches with the tolerance of :func:`lowp_atol`, float32 ones exactly."""
    out, lse = got
    exact_out, exact_lse = ref_attention(batch.q, batch.q_lens, batch.ks, batch.vs, causal)
    text = case_text(batch.case, batch.dtype, causal)
    hint = PAGED_HINT + ("; " + CAUSAL_HINT if causal else "")
    lowp = batch.dtype in (torch.float16, torch.bfloat16)
    if lowp:
        atol = lowp_atol(batch.dtype, batch.q, batch.q_lens, batch.ks, batch.vs, exact_out, causal)
        rtol = tolerances(batch.dtype)[1]
    else:
        atol, rtol = 2e-5, 1e-5
    assert_close(out, exact_out, name=f"{what} output", dtype=batch.dtype, case=text, atol=atol, rtol=rtol, hint=hint)
    assert_close(lse, exact_lse, name=f"{what} lse", dtype=torch.float32, case=text,
                 atol=1e-3 if lowp else 2e-5, rtol=1e-3 if lowp else 1e-5,
                 hint="lse is float32 [total_q, num_heads], the natural log of each row's softmax denominator")


@task(6, "FlashInferPagedAttention")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_reference_matches_float64(seed, causal):
    batch = Batch(CPU_CASES[0], torch.float64, "cpu", seed)
    got = L.paged_attention_reference_csr(batch.q, batch.k_cache, batch.v_cache, *batch.csr(), causal=causal)
    check_plan_run(batch, (got[0], got[1].float()), causal, "paged_attention_reference_csr")


@task(6, "FlashInferPagedAttention")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_paged_plan_run_float32(device, seed, case_index, causal):
    """float32, exact; the planner's own split (kv_chunk_size None) at the GPU cases' sizes."""
    case = cases(device)[case_index]
    if device == "cuda":            # exact float32 dot products on a GPU: a small head size (GPU_FLOAT32_HEAD_DIM)
        case = (*case[:4], GPU_FLOAT32_HEAD_DIM, case[5])
    batch = Batch(case, torch.float32, device, seed)
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*batch.csr(), *batch.sizes(), causal=causal)
    check_plan_run(batch, wrapper.run(batch.q, batch.k_cache, batch.v_cache), causal, "FlashInferPagedAttention.run")


@task(6, "FlashInferPagedAttention")
@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_paged_split_kv(device, seed, chunk):
    """Long key ranges cut into chunks (split-KV): every chunking gives the same answer."""
    case = cases(device)[0 if device == "cpu" else 1]
    chunk = chunk if device == "cpu" else chunk * 16
    batch = Batch(case, logic_dtype(device), device, seed)
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*batch.csr(), *batch.sizes(), causal=True, kv_chunk_size=chunk)
    out, lse = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    try:
        check_plan_run(batch, (out, lse), True, f"FlashInferPagedAttention.run with kv_chunk_size={chunk}")
    except GradingError as err:
        raise GradingError(f"{err}\n  note:     each tile's keys are cut into chunks of {chunk}; merge the chunks' "
                           "states by log-sum-exp (task 5); a chunk whose keys are all after a causal row's "
                           "position is empty for that row (lse -inf)") from None


def small_chunk_heuristic(monkeypatch):
    """Make the module's split heuristic choose CPU-sized chunks (it never splits at CPU shapes: its
    chunks are at least MIN_CHUNK = 256 keys, whole tiles of 64); returns the chunks it chose."""
    mod = lesson_module(5, 2)
    real = mod.choose_kv_chunk
    chosen: list[int] = []

    def small(tile_kv_lens, num_kv_heads, sms, granule=64, min_chunk=None):
        chunk = real(tile_kv_lens, num_kv_heads, 4 * sms, granule=4, min_chunk=4)
        chosen.append(chunk)
        return chunk

    monkeypatch.setattr(mod, "choose_kv_chunk", small)
    return chosen


def expect_heuristic_split(chosen, batch, what):
    if not chosen:
        raise GradingError(f"{what}: plan(kv_chunk_size=None) never called choose_kv_chunk\n"
                           f"  case:     {case_text(batch.case, batch.dtype)}\n"
                           "  hint:     with kv_chunk_size None, ask choose_kv_chunk(tile_kv_lens, num_kv_heads, "
                           "num_sms(device), BLOCK_N) for the chunk, then cut each tile into "
                           "max(1, round(length / chunk)) equal chunks")


SPLIT_HINT = ("kv_chunk_size None: the chunk comes from choose_kv_chunk and each tile's keys are cut into "
              "max(1, round(length / chunk)) EQUAL chunks of ceil(length / count) keys (the last one shorter): "
              "not every chunk keys as with an explicit kv_chunk_size; merge the chunks' states (task 5)")


@task(6, "FlashInferPagedAttention")
@pytest.mark.parametrize("case_index", [0, 1])
def test_paged_split_kv_by_the_heuristic(device, seed, case_index, monkeypatch):
    """The planner's own split (kv_chunk_size None), forced to split at CPU shapes."""
    chosen = small_chunk_heuristic(monkeypatch)
    batch = Batch(cases(device)[case_index], logic_dtype(device), device, seed)
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*batch.csr(), *batch.sizes(), causal=True)
    expect_heuristic_split(chosen, batch, "FlashInferPagedAttention")
    out, lse = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    try:
        check_plan_run(batch, (out, lse), True, f"FlashInferPagedAttention.run split by the heuristic (chunk {chosen[-1]})")
    except GradingError as err:
        raise GradingError(f"{err}\n  note:     {SPLIT_HINT}") from None


def plan_tiles(device: str, group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, WIDE_M) of the plan's tiles (the module's ``_tile_config``, as the reference has it)."""
    return tuple(tile(5, 2, lambda m: m._tile_config(group, head_dim)[name], default)
                 for name, default in (("BLOCK_N", 64 if device == "cuda" else 16),
                                       ("WIDE_M", 128 if device == "cuda" else 32)))


@task(6, "FlashInferPagedAttention")
@pytest.mark.parametrize("chunk", [None, "tile"])
def test_paged_lengths_on_tile_edges(device, seed, chunk):
    """Key counts of whole key tiles (and one less), prefill rows (tokens x group) of whole wide tiles (and
    one more); with ``kv_chunk_size`` one key tile, every chunk ends on a tile edge. On a GPU in bf16 with
    GPU_CASES' group, head size and page size (their compiled variant)."""
    heads, kv_heads, head_dim = (4, 2, 32) if device == "cpu" else (16, 4, 64)
    group = heads // kv_heads
    block_n, wide_m = plan_tiles(device, group, head_dim)
    rows = wide_m // group                               # tokens whose rows (x group query heads) fill a wide tile
    case = ([1, rows, rows + 1, 1, rows], [block_n, 2 * block_n, rows + 2 * block_n, 2 * block_n - 1, rows],
            heads, kv_heads, head_dim, 16)
    batch = Batch(case, logic_dtype(device), device, seed)
    size = None if chunk is None else block_n
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*batch.csr(), *batch.sizes(), causal=True, kv_chunk_size=size)
    try:
        check_plan_run(batch, wrapper.run(batch.q, batch.k_cache, batch.v_cache), True,
                       f"FlashInferPagedAttention.run (lengths on tile edges, kv_chunk_size={size})")
    except GradingError as err:
        raise GradingError(f"{err}\n  note:     tiles of {block_n} keys, wide tiles of {wide_m} rows: a length that "
                           "fills its last tile exactly has no partial tile (no extra tile, no extra chunk)") from None


@task(6, "FlashInferPagedAttention")
@pytest.mark.parametrize("case_index", [0, 2])
def test_paged_plan_run_low_precision(device, seed, case_index):
    """A 16-bit dtype: float16 in the interpreter, bf16 on a GPU (GPU_CASES' compiled variant)."""
    batch = Batch(cases(device)[case_index], half_dtype(device), device, seed)
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*batch.csr(), *batch.sizes(), causal=True)
    check_plan_run(batch, wrapper.run(batch.q, batch.k_cache, batch.v_cache), True,
                   "FlashInferPagedAttention.run")


@task(6, "FlashInferPagedAttention")
def test_paged_plan_once_run_every_layer(device, seed):
    """One plan serves every layer: run it on two layers' caches (same pages, other numbers) and queries."""
    case, dtype = cases(device)[0], logic_dtype(device)
    layer0 = Batch(case, dtype, device, seed)
    layer1 = Batch(case, dtype, device, seed + 1000, layout_seed=seed)   # same pages, other numbers
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*layer0.csr(), *layer0.sizes(), causal=True)
    for index, layer in enumerate((layer0, layer1, layer0)):
        got = wrapper.run(layer.q, layer.k_cache, layer.v_cache)
        check_plan_run(layer, got, True, f"run #{index + 1} of one plan")


@task(6, "FlashInferPagedAttention")
def test_paged_run_reads_the_page_ids_at_run_time(device, seed):
    """The engine's CUDA graphs keep a plan and overwrite its kv_indices tensor in place (other pages, as many):
    each run must follow the pages the tensor holds then."""
    case, dtype = cases(device)[0], logic_dtype(device)
    planned = Batch(case, dtype, device, seed)
    moved = Batch(case, dtype, device, seed + 1000, layout_seed=seed + 7)   # same shape, other pages
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*planned.csr(), *planned.sizes(), causal=True)
    planned.kv_indices.copy_(moved.kv_indices)
    try:
        check_plan_run(moved, wrapper.run(moved.q, moved.k_cache, moved.v_cache), True,
                       "run after kv_indices was overwritten in place")
    except GradingError as err:
        raise GradingError(f"{err}\n  note:     keep the kv_indices tensor plan() was given and read it in run(), "
                           "not a copy made in plan(): a caller may change the page ids in place between runs") from None


@task(6, "FlashInferPagedAttention")
def test_paged_empty_contexts(device, seed):
    """Requests without keys (non-causal: their rows get 0 and lse -inf) and requests without queries. On a GPU
    with GPU_CASES' sizes and a prefill without keys too (their compiled variant: decode and prefill tiles)."""
    if device == "cpu":
        case = ([3, 0, 1, 2], [0, 12, 0, 20], 4, 2, 16, 8)
    else:
        case = ([3, 0, 1, 2, 9], [0, 12, 0, 20, 0], 16, 4, 64, 16)
    batch = Batch(case, logic_dtype(device), device, seed)
    wrapper = L.FlashInferPagedAttention()
    wrapper.plan(*batch.csr(), *batch.sizes(), causal=False)
    out, lse = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    check_plan_run(batch, (out, lse), False, "FlashInferPagedAttention.run with empty contexts")


@task(6, "FlashInferPagedAttention")
def test_paged_bad_input(device, seed):
    case = ([1, 4], [9, 4], 4, 2, 16, 8)
    batch = Batch(case, torch.float32, device, seed)
    qo, kvp, idx, last = batch.csr()
    h, hk, d, bs = batch.sizes()
    w = L.FlashInferPagedAttention()
    expect_value_error(w.run, batch.q, batch.k_cache, batch.v_cache, what="run before plan")
    expect_value_error(w.plan, qo.long(), kvp, idx, last, h, hk, d, bs, what="int64 qo_indptr")
    expect_value_error(w.plan, qo.flip(0), kvp, idx, last, h, hk, d, bs, what="a decreasing qo_indptr")
    expect_value_error(w.plan, qo, kvp[:2], idx, last, h, hk, d, bs, what="qo_indptr and kv_indptr of different lengths")
    expect_value_error(w.plan, qo, kvp, idx[:-1], last, h, hk, d, bs, what="kv_indices shorter than kv_indptr[-1]")
    expect_value_error(w.plan, qo, kvp, idx, torch.zeros_like(last), h, hk, d, bs,
                       what="kv_last_page_len 0 for requests with pages")
    expect_value_error(w.plan, qo, kvp, idx, last + bs, h, hk, d, bs, what="kv_last_page_len above block_size")
    expect_value_error(w.plan, qo, kvp, idx, last, 3, hk, d, bs, what="3 query heads over 2 KV heads")
    expect_value_error(w.plan, i32([0, 1, 14], device), kvp, idx, last, h, hk, d, bs, causal=True,
                       what="causal with more queries (13) than keys (4)")
    w.plan(*batch.csr(), h, hk, d, bs)
    expect_value_error(w.run, batch.q[:-1], batch.k_cache, batch.v_cache, what="q with fewer rows than planned")
    expect_value_error(w.run, batch.q.half(), batch.k_cache, batch.v_cache, what="q and the cache in different dtypes")
    expect_value_error(w.run, batch.q, batch.k_cache[:, :4], batch.v_cache[:, :4],
                       what="a cache whose block_size differs from the plan's")
    expect_value_error(w.run, batch.q, batch.k_cache[:2], batch.v_cache[:2],
                       what="a cache with fewer blocks than the pages the plan reads")


# ================================================================ task 7: contiguous ragged plan/run

@task(7, "FlashInferAttention")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged_reference_matches_float64(seed, causal):
    batch = Batch(CPU_CASES[1], torch.float64, "cpu", seed)
    k, v, kv_indptr = batch.contiguous_kv()
    got = L.ragged_attention_reference(batch.q, k, v, batch.qo_indptr, kv_indptr, causal=causal)
    check_plan_run(batch, (got[0], got[1].float()), causal, "ragged_attention_reference")


@task(7, "FlashInferAttention")
@pytest.mark.parametrize("chunk", [None, 11])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case_index", [0, 2])
def test_ragged_plan_run(device, seed, case_index, causal, chunk):
    """float32 in the interpreter (exact); bf16 on a GPU (GPU_CASES' compiled variant: the float32 path of the
    plan/run kernel is the paged check's)."""
    batch = Batch(cases(device)[case_index], logic_dtype(device), device, seed)
    k, v, kv_indptr = batch.contiguous_kv()
    h, hk, d, _ = batch.sizes()
    wrapper = L.FlashInferAttention()
    wrapper.plan(batch.qo_indptr, kv_indptr, h, hk, d, causal=causal,
                 kv_chunk_size=chunk if device == "cpu" or chunk is None else chunk * 16)
    check_plan_run(batch, wrapper.run(batch.q, k, v), causal, "FlashInferAttention.run")


@task(7, "FlashInferAttention")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged_split_kv_by_the_heuristic(device, seed, causal, monkeypatch):
    """The planner's own split (kv_chunk_size None), forced to split at CPU shapes."""
    chosen = small_chunk_heuristic(monkeypatch)
    batch = Batch(cases(device)[1], logic_dtype(device), device, seed)
    k, v, kv_indptr = batch.contiguous_kv()
    h, hk, d, _ = batch.sizes()
    wrapper = L.FlashInferAttention()
    wrapper.plan(batch.qo_indptr, kv_indptr, h, hk, d, causal=causal)
    expect_heuristic_split(chosen, batch, "FlashInferAttention")
    try:
        check_plan_run(batch, wrapper.run(batch.q, k, v), causal,
                       f"FlashInferAttention.run split by the heuristic (chunk {chosen[-1]})")
    except GradingError as err:
        raise GradingError(f"{err}\n  note:     {SPLIT_HINT}") from None


@task(7, "FlashInferAttention")
def test_ragged_plan_run_low_precision(device, seed):
    """A 16-bit dtype: float16 in the interpreter, bf16 on a GPU."""
    batch = Batch(cases(device)[1], half_dtype(device), device, seed)
    k, v, kv_indptr = batch.contiguous_kv()
    h, hk, d, _ = batch.sizes()
    wrapper = L.FlashInferAttention()
    wrapper.plan(batch.qo_indptr, kv_indptr, h, hk, d, causal=True)
    check_plan_run(batch, wrapper.run(batch.q, k, v), True, "FlashInferAttention.run")


@task(7, "FlashInferAttention")
def test_ragged_bad_input(device, seed):
    batch = Batch(([1, 4], [9, 4], 4, 2, 16, 8), torch.float32, device, seed)
    k, v, kv_indptr = batch.contiguous_kv()
    w = L.FlashInferAttention()
    expect_value_error(w.run, batch.q, k, v, what="run before plan")
    expect_value_error(w.plan, batch.qo_indptr, kv_indptr[:2], 4, 2, 16, what="offsets of different lengths")
    expect_value_error(w.plan, batch.qo_indptr, kv_indptr, 4, 2, 16, scale=-1.0, what="a negative scale")
    w.plan(batch.qo_indptr, kv_indptr, 4, 2, 16)
    expect_value_error(w.run, batch.q, k[:-1], v[:-1], what="K/V with fewer rows than planned")
    expect_value_error(w.run, batch.q, k, v[:, :1], what="k and v of different shapes")


# ================================================================ task 8: cascade attention

def cascade_batch(groups, suffix_q, suffix_kv, h, hk, d, bs, dtype, device, seed):
    """Requests in ``groups`` (lists of request indices) share their group's prefix (a whole number of pages);
    each request has its own suffix. Returns (the Batch holding every piece, the per-level CSR lists, the
    per-request keys and values: prefix + suffix)."""
    prefix_lens = [bs * (2 + g) for g in range(len(groups))]          # whole pages
    pieces_kv = prefix_lens + suffix_kv
    pieces_q = [0] * len(groups) + suffix_q
    batch = Batch((pieces_q, pieces_kv, h, hk, d, bs), dtype, device, seed)
    num_req = len(suffix_q)
    # Level 0: the queries of a group's requests, consecutive rows, against the group's prefix pages.
    order = [r for group in groups for r in group]
    if order != list(range(num_req)):
        raise ValueError("groups must list the requests in order")
    qo0 = offsets([sum(suffix_q[r] for r in group) for group in groups])
    kv0 = offsets([batch.pages[g] for g in range(len(groups))])
    idx0 = batch.kv_indices[: kv0[-1]]
    last0 = i32([bs] * len(groups), device)
    # Level 1: each request's own suffix pages.
    g = len(groups)
    qo1 = offsets(suffix_q)
    kv1 = offsets(batch.pages[g:])
    idx1 = batch.kv_indices[kv0[-1]:]
    last1 = batch.kv_last_page_len[g:]
    levels = ([i32(qo0, device), i32(qo1, device)], [i32(kv0, device), i32(kv1, device)], [idx0, idx1],
              [last0, last1])
    ks, vs = [], []
    for gi, group in enumerate(groups):
        for r in group:
            ks.append(torch.cat([batch.ks[gi], batch.ks[g + r]]))
            vs.append(torch.cat([batch.vs[gi], batch.vs[g + r]]))
    return batch, levels, ks, vs


@task(8, "CascadeAttention")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_cascade_matches_float64(device, seed, kind):
    if device == "cpu":
        groups, h, hk, d, bs = [[0, 1, 2], [3, 4]], 4, 2, 32, 8
        suffix_kv = [5, 9, 1, 16, 3]
    else:                           # GPU_CASES' group, head size and page size, bf16: their compiled variant
        groups, h, hk, d, bs = [list(range(24)), list(range(24, 32))], 32, 8, 64, 16
        suffix_kv = [(37 * r) % 300 + 1 for r in range(32)]
    dtype = logic_dtype(device)
    suffix_q = [1] * len(suffix_kv) if kind == "decode" else [min(n, 1 + (5 * r) % 7) for r, n in enumerate(suffix_kv)]
    batch, levels, ks, vs = cascade_batch(groups, suffix_q, suffix_kv, h, hk, d, bs, dtype, device, seed)
    wrapper = L.CascadeAttention()
    wrapper.plan(*levels, h, hk, d, bs, causal=True)
    out, lse = wrapper.run(batch.q, batch.k_cache, batch.v_cache)
    exact_out, exact_lse = ref_attention(batch.q, suffix_q, ks, vs, causal=True)
    text = (f"{len(groups)} shared prefixes (groups {[len(g) for g in groups]}), suffix keys {suffix_kv}, "
            f"queries {suffix_q}, heads {h}/{hk}, head_dim {d}, block_size {bs}, {str(dtype).replace('torch.', '')}")
    hint = ("level 0: the queries of a group's requests against its shared prefix, no causal mask (every query "
            "comes after the prefix); last level: each request's suffix, causal; merge the two states")
    if dtype == torch.float32:
        atol, rtol, lse_tol = 2e-5, 1e-5, (2e-5, 1e-5)
    else:
        atol = lowp_atol(dtype, batch.q, suffix_q, ks, vs, exact_out, True)
        rtol, lse_tol = tolerances(dtype)[1], (1e-3, 1e-3)
    assert_close(out, exact_out, name="CascadeAttention.run output", dtype=dtype, case=text,
                 atol=atol, rtol=rtol, hint=hint)
    assert_close(lse, exact_lse, name="CascadeAttention.run lse", case=text, atol=lse_tol[0], rtol=lse_tol[1],
                 hint=hint)


@task(8, "CascadeAttention")
def test_cascade_bad_input(device, seed):
    batch, levels, _, _ = cascade_batch([[0, 1]], [1, 1], [3, 4], 4, 2, 16, 8, torch.float32, device, seed)
    w = L.CascadeAttention()
    expect_value_error(w.run, batch.q, batch.k_cache, batch.v_cache, what="run before plan")
    qo, kvp, idx, last = levels
    expect_value_error(w.plan, qo, kvp[:1], idx, last, 4, 2, 16, 8, what="lists of different lengths")
    bad_qo = [qo[0], i32([0, 1, 3], device)]
    expect_value_error(w.plan, bad_qo, kvp, idx, last, 4, 2, 16, 8, what="levels covering different query rows")
