"""Lesson 04 under Nsight Compute: the workload that ``scripts/gpu_lesson04_ncu.sh`` profiles.

Runs SDPA's default (cuDNN on the H200) and the solution's paged decode on the same data, at the shapes in
``NCU_SHAPES`` (``batch x kv_heads x context``, comma separated; default two), three calls each after a
warm-up, with the profiler switched on (``cudaProfilerStart``) for the timed calls only, so that ncu run with
``--profile-from-start off`` sees nothing of the set-up. Run alone it only prints the shapes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solutions.kernels import paged_attention as pa  # noqa: E402
from yaie.bench.lesson04 import make_inputs, shape_label  # noqa: E402


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("NCU_SHAPES", "32x8x4096,32x4x4096").split(",")]
    for batch, kv, ctx in shapes:
        q, k, v, k_cache, v_cache, tables, lens = make_inputs(batch, kv, ctx, gen)
        q4 = q.unsqueeze(2)
        splits = pa.choose_num_splits(batch, kv, ctx)
        calls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
                 "yaie": lambda: pa.paged_attention_forward(q, k_cache, v_cache, tables, lens, ctx, validate=False),
                 "yaie_contiguous": lambda: pa.paged_attention_forward(
                     q, k.transpose(1, 2), v.transpose(1, 2),
                     torch.arange(batch, device="cuda", dtype=torch.int32)[:, None], lens, ctx, validate=False)}
        print(shape_label(batch, kv, ctx), "splits", splits, flush=True)
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            print(" ", name, flush=True)
            torch.cuda.profiler.start()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        del q, k, v, k_cache, v_cache, tables, lens
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
