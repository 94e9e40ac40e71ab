#!/usr/bin/env bash
# Lesson 05 part 2 on the lent GPU, in one call: the plan/run grader (tasks 5-8) on the reference solutions
# with its GPU checks (bf16, model-sized ragged batches), then the benchmark (mixed prefill + decode step in
# one launch vs lesson 04 + prefix prefill; cascade decode vs lesson 04; then the kernel's launch-setting
# and work-order variants). Logs and results go to $OUT; the benchmark log holds every row as it is
# measured, so a timeout still leaves the rows measured so far.
#   bash scripts/gpu_lesson05_plan_run.sh            # everything (about 6 minutes)
#   QUICK=1 bash scripts/gpu_lesson05_plan_run.sh    # one shape per section, no launch-setting variants
# The results name the commit from `git rev-parse`; where the lent machine's .git lags the tree it was sent,
# pass the right one: YAIE_GIT_COMMIT=<hash> bash scripts/gpu_lesson05_plan_run.sh
set -uo pipefail
OUT=${OUT:-out_lesson05_plan_run}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG="$OUT/lesson05_plan_run_grader.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

echo "== grader lesson 05 tasks 5-8 (reference solutions, GPU checks included) ==" | tee -a "$LOG"
timeout ${GRADER_TIMEOUT:-200} python3 -m pytest grader/lesson05/test_flashinfer.py --solutions -q -p no:cacheprovider \
    --durations=8 2>&1 | tee -a "$LOG" | tail -25
echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"

echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-200} python3 -m yaie.bench.lesson05_plan_run --solutions --out "$OUT" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/lesson05_plan_run_bench.log" | grep -v "^|"
ls -la "$OUT"
