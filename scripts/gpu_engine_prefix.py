"""Automatic prefix caching on the lent GPU: the engine's check, then the shared-system-prompt benchmark.

    OUT=out python scripts/gpu_engine_prefix.py --out "$OUT"                  # on a CUDA GPU
    python scripts/gpu_engine_prefix.py --out /tmp/x --device cpu --size tiny --system-len 64 --requests 6
                                                                             # a dry run of this script

1. Check (float32, a random Llama checkpoint, prompts sharing a long prefix, block size 16): greedy ids of
   the engine with prefix caching on equal transformers' and the engine's with caching off; the prefills
   that continue a cached context count as calls of lesson 05's ``prefix_prefill_attention`` (a spy);
   nothing leaks. The same on the bundled model.
2. Benchmark (the ~1.1B random Llama of ``yaie bench engine``, bf16): ``--requests`` requests (64) whose
   prompts are one ``--system-len`` (2048) token system prompt plus ``--unique-len`` (64) tokens of their
   own, ``--new-tokens`` (128) greedy tokens each, end-of-sequence ignored, all submitted at once
   (``LLM.generate``'s loop). With prefix caching off, on, and on without cascade decode (the decode steps
   over the shared prompt then read it once per request), each on its own warm engine, the prefix
   cache emptied before every timed run (a cold cache: the first request computes the system prompt):
   end-to-end time, generated tokens/s, and the time to first token of every request (host clock at the
   step that returned its first token). Median of ``--repeats`` runs. Also, with caching on, new requests
   (new unique tokens) after a run that left the system prompt cached.

Writes ``engine_prefix_caching_<gpu>.json`` and ``.md`` (the table) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")

import solutions.kernels.prefix_prefill as lesson05_kernel  # noqa: E402
from yaie import ops  # noqa: E402
from yaie.bench.engine import CONFIGS, build_model  # noqa: E402
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams, cuda_graphs  # noqa: E402
from yaie.engine.cuda_graphs import SCRATCH_SEQ  # noqa: E402
from yaie.model.testing import hf_greedy, save_random_model  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- 1. check
class Spy:
    """Counts the calls of ``module.name`` while active (the engine looks both spied functions up at call
    time: lesson 05's ``prefix_prefill_attention``, and the ``run`` of the engine's cascade decode backend,
    ``ops.attention_backends.CASCADE_DECODE``)."""

    def __init__(self, module, name: str):
        self.module, self.name, self.calls = module, name, 0
        self.real = getattr(module, name)

    def __enter__(self):
        def spy(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)
        setattr(self.module, self.name, spy)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.real)
        return False


def leak_report(llm) -> dict:
    scheduler = llm.last_core.scheduler
    manager, cache = scheduler.manager, scheduler.prefix_cache
    sequences = [s for s in manager.seq_ids() if s != SCRATCH_SEQ]
    cached = cache.tree.num_evictable_blocks
    free_before = manager.num_free_blocks
    cache.clear()
    return dict(sequences_left=len(sequences), free_plus_cached=free_before + cached,
                free_after_clear=manager.num_free_blocks, usable_blocks=scheduler.usable_blocks)


def check(device: str) -> dict:
    result = {}
    with tempfile.TemporaryDirectory() as folder:
        hf = save_random_model("llama", folder, seed=3, max_position_embeddings=1024).to(device)
        gen = torch.Generator().manual_seed(3)
        # 300 shared tokens: decode steps of the requests that share them run as cascades (256 of them).
        prefix = [1] + torch.randint(3, 96, (299,), generator=gen).tolist()
        prompts = [prefix + torch.randint(3, 96, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        want = [hf_greedy(hf, ids, 12, []) for ids in prompts]
        off = LLM(folder, device=device, dtype=torch.float32, block_size=16, prefix_caching=False)
        got_off = [o.token_ids for o in off.generate(prompts, params)]
        llm = LLM(folder, device=device, dtype=torch.float32, block_size=16)
        with Spy(lesson05_kernel, "prefix_prefill_attention") as spy, Spy(ops.attention_backends.CASCADE_DECODE, "run") as cascade:
            first = llm.generate(prompts[0], params)[0].token_ids      # caches the prefix
            rest = [o.token_ids for o in llm.generate(prompts[1:], params)]
        got_on = [first] + rest
        stats = llm.prefix_cache_stats()
        graphs = llm.last_core.runner.graphs
        result["random_llama_fp32"] = dict(
            transformers_equal=got_on == want, caching_off_equal=got_off == want,
            requests_equal_to_transformers=sum(g == w for g, w in zip(got_on, want)), requests=len(prompts),
            cached_tokens=stats.cached_tokens, prompt_tokens=stats.prompt_tokens,
            prefix_prefill_kernel_calls=spy.calls, cascade_decode_calls=cascade.calls,
            cascade_graphs=sorted(k for k in graphs.graphs if k[2]) if graphs else None,
            cascade_failure=graphs.no_cascade if graphs else None, leaks=leak_report(llm))
    # The bundled model, bf16 (its dtype), a shared story opening: caching on equals caching off.
    opening = "Once upon a time, there was a little girl named Lily. She loved to play outside with her dog. "
    prompts = [opening + e for e in ("One day, she saw", "Her mom said", "The dog ran to", "It was a sunny")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    off = LLM(DEFAULT_MODEL, device=device, block_size=16, prefix_caching=False)
    want = [o.token_ids for o in off.generate(prompts, params)]
    llm = LLM(DEFAULT_MODEL, device=device, block_size=16)
    with Spy(lesson05_kernel, "prefix_prefill_attention") as spy:
        llm.generate(prompts[0], params)
        got = [o.token_ids for o in llm.generate(prompts, params)]
    result["bundled_model"] = dict(caching_off_equal=got == want, requests=len(prompts),
                                   cached_tokens=llm.prefix_cache_stats().cached_tokens,
                                   prefix_prefill_kernel_calls=spy.calls, leaks=leak_report(llm))
    return result


# ----------------------------------------------------------------------------- 2. benchmark
def run_workload(llm, prompts, new_tokens: int, device: str) -> dict:
    """All prompts at once through the engine's loop; end-to-end time, per-request first-token times."""
    params = [SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)] * len(prompts)
    first, outputs = {}, {}
    sync(device)
    start = time.perf_counter()
    for request, _, _, finish_reason in llm._run(prompts, params):
        first.setdefault(request.request_id, time.perf_counter() - start)
        if finish_reason is not None:
            outputs[request.request_id] = list(request.output_ids)
    sync(device)
    total = time.perf_counter() - start
    ttft = sorted(first.values())
    return dict(total_s=total, tokens_per_s=len(prompts) * new_tokens / total,
                ttft_mean_s=statistics.mean(ttft), ttft_median_s=statistics.median(ttft),
                ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))], ttft_max_s=ttft[-1],
                outputs=[outputs[i] for i in range(len(prompts))])


