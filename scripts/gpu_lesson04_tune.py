"""Lesson 04 investigation on the lent GPU (one call, about 2 minutes): where does paged decode lose time
against SDPA's default (cuDNN) kernel? Companion of ``yaie bench lesson04``; results go to
``$OUT/lesson04_tune_<gpu>.json`` and are summarised in bench/README.md.

Sections (``TUNE_SECTIONS``, comma separated; default ``host,contiguous,placement,sweep,large``):

* ``host``: microseconds of host time per call on a tiny shape (the GPU waits on the host there): the
  input checks, the launcher with and without the fused merge, a 3-argument Triton kernel, SDPA;
* ``host_ab``: host time per ``paged_attention_forward(validate=False)`` call (what the engine calls), the
  kernel now beside the one in ``bench/results/lesson04_baseline_paged_attention.py``, 1 and 2 splits,
  interleaved over 3 rounds, with the GPU time of the same call (CUDA-graph replay) beside it;
* ``contiguous``: SDPA's own contiguous ``[batch, kv_heads, ctx, head_dim]`` tensors handed to the kernel as
  a cache of one block per sequence, beside the paged (shuffled) cache and SDPA: is the gap the paging
  or the kernel? (Run 4, commit b752918, also tried a kernel fetching K/V tiles with the TMA engine: no
  gain on contiguous data, slower on 16-token blocks; it is in that commit's version of this script.)
* ``placement``: the paged cache with its blocks shuffled / in order / round-robin, block sizes 16-128,
  token-major (nhd) and head-major (hnd) blocks;
* ``sweep``: launch settings (TILE_N, num_warps, num_stages) x split counts (x nhd/hnd with ``TUNE_HND=1``),
  GPU time from CUDA graph replays (``TUNE_CONFIGS=128x4x2,64x4x3``: other settings, and SDPA's time beside);
* ``large``: a cache of more than 2**31 elements (64-bit offsets), checked against float64;
* ``balance``: does the last, partly empty wave cost? Batch 32 gives 256 programs for 264 slots (2 per
  multiprocessor of the H200), batch 33 fills them (264 (sequence, KV head) pairs at GQA 4:1; 132 pairs x 2
  splits at 8:1): GB/s of the kernel beside SDPA's default at both, blocks shuffled and in order;
* ``probe``: where the last microseconds go: deep pipelines without splits, K/V loads marked
  ``evict_first``, and a timeline of every program (``globaltimer`` at its start and end, written by a
  copy of the kernel made at run time) beside the kernel's time (``TUNE_DEEP=0`` skips the pipelines);
* ``tail``: longest pieces first. Programs start in grid order; the main splits come first and the
  context's last tiles follow as small extra splits that fill multiprocessors as they free up, so the
  programs that run slow do not set the kernel's end alone (a copy of the kernel made at run time), with
  3 and 4 pipeline stages (``TUNE_TAIL_STAGES``) and a timeline of each; ``TUNE_TAIL_SHAPES=N``: the first N
  shapes only;
* ``kernels``: name, grid, block, registers and shared memory of every GPU kernel SDPA's default and our
  kernel run (torch profiler);
* ``queue``: guided self-scheduling (``scripts/paged_decode_queue.py``): a persistent grid taking work items
  from a counter, the tail of each split in units of halving size, at tail fractions ``TUNE_QUEUE_FRACTIONS``
  (default ``0,0.0625,0.125,0.25``), with a timeline of the best setting; ``TUNE_QUEUE_SHAPES=N``: the first N;
* ``prefetch``: K/V rows prefetched into L2 some tiles ahead (``cp.async.bulk.prefetch.L2`` through a
  side-effecting inline asm statement; ``TUNE_PF`` depths), with the blocks in order and on contiguous K/V;
* ``ahead``: the block ids read two tiles ahead, and the L2 prefetch as a pure statement folded into the sums;
* ``asm``: PTX (and SASS where Triton gives it) of the kernel as launched, written to ``$OUT``;
* ``l2hint``: the kernel's own PTX with ``.L2::128B`` / ``.L2::256B`` on every ``cp.async``, compiled through
  Triton's ``ir_override`` launch option;
* ``lanes``: every warp of a program on its own slice of keys (``scripts/paged_decode_lanes.py``: batched
  ``tl.dot``, one online softmax per warp, merged after the loop), settings ``TUNE_LANES``;
* ``rows``: the query rows padded to 64 instead of 16, so that Triton builds both products as Hopper
  warpgroup MMAs (wgmma), over launch settings ``TUNE_ROWS``;
* ``regprefetch``: the next tile's K and V loaded into registers while this tile is multiplied (no
  pipeliner: num_stages=1), settings ``TUNE_REGPF``;
* ``unmasked``: whole tiles without masks (no predicates on the copies, no -inf on the scores), the last
  partial tile masked once, on the paged cache and on SDPA's contiguous tensors, settings ``TUNE_UNMASKED``;
* ``ceiling``: what the loads alone cost: the loop without the online softmax (both products kept) and with
  nothing but an elementwise max of the K/V tiles, paged and contiguous;
* ``readpeak``: the same K/V bytes read by a plain streaming kernel (several settings) and by PyTorch's ``amax``;
* ``gluon``: a warp-specialised kernel in Gluon (``scripts/paged_decode_gluon.py``: a one-warp TMA or cp.async
  loader and four compute warps around a ring of shared-memory buffers), checked against float64, then timed;
* ``gluonplace``: the Gluon TMA kernel on the same numbers in shuffled / in-order / head-major 16-token blocks,
  64-token blocks and SDPA's contiguous tensors;
* ``clocks``: SM clock, memory clock, power and throttle reasons (``nvidia-smi``, every 20 ms) while each of
  SDPA, the solution, the no-softmax probe and the Gluon kernel runs back to back for a few seconds.
* ``locality``: the benchmark's numbers in 16-token blocks in order, shuffled within each 2 MB of cache, in
  shuffled runs of 4 blocks, and fully shuffled: at which scale does the placement cost?

    OUT=out python scripts/gpu_lesson04_tune.py
    TUNE_SECTIONS=balance,probe,tail OUT=out python scripts/gpu_lesson04_tune.py    # session 4's questions
    TUNE_SECTIONS=kernels,queue OUT=out python scripts/gpu_lesson04_tune.py         # session 5's (and
    TUNE_SECTIONS=prefetch / ahead / asm / l2hint, one call each)
    TUNE_SECTIONS=lanes OUT=out python scripts/gpu_lesson04_tune.py                  # session 6's (and rows)
    TUNE_SECTIONS=ceiling,readpeak OUT=out python scripts/gpu_lesson04_tune.py       # session 7's (and gluon)
    TUNE_SECTIONS=locality OUT=out python scripts/gpu_lesson04_tune.py               # session 8's
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
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solutions.kernels import paged_attention as pa  # noqa: E402
from yaie.bench.harness import bench_ms, gpu_slug, measure_peaks  # noqa: E402
from yaie.bench.lesson04 import graphed, kv_bytes, make_inputs, shape_label  # noqa: E402

SHAPES = [(32, 4, 4096), (32, 8, 4096), (32, 4, 1024), (32, 8, 1024), (32, 4, 16384), (32, 8, 32768),
          (64, 4, 8192), (128, 8, 4096), (128, 4, 1024)]
CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (32, 2, 4), (32, 2, 6), (128, 4, 3),
           (128, 8, 3)]
SPLITS = (1, 2, 3, 4, 8)
# The 14 shapes of ``yaie bench lesson04`` in the order the later sections time them (``TUNE_*_SHAPES=N``: the first N).
BENCH_SHAPES = ((32, 8, 4096), (32, 4, 4096), (32, 8, 32768), (32, 4, 16384), (32, 4, 1024), (32, 8, 1024),
                (128, 8, 4096), (128, 4, 1024), (64, 4, 8192), (128, 8, 1024), (32, 8, 16384), (32, 4, 32768),
                (64, 8, 8192), (128, 4, 4096))
SCALE = 128 ** -0.5


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def per_call_us(fn, calls=400):
    """Wall microseconds per call in a loop without syncs: the host cost when the GPU work is tiny."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls * 1e6


def graph_ms(fn, warmup=5, rep=25):
    """GPU time of ``fn`` alone: median of CUDA-graph replays (no host Python per call)."""
    return bench_ms(graphed(fn), warmup, rep)


def sdpa_fn(q, k, v):
    q4 = q.unsqueeze(2)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)


def recorder(rows, label, moved, ref, pct):
    """``record(name, fn, **extra)``: check ``fn`` against ``ref``, time it, keep a row and print it."""
    def record(name, fn, **extra):
        err = rel_err(fn(), ref)
        ms = graph_ms(fn)
        rows.append({"shape": label, "impl": name, "ms": ms, "pct_copy": pct(moved, ms), "rel_err_vs_sdpa": err, **extra})
        print(f"  {label} {name}: {ms * 1e3:.1f}us ({pct(moved, ms):.1f}%) err {err:.1e}", flush=True)
    return record


def baselines(rows, pct, gen, batch, kv, ctx):
    """Inputs of one shape, its heuristic split count and a ``record`` for it, after recording SDPA's default
    and the kernel's default (the two rows every experiment is read against)."""
    label = shape_label(batch, kv, ctx)
    inputs = make_inputs(batch, kv, ctx, gen)
    q, k, v, k_cache, v_cache, tables, lens = inputs
    splits = pa.choose_num_splits(batch, kv, ctx)
    record = recorder(rows, label, kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2, sdpa_fn(q, k, v)(), pct)
    record("torch SDPA (default)", sdpa_fn(q, k, v))
    record(f"yaie default (splits {splits})", lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx,
                                                                        SCALE, splits))
    return label, inputs, splits, record


