"""Probe: the host's busy time per decode step (step() minus its wait for the tokens) at batch 64, on the GPU."""
import os, sys, tempfile, time, statistics
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")
from yaie.bench.engine import CONFIGS, build_model  # noqa: E402
from yaie.engine import LLM, SamplingParams  # noqa: E402
from yaie.engine.core import EngineCore  # noqa: E402
from yaie.engine.launched_step import LaunchedStep  # noqa: E402

rec = []
orig_step, orig_tokens = EngineCore.step, LaunchedStep.tokens
cur = {}
def step(self, *a, **k):
    cur["w"] = 0.0
    t0 = time.perf_counter(); r = orig_step(self, *a, **k); t1 = time.perf_counter()
    rec.append((t1 - t0, cur["w"]))
    return r
def tokens(self):
    t0 = time.perf_counter(); r = orig_tokens(self); cur["w"] += time.perf_counter() - t0
    return r
EngineCore.step, LaunchedStep.tokens = step, tokens

with tempfile.TemporaryDirectory() as folder:
    build_model("1b", Path(folder), "cuda", torch.bfloat16)
    for batch in (64, 1):
        llm = LLM(folder, device="cuda", dtype=torch.bfloat16, block_size=16, prefix_caching=False,
                  num_blocks=batch * 30 + 64)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 32000, (128,), generator=gen).tolist() for _ in range(batch)]
        for n in (8, 1, 256, 1, 256):
            rec.clear()
            torch.cuda.synchronize(); t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            torch.cuda.synchronize(); wall = time.perf_counter() - t0
            print(f"batch {batch}, {n} tokens: generate {wall * 1e3:.1f} ms, sum of step() {sum(t for t, _ in rec) * 1e3:.1f} ms "
                  f"over {len(rec)} steps; first 12 steps {[round(t * 1e6) for t, _ in rec[:12]]}; last 6 {[round(t * 1e6) for t, _ in rec[-6:]]}", flush=True)
        steady = rec[10:-5]
        total = [t * 1e6 for t, _ in steady]
        busy = [(t - w) * 1e6 for t, w in steady]
        wait = [w * 1e6 for _, w in steady]
        print(f"batch {batch}: steps {len(rec)}; steady {len(steady)}: step() wall median {statistics.median(total):.0f} us, "
              f"waiting for tokens median {statistics.median(wait):.0f} us, host busy median {statistics.median(busy):.0f} "
              f"mean {statistics.mean(busy):.0f} p90 {sorted(busy)[int(.9 * len(busy))]:.0f} max {max(busy):.0f} us; "
              f"steps with no wait (<20 us): {sum(w < 20 for w in wait)}", flush=True)
        del llm
