"""Write lessons/07_telescoping_cache/07_telescoping_cache.ipynb (stored without outputs).

    python scripts/build_notebook_07.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 07: the telescoping cache

A KV cache grows by one entry per token: at 16k tokens a Llama-3-8B sequence holds 2 GiB of keys and
values, and every decode step reads all of it. A **telescoping cache** keeps a constant number `c` of
entries per head: the recent tokens exactly, older ones as *averages* over spans that get longer with
distance (1, 1, ..., 2, 2, ..., 4, 4, ..., 8, ...). Memory per sequence stops growing.

It has two faces, and this lesson builds both:

* **recurrent** (decode): append the new token; when the cache holds `c + 1` entries, merge one pair into
  their size-weighted average, on a schedule that depends only on the step number;
* **parallel** (prefill, training): every position's cache is a row of an **index map** `M[l, c]` into a
  shared **buffer** of `n` span averages, and attention needs `Q x K[M]` and `P x V[M]`, computed by
  **indexed matmul** kernels that follow the map while they load instead of building the gathered
  `[b, l, c, h, d]` tensor (34 GB at b=4, l=16k, h=8, c=256, d=128 in bf16).

You will write, in `yaie/kernels/telescoping.py`:

| task | functions | what |
|---|---|---|
| 1 | `choose_merge(sizes)`, `telescoping_step(entries, sizes, new, c)` | the merge rule (pure PyTorch) |
| 2 | `telescoping_index_map(l, c)`, `telescoping_buffer(x, starts, ends)` | the parallel form: the map and the span averages |
| 3 | `indexed_qk_forward`, `indexed_pv_forward` | Triton: scores `O[b,l,h,e,c] = sum_d Q[b,l,h,e,d] K[b,M[l,c],h,d]`, and weights x values |
| 4 | `indexed_qk_backward`, `indexed_pv_backward` | Triton: dQ (a gather) and dK of the buffer (a scatter: many `(l, c)` hit one row) |

No GPU? The kernels run on your CPU in the **Triton interpreter** (small shapes; float32/float16).
Grade with `pytest grader/lesson07` or the last cell.
""")

code(r"""
# The interpreter must be switched on before triton is imported (a no-op on a GPU machine).
from yaie.device import prepare_triton, default_device
interpreted = prepare_triton()

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch

from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe
L7 = LessonProxy(7)          # your module, or the reference if YAIE_SOLUTIONS says so
device = default_device()
print("Triton interpreter:", interpreted, "| device:", device, "|", describe())
""")

md(r"""
## Task 1: the merge rule

The cache is a list of entries, oldest first; entry `i` averages `sizes[i]` consecutive tokens. Its
**level** is `floor(log2(size))`. After appending the new token (size 1), if there are `c + 1` entries:

* merge the **two oldest entries of the level that holds the most entries** (ties: the lowest level);
* if no level holds two entries (only after about `2**c` tokens), merge the two oldest entries.

The merged entry is `(s_i x_i + s_j x_j) / (s_i + s_j)` with size `s_i + s_j`, in the older one's place.
Why it works: sizes never grow from old to new, so one level's entries are neighbours (their two oldest
can merge), and picking the fullest level keeps the levels about equally full: `c / levels` entries of
each size. After `t` tokens there are about `log2(t / (c / levels))` levels: spans double with distance.
""")

code(r"""
def check_rule():
    print("sizes [1, 1, 1] ->", L7.choose_merge([1, 1, 1]))                  # level 0 holds 3: merge 0, 1
    print("sizes [2, 2, 1, 1, 1] ->", L7.choose_merge([2, 2, 1, 1, 1]))      # level 0 holds 3, level 1 two
    print("sizes [4, 2, 1] ->", L7.choose_merge([4, 2, 1]))                  # one entry per level: 0
    entries, sizes = torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)
    for t in range(10):
        entries, sizes = L7.telescoping_step(entries, sizes, torch.tensor([float(t), 1.0]), capacity=4)
    print("after 10 tokens, capacity 4: sizes", sizes.tolist(), "means of the positions",
          entries[:, 0].tolist())

try_it(check_rule)
""")

md(r"""
### The cache drawn over time

Row `t` is the cache after reading tokens `0..t`; along the row, each token is coloured by the entry that
holds it (neighbouring entries alternate colours; white = not read yet). Watch the blocks: recent tokens
are thin (exact), old ones are merged into wider and wider spans, and there are always `c` of them.
""")

