"""``yaie bench lesson07``: the indexed matmul kernels beside PyTorch gather + matmul.

bf16, h 8 KV heads, e 4 query heads each, d 128, c 256 cache slots, b 1 to 4, l 4096 and 16384. The map is
the real telescoping map of ``(l, c)`` (its buffer has ``n = 2l - c`` rows: l tokens and one merged span per
step after the first c) with its columns in the order :func:`stable_slots` gives them (an entry keeps
its column while it lives: what the model uses); at b 1 also the oldest-first order of task 2 and a random
map over ``n = l`` rows (no neighbouring rows to share).

Four products, each ours (the lesson's Triton kernels) against PyTorch building the gathered
``[b, h, l, c, d]`` tensor and multiplying (the natural eager code; its backward is autograd's):

* ``qk forward``  scores ``[b,l,h,e,c]`` from q ``[b,l,h,e,d]`` and the key buffer;
* ``qk backward`` dq and the key buffer's gradient;
* ``pv forward``  outputs ``[b,l,h,e,d]`` from weights ``[b,l,h,e,c]`` and the value buffer;
* ``pv backward`` dp and the value buffer's gradient.

Peak memory is ``torch.cuda.max_memory_allocated`` during one call, minus what was allocated before it
(the inputs); for the backward rows it covers forward + backward (what a training step of the product
holds). A baseline that runs out of memory is recorded as such. For scale, full causal attention
(lesson 06's FlashAttention, 32 query / 8 KV heads) is timed at the same lengths.

Each shape is checked once against the baseline before timing: fast and wrong is reported as wrong.
Besides the JSON/Markdown/PNG of the harness, ``lesson07_memory_<gpu>.json`` holds the memory figures.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from yaie.bench.harness import Row, bench_ms, gpu_slug, rel_err
from yaie.switch import module

LESSON = "lesson07"
H, E, D, C = 8, 4, 128, 256


def shapes(quick: bool) -> list[tuple[int, int, str]]:
    """(batch, length, map kind)."""
    if quick:
        return [(1, 4096, "telescoping"), (1, 4096, "oldest-first"), (4, 4096, "telescoping")]
    out = [(b, length, "telescoping") for length in (4096, 16384) for b in (1, 4)]
    out += [(2, 4096, "telescoping"), (2, 16384, "telescoping")]
    out += [(1, length, kind) for length in (4096, 16384) for kind in ("oldest-first", "random")]
    return out


# ---------------------------------------------------------------- the baseline: gather, then matmul

def _gathered(buf, index_map):
    """buf[:, M] as [b, h, l, c, d]; unused slots (M >= n) read an appended row of zeros."""
    n = buf.shape[1]
    padded = torch.cat([buf, buf.new_zeros(buf.shape[0], 1, *buf.shape[2:])], dim=1).transpose(1, 2)
    return padded[:, :, index_map.long().clamp(max=n)]


def torch_qk(q, k, index_map):
    """Scores by gathering k[:, M] into [b, h, l, c, d], then one batched matmul."""
    return torch.matmul(q.permute(0, 2, 1, 3, 4), _gathered(k, index_map).transpose(-1, -2)).permute(0, 2, 1, 3, 4)


def torch_pv(p, v, index_map):
    """Outputs by gathering v[:, M] into [b, h, l, c, d], then one batched matmul."""
    return torch.matmul(p.permute(0, 2, 1, 3, 4), _gathered(v, index_map)).permute(0, 2, 1, 3, 4)


def _peak_extra_bytes(fn) -> int | str:
    """Peak allocated bytes during ``fn()`` beyond what was allocated before; 'OOM' if it ran out."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        result = fn()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return int(peak)


