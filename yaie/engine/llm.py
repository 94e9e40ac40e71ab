"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Requests run through continuous batching (:mod:`yaie.engine.scheduler`): all prompts of a ``generate``
call are queued; every step runs one forward pass over the decoding requests (one token each) and
prefills (chunks of prompts, up to ``max_num_batched_tokens`` tokens in the step), packed into one batch.
The KV cache is lesson 03's paged cache (a ``KVCacheManager``, kept from one ``generate`` or ``stream``
call to the next when the last one ended cleanly); the model reads and writes it through a
:class:`yaie.model.paged.PagedStep`. When blocks run out the scheduler preempts the newest request by
recompute or swap; each request keeps its own sampler (and seed), so its tokens do not depend on what it
was batched with. On CUDA, decode-only steps replay
CUDA graphs (:mod:`yaie.engine.cuda_graphs`). The host does what it can while the GPU works: a step's
forward pass is queued, then the previous step's new tokens are turned into text, and only then does the
host wait for this step's tokens (which requests end is decided by token id and length at once, and by
text only for requests with stop strings; ``generate`` decodes each request's text once, at its end). When
the next step can only be the same decodes again, it is planned and launched before this step's
tokens are read, its input ids taken from the device (:meth:`LLM._look_ahead`; greedy and sampled rows
alike pick their tokens there, :mod:`yaie.engine.sampling`): the host plans the next step while the GPU
runs this one. Nothing in a decode step waits for the GPU but reading its tokens: the
inputs go to the graph's buffers from pinned memory, queued (:func:`yaie.engine.cuda_graphs.upload`), and
the tokens come back through pinned memory and an event recorded right after them (:class:`_Launched`), so
reading one step's tokens does not wait for the looked-ahead step queued behind it. See
``docs/engine.md``, "Pipelining and look-ahead".
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Iterator, Sequence

import torch

from yaie import ops
from yaie.device import default_device
from yaie.engine.cuda_graphs import SCRATCH_SEQ, DecodeGraphs
from yaie.engine.prefix_cache import make_prefix_cache
from yaie.engine.sampling import SamplingParams, StepTable, make_generator, sample_batch
from yaie.engine.scheduler import PREEMPTION_MODES, Request, Scheduler, StepPlan
from yaie.model.config import ModelLoadError, load_config
from yaie.model.llama import LlamaModel
from yaie.model.paged import PagedStep
from yaie.model.tokenizer import StreamDecoder, Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "tiny-stories"
DEFAULT_KV_CACHE_BYTES_CPU = 256 * 2**20     # the CPU cache is allocated lazily: pages are touched as used
DEFAULT_KV_CACHE_FRACTION_CUDA = 0.5         # of the GPU memory free after the weights are loaded
DEFAULT_SWAP_BYTES = 1 * 2**30               # host blocks for swapping (pinned memory on CUDA)


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


