"""``yaie bench lesson06``: FlashAttention forward and backward beside torch SDPA, its default and its flash backend.

bf16, head dims 128 and 64, 4k to 16k tokens per sequence (16k tokens per batch), causal and not.
FLOP counts are the usual ones: forward ``4 * batch * heads * seq^2 * head_dim`` (two matmuls), backward
2.5 times that (five matmuls: the recomputed scores, dV, dP, dQ, dK), both halved under a causal mask.
The same counts are used for every implementation, so the TFLOP/s ratio is the speed ratio.

Each row is timed for:

* ``yaie triton``: lesson 06's kernels (yours, or the reference with ``--solutions``);
* ``yaie triton hopper``: the reference's Hopper variant (``solutions/kernels/flash_attention_hopper.py``),
  forward and backward (dq from its own kernel), only with ``--solutions`` and on a compute-capability-9 GPU;
  ``yaie triton hopper (dq atomics)``: the same with dq added atomically by the dK/dV kernel (backward row
  only: its forward is the same kernel);
* ``torch SDPA default (<backend>)``: ``scaled_dot_product_attention`` with no backend forced, what a user
  gets without asking. The backend it picks is named (on the lent H100/H200 with torch 2.11: cuDNN), read
  from PyTorch's own dispatcher and confirmed by forcing that backend and getting the same output bits;
* ``torch SDPA flash``: SDPA forced to its FlashAttention-2 backend.

Before timing, each shape is checked once against SDPA's default (the same inputs): a kernel that is fast
and wrong is reported as wrong. ``YAIE_BENCH_HEAD_DIMS=128`` limits the run to some head dims.
"""

from __future__ import annotations

import os

import torch

from yaie.bench.harness import Row, bench_ms, rel_err
from yaie.device import is_hopper
from yaie.switch import module

LESSON = "lesson06"
DEFAULT = "torch SDPA default"
FLASH = "torch SDPA flash"
OURS = "yaie triton"
HOPPER = "yaie triton hopper"
HOPPER_ATOMIC = "yaie triton hopper (dq atomics)"
HOPPERS = (HOPPER, HOPPER_ATOMIC)


def shapes(quick: bool, head_dims: tuple[int, ...] = (128, 64)) -> list[tuple[int, int, int, int]]:
    """(batch, heads, seq, head_dim): 16k tokens per batch, 2048-wide models (16 x 128 or 32 x 64)."""
    seqs = [4096] if quick else [4096, 8192, 16384]
    out = []
    for head_dim, heads in ((128, 16), (64, 32)):
        if head_dim not in head_dims:
            continue
        for seq in seqs:
            out.append((16384 // seq, heads, seq, head_dim))
    return out


def head_dims_from_env(text: str | None) -> tuple[int, ...]:
    """``YAIE_BENCH_HEAD_DIMS`` ("128" or "128,64"; unset: both) as a tuple; ValueError on anything else."""
    if text is None or not text.strip():
        return (128, 64)
    dims = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    if not dims or any(d not in (128, 64) for d in dims):
        raise ValueError(f"YAIE_BENCH_HEAD_DIMS must list 128 and/or 64, got {text!r}")
    return dims


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> int:
    """Forward FLOPs: q k^T and P v, each 2 * seq^2 * head_dim per head; half of it under a causal mask."""
    flops = 4 * batch * heads * seq * seq * head_dim
    return flops // 2 if causal else flops


def backend_name(index: int) -> str:
    """PyTorch's SDPBackend number (what ``torch._fused_sdp_choice`` returns) as a short name."""
    from torch.nn.attention import SDPBackend

    names = {int(member.value): name for name, member in SDPBackend.__members__.items()}
    short = {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
             "MATH": "math", "OVERRIDEABLE": "overrideable", "ERROR": "none"}
    name = names.get(int(index))
    return short.get(name, f"backend {index}") if name is not None else f"backend {index}"


def sdpa_default_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The backend ``scaled_dot_product_attention`` picks for these inputs when none is forced.

    Asks PyTorch's dispatcher (``torch._fused_sdp_choice``, the function SDPA itself calls), then confirms
    the answer: the default call and a call forced to that backend must give the same bits. Returns the
    short name (``"cudnn"``, ``"flash"``, ...), with ``"?"`` appended if the confirmation failed.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))
    name = backend_name(choice)
    member = next((m for m in SDPBackend.__members__.values() if int(m.value) == choice), None)
    if member is None or name in ("none", "overrideable"):
        return name + "?"
    with torch.no_grad():
        default_out = sdpa(q, k, v, is_causal=causal)
        with sdpa_kernel([member]):
            forced_out = sdpa(q, k, v, is_causal=causal)
    return name if torch.equal(default_out, forced_out) else name + "?"


