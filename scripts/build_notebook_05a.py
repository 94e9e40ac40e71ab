"""Write lessons/05_radix_flashinfer/05a_radix_tree.ipynb (stored without outputs).

    python scripts/build_notebook_05a.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 05, part 1: radix prefix sharing

A server sees the same beginnings again and again: a system prompt, a few-shot preamble, the earlier turns of
a chat. The key and value of a token depend only on the tokens *before* it, so two prompts that start with
the same 2,000 tokens have the same K/V for those 2,000 tokens. Computing them once and **sharing the cache
blocks** saves both the prefill work and the memory.

This part keeps the books for that, on top of the paged cache of lesson 03 (blocks of `block_size` tokens,
reference-counted):

| task | what | where |
|---|---|---|
| 1 | `RadixAttentionBlock`: a radix tree over token ids whose nodes own cache blocks: `match_prefix`, `insert` (with node splitting), `lock`/`unlock`, `evict` (least recently used leaves) | `yaie/kernels/radix_attention.py` |
| 2 | `RadixAttentionWithPagedKVCache`: the glue a serving engine needs: match a prompt, share the matched blocks, allocate the rest, attend over the new tokens only, cache what was computed, free | same file |

The attention of new tokens over a cached prefix is the **prefix-prefill kernel** (`05b_prefix_prefill.ipynb`,
tasks 3-4); the engine's automatic prefix caching (`LLM(..., prefix_caching=True)`, the default) runs on the
classes you write here. Grade with `pytest grader/lesson05 -k "task1 or task2"` or the last cell.
""")

code(r"""
from yaie.device import prepare_triton, default_device
interpreted = prepare_triton()          # the glue's attention runs a Triton kernel (interpreted on a CPU)

import ipywidgets as widgets
import matplotlib.pyplot as plt
import matplotlib.patches as patches
import torch

from yaie import ops
from yaie.engine import DEFAULT_MODEL
from yaie.model.tokenizer import Tokenizer
from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe

L5 = LessonProxy(5)          # your radix tree and glue, or the reference if YAIE_SOLUTIONS says so
tokenizer = Tokenizer(DEFAULT_MODEL)
print("Triton interpreter:", interpreted, "|", describe())
""")

md(r"""
## 1. Prompts as token ids, cut into blocks

The cache stores K/V in blocks of `block_size` tokens, so sharing happens **a whole block at a time**: two
prompts share block `j` only if they agree on every token up to the end of that block. Here are four real
prompts, tokenized by the bundled model's tokenizer, cut into blocks of 4 tokens:
""")

code(r"""
BLOCK = 4
SYSTEM = "You are a kind teacher who tells short stories to children. "
prompts = [SYSTEM + "Tell me about a fox who lived in the woods.", SYSTEM + "Tell me about a cat who had a boat.",
           SYSTEM + "Why is the sky blue?", "Once upon a time, there was a little girl named Lily."]
ids = [tokenizer.encode(p) for p in prompts]

def show_blocks(token_ids, block_size=BLOCK):
    words = [tokenizer.decode([t]) or "<s>" for t in token_ids]
    blocks = ["".join(words[i:i + block_size]) for i in range(0, len(words), block_size)]
    return " | ".join(repr(b) for b in blocks)

for p in ids:
    print(len(p), "tokens:", show_blocks(p))
""")

md(r"""
## 2. The radix tree (task 1)

A **radix tree** stores the cached sequences so that common beginnings are stored once. An edge is labelled
with whole blocks of token ids and owns their block ids; a path from the root spells a cached prefix.
Children are found by their first block. When a new sequence leaves an edge in the middle, the edge is
**split** at the block where they differ.

Implement `_walk`, `match_prefix`, `insert`, `_split`, `lock`, `unlock` and `evict` in
`yaie/kernels/radix_attention.py`. The cell below inserts the four prompts (with made-up block ids) and draws
the tree: each box is a node, its text the tokens of its edge, its colour how many of the prompts pass
through it.
""")

