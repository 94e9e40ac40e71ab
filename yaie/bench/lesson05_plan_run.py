"""Lesson 05, part 2 benchmark: plan/run attention on a mixed step, and cascade decode over a shared prefix.

    python -m yaie.bench.lesson05_plan_run --out DIR [--quick] [--solutions]

Shapes: bf16, head_dim 128, block_size 16, 32 query heads over 8 KV heads (GQA 4:1), pages scattered at
random over the cache.

``mixed_step``: ONE engine step of 32 decodes at context 4096 plus 2 prefill chunks of 1024 new tokens over
2048 cached ones (their new tokens' K/V already written to the cache, as an engine does before attention).

* ``yaie plan/run (1 launch)``: :class:`FlashInferPagedAttention` planned once (outside the timing: an
  engine plans once per step for all its layers), ``run`` timed: one launch for the whole step;
* ``lesson 04 decode + prefix prefill (2 launches)``: what an engine without plan/run does: lesson 04's
  ``paged_attention_forward`` for the decodes, then part 1's ``prefix_prefill_attention`` for the prefills
  (or, where that module is missing, lesson 06's varlen kernel over K/V gathered from the cache, gather
  timed, said so in the row's name);
* each of the two baseline launches alone, and plan/run on the decodes alone and the prefills alone;
* ``plan (host)``: the host time of one ``plan`` call (perf_counter, median of 20; not a GPU time), with
  every CSR tensor on the GPU, and as the engine calls it (offsets on the host, page ids on the GPU);
* last, after the cascade rows (``mixed_step variants``): the plan/run kernel under other launch settings
  (``config=...``: wide-tile shape, warps, pipeline stages) and work orders (``order="longest"``: longest
  first; ``"interleave"``: decode and prefill items alternating; the default ``"auto"`` picks one), each
  on the whole step and, for tile settings, on the prefills alone and the decodes alone.

``cascade_decode``: a decode step of 64 requests sharing an 8192-token prefix, each with 256 tokens of its
own (block tables share the prefix's pages):

* ``yaie cascade (2 levels)``: :class:`CascadeAttention`: the prefix's K/V read ONCE for all 64 queries
  (a 256-row x 8192-key product per KV head), the suffixes per request, states merged;
* ``lesson 04 paged decode``: every request reads the whole prefix through its block table;
* ``yaie plan/run, 1 level``: the plan/run kernel without the cascade (prefix read per request);
* ``yaie cascade, merge fused``: the cascade with ``config={"fuse_merge": True}`` (the merge of the two
  levels done by the last program of each row: one launch instead of two).

``bytes_moved`` is the K/V each implementation must read (plus q and out): the cascade reads the prefix
once, the others 64 times; the log prints bytes per step. Each implementation is checked against the
lesson 04 / prefix-prefill results before it is timed (MISMATCH in the name otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from yaie.bench.harness import Row, bench_ms, rel_err
from yaie.switch import module

LESSON = "lesson05"
HEAD_DIM = 128
BLOCK_SIZE = 16
NUM_HEADS = 32
NUM_KV_HEADS = 8


def token_bytes(itemsize: int = 2) -> int:
    """K and V bytes of one token of one layer."""
    return 2 * NUM_KV_HEADS * HEAD_DIM * itemsize


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _offsets(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class PagedBatch:
    """Requests with ``kv_lens`` keys each (the last ``q_lens`` of them new) in a shuffled paged cache, plus the
    block tables of lesson 04 and the CSR arrays of plan/run for the same pages. ``shared`` tokens at the
    start of every request may live in pages shared by all (cascade)."""

    def __init__(self, q_lens, kv_lens, gen, dtype=torch.bfloat16, shared: int = 0):
        device = gen.device
        num_heads, num_kv_heads, head_dim, block_size = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE
        if shared % block_size:
            raise ValueError("the shared prefix must be a whole number of pages")
        self.q_lens, self.kv_lens, self.shared = list(q_lens), list(kv_lens), shared
        self.block_size = block_size
        shared_pages = shared // block_size
        own_pages = [-(-(n - shared) // block_size) for n in kv_lens]
        num_blocks = shared_pages + sum(own_pages)
        order = torch.randperm(num_blocks, generator=gen, device=device).tolist()
        self.prefix_pages = order[:shared_pages]
        self.tables, at = [], shared_pages
        for n in own_pages:
            self.tables.append(self.prefix_pages + order[at: at + n])
            at += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        self.q = torch.randn(sum(q_lens), num_heads, head_dim, device=device, dtype=dtype, generator=gen)
        self.device = device
        width = max(len(t) for t in self.tables)
        self.block_tables = _i32([t + [0] * (width - len(t)) for t in self.tables], device)
        self.context_lens = _i32(kv_lens, device)
        self.sizes = (num_heads, num_kv_heads, head_dim, block_size)

    def csr(self, rows=None):
        """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of the requests ``rows`` (default all)."""
        rows = range(len(self.tables)) if rows is None else rows
        pages = [self.tables[r] for r in rows]
        last = [self.kv_lens[r] - (len(self.tables[r]) - 1) * self.block_size for r in rows]
        return (_i32(_offsets([self.q_lens[r] for r in rows]), self.device), _i32(_offsets(map(len, pages)), self.device),
                _i32([p for t in pages for p in t], self.device), _i32(last, self.device))

    def cascade_levels(self):
        """Two levels: every query against the shared prefix pages, then each request's own pages."""
        shared_pages = len(self.prefix_pages)
        total_q = sum(self.q_lens)
        own = [t[shared_pages:] for t in self.tables]
        last = [n - self.shared - (len(t) - 1) * self.block_size for n, t in zip(self.kv_lens, own)]
        dev = self.device
        return ([_i32([0, total_q], dev), _i32(_offsets(self.q_lens), dev)],
                [_i32([0, shared_pages], dev), _i32(_offsets(map(len, own)), dev)],
                [_i32(self.prefix_pages, dev), _i32([p for t in own for p in t], dev)],
                [_i32([self.block_size], dev), _i32(last, dev)])

    def gather_new(self, rows):
        """The new tokens' K/V of requests ``rows`` from the cache: [tokens, kv_heads, head_dim] each."""
        ks, vs = [], []
        for r in rows:
            n, q = self.kv_lens[r], self.q_lens[r]
            pos = torch.arange(n - q, n, device=self.device)
            table = torch.tensor(self.tables[r], device=self.device)
            ks.append(self.k_cache[table[pos // self.block_size], pos % self.block_size])
            vs.append(self.v_cache[table[pos // self.block_size], pos % self.block_size])
        return torch.cat(ks), torch.cat(vs)


def mixed_shapes(quick: bool):
    """(decodes, decode context, prefills, new tokens, cached tokens)."""
    return [(32, 4096, 2, 1024, 2048)] if quick else [(32, 4096, 2, 1024, 2048), (32, 4096, 2, 512, 512)]


def cascade_shapes(quick: bool):
    """(batch, shared prefix, own tokens)."""
    return [(64, 8192, 256)] if quick else [(64, 8192, 256), (64, 2048, 256), (16, 8192, 256)]


def _timed(rows, kernel, impl, shape, fn, moved, warmup, rep, flops=None):
    try:
        rows.append(Row(LESSON, kernel, impl, shape, "bf16", bench_ms(fn, warmup, rep), bytes_moved=moved, flops=flops))
        print(f"    {kernel} | {impl}: {rows[-1].ms:.4f} ms", flush=True)    # kept in the log if a timeout hits
    except Exception as err:  # noqa: BLE001 - a failing variant is reported, not fatal
        print(f"  {impl}: failed ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})",
              flush=True)


def _timed_graph(rows, kernel, impl, shape, fn, moved, warmup, rep, flops=None):
    """The same call replayed from a CUDA graph: GPU time without the host's Python and launch work."""
    from yaie.bench.harness import graphed

    try:
        replay = graphed(fn)
    except Exception as err:  # noqa: BLE001 - not every call captures; say so and go on
        print(f"  {impl}: capture failed ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})",
              flush=True)
        return
    _timed(rows, kernel, impl, shape, replay, moved, warmup, rep, flops)


def _profile(label, fn):
    """Print the GPU kernels one call runs and their device times (torch profiler), and its host time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    host = _host_ms(fn, 20)
    torch.cuda.synchronize()
    print(f"  profile of {label}: host time of one call {host:.3f} ms; GPU kernels (5 calls):", flush=True)
    for event in sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:6]:
        total = getattr(event, "device_time_total", 0)
        if total > 0:
            print(f"    {event.key[:70]:70s} {event.count:4d} calls, {total / max(event.count, 1):8.1f} us each",
                  flush=True)


def reference_rows(batch: "PagedBatch", requests) -> torch.Tensor:
    """float64 attention of the queries of ``requests`` (causal: the last q_len of each request's keys)."""
    outs = []
    group = NUM_HEADS // NUM_KV_HEADS
    starts = _offsets(batch.q_lens)
    for r in requests:
        n, ql = batch.kv_lens[r], batch.q_lens[r]
        pos = torch.arange(n, device=batch.device)
        table = torch.tensor(batch.tables[r], device=batch.device)
        k = batch.k_cache[table[pos // batch.block_size], pos % batch.block_size].double().repeat_interleave(group, 1)
        v = batch.v_cache[table[pos // batch.block_size], pos % batch.block_size].double().repeat_interleave(group, 1)
        q = batch.q[starts[r]: starts[r] + ql].double()
        s = torch.einsum("ihd,jhd->hij", q, k) * HEAD_DIM ** -0.5
        visible = torch.arange(n, device=batch.device)[None, :] <= torch.arange(n - ql, n, device=batch.device)[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v))
    return torch.cat(outs)


def _host_ms(fn, repeats=20) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def mixed_step(rows, fi, pa, pp, decodes, ctx, prefills, new, cached, gen, warmup, rep, variants, main=True):
    """The mixed step's rows; ``variants`` (configs) add rows of the plan/run kernel under other launch
    settings or work orders; ``main=False`` measures only those (plus the checks)."""
    q_lens = [1] * decodes + [new] * prefills
    kv_lens = [ctx] * decodes + [cached + new] * prefills
    batch = PagedBatch(q_lens, kv_lens, gen)
    shape = f"{decodes} decodes ctx{ctx} + {prefills} prefills {new} new/{cached} cached, h{NUM_HEADS}/{NUM_KV_HEADS} d{HEAD_DIM}"
    dec_rows, pre_rows = list(range(decodes)), list(range(decodes, decodes + prefills))
    kv_read = sum(kv_lens) * token_bytes()
    moved = kv_read + 2 * batch.q.numel() * 2
    flops = 4 * NUM_HEADS * HEAD_DIM * (decodes * ctx + prefills * (new * cached + new * (new + 1) // 2))
    print(f"{shape}: K/V read once {kv_read / 1e6:.1f} MB, {flops / 1e9:.1f} GFLOP", flush=True)

    wrapper = fi.FlashInferPagedAttention()
    plan_args = (*batch.csr(), *batch.sizes)
    wrapper.plan(*plan_args, causal=True)
    plan_ms = _host_ms(lambda: fi.FlashInferPagedAttention().plan(*plan_args, causal=True))
    # The engine's way: offsets and last-page lengths built on the host, the page ids on the GPU.
    host_args = tuple(t.cpu() if i != 2 else t for i, t in enumerate(batch.csr())) + batch.sizes
    plan_host_ms = _host_ms(lambda: fi.FlashInferPagedAttention().plan(*host_args, causal=True))
    out, _ = wrapper.run(batch.q, batch.k_cache, batch.v_cache)

    # Baselines: lesson 04 for the decodes, the prefix-prefill kernel (or lesson 06 + gather) for the prefills.
    q_dec = batch.q[:decodes]
    q_pre = batch.q[decodes:]
    tables_dec = batch.block_tables[:decodes]
    lens_dec = batch.context_lens[:decodes]

    def decode_launch():
        return pa.paged_attention_forward(q_dec, batch.k_cache, batch.v_cache, tables_dec, lens_dec, ctx,
                                          validate=False)

    k_new, v_new = batch.gather_new(pre_rows)
    cu_q = _i32(_offsets([new] * prefills), batch.device)
    if pp is not None:
        prefill_name = "prefix prefill (lesson 05 part 1)"
        tables_pre = batch.block_tables[decodes:]
        ctx_pre = _i32([cached] * prefills, batch.device)

        def prefill_launch():
            return pp.prefix_prefill_attention(q_pre, k_new, v_new, batch.k_cache, batch.v_cache, tables_pre, cu_q,
                                               ctx_pre, new, validate=False)[0]
    else:
        prefill_name = "lesson 06 varlen over gathered K/V (gather timed)"
        fa = module(6)
        cu_k = _i32(_offsets([cached + new] * prefills), batch.device)
        gather_idx = []
        for r in pre_rows:
            pos = torch.arange(cached + new, device=batch.device)
            table = torch.tensor(batch.tables[r], device=batch.device)
            gather_idx.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        gather_idx = torch.cat(gather_idx)

        def prefill_launch():
            k = batch.k_cache.flatten(0, 1)[gather_idx]
            v = batch.v_cache.flatten(0, 1)[gather_idx]
            return fa.flash_attention_varlen_forward(q_pre, k, v, cu_q, cu_k, new, cached + new, causal=True)[0]

    def two_launches():
        decode_launch()
        prefill_launch()

    base = torch.cat([decode_launch(), prefill_launch()])
    err = rel_err(out, base)
    exact = reference_rows(batch, [0, decodes - 1, *pre_rows])     # two decodes and the prefills, float64
    rows_checked = torch.cat([torch.arange(b, b + 1) for b in (0, decodes - 1)]
                             + [torch.arange(decodes + i * new, decodes + (i + 1) * new) for i in range(prefills)])
    ours_err = rel_err(out[rows_checked.to(out.device)], exact)
    base_err = rel_err(base[rows_checked.to(out.device)], exact)
    status = "ok" if ours_err < 1e-2 else "MISMATCH"
    print(f"  relative error vs float64 (2 decodes + the prefills): plan/run {ours_err:.1e} [{status}], "
          f"the two baseline kernels {base_err:.1e}; plan/run vs baseline {err:.1e}; plan (host) {plan_ms:.3f} ms "
          f"({plan_host_ms:.3f} ms with the offsets on the host); {wrapper._plan.work.shape[0]} work items x "
          f"{NUM_KV_HEADS} KV heads, order {_order_of(wrapper)}", flush=True)
    tag = "" if status == "ok" else " (MISMATCH)"
    if not main:
        _mixed_variants(rows, fi, batch, shape, base, plan_args, dec_rows, pre_rows, q_dec, q_pre, moved, flops,
                        variants)
        del batch
        torch.cuda.empty_cache()
        return
    _timed(rows, "mixed_step", "yaie plan/run (1 launch)" + tag, shape,
           lambda: wrapper.run(batch.q, batch.k_cache, batch.v_cache), moved, warmup, rep, flops)
    _timed(rows, "mixed_step", f"lesson 04 decode + {prefill_name} (2 launches)", shape, two_launches, moved,
           warmup, rep, flops)
    _timed_graph(rows, "mixed_step", "yaie plan/run (CUDA graph)" + tag, shape,
                 lambda: wrapper.run(batch.q, batch.k_cache, batch.v_cache), moved, warmup, rep, flops)
    _timed_graph(rows, "mixed_step", "2 launches (CUDA graph)", shape, two_launches, moved, warmup, rep, flops)
    _timed(rows, "mixed_step", "lesson 04 decode alone", shape, decode_launch, None, warmup, rep)
    _timed(rows, "mixed_step", f"{prefill_name} alone", shape, prefill_launch, None, warmup, rep)
    for name, part in (("decodes", dec_rows), ("prefills", pre_rows)):
        sub = fi.FlashInferPagedAttention()
        sub.plan(*batch.csr(part), *batch.sizes, causal=True)
        q_part = q_dec if name == "decodes" else q_pre
        _timed(rows, "mixed_step", f"yaie plan/run, {name} alone", shape,
               lambda sub=sub, q_part=q_part: sub.run(q_part, batch.k_cache, batch.v_cache), None, warmup, rep)
    rows.append(Row(LESSON, "mixed_step", "plan (host time, not GPU)", shape, "bf16", plan_ms))
    rows.append(Row(LESSON, "mixed_step", "plan (host time), offsets on the host, page ids on the GPU", shape,
                    "bf16", plan_host_ms))
    _mixed_variants(rows, fi, batch, shape, base, plan_args, dec_rows, pre_rows, q_dec, q_pre, moved, flops, variants)
    _summary(rows, shape, "mixed_step", "yaie plan/run (1 launch)" + tag, "(2 launches)")
    del batch
    torch.cuda.empty_cache()


def _order_of(wrapper) -> str:
    """The work order the plan chose (the reference solution's plan says which; others: unknown)."""
    return getattr(getattr(wrapper, "_plan", None), "order", "order unknown")


def _variant_label(config: dict) -> str:
    return "yaie plan/run " + (",".join(f"{k}={v}" for k, v in config.items()) or "default")


def _mixed_variants(rows, fi, batch, shape, base, plan_args, dec_rows, pre_rows, q_dec, q_pre, moved, flops,
                    variants):
    """Rows of the plan/run kernel under other settings (``config``): the whole step, and, for settings
    of the tiles (not only of the work order), the prefills alone and the decodes alone."""
    for config in variants:
        label = _variant_label(config)
        variant = fi.FlashInferPagedAttention(config=config)
        try:
            variant.plan(*plan_args, causal=True)
            got, _ = variant.run(batch.q, batch.k_cache, batch.v_cache)
            bad = rel_err(got, base) >= 2e-2
        except Exception as err_:  # noqa: BLE001 - a failing variant is reported, not fatal
            print(f"  {label}: failed ({type(err_).__name__}: {str(err_).splitlines()[0][:160]})", flush=True)
            continue
        tag = " (MISMATCH)" if bad else ""
        _timed(rows, "mixed_step variants", f"{label} ({_order_of(variant)}){tag}", shape,
               lambda variant=variant: variant.run(batch.q, batch.k_cache, batch.v_cache), moved, 10, 40, flops)
        if set(config) <= {"order"} and config:
            continue                                   # the order changes nothing for one kind of item
        for name, part, q_part in (("prefills", pre_rows, q_pre), ("decodes", dec_rows, q_dec)):
            sub = fi.FlashInferPagedAttention(config=config)
            sub.plan(*batch.csr(part), *batch.sizes, causal=True)
            _timed(rows, "mixed_step variants", f"{label}, {name} alone", shape,
                   lambda sub=sub, q_part=q_part: sub.run(q_part, batch.k_cache, batch.v_cache), None, 10, 40)


def cascade_decode(rows, fi, pa, batch_size, prefix, own, gen, warmup, rep, profile=False):
    kv_lens = [prefix + own] * batch_size
    batch = PagedBatch([1] * batch_size, kv_lens, gen, shared=prefix)
    shape = f"b{batch_size} shared prefix {prefix} + {own} own, h{NUM_HEADS}/{NUM_KV_HEADS} d{HEAD_DIM}"
    per_request = batch_size * (prefix + own) * token_bytes()
    cascade_bytes = (prefix + batch_size * own) * token_bytes()
    qo = 2 * batch.q.numel() * 2
    print(f"{shape}: K/V bytes per step: per-request decode {per_request / 1e6:.1f} MB, cascade "
          f"{cascade_bytes / 1e6:.1f} MB ({per_request / cascade_bytes:.1f}x less)", flush=True)
    cascade = fi.CascadeAttention()
    levels = batch.cascade_levels()
    cascade.plan(*levels, *batch.sizes, causal=True)
    plan_ms = _host_ms(lambda: fi.CascadeAttention().plan(*levels, *batch.sizes, causal=True))
    single = fi.FlashInferPagedAttention()
    single.plan(*batch.csr(), *batch.sizes, causal=True)

    def decode():
        return pa.paged_attention_forward(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.context_lens, prefix + own, validate=False)

    base = decode()
    for name, fn in (("cascade", lambda: cascade.run(batch.q, batch.k_cache, batch.v_cache)[0]),
                     ("single", lambda: single.run(batch.q, batch.k_cache, batch.v_cache)[0])):
        err = rel_err(fn(), base)
        print(f"  {name} vs lesson 04: relative difference {err:.1e} [{'ok' if err < 2e-2 else 'MISMATCH'}]", flush=True)
    _timed(rows, "cascade_decode", "yaie cascade (2 levels)", shape,
           lambda: cascade.run(batch.q, batch.k_cache, batch.v_cache), cascade_bytes + qo, warmup, rep)
    _timed(rows, "cascade_decode", "lesson 04 paged decode (prefix read per request)", shape, decode,
           per_request + qo, warmup, rep)
    _timed(rows, "cascade_decode", "yaie plan/run, 1 level (prefix read per request)", shape,
           lambda: single.run(batch.q, batch.k_cache, batch.v_cache), per_request + qo, warmup, rep)
    _timed_graph(rows, "cascade_decode", "yaie cascade (CUDA graph)", shape,
                 lambda: cascade.run(batch.q, batch.k_cache, batch.v_cache), cascade_bytes + qo, warmup, rep)
    _timed_graph(rows, "cascade_decode", "lesson 04 paged decode (CUDA graph)", shape, decode, per_request + qo,
                 warmup, rep)
    # The merge fused into the plan/run kernel (config fuse_merge=True: one launch) instead of a second launch.
    fused = fi.CascadeAttention(config={"fuse_merge": True})
    try:
        fused.plan(*levels, *batch.sizes, causal=True)
        ok = rel_err(fused.run(batch.q, batch.k_cache, batch.v_cache)[0], base) < 2e-2
    except Exception as err:  # noqa: BLE001 - a solution without this setting: no rows
        print(f"  cascade with fuse_merge=True: failed ({type(err).__name__})", flush=True)
    else:
        label = "yaie cascade, merge fused (1 launch)" + ("" if ok else " (MISMATCH)")
        _timed(rows, "cascade_decode", label, shape, lambda: fused.run(batch.q, batch.k_cache, batch.v_cache),
               cascade_bytes + qo, warmup, rep)
        _timed_graph(rows, "cascade_decode", label + " (CUDA graph)", shape,
                     lambda: fused.run(batch.q, batch.k_cache, batch.v_cache), cascade_bytes + qo, warmup, rep)
    rows.append(Row(LESSON, "cascade_decode", "cascade plan (host time, not GPU)", shape, "bf16", plan_ms))
    print(f"  cascade: {cascade._plan.work.shape[0]} work items x {NUM_KV_HEADS} KV heads, order "
          f"{_order_of(cascade)}, plan (host) {plan_ms:.3f} ms", flush=True)
    if profile:
        _profile(f"cascade {shape}", lambda: cascade.run(batch.q, batch.k_cache, batch.v_cache))
    _summary(rows, shape, "cascade_decode", "yaie cascade (2 levels)", "lesson 04")
    del batch
    torch.cuda.empty_cache()


def _summary(rows, shape, kernel, ours, theirs_mark):
    group = {r.impl: r.ms for r in rows if r.shape == shape and r.kernel == kernel}
    theirs = [impl for impl in group if theirs_mark in impl and "alone" not in impl]
    if ours in group and theirs:
        print(f"  {ours}: {group[ours]:.4f} ms; {theirs[0]}: {group[theirs[0]]:.4f} ms "
              f"({group[theirs[0]] / group[ours]:.2f}x)", flush=True)


VARIANTS = [{}, dict(order="longest"), dict(order="interleave"), dict(WIDE_M=64, WIDE_N=64),
            dict(WIDE_N=64, num_warps=8), dict(num_stages=2)]


def run(args) -> list[Row]:
    fi = module(5, 2)
    pa = module(4)
    try:
        pp = module(5, 1)
        if not hasattr(pp, "prefix_prefill_attention"):
            pp = None
    except ImportError:
        pp = None
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 40) if quick else (25, 100)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[Row] = []
    for shape in mixed_shapes(quick):
        mixed_step(rows, fi, pa, pp, *shape, gen, warmup, rep, [])
    for index, shape in enumerate(cascade_shapes(quick)):
        cascade_decode(rows, fi, pa, *shape, gen, warmup, rep, profile=index == 0)
    if not quick:      # last: the rows above are what the lesson reports, these what it was tuned with
        for shape in mixed_shapes(quick):
            mixed_step(rows, fi, pa, pp, *shape, gen, warmup, rep, VARIANTS, main=False)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m yaie.bench.lesson05_plan_run", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write the results (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="one shape per section, no launch-setting variants")
    parser.add_argument("--solutions", nargs="?", const="all", default=None, metavar="SPEC",
                        help="run the reference solutions (all, or the lessons in SPEC)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("a CUDA GPU is needed to run benchmarks, and none was found; nothing was measured.")
        return 2
    from yaie import switch
    from yaie.bench import harness
    if args.solutions is not None:
        switch.use_solutions(args.solutions)
    print(f"lesson05_plan_run: {switch.describe()}; GPU {torch.cuda.get_device_name(0)}", flush=True)
    peaks = harness.measure_peaks("cuda")
    print(f"  copy {peaks['copy_GBps']:.0f} GB/s, bf16 matmul {peaks['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = run(args)
    out_dir = Path(args.out) if args.out else harness.ROOT / "bench" / "results"
    paths = harness.write_results(f"lesson05_plan_run_{harness.gpu_slug()}", rows, peaks, out_dir)
    print(harness.markdown_table(rows, peaks))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
