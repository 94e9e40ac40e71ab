"""Engine throughput beside Hugging Face transformers, same model, same requests, one run; and the
inter-token latency of running requests while a long prompt arrives, with and without chunked prefill.

    python -m yaie.bench.engine --out bench/results            # on a CUDA GPU: the ~1B config, bf16
    python -m yaie.bench.engine --out /tmp/x --size tiny --device cpu   # a dry run of this script

The model is a randomly initialised Llama (``--size 1b``: hidden 2048, 16 layers, 32 query heads over
8 KV heads, SwiGLU 8192, vocabulary 32000, untied embeddings: 1.1B parameters) written once with
``save_pretrained`` and loaded by both. For each batch size B, B prompts of ``--prompt-len`` random
token ids each generate exactly ``--new-tokens`` tokens (end-of-sequence ignored), greedy unless
``--temperature`` is above 0 (then sampled with ``--top-k``, ``--top-p``; with ``--seed S`` request ``i``
has seed ``S + i``, else each draws one; transformers samples with the same temperature, top-k and top-p):

* the engine: ``LLM.generate(prompts, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))`` (or
  the sampled parameters above),
  i.e. continuous batching over lesson 03's paged cache, lessons 02 (norms, RoPE, SiLU), 04 (decode)
  and 06 (prefill) on CUDA, the reference solutions; decode steps replayed from CUDA graphs (at batch 1
  also with ``cuda_graphs`` off: every kernel launched from Python). Prefix caching is off: the same
  prompts run again and again, and transformers caches nothing between calls either;
* transformers ``generate``: ``model.generate(input_ids [B, P], max_new_tokens=N, min_new_tokens=N,
  do_sample=False)`` with its default dynamic cache and attention implementation;
* transformers' fast path: the same call with ``cache_implementation="static"``, with which ``generate``
  compiles the decoding forward (``torch.compile``, mode ``reduce-overhead``: CUDA graphs) itself. It
  compiles again for each batch size; those warm-up calls are not timed. Rows that would start after
  ``--time-budget`` seconds are skipped, with a note.

Each is timed end to end (host clock around the call, the device synchronised), after a warm-up
call, ``--repeats`` times (the median is reported), and once more with one new token: that run is the
prefill (plus one sampling step), so ``decode tokens/s = B * (N - 1) / (t_total - t_first)``.

Roofline (batch 1): a decode step must read every weight matrix once (the embedding table only one row)
and the context's K/V; at the measured copy bandwidth (``yaie.bench.harness.measure_peaks``: bytes read +
written per second of a 1 GiB device copy) that bounds the steps per second. The row's fraction is its
decode steps per second over that bound.

Chunked prefill (``--long-prompt``): ``--itl-batch`` requests decode (one token per step each); then a
request with a ``--long-prompt``-token prompt arrives. Each step is timed (its tokens come back to the
host, so the step is over); reported are the running requests' inter-token latency before it arrives
and while it is ingested (until its first token), with ``max_num_batched_tokens`` chunks and with the
whole prompt in one step.
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
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=20480),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=20480),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
}
COMMON = dict(rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, initializer_range=0.02)
BLOCK_SIZE = 16


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


def measure(name, run, batch, new_tokens, repeats, device, warmup=None):
    """Median end-to-end time of ``run(new_tokens)``, and of ``run(1)`` (prefill + one step). ``warmup``:
    the new-token counts of the untimed calls first (compiles, allocates, records graphs)."""
    for n in warmup or [min(new_tokens, 4)]:
        run(n)
    totals = [timed(lambda: run(new_tokens), device) for _ in range(repeats)]
    firsts = [timed(lambda: run(1), device) for _ in range(repeats)]
    total, first = statistics.median(totals), statistics.median(firsts)
    decode = batch * (new_tokens - 1) / (total - first) if total > first else None
    row = dict(system=name, batch=batch, total_s=total, first_token_s=first, totals_s=totals, firsts_s=firsts,
               tokens_per_s=batch * new_tokens / total, decode_tokens_per_s=decode)
    print(f"{name:>34}  B={batch:<3d} total {total:7.3f} s  first {first:6.3f} s  "
          f"{row['tokens_per_s']:9.1f} tok/s  decode {decode or float('nan'):9.1f} tok/s", flush=True)
    return row


def decode_step_bytes(config: dict, context: float, element: int) -> dict:
    """Bytes one batch-1 decode step must read: every weight matrix (one embedding row), and the K/V of
    ``context`` tokens."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config["intermediate_size"] + 2 * h
    weights = (layers * per_layer + config["vocab_size"] * h + 2 * h) * element
    kv_bytes = int(context * layers * 2 * kv * element)
    return dict(weights=weights, kv=kv_bytes, total=weights + kv_bytes)


