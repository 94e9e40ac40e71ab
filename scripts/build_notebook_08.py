"""Write lessons/08_based_linear_attention/08_based_linear_attention.ipynb (stored without outputs).

    python scripts/build_notebook_08.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 08: Based linear attention

Softmax attention weighs key `j` for query `i` by `exp(s_ij)`, `s_ij = q_i . k_j / sqrt(d)`. Every new token
must look at every earlier one: prefill costs `n^2`, and decode reads a KV cache that grows by one row per
token. **Linear attention** replaces `exp(q . k)` by a dot product of *features*, `phi(q) . phi(k)`. Then

$$ \text{out}_i = \frac{\sum_{j \le i} (\phi(q_i)\cdot\phi(k_j))\, v_j}{\sum_{j \le i} \phi(q_i)\cdot\phi(k_j)}
 = \frac{\phi(q_i)^\top \big[\sum_{j\le i} \phi(k_j) v_j^\top\big]}{\phi(q_i)^\top \big[\sum_{j \le i}\phi(k_j)\big]} $$

and the two sums in brackets, the **state**, have a fixed size whatever the number of tokens.

**Based** (Arora et al., 2024) uses the second-order Taylor series of `exp`, with `q, k` projected to only
`d = 16` dimensions: `exp(s) ~ 1 + s + s^2/2`, written as a dot product of `1 + 16 + 256 = 273` features.

You will write, in `yaie/kernels/based.py`:

| task | function | what it does |
|---|---|---|
| 1 | `taylor_feature_map(x)`, `based_attention_reference(q, k, v)` | the 273 features; the quadratic (parallel) causal form with its normaliser |
| 2 | `based_prefill(q, k, v, chunk_size)` | the chunked causal Triton kernel: exact tile inside a chunk, running state across chunks; returns the output and the final state |
| 3 | `based_decode_step(q, k, v, state)` | one token: update the state in place, read the output from it |
| 4 | `check_based_inputs(...)` | bad input gets a `ValueError` (feature dim other than 16, shape mismatches, ...) |

`based_prefill` and `based_decode_step` validate their arguments with `check_based_inputs` (task 4, section 5)
before they touch anything: write it before task 2, or the checks of tasks 2 and 3 stop at its
`NotImplementedError`.

No GPU? The kernel runs in the **Triton interpreter** (small shapes, float32/float16). Grade with
`pytest grader/lesson08` or the last cell.
""")

code(r"""
# The interpreter must be switched on before triton is imported (a no-op on a GPU machine).
from yaie.device import prepare_triton, default_device
interpreted = prepare_triton()

import math

import ipywidgets as widgets
import matplotlib.pyplot as plt
import matplotlib.patches as patches
import numpy as np
import torch

from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe
L8 = LessonProxy(8)          # your module, or the reference if YAIE_SOLUTIONS says so
device = default_device()
dtype = torch.float32 if interpreted else torch.bfloat16
print("Triton interpreter:", interpreted, "| device:", device, "|", describe())


def exact_based(q, k, v):
    # The answer in float64, straight from the weights 1 + s + s^2/2 (j <= i).
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    s = q @ k.transpose(-1, -2) / 4
    w = (1 + s + s * s / 2).tril()
    return (w @ v) / w.sum(-1, keepdim=True)


def rand_qkv(seq, heads=2, value_dim=32, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, heads, seq, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, heads, seq, value_dim, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))
""")

md(r"""
## 1. The Taylor feature map (task 1)

With `x` a query or a key (16 numbers) and `d^(1/4) = 2`:

$$\phi(x) = \Big[\,1,\;\; \frac{x}{d^{1/4}},\;\; \frac{\mathrm{vec}(x x^\top)}{\sqrt 2\,\sqrt d}\,\Big]
\qquad\Rightarrow\qquad \phi(q)\cdot\phi(k) = 1 + s + \frac{s^2}{2},\quad s = \frac{q\cdot k}{\sqrt d}.$$

The order-2 block has all 256 products `x_a x_b` (`a` major): the symmetric pairs appear twice, which is what
makes `sum_ab q_a q_b k_a k_b = (q . k)^2` come out right. How good is the approximation? The plot compares
`1 + s + s^2/2` with `exp(s)`. Two facts matter:

* near `s = 0` they agree to third order, and `s = q.k/4` of unit-scale 16-dim vectors has a standard
  deviation of 1: most weights sit where the two curves are close;
* for large negative `s`, `exp` goes to 0 but the polynomial comes back up: `1 + s + s^2/2 = ((1+s)^2 + 1)/2
  >= 1/2`. Based never *ignores* a key completely (a blurrier attention, which is why Based models add exact
  sliding-window attention for the last few tokens). On the bright side, every weight is positive: the
  normaliser never vanishes.
""")

