"""Engine decode throughput, and what one decode step costs the host, for this tree and a baseline side by side.

    python scripts/gpu_engine_host.py --out "$OUT" --baseline bench/out/engine_base          # on a CUDA GPU
    python scripts/gpu_engine_host.py --out /tmp/x --baseline DIR --device cpu --size tiny --batches 4,1

``--baseline DIR``: files to lay over a copy of this tree's ``yaie/`` and ``solutions/`` (same relative
paths, e.g. ``DIR/yaie/engine/llm.py`` from ``git show OLD:yaie/engine/llm.py``): the engine to compare
with. Each engine runs in its own process (the baseline from the copy), on the same saved model:

* **throughput** (GPU): the engine rows of ``yaie.bench.engine`` (its ``measure``: B random prompts of
  ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens each, end-of-sequence ignored; median end-to-end
  time, and decode tokens/s from the time without the prefill), for each of ``--batches``;
  then, at the largest batch, torch.profiler over one ``generate``: GPU kernel time per step beside the
  wall time per step (the same when the GPU never waits for the host), and over its prefill alone (the
  run with one new token: the eager steps) with operators by host time. ``--max-num-batched-tokens``
  takes several budgets (e.g. ``2048,8192``): the rows are measured under each (fewer, larger prefill
  steps with a larger one);
* **host time per step** (always on the CPU, so it runs anywhere): the same workload on the tiny model with
  the decode step's forward pass replaced by a fixed logits tensor and the CUDA-graph runner's fixed-buffer
  steps run eagerly (as the CPU tests do): what is left is the engine's own host work (scheduler, KV-cache
  manager, step inputs, token checks). Reported: the median time of one iteration of the decode loop,
  per step and per request, in thread CPU time (other processes on the machine do not count).

Writes ``engine_host.json`` and ``engine_host.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def throughput(args) -> dict:
    """Worker: the engine rows of the benchmark, then the profile at the largest batch."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from yaie.bench.engine import BLOCK_SIZE, CONFIGS, measure, timed
    from yaie.engine import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(1)
    vocab = CONFIGS[args.size]["vocab_size"]
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(max(batches))]
    per_seq = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
    rows = []
    for budget in [int(b) for b in args.max_num_batched_tokens.split(",")]:
        llm = LLM(args.model, device=args.device, dtype=getattr(torch, args.dtype), block_size=BLOCK_SIZE,
                  prefix_caching=False, num_blocks=per_seq * max(batches) + 64, max_num_batched_tokens=budget)
        for batch in batches:
            def engine(n, ids=prompts[:batch]):
                outs = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                assert all(len(o.token_ids) == n for o in outs)
            rows.append(measure("yaie engine", engine, batch, args.new_tokens, args.repeats, args.device)
                        | dict(max_num_batched_tokens=budget))
        if budget != int(args.max_num_batched_tokens.split(",")[-1]):
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
    llm.settings.max_num_batched_tokens = int(args.max_num_batched_tokens.split(",")[0])   # profiled: the first budget
    batch = args.profile_batch or max(batches)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    wall = timed(lambda: llm.generate(prompts[:batch], params), args.device)
    steps = llm.last_core.scheduler.stats.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        outs = llm.generate(prompts[:batch], params)
    averages = prof.key_averages()
    kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in averages if e.device_type == DeviceType.CUDA)
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with profile(activities=activities) as prefill:
        prefill_wall = timed(lambda: llm.generate(prompts[:batch], first), args.device)
    prefill_steps = llm.last_core.scheduler.stats.steps
    return dict(rows=rows, token_ids=[o.token_ids for o in outs],
                profile=dict(batch=batch, steps=steps, wall_ms_per_step=wall * 1e3 / steps,
                             kernel_ms_per_step=kernel_us / 1e3 / steps,
                             table=averages.table(sort_by=sort, row_limit=20),
                             host_table=averages.table(sort_by="self_cpu_time_total", row_limit=30),
                             prefill_steps=prefill_steps, prefill_wall_ms_profiled=prefill_wall * 1e3,
                             prefill_table=prefill.key_averages().table(sort_by="self_cpu_time_total",
                                                                        row_limit=30)))


