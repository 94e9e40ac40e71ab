"""Write lessons/05_radix_flashinfer/05c_plan_run_cascade.ipynb (stored without outputs).

    python scripts/build_notebook_05c.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 05, part 2: plan/run attention, merging attention states, cascade attention

An engine step is a **ragged batch**: a few requests prefill a chunk of new tokens (tens to thousands of
queries each), most decode one token. Lesson 04 handles the decodes, part 1's prefix-prefill kernel the
prefills: two kernels, two launches per layer, each leaving part of the GPU idle while the other's work waits.
FlashInfer's answer has three ideas, and you will build all three in `yaie/kernels/flashinfer.py`:

| task | what | idea |
|---|---|---|
| 5 | `merge_state_reference`, `merge_state`, `merge_states` | attention over disjoint key sets combines **exactly** by log-sum-exp |
| 6 | `paged_attention_reference_csr`, `FlashInferPagedAttention.plan/run` | describe the batch in compressed sparse rows; **plan** the work once per step on the host, **run** it for every layer in one launch |
| 7 | `ragged_attention_reference`, `FlashInferAttention.plan/run` | the same over contiguous ragged K/V |
| 8 | `CascadeAttention.plan/run` | a prefix shared by many requests is read **once** for all of them, then merged |

No GPU? Everything runs in the Triton interpreter on small shapes (float32/float16). Grade with
`pytest grader/lesson05 -k "task5 or task6 or task7 or task8"` or the last cell.
""")

code(r"""
# The interpreter must be switched on before triton is imported (a no-op on a GPU machine).
from yaie.device import prepare_triton, default_device
interpreted = prepare_triton()

import json
from pathlib import Path

import ipywidgets as widgets
import matplotlib.pyplot as plt
import matplotlib.patches as patches
import numpy as np
import torch

from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe
FI = LessonProxy(5, 2)       # your plan/run module, or the reference if YAIE_SOLUTIONS says so
device = default_device()
print("Triton interpreter:", interpreted, "| device:", device, "|", describe())
""")

md(r"""
## 1. The batch as compressed sparse rows

Queries are packed token by token, `q: [total_q, num_heads, head_dim]`, and the paged cache is lesson 03's
`[num_blocks, block_size, num_kv_heads, head_dim]`. Four small arrays say who owns what:

```
qo_indptr        [batch + 1]   request b owns query rows   qo_indptr[b] : qo_indptr[b+1]
kv_indptr        [batch + 1]   request b owns page ids     kv_indices[kv_indptr[b] : kv_indptr[b+1]]
kv_indices       [pages]       physical block ids, in token order
kv_last_page_len [batch]       tokens in the last page (1..block_size; 0 without pages)
```

Unlike lesson 04's padded `block_tables [batch, max_blocks]`, nothing is padded: a batch of 63 short requests
and one of 100k tokens costs what its pages cost. Below: a real step of five requests (two decodes, a
prefill chunk over a cached prefix, a fresh prompt, and a request whose queries have no keys yet; causal
attention needs keys, so this one is planned without the causal mask).
""")

code(r"""
block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
q_lens = [1, 6, 1, 5, 2]
kv_lens = [9, 14, 3, 5, 0]
names = ["decode", "prefill chunk over a prefix", "decode", "fresh prompt", "no keys yet"]

gen = torch.Generator().manual_seed(0)
pages = [-(-n // block_size) for n in kv_lens]
num_blocks = sum(pages) + 3
order = torch.randperm(num_blocks, generator=gen).tolist()      # pages scattered over the cache
k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
v_cache = torch.full_like(k_cache, float("nan"))
kv_indices, last = [], []
for n, p in zip(kv_lens, pages):
    for j in range(p):
        block = order.pop()
        kv_indices.append(block)
        rows = min(block_size, n - j * block_size)
        k_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
        v_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    last.append(n - (p - 1) * block_size if p else 0)
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
qo_indptr = i32(np.concatenate([[0], np.cumsum(q_lens)]).tolist())
kv_indptr = i32(np.concatenate([[0], np.cumsum(pages)]).tolist())
kv_indices, kv_last_page_len = i32(kv_indices), i32(last)
q = torch.randn(int(qo_indptr[-1]), num_heads, head_dim, generator=gen)
print("qo_indptr       ", qo_indptr.tolist())
print("kv_indptr       ", kv_indptr.tolist())
print("kv_indices      ", kv_indices.tolist())
print("kv_last_page_len", kv_last_page_len.tolist())
""")