def blocks_in_order(k_cache, v_cache, tables):
    """The same sequences in a cache whose blocks lie in order (sequence 0's blocks first, ...)."""
    in_order = torch.arange(tables.numel(), device="cuda", dtype=torch.int32).view_as(tables)
    k_ordered, v_ordered = torch.empty_like(k_cache), torch.empty_like(v_cache)
    k_ordered[in_order.long().flatten()] = k_cache[tables.long().flatten()]
    v_ordered[in_order.long().flatten()] = v_cache[tables.long().flatten()]
    return k_ordered, v_ordered, in_order


def section_host(report, gen):
    q, k, v, k_cache, v_cache, tables, lens = make_inputs(1, 1, 64, gen)

    @triton.jit
    def _tiny(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)

    x, y = torch.zeros(16, device="cuda"), torch.zeros(16, device="cuda")
    calls = {
        "check_paged_inputs": lambda: pa.check_paged_inputs(q, k_cache, v_cache, tables, lens, 64),
        "launcher, 1 split": lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, 64, SCALE, 1),
        "launcher, 2 splits, fused merge": lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, 64, SCALE, 2),
        "launcher, 2 splits, merge as a 2nd kernel": lambda: pa._launch_decode(
            q, k_cache, v_cache, tables, lens, 64, SCALE, 2, fuse_merge=False),
        "paged_attention_forward (validate=False)": lambda: pa.paged_attention_forward(
            q, k_cache, v_cache, tables, lens, 64, validate=False),
        "a 3-argument Triton kernel": lambda: _tiny[(1,)](x, y, 16, BLOCK=16),
        "torch SDPA (default)": sdpa_fn(q, k, v),
    }
    report["host_us"] = {name: per_call_us(fn) for name, fn in calls.items()}
    for name, us in report["host_us"].items():
        print(f"host {name}: {us:.1f} us/call", flush=True)


def section_host_ab(report, gen):
    from yaie.bench.lesson04 import load_baseline

    before = load_baseline()
    if before is None:
        print("host_ab: no baseline kernel file, skipped", flush=True)
        return
    q, _, _, k_cache, v_cache, tables, lens = make_inputs(1, 1, 64, gen)
    rows = report.setdefault("host_ab", [])
    for round_ in range(3):
        for name, module in (("before", before), ("now", pa)):
            for splits in (1, 2):
                def call(m=module, s=splits):
                    return m.paged_attention_forward(q, k_cache, v_cache, tables, lens, 64, num_splits=s,
                                                     validate=False)
                host, gpu = per_call_us(call), graph_ms(call) * 1e3
                rows.append({"round": round_, "kernel": name, "splits": splits, "host_us": host, "gpu_us": gpu})
                print(f"host_ab round {round_} {name} splits {splits}: host {host:.1f} us, GPU {gpu:.1f} us",
                      flush=True)


