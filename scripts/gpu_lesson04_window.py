"""Sliding-window decode (lesson 04, task 4) on the lent GPU: correct, and what it costs. One call.

    OUT=out YAIE_GIT_COMMIT=<hash> python scripts/gpu_lesson04_window.py

bf16, head_dim 128, 32 query heads, 16-token blocks shuffled through the cache (the shapes of
``yaie bench lesson04``). For each (batch, KV heads, context, window), side by side in one run:

* ``yaie, window W``: ``paged_attention_forward(..., sliding_window=W)`` (the heuristic's split count);
* ``yaie, context W``: the same kernel over the first W tokens only (``context_lens = W``, no window): the
  same number of K/V bytes, so the window should cost what this costs;
* ``yaie, whole context``: no window: what a decode that ignored the window would read;
* ``torch SDPA (default) on the window``: SDPA on the window's K/V copied out contiguously (the copy is not
  timed): the baseline of issue 5, for the bytes the window reads;
* ``before: gather + lesson 01``: what the engine did for a windowed layer before task 4 (per sequence,
  gather every cached token's K/V through the block table, then lesson 01's attention with a window mask),
  eager time of one layer's call, checked against float64 too (before the cache is poisoned).

GPU times are medians of CUDA-graph replays (``triton.testing.do_bench``, L2 cleared between calls); the
gather row is eager (it loops over sequences in Python, as the engine did). Every windowed output is checked
against float64 attention over the window (max abs error), on a cache whose rows before each window are NaN.
A mixed-length batch (contexts 1 .. 20000, window 4096, 1 and 4 splits) is checked the same way.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")

from solutions.kernels import paged_attention as pa  # noqa: E402
from yaie import ops  # noqa: E402
from yaie.bench.harness import bench_ms, gpu_slug, measure_peaks  # noqa: E402
from yaie.bench.lesson04 import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, graphed, make_inputs  # noqa: E402

# (batch, kv_heads, context, window): Mistral's 4096-token window at long contexts, and a short window.
SHAPES = [(32, 8, 8192, 4096), (32, 8, 32768, 4096), (64, 4, 32768, 4096), (128, 8, 16384, 4096),
          (32, 8, 32768, 512)]


def float64_window(q, k, v, lens, window):
    """float64 attention of each sequence's query over its last ``window`` tokens (k, v: [b, kv, ctx, d])."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window)
        kk = k[b, :, first:n].double().repeat_interleave(group, 0)       # [heads, w, d]
        vv = v[b, :, first:n].double().repeat_interleave(group, 0)
        if n == 0:
            out[b] = 0
            continue
        weights = torch.softmax((kk @ q[b].double()[:, :, None])[..., 0] * HEAD_DIM ** -0.5, dim=-1)
        out[b] = (weights[:, None, :] @ vv)[:, 0]
    return out


def poison_before_window(k_cache, v_cache, tables, lens, window):
    """NaN in every cache row before a sequence's window: a kernel that reads one shows it in its output."""
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window)
        full_blocks, rest = divmod(first, BLOCK_SIZE)
        ids = tables[b, :full_blocks].long()
        k_cache[ids] = float("nan")
        v_cache[ids] = float("nan")
        if rest:
            k_cache[int(tables[b, full_blocks]), :rest] = float("nan")
            v_cache[int(tables[b, full_blocks]), :rest] = float("nan")