class _Text:
    """A request's sampler and text: stop ids, stop strings (held back until known not to start one)."""

    def __init__(self, llm: "LLM", params: SamplingParams):
        self.params = params
        self.greedy = params.greedy        # read for every request at every step: found once
        # A seeded request's own generator, on the logits' device (see yaie.engine.sampling).
        self.generator = None if params.seed is None else make_generator(params.seed, llm.device)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(llm.eos_token_ids))
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.decoder = StreamDecoder(llm.tokenizer)
        self.pending: list[int] = []       # accepted, not decoded yet
        self.emitted = 0
        self.end: int | None = None
        self.finish_reason: str | None = None

    def push(self, request: Request, token: int) -> str:
        """Take a sampled token; return the text that became final. Sets ``finish_reason`` when done."""
        self.accept(request, token)
        return self.piece()

    def accept(self, request: Request, token: int) -> bool:
        """Take a sampled token and decide whether the request ends (``finish_reason``), leaving the text
        for :meth:`piece`: the engine decodes it while the GPU runs the next step. Only a request with stop
        strings decodes here, since its end depends on its text. Returns whether the token joined the
        request's output (a stop id does not)."""
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return False
        request.output_ids.append(token)
        self.pending.append(token)
        if self.params.stop:
            self._decode()
            self.end = _find_stop(self.decoder.text, self.params.stop, max(0, self.emitted - self.hold))
            if self.end is not None:
                self.finish_reason = "stop"
                return True
        if len(request.output_ids) >= request.max_new_tokens:
            self.finish_reason = "length"
        return True

    def piece(self) -> str:
        """Decode the tokens taken since the last call; return the text that became final (all that is
        left once the request has ended; else all but the last characters that may start a stop string)."""
        self._decode()
        if self.finish_reason is not None:
            return self._rest()
        text = self.decoder.text
        safe = len(text) - self.hold
        if safe > self.emitted:
            piece, self.emitted = text[self.emitted:safe], safe
            return piece
        return ""

    def _decode(self) -> None:
        for token in self.pending:
            self.decoder.push(token)
        self.pending.clear()

    def _rest(self) -> str:
        text = self.final_text
        piece = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return piece

    @property
    def final_text(self) -> str:
        if self.pending and not self.decoder.ids:
            # Nothing decoded piece by piece (``generate`` reads the text only at the end): one decode of
            # all the tokens, which is what the stream decoder's pieces add up to, unless the text ends in
            # an incomplete character (then the stream decoder holds it back: decode as it does).
            text = self.decoder.tokenizer.decode(self.pending)
            if not text.endswith("\ufffd"):
                return text if self.end is None else text[:self.end]
        self._decode()
        return self.decoder.text if self.end is None else self.decoder.text[:self.end]


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
        block_size: tokens per KV-cache block (lesson 03; lesson 04's kernel takes 8 to 128).
        num_blocks: device blocks of the KV cache; default: 256 MiB worth on the CPU, half the free GPU
            memory on CUDA, at most what ``max_num_seqs`` full contexts need and never fewer than one.
        num_cpu_blocks: host blocks for swap preemption; default: as many as the device (CPU) or 1 GiB
            worth (CUDA, pinned) with ``preemption="swap"``, none with ``"recompute"``.
        preemption: what happens to the newest running request when blocks run out: ``"recompute"``
            (free its blocks, prefill it again later) or ``"swap"`` (copy its blocks to host memory).
        max_num_seqs: requests running at once at most.
        max_num_batched_tokens: tokens one step feeds: the running decodes (one each), then prefills in what
            is left, a long prompt cut into chunks over several steps (chunked prefill), so running requests
            keep getting a token every step while it is ingested. Default 2048: on a GPU a step of 2048
            tokens of a 1B model is already bound by arithmetic, so bigger chunks gain little, while each
            one delays the running requests' next token by its whole time.
        chunked_prefill: cut prompts into chunks (above; default on). Off: ``max_num_batched_tokens``
            counts prefill tokens only and a longer prompt runs whole in one step (the decodes wait for it).
        cuda_graphs: replay decode-only steps from CUDA graphs (:mod:`yaie.engine.cuda_graphs`); default:
            on CUDA. One block of the cache is kept back as the graphs' scratch block (``num_blocks`` counts
            the blocks requests can use).
        prefix_caching: automatic prefix caching (lesson 05's radix tree, :mod:`yaie.engine.prefix_cache`):
            a request whose tokens start like anything still cached (an earlier prompt, from this call or an
            earlier one) reads those blocks and prefills only the rest. Cached prefixes are evicted, least
            recently used first, when blocks run out. ``prefix_cache_stats()`` tells the tokens reused.
    """

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, cpu_threads: int | None = None, *,
                 block_size: int = 16, num_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 preemption: str = "recompute", max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 cuda_graphs: bool | None = None, prefix_caching: bool = True, chunked_prefill: bool = True):
        self.model_dir = Path(model) if model is not None else DEFAULT_MODEL
        self.device = torch.device(device) if device is not None else default_device()
        model_class, config = LlamaModel, load_config(self.model_dir)
        if config.based_layers:   # lesson 08: Based linear attention + windowed layers
            from yaie.model.based import BasedModel as model_class
        self.model = model_class.from_pretrained(self.model_dir, device=self.device, dtype=dtype, config=config)
        self.tokenizer = Tokenizer(self.model_dir)
        self.config = self.model.config
        self.generation_config = _read_generation_config(self.model_dir)
        eos = self.generation_config.get("eos_token_id", self.config.eos_token_ids)
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")
        small = self.num_parameters() < 100_000_000
        self.cpu_threads = cpu_threads or (1 if small else None)
        if not isinstance(block_size, int) or not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an int in 1..1024, got {block_size!r}")
        for name, value in (("num_blocks", num_blocks), ("num_cpu_blocks", num_cpu_blocks)):
            if value is not None and (not isinstance(value, int) or value < (1 if name == "num_blocks" else 0)):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.block_size, self.preemption = block_size, preemption
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.num_blocks = num_blocks or self._default_num_blocks()
        self.num_cpu_blocks = num_cpu_blocks if num_cpu_blocks is not None else self._default_cpu_blocks()
        supported = DecodeGraphs.supported(self.model, self.device)
        if cuda_graphs and not supported:
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.cuda_graphs = supported if cuda_graphs is None else bool(cuda_graphs)
        self.prefix_caching = bool(prefix_caching)
        self.chunked_prefill = bool(chunked_prefill)
        self.last_scheduler: Scheduler | None = None   # the last run's scheduler (stats, manager), for tests
        self.last_graphs: DecodeGraphs | None = None   # the last run's CUDA-graph runner, for tests
        self._kept: _RunCache | None = None    # the KV cache (and graphs) kept for the next run

    def _block_bytes(self) -> int:
        cfg = self.config
        element = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * element

    def _default_num_blocks(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * DEFAULT_KV_CACHE_FRACTION_CUDA)
        else:
            budget = DEFAULT_KV_CACHE_BYTES_CPU
        one_context = -(-self.config.max_position_embeddings // self.block_size)
        # No more than max_num_seqs full contexts could ever use, however much memory is free.
        return max(one_context, min(budget // self._block_bytes(), self.max_num_seqs * one_context))

    def _default_cpu_blocks(self) -> int:
        if self.preemption != "swap":
            return 0
        if self.device.type == "cpu":
            return self.num_blocks
        return min(self.num_blocks, DEFAULT_SWAP_BYTES // self._block_bytes())

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
        rule = ("a prompt is a non-empty string or a non-empty list of token ids "
                f"(ints in [0, {self.config.vocab_size}))")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"the prompt is an empty string; {rule}")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as err:     # a lone surrogate such as "\ud800": no text to tokenize
                raise ValueError(f"the prompt is not valid Unicode text ({err.reason} at character {err.start}); "
                                 f"{rule}") from None
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            if not isinstance(prompt, (list, tuple)) or not _all_token_ids(prompt):
                shown = repr(prompt) if len(repr(prompt)) <= 60 else repr(prompt)[:60] + "..."
                raise ValueError(f"{rule}; got {type(prompt).__name__} {shown}")
            ids, text = [int(t) for t in prompt], None
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size}), got {bad[:5]}")
        if not ids:
            raise ValueError(f"the prompt is empty (no tokens); {rule}")
        context = self.config.max_position_embeddings
        if len(ids) >= context:
            raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {context} tokens "
                             "(max_position_embeddings); shorten it")
        return text, ids

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids); one :class:`RequestOutput` each,
        in the order of the prompts. All prompts run together through continuous batching.
        ``sampling_params``: one for all, or a list with one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(_is_token_id(t) for t in prompts)):
            prompts = [prompts]
        if isinstance(prompts, (bytes, dict)) or not hasattr(prompts, "__iter__"):
            raise ValueError("generate() takes a prompt (a non-empty string or list of token ids) or a list of "
                             f"prompts; got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them")
        checked = [self._prompt_ids(p) for p in prompts]  # every prompt is checked before any work
        finished = {}
        for request, _, text in self._run([ids for _, ids in checked], params, pieces=False):
            if request.state == "finished":
                finished[request.request_id] = CompletionOutput(text.final_text, request.output_ids,
                                                                text.finish_reason)
        return [RequestOutput(prompt_text, ids, [finished[i]]) for i, (prompt_text, ids) in enumerate(checked)]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece, as tokens come.

        The generator's return value (``StopIteration.value``) is the :class:`CompletionOutput`.
        """
        _, ids = self._prompt_ids(prompt)
        for request, piece, text in self._run([ids], [sampling_params or self.default_sampling_params()]):
            if piece:
                yield piece
            if request.state == "finished":
                return CompletionOutput(text.final_text, request.output_ids, text.finish_reason)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Generate a reply to ``[{"role": ..., "content": ...}, ...]`` through the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = self.generate([ids], sampling_params)[0]
        out.prompt = text
        return out

    def new_kv_cache(self, extra_blocks: int = 0):
        """A fresh lesson 03 ``KVCacheManager`` sized for this engine (through :func:`yaie.ops.kv_cache_manager`),
        with ``extra_blocks`` more than ``num_blocks`` (the CUDA-graph scratch block)."""
        cfg = self.config
        return ops.kv_cache_manager(self.num_blocks + extra_blocks, self.block_size, cfg.num_layers, cfg.num_kv_heads,
                                    cfg.head_dim, self.model.dtype, self.device, self.num_cpu_blocks,
                                    swap=self.preemption == "swap" and self.num_cpu_blocks > 0)

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams], pieces: bool = True):
        """Generator over events ``(request, text piece, its _Text)``: one per request per step, the last
        one with ``request.state == "finished"``. ``pieces=False`` (``generate``, which reads the text only
        at the end): only the last event of each request, its piece empty; nothing is decoded per step."""
        if self.config.telescoping_capacity:   # lesson 07: constant-size caches, not the paged KV cache
            from yaie.model.telescoping import run_telescoping
            yield from run_telescoping(self, prompt_ids, params)
            return
        if self.config.based_layers:   # lesson 08: a constant-size state per sequence, not the paged KV cache
            from yaie.model.based import run_based
            yield from run_based(self, prompt_ids, params)
            return
        previous = torch.get_num_threads()
        cache = None
        if self.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            cache = self._cache_for_run()
            manager, graphs = cache.manager, cache.graphs
            reserved = 1 if graphs is not None else 0
            scheduler = Scheduler(manager, self.preemption, self.max_num_seqs, self.max_num_batched_tokens,
                                  reserved_blocks=reserved, prefix_cache=cache.prefix_cache,
                                  chunked_prefill=self.chunked_prefill)
            self.last_scheduler, self.last_graphs = scheduler, graphs
            texts = {}
            for i, (ids, p) in enumerate(zip(prompt_ids, params)):
                room = self.config.max_position_embeddings - len(ids)
                request = Request(i, ids, min(p.max_tokens, room))
                scheduler.add(request)      # ValueError if it can never fit: before any work
                texts[i] = _Text(self, p)
            late = []      # the last step's requests: their new text is decoded while the GPU runs this one
            pending = None  # a launched step whose tokens the host has not read yet
            while scheduler.has_unfinished():
                if pending is None:
                    plan = scheduler.schedule()
                    if plan.empty:
                        raise RuntimeError("the scheduler planned an empty step with requests left (a bug)")
                    pending = self._start(manager, plan, graphs, texts)
                # The next step, planned and launched before this one's tokens are read, when it can only
                # be the same decodes again (its token ids come from the device).
                following = self._look_ahead(scheduler, pending, graphs, texts)
                for request, text in late:
                    yield request, text.piece() if pieces else "", text
                late = []
                for request, token in zip(pending.requests, pending.tokens()):
                    if request is None:           # it ended before this (looked-ahead) step was read
                        continue
                    text = texts[request.request_id]
                    kept = text.accept(request, token)
                    if text.finish_reason is not None:
                        # Its blocks go back before the next step is planned. When the step after already
                        # runs with it, that step fed this token too: its K/V count as computed.
                        fed = following is not None and following.drop(request)
                        scheduler.finish(request, [] if kept or not fed else [token])
                        late.append((request, text))
                    elif pieces:
                        late.append((request, text))
                pending = following
            for request, text in late:
                yield request, text.piece() if pieces else "", text
        finally:
            if cache is not None:
                cache.in_use = False
                if cache.temporary and cache.graphs is not None:
                    cache.graphs.close()
            torch.set_num_threads(previous)

    def _cache_for_run(self) -> "_RunCache":
        """The KV cache (and CUDA-graph runner) of a run.

        The last run's, when it ended cleanly (every request's blocks given back) under the same settings
        (graphs on or off, the same lesson switch: recorded graphs replay the kernels they recorded), so
        its graphs replay again: they hold the cache's addresses. Else a new one, the old one dropped
        first (it may hold half the GPU's memory). While another run still holds the kept cache (an
        unfinished ``stream``), this run gets a cache of its own, dropped when it ends.
        """
        key = (self.cuda_graphs, ops.selection(), self.prefix_caching)
        if self._kept is not None and not self._kept.in_use:
            if self._kept.key == key and _ended_cleanly(self._kept.manager, self.num_cpu_blocks):
                self._kept.in_use = True
                return self._kept
            self._drop_kept()
        temporary = self._kept is not None
        manager = self.new_kv_cache(1 if self.cuda_graphs else 0)
        cache = _RunCache(manager, self._graph_runner(manager) if self.cuda_graphs else None, key,
                          in_use=True, temporary=temporary,
                          prefix_cache=make_prefix_cache(manager) if self.prefix_caching else None)
        if not temporary:
            self._kept = cache
        return cache

    def prefix_cache_stats(self):
        """Hit statistics of the prefix cache kept for the next run (requests, prompt tokens, tokens reused,
        blocks evicted; lesson 05's ``PrefixCacheStats``), or None when prefix caching is off."""
        if self._kept is None or self._kept.prefix_cache is None:
            return None
        return self._kept.prefix_cache.stats

    def _drop_kept(self) -> None:
        kept, self._kept = self._kept, None
        self.last_scheduler = self.last_graphs = None
        if kept.graphs is not None:
            kept.graphs.close()

    def _graph_runner(self, manager) -> DecodeGraphs:
        """The CUDA-graph runner of one run (tests replace this to run its fixed-buffer steps eagerly)."""
        return DecodeGraphs(self.model, manager, self.max_num_seqs)

    def _start(self, manager, plan: StepPlan, graphs: DecodeGraphs | None, texts: dict,
               device_tokens: torch.Tensor | None = None, table: StepTable | None = None) -> "_Launched":
        """Launch a step and the pick of its tokens, both on the device (greedy and sampled rows alike).
        ``table``: the sampled rows' parameters on the device, when the last step sampled the same requests."""
        sampled = plan.sampled
        step_texts = [texts[r.request_id] for r in sampled]
        logits = self._launch(manager, plan, graphs, device_tokens)
        tokens, table = _device_tokens(logits, step_texts, table) if logits is not None else (None, None)
        launched = _Launched(list(sampled), step_texts, logits, tokens, decode_only=not plan.prefills)
        launched.table = table
        return launched

    def _look_ahead(self, scheduler: Scheduler, pending: "_Launched", graphs: DecodeGraphs | None,
                    texts: dict) -> "_Launched | None":
        """Plan and launch the step after ``pending`` before its tokens reach the host, or None.

        Only when that step can only be ``pending``'s decodes again, in the same order: its tokens picked on
        the device (greedy or sampled: they feed the next step directly; the caller keeps this off while a
        request wants log-probabilities, read from logits a replay overwrites), nothing waiting or
        swapped out (no prefill joins), ``pending`` itself decodes only (no prompt waits to enter the prefix
        cache), free blocks for everyone's next slot (nobody is preempted), and some
        request not ending by length now. Each request holds a placeholder token while the step is planned
        and launched, so its length counts the token being sampled. A request that turns out to end with
        this step's token ran one step too many: its row of the looked-ahead step is dropped."""
        requests = pending.requests
        if (pending.device_tokens is None or not pending.decode_only or graphs is None
                or not graphs.fits(len(requests))
                or scheduler.waiting or scheduler.swapped
                or len(scheduler.running) != len(requests)      # (a dropped row, None, is never running)
                or not all(map(operator.is_, scheduler.running, requests))
                or scheduler.manager.num_free_blocks < len(requests)
                or all(len(r.output_ids) + 1 >= r.max_new_tokens for r in requests)):
            return None
        for request in requests:
            request.output_ids.append(LOOK_AHEAD_TOKEN)
        try:
            plan = scheduler.schedule_decodes()
            if plan.prefills or len(plan.decodes) != len(requests) or not all(
                    map(operator.is_, plan.decodes, requests)):
                raise RuntimeError("a looked-ahead step planned other work than the same decodes (a bug)")
            return self._start(scheduler.manager, plan, graphs, texts, pending.device_tokens, pending.table)
        finally:
            for request in requests:
                request.output_ids.pop()

    def _launch(self, manager, plan: StepPlan, graphs: DecodeGraphs | None = None,
                device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Queue one forward pass over a step's decodes and prefill chunks on the device, without waiting for
        it: the logits ``[len(plan.sampled), vocab]``, or None when no request of the step samples a token.
        ``device_tokens``: the decodes' input token ids, already on the device (a looked-ahead step)."""
        if graphs is not None and not plan.prefills and device_tokens is not None:
            seq_ids = [r.request_id for r in plan.decodes]
            if graphs.continues(seq_ids):    # a looked-ahead step: the last one's sequences, one token further
                logits = graphs.run_next(seq_ids, device_tokens)
                if logits is not None:
                    return logits
        # A prefill feeds its chunk: the tokens after its cached prefix (a prefix-cache hit, or the chunks
        # of earlier steps), up to the end of its tokens or of the step's budget.
        # (A decode reads its last token and length, not ``token_ids``: that would copy its whole context.)
        token_ids = [r.last_token for r in plan.decodes] + [t for r, (start, end) in zip(plan.prefills,
                                                                                        plan.prefill_ranges)
                                                            for t in r.token_ids[start:end]]
        positions = [r.num_tokens - 1 for r in plan.decodes] + [
            p for start, end in plan.prefill_ranges for p in range(start, end)]
        if graphs is not None and not plan.prefills and graphs.fits(len(plan.decodes)):
            logits = graphs.run([r.request_id for r in plan.decodes], token_ids, positions, device_tokens)
            if logits is not None:       # None: recording failed, run this step (and the next) eagerly
                return logits
        requests = plan.decodes + plan.prefills
        step = PagedStep(manager, [r.request_id for r in requests],
                         [1] * len(plan.decodes) + [end - start for start, end in plan.prefill_ranges],
                         len(plan.decodes),
                         torch.cat(plan.decode_slots + plan.prefill_slots))
        token_tensor = torch.tensor(token_ids, device=self.device)
        if device_tokens is not None:
            token_tensor[:len(device_tokens)] = device_tokens       # the decodes come first
        hidden = self.model.forward(token_tensor, torch.tensor(positions, device=self.device), step)
        # Logits only where a token is sampled: not after a chunk that leaves part of its prompt for later.
        ends = [r.num_tokens for r in plan.decodes] + [end for _, end in plan.prefill_ranges]
        rows = [row for row, r, end in zip(step.last_token_rows, requests, ends) if end == r.num_tokens]
        if not rows:
            return None
        rows = torch.tensor(rows, device=self.device)
        return self.model.logits(hidden[rows])


LOOK_AHEAD_TOKEN = -1   # what a request holds in place of the token being sampled while the next step is planned


class _Launched:
    """A launched step: the requests it samples a token for (in row order), their texts, the logits on the
    device and their tokens, picked on the device (``device_tokens``; None when no row samples)."""

    table: StepTable | None = None     # the sampled rows' parameters (:func:`_device_tokens`), for the next step

    def __init__(self, requests: list, texts: list, logits: torch.Tensor | None, device_tokens: torch.Tensor | None,
                 decode_only: bool):
        self.requests, self.texts, self.logits, self.device_tokens = requests, texts, logits, device_tokens
        self.decode_only = decode_only
        self._host_tokens, self._copied = None, None
        if device_tokens is not None and device_tokens.is_cuda:
            # Queue the tokens' copy to the host now, right behind this step's kernels, and mark its end
            # with an event: :meth:`tokens` waits for this step alone. (``tolist()`` on the device tensor
            # would queue the copy behind a looked-ahead step launched meanwhile and wait for that one too.)
            self._host_tokens = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            self._host_tokens.copy_(device_tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device_tokens.device))

    def tokens(self) -> list[int]:
        """The sampled tokens on the host (waits for the step)."""
        if self.logits is None:
            return []
        if self._copied is not None:
            self._copied.synchronize()
            return self._host_tokens.tolist()
        if self.device_tokens is not None:
            return self.device_tokens.tolist()
        return _sample_rows(self.logits, self.texts)

    def drop(self, request) -> bool:
        """Forget ``request``'s row (it ended before this step's tokens were read); whether it had one."""
        for i, r in enumerate(self.requests):
            if r is request:
                self.requests[i] = None
                return True
        return False


