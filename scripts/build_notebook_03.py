"""Write lessons/03_paged_kv_cache/03_paged_kv_cache.ipynb (stored without outputs).

    python scripts/build_notebook_03.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 03: the paged KV cache

While a model generates, every layer keeps the **keys and values** of every earlier token of every running
sequence: that is the KV cache. For a Llama-8B-like layer (8 KV heads of 128 numbers, bf16) one token costs
`2 x 8 x 128 x 2 = 4 KiB` per layer, 128 KiB over 32 layers: a 4k-token conversation holds 512 MiB.

The naive cache gives each sequence one contiguous tensor sized for its *maximum* length. Sequences end
early and their lengths are unknown in advance, so most of that memory is reserved and never written, and
what is freed comes back in odd-sized holes. The **paged** cache (vLLM's PagedAttention) borrows the idea of
virtual memory:

* memory is cut into fixed-size **blocks** of `block_size` tokens (in every layer at once);
* each sequence has a **block table**: its logical block `j` lives in physical block `table[j]`;
* a sequence takes one more block only when its last block is full, so at most `block_size - 1` slots per
  sequence are wasted;
* blocks are **reference counted**, so sequences can share them (`fork`: parallel sampling, beam search),
  copying a shared block only when one of them writes into it (**copy-on-write**);
* when blocks run out, a whole sequence can be **swapped** to host memory and back.

You will fill in `yaie/kernels/kv_cache.py`:

| task | what | methods |
|---|---|---|
| 1 | the memory pool: one preallocated arena, first-fit, coalescing | `MemoryPool.allocate / free / view` |
| 2 | block bookkeeping | `KVCacheManager.allocate / append_slots / free / block_table / context_lens` |
| 3 | writing K/V, the block-copy op, sharing | `write_kv / copy_blocks / fork` (copy-on-write lives in `append_slots`) |
| 4 | swapping through (pinned) host memory | `swap_blocks_to_cpu / swap_blocks_from_cpu / swap_out / swap_in` |

Do task 1 first: the manager's constructor carves its cache tensors out of a `MemoryPool`, so nothing else
works before the pool does. Grade with `pytest grader/lesson03` (or the last cell), one task with `-k task2`.
The grader's property tests use `hypothesis` (`pip install hypothesis`; without it they fall back to Python's
`random`, with less helpful failure reports).
""")

code(r"""
import matplotlib.pyplot as plt
import matplotlib.patches as patches
import torch
import ipywidgets as widgets

from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe, use_solutions

L3 = LessonProxy(3)           # your yaie/kernels/kv_cache.py, or the reference if the switch says so
# use_solutions(3)            # uncomment to run the reference for lesson 03
print(describe())

""")

md(r"""
## 1. Block tables: logical tokens, physical blocks

The layout of one layer's cache is `[num_blocks, block_size, num_kv_heads, head_dim]`: **token-major inside a
block**, so one token's vector of one head is `head_dim` contiguous numbers and a kernel reads it with wide,
coalesced loads. Token `t` of a sequence lives at

$$\text{block} = \text{table}[t \,/\!/\, \text{block\_size}], \qquad \text{row} = t \bmod \text{block\_size},
\qquad \text{slot} = \text{block} \cdot \text{block\_size} + \text{row}.$$

Viewing the layer as `[num_blocks * block_size, num_kv_heads, head_dim]`, the **slot** is simply the row
index: writing a new token's K/V is `cache.view(-1, H, D)[slot] = k`.

The picture: three sequences (lengths 11, 6 and 14, blocks of 4 tokens) and the physical blocks their tables
point to. Sequences need not own neighbouring blocks, and only the last block of each is partly empty.
""")

code(r"""
def draw_block_tables(tables, lengths, block_size, num_blocks, title="block tables"):
    colors = plt.cm.tab10.colors
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.9 + 0.6 * max(len(tables), 3)),
                                      gridspec_kw={"width_ratios": [1.2, 1]})
    owner = {}
    for s, (table, n) in enumerate(zip(tables, lengths)):
        for j, block in enumerate(table):
            filled = min(block_size, n - j * block_size)
            owner.setdefault(block, []).append((s, filled))
            left.add_patch(patches.Rectangle((j * 1.1, -s), 1, 0.8, color=colors[s % 10], alpha=0.35 + 0.6 * filled / block_size))
            left.text(j * 1.1 + 0.5, -s + 0.4, f"->{block}", ha="center", va="center", fontsize=8)
        left.text(-0.2, -s + 0.4, f"seq {s} ({n} tok)", ha="right", va="center", fontsize=8)
    left.set_xlim(-2.2, 1.1 * max(len(t) for t in tables) + 0.2); left.set_ylim(-len(tables) + 0.6, 1.0)
    left.set_title("logical blocks (-> physical id)", fontsize=9); left.axis("off")
    cols = 8
    for block in range(num_blocks):
        x, y = block % cols, -(block // cols)
        users = owner.get(block, [])
        color = colors[users[0][0] % 10] if users else "white"
        right.add_patch(patches.Rectangle((x * 1.1, y), 1, 0.8, facecolor=color, edgecolor="gray",
                                          alpha=0.8 if users else 1.0, hatch="//" if len(users) > 1 else None))
        label = f"{block}" + (f"\n{users[0][1]}/{block_size}" if users else "\nfree")
        right.text(x * 1.1 + 0.5, y + 0.4, label, ha="center", va="center", fontsize=7)
    right.set_xlim(-0.1, cols * 1.1); right.set_ylim(-(num_blocks - 1) // cols - 0.3, 1.0)
    right.set_title("physical blocks (filled slots; hatched = shared)", fontsize=9); right.axis("off")
    fig.suptitle(title, fontsize=10)
    plt.show()


draw_block_tables(tables=[[5, 0, 9], [2, 7], [11, 3, 6, 14]], lengths=[11, 6, 14], block_size=4, num_blocks=16,
                  title="three sequences in a 16-block cache (block_size 4)")
""")