code(r"""
s = np.linspace(-4, 4, 400)
fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
axes[0].plot(s, np.exp(s), label="exp(s)")
axes[0].plot(s, 1 + s + s ** 2 / 2, label="1 + s + s^2/2")
axes[0].set_ylim(0, 25); axes[0].set_xlabel("s = q.k / sqrt(16)"); axes[0].legend(); axes[0].set_title("the weights")
axes[1].plot(s, (1 + s + s ** 2 / 2) / np.exp(s))
axes[1].axhline(1, color="gray", lw=0.6); axes[1].set_yscale("log"); axes[1].set_xlabel("s")
axes[1].set_title("Taylor / exp: 1 near 0, too large far left", fontsize=9)
# Where do real scores fall? s = q.k/4 for unit-normal q, k: mean 0, standard deviation 1.
gen = torch.Generator().manual_seed(0)
scores = (torch.randn(20000, 16, generator=gen) * torch.randn(20000, 16, generator=gen)).sum(-1) / 4
axes[2].hist(scores.numpy(), bins=60, range=(-4, 4), density=True, color="gray")
axes[2].set_xlabel("s"); axes[2].set_title("s of random unit-scale q, k", fontsize=9)
plt.tight_layout(); plt.show()
print(f"share of random scores with |s| < 1.5: {float((scores.abs() < 1.5).float().mean()):.2f}")
""")

code(r"""
def check_feature_map():
    x, y = torch.randn(5, 16, dtype=torch.float64), torch.randn(7, 16, dtype=torch.float64)
    fx, fy = L8.taylor_feature_map(x), L8.taylor_feature_map(y)
    s = x @ y.T / 4
    print("phi(x):", tuple(fx.shape), "| max |phi(x).phi(y) - (1 + s + s^2/2)| =",
          float((fx @ fy.T - (1 + s + s * s / 2)).abs().max()))
    q, k, v = rand_qkv(30, dtype=torch.float64)
    out = L8.based_attention_reference(q.cpu(), k.cpu(), v.cpu())
    print("reference:", tuple(out.shape), "| max error vs the weights:", float((out - exact_based(q, k, v)).abs().max()))

try_it(check_feature_map)
""")

md(r"""
## 2. The chunked prefill (task 2)

The quadratic form costs `n^2` weights; the recurrent form (add `phi(k_j) v_j^T` to the state, read
`phi(q_i)` from it, token after token) is linear but serial, one token at a time: no matrix products, no
tensor cores. The **chunked** form takes both: cut the sequence into chunks of `C` tokens.

* **Inside chunk n** (the triangles on the diagonal): the exact causal `C x C` tile,
  `W = 1 + s + s^2/2` masked above the diagonal, then `W @ V_n`: a matrix product.
* **Before chunk n** (the rectangles left of it): all earlier keys are already summed in the state
  `S = sum phi(k) v^T` (`[273, d_v]`) and `z = sum phi(k)` (`[273]`): `phi(Q_n) @ S`, one `[C, 273] x [273, d_v]`
  matrix product for the whole chunk. No mask needed: every earlier key is visible to every query of the chunk.
* Then fold the chunk into the state, `S += phi(K_n)^T V_n`, `z += phi(K_n).sum(0)`, and go on.

In blocks of `phi` the state holds `sum v`, `sum k v^T` and `sum (k x k) v^T` for the numerator and `count`,
`sum k`, `sum k x k` for the normaliser: keep it in **float32** (it is a sum over the whole sequence).

The Triton kernel gives one program to each (sequence, head, block of value columns) and loops over the chunks
in order. Read `based_chunked_reference` (given, in PyTorch) first: it is the same loop.
""")

code(r"""
def draw_chunks(seq=24, chunk=8):
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    for i in range(seq):
        for j in range(i + 1):
            same = i // chunk == j // chunk
            ax.add_patch(patches.Rectangle((j, seq - 1 - i), 1, 1, color="tab:orange" if same else "tab:blue",
                                           alpha=0.75 if same else 0.35, lw=0))
    for c in range(0, seq + 1, chunk):
        ax.axhline(seq - c, color="black", lw=0.5); ax.axvline(c, color="black", lw=0.5)
    ax.set_xlim(0, seq); ax.set_ylim(0, seq); ax.set_aspect("equal")
    ax.set_xlabel("key j"); ax.set_ylabel("query i (top = first)")
    ax.set_yticks([]); ax.set_xticks(range(0, seq + 1, chunk))
    ax.set_title(f"orange: exact causal tiles ({chunk}x{chunk}); blue: read from the state", fontsize=9)
    plt.show()


draw_chunks()
""")