@dataclass
class _RunCache:
    """A KV cache, its CUDA-graph runner (or None) and the settings they were made under."""
    manager: object
    graphs: DecodeGraphs | None
    key: tuple
    in_use: bool = False
    temporary: bool = False     # made because another run held the kept cache: dropped after the run
    prefix_cache: object = None  # lesson 05's radix tree over this manager (automatic prefix caching), or None


def _ended_cleanly(manager, num_cpu_blocks: int) -> bool:
    """No sequence left in the cache but the graphs' scratch one, every host block free."""
    try:
        return set(manager.seq_ids()) <= {SCRATCH_SEQ} and manager.num_free_cpu_blocks == num_cpu_blocks
    except NotImplementedError:          # a student's cache without seq_ids yet: always start afresh
        return False


def _device_tokens(logits: torch.Tensor, texts: list[_Text],
                   table: StepTable | None = None) -> tuple[torch.Tensor, StepTable | None]:
    """One token per row, int64 on the logits' device, not read: greedy rows by argmax, sampled rows by
    the batched sampler (:func:`yaie.engine.sampling.sample_batch`, each with its own generator); and the
    rows' :class:`StepTable` (None when all are greedy). ``table``: the same rows' table, made before."""
    if table is None and all(map(operator.attrgetter("greedy"), texts)):
        return logits.argmax(dim=-1), None
    params, generators = [text.params for text in texts], [text.generator for text in texts]
    table = table or StepTable(params, generators, logits.shape[-1], logits.device)
    return sample_batch(logits, params, generators, table), table


def _sample_rows(logits: torch.Tensor, texts: list[_Text]) -> list[int]:
    """One token per row on the host (:func:`_device_tokens`, then one copy)."""
    return _device_tokens(logits, texts)[0].tolist()


def _is_token_id(value) -> bool:
    """An int (Python's or numpy's), not a bool and not a float."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _all_token_ids(values) -> bool:
    """Every value passes :func:`_is_token_id`; plain Python ints (the usual case) are checked in one
    pass at C speed, anything else one by one."""
    return set(map(type, values)) <= {int} or all(_is_token_id(t) for t in values)


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
