"""Write lessons/04_paged_attention/04_paged_attention.ipynb (stored without outputs).

    python scripts/build_notebook_04.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 04: paged-attention decode

Every decode step of a batch brings **one new query token per sequence**. Each must attend to all earlier
tokens of its own sequence, whose keys and values sit in the paged KV cache of lesson 03:

```
q:            [batch, num_heads, head_dim]                   one token per sequence
k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]   one layer
block_tables: int32 [batch, max_blocks]    logical block j of sequence b -> physical block
context_lens: int32 [batch]                tokens of each sequence (they differ)
```

You will write, in `yaie/kernels/paged_attention.py`:

| task | function | what it does |
|---|---|---|
| 1 | `paged_attention_reference(...)` | the naive version: gather each sequence's K/V from its blocks, then attention in PyTorch |
| 2 | `paged_attention_forward(..., num_splits=1)` | the Triton kernel: follows the block table while it loads, GQA, any head_dim (96 too) |
| 3 | `merge_split_results(part_out, part_lse)` and the split-K path | flash-decoding: cut long contexts into ranges, merge by log-sum-exp |
| 4 | `sliding_window=` in tasks 1 and 2 | attend to the last `w` tokens only, and read nothing before them |

No GPU? The kernel runs on your CPU in the **Triton interpreter** (small shapes; float32/float16, since
the interpreter's bf16 `tl.dot` is broken). Grade with `pytest grader/lesson04` or the last cell.
""")

code(r"""
# The interpreter must be switched on before triton is imported (a no-op on a GPU machine).
from yaie.device import prepare_triton, default_device
interpreted = prepare_triton()

import json
import math
import re
from pathlib import Path

import ipywidgets as widgets
import matplotlib.pyplot as plt
import matplotlib.patches as patches
import numpy as np
import torch
import torch.nn.functional as F

from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe
L4 = LessonProxy(4)          # your module, or the reference if YAIE_SOLUTIONS says so
device = default_device()
dtype = torch.float32 if interpreted else torch.bfloat16
print("Triton interpreter:", interpreted, "| device:", device, "|", describe())



def make_batch(lengths, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=0, dtype=torch.float32):
    # A paged cache holding random K/V for each sequence in shuffled blocks, and the same K/V contiguous.
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lengths):
        k, v = torch.randn(n, num_kv_heads, head_dim, generator=gen), torch.randn(n, num_kv_heads, head_dim, generator=gen)
        ks.append(k); vs.append(v)
        for j in range(per_seq[b]):
            block = order.pop()
            tables[b, j] = block
            rows = min(block_size, n - j * block_size)
            k_cache[block, :rows], v_cache[block, :rows] = k[j * block_size: j * block_size + rows], v[j * block_size: j * block_size + rows]
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    to = lambda t: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)   # noqa: E731
    return to(q), to(k_cache), to(v_cache), tables.to(device), lens.to(device), ks, vs


def sdpa_per_sequence(q, ks, vs):
    # The answer, one sequence at a time with torch SDPA on contiguous K/V (float64 on the CPU).
    outs = []
    for b in range(q.shape[0]):
        group = q.shape[1] // ks[b].shape[1]
        k = ks[b].double().transpose(0, 1).repeat_interleave(group, 0)        # [heads, n, d]
        v = vs[b].double().transpose(0, 1).repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(q[b].double().cpu()[:, None], k, v)[:, 0])
    return torch.stack(outs)
""")

md(r"""
## 1. From a block table to tokens

Token `t` of sequence `b` is row `t % block_size` of physical block `block_tables[b, t // block_size]`.
The kernel never makes a contiguous copy of a sequence: each program walks over its tokens a **tile** at a
time (here 16 tokens) and, for every token of the tile, looks up its block and row, then loads that token's
`head_dim` numbers. Tiles need not line up with blocks: a tile may span several blocks, or a part of one.

The picture: one sequence of 27 tokens in blocks of 8 (top: logical tokens, coloured by tile; bottom: the
physical blocks they come from).
""")

