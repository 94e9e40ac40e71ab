#!/usr/bin/env bash
# Every grader on the lent GPU in one call: on the reference solutions (all must pass, bf16 and realistic
# shapes included) and on the untouched stubs (every task must fail as not implemented).
#   bash scripts/gpu_all_graders.sh        (from the repository root; logs and results.json go to $OUT)
set -u -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" "$OUT/json"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
  for dir in grader/lesson*/; do
    lesson=$(basename "$dir")
    echo "== $lesson on the reference solutions"
    start=$SECONDS
    python3 -m pytest "$dir" --solutions -q -p no:cacheprovider --grader-timeout 300 \
      --results-json "$OUT/json/${lesson}_solutions.json" 2>&1 | tail -15
    echo "== $lesson reference: $((SECONDS - start)) s"
    echo "== $lesson on the stubs (expect every task: not implemented yet)"
    start=$SECONDS
    python3 -m pytest "$dir" -q -p no:cacheprovider --results-json "$OUT/json/${lesson}_stubs.json" 2>&1 | tail -8
    echo "== $lesson stubs: $((SECONDS - start)) s"
  done
} 2>&1 | tee "$OUT/gpu_all_graders.log"
# The device tool returns at most 8 files: pack the results.json files into one archive.
tar -czf "$OUT/graders_results.tar.gz" -C "$OUT" json && rm -rf "$OUT/json"