def section_contiguous(report, gen, pct):
    rows = report.setdefault("contiguous", [])
    for batch, kv, ctx in SHAPES:
        label = shape_label(batch, kv, ctx)
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
        moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
        sdpa = sdpa_fn(q, k, v)
        ref = sdpa()
        whole_k, whole_v = k.transpose(1, 2), v.transpose(1, 2)      # [batch, ctx, kv, d] views: one block each
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        splits = pa.choose_num_splits(batch, kv, ctx)
        impls = {
            "torch SDPA (default)": sdpa,
            "yaie, paged cache (shuffled, block 16)": lambda: pa._launch_decode(
                q, k_cache, v_cache, tables, lens, ctx, SCALE, splits),
            "yaie, paged cache, merge as a 2nd kernel": lambda: pa._launch_decode(
                q, k_cache, v_cache, tables, lens, ctx, SCALE, splits, fuse_merge=False),
            "yaie, SDPA's contiguous K/V": lambda: pa._launch_decode(
                q, whole_k, whole_v, one_block, lens, ctx, SCALE, splits),
        }
        for name, fn in impls.items():
            try:
                err = rel_err(fn(), ref)
                ms = graph_ms(fn)
            except Exception as exc:  # noqa: BLE001 - an experiment that does not compile is reported
                print(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append({"shape": label, "impl": name, "ms": ms, "pct_copy": pct(moved, ms), "rel_err_vs_sdpa": err})
            print(f"  {label} {name}: {ms * 1e3:.1f}us ({pct(moved, ms):.1f}%) err {err:.1e}", flush=True)
        del q, k, v, k_cache, v_cache, tables, lens, whole_k, whole_v
        torch.cuda.empty_cache()


def section_placement(report, gen, pct):
    rows = report.setdefault("placement", [])
    for batch, kv, ctx in ((32, 4, 4096), (32, 8, 4096), (32, 8, 32768), (128, 8, 4096)):
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        splits = pa.choose_num_splits(batch, kv, ctx)
        for bs in (16, 64, 128):
            per_seq, nb = ctx // bs, batch * (ctx // bs)
            k_nhd = torch.randn(nb, bs, kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            v_nhd = torch.randn_like(k_nhd)
            layouts = {"nhd": (k_nhd, v_nhd)}
            if bs == 16:   # the same numbers stored head-major, passed as a transposed view
                layouts["hnd"] = (k_nhd.transpose(1, 2).contiguous().transpose(1, 2),
                                  v_nhd.transpose(1, 2).contiguous().transpose(1, 2))
            orders = {"shuffled": torch.randperm(nb, device="cuda", generator=gen).view(batch, per_seq),
                      "in order": torch.arange(nb, device="cuda").view(batch, per_seq),
                      "round-robin": torch.arange(nb, device="cuda").view(per_seq, batch).t()}
            for layout, (kc, vc) in layouts.items():
                for order, table in orders.items():
                    table = table.contiguous().to(torch.int32)
                    ms = graph_ms(lambda kc=kc, vc=vc, t=table: pa._launch_decode(q, kc, vc, t, lens, ctx, SCALE, splits))
                    rows.append({"shape": f"b{batch} h32/{kv} ctx{ctx} d128", "block_size": bs, "layout": layout,
                                 "order": order, "ms": ms, "pct_copy": pct(moved, ms)})
                    print(f"  b{batch} h32/{kv} ctx{ctx} bs{bs} {layout} {order}: {ms * 1e3:.1f}us "
                          f"({pct(moved, ms):.1f}%)", flush=True)
            del k_nhd, v_nhd, layouts
            torch.cuda.empty_cache()


def locality_tables(batch, per_seq, group, gen):
    """Block tables (int32 ``[batch, per_seq]``) that keep each sequence's blocks in order but shuffle them at
    one scale: ``"in order"``; ``"shuffled within 2 MB"`` (each aligned group of ``group`` blocks, 2 MB of cache,
    permuted inside itself: every block stays on its 2 MB page, but its neighbours are random);
    ``"runs of 4, shuffled"`` (runs of 4 consecutive blocks placed at random: contiguous 64-token pieces on
    random pages); ``"shuffled"`` (every block anywhere: the benchmark's cache)."""
    nb = batch * per_seq
    in_order = torch.arange(nb, device="cuda")
    within = (in_order.view(-1, group)[:, torch.randperm(group, device="cuda", generator=gen)]).flatten()
    runs = (torch.randperm(nb // 4, device="cuda", generator=gen)[:, None] * 4
            + torch.arange(4, device="cuda")[None, :]).flatten()
    full = torch.randperm(nb, device="cuda", generator=gen)
    return {name: t.view(batch, per_seq).contiguous().to(torch.int32) for name, t in
            (("in order", in_order), ("shuffled within 2 MB", within), ("runs of 4, shuffled", runs),
             ("shuffled", full))}


def section_locality(report, gen, pct):
    """Session 8: at which scale does block placement cost? The same numbers in 16-token blocks placed four ways
    (``locality_tables``), beside SDPA's default on the contiguous tensors and the kernel on those tensors.
    If the 2 MB-local shuffle is as fast as in order, the cost is page-level (address translation); if it is
    as slow as the full shuffle, it is the order of the bytes within a page (DRAM rows)."""
    rows = report.setdefault("locality", [])
    for batch, kv, ctx in ((32, 8, 4096), (32, 4, 4096), (32, 8, 32768), (128, 8, 4096), (64, 4, 8192)):
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        record("yaie, SDPA's contiguous K/V", lambda: pa._launch_decode(q, k.transpose(1, 2), v.transpose(1, 2),
                                                                        one_block, lens, ctx, SCALE, splits))
        block = k_cache.shape[1]
        per_seq = ctx // block
        block_bytes = block * kv * 128 * 2
        group = (2 << 20) // block_bytes
        # The cache of the benchmark in sequence order: sequence b's block j at b * per_seq + j.
        k_ordered, v_ordered, _ = blocks_in_order(k_cache, v_cache, tables)
        for name, table in locality_tables(batch, per_seq, group, gen).items():
            kc, vc = torch.empty_like(k_ordered), torch.empty_like(v_ordered)
            kc[table.long().flatten()] = k_ordered
            vc[table.long().flatten()] = v_ordered
            record(f"yaie, blocks {name}", lambda kc=kc, vc=vc, t=table: pa._launch_decode(
                q, kc, vc, t, lens, ctx, SCALE, splits), block_bytes=block_bytes, blocks_per_2MB=group)
            del kc, vc
        del q, k, v, k_cache, v_cache, tables, lens, k_ordered, v_ordered
        torch.cuda.empty_cache()


def section_sweep(report, gen, pct, began, deadline_s):
    rows = report.setdefault("sweep", [])
    for batch, kv, ctx in SHAPES:
        label = shape_label(batch, kv, ctx)
        q, k, v, k_nhd, v_nhd, tables, lens = make_inputs(batch, kv, ctx, gen)
        k_hnd = k_nhd.transpose(1, 2).contiguous().transpose(1, 2)
        v_hnd = v_nhd.transpose(1, 2).contiguous().transpose(1, 2)
        moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
        best = {}
        layouts = (("nhd", (k_nhd, v_nhd)), ("hnd", (k_hnd, v_hnd)))[:2 if os.environ.get("TUNE_HND") else 1]
        configs = [tuple(int(x) for x in c.split("x")) for c in os.environ["TUNE_CONFIGS"].split(",")] \
            if os.environ.get("TUNE_CONFIGS") else CONFIGS
        for layout, (kc, vc) in layouts:
            for tile, warps, stages in configs:
                for splits in SPLITS:
                    if ctx // splits < 256 or time.monotonic() - began > deadline_s:
                        continue
                    config = dict(TILE_N=tile, num_warps=warps, num_stages=stages)
                    ms = graph_ms(lambda c=config, s=splits, kc=kc, vc=vc: pa._launch_decode(
                        q, kc, vc, tables, lens, ctx, SCALE, s, c))
                    entry = {"shape": label, "layout": layout, "tile": tile, "warps": warps, "stages": stages,
                             "splits": splits, "ms": ms, "pct_copy": pct(moved, ms)}
                    rows.append(entry)
                    if layout not in best or ms < best[layout]["ms"]:
                        best[layout] = entry
        sdpa_ms = graph_ms(sdpa_fn(q, k, v)) if os.environ.get("TUNE_CONFIGS") else None
        for layout, e in best.items():
            e["sdpa_ms_same_run"] = sdpa_ms
            print(f"  {label} {layout} best: tile {e['tile']} w{e['warps']} s{e['stages']} splits {e['splits']} "
                  f"{e['ms'] * 1e3:.1f}us ({e['pct_copy']:.1f}%)", flush=True)
        del q, k, v, k_nhd, v_nhd, k_hnd, v_hnd, tables, lens
        torch.cuda.empty_cache()


def section_balance(report, gen, pct):
    rows = report.setdefault("balance", [])
    for kv, ctx, batches in ((8, 4096, (32, 33)), (8, 32768, (32, 33)), (4, 4096, (32, 33)), (4, 16384, (32, 33)),
                             (8, 1024, (32, 33)), (4, 1024, (32, 33))):
        for batch in batches:
            label = shape_label(batch, kv, ctx)
            q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
            moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
            splits = pa.choose_num_splits(batch, kv, ctx)
            k_ordered, v_ordered, in_order = blocks_in_order(k_cache, v_cache, tables)
            ref = sdpa_fn(q, k, v)()
            record = recorder(rows, label, moved, ref, pct)
            programs = batch * kv * splits
            record("torch SDPA (default)", sdpa_fn(q, k, v), programs=programs)
            record("yaie, shuffled blocks", lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE,
                                                                      splits), programs=programs)
            record("yaie, blocks in order", lambda: pa._launch_decode(q, k_ordered, v_ordered, in_order, lens, ctx,
                                                                      SCALE, splits), programs=programs)
            del q, k, v, k_cache, v_cache, tables, lens, k_ordered, v_ordered
            torch.cuda.empty_cache()


def kernel_variant(name, edits):
    """A copy of the solution's kernel module with source ``edits`` ((old, new) pairs), imported from a
    temporary file (Triton reads a kernel's source from its file)."""
    import importlib.util
    import tempfile

    source = Path(pa.__file__).read_text()
    for old, new in edits:
        assert old in source, f"variant {name}: {old!r} not found"
        source = source.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"paged_attention_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"paged_attention_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TIMELINE_EDITS = [
    ("COUNTERS,\n    stride_qb", "COUNTERS, TIMES,\n    stride_qb"),
    ("    split = tl.program_id(2)\n", "    split = tl.program_id(2)\n    t_begin = tl.extra.cuda.globaltimer()\n"),
    ("    else:\n        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)\n",
     "    else:\n        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)\n"
     "    me = (seq * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split\n"
     "    tl.store(TIMES + 3 * me, t_begin)\n"
     "    tl.store(TIMES + 3 * me + 1, tl.extra.cuda.globaltimer())\n"
     "    tl.store(TIMES + 3 * me + 2, tl.extra.cuda.smid().to(tl.int64))\n"),
    ("out, part_out, part_lse, counters,\n", "out, part_out, part_lse, counters, TIMES_BUFFER,\n"),
]


def section_probe(report, gen, pct):
    rows = report.setdefault("probe", [])
    evict = kernel_variant("evict", [("offs_d[None, :], mask=kv_mask, other=0.0)",
                                      "offs_d[None, :], mask=kv_mask, other=0.0, eviction_policy='evict_first')")])
    timeline = kernel_variant("timeline", TIMELINE_EDITS)
    deep = [(64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 4, 6), (64, 8, 4), (64, 8, 5), (128, 8, 4), (32, 4, 8)] \
        if os.environ.get("TUNE_DEEP", "1") == "1" else []
    for batch, kv, ctx in ((32, 4, 1024), (32, 4, 4096), (32, 4, 16384), (32, 8, 4096), (32, 8, 32768)):
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        record("yaie evict_first K/V", lambda: evict._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE,
                                                                     splits))
        if kv == 4:
            for tile, warps, stages in deep:
                config = dict(TILE_N=tile, num_warps=warps, num_stages=stages)
                try:
                    record(f"splits 1, tile {tile} w{warps} s{stages}", lambda c=config: pa._launch_decode(
                        q, k_cache, v_cache, tables, lens, ctx, SCALE, 1, c))
                except Exception as exc:  # noqa: BLE001 - too much shared memory, say
                    print(f"  {label} tile {tile} w{warps} s{stages}: {type(exc).__name__}", flush=True)
        programs = batch * kv * splits
        k_ordered, v_ordered, in_order = blocks_in_order(k_cache, v_cache, tables)
        for placement, (kc, vc, tb) in (("shuffled", (k_cache, v_cache, tables)),
                                        ("in order", (k_ordered, v_ordered, in_order))):
            run = lambda kc=kc, vc=vc, tb=tb: timeline._launch_decode(q, kc, vc, tb, lens, ctx, SCALE,  # noqa: E731
                                                                      splits)
            entry = {"shape": label, "impl": f"timeline, {placement} blocks", "programs": programs,
                     **program_timeline(timeline, run, batch * kv, splits)}
            rows.append(entry)
            print(f"  {label} {entry}", flush=True)
        del k_ordered, v_ordered
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


TAIL_EDITS = [
    ("scale_log2, tokens_per_split, max_context_len,\n    GROUP",
     "scale_log2, tokens_per_split, max_context_len, main_splits, tail_tokens,\n    GROUP"),
    ("    start = split * tokens_per_split\n",
     "    is_main = split < main_splits\n"
     "    start = tl.where(is_main, split * tokens_per_split,\n"
     "                     main_splits * tokens_per_split + (split - main_splits) * tail_tokens)\n"),
    ("    end = tl.minimum(start + tokens_per_split, context_len)",
     "    end = tl.minimum(start + tl.where(is_main, tokens_per_split, tail_tokens), context_len)"),
    ("    per_split = (span + num_splits - 1) // num_splits\n",
     "    main_splits, tail_tiles = TAIL if TAIL else (num_splits, 0)\n"
     "    tail_tokens = tail_tiles * tile_n\n"
     "    main_part = max(tile_n, span - (num_splits - main_splits) * tail_tokens)\n"
     "    per_split = (main_part + main_splits - 1) // main_splits\n"),
    ("        scale * LOG2E, tokens_per_split, max_context_len,\n",
     "        scale * LOG2E, tokens_per_split, max_context_len, main_splits, tail_tokens,\n"),
]


def program_timeline(module, run, pairs, splits):
    """Start and end of every program of one call of ``run`` (a kernel copy with ``TIMELINE_EDITS``), after
    warm-up calls, the L2 cleared before each (as when timed). Per split: quantiles in us from the first
    start, the mean end, the mean end of the programs that had a multiprocessor to themselves (no other
    program of the call ran there), and the most programs of that split that ran on one multiprocessor
    during the call."""
    times = torch.zeros(pairs * splits * 3, device="cuda", dtype=torch.int64)
    module.TIMES_BUFFER = times
    flush = torch.empty(256 * 2**20, device="cuda", dtype=torch.int8)   # allocated once: no TLB churn
    spans = []
    for _ in range(6):
        flush.zero_()
        run()
        torch.cuda.synchronize()
        t = times.view(pairs, splits, 3).cpu()         # [(sequence, KV head), split, (start, end, SM)]
        spans.append(round(float(t[..., 1].max() - t[..., 0].min()) / 1e3, 2))
    t0 = t[..., 0].min()

    def quant(x):
        q = torch.quantile(x.double(), torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))
        return [round(float(v) / 1e3, 2) for v in q]

    result = {"span_us_per_call": spans}
    all_per_sm = torch.bincount(t[..., 2].long().flatten())      # programs of every split on each SM
    for s in range(splits):
        begin, end, sm = t[:, s, 0] - t0, t[:, s, 1] - t0, t[:, s, 2].long()
        per_sm = torch.bincount(sm)
        alone = all_per_sm[sm] == 1              # the only program of the call on its multiprocessor
        result[f"split {s}"] = {
            "start_q0_10_50_90_100": quant(begin), "end_q0_10_50_90_100": quant(end),
            "mean_end": round(float(end.double().mean()) / 1e3, 2),
            "programs_alone_on_sm": int(alone.sum()),
            "mean_end_alone_on_sm": round(float(end[alone].double().mean()) / 1e3, 2) if alone.any() else None,
            "most_on_one_sm": int(per_sm.max()), "sms": int(sm.unique().numel())}
    return result