def gather_path(q, k_cache, v_cache, tables, lens, window):
    """The engine's windowed decode before task 4: ops._gathered_attention over one layer's cache."""
    batch = q.shape[0]
    ctx_list = lens.tolist()
    rows = torch.arange(BLOCK_SIZE, device=q.device)

    def context_slots(i):
        n = ctx_list[i]
        blocks = tables[i, : (n + BLOCK_SIZE - 1) // BLOCK_SIZE].long()
        return (blocks[:, None] * BLOCK_SIZE + rows[None, :]).flatten()[:n]

    step = SimpleNamespace(manager=SimpleNamespace(k_cache=[k_cache], v_cache=[v_cache]),
                           query_starts=list(range(batch + 1)), context_slots=context_slots)
    out = torch.empty_like(q)
    ops._gathered_attention(out, q, step, 0, range(batch), window, None)
    return out


def shape_label(batch, kv, ctx, window):
    return f"b{batch} h{NUM_HEADS}/{kv} ctx{ctx} window{window}"


def time_shape(rows, gen, copy_gbps, batch, kv, ctx, window):
    label = shape_label(batch, kv, ctx, window)
    q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
    exact = float64_window(q, k, v, lens, window)
    window_bytes = 2 * batch * kv * min(ctx, window) * HEAD_DIM * 2
    k_win = k[:, :, ctx - window:].contiguous()
    v_win = v[:, :, ctx - window:].contiguous()
    q4 = q.unsqueeze(2)
    short = torch.full_like(lens, window)

    def record(impl, fn, moved, graph=True, check=True):
        out = fn()
        err = float((out.double() - exact).abs().max()) if check else None
        ms = bench_ms(graphed(fn), 5, 25) if graph else bench_ms(fn, 5, 25)
        rows.append({"shape": label, "impl": impl, "ms": ms, "kv_bytes": moved,
                     "pct_copy": 100 * moved / (ms * 1e-3) / 1e9 / copy_gbps, "max_abs_err_vs_float64": err,
                     "timing": "CUDA-graph replay" if graph else "eager"})
        shown = "-" if err is None else f"{err:.1e}"
        print(f"  {label} {impl}: {ms * 1e3:.1f} us ({rows[-1]['pct_copy']:.1f}% of copy) err {shown}", flush=True)

    # The old path reads every cached row (0 * NaN would be NaN): timed and checked before the poisoning.
    record("before: gather + lesson 01 (eager)", lambda: gather_path(q, k_cache, v_cache, tables, lens, window),
           window_bytes, graph=False)
    poison_before_window(k_cache, v_cache, tables, lens, window)
    record(f"yaie, window {window}", lambda: pa.paged_attention_forward(
        q, k_cache, v_cache, tables, lens, ctx, validate=False, sliding_window=window), window_bytes)
    # The same cache read over its first `window` tokens (those are not NaN only where the window covers them:
    # no check here, the bytes are what matters).
    record(f"yaie, context {window} (no window)", lambda: pa.paged_attention_forward(
        q, k_cache, v_cache, tables, short, window, validate=False), window_bytes, check=False)
    record("yaie, whole context (no window)", lambda: pa.paged_attention_forward(
        q, k_cache, v_cache, tables, lens, ctx, validate=False), 2 * batch * kv * ctx * HEAD_DIM * 2, check=False)
    record("torch SDPA (default) on the window, contiguous", lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, k_win, v_win, enable_gqa=True).squeeze(2), window_bytes)
    del q, k, v, k_cache, v_cache, tables, lens, k_win, v_win
    torch.cuda.empty_cache()


def mixed_lengths(report, gen, lengths=(1, 100, 4095, 4096, 4097, 9000, 20000, 17), window=4096, capacity=20480,
                  dtypes=(torch.bfloat16, torch.float16)):
    """Variable contexts in one batch, bf16 and fp16, 1, 4 and the heuristic's splits, against float64 over
    each window (``capacity``: tokens per block-table row, a multiple of the block size)."""
    lengths, kv = list(lengths), 8
    batch, ctx = len(lengths), max(lengths)
    checks = []
    for dtype in dtypes:
        q, k, v, k_cache, v_cache, tables, _ = make_inputs(batch, kv, capacity, gen)
        q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
        lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        exact = float64_window(q, k, v, lens, window)
        poison_before_window(k_cache, v_cache, tables, lens, window)
        for splits in (1, 4, None):
            out = pa.paged_attention_forward(q, k_cache, v_cache, tables, lens, ctx, num_splits=splits,
                                             sliding_window=window)
            err = float((out.double() - exact).abs().max())
            checks.append({"dtype": str(dtype), "num_splits": splits, "lengths": lengths, "window": window,
                           "max_abs_err_vs_float64": err, "ok": err < 2e-2})
            print(f"  mixed lengths {dtype} splits {splits}: max abs err {err:.1e}", flush=True)
    report["mixed_lengths"] = checks


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("YAIE_GIT_COMMIT"),
              "command": "OUT=out python scripts/gpu_lesson04_window.py", "peaks": measure_peaks("cuda"),
              "layout": f"bf16, head_dim {HEAD_DIM}, {NUM_HEADS} query heads, block_size {BLOCK_SIZE}, blocks shuffled",
              "rows": []}
    copy = report["peaks"]["copy_GBps"]
    print(f"{report['gpu']} torch {torch.__version__} triton {triton.__version__} copy {copy:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    began = time.monotonic()
    mixed_lengths(report, gen)
    for shape in SHAPES:
        time_shape(report["rows"], gen, copy, *shape)
    report["seconds"] = time.monotonic() - began
    path = out_dir / f"lesson04_window_{gpu_slug()}.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)
    bad = [c for c in report["mixed_lengths"] if not c["ok"]]
    bad += [r for r in report["rows"] if r["max_abs_err_vs_float64"] is not None and not r["max_abs_err_vs_float64"] < 2e-2]
    if bad:
        print("FAILED checks:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