code(r"""
def check_prefill():
    for seq in (1, 15, 16, 17, 40):
        q, k, v = rand_qkv(seq, dtype=dtype)
        out, state = L8.based_prefill(q, k, v, chunk_size=16)
        print(f"seq {seq:3d}: out {tuple(out.shape)} {out.dtype}, state.kv {tuple(state.kv.shape)} | max error",
              f"{float((out.double().cpu() - exact_based(q, k, v)).abs().max()):.2e}")

try_it(check_prefill)
""")

md(r"""
### Choosing the chunk size

A chunk of `C` tokens costs `C^2 (16 + d_v)` multiply-adds in its tile and `2 C 273 d_v` for reading and
updating the state. Small chunks waste the tensor cores (a `tl.dot` wants at least 16 rows) and walk the
serial loop more often; large chunks spend more on the quadratic tile and need more registers. Move the
slider: the bars count the work per token, the check runs your kernel at that chunk size.
""")

code(r"""
def chunk_tradeoff(chunk_size=64, seq=300, value_dim=64):
    chunks = [16, 32, 64, 128]
    tile = [c * (16 + value_dim) / 2 for c in chunks]           # per token: half a C x C tile on average
    state = [2 * 273 * value_dim for _ in chunks]               # per token: read + update the state
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.bar([str(c) for c in chunks], state, label="state read + update")
    ax.bar([str(c) for c in chunks], tile, bottom=state, label="causal tile")
    ax.bar(str(chunk_size), 0, color="black")
    ax.set_xlabel("chunk size"); ax.set_ylabel("multiply-adds per token (one head)"); ax.legend(fontsize=8)
    ax.set_title(f"loop steps for {seq} tokens at chunk {chunk_size}: {math.ceil(seq / chunk_size)}", fontsize=9)
    plt.show()
    q, k, v = rand_qkv(seq, dtype=dtype)
    try:
        out, _ = L8.based_prefill(q, k, v, chunk_size=chunk_size)
        print(f"chunk {chunk_size}: max error vs float64 {float((out.double().cpu() - exact_based(q, k, v)).abs().max()):.2e}")
    except NotImplementedError as err:
        print(f"not implemented yet: {err}")


widgets.interact(chunk_tradeoff, chunk_size=widgets.SelectionSlider(options=[16, 32, 64, 128], value=64),
                 seq=widgets.IntSlider(300, 1, 600), value_dim=widgets.fixed(64));
""")

md(r"""
## 3. Recurrent decode (task 3)

After the prefill, each new token updates the state and reads its output from it: `S += phi(k) v^T`,
`z += phi(k)`, `out = phi(q) @ S / (phi(q) . z)`. The token sees itself, as in the causal form. Work and
memory per step are constant. The test every Based engine needs: **prefill then decode equals the parallel form**.

In the engine (`yaie generate --model yaie/assets/tiny-based`) your `based_decode_step` runs at every decode
step, and your `based_prefill` runs the prompts on a GPU. On a CPU the engine prefills with
`based_chunked_reference` instead (the given PyTorch form of the same chunked algorithm): the Triton
interpreter is too slow for an engine. The grader runs your kernel on the CPU all the same.
""")

code(r"""
# The prefill here is the given based_chunked_reference (its state is what based_prefill returns), so this
# cell needs tasks 1 and 3 only; swap in L8.based_prefill once task 2 is done.
def check_decode():
    q, k, v = rand_qkv(24)
    out, state = L8.based_chunked_reference(q[:, :, :17], k[:, :, :17], v[:, :, :17], chunk_size=16)
    steps = [L8.based_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state) for t in range(17, 24)]
    full = torch.cat([out, torch.stack(steps, 2)], 2)
    print("prefill 17 + decode 7: max error vs the parallel form over 24 tokens:",
          float((full.double().cpu() - exact_based(q, k, v)).abs().max()))

try_it(check_decode)
""")

md(r"""
## 4. The state against a KV cache

Per sequence and layer, the Based state is `heads x 273 x (d_v + 1)` float32 numbers, whatever the length;
a bf16 KV cache is `2 x heads x head_dim x 2` bytes **per token**. For 16 heads of 64: the state is 1.1 MB, the
cache passes it at 278 tokens, and at 16k tokens it is 60 times larger. (Based models keep a small exact
sliding window too: a few more fixed KB.)
""")

