"""Write lessons/05_radix_flashinfer/05b_prefix_prefill.ipynb (stored without outputs).

    python scripts/build_notebook_05b.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 05, part 1b: the prefix-prefill kernel

With prefix caching (the radix tree of part 1a) a request often arrives with most of its prompt **already in
the paged KV cache**: a system prompt, the earlier turns of a chat, a shared few-shot block. Only the *new*
tokens need a prefill, and each of them must attend to

* (a) the sequence's **cached prefix**, read through its block table (lesson 03's layout): every new token comes
  after all of it, so no mask is needed there;
* (b) the **new tokens themselves** (their keys and values are passed in, packed), under a causal mask.

```
q:            [total_new, num_heads, head_dim]        the new tokens of every sequence, packed
k, v:         [total_new, num_kv_heads, head_dim]     their keys and values
k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]   one layer (lesson 03)
block_tables: int32 [batch, max_blocks]   cu_seqlens_q: int32 [batch + 1]   context_lens: int32 [batch]
query i of sequence b sits at position context_lens[b] + i
```

Lesson 06's varlen kernel could do this too, but only after **gathering** each prefix into a contiguous copy:
one more pass over every cached byte, per layer, per step. The prefix-prefill kernel folds (a) and (b) into
**one online softmax** and reads the prefix where it lies.

You will write, in `yaie/kernels/prefix_prefill.py`:

| task | function | what it does |
|---|---|---|
| 3 | `prefix_prefill_reference(...)` | the naive version: gather each prefix, append the new keys, masked attention in PyTorch (window, sinks, fp8 scales, the 16-byte K layout) |
| 4 | `prefix_prefill_attention(...)` | the Triton kernel: block-table loads, GQA, head sizes 80/96, a sliding window, attention sinks, fp8 caches, `skip_decode`, the 16-byte K layout |

(Tasks 1-2 are the radix tree, notebook 05a; tasks 5-8 the plan/run attention of notebook 05c.) No GPU? The kernel
runs on your CPU in the **Triton interpreter** (small shapes; float32/float16). Grade with
`pytest grader/lesson05 -k "task3 or task4"` or the last cell.
""")

code(r"""
# The interpreter must be switched on before triton is imported (a no-op on a GPU machine).
from yaie.device import prepare_triton, default_device
interpreted = prepare_triton()

import math

import matplotlib.pyplot as plt
import matplotlib.patches as patches
import numpy as np
import torch

from yaie.switch import LessonProxy, describe
L5 = LessonProxy(5, 1)       # your prefix_prefill module, or the reference if YAIE_SOLUTIONS says so
L6 = LessonProxy(6)          # lesson 06, for the comparison
device = default_device()
print("Triton interpreter:", interpreted, "| device:", device, "|", describe())


def make_batch(context_lens, new_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=0,
               dtype=torch.float32):
    # New tokens packed, every prefix in shuffled blocks of a paged cache; also the prefixes contiguous.
    gen = torch.Generator().manual_seed(seed)
    per_seq = [max(1, math.ceil((c + n) / block_size)) for c, n in zip(context_lens, new_lens)]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(context_lens), max(per_seq), dtype=torch.int32)
    prefix_k, prefix_v = [], []
    for b, c in enumerate(context_lens):
        for j in range(per_seq[b]):
            tables[b, j] = order.pop()
        pk, pv = torch.randn(c, num_kv_heads, head_dim, generator=gen), torch.randn(c, num_kv_heads, head_dim, generator=gen)
        prefix_k.append(pk); prefix_v.append(pv)
        for t in range(c):
            k_cache[tables[b, t // block_size], t % block_size] = pk[t]
            v_cache[tables[b, t // block_size], t % block_size] = pv[t]
    total = sum(new_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k, v = torch.randn(total, num_kv_heads, head_dim, generator=gen), torch.randn(total, num_kv_heads, head_dim, generator=gen)
    cu = torch.tensor([0] + np.cumsum(new_lens).tolist(), dtype=torch.int32)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    put = lambda t: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
    return [put(t) for t in (q, k, v, k_cache, v_cache, tables, cu, ctx)], prefix_k, prefix_v
""")

md(r"""
## The picture: which tiles a program visits, and which it masks

One program owns `BLOCK_M` new query rows of one head of one sequence and walks over the keys `BLOCK_N` at a time:
first the cached prefix (read through the block table), then the new tokens. Each key tile is one of

* **fast** (green): every row of the program sees every key of the tile: no mask, no bounds checks;
* **masked** (orange): some pairs are invisible: the prefix's ragged last tile, the causal diagonal of the new
  tokens, the lower edge of a sliding window. Invisible scores get a large negative number;
* **skipped** (not drawn): no row sees any key of it (after the diagonal, or wholly before every row's window):
  not even loaded.

The white background shows the pairs that are really visible, grey the invisible ones. The cell below works out the ranges exactly as
the reference kernel does (three loops per part: masked, fast, masked).
""")

code(r"""
def tile_ranges(context_len, num_new, block_m, block_n, window=None):
    # For each query block: (start_m, [(lo, hi, kind, part), ...]) with key positions counted from 0 = first
    # cached token (so the new keys start at context_len).
    out = []
    for start_m in range(0, num_new, block_m):
        ranges = []
        full_end = context_len // block_n * block_n
        lo = fast_lo = 0
        if window is not None:
            first_pos = context_len + start_m
            lo = min(max(first_pos - window + 1, 0) // block_n * block_n, full_end)
            seen_from = max(first_pos + block_m - window, 0)
            fast_lo = min(max(-(-seen_from // block_n) * block_n, lo), full_end)
        ranges += [(lo, fast_lo, "masked", "prefix"), (fast_lo, full_end, "fast", "prefix"),
                   (full_end, context_len, "masked", "prefix")]
        new_full_end = min(num_new // block_n * block_n, (start_m + 1) // block_n * block_n)
        new_end = min(num_new, start_m + block_m)
        new_lo = new_fast_lo = 0
        if window is not None:
            new_lo = min(max(start_m - window + 1, 0) // block_n * block_n, new_full_end)
            new_fast_lo = min(max(-(-max(start_m + block_m - window, 0) // block_n) * block_n, new_lo), new_full_end)
        ranges += [(context_len + new_lo, context_len + new_fast_lo, "masked", "new"),
                   (context_len + new_fast_lo, context_len + new_full_end, "fast", "new"),
                   (context_len + new_full_end, context_len + new_end, "masked", "new")]
        out.append((start_m, [r for r in ranges if r[1] > r[0]]))
    return out


def draw(ax, context_len, num_new, block_m=8, block_n=8, window=None):
    rows = np.arange(num_new)[:, None] + context_len
    cols = np.arange(context_len + num_new)[None, :]
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    ax.imshow(np.where(visible, 0.05, 0.45), cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest",
              extent=(0, context_len + num_new, num_new, 0))
    colors = {"fast": "tab:green", "masked": "tab:orange"}
    for start_m, ranges in tile_ranges(context_len, num_new, block_m, block_n, window):
        height = min(block_m, num_new - start_m)
        for lo, hi, kind, part in ranges:
            for t in range(lo, hi, block_n):
                width = min(block_n, hi - t)
                ax.add_patch(patches.Rectangle((t, start_m), width, height, fill=True, alpha=0.35,
                                               color=colors[kind], lw=0))
                ax.add_patch(patches.Rectangle((t, start_m), width, height, fill=False, ec="k", lw=0.4))
    ax.axvline(context_len, color="tab:blue", lw=2)
    ax.set_xlabel("key position: cached prefix (through the block table) | new tokens (blue line between)")
    ax.set_ylabel("new query row")
    ax.set_title(f"context {context_len}, {num_new} new" + (f", window {window}" if window else "") +
                 f"  (BLOCK_M={block_m}, BLOCK_N={block_n})", fontsize=10)


fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
draw(axes[0], 43, 28)
draw(axes[1], 43, 28, window=20)
handles = [patches.Patch(color="tab:green", alpha=0.5, label="fast (no mask)"),
           patches.Patch(color="tab:orange", alpha=0.5, label="masked"),
           patches.Patch(color="whitesmoke", label="visible pairs"),
           patches.Patch(color="grey", label="invisible pairs")]
axes[1].legend(handles=handles, loc="lower left", fontsize=8)
plt.tight_layout(); plt.show()
""")

md(r"""
Things to see: without a window, **all prefix tiles but the ragged last one run unmasked**: for a long cached
prefix almost all of the work is on the fast path, and it costs exactly what lesson 06 would pay on the gathered
copy. The new tokens give the usual causal triangle. With a window, whole tiles on the left are never loaded;
only the tiles the window's edge crosses need the mask.

Why a **large negative number** (`-1e30`) rather than `-inf` for masked scores? With a window, a row's first
visited tiles can be invisible *for that row* (they are visited because another row of the program needs them).
With `-inf` its running max stays `-inf` and `exp2(m_old - m_new) = exp2(-inf + inf)` is NaN. With `-1e30` the
max stays finite; the junk the row sums meanwhile (`exp2(0) = 1` per masked key) is multiplied by
`exp2(-1e30 - real_max) = 0` as soon as the row meets its first visible key, and every row sees at least its own.
""")

