"""``yaie serve``: the OpenAI-compatible server on the engine.

    yaie serve                                              # the bundled tiny model on 127.0.0.1:8000
    yaie serve --model ~/models/Llama-3.2-1B-Instruct --port 8080 --max-num-seqs 64
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-stories", "prompt": "Once upon a time", "max_tokens": 32}'
    YAIE_API_KEY=... yaie serve --host 0.0.0.0              # for a class: clients send 'Authorization: Bearer ...'
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from yaie.server.app import Limits         # (importing yaie.server imports the app already)
from yaie.server.protocol import MAX_CHOICES

API_KEY_ENV = "YAIE_API_KEY"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text}")
    return value


def check_api_key(key: str) -> str | None:
    """Why ``key`` cannot be an API key (it travels in an HTTP header), or None when it can."""
    if not key:
        return "the API key is empty"
    if not all(33 <= ord(c) <= 126 for c in key):
        return "the API key must be printable ASCII without spaces (it is sent in an HTTP header)"
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) listens on this machine only: ``localhost``, 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:                 # a host name: it may resolve to any interface
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed at start when the server listens beyond this machine without an API key."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"WARNING: listening on {host} without an API key: anyone who can reach this port can use the model. "
            f"Pass --api-key KEY or set {API_KEY_ENV} (clients then send 'Authorization: Bearer KEY').")


def build_parser() -> argparse.ArgumentParser:
    """``yaie serve``'s options (``--help`` lists them; ``docs/server.md`` explains them)."""
    p = argparse.ArgumentParser(prog="yaie serve", description="Serve a model over the OpenAI API (completions, chat).")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the bundled tiny model)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model folder's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                        "then set an API key)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"every request but /health and /metrics needs 'Authorization: Bearer KEY' (401 "
                        f"otherwise); default: the environment variable {API_KEY_ENV} (which stays out of the "
                        "shell's history), else no key")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None, metavar="N",
                   help="the longest prompt a request may send, in tokens (400 past it; default: the model's "
                        "context)")
    p.add_argument("--max-n", type=positive_int, default=Limits.max_n, metavar="N",
                   help=f"the largest 'n' (choices) a request may ask for (400 past it; default {Limits.max_n}, "
                        f"at most {MAX_CHOICES})")
    p.add_argument("--max-waiting", type=positive_int, default=Limits.max_waiting, metavar="N",
                   help="refuse new requests with 429 and Retry-After while this many requests wait for the "
                        f"engine (queued or preempted, not running; default {Limits.max_waiting})")
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
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (default 1); the engine then runs in a thread "
                        "of the server process, which starts the other ranks (docs/tensor_parallel.md)")
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
    p.add_argument("--shutdown-grace", "--timeout-graceful-shutdown", dest="shutdown_grace", type=seconds,
                   default=5.0, metavar="S",
                   help="on SIGTERM or Ctrl-C the server takes no new requests (503) and gives those in flight "
                        "up to S seconds to finish (default 5); then the streams still running end with an error "
                        "event and the server exits. A second signal ends the wait at once")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if api_key is not None and check_api_key(api_key):
        parser.error(check_api_key(api_key))
    if args.max_n > MAX_CHOICES:
        parser.error(f"--max-n: at most {MAX_CHOICES}, got {args.max_n}")
    try:
        import uvicorn
    except ImportError:
        print("yaie serve: needs fastapi and uvicorn (pip install fastapi uvicorn)", file=sys.stderr)
        return 1
    from yaie import switch
    from yaie.engine.llm import LLM
    from yaie.model.config import ModelLoadError
    from yaie.ops import KernelMissing
    from yaie.engine.async_engine import AsyncEngine
    from yaie.engine.process_engine import Frontend, ProcessEngine
    from yaie.server.app import END_WAIT_S, Server, create_app

    llm_args = dict(model=args.model, device=args.device, cpu_threads=args.threads, block_size=args.block_size,
                    num_blocks=args.num_blocks, preemption=args.preemption, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill=not args.no_chunked_prefill,
                    cuda_graphs=False if args.no_cuda_graphs else None,
                    prefix_caching=not args.no_prefix_caching, tensor_parallel_size=args.tensor_parallel_size)
    window_s = args.admission_window_ms / 1000
    limits = Limits(args.max_prompt_tokens, args.max_n, args.max_waiting)
    options = dict(api_key=api_key, limits=limits, shutdown_grace_s=args.shutdown_grace)
    warning = exposure_warning(args.host, api_key)
    if warning:                              # before the model loads: seen first
        print(f"yaie serve: {warning}", file=sys.stderr, flush=True)
    try:
        if args.solutions is not None:
            switch.use_solutions(args.solutions)
        if args.engine_in_thread or args.tensor_parallel_size > 1:    # (a daemon process starts no workers)
            llm = LLM(**llm_args)
            app = create_app(llm, args.served_model_name, AsyncEngine(llm, window_s=window_s), **options)
        else:
            llm = Frontend(args.model, args.block_size)      # checks the folder before the engine loads it
            engine = ProcessEngine(llm_args, window_s=window_s)
            engine.start()
            app = create_app(llm, args.served_model_name, engine, **options)
    except (KernelMissing, switch.LessonUnavailable, ModelLoadError, ValueError, RuntimeError) as err:
        print(f"yaie serve: {err}", file=sys.stderr)
        return 1
    where = "in a thread" if args.engine_in_thread or args.tensor_parallel_size > 1 else "in its own process"
    key = "API key required" if api_key is not None else "no API key"
    print(f"yaie serve: {app.state.served_model_name} (engine {where}, {key}), http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    if warning:                              # again below the model's loading messages
        print(f"yaie serve: {warning}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=END_WAIT_S)
    Server(config, app.state.lifecycle).run()
    return 0
