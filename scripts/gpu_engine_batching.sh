#!/usr/bin/env bash
# One lent-GPU call for the batched engine (issue 5 engine part, issue 6 item 4):
#   run: bash scripts/gpu_engine_batching.sh        ($OUT must be set; everything it writes lands there)
# 1. scripts/gpu_engine_batching.py: spies (lessons 02, 03, 04, 06 called), float32 greedy ids equal to
#    transformers' through the batched path (bundled model, roomy and tiny caches with recompute and swap
#    preemption; a random Llama 3 checkpoint)          -> $OUT/engine_batching_check.json
# 2. python -m yaie.bench.engine: decode throughput on a random ~1B Llama, bf16, batch 1 and 64, beside
#    transformers generate in the same process          -> $OUT/engine_<gpu>.{json,md}
set -o pipefail
export PYTHONUNBUFFERED=1 YAIE_SOLUTIONS=all
: "${OUT:?set OUT to the output folder}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "== gpu_engine_batching.py"
  timeout 200 python3 scripts/gpu_engine_batching.py --out "$OUT"
  echo "== engine throughput (rc of the check above: $?)"
  timeout 240 python3 -m yaie.bench.engine --out "$OUT" --size 1b --batches 1,64 --prompt-len 128 --new-tokens 128 --repeats 2
  echo "== done (rc $?)"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/engine_batching_gpu_log.txt"
