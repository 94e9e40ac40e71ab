"""``yaie bench lesson08``: Based linear-attention prefill beside flash-linear-attention and SDPA.

Shapes: batch 16, 16 heads, feature dim 16 (q, k), value dim 64, bf16, 1k to 16k tokens, causal, forward.

Rows (``based_prefill``):

* ``yaie triton``: :func:`based_prefill` as the engine calls it (``chunk_size=None``, the final state
  returned): the reference's default route (segments of ``DEFAULT_SEGMENT`` tokens: the boundary states
  (beside the first segment's queries, or on a Hopper GPU from the Hopper state kernel), then the quadratic
  form inside each segment plus the state before it);
* ``yaie triton (output only)``: the same without the state (what the fla kernels return);
* ``yaie segmented (segment L, BM m, BN n, w warps[, s stages])``: the same route with other settings of
  its query programs (the final state returned); at 8 warps the boundary states (4 warps) take a launch of
  their own, since one launch has one warp count;
* ``yaie chunked (registers, chunk C, BV b, w warps)``: the chunked kernel (output and state: the
  lesson's task 2, ``chunk_size`` given);
* ``fla fused_chunk_based`` and ``fla parallel_based``: flash-linear-attention's Triton kernels
  (``fla-core``, a benchmark-only extra: ``pip install -e .[bench]``). Without fla these rows are
  skipped with a note. fla takes ``[batch, seq, heads, dim]``; it is given views of the same
  ``[batch, heads, seq, dim]`` tensors, so its own transposes find contiguous memory and copy nothing;
* ``yaie route, Triton boundary states``: the route with the Triton state kernel (``hopper=False``) where
  the reference takes its Hopper state kernel (``solutions/kernels/based_hopper.py``, on an H100 or H200),
  timed in the rounds beside it (the reference's private launcher; skipped for other implementations);
* ``... (CUDA graph)``: ``yaie triton``, ``fla parallel_based`` and the Triton-state route recorded in a CUDA
  graph and replayed (``harness.graphed``): GPU time alone, without the host's Python per call, which at 1k
  tokens takes longer than the GPU work of an eager call of the route;
* ``torch SDPA causal (head_dim 64)``: softmax attention of the same batch with q, k, v of head dim 64
  (what a full-attention layer of the same width costs).

Rows (``based_state``): the route's Triton state kernel alone (the state at every boundary of segments of
``STATE_SWEEP_SEGMENT`` tokens, bfloat16, and the final state) with other settings (groups of 16
order-2 feature rows per program, tokens per step, warps, the order-2 product in two halves: ``split``), and
on a Hopper GPU the Hopper state kernel (Gluon) that the route takes there.

FLOPs: all ``based_prefill`` rows count the same work, the linear form's ``4 * 273 * d_v`` per token and
head (the state read ``phi(q) @ S`` and the state update ``phi(k)^T v``), whatever route they take;
``based_state`` rows half of it (the update only); SDPA rows the usual ``4 * seq^2 * head_dim / 2`` per
head under the causal mask. Within one kernel's rows the TFLOP/s ratio is the speed ratio.

The kernels first run back to back for ``WARM_SECONDS``. The ``yaie triton`` and ``fla`` rows are timed in
``ROUNDS`` interleaved rounds and report the median round (the log prints every round). Each shape is checked
once before timing: our output against fla's and against the float32 chunked reference on the first sequence;
a kernel that is fast and wrong is reported as MISMATCH. Every sweep setting is compared with the default
route's output (and state) before it is timed.
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch

from yaie.bench.harness import Row, bench_ms, graphed, rel_err
from yaie.switch import module

LESSON = "lesson08"
DEVICE = "cuda"
BATCH, HEADS, FEATURES, VALUE_DIM = 16, 16, 16, 64
DTYPE = torch.bfloat16
SEGMENT_SWEEP = [  # (segment_len, block_m, block_n, num_warps, num_stages or None)
    (128, 64, 64, 4, None), (512, 64, 64, 4, None), (1024, 64, 64, 4, None), (256, 64, 32, 4, None),
    (256, 128, 64, 8, None),
]
STATE_SWEEP = [  # (groups of 16 order-2 rows per program, tokens per step, num_warps, order-2 product split)
    (4, 128, 4, False), (4, 256, 8, False), (4, 128, 8, False), (2, 128, 4, False), (8, 128, 8, False),
    (4, 64, 4, False), (4, 128, 4, True), (8, 128, 4, True),
]
ROUTE_VARIANTS = [  # (name, keyword arguments of _launch_segmented): timed in the rounds beside the route
    ("yaie route, Triton boundary states", {"hopper": False}),
]
GRAPHED = ("yaie triton", "fla parallel_based", "yaie route, Triton boundary states")   # also timed in CUDA graphs
STATE_SWEEP_SEGMENT = 256
WARM_SECONDS = 5.0          # _settle before the first timing
ROUNDS = 3                 # interleaved rounds of the headline rows (yaie, fla), median of the rounds
CHUNKED_SWEEP = [  # (chunk, block_v, num_warps): the chunked kernel (lesson task 2, chunk_size given)
    (32, 64, 4),
]


def lengths(quick: bool) -> list[int]:
    return [4096] if quick else [1024, 2048, 4096, 8192, 16384]


def based_flops(batch: int, heads: int, seq: int, value_dim: int) -> int:
    """The linear form's multiply-adds, times 2: state read and state update, 273 x d_v each, per token."""
    return 4 * batch * heads * seq * 273 * value_dim


