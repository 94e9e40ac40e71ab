#!/usr/bin/env bash
# Lessons 03 and 04 on the lent GPU, in one call: both graders on the reference (CUDA cache, pinned-memory
# swaps, bf16 paged decode), then the paged-decode benchmark beside torch SDPA (default and forced backends,
# merge fused vs a 2nd kernel, the kernel on SDPA's contiguous tensors, CUDA-graph rows, split sweep).
# Logs and results go to $OUT. Fits in about 4 minutes.
#   bash scripts/gpu_lesson04.sh            # everything
#   QUICK=1 bash scripts/gpu_lesson04.sh    # benchmark on 4 shapes, no sweeps
set -uo pipefail
OUT=${OUT:-out_lesson04}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Files: grader.log (GPU facts and both graders), bench.log, lesson04_<gpu>.{json,md,png}.
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
ls -la "$OUT"
