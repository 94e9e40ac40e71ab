"""The load test of scripts/gpu_serve_based.sh: yaie serve over a Based model beside offline LLM.generate.

    python scripts/gpu_serve_based_load.py OUT DEVICE MODEL_DIR     # LEVELS, REQUESTS, PROMPT_LEN, NEW_TOKENS from the env

C streaming clients per level (``LEVELS``, default 1,16,64), ``REQUESTS`` each one after the other (default 2),
``PROMPT_LEN`` random token ids (default 128), ``NEW_TOKENS`` generated greedily with end-of-sequence ignored
(default 128), through :func:`yaie.bench.serve.run_clients`; offline: the same requests through
``LLM.generate`` (:func:`yaie.bench.serve.run_offline`). The server has as many rows as the largest level.
Writes ``OUT/serve_based_<gpu>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from yaie.bench.harness import environment, gpu_slug
from yaie.bench.serve import ServerProcess, run_clients, run_offline
from yaie.engine import LLM


def main(out: Path, device: str, model: str) -> None:
    levels = [int(c) for c in os.environ.get("LEVELS", "1,16,64").split(",")]
    per_client, prompt_len = int(os.environ.get("REQUESTS", "2")), int(os.environ.get("PROMPT_LEN", "128"))
    new_tokens = int(os.environ.get("NEW_TOKENS", "128"))
    gen = torch.Generator().manual_seed(1)

    def prompts(n):
        return [torch.randint(3, 1000, (prompt_len,), generator=gen).tolist() for _ in range(n)]

    work = {c: (prompts(c * per_client), prompts(c)) for c in levels}     # (measured, warm-up round)
    llm = LLM(model, device=device, max_num_seqs=max(levels))
    offline = {c: run_offline(llm, *work[c], new_tokens, device) for c in levels}
    del llm
    rows = []
    with ServerProcess(model, ["--device", device, "--max-num-seqs", str(max(levels))]) as server:
        for c in levels:
            served = run_clients(server.url, Path(model).name, *work[c], new_tokens, 120, 8)
            row = dict(concurrency=c, offline_tokens_per_s=offline[c]["tokens_per_s"],
                       **{f"served_{k}": v for k, v in served.items()})
            row["overhead"] = 1 - served["tokens_per_s"] / offline[c]["tokens_per_s"]
            rows.append(row)
            print(f"C={c:<3d} served {served['tokens_per_s']:9.1f} tok/s  offline {offline[c]['tokens_per_s']:9.1f} "
                  f"tok/s  overhead {100 * row['overhead']:5.1f}%  TTFT p50 {served['ttft_p50_ms']:.1f} ms  "
                  f"ITL p50 {served['itl_p50_ms'] or 0:.2f} ms p99 {served['itl_p99_ms'] or 0:.2f} ms", flush=True)
        metrics = server.metrics()
    report = dict(environment=environment(), model=model, device=device,
                  workload=dict(levels=levels, requests_per_client=per_client, prompt_len=prompt_len,
                                new_tokens=new_tokens, sampling="greedy, ignore_eos", rows=max(levels)),
                  rows=rows, server_metrics_at_end=metrics)
    slug = gpu_slug() if device == "cuda" else "cpu"
    (out / f"serve_based_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