code(r"""
def edge_text(node, limit=28):
    text = tokenizer.decode(list(node.tokens)).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."

def draw_tree(tree, ax, title="", counts=None, locked_color="tab:red"):
    # Leaves get one row each; a node sits at the mean row of its leaves, at the depth of its first token.
    rows, placed = {}, []
    def place(node, depth):
        kids = sorted(node.children.values(), key=lambda n: n.tokens)
        if not kids:
            rows[id(node)] = len(placed); placed.append(node)
        for child in kids:
            place(child, depth + len(node.tokens))
        if kids:
            rows[id(node)] = sum(rows[id(k)] for k in kids) / len(kids)
        node_depth[id(node)] = depth
    node_depth = {}
    place(tree.root, 0)
    ax.clear()
    ax.set_title(title)
    ax.axis("off")
    width = max([node_depth[id(n)] + len(n.tokens) for n in tree.nodes()] + [1])
    for node in tree.nodes():
        x0, y = node_depth[id(node)], -rows[id(node)]
        share = (counts or {}).get(id(node), 1)
        color = plt.cm.Blues(0.25 + 0.6 * min(share, 4) / 4)
        ax.add_patch(patches.FancyBboxPatch((x0 + 0.2, y - 0.3), len(node.tokens) - 0.4, 0.6,
                                            boxstyle="round,pad=0.02", facecolor=color,
                                            edgecolor=locked_color if node.lock_count else "black",
                                            linewidth=2.5 if node.lock_count else 1))
        ax.text(x0 + len(node.tokens) / 2, y + 0.02, edge_text(node), ha="center", va="center", fontsize=8)
        ax.text(x0 + len(node.tokens) / 2, y - 0.45, f"blocks {node.blocks}", ha="center", va="top", fontsize=7,
                color="dimgray")
        parent = node.parent
        if parent is not None and parent is not tree.root:
            ax.plot([node_depth[id(parent)] + len(parent.tokens), x0 + 0.2], [-rows[id(parent)], y], color="gray")
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(-len(placed) - 0.3, 0.8)
    ax.set_xlabel("token position")

def shared_counts(tree, sequences):
    # How many of the sequences walk through each node.
    counts = {}
    for seq in sequences:
        node, pos = tree.root, 0
        while pos + tree.block_size <= len(seq):
            child = node.children.get(tuple(seq[pos:pos + tree.block_size]))
            if child is None or list(child.tokens) != seq[pos:pos + len(child.tokens)]:
                break
            counts[id(child)] = counts.get(id(child), 0) + 1
            node, pos = child, pos + len(child.tokens)
    return counts

def build_tree():
    tree = L5.RadixAttentionBlock(BLOCK)
    next_block = 0
    for p in ids:
        n = len(p) // BLOCK
        taken = tree.insert(p, list(range(next_block, next_block + n)))
        print(f"inserted {len(p):2d} tokens: the tree took {len(taken)} of {n} blocks -> {list(taken)}")
        next_block += n
    fig, ax = plt.subplots(figsize=(12, 3.2))
    draw_tree(tree, ax, "four prompts in a radix tree (block_size 4)", shared_counts(tree, ids))
    plt.show()
    return tree

tree = try_it(build_tree)


def built_tree():
    # The tree above; while task 1 is unfinished that is None, and this raises its NotImplementedError again.
    return tree if tree is not None else build_tree()
""")

md(r"""
The three prompts that start with the system prompt share one node (dark): its blocks are stored once.
The first two continue together a little longer (`... Tell me about a`) before they differ: inserting the
second one **split** the first one's edge at the first block where they differ, and the third one split it
again, earlier. The fourth prompt shares nothing. (Look at the block ids: the tree kept the first prompt's
blocks for the shared part; the later prompts' own copies of those blocks were not taken.)

Now `match_prefix`: the longest cached prefix in whole blocks. A partial last block never matches.
""")

code(r"""
def matches():
    question = tokenizer.encode(SYSTEM + "Tell me about a dog.")
    found = built_tree().match_prefix(question)
    print(f"{len(question)} tokens; cached: {found.num_tokens} tokens in blocks {list(found.blocks)}")
    print("reused:  ", repr(tokenizer.decode(question[:found.num_tokens])))
    print("to compute:", repr(tokenizer.decode(question[found.num_tokens:])))

try_it(matches)
""")

md(r"""
**Locks and eviction.** A request that reads a cached prefix **locks** its node: `lock_count` goes up on the
node and every ancestor, and `evict` never touches a node whose count is not zero. Eviction takes blocks from
the end of the **least recently used** unlocked leaf (`last_access`: the tree's clock at the last match or
insert that walked through the node), so the deepest, least shared tokens go first, and a node left with no
blocks is removed. Below, the fox prompt is locked (red border) and we ask for 6 blocks back.
""")

code(r"""
def lock_and_evict():
    the_tree = built_tree()
    fox = the_tree.match_prefix(ids[0])
    the_tree.lock(fox.node)
    freed = the_tree.evict(6)
    print("evicted blocks:", list(freed), "| still cached:", the_tree.num_cached_blocks, "blocks")
    fig, ax = plt.subplots(figsize=(12, 2.6))
    draw_tree(the_tree, ax, "after evict(6) with the fox prompt locked (red)")
    plt.show()
    the_tree.unlock(fox.node)

try_it(lock_and_evict)
""")

md(r"""
## 3. The glue with the paged cache (task 2)

Lesson 03's `KVCacheManager` already counts references per block (`fork` and copy-on-write use them). The
tree becomes one more **owner**: a block's `ref_count` is `(1 if the tree caches it) + (number of block tables
holding it)`. A request's life in `RadixAttentionWithPagedKVCache`:

1. `allocate(seq_id, tokens)`: match `tokens[:-1]` (the last token is always computed: its logits pick the
   next token), lock the node, start the block table with the matched blocks (one more reference each),
   allocate the rest, **evicting** unlocked prefixes if the free list is short;
2. `prefill_attention(layer, seq_ids, query_lens, q, k, v)`: write the new K/V, then the prefix-prefill kernel
   attends the new queries to the cached prefix (through the block table) and, causally, to themselves;
3. `cache_sequence(seq_id, tokens)`: put the computed whole blocks into the tree (the tree takes a reference);
4. `free(seq_id, tokens)`: cache, unlock, drop the request's references. What the tree holds stays cached.

The widget below runs that life for each prompt you add, on a small cache: the bar
shows each block (free, cached by the tree only, or held by a running request), the text what was reused
and what was evicted. The cache has 18 blocks of 4 tokens: the last prompt of the demo does not fit beside
what is cached, so the least recently used unlocked blocks are evicted (the running request's are locked).
""")

code(r"""
manager = ops.kv_cache_manager(num_blocks=18, block_size=BLOCK, num_layers=1, num_kv_heads=1, head_dim=4,
                               dtype=torch.float32, device="cpu")
glue = None
history = []

def draw_blocks(ax):
    cached = set(glue.tree.cached_blocks())
    colors = []
    for b in manager.blocks:
        if b.ref_count == 0:
            colors.append("white")
        elif b.block_id in cached and b.ref_count == 1:
            colors.append("tab:blue")
        else:
            colors.append("tab:orange")
    ax.clear()
    ax.bar(range(len(colors)), [1] * len(colors), color=colors, edgecolor="black", width=1.0)
    ax.set_yticks([]); ax.set_xticks(range(len(colors)))
    ax.set_title("cache blocks: white free, blue cached (tree only), orange held by a running request")

def add_prompt(text, keep_running=False):
    global glue
    if glue is None:
        glue = L5.RadixAttentionWithPagedKVCache(manager)
    tokens = tokenizer.encode(text)
    seq_id = f"request {len(history)}"
    evicted_before = glue.stats.evicted_blocks
    try:
        got = glue.allocate(seq_id, tokens)
    except Exception as err:            # the manager's OutOfBlocks: the locked prefixes leave too little room
        print(f"{seq_id} does not fit even after evicting every unlocked prefix: {err}")
        return
    history.append(tokens)
    # (the model would run here: prefill_attention over the new tokens, then decode)
    glue.cache_sequence(seq_id, tokens)
    print(f"{seq_id}: {len(tokens)} tokens, {got.num_cached} reused "
          f"({tokenizer.decode(tokens[:got.num_cached])!r}), {len(tokens) - got.num_cached} computed; "
          f"{glue.stats.evicted_blocks - evicted_before} blocks evicted to make room")
    if not keep_running:
        glue.free(seq_id, tokens)
    fig, (ax_tree, ax_blocks) = plt.subplots(2, 1, figsize=(12, 4.5), gridspec_kw=dict(height_ratios=[3, 1]))
    draw_tree(glue.tree, ax_tree, f"the prefix cache after {seq_id}", shared_counts(glue.tree, history))
    draw_blocks(ax_blocks)
    plt.tight_layout()
    plt.show()

def demo():
    for text in prompts[:3]:
        add_prompt(text)
    add_prompt(SYSTEM + "Tell me about a fox who lived in a city.", keep_running=True)   # still running: locked
    add_prompt("Once upon a time, a big brown bear lived in a cave near a river.")   # the cache is full: evict

try_it(demo)
""")

code(r"""
# Add your own prompts (one click, one request); "keep running" leaves it locked in the cache.
widgets.interact_manual(lambda text, keep_running: try_it(lambda: add_prompt(text, keep_running)),
                        text=widgets.Text(SYSTEM + "Tell me about a", layout=widgets.Layout(width="90%")),
                        keep_running=False);
""")

md(r"""
## 4. Attention over the new tokens only

`prefill_attention` writes the new tokens' K/V into the cache and calls lesson 05's
`prefix_prefill_attention` (task 4: the kernel of notebook 05b) with the block tables, `cu_seqlens_q` (where each sequence's
new tokens start) and `context_lens` (how many tokens each has cached). Below: a 13-token sequence is prefilled,
cached, then a second sequence reuses its first 8 tokens and computes only 3 new ones; the output is compared
with plain attention over the whole 11 tokens in float64.
Without the course's reference (the copy students get), this cell waits for task 4: until you have written
it in notebook 05b, it prints one line saying so.
""")

