#!/usr/bin/env bash
# Lessons 03 and 04 on the lent GPU, in one call: both graders on the reference (CUDA cache, pinned-memory
# swaps, bf16 paged decode), then the paged-decode benchmark beside torch SDPA. Logs and results go to $OUT.
#   bash scripts/gpu_lesson04.sh            # everything
#   QUICK=1 bash scripts/gpu_lesson04.sh    # benchmark on 4 shapes, no sweeps
set -uo pipefail
OUT=${OUT:-out_lesson04}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import hypothesis; print('hypothesis', hypothesis.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt" \
    || echo "hypothesis missing: the random programs use Python's random" | tee -a "$OUT/gpu.txt"

for lesson in 03 04; do
    echo "== grader lesson $lesson (reference solutions) =="
    timeout ${GRADER_TIMEOUT:-150} python3 -m pytest grader/lesson$lesson --solutions -q -p no:cacheprovider \
        2>&1 | tee "$OUT/grader_lesson${lesson}_gpu.log" | tail -12
done

echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-330} python3 -m yaie.cli bench lesson04 --solutions --out "$OUT" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^|"
ls -la "$OUT"
