#!/usr/bin/env bash
# The OpenAI server on the lent GPU, in one call (everything it writes lands in $OUT):
#   OUT=out bash scripts/gpu_serve.sh
#   SMOKE=0 OUT=out bash scripts/gpu_serve.sh          # the benchmark only
#   THREAD_TOO=1 OUT=out bash scripts/gpu_serve.sh     # then the engine loop in a thread, C=16,64 -> out/thread
#   OUT=/tmp/x BENCH_ARGS="--size tiny --device cpu --concurrency 1,4 --new-tokens 16 --admission-window-ms default,50" \
#     bash scripts/gpu_serve.sh                       # CPU dry run
# 1. `yaie serve` on the bundled model (CUDA): the docs' curl commands (models, completion, streamed chat,
#    a bad request, metrics);
# 2. yaie bench serve: the random ~1.1B Llama, bf16; C = 1, 4, 16, 64 streaming clients (4 requests each)
#    beside offline LLM.generate on the same requests (measured before and after the served levels), the
#    server as shipped (admission window off); then at C = 64 three more served and offline measurements in
#    turn (--interleave 3: each served figure against the offline ones around it) -> $OUT/serve_<gpu>.{json,md}.
#    BENCH_ARGS="--size 1b --requests-per-client 4 --admission-window-ms default,50 --compare-concurrency 64":
#    a second server with a 50 ms admission window at C = 64 (the report is written after each server: a
#    comparison cut short by the time limit leaves the main table).
# fastapi, uvicorn, pydantic and httptools are not on the GPU image: they travel as wheels in .whl/ (ignored
# by git; fetch them with `pip download` as /work/.library/device/README.md explains) and are installed
# here. httptools is uvicorn's fast HTTP parser (without it uvicorn parses in pure Python with h11: more
# CPU per streamed chunk); uvloop is on the image.
set -o pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output folder}"
if ! python3 -c "import fastapi, uvicorn, httptools" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/{fastapi,starlette,uvicorn,httptools,pydantic,pydantic_core,annotated_types,typing_inspection,typing_extensions,opentelemetry_api}-*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  echo "== $(date -u +%FT%TZ) commit ${YAIE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, fastapi, uvicorn, httptools, uvloop; print('torch', torch.__version__, 'triton', triton.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'httptools', httptools.__version__, 'uvloop', uvloop.__version__)"
  if [ "${SMOKE:-1}" = "1" ]; then
  echo "== yaie serve (bundled model, CUDA) and the docs' curl commands"
  YAIE_SOLUTIONS=all python3 -m yaie.cli serve --port 8000 --log-level warning &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  curl -s http://127.0.0.1:8000/v1/models; echo
  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{
    "model": "tiny-stories", "prompt": "Once upon a time, there was a little fox named",
    "max_tokens": 48, "temperature": 0.8, "seed": 1}'; echo
  curl -sN http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "model": "tiny-stories", "messages": [{"role": "user", "content": "Tom had a red kite."}],
    "max_tokens": 12, "stream": true}'
  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{
    "model": "tiny-stories", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 2}'; echo
  curl -s -w ' HTTP %{http_code}\n' http://127.0.0.1:8000/v1/completions -d '{"model": "tiny-stories", "prompt": "hi", "temperature": -1}'
  curl -s http://127.0.0.1:8000/metrics | grep -v '^#'
  kill -INT $server; wait $server
  echo "== server rc $?"
  fi
  echo "== yaie bench serve"
  YAIE_SOLUTIONS=all timeout "${BENCH_TIMEOUT:-330}" python3 -m yaie.cli bench serve --out "$OUT" \
    ${BENCH_ARGS:---size 1b --requests-per-client 4 --interleave 3}
  echo "== done (rc $?)"
  if [ "${THREAD_TOO:-0}" = "1" ]; then
  echo "== yaie bench serve --engine-in-thread (C = ${THREAD_LEVELS:-16,64}) -> $OUT/thread"
  YAIE_SOLUTIONS=all timeout 300 python3 -m yaie.cli bench serve --out "$OUT/thread" ${BENCH_ARGS:---size 1b} \
    --engine-in-thread --concurrency "${THREAD_LEVELS:-16,64}"
  echo "== done (rc $?)"
  fi
} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee "$OUT/serve_gpu_log.txt"
