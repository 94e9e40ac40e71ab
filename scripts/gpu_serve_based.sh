#!/usr/bin/env bash
# yaie serve over the bundled tiny Based model (lesson 08) on the lent GPU, in one call (all output in $OUT):
#   OUT=out YAIE_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_serve_based.sh
#   OUT=/tmp/x DEVICE=cpu LEVELS=1,4 NEW_TOKENS=16 SKIP_TESTS=1 bash scripts/gpu_serve_based.sh   # CPU dry run
# 1. tests/test_row_engine.py and tests/test_serve_based.py with the GPU (the row engine on CUDA graphs against LLM.generate; the second needs openai);
# 2. `yaie serve --model yaie/assets/tiny-based`: a completion, a streamed chat, logprobs, metrics (curl);
# 3. a load test: C streaming clients (LEVELS, REQUESTS per client, PROMPT_LEN random ids, NEW_TOKENS greedy,
#    end-of-sequence ignored) through yaie.bench.serve's client processes, beside offline LLM.generate on the
#    same requests (scripts/gpu_serve_based_load.py) -> $OUT/serve_based_<gpu>.json.
# fastapi/uvicorn travel as wheels in .whl/ (see scripts/gpu_serve.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/{fastapi,starlette,uvicorn,httptools,pydantic,pydantic_core,annotated_types,typing_inspection,typing_extensions,opentelemetry_api}-*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} YAIE_SOLUTIONS=all
DEVICE=${DEVICE:-cuda}
MODEL=yaie/assets/tiny-based
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch, triton, fastapi, uvicorn; print('torch', torch.__version__, 'triton', triton.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
  if [ "${SKIP_TESTS:-0}" != "1" ]; then
    echo "== tests/test_row_engine.py (GPU test included); tests/test_serve_based.py where openai is installed"
    tests=tests/test_row_engine.py
    python3 -c "import openai, httpx" 2>/dev/null && tests="$tests tests/test_serve_based.py"
    timeout "${TEST_TIMEOUT:-120}" python3 -m pytest $tests -q -p no:cacheprovider -rs
    echo "== tests rc $?"
  fi
  echo "== yaie serve --model $MODEL ($DEVICE) and curl"
  python3 -m yaie.cli serve --model "$MODEL" --device "$DEVICE" --port 8011 --log-level warning &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  curl -s http://127.0.0.1:8011/v1/completions -H 'Content-Type: application/json' -d '{
    "model": "tiny-based", "prompt": "Once upon a time, there was a little fox named", "max_tokens": 32,
    "temperature": 0.8, "seed": 1}'; echo
  curl -sN http://127.0.0.1:8011/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "model": "tiny-based", "messages": [{"role": "user", "content": "Tom had a red kite."}], "max_tokens": 12,
    "stream": true}'
  curl -s http://127.0.0.1:8011/v1/completions -H 'Content-Type: application/json' -d '{
    "model": "tiny-based", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 2}'; echo
  curl -s http://127.0.0.1:8011/metrics | grep -v '^#'
  kill -INT $server; wait $server
  echo "== server rc $?"
  echo "== load test"
  timeout "${BENCH_TIMEOUT:-200}" python3 scripts/gpu_serve_based_load.py "$OUT" "$DEVICE" "$MODEL"
  echo "== load test rc $?"
} 2>&1 | tee "$OUT/serve_based_gpu_log.txt"
