"""``yaie bench lesson02``: RMSNorm, fused add + RMSNorm, RoPE and SiLU-and-mul beside torch eager and torch.compile.

bf16, hidden 4096 (Llama 3 8B: 32 query heads and 8 KV heads of 128, MLP gate/up halves of 4096 in the
target shapes, plus the model's real intermediate size 14336), 4k, 8k and 16k tokens.

The baselines compute the same function as the lesson's naive references (float32 math, one rounding)
and write to the same place (in place for the fused norm and RoPE): eager PyTorch runs it as a chain of
kernels, ``torch.compile`` (Inductor) fuses it into one generated Triton kernel.

Bytes counted (``Row.bytes_moved``) are the least traffic each op needs: every input element read once,
every output element written once, the weight once, and for RoPE each token's position and the first
half of its cos and sin rows (the rotate-half table repeats its angles). The same count is used for every
implementation, so the GB/s ratio is the speed ratio.

``python -m yaie.bench.lesson02 --sweep`` times the reference kernels under several launch settings
(warps, block sizes): the measurements behind the settings the reference launchers use.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from yaie.bench.harness import Row, bench_ms, rel_err
from yaie.switch import module, uses_reference

LESSON = "lesson02"
HIDDEN = 4096
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
INTERMEDIATE = 14336
MAX_POSITION = 32768
DEVICE = "cuda"     # the CPU smoke test of the course tests sets "cpu" (Triton interpreter)


def token_counts(quick: bool) -> list[int]:
    return [4096] if quick else [4096, 8192, 16384]


def rope_tables(max_position: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin tables (float32), angles computed in float64 as lesson 01 does."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


# ------------------------------------------------------------------ the four cases: inputs, baselines, bytes

class Case:
    """One kernel on one shape: how to make inputs, run each implementation, and count the bytes."""

    kernel: str

    def __init__(self, tokens: int, dtype: torch.dtype, device: str):
        self.tokens, self.dtype, self.device = tokens, dtype, device
        self.generator = torch.Generator(device=device).manual_seed(1234 + tokens)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.device, generator=self.generator)

    @property
    def esize(self) -> int:
        return torch.finfo(self.dtype).bits // 8


class RmsNormCase(Case):
    kernel = "rms_norm"

    def __init__(self, tokens, dtype, device):
        super().__init__(tokens, dtype, device)
        self.x, self.w = self.randn(tokens, HIDDEN), self.randn(HIDDEN)
        self.shape = f"{tokens}x{HIDDEN}"
        self.bytes_moved = (2 * tokens * HIDDEN + HIDDEN) * self.esize

    @staticmethod
    def eager(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    def call(self, fn: Callable) -> Callable[[], object]:
        return lambda: fn(self.x, self.w)

    def check(self, lesson_module) -> float:
        return rel_err(lesson_module.rms_norm(self.x, self.w, 1e-6), self.eager(self.x, self.w))

    def ours(self, lesson_module):
        return lambda: lesson_module.rms_norm(self.x, self.w, 1e-6)


class FusedAddRmsNormCase(Case):
    kernel = "fused_add_rms_norm"

    def __init__(self, tokens, dtype, device):
        super().__init__(tokens, dtype, device)
        self.x, self.res, self.w = self.randn(tokens, HIDDEN), self.randn(tokens, HIDDEN), self.randn(HIDDEN)
        self.shape = f"{tokens}x{HIDDEN}"
        # read x and residual, write residual and x, read the weight
        self.bytes_moved = (4 * tokens * HIDDEN + HIDDEN) * self.esize

    @staticmethod
    def eager(x, res, w):
        res.add_(x)
        x.copy_(RmsNormCase.eager(res, w))
        return x, res

    def call(self, fn: Callable) -> Callable[[], object]:
        return lambda: fn(self.x, self.res, self.w)

    def check(self, lesson_module) -> float:
        x, res = self.x.clone(), self.res.clone()
        ex, eres = self.eager(x.clone(), res.clone(), self.w)
        lesson_module.fused_add_rms_norm(x, res, self.w, 1e-6)
        return max(rel_err(x, ex), rel_err(res, eres))

    def ours(self, lesson_module):
        return lambda: lesson_module.fused_add_rms_norm(self.x, self.res, self.w, 1e-6)


class RopeCase(Case):
    kernel = "apply_rope_qk"

    def __init__(self, tokens, dtype, device):
        super().__init__(tokens, dtype, device)
        # q and k are slices of one fused qkv projection output, as in the engine (strided views).
        self.qkv = self.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.q = self.qkv[:, : Q_HEADS * HEAD_DIM].view(tokens, Q_HEADS, HEAD_DIM)
        self.k = self.qkv[:, Q_HEADS * HEAD_DIM: (Q_HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        self.cos, self.sin = rope_tables(MAX_POSITION, HEAD_DIM, device)
        # A ragged batch of prefills: sequences of 1000 tokens, each starting at position 0.
        self.pos = (torch.arange(tokens, device=device) % 1000).to(torch.int64)
        self.shape = f"{tokens}x({Q_HEADS}+{KV_HEADS})x{HEAD_DIM}"
        qk_elems = tokens * (Q_HEADS + KV_HEADS) * HEAD_DIM
        self.bytes_moved = 2 * qk_elems * self.esize + tokens * 8 + 2 * tokens * (HEAD_DIM // 2) * 4

    @staticmethod
    def _rotate(x, cos, sin, pos):
        half = x.shape[-1] // 2
        xf = x.float()
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        return (xf * c + torch.cat([-xf[..., half:], xf[..., :half]], -1) * s).to(x.dtype)

    @classmethod
    def eager(cls, q, k, cos, sin, pos):
        q.copy_(cls._rotate(q, cos, sin, pos))
        k.copy_(cls._rotate(k, cos, sin, pos))
        return q, k

    def call(self, fn: Callable) -> Callable[[], object]:
        return lambda: fn(self.q, self.k, self.cos, self.sin, self.pos)

    def check(self, lesson_module) -> float:
        saved = self.qkv.clone()
        ref_q, ref_k = self._rotate(self.q, self.cos, self.sin, self.pos), self._rotate(self.k, self.cos, self.sin, self.pos)
        lesson_module.apply_rope_qk(self.q, self.k, self.cos, self.sin, self.pos)
        err = max(rel_err(self.q, ref_q), rel_err(self.k, ref_k))
        untouched = torch.equal(self.qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM:], saved[:, (Q_HEADS + KV_HEADS) * HEAD_DIM:])
        self.qkv.copy_(saved)
        return err if untouched else float("inf")

    def ours(self, lesson_module):
        return lambda: lesson_module.apply_rope_qk(self.q, self.k, self.cos, self.sin, self.pos)


class SiluAndMulCase(Case):
    kernel = "silu_and_mul"

    def __init__(self, tokens, dtype, device, d: int = HIDDEN):
        super().__init__(tokens, dtype, device)
        self.x = self.randn(tokens, 2 * d)
        self.shape = f"{tokens}x{2 * d}"
        self.bytes_moved = 3 * tokens * d * self.esize

    @staticmethod
    def eager(x):
        d = x.shape[-1] // 2
        xf = x.float()
        return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)

    def call(self, fn: Callable) -> Callable[[], object]:
        return lambda: fn(self.x)

    def check(self, lesson_module) -> float:
        return rel_err(lesson_module.silu_and_mul(self.x), self.eager(self.x))

    def ours(self, lesson_module):
        return lambda: lesson_module.silu_and_mul(self.x)


CASES = (RmsNormCase, FusedAddRmsNormCase, RopeCase, SiluAndMulCase)


def _compiled(fn: Callable) -> Callable:
    # dynamic=False: one specialised kernel per shape, Inductor's best case.
    return torch.compile(fn, dynamic=False)


def run(args) -> list[Row]:
    """Time each kernel of lesson 02 beside torch eager and torch.compile; return the rows."""
    quick = bool(getattr(args, "quick", False))
    warmup_ms, rep_ms = (10, 40) if quick else (25, 200)
    dtype, device = torch.bfloat16, DEVICE
    lesson = module(2)
    ours_label = "triton (reference)" if uses_reference(2) else "triton (yours)"
    rows: list[Row] = []
    cases = []
    for tokens in token_counts(quick):
        cases += [cls(tokens, dtype, device) for cls in CASES]
    if not quick:
        cases.append(SiluAndMulCase(4096, dtype, device, d=INTERMEDIATE))
    compiled = {cls.kernel: _compiled(cls.eager) for cls in CASES}
    for case in cases:
        label = f"{case.kernel} {case.shape}"
        impls: list[tuple[str, Callable]] = []
        try:
            err = case.check(lesson)
            print(f"{label}: relative error of {ours_label} vs eager = {err:.2e}", flush=True)
            if not err < 2e-2:
                print(f"  {label}: {ours_label} gives a wrong answer; not timed", flush=True)
            else:
                impls.append((ours_label, case.ours(lesson)))
        except NotImplementedError as exc:
            print(f"  {label}: {exc} -- timing the baselines only", flush=True)
        impls.append(("torch eager", case.call(case.eager)))
        # The ceiling at this size: a plain copy of as many bytes (half read, half written). Short
        # kernels do not reach the bandwidth of the 2 GiB copy that measure_peaks times.
        copy_src = torch.randn(case.bytes_moved // 4, dtype=torch.bfloat16, device=device)
        copy_dst = torch.empty_like(copy_src)
        impls.append(("copy_ of the same bytes", lambda s=copy_src, t=copy_dst: t.copy_(s)))
        impls.append(("torch.compile", case.call(compiled[case.kernel])))
        for impl, fn in impls:
            ms = bench_ms(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
            rows.append(Row(LESSON, case.kernel, impl, case.shape, "bf16", ms, bytes_moved=case.bytes_moved))
            print(f"  {label:40s} {impl:20s} {ms * 1e3:9.1f} us  {rows[-1].gbps:7.0f} GB/s", flush=True)
        del case
    return rows


# ------------------------------------------------------------------ launch-setting sweep (reference kernels)

def sweep(tokens: int = 8192, rep_ms: float = 100) -> list[Row]:
    """Time the reference kernels and the variants of ``lesson02_variants`` under several launch settings.

    bf16, hidden 4096, ``tokens`` rows. Some settings are timed twice: the spread between the two is
    the noise to compare differences with.
    """
    import triton

    from solutions.kernels import gpu_elementwise as ref
    from yaie.bench import lesson02_variants as var

    dtype, device = torch.bfloat16, DEVICE
    rows: list[Row] = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4

    def add(kernel, impl, shape, fn, nbytes):
        try:
            ms = bench_ms(fn, warmup_ms=25, rep_ms=rep_ms)
        except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses is a result too
            print(f"  sweep {kernel:20s} {impl:24s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        rows.append(Row(LESSON, kernel, impl, shape, "bf16", ms, bytes_moved=nbytes))
        print(f"  sweep {kernel:20s} {shape:18s} {impl:34s} {ms * 1e3:8.1f} us {rows[-1].gbps:7.0f} GB/s", flush=True)

    norm = RmsNormCase(tokens, dtype, device)
    out = torch.empty_like(norm.x)
    block = triton.next_power_of_2(HIDDEN)
    for num_warps in (4, 8, 8, 16):
        add("rms_norm", f"ref num_warps={num_warps}", norm.shape,
            lambda nw=num_warps: ref._rms_norm_kernel[(tokens,)](norm.x, norm.w, out, HIDDEN, HIDDEN, HIDDEN, 1e-6,
                                                                 BLOCK_SIZE=block, num_warps=nw),
            norm.bytes_moved)
    add("rms_norm", "evict_first num_warps=8", norm.shape,
        lambda: var.rms_norm_evict_first[(tokens,)](norm.x, norm.w, out, HIDDEN, HIDDEN, HIDDEN, 1e-6,
                                                    BLOCK_SIZE=block, num_warps=8),
        norm.bytes_moved)
    for per_sm, num_warps in ((2, 8), (4, 8), (8, 4), (8, 8)):
        grid = (min(tokens, per_sm * num_sms),)
        add("rms_norm", f"persistent {per_sm}/SM num_warps={num_warps}", norm.shape,
            lambda g=grid, nw=num_warps: var.rms_norm_persistent[g](
                norm.x, norm.w, out, tokens, HIDDEN, HIDDEN, HIDDEN, 1e-6, BLOCK_SIZE=block, num_warps=nw),
            norm.bytes_moved)
    fused = FusedAddRmsNormCase(tokens, dtype, device)
    for num_warps in (4, 8, 16):
        add("fused_add_rms_norm", f"ref num_warps={num_warps}", fused.shape,
            lambda nw=num_warps: ref._fused_add_rms_norm_kernel[(tokens,)](
                fused.x, fused.res, fused.w, HIDDEN, HIDDEN, HIDDEN, 1e-6, BLOCK_SIZE=block, num_warps=nw),
            fused.bytes_moved)
    rope = RopeCase(tokens, dtype, device)
    for num_warps in (2, 4, 4, 8):
        add("apply_rope_qk", f"ref num_warps={num_warps}", rope.shape,
            lambda nw=num_warps: ref._rope_qk_kernel[(tokens,)](
                rope.q, rope.k, rope.cos, rope.sin, rope.pos, rope.q.stride(0), rope.q.stride(1),
                rope.k.stride(0), rope.k.stride(1), rope.cos.stride(0), rope.sin.stride(0),
                Q_HEADS, KV_HEADS, HEAD_DIM // 2, MAX_POSITION,
                BLOCK_Q_HEADS=Q_HEADS, BLOCK_K_HEADS=KV_HEADS, BLOCK_HALF=HEAD_DIM // 2, num_warps=nw),
            rope.bytes_moved)
    silu = SiluAndMulCase(tokens, dtype, device)
    silu_out = torch.empty(tokens, HIDDEN, dtype=dtype, device=device)
    for block_size, num_warps in ((1024, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8)):
        n_blocks = triton.cdiv(HIDDEN, block_size)
        add("silu_and_mul", f"ref flat BLOCK={block_size} nw={num_warps}", silu.shape,
            lambda b=block_size, nw=num_warps, nb=n_blocks: ref._silu_and_mul_kernel[(tokens * nb,)](
                silu.x, silu_out, HIDDEN, 2 * HIDDEN, HIDDEN, nb, BLOCK_SIZE=b, num_warps=nw),
            silu.bytes_moved)
        add("silu_and_mul", f"plain flat BLOCK={block_size} nw={num_warps}", silu.shape,
            lambda b=block_size, nw=num_warps, nb=n_blocks: var.silu_and_mul_plain[(tokens * nb,)](
                silu.x, silu_out, HIDDEN, 2 * HIDDEN, HIDDEN, nb, BLOCK_SIZE=b, num_warps=nw),
            silu.bytes_moved)
    add("silu_and_mul", "rows-first 2-D BLOCK=1024 nw=4", silu.shape,
        lambda: var.silu_and_mul_rows[(tokens, triton.cdiv(HIDDEN, 1024))](
            silu.x, silu_out, HIDDEN, 2 * HIDDEN, HIDDEN, BLOCK_SIZE=1024, num_warps=4),
        silu.bytes_moved)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="lesson 02 launch-setting sweep of the reference kernels")
    parser.add_argument("--sweep", action="store_true", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        from yaie.bench import NO_GPU_MESSAGE
        print(NO_GPU_MESSAGE)
        return 2
    from yaie.bench import harness
    peaks = harness.measure_peaks("cuda")
    rows = [row for tokens in args.tokens for row in sweep(tokens)]
    out_dir = args.out or harness.ROOT / "bench" / "results"
    for path in harness.write_results(f"{LESSON}_sweep_{harness.gpu_slug()}", rows, peaks, out_dir):
        print(f"wrote {path}")
    print(harness.markdown_table(rows, peaks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
