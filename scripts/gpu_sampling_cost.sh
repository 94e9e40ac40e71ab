#!/usr/bin/env bash
# What sampling costs a decode step, on the lent GPU, in one call: the random 1.1B Llama at batch 64 (bf16, 128 +
# 128 tokens per request, CUDA graphs, engine rows only) greedy, sampled (temperature 1.0, top-p 0.95, no seeds)
# and sampled with a seed per request (seed 1000 + i), each run twice in the order greedy, sampled, seeded,
# seeded, sampled, greedy (so a drift of the machine shows). Output: $OUT/sampling_cost_log.txt and one folder
# of python -m yaie.bench.engine results per run.
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_sampling_cost.sh
set -o pipefail
export PYTHONUNBUFFERED=1 YAIE_SOLUTIONS=all PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
BATCH=${BATCH:-64}
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}, batch $BATCH"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  run() {   # label, options
    echo "== $1"
    timeout 120 python3 -m yaie.bench.engine --out "$OUT/$1" --size 1b --batches "$BATCH" --prompt-len 128 \
      --new-tokens 128 --repeats 3 --long-prompt 0 --skip-hf $2 | grep "yaie engine  "
  }
  SAMPLED="--temperature 1.0 --top-p 0.95"
  run greedy1 ""
  run sampled1 "$SAMPLED"
  run seeded1 "$SAMPLED --seed 1000"
  run seeded2 "$SAMPLED --seed 1000"
  run sampled2 "$SAMPLED"
  run greedy2 ""
  echo "== done"
} 2>&1 | tee "$OUT/sampling_cost_log.txt"
