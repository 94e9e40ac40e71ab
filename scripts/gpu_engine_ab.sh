#!/usr/bin/env bash
# The engine of this tree beside the engine of another commit, on the lent GPU, in one call (output in $OUT):
#   mkdir .baseline && git archive BASE yaie solutions scripts/gpu_serve_based_load.py | tar -x -C .baseline
#   rm -r .baseline/yaie/assets && ln -s ../../yaie/assets .baseline/yaie/assets      # (.baseline/ is not tracked)
#   run with carry [.baseline, .whl]:  OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) BASE_COMMIT=BASE \
#       bash scripts/gpu_engine_ab.sh
# 1. the engine's GPU tests of the row runner (Based on CUDA graphs against LLM.generate);
# 2. python -m yaie.bench.engine, engine rows only (no transformers), 128 + 128 tokens per request, bf16: the random
#    ~1.1B Llama at batch 1 and 64, then the Llama-3-8B shape at batch 1; baseline, this tree, then this tree and the
#    baseline again (the order swapped, so a drift of the machine shows)           -> $OUT/{base,new}{1,2}/...
# 3. yaie serve over the tiny Based model at 1 and 16 streaming clients beside offline LLM.generate, for both trees
#    (scripts/gpu_serve_based_load.py)                                               -> $OUT/serve_{base,new}/...
# SIZES (default "1b 8b") and SERVE=0 split the work over calls (each call's limit is 10 minutes); BATCHES (default
# 1,64) for the 1.1B; BENCH_EXTRA adds options to both trees' benchmark (e.g. "--temperature 1.0 --top-p 0.95" for
# sampled requests: the baseline tree then needs this tree's yaie/bench/engine.py if it lacks those options).
# 4. scripts/engine_ab_table.py: one Markdown table of it all                        -> $OUT/engine_ab_<gpu>.md
# One tree under two settings instead of two trees: BASE_TREE=. with BASE_ENV and NEW_ENV, e.g.
#   BASE_TREE=. BASE_ENV="YAIE_PDL=0" NEW_ENV="YAIE_PDL=1" SIZES="1b 8b" BATCHES=1 SERVE=0 bash scripts/gpu_engine_ab.sh
set -o pipefail
export PYTHONUNBUFFERED=1 YAIE_SOLUTIONS=all
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
SITE=/tmp/site
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown} against ${BASE_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  if [ "${SKIP_TESTS:-0}" != "1" ]; then
    echo "== GPU tests of the row runner"
    PYTHONPATH=$PWD timeout 150 python3 -m pytest tests/test_row_engine.py tests/test_based_engine.py -q -p no:cacheprovider -k "cuda or gpu or graphs" -x
    echo "== tests rc $?"
  fi
  bench() {   # tree, label, environment settings (NAME=VALUE ...)
    for size in ${SIZES:-1b 8b}; do
      batches=${BATCHES:-1,64}; [ $size = 8b ] && batches=1
      # From inside the tree: `python -m` puts the current folder first on sys.path, before PYTHONPATH.
      (cd "$1" && PYTHONPATH=$1 python3 -c "import yaie; print('== $2 runs', yaie.__file__, 'with', '${3:-}')" &&
        env ${3:-} PYTHONPATH=$1 timeout 200 python3 -m yaie.bench.engine --out "$OUT/$2/$size" --size $size --batches $batches \
        --prompt-len 128 --new-tokens 128 --repeats 3 --long-prompt 0 --skip-hf ${BENCH_EXTRA:-})
      echo "== $2 $size rc $?"
    done
  }
  BASE_TREE=$(cd "${BASE_TREE:-.baseline}" && pwd)
  bench "$BASE_TREE" base1 "${BASE_ENV:-}"
  bench "$PWD" new1 "${NEW_ENV:-}"
  bench "$PWD" new2 "${NEW_ENV:-}"
  bench "$BASE_TREE" base2 "${BASE_ENV:-}"
  [ "${SERVE:-1}" = "1" ] && for tree in new base; do
    root=$PWD; [ $tree = base ] && root=$PWD/.baseline
    echo "== yaie serve over tiny-based, $tree"
    mkdir -p "$OUT/serve_$tree"
    (cd "$root" && PYTHONPATH=$root:$SITE LEVELS=${LEVELS:-1,16} REQUESTS=${REQUESTS:-8} NEW_TOKENS=${NEW_TOKENS:-256} timeout 200 \
      python3 scripts/gpu_serve_based_load.py "$OUT/serve_$tree" cuda yaie/assets/tiny-based)
    echo "== serve $tree rc $?"
  done
  base_label="commit ${BASE_COMMIT:-unknown}"
  [ -n "${BASE_ENV:-}" ] && base_label="the tree at $BASE_TREE with $BASE_ENV"
  AB_BASE=$base_label AB_NEW="this tree${NEW_ENV:+ with $NEW_ENV}" PYTHONPATH=$PWD python3 scripts/engine_ab_table.py "$OUT"
  echo "== done"
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/engine_ab_log.txt"