def section_tail(report, gen, pct):
    rows = report.setdefault("tail", [])
    variant = kernel_variant("tail", TAIL_EDITS)
    timed = kernel_variant("tail_timeline", TAIL_EDITS + TIMELINE_EDITS)
    sms = pa._num_sms(torch.device("cuda"))
    shapes = ((32, 8, 4096), (32, 8, 32768), (32, 4, 4096), (32, 4, 16384), (32, 4, 1024), (64, 4, 8192),
              (128, 8, 4096), (32, 8, 1024))
    # 3 stages (the default): about 70 KB of shared memory, so 3 programs fit on a multiprocessor once the grid
    # is larger than 2 per SM; 4 stages: about 100 KB, at most 2 per SM.
    stage_list = [int(x) for x in os.environ.get("TUNE_TAIL_STAGES", "3,4").split(",")]
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_TAIL_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), main, record = baselines(rows, pct, gen, batch, kv, ctx)
        for stages in stage_list:
            config = {**pa._decode_config(128, 2, batch * kv * main, sms), "num_stages": stages}

            def launch(module, splits, tail_tiles, c=config):
                module.TAIL = (main, tail_tiles) if splits > main else None
                return module._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, splits, c)

            record(f"s{stages}: {main} splits, no tail (control)", lambda: launch(variant, main, 0), stages=stages)
            for tail_tiles, tails in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 4)):
                if tail_tiles * tails * 64 * 4 > ctx:     # the tail at most a quarter of the context
                    continue
                record(f"s{stages}: {main} main splits + {tails} tail splits of {tail_tiles} tiles",
                       lambda t=tail_tiles, n=tails: launch(variant, main + n, t), stages=stages, main_splits=main,
                       tail_splits=tails, tail_tiles=tail_tiles)
            for tails in (0, 2):
                entry = {"shape": label, "impl": f"timeline, s{stages}, {main} main splits + {tails} tails of 1 tile",
                         **program_timeline(timed, lambda n=tails: launch(timed, main + n, 1), batch * kv,
                                            main + tails)}
                rows.append(entry)
                print("  ", entry, flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def section_queue(report, gen, pct):
    """Guided self-scheduling (``scripts/paged_decode_queue.py``): a persistent grid whose programs take
    work items from a counter, the tail of every split cut into units of halving size."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import paged_decode_queue as pq

    rows = report.setdefault("queue", [])
    fractions = [float(x) for x in os.environ.get("TUNE_QUEUE_FRACTIONS", "0,0.0625,0.125,0.25").split(",")]
    shapes = ((32, 8, 4096), (32, 8, 32768), (32, 4, 4096), (32, 4, 16384), (32, 4, 1024), (128, 8, 4096),
              (128, 4, 1024), (32, 8, 1024))
    sms = pa._num_sms(torch.device("cuda"))
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_QUEUE_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        variants = [(splits, f) for f in fractions]
        if splits > 1:   # one split per pair, the rest of the balance left to the queue
            variants += [(1, 0.5)]
        for s, f in variants:
            record(f"queue: {s} splits, tail {f}", lambda s=s, f=f: pq.queue_decode(
                q, k_cache, v_cache, tables, lens, ctx, SCALE, s, f), splits=s, tail_fraction=f)
        best = min((r for r in rows if r["shape"] == label and r["impl"].startswith("queue")), key=lambda r: r["ms"])
        s, f = best["splits"], best["tail_fraction"]
        times = torch.zeros(pa.PROGRAMS_PER_SM * sms * 4, device="cuda", dtype=torch.int64)
        spans = []
        for _ in range(4):
            times.zero_()
            pq.queue_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, s, f, times=times)
            torch.cuda.synchronize()
            t = times.view(-1, 4).cpu()
            t = t[t[:, 1] > 0]
            spans.append(round(float(t[:, 1].max() - t[:, 0].min()) / 1e3, 2))
        ends = (t[:, 1] - t[:, 0].min()).double() / 1e3
        entry = {"shape": label, "impl": f"timeline of the best queue setting ({s} splits, tail {f})",
                 "span_us_per_call": spans, "programs": int(t.shape[0]),
                 "end_q0_10_50_90_100": [round(float(x), 2) for x in torch.quantile(
                     ends, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))],
                 "mean_end": round(float(ends.mean()), 2),
                 "items_min_max": [int(t[:, 3].min()), int(t[:, 3].max())],
                 "most_on_one_sm": int(torch.bincount(t[:, 2].long()).max())}
        rows.append(entry)
        print("  ", entry, flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


# A constexpr PF (how many tiles ahead the L2 prefetches run; 0: none), set from the module's PREFETCH.
PF_EDITS = [
    ("FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,\n):\n    \"\"\"One program",
     "FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, PF: tl.constexpr,\n):\n    \"\"\"One program"),
    ("                PRECISION=\"ieee\" if q.dtype == torch.float32 else \"tf32\", **settings)",
     "                PRECISION=\"ieee\" if q.dtype == torch.float32 else \"tf32\", PF=PREFETCH, **settings)"),
]

PREFETCH_EDITS = PF_EDITS + [
    ("    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)\n",
     "    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)\n"
     "    pf_block = tl.load(table + tl.maximum(tl.minimum(first + PF * TILE_N, end - 1), 0) // BLOCK_SIZE)\n"),
    ("        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)\n",
     "        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)\n"
     "        if PF > 0:\n"
     "            pf_tok = tl.maximum(tl.minimum(offs_n + PF * TILE_N, end - 1), 0)\n"
     "            pf_row = pf_block.to(tl.int64) * stride_kb + (pf_tok % BLOCK_SIZE) * stride_kt + kv_head * stride_kh\n"
     "            _prefetch_l2(K_CACHE + pf_row)\n"
     "            _prefetch_l2(V_CACHE + pf_row)\n"
     "            pf_next = tl.maximum(tl.minimum(offs_n + (PF + 1) * TILE_N, end - 1), 0)\n"
     "            pf_block = tl.load(table + pf_next // BLOCK_SIZE)\n"),
    ("# yaie: solution-only\n@triton.jit\ndef _merge_rows(",
     "@triton.jit\ndef _prefetch_l2(ptrs):\n"
     "    tl.inline_asm_elementwise('cp.async.bulk.prefetch.L2.global [$1], 256;\\n mov.u32 $0, 0;', '=r,l', [ptrs],\n"
     "                              dtype=tl.int32, is_pure=False, pack=1)\n\n\n"
     "# yaie: solution-only\n@triton.jit\ndef _merge_rows("),
]


def section_prefetch(report, gen, pct):
    """K/V rows prefetched into L2 ``PF`` tiles ahead of the pipelined loads (``cp.async.bulk.prefetch.L2``, one
    256-byte row per thread; a copy of the kernel made at run time; head_dim 128 bf16 only)."""
    variant = kernel_variant("prefetch", PREFETCH_EDITS)
    rows = report.setdefault("prefetch", [])
    depths = [int(x) for x in os.environ.get("TUNE_PF", "0,1,2,4").split(",")]
    shapes = ((32, 8, 4096), (32, 8, 32768), (32, 4, 4096), (32, 4, 16384), (32, 4, 1024), (128, 8, 4096),
              (128, 4, 1024), (32, 8, 1024), (64, 4, 8192), (128, 8, 1024))
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_PF_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        k_ordered, v_ordered, in_order = blocks_in_order(k_cache, v_cache, tables)
        whole_k, whole_v = k.transpose(1, 2), v.transpose(1, 2)
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        for pf in depths:
            def launch(pf=pf, s=splits, kc=k_cache, vc=v_cache, tb=tables, config=None):
                variant.PREFETCH = pf
                return variant._launch_decode(q, kc, vc, tb, lens, ctx, SCALE, s, config)
            record(f"prefetch {pf} tiles ahead", launch, prefetch=pf)
            if pf and splits > 1:
                record(f"prefetch {pf}, no split", lambda pf=pf: launch(pf, 1), prefetch=pf, splits=1)
            if pf in (0, max(depths)):
                record(f"prefetch {pf}, blocks in order", lambda pf=pf: launch(pf, kc=k_ordered, vc=v_ordered,
                                                                               tb=in_order), prefetch=pf)
                record(f"prefetch {pf}, SDPA's contiguous K/V", lambda pf=pf: launch(pf, kc=whole_k, vc=whole_v,
                                                                                    tb=one_block), prefetch=pf)
        del q, k, v, k_cache, v_cache, tables, lens, k_ordered, v_ordered, whole_k, whole_v
        torch.cuda.empty_cache()


# Block ids read TWO tiles ahead (a pair of carried id vectors): the id load of a tile is first needed two
# iterations later, so no K/V address waits on a load issued in the iteration before.
LOOKAHEAD2_EDITS = [
    ("    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)\n",
     "    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)\n"
     "    second = first + TILE_N\n"
     "    after_next = tl.load(table + second // BLOCK_SIZE, mask=second < max_context_len, other=0)\n"),
    ("        ahead = offs_n + TILE_N\n        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)\n",
     "        ahead = offs_n + 2 * TILE_N\n        next_block = after_next\n"
     "        after_next = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)\n"),
]

# The L2 prefetch with a PURE asm statement (one 256-byte row of K and of V per thread, on a fresh 1-D
# token vector, so each row is prefetched by few threads) whose zero result is folded into the running sum:
# the pipeliner sees no side effect, so it can still pipeline the loop.
PURE_PREFETCH_EDITS = PF_EDITS + [
    ("    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)\n",
     "    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)\n"
     "    pf_first = tl.maximum(tl.minimum(start + PF * TILE_N + tl.arange(0, TILE_N), end - 1), 0)\n"
     "    pf_block = tl.load(table + pf_first // BLOCK_SIZE)\n"),
    ("        l = l * alpha + tl.sum(p, 1)\n",
     "        pf_tok = tl.maximum(tl.minimum(tile_start + PF * TILE_N + tl.arange(0, TILE_N), end - 1), 0)\n"
     "        pf_row = pf_block.to(tl.int64) * stride_kb + (pf_tok % BLOCK_SIZE) * stride_kt + kv_head * stride_kh\n"
     "        zero = tl.max(_prefetch_l2_pure(K_CACHE + pf_row, V_CACHE + pf_row), 0)\n"
     "        pf_next = tl.maximum(tl.minimum(tile_start + (PF + 1) * TILE_N + tl.arange(0, TILE_N), end - 1), 0)\n"
     "        pf_block = tl.load(table + pf_next // BLOCK_SIZE)\n"
     "        l = l * alpha + tl.sum(p, 1) + zero.to(tl.float32)\n"),
    ("# yaie: solution-only\n@triton.jit\ndef _merge_rows(",
     "@triton.jit\ndef _prefetch_l2_pure(k_ptrs, v_ptrs):\n"
     "    return tl.inline_asm_elementwise('cp.async.bulk.prefetch.L2.global [$1], 256;\\n"
     "cp.async.bulk.prefetch.L2.global [$2], 256;\\n mov.u32 $0, 0;', '=r,l,l', [k_ptrs, v_ptrs],\n"
     "                                     dtype=tl.int32, is_pure=True, pack=1)\n\n\n"
     "# yaie: solution-only\n@triton.jit\ndef _merge_rows("),
]


def section_ahead(report, gen, pct):
    """Block ids two tiles ahead, and a pipelined L2 prefetch, each with the default split and with one program
    per (sequence, KV head) (as cuDNN launches: ``kernels``)."""
    two = kernel_variant("ahead2", LOOKAHEAD2_EDITS)
    pure = kernel_variant("pure_prefetch", PURE_PREFETCH_EDITS)
    rows = report.setdefault("ahead", [])
    shapes = ((32, 8, 4096), (32, 4, 4096), (32, 8, 32768), (32, 4, 16384), (32, 4, 1024), (128, 8, 4096),
              (128, 4, 1024), (32, 8, 1024))
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_AHEAD_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        for s in sorted({splits, 1}, reverse=True):
            if s != splits:
                record(f"yaie, {s} split", lambda s=s: pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE,
                                                                         s), splits=s)
            record(f"ids 2 tiles ahead, {s} split(s)", lambda s=s: two._launch_decode(
                q, k_cache, v_cache, tables, lens, ctx, SCALE, s), splits=s)
            for pf in (2, 4):
                def launch(pf=pf, s=s):
                    pure.PREFETCH = pf
                    return pure._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, s)
                record(f"pure prefetch {pf} tiles ahead, {s} split(s)", launch, splits=s, prefetch=pf)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def section_asm(report, gen, out_dir):
    """PTX and SASS of the kernel as launched at b32 h32/8 ctx4k (3 stages, 1 split) and b32 h32/4 ctx4k (2
    splits), written to ``out_dir``: where the pipeline's waits and copies sit in the loop."""
    for batch, kv, ctx in ((32, 8, 4096), (32, 4, 4096)):
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
        splits = pa.choose_num_splits(batch, kv, ctx)
        pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, splits)
        torch.cuda.synchronize()
        del q, k, v, k_cache, v_cache, tables, lens
    cache = pa._paged_decode_kernel.device_caches[torch.cuda.current_device()][0]
    summary = []
    for i, compiled in enumerate(cache.values()):
        for kind in ("ptx", "sass"):
            text = compiled.asm.get(kind)
            if text:
                (out_dir / f"decode_{i}.{kind}").write_text(text if isinstance(text, str) else text.decode())
        summary.append({"index": i, "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
                        "num_stages": compiled.metadata.num_stages, "n_regs": getattr(compiled, "n_regs", None),
                        "n_spills": getattr(compiled, "n_spills", None)})
    report["asm"] = summary
    print("asm:", summary, flush=True)