code(r"""
def spans_over_time(length, capacity):
    # Replays the rule with your telescoping_step on the token positions themselves.
    out, entries, sizes = [], torch.zeros(0, 1, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    for t in range(length):
        entries, sizes = L7.telescoping_step(entries, sizes, torch.tensor([float(t)], dtype=torch.float64), capacity)
        ends = sizes.cumsum(0)
        out.append([(int(e - s), int(e)) for s, e in zip(sizes, ends)])
    return out


def draw_cache(length=96, capacity=12):
    picture = np.full((length, length), np.nan)
    for t, spans in enumerate(spans_over_time(length, capacity)):
        for j, (a, b) in enumerate(spans):
            picture[t, a:b] = (j % 2) + 0.4 * ((b - a).bit_length() - 1) / 6
    plt.figure(figsize=(6, 6))
    plt.imshow(picture, cmap="viridis", interpolation="nearest")
    plt.xlabel("token position"); plt.ylabel("time step (tokens read - 1)")
    plt.title(f"telescoping cache, capacity {capacity}")
    plt.show()

try_it(draw_cache)
""")

md(r"""
### Step through the merge rule

Each bar is one entry, as wide as the tokens it averages; the label is its size. The pair the rule
merges at the next step is marked in red.
""")

code(r"""
def show_step(step=40, capacity=10):
    spans = spans_over_time(step + 1, capacity)[-1]
    sizes = [b - a for a, b in spans]
    nxt = L7.choose_merge(sizes + [1]) if len(sizes) + 1 > capacity else None
    fig, ax = plt.subplots(figsize=(10, 1.6))
    for j, (a, b) in enumerate(spans):
        color = "tab:red" if nxt is not None and j in (nxt, nxt + 1) else ("tab:blue" if j % 2 else "tab:cyan")
        ax.barh(0, b - a, left=a, color=color, edgecolor="k")
        ax.text((a + b) / 2, 0, str(b - a), ha="center", va="center", fontsize=8)
    ax.set_yticks([]); ax.set_xlim(0, step + 2); ax.set_xlabel("token position")
    levels = [s.bit_length() - 1 for s in sizes]
    ax.set_title(f"after token {step}: {len(spans)} entries, per level "
                 f"{[levels.count(v) for v in sorted(set(levels), reverse=True)]}"
                 + ("" if nxt is None else f"; next step merges entries {nxt} and {nxt + 1}"))
    plt.show()

try_it(lambda: widgets.interact(show_step, step=widgets.IntSlider(40, 0, 300), capacity=widgets.IntSlider(10, 1, 32)))
""")

md(r"""
## Task 2: the index map (parallel form)

Training and prefill need every position's cache at once. Each step creates at most two entries (the new
token and one merged span), so all caches of `l` tokens share `n = l + max(0, l - c)` distinct averages:
the **buffer**, tokens first (row `p` = token `p`), then merged spans in the order the rule makes them.
`M[p, j]` is the buffer row of entry `j` of position `p`'s cache (oldest first); `n` marks an unused slot.

The buffer comes from prefix sums in one parallel step: `row r = (S[end] - S[start]) / (end - start)`.
""")

code(r"""
def show_map(length=120, capacity=16):
    index_map, starts, ends = L7.telescoping_index_map(length, capacity)
    n = starts.numel()
    shown = np.ma.masked_where(index_map.numpy() >= n, index_map.numpy())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    im = axes[0].imshow(shown, aspect="auto", cmap="turbo", interpolation="nearest")
    axes[0].set_xlabel("slot c"); axes[0].set_ylabel("position l"); axes[0].set_title(f"M[l, c] (n = {n}; white: unused)")
    fig.colorbar(im, ax=axes[0])
    stable = L7.stable_slots(index_map, n)
    im = axes[1].imshow(np.ma.masked_where(stable.numpy() >= n, stable.numpy()), aspect="auto", cmap="turbo",
                        interpolation="nearest")
    axes[1].set_xlabel("slot c"); axes[1].set_title("the same caches, each entry in one column (stable_slots)")
    plt.show()

try_it(show_map)
""")

md(r"""
Recurrent and parallel must give **the same cache at every position**. Check it on random vectors:
""")

