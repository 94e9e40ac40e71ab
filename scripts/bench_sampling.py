"""The sampling kernel beside the torch sampler, on a CUDA GPU: what a step's sampling costs.

For each vocabulary, batch and setting (greedy, temperature 1.0, top-p 0.95, top-k 50 with top-p 0.9), random
bf16 logits (standard deviation 3): the torch ops (``sample_batch_reference``; for greedy rows ``argmax``) and
the kernel (``sample_rows``), each timed two ways:

* ``gpu_us``: ``triton.testing.do_bench``'s median, L2 cleared before each call (the kernels' time);
* ``loop_us``: 100 calls back to back between two CUDA events, per call (what the engine sees, where the
  sampler's ops are launched from Python after each step: for many small ops the host's launches set it).

Each row also says on how many rows the two picked the same token (they share the numbers; float32 sums may
move a boundary). Writes ``sampling_<gpu>.json`` and ``.md`` to ``--out``.
    python scripts/bench_sampling.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch
import triton
import triton.testing

from yaie.engine.sampling import SamplingParams, StepTable, noise_key, sample_batch_reference
from yaie.engine.sampling_kernel import sample_rows

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "top-p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "top-k 50, top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}


def loop_us(fn, calls: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def measure(vocab: int, batch: int, name: str, params: SamplingParams) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(vocab + batch)
    logits = (torch.randn(batch, vocab, device="cuda", generator=gen) * 3).bfloat16()
    table = StepTable([params] * batch, [noise_key(i) for i in range(batch)], [0] * batch, vocab,
                      torch.device("cuda"))
    if params.greedy:
        torch_fn = lambda: logits.argmax(dim=-1)                                    # noqa: E731
    else:
        torch_fn = lambda: sample_batch_reference(logits, table)                    # noqa: E731
    kernel_fn = lambda: sample_rows(logits, table.temperature, table.top_k,  # noqa: E731
                                    table.top_p, table.greedy, table.state)
    same = (torch_fn() == kernel_fn()).float().mean().item()
    row = {"vocab": vocab, "batch": batch, "setting": name, "same_tokens": same}
    for label, fn in (("torch", torch_fn), ("kernel", kernel_fn)):
        row[f"{label}_gpu_us"] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1000
        row[f"{label}_loop_us"] = loop_us(fn)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocabs", default="32000,128256")
    p.add_argument("--batches", default="1,16,64,256")
    args = p.parse_args()
    rows = [measure(v, b, name, params) for v in map(int, args.vocabs.split(","))
            for b in map(int, args.batches.split(",")) for name, params in SETTINGS.items()]
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "commit": os.environ.get("YAIE_GIT_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "command": "python scripts/bench_sampling.py --out OUT", "logits": "bf16, N(0, 3^2)"}
    args.out.mkdir(parents=True, exist_ok=True)
    tag = gpu.split()[1].lower() if len(gpu.split()) > 1 else "gpu"
    (args.out / f"sampling_{tag}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# The sampler: torch ops against the kernel ({gpu})", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "| vocab | batch | setting | torch, GPU us | kernel, GPU us | torch, loop us | kernel, loop us | "
             "loop speed-up | same tokens |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['setting']} | {r['torch_gpu_us']:.1f} | "
                     f"{r['kernel_gpu_us']:.1f} | {r['torch_loop_us']:.1f} | {r['kernel_loop_us']:.1f} | "
                     f"{r['torch_loop_us'] / r['kernel_loop_us']:.2f}x | {r['same_tokens']:.0%} |")
    (args.out / f"sampling_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