md(r"""
## 2. Task 1: one arena, carved up

`cudaMalloc` is slow and synchronising, and a caching allocator fragments over hours of serving. The engine
therefore reserves **one** byte arena when it starts and carves every KV tensor out of it: while serving, the
device allocator is never called. `MemoryPool` is a first-fit allocator over that arena:

* `free_ranges`: sorted `(offset, size)` pairs, never two touching;
* `allocate(size, alignment)`: the first range that fits after rounding its start up to `alignment`; cut it;
* `free(handle)`: put the range back and **coalesce** with the free neighbours on both sides;
* `view(handle, shape, dtype)`: a typed tensor over the allocation's bytes (`arena[a:b].view(dtype).view(shape)`).

Run it: a few allocations, a hole, and what coalescing does.
""")

code(r"""
def pool_demo():
    pool = L3.MemoryPool(4096, "cpu")
    a = pool.allocate(1000)
    b = pool.allocate(500, alignment=512)
    c = pool.allocate(700)
    print("handles (byte offsets):", a, b, c)
    pool.free(b)
    print("after free(b):         ", pool.free_ranges)
    pool.free(a)
    print("after free(a):         ", pool.free_ranges, "<- a and b merged")
    x = pool.view(c, (7, 25), torch.float32)
    print("a float32 view of c:", tuple(x.shape), "same memory:", x.data_ptr() == pool.arena.data_ptr() + c)

try_it(pool_demo)
""")

md(r"""
## 3. Tasks 2 and 3: allocate, append, fork

`allocate(seq, n)` reserves `ceil(n / block_size)` blocks **all or nothing** and returns the slot of each
token; `append_slots(seq, k)` reserves the slots of `k` more tokens. If there are not enough free blocks, the
call raises `OutOfBlocks` and changes **nothing** (the scheduler of the engine relies on it: it tries, and on
failure preempts someone and tries again).

`fork(parent, child)` shares every block (reference counts go up). When the child then appends into a
**shared, partly filled** last block, `append_slots` first copies that block (`copy_blocks`) so the parent
keeps its tokens: copy-on-write. Below: a parent with 6 tokens, two children that each append a token.
""")

code(r"""
def fork_demo():
    m = L3.KVCacheManager(num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                          dtype=torch.float32, device="cpu")
    slots = m.allocate("parent", 6)
    m.write_kv(0, slots, torch.randn(6, 1, 8), torch.randn(6, 1, 8))
    m.fork("parent", "a"); m.fork("parent", "b")
    print("after fork:  ref counts", [m.blocks[i].ref_count for i in m.block_ids("parent")])
    for child in ("a", "b"):
        m.append_slots(child, 1)
    seqs = ["parent", "a", "b"]
    for s in seqs:
        print(f"{s:7s} blocks {m.block_ids(s)}  tokens {m.num_tokens(s)}")
    draw_block_tables([m.block_ids(s) for s in seqs], [m.num_tokens(s) for s in seqs], 4, 16,
                      title="fork + copy-on-write: the first block stays shared, the half-full one was copied")

try_it(fork_demo)
""")

md(r"""
## 4. Fragmentation, interactively

Allocate and free sequences and watch the cache. **Internal fragmentation** is the unused slots in each
sequence's last block (at most `block_size - 1` per sequence); there is no external fragmentation: any free
block serves any sequence, wherever it sits. Compare with a contiguous cache that reserves `max_len` tokens
per sequence. Try a big `block_size` (less table overhead, more waste) and a small one.
""")

