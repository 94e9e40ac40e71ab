#!/usr/bin/env bash
# Lesson 07 on the lent GPU, in one call: the grader on the reference (bf16/fp16/fp32 checks on GPU shapes),
# the indexed-matmul benchmark against PyTorch gather + matmul, and the tiny-model training of the
# telescoping and full-attention models with the engine's memory per sequence. Logs and results go to $OUT.
#   bash scripts/gpu_lesson07.sh                        # everything
#   SECTIONS="grader bench" bash scripts/gpu_lesson07.sh  # a part
#   QUICK=1 bash scripts/gpu_lesson07.sh                # benchmark on 3 shapes
set -uo pipefail
OUT=${OUT:-out_lesson07}
SECTIONS=${SECTIONS:-grader bench train}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

if [[ " $SECTIONS " == *" grader "* ]]; then
    echo "== grader lesson 07 (reference solutions) =="
    timeout ${GRADER_TIMEOUT:-150} python3 -m pytest grader/lesson07 --solutions -q -p no:cacheprovider -rs \
        2>&1 | tee "$OUT/grader_gpu.log" | tail -12
fi

if [[ " $SECTIONS " == *" bench "* ]]; then
    echo "== benchmark =="
    export LESSON07_DEADLINE_S=${LESSON07_DEADLINE_S:-200}   # later shapes are skipped after this
    timeout ${BENCH_TIMEOUT:-300} python3 -m yaie.cli bench lesson07 --solutions --out "$OUT" ${QUICK:+--quick} \
        2>&1 | tee "$OUT/bench.log" | grep -v "^|"
fi

if [[ " $SECTIONS " == *" train "* ]]; then
    echo "== training: full attention and telescoping tiny models, same data and steps =="
    for attn in full telescoping; do
        timeout ${TRAIN_TIMEOUT:-200} python3 scripts/train_tiny_model.py --attention "$attn" \
            --out "$OUT/tiny-$attn" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_$attn.log" | tail -6
    done
    echo "== engine memory per sequence (telescoping model) =="
    timeout ${ENGINE_TIMEOUT:-120} python3 scripts/gpu_lesson07_engine.py --model "$OUT/tiny-telescoping" \
        --out "$OUT/engine_memory.json" 2>&1 | tee "$OUT/engine_memory.log" | tail -12
fi
ls -la "$OUT"