code(r"""
from yaie.kernels.based import state_bytes   # given code (yaie/kernels/based_given.py)

heads, head_dim = 16, 64
tokens = np.array([256, 1024, 4096, 16384, 65536])
kv = 2 * heads * head_dim * 2 * tokens
st = np.full_like(tokens, state_bytes(heads, head_dim))
fig, ax = plt.subplots(figsize=(6, 3))
ax.loglog(tokens, kv / 2 ** 20, "o-", label="bf16 KV cache")
ax.loglog(tokens, st / 2 ** 20, "s-", label="Based state (fp32)")
ax.set_xlabel("tokens in the sequence"); ax.set_ylabel("MiB per sequence and layer"); ax.legend()
plt.show()
for n, a, b in zip(tokens, kv, st):
    print(f"{n:6d} tokens: KV cache {a / 2**20:8.2f} MiB, state {b / 2**20:5.2f} MiB")
""")

md(r"""
## 5. Bad input (task 4)

`check_based_inputs` guards the kernel: the feature dimension must be 16 (the kernel is built for 273 features),
q and k must have the same shape, v the same batch, heads and length, dtypes and devices must agree, and a
decode state must have the right shapes and be float32. A wrong call must fail loudly *before* anything is
written.
""")

code(r"""
def check_errors():
    q, k, v = rand_qkv(8)
    for what, args in [("feature dim 32", (torch.cat([q, q], -1), torch.cat([k, k], -1), v)),
                       ("v shorter than q", (q, k, v[:, :, :4]))]:
        try:
            L8.check_based_inputs(*args)
            print(f"{what}: accepted (should raise ValueError)")
        except ValueError as err:
            print(f"{what}: ValueError: {err}")

try_it(check_errors)
""")

md(r"""
## Exercises

1. Implement tasks 1-4. Run `pytest grader/lesson08 -k task2` while you work on the kernel.
2. Why is `1 + s + s^2/2` never below 1/2? What would a first-order feature map (`1 + s`) do to the
   normaliser, and why do linear-attention models with such maps need a ReLU or an ELU + 1?
3. `phi` has 256 order-2 features, but `x_a x_b = x_b x_a`: only 136 are distinct. Rewrite the feature map with
   the 136 (what factor must the off-diagonal ones carry?). What does it save in the state, and what does it cost
   the kernel?
4. The kernel scales q and k by `1/2` on load instead of dividing `s` by 4. Why is that exact in bf16?
5. `scripts/probe_lesson08_registers.py` (in the instructors' copy of the course, beside the reference it
   probes) compiles the reference's two kernel designs for the H100 without a GPU and prints ptxas's register
   and spill counts; ask your instructor for its output. Why does the default kernel, which keeps the 256 x 64
   float32 order-2 state in registers and builds `[C, 256]` products, spill? The second design ("rows") keeps
   that state in the output state tensor and visits it 16 rows at a time: why must each chunk then end with a
   barrier? (GPU) Time both with `yaie bench lesson08`: which wins, and why?
6. (GPU) Run `yaie bench lesson08`: at which length does the chunked kernel overtake SDPA, and why does
   flash-linear-attention's quadratic `parallel_based` win at short lengths but lose at long ones? The
   reference solution's default route takes the middle way (the module docstring of `yaie/kernels/based.py`
   describes it): segments of 256 tokens, the quadratic form tiled like flash attention inside each segment
   but with no running maximum (why is none needed?), plus `phi(q) @ S` with `S` the state before the
   segment, from a first kernel that walks the sequence and stores the state at every segment boundary.
   Why can the first segment's queries run in the same launch as that kernel, and what does it gain?
   Compare the Triton state kernel's time with the whole route's in the benchmark (the `based_state` rows):
   at 1k tokens it is about half. Splitting its walk into parts of the sequence did not make it faster; the
   profile in `bench/results/lesson08_ncu_h100.txt` shows 206 registers per thread and a busy shared-memory
   pipe. Which of its tiles need those registers, and what would you change first? On a Hopper GPU the
   reference takes the states from a Gluon kernel instead (`solutions/kernels/based_hopper.py`, in the
   instructors' copy; the `based_state` row "Hopper kernel"): it builds `k_a k_b` directly in the register
   layout in which the tensor cores read their first operand, so no factor moves through shared memory.
   Which thread needs which `k_a` and `k_b` for that layout, and why can a Triton kernel not ask for it?
7. A Based layer pairs linear attention with exact attention over a short sliding window (64 tokens, say).
   What does a decode step of such a layer keep per sequence? Compare with lesson 04's windowed decode.

## Grade
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(8)
""")

notebook.write("lessons/08_based_linear_attention/08_based_linear_attention.ipynb")