md(r"""
## Try it: the kernel, the reference, and lesson 06 on a gathered copy

The comparison with lesson 06 needs lesson 06's `flash_attention_varlen_forward` (its task 4): until you have
written it, that line says it is not implemented yet.
""")

code(r"""
from yaie.notebook import try_it

args, prefix_k, prefix_v = make_batch([37, 0, 20], [19, 6, 1])
q, k, v, k_cache, v_cache, tables, cu, ctx = args


def kernel_vs_reference():
    out, lse = L5.prefix_prefill_attention(*args, max_query_len=19)
    ref_out, ref_lse = L5.prefix_prefill_reference(*args)
    print("kernel vs reference: max |out diff|", float((out - ref_out).abs().max()), "| max |lse diff|",
          float((lse - ref_lse).abs().max()))
    return True


def kernel_vs_lesson06():
    out, _ = L5.prefix_prefill_attention(*args, max_query_len=19)
    # Lesson 06 needs every prefix gathered into one contiguous buffer first: that copy is what this kernel saves.
    keys, values, cu_k = [], [], [0]
    for b in range(len(prefix_k)):
        first, last = int(cu[b]), int(cu[b + 1])
        keys.append(torch.cat([prefix_k[b].to(k), k[first:last]]))
        values.append(torch.cat([prefix_v[b].to(v), v[first:last]]))
        cu_k.append(cu_k[-1] + keys[-1].shape[0])
    cu_k = torch.tensor(cu_k, dtype=torch.int32, device=device)
    out06, _ = L6.flash_attention_varlen_forward(q, torch.cat(keys), torch.cat(values), cu, cu_k, 19,
                                                 int(cu_k.diff().max()))
    print("kernel vs lesson 06 on the gathered copy: max |diff|", float((out - out06).abs().max()))


if try_it(kernel_vs_reference):
    try_it(kernel_vs_lesson06)
""")

md(r"""
## Attention sinks, windows, and sequences that only decode

**Sinks** (gpt-oss): each head has one learned logit `s_h` that joins every row's softmax *denominator* but has
no value. Rows can then "attend to nothing" (put their mass on the sink) instead of being forced to spread it
over real keys. In the online softmax the sink is simply where each row starts: `m = s_h, l = 1` instead of
`m = -big, l = 0`. The output rows then sum to less than a full convex combination, and `lse` includes the sink.

**`skip_decode=True`**: a sequence with exactly one new token is a decode step; lesson 04's kernel does it better
(split-K over a long context). The prefill kernel returns at once for it and leaves its output rows alone:
zeros in a new `out`, or whatever your own `out` held (e.g. what the decode kernel wrote).
""")

code(r"""
def sinks_window_skip_decode():
    out, lse = L5.prefix_prefill_attention(*args, 19)
    sinks = torch.tensor([0.0, 2.0, 4.0, 8.0], device=device)
    with_sinks, lse_s = L5.prefix_prefill_attention(*args, 19, sinks=sinks)
    plain_norm = out.float().norm(dim=-1).mean(0)
    sink_norm = with_sinks.float().norm(dim=-1).mean(0)
    for h in range(4):
        print(f"head {h}: sink {float(sinks[h]):4.1f}  mean |out| {float(plain_norm[h]):.3f} -> "
              f"{float(sink_norm[h]):.3f}   mean lse {float(lse[h].mean()):.2f} -> {float(lse_s[h].mean()):.2f}")

    windowed, _ = L5.prefix_prefill_attention(*args, 19, sliding_window=8)
    ref_w, _ = L5.prefix_prefill_reference(*args, sliding_window=8)
    print("window 8: kernel vs reference", float((windowed - ref_w).abs().max()))

    mine = torch.full_like(q, 7.0)
    L5.prefix_prefill_attention(*args, 19, skip_decode=True, out=mine)
    print("skip_decode: the one-token sequence's row kept its 7.0:", bool((mine[int(cu[2]):] == 7.0).all()))


try_it(sinks_window_skip_decode)
""")

md(r"""
## The 16-byte K layout

`to_vector_k_layout` rearranges a K cache to `[num_blocks, num_kv_heads, head_dim // x, block_size, x]` with `x`
elements = 16 bytes (8 for fp16/bf16, 16 for fp8): one block of one KV head becomes one contiguous run, and each
token contributes exactly one 16-byte vector per chunk of the head dimension, right next to the next token's.
That is the layout of vLLM's CUDA paged kernels, whose threads each read one 16-byte vector of K. The kernel
reads either layout (a 5-D `k_cache` selects this one); the benchmark (`yaie bench lesson05`) times both.
""")