code(r"""
def draw_csr():
    fig, ax = plt.subplots(figsize=(11, 3.4))
    colors = plt.cm.tab10.colors
    y = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        ids = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].tolist()
        for j, page in enumerate(ids):
            used = block_size if j < len(ids) - 1 else last[b]
            ax.add_patch(patches.Rectangle((j * block_size, y), used, 0.8, color=colors[b], alpha=0.6))
            ax.add_patch(patches.Rectangle((j * block_size, y), block_size, 0.8, fill=False, lw=1))
            ax.text(j * block_size + block_size / 2, y + 0.4, f"page {page}", ha="center", va="center", fontsize=7)
        # the request's queries are its LAST q_len tokens (causal); mark them
        for t in range(kl - ql, kl):
            ax.plot(t + 0.5, y + 0.9, "v", color="black", ms=4)
        ax.text(-0.5, y + 0.4, f"req {b}: q_len {ql}, kv_len {kl} ({names[b]})", ha="right", va="center", fontsize=8)
        y -= 1
    ax.set_xlim(-22, max(kv_lens) + 2)
    ax.set_ylim(y + 0.5, 1.2)
    ax.set_xlabel("token position (triangles: the query tokens; empty part of a box: NaN slots of a last page)")
    ax.set_yticks([])
    ax.set_title("the CSR page table of one engine step")
    plt.tight_layout()
    plt.show()

draw_csr()
""")

md(r"""
## 2. Attention states and their merge (task 5)

The attention of one query over a set of keys $I$ is summarised by its **state** $(o_I, \mathrm{lse}_I)$:

$$o_I = \sum_{j\in I} \frac{e^{s_j}}{\sum_{i\in I} e^{s_i}}\, v_j, \qquad \mathrm{lse}_I = \log \sum_{j\in I} e^{s_j}$$

(natural log, scores already scaled). For two disjoint sets $A$ and $B$:

$$\mathrm{lse}_{A\cup B} = \log\left(e^{\mathrm{lse}_A} + e^{\mathrm{lse}_B}\right), \qquad
o_{A\cup B} = e^{\mathrm{lse}_A - \mathrm{lse}_{A\cup B}}\, o_A + e^{\mathrm{lse}_B - \mathrm{lse}_{A\cup B}}\, o_B$$

Compute it with the larger lse subtracted first (as the online softmax does). An empty set has
$\mathrm{lse} = -\infty$: its weight is 0 and its output is never read (it may be NaN), so it is the
**identity** of the merge. The merge is commutative and associative: cut a query's keys into any pieces,
compute them anywhere, merge in any order. Layout here: `o [n, num_heads, head_dim]`, `lse` float32
`[n, num_heads]`.
""")

code(r"""
def attention_state(q, k, v):
    # float64 state of queries q [n, h, d] over keys k, v [m, h, d]
    s = torch.einsum("nhd,mhd->nhm", q.double(), k.double()) * q.shape[-1] ** -0.5
    return torch.einsum("nhm,mhd->nhd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1)

qs, ks, vs = torch.randn(3, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
full_o, full_lse = attention_state(qs, ks, vs)
o_a, lse_a = attention_state(qs, ks[:7], vs[:7])        # keys 0..6
o_b, lse_b = attention_state(qs, ks[7:], vs[7:])        # keys 7..19

def check_merge():
    o, lse = FI.merge_state(o_a.float().to(device), lse_a.float().to(device), o_b.float().to(device),
                            lse_b.float().to(device))
    print("merged vs full attention: max |difference|", float((o.cpu().double() - full_o).abs().max()),
          "| lse", float((lse.cpu().double() - full_lse).abs().max()))
    empty = torch.full_like(lse_a, float("-inf")).float().to(device)
    same, _ = FI.merge_state(o_a.float().to(device), lse_a.float().to(device), torch.full_like(o_a, float("nan")).float().to(device), empty)
    print("merge with an empty state (its output NaN) changes nothing:", torch.allclose(same.cpu().double(), o_a, atol=1e-6))

try_it(check_merge)
""")

