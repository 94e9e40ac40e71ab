"""Does the page-local free list (lesson 03, ``FreeBlocks``) make decode faster in a long-running server?

    OUT=out YAIE_GIT_COMMIT=<hash> [ALLOC_CONTEXT=16384] python scripts/gpu_lesson03_allocator.py

1. On the CPU, the same random serving workload runs through lesson 03's ``KVCacheManager`` twice: with the
   free list as it was before session 8 (a stack of ids: the most recently freed block first) and with
   ``FreeBlocks`` (a sequence's next block from its last block's 2 MiB page when there is room). Background
   requests arrive (prompts of 16-2048 tokens), grow by one 16-token block per step and leave at random
   lengths (256-8192 tokens); after a warm-up the measured batch is admitted (prompts of 512 tokens) and
   grows to ``CONTEXT`` tokens while the churn goes on. Only the block tables matter here, so the manager
   holds a tiny cache (1 layer, 1 head, head_dim 1) with the real layout's blocks per page.
2. On the GPU, lesson 04's decode reads a bf16 cache laid out as each policy left it (and, for reference,
   the same sequences with their blocks in order and fully shuffled), GQA 4:1 (32 query heads over 8 KV
   heads), head_dim 128, 16-token blocks; CUDA-graph replays beside SDPA's default on the contiguous tensors.
   Also reported: the 2 MiB pages each sequence's blocks touch.
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solutions.kernels import kv_cache as l3  # noqa: E402
from solutions.kernels import paged_attention as pa  # noqa: E402
from yaie.bench.harness import bench_ms, gpu_slug, measure_peaks  # noqa: E402
from yaie.bench.lesson04 import graphed  # noqa: E402

BATCH, KV_HEADS, HEADS, DIM, BLOCK = 32, 8, 32, 128, 16
CONTEXT = int(os.environ.get("ALLOC_CONTEXT", "16384"))
BLOCK_BYTES = BLOCK * KV_HEADS * DIM * 2                       # one block of one layer's K, bf16
PER_PAGE = (2 << 20) // BLOCK_BYTES                             # 64 blocks per 2 MiB
NUM_BLOCKS = int(BATCH * CONTEXT // BLOCK * 1.3) // PER_PAGE * PER_PAGE   # 30% room for the background
WARMUP_STEPS, BACKGROUND = 2000, 48


class _Stack(list):
    """The free list before session 8: a stack of ids (``near`` ignored)."""

    def pop(self, near=None):  # noqa: ARG002 - the old list had no hint
        return super().pop()


def manager(policy: str):
    tiny_block_bytes = BLOCK * 1 * 1 * 2
    m = l3.KVCacheManager(NUM_BLOCKS, BLOCK, 1, 1, 1, dtype=torch.float16, page_bytes=PER_PAGE * tiny_block_bytes)
    if policy == "stack (before)":
        m._free = _Stack(range(NUM_BLOCKS - 1, -1, -1))
    return m


def simulate(policy: str, seed: int = 0) -> tuple[list[list[int]], dict]:
    """Run the workload; return the measured sequences' block tables and a few counts."""
    rng = random.Random(seed)
    m = manager(policy)
    background: dict[int, int] = {}       # seq id -> target length
    next_id, admitted, stats = 1000, 0, {"background_admitted": 0, "background_refused": 0}

    def admit_background():
        nonlocal next_id
        prompt, target = rng.randint(16, 2048), rng.randint(256, 8192)
        needed = -(-max(prompt, target) // BLOCK)
        reserve = sum(-(-CONTEXT // BLOCK) - len(m.block_ids(s)) for s in range(admitted))   # measured growth
        if m.num_free_blocks - reserve < needed:
            stats["background_refused"] += 1
            return
        m.allocate(next_id, prompt)
        background[next_id] = max(prompt + BLOCK, target)
        next_id += 1
        stats["background_admitted"] += 1

    def preempt_one():
        victim = max(background)                        # the newest background request gives way
        m.free(victim)
        del background[victim]
        stats["background_preempted"] = stats.get("background_preempted", 0) + 1

    def step():
        for s in list(background):
            if s not in background:
                continue
            if m.num_tokens(s) + BLOCK > background[s]:
                m.free(s)
                del background[s]
                continue
            try:
                m.append_slots(s, BLOCK)
            except l3.OutOfBlocks:
                preempt_one()
        while len(background) < BACKGROUND and rng.random() < 0.9:
            before = len(background)
            admit_background()
            if len(background) == before:
                break

    for _ in range(WARMUP_STEPS):
        step()
    for s in range(BATCH):                      # the measured batch arrives, one request per step
        while m.num_free_blocks < 512 // BLOCK:
            preempt_one()
        m.allocate(s, 512)
        admitted += 1
        step()
    while any(m.num_tokens(s) < CONTEXT for s in range(BATCH)):
        for s in range(BATCH):
            if m.num_tokens(s) < CONTEXT:
                while True:
                    try:
                        m.append_slots(s, min(BLOCK, CONTEXT - m.num_tokens(s)))
                        break
                    except l3.OutOfBlocks:
                        preempt_one()               # raises ValueError (max of nothing) if none is left
        step()
    tables = [m.block_ids(s) for s in range(BATCH)]
    pages = [len({b // PER_PAGE for b in t}) for t in tables]
    stats.update(pages_per_sequence_mean=sum(pages) / len(pages), pages_per_sequence_min=min(pages),
                 pages_per_sequence_max=max(pages), pages_if_in_order=-(-CONTEXT // BLOCK // PER_PAGE),
                 page_moves_mean=sum(sum((a // PER_PAGE) != (b // PER_PAGE) for a, b in zip(t, t[1:]))
                                     for t in tables) / len(tables))
    return tables, stats


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("YAIE_GIT_COMMIT"),
              "command": f"ALLOC_CONTEXT={CONTEXT} OUT=out python scripts/gpu_lesson03_allocator.py",
              "shape": f"b{BATCH} h{HEADS}/{KV_HEADS} ctx{CONTEXT} d{DIM} bs{BLOCK} bf16, cache of {NUM_BLOCKS} blocks",
              "workload": {"warmup_steps": WARMUP_STEPS, "background_requests": BACKGROUND,
                           "background_prompt": [16, 2048], "background_length": [256, 8192],
                           "measured_prompt": 512, "block_bytes": BLOCK_BYTES, "blocks_per_2MiB": PER_PAGE},
              "peaks": measure_peaks("cuda"), "policies": {}, "rows": []}
    copy = report["peaks"]["copy_GBps"]
    print(f"{report['gpu']} torch {torch.__version__} triton {triton.__version__} copy {copy:.0f} GB/s", flush=True)
    began = time.monotonic()
    layouts = {}
    for policy in ("stack (before)", "page-local (now)"):
        tables, stats = simulate(policy)
        report["policies"][policy] = stats
        layouts[policy] = tables
        print(f"  {policy}: {stats} ({time.monotonic() - began:.0f} s)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = CONTEXT // BLOCK
    layouts["in order (reference)"] = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(BATCH)]
    layouts["shuffled (reference)"] = torch.randperm(NUM_BLOCKS, generator=gen, device="cuda")[:BATCH * per_seq] \
        .view(BATCH, per_seq).tolist()
    # One set of numbers, the contiguous [batch, kv_heads, ctx, dim] tensors SDPA reads, stored per layout.
    k = torch.randn(BATCH, KV_HEADS, CONTEXT, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(BATCH, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((BATCH,), CONTEXT, device="cuda", dtype=torch.int32)
    moved = 2 * k.numel() * 2
    want = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)

    def record(name, fn, **extra):
        err = float((fn().float() - want.float()).abs().max())
        ms = bench_ms(graphed(fn), 5, 25)
        report["rows"].append({"layout": name, "ms": ms, "pct_copy": 100 * moved / (ms * 1e-3) / 1e9 / copy,
                               "max_abs_diff_vs_sdpa": err, **extra})
        print(f"  {name}: {ms * 1e3:.1f} us ({report['rows'][-1]['pct_copy']:.1f}% of copy), diff {err:.1e}", flush=True)

    record("torch SDPA (default), contiguous", lambda: torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2))
    splits = pa.choose_num_splits(BATCH, KV_HEADS, CONTEXT)
    rows_k = k.permute(0, 2, 1, 3).reshape(BATCH * per_seq, BLOCK, KV_HEADS, DIM)
    rows_v = v.permute(0, 2, 1, 3).reshape(BATCH * per_seq, BLOCK, KV_HEADS, DIM)
    for _round in range(2):                 # two rounds, interleaved: the GPU's state drifts within a run
        for name, tables in layouts.items():
            table = torch.tensor(tables, dtype=torch.int32, device="cuda")
            k_cache = torch.empty(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.empty_like(k_cache)
            k_cache[table.long().flatten()] = rows_k
            v_cache[table.long().flatten()] = rows_v
            pages = [len({b // PER_PAGE for b in t}) for t in tables]
            record(f"yaie, {name}", lambda kc=k_cache, vc=v_cache, t=table: pa.paged_attention_forward(
                q, kc, vc, t, lens, CONTEXT, num_splits=splits, validate=False), round=_round,
                pages_per_sequence_mean=sum(pages) / len(pages))
            del k_cache, v_cache
            torch.cuda.empty_cache()
    report["seconds"] = time.monotonic() - began
    path = out_dir / f"lesson03_allocator_{gpu_slug()}.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)
    bad = [r for r in report["rows"] if not r["max_abs_diff_vs_sdpa"] < 2e-2]
    if bad:
        print("FAILED checks:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
