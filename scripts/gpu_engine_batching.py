"""The batched engine on a CUDA GPU: correctness and spies. One run, one JSON.

    python scripts/gpu_engine_batching.py --out DIR [--device cpu]   (cpu: a dry run of the script)

With the reference solutions, through continuous batching over lesson 03's paged cache:

1. spies: a batched generation calls lesson 02 (norms, RoPE, SiLU), lesson 03 (KVCacheManager),
   lesson 04 (``paged_decode_with_rope``, a decode step's RoPE, cache write and attention in one kernel) and
   lesson 06 (``flash_attention_varlen_forward``, prefill);
2. float32, bundled model: the prompts generated together in ONE ``generate`` call, greedy, equal
   transformers' greedy ids for each prompt alone; again through a cache too small for them all, with
   recompute and with swap preemption (preemptions counted);
3. float32, bundled model: CUDA graphs on (the default on CUDA) give the tokens of graphs off, in two
   calls in a row (the second replays the first's graphs); sections 2 and 4 run with graphs on too, the
   spies (1) with graphs off (a replayed graph calls no Python);
4. float32, a random Llama 3 checkpoint (fresh seed): six random prompts in one call vs transformers;
5. float32, random Mistral and Qwen2 checkpoints with sliding-window layers, CUDA graphs on: vs transformers.

Each section is independent: a failure is recorded and the next runs. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")

from gpu_sections import run_sections  # noqa: E402
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402
from yaie.model.testing import hf_greedy  # noqa: E402

DEVICE = "cuda"
PROMPTS = ["Once upon a time, there was a little fox named",
           "One day, Tom and Mia went to the park. Tom had a blue kite",
           "Lily was afraid of the dark.",
           "Ben found a shiny red ball under the big tree.",
           "The little owl could not sleep."]



def _spy_functions(module, names, calls):
    saved = {n: getattr(module, n) for n in names}
    for n in names:
        @functools.wraps(saved[n])
        def spy(*a, _n=n, **kw):
            calls[_n] += 1
            return saved[_n](*a, **kw)
        setattr(module, n, spy)
    return lambda: [setattr(module, n, f) for n, f in saved.items()]


def section_spies():
    import solutions.kernels.flash_attention as l6
    import solutions.kernels.gpu_elementwise as l2
    import solutions.kernels.kv_cache as l3
    import solutions.kernels.paged_attention as l4
    groups = [(l2, ["rms_norm", "fused_add_rms_norm", "apply_rope_qk_store_kv", "silu_and_mul",
                    "skinny_matmul_silu_and_mul"]),
              (l3.KVCacheManager, ["allocate", "append_slots", "write_kv", "block_table", "free"]),
              (l4, ["paged_attention_forward", "paged_decode_with_rope"]), (l6, ["flash_attention_varlen_forward"])]
    calls = {n: 0 for _, names in groups for n in names}
    restore = [_spy_functions(m, names, calls) for m, names in groups]
    try:
        # Without CUDA graphs: a replayed graph calls no Python, so the spies would miss its steps.
        llm = LLM(DEFAULT_MODEL, device=DEVICE, block_size=16, cuda_graphs=False)
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        steps = llm.last_core.scheduler.stats.steps
    finally:
        for r in restore:
            r()
    layers = llm.config.num_layers
    # A decode step goes to lesson 04 through the fused kernel, so paged_attention_forward itself may not run;
    # the SwiGLU gate runs in silu_and_mul or, for 2 to 64 rows, in the few-row gate/up product's epilogue.
    assert calls["silu_and_mul"] + calls["skinny_matmul_silu_and_mul"], calls
    assert all(n for name, n in calls.items() if name != "paged_attention_forward" and "silu" not in name), calls
    # every layer of every step rotates q, k and writes the cache in one kernel: a decode step's with its
    # attention (the reference serves lessons 02 to 04: yaie.ops.rope_and_paged_attention), another step's
    # alone (yaie.ops.rope_and_write_kv); write_kv itself runs once, in the probe of the class before serving
    rotations = calls["apply_rope_qk_store_kv"] + calls["paged_decode_with_rope"]
    assert rotations == layers * steps and calls["write_kv"] == 1, (calls, steps)
    return dict(calls=calls, steps=steps, layers=layers)


def section_fp32_bundled():
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to(DEVICE).eval()
    results = {}
    for label, options in [("roomy cache", {}),
                           ("tiny cache, recompute", dict(block_size=8, num_blocks=18, preemption="recompute")),
                           ("tiny cache, swap", dict(block_size=8, num_blocks=18, preemption="swap"))]:
        llm = LLM(DEFAULT_MODEL, device=DEVICE, dtype=torch.float32, **options)
        params = [SamplingParams(max_tokens=40 + 8 * i, temperature=0) for i in range(len(PROMPTS))]
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        want = [hf_greedy(hf, llm.tokenizer.encode(p), sp.max_tokens, llm.eos_token_ids)
                for p, sp in zip(PROMPTS, params)]
        scheduler = llm.last_core.scheduler
        stats, manager, graphs = scheduler.stats, scheduler.manager, llm.last_core.runner.graphs
        # Prefix caching (on by default) keeps finished prompts' blocks in the radix tree, unlocked: they count
        # as free. blocks: the ones requests may use (with CUDA graphs the cache has one more, the graphs' scratch).
        cached = scheduler.prefix_cache.tree.num_evictable_blocks if scheduler.prefix_cache else 0
        results[label] = dict(equal=[g == w for g, w in zip(got, want)], tokens=[len(w) for w in want],
                              stats=vars(stats), blocks_free_after=manager.num_free_blocks + cached,
                              blocks=llm.settings.num_blocks,
                              cuda_graph_buckets=sorted(graphs.graphs) if graphs else None,
                              cuda_graph_failure=graphs.failed if graphs else None)
    assert all(all(r["equal"]) for r in results.values()), results
    assert all(r["blocks_free_after"] == r["blocks"] for r in results.values()), results
    if DEVICE == "cuda":     # the batched steps above really replayed graphs
        assert all(r["cuda_graph_buckets"] and r["cuda_graph_failure"] is None for r in results.values()), results
    for label in ("tiny cache, recompute", "tiny cache, swap"):
        s = results[label]["stats"]
        assert s["preempted_by_swap"] + s["preempted_by_recompute"] > 0, results
    return results


def section_graphs_vs_eager():
    """float32, the bundled model: the engine with CUDA graphs gives the tokens it gives without them, for
    5 requests that end at different steps (buckets 8, 4, 2, 1, with padding rows), twice in a row (the
    second call replays the graphs of the first). float32 because the graphs' decode kernel splits the
    context by the whole block table, not by the longest context: another summation order, which in
    bf16 could flip a near-tie between two tokens."""
    params = [SamplingParams(max_tokens=12 + 6 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = LLM(DEFAULT_MODEL, device=DEVICE, dtype=torch.float32, cuda_graphs=False)
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    llm = LLM(DEFAULT_MODEL, device=DEVICE, dtype=torch.float32)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    runner = llm.last_core.runner.graphs
    second = [o.token_ids for o in llm.generate(PROMPTS, params)]
    result = dict(equal_first=[g == w for g, w in zip(first, want)], equal_second=[g == w for g, w in zip(second, want)],
                  buckets=sorted(runner.graphs) if runner else None, failure=runner.failed if runner else None,
                  same_runner=llm.last_core.runner.graphs is runner)
    assert all(result["equal_first"]) and all(result["equal_second"]), result
    if DEVICE == "cuda":
        assert result["buckets"] and result["failure"] is None and result["same_runner"], result
    return result


def _random_model_vs_transformers(kind: str, **overrides) -> dict:
    """float32, a random ``kind`` checkpoint (fresh seed): six random prompts of 4-40 tokens in one call, 24
    greedy tokens each, against transformers' greedy ids for each prompt alone."""
    from yaie.model.testing import save_random_model
    with tempfile.TemporaryDirectory() as d:
        seed = int.from_bytes(os.urandom(4), "little") % 2**31
        hf = save_random_model(kind, d, seed=seed, **overrides).to(DEVICE)
        llm = LLM(d, device=DEVICE, dtype=torch.float32, block_size=8)
        gen = torch.Generator().manual_seed(seed)
        prompts = [[1] + torch.randint(3, 96, (int(n),), generator=gen).tolist()
                   for n in torch.randint(4, 40, (6,), generator=gen)]
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))]
        want = [hf_greedy(hf, ids, 24, [2]) for ids in prompts]
    graphs = llm.last_core.runner.graphs
    return dict(seed=seed, windows=llm.config.sliding_windows, equal=[g == w for g, w in zip(got, want)],
                tokens=[len(w) for w in want], cuda_graph_buckets=sorted(graphs.graphs) if graphs else None,
                cuda_graph_failure=graphs.failed if graphs else None)