def _time(fn, warmup, rep) -> float | None:
    try:
        return bench_ms(fn, warmup, rep)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def run(args) -> list[Row]:
    tele = module(7)
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (5, 20) if quick else (10, 50)
    deadline = time.monotonic() + float(os.environ.get("LESSON07_DEADLINE_S", "1e9"))
    dtype = torch.bfloat16
    rows: list[Row] = []
    memory: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    maps: dict[int, tuple] = {}
    for batch, length, kind in shapes(quick):
        if time.monotonic() > deadline:
            print(f"deadline reached: skipping b{batch} l{length} {kind}", flush=True)
            continue
        if kind in ("telescoping", "oldest-first"):
            if length not in maps:
                index_map, starts, _ = tele.telescoping_index_map(length, C)
                n = starts.numel()
                maps[length] = (tele.stable_slots(index_map, n).cuda(), index_map.cuda(), n)
            stable, oldest_first, n = maps[length]
            index_map = stable if kind == "telescoping" else oldest_first
        else:
            n = length
            index_map = torch.randint(0, n, (length, C), device="cuda", generator=gen, dtype=torch.int32)
        shape = f"b{batch} l{length} h{H} e{E} d{D} c{C} n{n} {kind} map"
        q = torch.randn(batch, length, H, E, D, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(batch, n, H, D, device="cuda", dtype=dtype, generator=gen)
        p = torch.softmax(torch.randn(batch, length, H, E, C, device="cuda", generator=gen), -1).to(dtype)
        d_scores = torch.randn(batch, length, H, E, C, device="cuda", dtype=dtype, generator=gen)
        d_out = torch.randn(batch, length, H, E, D, device="cuda", dtype=dtype, generator=gen)

        products = {
            "qk": (q, k, d_scores, tele.indexed_qk_forward, tele.indexed_qk_backward, torch_qk),
            "pv": (p, k, d_out, tele.indexed_pv_forward, tele.indexed_pv_backward, torch_pv),
        }
        for name, (x, buf, grad, fwd, bwd, base) in products.items():
            # Correctness once (also compiles): ours in bf16 against torch in float32 on the first
            # 1024 positions of batch 0 (the full float32 baseline would not fit at the largest shapes).
            ours_out = fwd(x, buf, index_map)
            ours_grads = bwd(grad, x, buf, index_map)
            cut = min(length, 1024)
            x32, buf32, g32 = x[:1, :cut].float(), buf[:1].float(), grad[:1, :cut].float()
            ref_out = base(x32, buf32, index_map[:cut])
            leaves = [x32.requires_grad_(True), buf32.requires_grad_(True)]
            ref_grads = torch.autograd.grad(base(leaves[0], leaves[1], index_map[:cut]), leaves, g32)
            prefix_grads = bwd(grad[:1, :cut].contiguous(), x[:1, :cut].contiguous(), buf[:1].contiguous(),
                               index_map[:cut])
            errs = [rel_err(ours_out[:1, :cut], ref_out)] + [rel_err(a, b) for a, b in zip(prefix_grads, ref_grads)]
            status = "ok" if max(errs) < 1e-2 else "MISMATCH"
            print(f"{shape} {name}: relative difference to float32 torch (prefix) out/dx/dbuf = "
                  + ", ".join(f"{e:.1e}" for e in errs) + f" [{status}]" + _plan_note(tele, index_map, n), flush=True)
            ours_out = ours_grads = ref_out = ref_grads = prefix_grads = leaves = x32 = buf32 = g32 = None
            torch.cuda.empty_cache()

            def base_fwd():
                return base(x, buf, index_map)

            leaves = [x.detach().clone().requires_grad_(True), buf.detach().clone().requires_grad_(True)]

            def base_train():
                out = base(leaves[0], leaves[1], index_map)
                return torch.autograd.grad(out, leaves, grad)

            def ours_fwd():
                return fwd(x, buf, index_map)

            def ours_bwd():
                return bwd(grad, x, buf, index_map)

            def ours_train():
                return (fwd(x, buf, index_map), bwd(grad, x, buf, index_map))

            label = "yaie triton" + ("" if status == "ok" else f" ({status})")
            with torch.no_grad():
                t_ours_fwd = _time(ours_fwd, warmup, rep)
                t_base_fwd = _time(base_fwd, warmup, rep)
            t_ours_bwd = _time(ours_bwd, warmup, rep)
            # The baseline's backward alone: its forward graph is built once, outside the timing.
            t_base_bwd = out_graph = None
            try:
                out_graph = base(leaves[0], leaves[1], index_map)
                t_base_bwd = _time(lambda: torch.autograd.grad(out_graph, leaves, grad, retain_graph=True),
                                   warmup, rep)
            except torch.OutOfMemoryError:
                pass
            out_graph = None
            torch.cuda.empty_cache()
            with torch.no_grad():
                m_ours_fwd, m_base_fwd = _peak_extra_bytes(ours_fwd), _peak_extra_bytes(base_fwd)
            m_ours_train, m_base_train = _peak_extra_bytes(ours_train), _peak_extra_bytes(base_train)
            del leaves
            torch.cuda.empty_cache()

            for op, t_ours, t_base in (("forward", t_ours_fwd, t_base_fwd), ("backward", t_ours_bwd, t_base_bwd)):
                kernel = f"indexed_{name}_{op}"
                rows.append(Row(LESSON, kernel, label, shape, "bf16", t_ours if t_ours is not None else float("nan")))
                rows.append(Row(LESSON, kernel, "torch gather + matmul", shape, "bf16",
                                t_base if t_base is not None else float("nan")))
            entry = dict(shape=shape, product=name, batch=batch, length=length, n=n, map=kind, status=status,
                         ms=dict(ours_forward=t_ours_fwd, torch_forward=t_base_fwd,
                                 ours_backward=t_ours_bwd, torch_backward=t_base_bwd),
                         peak_extra_bytes=dict(ours_forward=m_ours_fwd, torch_forward=m_base_fwd,
                                               ours_forward_backward=m_ours_train,
                                               torch_forward_backward=m_base_train))
            memory.append(entry)

            def ratio(a, b):
                return f"{a / b:.1f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "n/a"

            def mib(x):
                return f"{x / 2**20:.0f} MiB" if isinstance(x, int) else str(x)

            print(f"  {name} forward  ours {t_ours_fwd} ms, torch {t_base_fwd} ms ({ratio(t_base_fwd, t_ours_fwd)} faster); "
                  f"peak {mib(m_ours_fwd)} vs {mib(m_base_fwd)} ({ratio(m_base_fwd, m_ours_fwd)} less)\n"
                  f"  {name} backward ours {t_ours_bwd} ms, torch {t_base_bwd} ms ({ratio(t_base_bwd, t_ours_bwd)} faster); "
                  f"fwd+bwd peak {mib(m_ours_train)} vs {mib(m_base_train)} ({ratio(m_base_train, m_ours_train)} less)",
                  flush=True)
        del q, k, p, d_scores, d_out
        torch.cuda.empty_cache()

        if kind == "random" and time.monotonic() < deadline:
            rows.extend(_full_attention_rows(length, warmup, rep, gen))

    out_dir = Path(args.out) if getattr(args, "out", None) else Path(__file__).resolve().parents[2] / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{LESSON}_memory_{gpu_slug()}.json"
    path.write_text(json.dumps(memory, indent=1))
    summary = out_dir / f"{LESSON}_summary_{gpu_slug()}.md"
    summary.write_text(summary_markdown(memory, torch.cuda.get_device_name(0)))
    print(f"wrote {path}\nwrote {summary}", flush=True)
    return rows


def _plan_note(tele, index_map, n: int) -> str:
    """Which variant of the gather-dot and scatter kernels the reference picks for this map (if it says)."""
    plan = getattr(tele, "_blocks_plan", None)
    if plan is None:
        return ""
    block_l, _ = plan(index_map, index_map.clamp(max=n).to(torch.int32), n, E)
    return f"; gather-dot and scatter: {f'blocks of {block_l} positions' if block_l else 'per position'}"


def summary_markdown(memory: list[dict], gpu: str) -> str:
    """Speed-ups and memory savings against gather + matmul, one row per shape and product."""

    def ratio(a, b):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
        return f"{a / b:.1f}x" if ok else "torch OOM" if a == "OOM" or a is None else "-"

    def mib(x):
        return f"{x / 2**20:,.0f}" if isinstance(x, (int, float)) else str(x)

    lines = [f"# lesson 07 on the {gpu}: indexed matmuls against PyTorch gather + matmul", "",
             "bf16; speed-up = torch time / ours (median of `do_bench`); memory = peak allocated during the "
             "call above the inputs (backward rows: forward + backward), MiB; `python -m yaie.cli bench lesson07`.",
             "", "n is the buffer's rows. The telescoping map's buffer has n = 2l - c rows: the l tokens, then one "
             "merged span for every step after the first c (each step past the capacity merges one pair into a "
             "new average), so it is measured at n = 2l - c, not n = l; the random map draws from n = l rows.",
             "", "| shape | product | fwd speed-up | bwd speed-up | fwd peak ours / torch | fwd+bwd peak ours / torch "
             "| fwd+bwd memory saved |", "|---|---|---:|---:|---:|---:|---:|"]
    for m in memory:
        t, p = m["ms"], m["peak_extra_bytes"]
        lines.append(f"| {m['shape']} | {m['product']} | {ratio(t['torch_forward'], t['ours_forward'])} | "
                     f"{ratio(t['torch_backward'], t['ours_backward'])} | {mib(p['ours_forward'])} / "
                     f"{mib(p['torch_forward'])} | {mib(p['ours_forward_backward'])} / "
                     f"{mib(p['torch_forward_backward'])} | "
                     f"{ratio(p['torch_forward_backward'], p['ours_forward_backward'])} |")
    return "\n".join(lines) + "\n"


def _full_attention_rows(length: int, warmup: int, rep: int, gen) -> list[Row]:
    """Lesson 06's causal FlashAttention at the same length and heads (b 1), forward and backward."""
    try:
        fa = module(6)
    except ImportError:
        return []
    shape = f"b1 l{length} h{H} e{E} d{D} full causal"
    q = torch.randn(1, H * E, length, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(1, H, length, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(1, H, length, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    dout = torch.randn_like(q)
    with torch.no_grad():
        t_fwd = _time(lambda: fa.flash_attention(q, k, v, causal=True), warmup, rep)
    out = fa.flash_attention(q, k, v, causal=True)
    t_bwd = _time(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup, rep)
    print(f"  full causal attention (lesson 06) l{length}: forward {t_fwd} ms, backward {t_bwd} ms", flush=True)
    return [Row(LESSON, "full_attention_forward", "lesson 06 flash (causal)", shape, "bf16", t_fwd or float("nan")),
            Row(LESSON, "full_attention_backward", "lesson 06 flash (causal)", shape, "bf16", t_bwd or float("nan"))]
