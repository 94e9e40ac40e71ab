"""Memory per sequence and decode speed of a Based model in the engine (lesson 08), on the lent GPU.

    python scripts/gpu_lesson08_memory.py MODEL_DIR [--out memory.json]

For prompts of 1k and 16k random token ids: the bytes one sequence holds in the engine (its row of the
batched Based states and its window rings: ``llm.state_bytes_per_sequence()``) after a generate call, and
again on a :class:`BasedCache` of the script's own, where the prompt and then 64 decode steps (batch 1,
eager) are timed apart (prefill seconds, decode ms per token; on a GPU also the peak of allocated memory
over what was allocated before). Beside it, the bf16 KV cache a full-attention model of the same shape
(every layer a softmax layer over the whole context) would hold for the same tokens.

    python scripts/gpu_lesson08_memory.py MODEL_DIR --full FULL_MODEL_DIR [--batches 1,16] [--out memory.json]

``--full``: decode speed in the engine, the Based model beside a full-attention one, at the same prompt
lengths and batch sizes: tokens per second of ``batch`` sequences decoding together (each its own random
prompt), timed over ``--decode-steps`` steps (512 by default) once every sequence has its first two tokens
(an engine core driven step by step, the clock started after the prefill: at 16k tokens the prefill of 16
prompts varies between runs by more than the decode steps take), the fastest of three tries. Both run as the engine runs
them on the device: CUDA graphs of the decode step. The full-attention model runs through the engine's
paged KV cache (no prefix caching, so the second call computes its prompts again); its context limit is
raised to cover the longest prompt (a copy of its config in a temporary folder): the speed of a step does not
depend on the weights having seen such lengths.

    python scripts/gpu_lesson08_memory.py MODEL_DIR --full FULL_MODEL_DIR --device cpu --lengths 64,200 \
        --batches 1,3 --decode-steps 4      # a smoke run of the script's logic on a CPU

With ``--full`` on a GPU it also counts the kernels of one decode step at batch 1 and the first length, for
both models (``--kernel-steps``, 0 to skip): torch.profiler over two ``generate`` calls (1 and 1 +
``--kernel-steps`` new tokens), the difference divided by the steps; copies and fills (Memcpy, Memset) are
counted apart. At the end a table puts the two models' tokens/s side by side.

``YAIE_GIT_COMMIT`` (when set) names the commit in the results.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("YAIE_SOLUTIONS", "all")

import torch  # noqa: E402

from yaie.engine.llm import LLM  # noqa: E402
from yaie.engine.sampling import SamplingParams  # noqa: E402
from yaie.model.based_rows import BasedCache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", default=None)
    p.add_argument("--lengths", default="1024,16384")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no GPU memory figures)")
    p.add_argument("--full", default=None, help="a full-attention model: decode tokens/s beside the Based model's")
    p.add_argument("--decode-steps", type=int, default=512, help="decode steps timed in the --full comparison")
    p.add_argument("--memory-steps", type=int, default=64, help="decode steps of the BasedCache memory run")
    p.add_argument("--batches", default="1,16", help="sequences decoding together in the --full comparison")
    p.add_argument("--kernel-steps", type=int, default=32,
                   help="--full on a GPU: decode steps profiled to count the kernels of a step (0: skip)")
    args = p.parse_args()
    started = time.perf_counter()
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
        engine_bytes = llm.state_bytes_per_sequence()
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
        for step in range(args.memory_steps):
            hidden = llm.model.forward(token, torch.tensor([n + step], device=llm.device), cache)
            token = llm.model.logits(hidden).argmax(-1)
        sync()
        t2 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        full_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * (n + args.memory_steps)
        row = dict(prompt_tokens=n, tokens_at_end=len(cache), state_bytes=cache.nbytes(),
                   engine_state_bytes=engine_bytes, peak_extra_allocated_bytes=peak,
                   full_attention_bf16_kv_bytes=full_kv, prefill_seconds=round(t1 - t0, 4),
                   decode_ms_per_token=round(1e3 * (t2 - t1) / args.memory_steps, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(commit=os.environ.get("YAIE_GIT_COMMIT"), command="python " + " ".join(sys.argv),
                  model=str(args.model), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__, rows=rows)
    print(f"memory rows done after {time.perf_counter() - started:.0f} s", flush=True)
    if args.full:
        lengths = [int(x) for x in args.lengths.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        count = cuda and args.kernel_steps > 0
        kernels = {}
        decode = {"based": engine_decode_speed(llm, lengths, batches, args.decode_steps, sync, "based")}
        if count:
            kernels["based"] = kernels_per_decode_step(llm, lengths[0], args.kernel_steps, "based")
        print(f"Based decode done after {time.perf_counter() - started:.0f} s", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            full = LLM(long_context_copy(args.full, tmp, max(lengths) + args.decode_steps + 16), device=args.device,
                       prefix_caching=False)
            decode["full_attention"] = engine_decode_speed(full, lengths, batches, args.decode_steps, sync,
                                                            "full attention")
            if count:
                kernels["full_attention"] = kernels_per_decode_step(full, lengths[0], args.kernel_steps,
                                                                    "full attention")
            del full
        print(f"full-attention decode done after {time.perf_counter() - started:.0f} s", flush=True)
        result["engine_decode"] = dict(
            based_model=str(args.model), full_attention_model=str(args.full), decode_steps=args.decode_steps,
            based_cuda_graphs=llm.settings.cuda_graphs,
            rows=[dict(prompt_tokens=n, batch=b, based_tokens_per_s=decode["based"][n, b],
                       full_attention_tokens_per_s=decode["full_attention"][n, b],
                       based_over_full=round(decode["based"][n, b] / decode["full_attention"][n, b], 3))
                  for n in lengths for b in batches])
        if kernels:
            result["engine_decode"]["kernels_per_decode_step"] = dict(prompt_tokens=lengths[0], batch=1, **kernels)
        for row in result["engine_decode"]["rows"]:
            print(json.dumps(row), flush=True)
        print("\n| context | batch | Based tok/s | full attention tok/s | Based / full |\n|---:|---:|---:|---:|---:|")
        for row in result["engine_decode"]["rows"]:
            print(f"| {row['prompt_tokens']} | {row['batch']} | {row['based_tokens_per_s']:.0f} | "
                  f"{row['full_attention_tokens_per_s']:.0f} | {row['based_over_full']:.2f} |")
        for label, found in kernels.items():
            print(f"kernels per decode step ({label}, batch 1, {lengths[0]} tokens): {found}")
        print(f"done after {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def long_context_copy(model_dir: str, tmp: str, context: int) -> str:
    """A copy of ``model_dir`` in ``tmp`` whose config allows ``context`` positions (weights linked, not copied)."""
    dst = os.path.join(tmp, "model")
    os.makedirs(dst)
    for name in os.listdir(model_dir):
        src = os.path.join(os.path.abspath(model_dir), name)
        if name == "config.json":
            with open(src) as f:
                config = json.load(f)
            config["max_position_embeddings"] = max(int(config.get("max_position_embeddings", 0)), context)
            with open(os.path.join(dst, name), "w") as f:
                json.dump(config, f, indent=2)
        elif os.path.isfile(src):
            try:
                os.symlink(src, os.path.join(dst, name))
            except OSError:
                shutil.copy(src, os.path.join(dst, name))
    return dst


def kernels_per_decode_step(llm, length: int, steps: int, label: str) -> dict:
    """Kernels one decode step of one sequence launches (CUDA graphs included: the profiler sees the kernels
    of a replay): ``{"kernels": ..., "copies_and_fills": ...}`` per step, from the difference of two profiled
    ``generate`` calls on the same prompt of ``length`` random ids (1 and ``1 + steps`` new tokens)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, llm.config.vocab_size - 64, (length,), generator=gen).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))     # graphs, compiles
    counts = {}
    for new in (1, 1 + steps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
            torch.cuda.synchronize()
        found = collections.Counter()
        for event in prof.key_averages():
            if event.device_type == DeviceType.CUDA:
                kind = "copies_and_fills" if event.key.startswith(("Memcpy", "Memset")) else "kernels"
                found[kind] += event.count
        counts[new] = found
    per_step = {kind: round((counts[1 + steps][kind] - counts[1][kind]) / steps, 2)
                for kind in ("kernels", "copies_and_fills")}
    print(f"{label}: {length} tokens, batch 1: {per_step} per decode step", flush=True)
    return per_step


def engine_decode_speed(llm, lengths: list[int], batches: list[int], steps: int, sync, label: str) -> dict:
    """Decode tokens per second of ``batch`` sequences decoding together, after prompts of ``lengths`` random
    ids: ``{(length, batch): tokens/s}``, the fastest of three tries."""
    gen = torch.Generator().manual_seed(1)
    vocab = llm.config.vocab_size
    llm.generate([[2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    speeds = {}
    for n in lengths:
        for batch in batches:
            prompts = [torch.randint(2, vocab - 64, (n,), generator=gen).tolist() for _ in range(batch)]
            # One untimed call of this shape first: the first prompt of a new length compiles kernels and
            # a new batch size records graphs, which would otherwise land in a timed try.
            llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            speeds[n, batch] = round(max(timed_decode(llm, prompts, steps, sync) for _ in range(3)), 1)
            print(f"{label}: {n} tokens, batch {batch}: {speeds[n, batch]} tokens/s", flush=True)
    return speeds


def timed_decode(llm, prompts: list[list[int]], steps: int, sync) -> float:
    """Tokens per second of the decode steps alone: an engine core takes the prompts, steps until every
    sequence has its first two tokens (prefill done, decoding under way), then the clock runs until each has
    ``steps`` more."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    core = llm.open_core(len(prompts))
    try:
        with core.cpu_threads_set():
            requests = [core.add(ids, params, streams=False) for ids in prompts]
            while core.has_unfinished() and min(len(r.output_ids) for r in requests) < 2:
                core.step()
            sync()
            start, made_before = time.perf_counter(), sum(len(r.output_ids) for r in requests)
            while core.has_unfinished():
                core.step()
            core.flush()
            sync()
            elapsed = time.perf_counter() - start
            made = sum(len(r.output_ids) for r in requests) - made_before
    finally:
        core.close()
    if made <= 0 or elapsed <= 0:
        raise RuntimeError(f"{len(prompts)} prompts: no decode step was timed ({made} tokens in {elapsed} s)")
    return made / elapsed


if __name__ == "__main__":
    main()
