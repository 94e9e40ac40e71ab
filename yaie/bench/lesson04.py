"""``yaie bench lesson04``: paged-attention decode beside torch SDPA on the same data laid out contiguously.

Shapes: bf16, head_dim 128, block_size 16, 32 query heads over 8 KV heads (GQA 4:1) and over 4 (8:1),
batch 32-128, context 1k-32k. Every sequence of a batch has the SAME length, so SDPA can read the same
keys and values from a contiguous ``[batch, kv_heads, ctx, head_dim]`` tensor (``enable_gqa=True``, no
padding, no copies of heads). The paged cache holds the same numbers in blocks scattered at random
(a shuffled block table, as a long-running server's cache would be).

Decode is memory bound: the figure that matters is the K/V bytes read per second, as a share of the
measured copy bandwidth (``bytes_moved`` = K + V + q + out; the block table is negligible). The same
byte count is used for SDPA, so the GB/s ratio is the speed ratio.

Rows:

* ``paged_decode`` / ``yaie triton``: the kernel with its own split-K heuristic (``num_splits=None``);
* ``paged_decode`` / ``torch SDPA (<backend>)``: each SDPA backend that accepts the inputs;
* ``paged_decode split sweep`` / ``splits=N``: the kernel with a forced split count (to judge the heuristic);
* ``paged_decode tile sweep``: launch settings of the reference kernel on two shapes.

Every shape is checked once against SDPA before timing: a fast wrong kernel is reported as MISMATCH.
"""

from __future__ import annotations

import warnings

import torch

from yaie.bench.harness import Row, bench_ms
from yaie.switch import module

LESSON = "lesson04"
HEAD_DIM = 128
BLOCK_SIZE = 16
NUM_HEADS = 32


def shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(batch, num_kv_heads, context)."""
    points = [(32, 1024), (32, 4096), (32, 16384), (32, 32768), (64, 8192), (128, 1024), (128, 4096)]
    if quick:
        points = [(32, 4096), (128, 1024)]
    return [(b, kv, ctx) for kv in (8, 4) for b, ctx in points]


def kv_bytes(batch: int, num_kv_heads: int, ctx: int, itemsize: int = 2) -> int:
    return 2 * batch * ctx * num_kv_heads * HEAD_DIM * itemsize


def make_inputs(batch: int, num_kv_heads: int, ctx: int, gen: torch.Generator):
    """The same K/V twice: paged (blocks shuffled) and contiguous for SDPA."""
    dtype, dev = torch.bfloat16, "cuda"
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    k = torch.randn(batch, num_kv_heads, ctx, HEAD_DIM, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(batch, num_kv_heads, ctx, HEAD_DIM, device=dev, dtype=dtype, generator=gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=dev, dtype=dtype, generator=gen)
    order = torch.randperm(num_blocks, device=dev, generator=gen)
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device=dev, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    # [b, h, ctx, d] -> [b, ctx/bs, bs, h, d] -> scatter block j of sequence b to physical block tables[b, j]
    k_cache[tables.long().flatten()] = k.permute(0, 2, 1, 3).reshape(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    v_cache[tables.long().flatten()] = v.permute(0, 2, 1, 3).reshape(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return q, k, v, k_cache, v_cache, tables, lens


def sdpa_backends():
    """(label, context manager factory) of the SDPA backends to try."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [("flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
            ("efficient", lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)),
            ("cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
            ("math", lambda: sdpa_kernel(SDPBackend.MATH))]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def run(args) -> list[Row]:
    pa = module(4)
    # SDPA explains at length why a backend declines GQA inputs; one line per backend is printed instead.
    warnings.filterwarnings("ignore", message=".*(kernel not used|num_heads|runtime disabled).*")
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 40) if quick else (25, 100)
    rows: list[Row] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, kv_heads, ctx in shapes(quick):
        shape = f"b{batch} h{NUM_HEADS}/{kv_heads} ctx{ctx} d{HEAD_DIM} bs{BLOCK_SIZE}"
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv_heads, ctx, gen)
        moved = kv_bytes(batch, kv_heads, ctx) + 2 * q.numel() * q.element_size()
        q4 = q.unsqueeze(2)                                    # [b, h, 1, d] for SDPA

        def ours(splits=None):
            return pa.paged_attention_forward(q, k_cache, v_cache, tables, lens, ctx, num_splits=splits,
                                              validate=False)

        reference = torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)
        err = _rel_err(ours(), reference)
        status = "ok" if err < 2e-2 else "MISMATCH"
        chosen = pa.choose_num_splits(batch, kv_heads, ctx) if hasattr(pa, "choose_num_splits") else None
        print(f"{shape}: relative difference to SDPA {err:.1e} [{status}], heuristic splits {chosen}", flush=True)
        label = "yaie triton" + ("" if status == "ok" else " (MISMATCH)")
        rows.append(Row(LESSON, "paged_decode", label, shape, "bf16", bench_ms(ours, warmup, rep), bytes_moved=moved))
        for name, backend in sdpa_backends():
            if name == "math" and ctx * batch > 32 * 8192:
                continue   # the math backend materialises the scores and copies heads: slow and huge
            try:
                with backend():
                    torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            except RuntimeError as err_:
                print(f"  SDPA {name}: not available here ({str(err_).splitlines()[0][:100]})", flush=True)
                continue

            def sdpa(backend=backend):
                with backend():
                    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

            rows.append(Row(LESSON, "paged_decode", f"torch SDPA ({name})", shape, "bf16",
                            bench_ms(sdpa, warmup, rep), bytes_moved=moved))
        if not quick:
            for splits in (1, 2, 4, 8, 16):
                rows.append(Row(LESSON, "paged_decode split sweep", f"splits={splits}", shape, "bf16",
                                bench_ms(lambda s=splits: ours(s), warmup, rep), bytes_moved=moved))
        group = [r for r in rows if r.shape == shape and r.kernel == "paged_decode"]
        best_sdpa = min((r.ms for r in group if r.impl.startswith("torch")), default=float("nan"))
        print(f"  yaie {group[0].ms:.4f} ms ({group[0].gbps:.0f} GB/s), best SDPA {best_sdpa:.4f} ms "
              f"({best_sdpa / group[0].ms:.2f}x)", flush=True)
        if not quick and hasattr(pa, "_launch_decode") and (batch, kv_heads, ctx) in ((32, 8, 4096), (32, 4, 16384)):
            rows.extend(tile_sweep(pa, q, k_cache, v_cache, tables, lens, ctx, shape, moved, warmup, rep))
        del q, k, v, k_cache, v_cache, tables, lens, reference
        torch.cuda.empty_cache()
    return rows


def tile_sweep(pa, q, k_cache, v_cache, tables, lens, ctx, shape, moved, warmup, rep) -> list[Row]:
    """Launch settings of the reference kernel (TILE_N, num_warps, num_stages) at the heuristic's split count."""
    splits = pa.choose_num_splits(q.shape[0], k_cache.shape[2], ctx)
    scale = HEAD_DIM ** -0.5
    rows = []
    for tile, warps, stages in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2),
                                (128, 8, 3), (64, 2, 2)):
        config = dict(TILE_N=tile, num_warps=warps, num_stages=stages)

        def fn(config=config):
            return pa._launch_decode(q, k_cache, v_cache, tables, lens, scale, splits, config)

        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            print(f"  tile sweep {config}: failed ({type(err).__name__})", flush=True)
            continue
        rows.append(Row(LESSON, "paged_decode tile sweep", f"tile{tile} w{warps} s{stages} splits{splits}", shape,
                        "bf16", bench_ms(fn, warmup, rep), bytes_moved=moved))
    return rows
