"""Engine throughput beside Hugging Face transformers ``generate``, same model, same requests, one run.

    python -m yaie.bench.engine --out bench/results            # on a CUDA GPU: the ~1B config, bf16
    python -m yaie.bench.engine --out /tmp/x --size tiny --device cpu   # a dry run of this script

The model is a randomly initialised Llama (``--size 1b``: hidden 2048, 16 layers, 32 query heads over
8 KV heads, SwiGLU 8192, vocabulary 32000, untied embeddings: 1.1B parameters) written once with
``save_pretrained`` and loaded by both. For each batch size B, B prompts of ``--prompt-len`` random
token ids each generate exactly ``--new-tokens`` tokens, greedy (end-of-sequence ignored):

* the engine: ``LLM.generate(prompts, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))``,
  i.e. continuous batching over lesson 03's paged cache, lessons 02 (norms, RoPE, SiLU), 04 (decode)
  and 06 (prefill) on CUDA, the reference solutions; decode steps replayed from CUDA graphs, and again
  with ``cuda_graphs`` off (every kernel launched from Python);
* transformers: ``model.generate(input_ids [B, P], max_new_tokens=N, min_new_tokens=N, do_sample=False)``
  (its default dynamic cache and attention implementation).

Each is timed end to end (host clock around the call, the device synchronised), after a warm-up
call, ``--repeats`` times (the median is reported), and once more with one new token: that run is the
prefill (plus one sampling step), so ``decode tokens/s = B * (N - 1) / (t_total - t_first)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}
COMMON = dict(rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, initializer_range=0.02)


def build_model(size: str, path: Path, device: str, dtype: torch.dtype):
    """A random Llama of ``size`` saved to ``path`` (weights + a word-level tokenizer); returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from yaie.model.testing import write_tokenizer
    config = LlamaConfig(**CONFIGS[size], **COMMON)
    torch.manual_seed(0)
    with torch.device(device):           # initialise on the GPU: seconds instead of a minute on the CPU
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    model.save_pretrained(str(path))
    write_tokenizer(path, config.vocab_size)
    return model


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(name, run, batch, new_tokens, repeats, device):
    """Median end-to-end time of ``run(new_tokens)``, and of ``run(1)`` (prefill + one step)."""
    run(min(new_tokens, 4))                                  # warm-up: compiles, allocates, tunes
    totals = [timed(lambda: run(new_tokens), device) for _ in range(repeats)]
    firsts = [timed(lambda: run(1), device) for _ in range(repeats)]
    total, first = statistics.median(totals), statistics.median(firsts)
    decode = batch * (new_tokens - 1) / (total - first) if total > first else None
    row = dict(system=name, batch=batch, total_s=total, first_token_s=first, totals_s=totals, firsts_s=firsts,
               tokens_per_s=batch * new_tokens / total, decode_tokens_per_s=decode)
    print(f"{name:>14}  B={batch:<3d} total {total:7.3f} s  first {first:6.3f} s  "
          f"{row['tokens_per_s']:9.1f} tok/s  decode {decode or float('nan'):9.1f} tok/s", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="1b", choices=sorted(CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)

    import os
    os.environ.setdefault("YAIE_SOLUTIONS", "all")
    from yaie.bench.harness import environment, gpu_slug
    from yaie.engine import LLM, SamplingParams
    import transformers

    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(1)
    vocab = CONFIGS[args.size]["vocab_size"]
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(max(batches))]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        hf = build_model(args.size, Path(folder), args.device, dtype)
        per_seq_blocks = -(-(args.prompt_len + args.new_tokens) // 16)
        llm = LLM(folder, device=args.device, dtype=dtype, num_blocks=per_seq_blocks * max(batches) + 64)
        params_total = llm.num_parameters()
        for batch in batches:
            ids = prompts[:batch]

            def engine(n, ids=ids):
                outs = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                assert all(len(o.token_ids) == n for o in outs)

            graphs_supported = llm.cuda_graphs
            rows.append(measure("yaie engine", engine, batch, args.new_tokens, args.repeats, args.device))
            if graphs_supported:     # the same engine with every step run eagerly, side by side
                llm.cuda_graphs = False
                rows.append(measure("yaie engine (no CUDA graphs)", engine, batch, args.new_tokens, args.repeats,
                                    args.device))
                llm.cuda_graphs = True
            if args.skip_hf:
                continue
            x = torch.tensor(ids, device=args.device)

            def huggingface(n, x=x):
                with torch.no_grad():
                    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                      min_new_tokens=n, pad_token_id=0)
                assert out.shape[1] == x.shape[1] + n

            rows.append(measure("transformers", huggingface, batch, args.new_tokens, args.repeats, args.device))
    env = environment() | dict(transformers=transformers.__version__)
    report = dict(environment=env, model=dict(size=args.size, parameters=params_total, dtype=args.dtype,
                                              config=CONFIGS[args.size] | COMMON, init="random (seed 0)"),
                  workload=dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, batches=batches,
                                repeats=args.repeats, sampling="greedy, ignore_eos", kv_block_size=16),
                  rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug() if args.device == "cuda" else "cpu"
    (out / f"engine_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"engine_{slug}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    env, model, work = report["environment"], report["model"], report["workload"]
    cfg = model["config"]
    lines = [
        f"# Engine throughput: YAIE vs transformers generate ({env['gpu'] or 'CPU'})", "",
        f"Model: random Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, intermediate "
        f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']} ({model['parameters'] / 1e9:.2f}B parameters), "
        f"{model['dtype']}.",
        f"Workload: B prompts of {work['prompt_len']} random tokens, {work['new_tokens']} new tokens each, "
        f"greedy, end-of-sequence ignored; median of {work['repeats']} timed runs after a warm-up.",
        f"Versions: torch {env['torch']}, triton {env['triton']}, transformers {env.get('transformers')}, "
        f"CUDA {env['cuda']}; commit {env['git_commit']}; {env['date_utc']}.",
        f"Command: `{env['command']}`", "",
        "| system | batch | total s | prefill + 1 step s | tokens/s (end to end) | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        decode = f"{r['decode_tokens_per_s']:.0f}" if r["decode_tokens_per_s"] else "n/a"
        lines.append(f"| {r['system']} | {r['batch']} | {r['total_s']:.3f} | {r['first_token_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {decode} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