md(r"""
Move the sliders: two one-dimensional "outputs" $o_A$, $o_B$ with their lse. The merged output slides between
them with weight $\sigma(\mathrm{lse}_A - \mathrm{lse}_B)$; at $\mathrm{lse}_B = -\infty$ (the leftmost
position) it is exactly $o_A$.
""")

code(r"""
def merge_plot(lse_a=0.0, lse_b=0.0, o_a=-1.0, o_b=1.0):
    lse_b_eff = -np.inf if lse_b <= -8 else lse_b
    top = max(lse_a, lse_b_eff)
    wa, wb = np.exp(lse_a - top), (0.0 if np.isinf(lse_b_eff) else np.exp(lse_b_eff - top))
    lse = top + np.log(wa + wb)
    o = (wa * o_a + wb * o_b) / (wa + wb)
    fig, ax = plt.subplots(figsize=(7, 1.8))
    ax.axhline(0, color="gray", lw=0.5)
    for x, label, c in ((o_a, "o_A", "tab:blue"), (o_b, "o_B", "tab:orange"), (o, "merged o", "black")):
        ax.plot([x], [0], "o", color=c, ms=10)
        ax.annotate(label, (x, 0.02), ha="center", fontsize=9)
    ax.set_xlim(-2.2, 2.2)
    ax.set_yticks([])
    ax.set_title(f"weights {wa / (wa + wb):.3f} / {wb / (wa + wb):.3f}, merged lse = {lse:.3f}"
                 + ("  (B empty: the identity)" if np.isinf(lse_b_eff) else ""))
    plt.show()

widgets.interact(merge_plot, lse_a=(-8.0, 8.0, 0.25), lse_b=(-8.0, 8.0, 0.25), o_a=(-2.0, 2.0, 0.1),
                 o_b=(-2.0, 2.0, 0.1));
""")

md(r"""
## 3. Plan once, run every layer (task 6)

`plan` reads the CSR arrays on the host (one copy each: that is its job) and writes a **work list**: one
item per (tile of query rows, range of keys). The query heads that share a KV head are packed into a tile's
rows, so one K/V tile serves the whole group: a decode (1 token x `group` heads) fits a **narrow** tile of
16 rows; a prefill chunk fills **wide** tiles (128 rows on a GPU, 32 in the interpreter). Causal tiles stop
at their last query's position. When the tiles are too few to fill the GPU (about 2 programs per
multiprocessor), long key ranges are cut into chunks (**split-KV**) whose states are merged afterwards (task 5).

The order of the work list is a schedule: programs start in that order. Prefill tiles are compute bound,
decode tiles memory bound; the reference interleaves the two kinds when the prefills are most of the work
(the decodes' reads then hide under the prefills' matrix products), and otherwise sorts longest first, so a
long item never ends up alone in the last wave.

`run(q, k_cache, v_cache)` does no host work but checks and launches: ONE kernel over the
(work item, KV head) pairs, each program taking the narrow or the wide branch its item asks for (+ one merge
launch if something was split). The engine plans once per step and runs it for each of its layers, so the
plan's host time counts once per step: build the work list with array operations, not Python loops.
""")

