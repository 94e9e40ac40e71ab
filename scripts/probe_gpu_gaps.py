"""Probe: where the GPU waits during engine decode (kernel timeline gaps from torch.profiler)."""
import os, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")
from yaie.bench.engine import CONFIGS, build_model  # noqa: E402
from yaie.engine import LLM, SamplingParams  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

size = sys.argv[1] if len(sys.argv) > 1 else "1b"
with tempfile.TemporaryDirectory() as folder:
    build_model(size, Path(folder), "cuda", torch.bfloat16)
    for batch, new in ((64, 256), (1, 256)):
        llm = LLM(folder, device="cuda", dtype=torch.bfloat16, block_size=16, prefix_caching=False,
                  num_blocks=batch * 30 + 64)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, CONFIGS[size]["vocab_size"], (128,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter(); llm.generate(prompts, params); torch.cuda.synchronize(); wall = time.perf_counter() - t0
        ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and "Memcpy" not in e.name and "Memset" not in e.name))
        # the decode region: skip the first 10% of kernels (prefill), up to the end
        ks = ks[len(ks) // 10:]
        busy, gaps, end, prev = 0.0, [], ks[0][0], ks[0][2]
        for s, e, n in ks:
            if s > end:
                gaps.append((s - end, prev, n))
            busy += max(0.0, e - max(s, end))
            if e > end:
                end, prev = e, n
        span = end - ks[0][0]
        big = sorted(gaps, reverse=True)
        print(f"== {size} batch {batch}: wall {wall*1e3:.1f} ms; decode region span {span/1e3:.1f} ms, kernels busy {busy/1e3:.1f} ms ({busy/span:.1%})")
        for lo, hi in ((0, 2), (2, 5), (5, 20), (20, 100), (100, 1e9)):
            sel = [g for g, _, _ in gaps if lo <= g < hi]
            print(f"   gaps {lo}-{hi} us: {len(sel)}, total {sum(sel)/1e3:.2f} ms")
        for g, a, b in big[:8]:
            print(f"   gap {g:.1f} us after {a[:60]} before {b[:60]}")
        del llm
