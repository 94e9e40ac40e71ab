#!/usr/bin/env bash
# Lesson 06 on the lent GPU, in one call: the Hopper variant's course tests (forward and backward, both dq
# modes, against float64), the benchmark (reference, Hopper variant, SDPA's default and its flash backend,
# forward and backward), then a sweep that times each configuration of the Hopper kernels (and the
# backward's preprocessing alone). The most wanted results come first, in case a time limit cuts the rest.
# Output under $OUT (or ./out_lesson06), few files (the device returns at most 8): run.log (everything
# printed), bench/lesson06.{json,md,png}, lesson06_hopper_sweep.json.
#   bash scripts/gpu_lesson06.sh                               # everything
#   QUICK=1 bash scripts/gpu_lesson06.sh                       # benchmark and sweep on the 4k shapes only
#   YAIE_BENCH_HEAD_DIMS=128 TESTS_TIMEOUT=120 bash scripts/gpu_lesson06.sh   # head dim 128 only, shorter
#   DRY_RUN=1 bash scripts/gpu_lesson06.sh                     # no GPU: the sweep's logic in the interpreter
set -uo pipefail
OUT=${OUT:-out_lesson06}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1

if [ -n "${DRY_RUN:-}" ]; then
    echo "== dry run: the sweep's logic on the CPU (interpreter, tiny shapes; timings fail without a GPU) =="
    TRITON_INTERPRET=1 python3 -c "
from yaie.bench import lesson06
rows = lesson06.sweep('$OUT', device='cpu', sweep_shapes=[(1, 2, 70, 32)])
bad = [r for r in rows if r.get('rel_err') is None or not r['rel_err'] < 2e-2]
print(len(rows), 'rows;', len(bad), 'did not run or did not match'); raise SystemExit(1 if bad else 0)"
    exit $?
fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
echo "commit ${YAIE_GIT_COMMIT:-unknown}; started $(date -u +%FT%TZ)"

echo "== Hopper variant and benchmark logic: course tests on the GPU =="
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/test_lesson06_hopper.py tests/test_bench_lesson06.py -q \
    -p no:cacheprovider -rs 2>&1 | tail -40
echo "tests done $(date -u +%T)"

echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-240} python3 -m yaie.cli bench lesson06 --solutions --out "$OUT/bench" ${QUICK:+--quick} \
    2>&1 | grep -v "^|"
echo "benchmark done $(date -u +%T)"

if python3 -c "import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9))"; then
    echo "== Hopper kernels: each configuration timed =="
    timeout ${SWEEP_TIMEOUT:-150} python3 -m yaie.bench.lesson06 sweep --out "$OUT" ${QUICK:+--quick}
    echo "sweep done $(date -u +%T)"
fi
ls -la "$OUT" "$OUT/bench"
