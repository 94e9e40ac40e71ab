#!/usr/bin/env bash
# Lesson 08 on the lent GPU, in one call: the benchmark against flash-linear-attention and SDPA, the
# tiny Based model in the engine (memory per sequence; decode tokens/s beside the tiny full-attention
# model at 1k and 16k tokens), the grader on the reference (GPU bf16 checks included), then (unless
# SKIP_TRAIN=1) the tiny Based model trained beside the full-attention one (scripts/gpu_lesson08_train.sh).
# The benchmark comes first so that a run cut short by its time limit still has the numbers.
# Everything printed goes to $OUT/lesson08_gpu.log (or ./out_lesson08); result files beside it.
#   bash scripts/gpu_lesson08.sh
#   QUICK=1 SKIP_TRAIN=1 bash scripts/gpu_lesson08.sh
#   SKIP_TRAIN=1 SKIP_ENGINE=1 bash scripts/gpu_lesson08.sh     # the kernel benchmark and the grader only
#   SKIP_GRADER=1 ...; GRADER_ARGS="-n 8" ...                      # no grader; the grader's tests in 8 processes
# fla-core (the benchmark's baseline) is installed from wheels in .whl/ when they are there (the GPU
# machine has no network); without it the benchmark skips the fla rows with a note.
set -uo pipefail
OUT=${OUT:-out_lesson08}
mkdir -p "$OUT"
LOG="$OUT/lesson08_gpu.log"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import fla; print('fla-core', fla.__version__)" 2>&1 | tail -1

echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-300} python3 -m yaie.cli bench lesson08 --solutions --out "$OUT" ${QUICK:+--quick} 2>&1

if [ -z "${SKIP_ENGINE:-}" ]; then
    echo "== engine: memory per sequence, decode tokens/s of the tiny Based model beside the tiny full-attention one =="
    timeout ${DECODE_TIMEOUT:-120} python3 scripts/gpu_lesson08_memory.py yaie/assets/tiny-based \
        --full yaie/assets/tiny-stories --lengths ${DECODE_LENGTHS:-1024,16384} --out "$OUT/lesson08_engine.json" 2>&1
fi

if [ -z "${SKIP_GRADER:-}" ]; then
    echo "== grader (reference solutions) =="
    timeout ${GRADER_TIMEOUT:-240} python3 -m pytest grader/lesson08 --solutions -q -p no:cacheprovider ${GRADER_ARGS:-} 2>&1
fi

if [ -z "${SKIP_TRAIN:-}" ]; then
    echo "== tiny Based model beside the full-attention one =="
    timeout ${TRAIN_TIMEOUT:-300} bash scripts/gpu_lesson08_train.sh "$OUT" 2>&1
fi
ls -la "$OUT"
} 2>&1 | tee "$LOG"
