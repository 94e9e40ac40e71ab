"""Sliding-window prefill (lesson 06, task 5) on the lent GPU: correct, and what it costs. One call.

    OUT=out YAIE_GIT_COMMIT=<hash> python scripts/gpu_lesson06_window.py

bf16, 32 query heads over 8 KV heads, head_dim 128: one prompt per row of the table, packed as the engine
packs its prefills. Side by side in one run, for each (prompt length, window):

* ``yaie varlen, window W``: ``flash_attention_varlen_forward(..., causal=True, sliding_window=W)``;
* ``yaie varlen, causal (no window)``: what a prefill that ignored the window would compute;
* ``torch SDPA, boolean window mask``: ``scaled_dot_product_attention`` on the same numbers laid out
  ``[1, heads, n, 128]`` (KV heads repeated) with the window as an explicit mask (the flash backend takes no
  mask, so PyTorch picks another), the copy to that layout not timed;
* ``before: gather + lesson 01``: the engine's path for a windowed prompt longer than the window before task
  5 (lesson 01's attention with the mask built as a tensor), where it fits in memory.

Times: ``triton.testing.do_bench`` medians (eager; one call is milliseconds). Correctness: 256 random query
rows of the windowed output against float64 attention over their windows (max abs error), and the lse of
those rows; a mixed batch (a long prompt, a short one, a prompt after a cached context) checked the same way.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")

from solutions.kernels import flash_attention as fa  # noqa: E402
from yaie import ops  # noqa: E402
from yaie.bench.harness import bench_ms, gpu_slug  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
# (prompt length, window): Mistral's 4096 at 8k and 32k tokens, a short window.
SHAPES = [(8192, 4096), (8192, 1024), (32768, 4096)]
GATHER_LIMIT_GB = 40     # the old path builds [heads, n, n] float32 scores: run it only below this


def exact_rows(q, k, v, rows, len_q, len_k, window):
    """float64 out [len(rows), heads, d] and lse [heads, len(rows)] of query rows ``rows`` of one sequence."""
    group = HEADS // KV_HEADS
    outs, lses = [], []
    for i in rows.tolist():
        p = len_k - len_q + i
        lo = max(0, p - window + 1)
        kk = k[lo:p + 1].double().repeat_interleave(group, 1)          # [w, heads, d]
        vv = v[lo:p + 1].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), kk) * DIM ** -0.5
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses, 1)


def check_rows(out, lse, q, k, v, cu_q, cu_k, window, gen, per_seq=256):
    """Max abs error of out and lse over up to ``per_seq`` random query rows of every sequence."""
    err_out = err_lse = 0.0
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        rows = torch.randperm(q1 - q0, generator=gen)[:per_seq]
        want_out, want_lse = exact_rows(q[q0:q1], k[k0:k1], v[k0:k1], rows, q1 - q0, k1 - k0, window)
        got_out = out[q0:q1][rows.to(out.device)].double()
        got_lse = lse[:, q0:q1][:, rows.to(out.device)].double()
        err_out = max(err_out, float((got_out - want_out).abs().max()))
        err_lse = max(err_lse, float((got_lse - want_lse).abs().max()))
    return err_out, err_lse


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def window_mask(n, window):
    pos = torch.arange(n, device="cuda")
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


def time_shape(rows, gen, n, window):
    label = f"prompt {n}, h{HEADS}/{KV_HEADS}, d{DIM}, window {window}"
    q = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    cu = offsets([n])

    def record(impl, fn, check, **extra):
        result = fn()
        errors = check_rows(*result, q, k, v, cu, cu, window, gen) if check else (None, None)
        ms = bench_ms(fn, 10, 50)
        rows.append({"shape": label, "impl": impl, "ms": ms, "max_abs_err_out": errors[0],
                     "max_abs_err_lse": errors[1], **extra})
        shown = "-" if errors[0] is None else f"out {errors[0]:.1e} lse {errors[1]:.1e}"
        print(f"  {label} {impl}: {ms:.3f} ms  err {shown}", flush=True)

    record(f"yaie varlen, window {window}", lambda: fa.flash_attention_varlen_forward(
        q, k, v, cu, cu, n, n, causal=True, sliding_window=window), True)
    record("yaie varlen, causal (no window)", lambda: fa.flash_attention_varlen_forward(
        q, k, v, cu, cu, n, n, causal=True), False)
    # KV heads repeated for SDPA: with a mask and grouped heads PyTorch would fall back to its math backend,
    # which builds the [heads, n, n] scores.
    group = HEADS // KV_HEADS
    qd, kd, vd = (t.transpose(0, 1)[None].contiguous() for t in (q, k.repeat_interleave(group, 1),
                                                                 v.repeat_interleave(group, 1)))
    mask = window_mask(n, window)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
        return out[0].transpose(0, 1), None

    out = sdpa()[0]
    want, _ = exact_rows(q, k, v, torch.arange(0, n, max(1, n // 256)), n, n, window)
    sdpa_err = float((out[torch.arange(0, n, max(1, n // 256), device="cuda")].double() - want).abs().max())
    ms = bench_ms(sdpa, 10, 50)
    rows.append({"shape": label, "impl": "torch SDPA, boolean window mask", "ms": ms, "max_abs_err_out": sdpa_err,
                 "max_abs_err_lse": None})
    print(f"  {label} torch SDPA, boolean window mask: {ms:.3f} ms  err out {sdpa_err:.1e}", flush=True)
    del qd, kd, vd, mask
    need_gb = HEADS * n * n * 4 * 3 / 1e9          # scores, mask-filled scores, softmax (float32)
    if need_gb < GATHER_LIMIT_GB:
        gathered = lambda: (ops.attention(q, k, v, sliding_window=window), None)  # noqa: E731
        out = gathered()[0]
        err = float((out[torch.arange(0, n, max(1, n // 256), device="cuda")].double() - want).abs().max())
        ms = bench_ms(gathered, 10, 50)
        rows.append({"shape": label, "impl": "before: gather + lesson 01", "ms": ms, "max_abs_err_out": err,
                     "max_abs_err_lse": None})
        print(f"  {label} before: gather + lesson 01: {ms:.3f} ms  err out {err:.1e}", flush=True)
    else:
        rows.append({"shape": label, "impl": "before: gather + lesson 01", "ms": None,
                     "skipped": f"needs about {need_gb:.0f} GB of float32 scores"})
        print(f"  {label} before: gather + lesson 01: skipped (about {need_gb:.0f} GB of scores)", flush=True)
    torch.cuda.empty_cache()


def mixed_batch(report, gen):
    """A long prompt, a short prompt and 700 new tokens after 3000 cached ones, bf16 and fp16, window 1024."""
    lens_q, lens_k, window = [5000, 37, 700], [5000, 37, 3700], 1024
    checks = []
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(sum(lens_q), HEADS, DIM, device="cuda", dtype=dtype)
        k = torch.randn(sum(lens_k), KV_HEADS, DIM, device="cuda", dtype=dtype)
        v = torch.randn(sum(lens_k), KV_HEADS, DIM, device="cuda", dtype=dtype)
        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        out, lse = fa.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                     sliding_window=window)
        err_out, err_lse = check_rows(out, lse, q, k, v, cu_q, cu_k, window, gen)
        checks.append({"dtype": str(dtype), "lens_q": lens_q, "lens_k": lens_k, "window": window,
                       "max_abs_err_out": err_out, "max_abs_err_lse": err_lse,
                       "ok": err_out < 2e-2 and err_lse < 1e-2})
        print(f"  mixed batch {dtype}: out {err_out:.1e} lse {err_lse:.1e}", flush=True)
    report["mixed_batch"] = checks


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("YAIE_GIT_COMMIT"),
              "command": "OUT=out python scripts/gpu_lesson06_window.py",
              "layout": f"bf16, {HEADS} query heads over {KV_HEADS} KV heads, head_dim {DIM}, one prompt, packed",
              "timing": "triton.testing.do_bench median, eager (L2 cleared between calls)", "rows": []}
    print(f"{report['gpu']} torch {torch.__version__} triton {triton.__version__}", flush=True)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    began = time.monotonic()
    mixed_batch(report, gen)
    for n, window in SHAPES:
        time_shape(report["rows"], gen, n, window)
    report["seconds"] = time.monotonic() - began
    path = out_dir / f"lesson06_window_{gpu_slug()}.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)
    bad = [c for c in report["mixed_batch"] if not c["ok"]]
    bad += [r for r in report["rows"] if r.get("max_abs_err_out") is not None and not r["max_abs_err_out"] < 2e-2]
    if bad:
        print("FAILED checks:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
