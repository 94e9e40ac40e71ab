"""Prototype tooling (GPU only): the all-layers launch of scripts/decode_layer_gluon.py timed at 1, 2, 4, 8 and 16
layers of the 1.1B shape (each in a CUDA graph, 4 launches per replay, median of 15 replays): the slope is a layer's
cost inside one launch, the intercept the launch and the kernel's start.

    python scripts/decode_layer_scan.py      # on an H100/H200
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import bench_decode_chain as bdc  # noqa: E402
from scripts import decode_layer_gluon  # noqa: E402


def scan(model, settings, counts=(1, 2, 4, 8, 16), reps=4, iters=15):
    if not hasattr(model, "stacked"):
        model.step("one Gluon kernel for all layers, producer warp, split attention")
    rows = []
    for n in counts:
        def run():
            decode_layer_gluon.decode_layers(model.x0, model.res0, model.stacked, model.k_cache, model.v_cache, n,
                                             model.table[0], model.lens, model.positions, model.slots, model.cos,
                                             model.sin, model.buf, model.counters, bdc.EPS, model.sizes,
                                             WS=True, SPLIT=True, **settings)
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                run()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
        rows.append((n, sorted(times)[iters // 2]))
    x = torch.tensor([float(n) for n, _ in rows])
    y = torch.tensor([t for _, t in rows])
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    print(f"{settings}: " + ", ".join(f"{n} layers {t:.1f} us" for n, t in rows)
          + f"; a layer {slope:.2f} us, the rest {(y.mean() - slope * x.mean()):.1f} us")


if __name__ == "__main__":
    torch.manual_seed(0)
    m = bdc.Model("cuda", torch.bfloat16, *bdc.SIZES["1b"])
    print(torch.cuda.get_device_name())
    for _ in range(2):
        scan(m, {})
        scan(m, dict(FUSE=True, S=3, NB=8))