code(r"""
def draw_token_map(length=27, block_size=8, tile=16, table=(6, 2, 9, 4), num_blocks=12):
    colors = plt.cm.Set2.colors
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for t in range(length):
        ax.add_patch(patches.Rectangle((t, 2), 0.9, 0.9, color=colors[(t // tile) % 8]))
        ax.text(t + 0.45, 2.45, str(t), ha="center", va="center", fontsize=6)
        block, row = table[t // block_size], t % block_size
        x = block * (block_size + 1) * 0.45 + row * 0.45
        ax.add_patch(patches.Rectangle((x, 0), 0.4, 0.9, color=colors[(t // tile) % 8]))
        if row == 0:
            ax.plot([t + 0.45, x + 0.2], [2, 0.9], color="gray", lw=0.6)
    for block in range(num_blocks):
        x = block * (block_size + 1) * 0.45
        ax.add_patch(patches.Rectangle((x - 0.02, -0.05), block_size * 0.45, 1.0, fill=False, ec="black", lw=0.6))
        ax.text(x + block_size * 0.225, -0.35, f"block {block}", ha="center", fontsize=6)
    ax.text(-0.5, 2.45, "logical tokens", ha="right", va="center", fontsize=8)
    ax.text(-0.5, 0.45, "physical blocks", ha="right", va="center", fontsize=8)
    ax.set_xlim(-6, max(length, num_blocks * (block_size + 1) * 0.45) + 1); ax.set_ylim(-0.7, 3.1); ax.axis("off")
    ax.set_title(f"block table {list(table)}: tiles of {tile} tokens (colours) gather from scattered blocks", fontsize=9)
    plt.show()


draw_token_map()
""")

md(r"""
## 2. Task 1: the naive reference

Gather, then attend: for each sequence build `k = k_cache[blocks, rows]` (`[length, num_kv_heads, head_dim]`),
repeat each KV head for its `group = num_heads // num_kv_heads` query heads, and compute
`softmax(q k^T * scale) v`. It allocates a contiguous copy of every context (slow, memory hungry), which is
exactly what the kernel avoids, but it is short and obviously right: the yardstick for tasks 2 and 3.
""")

code(r"""
def check_reference():
    q, kc, vc, bt, cl, ks, vs = make_batch([13, 30, 5])
    got = L4.paged_attention_reference(q.double().cpu(), kc.double().cpu(), vc.double().cpu(), bt.cpu(), cl.cpu())
    print("max |reference - SDPA on contiguous K/V| =", float((got - sdpa_per_sequence(q, ks, vs)).abs().max()))

try_it(check_reference)
""")

md(r"""
## 3. Task 2: the kernel

**Why decode is memory bound.** Per token of context and per KV head, the kernel reads `2 x head_dim`
numbers (K and V) and does about `4 x head_dim` FLOPs for *each* of the `group` query heads that share the KV
head. That is `group` FLOPs per byte in bf16: 4 to 8 for GQA models. An H200 does ~680 bf16 TFLOP/s but moves
~4.2 TB/s: it needs ~160 FLOPs per byte to be compute bound. Decode is 20-40x below that, so the kernel's only
job is to **read K and V once, at full memory bandwidth**.

Hence the design:

* one program per (sequence, **KV head**): it loads each K/V tile once and uses it for all `group` query
  heads (a `[group, head_dim] x [head_dim, tile]` product, padded to 16 rows for `tl.dot`);
* an **online softmax** (lesson 06) over the tiles: running max `m`, running sum `l`, accumulator `acc`, all
  float32; scores in base 2 (`exp2`), scaled by `scale * log2(e)`;
* masks: tokens `>= context_len` (scores `-inf`, loads masked), head dims `>= head_dim` when padding 96 to 128.
""")

code(r"""
def check_kernel():
    q, kc, vc, bt, cl, ks, vs = make_batch([37, 5, 64], head_dim=64, block_size=16, dtype=dtype)
    out = L4.paged_attention_forward(q, kc, vc, bt, cl, max_context_len=64, num_splits=1)
    ref = sdpa_per_sequence(q, ks, vs)
    print("output", tuple(out.shape), out.dtype, "| max |kernel - float64| =", float((out.double().cpu() - ref).abs().max()))
    q, kc, vc, bt, cl, ks, vs = make_batch([20, 9], num_heads=6, num_kv_heads=3, head_dim=96, block_size=8, dtype=dtype)
    out = L4.paged_attention_forward(q, kc, vc, bt, cl, max_context_len=20, num_splits=1)
    print("head_dim 96 (padded to 128): max error", float((out.double().cpu() - sdpa_per_sequence(q, ks, vs)).abs().max()))

try_it(check_kernel)
""")

