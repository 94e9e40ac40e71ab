#!/usr/bin/env bash
# Lesson 08's engine path on the lent GPU, in one call: memory per sequence and decode tokens/s of the tiny
# Based model beside the tiny full-attention model (1k and 16k tokens, batch 1 and 16; CUDA graphs; a table
# side by side at the end, and the kernels of one batch-1 decode step of each model), then the fused Based
# decode kernel against the PyTorch step on the GPU, then (unless SKIP_TESTS=1) the Based engine tests with
# the GPU (batched CUDA graphs against eager steps, the kernels against the PyTorch path). The numbers come
# first so that a run cut short by its time limit still has them.
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_lesson08_engine.sh
#   OUT=out SKIP_TESTS=1 bash scripts/gpu_lesson08_engine.sh        # the numbers and the kernel check only
# Everything printed goes to $OUT/lesson08_engine_gpu.log; the results to $OUT/lesson08_tiny_based_memory.json.
set -uo pipefail
OUT=${OUT:-out_lesson08_engine}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== engine: memory per sequence, decode tokens/s (Based beside full attention) =="
timeout ${DECODE_TIMEOUT:-180} python3 scripts/gpu_lesson08_memory.py yaie/assets/tiny-based \
    --full yaie/assets/tiny-stories --lengths ${DECODE_LENGTHS:-1024,16384} --batches ${DECODE_BATCHES:-1,16} \
    --out "$OUT/lesson08_tiny_based_memory.json" 2>&1

echo "== the fused decode kernel on the GPU against the PyTorch step =="
timeout ${CHECK_TIMEOUT:-90} python3 -m pytest tests/test_lesson08.py -q -p no:cacheprovider -rs -k cuda 2>&1

if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== Based engine tests (GPU ones included) =="
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_based_engine.py -q -p no:cacheprovider -rs 2>&1
fi
} 2>&1 | tee "$OUT/lesson08_engine_gpu.log"
