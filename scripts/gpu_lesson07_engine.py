"""Memory per sequence of the engine serving a telescoping model, measured while it generates.

    python scripts/gpu_lesson07_engine.py --model DIR [--tokens 16384] [--out FILE.json] [--device cuda]

Loads the model as the engine does (:class:`yaie.engine.llm.LLM`, which hands telescoping models to
:func:`yaie.model.telescoping.run_telescoping`), generates greedily with EOS ignored, and records after
1024 and after ``--tokens`` generated tokens (and at a few points between):

* the bytes the sequence's cache holds (keys, values and sizes of every layer);
* ``torch.cuda.memory_allocated()`` above what was allocated before the prompt (on a GPU), or the
  process's resident memory (on a CPU);
* what a full KV cache of the same model would hold at that length (layers x 2 x tokens x kv heads x
  head dim x 2 bytes in bf16), for comparison.

The positions run far past the 256-token training windows: the text is not the point here, the memory is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yaie.engine.llm import LLM  # noqa: E402
from yaie.engine.sampling import SamplingParams  # noqa: E402
from yaie.switch import use_solutions  # noqa: E402


def _rss_bytes() -> int | None:
    """The process's resident memory (Linux), for CPU runs."""
    try:
        import os
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt", default="Once upon a time, there was a little cat named")
    args = parser.parse_args()
    use_solutions("all")
    llm = LLM(args.model, device=args.device)
    cfg = llm.config
    if not cfg.telescoping_capacity:
        raise SystemExit(f"{args.model} is not a telescoping model (no telescoping_capacity in config.json)")
    cuda = llm.device.type == "cuda"
    checkpoints = sorted({1024, 2048, 4096, 8192, args.tokens} & set(range(1, args.tokens + 1)))
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    records = []
    generated = 0
    text = ""
    t0 = time.time()
    for request, piece, _ in llm._run([llm.tokenizer.encode(args.prompt)], [params]):
        text += piece
        generated = len(request.output_ids)
        if generated in checkpoints and not any(r["generated"] == generated for r in records):
            cache = llm.last_caches[0]
            full = cfg.num_layers * 2 * (len(request.prompt_ids) + generated) * cfg.num_kv_heads * cfg.head_dim * 2
            row = dict(generated=generated, entries_per_layer=int(cache.keys[0].shape[0]),
                       cache_bytes=cache.nbytes(), full_kv_cache_bf16_bytes=full,
                       seconds=round(time.time() - t0, 1))
            if cuda:
                torch.cuda.synchronize()
                row["allocated_above_start_bytes"] = torch.cuda.memory_allocated() - base
                row["peak_above_start_bytes"] = torch.cuda.max_memory_allocated() - base
            else:
                row["process_rss_bytes"] = _rss_bytes()
            records.append(row)
            print(json.dumps(row), flush=True)
            if args.out:   # after every record: a run cut short still leaves what it measured
                Path(args.out).write_text(json.dumps(dict(model=str(args.model), records=records), indent=1) + "\n")
    result = dict(model=str(args.model), device=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__, telescoping_capacity=cfg.telescoping_capacity,
                  layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  prompt=args.prompt, generated=generated, records=records, text_start=text[:300])
    print("text:", text[:300].replace("\n", " "), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