code(r"""
state = {}


def new_cache(block_size):
    state["m"] = L3.KVCacheManager(num_blocks=32, block_size=block_size, num_layers=1, num_kv_heads=1,
                                   head_dim=8, dtype=torch.float16, device="cpu")
    state["next"] = 0


def show(message=""):
    m = state["m"]
    seqs = [s for s in m.seq_ids()]
    used_slots = sum(m.num_tokens(s) for s in seqs)
    held = sum(len(m.block_ids(s)) for s in seqs) * m.block_size
    waste = held - used_slots
    print(message)
    print(f"{len(seqs)} sequences, {used_slots} tokens in {held // m.block_size} blocks: "
          f"{waste} slots unused ({100 * waste / max(held, 1):.0f}% internal fragmentation); "
          f"{m.num_free_blocks}/{m.num_blocks} blocks free")
    print(f"a contiguous cache reserving 64 tokens per sequence would hold {64 * len(seqs)} slots "
          f"for the same {used_slots} tokens")
    if seqs:
        draw_block_tables([m.block_ids(s) for s in seqs], [m.num_tokens(s) for s in seqs], m.block_size,
                          m.num_blocks, title="the cache now")


def play(block_size=8, action="allocate", tokens=13, which=0):
    if "m" not in state or state["m"].block_size != block_size:
        new_cache(block_size)
    m = state["m"]
    seqs = m.seq_ids()
    try:
        if action == "allocate":
            m.allocate(state["next"], tokens); state["next"] += 1
        elif action == "append" and seqs:
            m.append_slots(seqs[which % len(seqs)], tokens)
        elif action == "free" and seqs:
            m.free(seqs[which % len(seqs)])
        show(f"{action} done")
    except L3.OutOfBlocks as err:
        show(f"OutOfBlocks: {err}")


def fragmentation_widget():
    new_cache(8)
    for n in (13, 40, 5, 22):                 # a few sequences to start with
        state["m"].allocate(state["next"], n); state["next"] += 1
    widgets.interact(play, block_size=widgets.Dropdown(options=[4, 8, 16, 32], value=8),
                     action=widgets.ToggleButtons(options=["allocate", "append", "free"]),
                     tokens=widgets.IntSlider(13, 1, 64), which=widgets.IntSlider(0, 0, 10))

try_it(fragmentation_widget)
""")

md(r"""
## 5. Task 4: swapping

When the device runs out of blocks the engine **preempts** a sequence: either it frees it and recomputes its
prompt later, or it **swaps** its blocks to host memory and back. Host blocks are **pinned** (page-locked)
memory when CUDA is present: the GPU's copy engines can then DMA them asynchronously (`copy_(...,
non_blocking=True)`), while pageable memory needs a staging copy. The round trip must be bit for bit
identical: it is a copy, not a conversion.
""")

code(r"""
def swap_demo():
    m = L3.KVCacheManager(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                          dtype=torch.bfloat16, device="cpu", num_cpu_blocks=8)
    slots = m.allocate("s", 10)
    k = torch.randn(10, 2, 8).to(torch.bfloat16)
    for layer in range(2):
        m.write_kv(layer, slots, k, k)
    m.swap_out("s")
    print("swapped out:", m.is_swapped("s"), "| device blocks free:", m.num_free_blocks,
          "| host blocks free:", m.num_free_cpu_blocks)
    m.allocate("other", 8)        # someone else takes device blocks meanwhile
    m.swap_in("s")
    ids = torch.tensor(m.block_ids("s"))
    t = torch.arange(10)
    back = m.k_cache[1][ids[t // 4], t % 4]
    print("back in blocks", m.block_ids("s"), "| bit identical:", torch.equal(back.view(torch.int16), k.view(torch.int16)))

try_it(swap_demo)
""")

md(r"""
## Exercises

1. Implement tasks 1-4 in `yaie/kernels/kv_cache.py`, in order. Run `pytest grader/lesson03 -k task1` after each.
2. `append_slots` on a shared last block that is **full** needs no copy. Why? What does a beam search of width
   4 over a 1000-token prompt cost in blocks right after `fork`, and after each beam adds one token?
3. The free list (`FreeBlocks`, given in `yaie/kernels/kv_cache_given.py`) hands a sequence its next block from the 2 MiB page of its last block
   when it can, and otherwise from the page with the most free blocks; within a page, the most recently freed
   block goes first. Pass `near=table[-1]` to `_take_blocks` in your `append_slots`. Why does a plain stack of
   ids scatter a batch that decodes in lockstep over hundreds of pages per sequence, and why does the decode
   kernel of lesson 04 care (`bench/README.md`, lessons 03 and 04: 0.6-0.9% of decode time on an H200)?
4. `OutOfBlocks` must leave the manager unchanged. Find the line in your `append_slots` where a half-done update
   could happen if you checked for room too late.
5. The grader's random programs (`grader/lesson03/programs.py`) check every invariant after every step. Break
   your copy-on-write on purpose and watch hypothesis shrink the failing program to a few calls.

## Grade

The cell below runs `pytest grader/lesson03` in a fresh process and prints the report.
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(3)
""")

notebook.write("lessons/03_paged_kv_cache/03_paged_kv_cache.ipynb")
