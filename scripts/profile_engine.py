"""Where the engine's time goes on one workload: host functions (cProfile) and kernels (torch.profiler).

    python scripts/profile_engine.py --out "$OUT"                                   # on a CUDA GPU
    python scripts/profile_engine.py --out /tmp/x --device cpu --size tiny --system-len 64 --requests 4

The workload is the prefix-caching benchmark's (``scripts/gpu_engine_prefix.py``): ``--requests``
prompts of one ``--system-len``-token shared prefix plus ``--unique-len`` tokens of their own, each
generating ``--new-tokens`` greedy tokens, all submitted at once; ``--system-len 0`` gives plain batched
decoding. After a warm-up run (graphs recorded, kernels tuned), one run under cProfile and one under
torch.profiler. Writes ``profile_<name>.txt`` to ``--out``: wall time per step, GPU kernel time per
step, then the top host functions (by own time and by cumulative time) and the top kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")

from scripts.gpu_engine_prefix import add_workload_args  # noqa: E402
from yaie.bench.engine import CONFIGS, build_model  # noqa: E402
from yaie.engine import LLM, SamplingParams  # noqa: E402


def workload(args, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, vocab, (args.system_len,), generator=gen).tolist()
    return [system + torch.randint(3, vocab, (args.unique_len,), generator=gen).tolist()
            for _ in range(args.requests)]


def timed_run(llm, prompts, params, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def profile(args) -> str:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dtype = getattr(torch, args.dtype)
    prompts = workload(args, CONFIGS[args.size]["vocab_size"])
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    lines = [f"workload: {args.requests} requests, {args.system_len} shared + {args.unique_len} own prompt "
             f"tokens, {args.new_tokens} new tokens; size {args.size}, {args.dtype}, device {args.device}, "
             f"prefix caching {'on' if args.prefix_caching else 'off'}"]
    with tempfile.TemporaryDirectory() as folder:
        build_model(args.size, Path(folder), args.device, dtype)
        per_request = -(-(args.system_len + args.unique_len + args.new_tokens) // 16)
        llm = LLM(folder, device=args.device, dtype=dtype, block_size=16, prefix_caching=args.prefix_caching,
                  num_blocks=per_request * args.requests + 64)
        timed_run(llm, prompts, params, args.device)                 # warm-up
        wall = timed_run(llm, prompts, params, args.device)
        steps = llm.last_core.scheduler.stats.steps
        lines.append(f"wall {wall * 1e3:.1f} ms over {steps} steps: {wall * 1e3 / steps:.3f} ms per step")

        profiler = cProfile.Profile()
        profiler.enable()
        timed_run(llm, prompts, params, args.device)
        profiler.disable()
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
            lines += [f"\n== host functions by {key} (cProfile, one run)", text.getvalue()]

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            wall = timed_run(llm, prompts, params, args.device)
        averages = prof.key_averages()
        kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in averages
                        if e.device_type == DeviceType.CUDA)
        lines.append(f"\n== torch.profiler: wall {wall * 1e3:.1f} ms, kernels {kernel_us / 1e3:.1f} ms "
                     f"({kernel_us / 1e3 / steps:.3f} ms per step)")
        sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        lines.append(averages.table(sort_by=sort, row_limit=args.top))
        lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="engine")
    add_workload_args(p, new_tokens=64)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args(argv)
    report = profile(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{args.name}.txt").write_text(report + "\n")
    print(report.splitlines()[0], report.splitlines()[1], sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
