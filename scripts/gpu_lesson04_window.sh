#!/usr/bin/env bash
# One lent-GPU call for sliding windows (lesson 04 task 4, lesson 06 task 5) and the engine's windowed models:
#   run: OUT=... YAIE_GIT_COMMIT=<hash> bash scripts/gpu_lesson04_window.sh   (everything lands in $OUT)
# 1. pytest grader/lesson04 on CUDA: the reference solutions (all 4 tasks, bf16 and real shapes) and the
#    stubs (every task "not implemented yet")                       -> $OUT/lesson04_window_grader.log
# 2. scripts/gpu_engine_batching.py: the engine on CUDA vs transformers, now with random Mistral and Qwen2
#    checkpoints whose windowed layers decode through lesson 04 inside CUDA graphs
#                                                                    -> $OUT/engine_batching_check.json
# 3. scripts/gpu_lesson04_window.py: windowed decode checked against float64 and timed beside the same
#    kernel over the window's tokens, the whole context, SDPA on the window, and the old gather path
#                                                                    -> $OUT/lesson04_window_<gpu>.json
# 4. scripts/gpu_lesson06_window.py: windowed prefill checked against float64 and timed beside causal
#    prefill, SDPA with a window mask and the old gather path       -> $OUT/lesson06_window_<gpu>.json
# (1. also runs grader/lesson06, whose task 5 is the prefill window.)
# pytest may be missing on the GPU machine: carry .whl (see scripts/gpu_lesson02.sh) and it is installed.
set -u -o pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1 YAIE_SOLUTIONS=all PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "== grader/lesson04 on the reference solutions"
  (unset YAIE_SOLUTIONS; timeout 200 python3 -m pytest grader/lesson04 --solutions -q -p no:cacheprovider 2>&1 | tail -12)
  echo "== grader/lesson04 on the stubs"
  (unset YAIE_SOLUTIONS; timeout 100 python3 -m pytest grader/lesson04 -q -p no:cacheprovider 2>&1 | tail -8)
  echo "== grader/lesson06 on the reference solutions"
  (unset YAIE_SOLUTIONS; timeout 300 python3 -m pytest grader/lesson06 --solutions -q -p no:cacheprovider 2>&1 | tail -12)
  echo "== grader/lesson06 on the stubs"
  (unset YAIE_SOLUTIONS; timeout 100 python3 -m pytest grader/lesson06 -q -p no:cacheprovider 2>&1 | tail -9)
} 2>&1 | tee "$OUT/lesson04_window_grader.log"
{
  echo "== gpu_engine_batching.py"
  timeout 240 python3 scripts/gpu_engine_batching.py --out "$OUT"
  echo "== gpu_lesson04_window.py (rc of the check above: $?)"
  timeout 240 python3 scripts/gpu_lesson04_window.py
  echo "== gpu_lesson06_window.py (rc of the benchmark above: $?)"
  timeout 240 python3 scripts/gpu_lesson06_window.py
  echo "== done (rc $?)"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/lesson04_window_gpu.log"
