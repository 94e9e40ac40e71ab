"""Grader of lesson 07: the telescoping cache (merge rule, index map) and its indexed matmul kernels.

References are written here, independently of the solution:

* the merge rule is replayed on span lengths and on float64 vectors straight from its definition
  (append; over capacity, merge the two oldest entries of the fullest level, ties to the lowest level;
  all levels single, the two oldest);
* the indexed products gather the buffer rows slot by slot into a float64 tensor and multiply;
  gradients come from float64 autograd through that gather.

On a CPU the kernels run in the Triton interpreter: shapes stay small. bf16 checks need a GPU (the
interpreter's bf16 tl.dot is broken).
"""

from __future__ import annotations

import pytest
import torch

from grader.checks import GradingError, assert_close, assert_unchanged, describe, expect_value_error, randn, task
from grader.edges import tile
from yaie.switch import LessonProxy

L = LessonProxy(7)

# Each task is two functions: its label names both (the summary prints one label per task).
TASK1 = "choose_merge and telescoping_step"
TASK2 = "telescoping_index_map and telescoping_buffer"
TASK3 = "indexed_qk_forward and indexed_pv_forward"
TASK4 = "indexed_qk_backward and indexed_pv_backward"

# (b, l, h, e, d, c, n): lengths, slots and buffer rows off the block sizes on purpose.
CPU_CASES = [
    (2, 7, 2, 3, 64, 5, 9),
    (1, 11, 1, 8, 128, 19, 13),     # more slots than buffer rows: repeated rows in one cache
    (1, 6, 3, 1, 64, 70, 40),       # c over one block of slots
]
GPU_CASES = [
    (2, 300, 4, 4, 128, 256, 500),
    (1, 517, 2, 8, 64, 100, 517),
    (3, 64, 8, 1, 128, 33, 90),
    (1, 200, 2, 2, 64, 300, 150),
]


def cases(device):
    return GPU_CASES if device == "cuda" else CPU_CASES


def case_id(case) -> str:
    b, l, h, e, d, c, n = case
    return f"b{b} l{l} h{h} e{e} d{d} c{c} n{n}"


# ---------------------------------------------------------------- references

def ref_merge_at(sizes: list[int]) -> int:
    """The rule, straight from its definition."""
    levels = [s.bit_length() - 1 for s in sizes]
    best_level, best_count = None, 1
    for level in sorted(set(levels)):
        count = levels.count(level)
        if count > best_count:
            best_level, best_count = level, count
    if best_level is None:
        return 0
    return min(i for i, lv in enumerate(levels) if lv == best_level)


def ref_spans(length: int, capacity: int) -> list[list[tuple[int, int]]]:
    """For every position, its cache as (start, end) token spans, oldest first."""
    cache: list[tuple[int, int]] = []
    out = []
    for p in range(length):
        cache.append((p, p + 1))
        if len(cache) > capacity:
            i = ref_merge_at([b - a for a, b in cache])
            cache[i:i + 2] = [(cache[i][0], cache[i + 1][1])]
        out.append(list(cache))
    return out