def _sdpa_default(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _best_configs(fa) -> str:
    """The autotuner's choices of the reference kernels (empty for a student module without them)."""
    tuned = getattr(fa, "_tuned", None)
    if tuned is None:
        return ""
    parts = []
    for kind in ("fwd", "dkdv", "dq"):
        config = getattr(tuned(kind), "best_config", None)
        if config is not None:
            parts.append(f"{kind}: {config}")
    return "; ".join(parts)


def _hopper_module(fa):
    """The Hopper variant of the reference, when the reference runs and the GPU is a Hopper; else None."""
    if not fa.__name__.startswith("solutions.") or not is_hopper(torch.device("cuda")):
        return None
    from solutions.kernels import flash_attention_hopper

    return flash_attention_hopper


def ratio_lines(rows: list[Row], baseline: str) -> list[str]:
    """One line per (kernel, implementation) of one shape: speed over the ``baseline`` impl's (>1: faster).

    ``rows`` are the rows of one shape; the baseline is matched by prefix (its name carries the backend).
    """
    lines = []
    for kernel in ("flash_attention_forward", "flash_attention_backward"):
        group = [r for r in rows if r.kernel == kernel]
        base = next((r for r in group if r.impl.startswith(baseline)), None)
        if base is None:
            continue
        for row in group:
            if row is base:
                continue
            what = "forward " if kernel.endswith("forward") else "backward"
            lines.append(f"  {what} {row.impl:<32} {row.tflops:6.1f} TFLOP/s = {base.ms / row.ms:.2f}x "
                         f"{base.impl} ({base.tflops:.1f})")
    return lines


def run(args) -> list[Row]:
    fa = module(6)
    hopper = _hopper_module(fa)
    failed_hoppers: set[str] = set()    # a Hopper impl that failed once is left out of the later shapes
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 30) if quick else (25, 100)
    dtype = torch.bfloat16
    rows: list[Row] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, seq, head_dim in shapes(quick, head_dims_from_env(os.environ.get("YAIE_BENCH_HEAD_DIMS"))):
        for causal in (False, True):
            shape = f"b{batch} h{heads} s{seq} d{head_dim}" + (" causal" if causal else "")
            q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, generator=gen)
                             for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            backend = sdpa_default_backend(q, k, v, causal)
            default_name = f"{DEFAULT} ({backend})"
            impls = {OURS: lambda: fa.flash_attention(q, k, v, causal=causal)}
            if hopper is not None:
                for impl, mode in ((HOPPER, "kernel"), (HOPPER_ATOMIC, "atomic")):
                    if impl not in failed_hoppers:
                        impls[impl] = lambda m=mode: hopper.flash_attention(q, k, v, causal=causal, dq_mode=m)
            impls[default_name] = lambda: _sdpa_default(q, k, v, causal)
            impls[FLASH] = lambda: _sdpa_flash(q, k, v, causal)

            # Check once against SDPA's default (this also compiles and autotunes outside the timed region).
            out_ref = impls[default_name]()
            grads_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
            status = {}
            for impl, fn in list(impls.items()):
                if impl == default_name:
                    continue
                try:
                    out = fn()
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                except Exception as err:   # the Hopper variant failing must not lose the other rows
                    if impl not in HOPPERS:
                        raise
                    print(f"{shape}: {impl} failed, left out from here on: {type(err).__name__}: {err}"[:2000],
                          flush=True)
                    del impls[impl]
                    failed_hoppers.add(impl)
                    continue
                errors = [rel_err(out, out_ref)] + [rel_err(a, b) for a, b in zip(grads, grads_ref)]
                status[impl] = "ok" if max(errors) < 2e-2 else "MISMATCH"
                print(f"{shape}: {impl} vs {default_name}, relative difference out/dq/dk/dv = "
                      + ", ".join(f"{e:.1e}" for e in errors) + f" [{status[impl]}]", flush=True)
                del out, grads
            del out_ref, grads_ref

            fwd_flops = attention_flops(batch, heads, seq, head_dim, causal)
            shape_rows = []
            for impl, fn in impls.items():
                name = impl if status.get(impl, "ok") == "ok" else impl + " (MISMATCH)"
                if impl != HOPPER_ATOMIC:      # (its forward is HOPPER's kernel)
                    with torch.no_grad():
                        fwd_ms = bench_ms(fn, warmup, rep)
                    shape_rows.append(Row(LESSON, "flash_attention_forward", name, shape, "bf16", fwd_ms,
                                          flops=fwd_flops))
                out = fn()
                bwd_ms = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup, rep)
                shape_rows.append(Row(LESSON, "flash_attention_backward", name, shape, "bf16", bwd_ms,
                                      flops=int(2.5 * fwd_flops)))
                del out
            rows.extend(shape_rows)
            del q, k, v, dout
            torch.cuda.empty_cache()
            print("\n".join(ratio_lines(shape_rows, DEFAULT)), flush=True)
            configs = _best_configs(fa)
            if configs:
                print(f"  tuned: {configs}", flush=True)
            if hopper is not None and getattr(hopper, "tuned_configs", None):
                print(f"  hopper tuned: {hopper.tuned_configs()}", flush=True)
    return rows