def sdpa_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    return 4 * batch * heads * seq * seq * head_dim // 2


def load_fla():
    """``(fused_chunk_based, parallel_based)`` or ``(None, reason)`` when fla-core is not importable."""
    try:
        ops = importlib.import_module("fla.ops.based")
        return (ops.fused_chunk_based, ops.parallel_based), None
    except Exception as err:  # noqa: BLE001 - any import failure means: no fla rows
        return None, f"{type(err).__name__}: {err}"


def _timed_setting(name, kernel, launch, check, shape, warmup, rep, flops) -> list[Row]:
    """Run ``launch`` once, compare with ``check()`` (a relative difference), time it: one row, or none
    (with a note) when the setting does not compile or run."""
    try:
        launch()
        err = check()
        ms = bench_ms(launch, warmup, rep)
    except Exception as exc:  # noqa: BLE001 - a config that does not compile is a finding, not a crash
        print(f"  {name}: failed ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
        return []
    flag = "" if err < 2e-2 else " MISMATCH"
    print(f"  {name}: {ms:.3f} ms, rel. diff to the default {err:.1e}{flag}", flush=True)
    return [Row(LESSON, kernel, name + flag, shape, "bf16", ms, flops=flops)]


def _sweep_rows(based, q, k, v, shape, warmup, rep, flops) -> list[Row]:
    """Other launch settings of the reference kernels (they need its private launchers)."""
    if not all(hasattr(based, f) for f in ("_launch_prefill", "_launch_segmented", "_launch_prefix_state")):
        return []
    seq = q.shape[2]
    rows: list[Row] = []
    ref_out, ref_state = based.based_prefill(q, k, v)
    out = torch.empty_like(v)
    kv = torch.empty(BATCH, HEADS, 273, VALUE_DIM, device=DEVICE, dtype=torch.float32)
    ks = torch.empty(BATCH, HEADS, 273, device=DEVICE, dtype=torch.float32)
    found = {}

    def state_err(state):
        return max(rel_err(state.kv, ref_state.kv), rel_err(state.k, ref_state.k))

    for seg, bm, bn, warps, stages in SEGMENT_SWEEP:
        if seg >= 2 * seq:                      # the same single segment as a shorter setting
            continue
        name = (f"yaie segmented (segment {seg}, BM {bm}, BN {bn}, {warps} warps"
                + (f", {stages} stages)" if stages else ")"))
        rows += _timed_setting(
            name, "based_prefill",
            lambda: found.update(state=based._launch_segmented(q, k, v, out, seg, True, bm, bn, warps, stages)),
            lambda: max(rel_err(out, ref_out), state_err(found["state"])), shape, warmup, rep, flops)
    segments = -(-seq // STATE_SWEEP_SEGMENT)
    prefix_kv = torch.empty(BATCH, HEADS, segments - 1, 273, VALUE_DIM, device=DEVICE, dtype=q.dtype)
    prefix_k = torch.empty(BATCH, HEADS, segments - 1, 273, device=DEVICE, dtype=torch.float32)
    for groups, block_t, warps, split in STATE_SWEEP:
        rows += _timed_setting(
            f"yaie boundary states (segment {STATE_SWEEP_SEGMENT}, groups {groups}, tokens {block_t}, {warps} warps"
            + (", split)" if split else ")"),
            "based_state",
            lambda: based._launch_prefix_state(k, v, prefix_kv, prefix_k, kv, ks, STATE_SWEEP_SEGMENT, groups,
                                               block_t, warps, None, split),
            lambda: max(rel_err(kv, ref_state.kv), rel_err(ks, ref_state.k)), shape, warmup, rep, flops // 2)
    try:
        from solutions.kernels import based_hopper as fast
    except ImportError:                     # a student copy: no reference, no Hopper kernel
        fast = None
    if fast is not None and fast.fast_path_reason(k, v, STATE_SWEEP_SEGMENT) is None:
        rows += _timed_setting(
            f"yaie boundary states (Hopper kernel, Gluon; segment {STATE_SWEEP_SEGMENT})", "based_state",
            lambda: fast.launch_states(k, v, prefix_kv, prefix_k, kv, ks, STATE_SWEEP_SEGMENT),
            lambda: max(rel_err(kv, ref_state.kv), rel_err(ks, ref_state.k)), shape, warmup, rep, flops // 2)
    for chunk, block_v, warps in CHUNKED_SWEEP:
        rows += _timed_setting(
            f"yaie chunked (registers, chunk {chunk}, BV {block_v}, {warps} warps)", "based_prefill",
            lambda: based._launch_prefill(q, k, v, out, kv, ks, chunk, block_v, warps, None, "registers"),
            lambda: max(rel_err(out, ref_out), rel_err(kv, ref_state.kv)), shape, warmup, rep, flops)
    return rows


def _settle(based, fla, seq: int, seconds: float) -> None:
    """Run the first shape's kernels back to back for ``seconds`` before anything is timed.

    Without it the first length's rows can come out 1.5-4x slow (every implementation, the sweep rows too)
    while the later lengths are steady: the first seconds of timing on the lent GPU are not representative.
    """
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, k = (torch.randn(BATCH, HEADS, seq, FEATURES, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(2))
    v = torch.randn(BATCH, HEADS, seq, VALUE_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    work = [lambda: based.based_prefill(q, k, v)]
    if fla is not None:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        work += [lambda: fla[1](qt, kt, vt)]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for fn in work:
            for _ in range(20):
                fn()
        torch.cuda.synchronize()


def run(args) -> list[Row]:
    based = module(8)
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 30) if quick else (25, 100)
    dtype = DTYPE
    fla, why = load_fla()
    if fla is None:
        print(f"note: flash-linear-attention (fla-core) is not importable ({why}); its rows are skipped. "
              "Install the benchmark extra: pip install -e .[bench]", flush=True)
    rows: list[Row] = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    _settle(based, fla, lengths(quick)[0], 1.0 if quick else WARM_SECONDS)
    for seq in lengths(quick):
        shape = f"b{BATCH} h{HEADS} s{seq} f{FEATURES} dv{VALUE_DIM}"
        q = torch.randn(BATCH, HEADS, seq, FEATURES, device=DEVICE, dtype=dtype, generator=gen)
        k = torch.randn(BATCH, HEADS, seq, FEATURES, device=DEVICE, dtype=dtype, generator=gen)
        v = torch.randn(BATCH, HEADS, seq, VALUE_DIM, device=DEVICE, dtype=dtype, generator=gen)
        flops = based_flops(BATCH, HEADS, seq, VALUE_DIM)

        def ours():
            return based.based_prefill(q, k, v)[0]

        t0 = time.perf_counter()
        out = ours()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        print(f"{shape}: first call {time.perf_counter() - t0:.1f} s (compile)", flush=True)
        ref, _ = based.based_chunked_reference(q[:1].float(), k[:1].float(), v[:1].float())
        errors = {"chunked reference (fp32, sequence 0)": rel_err(out[:1], ref)}
        impls = [("yaie triton", ours),
                 ("yaie triton (output only)", lambda: based.based_prefill(q, k, v, return_state=False)[0])]
        if fla is not None:
            fused_chunk, parallel = fla
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))     # [b, s, h, d] views of the same memory
            impls.append(("fla fused_chunk_based", lambda: fused_chunk(qt, kt, vt)))
            impls.append(("fla parallel_based", lambda: parallel(qt, kt, vt)))
        if hasattr(based, "_launch_segmented"):
            for name, kwargs in ROUTE_VARIANTS:
                variant_out = torch.empty_like(v)
                impls.append((name, lambda kw=kwargs, o=variant_out: (
                    based._launch_segmented(q, k, v, o, based.DEFAULT_SEGMENT, True, **kw), o)[1]))
        for name, fn in impls[2:]:
            try:
                got = fn()
                errors[name] = rel_err(out, got.transpose(1, 2) if name.startswith("fla") else got)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: failed ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
                impls = [i for i in impls if i[0] != name]
        status = "ok" if all(e < 2e-2 for e in errors.values()) else "MISMATCH"
        print("  relative difference of yaie to " + ", ".join(f"{n}: {e:.1e}" for n, e in errors.items())
              + f" [{status}]", flush=True)
        del out, ref
        # The headline rows in interleaved rounds, each the median of its rounds: a drift of the GPU's
        # speed during the run (seen at the first length) then moves every implementation alike.
        rounds = {name: [] for name, _ in impls}
        for _ in range(ROUNDS):
            for name, fn in impls:
                rounds[name].append(bench_ms(fn, warmup, rep))
        timed = {}
        for name, _ in impls:
            ms = statistics.median(rounds[name])
            timed[name] = ms
            print(f"  {name}: rounds " + ", ".join(f"{t:.4f}" for t in rounds[name]) + " ms", flush=True)
            label = name if status == "ok" or not name.startswith("yaie") else name + " (MISMATCH)"
            rows.append(Row(LESSON, "based_prefill", label, shape, "bf16", ms, flops=flops))
        # The same calls recorded in CUDA graphs: GPU time alone. At 1k tokens an eager call of the route
        # costs the host more than the GPU takes, and the rows above time that too.
        for name, fn in impls:
            if name not in GRAPHED:
                continue
            try:
                ms = bench_ms(graphed(fn), warmup, rep)
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured is reported, not fatal
                print(f"  {name} (CUDA graph): failed ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
                continue
            timed[name + " (CUDA graph)"] = ms
            print(f"  {name} (CUDA graph): {ms:.4f} ms", flush=True)
            rows.append(Row(LESSON, "based_prefill", name + " (CUDA graph)", shape, "bf16", ms, flops=flops))
        rows.extend(_sweep_rows(based, q, k, v, shape, warmup // 2, rep // 2, flops))

        qs, ks, vs = (torch.randn(BATCH, HEADS, seq, 64, device=DEVICE, dtype=dtype, generator=gen) for _ in range(3))
        sdpa_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                           warmup, rep)
        rows.append(Row(LESSON, "based_prefill", "torch SDPA causal (head_dim 64)", shape, "bf16", sdpa_ms,
                        flops=sdpa_flops(BATCH, HEADS, seq, 64)))
        del qs, ks, vs
        line = ", ".join(f"{n} {ms:.3f} ms" for n, ms in timed.items()) + f", SDPA {sdpa_ms:.3f} ms"
        fla_best = min((ms for n, ms in timed.items() if n.startswith("fla") and not n.endswith("(CUDA graph)")),
                       default=None)
        if fla_best is not None:
            line += (f"; yaie vs faster fla: {fla_best / timed['yaie triton']:.2f}x with the state, "
                     f"{fla_best / timed['yaie triton (output only)']:.2f}x output only")
            line += "".join(f", {n}: {fla_best / timed[n]:.2f}x" for n, _ in ROUTE_VARIANTS if n in timed)
        fla_graph = timed.get("fla parallel_based (CUDA graph)")
        if fla_graph is not None:
            line += "; in CUDA graphs, against fla parallel_based: " + ", ".join(
                f"{n[:-len(' (CUDA graph)')]} {fla_graph / ms:.2f}x" for n, ms in timed.items()
                if n.endswith("(CUDA graph)") and not n.startswith("fla"))
        print("  " + line, flush=True)
        del q, k, v
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows
