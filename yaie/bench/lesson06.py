"""``yaie bench lesson06``: FlashAttention forward and backward beside torch SDPA's flash backend.

bf16, head dims 128 and 64, 4k to 16k tokens per sequence (16k tokens per batch), causal and not.
FLOP counts are the usual ones: forward ``4 * batch * heads * seq^2 * head_dim`` (two matmuls), backward
2.5 times that (five matmuls: the recomputed scores, dV, dP, dQ, dK), both halved under a causal mask.
The same counts are used for both implementations, so the TFLOP/s ratio is the speed ratio.

Before timing, each shape is checked once against SDPA (the same inputs): a kernel that is fast and
wrong is reported as wrong.
"""

from __future__ import annotations

import torch

from yaie.bench.harness import Row, bench_ms
from yaie.switch import module

LESSON = "lesson06"


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(batch, heads, seq, head_dim): 16k tokens per batch, 2048-wide models (16 x 128 or 32 x 64)."""
    seqs = [4096] if quick else [4096, 8192, 16384]
    out = []
    for head_dim, heads in ((128, 16), (64, 32)):
        for seq in seqs:
            out.append((16384 // seq, heads, seq, head_dim))
    return out


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> int:
    """Forward FLOPs: q k^T and P v, each 2 * seq^2 * head_dim per head; half of it under a causal mask."""
    flops = 4 * batch * heads * seq * seq * head_dim
    return flops // 2 if causal else flops


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _best_configs(fa) -> str:
    """The autotuner's choices of the reference kernels (empty for a student module without them)."""
    tuned = getattr(fa, "_tuned", None)
    if tuned is None:
        return ""
    parts = []
    for kind in ("fwd", "dkdv", "dq"):
        config = getattr(tuned(kind), "best_config", None)
        if config is not None:
            parts.append(f"{kind}: {config}")
    return "; ".join(parts)


def run(args) -> list[Row]:
    fa = module(6)
    quick = bool(getattr(args, "quick", False))
    warmup, rep = (10, 30) if quick else (25, 100)
    dtype = torch.bfloat16
    rows: list[Row] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, seq, head_dim in shapes(quick):
        for causal in (False, True):
            shape = f"b{batch} h{heads} s{seq} d{head_dim}" + (" causal" if causal else "")
            q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, generator=gen)
                             for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)

            def ours():
                return fa.flash_attention(q, k, v, causal=causal)

            def sdpa():
                return _sdpa_flash(q, k, v, causal)

            # Check once (this also compiles and autotunes outside the timed region).
            out_ours, out_sdpa = ours(), sdpa()
            grads_ours = torch.autograd.grad(out_ours, (q, k, v), dout)
            grads_sdpa = torch.autograd.grad(out_sdpa, (q, k, v), dout)
            errors = [_rel_err(out_ours, out_sdpa)] + [_rel_err(a, b) for a, b in zip(grads_ours, grads_sdpa)]
            status = "ok" if max(errors) < 2e-2 else "MISMATCH"
            print(f"{shape}: relative difference to SDPA out/dq/dk/dv = "
                  + ", ".join(f"{e:.1e}" for e in errors) + f" [{status}]", flush=True)
            del grads_ours, grads_sdpa

            fwd_flops = attention_flops(batch, heads, seq, head_dim, causal)
            for impl, fn in (("yaie triton", ours), ("torch SDPA flash", sdpa)):
                with torch.no_grad():
                    fwd_ms = bench_ms(fn, warmup, rep)
                out = fn()
                bwd_ms = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup, rep)
                name = impl if status == "ok" or impl != "yaie triton" else impl + " (MISMATCH)"
                rows.append(Row(LESSON, "flash_attention_forward", name, shape, "bf16", fwd_ms, flops=fwd_flops))
                rows.append(Row(LESSON, "flash_attention_backward", name, shape, "bf16", bwd_ms,
                                flops=int(2.5 * fwd_flops)))
                del out
            del q, k, v, dout, out_ours, out_sdpa
            torch.cuda.empty_cache()
            fwd = [r for r in rows[-4:] if r.kernel.endswith("forward")]
            bwd = [r for r in rows[-4:] if r.kernel.endswith("backward")]
            print(f"  forward  {fwd[0].tflops:6.1f} TFLOP/s vs SDPA {fwd[1].tflops:6.1f} ({fwd[1].ms / fwd[0].ms:.2f}x)\n"
                  f"  backward {bwd[0].tflops:6.1f} TFLOP/s vs SDPA {bwd[1].tflops:6.1f} ({bwd[1].ms / bwd[0].ms:.2f}x)",
                  flush=True)
            configs = _best_configs(fa)
            if configs:
                print(f"  tuned: {configs}", flush=True)
    return rows
