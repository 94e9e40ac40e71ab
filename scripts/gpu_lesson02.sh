#!/usr/bin/env bash
# Lesson 02 on the lent GPU, in one call: the GPU grader on the reference, the grader on the stubs
# (every task must fail as not implemented), the launch-setting sweep, and the benchmark.
#   run from the repository root; results and logs go to $OUT (default ./gpu_out)
set -u -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_DEFAULT_FP_FUSION=1
LOG="$OUT/gpu_lesson02.log"
# pytest may be missing on the GPU machine: install the carried wheels (.whl) then.
python3 -c "import pytest" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; }
{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "== grader on the reference solutions (GPU)"
  python3 -m pytest grader/lesson02 --solutions -q -p no:cacheprovider
  echo "grader-solutions-rc=$?"
  echo "== grader on the stubs (every task must be 'not implemented yet')"
  python3 -m pytest grader/lesson02 -q -p no:cacheprovider
  echo "grader-stubs-rc=$? (expected non-zero)"
} 2>&1 | tee "$LOG"
if [ "${SKIP_SWEEP:-0}" != "1" ]; then
  echo "== launch-setting sweep of the reference kernels" | tee -a "$LOG"
  python3 -m yaie.bench.lesson02 --sweep --out "$OUT" 2>&1 | tee -a "$LOG"
fi
echo "== benchmark" | tee -a "$LOG"
python3 -m yaie.cli bench lesson02 --solutions --out "$OUT" 2>&1 | tee -a "$LOG"
echo "bench-rc=$?" | tee -a "$LOG"
