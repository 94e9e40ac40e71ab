"""Tensor parallelism on GPUs: greedy ids over 2 ranks against 1 and transformers, decode speed of the
Llama-3-8B shape over 1 and 2 GPUs, and what the step's all-reduces cost. Each part is one command, run in a
process of its own (``scripts/gpu_tensor_parallel.sh`` runs them in order, each under a time limit); each
adds what it measured to a JSON file in ``--out`` as soon as it has it, and ``report`` joins them::

    python -m yaie.bench.tensor_parallel collectives --out OUT      # a step's collectives alone, 2 GPUs
    python -m yaie.bench.tensor_parallel speed --tp 1 --out OUT     # the 8B shape: decode tokens/s, batch 1, 64
    YAIE_TP_ALL_REDUCE=nccl python -m yaie.bench.tensor_parallel speed --tp 2 --out OUT
    python -m yaie.bench.tensor_parallel check --tp 1 --out OUT     # small random Llama, bf16: ids (+ transformers)
    python -m yaie.bench.tensor_parallel check --tp 2 --out OUT     # (--eager: without CUDA graphs)
    python -m yaie.bench.tensor_parallel report --out OUT           # tensor_parallel_<gpu>.{json,md}

``speed``: B prompts of 128 random tokens generate 128 tokens each (greedy, end-of-sequence ignored, prefix
caching off, decode steps from CUDA graphs); timed end to end after a warm-up, and with one new token:
``decode tokens/s = B * 127 / (t_total - t_first)``, a decode step's time ``B / decode tokens/s``
(:func:`yaie.bench.engine.measure`). Its row names the all-reduce path (``YAIE_TP_ALL_REDUCE``, see
:mod:`yaie.model.all_reduce`): with ``skip`` the step sums nothing (its output is wrong), which times a step
without its all-reduces: ``1 - step(skip) / step(path)`` is their share of a step.

``collectives``: one CUDA graph holding what a decode step of the 8B shape communicates over 2 ranks (65
all-reduces of ``[B, 4096]``: the embedding and 2 per layer; one all-gather of the ``[B, 128256 / 2]``
logits), replayed, for each all-reduce path; and whether the one-shot sums equal NCCL's, bit for bit.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from yaie.device import PDL_ENV_VAR

HIDDEN, LAYERS, VOCAB = 4096, 32, 128256            # the 8B shape (yaie.bench.engine.CONFIGS["8b"])
# head_dim 128 and 4 query heads per KV head, as the 8B shape: the check compiles the kernels the speed runs use
CHECK_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
CHECK_DIR = "/tmp/yaie_tp_check"
TOP = 5                      # log-probabilities kept per position: where two runs part, is it a near-tie?
CLOSE_LIMIT_S = 20.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def add_to(path: Path, key: str, value) -> None:
    """Set ``key`` of the JSON object in ``path`` (made if missing) to ``value``."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")


def close(llm) -> None:
    """``llm.close()``, timed; a close that does not return within ``CLOSE_LIMIT_S`` prints where every
    thread is, and ends the process."""
    def give_up():
        log(f"close did not return within {CLOSE_LIMIT_S:g} s; the workers alive: "
            f"{[p.is_alive() for p in getattr(llm._workers, 'procs', [])]}; the threads:")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)
    timer = threading.Timer(CLOSE_LIMIT_S, give_up)
    timer.daemon = True
    timer.start()
    began = time.perf_counter()
    llm.close()
    timer.cancel()
    log(f"closed in {time.perf_counter() - began:.1f} s")