code(r"""
def attention_demo():
    heads, kv_heads, dim = 4, 2, 16
    cache_mgr = ops.kv_cache_manager(12, BLOCK, 1, kv_heads, dim, torch.float32, "cpu")
    g = L5.RadixAttentionWithPagedKVCache(cache_mgr)
    gen = torch.Generator().manual_seed(0)
    first = list(range(100, 113))
    g.allocate("a", first)
    q, k, v = (torch.randn(13, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    g.prefill_attention(0, ["a"], [13], q, k, v)
    g.cache_sequence("a", first)
    second = first[:8] + [7, 8, 9]
    got = g.allocate("b", second)
    q2, k2, v2 = (torch.randn(3, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    out = g.prefill_attention(0, ["b"], [len(second) - got.num_cached], q2, k2, v2)
    keys = torch.cat([k[:8], k2]).double().repeat_interleave(2, 1)
    values = torch.cat([v[:8], v2]).double().repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q2.double(), keys) / dim ** 0.5
    visible = torch.arange(11)[None, :] <= torch.arange(8, 11)[:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    print(f"reused {got.num_cached} tokens, computed {len(second) - got.num_cached}; "
          f"max |out - float64 reference| = {(out.double() - ref).abs().max():.2e}")

try_it(attention_demo)
""")

md(r"""
## 5. In the engine

`LLM` keeps one prefix cache beside its KV cache, across `generate` calls. The scheduler admits each request
through `allocate` (its prefill feeds only the tokens after the cached prefix), caches each prompt after its
prefill and everything computed when a request ends, and evicts unlocked prefixes before it preempts anyone.
`LLM(..., prefix_caching=False)` (or `yaie generate --no-prefix-caching`) turns it off; the outputs are the same.
""")

code(r"""
from yaie.engine import LLM, SamplingParams

def engine_demo():
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=BLOCK)
    params = SamplingParams(max_tokens=12, temperature=0)
    story = "Once upon a time, there was a little girl named Lily. She loved to play with her dog. One day, "
    llm.generate(story + "she", params)                                  # caches the story
    outs = llm.generate([story + "they went to the park.", story + "it rained."], params)
    stats = llm.prefix_cache_stats()
    if stats is None:       # no prefix cache: tasks 1-2 unfinished (the engine's notice above says which)
        print("the engine ran without a prefix cache: it reuses tokens once tasks 1 and 2 are written")
    else:
        print(f"tokens reused: {stats.cached_tokens} of {stats.prompt_tokens} prompt tokens ({stats.hit_rate:.0%})")
    for o in outs:
        print(repr(o.text))

try_it(engine_demo)
""")

md(r"""
## Exercises

1. Implement tasks 1 and 2. `pytest grader/lesson05 -k task1` checks the tree alone: hand-written cases, then
   random programs (hypothesis) against a shadow of what the tree must own.
2. Why does `allocate` match `tokens[:-1]` and not `tokens`? What would the engine have to do differently if a
   whole prompt could come from the cache?
3. A split keeps the *old* node object as the lower part. Which bug would you get if the new node were the
   lower part instead (hint: who holds a reference to the node a request locked)?
4. `evict` takes blocks from the end of a leaf, not whole leaves. Give a workload where evicting whole leaves
   frees far more than asked, and one where it makes no difference.
5. The tree's granularity is one block. With `block_size` 16, how many tokens of a 2,000-token system prompt
   can be shared at most, and how many tokens of each request are recomputed even when its whole prompt is
   cached? What does a larger block cost elsewhere (lesson 03)?
6. The engine caches a prompt only after its prefill has run. Two requests with the same new system prompt
   arriving in the same step both compute it. How would you make the second one wait for the first (what
   would it cost in time to first token)?
7. On preemption by recompute, the engine puts the victim's computed blocks into the tree before freeing them.
   Why does that make the re-prefill cheap, and when is it useless (hint: what does eviction take first)?
8. `evict` scans every node to find the leaves; an engine with 100,000 cached blocks calls it often. Keep a
   heap of evictable leaves up to date instead: which operations change the set of evictable leaves?
9. (GPU) `scripts/gpu_engine_prefix.py` runs 64 requests sharing a 2,048-token system prompt with caching on
   and off. Predict the throughput ratio from the prefill and decode costs of a 1.1B model, then compare with
   `bench/results/engine_prefix_caching_*.md`.

## Grade (tasks 1-2)
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(5, extra_args=["-k", "task1 or task2"])
""")

notebook.write("lessons/05_radix_flashinfer/05a_radix_tree.ipynb")
