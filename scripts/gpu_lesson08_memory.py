"""Memory per sequence and decode speed of a Based model in the engine (lesson 08), on the lent GPU.

    python scripts/gpu_lesson08_memory.py MODEL_DIR [--out memory.json]

For prompts of 1k and 16k random token ids: the bytes the sequence's :class:`BasedCache` holds (the
tensors it keeps) after the engine's generate call, and again after the prompt plus 64 decode steps run
on a cache of the script's own, timed apart (prefill seconds, decode ms per token; on a GPU also the
peak of allocated memory over what was allocated before). Beside it, the bf16 KV cache a full-attention
model of the same shape (every layer a softmax layer over the whole context) would hold for the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("YAIE_SOLUTIONS", "all")

import torch  # noqa: E402

from yaie.engine.llm import LLM  # noqa: E402
from yaie.engine.sampling import SamplingParams  # noqa: E402
from yaie.model.based import BasedCache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", default=None)
    p.add_argument("--lengths", default="1024,16384")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no GPU memory figures)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if not cuda:
        from yaie.device import prepare_triton
        prepare_triton()
    llm = LLM(args.model, device=args.device)
    cfg = llm.config
    gen = torch.Generator().manual_seed(0)
    rows = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(2, cfg.vocab_size - 64, (n,), generator=gen).tolist()
        # The engine's path: one generate call (prefill, then decode steps) ...
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        engine_bytes = llm.last_caches[0].nbytes()
        # ... and the same two phases timed apart, on a cache of the model's own.
        cache = BasedCache(cfg, llm.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        sync()
        t0 = time.perf_counter()
        hidden = llm.model.forward(torch.tensor(ids, device=llm.device), torch.arange(n, device=llm.device), cache)
        token = llm.model.logits(hidden[-1:]).argmax(-1)
        sync()
        t1 = time.perf_counter()
        for step in range(64):
            hidden = llm.model.forward(token, torch.tensor([n + step], device=llm.device), cache)
            token = llm.model.logits(hidden).argmax(-1)
        sync()
        t2 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        full_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * (n + 64)
        row = dict(prompt_tokens=n, tokens_at_end=len(cache), state_bytes=cache.nbytes(),
                   engine_state_bytes=engine_bytes, peak_extra_allocated_bytes=peak,
                   full_attention_bf16_kv_bytes=full_kv, prefill_seconds=round(t1 - t0, 4),
                   decode_ms_per_token=round(1e3 * (t2 - t1) / 64, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(model=str(args.model), gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
