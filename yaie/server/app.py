"""The FastAPI app: OpenAI's completions and chat endpoints over :class:`yaie.engine.async_engine.AsyncEngine`.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON, or server-sent events with ``"stream": true``), ``GET /health``,
``GET /metrics`` (Prometheus text). Each HTTP request becomes a group of engine requests (one per prompt
and choice) that joins the running batch; the handler reads the group's events as the engine thread
produces them. A client that disconnects (stream or not) aborts its group: its blocks are freed before the
engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from yaie.engine.async_engine import AsyncEngine, Frontend, ProcessEngine, RequestGroup
from yaie.engine.llm import LLM
from yaie.engine.slot_engine import serves_by_rows
from yaie.server.protocol import UNLIMITED, APIError, Parsed, choice_params, parse_chat, parse_completion

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 64 * 2**20     # a request body larger than this is refused (413) before it is all in memory


def create_app(llm: LLM | Frontend, served_model_name: str | None = None,
               engine: AsyncEngine | ProcessEngine | None = None) -> FastAPI:
    """An app serving ``llm`` under ``served_model_name`` (default: the model folder's name).

    ``engine``: default an :class:`AsyncEngine` (the engine loop in a thread of this process) over ``llm``;
    ``yaie serve`` passes a :class:`ProcessEngine` (the loop in a process of its own) and a
    :class:`Frontend` as ``llm``. The engine starts with the app (its lifespan) unless started already,
    and stops with it; ``app.state.engine`` is the engine."""
    served = served_model_name or llm.model_dir.name
    engine = engine if engine is not None else AsyncEngine(llm)
    created = int(time.time())
    context = llm.config.max_position_embeddings
    by_rows = serves_by_rows(llm.config)     # a constant-size state per sequence: only the context bounds it
    token_texts = TokenTexts(llm.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.started:
            engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="YAIE OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.llm = llm
    app.state.served_model_name = served

    # ------------------------------------------------------------------ errors, as OpenAI gives them
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = (f"no such endpoint: {request.method} {request.url.path}" if err.status_code in (404, 405)
                   else str(err.detail))
        return JSONResponse(APIError(message, code=kind, status=err.status_code, type=kind).body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        body = APIError(f"internal server error: {type(err).__name__}: {err}", code="internal_error",
                        status=500, type="server_error").body()
        return JSONResponse(body, status_code=500)

    # ------------------------------------------------------------------ plain endpoints
    def model_card() -> dict:
        return {"id": served, "object": "model", "created": created, "owned_by": "yaie", "max_model_len": context}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model != served:
            raise APIError(f"The model `{model}` does not exist; this server serves `{served}`", "model",
                           "model_not_found", status=404)
        return model_card()

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        parsed = parse_completion(body, served, llm.default_sampling_params())
        text_size = sum(len(p) for p in parsed.prompts if isinstance(p, str))
        prompt_ids = await off_loop(lambda: [checked_prompt(llm, p, "prompt") for p in parsed.prompts], text_size)
        return await generate(request, parsed, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        parsed, messages = parse_chat(body, served, llm.default_sampling_params())
        text_size = sum(len(m["content"]) for m in messages)
        prompt_ids = [await off_loop(lambda: checked_prompt(llm, render_chat(llm, messages), "messages"), text_size)]
        return await generate(request, parsed, prompt_ids, chat=True)

    async def generate(request: Request, parsed: Parsed, prompt_ids: list[list[int]], chat: bool):
        params = parsed.params
        if params.max_tokens == UNLIMITED:     # chat without max_tokens: up to the context, or what the cache holds
            cache_tokens = context if by_rows else engine.stats.blocks_total * llm.block_size
            params = dataclasses.replace(params, max_tokens=max(1, cache_tokens + 1 - max(map(len, prompt_ids))))
        items = [(ids, choice_params(params, j)) for ids in prompt_ids for j in range(parsed.n)]
        try:
            group = await engine.submit(items, parsed.logprobs)
        except ValueError as err:          # a request that could never fit in the KV cache, even alone
            if by_rows:                    # (a row holds any length: the engine's own check of the prompt)
                raise APIError(str(err), "messages" if chat else "prompt", "invalid_value") from None
            raise cache_too_small(prompt_ids, params, engine.stats.blocks_total * llm.block_size, context,
                                  "messages" if chat else "prompt") from None
        except RuntimeError as err:        # shutting down
            raise APIError(str(err), None, "unavailable", status=503, type="server_error") from None
        reply = Reply(served, chat, len(items), sum(map(len, prompt_ids)), parsed.include_usage,
                      token_texts if parsed.logprobs is not None else None)
        if parsed.stream:
            return StreamingResponse(reply.sse(batches(request, group)), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        async for batch in batches(request, group):
            for event in batch:
                reply.take(event)
        if reply.error is not None:
            raise APIError(reply.error, None, "engine_error", status=500, type="server_error")
        return JSONResponse(reply.whole())

    return app


# ---------------------------------------------------------------------------- requests
async def read_json(request: Request) -> dict:
    too_large = APIError(f"the request body is larger than this server takes ({MAX_BODY_BYTES} bytes)", None,
                         "request_too_large", status=413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():     # counted as it comes: a body sent without a length too
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(f"the request body is not valid JSON ({err}); send a JSON object", None,
                       "invalid_json") from None
    except RecursionError:                 # [[[[...]]]] nested deeper than the parser's stack
        raise APIError("the request body nests arrays or objects too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    return body


INLINE_TEXT_CHARS = 16_384    # prompts up to this many characters are tokenized on the event loop


async def off_loop(work, text_chars: int):
    """``work()`` (tokenizing and checking prompts): in a worker thread, off the interpreter lock (see
    :func:`encode`), when the text is long enough to stall the other streams (a prompt of megabytes takes
    seconds); inline otherwise, since the thread's round trip (two hand-overs of the interpreter lock, each
    up to its 5 ms switch interval while the loop is busy streaming) costs more than a short prompt's
    tokenization."""
    if text_chars <= INLINE_TEXT_CHARS:
        return work()
    return await asyncio.to_thread(work)


def checked_prompt(llm: LLM, prompt, param: str) -> list[int]:
    """Token ids of a prompt (a string or ids), checked by the engine: 400 if empty, out of the vocabulary
    or not shorter than the model's context."""
    try:
        if isinstance(prompt, str) and prompt:    # an empty string gets _prompt_ids' own message
            prompt = encode(llm.tokenizer, prompt)
        return llm._prompt_ids(prompt)[1]
    except ValueError as err:
        code = "context_length_exceeded" if "context" in str(err) else "invalid_value"
        raise APIError(str(err), param, code) from None


