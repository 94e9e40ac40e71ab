#!/usr/bin/env bash
# Lesson 05 (part 1, prefix prefill) on the lent GPU, in one call: the lesson 05 grader on the reference
# (bf16 and fp8 checks included), the engine's split prefill through the kernel on CUDA, then the
# benchmark (prefix prefill vs gather + SDPA and gather + lesson 06). Logs and result files go to $OUT.
#   bash scripts/gpu_lesson05.sh            # everything
#   QUICK=1 bash scripts/gpu_lesson05.sh    # benchmark on two shapes only
#   GRADER_PATHS=grader/lesson05/test_prefix_prefill.py bash scripts/gpu_lesson05.sh   # part 1 checks only
#   PARTS=grader bash scripts/gpu_lesson05.sh   # only some of: grader, engine, bench
set -uo pipefail
OUT=${OUT:-out_lesson05}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

PARTS=${PARTS:-grader,engine,bench}
if [[ $PARTS == *grader* ]]; then
echo "== grader (reference solutions) =="
timeout ${GRADER_TIMEOUT:-240} python3 -m pytest ${GRADER_PATHS:-grader/lesson05} --solutions -q -p no:cacheprovider \
    2>&1 | tee "$OUT/grader_gpu.log" | tail -30
fi

if [[ $PARTS == *engine* ]]; then
echo "== engine: a prompt prefilled in two steps (the second through lesson 05) vs in one step =="
timeout ${ENGINE_TIMEOUT:-120} python3 - <<'EOF' 2>&1 | tee "$OUT/engine_gpu.log"
import tempfile

import torch

from yaie import ops, switch
from yaie.engine import LLM
from yaie.model.testing import save_random_model
from tests.test_lesson05_prefill import _greedy

switch.use_solutions("all")
calls = []
real_call_in = ops.lessons.call_in
def spy(lesson, which, name, *args, **kwargs):
    calls.append(name)
    return real_call_in(lesson, which, name, *args, **kwargs)
ops.lessons.call_in = spy
with tempfile.TemporaryDirectory() as path:
    save_random_model("llama", path, seed=5, num_hidden_layers=2, max_position_embeddings=512)
    llm = LLM(path, device="cuda")
    gen = torch.Generator().manual_seed(5)
    prompt = [1] + torch.randint(3, llm.config.vocab_size, (200,), generator=gen).tolist()
    whole, whole_logits = _greedy(llm, [prompt], True, 16, block_size=16)
    calls.clear()
    split, split_logits = _greedy(llm, [prompt[:130], prompt[130:]], True, 16, block_size=16)
    used = calls.count("prefix_prefill_attention")
    diff = float((split_logits - whole_logits).abs().max())
    print(f"dtype {llm.model.dtype}: prefix_prefill_attention calls {used} (layers {llm.config.num_layers}); "
          f"tokens identical: {split == whole}; max logit difference {diff:.2e}")
    print("ENGINE CHECK", "ok" if used == llm.config.num_layers and split == whole else "FAILED")
EOF
fi

if [[ $PARTS == *bench* ]]; then
echo "== benchmark =="
timeout ${BENCH_TIMEOUT:-300} python3 -m yaie.cli bench lesson05 --solutions --out "$OUT" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^|"
fi
ls -la "$OUT"
