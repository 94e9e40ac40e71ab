"""``yaie bench lesson04``: paged-attention decode beside torch SDPA on the same data laid out contiguously.

Shapes: bf16, head_dim 128, block_size 16, 32 query heads over 8 KV heads (GQA 4:1) and over 4 (8:1),
batch 32-128, context 1k-32k. Every sequence of a batch has the SAME length, so SDPA can read the same
keys and values from a contiguous ``[batch, kv_heads, ctx, head_dim]`` tensor (``enable_gqa=True``, no
padding, no copies of heads). The paged cache holds the same numbers in blocks scattered at random
(a shuffled block table, as a long-running server's cache would be).

Decode is memory bound: the figure that matters is the K/V bytes read per second, as a share of the
measured copy bandwidth (``bytes_moved`` = K + V + q + out; the block table is negligible). The same
byte count is used for SDPA, so the GB/s ratio is the speed ratio.

Every yaie row calls the kernel with ``validate=False``, as the engine does: the value check of the
block table and lengths is a device-to-host sync per call, which a server skips because it builds those
tensors itself. The shape checks (host Python) stay in, as in the engine.

Rows (``paged_decode``):

* ``yaie triton``: the kernel with its own split-K heuristic (``num_splits=None``);
* ``yaie triton (before)``: an older kernel timed in the same run (old vs new side by side), when a copy of it
  is put at ``bench/results/lesson04_baseline_paged_attention.py`` (the committed results compare against
  ``git show 6667ffd:solutions/kernels/paged_attention.py``, the kernel before the fused merge); without that
  file these rows are skipped;
* ``yaie triton (merge as a 2nd kernel)``: split-K with the log-sum-exp merge launched as a kernel of its
  own instead of fused into the decode kernel's last split (shapes where the heuristic splits);
* ``yaie triton on SDPA's contiguous K/V``: the kernel reading SDPA's own ``[batch, kv_heads, ctx, head_dim]``
  tensors as a cache of one block per sequence (``block_size = ctx``): the same bytes in the same places,
  so the gap left to SDPA is the kernel's, not the paging's;
* ``yaie triton (CUDA graph)``: the same call replayed from a CUDA graph: the GPU time alone, without the
  host's Python and launch work (what an engine that captures its decode step would see);
* ``torch SDPA (default: <backend>)``: SDPA as a user calls it, no backend forced; the backend it picked
  is read from the names of the GPU kernels it ran (torch profiler);
* ``torch SDPA (default, CUDA graph)``: the same, replayed from a CUDA graph;
* ``torch SDPA (<backend>)``: each SDPA backend forced in turn, where it accepts the inputs.

``paged_decode split sweep`` / ``splits=N``: the kernel with a forced split count (to judge the heuristic).
Launch settings, cache layouts, block placement and host time were studied beside it (results
``bench/results/lesson04_tune_h200.json``; the experiments: ``docs/decode_kernel_findings.md``).

Every shape is checked once against SDPA before timing: a fast wrong kernel is reported as MISMATCH.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from pathlib import Path

import torch

from yaie.bench.harness import Row, bench_ms, graphed, rel_err
from yaie.switch import module

LESSON = "lesson04"
HEAD_DIM = 128
BLOCK_SIZE = 16
NUM_HEADS = 32
BASELINE = Path(__file__).resolve().parents[2] / "bench" / "results" / "lesson04_baseline_paged_attention.py"


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


def load_baseline():
    """The kernel module as committed before the issue-5 changes (None when the frozen copy is missing)."""
    if not BASELINE.exists():
        return None
    spec = importlib.util.spec_from_file_location("yaie_lesson04_baseline", BASELINE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def backend_of(fn) -> str:
    """Which SDPA backend ``fn`` ran: the name of the aten op it dispatched to (torch profiler), else the
    names of its GPU kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    joined = " ".join(names).lower()
    for label, marks in (("cudnn", ("_scaled_dot_product_cudnn", "cudnn", "fort_native_sdpa")),
                         ("flash", ("_scaled_dot_product_flash", "flash_fwd")),
                         ("efficient", ("_efficient_attention", "fmha", "attentionkernel")),
                         ("math", ("_scaled_dot_product_attention_math",))):
        if any(m in joined for m in marks):
            return label
    return "unknown"


def _timed(rows, impl, shape, fn, moved, warmup, rep, kernel="paged_decode"):
    """Time ``fn`` into a row; a failure (a graph that does not capture, say) is printed, not fatal."""
    try:
        rows.append(Row(LESSON, kernel, impl, shape, "bf16", bench_ms(fn, warmup, rep), bytes_moved=moved))
    except Exception as err:  # noqa: BLE001
        print(f"  {impl}: failed ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})",
              flush=True)


def shape_label(batch: int, kv_heads: int, ctx: int) -> str:
    return f"b{batch} h{NUM_HEADS}/{kv_heads} ctx{ctx} d{HEAD_DIM} bs{BLOCK_SIZE}"


