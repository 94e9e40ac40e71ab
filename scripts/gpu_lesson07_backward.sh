#!/usr/bin/env bash
# Lesson 07's backward kernels on the lent GPU, in one call: the grader on the reference (its GPU shapes,
# bf16 too), then scripts/gpu_lesson07_backward.py (the backward rows of `yaie bench lesson07` on the
# oldest-first and random maps at l 4k and 16k (the stable map at 4k), ours against PyTorch gather +
# matmul in the same run; first a tile sweep whose fastest tiles the rest uses; then the route's
# threshold and where the time goes; tiles4k, not in the default list: tiles at l 4k, reported only).
# Logs and results go to $OUT: run.log, lesson07_backward_<gpu>.json and .md.
#   bash scripts/gpu_lesson07_backward.sh                       # grader, then every section
#   SECTIONS=bench bash scripts/gpu_lesson07_backward.sh        # grader, then the backward rows alone
set -uo pipefail
OUT=${OUT:-out_lesson07_backward}
SECTIONS=${SECTIONS:-sweep,bench,runs,parts}
START=$SECONDS
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.total --format=csv | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" \
    | tee -a "$LOG"
echo "commit ${YAIE_GIT_COMMIT:-unknown}" | tee -a "$LOG"
echo "== grader lesson 07 (reference solutions) ==" | tee -a "$LOG"
timeout ${GRADER_TIMEOUT:-100} python3 -m pytest grader/lesson07 --solutions -q -p no:cacheprovider -rs 2>&1 \
    | tee -a "$LOG" | tail -12
echo "== backward: $SECTIONS ($(( SECONDS - START )) s) ==" | tee -a "$LOG"
timeout ${BENCH_TIMEOUT:-180} python3 scripts/gpu_lesson07_backward.py --out "$OUT" --sections "$SECTIONS" 2>&1 \
    | tee -a "$LOG" | grep -v '^sweep\|^runs\|^parts\|^tiles4k'
echo "done in $(( SECONDS - START )) s" | tee -a "$LOG"