# ----------------------------------------------------------------------------- Hopper configuration sweep

SWEEP_SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128)]
# Forward: (BLOCK_M, BLOCK_N, num_warps, num_stages[, warp_specialize[, prefetch_s[, persistent]]]). The first
# two are the Hopper forward's autotuning list (already compiled by the benchmark when it ran first); each
# later one changes one thing from one of them.
SWEEP_CONFIGS = [
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 3, False, True), (128, 128, 8, 2, False, False, True),
    (128, 128, 8, 3, True), (128, 128, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3),
]
# Left out (seen on an H100): 128 x 128 x 3 stages with prefetch_s or persistent (262 KB of shared memory, over
# the 227 KB limit); (128, 128, 4, 3, True) (Triton 3.6's warp-specialisation pass fails on it).
# Backward: (dq mode, BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel (the dQ kernel mirrors them).
SWEEP_BACKWARD_CONFIGS = [("kernel", 64, 128, 8, 2), ("kernel", 64, 128, 8, 3),
                          ("atomic", 64, 128, 8, 2), ("atomic", 64, 128, 8, 3)]


def config_text(config: tuple) -> str:
    """(128, 64, 8, 3, True) -> "128,64,8,3,1", ("atomic", 64, 128, 8, 2) -> "atomic,64,128,8,2": the forms
    ``YAIE_FA_HOPPER_CONFIGS`` / ``YAIE_FA_HOPPER_BWD_CONFIGS`` read (``parse_config``, ``parse_backward_config``)."""
    return ",".join(x if isinstance(x, str) else str(int(x)) for x in config)


def best_configs(results: list[dict], count: int = 3, kernel: str = "forward") -> list[tuple]:
    """The ``count`` configurations of one pass (``kernel``: "forward" or "backward") with the least total
    time over the sweep's shapes (only those that ran and matched SDPA at every shape)."""
    totals: dict[tuple, float] = {}
    failed = set()
    for r in results:
        if r.get("config") is None or r.get("kernel", "forward") != kernel:
            continue
        config = tuple(r["config"])
        if r.get("ms") is None or r.get("status") != "ok":
            failed.add(config)
            continue
        totals[config] = totals.get(config, 0.0) + r["ms"]
    ranked = sorted((t, c) for c, t in totals.items() if c not in failed)
    return [c for _, c in ranked[:count]]


def _sweep_row(results: list, shape: str, kernel: str, name: str, config, fn, check, flops: int) -> None:
    """Run ``fn`` once, compare with ``check`` (a function of its result giving the largest relative
    difference to SDPA's default), time it; record a row (an error is recorded, not raised)."""
    import traceback

    row = {"shape": shape, "kernel": kernel, "impl": name, "config": config, "ms": None, "status": "ok"}
    try:
        row["rel_err"] = check(fn())
        if not row["rel_err"] < 2e-2:
            row["status"] = "MISMATCH"
        row["ms"] = bench_ms(fn, 10, 50)
        row["TFLOPs"] = flops / (row["ms"] * 1e-3) / 1e12
    except Exception as err:   # a configuration that does not compile or run: recorded, skipped
        row["status"] = "error"
        row["error"] = "".join(traceback.format_exception_only(type(err), err))[-600:]
    results.append(row)
    timing = f"{row['ms']:8.3f} ms {row['TFLOPs']:6.1f} TFLOP/s" if row["ms"] is not None else row["status"]
    print(f"{shape:26s} {kernel:10s} {name:36s} {timing} {row.get('rel_err', float('nan')):.1e}", flush=True)


