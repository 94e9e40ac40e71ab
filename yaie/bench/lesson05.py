"""``yaie bench lesson05``: the prefix-prefill kernel beside gather + torch SDPA and gather + lesson 06.

bf16, head_dim 128, 32 query heads over 8 KV heads, block size 16. Each sequence has a cached prefix of
``prefix`` tokens in a paged cache (blocks shuffled, as a serving engine leaves them) and ``new`` new
tokens. Shapes: (a) batch 8, prefix 2048, new 512; (b) batch 4, prefix 8192, new 1024; (c) batch 16,
prefix 1024, new 128; (d) batch 1, prefix 16384, new 2048.

Rows per shape:

* ``yaie prefix prefill (paged)``: lesson 05 reading the prefix through the block tables;
* ``... (16-byte K layout)``: the same with the K cache in ``to_vector_k_layout``'s layout;
* ``gather K/V``: the copy the baselines need first: each prefix gathered from its blocks and the new
  tokens appended, into one contiguous ``[batch, prefix + new, kv_heads, head_dim]`` buffer (K and V);
* ``torch SDPA default + gather`` and ``torch SDPA default (pre-gathered)``: SDPA's default backend with a
  bottom-right causal mask (``causal_lower_right``) and ``enable_gqa``;
* ``lesson 06 varlen + gather`` and ``lesson 06 varlen (pre-gathered)``: lesson 06's
  ``flash_attention_varlen_forward`` over the same buffer.

FLOPs (the same count for every implementation, so the TFLOP/s ratio is the speed ratio): per sequence and
query head, ``4 * head_dim * (new * prefix + new * (new + 1) / 2)`` (q k^T and p v over the keys each query
sees). Targets: >= 1.2x SDPA with the gather counted, >= lesson 06 without it.

Part 2 of the lesson (plan/run attention, cascade) adds its rows through ``yaie/bench/lesson05_plan_run.py``
(``run(args) -> list[Row]``) when that file exists.
"""

from __future__ import annotations

import os

import torch

from yaie.bench.harness import Row, bench_ms, rel_err
from yaie.switch import module

LESSON = "lesson05"
DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TARGET_SDPA, TARGET_L06 = 1.2, 1.0


def shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(batch, prefix, new) of the four benchmark shapes (two with --quick)."""
    full = [(8, 2048, 512), (4, 8192, 1024), (16, 1024, 128), (1, 16384, 2048)]
    return full[:2] if quick else full


def prefill_flops(batch: int, prefix: int, new: int) -> int:
    return 4 * HEAD_DIM * HEADS * batch * (new * prefix + new * (new + 1) // 2)


def build(batch: int, prefix: int, new: int, gen: torch.Generator):
    """Random new tokens and a paged cache holding every prefix in shuffled blocks."""
    dtype, dev = torch.bfloat16, DEVICE
    per_seq = -(-(prefix + new) // BLOCK_SIZE)         # each sequence owns the blocks of its new tokens too
    num_blocks = batch * per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev, generator=gen)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, device=dev, generator=gen)
    block_tables = order[:batch * per_seq].view(batch, per_seq).to(torch.int32).contiguous()
    q = torch.randn(batch * new, HEADS, HEAD_DIM, dtype=dtype, device=dev, generator=gen)
    k = torch.randn(batch * new, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev, generator=gen)
    v = torch.randn_like(k)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev) * new
    context_lens = torch.full((batch,), prefix, dtype=torch.int32, device=dev)
    # The cache slots of each prefix (an engine has them from its block tables; not timed).
    positions = torch.arange(prefix, device=dev)
    blocks = block_tables[:, positions // BLOCK_SIZE].long()
    slots = (blocks * BLOCK_SIZE + positions % BLOCK_SIZE).reshape(-1)
    return q, k, v, k_cache, v_cache, block_tables, cu_q, context_lens, slots


def _sdpa_fn(batch, prefix, new, q):
    """SDPA's default backend on [batch, heads, tokens, head_dim] views, bottom-right causal, GQA.

    Returns (fn(keys, values) -> out token-major, description)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    total = prefix + new
    mask = causal_lower_right(new, total)
    qd = q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2)

    def gqa(keys, values):
        kd = keys.view(batch, total, KV_HEADS, HEAD_DIM).transpose(1, 2)
        vd = values.view(batch, total, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)

    def expanded(keys, values):   # older torch: no enable_gqa with a CausalBias; repeat the KV heads
        group = HEADS // KV_HEADS
        kd = keys.view(batch, total, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(group, dim=1)
        vd = values.view(batch, total, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)

    return gqa, expanded


def _best_config(pp) -> str:
    tuned = getattr(pp, "_tuned_kernel", None)
    config = getattr(tuned(), "best_config", None) if tuned is not None else None
    return str(config) if config is not None else ""


def run(args) -> list[Row]:
    pp = module(5, 1)
    fa = module(6)
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 30) if quick else (25, 100)
    rows: list[Row] = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for batch, prefix, new in shapes(quick):
        shape = f"b{batch} prefix{prefix} new{new} h{HEADS}/{KV_HEADS} d{HEAD_DIM} bs{BLOCK_SIZE}"
        q, k, v, k_cache, v_cache, tables, cu_q, ctx, slots = build(batch, prefix, new, gen)
        k_vec = pp.to_vector_k_layout(k_cache)
        total = prefix + new
        cu_k = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * total
        k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)

        def gather():
            keys = torch.cat([k_rows[slots].view(batch, prefix, KV_HEADS, HEAD_DIM),
                              k.view(batch, new, KV_HEADS, HEAD_DIM)], dim=1).view(batch * total, KV_HEADS, HEAD_DIM)
            values = torch.cat([v_rows[slots].view(batch, prefix, KV_HEADS, HEAD_DIM),
                                v.view(batch, new, KV_HEADS, HEAD_DIM)], dim=1).view(batch * total, KV_HEADS, HEAD_DIM)
            return keys, values

        def ours():
            return pp.prefix_prefill_attention(q, k, v, k_cache, v_cache, tables, cu_q, ctx, new, validate=False)

        def ours_vec():
            return pp.prefix_prefill_attention(q, k, v, k_vec, v_cache, tables, cu_q, ctx, new, validate=False)

        keys, values = gather()
        sdpa_gqa, sdpa_expanded = _sdpa_fn(batch, prefix, new, q)
        sdpa_name = "torch SDPA default"
        try:
            ref = sdpa_gqa(keys, values)
            sdpa = sdpa_gqa
        except (RuntimeError, TypeError, NotImplementedError) as err:
            print(f"  SDPA with enable_gqa and causal_lower_right failed ({err}); repeating the KV heads", flush=True)
            ref = sdpa_expanded(keys, values)
            sdpa, sdpa_name = sdpa_expanded, "torch SDPA default (KV heads repeated)"
        ref = ref.transpose(1, 2).reshape(batch * new, HEADS, HEAD_DIM)

        def l06(keys_, values_):
            return fa.flash_attention_varlen_forward(q, keys_, values_, cu_q, cu_k, new, total, causal=True)

        # Check once against SDPA (this also compiles and autotunes outside the timed region).
        errors = {"paged": rel_err(ours()[0], ref), "16-byte K": rel_err(ours_vec()[0], ref),
                  "lesson 06": rel_err(l06(keys, values)[0], ref)}
        bad = [name for name, e in errors.items() if e > 2e-2]
        print(f"{shape}: relative difference to SDPA " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
              + (f" [MISMATCH: {bad}]" if bad else " [ok]"), flush=True)

        flops = prefill_flops(batch, prefix, new)
        gathered_bytes = 2 * 2 * keys.numel() * keys.element_size()       # K and V, read + written
        timings = [
            ("yaie prefix prefill (paged)", ours, flops, None, "paged"),
            ("yaie prefix prefill (paged, 16-byte K layout)", ours_vec, flops, None, "16-byte K"),
            ("gather K/V (contiguous copy)", gather, None, gathered_bytes, None),
            (f"{sdpa_name} + gather", lambda: sdpa(*gather()), flops, None, None),
            (f"{sdpa_name} (pre-gathered)", lambda: sdpa(keys, values), flops, None, None),
            ("lesson 06 varlen + gather", lambda: l06(*gather()), flops, None, "lesson 06"),
            ("lesson 06 varlen (pre-gathered)", lambda: l06(keys, values), flops, None, "lesson 06"),
        ]
        measured = {}
        for impl, fn, fl, nbytes, check in timings:
            with torch.no_grad():
                ms = bench_ms(fn, warmup, rep)
            measured[impl] = ms
            name = impl + (" (MISMATCH)" if check in bad else "")
            rows.append(Row(LESSON, "prefix_prefill", name, shape, "bf16", ms, bytes_moved=nbytes, flops=fl))
        mine = measured["yaie prefix prefill (paged)"]
        vs_sdpa = measured[f"{sdpa_name} + gather"] / mine
        vs_l06 = measured["lesson 06 varlen (pre-gathered)"] / mine
        print(f"  paged {flops / mine / 1e9:6.1f} TFLOP/s ({mine:.3f} ms); 16-byte K layout "
              f"{measured['yaie prefix prefill (paged, 16-byte K layout)']:.3f} ms; gather alone "
              f"{measured['gather K/V (contiguous copy)']:.3f} ms\n"
              f"  vs SDPA + gather {vs_sdpa:.2f}x (target >= {TARGET_SDPA}x: {'met' if vs_sdpa >= TARGET_SDPA else 'MISSED'}); "
              f"vs lesson 06 pre-gathered {vs_l06:.2f}x (target >= {TARGET_L06}x: "
              f"{'met' if vs_l06 >= TARGET_L06 else 'MISSED'})", flush=True)
        config = _best_config(pp)
        if config:
            print(f"  tuned: {config}", flush=True)
        del q, k, v, k_cache, v_cache, k_vec, keys, values, ref, k_rows, v_rows
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows + _part2_rows(args)


def _part2_rows(args) -> list[Row]:
    """Rows of lesson 05 part 2 (plan/run attention), from ``yaie/bench/lesson05_plan_run.py``
    (``YAIE_BENCH_LESSON05_PART2=0`` leaves them out)."""
    if os.environ.get("YAIE_BENCH_LESSON05_PART2", "1") == "0":
        return []
    from yaie.bench import lesson05_plan_run
    return lesson05_plan_run.run(args)