class _CaptureLaunch:
    """Stands in for a Triton kernel and keeps the compiled kernel of its last launch (``.last``)."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.kernel[grid](*args, **kwargs)
            return self.last
        return launch


def section_l2hint(report, gen, pct, out_dir):
    """The kernel's own PTX with an L2 prefetch size on every ``cp.async`` (``.L2::128B`` / ``.L2::256B``: the
    hint CUTLASS-style kernels give, which Triton does not emit), compiled through Triton's ``ir_override``
    option, beside the kernel as Triton builds it and SDPA's default."""
    import tempfile

    rows = report.setdefault("l2hint", [])
    capture = _CaptureLaunch(pa._paged_decode_kernel)
    pa._paged_decode_kernel = capture
    work = Path(tempfile.mkdtemp())
    shapes = BENCH_SHAPES
    try:
        for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_HINT_SHAPES", len(shapes)))]:
            label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv,
                                                                                        ctx)
            ptx = capture.last.asm["ptx"]
            k_ordered, v_ordered, in_order = blocks_in_order(k_cache, v_cache, tables)
            for hint in ("L2::128B", "L2::256B"):
                path = work / f"{label.replace(' ', '_').replace('/', '_')}_{hint[4:]}.ptx"
                hinted = ptx.replace("cp.async.cg.shared.global [", f"cp.async.cg.shared.global.{hint} [")
                path.write_text(hinted)
                config = {**pa._decode_config(128, 2, batch * kv * splits, pa._num_sms(q.device)),
                          "ir_override": str(path)}
                run = lambda c=config, kc=k_cache, vc=v_cache, tb=tables: pa._launch_decode(  # noqa: E731
                    q, kc, vc, tb, lens, ctx, SCALE, splits, c)
                run()
                got = capture.last.asm["ptx"].count(f".{hint} [")
                record(f"yaie + .{hint} on cp.async", run, hinted_copies=got)
                if hint == "L2::256B" and batch == 32:
                    record(f"yaie + .{hint}, blocks in order", lambda c=config: pa._launch_decode(
                        q, k_ordered, v_ordered, in_order, lens, ctx, SCALE, splits, c))
            if batch == 32:
                record("yaie, blocks in order", lambda: pa._launch_decode(q, k_ordered, v_ordered, in_order, lens,
                                                                           ctx, SCALE, splits))
            del q, k, v, k_cache, v_cache, tables, lens, k_ordered, v_ordered
            torch.cuda.empty_cache()
    finally:
        pa._paged_decode_kernel = capture.kernel


LANE_CONFIGS = ((4, 16, 3, 4), (4, 16, 4, 4), (4, 32, 2, 4), (4, 32, 3, 4), (8, 16, 3, 8), (8, 16, 2, 8))