code(r"""
def check_forms(length=60, capacity=7):
    x = torch.randn(length, 4, dtype=torch.float64)
    index_map, starts, ends = L7.telescoping_index_map(length, capacity)
    buf = L7.telescoping_buffer(x[None], starts, ends)[0]
    entries, sizes, worst = torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, dtype=torch.int64), 0.0
    for p in range(length):
        entries, sizes = L7.telescoping_step(entries, sizes, x[p], capacity)
        worst = max(worst, float((buf[index_map[p, :len(sizes)].long()] - entries).abs().max()))
    print(f"largest difference between the recurrent and the parallel cache over {length} positions: {worst:.2e}")

try_it(check_forms)
""")

md(r"""
## Task 3: indexed matmul forward (Triton)

Scores of every position against its own cache: `O[b,l,h,e,c] = sum_d Q[b,l,h,e,d] * K[b, M[l,c], h, d]`
(`e` query heads share a KV head). One program per (position, block of slots, batch x head): load the
block's rows of the map, load those rows of `K` (a gather, straight from the buffer), one `tl.dot` with
the position's `[e, d]` queries (padded to 16 rows, the least `tl.dot` takes). Unused slots read zeros.
The transposed use, `P [b,l,h,e,c]` times the value buffer, walks the slots block by block and
accumulates `[e, d]`.
""")

code(r"""
def check_forward():
    b, l, h, e, d, c, n = 1, 9, 2, 4, 32, 12, 15
    dtype = torch.float32
    q = torch.randn(b, l, h, e, d, dtype=dtype, device=device)
    k = torch.randn(b, n, h, d, dtype=dtype, device=device)
    index_map = torch.randint(0, n + 2, (l, c), device=device)        # some slots unused (>= n)
    got = L7.indexed_qk_forward(q, k, index_map)
    want = L7.indexed_qk_reference(q.double(), k.double(), index_map)
    print("indexed_qk_forward: largest error vs float64 gather + matmul", float((got.double() - want).abs().max()))
    p = torch.softmax(got.float(), -1).to(dtype)
    got = L7.indexed_pv_forward(p, k, index_map)
    want = L7.indexed_pv_reference(p.double(), k.double(), index_map)
    print("indexed_pv_forward: largest error", float((got.double() - want).abs().max()))

try_it(check_forward)
""")

