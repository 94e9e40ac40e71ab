"""Write lessons/01_cpu_kernels/01_cpu_kernels.ipynb (stored without outputs).

The notebook is generated so its cells stay reviewable as plain Python in this file:
    python scripts/build_notebook_01.py
"""

from notebook_builder import NotebookBuilder

notebook = NotebookBuilder()
md, code = notebook.md, notebook.code

md(r"""
# Lesson 01: CPU kernels

Every layer of a Llama-family model runs the same handful of ops: **RMSNorm**, **rotary position
embeddings (RoPE)**, **attention** and a gated MLP. Before we write them as fast GPU kernels (lessons 02-08),
we write them once in plain PyTorch on the CPU. These versions are

* the engine's CPU path: `yaie generate` on a laptop runs *your* functions from this lesson;
* the yardstick: every later kernel is checked against the same math.

You will fill in four functions in `yaie/kernels/cpu_kernels.py`:

| task | function | what it does |
|---|---|---|
| 1 | `build_rope_cache(max_position, head_dim, base, rope_scaling)` | the cos/sin tables of RoPE (with Llama 3 scaling) |
| 2 | `cpu_rope_embeddings(x, cos, sin, position_ids)` | rotate query/key vectors by each token's position |
| 3 | `cpu_rms_norm(x, weight, epsilon)` | root-mean-square normalisation |
| 4 | `cpu_attention_forward(q, k, v, mask, scale)` | causal, grouped-query attention that can continue a cache |

Each function's docstring is the specification: shapes, dtypes, semantics, and which bad inputs raise
`ValueError`. Grade yourself any time with `pytest grader/lesson01` (or the last cell here); one task
at a time with `pytest grader/lesson01 -k task2`.

**The switch.** Cells below call your code through `LessonProxy(1)`. To see what the reference does,
run the notebook with `YAIE_SOLUTIONS=1` in the environment (or call `use_solutions(1)` below).
""")

code(r"""
import math

import matplotlib.pyplot as plt
import torch
import ipywidgets as widgets

from yaie.notebook import try_it
from yaie.switch import LessonProxy, describe, use_solutions

L1 = LessonProxy(1)           # your yaie/kernels/cpu_kernels.py, or the reference if the switch says so
# use_solutions(1)            # uncomment to run the reference for lesson 01
print(describe())

""")

md(r"""
## 1. RoPE: positions as rotations

A transformer's attention score is a dot product `q · k`; by itself it knows nothing about *where* the
two tokens are. RoPE encodes position by **rotating** each query and key vector by an angle proportional
to its position. Split a head vector of size `d` into `d/2` pairs; pair `i` rotates at frequency

$$\omega_i = \text{base}^{-2i/d}, \qquad \text{angle}(p, i) = p \cdot \omega_i .$$

Rotating `q` at position `m` and `k` at position `n` and then taking the dot product gives a number
that depends only on `m - n`: rotations compose, and `R(m)ᵀ R(n) = R(n - m)`. That is how relative
position enters attention without any extra parameters.

In Llama's **rotate-half** layout, pair `i` is (element `i`, element `i + d/2`), so

$$\text{out} = x \cdot \cos\theta + \text{rotate\_half}(x) \cdot \sin\theta, \qquad \text{rotate\_half}(x) = [-x_2, x_1].$$

The first pairs spin fast (short wavelengths: local order), the last ones slowly (long wavelengths:
coarse position). Below: the wavelength of every pair, and what Llama 3's scaling does to it. Llama 3
divides the frequencies of pairs whose wavelength is longer than the original training context by
`factor`, leaves the short ones alone and blends in between, so a model trained on 8k tokens can read 128k.
""")

code(r"""
head_dim, base = 128, 500000.0
i = torch.arange(head_dim // 2, dtype=torch.float64)
inv_freq = base ** (-2 * i / head_dim)
llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
wavelength = 2 * math.pi / inv_freq
low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
scaled = torch.where(wavelength > low_wl, inv_freq / 8,
                     torch.where(wavelength < high_wl, inv_freq, (1 - smooth) * inv_freq / 8 + smooth * inv_freq))

fig, ax = plt.subplots(figsize=(7, 3.2))
ax.semilogy(i, wavelength, label="plain RoPE")
ax.semilogy(i, 2 * math.pi / scaled, label="Llama 3 scaling (factor 8)")
ax.axhline(8192, color="gray", ls=":", label="original context (8192)")
ax.set_xlabel("pair index i"); ax.set_ylabel("wavelength (tokens)"); ax.legend(); ax.set_title("RoPE wavelengths")
plt.show()
""")

