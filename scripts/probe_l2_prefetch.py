"""Probe: does cp.async.bulk.prefetch.L2 bring a weight into L2? Times a one-row product over it cold and prefetched."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_decode_chain import l2_prefetch  # noqa: E402
from solutions.kernels import gpu_elementwise as l02  # noqa: E402

dev = "cuda"
flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
for mb in (8, 16, 32):
    w = torch.randn((mb << 20) // 4096, 2048, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    flat = w.view(torch.uint8).view(-1)
    res = {}
    for mode in ("cold", "prefetched", "cold", "prefetched"):
        times = []
        for _ in range(20):
            flush.add_(1)
            if mode == "prefetched":
                l2_prefetch(flat, flat.numel(), flat, 0)
            torch.cuda._sleep(20000)     # ~10 us: the prefetch lands
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); l02.matvec(x, w); e.record(); e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        res.setdefault(mode, []).append(sorted(times)[10])
    print(f"{mb} MB weight: one-row product cold {res['cold']} us, after an L2 prefetch {res['prefetched']} us")