def run(args) -> list[Row]:
    pa = module(4)
    before = load_baseline()
    # SDPA explains at length why a backend declines GQA inputs; one line per backend is printed instead.
    warnings.filterwarnings("ignore", message=".*(kernel not used|num_heads|runtime disabled).*")
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 40) if quick else (25, 100)
    rows: list[Row] = []
    began = time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("yaie rows call paged_attention_forward(..., validate=False) (no host sync), as the engine does", flush=True)
    for batch, kv_heads, ctx in shapes(quick):
        shape = shape_label(batch, kv_heads, ctx)
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv_heads, ctx, gen)
        moved = kv_bytes(batch, kv_heads, ctx) + 2 * q.numel() * q.element_size()
        q4 = q.unsqueeze(2)                                    # [b, h, 1, d] for SDPA

        def ours(splits=None, impl=pa):
            return impl.paged_attention_forward(q, k_cache, v_cache, tables, lens, ctx, num_splits=splits,
                                                validate=False)

        def sdpa_default():
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        reference = sdpa_default().squeeze(2)
        err = rel_err(ours(), reference)
        status = "ok" if err < 2e-2 else "MISMATCH"
        chosen = pa.choose_num_splits(batch, kv_heads, ctx) if hasattr(pa, "choose_num_splits") else None
        programs = batch * kv_heads * (chosen or 1)
        print(f"{shape}: relative difference to SDPA {err:.1e} [{status}], heuristic splits {chosen} "
              f"({programs} programs)", flush=True)
        label = "yaie triton" + ("" if status == "ok" else " (MISMATCH)")
        _timed(rows, label, shape, ours, moved, warmup, rep)
        if before is not None:
            _timed(rows, "yaie triton (before)", shape, lambda: ours(impl=before), moved, warmup, rep)
        if chosen and chosen > 1 and hasattr(pa, "_launch_decode"):
            scale = HEAD_DIM ** -0.5
            _timed(rows, "yaie triton (merge as a 2nd kernel)", shape,
                   lambda: pa._launch_decode(q, k_cache, v_cache, tables, lens, ctx, scale, chosen,
                                             fuse_merge=False),
                   moved, warmup, rep)
        # SDPA's own contiguous tensors handed to our kernel as a cache of one block per sequence: the same
        # bytes in the same places, so what differs from the SDPA rows is the kernel, not the paging.
        one_block = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
        _timed(rows, "yaie triton on SDPA's contiguous K/V", shape,
               lambda: pa.paged_attention_forward(q, k.transpose(1, 2), v.transpose(1, 2), one_block, lens, ctx,
                                                  validate=False), moved, warmup, rep)
        if status == "ok":
            _timed_graph(rows, "yaie triton (CUDA graph)", shape, ours, moved, warmup, rep)
        try:
            picked = backend_of(sdpa_default)
        except Exception as err_:  # noqa: BLE001 - the profiler is a nicety
            picked = f"unknown ({type(err_).__name__})"
        print(f"  SDPA default picks: {picked}", flush=True)
        _timed(rows, f"torch SDPA (default: {picked})", shape, sdpa_default, moved, warmup, rep)
        _timed_graph(rows, "torch SDPA (default, CUDA graph)", shape, sdpa_default, moved, warmup, rep)
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

            _timed(rows, f"torch SDPA ({name})", shape, sdpa, moved, warmup, rep)
        if not quick and time.monotonic() - began < 0.6 * deadline():
            for splits in (1, 2, 4, 8, 16):
                _timed(rows, f"splits={splits}", shape, lambda s=splits: ours(s), moved, 10, 40,
                       kernel="paged_decode split sweep")
        group = {r.impl: r.ms for r in rows if r.shape == shape and r.kernel == "paged_decode"}
        sdpa_ms = {impl: ms for impl, ms in group.items() if impl.startswith("torch")}
        best = min(sdpa_ms, key=sdpa_ms.get, default=None)
        if label in group and best:
            print(f"  yaie {group[label]:.4f} ms (before {group.get('yaie triton (before)', float('nan')):.4f}), "
                  f"best SDPA {sdpa_ms[best]:.4f} ms [{best}] ({sdpa_ms[best] / group[label]:.2f}x)", flush=True)
        del q, k, v, k_cache, v_cache, tables, lens, reference
        torch.cuda.empty_cache()
    return rows


def deadline() -> float:
    """Seconds after the start of :func:`run` after which the split sweeps are skipped (``LESSON04_DEADLINE_S``)."""
    return float(os.environ.get("LESSON04_DEADLINE_S", "150"))


def _timed_graph(rows, impl, shape, fn, moved, warmup, rep):
    try:
        replay = graphed(fn)
    except Exception as err:  # noqa: BLE001 - not every call captures; say so and go on
        print(f"  {impl}: capture failed ({type(err).__name__})", flush=True)
        return
    _timed(rows, impl, shape, replay, moved, warmup, rep)
