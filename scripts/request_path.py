"""Follow one request: the functions ``LLM.generate`` runs for one greedy prompt on a Llama on the CPU, in order,
and how many lines of body each has (docstrings, comments and blank lines not counted).

    python scripts/request_path.py          # prints the walk as the Markdown table of docs/engine.md

``tests/test_layers.py`` keeps the total under ``BUDGET`` lines.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 700

# (file, function or Class.method, what it does for the request), in the order the request meets them.
PATH = [
    ("yaie/engine/llm.py", "LLM.generate", "check the arguments, then run the loop"),
    ("yaie/engine/prompts.py", "to_token_ids", "tokenize the prompt"),
    ("yaie/engine/prompts.py", "check_token_ids", "ids in the vocabulary, room in the context"),
    ("yaie/engine/llm.py", "LLM._run", "the loop: add every prompt, step until done"),
    ("yaie/engine/llm.py", "LLM.open_core", "a core over the kept runner (the KV cache)"),
    ("yaie/engine/paged_runner.py", "PagedRunner.reusable", "is the kept cache clean?"),
    ("yaie/engine/core.py", "EngineCore.__init__", "the core's books"),
    ("yaie/engine/paged_runner.py", "PagedRunner.new_scheduler", "a scheduler over the cache"),
    ("yaie/engine/scheduler.py", "Scheduler.__init__", "three queues"),
    ("yaie/engine/core.py", "EngineCore.add", "a Request and its OutputState"),
    ("yaie/engine/scheduler.py", "Scheduler.add", "could it ever fit? queue it"),
    ("yaie/engine/scheduler.py", "_insert_by_age", "oldest first"),
    ("yaie/engine/output.py", "OutputState.__init__", "stop ids, the text decoder"),
    ("yaie/engine/core.py", "EngineCore.cpu_threads_set", "one CPU thread for a tiny model"),
    ("yaie/engine/core.py", "EngineCore.has_unfinished", "anything left?"),
    ("yaie/engine/scheduler.py", "Scheduler.has_unfinished", "any queue not empty"),
    ("yaie/engine/core.py", "EngineCore.step", "one forward pass, pipelined"),
    ("yaie/engine/scheduler.py", "Scheduler.schedule", "plan the step"),
    ("yaie/engine/scheduler.py", "Scheduler._cache_prefills", "last step's prompts into the prefix cache"),
    ("yaie/engine/scheduler.py", "Scheduler._schedule_running", "a slot for each running request"),
    ("yaie/engine/request.py", "Request.prefilling", "more than its last token to feed?"),
    ("yaie/engine/scheduler.py", "Scheduler._swap_in", "nothing swapped out"),
    ("yaie/engine/scheduler.py", "Scheduler._admit", "admit the prompt: allocate its blocks"),
    ("yaie/engine/request.py", "StepPlan.add_prefill", "the prompt's chunk goes in the plan"),
    ("yaie/engine/request.py", "StepPlan.add_decode", "a decode goes in the plan"),
    ("yaie/engine/request.py", "StepPlan.sampled", "who gets a token from the step"),
    ("yaie/engine/core.py", "EngineCore._launch", "run the plan, pick the tokens on the device"),
    ("yaie/engine/paged_runner.py", "PagedRunner.execute", "the plan as the step's inputs, then run them"),
    ("yaie/engine/paged_runner.py", "StepInputs.of", "token ids, positions, slots, rows that get logits"),
    ("yaie/engine/paged_runner.py", "PagedRunner.run", "graphs or eager"),
    ("yaie/engine/paged_runner.py", "PagedRunner._eager", "a PagedStep, the forward, the logits"),
    ("yaie/engine/request.py", "Request.token_ids", "prompt + output"),
    ("yaie/engine/request.py", "Request.last_token", "a decode's input"),
    ("yaie/engine/request.py", "Request.num_tokens", "a decode's position"),
    ("yaie/model/paged.py", "PagedStep.__init__", "what every layer reads of the step"),
    ("yaie/model/llama.py", "LlamaModel.forward", "embedding, layers, final norm"),
    ("yaie/ops/layers.py", "rms_norm", "the first layer's norm"),
    ("yaie/model/llama.py", "LlamaModel._attention_block", "the first layer's q, k, v product"),
    ("yaie/ops/layers.py", "linear", "a matrix product"),
    ("yaie/ops/layers.py", "add_rms_norm_linear", "norm and the next product"),
    ("yaie/ops/layers.py", "add_rms_norm", "lesson 01's RMSNorm"),
    ("yaie/model/llama.py", "LlamaModel._attention", "split q, k, v; attend; project"),
    ("yaie/model/paged.py", "PagedStep.rope_and_attend", "RoPE, cache write, attention"),
    ("yaie/ops/attention_backends.py", "rope_and_paged_attention", "one kernel for a decode step? else apart"),
    ("yaie/ops/attention_backends.py", "fused_decode", "a decode step on CUDA, lessons 02-04 the reference?"),
    ("yaie/ops/kv.py", "fused_rope_write_kv", "CUDA and the reference's RoPE and cache? (not on the CPU)"),
    ("yaie/ops/kv.py", "rope_and_write_kv", "lesson 01's RoPE, lesson 03's write_kv"),
    ("yaie/ops/layers.py", "rope", "lesson 01's RoPE"),
    ("yaie/ops/kv.py", "write_kv", "lesson 03's write_kv"),
    ("yaie/ops/attention_backends.py", "paged_attention", "the first backend that takes the step"),
    ("yaie/ops/attention_backends.py", "first_accepting", "walk the ordered list"),
    ("yaie/ops/attention_backends.py", "_gathered_prefills", "the CPU's prefill: gather, lesson 01"),
    ("yaie/ops/attention_backends.py", "_gathered_attention", "per sequence: its keys, lesson 01's attention"),
    ("yaie/ops/attention_backends.py", "attention", "lesson 01's cpu_attention_forward"),
    ("yaie/ops/lessons.py", "call", "through the switch"),
    ("yaie/ops/lessons.py", "call_in", "the student's function, or the reference"),
    ("yaie/ops/lessons.py", "run_with_fallback", "a stub falls back in auto mode"),
    ("yaie/ops/layers.py", "swiglu_mlp", "the MLP half: add + norm, gate/up, gate, down"),
    ("yaie/ops/layers.py", "silu_and_mul_linear", "the MLP's gate and down product"),
    ("yaie/ops/layers.py", "silu_and_mul", "SwiGLU's gate"),
    ("yaie/model/llama.py", "LlamaModel.logits", "the LM head"),
    ("yaie/engine/sampling.py", "pick_tokens", "argmax for a greedy row"),
    ("yaie/engine/launched_step.py", "LaunchedStep.__init__", "the launched step"),
    ("yaie/engine/core.py", "EngineCore._look_ahead", "launch the next step now? (not on the CPU)"),
    ("yaie/engine/core.py", "EngineCore.flush", "the last step's text"),
    ("yaie/engine/launched_step.py", "LaunchedStep.tokens", "read the tokens"),
    ("yaie/engine/output.py", "OutputState.accept", "does the request end?"),
    ("yaie/engine/scheduler.py", "Scheduler.finish", "give its blocks back"),
    ("yaie/engine/scheduler.py", "Scheduler._free", "into the prefix cache, then free"),
    ("yaie/engine/output.py", "OutputState.piece", "the text that became final"),
    ("yaie/engine/output.py", "OutputState.final_text", "the whole text, once"),
    ("yaie/engine/core.py", "EngineCore.close", "abort what is left, give the runner back"),
    ("yaie/engine/core.py", "EngineCore.abort_all", "nothing left to abort"),
    ("yaie/engine/runner.py", "Runner.release", "the cache is kept for the next call"),
]


def _find(tree: ast.Module, qualified: str):
    node = tree
    for part in qualified.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


def body_lines(path: Path, qualified: str) -> int:
    """Lines of ``qualified``'s body in ``path`` that hold code (no docstring, comment or blank line)."""
    source = path.read_text()
    function = _find(ast.parse(source), qualified)
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]                                   # the docstring
    if not body:
        return 0
    first, last = body[0].lineno, body[-1].end_lineno
    code_lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER) and first <= token.start[0] <= last:
            code_lines.update(range(token.start[0], token.end[0] + 1))
    return len(code_lines)


def walk() -> list[tuple[str, str, str, int]]:
    return [(file, name, what, body_lines(ROOT / file, name)) for file, name, what in PATH]


def main() -> int:
    rows = walk()
    print("| # | file | function | what it does for the request | body lines |")
    print("|---:|---|---|---|---:|")
    for i, (file, name, what, lines) in enumerate(rows, 1):
        print(f"| {i} | `{file}` | `{name}` | {what} | {lines} |")
    total = sum(r[3] for r in rows)
    print(f"|  | {len({r[0] for r in rows})} files | {len(rows)} functions |  | **{total}** |")
    return 0 if total <= BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