def cache_too_small(prompt_ids: list[list[int]], params, cache_tokens: int, context: int, prompt_param: str):
    """The 400 for a request whose prompt and max_tokens need more KV cache than the server has: what
    would fit (the engine's own message names its internal request id, which means nothing to a client)."""
    longest = max(map(len, prompt_ids))
    allowed = min(cache_tokens + 1, context) - longest      # the last token generated is never cached
    if allowed < 1:
        return APIError(f"the prompt ({longest} tokens) does not fit in this server's KV cache ({cache_tokens} "
                        "tokens); shorten it", prompt_param, "context_length_exceeded")
    return APIError(f"the prompt ({longest} tokens) and max_tokens ({params.max_tokens}) need more than this "
                    f"server's KV cache ({cache_tokens} tokens); ask for max_tokens <= {allowed}", "max_tokens",
                    "context_length_exceeded")


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)``, letting go of the interpreter lock while the tokenizers library works
    (its ``encode`` holds it, its ``encode_batch`` does not). The handlers call this in a worker thread: a
    prompt of megabytes takes seconds, and holding the lock it would stall every other client's stream."""
    return tokenizer._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def render_chat(llm: LLM, messages: list[dict]) -> list[int]:
    """The model's chat template (tokenizer_config.json / chat_template.jinja); a model without one (the
    bundled tiny-stories model) gets the messages' texts one per line, as plain text to continue."""
    tokenizer = llm.tokenizer
    if not tokenizer.chat_template:
        return encode(tokenizer, "\n".join(m["content"] for m in messages))
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as err:
        raise APIError(str(err), "messages", "invalid_value") from None
    except Exception as err:  # noqa: BLE001 (a Jinja error in the template's own logic)
        raise APIError(f"the chat template failed on these messages: {err}", "messages", "invalid_value") from None
    return encode(tokenizer, text, add_special_tokens=False)


