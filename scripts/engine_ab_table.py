"""The table of scripts/gpu_engine_ab.sh: the engine of this tree beside a baseline's, from one call's results.

    python scripts/engine_ab_table.py OUT          # reads OUT/{base1,new1,new2,base2}/{1b,8b}/engine_*.json and
                                                   # OUT/serve_{base,new}/serve_based_*.json; writes OUT/engine_ab_<gpu>.md
    AB_BASE, AB_NEW: what the two arms are, for the title (gpu_engine_ab.sh sets them)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

RUNS = ("base1", "new1", "new2", "base2")


def engine_rows(out: Path) -> dict:
    """{(size, batch): {run: (tokens/s, decode tokens/s, roofline fraction)}} of the engine rows."""
    found: dict = {}
    for run in RUNS:
        for size in ("1b", "8b"):
            for path in sorted((out / run / size).glob("engine_*.json")):
                report = json.loads(path.read_text())
                for row in report["rows"]:
                    if row.get("system") == "yaie engine":
                        found.setdefault((size, row["batch"]), {})[run] = (
                            row["tokens_per_s"], row.get("decode_tokens_per_s"), row.get("roofline_fraction"))
    return found


def serve_rows(out: Path) -> dict:
    """{concurrency: {tree: (offline tokens/s, served tokens/s, overhead)}}."""
    found: dict = {}
    for tree in ("base", "new"):
        for path in sorted((out / f"serve_{tree}").glob("serve_based_*.json")):
            for row in json.loads(path.read_text())["rows"]:
                found.setdefault(row["concurrency"], {})[tree] = (row["offline_tokens_per_s"],
                                                                  row["served_tokens_per_s"], row["overhead"])
    return found


def environment(out: Path) -> str:
    for path in sorted(out.glob("*/1b/engine_*.json")):
        env = json.loads(path.read_text())["environment"]
        return ", ".join(f"{k} {v}" for k, v in env.items() if k in ("gpu", "torch", "triton", "git_commit"))
    return "unknown"


def main(out: Path) -> None:
    base = os.environ.get("AB_BASE", "the baseline")
    new = os.environ.get("AB_NEW", "this tree")
    lines = [f"# The engine: {new} beside {base} ({environment(out)})", "",
             "Engine rows of `python -m yaie.bench.engine` (random Llamas, bf16, 128 + 128 tokens per request, "
             "CUDA graphs), run four times in one call: baseline, new, new, baseline. Decode tokens/s (end to end "
             "in brackets); the ratio is the median of the new runs over the median of the baseline runs.", "",
             "| model | batch | baseline 1 | new 1 | new 2 | baseline 2 | new / baseline (decode) | roofline, new |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (size, batch), runs in sorted(engine_rows(out).items()):
        cells = [f"{runs[r][1]:.0f} ({runs[r][0]:.0f})" if r in runs and runs[r][1] else "" for r in RUNS]
        new = [runs[r][1] for r in ("new1", "new2") if r in runs and runs[r][1]]
        base = [runs[r][1] for r in ("base1", "base2") if r in runs and runs[r][1]]
        ratio = f"{statistics.median(new) / statistics.median(base):.3f}" if new and base else ""
        roof = [runs[r][2] for r in ("new1", "new2") if r in runs and runs[r][2]]
        lines.append(f"| {size} | {batch} | " + " | ".join(cells) + f" | {ratio} | "
                     + (f"{statistics.median(roof):.0%}" if roof else "") + " |")
    serve = serve_rows(out)
    if serve:
        lines += ["", "`yaie serve` over the tiny Based model (`scripts/gpu_serve_based_load.py`): streaming clients "
                  "beside offline `LLM.generate` on the same requests; overhead = 1 - served / offline.", "",
                  "| clients | baseline offline | baseline served | baseline overhead | new offline | new served | "
                  "new overhead |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for clients, trees in sorted(serve.items()):
            cells = []
            for tree in ("base", "new"):
                offline, served, overhead = trees.get(tree, (None, None, None))
                cells += ["", "", ""] if offline is None else [f"{offline:.0f}", f"{served:.0f}", f"{overhead:+.1%}"]
            lines.append(f"| {clients} | " + " | ".join(cells) + " |")
    env = environment(out)
    gpu = next((name.lower() for name in ("H100", "H200") if name in env), "gpu")
    path = out / f"engine_ab_{gpu}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
