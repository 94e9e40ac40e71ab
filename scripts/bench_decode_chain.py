"""A batch-1 decode step's layers as the engine chains them, timed inside one CUDA graph, under launch variants.

    python scripts/bench_decode_chain.py --out "$OUT"        # on a CUDA GPU -> $OUT/decode_chain_1b_<gpu>.json
    python scripts/bench_decode_chain.py --check             # CPU: every variant once (Triton interpreter)
    python scripts/bench_decode_chain.py --batch 64 --out "$OUT"   # a batch-64 layer (BATCH_VARIANTS)

Shapes (``--size``): the engine benchmark's random 1.1B Llama (hidden 2048, 32 query / 8 KV heads of 64,
SwiGLU 8192, 16 layers) or the Llama-3-8B shape (``SIZES``); bf16, KV blocks of 16 tokens, a context of 192.
One layer is lesson 02's one-row products and lesson 04's fused decode kernel, as ``yaie.model.llama`` runs
them at batch 1 on CUDA:

    qkv, residual = add_rms_norm_matvec(x, residual, input_norm, qkv)
    attn = paged_decode_with_rope(q, k, v, ...)
    x = matvec(attn, o)
    gate_up, residual = add_rms_norm_matvec(x, residual, post_attention_norm, gate_up)
    x = silu_and_mul_matvec(gate_up, down)

Each variant records the layers ``--reps`` times in one graph (distinct weights per layer, 1.9 GB or more,
so every weight comes from memory) and replays it; a row gives the median microseconds per layer over several
replays, and the bytes of the layer's weights at the copy bandwidth measured in the same call.
With ``--batch B`` (B > 1) a layer is the engine's at that batch: lesson 02's add + RMSNorm, cuBLAS's q/k/v
product, lesson 04's fused decode over B sequences of 192 tokens, cuBLAS's output product, add + RMSNorm,
lesson 02's few-row gate/up product with SiLU-and-mul, cuBLAS's down product (``BATCH_VARIANTS``); the roofline
of a variant that runs the attention kernel counts the B sequences' keys and values beside the weights.

Variants differ in how the products and the attention kernel launch (``VARIANTS``); each is checked against
the first. Two leave part of the layer out, to show what bounds it: "engine's products, no attention" (the
products alone) and "one product" (one product per layer over the layer's weight bytes: the same bytes without
the kernel boundaries between the layer's steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yaie.device import prepare_triton  # noqa: E402

if not torch.cuda.is_available():
    prepare_triton()

import triton  # noqa: E402

from solutions.kernels import gpu_elementwise as l02  # noqa: E402
from solutions.kernels import paged_attention as l04  # noqa: E402

BLOCK, CONTEXT = 16, 192
# --size: (hidden, intermediate, layers, heads, KV heads, head dim); the 8B shape with 8 of its 32 layers
# (3.5 GB of weights, still far past the L2 cache).
SIZES = {"1b": (2048, 8192, 16, 32, 8, 64), "8b": (4096, 14336, 8, 32, 8, 128)}
BOUND = 512             # the decode kernel's context bound: the engine's graphs use 512 for contexts up to 512
EPS = 1e-5

# name -> launch settings of the four products: (BLOCK_N, BLOCK_K, num_warps) for qkv (norm), o, gate/up (norm),
# down (SiLU-and-mul prologue); BLOCK_K 0 is the whole row (K) in one tile, -2 half of it. "engine": lesson
# 02's functions as the engine calls them, with their own settings; "attention": False leaves the attention
# kernel out (the output product reads a fixed random row), which shows what the rest of the layer costs;
# "attention": a dict launches lesson 04's kernel with that many context splits ("splits") and those launch
# settings instead of its own choice. "one product": a single one-row product per layer over as many weight
# bytes as the layer's (hidden columns), no attention: what the same bytes cost without kernel boundaries.
VARIANTS = {
    "engine": None,
    "512 / 1024 columns": dict(qkv=(4, 512, 4), o=(4, 1024, 8), gate_up=(4, 512, 4), down=(4, 1024, 8)),
    "whole row": dict(qkv=(4, 0, 4), o=(4, 0, 8), gate_up=(4, 0, 4), down=(4, 1024, 8)),
    "whole row, 8 warps": dict(qkv=(4, 0, 8), o=(4, 0, 8), gate_up=(4, 0, 8), down=(4, 1024, 8)),
    "whole row, 2 rows": dict(qkv=(2, 0, 4), o=(2, 0, 4), gate_up=(2, 0, 4), down=(4, 1024, 8)),
    "half row": dict(qkv=(4, -2, 4), o=(4, -2, 8), gate_up=(4, -2, 4), down=(4, 1024, 8)),
    "whole row, down 2048 columns": dict(qkv=(4, 0, 4), o=(4, 0, 8), gate_up=(4, 0, 4), down=(4, 2048, 8)),
    "engine's products, no attention": dict(engine=True, attention=False),
    "attention in 2 splits": dict(engine=True, attention=dict(splits=2)),
    "attention in 4 splits": dict(engine=True, attention=dict(splits=4)),
    "attention in 8 splits": dict(engine=True, attention=dict(splits=8)),
    "attention in 8 splits, 2 warps": dict(engine=True, attention=dict(splits=8, num_warps=2)),
    "attention, tiles of 32": dict(engine=True, attention=dict(splits=1, TILE_N=32)),
    "attention in 4 splits, tiles of 32": dict(engine=True, attention=dict(splits=4, TILE_N=32)),
    "attention, tiles of 128": dict(engine=True, attention=dict(splits=1, TILE_N=128, num_stages=2)),
    "attention, tiles of 256": dict(engine=True, attention=dict(splits=1, TILE_N=256, num_stages=1)),
    "attention, tiles of 256, 8 warps": dict(engine=True, attention=dict(splits=1, TILE_N=256, num_stages=1,
                                                                            num_warps=8)),
    "one product": dict(engine=True, one_product=True),
}


# Variants of a batched layer (--batch B > 1): the engine's kernels, without the attention kernel, one cuBLAS
# product of B rows over the layer's weight bytes, and lesson 04's kernel under other launch settings.
BATCH_VARIANTS = {
    "engine": {},
    "engine's products, no attention": dict(attention=False),
    "one product": dict(one_product=True),
    "attention, tiles of 32": dict(attention=dict(splits=1, TILE_N=32)),
    "attention, tiles of 32, 4 stages": dict(attention=dict(splits=1, TILE_N=32, num_stages=4)),
    "attention, tiles of 16, 4 stages": dict(attention=dict(splits=1, TILE_N=16, num_stages=4)),
    "attention, 2 warps": dict(attention=dict(splits=1, num_warps=2)),
    "attention, 8 warps": dict(attention=dict(splits=1, num_warps=8)),
    "attention, 2 stages": dict(attention=dict(splits=1, num_stages=2)),
    "attention in 2 splits": dict(attention=dict(splits=2)),
    "attention, tiles of 128": dict(attention=dict(splits=1, TILE_N=128, num_stages=2)),
    "attention, tiles of 256": dict(attention=dict(splits=1, TILE_N=256, num_stages=1)),
    "attention, tiles of 256, 8 warps": dict(attention=dict(splits=1, TILE_N=256, num_stages=1, num_warps=8)),
}


def runs_attention(settings) -> bool:
    """Whether a variant (its ``VARIANTS`` or ``BATCH_VARIANTS`` entry) runs the whole layer, attention included:
    only those are compared with the first variant, and only their roofline counts the keys and values."""
    settings = settings or {}
    return bool(settings.get("attention", True)) and not settings.get("one_product")


def product(prologue, x, weight, out, config, residual=None, norm_weight=None, res_out=None):
    """One one-row product; returns ``(product, new residual or None)``. ``config`` None: lesson 02's function as
    the engine calls it (new tensors, its own settings); else its kernel launched with ``config``'s settings
    into ``out`` (and ``res_out``)."""
    if config is None:
        if prologue == 2:
            return l02.add_rms_norm_matvec(x, residual, norm_weight, EPS, weight)
        return (l02.silu_and_mul_matvec if prologue == 1 else l02.matvec)(x, weight), None
    block_n, block_k, warps = config
    n, k = weight.shape
    if block_k <= 0:
        block_k = triton.next_power_of_2(k) // (-block_k or 1)
    if not torch.cuda.is_available():
        block_k = min(block_k, 64)
    l02._matvec_kernel[((n + block_n - 1) // block_n,)](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight, weight, weight, out,
        out if res_out is None else res_out, n, k, weight.stride(0), EPS, PROLOGUE=prologue, HAS_BIAS=False,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3, **l02._pdl_options(weight.device))
    return out, res_out


class Model:
    def __init__(self, device, dtype, hidden, inter, layers, heads, kv_heads, head_dim, batch=1,
                 one_product=False):
        def w(n, k):
            return torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        self.sizes = (q_size, kv_size, heads, kv_heads, head_dim)
        self.layers = [dict(qkv=w(q_size + 2 * kv_size, hidden), o=w(hidden, q_size), gate_up=w(2 * inter, hidden),
                            down=w(hidden, inter), n1=1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
                            n2=1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype))
                       for _ in range(layers)]
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.layers[0].values())
        # "one product" (only when a chosen variant runs it: as many bytes again): the layer's bytes as one
        # [rows, hidden] matrix, rows a multiple of 128 (cuBLAS takes a slower kernel for a row count that leaves
        # the output's rows unaligned).
        rows = self.weight_bytes // (hidden * dtype.itemsize) // 128 * 128
        for layer in self.layers if one_product else []:
            layer["all"] = w(rows, hidden)
        # The keys and values the attention reads in a step: each sequence's context, K and V.
        self.batch, self.kv_bytes = batch, batch * CONTEXT * 2 * kv_size * dtype.itemsize
        blocks = BOUND // BLOCK       # a block-table row as long as the graphs' context bound
        self.k_cache = torch.randn(layers, batch * blocks, BLOCK, kv_heads, head_dim, device=device, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        self.table = torch.randperm(batch * blocks, device=device, dtype=torch.int32).view(batch, blocks)
        self.lens = torch.full((batch,), CONTEXT, device=device, dtype=torch.int32)
        self.positions = torch.full((batch,), CONTEXT - 1, device=device)
        last = self.table[:, (CONTEXT - 1) // BLOCK].long()
        self.slots = last * BLOCK + (CONTEXT - 1) % BLOCK
        self.cos = torch.randn(4096, head_dim, device=device)
        self.sin = torch.randn(4096, head_dim, device=device)
        self.attn_fixed = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)  # "attention": False
        self.x0 = torch.randn(batch, hidden, device=device, dtype=dtype)
        self.res0 = torch.randn(batch, hidden, device=device, dtype=dtype)
        # Buffers every variant writes (allocated once, outside the graph).
        self.buf = dict(qkv=torch.empty(1, q_size + 2 * kv_size, device=device, dtype=dtype),
                        x=torch.empty(1, hidden, device=device, dtype=dtype),
                        res_a=torch.empty(1, hidden, device=device, dtype=dtype),
                        res_b=torch.empty(1, hidden, device=device, dtype=dtype),
                        gate_up=torch.empty(1, 2 * inter, device=device, dtype=dtype),
                        out=torch.empty(1, hidden, device=device, dtype=dtype))

    def step(self, variant, layers=None):
        """The first ``layers`` layers (all by default) under ``variant``; returns the last one's output and
        residual."""
        v, b = VARIANTS[variant] or dict(engine=True), self.buf
        if v.get("engine"):
            v = dict(dict.fromkeys(("qkv", "o", "gate_up", "down")), **v)
        q_size, kv_size = self.sizes[:2]
        x, residual = self.x0, self.res0
        for n, layer in enumerate(self.layers[:layers]):
            if v.get("one_product"):
                x = l02.matvec(x, layer["all"])[:, :x.shape[1]]
                continue
            qkv, residual = product(2, x, layer["qkv"], b["qkv"], v["qkv"], residual, layer["n1"], b["res_a"])
            q, k, val = qkv.split([q_size, kv_size, kv_size], dim=-1)
            attn = self.attend(v.get("attention", True), n, q, k, val)
            x, _ = product(0, attn.reshape(1, q_size), layer["o"], b["x"], v["o"])
            gate_up, residual = product(2, x, layer["gate_up"], b["gate_up"], v["gate_up"], residual, layer["n2"],
                                        b["res_b"])
            x, _ = product(1, gate_up, layer["down"], b["out"], v["down"])
        return x.clone(), residual.clone()

    def attend(self, attention, n, q, k, v):
        """Layer ``n``'s RoPE, cache write and attention for the step's rows of ``q`` ``[B, heads * head_dim]``
        and ``k``, ``v`` (views of the q/k/v product). ``attention``: True, lesson 04's fused decode as the engine
        calls it; a dict, its kernel in ``attention["splits"]`` splits of the context with the other items as
        launch settings; False, no attention (a fixed random output)."""
        if not attention:
            return self.attn_fixed
        _, _, heads, kv_heads, head_dim = self.sizes
        batch = q.shape[0]
        q, k, v = (q.reshape(batch, heads, head_dim), k.reshape(batch, kv_heads, head_dim),
                   v.reshape(batch, kv_heads, head_dim))
        if attention is True:
            return l04.paged_decode_with_rope(q, k, v, self.cos, self.sin, self.positions, self.k_cache[n],
                                              self.v_cache[n], self.slots, self.table, self.lens, BOUND,
                                              validate=False)
        settings = {key: value for key, value in attention.items() if key != "splits"}
        if not torch.cuda.is_available():
            settings = dict(settings, TILE_N=16, num_warps=1, num_stages=1)
        return l04._launch_decode(q, self.k_cache[n], self.v_cache[n], self.table, self.lens, BOUND, head_dim ** -0.5,
                                  attention["splits"], config=settings,
                                  rope=(k, v, self.cos, self.sin, self.positions, self.slots))

    def step_batched(self, variant, layers=None):
        """:meth:`step` for a batch of ``self.batch`` sequences, under a name of ``BATCH_VARIANTS``."""
        v = BATCH_VARIANTS[variant]
        q_size, kv_size = self.sizes[:2]
        batch, hidden = self.x0.shape
        x, residual = self.x0.clone(), self.res0.clone()     # the add + norm works in place
        for n, layer in enumerate(self.layers[:layers]):
            if v.get("one_product"):
                x = torch.nn.functional.linear(x, layer["all"])[:, :hidden]
                continue
            h, residual = l02.fused_add_rms_norm(x, residual, layer["n1"], EPS)
            q, k, val = torch.nn.functional.linear(h, layer["qkv"]).split([q_size, kv_size, kv_size], dim=-1)
            attn = self.attend(v.get("attention", True), n, q, k, val)
            x = torch.nn.functional.linear(attn.reshape(batch, q_size), layer["o"])
            h, residual = l02.fused_add_rms_norm(x, residual, layer["n2"], EPS)
            # The few-row product takes half precision only; on the CPU check (float32) its reference stands in.
            gate = l02.skinny_matmul_silu_and_mul if h.is_cuda else l02.skinny_matmul_silu_and_mul_reference
            x = torch.nn.functional.linear(gate(h, layer["gate_up"]), layer["down"])
        return x.clone(), residual.clone()

    def run(self, variant, layers=None):
        return (self.step if self.batch == 1 else self.step_batched)(variant, layers)


def copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + written), median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / sorted(times[1:])[5]


def time_variant(model, variant, reps, iters=15) -> float:
    """Microseconds per layer: the model's layers recorded ``reps`` times in one CUDA graph, median of replays."""
    for _ in range(2):
        model.run(variant)                  # compile and warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            model.run(variant)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[iters // 2] / (reps * len(model.layers))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--check", action="store_true", help="tiny shapes, each variant once (CPU interpreter)")
    p.add_argument("--size", choices=SIZES, default="1b")
    p.add_argument("--batch", type=int, default=1, help="sequences a step decodes (B > 1: BATCH_VARIANTS)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="times each variant is timed, interleaved")
    p.add_argument("--variants", default=None,
                   help="names from VARIANTS (BATCH_VARIANTS with --batch > 1), separated by ';' (default: all)")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch must be at least 1, got {args.batch}")
    known = VARIANTS if args.batch == 1 else BATCH_VARIANTS
    names = args.variants.split(";") if args.variants else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(known)}")
    cuda = torch.cuda.is_available() and not args.check
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    shape = SIZES[args.size] if cuda else (64, 96, 2, 4, 2, 16)
    model = Model(device, dtype, *shape, batch=args.batch,
                  one_product=any((known[name] or {}).get("one_product") for name in names))
    # One layer: bf16 products summed in other orders round apart by an ulp, and random layers amplify that.
    expected = model.run(names[0], layers=1)
    for name in names[1:]:
        got = model.run(name, layers=1)
        if not runs_attention(known[name]):
            continue                        # another computation: nothing to compare
        for e, g in zip(expected, got):
            error = ((e.float() - g.float()).norm() / e.float().norm()).item()
            if not error < 1e-2:
                raise SystemExit(f"{name}: differs from {names[0]} by {error:.3g} (relative norm)")
    if not cuda:
        print(f"checked {len(names)} variants against {names[0]} on the CPU (batch {args.batch})")
        return 0
    bandwidth = copy_bandwidth(device)
    at_bandwidth = model.weight_bytes / bandwidth * 1e6
    # A row's roofline: the bytes it reads at the copy bandwidth, the layer's weights and, batched, the
    # sequences' keys and values when the variant runs the attention kernel.
    kv_at_bandwidth = (model.kv_bytes if args.batch > 1 else 0) / bandwidth * 1e6
    times = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            times[name].append(time_variant(model, name, args.reps))
    rows = []
    for name in names:
        us = sorted(times[name])[len(times[name]) // 2]
        roofline = at_bandwidth + (kv_at_bandwidth if runs_attention(known[name]) else 0.0)
        rows.append(dict(variant=name, settings=known[name], us_per_layer=us, all_us=times[name],
                         weights_at_copy_bw_us=at_bandwidth, roofline_us=roofline, fraction_of_copy_bw=roofline / us))
        print(f"{name:32s} {us:7.2f} us/layer  ({roofline / us:.1%} of copy bw; rounds {times[name]})")
    if args.out:
        from yaie.bench.harness import environment, gpu_slug
        Path(args.out).mkdir(parents=True, exist_ok=True)
        batch = f"_b{args.batch}" if args.batch > 1 else ""
        path = Path(args.out) / f"decode_chain_{args.size}{batch}_{gpu_slug()}.json"
        names_of_shape = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim")
        result = dict(command="python scripts/bench_decode_chain.py " + " ".join(argv or sys.argv[1:]),
                      environment=environment(), copy_bandwidth_GBps=bandwidth / 1e9, size=args.size,
                      shape=dict(zip(names_of_shape, shape)), batch=args.batch,
                      layer_weight_MB=model.weight_bytes / 1e6,
                      layer_kv_MB=model.kv_bytes / 1e6 if args.batch > 1 else 0.0,
                      context=CONTEXT, context_bound=BOUND, rows=rows)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
