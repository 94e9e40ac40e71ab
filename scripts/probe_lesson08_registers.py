"""Compile lesson 08's prefill kernels for the H100 (sm_90a) on any machine and print what ptxas reports:
registers per thread, bytes spilled, shared memory, tensor-core instructions. No GPU needed.

    python scripts/probe_lesson08_registers.py                  # both chunked designs, a few settings;
                                                                # the default route's two kernels

The chunked "registers" kernel (what based_prefill runs when given a chunk size: the whole state in
registers, order-2 features built as [C, 16, 16] products) spills kilobytes at every setting; the "rows"
design keeps the order-2 state in memory 16 rows at a time and spills little or nothing. The default
route's kernels (segment kernel, boundary-state kernel) do not spill at their default settings.
Uses the ptxas bundled with triton (its newest one, which reads the PTX version triton writes), or $PTXAS.
The counts depend on the Triton version: the GPU machine has Triton 3.6 (``pip install --target DIR
triton==3.6.0``, then ``PYTHONPATH=DIR``; its own ``DIR/triton/backends/nvidia/bin/ptxas`` as $PTXAS).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from solutions.kernels import based  # noqa: E402


def ptxas() -> str:
    tools = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas*")))
    return os.environ.get("PTXAS") or next((t for t in tools if t.endswith("blackwell")), tools[0])


def probe(kernel, consts: dict, num_warps: int, num_stages: int = 3, types: dict | None = None) -> dict:
    # Pointers, strides and the sizes a launch passes as multiples of 16 get the divisibility a real launch
    # specializes on (16-byte vector loads): without it ptxas reports other counts (the segment kernel 255
    # registers instead of the 128 that Nsight Compute saw on the H100).
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if types and name in types:
            sig[name] = types[name]
        elif name in consts:
            sig[name] = "constexpr"
            continue
        elif name in ("Q", "K", "V", "O"):
            sig[name] = "*bf16"
        elif name in ("STATE_KV", "STATE_K", "PREFIX_KV", "PREFIX_K"):     # float32 unless `types` says
            sig[name] = "*fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name.startswith("stride") or name in ("value_dim", "heads", "segment_len"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()},
                                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    report = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                            capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None,
            "shared": compiled.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"), "mma.sync": ptx.count("mma.sync")}


def main() -> None:
    settings = [(32, 64, 4), (64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 32, 4)]
    for variant, kernel, extra in (("registers", based._based_prefill_kernel,
                                    {"STATE_DOT_FP32": False}),
                                   ("rows", based._based_prefill_kernel_rows, {})):
        for chunk, block_v, warps in settings:
            consts = {"CHUNK": chunk, "BLOCK_V": block_v, "PRECISION": "tf32", **extra}
            try:
                result = probe(kernel, consts, warps)
            except Exception as err:  # noqa: BLE001 - report and go on
                result = f"failed: {type(err).__name__}: {str(err)[:200]}"
            print(f"{variant:9s} chunk {chunk:3d} BV {block_v:3d} {warps} warps: {result}", flush=True)
    # The default route: the segment (quadratic) kernel, float32 or bfloat16 boundary states, the
    # kernel that writes those states, and the launch that runs both kinds of program.
    for name, kernel, consts, warps, types in (
            ("segment BM 128 BN 64, float32 states", based._based_segment_kernel,
             {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_V": 64, "PRECISION": "tf32", "PREFIX_16BIT": False}, 8, None),
            ("segment BM 128 BN 64, bfloat16 states", based._based_segment_kernel,
             {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_V": 64, "PRECISION": "tf32", "PREFIX_16BIT": True}, 8,
             {"PREFIX_KV": "*bf16"}),
            ("segment BM 64 BN 64, bfloat16 states (the default)", based._based_segment_kernel,
             {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_V": 64, "PRECISION": "tf32", "PREFIX_16BIT": True}, 4,
             {"PREFIX_KV": "*bf16"}),
            *((f"boundary states groups {g} tokens {t}" + (", split" if sp else ""), based._based_prefix_state_kernel,
               {"GROUPS": g, "BLOCK_T": t, "BLOCK_V": 64, "PRECISION": "tf32", "SPLIT_V": sp}, w,
               {"PREFIX_KV": "*bf16"})
              for g, t, w, sp in ((4, 128, 4, False), (4, 128, 4, True), (4, 64, 4, False), (2, 128, 4, False),
                                  (8, 128, 8, False), (8, 128, 4, True))),
            *((f"first launch (boundary states + first segment), groups {g}" + (", split" if sp else "") + label,
               based._based_first_launch_kernel,
               {"GROUPS": g, "BLOCK_T": 128, "STATE_BLOCK_V": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_V": 64,
                "PRECISION": "tf32", "PREFIX_16BIT": True, "SPLIT_V": sp}, 4, {"PREFIX_KV": "*bf16"})
              for g, sp, label in ((8, True, " (the default)"), (4, False, ""), (4, True, "")))):
        try:
            result = probe(kernel, consts, warps, types=types)
        except Exception as err:  # noqa: BLE001 - report and go on
            result = f"failed: {type(err).__name__}: {str(err)[:200]}"
        print(f"{name}, {warps} warps: {result}", flush=True)


if __name__ == "__main__":
    main()
