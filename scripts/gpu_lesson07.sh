#!/usr/bin/env bash
# Lesson 07 on the lent GPU, in one call: the grader on the reference (bf16/fp16/fp32 checks on GPU shapes);
# the tiny-model training of a full-attention and a telescoping model (same data, steps and seed) and the
# engine's memory per sequence while it generates from the telescoping one; then the indexed-matmul
# benchmark against PyTorch gather + matmul with what time is left. Logs and results go to $OUT.
#   bash scripts/gpu_lesson07.sh                          # everything, in about TOTAL_S seconds
#   SECTIONS="grader bench" bash scripts/gpu_lesson07.sh  # a part (at most 8 files come back: run
#   SECTIONS=train TOTAL_S=300 bash scripts/gpu_lesson07.sh   #   "train" on its own)
#   QUICK=1 bash scripts/gpu_lesson07.sh                  # benchmark on 3 shapes
set -uo pipefail
OUT=${OUT:-out_lesson07}
SECTIONS=${SECTIONS:-grader train bench}
TOTAL_S=${TOTAL_S:-450}          # the whole script's budget: the benchmark gets what is left of it
START=$SECONDS
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
FACTS="$OUT/gpu.txt"; [[ "$SECTIONS" == "train" ]] && FACTS=/dev/null   # train alone: its 8 files only
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.total --format=csv | tee "$FACTS"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$FACTS"

if [[ " $SECTIONS " == *" grader "* ]]; then
    echo "== grader lesson 07 (reference solutions) =="
    timeout ${GRADER_TIMEOUT:-120} python3 -m pytest grader/lesson07 --solutions -q -p no:cacheprovider -rs \
        2>&1 | tee "$OUT/grader_gpu.log" | tail -12
fi

if [[ " $SECTIONS " == *" train "* ]]; then
    # At most 8 files come back from $OUT: the telescoping model's 5 files, both training logs and the
    # engine's memory record. The full-attention model (the comparison) stays on the machine.
    echo "== training: full attention and telescoping tiny models, same data, steps and seed =="
    for attn in full telescoping; do
        dest="$OUT/tiny-$attn"; [[ $attn == full ]] && dest=/tmp/tiny-full
        timeout ${TRAIN_TIMEOUT:-150} python3 scripts/train_tiny_model.py --attention "$attn" \
            --out "$dest" ${TRAIN_ARGS:---steps 2000} 2>&1 | tee "$OUT/train_$attn.log" | grep -v "^step" | tail -6
    done
    echo "== engine memory per sequence (telescoping model) =="
    timeout ${ENGINE_TIMEOUT:-100} python3 scripts/gpu_lesson07_engine.py --model "$OUT/tiny-telescoping" \
        --tokens ${ENGINE_TOKENS:-16384} --out "$OUT/engine_memory.json" 2>&1 | tail -8
fi

if [[ " $SECTIONS " == *" bench "* ]]; then
    LEFT=$(( TOTAL_S - (SECONDS - START) ))
    echo "== benchmark ($LEFT s left) =="
    # No new shape starts after the deadline; the last one (b4 l16k) takes about 25 s.
    export LESSON07_DEADLINE_S=${LESSON07_DEADLINE_S:-$(( LEFT - 60 ))}
    timeout ${BENCH_TIMEOUT:-$(( LEFT - 5 ))} python3 -m yaie.cli bench lesson07 --solutions --out "$OUT" ${QUICK:+--quick} \
        2>&1 | tee "$OUT/bench.log" | grep -v "^|"
fi
ls -la "$OUT" "$OUT"/tiny-* 2>/dev/null
