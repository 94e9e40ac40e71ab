#!/usr/bin/env bash
# Tensor parallelism on a lent 2-GPU machine, in one call (everything it writes lands in $OUT):
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_tensor_parallel.sh
# Stages, in this order, each a process of its own (python -m yaie.bench.tensor_parallel ...):
#   collectives        a decode step's all-reduces + logits all-gather alone, in a CUDA graph, 2 GPUs, NCCL and
#                      one-shot; one-shot sums against NCCL's                     -> $OUT/tp_collectives.json
#   speed, 1 GPU       the Llama-3-8B shape (random, bf16; written once to /tmp): decode tokens/s, batch 1 and 64
#   speed, 2 GPUs      the same over 2 GPUs, by all-reduce path (YAIE_TP_ALL_REDUCE): nccl, one-shot, then skip
#                      (a step without its all-reduces, wrong output)            -> $OUT/tp_speed.json
#   check              a random small Llama in bf16, greedy ids and top-5 log-probabilities: 1 GPU with CUDA
#                      graphs, transformers (bf16, float32), 1 GPU eager; 2 GPUs with CUDA graphs over each
#                      path                                                       -> $OUT/tp_check.json
#   speed, YAIE_PDL=0  (PDL_AB=1) 1 and 2 GPUs with the one-row products launched without PDL -> $OUT/tp_speed.json
#   report                                                         -> $OUT/tensor_parallel_<gpu>.{json,md}
# Each stage runs under its own time limit, in a process group of its own that is killed at the limit (its
# worker processes with it), and never past the whole script's budget (BUDGET_S, default 400 s): a stage that
# hangs costs its limit, the others still run. Each stage writes what it measured as soon as it has it, and
# the log ($OUT/tensor_parallel_log.txt) is written line by line; `report` can be run again anywhere on $OUT.
# If the one-shot all-reduce did not work in the first stage, its later stages are skipped; SKIP_ONE_SHOT=1 skips
# them too.
# NVLink multicast stays off (the lent machines' rule): NCCL_NVLS_ENABLE=0 and the rest, set again here.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} YAIE_SOLUTIONS=all
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
: "${OUT:?set OUT to the output folder}"
BUDGET_S=${BUDGET_S:-400}
TP="python3 -m yaie.bench.tensor_parallel"

stage() {   # stage NAME LIMIT_S COMMAND...: run it in a process group of its own, killed at the limit
  local name=$1 limit=$2 left=$((BUDGET_S - SECONDS - 5)); shift 2
  if (( left < 15 )); then echo "== $name: skipped, ${left} s of the budget left"; return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit} s) $(date -u +%T)"
  setsid "$@" &
  local pid=$!
  ( sleep "$limit" >/dev/null 2>&1; echo "== $name: ${limit} s limit reached, killing it"
    kill -TERM -- -"$pid" 2>/dev/null; sleep 3 >/dev/null 2>&1; kill -KILL -- -"$pid" 2>/dev/null ) &
  local watchdog=$!
  wait "$pid"; local rc=$?
  kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  kill -KILL -- -"$pid" 2>/dev/null          # whatever the stage left (its workers)
  echo "== $name: rc $rc $(date -u +%T)"
}

mkdir -p "$OUT"
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}, budget ${BUDGET_S} s"
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m | head -4
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version())"
  stage collectives 60 $TP collectives --out "$OUT"
  ONE_SHOT=1
  if [ "${SKIP_ONE_SHOT:-0}" = 1 ]; then
    echo "== SKIP_ONE_SHOT=1: the one-shot all-reduce's speed and check stages are skipped"
    ONE_SHOT=
  elif ! python3 -c "import json, sys; sys.exit(not json.load(open('$OUT/tp_collectives.json'))['one_shot_available'])" 2>/dev/null; then
    echo "== the one-shot all-reduce did not run in the collectives stage: its other stages are skipped"
    ONE_SHOT=
  fi
  stage "speed, 1 GPU" 150 $TP speed --tp 1 --out "$OUT"
  stage "speed, 2 GPUs, NCCL" 80 env YAIE_TP_ALL_REDUCE=nccl $TP speed --tp 2 --out "$OUT"
  [ -n "$ONE_SHOT" ] && stage "speed, 2 GPUs, one-shot" 80 env YAIE_TP_ALL_REDUCE=one-shot $TP speed --tp 2 --out "$OUT"
  stage "check, 1 GPU and transformers" 80 $TP check --tp 1 --out "$OUT"
  stage "check, 2 GPUs, NCCL" 60 env YAIE_TP_ALL_REDUCE=nccl $TP check --tp 2 --out "$OUT"
  [ -n "$ONE_SHOT" ] && stage "check, 2 GPUs, one-shot" 60 env YAIE_TP_ALL_REDUCE=one-shot $TP check --tp 2 --out "$OUT"
  stage "speed, 2 GPUs, no all-reduce" 80 env YAIE_TP_ALL_REDUCE=skip $TP speed --tp 2 --out "$OUT"
  if [ "${PDL_AB:-0}" = 1 ]; then   # the one-row products without programmatic dependent launch, 1 and 2 GPUs
    stage "speed, 1 GPU, YAIE_PDL=0" 100 env YAIE_PDL=0 $TP speed --tp 1 --out "$OUT"
    stage "speed, 2 GPUs, NCCL, YAIE_PDL=0" 80 env YAIE_PDL=0 YAIE_TP_ALL_REDUCE=nccl $TP speed --tp 2 --out "$OUT"
  fi
  stage report 20 $TP report --out "$OUT"
  cat "$OUT"/tensor_parallel_*.md 2>/dev/null
  echo "== done $(date -u +%FT%TZ), ${SECONDS} s"
} 2>&1 | grep --line-buffered -v "Loading weights\|Writing model shards" | tee "$OUT/tensor_parallel_log.txt"