md(r"""
**Play with it.** Pick a pair `i` and two positions. The left plot shows the 2-D pair of `q` (blue) and
`k` (orange) after rotation; the title shows their dot product. Move `m` and `n` together, keeping
`m - n` fixed: the dot product does not change. That is the relative-position property.
""")

code(r"""
q_pair = torch.tensor([1.0, 0.3])
k_pair = torch.tensor([0.6, 0.8])


def rotate(vec, angle):
    c, s = math.cos(angle), math.sin(angle)
    return torch.tensor([vec[0] * c - vec[1] * s, vec[0] * s + vec[1] * c])


def show_rotation(pair=2, m=5, n=3):
    w = float(inv_freq[pair])
    q_rot, k_rot = rotate(q_pair, m * w), rotate(k_pair, n * w)
    fig, ax = plt.subplots(figsize=(3.6, 3.6))
    for vec, color, name in ((q_rot, "tab:blue", f"q at m={m}"), (k_rot, "tab:orange", f"k at n={n}")):
        ax.arrow(0, 0, float(vec[0]), float(vec[1]), color=color, width=0.02, length_includes_head=True, label=name)
    ax.set_xlim(-1.2, 1.2); ax.set_ylim(-1.2, 1.2); ax.set_aspect("equal"); ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"pair {pair}: q.k = {float(q_rot @ k_rot):.4f}  (m-n = {m - n})")
    plt.show()


widgets.interact(show_rotation, pair=widgets.IntSlider(2, 0, 8), m=widgets.IntSlider(5, 0, 40),
                 n=widgets.IntSlider(3, 0, 40));
""")

md(r"""
### Task 1: `build_rope_cache`

Open `yaie/kernels/cpu_kernels.py` and implement `build_rope_cache`. Two traps the grader checks:

* compute the angles `p * inv_freq` in **float64** and only then take cos/sin: at position 100 000 a
  float32 angle is off by about 0.01 radians;
* the tables are `[max_position, head_dim]` with both halves repeating the same angles.

Then run the cell below: it compares your tables with the formula above.
""")

code(r"""
def check_rope_tables():
    cos, sin = L1.build_rope_cache(4096, head_dim, base=base, rope_scaling=llama3)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * scaled[None, :]
    ref = torch.cat([angles.cos(), angles.cos()], dim=-1)
    print("shape", tuple(cos.shape), cos.dtype, "| max |cos - ref| =", float((cos.double() - ref).abs().max()))

try_it(check_rope_tables)
""")

md(r"""
### Task 2: `cpu_rope_embeddings`

Rotate a batch of vectors, each by **its own** position. The engine hands you token-major tensors
`[num_tokens, num_heads, head_dim]` whose tokens come from different sequences at different positions
(a ragged batch), so `position_ids` has one entry per token: index the tables with it, then broadcast
over the heads. Compute in float32 and cast back.
""")

code(r"""
def check_rope():
    cos, sin = L1.build_rope_cache(64, 16)
    x = torch.randn(5, 2, 16)
    pos = torch.tensor([0, 1, 2, 40, 41])           # two sequences: 3 tokens from 0, 2 tokens from 40
    out = L1.cpu_rope_embeddings(x, cos, sin, pos)
    print("position 0 leaves vectors unchanged:", torch.allclose(out[0], x[0]))
    print("rotation keeps lengths:", torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5))
    # relative positions: q at 41 . k at 40 equals q at 1 . k at 0
    q, k = torch.randn(16), torch.randn(16)
    qk = torch.stack([q, k, q, k])[:, None]
    r = L1.cpu_rope_embeddings(qk, cos, sin, torch.tensor([41, 40, 1, 0]))[:, 0]
    print("q41.k40 =", round(float(r[0] @ r[1]), 5), " q1.k0 =", round(float(r[2] @ r[3]), 5))

try_it(check_rope)
""")

md(r"""
## 2. RMSNorm

Between every block, Llama normalises each token's hidden vector by its root mean square and scales it
by a learned weight:

$$\text{out} = \frac{x}{\sqrt{\tfrac{1}{H}\sum_j x_j^2 + \epsilon}} \odot w .$$

No mean subtraction, no bias: cheaper than LayerNorm and just as good in practice. The catch is
precision. Models run in fp16/bf16, and squares overflow fast: fp16 tops out at 65504, so any element
above 256 squares to infinity. Upcast to float32 first, normalise, multiply by the weight, cast back
once. See it happen:
""")

code(r"""
x16 = torch.tensor([[300.0, -20.0, 5.0, 1.0]], dtype=torch.float16)
print("mean of squares in fp16:", x16.pow(2).mean().item(), "  in fp32:", x16.float().pow(2).mean().item())
""")

