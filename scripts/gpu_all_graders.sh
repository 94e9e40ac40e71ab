#!/usr/bin/env bash
# Every grader on the lent GPU in one call: on the reference solutions (all must pass, bf16 and realistic
# shapes included) and on the untouched stubs (every task must fail as not implemented).
#   bash scripts/gpu_all_graders.sh        (from the repository root; logs and results.json go to $OUT)
# LESSONS="05 08" limits the lessons; COMPILE_LOG=1 adds scripts/triton_compile_log.py's summary of
# which tests and kernels spent the time compiling; SKIP_STUBS=1 leaves out the runs on the stubs.
set -u -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" "$OUT/json"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
  plugin=${COMPILE_LOG:+-p scripts.triton_compile_log --durations=12}
  for number in ${LESSONS:-01 02 03 04 05 06 07 08}; do
    dir=grader/lesson$number/
    lesson=lesson$number
    echo "== $lesson on the reference solutions"
    start=$SECONDS
    python3 -m pytest "$dir" --solutions -q -p no:cacheprovider --grader-timeout 300 \
      --results-json "$OUT/json/${lesson}_solutions.json" $plugin 2>&1 | tail -${TAIL:-15}
    echo "== $lesson reference: $((SECONDS - start)) s"
    [ -n "${SKIP_STUBS:-}" ] && continue
    echo "== $lesson on the stubs (expect every task: not implemented yet)"
    start=$SECONDS
    python3 -m pytest "$dir" -q -p no:cacheprovider --results-json "$OUT/json/${lesson}_stubs.json" 2>&1 | tail -8
    echo "== $lesson stubs: $((SECONDS - start)) s"
  done
} 2>&1 | tee "$OUT/gpu_all_graders.log"
# The device tool returns at most 8 files: pack the results.json files into one archive.
tar -czf "$OUT/graders_results.tar.gz" -C "$OUT" json && rm -rf "$OUT/json"