def sweep(out_dir: str, quick: bool = False, device: str = "cuda", sweep_shapes: list | None = None) -> list[dict]:
    """Time the Hopper kernels at each configuration (forward: SWEEP_CONFIGS; backward:
    SWEEP_BACKWARD_CONFIGS) beside the reference and SDPA, bf16; also the backward's preprocessing (delta and
    the base-2 lse) done by PyTorch operations as the reference does, against the fused kernel. Writes
    ``lesson06_hopper_sweep.json`` after every shape (a time limit keeps what was measured) and returns the rows.

    ``device`` and ``sweep_shapes`` let the logic run on the CPU (the interpreter, tiny shapes: every row
    then records the timing's error, after the kernels ran and were compared)."""
    import json
    from pathlib import Path

    from solutions.kernels import flash_attention as reference
    from solutions.kernels import flash_attention_hopper as hopper

    results: list[dict] = []
    Path(out_dir).mkdir(parents=True, exist_ok=True)

    def write():
        best = {kind: [config_text(c) for c in best_configs(results, kernel=kind)] for kind in ("forward", "backward")}
        Path(out_dir, "lesson06_hopper_sweep.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__,
             "rows": results, "best": best},
            indent=1))
        return best

    gen = torch.Generator(device=device).manual_seed(1)
    for batch, heads, seq, head_dim in sweep_shapes or (SWEEP_SHAPES[:1] if quick else SWEEP_SHAPES):
        for causal in (False, True):
            shape = f"b{batch} h{heads} s{seq} d{head_dim}" + (" causal" if causal else "")
            dtype = torch.bfloat16 if device == "cuda" else torch.float16    # (interpreter: no bf16 dots)
            q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device=device, generator=gen).to(dtype)
                             for _ in range(4))
            flops = attention_flops(batch, heads, seq, head_dim, causal)
            with torch.no_grad():
                want = _sdpa_default(q, k, v, causal)

            def check_out(got):
                return rel_err(got[0] if isinstance(got, tuple) else got, want)

            forward = [("torch SDPA default", None, lambda: _sdpa_default(q, k, v, causal)),
                       ("torch SDPA flash", None, lambda: _sdpa_flash(q, k, v, causal)),
                       ("yaie triton (reference)", None,
                        lambda: reference.flash_attention_forward(q, k, v, causal=causal))]
            forward += [(f"hopper {config_text(c)}", c,
                         lambda c=c: hopper.forward_with_config(q, k, v, causal, None, c)) for c in SWEEP_CONFIGS]
            with torch.no_grad():
                for name, config, fn in forward:
                    _sweep_row(results, shape, "forward", name, config, fn, check_out, flops)

            # Backward, each from the same (out, lse) of the Hopper forward; SDPA's default through autograd.
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            sdpa_out = _sdpa_default(*leaves, causal)
            want_grads = torch.autograd.grad(sdpa_out, leaves, dout, retain_graph=True)
            out, lse = hopper.flash_attention_forward(q, k, v, causal=causal)

            def check_grads(got):
                return max(rel_err(a, b) for a, b in zip(got, want_grads))

            backward = [("torch SDPA default", None,
                         lambda: torch.autograd.grad(sdpa_out, leaves, dout, retain_graph=True)),
                        ("yaie triton (reference)", None,
                         lambda: reference.flash_attention_backward(dout, q, k, v, out, lse, causal=causal))]
            backward += [(f"hopper {config_text(c)}", c,
                          lambda c=c: hopper.backward_with_config(dout, q, k, v, out, lse, causal, None, None, c))
                         for c in SWEEP_BACKWARD_CONFIGS]
            for name, config, fn in backward:
                _sweep_row(results, shape, "backward", name, config, fn, check_grads, int(2.5 * flops))

            # The backward's preprocessing alone: PyTorch operations (the reference) against the fused kernel.
            def torch_preprocess():
                delta = (dout.float() * out.float()).sum(-1).contiguous()
                lse2 = torch.where(lse == float("-inf"), float("inf"), lse * reference.LOG2E).contiguous()
                return delta, lse2

            want_delta = torch_preprocess()[0]
            for name, fn in (("preprocess: torch operations", torch_preprocess),
                             ("preprocess: fused kernel", lambda: hopper.backward_preprocess(out, dout, lse))):
                _sweep_row(results, shape, "preprocess", name, None, fn,
                           lambda got: rel_err(got[0], want_delta), 0)
            del q, k, v, dout, want, leaves, sdpa_out, want_grads, out, lse
            if device == "cuda":
                torch.cuda.empty_cache()
            write()
    best = write()
    print("best forward:", ";".join(best["forward"]), " best backward:", ";".join(best["backward"]), flush=True)
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="lesson 06 Hopper kernels: time each configuration")
    parser.add_argument("command", choices=["sweep"])
    parser.add_argument("--out", default="out_lesson06")
    parser.add_argument("--quick", action="store_true")
    cli = parser.parse_args()
    sweep(cli.out, cli.quick)