code(r"""
wrapper = FI.FlashInferPagedAttention()

def plan_and_run(chunk=None):
    # request 4 has queries but no keys, which causal attention does not allow: this batch is planned
    # without the causal mask (every query sees all of its request's keys)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_heads, num_kv_heads, head_dim,
                 block_size, causal=False, kv_chunk_size=chunk)
    out, lse = wrapper.run(q.to(device), k_cache.to(device), v_cache.to(device))
    ref_out, ref_lse = FI.paged_attention_reference_csr(q.double(), k_cache.double(), v_cache.double(), qo_indptr,
                                                        kv_indptr, kv_indices, kv_last_page_len, causal=False)
    print(f"kv_chunk_size={chunk}: max |out - float64 reference| = {float((out.cpu().double() - ref_out).abs().max()):.2e};"
          f" rows without keys: lse {lse[-1].tolist()}")
    return out

try_it(lambda: plan_and_run(None))
try_it(lambda: plan_and_run(4))
""")

md(r"""
The work list of a plan as a picture: one bar per program row (work item; every KV head runs it), along
the keys it reads; narrow (decode) tiles and wide (prefill) tiles in different colours, the chunks of a
split tile hatched. The picture reads the reference's work list, `wrapper._plan.host_work` (fields: first
query row, query tokens, first query's position (2**30 without a causal mask), first key, end key, page-table
offset, which partial state of its rows it writes (-1: the only one, straight to the output), offset into the
table of partial rows) and `wrapper._plan.narrow`; if your plan keeps its work list another way, adapt
`draw_work` to it.
""")

code(r"""
def draw_work(chunk=None, causal=True):
    lens_q = [1, 6, 1, 5, 0]           # causal needs q_len <= kv_len: the last request is left out here
    qo = i32(np.concatenate([[0], np.cumsum(lens_q)]).tolist())
    w = FI.FlashInferPagedAttention()
    w.plan(qo, kv_indptr, kv_indices, kv_last_page_len, num_heads, num_kv_heads, head_dim, block_size,
           causal=causal, kv_chunk_size=chunk)
    plan = getattr(w, "_plan", None)
    if not (hasattr(plan, "host_work") and hasattr(plan, "narrow")):
        print("your plan keeps its work list another way: adapt draw_work to read it")
        return
    items, narrow = plan.host_work, plan.narrow.tolist()
    starts = qo.tolist()
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(items) + 1.2))
    for i, (it, nar) in enumerate(zip(items, narrow)):
        q0, n, pos0, lo, hi, base, part, rows_at = it
        req = max(b for b in range(len(lens_q)) if starts[b] <= q0)
        ax.barh(i, max(hi - lo, 0.15), left=lo, color="tab:blue" if nar else "tab:orange",
                hatch="//" if part >= 0 else None, edgecolor="black")
        ax.text(max(hi, lo) + 0.3, i, f"req {req}, queries {q0}..{q0 + n - 1}" + (f", chunk {part + 1}" if part >= 0 else ""),
                va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("key position within the request")
    ax.set_ylabel("program (work item)")
    ax.set_title(f"work list: {len(items)} items x {num_kv_heads} KV heads = {len(items) * num_kv_heads} programs "
                 "(blue: narrow/decode tile, orange: wide/prefill tile, hatched: a split chunk)", fontsize=9)
    ax.set_xlim(0, max(kv_lens) + 12)
    plt.tight_layout()
    plt.show()

if try_it(lambda: draw_work() or True):
    widgets.interact(draw_work, chunk=widgets.Dropdown(options=[None, 3, 4, 8], value=None), causal=True);
""")

md(r"""
## 4. The same over contiguous K/V (task 7)

`FlashInferAttention` plans the same work list over K/V tensors `[total_kv, num_kv_heads, head_dim]` where
request `b` owns rows `kv_indptr[b]:kv_indptr[b+1]`: key `t` is row `kv_indptr[b] + t`, no page lookup. (The
reference runs both through one kernel, with the page lookup switched by a compile-time flag.)
""")

code(r"""
def check_ragged():
    k_rows = torch.randn(sum(kv_lens), num_kv_heads, head_dim)
    v_rows = torch.randn(sum(kv_lens), num_kv_heads, head_dim)
    kv_off = i32(np.concatenate([[0], np.cumsum(kv_lens)]).tolist())
    w = FI.FlashInferAttention()
    w.plan(qo_indptr, kv_off, num_heads, num_kv_heads, head_dim, causal=False, device=device)
    out, _ = w.run(q.to(device), k_rows.to(device), v_rows.to(device))
    ref, _ = FI.ragged_attention_reference(q.double(), k_rows.double(), v_rows.double(), qo_indptr, kv_off)
    print("FlashInferAttention vs float64: max |difference|", float((out.cpu().double() - ref).abs().max()))

try_it(check_ragged)
""")

md(r"""
## 5. Cascade attention (task 8)

64 requests sample from one 8k-token prompt (or share a system prompt). A decode step of lesson 04 reads the
prompt's K/V **64 times**, once per request: decode is memory bound, so that is 64x the time. Cascade
attention splits every request's keys into two levels:

* **level 0**, the shared prefix: the queries of ALL the requests that share it form one multi-query
  "request" (`qo_indptr = [0, 64]`) over the prefix pages, with no causal mask (every query comes after the
  prefix). The prefix is read once, and 64 queries x `group` heads make a real matrix product of it;
* **level 1**, each request's own pages, as in section 3 (causal);
* the two states merged by task 5.

The picture counts the K/V bytes one decode step reads (one layer, bf16, 8 KV heads of 128).
""")

code(r"""
def bytes_saved(batch=64, prefix=8192, own=256):
    per_token = 2 * 8 * 128 * 2                    # K and V, 8 KV heads, head_dim 128, bf16
    plain = batch * (prefix + own) * per_token
    cascade = (prefix + batch * own) * per_token
    fig, ax = plt.subplots(figsize=(7, 2.2))
    ax.barh(["lesson 04: prefix per request", "cascade: prefix once"], [plain / 1e6, cascade / 1e6],
            color=["tab:gray", "tab:green"])
    ax.set_xlabel("MB of K/V read per decode step (one layer)")
    ax.set_title(f"batch {batch}, shared prefix {prefix}, {own} own tokens each: {plain / cascade:.1f}x fewer bytes")
    plt.tight_layout()
    plt.show()

widgets.interact(bytes_saved, batch=widgets.IntSlider(value=64, min=2, max=256), prefix=widgets.IntSlider(
    value=8192, min=256, max=32768, step=256), own=widgets.IntSlider(value=256, min=16, max=4096, step=16));
""")

code(r"""
def check_cascade():
    # 3 requests share a 2-page prefix (8 tokens); each has a suffix of its own; decode step (1 query each)
    prefix_pages, own = [0, 1], [[2, 3], [4], [5, 6]]
    own_lens = [6, 2, 7]
    kc = torch.randn(7, block_size, num_kv_heads, head_dim)
    vc = torch.randn(7, block_size, num_kv_heads, head_dim)
    qq = torch.randn(3, num_heads, head_dim)
    levels = ([i32([0, 3]), i32([0, 1, 2, 3])],                                   # qo_indptr per level
              [i32([0, 2]), i32([0, 2, 3, 5])],                                   # kv_indptr per level
              [i32(prefix_pages), i32([p for t in own for p in t])],              # kv_indices per level
              [i32([block_size]), i32([n - (len(t) - 1) * block_size for n, t in zip(own_lens, own)])])
    cascade = FI.CascadeAttention()
    cascade.plan(*levels, num_heads, num_kv_heads, head_dim, block_size, causal=True)
    out, _ = cascade.run(qq.to(device), kc.to(device), vc.to(device))
    # the same thing without the cascade: every request's pages = prefix pages + its own
    flat = [p for t in own for p in prefix_pages + t]
    ref, _ = FI.paged_attention_reference_csr(qq.double(), kc.double(), vc.double(), i32([0, 1, 2, 3]),
                                              i32([0, 4, 7, 11]), i32(flat),
                                              levels[3][1], causal=True)
    print("cascade vs per-request attention: max |difference|", float((out.cpu().double() - ref).abs().max()))

try_it(check_cascade)
""")

md(r"""
## 6. On the GPU

`python -m yaie.bench.lesson05_plan_run` (and `scripts/gpu_lesson05_plan_run.sh`) times (a) a mixed step of
32 decodes at 4k plus 2 prefill chunks of 1k over 2k cached tokens: plan/run in ONE launch against lesson 04 +
the prefix-prefill kernel as two launches, and (b) cascade decode of 64 requests sharing an 8k prefix against
lesson 04. The committed results, if any:
""")

