"""Probe: engine decode step time vs the same step's graph replayed back to back (what the host costs)."""
import os, sys, tempfile, time, statistics
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")
from yaie.bench.engine import CONFIGS, build_model  # noqa: E402
from yaie.engine import LLM, SamplingParams  # noqa: E402

size = sys.argv[1] if len(sys.argv) > 1 else "1b"
with tempfile.TemporaryDirectory() as folder:
    build_model(size, Path(folder), "cuda", torch.bfloat16)
    for batch in (64, 1, 16):
        llm = LLM(folder, device="cuda", dtype=torch.bfloat16, block_size=16, prefix_caching=False,
                  num_blocks=batch * 30 + 64)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, CONFIGS[size]["vocab_size"], (128,), generator=gen).tolist() for _ in range(batch)]

        def run(n):
            torch.cuda.synchronize(); t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            torch.cuda.synchronize(); return time.perf_counter() - t
        run(8)
        totals = [run(256) for _ in range(3)]
        c = llm.last_core
        print(f"   256 tokens: steps {c.scheduler.stats.steps}, looked ahead {c.looked_ahead_steps}, prefill steps {c.prefill_steps}")
        firsts = [run(1) for _ in range(3)]
        step_ms = (statistics.median(totals) - statistics.median(firsts)) / 255 * 1e3
        core = llm.last_core
        graphs = core.runner.graphs
        print(f"{size} batch {batch}: engine decode step {step_ms:.3f} ms; looked-ahead steps "
              f"{core.looked_ahead_steps}", flush=True)
        for key in sorted(graphs.graphs):
            graph, logits = graphs.graphs[key]
            if graph is None or isinstance(graph, str) or key[0] < batch:
                continue
            for _ in range(5):
                graph.replay(); logits.argmax(-1)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(100):
                graph.replay(); logits.argmax(-1)
            e.record(); e.synchronize()
            replay_ms = s.elapsed_time(e) / 100
            print(f"   graph {key} replayed back to back + argmax {replay_ms:.3f} ms "
                  f"({1 - replay_ms / step_ms:+.1%} of the engine's step)", flush=True)
            if batch == 64:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        graph.replay(); logits.argmax(-1)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
        del llm, core, graphs
        torch.cuda.empty_cache()
