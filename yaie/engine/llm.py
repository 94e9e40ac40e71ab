"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

``LLM`` loads a model and its tokenizer, checks its settings (:class:`yaie.engine.settings.EngineSettings`)
and drives an engine core (:class:`yaie.engine.core.EngineCore`) through its one loop::

    core.add(ids, params) for each prompt;  while core.has_unfinished(): core.step()

The core's runner (the paged KV cache, or the rows of a constant-size state) holds most of the memory and
the CUDA graphs, so ``LLM`` keeps it from one call to the next (:meth:`LLM.open_core`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

from yaie.device import resolve_device
from yaie.engine.core import EngineCore
from yaie.engine.output import CompletionOutput, RequestOutput, final_texts
from yaie.engine.paged_runner import PagedRunner
from yaie.engine.prompts import is_token_id, to_token_ids
from yaie.engine.row_runner import RowRunner, has_rows
from yaie.engine.sampling import SamplingParams
from yaie.engine.settings import EngineSettings
from yaie.engine.tp_group import WorkerGroup
from yaie.engine.tp_runner import TensorParallelRunner
from yaie.model.based import BasedModel
from yaie.model.config import ModelLoadError, load_config
from yaie.model.llama import LlamaModel
from yaie.model.tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "tiny-stories"


class LLM:
    """A loaded model and its tokenizer, ready to generate.

    Args:
        model: a local Hugging Face folder (config.json, *.safetensors, tokenizer.json); default: the
            bundled tiny-stories model.
        device: default CUDA when there is a GPU, else the CPU.
        dtype: default float32 on the CPU, the checkpoint's dtype on a GPU.
        cpu_threads, and the keyword options: the engine's settings (:mod:`yaie.engine.settings`:
            ``block_size``, ``num_blocks``, ``num_cpu_blocks``, ``preemption``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``chunked_prefill``, ``cuda_graphs``, ``graph_capture``,
            ``prefix_caching``, ``tensor_parallel_size``, ``tensor_parallel_timeout_s``). ``ValueError`` for a
            bad one. With ``tensor_parallel_size`` N > 1 the model is split over N processes (this one is rank
            0; :meth:`close` ends the others) and one engine runs on all of them.
    """

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, cpu_threads: int | None = None, **options):
        self.settings = EngineSettings(cpu_threads=cpu_threads, **options)
        self.model_dir = Path(model) if model is not None else DEFAULT_MODEL
        self.device = resolve_device(device)
        config = load_config(self.model_dir)
        self.settings.check_parallel(config, self.device)
        self._workers = None                   # the other ranks of a tensor-parallel engine
        if self.settings.tensor_parallel_size > 1:
            self._workers = WorkerGroup(self.model_dir, dtype, self.device, self.settings.tensor_parallel_size,
                                        self.settings.tensor_parallel_timeout_s)
        model_class = BasedModel if config.based_layers else LlamaModel     # lesson 08's layers, or Llama's
        try:
            self.model = model_class.from_pretrained(self.model_dir, device=self.device, dtype=dtype, config=config)
            if self._workers is not None:
                self._workers.wait_ready()
        except BaseException:
            self.close()
            raise
        self.config, self.tokenizer = self.model.config, Tokenizer(self.model_dir)
        self.generation_config = read_generation_config(self.model_dir)
        eos = self.generation_config.get("eos_token_id", self.config.eos_token_ids)
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
        self.settings.resolve(self.config, self.model.dtype, self.device, self.num_parameters())
        self._runner = None                    # the runner kept for the next run
        self.last_core: EngineCore | None = None   # the last run's core (its scheduler and runner), for tests

    def num_parameters(self) -> int:
        cfg = self.config
        per_layer = (cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
                     + 3 * cfg.hidden_size * cfg.intermediate_size)
        embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        return cfg.num_layers * per_layer + embeddings

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """The model's own defaults (generation_config.json), then ``overrides`` (None values are skipped)."""
        gc = self.generation_config
        values: dict = {}
        if gc.get("do_sample") is False:
            values["temperature"] = 0.0
        elif gc.get("do_sample"):
            values.update({key: gc[key] for key in ("temperature", "top_k", "top_p") if gc.get(key) is not None})
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids); one :class:`RequestOutput` each, in
        the order of the prompts, all run together through continuous batching. ``sampling_params``: one
        for all, or one per prompt. Every prompt is checked before any work (``ValueError``)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(is_token_id(t) for t in prompts)):
            prompts = [prompts]
        if isinstance(prompts, (bytes, dict)) or not hasattr(prompts, "__iter__"):
            raise ValueError("generate() takes a prompt (a non-empty string or list of token ids) or a list of "
                             f"prompts; got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        params = sampling_params if sampling_params is not None else self.default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them")
        checked = [to_token_ids(p, self.tokenizer, self.config) for p in prompts]
        # One request per completion, in order: prompt j's n completions follow those of the prompts before it.
        ids = [ids for (_, ids), p in zip(checked, params) for _ in range(p.n)]
        choices = [p.choice(i) for p in params for i in range(p.n)]
        ended = {}      # request id -> (its token ids, its output state, its finish reason)
        for request, _, state, finish_reason in self._run(ids, choices, streams=False):
            if finish_reason is not None:
                ended[request.request_id] = (request.output_ids, state, finish_reason)
        # Every text at the end, in one batch decode (requests of a batch tend to end together).
        texts = final_texts([state for _, state, _ in ended.values()], self.tokenizer)
        finished = {request_id: CompletionOutput(text, token_ids, finish_reason)
                    for (request_id, (token_ids, _, finish_reason)), text in zip(ended.items(), texts)}
        outputs, next_id = [], 0
        for (text, prompt_ids), p in zip(checked, params):
            outputs.append(RequestOutput(text, prompt_ids, [finished[next_id + i] for i in range(p.n)]))
            next_id += p.n
        return outputs

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece, as tokens come. The generator's return
        value (``StopIteration.value``) is the :class:`CompletionOutput`."""
        _, ids = to_token_ids(prompt, self.tokenizer, self.config)
        params = sampling_params or self.default_sampling_params()
        if params.n != 1:
            raise ValueError(f"stream() yields one completion; got n={params.n} (generate() returns n of them)")
        for request, piece, state, finish_reason in self._run([ids], [params]):
            if piece:
                yield piece
            if finish_reason is not None:
                return CompletionOutput(state.final_text, request.output_ids, finish_reason)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Generate a reply to ``[{"role": ..., "content": ...}, ...]`` through the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = self.generate([self.tokenizer.encode(text, add_special_tokens=False)], sampling_params)[0]
        out.prompt = text
        return out

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams], streams: bool = True):
        """The loop: every prompt into one core, then steps until all are done; yields the core's events. A
        generator closed early (a stream left unfinished) aborts what is left."""
        core = self.open_core(len(prompt_ids))
        try:
            with core.cpu_threads_set():
                for ids, p in zip(prompt_ids, params):
                    core.add(ids, p, streams=streams)
                while core.has_unfinished():
                    yield from core.step()
                yield from core.flush()
        finally:
            core.close()

    # ------------------------------------------------------------------ the runner, kept between runs
    def open_core(self, rows: int | None = None) -> EngineCore:
        """A new engine core over this model's runner; ``close()`` it when done. The kept runner serves it
        when no other core holds it and it fits (same settings and kernels; a paged cache every earlier run
        gave back; rows enough for ``rows`` sequences, default ``max_num_seqs``). Else a new runner, kept
        from now on, the old one dropped first (it may hold half the GPU's memory); while another core holds
        the kept runner (an unfinished ``stream``), a runner for this core alone."""
        rows = min(rows or self.settings.max_num_seqs, self.settings.max_num_seqs)
        runner = self._runner
        if runner is None or runner.in_use or not runner.reusable(self.settings.runner_key(), rows):
            if runner is not None and not runner.in_use:
                self._runner = self.last_core = None     # nothing refers to the old runner's memory now
                runner.close()
            runner = None
            kept = self._runner is None                    # else the kept one is held: this one is for one run
            runner = self._new_runner(rows, kept)
            if kept:
                self._runner = runner
        runner.acquire()
        self.last_core = EngineCore(runner, self.tokenizer, self.eos_token_ids, self.settings.cpu_threads)
        return self.last_core

    def _new_runner(self, rows: int, kept: bool):
        if has_rows(self.config):
            return RowRunner(self.model, self.settings, rows, kept)
        if self._workers is not None:
            return TensorParallelRunner(self.model, self.settings, self._workers, kept)
        return PagedRunner(self.model, self.settings, kept)

    def close(self) -> None:
        """End the other ranks of a tensor-parallel engine (nothing otherwise); the ``LLM`` cannot generate
        after it."""
        if self._workers is not None:
            self._workers.stop()

    def prefix_cache_stats(self):
        """Hit statistics of the kept prefix cache (requests, prompt tokens, tokens reused, blocks evicted;
        lesson 05's ``PrefixCacheStats``), or None when there is none."""
        cache = getattr(self._runner, "prefix_cache", None)
        return None if cache is None else cache.stats

    def state_bytes_per_sequence(self) -> int | None:
        """Bytes a sequence holds in a constant-state model (Based, telescoping), at any length; None for a
        paged model, whose KV cache grows with the sequence."""
        return self._runner.row_nbytes() if isinstance(self._runner, RowRunner) else None


def read_generation_config(model_dir: Path) -> dict:
    """``generation_config.json`` of a model folder ({} when there is none)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None
