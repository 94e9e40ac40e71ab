"""Replay, on the CPU, the order in which lesson 07's kernel by rows adds float32 products on the GPU.

A float32 ``tl.dot`` on the GPU is a chain of FMAs over K. The kernel by rows (``_scatter_rows_kernel``)
first chained every chunk of 32 entries (K = 128) into its running sum ("chain"); it now sums each chunk
from 0 and adds it ("fresh"). This replays both orders, one FMA at a time (float64 product and sum, rounded
to float32: one rounding, as an FMA), for the grader's check that failed on the H100 at commit eab0604
(``test_backward_on_a_telescoping_map[fp32-oldest-first]``, YAIE_SEED=620628238, l 1500, c 64, e 4, d 128),
and prints the worst error over the grader's tolerance (atol 5e-5 + rtol 1e-5 x |expected|) and the failing
elements. The GPU failed 3 elements, worst 0.647299 against 0.647378 at (0, 2517, 1, 38): "chain" gives the
same. A few minutes per (product, order).

    PYTHONPATH=. python scripts/check_lesson07_fp32_order.py [seed]
"""

from __future__ import annotations

import sys

import torch

from grader.checks import randn
from grader.lesson07.test_telescoping import _telescoping_map

LENGTH, CAPACITY, E, D = 1500, 64, 4, 128
ROWS, ENTRIES = 16, 32                      # the kernel's tiles: rows per program, entries per chunk


def replay(p, a, m, n, h, order):
    """The kernel's sums for head h, every row block at once, one FMA at a time."""
    flat = m.clamp(max=n).flatten()
    blocks = (n + ROWS - 1) // ROWS
    key = torch.where(flat < n, flat // ROWS, blocks)
    entries = torch.sort(key, stable=True).indices
    bounds = torch.searchsorted(key[entries], torch.arange(blocks + 1))
    chunks = int((bounds[1:] - bounds[:-1]).max() + ENTRIES - 1) // ENTRIES
    idx = bounds[:-1, None] + torch.arange(chunks * ENTRIES)[None, :]
    valid = idx < bounds[1:, None]
    ent = entries[idx.clamp(max=len(entries) - 1)]
    pos, slot = ent // CAPACITY, ent % CAPACITY
    row = (flat[ent] - torch.arange(blocks)[:, None] * ROWS).clamp(0, ROWS - 1)
    pv, av = p[0, :, h].double(), a[0, :, h].double()
    acc = torch.zeros(blocks, ROWS, D, dtype=torch.float64)
    for ci in range(chunks):
        part = torch.zeros_like(acc) if order == "fresh" else acc
        for jj in range(ENTRIES):
            j = ci * ENTRIES + jj
            onehot = torch.nn.functional.one_hot(row[:, j], ROWS).double() * valid[:, j, None]
            for e in range(E):
                s = onehot * pv[pos[:, j], e, slot[:, j]][:, None]
                part = (part + s[:, :, None] * av[pos[:, j], e][:, None, :]).float().double()
        acc = part if order == "chain" else (acc + part).float().double()
    return acc.reshape(blocks * ROWS, D)[:n]


def exact(p, a, m, n, h):
    out = torch.zeros(n + 1, D, dtype=torch.float64)
    terms = torch.einsum("lec,led->lcd", p[0, :, h].double(), a[0, :, h].double())
    out.index_add_(0, m.clamp(max=n).flatten().long(), terms.reshape(-1, D))
    return out[:n]


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 620628238
    m, n = _telescoping_map(LENGTH, CAPACITY)
    q = randn(1, LENGTH, 2, E, D, seed=seed)
    d_scores = randn(1, LENGTH, 2, E, CAPACITY, seed=seed + 2)
    d_out = randn(1, LENGTH, 2, E, D, seed=seed + 3)
    for name, p, a in (("qk", d_scores, q), ("pv", d_scores, d_out)):
        for order in ("chain", "fresh"):
            worst, fails = 0.0, 0
            for h in range(2):
                want, got = exact(p, a, m, n, h), replay(p, a, m, n, h, order)
                allowed = 5e-5 + 1e-5 * want.abs()
                worst = max(worst, float(((got - want).abs() / allowed).max()))
                fails += int(((got - want).abs() > allowed).sum())
            print(f"seed {seed} {name} {order}: worst error / tolerance {worst:.2f}, {fails} elements fail", flush=True)


if __name__ == "__main__":
    main()
