"""``yaie bench serve``: the OpenAI server under load, beside offline ``LLM.generate`` on the same requests.

    yaie bench serve --out bench/results                         # on a CUDA GPU: the ~1B random Llama, bf16
    python -m yaie.bench.serve --out /tmp/x --size tiny --device cpu --concurrency 1,4 --new-tokens 16  # dry run

The model is :mod:`yaie.bench.engine`'s random Llama (``--size 1b``: 1.1B parameters), written once with
``save_pretrained``. For each concurrency C, C clients each send ``--requests-per-client`` requests one
after the other: ``--prompt-len`` random token ids, ``--new-tokens`` tokens generated, greedy,
end-of-sequence ignored (so every request has the same length and the C clients move in step).

* offline: the same requests through ``LLM.generate`` in this process, C prompts per call (one call per
  round of the clients), after a warm-up round;
* served: ``yaie serve`` in a subprocess (same engine settings), C clients (httpx, a connection each,
  spread over ``--client-processes`` worker processes: see :func:`run_clients`) streaming
  ``POST /v1/completions`` with ``stream_options.include_usage``, after a warm-up round. Per request:
  time to first token (TTFT: request sent to the first text chunk) and inter-token latency (ITL: gaps
  between text chunks); throughput is generated tokens (the usage counts) over the wall time of all rounds.

Serving overhead = 1 - served tokens/s / offline tokens/s (target <= 10% at C = 64).

``--admission-window-ms default,50`` serves the same requests once per value, each with a server of its own:
the server's admission window (:class:`yaie.engine.async_engine.AsyncEngine`) as shipped (off), then at
most 50 ms, beside the same offline figures (``--compare-concurrency``: the levels of the values after the first). The
report counts each level's steps, and those that fed prompt tokens (eager on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from yaie.bench.engine import COMMON, CONFIGS, build_model


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ----------------------------------------------------------------------------- offline
def run_offline(llm, prompts: list[list[int]], warm: list[list[int]], new_tokens: int, device: str) -> dict:
    """``prompts`` in rounds of ``len(warm)`` (the concurrency), one ``generate`` call each, after a warm-up
    round on ``warm``. Also counts the measured rounds' steps and those that fed prompt tokens (on CUDA
    the eager ones: a decode-only step replays a CUDA graph)."""
    from yaie.engine import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    concurrency = len(warm)
    rounds = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
    llm.generate(warm, SamplingParams(max_tokens=min(new_tokens, 8), temperature=0, ignore_eos=True))
    _sync(device)
    counts = dict(steps=0, prefill_steps=0)
    start = time.perf_counter()
    tokens = 0
    for batch in rounds:
        tokens += sum(len(o.token_ids) for o in llm.generate(batch, params))
        core = llm.last_core                          # each generate call runs one core: its counters
        counts["steps"] += core.scheduler.stats.steps
        counts["prefill_steps"] += core.prefill_steps
    _sync(device)
    elapsed = time.perf_counter() - start
    return dict(tokens=tokens, seconds=elapsed, tokens_per_s=tokens / elapsed, **counts)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- served
async def one_request(client, url: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"server error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    if usage is None or not arrivals:
        raise RuntimeError("a stream ended without text or usage")
    return dict(ttft=arrivals[0] - sent, itl=[b - a for a, b in zip(arrivals, arrivals[1:])],
                tokens=usage["completion_tokens"])


def run_clients(url: str, model: str, prompts: list[list[int]], warm: list[list[int]], new_tokens: int,
                timeout: float, processes: int = 8) -> dict:
    """``len(warm)`` clients (the concurrency), each sending its share of ``prompts`` one after the other,
    after a warm-up round on ``warm``.

    The clients run in ``processes`` worker processes (fewer when there are fewer clients), each client with
    an HTTP connection of its own. Why: a Python client costs CPU per streamed chunk (HTTP parsing, the
    SSE lines, JSON), and 64 streams at thousands of tokens per second saturate one interpreter: then the
    measurement is the load generator's speed, not the server's. (httpx with one shared pool of 64
    connections is worse still: its pool scans every connection on every request event, most of the
    client's time at 64 streams.) The workers warm up, wait for one start signal, and report their
    requests' times on the machine's monotonic clock (``time.perf_counter``), so the wall time of the
    round is measured from the signal to the last worker's end."""
    concurrency = len(warm)
    processes = max(1, min(processes, concurrency))
    context = multiprocessing.get_context("spawn")    # a fresh interpreter: nothing of this process's CUDA
    results, go = context.Queue(), context.Event()
    workers = []
    for w in range(processes):
        mine = list(range(w, concurrency, processes))
        job = dict(url=url, model=model, new_tokens=new_tokens, timeout=timeout,
                   clients=[prompts[c::concurrency] for c in mine], warm=[warm[c] for c in mine])
        workers.append(context.Process(target=_client_worker, args=(job, results, go), daemon=True))
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + timeout
        for _ in workers:                              # every worker has warmed up
            _get(results, deadline, "ready", workers)
        start = time.perf_counter()
        go.set()
        reports = [_get(results, deadline + timeout, "done", workers) for _ in workers]
    finally:
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
    done = [r for report in reports for r in report["requests"]]
    elapsed = max(report["end"] for report in reports) - start
    tokens = sum(r["tokens"] for r in done)
    ttft = [r["ttft"] for r in done]
    itl = [g for r in done for g in r["itl"]]
    return dict(requests=len(done), tokens=tokens, seconds=elapsed, tokens_per_s=tokens / elapsed,
                client_processes=processes,
                client_cpu_us_per_token=1e6 * sum(report["cpu_s"] for report in reports) / tokens,
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
                itl_p50_ms=1e3 * percentile(itl, 50) if itl else None,
                itl_p99_ms=1e3 * percentile(itl, 99) if itl else None)


def _get(queue, deadline: float, expected: str, workers: list):
    """The next worker message, which must be ``expected``; a worker's error, a worker that died without a
    word, or the deadline raises."""
    import queue as queues
    while True:
        try:
            kind, payload = queue.get(timeout=1.0)
            break
        except queues.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a load generator worker exited with code {dead[0]}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the load generator's workers did not report '{expected}' in time") from None
    if kind != expected:
        raise RuntimeError(f"a load generator worker failed: {payload}")
    return payload


def _client_worker(job: dict, results, go) -> None:
    """One worker process of :func:`run_clients`: its clients' warm-up, the start signal, the round."""
    try:
        asyncio.run(_worker_rounds(job, results, go))
    except BaseException as err:  # noqa: BLE001 (reported to the parent, which raises it)
        results.put(("error", f"{type(err).__name__}: {err}"))


async def _worker_rounds(job: dict, results, go) -> None:
    import httpx
    url, model, new_tokens, timeout = job["url"], job["model"], job["new_tokens"], job["timeout"]
    clients = [httpx.AsyncClient(limits=httpx.Limits(max_connections=1), timeout=httpx.Timeout(timeout))
               for _ in job["clients"]]
    try:
        await asyncio.wait_for(asyncio.gather(*(one_request(client, url, model, p, min(new_tokens, 8))
                                                for client, p in zip(clients, job["warm"]))), timeout)
        results.put(("ready", None))
        await asyncio.to_thread(go.wait)
        cpu = time.process_time()

        async def client_loop(client, mine):
            return [await one_request(client, url, model, p, new_tokens) for p in mine]

        done = await asyncio.wait_for(asyncio.gather(*(client_loop(c, m) for c, m in zip(clients, job["clients"]))),
                                      timeout)
        end = time.perf_counter()
        results.put(("done", dict(requests=[r for rs in done for r in rs], end=end, cpu_s=time.process_time() - cpu)))
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m yaie.server`` on a free loopback port; waits (bounded) for /health, stops it at the end."""

    def __init__(self, model_dir: str, args: list[str], startup_s: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, YAIE_SOLUTIONS=os.environ.get("YAIE_SOLUTIONS", "all"))
        self.proc = subprocess.Popen([sys.executable, "-m", "yaie.server", "--model", model_dir,
                                      "--port", str(self.port), "--log-level", "warning", *args], env=env)
        self.startup_s = startup_s

    def __enter__(self):
        import httpx
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not answer /health in {self.startup_s} s")
            time.sleep(0.5)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of the HTTP process and of its engine process (Linux /proc; {}
        elsewhere)."""
        try:
            tick = os.sysconf("SC_CLK_TCK")
            times = {}
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    pid, parent = int(entry.name), int(fields[1])
                    if pid == self.proc.pid or parent == self.proc.pid:
                        name = "http" if pid == self.proc.pid else "engine"
                        times[name] = times.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
            return times
        except (OSError, ValueError, AttributeError):
            return {}

    def metrics(self) -> dict:
        import httpx

        from yaie.server.app import parse_prometheus
        return parse_prometheus(httpx.get(self.url + "/metrics", timeout=10).text)

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ----------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="yaie bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="where to write serve_<gpu>.{json,md} (default: bench/results)")
    p.add_argument("--size", default="1b", choices=sorted(CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=300, help="seconds one concurrency level may take")
    p.add_argument("--client-processes", type=int, default=8,
                   help="worker processes the clients are spread over (default 8; one Python process cannot "
                        "parse 64 streams at full speed)")
    p.add_argument("--admission-window-ms", default="default", metavar="LIST",
                   help="the server's admission window (yaie serve --admission-window-ms): 'default' (the "
                        "server's own: off) or milliseconds; a list ('default,50') serves once per value, the first "
                        "for the main table, the others for comparison at --compare-concurrency")
    p.add_argument("--compare-concurrency", default=None, metavar="LIST",
                   help="the concurrency levels of the comparison windows (default: all of --concurrency)")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="then, with the first server still up (idle while offline runs), N more served and offline "
                        "measurements in turn at --interleave-concurrency, fresh prompts each: each served figure "
                        "is compared with the offline ones just before and after it, so a drift of the machine "
                        "cancels")
    p.add_argument("--interleave-concurrency", default=None, metavar="LIST",
                   help="levels of the interleaved measurements (default: the largest of --concurrency)")
    p.add_argument("--engine-in-thread", action="store_true",
                   help="serve with the engine loop in a thread of the server process (yaie serve --engine-in-thread)")
    args = p.parse_args(argv)

    os.environ.setdefault("YAIE_SOLUTIONS", "all")
    from yaie.bench.harness import ROOT, environment, gpu_slug
    from yaie.engine import LLM

    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    levels = [int(c) for c in args.concurrency.split(",")]
    gen = torch.Generator().manual_seed(1)
    vocab = CONFIGS[args.size]["vocab_size"]

    def random_prompts(count):
        return [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(count)]

    # Each level its own prompts, and its warm-up round others again: no prompt is ever in the prefix cache.
    prompts = {c: random_prompts(c * args.requests_per_client) for c in levels}
    warm_prompts = {c: random_prompts(c) for c in levels}
    again = {c: (random_prompts(c * args.requests_per_client), random_prompts(c)) for c in levels}  # offline, after
    # One cache size for both: every request of the largest level at once, with room to spare.
    num_blocks = max(levels) * -(-(args.prompt_len + args.new_tokens) // 16) + 64
    engine_args = ["--device", args.device, "--num-blocks", str(num_blocks)]
    engine_args += ["--engine-in-thread"] if args.engine_in_thread else []
    default_ms = 0.0                                          # the server's default: off
    windows = [None if w.strip() == "default" else float(w) for w in args.admission_window_ms.split(",")]
    compared = [int(c) for c in args.compare_concurrency.split(",")] if args.compare_concurrency else levels
    interleave_levels = ([int(c) for c in args.interleave_concurrency.split(",")] if args.interleave_concurrency
                         else [max(levels)])
    runs = [(w, levels if i == 0 else [c for c in compared if c in levels]) for i, w in enumerate(windows)]
    env = environment()
    for name in ("fastapi", "uvicorn", "httpx", "httptools", "uvloop"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    report = dict(environment=env, model=dict(size=args.size, dtype=dtype_name, config=CONFIGS[args.size] | COMMON,
                                              init="random (seed 0)"),
                  workload=dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, concurrency=levels,
                                requests_per_client=args.requests_per_client, sampling="greedy, ignore_eos",
                                kv_block_size=16, num_blocks=num_blocks, client_processes=args.client_processes,
                                engine_loop="thread" if args.engine_in_thread else "process",
                                admission_window_ms=[default_ms if w is None else w for w in windows],
                                compare_concurrency=compared if len(windows) > 1 else None),
                  rows=[], server_metrics_at_end=None)
    out = Path(args.out) if args.out else ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug() if args.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as folder:
        hf = build_model(args.size, Path(folder), args.device, dtype)
        del hf
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        llm = LLM(folder, device=args.device, dtype=dtype, num_blocks=num_blocks)
        report["model"]["parameters"] = llm.num_parameters()
        offline = {}
        for c in levels:
            offline[c] = run_offline(llm, prompts[c], warm_prompts[c], args.new_tokens, args.device)
            print(f"offline  C={c:<3d} {offline[c]['tokens_per_s']:9.1f} tok/s", flush=True)
        for server_index, (window, run_levels) in enumerate(runs):
            window_args = [] if window is None else ["--admission-window-ms", str(window)]
            with ServerProcess(folder, engine_args + window_args) as server:
                rows = serve_levels(server, Path(folder).name, run_levels, prompts, warm_prompts, offline, args,
                                    default_ms if window is None else window)
                report["rows"] += [dict(row, server=server_index) for row in rows]
                # The first server's counters, after all its levels.
                report["server_metrics_at_end"] = report["server_metrics_at_end"] or server.metrics()
                if server_index == 0 and args.interleave:
                    report["interleaved"] = interleave(server, Path(folder).name, llm, interleave_levels,
                                                       random_prompts, args)
            if server_index == 0:
                # Offline again (fresh prompts) after the served levels: the offline figure is the mean of the
                # measurements before and after, so a drift of the machine over the run shows and cancels.
                for c in levels:
                    after = run_offline(llm, *again[c], args.new_tokens, args.device)
                    print(f"offline  C={c:<3d} {after['tokens_per_s']:9.1f} tok/s (again)", flush=True)
                    offline[c]["tokens_per_s_before"] = offline[c]["tokens_per_s"]
                    offline[c]["tokens_per_s_after"] = after["tokens_per_s"]
                    offline[c]["tokens_per_s"] = (offline[c]["tokens_per_s"] + after["tokens_per_s"]) / 2
                del llm
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            for row in report["rows"]:
                c = row["concurrency"]
                row["offline_tokens_per_s"] = offline[c]["tokens_per_s"]
                row["offline_tokens_per_s_before"] = offline[c].get("tokens_per_s_before")
                row["offline_tokens_per_s_after"] = offline[c].get("tokens_per_s_after")
                row["overhead"] = 1 - row["served_tokens_per_s"] / row["offline_tokens_per_s"]
            # Written after each server: what was measured stays when a later comparison runs out of time.
            (out / f"serve_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
            (out / f"serve_{slug}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def serve_levels(server: "ServerProcess", model: str, levels: list[int], prompts: dict, warm_prompts: dict,
                 offline: dict, args, window_ms: float) -> list[dict]:
    """One table's rows: each concurrency level's clients against ``server``, beside its offline figures."""
    print(f"yaie serve: admission window {window_ms:g} ms", flush=True)
    rows = []
    for c in levels:
        cpu_before, steps_before = server.cpu_seconds(), server.metrics()
        served = run_clients(server.url, model, prompts[c], warm_prompts[c], args.new_tokens, args.timeout,
                             args.client_processes)
        cpu_after, steps_after = server.cpu_seconds(), server.metrics()
        for name in ("steps", "prefill_steps"):     # warm-up round included
            key = f"yaie_engine_{name}_total"
            served[name] = int(steps_after.get(key, 0) - steps_before.get(key, 0))
        for name in cpu_after:       # warm-up round included: an upper bound of the measured rounds'
            served[f"{name}_cpu_us_per_token"] = (1e6 * (cpu_after[name] - cpu_before.get(name, 0.0))
                                                  / served["tokens"])
        row = dict(concurrency=c, admission_window_ms=window_ms, offline_tokens_per_s=offline[c]["tokens_per_s"],
                   offline_seconds=offline[c]["seconds"], offline_steps=offline[c]["steps"],
                   offline_prefill_steps=offline[c]["prefill_steps"], **{f"served_{k}": v for k, v in served.items()})
        row["overhead"] = 1 - row["served_tokens_per_s"] / row["offline_tokens_per_s"]
        rows.append(row)
        print(f"served   C={c:<3d} {served['tokens_per_s']:9.1f} tok/s  overhead {100 * row['overhead']:5.1f}% "
              f"(vs {row['offline_tokens_per_s']:.0f})  "
              f"TTFT p50 {served['ttft_p50_ms']:.1f} ms p99 {served['ttft_p99_ms']:.1f} ms  "
              f"ITL p50 {served['itl_p50_ms'] or 0:.2f} ms p99 {served['itl_p99_ms'] or 0:.2f} ms  "
              f"steps {served['steps']} ({served['prefill_steps']} with prompts; offline "
              f"{offline[c]['steps']} ({offline[c]['prefill_steps']}))", flush=True)
    return rows


def interleave(server: "ServerProcess", model: str, llm, levels: list[int], random_prompts, args) -> list[dict]:
    """Offline, served, offline, served, ... offline at each level (fresh prompts every time, the server up
    throughout): served run i is compared with the mean of the offline runs just before and after it, so a
    machine whose speed drifts over the run (seen on the lent GPU: up to 22% between the start and the end)
    does not decide the overhead. Returns one row per level with every figure and the median overhead."""
    rows = []
    for c in levels:
        def fresh():
            return random_prompts(c * args.requests_per_client), random_prompts(c)

        offline = [run_offline(llm, *fresh(), args.new_tokens, args.device)["tokens_per_s"]]
        served = []
        for _ in range(args.interleave):
            prompts, warm = fresh()
            served.append(run_clients(server.url, model, prompts, warm, args.new_tokens, args.timeout,
                                      args.client_processes)["tokens_per_s"])
            offline.append(run_offline(llm, *fresh(), args.new_tokens, args.device)["tokens_per_s"])
        overheads = [1 - s / ((a + b) / 2) for s, a, b in zip(served, offline, offline[1:])]
        row = dict(concurrency=c, offline_tokens_per_s=offline, served_tokens_per_s=served, overheads=overheads,
                   median_overhead=statistics.median(overheads))
        rows.append(row)
        print(f"interleaved C={c}: offline {[round(x) for x in offline]}, served {[round(x) for x in served]}, "
              f"overheads {[f'{100 * o:.1f}%' for o in overheads]}, median {100 * row['median_overhead']:.1f}%",
              flush=True)
    return rows


LOOP_WORDS = {"thread": "in a thread of the server process", "process": "in a process of its own"}


def markdown(report: dict) -> str:
    env, model, work = report["environment"], report["model"], report["workload"]
    cfg = model["config"]
    lines = [
        f"# The OpenAI server under load vs offline LLM.generate ({env['gpu'] or 'CPU'})", "",
        f"Model: random Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, vocab {cfg['vocab_size']} "
        f"({model['parameters'] / 1e9:.2f}B parameters), {model['dtype']}.",
        f"Workload: C clients, {work['requests_per_client']} requests each one after the other; "
        f"{work['prompt_len']} random prompt tokens, {work['new_tokens']} new tokens, greedy, end-of-sequence "
        f"ignored; the server streams (`POST /v1/completions`, SSE); offline runs the same requests through "
        f"`LLM.generate`, C prompts per call. KV cache: {work['num_blocks']} blocks of {work['kv_block_size']} "
        f"for both. The server's engine loop: {LOOP_WORDS[work.get('engine_loop', 'thread')]}. "
        f"The clients: spread over {work.get('client_processes', 1)} worker processes (one per client below "
        f"that), an HTTP connection each. "
        "Throughput: generated tokens over the wall time of all rounds, after a warm-up round.",
        f"Versions: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, fastapi {env.get('fastapi')}, "
        f"uvicorn {env.get('uvicorn')} (httptools {env.get('httptools')}, uvloop {env.get('uvloop')}), "
        f"httpx {env.get('httpx')}; commit {env['git_commit']}; {env['date_utc']}.",
        f"Command: `{env['command']}`", "",
        "CPU per token: microseconds of CPU time per generated token of the HTTP process, the engine process "
        "and the load generator's workers (the warm-up round counted in for the server's two). Steps: forward "
        "passes, and in brackets those that fed prompt tokens (on CUDA launched eagerly, each costing every "
        "running stream many decode steps' time): offline over the measured rounds, served with the warm-up "
        "round (its requests generate 8 tokens). Offline tok/s: the mean of a measurement before the served "
        "levels and one after them (fresh prompts), in brackets.",
    ]
    windows = work.get("admission_window_ms")
    for server, window in enumerate(windows if isinstance(windows, list) else [windows]):
        lines += ["", f"Admission window: {window_words(window)}.", "",
                  "| clients | offline tok/s | served tok/s | overhead | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
                  "| ITL p99 ms | CPU us/token: HTTP / engine / clients | steps offline | steps served |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [table_row(r) for r in report["rows"] if r.get("server", 0) == server]
    if report.get("interleaved"):
        lines += ["", "Interleaved, after the table above, with the first server up throughout: offline, served, "
                  "offline, ... (fresh prompts each time); each served figure against the mean of the offline ones "
                  "just before and after it.", "",
                  "| clients | offline tok/s, in order | served tok/s, in order | overheads | median overhead |",
                  "|---:|---|---|---|---:|"]
        for r in report["interleaved"]:
            lines.append(f"| {r['concurrency']} | {' / '.join(f'{x:.0f}' for x in r['offline_tokens_per_s'])} | "
                         f"{' / '.join(f'{x:.0f}' for x in r['served_tokens_per_s'])} | "
                         f"{' / '.join(f'{100 * x:.1f}%' for x in r['overheads'])} | "
                         f"{100 * r['median_overhead']:.1f}% |")
    return "\n".join(lines) + "\n"


def table_row(r: dict) -> str:
    def ms(v):
        return f"{v:.1f}" if v is not None else "n/a"

    def us(v):
        return f"{v:.0f}" if v is not None else "n/a"

    before, after = r.get("offline_tokens_per_s_before"), r.get("offline_tokens_per_s_after")
    offline = f"{r['offline_tokens_per_s']:.0f}" + (f" ({before:.0f} / {after:.0f})" if after else "")
    return (f"| {r['concurrency']} | {offline} | {r['served_tokens_per_s']:.0f} | "
            f"{100 * r['overhead']:.1f}% | {ms(r['served_ttft_p50_ms'])} | {ms(r['served_ttft_p99_ms'])} | "
            f"{ms(r['served_itl_p50_ms'])} | {ms(r['served_itl_p99_ms'])} | "
            f"{us(r.get('served_http_cpu_us_per_token'))} / {us(r.get('served_engine_cpu_us_per_token'))} / "
            f"{us(r.get('served_client_cpu_us_per_token'))} | {steps(r, 'offline_')} | {steps(r, 'served_')} |")


def steps(row: dict, prefix: str) -> str:
    total, prefill = row.get(prefix + "steps"), row.get(prefix + "prefill_steps")
    return "n/a" if total is None else f"{total} ({prefill})"


def window_words(window: float | None) -> str:
    if not window:
        return "off (a request joins the batch at the next step)"
    return (f"at most {window:g} ms (`yaie serve --admission-window-ms`; while decodes run, up to 1.5 times a "
            "recent step with prompts, shared out over the running and the held requests; when idle, until "
            "none has come for 1 ms, unless clients that just finished have not come back yet)")

if __name__ == "__main__":
    raise SystemExit(main())
