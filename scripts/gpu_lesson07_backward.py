"""Lesson 07's backward kernels on the maps whose rows move (oldest-first, random), against PyTorch.

The shapes of ``yaie bench lesson07`` (bf16, b 1, h 8, e 4, d 128, c 256, l 4096 and 16384; the oldest-first
map of task 2 with its n = 2l - c buffer rows, a random map over n = l rows; at l 4k also the stable-column
map the model uses, as a check that its route did not move). Sections (``--sections``, in this order):

* ``bench``: the two backward products, the reference's own choice of kernel against PyTorch gathering
  ``[b, h, l, c, d]`` and multiplying (its backward is autograd's, the forward graph built outside the
  timing), as ``yaie bench lesson07`` times them; each shape checked first: the buffer gradient by rows
  against the atomic kernel at full size, and both gradients against float32 PyTorch on the first 1024
  positions. Ours is timed twice: on the map tensor the checks used (as a model calls it: the map's
  check, measures, normalised copy and sorted order kept on it), and on a new copy of the map at every
  call (``index_map.clone()``: all of them made again, with their device syncs, a first call's cost);
* ``parts``: where the time goes: the sort, the buffer gradient by rows with the order kept (the kernel
  and an empty), the per-position atomic kernel, the gather half (dq or dp);
* ``tiles4k``: tiles of the kernel by rows at l 4k (pv's buffer gradient, order kept), reported only
  (the defaults stay as they are);
* ``sweep``: tiles of the kernel by rows (rows per program, entries per chunk, warps, stages) and p in
  an e-contiguous copy, on the random and oldest-first maps at l 16k; the fastest (sum of both maps)
  becomes the reference's tiles for the sections after it;
* ``runs``: maps whose slots change rows every R positions (R = 1..32, n = l = 16k): the kernel by rows
  against the per-position atomic one and the route picked, to place the route's threshold on the share of row changes.

    PYTHONPATH=. python3 scripts/gpu_lesson07_backward.py --out DIR [--sections sweep,bench,runs,parts,tiles4k]

Prints a table last; writes ``lesson07_backward_<gpu>.json`` and ``.md`` to DIR.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from yaie.device import prepare_triton

prepare_triton()                                        # the interpreter for --smoke on a CPU; no-op on a GPU

from solutions.kernels import telescoping as ref
from yaie.bench.harness import bench_ms, environment, gpu_slug, rel_err
from yaie.bench.lesson07 import C, D, E, H, torch_pv, torch_qk

ROWS = ref._scatter_rows                                # as written, whatever the sweep makes the default

LENGTHS, LONG = (4096, 16384), 16384
WARMUP_MS, REP_MS = 25, 100
DEV = "cuda"


def make_map(kind: str, length: int, gen) -> tuple[torch.Tensor, int]:
    """(map on the GPU, n) as ``yaie bench lesson07`` builds them."""
    if kind == "random":
        return torch.randint(0, length, (length, C), device=DEV, generator=gen, dtype=torch.int32), length
    index_map, starts, _ = ref.telescoping_index_map(length, C)
    n = starts.numel()
    if kind == "stable":
        index_map = ref.stable_slots(index_map, n)
    return index_map.to(DEV), n


def runs_map(length: int, run: int, gen) -> torch.Tensor:
    """Every slot holds a random row for ``run`` positions, then another (phases differ by slot)."""
    phase = torch.randint(0, run, (1, C), device=DEV, generator=gen)
    epoch = (torch.arange(length, device=DEV)[:, None] + phase) // run        # [l, c]
    rows = torch.randint(0, length, (length // run + 2, C), device=DEV, generator=gen, dtype=torch.int32)
    return torch.gather(rows, 0, epoch)


def inputs(length: int, n: int, gen) -> dict:
    dtype = torch.bfloat16
    return dict(
        q=torch.randn(1, length, H, E, D, device=DEV, dtype=dtype, generator=gen),
        k=torch.randn(1, n, H, D, device=DEV, dtype=dtype, generator=gen),
        p=torch.softmax(torch.randn(1, length, H, E, C, device=DEV, generator=gen), -1).to(dtype),
        d_scores=torch.randn(1, length, H, E, C, device=DEV, dtype=dtype, generator=gen),
        d_out=torch.randn(1, length, H, E, D, device=DEV, dtype=dtype, generator=gen))


def products(t: dict) -> dict:
    """name: (x, buf, dout, our backward, torch forward, (p, a) of the buffer gradient's scatter)."""
    return {"qk": (t["q"], t["k"], t["d_scores"], ref.indexed_qk_backward, torch_qk, (t["d_scores"], t["q"])),
            "pv": (t["p"], t["k"], t["d_out"], ref.indexed_pv_backward, torch_pv, (t["p"], t["d_out"]))}


def time_ms(fn) -> float | None:
    if DEV == "cpu":                                    # --smoke: run it once, time nothing
        fn()
        return 1.0
    try:
        return bench_ms(fn, WARMUP_MS, REP_MS)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def route_name(index_map, n) -> str:
    m = ref._normalise_map(index_map, n)
    if ref._rows_route(index_map, m, n, E):
        return "rows"
    return f"blocks of {ref._blocks_plan(index_map, m, n, E)[0]}" if ref._blocks_plan(index_map, m, n, E)[0] \
        else "per position"


def bench(results: dict, gen) -> None:
    for length in LENGTHS:
        for kind in ("oldest-first", "random", "stable")[:3 if length == LENGTHS[0] else 2]:
            index_map, n = make_map(kind, length, gen)
            t = inputs(length, n, gen)
            shape = f"b1 l{length} h{H} e{E} d{D} c{C} n{n} {kind} map"
            share = ref._row_change_share(ref._normalise_map(index_map, n))
            for name, (x, buf, dout, bwd, base, (sp, sa)) in products(t).items():
                # Checks: full size, rows against atomics (two float32 sums of the same terms); prefix
                # against float32 PyTorch, as yaie bench lesson07 does.
                by_rows = ref._scatter(sp, sa, index_map, n, torch.float32, rows=True)
                by_atomics = ref._scatter(sp, sa, index_map, n, torch.float32, blocks=(0, 4))
                full = rel_err(by_rows, by_atomics)
                del by_rows, by_atomics
                cut = 1024
                x32, buf32, g32 = x[:, :cut].float(), buf.float(), dout[:, :cut].float()
                leaves = [x32.requires_grad_(True), buf32.requires_grad_(True)]
                want = torch.autograd.grad(base(leaves[0], leaves[1], index_map[:cut]), leaves, g32)
                got = bwd(dout[:, :cut].contiguous(), x[:, :cut].contiguous(), buf, index_map[:cut])
                errs = [rel_err(g, w) for g, w in zip(got, want)]
                del x32, buf32, g32, leaves, want, got
                ok = max(errs) < 1e-2 and full < 1e-5
                torch.cuda.empty_cache()
                t_ours = time_ms(lambda: bwd(dout, x, buf, index_map))
                t_new_map = time_ms(lambda: bwd(dout, x, buf, index_map.clone()))
                leaves = [x.detach().clone().requires_grad_(True), buf.detach().clone().requires_grad_(True)]
                t_torch = None
                try:
                    graph = base(leaves[0], leaves[1], index_map)
                    t_torch = time_ms(lambda: torch.autograd.grad(graph, leaves, dout, retain_graph=True))
                except torch.OutOfMemoryError:
                    pass
                graph = leaves = None
                torch.cuda.empty_cache()
                entry = dict(shape=shape, product=name, map=kind, length=length, n=n, route=route_name(index_map, n),
                             row_change_share=share, ours_ms=t_ours, ours_new_map_ms=t_new_map, torch_ms=t_torch,
                             speedup=(t_torch / t_ours) if t_ours and t_torch else None,
                             speedup_new_map=(t_torch / t_new_map) if t_new_map and t_torch else None,
                             rel_err_prefix_dx_dbuf=errs, rel_rows_vs_atomics_full=full, ok=ok)
                results["bench"].append(entry)
                print(f"{shape} {name} backward [{entry['route']}, row changes {share:.3f}]: ours {t_ours:.3f} ms, "
                      f"torch {t_torch} ms, {entry['speedup'] or 0:.2f}x; new map each call {t_new_map:.3f} ms, "
                      f"{entry['speedup_new_map'] or 0:.2f}x; prefix err dx/dbuf "
                      f"{errs[0]:.1e}/{errs[1]:.1e}, rows vs atomics {full:.1e} [{'ok' if ok else 'MISMATCH'}]",
                      flush=True)
            del t
            torch.cuda.empty_cache()


def parts(results: dict, gen) -> None:
    for length in LENGTHS:
        for kind in ("oldest-first", "random"):
            index_map, n = make_map(kind, length, gen)
            t = inputs(length, n, gen)
            m = ref._normalise_map(index_map, n)
            block_r, _ = ref._rows_blocks(E, D)
            row = dict(shape=f"l{length} n{n} {kind}", sort_ms=time_ms(lambda: ref._rows_order(m, n, block_r)))
            for name, (x, buf, dout, bwd, base, (sp, sa)) in products(t).items():
                row[f"{name}_rows_ms"] = time_ms(lambda: ref._scatter(sp, sa, index_map, n, buf.dtype, rows=True))
                row[f"{name}_atomics_ms"] = time_ms(lambda: ref._scatter(sp, sa, index_map, n, buf.dtype,
                                                                         blocks=(0, 4)))
            row["dq_gather_acc_ms"] = time_ms(lambda: ref._gather_acc(t["d_scores"], t["k"], index_map))
            row["dp_gather_dot_ms"] = time_ms(lambda: ref._gather_dot(t["d_out"], t["k"], index_map))
            results["parts"].append(row)
            print("parts", json.dumps(row), flush=True)
            del t
            torch.cuda.empty_cache()


SWEEP = [  # (rows per program, entries per chunk, warps, stages); entries x e = the dot's K
    (16, 32, 4, 3), (16, 32, 4, 2), (16, 32, 8, 3), (16, 16, 4, 3), (16, 64, 8, 3), (32, 32, 4, 3),
    (32, 32, 8, 3), (64, 32, 8, 3),
]


def tile_case(kind: str, length: int, gen):
    """``(p, a, normalised map, n, want)`` for timing pv's buffer gradient by rows on a ``kind`` map: ``want`` is
    the per-position atomic kernel's float32 result."""
    index_map, n = make_map(kind, length, gen)
    t = inputs(length, n, gen)
    p, a = t["p"], t["d_out"]
    return p, a, ref._normalise_map(index_map, n), n, ref._scatter(p, a, index_map, n, torch.float32, blocks=(0, 4))


def time_tile(p, a, m, n: int, want, cfg: dict):
    """``(relative error in float32 against want, bf16 ms)`` of the kernel by rows with tiles ``cfg``; a tile
    that does not compile gives ``(None, the error's text)``."""
    try:
        err = rel_err(ROWS(p, a, m, n, torch.float32, **cfg), want)
        ms = time_ms(lambda: ROWS(p, a, m, n, torch.bfloat16, **cfg))
    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
        err, ms = None, f"{type(exc).__name__}: {str(exc)[:120]}"
    return err, ms


def sweep(results: dict, gen) -> None:
    """Times each tile on both maps (pv's buffer gradient, l 16k), then makes the fastest in sum the
    reference's tiles for the sections after it (the reference's defaults are then set to it)."""
    length = LONG
    totals: dict[tuple, float] = {}
    for kind in ("random", "oldest-first"):
        p, a, m, n, want = tile_case(kind, length, gen)
        p_e = p.transpose(3, 4).contiguous().transpose(3, 4)        # e side by side: one sector per entry
        for label, pp in (("p", p), ("p e-contiguous", p_e)):
            for cfg_tuple in (SWEEP if label == "p" else SWEEP[:1]):
                block_r, block_k, warps, stages = cfg_tuple
                cfg = dict(block_r=block_r, block_k=block_k, num_warps=warps, num_stages=stages)
                err, ms = time_tile(pp, a, m, n, want, cfg)
                row = dict(map=kind, length=length, layout=label, **cfg, ms=ms, rel_err=err)
                results["sweep"].append(row)
                print("sweep", json.dumps(row), flush=True)
                if label == "p":
                    ok = isinstance(ms, float) and err is not None and err < 1e-5
                    totals[cfg_tuple] = totals.get(cfg_tuple, 0.0) + (ms if ok else float("inf"))
        del p, a, want, p_e
        torch.cuda.empty_cache()
    best = min(totals, key=totals.get)
    block_r, block_k, warps, stages = best
    results["tiles"] = dict(block_r=block_r, block_k=block_k, num_warps=warps, num_stages=stages,
                            random_plus_oldest_first_ms=totals[best])
    print(f"tiles picked: {results['tiles']}", flush=True)
    ref._rows_blocks = lambda e, d: (block_r, block_k)          # the bench shapes all have e 4
    ref._scatter_rows = functools.partial(ROWS, num_warps=warps, num_stages=stages)


def runs(results: dict, gen) -> None:
    length = LONG
    t = inputs(length, length, gen)
    p, a = t["p"], t["d_out"]
    for run in (1, 2, 4, 8, 16, 32):
        index_map = runs_map(length, run, gen)
        share = ref._row_change_share(index_map)
        row = dict(run=run, row_change_share=share,
                   rows_ms=time_ms(lambda: ref._scatter(p, a, index_map, length, p.dtype, rows=True)),
                   atomics_ms=time_ms(lambda: ref._scatter(p, a, index_map, length, p.dtype, blocks=(0, 4))),
                   picked_ms=time_ms(lambda: ref._scatter(p, a, index_map, length, p.dtype)),
                   picked=route_name(index_map, length))
        results["runs"].append(row)
        print("runs", json.dumps(row), flush=True)


SWEEP_4K = [  # (rows per program, entries per chunk, warps, stages); the first is the default
    (16, 32, 4, 2), (16, 32, 4, 3), (16, 16, 4, 2), (16, 64, 4, 2), (16, 32, 2, 2), (16, 32, 8, 2), (32, 32, 4, 2),
]


def tiles4k(results: dict, gen) -> None:
    """Tiles of the kernel by rows at the shortest length (pv's buffer gradient, order kept on the map),
    on both maps whose rows move; reported only: the reference's defaults are not changed."""
    length = LENGTHS[0]
    for kind in ("random", "oldest-first"):
        p, a, m, n, want = tile_case(kind, length, gen)
        for block_r, block_k, warps, stages in SWEEP_4K:
            cfg = dict(block_r=block_r, block_k=block_k, num_warps=warps, num_stages=stages)
            err, ms = time_tile(p, a, m, n, want, cfg)
            row = dict(map=kind, length=length, **cfg, ms=ms, rel_err=err)
            results["tiles4k"].append(row)
            print("tiles4k", json.dumps(row), flush=True)
        del p, a, want
        torch.cuda.empty_cache()


def table(results: dict) -> str:
    lines = ["| shape | product | route | ours ms | torch gather + matmul ms | speed-up | ours, new map each call ms "
             "| speed-up | checks |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results["bench"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        sp_new = f"{r['speedup_new_map']:.2f}x" if r["speedup_new_map"] else "-"
        torch_ms = f"{r['torch_ms']:.3f}" if r["torch_ms"] else "OOM"
        lines.append(f"| {r['shape']} | {r['product']} backward | {r['route']} | {r['ours_ms']:.3f} | {torch_ms} | "
                     f"{sp} | {r['ours_new_map_ms']:.3f} | {sp_new} | {'ok' if r['ok'] else 'MISMATCH'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out_lesson07_backward")
    parser.add_argument("--sections", default="sweep,bench,runs,parts", help="any of sweep,bench,runs,parts,tiles4k")
    parser.add_argument("--smoke", action="store_true", help="tiny lengths on the CPU (Triton's interpreter)")
    args = parser.parse_args()
    if args.smoke:
        global DEV, LENGTHS, LONG, SWEEP, H, C
        DEV, LENGTHS, LONG, SWEEP, H, C = "cpu", (80,), 80, SWEEP[:2], 1, 32
        SWEEP_4K[2:] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(environment=environment(), sections=args.sections, tiles=None, bench=[], parts=[], sweep=[], runs=[],
                   tiles4k=[])
    gen = torch.Generator(device=DEV).manual_seed(0)
    start = time.monotonic()
    for section in args.sections.split(","):
        globals()[section](results, gen)
        print(f"== {section} done at {time.monotonic() - start:.0f} s", flush=True)
        (out / f"lesson07_backward_{gpu_slug()}.json").write_text(json.dumps(results, indent=1, default=str))
    text = table(results)
    (out / f"lesson07_backward_{gpu_slug()}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
