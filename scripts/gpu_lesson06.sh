#!/usr/bin/env bash
# Lesson 06 on the lent GPU, in one call: the Hopper variant's checks, the benchmark (reference, Hopper
# variant, SDPA's default and its flash backend, forward and backward), a sweep that times each configuration
# of the Hopper forward (warp specialisation included), then the grader on the reference. Logs and result
# files go to $OUT (or ./out_lesson06). The most wanted results come first, in case a time limit cuts the rest.
#   bash scripts/gpu_lesson06.sh                                   # everything
#   QUICK=1 bash scripts/gpu_lesson06.sh                           # benchmark on the 4k shapes only
#   GRADER_K=low_precision YAIE_BENCH_HEAD_DIMS=128 bash scripts/gpu_lesson06.sh   # a shorter call
set -uo pipefail
OUT=${OUT:-out_lesson06}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"

echo "== Hopper variant and benchmark logic: course tests on the GPU =="
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/test_lesson06_hopper.py tests/test_bench_lesson06.py -q \
    -p no:cacheprovider 2>&1 | tee "$OUT/hopper_tests.log" | tail -15

echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-420} python3 -m yaie.cli bench lesson06 --solutions --out "$OUT" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^|"
if python3 -c "import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9))"; then
    echo "== Hopper forward: each configuration timed =="
    timeout ${SWEEP_TIMEOUT:-200} python3 -m yaie.bench.lesson06 sweep --out "$OUT" ${QUICK:+--quick} 2>&1 \
        | tee "$OUT/sweep.log"
fi

# The grader's shapes are <= 1024 tokens: the reference uses its fixed blocks there (no autotuning).
echo "== grader (reference solutions) =="
timeout ${GRADER_TIMEOUT:-200} python3 -m pytest grader/lesson06 --solutions -q -p no:cacheprovider \
    ${GRADER_K:+-k "$GRADER_K"} 2>&1 | tee "$OUT/grader_gpu.log" | tail -12

ls -la "$OUT"
