#!/usr/bin/env bash
# Batch-1 decode of the engine on the lent GPU, in one call (everything lands in $OUT):
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_engine_decode.sh
# 1. GPU tests of the decode-step kernels: tests/test_fused_kernels.py -m gpu and the graders of lessons 02-04
#    and tests/test_lesson04.py on the reference (GPU checks included)        (TESTS=0 skips; TEST_PATHS: others)
# 2. scripts/gpu_engine_batching.py: greedy ids of the engine (CUDA graphs) equal transformers' (float32), spies
#                                                                                -> $OUT/batching.json (CHECK=0 skips)
# 3. scripts/bench_decode_kernels.py: each decode-step kernel beside what it replaces, inside CUDA graphs
#                                                                   -> $OUT/decode_kernels_<gpu>.json (KERNELS=0 skips)
# 4. python -m yaie.bench.engine at batch 1 (no transformers rows): with every op apart (switched off in-process:
#    yaie.ops' fused decode-step kernels, RoPE + K/V write and the one-row products with their norm or SwiGLU
#    gate; and the CUDA graphs' smallest context bound back at 1024), then as the engine runs, with the torch
#    profile of a decode run
#                                                                                -> $OUT/apart/, $OUT/engine/
#    (ENGINE=0 skips)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} YAIE_SOLUTIONS=all
: "${OUT:?set OUT to the output folder}"
ENGINE_ARGS="--size 1b --batches 1 --prompt-len 128 --new-tokens 128 --repeats 3 --skip-hf --long-prompt 0"
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  if [ "${TESTS:-1}" = "1" ]; then
    echo "== GPU tests"; start=$SECONDS
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider ${TEST_PATHS:-tests/test_fused_kernels.py grader/lesson02 \
        grader/lesson03 grader/lesson04 tests/test_lesson04.py}      # the reference: YAIE_SOLUTIONS=all
    echo "== rc $? ($((SECONDS - start)) s)"
  fi
  if [ "${CHECK:-1}" = "1" ]; then
    echo "== gpu_engine_batching.py"; start=$SECONDS
    timeout 200 python3 scripts/gpu_engine_batching.py --out "$OUT"
    echo "== rc $? ($((SECONDS - start)) s)"
  fi
  if [ "${KERNELS:-1}" = "1" ]; then
    echo "== bench_decode_kernels.py"; start=$SECONDS
    timeout 240 python3 scripts/bench_decode_kernels.py --out "$OUT" ${KERNEL_ARGS:-}
    echo "== rc $? ($((SECONDS - start)) s)"
  fi
  if [ "${ENGINE:-1}" = "1" ]; then
  echo "== engine, batch 1, every op apart"; start=$SECONDS
  timeout 150 python3 -c "import sys; from yaie import ops; ops.kv.fused_rope_write_kv = lambda manager, q: None
ops.layers.one_row_kernel = lambda x, name: None
import yaie.engine.cuda_graphs as graphs; graphs.MIN_BOUND = 1024
from yaie.bench.engine import main; sys.exit(main(sys.argv[1:]))" --out "$OUT/apart" $ENGINE_ARGS
  echo "== rc $? ($((SECONDS - start)) s)"
  echo "== engine, batch 1, as it runs (+ profile)"; start=$SECONDS
  timeout 150 python3 -m yaie.bench.engine --out "$OUT/engine" $ENGINE_ARGS --profile
  echo "== rc $? ($((SECONDS - start)) s)"
  rm -f "$OUT"/apart/*.md
  fi
  echo "== done"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/log.txt"
