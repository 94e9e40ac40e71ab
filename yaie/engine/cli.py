"""``yaie generate``: stream text from the engine.

    yaie generate "Once upon a time, there was a little fox named"
    yaie generate "The capital of France is" --model ~/models/Llama-3.2-1B --max-tokens 32 --temperature 0
    yaie generate --solutions 1 "..."        # run the reference for lesson 01

Text goes to stdout as tokens come; notices and the timing line go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = "Once upon a time, there was a little fox named"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="yaie generate", description="Generate text with the YAIE engine.")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the bundled tiny model)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens to generate at most (default 200)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's generation_config)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for small models, where more threads only add overhead)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="prefill every prompt in full (default: reuse cached prefixes, lesson 05's radix tree)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step: the decodes, then prompt chunks in what is left (default 2048)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in one step instead of in chunks of the step's budget")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (default 1; docs/tensor_parallel.md)")
    p.add_argument("--solutions", default=None, metavar="SPEC",
                   help="lessons that run the reference: 'all', 'none', '1,2' or '1-3' (sets YAIE_SOLUTIONS)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from yaie import switch
    from yaie.engine.llm import LLM
    from yaie.model.config import ModelLoadError
    from yaie.ops import KernelMissing, describe, ran

    wrote = False  # whether stdout holds text (an error message then starts on a new line)
    try:
        if args.solutions is not None:
            switch.use_solutions(args.solutions)
        llm = LLM(args.model, device=args.device, cpu_threads=args.threads,
                  prefix_caching=not args.no_prefix_caching, max_num_batched_tokens=args.max_num_batched_tokens,
                  chunked_prefill=not args.no_chunked_prefill, tensor_parallel_size=args.tensor_parallel_size)
        params = llm.default_sampling_params(max_tokens=args.max_tokens, temperature=args.temperature,
                                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                          add_special_tokens=False)
        start = time.perf_counter()
        stream = llm.stream(prompt, params)
        while True:
            try:
                piece = next(stream)
            except StopIteration as done:
                output = done.value
                if not wrote and not args.chat:
                    sys.stdout.write(prompt)  # nothing was generated: still show the prompt
                break
            if not wrote and not args.chat:
                # The prompt goes out with the first piece, after any notice the prefill printed on stderr.
                sys.stdout.write(prompt)
            sys.stdout.write(piece)
            sys.stdout.flush()
            wrote = True
        sys.stdout.write("\n")
        wrote = False
        elapsed = time.perf_counter() - start
    except (KernelMissing, switch.LessonUnavailable, ModelLoadError, ValueError) as err:
        sys.stdout.write("\n" if wrote else "")
        sys.stdout.flush()
        print(f"yaie generate: {err}", file=sys.stderr)
        return 1
    hits = llm.prefix_cache_stats()
    cached = (f"; prefix cache: {hits.cached_tokens} of {hits.prompt_tokens} prompt tokens reused" if hits is not None
              else "; prefix caching off")
    print(f"[{llm.model_dir.name} on {llm.device}, {describe()}; {ran()}; "
          f"{len(output.token_ids)} tokens in {elapsed:.2f}s, finish: {output.finish_reason}{cached}]",
          file=sys.stderr)
    return 0