code(r"""
def vector_k_layout():
    k16 = L5.to_vector_k_layout(k_cache.half())
    print("lesson 03 layout:", tuple(k_cache.shape), "-> vector layout:", tuple(k16.shape),
          f"(x = {k16.shape[-1]} halves = {k16.shape[-1] * k16.element_size()} bytes)")
    args16 = [t.half() if t.is_floating_point() else t for t in args]
    args16[3] = k16
    out16, _ = L5.prefix_prefill_attention(*args16, 19)
    out, _ = L5.prefix_prefill_attention(*args, 19)
    print("fp16, vector K layout: max |diff| to the float32 result", float((out16.float() - out.float()).abs().max()))


try_it(vector_k_layout)
""")

md(r"""
## What the reference measured (H100, bf16, head_dim 128, 32/8 heads, block 16)

`bench/results/lesson05_h100.md`, `yaie bench lesson05 --solutions`:

| shape | prefix prefill (paged) | SDPA + gather | lesson 06 (pre-gathered) | gather alone | vs SDPA + gather | vs lesson 06 |
|---|---:|---:|---:|---:|---:|---:|
| (a) b8, prefix 2048, new 512 | 0.446 ms (347 TFLOP/s) | 0.586 ms | 0.494 ms | 0.114 ms | 1.31x | 1.11x |
| (b) b4, prefix 8192, new 1024 | 1.428 ms (409 TFLOP/s) | 1.898 ms | 1.468 ms | 0.210 ms | 1.33x | 1.03x |
| (c) b16, prefix 1024, new 128 | 0.134 ms (273 TFLOP/s) | 0.234 ms | 0.246 ms | 0.109 ms | 1.75x | 1.84x |
| (d) b1, prefix 16384, new 2048 | 1.435 ms (407 TFLOP/s) | 1.853 ms | 1.440 ms | 0.109 ms | 1.29x | 1.00x |

Reading the prefix through the block table costs nothing measurable next to a contiguous copy (rows (b) and (d)):
the tiles are whole 256-byte rows either way. The gain is the gather the others need, which matters most where the
attention itself is short (c). The same kernel with the K cache in the 16-byte vector layout was 2.2-2.7x *slower*
(exercise 8).
""")

md(r"""
## Exercises

1. Implement task 3 (`prefix_prefill_reference`). Start without window, sinks and fp8, then add them one by one
   (`pytest grader/lesson05 -k task3`). Which cached rows does a window make unnecessary to gather, and why must
   the reference not gather them (the grader fills them with NaN)?
2. Implement task 4. Suggested order: one program per (query block, head, sequence); loop over the prefix through
   the block table with the online softmax of lesson 06; then the new tokens with the causal mask; then GQA
   (`kv_head = head // group`), padding of head sizes 80/96, the window, sinks, `skip_decode`, fp8, the 5-D K layout.
3. The grader poisons every cache row a sequence does not own with NaN. Masking the *scores* of those keys is
   not enough: why must the **V** load be masked too (what is `0 * NaN`)?
4. In the figure, count the tiles of each kind for context 43 and 28 new tokens, with and without the window.
   For a prefix of 8192 and 1024 new tokens (BLOCK_M = 128, BLOCK_N = 64), what fraction of the tiles is masked?
5. fp8: why is it enough to multiply the *scores* by `k_scale` and the *probabilities* by `v_scale` (and not the
   running sum `l`)? What would go wrong if you scaled `l` too?
6. Sinks: show that starting each row at `m = sink, l = 1` gives exactly `softmax([scores, sink])[:-1] @ v`.
   What `lse` does the kernel return, and what must part 2's cascade merge do so the sink is counted once?
7. (GPU) `yaie bench lesson05` compares your kernel with SDPA and lesson 06 on a gathered copy. How long does
   the gather alone take next to the attention, and how does that share change from shape (c) (prefix 1024, new
   128) to shape (b) (prefix 8192, new 1024)? Why?
8. (GPU) The 16-byte K layout is what vLLM's CUDA kernels want. Does it help a Triton kernel that loads a whole
   `[BLOCK_N, head_dim]` tile (look at how consecutive threads' addresses fall in each layout)?
9. The engine (`_prefix_prefill` in `yaie/ops/attention_backends.py`) sends every prefill that continues a cached context to your
   kernel with `validate=False` (when decodes run in the same step, lesson 05's plan/run attention takes the
   whole step instead: notebook 05c). Why must the kernel never call `.item()` or read a tensor on the host?

## Grade (tasks 3 and 4)
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(5, extra_args=["-k", "task3 or task4"])
""")

notebook.write("lessons/05_radix_flashinfer/05b_prefix_prefill.ipynb")