def section_lanes(report, gen, pct):
    """Session 6: the decode loop with every warp on its own keys (``scripts/paged_decode_lanes.py``: batched
    ``tl.dot`` over ``LANES`` slices of the tile, one online softmax per warp, merged after the loop) beside
    the solution kernel and SDPA's default, at the heuristic's split count. ``TUNE_LANES`` picks settings
    (``lanes x lane_n x stages x warps``, comma separated)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import paged_decode_lanes as pl

    configs = [tuple(int(x) for x in c.split("x")) for c in os.environ["TUNE_LANES"].split(",")] \
        if os.environ.get("TUNE_LANES") else LANE_CONFIGS
    rows = report.setdefault("lanes", [])
    shapes = BENCH_SHAPES
    compiled = {}
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_LANES_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        for lanes, lane_n, stages, warps in configs:
            def run(lanes=lanes, lane_n=lane_n, stages=stages, warps=warps, s=splits):
                return pl.lanes_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, s, lanes, lane_n, stages, warps)
            try:
                record(f"lanes {lanes}x{lane_n} s{stages} w{warps}", run, splits=splits)
            except Exception as err:  # noqa: BLE001 - a setting that does not compile is a result too
                rows.append({"shape": label, "impl": f"lanes {lanes}x{lane_n} s{stages} w{warps}",
                             "error": f"{type(err).__name__}: {str(err)[:200]}"})
                print("  failed:", rows[-1], flush=True)
                continue
            kernel = pl.LAST["kernel"]
            key = f"{lanes}x{lane_n} s{stages} w{warps} splits {splits}"
            if key not in compiled:
                ptx = kernel.asm["ptx"]
                loop = ptx[ptx.find("cp.async.wait_group"):]
                compiled[key] = {"shared": kernel.metadata.shared, "n_regs": getattr(kernel, "n_regs", None),
                                 "n_spills": getattr(kernel, "n_spills", None),
                                 "cp_async": ptx.count("cp.async.cg"), "bar_sync": ptx.count("bar.sync"),
                                 "bar_sync_after_first_wait": loop.count("bar.sync"),
                                 "mma": ptx.count("mma.sync"), "shfl": ptx.count("shfl.sync")}
                print("  compiled", key, compiled[key], flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()
    report["lanes_compiled"] = compiled


# The query rows padded to ROWS_PAD (module global of the copy) instead of 16: from 64 rows on, Triton builds both
# products as Hopper warpgroup MMAs (wgmma: K and V read straight from shared memory, p fed from registers,
# row reductions inside each warp), at the price of computing on 64 rows of which GROUP are real.
ROWS_EDITS = [
    ("PROGRAMS_PER_SM = 2 ", "ROWS_PAD = 64\nPROGRAMS_PER_SM = 2 "),
    ("GROUP_PAD=max(16, triton.next_power_of_2(group))", "GROUP_PAD=max(ROWS_PAD, triton.next_power_of_2(group))"),
]
ROWS_CONFIGS = ((64, 4, 3), (64, 4, 4), (64, 4, 2), (128, 4, 2), (128, 4, 3), (32, 4, 4))


def section_rows(report, gen, pct):
    """Session 6: the solution kernel with its query rows padded to 64 (``ROWS_EDITS``: wgmma for both products)
    beside the kernel as it is and SDPA's default, at the heuristic's split count, over launch settings
    ``TUNE_ROWS`` (``tile x warps x stages``, comma separated) and row paddings ``TUNE_ROWS_PAD`` (default 64)."""
    wide = kernel_variant("rows", ROWS_EDITS)
    configs = [tuple(int(x) for x in c.split("x")) for c in os.environ["TUNE_ROWS"].split(",")] \
        if os.environ.get("TUNE_ROWS") else ROWS_CONFIGS
    pads = [int(x) for x in os.environ.get("TUNE_ROWS_PAD", "64").split(",")]
    capture = _CaptureLaunch(wide._paged_decode_kernel)
    wide._paged_decode_kernel = capture
    rows = report.setdefault("rows", [])
    shapes = BENCH_SHAPES
    compiled = report.setdefault("rows_compiled", {})
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_ROWS_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        for pad in pads:
            for tile, warps, stages in configs:
                config = dict(TILE_N=tile, num_warps=warps, num_stages=stages)

                def run(config=config, pad=pad):
                    wide.ROWS_PAD = pad
                    return wide._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, splits, config)
                name = f"rows {pad}, tile {tile} w{warps} s{stages}"
                try:
                    record(name, run, splits=splits, rows_pad=pad, tile=tile, warps=warps, stages=stages)
                except Exception as err:  # noqa: BLE001 - a setting that does not compile is a result too
                    rows.append({"shape": label, "impl": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
                    print("  failed:", rows[-1], flush=True)
                    continue
                key = f"{name} splits {splits}"
                if key not in compiled:
                    run()
                    ptx = capture.last.asm["ptx"]
                    compiled[key] = {"shared": capture.last.metadata.shared, "n_regs": getattr(capture.last, "n_regs", None),
                                     "n_spills": getattr(capture.last, "n_spills", None),
                                     "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
                                     "cp_async": ptx.count("cp.async.cg"), "bar_sync": ptx.count("bar.sync"),
                                     "shfl": ptx.count("shfl.sync")}
                    print("  compiled", key, compiled[key], flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


# One online-softmax step over a tile (the solution's loop body), as a helper the loop variants below share.
TILE_UPDATE = """@triton.jit
def _tile_update(q, k, v, n_ok, m, l, acc, scale_log2, MASK_KEYS: tl.constexpr, FP32_DOT: tl.constexpr,
                 PRECISION: tl.constexpr):
    if FP32_DOT:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    scores = scores * scale_log2
    if MASK_KEYS:
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