md(r"""
## Task 4: the backward kernels

For the scores `O = Q K[M]^T`: `dQ[l] = sum_c dO[l, :, c] K[M[l, c]]` is the P x V kernel again (with
`P = dO`). The buffer's gradient is a **scatter**: `dK[r] = sum over (l, c) with M[l, c] = r of dO[l,:,c]^T Q[l]`.
Many positions hit one row (an entry lives in the cache for many steps), so adds must be atomic
(`tl.atomic_add`, in float32), or the map must be inverted. Write it one position at a time first (a
`[c_block, e] x [e, d]` product and its atomic add per position): that is the task.

The reference has a faster variant for the map the model uses. With `stable_slots` columns an entry keeps
its column while it lives, so over a block of 32 neighbouring positions a slot holds at most two buffer
rows (the one at the block's first position and the one at its last). Stack the block's (position,
query head) pairs into one `K = 32 x e = 128` deep axis and the block's whole sum for a slot is two
matmuls, `P_block^T [c, K] x dO_block [K, d]`, masked to the pairs that hold each row, and one atomic add
per slot and row instead of one per position; the rare third row is added position by position. The same
trick speeds up the gather-dot (`dP = dO V[M]^T`, and the Q K^T forward): the block reads each slot's two
rows once instead of once per position. The host measures once per map how many (block, slot) pairs have
a third row and picks the variant (maps whose rows move go another way, below).

**Going further: the map inverted.** Atomics are cheap only while a slot keeps its row. The oldest-first map
changes rows in about a third of its (position, slot) pairs (every merge shifts the columns after it), a random
map in all of them, and float32 atomics to scattered rows are slow: at `l = 16k` the per-position kernel spent
30 ms on the random map's buffer gradient (4.3 G atomic adds), more than PyTorch's whole P V backward
(17.6 ms). For such maps the reference turns the scatter into a gather (`_scatter_rows_kernel`):

* **Sort once per map.** `torch.sort` orders the map's entries `l * c + j` by block of 16 buffer rows (unused
  slots last), and `searchsorted` finds where each block's entries start. The map is the same for every batch
  and head, so one sort serves them all. The sort is stable: a block's entries stay in position order. It is
  about ten launches and 0.13 ms at 4k (0.34 ms at 16k), and a model calls the backward with the same map
  in every layer and step, so the order is kept on the map tensor, as the route's measures are, keyed by the
  tensor's version counter (an in-place edit of the map sorts again).
* **Let the host run ahead.** Checking that no map entry is negative reads the map's minimum back from the GPU:
  the host waits until the GPU has finished everything queued, then queues the next kernels while the GPU
  idles. The given check (`check_map_entries`) marks a map found valid on the tensor with its version, so
  later calls with the same, unedited map queue their kernels without a wait; an edited map is checked again
  and a negative entry is still a `ValueError` at the call (a check inside the kernel could only fail later,
  far from the bad input). Maps made in `torch.inference_mode` have no version counter: they are checked every
  call, and nothing made from them (the int32 copy, the order) is kept.
* **Each program owns 16 rows and gathers what adds into them.** It walks its entries 32 at a time; their
  (entry, query head) pairs are a `K = 32 x e = 128` deep axis: one row of `dO` (or `Q`) gathered per pair, and a
  `[16, K]` matrix that holds `P[l, e, j]` in the row its entry adds to and 0 in the other 15. One `tl.dot` adds
  the chunk to all 16 rows. No atomics, no zeroed float32 buffer, every row written once, and the sum comes out
  in the same order every run (deterministic gradients). 16 rows because it is `tl.dot`'s smallest M: each row
  more multiplies another row of zeros.
* **What bounds it.** Every entry reads its position's `e x d` row of `dO`: 1 KB in bf16, 34 GB at `l = 16k` for
  8 heads. The grid runs one head's row blocks together, so that head's `dO` (16 MB) stays in L2: 6.0 ms, about
  5.7 TB/s, on the H100. More warps, rows or entries per program only queue more loads (the measured sweep: 16
  rows, 32 entries, 4 warps, 2 stages were fastest).
* **In float32, sum each chunk from 0.** A float32 `tl.dot` is a chain of FMAs. Chained into the running sum,
  every product is rounded against the whole sum; a row of the oldest-first map sums hundreds of entries, and the
  grader's float32 check failed by 1e-4 where such a sum cancels to about 1.
* **Pick the route from the map.** The host measures once per map the share of (position, slot) pairs whose row
  differs from the position before (stable columns 0.8%, oldest-first 27-36%, random 100%). Above 10% it goes by
  rows, below it keeps the atomic kernels (blocked where they fit). On maps whose slots change rows every `R`
  positions the kernel by rows took 6.5 ms whatever `R`, the per-position atomic kernel 30 ms at `R = 1` and
  5.7 ms at `R = 32`, the blocked one 8.1 ms at `R = 8` and 4.4 ms at `R = 16`: the crossover lies between 1/16
  and 1/8.

Measured (`bench/results/lesson07_backward_h100.md`, the map tensor reused as a model does): on the oldest-first
map both backwards are 18.6-21.9x PyTorch's gather + matmul at `l = 4k` and 6.1-9.4x at 16k (with atomics
9.0-10.7x and 3.8-5.8x); on the random map 5.5x (Q K^T) and 2.3x (P V) at 4k, 5.7x and 2.3x at 16k (0.6-1.4x
with atomics). P V on the random map at 4k is its two kernels and nothing else: 1.63 ms in the kernel by rows,
0.40 ms in `dP`. Before the check and the order were kept it took 0.39 ms more (0.13 ms sorting, about 0.26 ms
of GPU idle while the host queued after the check's sync) and was 1.9x. A new map tensor at every call still
pays all of it, and the route's measures: 1.5x at 4k.
""")

code(r"""
def check_backward():
    b, l, h, e, d, c = 1, 10, 2, 2, 16, 6
    index_map, starts, ends = L7.telescoping_index_map(l, c)
    n = starts.numel()
    q = torch.randn(b, l, h, e, d, device=device, requires_grad=True)
    k = torch.randn(b, n, h, d, device=device, requires_grad=True)
    dout = torch.randn(b, l, h, e, c, device=device)
    dq, dk = torch.autograd.grad(L7.indexed_qk(q, k, index_map.to(device)), (q, k), dout)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want_dq, want_dk = torch.autograd.grad(L7.indexed_qk_reference(q64, k64, index_map), (q64, k64), dout.double())
    print("dq error", float((dq.double() - want_dq).abs().max()), "| dk error", float((dk.double() - want_dk).abs().max()))

try_it(check_backward)
""")

md(r"""
## Memory: a telescoping cache against a full cache

Per sequence, for the bundled tiny model's shape (6 layers, 2 KV heads, head dim 32) and for a
Llama-3-8B-like shape (32 layers, 8 KV heads, head dim 128), bf16 entries. The full cache grows with every
token; the telescoping cache is `layers x 2 x c x kv_heads x head_dim` whatever the length. Below, the
gathered tensor the indexed kernels avoid, for prefill/training over `l` tokens.
""")