md(r"""
## 4. Task 3: split-K (flash-decoding)

With batch 8 and 8 KV heads there are 64 programs: on a 132-multiprocessor GPU, half the chip idles, and each
program streams a long context alone. **Split-K** cuts each sequence's context into `num_splits` ranges handled
by separate programs. Split `i` produces its normalised output `o_i` and the log-sum-exp of its scores
`lse_i`; the exact answer is

$$\text{out} = \sum_i e^{\,lse_i - lse}\, o_i, \qquad lse = \log \sum_i e^{\,lse_i}.$$

(Subtract `max_i lse_i` before `exp` so nothing overflows; a split with no keys has `lse_i = -inf` and weighs 0.)
`choose_num_splits` (given, in `yaie/kernels/paged_attention_given.py`) picks about 2 programs per multiprocessor (one wave of them), a power of two, at
least 512 tokens per split. Move the sliders: the picture shows how one sequence's tokens are shared out, and the check runs your
split path against float64.
""")

code(r"""
def show_splits(context_len=70, num_splits=3, tile=16):
    per_split = math.ceil(math.ceil(context_len / num_splits) / tile) * tile
    fig, ax = plt.subplots(figsize=(10, 1.2))
    for s in range(num_splits):
        start, end = s * per_split, min((s + 1) * per_split, context_len)
        if end > start:
            ax.add_patch(patches.Rectangle((start, 0), end - start, 1, color=plt.cm.tab10(s % 10), alpha=0.7))
            ax.text((start + end) / 2, 0.5, f"split {s}\n{start}..{end - 1}", ha="center", va="center", fontsize=7)
        else:
            ax.text(context_len + 2 + 12 * (s - context_len // per_split), 0.5, f"split {s}: empty", fontsize=7, va="center")
    ax.set_xlim(0, context_len + 40); ax.set_ylim(0, 1); ax.set_yticks([]); ax.set_xlabel("token")
    ax.set_title(f"{num_splits} splits of {per_split} tokens (whole tiles of {tile})", fontsize=9)
    plt.show()
    q, kc, vc, bt, cl, ks, vs = make_batch([context_len, max(1, context_len // 3)], dtype=dtype)
    try:
        out = L4.paged_attention_forward(q, kc, vc, bt, cl, context_len, num_splits=num_splits)
        print("split-K max error vs float64:", float((out.double().cpu() - sdpa_per_sequence(q, ks, vs)).abs().max()))
    except NotImplementedError as err:
        print(f"not implemented yet: {err}")


widgets.interact(show_splits, context_len=widgets.IntSlider(70, 1, 200), num_splits=widgets.IntSlider(3, 1, 8),
                 tile=widgets.fixed(16));
""")

code(r"""
def check_merge():
    # Two halves of one softmax, merged, must equal the softmax over everything.
    scores, values = torch.randn(40, dtype=torch.float64) * 3, torch.randn(40, 16, dtype=torch.float64)
    parts, lses = [], []
    for chunk in (slice(0, 25), slice(25, 40)):
        s = scores[chunk]
        parts.append(torch.softmax(s, 0) @ values[chunk]); lses.append(torch.logsumexp(s, 0))
    part_out = torch.stack(parts)[None, None].float()          # [1, 1, 2, 16]
    part_lse = torch.stack(lses)[None, None].float()           # [1, 1, 2]
    merged = L4.merge_split_results(part_out.to(device), part_lse.to(device))
    print("merge error:", float((merged.double().cpu()[0, 0] - torch.softmax(scores, 0) @ values).abs().max()))

try_it(check_merge)
""")

