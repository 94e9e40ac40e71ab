"""Tensor parallelism on GPUs: greedy ids over 2 ranks against 1, decode speed of the Llama-3-8B shape over
1 and 2 GPUs, and what the step's collectives cost alone. Each part is one command (``scripts/
gpu_tensor_parallel.sh`` runs them in order, each in a process of its own, and ``report`` joins them):

    python -m yaie.bench.tensor_parallel check --out OUT        # random small Llama, bf16: N=2 ids vs N=1
    python -m yaie.bench.tensor_parallel speed --tp 1 --out OUT  # the 8B shape: decode tokens/s at batch 1, 64
    python -m yaie.bench.tensor_parallel collectives --out OUT  # a step's all-reduces + all-gather, 2 GPUs
    python -m yaie.bench.tensor_parallel report --out OUT       # tensor_parallel_<gpu>.{json,md}

``speed``: B prompts of 128 random tokens generate 128 tokens each (greedy, end-of-sequence ignored, prefix
caching off, decode steps from CUDA graphs); timed end to end after a warm-up, and with one new token:
``decode tokens/s = B * 127 / (t_total - t_first)``, a decode step's time ``B / decode tokens/s``
(:func:`yaie.bench.engine.measure`). ``collectives``: one CUDA graph holding what a decode step of the 8B
shape communicates over 2 ranks (65 all-reduces of ``[B, 4096]``: the embedding and 2 per layer; one
all-gather of the ``[B, 128256 / 2]`` logits), replayed; its time over the 2-rank step time is the
collectives' share of a step (an upper bound: inside the engine they overlap nothing, but wait for nothing
either).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, LAYERS, VOCAB = 4096, 32, 128256            # the 8B shape (yaie.bench.engine.CONFIGS["8b"])
CHECK_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=1000, max_position_embeddings=2048)


def check(out: Path) -> dict:
    """Greedy ids of 16 prompts over 2 ranks against 1 rank, bf16, with and without CUDA graphs."""
    from yaie.engine import LLM, SamplingParams
    from yaie.model.testing import save_random_model

    folder = tempfile.mkdtemp()
    save_random_model("llama", folder, seed=0, **CHECK_MODEL)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 300, (16,), generator=gen)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    result = dict(model=CHECK_MODEL, init="save_random_model('llama', seed=0): initializer_range 0.2",
                  dtype="bfloat16", prompts=len(prompts), new_tokens=64, runs={})
    for graphs in (True, False):
        ids = {}
        for n in (1, 2):
            llm = LLM(folder, dtype=torch.bfloat16, tensor_parallel_size=n, cuda_graphs=graphs)
            ids[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            print(f"check: {n} GPU(s), {'CUDA graphs' if graphs else 'eager'}: generated", flush=True)
            llm.close()
            del llm
            torch.cuda.empty_cache()
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ids[1], ids[2])]
        run = dict(identical=sum(f is None for f in firsts), first_divergence=[f for f in firsts if f is not None])
        result["runs"]["cuda_graphs" if graphs else "eager"] = run
        print(f"check ({'CUDA graphs' if graphs else 'eager'}): {run['identical']} of {len(prompts)} sequences "
              f"identical over 2 ranks; divergences at {run['first_divergence']}", flush=True)
    (out / "tp_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def speed(out: Path, tp: int, model_dir: Path, batches: list[int], repeats: int) -> list[dict]:
    """Decode tokens/s of the 8B shape over ``tp`` GPUs at each batch size (rows in ``tp_speed_<tp>.json``)."""
    from yaie.bench.engine import BLOCK_SIZE, build_model, measure
    from yaie.engine import LLM, SamplingParams

    if not (model_dir / "config.json").is_file():
        began = time.perf_counter()
        build_model("8b", model_dir, "cuda", torch.bfloat16)
        torch.cuda.empty_cache()
        print(f"built the random 8B-shaped Llama in {time.perf_counter() - began:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (128,), generator=gen).tolist() for _ in range(max(batches))]
    began = time.perf_counter()
    llm = LLM(model_dir, dtype=torch.bfloat16, tensor_parallel_size=tp, block_size=BLOCK_SIZE, prefix_caching=False,
              max_num_seqs=max(batches), max_num_batched_tokens=8192, num_blocks=max(batches) * 17 + 64)
    started = time.perf_counter() - began
    rows = []
    for batch in batches:
        def run(n, batch=batch):
            llm.generate(prompts[:batch], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        row = measure(f"yaie engine, {tp} GPU(s)", run, batch, 128, repeats, "cuda", warmup=[4, 128])
        row.update(tensor_parallel_size=tp, start_s=started, step_ms=1e3 * batch / row["decode_tokens_per_s"])
        rows.append(row)
        (out / f"tp_speed_{tp}.json").write_text(json.dumps(rows, indent=2) + "\n")
    llm.close()
    return rows


def _collectives_rank(rank: int, init_file: str, batches: list[int], replays: int, result) -> None:
    from yaie.model import parallel

    torch.cuda.set_device(rank)
    parallel.join(rank, 2, init_file, "nccl", 120, 120)
    times = {}
    for batch in batches:
        x = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
        scores = torch.randn(batch, VOCAB // 2, dtype=torch.bfloat16, device="cuda")

        def step():
            for _ in range(2 * LAYERS + 1):
                parallel.all_reduce(x)
            parallel.all_gather_last(scores)
        step()                                                   # the communicator, warm
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
        samples = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times[batch] = statistics.median(samples)
    if rank == 0:
        result.update({str(b): t for b, t in times.items()})
    parallel.leave()
    os._exit(0)                 # (no teardown: the graph holds the communicator's collectives)


def collectives(out: Path, batches: list[int], replays: int = 50) -> dict:
    """Milliseconds of one decode step's collectives over 2 GPUs (a CUDA graph), per batch size."""
    import torch.multiprocessing as mp

    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_collectives_rank, args=(init_file, batches, replays, shared), nprocs=2)
        result = dict(shared)
    report = dict(all_reduces_per_step=2 * LAYERS + 1, all_reduce_shape=["B", HIDDEN],
                  all_gather_shape=["B", VOCAB // 2], dtype="bfloat16", replays=replays, ms_per_step=result)
    print(f"collectives of a decode step over 2 GPUs (ms, by batch): {result}", flush=True)
    (out / "tp_collectives.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def report(out: Path) -> dict:
    """Join what the other commands wrote into ``tensor_parallel_<gpu>.{json,md}``."""
    from yaie.bench.harness import environment, gpu_slug

    def read(name):
        path = out / name
        return json.loads(path.read_text()) if path.is_file() else None

    rows = (read("tp_speed_1.json") or []) + (read("tp_speed_2.json") or [])
    coll = read("tp_collectives.json")
    for row in rows:
        one = next((r for r in rows if r["batch"] == row["batch"] and r["tensor_parallel_size"] == 1), None)
        if one is not None and row["decode_tokens_per_s"]:
            row["speedup_vs_1_gpu"] = row["decode_tokens_per_s"] / one["decode_tokens_per_s"]
        if coll and row["tensor_parallel_size"] == 2 and str(row["batch"]) in coll["ms_per_step"]:
            row["collectives_share"] = coll["ms_per_step"][str(row["batch"])] / row["step_ms"]
    data = dict(environment=environment(), check=read("tp_check.json"), collectives=coll, rows=rows,
                workload=dict(model="random Llama, 8B shape (yaie.bench.engine.CONFIGS['8b']), bfloat16",
                              prompt_len=128, new_tokens=128, sampling="greedy, ignore_eos", prefix_caching=False))
    slug = gpu_slug()
    (out / f"tensor_parallel_{slug}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"tensor_parallel_{slug}.md").write_text(markdown(data))
    return data


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# Tensor parallelism: the Llama-3-8B shape over 1 and 2 GPUs ({env['gpu']})", "",
             f"Versions: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; commit {env['git_commit']}; "
             f"{env['date_utc']}.", "Command: `bash scripts/gpu_tensor_parallel.sh` (each part: `python -m "
             "yaie.bench.tensor_parallel check|speed|collectives|report`).", "",
             "| GPUs | batch | decode tokens/s | step ms | vs 1 GPU | collectives share | start s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(data["rows"], key=lambda r: (r["batch"], r["tensor_parallel_size"])):
        speedup, share = r.get("speedup_vs_1_gpu"), r.get("collectives_share")
        lines.append(f"| {r['tensor_parallel_size']} | {r['batch']} | {r['decode_tokens_per_s']:.0f} | "
                     f"{r['step_ms']:.2f} | {f'{speedup:.2f}x' if speedup else ''} | "
                     f"{f'{share:.0%}' if share is not None else ''} | {r['start_s']:.0f} |")
    if data.get("collectives"):
        lines += ["", f"Collectives alone (a CUDA graph of one step's {data['collectives']['all_reduces_per_step']} "
                      f"all-reduces and 1 all-gather, 2 GPUs), ms by batch: {data['collectives']['ms_per_step']}."]
    if data.get("check"):
        lines += ["", f"Greedy ids, random small Llama in bf16 ({data['check']['prompts']} prompts, "
                      f"{data['check']['new_tokens']} tokens), 2 GPUs against 1: {json.dumps(data['check']['runs'])}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("check", "speed", "collectives", "report"))
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--model-dir", default="/tmp/yaie_tp_8b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("YAIE_SOLUTIONS", "all")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    if args.part == "check":
        check(out)
    elif args.part == "speed":
        speed(out, args.tp, Path(args.model_dir), batches, args.repeats)
    elif args.part == "collectives":
        collectives(out, batches)
    else:
        report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
