"""The engine on a CUDA GPU, against Hugging Face transformers on the same GPU. One run, one JSON.

    python scripts/gpu_engine_check.py --out DIR

On CUDA the engine's norms, RoPE and SiLU-and-mul are lesson 02's Triton kernels (reference
solutions here). Generation runs through the paged cache and lessons 04/06 (scripts/gpu_engine_batching.py
checks that); the logit checks below use the one-sequence ContiguousKVCache path (lesson 01 attention).
Checks:

1. spies: a short generation calls lesson 02's rms_norm, fused_add_rms_norm, apply_rope_qk_store_kv (RoPE
   and the cache write in one kernel: the reference serves lessons 02 and 03), and silu_and_mul or the few-row
   gate/up product with the gate in its epilogue;
2. float32: greedy token ids equal transformers' (same GPU, float32) on the bundled model's prompts and
   on random Llama 3 / Qwen2 / Mistral checkpoints;
3. bfloat16 (the bundled checkpoint's dtype): prefill logits of the engine and of transformers, both in
   bf16, each compared with transformers in float32, and how many greedy tokens agree.

Each section is independent: a failure is recorded and the next section runs. Exit status 1 if any failed.
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
from yaie.model.contiguous_cache import ContiguousKVCache  # noqa: E402

DEVICE = "cuda"  # --device cpu runs the same checks on the CPU (a dry run of this script)
PROMPTS = ["Once upon a time, there was a little fox named",
           "One day, Tom and Mia went to the park. Tom had a blue kite",
           "Lily was afraid of the dark."]



def engine_logits(llm, ids):
    cache = ContiguousKVCache.for_model(llm.config, len(ids), llm.model.dtype, llm.device)
    hidden = llm.model.forward(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE), cache)
    return llm.model.logits(hidden)


def section_spies():
    import solutions.kernels.gpu_elementwise as l2
    # The SwiGLU gate runs in lesson 02's silu_and_mul, or, for 2 to 64 rows (this short prompt), in the
    # epilogue of its few-row gate/up product.
    names = ["rms_norm", "fused_add_rms_norm", "apply_rope_qk_store_kv", "silu_and_mul", "skinny_matmul_silu_and_mul"]
    calls = dict.fromkeys(names, 0)
    saved = {n: getattr(l2, n) for n in names}
    try:
        for n in names:
            @functools.wraps(saved[n])
            def spy(*a, _n=n, **kw):
                calls[_n] += 1
                return saved[_n](*a, **kw)
            setattr(l2, n, spy)
        LLM(DEFAULT_MODEL, device=DEVICE).generate("Once", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        for n in names:
            setattr(l2, n, saved[n])
    gates = calls["silu_and_mul"] + calls["skinny_matmul_silu_and_mul"]
    assert gates and all(n for name, n in calls.items() if "silu" not in name), calls
    return calls


def section_fp32_bundled():
    from transformers import AutoModelForCausalLM
    llm = LLM(DEFAULT_MODEL, device=DEVICE, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to(DEVICE).eval()
    results = []
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        want = hf_greedy(hf, ids, 48, llm.eos_token_ids)
        got = llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0))[0]
        results.append(dict(prompt=prompt, equal=got.token_ids == want, tokens=len(want), text=got.text))
    assert all(r["equal"] for r in results), results
    return results


def section_fp32_random():
    from yaie.model.testing import save_random_model
    results = {}
    for kind in ("llama3", "qwen2", "mistral"):
        with tempfile.TemporaryDirectory() as d:
            seed = int.from_bytes(os.urandom(4), "little") % 2**31
            hf = save_random_model(kind, d, seed=seed).to(DEVICE)
            llm = LLM(d, device=DEVICE, dtype=torch.float32)
            ids = [1] + torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
            with torch.no_grad():
                diff = (engine_logits(llm, ids) - hf(torch.tensor([ids], device=DEVICE)).logits[0]).abs().max().item()
            want = hf_greedy(hf, ids, 24, [2])
            got = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
            results[kind] = dict(seed=seed, equal=got == want, tokens=len(want), max_logit_diff=diff)
    assert all(r["equal"] for r in results.values()), results
    return results


def section_bf16_bundled():
    from transformers import AutoModelForCausalLM
    llm = LLM(DEFAULT_MODEL, device=DEVICE, dtype=torch.bfloat16)   # the stored dtype
    hf32 = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to(DEVICE).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.bfloat16).to(DEVICE).eval()
    results = []
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        x = torch.tensor([ids], device=DEVICE)
        with torch.no_grad():
            ref = hf32(x).logits[0].float()
            err_engine = (engine_logits(llm, ids) - ref).abs().max().item()
            err_hf_bf16 = (hf16(x).logits[0].float() - ref).abs().max().item()
        want = hf_greedy(hf16, ids, 48, llm.eos_token_ids)
        got = llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0))[0].token_ids
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        results.append(dict(prompt=prompt, engine_bf16_vs_fp32=err_engine, hf_bf16_vs_fp32=err_hf_bf16,
                            greedy_tokens_agreeing_with_hf_bf16=agree, of=len(want)))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    sections = [("spies", section_spies), ("fp32_bundled", section_fp32_bundled),
                ("fp32_random", section_fp32_random), ("bf16_bundled", section_bf16_bundled)]
    return run_sections(sections, DEVICE, Path(args.out) / "engine_gpu_check.json", print_chars=1500)


if __name__ == "__main__":
    sys.exit(main())