md(r"""
## 5. Task 4: sliding windows

Some models let a layer see only the last `w` tokens: Mistral 7B (`w = 4096` in every layer), Gemma 2 and 3
and gpt-oss (every other layer, or five layers in six), Qwen2 (the upper layers, when enabled). Stacked
layers still carry information further back, and each windowed layer's decode costs `w` tokens of K/V, not
the whole context.

The newest token of a sequence of `n` tokens sees positions `max(0, n - w) .. n - 1` (the rule Hugging Face
applies: `j > p - w` for the query at `p = n - 1`). For your kernel that is one change where each split's
range begins: it starts at the sequence's first visible token instead of 0, and the splits share out
`min(max_context_len, w)` tokens instead of the whole context. Nothing else: the loop already looks up each
token's block from its position, so a window that starts in the middle of a block or a tile just works.
The blocks before the window are **never read**; the grader fills them with NaN to make sure.

Measured on the H200 (`bench/README.md`, "Sliding-window decode"): at batch 32, 8 KV heads and a 32k context, a
4096-token window takes 139.7 us, the same as a 4096-token context (139.5 us) and 7x less than the whole
context (976.1 us). The engine's old path for windowed layers, gathering every cached token and masking,
took 48 ms for the same call.

Until you do task 4, tasks 1 and 2 raise `NotImplementedError("lesson 04, task 4: ...")` when
`sliding_window` is set (their docstrings say so); the engine then runs the reference for windowed models.

The picture: which blocks one decode step reads, for a window of `w` tokens (drag it).
""")

code(r"""
def show_window(context_len=45, window=20, block_size=8):
    first = max(0, context_len - window)
    fig, ax = plt.subplots(figsize=(10, 1.3))
    for t in range(context_len):
        seen = t >= first
        ax.add_patch(patches.Rectangle((t, 0), 0.9, 0.9, color="tab:green" if seen else "lightgray"))
    for j in range(math.ceil(context_len / block_size)):
        read = (j + 1) * block_size > first
        ax.add_patch(patches.Rectangle((j * block_size - 0.05, -0.1), block_size, 1.1, fill=False,
                                       ec="black" if read else "silver", lw=1.2 if read else 0.6))
    blocks_read = math.ceil(context_len / block_size) - first // block_size
    ax.set_xlim(-1, context_len + 1); ax.set_ylim(-0.3, 1.2); ax.axis("off")
    ax.set_title(f"the newest token sees tokens {first}..{context_len - 1} (green); "
                 f"{blocks_read} of {math.ceil(context_len / block_size)} blocks are read (black)", fontsize=9)
    plt.show()
    q, kc, vc, bt, cl, ks, vs = make_batch([context_len, max(1, context_len // 3)], block_size=block_size, dtype=dtype)
    seen_k = [k[max(0, k.shape[0] - window):] for k in ks]
    seen_v = [v[max(0, v.shape[0] - window):] for v in vs]
    try:
        out = L4.paged_attention_forward(q, kc, vc, bt, cl, context_len, num_splits=2, sliding_window=window)
        print("windowed kernel, 2 splits: max error vs float64 over the window:",
              float((out.double().cpu() - sdpa_per_sequence(q, seen_k, seen_v)).abs().max()))
    except NotImplementedError as err:
        print(f"not implemented yet: {err}")


widgets.interact(show_window, context_len=widgets.IntSlider(45, 1, 120), window=widgets.IntSlider(20, 1, 120),
                 block_size=widgets.fixed(8));
""")

md(r"""
## 6. The decode roofline, measured

The points below are read from `bench/results/lesson04_<gpu>.json`, made on a lent GPU with
`yaie bench lesson04 --solutions` (the same script measures the card's copy bandwidth and bf16 matmul rate:
the two roofs). Every point sits at arithmetic intensity `group` FLOPs/byte, far left of the ridge: the
height it reaches is its share of memory bandwidth. Right: achieved K/V bandwidth against context length,
beside torch SDPA on the same data laid out contiguously.
""")

