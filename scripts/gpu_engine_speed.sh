#!/usr/bin/env bash
# Engine speed on the lent GPU, in one call, on the reference solutions (everything it writes lands in $OUT):
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_engine_speed.sh
# 1. scripts/gpu_engine_chunked_check.py: float32, chunked prefill gives the ids of whole-prompt prefill and of
#    transformers, through lesson 05's prefix-prefill kernel, with preemption       -> $OUT/engine_chunked_check.json
# 2. python -m yaie.bench.engine: the random ~1B Llama, bf16: inter-token latency of 16 decoding requests while
#    a 16k-token prompt arrives (chunked and whole); throughput at batch 64, 1, 16, 256 (engine rows first, then transformers in that order: the time budget may cut the last) beside transformers
#    generate and transformers with its static cache + torch.compile; batch 1 against the bandwidth roofline
#                                                                                   -> $OUT/engine_<gpu>.{json,md}
# SKIP_CHECK=1: the benchmark only. BENCH_BUDGET: seconds after which the benchmark starts no more transformers rows (default 260).
# WITH_8B=1: then the Llama-3-8B-shaped config (hidden 4096, 32 layers, 32/8 heads, vocab 128256), batch 1 and 64
#   (BENCH_8B_EXTRA=--skip-hf: the engine rows only, e.g. the batch-1 roofline fraction when time is short).
# BATCHES: the 1.1B's batch sizes, in the order they run (default 64,1,16,256).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} YAIE_SOLUTIONS=all
: "${OUT:?set OUT to the output folder}"
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  if [ "${SKIP_CHECK:-0}" != "1" ]; then
    echo "== gpu_engine_chunked_check.py"
    timeout 80 python3 scripts/gpu_engine_chunked_check.py --out "$OUT"
  fi
  echo "== engine throughput and chunked-prefill latency (rc of the check above: $?)"
  timeout "${BENCH_TIMEOUT:-400}" python3 -m yaie.bench.engine --out "$OUT" --size 1b --batches "${BATCHES:-64,1,16,256}" \
      --prompt-len 128 --new-tokens 128 --repeats 2 --long-prompt 16000 --itl-batch 16 \
      --max-num-batched-tokens 2048 --time-budget "${BENCH_BUDGET:-260}" --profile
  echo "== rc $?"
  if [ "${WITH_8B:-0}" = "1" ]; then
    echo "== the Llama-3-8B-shaped random config: batch 1 and 64 beside transformers (-> \$OUT/8b/engine_<gpu>.*)"
    timeout "${BENCH_8B_TIMEOUT:-330}" python3 -m yaie.bench.engine --out "$OUT/8b" --size 8b --batches 1,64 \
        --prompt-len 128 --new-tokens 128 --repeats 2 --long-prompt 0 --time-budget "${BENCH_8B_BUDGET:-200}" \
        ${BENCH_8B_EXTRA:-}
    echo "== rc $?"
  fi
  echo "== done"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/engine_speed_log.txt"