async def batches(request: Request, group: RequestGroup):
    """The group's events, in lists (:meth:`RequestGroup.batches`); stops early, aborting the group, when the
    client disconnects."""
    gone = asyncio.Event()

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                group.abort()
                group.queue.put_nowait(None)      # wake the reader below
                return

    watcher = asyncio.create_task(watch())
    try:
        async for batch in group.batches():
            if gone.is_set():
                return
            yield batch
    finally:
        watcher.cancel()
        group.abort()                             # nothing left to abort when the group finished


# ---------------------------------------------------------------------------- responses
class TokenTexts:
    """Each token id's own text, for logprobs (decoded once per id: a token alone, so a piece of a UTF-8
    character shows as U+FFFD, as in the OpenAI API)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class Reply:
    """Builds one response, whole (JSON) or as server-sent events, from a group's events."""

    def __init__(self, model: str, chat: bool, choices: int, prompt_tokens: int, include_usage: bool,
                 token_texts: TokenTexts | None = None):
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.token_texts = token_texts            # set when the request asked for logprobs
        self.logprobs = [[] for _ in range(choices)]      # per choice: the engine's entries, in order
        self.offsets = [0] * choices                      # completions' text_offset of the next token
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = [""] * choices
        self.finish = [None] * choices
        self.tokens = [0] * choices
        self.prompt_tokens = prompt_tokens
        self.error: str | None = None
        self._templates: dict[int, list[str]] = {}

    def take(self, event) -> None:
        if event.error is not None:
            self.error = self.error or event.error
            return
        self.texts[event.index] += event.text
        self.tokens[event.index] = event.num_tokens
        if event.logprobs:
            self.logprobs[event.index].extend(event.logprobs)
        if event.finish_reason is not None:
            self.finish[event.index] = event.finish_reason

    def usage(self) -> dict:
        completion = sum(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def logprobs_body(self, index: int, entries: list) -> dict | None:
        """OpenAI's ``logprobs`` of a choice's tokens ``entries`` (``StepEngine.take_logprobs``), or None when
        the request did not ask. Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top k
        and the chosen token, by text), ``text_offset`` (where each token's text starts in the completion).
        Chat: ``content``, one ``{token, logprob, bytes, top_logprobs}`` per token."""
        if self.token_texts is None:
            return None
        text_of = self.token_texts
        if self.chat:
            def item(token_id, logprob):
                text = text_of(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [dict(item(token_id, logprob), top_logprobs=[item(i, lp) for i, lp in top])
                                for token_id, logprob, top in entries], "refusal": None}
        tokens = [text_of(token_id) for token_id, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        tops = [{text_of(i): lp for i, lp in top} | {text: logprob}
                for text, (_, logprob, top) in zip(tokens, entries)]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def whole(self) -> dict:
        logprobs = [self.logprobs_body(i, entries) for i, entries in enumerate(self.logprobs)]
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs[i],
                        "finish_reason": finish} for i, (text, finish) in enumerate(zip(self.texts, self.finish))]
        else:
            choices = [{"index": i, "text": text, "logprobs": logprobs[i], "finish_reason": finish}
                       for i, (text, finish) in enumerate(zip(self.texts, self.finish))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def _chunk(self, choices: list, usage=None) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return "data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False) + "\n\n"

    def _text_chunk(self, index: int, text: str) -> str:
        """The chunk of one piece of text (no finish yet): the most frequent message, built from a template
        made once per choice (one ``json.dumps`` of the text per token instead of the whole chunk)."""
        template = self._templates.get(index)
        if template is None:
            marker = "\x00"
            choice = self._choice(index, marker, None)
            template = self._templates[index] = self._chunk([choice]).split(json.dumps(marker))
        return template[0] + json.dumps(text, ensure_ascii=False) + template[1]

    def _choice(self, index: int, text: str | None, finish: str | None, role: bool = False,
                logprobs: dict | None = None) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def sse(self, batches):
        """``data: {chunk}`` per piece of text, a last chunk per choice with its finish_reason, the usage
        chunk when asked for (``stream_options.include_usage``), then ``data: [DONE]``. The chunks of one
        batch of events (:func:`batches`) go out in one write: the same bytes, fewer wake-ups and syscalls
        when a client has several choices or the server fell behind."""
        if self.chat:                                 # OpenAI's first chunk of a choice names the role
            yield "".join(self._chunk([self._choice(i, None, None, role=True)]) for i in range(len(self.texts)))
        async for batch in batches:
            out = []
            for event in batch:
                if event.error is not None:
                    out.append("data: " + json.dumps(APIError(event.error, None, "engine_error", status=500,
                                                              type="server_error").body()) + "\n\n")
                    yield "".join(out)
                    return
                self.take(event)
                if event.logprobs:          # a chunk per event with tokens, its text empty or not
                    logprobs = self.logprobs_body(event.index, event.logprobs)
                    out.append(self._chunk([self._choice(event.index, event.text, event.finish_reason,
                                                         logprobs=logprobs)]))
                elif event.finish_reason is not None:
                    out.append(self._chunk([self._choice(event.index, event.text, event.finish_reason)]))
                elif event.text:
                    out.append(self._text_chunk(event.index, event.text))
            if out:
                yield "".join(out)
        end = [self._chunk([], self.usage())] if self.include_usage else []
        yield "".join(end + ["data: [DONE]\n\n"])


# ---------------------------------------------------------------------------- metrics
def prometheus_text(engine: AsyncEngine) -> str:
    """The engine's counters in Prometheus' text format (one ``# HELP``, ``# TYPE`` and value each)."""
    s = engine.stats
    total = max(1, s.blocks_total)
    rows = [
        ("yaie_requests_running", "gauge", "requests in the running batch", s.running),
        ("yaie_requests_waiting", "gauge", "requests queued for a prefill (new or preempted by recompute)", s.waiting),
        ("yaie_requests_swapped", "gauge", "requests preempted to host memory", s.swapped),
        ("yaie_kv_cache_blocks_total", "gauge", "KV-cache blocks requests can use", s.blocks_total),
        ("yaie_kv_cache_blocks_used", "gauge", "KV-cache blocks held by requests", s.blocks_used),
        ("yaie_kv_cache_usage", "gauge", "fraction of the KV-cache blocks in use", s.blocks_used / total),
        ("yaie_generation_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
         s.tokens_per_s()),
        ("yaie_prompt_tokens_total", "counter", "prompt tokens accepted", s.prompt_tokens),
        ("yaie_generation_tokens_total", "counter", "tokens generated", s.generation_tokens),
        ("yaie_requests_finished_total", "counter", "requests that ran to a stop or their length", s.requests_finished),
        ("yaie_requests_aborted_total", "counter", "requests cancelled by their client", s.requests_aborted),
        ("yaie_requests_failed_total", "counter", "requests failed by an engine error", s.requests_failed),
        ("yaie_preemptions_total", "counter", "preemptions (recompute or swap)", s.preemptions),
        ("yaie_engine_steps_total", "counter", "forward passes", s.steps),
        ("yaie_engine_prefill_steps_total", "counter", "forward passes that fed prompt tokens (on CUDA: launched "
         "eagerly, not from a CUDA graph)", s.prefill_steps),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}" if isinstance(value, float)
                  else f"{name} {value}"]
    return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """``{name: value}`` of a metrics page (for tests and the benchmark)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            values[name] = float(value)
    return values
