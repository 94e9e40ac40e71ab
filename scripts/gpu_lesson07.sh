#!/usr/bin/env bash
# Lesson 07 on the lent GPU, in one call: the grader on the reference (bf16/fp16/fp32 checks on GPU shapes)
# while the engine's memory per sequence is measured beside it (a telescoping and a full-attention tiny
# model, two processes, each generating ENGINE_TOKENS tokens: memory, not timing, so sharing the GPU does
# not matter);
# then, the GPU to itself, the indexed-matmul benchmark against PyTorch gather + matmul with what time
# is left. Logs and results go to $OUT (at most 8 files: run.log, engine_memory.json, bench.log and the
# benchmark's five).
#   bash scripts/gpu_lesson07.sh                          # grader, engine memory, benchmark in TOTAL_S seconds
#   SECTIONS="grader bench" bash scripts/gpu_lesson07.sh  # a part
#   SECTIONS=train TOTAL_S=300 bash scripts/gpu_lesson07.sh   # train the tiny full and telescoping models
#   QUICK=1 ENGINE_TOKENS=2048 bash scripts/gpu_lesson07.sh   # a short try: benchmark on 3 shapes
set -uo pipefail
OUT=${OUT:-out_lesson07}
SECTIONS=${SECTIONS:-grader engine bench}
TOTAL_S=${TOTAL_S:-395}          # the whole script's budget: the benchmark gets what is left of it
ENGINE_WAIT_S=${ENGINE_WAIT_S:-200}   # the benchmark starts by then: an engine still running is stopped
START=$SECONDS
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG="$OUT/run.log"; [[ "$SECTIONS" == "train" ]] && LOG=/dev/null   # train alone: its 8 files only
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.total --format=csv | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
echo "commit ${YAIE_GIT_COMMIT:-unknown}" | tee -a "$LOG"

ENGINE_PIDS=""
if [[ " $SECTIONS " == *" engine "* ]]; then
    # Two processes side by side (each measures its own allocations), merged into one JSON at the end.
    echo "== engine memory per sequence: tiny-telescoping and tiny-stories, ${ENGINE_TOKENS:-16384} tokens (background) =="
    for model in tiny-telescoping tiny-stories; do
        python3 scripts/gpu_lesson07_engine.py --model yaie/assets/$model --tokens ${ENGINE_TOKENS:-16384} \
            --out /tmp/lesson07_engine_$model.json > /tmp/lesson07_engine_$model.log 2>&1 &
        ENGINE_PIDS="$ENGINE_PIDS $!"
    done
fi

if [[ " $SECTIONS " == *" grader "* ]]; then
    echo "== grader lesson 07 (reference solutions) ==" | tee -a "$LOG"
    timeout ${GRADER_TIMEOUT:-150} python3 -m pytest grader/lesson07 --solutions -q -p no:cacheprovider -rs \
        2>&1 | tee -a "$LOG" | tail -12
fi

if [[ -n "$ENGINE_PIDS" ]]; then
    for pid in $ENGINE_PIDS; do
        while kill -0 "$pid" 2>/dev/null && (( SECONDS - START < ENGINE_WAIT_S )); do sleep 2; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "engine measurement $pid still running after $ENGINE_WAIT_S s: stopped (its JSON holds what it measured)" | tee -a "$LOG"
            kill "$pid"; sleep 2
        fi
        wait "$pid" 2>/dev/null
    done
    echo "== engine memory logs ($(( SECONDS - START )) s) ==" | tee -a "$LOG"
    tail -n 12 /tmp/lesson07_engine_*.log | tee -a "$LOG"
    python3 - "$OUT/engine_memory.json" /tmp/lesson07_engine_tiny-telescoping.json /tmp/lesson07_engine_tiny-stories.json <<'PY'
import json, sys
parts = [json.load(open(p)) for p in sys.argv[2:] if __import__("os").path.exists(p)]
merged = {k: v for k, v in (parts[0] if parts else {}).items() if k not in ("models", "command")}
merged["command"] = "bash scripts/gpu_lesson07.sh (scripts/gpu_lesson07_engine.py --model M, both models at once)"
merged["models"] = [m for part in parts for m in part.get("models", [])]
open(sys.argv[1], "w").write(json.dumps(merged, indent=1) + "\n")
print("wrote", sys.argv[1], "with", [m["model"] for m in merged["models"]])
PY
fi

if [[ " $SECTIONS " == *" train "* ]]; then
    # At most 8 files come back from $OUT: the telescoping model's 5 files and both training logs. The
    # full-attention model (the comparison) stays on the machine.
    echo "== training: full attention and telescoping tiny models, same data, steps and seed =="
    for attn in full telescoping; do
        dest="$OUT/tiny-$attn"; [[ $attn == full ]] && dest=/tmp/tiny-full
        timeout ${TRAIN_TIMEOUT:-150} python3 scripts/train_tiny_model.py --attention "$attn" \
            --out "$dest" ${TRAIN_ARGS:---steps 2000} 2>&1 | tee "$OUT/train_$attn.log" | grep -v "^step" | tail -6
    done
fi

if [[ " $SECTIONS " == *" bench "* ]]; then
    LEFT=$(( TOTAL_S - (SECONDS - START) ))
    echo "== benchmark ($LEFT s left) ==" | tee -a "$LOG"
    # No new shape starts after the deadline; the largest one (b4 l16k) takes about 25 s.
    export LESSON07_DEADLINE_S=${LESSON07_DEADLINE_S:-$(( LEFT - 45 ))}
    timeout ${BENCH_TIMEOUT:-$(( LEFT - 5 ))} python3 -m yaie.cli bench lesson07 --solutions --out "$OUT" ${QUICK:+--quick} \
        2>&1 | tee "$OUT/bench.log" | grep -v "^|"
fi
echo "done in $(( SECONDS - START )) s" | tee -a "$LOG"
ls -la "$OUT"