"""
TILE_UPDATE_EDITS = [("# yaie: solution-only\n@triton.jit\ndef _merge_rows(",
                      TILE_UPDATE + "# yaie: solution-only\n@triton.jit\ndef _merge_rows(")]


# The loop with the NEXT tile's K and V loaded into registers before this tile's arithmetic (the pre-cp.async
# way to hide latency; launched with num_stages=1, so Triton's pipeliner stays out): one tile in flight per
# program while the previous one is multiplied, as an FA2-style kernel with single K/V buffers has. (Timed at
# commit a14eff1 with the step written out in the loop; here it calls the same step as a helper.)
REGISTER_PREFETCH_LOOP = """    first = start + tl.arange(0, TILE_N)
    first_ok = first < end
    block = tl.load(table + first // BLOCK_SIZE, mask=first_ok, other=0).to(tl.int64)
    kv_mask = first_ok[:, None] & d_ok[None, :]
    k = tl.load(K_CACHE + block[:, None] * stride_kb + (first % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V_CACHE + block[:, None] * stride_vb + (first % BLOCK_SIZE)[:, None] * stride_vt + kv_head * stride_vh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    second = first + TILE_N
    next_block = tl.load(table + second // BLOCK_SIZE, mask=second < end, other=0)
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        n_ok = offs_n < end
        nxt = offs_n + TILE_N
        nxt_mask = (nxt < end)[:, None] & d_ok[None, :]
        nb = next_block.to(tl.int64)
        k_next = tl.load(K_CACHE + nb[:, None] * stride_kb + (nxt % BLOCK_SIZE)[:, None] * stride_kt
                         + kv_head * stride_kh + offs_d[None, :], mask=nxt_mask, other=0.0)
        v_next = tl.load(V_CACHE + nb[:, None] * stride_vb + (nxt % BLOCK_SIZE)[:, None] * stride_vt
                         + kv_head * stride_vh + offs_d[None, :], mask=nxt_mask, other=0.0)
        after = nxt + TILE_N
        next_block = tl.load(table + after // BLOCK_SIZE, mask=after < end, other=0)
        m, l, acc = _tile_update(q, k, v, n_ok, m, l, acc, scale_log2, True, FP32_DOT, PRECISION)
        k = k_next
        v = v_next
"""


def loop_variant(name, loop, edits=()):
    """A copy of the solution's kernel module whose tile loop (from ``first = ...`` to ``m = m_new``) is ``loop``
    (and further source ``edits``)."""
    source = Path(pa.__file__).read_text()
    begin = source.index("    first = start + tl.arange(0, TILE_N)\n")
    end = source.index("        m = m_new\n", begin) + len("        m = m_new\n")
    return kernel_variant(name, [(source[begin:end], loop), *edits])


# The loop over WHOLE tiles without any mask (no predicate on the K/V copies, no -inf on the scores; the head
# dim is masked only when it is padded), then the context's last, partial tile with the masks, once.
UNMASKED_LOOP = """    first = start + tl.arange(0, TILE_N)
    next_block = tl.load(table + first // BLOCK_SIZE, mask=first < max_context_len, other=0)
    whole_end = start + tl.maximum(end - start, 0) // TILE_N * TILE_N
    for tile_start in range(start, whole_end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        block = next_block.to(tl.int64)
        ahead = offs_n + TILE_N
        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0)
        k_rows = K_CACHE + block[:, None] * stride_kb + (offs_n % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh
        v_rows = V_CACHE + block[:, None] * stride_vb + (offs_n % BLOCK_SIZE)[:, None] * stride_vt + kv_head * stride_vh
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_rows + offs_d[None, :])
            v = tl.load(v_rows + offs_d[None, :])
        else:
            k = tl.load(k_rows + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_rows + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        m, l, acc = _tile_update(q, k, v, offs_n < end, m, l, acc, scale_log2, False, FP32_DOT, PRECISION)
    if whole_end < end:
        offs_n = whole_end + tl.arange(0, TILE_N)
        n_ok = offs_n < end
        block = next_block.to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K_CACHE + block[:, None] * stride_kb + (offs_n % BLOCK_SIZE)[:, None] * stride_kt
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_CACHE + block[:, None] * stride_vb + (offs_n % BLOCK_SIZE)[:, None] * stride_vt
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        m, l, acc = _tile_update(q, k, v, n_ok, m, l, acc, scale_log2, True, FP32_DOT, PRECISION)
"""



def section_unmasked(report, gen, pct):
    """Session 6: whole tiles without masks, the last partial tile masked once (``UNMASKED_LOOP``), with the
    default launch and with ``TUNE_UNMASKED`` settings (``tile x warps x stages``), beside the kernel as it is
    and SDPA's default; on the paged cache and on SDPA's own contiguous tensors."""
    variant = loop_variant("unmasked", UNMASKED_LOOP, TILE_UPDATE_EDITS)
    configs = [tuple(int(x) for x in c.split("x")) for c in os.environ.get("TUNE_UNMASKED", "64x4x4,128x4x2").split(",")]
    rows = report.setdefault("unmasked", [])
    shapes = BENCH_SHAPES
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_UNMASKED_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        record("unmasked whole tiles", lambda: variant._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE,
                                                                      splits), splits=splits)
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        record("yaie on SDPA's contiguous K/V", lambda: pa._launch_decode(q, kt, vt, one_block, lens, ctx, SCALE, splits),
               splits=splits)
        record("unmasked on SDPA's contiguous K/V", lambda: variant._launch_decode(q, kt, vt, one_block, lens, ctx,
                                                                                   SCALE, splits), splits=splits)
        for tile, warps, stages in configs:
            config = dict(TILE_N=tile, num_warps=warps, num_stages=stages)
            record(f"unmasked, tile {tile} w{warps} s{stages}", lambda c=config: variant._launch_decode(
                q, k_cache, v_cache, tables, lens, ctx, SCALE, splits, c), splits=splits)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def section_regprefetch(report, gen, pct):
    """Session 6: the next tile loaded into registers during this tile's arithmetic (``REGISTER_PREFETCH_LOOP``,
    num_stages=1) beside the kernel as it is and SDPA's default, settings ``TUNE_REGPF`` (``tile x warps``)."""
    variant = loop_variant("regprefetch", REGISTER_PREFETCH_LOOP, TILE_UPDATE_EDITS)
    configs = [tuple(int(x) for x in c.split("x")) for c in os.environ.get("TUNE_REGPF", "64x4,64x8,32x4,128x8").split(",")]
    rows = report.setdefault("regprefetch", [])
    shapes = BENCH_SHAPES
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_REGPF_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        for tile, warps in configs:
            config = dict(TILE_N=tile, num_warps=warps, num_stages=1)
            name = f"registers, tile {tile} w{warps}"
            try:
                record(name, lambda c=config: variant._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE,
                                                                     splits, c), splits=splits, tile=tile, warps=warps)
            except Exception as err:  # noqa: BLE001 - a setting that does not compile is a result too
                rows.append({"shape": label, "impl": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
                print("  failed:", rows[-1], flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def _solution_loop_head():
    """The solution's tile loop up to its arithmetic (block-table walk, masks, K/V loads), as text, so that the
    probes below load exactly what the solution loads."""
    source = Path(pa.__file__).read_text()
    begin = source.index("    first = start + tl.arange(0, TILE_N)\n")
    return source[begin:source.index("        if FP32_DOT:", begin)]


# Session 7: what the loads alone cost. Two loops with the solution's block-table walk, masks, tiles and launch
# settings, but less arithmetic: NO_SOFTMAX_LOOP keeps both tensor-core products (so the same cp.async pipeline)
# and drops the online softmax (the scores go straight into P @ V); LOADS_ONLY_LOOP keeps only an elementwise max
# of the K and V tiles (one bf16x2 instruction per two numbers; measured, Triton then streams the tiles with plain
# register loads, as it pipelines through shared memory only loads that feed a tl.dot). Neither computes attention.
NO_SOFTMAX_LOOP = _solution_loop_head() + """        if FP32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
            acc += tl.dot(scores, v.to(tl.float32), input_precision=PRECISION)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            acc += tl.dot(scores.to(v.dtype), v, input_precision=PRECISION)
    l += 1.0
    m = tl.zeros_like(m)
"""
# Masked-off keys load as -inf here (the max must ignore them), and the running max is set up before the loop.
LOADS_ONLY_LOOP = _solution_loop_head().replace("mask=kv_mask, other=0.0)", 'mask=kv_mask, other=float("-inf"))').replace(
    "    for tile_start in range(start, end, TILE_N):\n",
    '    top = tl.full([TILE_N, BLOCK_D], float("-inf"), K_CACHE.dtype.element_ty)\n'
    "    for tile_start in range(start, end, TILE_N):\n") + """        top = tl.maximum(top, tl.maximum(k, v)).to(top.dtype)   # (Triton may compute a bf16 max in fp32)
    acc += tl.max(top.to(tl.float32), 0)[None, :]
    l += 1.0
    m = tl.zeros_like(m)
"""


def section_ceiling(report, gen, pct):
    """Session 7: the solution's loop without the softmax (``NO_SOFTMAX_LOOP``) and without any arithmetic but a max
    (``LOADS_ONLY_LOOP``), on the paged cache and on SDPA's contiguous tensors, beside the kernel and SDPA's default,
    at the heuristic's split count and default launch settings. Only times: these probes do not compute attention
    (``tests/test_lesson04.py`` checks what they do compute)."""
    probes = {"no softmax": loop_variant("nosoftmax", NO_SOFTMAX_LOOP), "loads only": loop_variant("loadsonly",
                                                                                                   LOADS_ONLY_LOOP)}
    rows = report.setdefault("ceiling", [])
    shapes = BENCH_SHAPES
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_CEILING_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        record("yaie on SDPA's contiguous K/V", lambda: pa._launch_decode(q, kt, vt, one_block, lens, ctx, SCALE,
                                                                          splits), splits=splits)
        for name, probe in probes.items():
            for where, (kc, vc, tb) in (("paged", (k_cache, v_cache, tables)), ("contiguous", (kt, vt, one_block))):
                ms = graph_ms(lambda p=probe, kc=kc, vc=vc, tb=tb: p._launch_decode(q, kc, vc, tb, lens, ctx, SCALE,
                                                                                    splits))
                rows.append({"shape": label, "impl": f"{name} ({where})", "ms": ms, "pct_copy": pct(moved, ms),
                             "splits": splits})
                print(f"  {label} {name} ({where}): {ms * 1e3:.1f}us ({pct(moved, ms):.1f}%)", flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


@triton.jit
def _read_max_kernel(X, Y, OUT, n, BLOCK: tl.constexpr):
    """Read ``X[:n]`` and ``Y[:n]`` once, grid-strided in ``BLOCK``-element pieces; store each program's max. The
    least arithmetic a full read needs (a bf16 max per two numbers)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for begin in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        at = begin + offs          # n < 2**31 at every shape timed here
        ok = at < n
        x = tl.load(X + at, mask=ok, other=float("-inf"), eviction_policy="evict_first")
        y = tl.load(Y + at, mask=ok, other=float("-inf"), eviction_policy="evict_first")
        top = tl.maximum(top, tl.maximum(x, y).to(tl.float32))
    tl.store(OUT + pid, tl.max(top, 0))


READ_CONFIGS = ((4096, 4, 2), (4096, 4, 4), (4096, 8, 4), (8192, 8, 2), (8192, 8, 4), (2048, 4, 8), (16384, 8, 2))


def section_readpeak(report, gen, pct):
    """Session 7: how fast can these K/V bytes be read at all? A plain streaming read of SDPA's contiguous K and V
    (``_read_max_kernel``, settings ``READ_CONFIGS``: elements per piece x warps x programs per multiprocessor) and
    PyTorch's ``amax`` of both, beside SDPA's default and the decode kernel, same bytes, same timing."""
    rows = report.setdefault("readpeak", [])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = ((32, 8, 4096), (32, 4, 4096), (32, 8, 32768), (128, 8, 4096), (32, 4, 32768))
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_READ_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
        truth = float(torch.maximum(k.amax(), v.amax()))
        timed = {"torch amax(k), amax(v)": lambda: torch.maximum(k.amax(), v.amax())}
        for block, warps, per_sm in READ_CONFIGS:
            grid = sms * per_sm
            tops = torch.empty(grid, device="cuda", dtype=torch.float32)
            def read(tops=tops, block=block, warps=warps, grid=grid):
                _read_max_kernel[(grid,)](k, v, tops, k.numel(), BLOCK=block, num_warps=warps)
                return tops.max()
            timed[f"triton read, {block} x w{warps} x {per_sm}/SM"] = read
        for name, fn in timed.items():
            assert float(fn()) == truth, name
            ms = graph_ms(fn)
            rows.append({"shape": label, "impl": name, "ms": ms, "pct_copy": pct(moved, ms)})
            print(f"  {label} {name}: {ms * 1e3:.1f}us ({pct(moved, ms):.1f}%)", flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def section_gluon(report, gen, pct):
    """Session 7: the warp-specialised Gluon kernel (``scripts/paged_decode_gluon.py``: a one-warp loader filling a
    ring of shared-memory buffers by TMA or cp.async, four compute warps) checked against float64, then timed
    beside SDPA's default and the solution at the benchmark shapes where the solution uses one split (the probe
    has no split), with ``TUNE_GLUON_STAGES`` ring depths (default 3,2)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import paged_decode_gluon as pg

    checks = pg.check_against_float64()
    report["gluon_check"] = checks
    for row in checks:
        print("  check", row, flush=True)
    good = {r["loader"] for r in checks} - {r["loader"] for r in checks if not (r["finite"] and r["max_abs_err"] < 2e-2)}
    stages_list = [int(x) for x in os.environ.get("TUNE_GLUON_STAGES", "3,2").split(",")]
    rows = report.setdefault("gluon", [])
    shapes = [shape for shape in BENCH_SHAPES if pa.choose_num_splits(*shape) == 1]
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_GLUON_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)
        for loader in pg.LOADERS:
            if loader not in good:
                continue
            descriptors = pg.make_descriptors(k_cache, v_cache)
            for stages in stages_list:
                name = f"gluon {loader} s{stages}"
                try:
                    record(name, lambda l=loader, st=stages, d=descriptors: pg.ws_decode(
                        q, k_cache, v_cache, tables, lens, SCALE, l, st, d))
                except Exception as err:  # noqa: BLE001 - a setting that does not compile is a result too
                    rows.append({"shape": label, "impl": name, "error": f"{type(err).__name__}: {str(err)[:300]}"})
                    print("  failed:", rows[-1], flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def section_gluonplace(report, gen, pct):
    """Session 7: the Gluon TMA kernel (2-stage ring) on the same numbers stored five ways: the benchmark's shuffled
    16-token blocks, the same blocks in order, head-major 16-token blocks, shuffled 64-token blocks, and SDPA's own
    contiguous tensors as one block per sequence (with the solution on those too, and a 3-stage ring), beside
    SDPA's default, at the shapes where the solution uses one split."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import paged_decode_gluon as pg

    rows = report.setdefault("gluonplace", [])
    shapes = [shape for shape in BENCH_SHAPES if pa.choose_num_splits(*shape) == 1]
    for batch, kv, ctx in shapes[:int(os.environ.get("TUNE_GLUON_SHAPES", len(shapes)))]:
        label, (q, k, v, k_cache, v_cache, tables, lens), splits, record = baselines(rows, pct, gen, batch, kv, ctx)

        def gluon(name, kc, vc, table, stages=2):
            descriptors = pg.make_descriptors(kc, vc)
            record(name, lambda: pg.ws_decode(q, kc, vc, table, lens, SCALE, "tma", stages, descriptors))

        gluon("gluon tma s2, shuffled 16-token blocks", k_cache, v_cache, tables)
        k_ordered, v_ordered, in_order = blocks_in_order(k_cache, v_cache, tables)
        gluon("gluon tma s2, 16-token blocks in order", k_ordered, v_ordered, in_order)
        del k_ordered, v_ordered
        k_hnd = k_cache.transpose(1, 2).contiguous().transpose(1, 2)      # head-major storage, the same view
        v_hnd = v_cache.transpose(1, 2).contiguous().transpose(1, 2)
        gluon("gluon tma s2, shuffled head-major 16-token blocks", k_hnd, v_hnd, tables)
        del k_hnd, v_hnd
        blocks64 = batch * ctx // 64
        tables64 = torch.randperm(blocks64, device="cuda", generator=gen).view(batch, ctx // 64).to(torch.int32)
        k64 = torch.empty(blocks64, 64, kv, 128, device="cuda", dtype=k.dtype)
        v64 = torch.empty_like(k64)
        k64[tables64.long().flatten()] = k.permute(0, 2, 1, 3).reshape(blocks64, 64, kv, 128)
        v64[tables64.long().flatten()] = v.permute(0, 2, 1, 3).reshape(blocks64, 64, kv, 128)
        gluon("gluon tma s2, shuffled 64-token blocks", k64, v64, tables64)
        del k64, v64
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        record("yaie on SDPA's contiguous K/V", lambda: pa._launch_decode(q, kt, vt, one_block, lens, ctx, SCALE, 1))
        gluon("gluon tma s2 on SDPA's contiguous K/V", kt, vt, one_block)
        gluon("gluon tma s3 on SDPA's contiguous K/V", kt, vt, one_block, stages=3)
        del q, k, v, k_cache, v_cache, tables, lens, kt, vt
        torch.cuda.empty_cache()


def _sample_gpu(seconds, fn):
    """Run ``fn`` back to back for ``seconds`` while ``nvidia-smi`` samples the SM clock, memory clock and power
    every 20 ms; returns (milliseconds per call from CUDA events, the samples taken while it ran)."""
    import subprocess

    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)                                  # let the sampler start before the load does
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, began = 0, time.monotonic()
    start.record()
    while time.monotonic() - began < seconds:
        for _ in range(50):
            fn()
        calls += 50
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = []
    for line in lines[len(lines) // 4:-2]:           # drop the ramp-up and the last, partly idle samples
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append({"sm_mhz": float(fields[0]), "mem_mhz": float(fields[1]), "watts": float(fields[2]),
                            "celsius": float(fields[3]), "reasons": fields[4]})
        except (ValueError, IndexError):
            continue
    return start.elapsed_time(end) / calls, samples


def section_clocks(report, gen, pct):
    """Session 7: is the gap to cuDNN the clock? Each kernel replayed back to back for ``TUNE_CLOCK_S`` seconds
    (default 3) while ``nvidia-smi`` samples SM clock, memory clock, power and throttle reasons; two rounds,
    interleaved, at b32 h32/8 ctx32k and ctx4k."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import paged_decode_gluon as pg

    seconds = float(os.environ.get("TUNE_CLOCK_S", "3"))
    no_softmax = loop_variant("nosoftmax", NO_SOFTMAX_LOOP)
    rows = report.setdefault("clocks", [])
    for batch, kv, ctx in ((32, 8, 32768), (32, 8, 4096)):
        label = shape_label(batch, kv, ctx)
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
        moved = kv_bytes(batch, kv, ctx) + 2 * q.numel() * 2
        descriptors = pg.make_descriptors(k_cache, v_cache)
        impls = {"torch SDPA (default)": sdpa_fn(q, k, v),
                 "yaie default": lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, 1),
                 "no softmax probe": lambda: no_softmax._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE, 1),
                 "gluon tma s2": lambda: pg.ws_decode(q, k_cache, v_cache, tables, lens, SCALE, "tma", 2, descriptors)}
        replays = {name: graphed(fn) for name, fn in impls.items()}
        for round_ in (1, 2):
            for name, replay in replays.items():
                ms, samples = _sample_gpu(seconds, replay)
                row = {"shape": label, "impl": name, "round": round_, "ms": ms, "pct_copy": pct(moved, ms),
                       "samples": len(samples)}
                for key in ("sm_mhz", "mem_mhz", "watts", "celsius"):
                    values = [x[key] for x in samples]
                    if values:
                        row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
                row["reasons"] = sorted({x["reasons"] for x in samples})
                rows.append(row)
                print(f"  {label} {name} round {round_}: {ms * 1e3:.1f}us, "
                      + ", ".join(f"{key} {row[key]['median']:.0f} ({row[key]['min']:.0f}-{row[key]['max']:.0f})"
                                  for key in ("sm_mhz", "mem_mhz", "watts", "celsius") if key in row)
                      + f", reasons {row['reasons']}", flush=True)
        del q, k, v, k_cache, v_cache, tables, lens, replays
        torch.cuda.empty_cache()


def section_kernels(report, gen):
    """What SDPA's default runs and how our kernel is launched: name, grid, block, registers, shared memory
    and time of every GPU kernel of one call (torch profiler trace)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    rows = report.setdefault("kernels", [])
    for batch, kv, ctx in ((32, 8, 4096), (32, 4, 4096), (32, 8, 32768), (128, 8, 1024)):
        label = shape_label(batch, kv, ctx)
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
        splits = pa.choose_num_splits(batch, kv, ctx)
        for name, fn in (("torch SDPA (default)", sdpa_fn(q, k, v)),
                         ("yaie default", lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx, SCALE,
                                                                    splits))):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            path = Path(tempfile.mkdtemp()) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
            for e in events:
                if e.get("cat") == "kernel":
                    args = e.get("args", {})
                    entry = {"shape": label, "impl": name, "kernel": e.get("name", "")[:160], "us": e.get("dur"),
                             **{key: args.get(key) for key in ("grid", "block", "registers per thread",
                                                               "shared memory", "blocks per SM", "warps per SM",
                                                               "est. achieved occupancy %")}}
                    rows.append(entry)
                    print("  ", entry, flush=True)
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


def section_large(report):
    """A cache past 2**31 elements (sequences use its last blocks), against float64 on the used blocks."""
    num_blocks = 2**31 // (16 * 8 * 128) + 64
    try:
        k_cache = torch.randn(num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(num_blocks - 4 * 64, num_blocks, device="cuda", dtype=torch.int32).view(4, 64)
        lens = torch.tensor([1024, 1000, 17, 512], device="cuda", dtype=torch.int32)
        q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
        errs = {}
        for splits in (1, 4):
            out = pa.paged_attention_forward(q, k_cache, v_cache, tables, lens, 1024, num_splits=splits)
            used = tables.flatten().long()
            small_tables = torch.arange(4 * 64, device="cuda", dtype=torch.int32).view(4, 64)
            ref = pa.paged_attention_reference(q.double(), k_cache[used].double(), v_cache[used].double(),
                                               small_tables, lens)
            errs[f"max_abs_err splits={splits}"] = float((out.double() - ref).abs().max())
        result = {"elements": k_cache.numel(), **errs}
    except Exception as err:  # noqa: BLE001
        result = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
    report["large_cache"] = result
    print("cache past 2**31 elements:", result, flush=True)
    torch.cuda.empty_cache()


def main() -> None:
    began = time.monotonic()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = os.environ.get("TUNE_SECTIONS", "host,contiguous,placement,sweep,large").split(",")
    deadline_s = float(os.environ.get("TUNE_DEADLINE_S", "240"))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("YAIE_GIT_COMMIT"),
              "command": f"TUNE_SECTIONS={','.join(sections)} TUNE_SEED={os.environ.get('TUNE_SEED', '0')} OUT=out python scripts/gpu_lesson04_tune.py",
              "peaks": measure_peaks("cuda"),
              "timing": "GPU time: median of CUDA-graph replays under triton.testing.do_bench (L2 cleared); "
                        "host: wall time per call over 400 calls without syncs"}
    copy = report["peaks"]["copy_GBps"]
    print(f"{report['gpu']} torch {torch.__version__} triton {triton.__version__} copy {copy:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(int(os.environ.get("TUNE_SEED", "0")))

    def pct(moved, ms):
        return 100 * moved / (ms * 1e-3) / 1e9 / copy

    if "host" in sections:
        section_host(report, gen)
    if "host_ab" in sections:
        section_host_ab(report, gen)
    if "contiguous" in sections:
        section_contiguous(report, gen, pct)
    if "placement" in sections:
        section_placement(report, gen, pct)
    if "sweep" in sections:
        section_sweep(report, gen, pct, began, deadline_s)
    if "large" in sections:
        section_large(report)
    if "balance" in sections:
        section_balance(report, gen, pct)
    if "probe" in sections:
        section_probe(report, gen, pct)
    if "tail" in sections:
        section_tail(report, gen, pct)
    if "kernels" in sections:
        section_kernels(report, gen)
    if "queue" in sections:
        section_queue(report, gen, pct)
    if "prefetch" in sections:
        section_prefetch(report, gen, pct)
    if "ahead" in sections:
        section_ahead(report, gen, pct)
    if "asm" in sections:
        section_asm(report, gen, out_dir)
    if "l2hint" in sections:
        section_l2hint(report, gen, pct, out_dir)
    if "lanes" in sections:
        section_lanes(report, gen, pct)
    if "rows" in sections:
        section_rows(report, gen, pct)
    if "regprefetch" in sections:
        section_regprefetch(report, gen, pct)
    if "unmasked" in sections:
        section_unmasked(report, gen, pct)
    if "ceiling" in sections:
        section_ceiling(report, gen, pct)
    if "readpeak" in sections:
        section_readpeak(report, gen, pct)
    if "gluon" in sections:
        section_gluon(report, gen, pct)
    if "gluonplace" in sections:
        section_gluonplace(report, gen, pct)
    if "clocks" in sections:
        section_clocks(report, gen, pct)
    if "locality" in sections:
        section_locality(report, gen, pct)
    path = out_dir / f"lesson04_tune_{gpu_slug()}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} after {time.monotonic() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
