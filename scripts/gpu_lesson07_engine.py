"""Memory per sequence of the engine while it generates: a telescoping model beside a full-attention one.

    python scripts/gpu_lesson07_engine.py [--model DIR ...] [--tokens 16384] [--out FILE.json] [--device cuda]

Each model is loaded as the engine does (:class:`yaie.engine.llm.LLM`) and generates greedily from one
prompt, EOS ignored, for ``--tokens`` tokens; after 1024 and ``--tokens`` generated tokens (and at a few
points between) the script records:

* telescoping model (``telescoping_capacity`` in its config; the engine hands it to
  :func:`yaie.model.telescoping.run_telescoping`): the bytes its cache holds (keys, values and sizes of
  every layer), and ``torch.cuda.memory_allocated()`` above what was allocated before the prompt (on a
  CPU: the process's resident memory);
* full-attention model (the paged KV cache of lessons 03-04): the bytes of the cache blocks the sequence
  holds (blocks x block bytes; the pool itself is allocated once, up front, so ``memory_allocated`` does
  not move). Its context is raised to fit the tokens (``max_position_embeddings`` in a copy of its config:
  RoPE takes any position; the text past the 512 training positions is not the point, the memory is);
* for both, what a full bf16 KV cache of that model holds at that length (layers x 2 x tokens x kv heads
  x head dim x 2 bytes).

Default models: the bundled ``tiny-telescoping`` and ``tiny-stories`` (same size, same data). The JSON is
rewritten after every record, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yaie.engine.llm import LLM  # noqa: E402
from yaie.engine.sampling import SamplingParams  # noqa: E402
from yaie.model.config import load_config  # noqa: E402
from yaie.switch import use_solutions  # noqa: E402

DEFAULT_MODELS = [ROOT / "yaie" / "assets" / "tiny-telescoping", ROOT / "yaie" / "assets" / "tiny-stories"]


def block_bytes(llm) -> int:
    """Bytes of one KV-cache block of the paged model: keys and values of every layer."""
    cfg = llm.config
    return 2 * cfg.num_layers * llm.settings.block_size * cfg.num_kv_heads * cfg.head_dim * llm.model.dtype.itemsize


def _rss_bytes() -> int | None:
    """The process's resident memory (Linux), for CPU runs."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def with_context(model_dir: Path, context: int, work: Path) -> Path:
    """``model_dir`` itself if its context holds ``context`` tokens, else a copy whose config says it does."""
    raw = json.loads((model_dir / "config.json").read_text())
    if int(raw.get("max_position_embeddings") or 0) >= context:
        return model_dir
    target = work / model_dir.name
    target.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy(path, target / path.name)
    raw["max_position_embeddings"] = context
    (target / "config.json").write_text(json.dumps(raw, indent=1))
    return target


def measure(model_dir: Path, tokens: int, device: str, prompt: str, save) -> dict:
    """Generate ``tokens`` tokens with ``model_dir``; the records at the checkpoints (``save(result)`` after each)."""
    telescoping = bool(load_config(model_dir).telescoping_capacity)
    # One sequence: a full model's pool needs only its blocks (and its CUDA graphs one batch size).
    llm = LLM(model_dir, device=device) if telescoping else LLM(model_dir, device=device, max_num_seqs=1)
    cfg = llm.config
    cuda = llm.device.type == "cuda"
    checkpoints = sorted({1024, 2048, 4096, 8192, tokens} & set(range(1, tokens + 1)))
    result = dict(model=model_dir.name, attention="telescoping" if telescoping else "full (paged KV cache)",
                  telescoping_capacity=cfg.telescoping_capacity, layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, context=cfg.max_position_embeddings, prompt=prompt, records=[])
    if not telescoping:
        result.update(block_size=llm.settings.block_size, block_bytes=block_bytes(llm), pool_blocks=llm.settings.num_blocks)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    # One token more than measured: a finished request has given its blocks back before its last event.
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    text = ""
    t0 = time.time()
    for request, piece, _, _ in llm._run([llm.tokenizer.encode(prompt)], [params]):
        text += piece
        generated = len(request.output_ids)
        if generated not in checkpoints or any(r["generated"] == generated for r in result["records"]):
            continue
        length = len(request.prompt_ids) + generated
        row = dict(generated=generated, seconds=round(time.time() - t0, 1),
                   full_kv_cache_bf16_bytes=cfg.num_layers * 2 * length * cfg.num_kv_heads * cfg.head_dim * 2)
        if telescoping:
            cache = llm.last_core.runner.rows.caches[0]
            row.update(entries_per_layer=int(cache.keys[0].shape[0]), cache_bytes=cache.nbytes())
        else:
            blocks = len(llm.last_core.scheduler.manager.block_ids(request.request_id))
            row.update(blocks_held=blocks, cache_bytes=blocks * block_bytes(llm))
        if cuda:
            torch.cuda.synchronize()
            row["allocated_above_start_bytes"] = torch.cuda.memory_allocated() - base
            row["peak_above_start_bytes"] = torch.cuda.max_memory_allocated() - base
        else:
            row["process_rss_bytes"] = _rss_bytes()
        result["records"].append(row)
        print(model_dir.name, json.dumps(row), flush=True)
        save(result)
    result.update(generated=generated, seconds=round(time.time() - t0, 1), text_start=text[:200])
    print(f"{model_dir.name}: {generated} tokens in {result['seconds']} s; text: {text[:120]!r}", flush=True)
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None,
                        help="a model folder (repeat for several; default: tiny-telescoping and tiny-stories)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt", default="Once upon a time, there was a little cat named")
    args = parser.parse_args()
    use_solutions("all")
    report = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                  tokens=args.tokens, command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]), models=[])

    def save(result: dict) -> None:
        if args.out:
            done = [m for m in report["models"] if m is not result]
            Path(args.out).write_text(json.dumps({**report, "models": done + [result]}, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as work:
        for model in args.model or DEFAULT_MODELS:
            model_dir = with_context(Path(model), args.tokens + 128, Path(work))
            report["models"].append(measure(model_dir, args.tokens, args.device, args.prompt, save))
            save(report["models"][-1])
    for m in report["models"]:
        last = m["records"][-1] if m["records"] else {}
        print(f"{m['model']} ({m['attention']}): {last.get('cache_bytes', 0) / 2**20:.2f} MiB of cache per sequence "
              f"after {last.get('generated')} tokens (a full bf16 KV cache: "
              f"{last.get('full_kv_cache_bf16_bytes', 0) / 2**20:.2f} MiB)", flush=True)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
