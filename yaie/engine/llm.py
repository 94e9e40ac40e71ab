"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Version 0 runs one sequence at a time with a contiguous KV cache: a prefill pass over the prompt,
then one decode pass per new token. Later lessons bring the paged cache, batching and prefix sharing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from yaie.device import default_device
from yaie.engine.kv_cache import ContiguousKVCache
from yaie.engine.sampling import SamplingParams, sample
from yaie.model.config import ModelLoadError
from yaie.model.llama import LlamaModel
from yaie.model.tokenizer import StreamDecoder, Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "tiny-stories"


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str     # "stop" (end-of-sequence id, stop id or stop string) or "length"


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    """A loaded model and its tokenizer, ready to generate.

    Args:
        model: a local Hugging Face folder (config.json, *.safetensors, tokenizer.json); default: the
            bundled tiny-stories model.
        device: default CUDA when there is a GPU, else the CPU.
        dtype: default float32 on the CPU, the checkpoint's dtype on a GPU.
        cpu_threads: torch threads while generating on the CPU. Default: 1 for models under
            100M parameters, whose matrices are too small to split (measured on the bundled model on a
            busy 2-core machine: 0.4 s with one thread, 13 s with two), else torch's own setting.
    """

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, cpu_threads: int | None = None):
        self.model_dir = Path(model) if model is not None else DEFAULT_MODEL
        self.device = torch.device(device) if device is not None else default_device()
        self.model = LlamaModel.from_pretrained(self.model_dir, device=self.device, dtype=dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        self.config = self.model.config
        self.generation_config = _read_generation_config(self.model_dir)
        eos = self.generation_config.get("eos_token_id", self.config.eos_token_ids)
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")
        small = self.num_parameters() < 100_000_000
        self.cpu_threads = cpu_threads or (1 if small else None)

    def num_parameters(self) -> int:
        cfg = self.config
        per_layer = (cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
                     + 3 * cfg.hidden_size * cfg.intermediate_size)
        embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        return cfg.num_layers * per_layer + embeddings

    # ------------------------------------------------------------------ parameters
    def default_sampling_params(self, **overrides) -> SamplingParams:
        """The model's own defaults (generation_config.json), then ``overrides``."""
        gc = self.generation_config
        values: dict = {}
        if gc.get("do_sample") is False:
            values["temperature"] = 0.0
        elif gc.get("do_sample"):
            for key in ("temperature", "top_k", "top_p"):
                if gc.get(key) is not None:
                    values[key] = gc[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        context = self.config.max_position_embeddings
        if len(ids) >= context:
            raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {context} tokens "
                             "(max_position_embeddings); shorten it")
        return text, ids

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids); one :class:`RequestOutput` each."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        checked = [self._prompt_ids(p) for p in prompts]  # every prompt is checked before any work
        results = []
        for (text, ids), p in zip(checked, params):
            steps = self._run(ids, p)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    results.append(RequestOutput(text, ids, [done.value]))
                    break
        return results

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece, as tokens come.

        The generator's return value (``StopIteration.value``) is the :class:`CompletionOutput`.
        """
        _, ids = self._prompt_ids(prompt)
        return (yield from self._run(ids, sampling_params or self.default_sampling_params()))

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Generate a reply to ``[{"role": ..., "content": ...}, ...]`` through the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = self.generate([ids], sampling_params)[0]
        out.prompt = text
        return out

    def _run(self, prompt_ids: list[int], params: SamplingParams):
        """Generator: yields text pieces as they are final; returns the :class:`CompletionOutput`."""
        previous = torch.get_num_threads()
        if self.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            return (yield from self._decode_loop(prompt_ids, params))
        finally:
            torch.set_num_threads(previous)

    def _decode_loop(self, prompt_ids: list[int], params: SamplingParams):
        """Prefill, then one decode step per token. Text that could be the start of a stop string is
        held back until it is known not to be one."""
        room = self.config.max_position_embeddings - len(prompt_ids)
        max_new = min(params.max_tokens, room)
        cache = ContiguousKVCache.for_model(self.config, len(prompt_ids) + max_new, self.model.dtype, self.device)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        hold = max((len(s) for s in params.stop), default=1) - 1
        decoder = StreamDecoder(self.tokenizer)
        tokens = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)
        out_ids: list[int] = []
        emitted, finish, end = 0, "length", None
        for _ in range(max_new):
            hidden = self.model.forward(tokens, positions, cache)
            token = sample(self.model.logits(hidden[-1:])[0], params, generator)
            if token in stop_ids:
                finish = "stop"
                break
            out_ids.append(token)
            decoder.push(token)
            text = decoder.text
            end = _find_stop(text, params.stop, max(0, emitted - hold))
            if end is not None:
                finish = "stop"
                break
            safe = len(text) - hold
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            tokens = torch.tensor([token], dtype=torch.long, device=self.device)
            positions = torch.tensor([len(cache)], device=self.device)
        text = decoder.text if end is None else decoder.text[:end]
        if len(text) > emitted:
            yield text[emitted:]
        return CompletionOutput(text=text, token_ids=out_ids, finish_reason=finish)


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]``, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None