code(r"""
def find_root():
    for folder in [Path.cwd(), *Path.cwd().parents]:
        if (folder / "bench" / "results").is_dir():
            return folder
    return None

root = find_root()
result_files = sorted((root / "bench" / "results").glob("lesson04_*.json")) if root else []
result_files = [p for p in result_files if re.fullmatch(r"lesson04_[a-z0-9-]+\.json", p.name)]
print("results found:", [p.name for p in result_files] or "none (run `yaie bench lesson04` on a GPU)")


def decode_roofline(path):
    data = json.loads(path.read_text())
    peaks, env = data["peaks"], data["environment"]
    bw, flops_peak = peaks["copy_GBps"] * 1e9, peaks["bf16_matmul_TFLOPs"] * 1e12
    rows = [r for r in data["rows"] if r["kernel"] == "paged_decode"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    intensity = np.logspace(-1, 3.5, 200)
    ax.loglog(intensity, np.minimum(flops_peak, intensity * bw) / 1e12, "k-", label="roofline (measured roofs)")
    markers = {"yaie triton": "o", "torch SDPA (flash)": "s", "torch SDPA (cudnn)": "^"}
    for impl, marker in markers.items():
        pts = [r for r in rows if r["impl"] == impl]
        if not pts:
            continue
        group = [int(re.search(r"h(\d+)/(\d+)", r["shape"]).group(1)) / int(re.search(r"h(\d+)/(\d+)", r["shape"]).group(2))
                 for r in pts]
        # FLOPs = 4 * head_dim per (query head, token); bytes = 4 * head_dim per (KV head, token) in bf16.
        ax.loglog(group, [g * r["GBps"] / 1e3 for g, r in zip(group, pts)], marker, alpha=0.6, label=impl)
    ax.axvline(flops_peak / bw, color="gray", ls=":", label=f"ridge: {flops_peak / bw:.0f} FLOP/byte")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)"); ax.set_ylabel("TFLOP/s"); ax.legend(fontsize=7)
    ax.set_title(f"decode roofline: {env['gpu']}", fontsize=9)
    for impl, marker in markers.items():
        for kv in ("8", "4"):
            pts = sorted(((int(re.search(r"ctx(\d+)", r["shape"]).group(1)), r["GBps"], r["shape"]) for r in rows
                          if r["impl"] == impl and f"/{kv} " in r["shape"] and r["shape"].startswith("b32 ")),
                         key=lambda p: p[0])
            if pts:
                ax2.semilogx([p[0] for p in pts], [p[1] for p in pts], marker + ("-" if kv == "8" else "--"),
                             label=f"{impl}, batch 32, GQA {32 // int(kv)}:1")
    ax2.axhline(peaks["copy_GBps"], color="black", ls=":", label="measured copy bandwidth")
    ax2.set_xlabel("context length (tokens)"); ax2.set_ylabel("K/V GB/s"); ax2.legend(fontsize=7)
    ax2.set_title("achieved bandwidth vs context (batch 32)", fontsize=9)
    plt.tight_layout(); plt.show()


for path in result_files[:1]:
    decode_roofline(path)
""")

md(r"""
What the measurement says (H200, `bench/README.md`): from 4k tokens of context the kernel reads K/V at
80-103% of the copy bandwidth and beats SDPA's flash backend at every shape (1.03-1.72x). SDPA's default
backend is cuDNN, and the lesson's target against it is "within 3% at >= 4k tokens, with a page-local
allocator": met, 0.5-0.9% behind cuDNN on the cache lesson 03's page-local free list leaves under a serving
workload and 0.4-2.5% with every sequence's blocks in order. On the benchmark's cache, whose blocks are
shuffled over all of memory, it trails by 1-3% (6% at the shortest context). Three changes of the reference
each bought a few percent: fusing the split merge into the decode kernel (2.6-8 us per call), unrolling that
merge so every split's partial result is requested at once, and choosing splits and pipeline depth by
waves: about 2 programs per multiprocessor, with 3 stages when they all fit at once (up to 10% at a 1k
context).

### Going further: the last percent

Where does the rest go? Fit time = fixed cost + bytes / rate over the context lengths: both kernels pay
about 15-21 us per call whatever the length, but cuDNN streams K/V at 4.55-4.62 TB/s and ours at 4.45-4.49
TB/s on the shuffled paged cache (4.49-4.53 TB/s on contiguous tensors). So part of the gap is where the
blocks lie, part is the kernel. `docs/decode_kernel_findings.md` collects the experiments that took it apart,
with their numbers; the scripts are in the repository's history (check out commit 9fb4f33 to rerun them).

*The arithmetic is not the gap.* A copy of the loop with the online softmax removed (the scores go straight
into `P @ V`) takes the same time as the full kernel. cuDNN's kernel, read from a `torch.profiler` trace, has
the same grid as ours (one block of 128 threads per sequence and KV head, no split); its blocks simply stream
faster. Nsight Compute finds both reading the same bytes from DRAM, ours issuing about twice the
instructions.

*Other loops were not faster.* Each was the standard cure for one suspect, and each was correct and 0-40%
slower at its best setting: giving every warp its own slice of keys (a batched `tl.dot`, so the softmax
reductions stay inside a warp), padding the query rows to 64 so Triton emits Hopper's `wgmma`, loading the
next tile into registers by hand, whole tiles without masks, L2 prefetches ahead of the pipeline (they stop
the software pipeliner), small extra splits for the last tiles, a persistent grid taking work from an atomic
queue, and TMA loads. A warp-specialised kernel written in Gluon, Triton's lower-level language (one loader
warp filling a ring of shared-memory buffers with the TMA engine, four compute warps), landed within about a
percent of our Triton kernel, still 1-3% behind cuDNN.

*Energy and pages.* At full memory bandwidth the H200 runs at its 700 W power cap: every kernel draws 695 W,
the memory clock holds, and the SM clock drops by the energy a kernel spends per byte (back to back: 1935 MHz
under cuDNN and the Gluon kernel, 1740-1770 MHz under our Triton kernel, which issues more instructions). And
block placement costs at the scale of 2 MiB pages: blocks shuffled only within each 2 MiB are as fast as
blocks in order, while 64-token runs scattered over random pages cost as much as a full shuffle. The penalty
follows the number of pages a program wanders over, the signature of address translation. Hence lesson 03's
page-local free list (exercise 15). A memory-bound kernel near the roofline is judged by its energy and its
access pattern, not by its FLOPs; exercises 9-13 let you see both.

### Going further: one kernel for the step's attention

Before your kernel runs, a decode step rotates the new token's query and key (RoPE) and writes its key and
value into the cache: in the reference, one small kernel of lesson 02 per layer, whose cost is its launch
and latency rather than its bytes. The reference's `paged_decode_with_rope` folds that work into the decode
kernel. Every program rotates its group's queries as it loads them (a few hundred bytes; each split does it
again), and the ONE program whose range of the context holds the new token, the sequence's last, rotates its
key and stores it and its value into the cache, then waits at a barrier (`tl.debug_barrier()`) so that its
loop reads back what it stored. In the engine's decode steps (`yaie.ops.rope_and_paged_attention`) this
raised the random 1.1B Llama's batch-1 decode by about 2% on an H100 (`bench/results/engine_fused_decode_ab_h100.md`).
Why must the program that stores the key be the one whose range holds the new token, and what would go
wrong if another split's program stored it?
""")

