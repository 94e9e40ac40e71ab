"""Does a change leave a kernel's machine code alone? Compile the decode kernel (lesson 04) and the FlashAttention
forward kernel (lesson 06) at an earlier commit and now, for sm_90 (Hopper), on any machine, and compare the PTX
instructions (parameters, line records and debug sections left out).

    python scripts/compare_kernel_ptx.py a0cca22        # session 8: the sliding window's constexpr paths

No GPU is needed: ``triton.compile`` targets ``GPUTarget("cuda", 90, 32)`` from the CPU. Used in session 8 to show
that adding ``sliding_window`` (behind ``WINDOWED: tl.constexpr``) did not change the full-attention kernels, so
their earlier benchmark results still describe them (bench/README.md, session 8). Triton 3.6 (the lent GPU's
version) was used; another version compiles differently, but the same for both sides.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "K_CACHE": "*bf16", "V_CACHE": "*bf16",
            "OUT": "*bf16", "LSE": "*fp32", "PART_OUT": "*fp32", "PART_LSE": "*fp32", "CU_SEQLENS_Q": "*i32",
            "CU_SEQLENS_K": "*i32", "BLOCK_TABLES": "*i32", "CONTEXT_LENS": "*i32", "COUNTERS": "*i32"}
FLOATS = {"qk_scale_log2", "scale_log2"}

# (file, kernel, constexprs, launch options): the settings the benchmarks launch with.
CASES = [
    ("solutions/kernels/paged_attention.py", "_paged_decode_kernel",
     dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=64, NUM_SPLITS=1, FUSE_MERGE=False,
          FP32_DOT=False, PRECISION="tf32"), dict(num_warps=4, num_stages=3)),
    ("solutions/kernels/paged_attention.py", "_paged_decode_kernel",
     dict(GROUP=8, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=64, NUM_SPLITS=2, FUSE_MERGE=True,
          FP32_DOT=False, PRECISION="tf32"), dict(num_warps=4, num_stages=3)),
    ("solutions/kernels/flash_attention.py", "_flash_fwd_kernel",
     dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, CAUSAL=True, VARLEN=True, FP32_DOT=False,
          PRECISION="tf32"), dict(num_warps=8, num_stages=3)),
    ("solutions/kernels/flash_attention.py", "_flash_fwd_kernel",
     dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, CAUSAL=False, VARLEN=False, FP32_DOT=False,
          PRECISION="tf32"), dict(num_warps=8, num_stages=3)),
]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ptx(kernel, constexprs: dict, options: dict) -> str:
    names = kernel.arg_names
    # A constexpr the other side does not have (a new feature) is compiled switched off; one this side does
    # not have is left out.
    consts = {**{n: False for n in names if n.isupper() and n not in constexprs and n not in POINTERS},
              **{n: v for n, v in constexprs.items() if n in names}}
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(c),): v for c, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def instructions(text: str, kernel_name: str) -> list[str]:
    """The PTX without parameter names and loads, line records, comments and the DWARF sections."""
    text = re.sub(rf"{kernel_name}_param_\d+", "PARAM", text)
    code = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith((".section", ".b8")):
            break
        if stripped.startswith((".param", "//", ".loc", ".file")) or "ld.param" in stripped:
            continue
        kept = line.split("//")[0].rstrip()
        if kept:
            code.append(kept)
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the earlier commit")
    args = parser.parse_args()
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for i, (path, name, constexprs, options) in enumerate(CASES):
            old_file = Path(tmp) / f"old_{i}.py"
            old_file.write_text(subprocess.run(["git", "show", f"{args.rev}:{path}"], cwd=ROOT, check=True,
                                               capture_output=True, text=True).stdout)
            old = instructions(ptx(getattr(load(old_file, f"old_{i}"), name), constexprs, options), name)
            new = instructions(ptx(getattr(load(ROOT / path, f"new_{i}"), name), constexprs, options), name)
            label = f"{name} {', '.join(f'{k}={v}' for k, v in constexprs.items() if k in ('NUM_SPLITS', 'CAUSAL', 'VARLEN', 'GROUP'))}"
            print(f"{label}: {len(old)} and {len(new)} PTX lines, {'identical' if old == new else 'DIFFERENT'}")
            if old != new:
                same = False
                print("\n".join(list(difflib.unified_diff(old, new, args.rev, "now", lineterm="", n=1))[:40]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