def host_cost(args) -> dict:
    """Worker: the engine's host time per decode step, the forward pass stubbed (see the module docstring)."""
    import torch

    from yaie.bench.engine import build_model
    from yaie.engine import LLM, SamplingParams
    from yaie.engine.cuda_graphs import DecodeGraphs
    from yaie.engine.launched_step import LaunchedStep

    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        build_model("tiny", Path(folder), "cpu", torch.float32)
        for batch in [int(b) for b in args.batches.split(",")]:
            llm = LLM(folder, device="cpu", block_size=16, prefix_caching=False, num_blocks=batch * 20 + 64)
            llm.settings.cuda_graphs, llm.settings.graph_capture = True, False
            logits = {}

            def fixed_logits(self, buf, bound, cascade=None):
                rows = buf.ids.shape[1]
                if rows not in logits:
                    logits[rows] = torch.randn(rows, llm.config.vocab_size)
                return logits[rows]

            DecodeGraphs._forward = fixed_logits
            stamps = []
            tokens = LaunchedStep.tokens

            def stamped(self):
                stamps.append(time.thread_time())
                return tokens(self)

            LaunchedStep.tokens = stamped
            gen = torch.Generator().manual_seed(1)
            prompts = [torch.randint(3, llm.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
                       for _ in range(batch)]
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            medians = []
            for _ in range(3):
                stamps.clear()
                llm.generate(prompts, params)
                # The last new_tokens - 8 loop iterations: decode steps only (the prefills come first).
                steps = [b - a for a, b in zip(stamps, stamps[1:])][-(args.new_tokens - 8):]
                medians.append(statistics.median(steps))
            LaunchedStep.tokens = tokens
            step_us = 1e6 * min(medians)
            results[batch] = dict(step_us=step_us, per_request_us=step_us / batch)
            print(f"host, batch {batch}: {step_us:.0f} us per decode step, {step_us / batch:.2f} us per request",
                  flush=True)
    return results


def run_worker(tree: Path, mode: str, args, model: str | None) -> dict:
    """Run this script's ``mode`` worker with ``tree`` first on the import path; its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = ([sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--result", result.name,
                    "--device", args.device, "--size", args.size, "--dtype", args.dtype, "--batches", args.batches,
                    "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                    "--repeats", str(args.repeats), "--max-num-batched-tokens", args.max_num_batched_tokens]
                   + (["--profile-batch", str(args.profile_batch)] if args.profile_batch else [])
                   + (["--model", model] if model else []))
        env = dict(os.environ, PYTHONPATH=str(tree), YAIE_SOLUTIONS="all", PYTHONUNBUFFERED="1")
        subprocess.run(command, env=env, check=True, cwd=tree)
        return json.loads(Path(result.name).read_text())


def baseline_tree(overlay: Path, folder: Path) -> Path:
    """A copy of this tree's ``yaie/`` and ``solutions/`` with the files of ``overlay`` laid over it."""
    tree = folder / "baseline"
    for package in ("yaie", "solutions"):
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for path in overlay.rglob("*.py"):
        target = tree / path.relative_to(overlay)
        if not target.exists():
            raise SystemExit(f"--baseline: {path.relative_to(overlay)} is not a file of this tree")
        shutil.copyfile(path, target)
    return tree


def markdown(report: dict) -> str:
    env, work = report["environment"], report["workload"]
    names = list(report["engines"])
    title = "this tree vs a baseline" if report["baseline"] else "this tree"
    lines = [f"# Engine decode throughput and host cost per step, {title} ({env['gpu'] or 'CPU'})", "",
             f"Model `{work['size']}` ({work['dtype']}), B prompts of {work['prompt_len']} random tokens, "
             f"{work['new_tokens']} greedy new tokens each (end-of-sequence ignored), prefix caching off; median of "
             f"{work['repeats']} runs after a warm-up. Baseline: {report['baseline']}.",
             f"Versions: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; commit "
             f"{env['git_commit']}; {env['date_utc']}.",
             f"Command: `{env['command']}`", ""]
    if any(report["engines"][n].get("throughput") for n in names):
        lines += ["| engine | max_num_batched_tokens | batch | total s | prefill + 1 step s | tokens/s (end to end) "
                  "| decode tokens/s |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name in names:
            for r in report["engines"][name].get("throughput", {}).get("rows", []):
                lines.append(f"| {name} | {r.get('max_num_batched_tokens', 2048)} | {r['batch']} | "
                             f"{r['total_s']:.3f} | {r['first_token_s']:.3f} | {r['tokens_per_s']:.0f} | "
                             f"{r['decode_tokens_per_s'] or float('nan'):.0f} |")
        lines += ["", "| engine | batch | steps | wall ms per step | GPU kernels ms per step (torch.profiler) |",
                  "|---|---:|---:|---:|---:|"]
        for name in names:
            p = report["engines"][name].get("throughput", {}).get("profile")
            if p:
                lines.append(f"| {name} | {p['batch']} | {p['steps']} | {p['wall_ms_per_step']:.3f} | "
                             f"{p['kernel_ms_per_step']:.3f} |")
        lines.append("")
    runs = [report["engines"][n].get("throughput", {}).get("token_ids") for n in names]
    if len(runs) == 2 and all(runs):
        lines += [f"Greedy tokens of the profiled batch, {names[0]} vs {names[1]}: "
                  f"{'identical' if runs[0] == runs[1] else 'DIFFERENT'}.", ""]
    if not any(report["engines"][n].get("host") for n in names):
        return "\n".join(lines) + "\n"
    lines += ["Host time of one decode-loop iteration, forward pass stubbed (tiny model on the CPU, thread time):", "",
              "| engine | batch | us per step | us per request per step |", "|---|---:|---:|---:|"]
    for name in names:
        for batch, h in (report["engines"][name]["host"] or {}).items():
            lines.append(f"| {name} | {batch} | {h['step_us']:.0f} | {h['per_request_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--baseline", help="folder of files laid over a copy of this tree (see the docstring)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="64,1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", default="2048", help="the engine's budget; several: 2048,8192")
    p.add_argument("--skip-host", action="store_true", help="no host-time rows (they need no GPU)")
    p.add_argument("--profile-batch", type=int, default=None, help="the batch profiled (default: the largest)")
    p.add_argument("--worker", choices=["throughput", "host"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = throughput(args) if args.worker == "throughput" else host_cost(args)
        Path(args.result).write_text(json.dumps(result))
        return 0
    if not args.out:
        p.error("--out is required")

    import torch

    from yaie.bench.engine import build_model
    from yaie.bench.harness import environment
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        trees = {"this tree": ROOT}
        if args.baseline:
            trees = {"baseline": baseline_tree(Path(args.baseline), folder), **trees}
        build_model(args.size, folder / "model", args.device, getattr(torch, args.dtype))
        engines = {}
        for name, tree in trees.items():
            print(f"== {name}", flush=True)
            engines[name] = dict(throughput=run_worker(tree, "throughput", args, str(folder / "model")),
                                 host=None if args.skip_host else run_worker(tree, "host", args, None))
    env = environment()
    report = dict(environment=env, baseline=args.baseline and sorted(
        str(p.relative_to(args.baseline)) for p in Path(args.baseline).rglob("*.py")),
        workload=dict(size=args.size, dtype=args.dtype, batches=args.batches, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, repeats=args.repeats,
                      max_num_batched_tokens=args.max_num_batched_tokens), engines=engines)
    (out / "engine_host.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "engine_host.md").write_text(markdown(report))
    (out / "engine_host_profile.txt").write_text("".join(
        f"== {name}: top operators by device time, one generate at batch {e['throughput']['profile']['batch']}\n"
        f"{e['throughput']['profile']['table']}\n\n"
        f"== {name}: the same generate, top operators by host time\n{e['throughput']['profile']['host_table']}\n\n"
        f"== {name}: top operators by host time, the prefill alone ({e['throughput']['profile']['prefill_steps']} "
        f"steps, {e['throughput']['profile']['prefill_wall_ms_profiled']:.1f} ms under the profiler)\n"
        f"{e['throughput']['profile']['prefill_table']}\n\n" for name, e in engines.items()))
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
