#!/usr/bin/env bash
# Tensor parallelism on a lent 2-GPU machine, in one call (everything it writes lands in $OUT):
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_tensor_parallel.sh
# 1. check: a random small Llama in bf16, greedy ids over 2 GPUs against 1, with and without CUDA graphs
#                                                                                  -> $OUT/tp_check.json
# 2. speed: the Llama-3-8B shape (random, bf16; written once to /tmp), decode tokens/s at batch 1 and 64 over
#    1 GPU, then 2 GPUs (each in a process of its own)                             -> $OUT/tp_speed_{1,2}.json
# 3. collectives: one decode step's all-reduces and logits all-gather alone, in a CUDA graph, 2 GPUs
#                                                                                  -> $OUT/tp_collectives.json
# 4. report                                                          -> $OUT/tensor_parallel_<gpu>.{json,md}
# NVLink multicast stays off (the lent machines' rule): NCCL_NVLS_ENABLE=0 and the rest, set again here.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} YAIE_SOLUTIONS=all
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
: "${OUT:?set OUT to the output folder}"
run() { local limit=$1; shift; timeout "$limit" python3 -m yaie.bench.tensor_parallel "$@" --out "$OUT"; echo "== rc $?"; }
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m | head -4
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "== check"; run 150 check
  echo "== speed, 1 GPU"; run 210 speed --tp 1
  echo "== speed, 2 GPUs"; run 150 speed --tp 2
  echo "== collectives"; run 60 collectives
  run 30 report
  cat "$OUT"/tensor_parallel_*.md
  echo "== done $(date -u +%FT%TZ)"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/tensor_parallel_log.txt"