def check(out: Path, tp: int, graphs: bool) -> None:
    """Greedy ids of 12 prompts over ``tp`` ranks in bf16, with the top ``TOP`` log-probabilities of every
    position (run ``tp<N>_<path>_graphs`` or ``..._eager`` of ``tp_check.json``). One rank: with CUDA graphs,
    then transformers in bf16 and in float32, then eager."""
    from yaie.engine import LLM, SamplingParams
    from yaie.model import parallel
    from yaie.model.testing import save_random_model

    folder = Path(CHECK_DIR)
    if not (folder / "config.json").is_file():
        save_random_model("llama", folder, seed=0, **CHECK_MODEL)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (12,), generator=gen)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    path = out / "tp_check.json"
    add_to(path, "setup", dict(model=CHECK_MODEL, init="save_random_model('llama', seed=0)", dtype="bfloat16",
                               prompts=len(prompts), prompt_lens=[len(p) for p in prompts], new_tokens=32, top=TOP))

    def generate(with_graphs: bool) -> None:
        log(f"check: {tp} GPU(s), {'CUDA graphs' if with_graphs else 'eager'}: starting")
        # (No prefix caching: the second pass computes what the first did, not from its cached prompts.)
        llm = LLM(folder, dtype=torch.bfloat16, tensor_parallel_size=tp, cuda_graphs=with_graphs, max_num_seqs=16,
                  num_blocks=1024, max_num_batched_tokens=1024, prefix_caching=False)
        run = f"tp{tp}_{parallel.all_reduce_path() if tp > 1 else 'none'}_{'graphs' if with_graphs else 'eager'}"
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]     # looked-ahead steps
        core = llm.open_core()                       # again, with log-probabilities (no look-ahead then)
        requests = [core.add(p, params, logprobs=TOP) for p in prompts]
        while core.has_unfinished():
            core.step()
        core.flush()
        entries = [core.take_logprobs(r.request_id) for r in requests]
        core.close()
        add_to(path, run, dict(ids=[[e[0] for e in seq] for seq in entries],
                               top=[[[[i, round(v, 4)] for i, v in e[2]] for e in seq] for seq in entries],
                               generate_ids_same=plain == [[e[0] for e in seq] for seq in entries]))
        log(f"check: {run} generated")
        close(llm)

    generate(graphs)
    if tp == 1:
        import transformers
        for dtype, name in ((torch.bfloat16, "hf_bf16"), (torch.float32, "hf_fp32")):
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder).to("cuda", dtype).eval()
            hf.generation_config.eos_token_id = None          # as ignore_eos
            ids, top = [], []
            for prompt in prompts:
                x = torch.tensor([prompt], device="cuda")
                result = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                                     pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                ids.append(result.sequences[0, len(prompt):].tolist())
                logprobs = torch.log_softmax(torch.cat(result.logits).float(), dim=-1)
                values, indices = logprobs.topk(TOP, dim=-1)
                top.append([[[i, round(v, 4)] for i, v in zip(ii, vv)]
                            for ii, vv in zip(indices.tolist(), values.tolist())])
            add_to(path, name, dict(ids=ids, top=top))
            log(f"check: transformers {name} generated")
            del hf
        generate(False)