def section_fp32_random():
    result = _random_model_vs_transformers("llama3")
    assert all(result["equal"]), result
    return result


def section_fp32_windowed():
    """float32, random models with sliding-window layers (window 8, so most prompts are longer than it): a
    Mistral (every layer windowed) and a Qwen2 whose layer 0 sees everything. With CUDA graphs on (the
    default), the windowed layers decode through lesson 04 (task 4) and prefill through lesson 06 (task 5)
    with their window."""
    results = {"mistral": _random_model_vs_transformers("mistral"),
               "qwen2": _random_model_vs_transformers("qwen2", use_sliding_window=True, sliding_window=8,
                                                      max_window_layers=1)}
    assert all(all(r["equal"]) for r in results.values()), results
    if DEVICE == "cuda":
        assert all(r["cuda_graph_buckets"] and r["cuda_graph_failure"] is None for r in results.values()), results
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    sections = [("spies", section_spies), ("fp32_bundled_batched", section_fp32_bundled),
                ("fp32_graphs_vs_eager", section_graphs_vs_eager),
                ("fp32_random_llama3_batched", section_fp32_random),
                ("fp32_random_sliding_window_graphs", section_fp32_windowed)]
    return run_sections(sections, DEVICE, Path(args.out) / "engine_batching_check.json", print_chars=2000)


if __name__ == "__main__":
    sys.exit(main())