def inter_token_latency(llm, prompts: list[list[int]], long_prompt: list[int], chunked: bool, device: str,
                        before_steps: int = 24) -> dict:
    """Step times of running decodes before and while a long prompt is ingested (see the module docstring)."""
    from yaie.engine.sampling import SamplingParams

    llm.settings.chunked_prefill = chunked
    engine = llm.open_core()
    try:
        params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        for ids in prompts:
            engine.add(ids, params)
        while any(r.prefilling for r in engine.requests.values()):
            engine.step()                               # their prefills
        for _ in range(4):
            engine.step()                               # graphs recorded, caches warm
        before = [timed(engine.step, device) for _ in range(before_steps)]
        long = engine.add(long_prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        during, start = [], time.perf_counter()
        while long.request_id in engine.requests:
            during.append(timed(engine.step, device))
        ttft = time.perf_counter() - start
    finally:
        engine.close()
    row = dict(chunked_prefill=chunked, max_num_batched_tokens=llm.settings.max_num_batched_tokens if chunked else None,
               running_requests=len(prompts), long_prompt_tokens=len(long_prompt),
               itl_before_median_ms=1e3 * statistics.median(before), itl_during_median_ms=1e3 * statistics.median(during),
               itl_during_max_ms=1e3 * max(during), itl_during_mean_ms=1e3 * statistics.mean(during),
               steps_to_ingest=len(during), long_prompt_ttft_s=ttft, steps_ms=[1e3 * t for t in during])
    print(f"chunked prefill {'on ' if chunked else 'off'}: {len(prompts)} decoding, a {len(long_prompt)}-token prompt "
          f"arrives: ITL before {row['itl_before_median_ms']:.1f} ms, during median {row['itl_during_median_ms']:.1f} "
          f"ms, max {row['itl_during_max_ms']:.1f} ms over {len(during)} steps; its first token after {ttft:.3f} s",
          flush=True)
    return row


def profile_decode(llm, prompts: list[list[int]], new_tokens: int, out: Path, device: str) -> dict:
    """torch.profiler over one ``generate`` of ``prompts`` (a batch of ``len(prompts)``): where a decode step's
    time goes. Writes the top operators by device and by host time to ``out``; returns wall time and device
    (kernel) time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from yaie.engine import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)                       # warm: graphs recorded
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = timed(lambda: llm.generate(prompts, params), device)
    averages = prof.key_averages()
    kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in averages if e.device_type == DeviceType.CUDA)
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    out.write_text(f"batch {len(prompts)}, {new_tokens} new tokens, wall {wall * 1e3:.1f} ms, kernels "
                   f"{kernel_us / 1e3:.1f} ms\n\n"
                   + averages.table(sort_by=sort, row_limit=30) + "\n\n"
                   + averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    row = dict(batch=len(prompts), new_tokens=new_tokens, wall_ms_per_token=wall * 1e3 / new_tokens,
               kernel_ms_per_token=kernel_us / 1e3 / new_tokens, table=out.name)
    print(f"profile, batch {len(prompts)}: {row['wall_ms_per_token']:.3f} ms per step, of which kernels "
          f"{row['kernel_ms_per_token']:.3f} ms (the rest: the GPU waits for the host)", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="1b", choices=sorted(CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,64,16,256", help="measured in this order (default 1,64,16,256)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-compiled", action="store_true", help="no transformers static-cache + torch.compile rows")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: transformers rows that would start later are skipped (with a note)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the engine's token budget per step while the long prompt arrives (the latency rows)")
    p.add_argument("--throughput-batched-tokens", type=int, default=8192,
                   help="the engine's token budget per step in the throughput rows (transformers prefills a "
                        "whole batch in one forward; 8192 lets the engine do the same for 64 x 128 tokens)")
    p.add_argument("--long-prompt", type=int, default=16000, help="tokens of the late prompt (0: no latency rows)")
    p.add_argument("--itl-batch", type=int, default=16, help="requests decoding when the long prompt arrives")
    p.add_argument("--profile", action="store_true", help="profile a generate (engine_profile_<gpu>.txt)")
    p.add_argument("--profile-batch", type=int, default=1, help="the profiled generate's batch (default 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the throughput rows' temperature (default 0: greedy); above 0 they sample")
    p.add_argument("--top-k", type=int, default=0, help="the throughput rows' top-k when they sample (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="the throughput rows' top-p when they sample")
    p.add_argument("--seed", type=int, default=None,
                   help="request i of a sampled throughput row samples with seed SEED + i (default: no seeds)")
    args = p.parse_args(argv)

    import os
    os.environ.setdefault("YAIE_SOLUTIONS", "all")
    from yaie.bench.harness import environment, gpu_slug, measure_peaks
    from yaie.engine import LLM, SamplingParams
    import transformers

    began = time.perf_counter()
    params_total = None
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(1)
    config = CONFIGS[args.size]
    vocab = config["vocab_size"]
    count = max(batches + [args.profile_batch])
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(count)]
    peaks = measure_peaks(args.device) if args.device == "cuda" else None
    rows, notes, latency, profiled = [], [], [], None
    sampled = args.temperature > 0
    sampling = (f"temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p}, "
                + ("unseeded" if args.seed is None else f"seed {args.seed} + i") if sampled else "greedy")

    def engine_params(n: int, batch: int) -> list[SamplingParams]:
        """The throughput rows' sampling parameters, one per request."""
        return [SamplingParams(max_tokens=n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               seed=None if args.seed is None else args.seed + i, ignore_eos=True)
                for i in range(batch)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug() if args.device == "cuda" else "cpu"
    def write_report() -> dict:
        """Write what is measured so far (after every batch size: a run cut short still leaves its rows)."""
        element = torch.empty((), dtype=dtype).element_size()
        step_bytes = decode_step_bytes(config, args.prompt_len + args.new_tokens / 2, element)
        for r in rows:
            if peaks and r["decode_tokens_per_s"]:
                # A decode step of B sequences reads the weights once and each sequence's K/V.
                step = step_bytes["weights"] + r["batch"] * step_bytes["kv"]
                roofline_steps = peaks["copy_GBps"] * 1e9 / step
                r["roofline_steps_per_s"] = roofline_steps
                r["roofline_fraction"] = r["decode_tokens_per_s"] / (r["batch"] * roofline_steps)
        for batch in batches:
            ours = [r for r in rows if r["batch"] == batch and r["system"] == "yaie engine"]
            theirs = [r for r in rows if r["batch"] == batch and r["system"].startswith("transformers")]
            if ours and theirs:
                best = max(theirs, key=lambda r: r["tokens_per_s"])
                ours[0]["speedup_vs_best_transformers"] = ours[0]["tokens_per_s"] / best["tokens_per_s"]
                ours[0]["best_transformers"] = best["system"]
        env = environment() | dict(transformers=transformers.__version__)
        report = dict(environment=env, peaks=peaks,
                      model=dict(size=args.size, parameters=params_total, dtype=args.dtype,
                                 config=config | COMMON, init="random (seed 0)"),
                      workload=dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, batches=batches,
                                    repeats=args.repeats, sampling=f"{sampling}, ignore_eos", kv_block_size=BLOCK_SIZE,
                                    prefix_caching=False, max_num_batched_tokens=args.throughput_batched_tokens,
                                    max_num_batched_tokens_latency_rows=args.max_num_batched_tokens),
                      decode_step_bytes_batch1=step_bytes, rows=rows, notes=notes, chunked_prefill_latency=latency,
                      profile=profiled)
        (out / f"engine_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"engine_{slug}.md").write_text(markdown(report))
        return report

    with tempfile.TemporaryDirectory() as folder:
        hf = build_model(args.size, Path(folder), args.device, dtype)
        per_seq_blocks = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
        long_blocks = -(-(args.long_prompt + 1) // BLOCK_SIZE) + args.itl_batch * (per_seq_blocks + 64)
        llm = LLM(folder, device=args.device, dtype=dtype, block_size=BLOCK_SIZE, prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  num_blocks=max(per_seq_blocks * max(batches), long_blocks) + 64)
        params_total = llm.num_parameters()
        write_report()
        if args.long_prompt:        # first: the transformers rows below may spend the run's time budget
            long_prompt = torch.randint(3, vocab, (args.long_prompt,), generator=gen).tolist()
            for chunked in (True, False):
                # Once untimed (kernels compiled for these shapes, graphs recorded), then measured.
                inter_token_latency(llm, prompts[:args.itl_batch], long_prompt, chunked, args.device)
                latency.append(inter_token_latency(llm, prompts[:args.itl_batch], long_prompt, chunked, args.device))
            llm.settings.chunked_prefill = True
        llm.settings.max_num_batched_tokens = args.throughput_batched_tokens    # read when each generate starts
        if args.profile:
            try:
                profiled = profile_decode(llm, prompts[:args.profile_batch], 64, out / f"engine_profile_{slug}.txt",
                                          args.device)
            except Exception as err:  # noqa: BLE001 - the profile is an extra: note a failure, go on
                notes.append(f"profile: {type(err).__name__}: {err}")
        for batch in batches:
            write_report()
            ids = prompts[:batch]

            def engine(n, ids=ids):
                outs = llm.generate(ids, engine_params(n, len(ids)))
                assert all(len(o.token_ids) == n for o in outs)

            rows.append(measure("yaie engine", engine, batch, args.new_tokens, args.repeats, args.device))
            if llm.settings.cuda_graphs and batch == 1:     # the same engine with every step run eagerly, side by side
                llm.settings.cuda_graphs = False
                rows.append(measure("yaie engine (no CUDA graphs)", engine, batch, args.new_tokens, args.repeats,
                                    args.device))
                llm.settings.cuda_graphs = True
        # transformers after every engine row: its compiled path records CUDA graphs of its own
        # (torch.compile's cudagraph trees), and the engine's graphs recorded before are not replayed
        # after that in this process (an illegal memory access was seen on the H100 when they were).
        for batch in [] if args.skip_hf else batches:
            write_report()
            x = torch.tensor(prompts[:batch], device=args.device)

            how = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) \
                if sampled else dict(do_sample=False)

            def huggingface(n, x=x, **extra):
                with torch.no_grad():
                    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=0, **how, **extra)
                assert out.shape[1] == x.shape[1] + n

            for name, extra, warmup in [("transformers", {}, None),
                                        ("transformers static cache + compile", dict(cache_implementation="static"),
                                         [args.new_tokens, args.new_tokens])]:
                if extra and args.skip_compiled:
                    continue
                late = args.time_budget is not None and time.perf_counter() - began > args.time_budget
                if late:
                    notes.append(f"{name}, batch {batch}: skipped, the run's time budget ({args.time_budget:.0f} s) "
                                 "was spent")
                    print(notes[-1], flush=True)
                    continue
                try:
                    rows.append(measure(name, lambda n, **kw: huggingface(n, **extra), batch, args.new_tokens,
                                        args.repeats, args.device, warmup))
                except Exception as err:  # noqa: BLE001 - out of memory, a compile failure: note it, go on
                    reason = "out of GPU memory" if isinstance(err, torch.OutOfMemoryError) else \
                        f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                    notes.append(f"{name}, batch {batch}: skipped, {reason}")
                    print(notes[-1], flush=True)
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
    report = write_report()
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    env, model, work = report["environment"], report["model"], report["workload"]
    cfg, peaks = model["config"], report.get("peaks")
    step = report["decode_step_bytes_batch1"]
    lines = [
        f"# Engine throughput: YAIE vs transformers ({env['gpu'] or 'CPU'})", "",
        f"Model: random Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, intermediate "
        f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']} ({model['parameters'] / 1e9:.2f}B parameters), "
        f"{model['dtype']}.",
        f"Workload: B prompts of {work['prompt_len']} random tokens, {work['new_tokens']} new tokens each, "
        f"{work['sampling'].replace('ignore_eos', 'end-of-sequence ignored')}; median of {work['repeats']} "
        f"timed runs after a warm-up; engine prefix caching off, at most {work['max_num_batched_tokens']} tokens "
        "per engine step.",
        f"Versions: torch {env['torch']}, triton {env['triton']}, transformers {env.get('transformers')}, "
        f"CUDA {env['cuda']}; commit {env['git_commit']}; {env['date_utc']}.",
        f"Command: `{env['command']}`", "",
    ]
    if peaks:
        lines += [f"Roofline at batch 1: a decode step reads {step['weights'] / 1e9:.3f} GB of weights and "
                  f"{step['kv'] / 1e6:.1f} MB of K/V (mean context); measured copy bandwidth "
                  f"{peaks['copy_GBps']:.0f} GB/s (read + written), so at most "
                  f"{peaks['copy_GBps'] * 1e9 / step['total']:.0f} steps/s. At batch B a step reads the weights once "
                  "and B sequences' K/V: the roofline fraction of each row is its decode tokens/s over B times the "
                  "steps/s those bytes allow.", ""]
    lines += ["| system | batch | total s | prefill + 1 step s | tokens/s (end to end) | decode tokens/s | "
              "roofline fraction | engine vs faster transformers |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(report["rows"], key=lambda r: r["batch"]):
        decode = f"{r['decode_tokens_per_s']:.0f}" if r["decode_tokens_per_s"] else "n/a"
        roof = f"{r['roofline_fraction']:.0%}" if r.get("roofline_fraction") is not None else ""
        speed = f"{r['speedup_vs_best_transformers']:.2f}x" if r.get("speedup_vs_best_transformers") else ""
        lines.append(f"| {r['system']} | {r['batch']} | {r['total_s']:.3f} | {r['first_token_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {decode} | {roof} | {speed} |")
    for note in report.get("notes", []):
        lines.append(f"\nNote: {note}")
    prof = report.get("profile")
    if prof:
        lines.append(f"\nProfile (torch.profiler, one generate of batch {prof['batch']}, {prof['new_tokens']} "
                     f"tokens each): {prof['wall_ms_per_token']:.3f} ms per step, of which GPU kernels "
                     f"{prof['kernel_ms_per_token']:.3f} ms; operators in `{prof['table']}`.")
    latency = report.get("chunked_prefill_latency") or []
    if latency:
        first = latency[0]
        lines += ["", f"## Inter-token latency while a {first['long_prompt_tokens']}-token prompt arrives", "",
                  f"{first['running_requests']} requests decode; then the long prompt arrives (prefix caching off). "
                  "Step times of the running requests (each step gives each of them one token):", "",
                  "| prefill | ITL before, median ms | ITL while ingesting, median ms | max ms | steps | "
                  "long prompt's first token s |", "|---|---:|---:|---:|---:|---:|"]
        for r in latency:
            how = (f"chunked, max_num_batched_tokens {r['max_num_batched_tokens']}" if r["chunked_prefill"]
                   else "whole prompt in one step")
            lines.append(f"| {how} | {r['itl_before_median_ms']:.1f} | {r['itl_during_median_ms']:.1f} | "
                         f"{r['itl_during_max_ms']:.1f} | {r['steps_to_ingest']} | {r['long_prompt_ttft_s']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