md(r"""
## Exercises

1. Implement tasks 1-4. Run `pytest grader/lesson04 -k task2` while you work on the kernel.
2. The grader fills every unused cache row with NaN. Which mask in your kernel keeps those NaNs out of the
   output, and why is masking the *load* not enough on its own (hint: what is `0 * q` in the score, and what
   does `exp2(0 - m)` add to `l`)?
3. GQA: what would it cost in bytes read if each program handled ONE query head instead of a KV head's group?
4. Why round the split length up to whole tiles? What happens to the last split when `num_splits` exceeds
   `context_len / tile`? (Check with the widget.)
5. On a GPU, `yaie bench lesson04` times your kernel; compare the `split sweep` rows with
   `choose_num_splits` and explain why one split more can make a decode step 20% slower (hint: how many
   programs fit on a multiprocessor at once, and what happens to the ones that do not?).
6. The reference solution fuses the merge into the decode kernel: each split bumps an atomic counter of its
   (sequence, KV head) after storing its partial result, and the split that sees `num_splits - 1` merges.
   Why is there a barrier (`tl.debug_barrier()`) before the atomic, why does the merging program read the
   partials with `cache_modifier=".cg"`, and what would go wrong on the NEXT call if it did not reset the
   counter to 0?
7. The solution reads the block ids of the next tile one iteration ahead. Compile the kernel for sm_90 with and
   without that look-ahead (`triton.compile` with a `GPUTarget("cuda", 90, 32)` works without a GPU) and compare
   `metadata.shared` at `num_stages` 2, 3 and 4: how many K/V buffers does the software pipeliner keep in each
   case, and why does a load whose address comes from another load of the same iteration stop it?
8. On CUDA the engine replays its decode steps from CUDA graphs (`yaie/engine/cuda_graphs.py`, `docs/engine.md`):
   a graph replays the kernels it recorded with the *same* Python numbers. `max_context_len` is a Python int
   that decides your split ranges. What goes wrong if a graph recorded at context 300 is replayed at context
   3000 with `max_context_len` still 300? How does the engine avoid it, and what does the context "bound" it
   passes instead cost when it is much larger than the real contexts? (Why must `paged_attention_forward`
   never call `.item()` or `int(tensor)` when `validate=False`?)
9. (GPU) When does each program finish? Copy your kernel, read `tl.extra.cuda.globaltimer()` at its start and
   store it, the time at its end and `tl.extra.cuda.smid()` per program into an int64 buffer (the
   `TIMELINE_EDITS` of `scripts/gpu_lesson04_tune.py` at commit 9fb4f33 do this to the reference by text
   edits). Sort the end
   times of one call and plot them. Programs with the same work: why do they not end together, which ones end
   first (count programs per multiprocessor), and how much faster would the call be if every program ended at
   the average time?
10. (GPU) Profile SDPA on a decode shape (`torch.profiler.profile(activities=[ProfilerActivity.CUDA])`, then
    `export_chrome_trace`): which kernel runs, with which grid, block, registers and shared memory (the `args`
    of the kernel events)? Do the same for your kernel. Then read your kernel's PTX (a Triton launch returns
    the compiled kernel; its `asm["ptx"]`): find the loop, count its `bar.sync`, `cp.async` and `mma`
    instructions, and say which line of your Triton code each barrier comes from.
11. Which tensor-core instruction does `tl.dot` become? Compile your kernel for sm_90 on the CPU
    (`triton.compile` with `GPUTarget("cuda", 90, 32)`, as in exercise 7) with the group padded to 16 rows and
    to 64 rows, and count `mma.sync` and `wgmma` in the PTX. Then write a batched version of the score
    product, `[LANES, 16, D] x [LANES, D, LANE_N]`, and find in its layout (`asm["ttgir"]`, the
    `warpsPerCTA` of the `#mma` encoding) where the 4 warps went. For each version, which softmax
    reductions cross warps, and why does that decide how many `bar.sync` the loop needs?
    (`scripts/paged_decode_lanes.py` and `ROWS_EDITS` in `scripts/gpu_lesson04_tune.py` at commit 9fb4f33
    are the reference's versions; `docs/decode_kernel_findings.md` has their times.)
12. (GPU) Power and clocks. Replay your kernel from a CUDA graph back to back for a few seconds while
    `nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active --format=csv -lms 20`
    runs beside it (`_sample_gpu` in `scripts/gpu_lesson04_tune.py` at commit 9fb4f33 does this), then do the
    same for SDPA.
    Which clock moves, which one does not, and which bit of the clock-event reasons is set? Why can a kernel
    that issues more instructions per byte end up slower on a *memory-bound* problem? Then time both with the
    L2 flushed between calls (`triton.testing.do_bench`): does the gap change, and why might it?
13. (GPU, advanced) Read `scripts/paged_decode_gluon.py` (`git show 9fb4f33:scripts/paged_decode_gluon.py`).
    Draw the ring: which barrier does the loader wait on
    before it overwrites a buffer, which one do the compute warps wait on, and what phase does each wait
    for on the first and the second pass through the ring? Why does the loader's first wait on a freshly
    initialised "empty" barrier return at once? Why must the compute warps zero the V rows past the context
    (`gl.where` on `v`) even though their scores are already `-inf`? Change the ring from 2 to 4 buffers
    and explain the time you measure (hint: shared memory per program, programs per multiprocessor).
14. Sliding windows: once a block lies wholly before the window of every windowed layer, no decode step
    reads it again. Could the engine give it back to the free list? Look at how lesson 03 stores a block
    (one block id covers the same rows of *every* layer's cache): for Mistral (all layers windowed) what would
    freeing take (the block table row, `context_lens`, and the positions of later tokens), and why does it not
    work for Gemma or Qwen2, where some layers see the whole context? What does the kernel need to know if
    the table no longer starts at token 0?
15. The allocator the last measurement asks for is lesson 03's `FreeBlocks`: a sequence's next block comes from
    the 2 MiB of cache that holds its previous block when one is free there. How many blocks is 2 MiB for
    your model's layer? Which invariants of lesson 03 must still hold, what does it cost per allocation, and
    what happens when the cache is nearly full? `scripts/gpu_lesson03_allocator.py` (at commit 9fb4f33) runs
    the same serving
    workload through the old stack and through `FreeBlocks`, then times lesson 04 on both caches: change the
    policy (a queue; the fullest page instead of the emptiest) and see what it does to the pages per sequence
    and to the time.

## Grade
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(4)
""")

notebook.write("lessons/04_paged_attention/04_paged_attention.ipynb")