code(r"""
results = sorted(Path("../../bench/results").glob("lesson05_plan_run_*.md"))
for path in results:
    print(path.read_text()[:4000])
if not results:
    print("(run the benchmark on a GPU to fill bench/results/lesson05_plan_run_<gpu>.md)")
""")

md(r"""
## Exercises

1. Implement tasks 5-8. `pytest grader/lesson05 -k task6` while you work on the kernel.
2. Why does the merge subtract the larger lse before `exp`? Give two lse values for which the naive
   `exp(lse_a) + exp(lse_b)` overflows float32, and two for which it underflows to 0 while the true answer
   is finite.
3. Prove that the merge is associative. Then explain why that is what makes split-KV and cascade exact, and
   not approximations.
4. GQA packing: with 32 query heads over 8 KV heads, how many rows of a narrow tile does a decode use, and
   how many bytes of K/V would a kernel read per decode if each program took ONE query head instead?
5. Sorted longest first (`config={"order": "longest"}` in the reference), construct a batch where the
   unsorted order makes the last wave hold one long program alone (draw it with `draw_work`), and estimate
   the time lost.
6. `choose_kv_chunk` stops at one wave of about 2 programs per multiprocessor. What does a second, mostly
   empty wave cost (lesson 04's split sweep measured it)? Why is a chunk never shorter than 256 keys?
7. `run` must not sync with the device: find every host operation in your `run` and say which could sync
   (`.item()`, `.tolist()`, `int(tensor)`, a tensor built from Python lists...). Why does that matter when an
   engine captures a step in a CUDA graph?
8. Cascade decode turns a memory-bound problem into a matrix product. With 64 requests and group 4, how
   many rows does level 0's tile hold per KV head, and how many FLOPs per byte does it do? At what batch size
   does the cascade stop paying for its extra launches (measure it with the benchmark's cascade shapes)?
9. A prefill chunk *also* shares the prefix (parallel sampling of one prompt, `n=4`). Write the two levels for
   4 requests that each prefill 3 new tokens after a shared 1k prefix; which level is causal, and why is
   the other not?
10. (GPU) On the H100 (`bench/results/lesson05_plan_run_h100.md`) the mixed step (32 decodes at 4k + 2
    prefills of 1k new tokens over 2k cached) took 0.387 ms in ONE launch with decode and prefill items
    interleaved, 0.435 ms sorted longest first (every prefill tile before the first decode), and 0.439 ms as
    lesson 04 + the prefix-prefill kernel apart; the decodes alone take 0.195 ms, the prefills alone 0.259 ms.
    Why is the interleaved launch shorter than its two halves added up, and the sorted one not? (Hint: which
    programs share a multiprocessor, and which unit of it does each kind keep busy?) At 512 new over 512
    cached it is the other way round: 0.237 ms longest first, 0.257 ms interleaved. Why? Measure your own
    plan's order at both shapes.
11. (Engine) The engine runs every step that mixes decodes and prefill chunks through your
    `FlashInferPagedAttention` (and your `CascadeAttention` when all of the step's sequences start with the
    same cached blocks): read `_plan_step` in `yaie/ops/plan_run.py`. Where do `qo_indptr` and `kv_indices` come from,
    and why may a sequence's last page never be part of the shared level? Decode-only steps replay CUDA graphs,
    which cannot plan per step: read `cascade_decode` in `yaie/ops/plan_run.py` and `shared_pages` in
    `yaie/engine/cuda_graphs.py`. What is planned once, while the graph warms up, and what changes from one
    replay to the next? Why is the shared length rounded down to a multiple of 256 tokens?

## Grade (tasks 5-8)
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(5, extra_args=["-k", "task5 or task6 or task7 or task8"])
""")

notebook.write("lessons/05_radix_flashinfer/05c_plan_run_cascade.ipynb")
