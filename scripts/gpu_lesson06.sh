#!/usr/bin/env bash
# Lesson 06 on the lent GPU, in one call: the grader on the reference (bf16/fp16/fp32 checks), then the
# benchmark against torch SDPA's flash backend. Logs and result files go to $OUT (or ./out_lesson06).
#   bash scripts/gpu_lesson06.sh            # everything
#   QUICK=1 bash scripts/gpu_lesson06.sh    # benchmark on the 4k shapes only
set -uo pipefail
OUT=${OUT:-out_lesson06}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# The grader's shapes are <= 1024 tokens: the reference uses its fixed blocks there (no autotuning).
echo "== grader (reference solutions) =="
timeout ${GRADER_TIMEOUT:-200} python3 -m pytest grader/lesson06 --solutions -q -p no:cacheprovider \
    2>&1 | tee "$OUT/grader_gpu.log" | tail -25

echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-420} python3 -m yaie.cli bench lesson06 --solutions --out "$OUT" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^|"
ls -la "$OUT"
