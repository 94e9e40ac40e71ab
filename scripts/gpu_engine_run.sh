#!/usr/bin/env bash
# The engine on the lent GPU, in one call, on the reference solutions (everything it writes lands in $OUT):
#   OUT=out bash scripts/gpu_engine_run.sh            # checks, then throughput
#   TRAIN=1 OUT=out bash scripts/gpu_engine_run.sh    # first retrain the bundled model and use the new one
# 0. (TRAIN=1) scripts/train_tiny_model.py -> $OUT (config.json, model.safetensors, tokenizer.json,
#    train_log.json, ...), copied into this machine's yaie/assets/tiny-stories/ for the next steps;
# 1. the README demo (`yaie generate`, auto mode) on the GPU and on the CPU;
# 2. scripts/gpu_engine_check.py: lesson 02 spies, float32 greedy ids equal transformers' (bundled model,
#    random Llama 3 / Qwen2 / Mistral checkpoints), bf16 logits against float32   -> $OUT/engine_gpu_check.json
# 3. scripts/gpu_engine_batching.py: spies on lessons 02, 03, 04, 06; float32 greedy ids equal transformers'
#    through continuous batching (preemption by recompute and swap, CUDA graphs on and off, random Llama 3,
#    Mistral and Qwen2 checkpoints with sliding-window layers)                   -> $OUT/engine_batching_check.json
# 4. python -m yaie.bench.engine: decode throughput on a random ~1B Llama, bf16, batch 1 and 64, with and
#    without CUDA graphs, beside transformers generate in the same process     -> $OUT/engine_<gpu>.{json,md}
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
: "${OUT:?set OUT to the output folder}"
if [ "${TRAIN:-0}" = "1" ]; then
  python3 scripts/train_tiny_model.py --out "$OUT" 2>&1 | tee "$OUT/train_output.txt"
  if [ -f "$OUT/model.safetensors" ]; then
    cp "$OUT"/{config.json,generation_config.json,model.safetensors,tokenizer.json,train_log.json,train_output.txt} \
       yaie/assets/tiny-stories/
  fi
fi
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "== yaie generate (GPU, YAIE_SOLUTIONS unset)"; env -u YAIE_SOLUTIONS python3 -m yaie.cli generate --seed 0
  echo "== yaie generate --device cpu"; env -u YAIE_SOLUTIONS python3 -m yaie.cli generate --device cpu --seed 0
  echo "== gpu_engine_check.py"
  YAIE_SOLUTIONS=all timeout 200 python3 scripts/gpu_engine_check.py --out "$OUT"
  echo "== gpu_engine_batching.py (rc of the check above: $?)"
  YAIE_SOLUTIONS=all timeout 240 python3 scripts/gpu_engine_batching.py --out "$OUT"
  echo "== engine throughput (rc of the check above: $?)"
  YAIE_SOLUTIONS=all timeout 240 python3 -m yaie.bench.engine --out "$OUT" --size 1b --batches 1,64 \
      --prompt-len 128 --new-tokens 128 --repeats 2
  echo "== done (rc $?)"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/engine_gpu_log.txt"
