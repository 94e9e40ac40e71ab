#!/usr/bin/env bash
# The sampling kernel of this tree beside that of another tree, kernel alone, on the lent GPU, in one call:
#   (.baseline/ as scripts/gpu_engine_ab.sh makes it) run with carry [.baseline]:
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) BASE_COMMIT=BASE bash scripts/gpu_sampling_ab.sh
# 1. the sampler's GPU tests (this tree);
# 2. scripts/bench_sampling.py (this tree's script) over this tree's kernel, then the baseline's, then this
#    tree's again (so a drift of the machine shows): $OUT/{new1,base,new2}/sampling_<gpu>.{json,md}.
# VOCABS and BATCHES (defaults 32000,128256 and 1,16,64) pick the shapes. The engine's sampled decode beside the
# baseline is scripts/gpu_engine_ab.sh with BENCH_EXTRA="--temperature 1.0 --top-p 0.95".
set -o pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BASE_TREE=$(cd "${BASE_TREE:-.baseline}" && pwd)
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown} against ${BASE_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== GPU tests of the sampler"
  PYTHONPATH=$PWD timeout 200 python3 -m pytest -m gpu tests/test_sampling_kernel.py tests/test_device_sampling.py \
    -q -p no:cacheprovider
  echo "== tests rc $?"
  bench() {   # tree, label
    (cd "$1" && PYTHONPATH=$1 python3 -c "import yaie.engine.sampling_kernel as k; print('== $2 runs', k.__file__)")
    PYTHONPATH=$1 timeout 150 python3 scripts/bench_sampling.py --out "$OUT/$2" --vocabs "${VOCABS:-32000,128256}" \
      --batches "${BATCHES:-1,16,64}"
    echo "== $2 rc $?"
  }
  bench "$PWD" new1
  bench "$BASE_TREE" base
  bench "$PWD" new2
  echo "== done"
} 2>&1 | tee "$OUT/sampling_ab_log.txt"