def speed(out: Path, tp: int, model_dir: Path, batches: list[int], repeats: int) -> None:
    """Decode tokens/s of the 8B shape over ``tp`` GPUs at each batch size (rows of ``tp_speed.json``)."""
    from yaie.bench.engine import BLOCK_SIZE, build_model, measure
    from yaie.bench.harness import environment
    from yaie.engine import LLM, SamplingParams
    from yaie.model import parallel

    if not (model_dir / "config.json").is_file():
        began = time.perf_counter()
        build_model("8b", model_dir, "cuda", torch.bfloat16)
        torch.cuda.empty_cache()
        log(f"built the random 8B-shaped Llama in {time.perf_counter() - began:.0f} s")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (128,), generator=gen).tolist() for _ in range(max(batches))]
    began = time.perf_counter()
    llm = LLM(model_dir, dtype=torch.bfloat16, tensor_parallel_size=tp, block_size=BLOCK_SIZE, prefix_caching=False,
              max_num_seqs=max(batches), max_num_batched_tokens=8192, num_blocks=max(batches) * 17 + 64)
    started = time.perf_counter() - began
    path = parallel.all_reduce_path() if tp > 1 else "none"
    pdl = os.environ.get(PDL_ENV_VAR, "1") != "0"       # the one-row products' programmatic dependent launch
    log(f"speed: {tp} GPU(s) started in {started:.0f} s; all-reduce: {path}; PDL: {pdl}")
    env = environment()
    for batch in batches:
        def run(n, batch=batch):
            llm.generate(prompts[:batch], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        row = measure(f"yaie engine, {tp} GPU(s), {path}", run, batch, 128, repeats, "cuda", warmup=[4, 128])
        row.update(tensor_parallel_size=tp, all_reduce=path, pdl=pdl, start_s=started,
                   step_ms=1e3 * batch / row["decode_tokens_per_s"], environment=env)
        add_to(out / "tp_speed.json", f"tp{tp}_{path}_b{batch}{'' if pdl else '_nopdl'}", row)
    close(llm)


def _collectives_rank(rank: int, init_file: str, out: str, batches: list[int], replays: int) -> None:
    from yaie.bench.harness import environment, event_times_ms, graphed
    from yaie.model import parallel
    from yaie.model.all_reduce import ENV_VAR, AllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    os.environ[ENV_VAR] = "one-shot"
    parallel.join(rank, 2, init_file, "nccl", 120, 120)      # its all-reduce: one-shot where it works
    paths = {"nccl": AllReduce("nccl", device, requested="nccl")}
    if parallel.all_reduce_path() == "one-shot":
        paths["one-shot"] = parallel.all_reduce
    result = dict(all_reduces_per_step=2 * LAYERS + 1, all_reduce_shape=["B", HIDDEN],
                  all_gather_shape=["B", VOCAB // 2], dtype="bfloat16", replays=replays,
                  one_shot_available=parallel.all_reduce_path() == "one-shot", ms_per_step={}, same_sums={})
    gen = torch.Generator(device=device).manual_seed(rank)
    for batch in batches:
        x = torch.randn(batch, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        scores = torch.randn(batch, VOCAB // 2, dtype=torch.bfloat16, device=device)
        if "one-shot" in paths:
            same = torch.equal(paths["one-shot"](x.clone()), paths["nccl"](x.clone()))
            result["same_sums"][str(batch)] = same
        for name, reduce in paths.items():
            def step(reduce=reduce):
                for _ in range(2 * LAYERS + 1):
                    reduce(x)
                parallel.all_gather_last(scores)
            step()                                                   # warm
            samples = event_times_ms(graphed(step, warm=1), replays)
            result["ms_per_step"].setdefault(name, {})[str(batch)] = statistics.median(samples)
            if rank == 0:
                log(f"collectives: {name}, batch {batch}: {statistics.median(samples):.3f} ms per step")
    if rank == 0:
        result["environment"] = environment()
        Path(out, "tp_collectives.json").write_text(json.dumps(result, indent=2) + "\n")
    torch.cuda.synchronize()
    os._exit(0)                 # no teardown: the graphs hold the communicator's collectives


def collectives(out: Path, batches: list[int], replays: int = 50) -> None:
    """Milliseconds of one decode step's collectives over 2 GPUs (a CUDA graph), per path and batch size."""
    import torch.multiprocessing as mp

    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    mp.spawn(_collectives_rank, args=(init_file, str(out), batches, replays), nprocs=2)


def report(out: Path) -> dict:
    """Join what the other commands wrote into ``tensor_parallel_<gpu>.{json,md}``."""
    from yaie.bench.harness import gpu_slug

    def read(name):
        path = out / name
        return json.loads(path.read_text()) if path.is_file() else {}

    rows = list(read("tp_speed.json").values())
    coll, check_runs = read("tp_collectives.json"), read("tp_check.json")
    for row in rows:
        same = [r for r in rows if r["batch"] == row["batch"] and r.get("pdl", True) == row.get("pdl", True)]
        one = next((r for r in same if r["tensor_parallel_size"] == 1), None)
        if one is not None:
            row["speedup_vs_1_gpu"] = row["decode_tokens_per_s"] / one["decode_tokens_per_s"]
        skip = next((r for r in same if r["tensor_parallel_size"] == row["tensor_parallel_size"]
                     and r["all_reduce"] == "skip"), None)
        if row["tensor_parallel_size"] > 1 and row["all_reduce"] != "skip" and skip is not None:
            row["all_reduce_share"] = 1 - skip["step_ms"] / row["step_ms"]
        alone = coll.get("ms_per_step", {}).get(row["all_reduce"], {}).get(str(row["batch"]))
        if alone is not None:
            row["collectives_alone_share"] = alone / row["step_ms"]
    env = next((r["environment"] for r in rows), None) or coll.get("environment") or {}
    data = dict(environment=env, check=check_summary(check_runs), collectives=coll, rows=rows,
                workload=dict(model="random Llama, 8B shape (yaie.bench.engine.CONFIGS['8b']), bfloat16",
                              prompt_len=128, new_tokens=128, sampling="greedy, ignore_eos", prefix_caching=False))
    slug = gpu_slug(env.get("gpu"))
    (out / f"tensor_parallel_{slug}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"tensor_parallel_{slug}.md").write_text(markdown(data))
    return data


def check_summary(runs: dict) -> dict:
    """Each run against the 1-GPU run with CUDA graphs, and the two transformers runs against each other: how
    many sequences have identical ids, and where the others part, whether each run's token is among the other
    run's ``TOP`` most likely there (a near-tie that rounding tipped) and by how much it trails the other's
    pick there (in log-probability, the larger of the two). This is the rule vLLM's tests compare greedy
    runs of different numerics by (``check_logprobs_close``): equal up to where they part, and parting at a
    near-tie; a bug makes them part between tokens that are not close."""
    named = {k: v for k, v in runs.items() if isinstance(v, dict) and "ids" in v}
    base = "tp1_none_graphs"
    pairs = [(k, base) for k in named if k != base] + [("hf_bf16", "hf_fp32")]
    summary = dict(setup=runs.get("setup"))
    for a, b in pairs:
        if a not in named or b not in named:
            continue
        x, y = named[a], named[b]
        result = dict(identical=0, of=len(x["ids"]), parted_at=[], near_tie=0, not_close=0, max_gap=0.0)
        for i, (s, t) in enumerate(zip(x["ids"], y["ids"])):
            pos = next((j for j, (p, q) in enumerate(zip(s, t)) if p != q), None)
            if pos is None:
                result["identical"] += 1
                continue
            result["parted_at"].append(pos)
            if "top" not in x or "top" not in y:                 # a run without log-probabilities: not judged
                continue
            top_x, top_y = dict(map(tuple, x["top"][i][pos])), dict(map(tuple, y["top"][i][pos]))
            if t[pos] in top_x and s[pos] in top_y:
                result["near_tie"] += 1
                gap = max(top_x[s[pos]] - top_x[t[pos]], top_y[t[pos]] - top_y[s[pos]])
                result["max_gap"] = max(result["max_gap"], round(gap, 4))
            else:
                result["not_close"] += 1
        result["generate_ids_same"] = x.get("generate_ids_same")
        summary[f"{a} vs {b}"] = result
    return summary


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# Tensor parallelism: the Llama-3-8B shape over 1 and 2 GPUs ({env.get('gpu')})", "",
             f"Versions: torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}; "
             f"commit {env.get('git_commit')}; {env.get('date_utc')}.",
             "Command: `bash scripts/gpu_tensor_parallel.sh` (each part: `python -m yaie.bench.tensor_parallel "
             "collectives|speed|check|report`; the all-reduce path by `YAIE_TP_ALL_REDUCE`).", "",
             "| GPUs | all-reduce | PDL | batch | decode tokens/s | step ms | vs 1 GPU (same PDL) "
             "| all-reduce share of a step | collectives alone / step | start s |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(v):
        return f"{v:.0%}" if v is not None else ""
    for r in sorted(data["rows"], key=lambda r: (r["batch"], not r.get("pdl", True), r["tensor_parallel_size"],
                                                 r["all_reduce"])):
        speedup = r.get("speedup_vs_1_gpu")
        lines.append(f"| {r['tensor_parallel_size']} | {r['all_reduce']} | {'on' if r.get('pdl', True) else 'off'} "
                     f"| {r['batch']} | "
                     f"{r['decode_tokens_per_s']:.0f} | {r['step_ms']:.2f} | {f'{speedup:.2f}x' if speedup else ''} | "
                     f"{pct(r.get('all_reduce_share'))} | {pct(r.get('collectives_alone_share'))} | "
                     f"{r['start_s']:.0f} |")
    lines += ["", "`skip` sums nothing (wrong output): a step without its all-reduces; the share is "
                  "`1 - step(skip) / step`. 'Collectives alone': a CUDA graph of one step's all-reduces and "
                  "all-gather, replayed without the model, over the step's time."]
    coll = data.get("collectives")
    if coll:
        lines += ["", f"Collectives alone, ms per step of {coll['all_reduces_per_step']} all-reduces of "
                      f"[B, {HIDDEN}] + 1 all-gather, by path and batch: {json.dumps(coll['ms_per_step'])}; "
                      f"one-shot sums equal to NCCL's, bit for bit: {json.dumps(coll.get('same_sums'))}."]
    check_data = data.get("check") or {}
    setup = check_data.get("setup")
    if setup:
        lines += ["", f"Greedy ids, random small Llama in bf16 ({setup['prompts']} prompts of "
                      f"{min(setup['prompt_lens'])}-{max(setup['prompt_lens'])} tokens, {setup['new_tokens']} new "
                      f"tokens each): identical sequences, and where the others part, whether at a near-tie (each "
                      f"run's token among the other's top {setup.get('top')}; the largest log-probability gap "
                      "there) or not:", "", "| runs | identical | parted at a near-tie | parted otherwise | "
                      "largest gap | where they part (token) |", "|---|---:|---:|---:|---:|---|"]
        for key, v in check_data.items():
            if " vs " in key:
                lines.append(f"| {key} | {v['identical']} of {v['of']} | {v['near_tie']} | {v['not_close']} | "
                             f"{v['max_gap']:.3f} | {v['parted_at']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("check", "speed", "collectives", "report"))
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="check: without CUDA graphs")
    p.add_argument("--model-dir", default="/tmp/yaie_tp_8b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.setdefault("YAIE_SOLUTIONS", "all")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    if args.part == "report":
        report(out)
        return 0
    if args.part == "check":
        check(out, args.tp, not args.eager)
    elif args.part == "speed":
        speed(out, args.tp, Path(args.model_dir), batches, args.repeats)
    else:
        collectives(out, batches)
    log("done")
    os._exit(0)                 # no interpreter teardown (NCCL, symmetric memory): what it measured is written


if __name__ == "__main__":
    raise SystemExit(main())