code(r"""
lengths = np.array([256, 1024, 4096, 16384, 65536])
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for name, layers, kv, d in (("tiny (6 x 2 x 32)", 6, 2, 32), ("8B-like (32 x 8 x 128)", 32, 8, 128)):
    full = layers * 2 * lengths * kv * d * 2
    axes[0].loglog(lengths, full / 2**20, "o-", label=f"full cache, {name}")
    for c in (64, 256):
        tele = layers * 2 * np.minimum(lengths, c) * kv * d * 2
        axes[0].loglog(lengths, tele / 2**20, "s--", label=f"telescoping c={c}, {name}")
axes[0].set_xlabel("tokens in the sequence"); axes[0].set_ylabel("MiB per sequence"); axes[0].legend(fontsize=7)
axes[0].set_title("KV cache per sequence")
b, h, e, d, c = 4, 8, 4, 128, 256
gathered = b * lengths * h * c * d * 2
inputs = b * lengths * h * e * (d + c) * 2 + b * (2 * lengths) * h * d * 2
axes[1].loglog(lengths, gathered / 2**30, "o-", label="gathered K[:, M] (gather + matmul)")
axes[1].loglog(lengths, inputs / 2**30, "s-", label="q, scores and the buffer (indexed kernels)")
axes[1].set_xlabel("l"); axes[1].set_ylabel("GiB"); axes[1].legend(fontsize=8)
axes[1].set_title("prefill / training, b=4 h=8 e=4 d=128 c=256, bf16")
plt.tight_layout(); plt.show()
""")

md(r"""
On the lent H100 (`bench/results/lesson07_summary_h100.md`, full table `lesson07_h100.md`), the kernels
against PyTorch gathering and multiplying at these shapes: forward and both backwards, time and peak memory.
The buffer there has `n = 2l - c` rows, not `n = l`: the telescoping map needs the `l` tokens and one merged
span per step after the first `c` (above), so that is the `n` the kernels meet and the one measured; the
random-map rows use `n = l`.

The engine's memory per sequence, tiny models (6 layers, 2 KV heads, head dim 32): the telescoping model's
cache (`c = 64`, float32 entries) holds 199,680 bytes after 1k, 2k and 4k generated tokens on the H100 and
after 1k to 16k on the CPU; the full-attention model's paged cache holds 1.6 MB of blocks after 1k tokens
and 25.2 MB after 16k on the H100 (`bench/results/lesson07_engine_memory_h100.json`,
`lesson07_engine_memory_cpu.json`).

## Exercises

1. Why does the rule pick the *fullest* level? Change it to "always merge the two oldest exact tokens"
   and draw the cache over time: what happens to the oldest spans, and to the number of exact tokens?
2. Prove that sizes never grow from old to new (so a level's entries are neighbours). Which merge could
   make the oldest entry a size that is not a power of two, and why is that harmless?
3. An entry averaging `s` tokens gets `+ log(s)` on its score in `telescoping_attention`. Show that
   when all the tokens of a span share one key, this gives exactly the attention of the full cache.
   What does the bias do when the keys of a span differ?
4. The caches of positions `l` and `l + 1` share all but at most two buffer rows (a merged pair leaves; the merged
   span and the new token arrive). Count, for `l = 16k, c = 256`, how many distinct
   buffer rows the forward kernel's programs for 128 consecutive positions read, and estimate the share
   of its reads that hit L2. Compare with a random map (`yaie bench lesson07` runs both).
5. The backward scatter: write the inverted-map version (for each buffer row, the list of `(l, c)` that
   read it, in CSR form) and compare it with atomics. When does each win?
6. `stable_slots` keeps entries in one column. Why does attention not care about the column order, and
   what does the order change for the scatter kernel?
7. Decoding with the recurrent rule costs one merge per token. Write the merge for a whole batch of
   sequences of different lengths as one kernel (each sequence merges at its own position).
8. The tiny telescoping model (`yaie/assets/tiny-telescoping/`) was trained with `c = 64` on 256-token
   windows. Its held-out loss is in its `train_log.json`, beside the full-attention model's. Where in a
   story would you expect the telescoping model to lose most? Measure the loss per position.

## Grade
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(7)
""")

notebook.write("lessons/07_telescoping_cache/07_telescoping_cache.ipynb")