md(r"""
### Task 3: `cpu_rms_norm`

Implement it, then compare with the float64 formula on random inputs of each dtype:
""")

code(r"""
def check_rms_norm():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x, w = torch.randn(4, 96).to(dtype), torch.randn(96).to(dtype)
        ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
        out = L1.cpu_rms_norm(x, w, 1e-6)
        print(f"{str(dtype):15} out dtype {str(out.dtype):15} max error {float((out.double() - ref).abs().max()):.2e}")

try_it(check_rms_norm)
""")

md(r"""
## 3. Attention: causal, grouped, continuing a cache

$$\text{Attention}(Q, K, V) = \text{softmax}\!\left(\frac{QK^\top}{\sqrt{d}} + M\right) V$$

Three details make the difference between a textbook version and one an engine can use:

1. **Causal masking that continues a cache.** During prefill the queries and keys are the same tokens and
   the mask is the lower triangle. During decode the engine has `kv_len` cached keys and only `q_len`
   new queries: query `i` sits at position `kv_len - q_len + i`. The mask must be aligned to the
   **end**, not the start, or every decoded token stops seeing its most recent context.
2. **Grouped-query attention (GQA).** Llama 3 8B has 32 query heads but only 8 KV heads; each KV head
   serves a group of 4 query heads (`kv_head = h // group`). The cache is 4x smaller.
3. **Numerical safety.** Subtract each row's max before `exp` (scores in the thousands overflow float32),
   accumulate in float32, and give a fully masked row zeros rather than `0/0 = NaN`.

Move the slider: with `kv_len = 12` fixed, grow `q_len` from 1 (a decode step) to 12 (a full prefill).
""")

code(r"""
def show_mask(q_len=4, kv_len=12):
    offset = kv_len - q_len
    mask = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + offset
    fig, ax = plt.subplots(figsize=(5, 0.45 * q_len + 1))
    ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.4)
    ax.set_xlabel("key position"); ax.set_ylabel("query (new token)")
    ax.set_yticks(range(q_len), [f"{offset + i}" for i in range(q_len)])
    ax.set_title(f"causal mask: {q_len} new tokens over {kv_len} keys ({offset} cached)")
    plt.show()


widgets.interact(show_mask, q_len=widgets.IntSlider(4, 1, 12), kv_len=widgets.fixed(12));
""")

md(r"""
And the attention weights themselves for a random query block with that mask. The `scale` slider plays
the role of a softmax temperature: large scores make each row nearly one-hot (sharp attention), small ones
spread it out.
""")

code(r"""
torch.manual_seed(0)
q_demo, k_demo = torch.randn(1, 1, 6, 16), torch.randn(1, 1, 12, 16)


def show_weights(scale=0.25):
    scores = (q_demo @ k_demo.transpose(-1, -2))[0, 0] * scale
    mask = torch.arange(12)[None, :] <= torch.arange(6)[:, None] + 6
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    fig, ax = plt.subplots(figsize=(5, 2.8))
    im = ax.imshow(weights, cmap="magma", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax); ax.set_xlabel("key"); ax.set_ylabel("query")
    ax.set_title(f"softmax(q k^T * {scale:.2f}) with the causal mask")
    plt.show()


widgets.interact(show_weights, scale=widgets.FloatLogSlider(value=0.25, base=10, min=-2, max=1));
""")

md(r"""
### Task 4: `cpu_attention_forward`

Implement it, then compare with PyTorch's own `scaled_dot_product_attention` on a GQA, cache-continuing case:
""")

code(r"""
import torch.nn.functional as F


def check_attention():
    q = torch.randn(2, 8, 3, 32)                 # 8 query heads, 3 new tokens
    k, v = torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)   # 2 KV heads, 10 keys (7 cached)
    out = L1.cpu_attention_forward(q, k, v, mask="causal")
    mask = torch.arange(10)[None, :] <= torch.arange(3)[:, None] + 7
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    print("output", tuple(out.shape), "max |out - sdpa| =", float((out - ref).abs().max()))

try_it(check_attention)
""")

md(r"""
## Grade

The cell below runs `pytest grader/lesson01` in a fresh process and prints its report: one line per task,
a teaching message for each failed check (expected, got, where, a hint), and the score. Each run draws
fresh random inputs; a failure prints the seed to replay it with.

When all four tasks pass, `yaie generate "Once upon a time"` runs the bundled model on **your** kernels.
""")

code(r"""
from yaie.grade import run_grader

result = run_grader(1)
""")

notebook.write("lessons/01_cpu_kernels/01_cpu_kernels.ipynb")
