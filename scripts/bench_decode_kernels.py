"""The kernels of a batch-1 decode step, each against what it would replace, timed inside CUDA graphs.

    python scripts/bench_decode_kernels.py --out "$OUT"          # on a CUDA GPU -> $OUT/decode_kernels_<gpu>.json
    python scripts/bench_decode_kernels.py --check               # CPU: run every variant once (interpreter)

Shapes: the engine benchmark's random 1.1B Llama (hidden 2048, 32 query / 8 KV heads of 64, SwiGLU 8192,
vocab 32000, bf16, KV blocks of 16 tokens). Each op is recorded ``--reps`` times in one CUDA graph and the
graph replayed, so a time includes the launch gap a graph node costs in the engine's decode graph. The
matrix-vector products cycle through copies of their weight totalling >= 256 MB (more than the L2 cache),
as in a decode step, where every weight is read once; the attention and RoPE inputs stay small (as in the
engine, where they are a few hundred KB per layer).

Rows:
* ``rope + kv write``: lesson 02's fused ``apply_rope_qk_store_kv`` vs ``apply_rope_qk`` + lesson 03's
  ``write_kv`` (two index copies), 1 token;
* ``paged decode``: lesson 04's kernel at batch 1 for several contexts under the CUDA graphs' context bound,
  by split count and tile (the default marked);
* ``matvec``: lesson 02's one-row products (``matvec``, ``silu_and_mul_matvec``, ``add_rms_norm_matvec``) vs
  cuBLAS (``F.linear``) and the unfused ops before it, at the model's projections, one token; the fused
  norm's launch settings swept;
* ``skinny``: lesson 02's few-row gate/up product with SiLU-and-mul fused (``skinny_matmul_silu_and_mul``)
  vs cuBLAS and the SiLU kernel, for a decode step of ``--rows`` sequences (64), its launch settings swept;
  the same product without the epilogue beside cuBLAS at the other projections.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yaie.device import prepare_triton  # noqa: E402

if not torch.cuda.is_available():
    prepare_triton()

import torch.nn.functional as F  # noqa: E402

from solutions.kernels import gpu_elementwise as l02  # noqa: E402
from solutions.kernels import kv_cache as l03  # noqa: E402
from solutions.kernels import paged_attention as l04  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 2048, 32, 8, 64, 8192, 32000, 16


def graph_us(fn, reps: int, iters: int = 10) -> float:
    """Microseconds per call of ``fn`` recorded ``reps`` times in one CUDA graph (median of ``iters`` replays)."""
    from yaie.bench.harness import event_times_ms, graphed
    replay = graphed(lambda: [fn(i) for i in range(reps)], warm=1)
    replay()
    torch.cuda.synchronize()
    times = sorted(event_times_ms(replay, iters))
    return times[len(times) // 2] * 1e3 / reps


def timer(device, reps):
    if device == "cuda":
        return lambda fn: graph_us(fn, reps)
    return lambda fn: (fn(0), float("nan"))[1]       # --check: run once, no time


def bench_rope(device, dtype, time_of, rows):
    manager = l03.KVCacheManager(num_blocks=64, block_size=BLOCK, num_layers=16, num_kv_heads=KV_HEADS,
                                 head_dim=HEAD_DIM, dtype=dtype, device=device)
    cos, sin = torch.randn(4096, HEAD_DIM, device=device), torch.randn(4096, HEAD_DIM, device=device)
    for tokens in (1, 64):
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device, dtype=dtype)
        q, k, v = (t.reshape(tokens, -1, HEAD_DIM) for t in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                                        KV_HEADS * HEAD_DIM], -1))
        positions = torch.arange(tokens, device=device) + 100
        slots = torch.arange(tokens, device=device) + 37

        def apart(i):
            l02.apply_rope_qk(q, k, cos, sin, positions)
            manager.write_kv(i % 16, slots, k, v, validate=False)

        def fused(i):
            l02.apply_rope_qk_store_kv(q, k, v, cos, sin, positions, manager.k_cache[i % 16], manager.v_cache[i % 16],
                                       slots)

        for name, fn in (("apply_rope_qk + write_kv", apart), ("apply_rope_qk_store_kv", fused)):
            rows.append(dict(op="rope + kv write", shape=f"{tokens} token(s), {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}",
                             impl=name, us=time_of(fn)))


def bench_decode(device, dtype, time_of, rows, quick):
    blocks = 4096 // BLOCK
    k_cache = torch.randn(16, blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device=device, dtype=torch.int32)[None]
    q = torch.randn(1, HEADS, HEAD_DIM, device=device, dtype=dtype)
    cases = [(200, 1024), (1000, 1024), (3000, 4096)] if not quick else [(40, 64)]
    for context, bound in cases:
        lens = torch.tensor([context], device=device, dtype=torch.int32)
        default = l04.choose_num_splits(1, KV_HEADS, bound, l04.num_sms(q.device))
        for splits in ((1, 2, 4, 8, 16) if not quick else (1, 2)):
            for tile in ((64,) if not quick else (16,)):
                for warps in ((2, 4) if not quick else (1,)):
                    config = dict(TILE_N=tile, num_warps=warps, num_stages=2 if quick else 3)

                    def fn(i, splits=splits, config=config):
                        l04._launch_decode(q, k_cache[i % 16], v_cache[i % 16], table, lens, bound, HEAD_DIM ** -0.5,
                                           splits, config=config)

                    rows.append(dict(op="paged decode", shape=f"b1 h{HEADS}/{KV_HEADS} d{HEAD_DIM} ctx{context} "
                                     f"bound{bound}", impl=f"splits={splits} tile={tile} warps={warps}",
                                     default=splits == default and tile == 64 and warps == 4, us=time_of(fn)))


def bench_matvec(device, dtype, time_of, rows, quick, no_sweep=False):
    """Lesson 02's one-row products (as launched by the engine) beside the ops they replace; for the fused
    norm, a sweep of launch settings too."""
    hidden, inter = (HIDDEN, INTER) if not quick else (96, 80)
    shapes = {"qkv": (3072, hidden, "norm"), "o": (hidden, hidden, "plain"), "gate_up": (2 * inter, hidden, "norm"),
              "down": (hidden, inter, "silu"), "lm_head": (VOCAB, hidden, "plain")}
    if quick:
        shapes = {k: (40, v[1], v[2]) for k, v in shapes.items()}
    sweep = [(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024) for w in (4, 8)] if not quick else [(4, 32, 1)]
    if no_sweep:
        sweep = []
    for name, (n, k, kind) in shapes.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2))) if not quick else 2
        weights = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=dtype)
        residual = torch.randn(1, k, device=device, dtype=dtype)
        norm_w = torch.randn(k, device=device, dtype=dtype)
        gate_up = torch.randn(1, 2 * k, device=device, dtype=dtype)
        shape = f"{name} {n}x{k} ({n * k * 2 / 1e6:.1f} MB)"

        def row(impl, fn, **extra):
            rows.append(dict(op="matvec", shape=shape, impl=impl, MB=n * k * 2 / 1e6, us=time_of(fn), **extra))

        row("cuBLAS F.linear", lambda i: F.linear(x, weights[i % copies]))
        if kind == "plain":
            row("matvec", lambda i: l02.matvec(x, weights[i % copies]))
        elif kind == "silu":
            row("silu_and_mul + cuBLAS", lambda i: F.linear(l02.silu_and_mul(gate_up), weights[i % copies]))
            row("silu_and_mul_matvec", lambda i: l02.silu_and_mul_matvec(gate_up, weights[i % copies]))
        else:
            row("fused_add_rms_norm + cuBLAS", lambda i: F.linear(
                l02.fused_add_rms_norm(x.clone(), residual.clone(), norm_w)[0], weights[i % copies]))
            row("clone x2 (the row above copies its inputs)", lambda i: (x.clone(), residual.clone()))
            row("add_rms_norm_matvec",
                lambda i: l02.add_rms_norm_matvec(x, residual, norm_w, 1e-5, weights[i % copies]))
            out, res_out = torch.empty(1, n, device=device, dtype=dtype), torch.empty_like(residual)
            for bn, bk, w in sweep:
                def launch(i, bn=bn, bk=bk, w=w):
                    l02._matvec_kernel[((n + bn - 1) // bn,)](
                        x, residual, norm_w, weights[i % copies], weights[0], out, res_out, n, k, k, 1e-5,
                        PROLOGUE=2, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3)
                row(f"add_rms_norm_matvec BN{bn} BK{bk} w{w}", launch)


def _skinny_sweep(quick, rows):
    """(BLOCK_N, BLOCK_K, warps, stages) to try for the fused gate/up product: its two weight tiles and the input
    tile of every stage, and of the peeled first K block, must fit in shared memory (about 200 KB of the H100's
    227); a setting that does not compile all the same is skipped when timed."""
    if quick:
        return [(32, 16, 4, 2)]
    block_m = l02.skinny_launch_config(rows)["BLOCK_M"]
    return [(bn, bk, w, st) for bn in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8) for st in (3, 4, 5, 6)
            if (2 * bn + block_m) * bk * 2 * (st + 1) <= 200_000 and (w == 8) == (bn == 128)]


def bench_skinny(device, dtype, time_of, rows, quick, m, no_sweep=False):
    """Lesson 02's few-row product at ``m`` rows beside cuBLAS: fused with SiLU-and-mul for the gate/up
    product (its launch settings swept), without the epilogue at the other projections (which keep cuBLAS)."""
    hidden, inter = (HIDDEN, INTER) if not quick else (96, 80)
    dtype = torch.float16 if dtype == torch.float32 else dtype   # the kernel takes half types only
    shapes = {"gate_up": (2 * inter, hidden), "qkv": (3072, hidden), "o": (hidden, hidden), "down": (hidden, inter),
              "lm_head": (VOCAB, hidden)}
    if quick:
        shapes = {k: (40, v[1]) for k, v in shapes.items()}
    for name, (n, k) in shapes.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2))) if not quick else 2
        weights = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(m, k, device=device, dtype=dtype)
        shape = f"{name} {m}x{n}x{k} ({n * k * 2 / 1e6:.1f} MB)"

        def row(impl, fn, **extra):
            try:
                us = time_of(fn)
            except Exception as error:  # a setting that does not compile (shared memory, registers)
                print(f"skip {shape} {impl}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                return
            rows.append(dict(op="skinny", shape=shape, impl=impl, MB=n * k * 2 / 1e6, us=us, **extra))

        if name != "gate_up":
            row("cuBLAS F.linear", lambda i: F.linear(x, weights[i % copies]))
            row("few-row product", lambda i: l02._launch_skinny(x, weights[i % copies], None, False))
            continue
        row("cuBLAS F.linear + silu_and_mul", lambda i: l02.silu_and_mul(F.linear(x, weights[i % copies])))
        row("few-row product + silu_and_mul",
            lambda i: l02.silu_and_mul(l02._launch_skinny(x, weights[i % copies], None, False)))
        row("skinny_matmul_silu_and_mul", lambda i: l02.skinny_matmul_silu_and_mul(x, weights[i % copies]),
            default=True)
        for bn, bk, w, st in ([] if no_sweep else _skinny_sweep(quick, m)):
            config = dict(l02.skinny_launch_config(m), BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
            row(f"skinny_matmul_silu_and_mul BN{bn} BK{bk} w{w} s{st}",
                lambda i, config=config: l02._launch_skinny(x, weights[i % copies], None, True, config),
                config=config)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--check", action="store_true", help="tiny shapes, each variant run once (CPU interpreter)")
    p.add_argument("--reps", type=int, default=64)
    p.add_argument("--only", default="rope,decode,matvec", help="any of rope,decode,matvec,skinny")
    p.add_argument("--rows", type=int, default=64, help="skinny: the decode step's rows")
    p.add_argument("--no-sweep", action="store_true", help="matvec, skinny: the launch settings in use only")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    time_of = timer(device, args.reps)
    rows: list[dict] = []
    began = time.perf_counter()
    only = set(args.only.split(","))
    if "rope" in only:
        bench_rope(device, dtype, time_of, rows)
    if "decode" in only:
        bench_decode(device, dtype, time_of, rows, args.check)
    if "matvec" in only:
        bench_matvec(device, dtype, time_of, rows, args.check, args.no_sweep)
    if "skinny" in only:
        bench_skinny(device, dtype, time_of, rows, args.check, args.rows, args.no_sweep)
    for r in rows:
        print(f"{r['op']:16} {r['shape']:40} {r['impl']:42} {r['us']:8.2f} us"
              + ("  (default)" if r.get("default") else "")
              , flush=True)
    if args.out:
        from yaie.bench.harness import environment, gpu_slug
        env = environment() if device == "cuda" else {}
        command = "python scripts/bench_decode_kernels.py " + " ".join(argv or sys.argv[1:])
        report = dict(environment=env, command=command,
                      reps_per_graph=args.reps, seconds=time.perf_counter() - began, rows=rows)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"decode_kernels_{gpu_slug() if device == 'cuda' else 'cpu'}.json"
        (out / name).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
