"""``yaie serve``: the OpenAI-compatible server on the engine.

    yaie serve                                              # the bundled tiny model on 127.0.0.1:8000
    yaie serve --model ~/models/Llama-3.2-1B-Instruct --port 8080 --max-num-seqs 64
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-stories", "prompt": "Once upon a time", "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="yaie serve", description="Serve a model over the OpenAI API (completions, chat).")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the bundled tiny model)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 for small models)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks (default: 256 MiB worth on the CPU, half the free GPU memory on CUDA)")
    p.add_argument("--preemption", choices=("recompute", "swap"), default="recompute",
                   help="what a request gives way by when blocks run out (default recompute)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests running at once at most (default 256); a Based model (lesson 08) holds this many "
                        "rows of its constant-size state from the start, and the KV-cache options do not apply to it "
                        "(a telescoping model, lesson 07, runs one request at a time)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step: the decodes, then prompt chunks in what is left (default 2048)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in one step (the running requests wait for it)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="launch every decode step's kernels from Python")
    p.add_argument("--no-prefix-caching", action="store_true", help="every request prefills all its tokens")
    p.add_argument("--engine-in-thread", action="store_true",
                   help="run the engine loop in a thread of the server process (default: a process of its own, "
                        "so HTTP work does not hold the engine's interpreter lock)")
    p.add_argument("--admission-window-ms", type=float, default=0.0, metavar="MS",
                   help="with CUDA graphs, hold an arrived request back up to MS so that others arriving share its "
                        "prefill step (sooner when idle and none has come for 1 ms, or while decodes run after 1.5 "
                        "times a recent prefill step, shared out over running and held requests); default 0: "
                        "every request joins at the next step (on an H100 the window did not reliably raise "
                        "throughput: bench/results/serve_window_h100.md)")
    p.add_argument("--solutions", default=None, metavar="SPEC",
                   help="lessons that run the reference: 'all', 'none', '1,2' or '1-3' (sets YAIE_SOLUTIONS)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=5.0, metavar="S",
                   help="on Ctrl-C or SIGTERM, seconds the requests in flight get to finish before they are "
                        "cancelled (default 5; without a limit one long or stalled stream holds the exit)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("yaie serve: needs fastapi and uvicorn (pip install fastapi uvicorn)", file=sys.stderr)
        return 1
    from yaie import switch
    from yaie.engine.llm import LLM
    from yaie.model.config import ModelLoadError
    from yaie.ops import KernelMissing
    from yaie.engine.async_engine import AsyncEngine, Frontend, ProcessEngine
    from yaie.server.app import create_app

    llm_args = dict(model=args.model, device=args.device, cpu_threads=args.threads, block_size=args.block_size,
                    num_blocks=args.num_blocks, preemption=args.preemption, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill=not args.no_chunked_prefill,
                    cuda_graphs=False if args.no_cuda_graphs else None,
                    prefix_caching=not args.no_prefix_caching)
    window_s = args.admission_window_ms / 1000
    try:
        if args.solutions is not None:
            switch.use_solutions(args.solutions)
        if args.engine_in_thread:
            llm = LLM(**llm_args)
            app = create_app(llm, args.served_model_name, AsyncEngine(llm, window_s=window_s))
        else:
            llm = Frontend(args.model, args.block_size)      # checks the folder before the engine loads it
            engine = ProcessEngine(llm_args, window_s=window_s)
            engine.start()
            app = create_app(llm, args.served_model_name, engine)
    except (KernelMissing, switch.LessonUnavailable, ModelLoadError, ValueError, RuntimeError) as err:
        print(f"yaie serve: {err}", file=sys.stderr)
        return 1
    where = "in a thread" if args.engine_in_thread else "in its own process"
    print(f"yaie serve: {app.state.served_model_name} (engine {where}), http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.timeout_graceful_shutdown)
    return 0
