"""Chunked prefill on a CUDA GPU: the same tokens as whole-prompt prefill, and as transformers. One JSON.

    python scripts/gpu_engine_chunked_check.py --out DIR [--device cpu]   (cpu: a dry run of the script)

float32, the bundled model, the reference solutions, CUDA graphs on (the default on CUDA):

1. chunked prefill with budgets that divide no prompt (7, 37), prefix caching on and off, gives each
   request the greedy ids of the same call with every prompt prefilled whole, and of transformers for the
   prompt alone; the chunks run through lesson 05 (spies count the calls of its prefix-prefill kernel,
   which continues a chunk in a prefill-only step, and of its plan/run attention, which runs the steps that
   mix decodes and chunks);
2. a cache too small for every request (preemption by recompute and swap), chunks of 11: the same ids.

Each section is independent: a failure is recorded and the next runs. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("YAIE_SOLUTIONS", "all")

from gpu_sections import run_sections  # noqa: E402
from yaie import ops  # noqa: E402
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402
from yaie.model.testing import hf_greedy  # noqa: E402

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
         "dog Max. One day, Lily and Max went to the park. They saw a big tree and a small pond. ")
PROMPTS = ["Tom had a red ball.", STORY + "Lily saw a duck in the pond and", "The little owl could not sleep, so",
           STORY * 2 + "Then it started to rain, and", STORY + "Max barked at a cat."]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def generate(device, **options) -> list[list[int]]:
    llm = LLM(DEFAULT_MODEL, device=device, dtype=torch.float32, block_size=16, **options)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)], llm


def section_same_tokens(device):
    from transformers import AutoModelForCausalLM
    whole, llm = generate(device, chunked_prefill=False, prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to(device).eval()
    hf_ids = [hf_greedy(hf, llm.tokenizer.encode(p), PARAMS.max_tokens, []) for p in PROMPTS]
    calls = {"prefix_prefill": 0, "plan_run": 0}
    backends = {"prefix_prefill": ops.attention_backends.PREFIX_PREFILL, "plan_run": ops.attention_backends.PLAN_RUN}
    originals = {name: backend.run for name, backend in backends.items()}

    def spy(name):
        def counted(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return counted

    for name, backend in backends.items():
        backend.run = spy(name)
    result = dict(whole_equals_transformers=whole == hf_ids, runs={})
    try:
        for budget in (7, 37):
            for prefix in (False, True):
                calls.update(prefix_prefill=0, plan_run=0)
                got, _ = generate(device, max_num_batched_tokens=budget, prefix_caching=prefix)
                key = f"budget {budget}, prefix caching {'on' if prefix else 'off'}"
                result["runs"][key] = dict(equal=got == whole, prefix_prefill_calls=calls["prefix_prefill"],
                                           plan_run_calls=calls["plan_run"])
    finally:
        for name, backend in backends.items():
            backend.run = originals[name]
    ok = result["whole_equals_transformers"] and all(r["equal"] for r in result["runs"].values())
    if device == "cuda":
        ok = ok and all(r["prefix_prefill_calls"] + r["plan_run_calls"] > 0 for r in result["runs"].values())
    if not ok:
        raise AssertionError(f"chunked prefill changed the tokens or skipped lesson 05: {result}")
    return result


def section_preemption(device):
    whole, _ = generate(device, chunked_prefill=False, prefix_caching=False)
    result = {}
    for preemption in ("recompute", "swap"):
        got, llm = generate(device, num_blocks=10, preemption=preemption, max_num_batched_tokens=11)
        stats = llm.last_core.scheduler.stats
        result[preemption] = dict(equal=got == whole, preempted=stats.preempted_by_recompute + stats.preempted_by_swap)
        if not (result[preemption]["equal"] and result[preemption]["preempted"]):
            raise AssertionError(f"{preemption}: {result[preemption]}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    sections = [("same_tokens", lambda: section_same_tokens(args.device)),
                ("preemption", lambda: section_preemption(args.device))]
    return run_sections(sections, args.device, Path(args.out) / "engine_chunked_check.json")


if __name__ == "__main__":
    raise SystemExit(main())
