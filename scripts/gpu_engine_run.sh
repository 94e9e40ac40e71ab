#!/usr/bin/env bash
# One lent-GPU call for the engine (issue 3): train the bundled model, then run the engine on the GPU.
#   run: bash scripts/gpu_engine_run.sh        ($OUT must be set; everything it writes lands there)
# 1. scripts/train_tiny_model.py -> $OUT (config.json, model.safetensors, tokenizer.json, ...), copied
#    into this machine's yaie/assets/tiny-stories/ so the next steps use the new model;
# 2. the README demo (`yaie generate`, auto mode) on the GPU and on this machine's CPU;
# 3. scripts/gpu_engine_check.py (lesson 02 spies, fp32 token parity with transformers, bf16 logits);
# 4. the engine's CPU tests with this machine's transformers.
set -o pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output folder}"
python3 scripts/train_tiny_model.py --out "$OUT" 2>&1 | tee "$OUT/train_output.txt"
if [ -f "$OUT/model.safetensors" ]; then
  cp "$OUT"/{config.json,generation_config.json,model.safetensors,tokenizer.json,train_log.json,train_output.txt} \
     yaie/assets/tiny-stories/
fi
{
  echo "== yaie generate (GPU, YAIE_SOLUTIONS unset)"; env -u YAIE_SOLUTIONS python3 -m yaie.cli generate --seed 0
  echo "== yaie generate --device cpu"; env -u YAIE_SOLUTIONS python3 -m yaie.cli generate --device cpu --seed 0
  echo "== gpu_engine_check"; python3 scripts/gpu_engine_check.py --out "$OUT"
  echo "== engine tests (CPU)"; python3 -m pytest tests/test_engine.py tests/test_engine_hf.py tests/test_engine_bundled.py \
      tests/test_loader.py tests/test_ops.py -q -p no:cacheprovider
} 2>&1 | tee "$OUT/gpu_log.txt"
