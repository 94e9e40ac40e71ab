"""The ``yaie`` command: ``yaie generate``, ``yaie grade``, ``yaie bench``, ``yaie serve``.

Sub-commands import their modules lazily so ``yaie --help`` is instant.
"""

from __future__ import annotations

import argparse
import difflib
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "generate": ("yaie.engine.cli", "generate text with the engine (default: the bundled tiny model)"),
        "grade": ("yaie.grade", "grade your lessons and print a per-lesson score table"),
        "bench": ("yaie.bench", "benchmark a lesson's kernels against their baselines (needs a GPU)"),
        "serve": ("yaie.server.cli", "serve a model over the OpenAI API (completions, chat; needs fastapi, uvicorn)"),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        parser = argparse.ArgumentParser(prog="yaie", description="YAIE: the course's command line")
        parser.add_argument("command", choices=sorted(commands), help="; ".join(f"{k}: {v[1]}" for k, v in commands.items()))
        if argv and argv[0] not in ("-h", "--help"):
            close = difflib.get_close_matches(argv[0], commands, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parser.print_usage(sys.stderr)
            print(f"yaie: error: invalid command {argv[0]!r} (choose from {', '.join(sorted(commands))}){hint}",
                  file=sys.stderr)
            return 2
        parser.print_help()
        return 0 if argv else 2
    import importlib

    from yaie.device import prepare_triton
    prepare_triton()
    module = importlib.import_module(commands[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
