#!/usr/bin/env bash
# Lessons 03 and 04 on the lent GPU, in one call: both graders on the reference (CUDA cache, pinned-memory
# swaps, bf16 paged decode), the paged-decode benchmark beside torch SDPA (default and forced backends,
# merge fused vs a 2nd kernel, the kernel on SDPA's contiguous tensors, CUDA-graph rows, split sweep),
# then the investigation script (host time, contiguous vs paged, block placement, launch sweep, a cache
# past 2**31 elements). Logs and results go to $OUT. Fits in about 6 minutes.
#   bash scripts/gpu_lesson04.sh            # everything
#   QUICK=1 bash scripts/gpu_lesson04.sh    # benchmark on 4 shapes, no sweeps, no investigation
set -uo pipefail
OUT=${OUT:-out_lesson04}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# At most 8 files come back from the lent machine: grader.log (GPU facts and both graders), bench.log,
# lesson04_<gpu>.{json,md,png}, tune.log and lesson04_tune_<gpu>.json.
LOG="$OUT/grader.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
python3 -c "import hypothesis; print('hypothesis', hypothesis.__version__)" 2>/dev/null | tee -a "$LOG" \
    || echo "hypothesis missing: the random programs use Python's random" | tee -a "$LOG"

for lesson in 03 04; do
    echo "== grader lesson $lesson (reference solutions) ==" | tee -a "$LOG"
    timeout ${GRADER_TIMEOUT:-45} python3 -m pytest grader/lesson$lesson --solutions -q -p no:cacheprovider \
        > "$OUT/grader_tmp.log" 2>&1; echo "exit $?" >> "$OUT/grader_tmp.log"
    cat "$OUT/grader_tmp.log" >> "$LOG"; tail -12 "$OUT/grader_tmp.log"; rm -f "$OUT/grader_tmp.log"
done

echo "== benchmark =="
export LESSON04_DEADLINE_S=${LESSON04_DEADLINE_S:-140}   # the split sweeps are skipped after this
timeout ${BENCH_TIMEOUT:-220} python3 -m yaie.cli bench lesson04 --solutions --out "$OUT" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^|"

if [ -z "${QUICK:-}" ]; then
    echo "== investigation =="
    OUT="$OUT" timeout ${TUNE_TIMEOUT:-200} python3 scripts/gpu_lesson04_tune.py 2>&1 | tee "$OUT/tune.log" | tail -40
fi
ls -la "$OUT"