def ref_cache(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Entries as plain float64 means of their spans (x: [l, *feature])."""
    return torch.stack([x[a:b].double().mean(0) for a, b in spans])


def make_map(length: int, slots: int, n: int, seed: int, device) -> torch.Tensor:
    """A random map with repeated rows and unused slots (n and beyond) in every row."""
    gen = torch.Generator().manual_seed(seed)
    index_map = torch.randint(0, n, (length, slots), generator=gen)
    unused = torch.rand(length, slots, generator=gen) < 0.2
    index_map[unused] = n + torch.randint(0, 3, (int(unused.sum()),), generator=gen)
    return index_map.to(torch.int32).to(device)


def gather(buf: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """[b, l, c, h, d] float64: buffer rows slot by slot, zeros at unused slots."""
    b, n, h, d = buf.shape
    length, slots = index_map.shape
    out = torch.zeros(b, length, slots, h, d, dtype=torch.float64, device=buf.device)
    m = index_map.long()
    for j in range(slots):
        rows = m[:, j]
        used = rows < n
        out[:, used, j] = buf.double()[:, rows[used]]
    return out


def ref_qk(q, k, index_map):
    return torch.einsum("blhed,blchd->blhec", q.double(), gather(k, index_map))


def ref_pv(p, v, index_map):
    return torch.einsum("blhec,blchd->blhed", p.double(), gather(v, index_map))


def ref_grads(fn, x, buf, index_map, dout):
    leaves = [x.detach().double().requires_grad_(True), buf.detach().double().requires_grad_(True)]
    out = fn(leaves[0], leaves[1], index_map)
    return torch.autograd.grad(out, leaves, dout.double())


def tol(dtype, d):
    """(atol, rtol): sums of d products in float32, then one rounding to ``dtype``."""
    if dtype == torch.float32:
        return 5e-5, 1e-5
    if dtype == torch.float16:
        return 1e-2 * (d / 16) ** 0.5, 2e-3
    return 2e-2 * (d / 16) ** 0.5, 1.6e-2


def buffer_tol(dtype, d, index_map, n, e):
    """(atol, rtol) of a buffer gradient: :func:`tol`, with float32's atol grown by the square root of the most
    contributions one buffer row sums (its (position, slot) entries times the ``e`` query heads) over 32.

    A long-lived entry of a telescoping map collects thousands of float32 products, whose rounding adds up
    in an order the kernel picks; one missing or doubled contribution is still off by about its own size.
    """
    atol, rtol = tol(dtype, d)
    if dtype != torch.float32:
        return atol, rtol
    used = index_map[index_map < n].flatten().long()
    most = int(torch.bincount(used.cpu(), minlength=1).max()) * e if used.numel() else 0
    return atol * max(1.0, (most / 32) ** 0.5), rtol


def make_qk_inputs(case, dtype, device, seed):
    b, l, h, e, d, c, n = case
    q = randn(b, l, h, e, d, dtype=dtype, device=device, seed=seed)
    k = randn(b, n, h, d, dtype=dtype, device=device, seed=seed + 1)
    return q, k, make_map(l, c, n, seed + 2, device)


def make_pv_inputs(case, dtype, device, seed):
    b, l, h, e, d, c, n = case
    p = randn(b, l, h, e, c, dtype=dtype, device=device, seed=seed)      # nonzero at unused slots too
    v = randn(b, n, h, d, dtype=dtype, device=device, seed=seed + 1)
    return p, v, make_map(l, c, n, seed + 2, device)


def skip_bf16_on_cpu(dtype, device):
    if dtype == torch.bfloat16 and device != "cuda":
        pytest.skip("bf16 tl.dot is broken in the Triton interpreter: bf16 runs on a GPU")


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                           pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                                 ids=["fp32", "fp16", "bf16"])


# ---------------------------------------------------------------- task 1: the merge rule

@task(1, TASK1)
def test_choose_merge_follows_the_rule():
    for capacity in (1, 2, 3, 4, 7, 16):
        sizes: list[int] = []
        for step in range(150):
            sizes.append(1)
            if len(sizes) > capacity:
                want = ref_merge_at(sizes)
                got = L.choose_merge(list(sizes))
                if got != want:
                    raise GradingError(
                        f"choose_merge is wrong\n  case:     capacity {capacity}, step {step}, sizes {sizes}\n"
                        f"  expected: {want} (levels {[s.bit_length() - 1 for s in sizes]})\n  got:      {got}\n"
                        "  hint:     level = floor(log2(size)); merge the two oldest entries of the level with "
                        "the most entries (ties: the lowest level); no level with two entries: i = 0")
                sizes[want:want + 2] = [sizes[want] + sizes[want + 1]]
    expect_value_error(L.choose_merge, [4], what="a single entry (nothing to merge)")
    expect_value_error(L.choose_merge, [2, 0, 1], what="an entry of size 0")
    expect_value_error(L.choose_merge, [2, 1.5, 1], what="a size that is not an int (1.5)")
    expect_value_error(L.choose_merge, None, what="sizes None instead of a list of ints")
    expect_value_error(L.choose_merge, 3, what="sizes an int instead of a list of ints")


@task(1, TASK1)
@pytest.mark.parametrize("capacity,length,feature", [(3, 40, (5,)), (8, 60, (2, 4)), (1, 6, (3,))])
def test_step_matches_float64(seed, capacity, length, feature):
    x = randn(length, *feature, dtype=torch.float64, seed=seed)
    entries = torch.zeros(0, *feature, dtype=torch.float64)
    sizes = torch.zeros(0, dtype=torch.int64)
    for p, spans in enumerate(ref_spans(length, capacity)):
        passed, before = entries, entries.clone()
        entries, sizes = L.telescoping_step(passed, sizes, x[p], capacity)
        case = f"capacity {capacity}, feature {list(feature)}, after token {p}"
        assert_unchanged(before, passed, "entries")
        want_sizes = [b - a for a, b in spans]
        if not isinstance(sizes, torch.Tensor) or sizes.tolist() != want_sizes:
            raise GradingError(f"telescoping_step sizes are wrong\n  case:     {case}\n"
                               f"  expected: {want_sizes}\n  got:      "
                               f"{sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes}\n"
                               "  hint:     append a size-1 entry; over capacity, one pair becomes one entry "
                               "whose size is their sum, in the older one's place")
        assert_close(entries, ref_cache(x, spans), name="telescoping_step entries", case=case,
                     atol=1e-12, rtol=1e-12, dtype=torch.float64,
                     hint="the merged entry is the size-weighted mean (s_i x_i + s_j x_j) / (s_i + s_j)")


@task(1, TASK1)
def test_step_rejects_bad_input(seed):
    x = randn(3, 4, seed=seed)
    sizes = torch.ones(3, dtype=torch.int64)
    good = dict(entries=x, sizes=sizes, new_entry=x[0], capacity=4)
    for what, change in [
        ("capacity 0", dict(capacity=0)),
        ("capacity 2.5 (not an int)", dict(capacity=2.5)),
        ("capacity '4' (a string)", dict(capacity="4")),
        ("entries as a list, not a tensor", dict(entries=x.tolist())),
        ("new entry as an int, not a tensor", dict(new_entry=3)),
        ("more entries than the capacity", dict(capacity=2)),
        ("new entry of another shape", dict(new_entry=x[0, :3])),
        ("sizes of another length", dict(sizes=sizes[:2])),
        ("sizes as floats", dict(sizes=sizes.float())),
        ("a size of 0", dict(sizes=torch.tensor([1, 0, 1]))),
        ("mixed dtypes", dict(new_entry=x[0].double())),
    ]:
        expect_value_error(L.telescoping_step, **{**good, **change}, what=what)


# ---------------------------------------------------------------- task 2: the index map

@task(2, TASK2)
@pytest.mark.parametrize("length,capacity", [(50, 4), (33, 33), (90, 9), (5, 1), (10, 16)])
def test_index_map_matches_the_rule(length, capacity):
    index_map, starts, ends = L.telescoping_index_map(length, capacity)
    n = length + max(0, length - capacity)
    case = f"length {length}, capacity {capacity}"
    if tuple(index_map.shape) != (length, capacity) or index_map.dtype != torch.int32:
        raise GradingError(f"telescoping_index_map is wrong\n  case:     {case}\n  expected: int32 "
                           f"[{length}, {capacity}]\n  got:      {index_map.dtype} {list(index_map.shape)}")
    if starts.shape != (n,) or ends.shape != (n,):
        raise GradingError(f"telescoping_index_map is wrong\n  case:     {case}\n  expected: n = {n} buffer rows "
                           f"(l tokens + one per merge)\n  got:      starts {list(starts.shape)}, ends {list(ends.shape)}")
    if starts[:length].tolist() != list(range(length)) or ends[:length].tolist() != list(range(1, length + 1)):
        raise GradingError(f"telescoping_index_map is wrong\n  case:     {case}\n"
                           "  expected: buffer rows 0..l-1 are the tokens (starts[r] = r, ends[r] = r + 1)")
    for p, spans in enumerate(ref_spans(length, capacity)):
        row = index_map[p].tolist()
        got = [(int(starts[r]), int(ends[r])) for r in row[:len(spans)] if 0 <= r < n]
        if got != spans or any(r != n for r in row[len(spans):]):
            raise GradingError(
                f"telescoping_index_map is wrong\n  case:     {case}, position {p}\n"
                f"  expected: spans {spans} then unused slots = {n}\n  got:      row {row} -> spans {got}\n"
                "  hint:     replay the merge rule on spans; each merge makes one new buffer row "
                "(start of the older, end of the newer)")


@task(2, TASK2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("length,capacity", [(45, 5), (30, 2)])
def test_recurrent_equals_parallel(seed, dtype, length, capacity):
    """The buffer read through the map gives, at every position, the cache the merge rule holds."""
    x = randn(2, length, 3, 4, dtype=dtype, seed=seed)
    index_map, starts, ends = L.telescoping_index_map(length, capacity)
    buf = L.telescoping_buffer(x, starts, ends)
    n = starts.numel()
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != (2, n, 3, 4) or buf.dtype != dtype:
        raise GradingError(f"telescoping_buffer is wrong\n  expected: {dtype} [2, {n}, 3, 4]\n"
                           f"  got:      {getattr(buf, 'dtype', type(buf).__name__)} {list(getattr(buf, 'shape', []))}")
    atol, rtol = (1e-12, 1e-12) if dtype == torch.float64 else (2e-6, 1e-5)
    for p, spans in enumerate(ref_spans(length, capacity)):
        rows = index_map[p, :len(spans)].long()
        for b in range(2):
            assert_close(buf[b, rows], ref_cache(x[b], spans), name="cache read through the index map",
                         case=f"length {length}, capacity {capacity}, position {p}, batch {b}, {dtype}",
                         atol=atol, rtol=rtol,
                         hint="row r = (S[end] - S[start]) / (end - start) with S the prefix sums, in float32")


@task(2, TASK2)
def test_buffer_gradient(seed):
    x = randn(1, 20, 3, dtype=torch.float64, seed=seed).requires_grad_(True)
    _, starts, ends = L.telescoping_index_map(20, 3)
    weights = randn(1, starts.numel(), 3, dtype=torch.float64, seed=seed + 1)
    (grad,) = torch.autograd.grad((L.telescoping_buffer(x, starts, ends) * weights).sum(), x)
    want = torch.zeros(1, 20, 3, dtype=torch.float64)
    for r, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        want[:, a:b] += weights[:, r:r + 1] / (b - a)
    assert_close(grad, want, name="gradient of telescoping_buffer", atol=1e-12, rtol=1e-12,
                 hint="build the buffer from differentiable torch ops (cumsum, indexing), no .item() or loops over tensors")


@task(2, TASK2)
def test_buffer_and_map_reject_bad_input(seed):
    x = randn(1, 8, 4, seed=seed)
    _, starts, ends = L.telescoping_index_map(8, 3)
    expect_value_error(L.telescoping_index_map, 0, 4, what="length 0")
    expect_value_error(L.telescoping_index_map, 8, 0, what="capacity 0")
    expect_value_error(L.telescoping_index_map, 8, 2.5, what="capacity 2.5 (not an int)")
    expect_value_error(L.telescoping_index_map, 8.0, 3, what="length 8.0 (a float, not an int)")
    expect_value_error(L.telescoping_buffer, 5, starts, ends, what="x an int, not a tensor")
    expect_value_error(L.telescoping_buffer, x, starts.tolist(), ends, what="starts a list, not a tensor")
    expect_value_error(L.telescoping_buffer, x, starts.float(), ends.float(), what="float starts and ends")
    expect_value_error(L.telescoping_buffer, x, starts, ends[:-1], what="starts and ends of different lengths")
    expect_value_error(L.telescoping_buffer, x[:, :4], starts, ends, what="spans past the end of x")
    expect_value_error(L.telescoping_buffer, x[0, 0], starts, ends, what="x with one dim")


# ---------------------------------------------------------------- task 3: indexed matmul forward

@task(3, TASK3)
@DTYPES
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_qk_forward(device, seed, dtype, case_index):
    skip_bf16_on_cpu(dtype, device)
    case = cases(device)[case_index]
    q, k, index_map = make_qk_inputs(case, dtype, device, seed)
    if case_index == 1:
        q = q.transpose(2, 3).contiguous().transpose(2, 3)          # strided: heads after the group axis
    q0, k0 = q.clone(), k.clone()
    out = L.indexed_qk_forward(q, k, index_map)
    atol, rtol = tol(dtype, case[4])
    assert_close(out, ref_qk(q, k, index_map), name="indexed_qk_forward output", dtype=dtype, atol=atol, rtol=rtol,
                 case=f"{case_id(case)}, {describe(q=q, k=k)}",
                 hint="out[b,l,h,e,c] = q[b,l,h,e] . k[b, M[l,c], h]; slots with M >= n give 0; accumulate in float32")
    assert_unchanged(q0, q, "q")
    assert_unchanged(k0, k, "k")


@task(3, TASK3)
@DTYPES
@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_pv_forward(device, seed, dtype, case_index):
    skip_bf16_on_cpu(dtype, device)
    case = cases(device)[case_index]
    p, v, index_map = make_pv_inputs(case, dtype, device, seed)
    out = L.indexed_pv_forward(p, v, index_map)
    atol, rtol = tol(dtype, case[5])
    assert_close(out, ref_pv(p, v, index_map), name="indexed_pv_forward output", dtype=dtype, atol=atol, rtol=rtol,
                 case=f"{case_id(case)}, {describe(p=p, v=v)}",
                 hint="out[b,l,h,e] = sum_c p[b,l,h,e,c] * v[b, M[l,c], h]; an unused slot adds nothing "
                      "even where p is not 0 there")


@task(3, TASK3)
@pytest.mark.parametrize("which", ["qk", "pv"])
@pytest.mark.parametrize("extra", [0, 1], ids=["whole blocks", "one more"])
def test_forward_on_block_edges(device, seed, which, extra):
    """Positions and slots of whole blocks of the kernel's own (its ``_block_c``), then one more of each."""
    block_c = tile(7, 0, lambda m: m._block_c(1 << 20), 64)
    block_l = 32                                     # a multiple of every position block the kernels take
    case = (1, block_l + extra, 2, 2, 32, 2 * block_c + extra, 40)
    if which == "qk":
        x, buf, index_map = make_qk_inputs(case, torch.float32, device, seed)
        out, ref = L.indexed_qk_forward(x, buf, index_map), ref_qk(x, buf, index_map)
    else:
        x, buf, index_map = make_pv_inputs(case, torch.float32, device, seed)
        out, ref = L.indexed_pv_forward(x, buf, index_map), ref_pv(x, buf, index_map)
    atol, rtol = tol(torch.float32, case[4])
    assert_close(out, ref, name=f"indexed_{which}_forward output", dtype=torch.float32, atol=atol, rtol=rtol,
                 case=f"{case_id(case)}; blocks of {block_c} slots",
                 hint="slot and position counts that fill their last block exactly leave no partial block: "
                      "cdiv(c, BLOCK_C) blocks, masks on c and l, not on the block size")


@task(3, TASK3)
@pytest.mark.parametrize("columns", ["stable", "oldest-first"])
def test_qk_forward_on_a_telescoping_map(device, seed, columns):
    """The map the model uses: consecutive rows share most of their buffer rows."""
    length, capacity = (60, 24) if device == "cpu" else (700, 64)
    index_map, n = _telescoping_map(length, capacity)
    if columns == "stable":
        index_map = _stable_columns(index_map, n)
    index_map = index_map.to(device)
    q = randn(1, length, 2, 2, 64, device=device, seed=seed)
    k = randn(1, n, 2, 64, device=device, seed=seed + 1)
    out = L.indexed_qk_forward(q, k, index_map)
    assert_close(out, ref_qk(q, k, index_map), name="indexed_qk_forward output on a telescoping map",
                 dtype=torch.float32, atol=5e-5, rtol=1e-5, case=f"l {length}, c {capacity}, {columns} columns",
                 hint="each position has its own rows: load M[l, c-block] for every program")


def _telescoping_map(length, capacity):
    """The telescoping map built here, (map, n): task 3 must not depend on task 2."""
    spans_at = ref_spans(length, capacity)
    rows_of: dict[tuple[int, int], int] = {(t, t + 1): t for t in range(length)}
    for spans in spans_at:
        for span in spans:
            rows_of.setdefault(span, len(rows_of))
    n = len(rows_of)
    index_map = torch.full((length, capacity), n, dtype=torch.int32)
    for p, spans in enumerate(spans_at):
        index_map[p, :len(spans)] = torch.tensor([rows_of[s] for s in spans], dtype=torch.int32)
    return index_map, n


def _stable_columns(index_map: torch.Tensor, n: int) -> torch.Tensor:
    """The same caches with every entry kept in one column while it lives (a new one takes a freed column):
    the order the model uses, in which neighbouring positions agree in almost every column."""
    out = torch.full_like(index_map, n)
    columns = [n] * index_map.shape[1]
    for p, row in enumerate(index_map.tolist()):
        alive = {r for r in row if r < n}
        columns = [r if r in alive else n for r in columns]
        free = [j for j, r in enumerate(columns) if r == n]
        for r, j in zip([r for r in row if r < n and r not in columns], free):
            columns[j] = r
        out[p] = torch.tensor(columns, dtype=index_map.dtype)
    return out


@task(3, TASK3)
def test_forward_rejects_bad_input(device, seed):
    q, k, index_map = make_qk_inputs((1, 4, 2, 2, 16, 3, 6), torch.float32, device, seed)
    p = randn(1, 4, 2, 2, 3, device=device, seed=seed)
    bad_map = index_map.clone()
    bad_map[1, 2] = -1
    for fn, x, what_x in ((L.indexed_qk_forward, q, "q"), (L.indexed_pv_forward, p, "p")):
        for what, args in [
            ("a negative map entry", (x, k, bad_map)),
            ("map with fewer rows than positions", (x, k, index_map[:3])),
            ("buffer with another head count", (x, k[:, :, :1], index_map)),
            ("buffer with another batch", (x, torch.cat([k, k]), index_map)),
            (f"{what_x} is 4-D", (x[:, :, 0], k, index_map)),
            ("mixed dtypes", (x, k.double() if device == "cpu" else k.half(), index_map)),
            ("a float map", (x, k, index_map.float())),
        ]:
            expect_value_error(fn, *args, what=f"{fn.__name__}: {what}")
    expect_value_error(L.indexed_qk_forward, q, k[..., :8], index_map, what="head_dim of q differs from k")
    expect_value_error(L.indexed_pv_forward, p[..., :2], k, index_map, what="p's last dim is not c")


# ---------------------------------------------------------------- task 4: backward and autograd

@task(4, TASK4)
@DTYPES
@pytest.mark.parametrize("case_index", [0, 1])
def test_qk_backward(device, seed, dtype, case_index):
    skip_bf16_on_cpu(dtype, device)
    case = cases(device)[case_index]
    q, k, index_map = make_qk_inputs(case, dtype, device, seed)
    dout = randn(*q.shape[:4], case[5], dtype=dtype, device=device, seed=seed + 5)
    dq, dk = L.indexed_qk_backward(dout, q, k, index_map)
    want_dq, want_dk = ref_grads(ref_qk, q, k, index_map, dout)
    text = f"{case_id(case)}, {describe(q=q, k=k, dout=dout)}"
    atol, rtol = tol(dtype, case[5])
    assert_close(dq, want_dq, name="indexed_qk_backward dq", dtype=dtype, atol=atol, rtol=rtol, case=text,
                 hint="dq[l,e] = sum_c dout[l,e,c] * k[M[l,c]]: the P V kernel with p = dout")
    atol, rtol = tol(dtype, 4 * case[3])
    assert_close(dk, want_dk, name="indexed_qk_backward dk", dtype=dtype, atol=atol, rtol=rtol, case=text,
                 hint="many (l, c) slots hit one buffer row: add their dout^T q into it with float32 atomics "
                      "(tl.atomic_add), never a plain store; rows no slot uses get 0; unused slots add nothing")


@task(4, TASK4)
@DTYPES
@pytest.mark.parametrize("case_index", [0, 2])
def test_pv_backward(device, seed, dtype, case_index):
    skip_bf16_on_cpu(dtype, device)
    case = cases(device)[case_index]
    p, v, index_map = make_pv_inputs(case, dtype, device, seed)
    dout = randn(*p.shape[:4], case[4], dtype=dtype, device=device, seed=seed + 5)
    dp, dv = L.indexed_pv_backward(dout, p, v, index_map)
    want_dp, want_dv = ref_grads(ref_pv, p, v, index_map, dout)
    text = f"{case_id(case)}, {describe(p=p, v=v, dout=dout)}"
    atol, rtol = tol(dtype, case[4])
    assert_close(dp, want_dp, name="indexed_pv_backward dp", dtype=dtype, atol=atol, rtol=rtol, case=text,
                 hint="dp[l,e,c] = dout[l,e] . v[M[l,c]]: the Q K^T kernel with q = dout; 0 at unused slots")
    atol, rtol = tol(dtype, 4 * case[3])
    assert_close(dv, want_dv, name="indexed_pv_backward dv", dtype=dtype, atol=atol, rtol=rtol, case=text,
                 hint="dv[r] = sum over slots with M[l,c] = r of p[l,:,c]^T dout[l]: atomic adds in float32")


@task(4, TASK4)
@pytest.mark.parametrize("which", ["qk", "pv"])
def test_backward_on_block_edges(device, seed, which):
    """The backward kernels over positions and slots of whole blocks (the module's ``_block_c``)."""
    block_c = tile(7, 0, lambda m: m._block_c(1 << 20), 64)
    case = (1, 32, 2, 2, 32, 2 * block_c, 40)
    text = f"{case_id(case)}; blocks of {block_c} slots"
    hint = ("slot and position counts that fill their last block exactly leave no partial block; rows no slot "
            "uses get 0, and every slot adds into its row once")
    if which == "qk":
        x, buf, index_map = make_qk_inputs(case, torch.float32, device, seed)
        dout = randn(*x.shape[:4], case[5], device=device, seed=seed + 5)
        got = L.indexed_qk_backward(dout, x, buf, index_map)
        want = ref_grads(ref_qk, x, buf, index_map, dout)
        names, sizes = ("dq", "dk"), (case[5], 4 * case[3])
    else:
        x, buf, index_map = make_pv_inputs(case, torch.float32, device, seed)
        dout = randn(*x.shape[:4], case[4], device=device, seed=seed + 5)
        got = L.indexed_pv_backward(dout, x, buf, index_map)
        want = ref_grads(ref_pv, x, buf, index_map, dout)
        names, sizes = ("dp", "dv"), (case[4], 4 * case[3])
    for name, g, w, size in zip(names, got, want, sizes):
        atol, rtol = tol(torch.float32, size)
        assert_close(g, w, name=f"indexed_{which}_backward {name}", dtype=torch.float32, atol=atol, rtol=rtol,
                     case=text, hint=hint)


@task(4, TASK4)
@pytest.mark.parametrize("which", ["qk", "pv"])
@pytest.mark.parametrize("extra", [0, 1], ids=["whole blocks", "one more"])
def test_backward_on_row_block_edges(device, seed, which, extra):
    """A random map whose rows fill whole blocks of a backward that goes by buffer rows (the reference's
    ``_rows_blocks``: rows per program, map entries per chunk): each of ``2 x rows`` buffer rows held by
    exactly one chunk of (position, slot) pairs; then one more: a slot that holds a last row at some
    positions (a partial block and chunk) and is unused at the others."""
    e, d = 2, 32
    block_r = tile(7, 0, lambda m: m._rows_blocks(e, d)[0], 16)
    block_k = tile(7, 0, lambda m: m._rows_blocks(e, d)[1], 16)
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * block_r
    slots = 32 if device == "cpu" else 64
    length = rows * block_k // slots
    index_map = torch.arange(rows).repeat_interleave(block_k)[torch.randperm(rows * block_k, generator=gen)]
    index_map = index_map.reshape(length, slots)
    n = rows + extra
    if extra:
        last = torch.where(torch.rand(length, 1, generator=gen) < 0.5, n - 1, n + 1)
        index_map = torch.cat([index_map, last], dim=1)
    index_map = index_map.to(torch.int32).to(device)
    case = (1, length, 2, e, d, index_map.shape[1], n)
    make = make_qk_inputs if which == "qk" else make_pv_inputs
    x, buf, _ = make(case, torch.float32, device, seed)
    fn, ref = (L.indexed_qk_backward, ref_qk) if which == "qk" else (L.indexed_pv_backward, ref_pv)
    dout = randn(*x.shape[:4], case[5] if which == "qk" else d, device=device, seed=seed + 5)
    got = fn(dout, x, buf, index_map)
    want = ref_grads(ref, x, buf, index_map, dout)
    names = ("dq", "dk") if which == "qk" else ("dp", "dv")
    for name, g, w, size in zip(names, got, want, (case[5] if which == "qk" else d, 4 * e)):
        atol, rtol = tol(torch.float32, size)
        assert_close(g, w, name=f"indexed_{which}_backward {name}", dtype=torch.float32, atol=atol, rtol=rtol,
                     case=f"{case_id(case)}; {rows} rows of {block_k} slots each, in blocks of {block_r}",
                     hint="every row gets each of its slots once: a block of rows whose entries fill their last "
                          "chunk exactly leaves no partial chunk, and a row past the last whole block still counts")


@task(4, TASK4)
def test_autograd_through_both_products(device, seed):
    """scores -> softmax -> weights x values: gradients of q, the key buffer and the value buffer."""
    b, l, h, e, d, c, n = cases(device)[0]
    q, k, index_map = make_qk_inputs((b, l, h, e, d, c, n), torch.float32, device, seed)
    v = randn(b, n, h, d, device=device, seed=seed + 7)
    dout = randn(b, l, h, e, d, device=device, seed=seed + 8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = L.indexed_pv(torch.softmax(L.indexed_qk(leaves[0], leaves[1], index_map), -1), leaves[2], index_map)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out = ref_pv(torch.softmax(ref_qk(ref_leaves[0], ref_leaves[1], index_map), -1), ref_leaves[2], index_map)
    want = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, g, w in zip(("q", "key buffer", "value buffer"), got, want):
        assert_close(g, w, name=f"gradient of {name} through indexed_qk and indexed_pv", dtype=torch.float32,
                     atol=5e-4, rtol=1e-4, case=case_id(cases(device)[0]),
                     hint="the given IndexedQK/IndexedPV call your tasks 3 and 4 with dout made contiguous: "
                          "check that each backward returns the gradient of the input in its position")


@task(4, TASK4)
@pytest.mark.parametrize("columns", ["stable", "oldest-first"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp32", "bf16"])
def test_backward_on_a_telescoping_map(device, seed, columns, dtype):
    """Both backwards on the maps a model trains with: long runs of positions share a slot's buffer row."""
    skip_bf16_on_cpu(dtype, device)
    length, capacity, e, d = (60, 24, 2, 32) if device == "cpu" else (1500, 64, 4, 128)
    index_map, n = _telescoping_map(length, capacity)
    if columns == "stable":
        index_map = _stable_columns(index_map, n)
    index_map = index_map.to(device)
    case = f"l {length}, c {capacity}, n {n}, e {e}, d {d}, {columns} columns, {dtype}"
    q = randn(1, length, 2, e, d, dtype=dtype, device=device, seed=seed)
    k = randn(1, n, 2, d, dtype=dtype, device=device, seed=seed + 1)
    d_scores = randn(1, length, 2, e, capacity, dtype=dtype, device=device, seed=seed + 2)
    d_out = randn(1, length, 2, e, d, dtype=dtype, device=device, seed=seed + 3)
    for name, fn, ref, x, dout in (("indexed_qk_backward", L.indexed_qk_backward, ref_qk, q, d_scores),
                                   ("indexed_pv_backward", L.indexed_pv_backward, ref_pv, d_scores, d_out)):
        dx, dbuf = fn(dout, x, k, index_map)
        want_dx, want_dbuf = ref_grads(ref, x, k, index_map, dout)
        atol, rtol = tol(dtype, d)
        assert_close(dx, want_dx, name=f"{name}, gradient of its first input", dtype=dtype, atol=atol, rtol=rtol,
                     case=case, hint="the same gather as the forward, with dout in place of the first input")
        atol, rtol = buffer_tol(dtype, d, index_map, n, e)
        assert_close(dbuf, want_dbuf, name=f"{name}, gradient of the buffer", dtype=dtype, atol=atol, rtol=rtol,
                     case=case, hint="a buffer row gets the sum over every (position, slot) that holds it, over "
                                     "many positions: every one must be added exactly once")


@task(4, TASK4)
def test_backward_rejects_bad_input(device, seed):
    q, k, index_map = make_qk_inputs((1, 4, 2, 2, 16, 3, 6), torch.float32, device, seed)
    p = randn(1, 4, 2, 2, 3, device=device, seed=seed)
    expect_value_error(L.indexed_qk_backward, p[..., :2], q, k, index_map, what="dout of the scores with c - 1 slots")
    expect_value_error(L.indexed_pv_backward, q[..., :8], p, k, index_map, what="dout of the output with d / 2")
    expect_value_error(L.indexed_pv_backward, 1.0, p, k, index_map, what="dout a float, not a tensor")
    bad_map = index_map.clone()
    bad_map[0, 0] = -3
    expect_value_error(L.indexed_qk_backward, p, q, k, bad_map, what="a negative map entry")
