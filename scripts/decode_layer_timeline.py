"""Prototype tooling (GPU only): where the one-kernel decode layer (scripts/decode_layer_gluon.py, Gluon) spends their time, from %clock64 stamps each program writes at its phase
boundaries (TIMING=True), over the 16 layers of the 1.1B shape of scripts/bench_decode_chain.py, 4 replays.
Also checks the Gluon kernel's q/k/v product and attention outputs against the engine's kernels.

    python scripts/decode_layer_timeline.py      # on an H100/H200
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import bench_decode_chain as bdc  # noqa: E402
from scripts import decode_layer_gluon  # noqa: E402
from solutions.kernels import gpu_elementwise as l02  # noqa: E402
from solutions.kernels import paged_attention as l04  # noqa: E402

# %clock64 counts SM cycles: the H200's and H100's boost clock, 1.98 GHz (the run's log prints nvidia-smi's reading).
CLOCK_GHZ = 1.98
PHASES = {
    decode_layer_gluon: ["A norm", "A q/k/v", "barrier 0", "attention", "barrier 1", "C vector", "C output",
                         "barrier 2", "D norm", "D gate/up", "barrier 3", "E vector", "E down"],
}


def timeline(model, module, settings):
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    names = PHASES[module]
    spans, attention = [], []
    for rep in range(5):
        x, r = model.x0, model.res0
        for n, layer in enumerate(model.layers):
            times = torch.zeros(programs, 16, dtype=torch.int64, device="cuda")
            x, r = module.decode_layer(x, r, layer, model.k_cache[n], model.v_cache[n], model.table[0], model.lens,
                                       model.positions, model.slots, model.cos, model.sin, model.buf, model.counters,
                                       bdc.EPS, model.sizes, times=times, **settings)
            torch.cuda.synchronize()
            if rep == 0:
                continue                     # compile and warm-up
            spans.append(times[:, :len(names) + 1].double().diff(dim=1) / (CLOCK_GHZ * 1e3))
            if module is decode_layer_gluon and not settings.get("SPLIT"):  # the 32 attention programs: loads, wait for the K/V copy, compute
                t = times[:32].double()
                attention.append(torch.stack([t[:, 14] - t[:, 3], t[:, 15] - t[:, 14], t[:, 4] - t[:, 15]], 1)
                                 / (CLOCK_GHZ * 1e3))
    d = torch.stack(spans)                   # [layers x replays, programs, phases]
    print(f"{module.__name__.split('.')[-1]} {settings or ''} (us; over programs: mean, slowest, fastest)")
    for i, name in enumerate(names):
        x = d[:, :, i]
        print(f"  {name:12s} {x.mean():6.2f} {x.max(1).values.median():6.2f} {x.min(1).values.median():6.2f}")
    print(f"  whole layer, mean over programs: {d.sum(2).mean():.2f}")
    if attention:
        a = torch.stack(attention).mean((0, 1)).tolist()
        print(f"  attention programs: q/k/v loads, RoPE and cache write {a[0]:.2f}; wait for the K/V copy {a[1]:.2f};"
              f" the attention itself {a[2]:.2f}")


def check_gluon(model):
    """The Gluon layer's q/k/v product against the engine's, and its attention against lesson 04's kernel."""
    q_size, kv_size, heads, kv_heads, hd = model.sizes
    b = model.buf
    layer = model.layers[0]
    qkv_engine, _ = l02.add_rms_norm_matvec(model.x0, model.res0, layer["n1"], bdc.EPS, layer["qkv"])
    decode_layer_gluon.decode_layer(model.x0, model.res0, model.layers[0], model.k_cache[0], model.v_cache[0],
                                    model.table[0], model.lens, model.positions, model.slots, model.cos, model.sin, b,
                                    model.counters, bdc.EPS, model.sizes)
    qkv = b["qkv"].clone()
    print("q/k/v against the engine's product, relative error:",
          f"{((qkv.float() - qkv_engine.float()).norm() / qkv_engine.float().norm()).item():.2e}")
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    ref = l04.paged_decode_with_rope(q.reshape(1, heads, hd), k.reshape(1, kv_heads, hd), v.reshape(1, kv_heads, hd),
                                     model.cos, model.sin, model.positions, model.k_cache[0].clone(),
                                     model.v_cache[0].clone(), model.slots, model.table, model.lens, bdc.BOUND,
                                     validate=False).float()
    err = (b["attn"].view(1, heads, hd).float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    print(f"attention against lesson 04's kernel, worst head's relative error: {err.max().item():.2e}")


def check_all_layers(model, variant):
    """All 16 layers in one launch under ``variant`` (a name of the chain's VARIANTS) against the same kernel with
    grid barriers only, twice in a row (sums zeroed and flags renewed inside the kernel): the last layer's output's
    relative error."""
    base = "one Gluon kernel for all layers, producer warp, split attention"
    model.step(base)
    expected = model.step(base)[0].float()
    for rep in range(2):
        got = model.step(variant)[0].float()
        print(f"{variant}, run {rep}: relative error {((got - expected).norm() / expected.norm()).item():.2e}")


def timeline_all(model, settings):
    """The 16 layers in one launch: each layer's phases and the barrier between layers, mean over programs and
    layers (the layer barrier over the first 15)."""
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    names = PHASES[decode_layer_gluon] + ["layer barrier"]
    n = len(model.layers)
    if not hasattr(model, "stacked"):
        model.step("one Gluon kernel for all layers, producer warp, split attention")
    spans = []
    for rep in range(5):
        times = torch.zeros(n, programs, 16, dtype=torch.int64, device="cuda")
        decode_layer_gluon.decode_layers(model.x0, model.res0, model.stacked, model.k_cache, model.v_cache, n,
                                         model.table[0], model.lens, model.positions, model.slots, model.cos,
                                         model.sin, model.buf, model.counters, bdc.EPS, model.sizes, times=times,
                                         WS=True, SPLIT=True, **settings)
        torch.cuda.synchronize()
        if rep == 0:
            continue
        t = times.double() / (CLOCK_GHZ * 1e3)
        spans.append(t[:, :, :15].diff(dim=2))              # [layers, programs, 14]
    d = torch.stack(spans)                                  # [reps, layers, programs, 14]
    print(f"all layers in one launch {settings} (us; mean over programs and layers)")
    for i, name in enumerate(names):
        x = d[:, :-1, :, i] if name == "layer barrier" else d[:, :, :, i]
        print(f"  {name:14s} {x.mean():6.2f}")
    print(f"  a layer, with the layer barrier: {d[:, :-1].sum(3).mean():.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    m = bdc.Model("cuda", torch.bfloat16, *bdc.SIZES["1b"])
    print(f"{torch.cuda.get_device_name()}, clock {CLOCK_GHZ:.2f} GHz")
    check_gluon(m)
    check_all_layers(m, "all layers, split attention, down product by input rows")
    timeline(m, decode_layer_gluon, dict(WS=True, SPLIT=True, FUSE=True, S=3, NB=8))
    timeline_all(m, {})
    timeline_all(m, dict(FUSE=True, S=3, NB=8))