def clear_prefix_cache(llm) -> None:
    core = llm.open_core()                      # the kept runner's prefix cache
    try:
        if core.scheduler.prefix_cache is not None:
            core.scheduler.prefix_cache.clear()
    finally:
        core.close()


def benchmark(args) -> dict:
    dtype = getattr(torch, args.dtype)
    vocab = CONFIGS[args.size]["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(3, vocab, (args.system_len,), generator=gen).tolist()

    def requests():      # the shared system prompt, then unique tokens (new ones on every call)
        return [system + torch.randint(3, vocab, (args.unique_len,), generator=gen).tolist()
                for _ in range(args.requests)]

    prompts = requests()
    default_cascades = cuda_graphs.MAX_CASCADE_LENGTHS
    per_request = -(-(args.system_len + args.unique_len + args.new_tokens) // 16)
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory() as folder:
        build_model(args.size, Path(folder), args.device, dtype)
        modes = (("prefix caching off", False, True), ("prefix caching on", True, True),
                 ("prefix caching on, cascade decode off", True, False))
        for mode, caching, cascade in modes:
            # MAX_CASCADE_LENGTHS = 0: no shared length gets a cascade graph (plain decode graphs only).
            cuda_graphs.MAX_CASCADE_LENGTHS = default_cascades if cascade else 0
            llm = LLM(folder, device=args.device, dtype=dtype, block_size=16, prefix_caching=caching,
                      num_blocks=per_request * args.requests + 64)
            run_workload(llm, prompts, args.new_tokens, args.device)          # warm-up: graphs, tuning
            runs = []
            for _ in range(args.repeats):
                clear_prefix_cache(llm)
                runs.append(run_workload(llm, prompts, args.new_tokens, args.device))
            stats = llm.prefix_cache_stats()
            row = summarize(mode + " (cold cache)", runs)
            row["cached_tokens_last_run"] = (stats.cached_tokens // (args.repeats + 1)) if stats else 0
            graphs = llm.last_core.runner.graphs
            row["cascade_graphs"] = sorted(k for k in graphs.graphs if k[2]) if graphs else []
            rows.append(row)
            outputs[mode] = runs[-1]["outputs"]
            if caching and cascade:   # new requests after a run that cached the system prompt: only their own tokens
                run_workload(llm, requests(), args.new_tokens, args.device)
                warm = [run_workload(llm, requests(), args.new_tokens, args.device) for _ in range(args.repeats)]
                rows.append(summarize(mode + " (system prompt cached by an earlier run)", warm))
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
        cuda_graphs.MAX_CASCADE_LENGTHS = default_cascades
    same = sum(a == b for a, b in zip(outputs["prefix caching off"], outputs["prefix caching on"]))
    return dict(rows=rows, identical_outputs=same, requests=args.requests,
                speedup_tokens_per_s=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"],
                ttft_median_ratio=rows[0]["ttft_median_s"] / rows[1]["ttft_median_s"])


def summarize(name: str, runs: list[dict]) -> dict:
    keys = ("total_s", "tokens_per_s", "ttft_mean_s", "ttft_median_s", "ttft_p90_s", "ttft_max_s")
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    row["system"] = name
    row["totals_s"] = [r["total_s"] for r in runs]
    print(f"{name:>48}: total {row['total_s']:.3f} s, {row['tokens_per_s']:.0f} tok/s, TTFT median "
          f"{row['ttft_median_s'] * 1e3:.0f} ms, p90 {row['ttft_p90_s'] * 1e3:.0f} ms", flush=True)
    return row


def markdown(report: dict) -> str:
    env, work, bench = report["environment"], report["workload"], report.get("benchmark")
    lines = [f"# Engine with automatic prefix caching ({env.get('gpu') or 'CPU'})", "",
             f"Versions: torch {env.get('torch')}, triton {env.get('triton')}; commit {env.get('git_commit')}; "
             f"{env.get('date_utc')}.", f"Command: `{env.get('command')}`", ""]
    chk = report.get("check", {})
    if chk:
        lines += ["## Check (greedy ids)", "", "```", json.dumps(chk, indent=1), "```", ""]
    if bench:
        lines += [f"## Shared system prompt: {work['requests']} requests, {work['system_len']} shared + "
                  f"{work['unique_len']} own prompt tokens, {work['new_tokens']} new tokens each", "",
                  f"Model: random Llama `{work['size']}` ({work['dtype']}), block size 16, all requests submitted "
                  f"at once; median of {work['repeats']} runs after a warm-up.", "",
                  "| engine | total s | generated tokens/s | TTFT median ms | TTFT p90 ms | TTFT max ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in bench["rows"]:
            lines.append(f"| {r['system']} | {r['total_s']:.3f} | {r['tokens_per_s']:.0f} | "
                         f"{r['ttft_median_s'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | "
                         f"{r['ttft_max_s'] * 1e3:.0f} |")
        lines += ["", f"Throughput, caching on / off (cold cache): **{bench['speedup_tokens_per_s']:.2f}x** "
                  "(target >= 3x); median time to first token, off / on: "
                  f"{bench['ttft_median_ratio']:.1f}x. Greedy outputs identical with caching on and off: "
                  f"{bench['identical_outputs']} of {bench['requests']} requests."]
        for r in bench["rows"]:
            if r.get("cascade_graphs"):
                lines.append(f"Cascade decode graphs of \"{r['system']}\" (batch bucket, context bound, shared "
                             f"blocks): {r['cascade_graphs']}.")
    return "\n".join(lines) + "\n"


def add_workload_args(p: argparse.ArgumentParser, new_tokens: int = 128) -> None:
    """The shared-system-prompt workload's options (``scripts/profile_engine.py`` takes them too)."""
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="1b", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--unique-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=new_tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    add_workload_args(p)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args(argv)
    from yaie.bench.harness import environment, gpu_slug
    report = dict(environment=environment(), workload=vars(args).copy())
    failed = False
    if not args.skip_check:
        try:
            report["check"] = check(args.device)
            print(json.dumps(report["check"], indent=1), flush=True)
        except Exception:  # noqa: BLE001 - recorded, the benchmark still runs
            report["check"] = dict(error=traceback.format_exc())
            print(report["check"]["error"], flush=True)
            failed = True
    report["benchmark"] = benchmark(args)
    for row in report["benchmark"]["rows"]:
        row.pop("outputs", None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug() if args.device == "cuda" else "cpu"
    (out / f"engine_prefix_caching_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"engine_prefix_caching_{slug}.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
