#!/usr/bin/env bash
# The tiny Based model beside the tiny full-attention one: same size, data, steps and seed, one run.
# Writes into $1: tiny-based.tar (the model folder, for yaie/assets/tiny-based/), full_train_log.json,
# memory.json (memory per sequence and decode time in the engine). Called by scripts/gpu_lesson08.sh.
set -uo pipefail
OUT=${1:-out_lesson08}
STEPS=${STEPS:-3000}
mkdir -p "$OUT/tiny-based" "$OUT/tiny-full"
python3 scripts/train_tiny_model.py --out "$OUT/tiny-full" --steps "$STEPS" 2>&1 | grep -v "^step .*[1-9]00 " 
python3 scripts/train_tiny_model.py --out "$OUT/tiny-based" --steps "$STEPS" --attention based 2>&1 \
    | tee "$OUT/tiny-based/train_output.txt" | grep -v "^step .*[1-9]00 "
cp "$OUT/tiny-full/train_log.json" "$OUT/full_train_log.json"
python3 scripts/gpu_lesson08_memory.py "$OUT/tiny-based" --out "$OUT/memory.json"
tar -C "$OUT" -cf "$OUT/tiny-based.tar" tiny-based
rm -rf "$OUT/tiny-based" "$OUT/tiny-full"
