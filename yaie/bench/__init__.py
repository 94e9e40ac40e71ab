"""``yaie bench lessonNN``: time a lesson's kernels beside their baselines on a CUDA GPU.

    yaie bench lesson02                    # your kernels (yaie/...)
    yaie bench lesson02 --solutions        # the reference kernels (solutions/...)
    yaie bench lesson02 --out /tmp/res --quick
    yaie bench engine --out bench/results  # engine tokens/s beside transformers (yaie/bench/engine.py)
    yaie bench serve --out bench/results   # the OpenAI server under load beside LLM.generate (yaie/bench/serve.py)

The command measures the GPU's copy bandwidth and matmul rate once (:func:`harness.measure_peaks`),
imports ``yaie.bench.lessonNN`` and calls its ``run(args) -> list[Row]``, then writes
``<out>/lessonNN_<gpu>.{json,md,png}`` (:func:`harness.write_results`) and prints the table.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

NO_GPU_MESSAGE = "yaie bench: a CUDA GPU is needed to run benchmarks, and none was found; nothing was measured."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yaie bench", description="benchmark a lesson's kernels against their baselines")
    parser.add_argument("lesson", help="which lesson, e.g. lesson02 (or 2)")
    parser.add_argument("--solutions", nargs="?", const="all", default=None, metavar="SPEC",
                        help="run the reference solutions: all of them, or the lessons in SPEC ('2', '1-3')")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where to write the JSON, Markdown and PNG files (default: bench/results)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing (a smoke run)")
    return parser


def lesson_module_name(text: str) -> str:
    """``'lesson02'``, ``'lesson2'`` or ``'2'`` -> ``'lesson02'``; ``ValueError`` otherwise."""
    match = re.fullmatch(r"(?:lesson)?0*(\d{1,2})", text.strip().lower())
    if not match:
        raise ValueError(f"cannot read lesson {text!r}; write it as lesson02 or 2")
    return f"lesson{int(match.group(1)):02d}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:  # the engine benchmark has options of its own
        import torch
        if not torch.cuda.is_available() and "--device" not in argv:
            print(NO_GPU_MESSAGE)
            return 2
        from yaie.bench import engine
        return engine.main(argv[1:])
    if argv[:1] == ["serve"]:   # the server under load beside offline LLM.generate (yaie/bench/serve.py)
        import torch
        if not torch.cuda.is_available() and "--device" not in argv:
            print(NO_GPU_MESSAGE)
            return 2
        from yaie.bench import serve
        return serve.main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        name = lesson_module_name(args.lesson)
    except ValueError as err:
        print(f"yaie bench: {err}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"yaie.bench.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"yaie.bench.{name}":
            raise
        print(f"yaie bench: there is no benchmark for {name} (no yaie/bench/{name}.py)", file=sys.stderr)
        return 2

    import torch
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 2

    from yaie import switch
    from yaie.bench import harness
    if args.solutions is not None:
        switch.use_solutions(args.solutions)
    print(f"yaie bench {name}: {switch.describe()}")
    print(f"GPU: {torch.cuda.get_device_name(0)}; measuring copy bandwidth and bf16 matmul rate ...", flush=True)
    peaks = harness.measure_peaks("cuda")
    print(f"  copy {peaks['copy_GBps']:.0f} GB/s (read + write), bf16 matmul {peaks['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    rows = module.run(args)
    out_dir = Path(args.out) if args.out else harness.ROOT / "bench" / "results"
    paths = harness.write_results(f"{name}_{harness.gpu_slug()}", rows, peaks, out_dir)
    print(harness.markdown_table(rows, peaks))
    for path in paths:
        print(f"wrote {path}")
    return 0
