"""The FastAPI app: OpenAI's completions and chat endpoints over :class:`yaie.engine.async_engine.AsyncEngine`.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON, or server-sent events with ``"stream": true``), ``GET /health``,
``GET /metrics`` (Prometheus text). Each HTTP request becomes a group of engine requests (one per prompt
and choice) that joins the running batch; the handler reads the group's events as the engine thread
produces them. A client that disconnects (stream or not) aborts its group: its blocks are freed before the
engine's next step.

In front of the endpoints, :class:`Gate` checks the API key (every path but ``/health`` and ``/metrics``),
refuses new requests while the server drains (503), and counts the requests in flight for
:class:`Lifecycle`, which holds the operator's :class:`Limits` (400, 429) and the graceful shutdown that
:class:`Server` (``yaie serve``'s uvicorn) runs on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import sys
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from yaie.engine.async_engine import AsyncEngine
from yaie.engine.llm import LLM
from yaie.engine.process_engine import Frontend, ProcessEngine
from yaie.engine.prompts import to_token_ids
from yaie.engine.row_runner import has_rows
from yaie.engine.serving import RequestGroup
from yaie.server.protocol import (MAX_CHOICES, UNLIMITED, APIError, Parsed, parse_chat,
                                  parse_completion)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 64 * 2**20     # a request body larger than this is refused (413) before it is all in memory
RETRY_AFTER_S = 2               # the Retry-After of a 429 (the openai client waits this long, then retries)
END_WAIT_S = 2.0                # after the grace period: how long the ended responses get to write their end
OPEN_PATHS = ("/health", "/metrics")      # answered without the API key


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server takes from one client (``yaie serve --max-prompt-tokens, --max-n, --max-waiting``).

    ``max_prompt_tokens``: the longest prompt, in tokens (a chat's rendered messages); None: the model's
    context, the engine's own bound. ``max_n``: the largest ``n``. Past either, a 400. ``max_waiting``: a
    new generation request is refused with 429 (and ``Retry-After``) while this many engine requests or more
    wait: the engine's queue as of its last step (``EngineStats.waiting`` + ``swapped``: admitted but not
    running, whether new, preempted or held by the admission window) plus the requests this server has
    handed to the engine that it has not taken yet. A request that is let in joins whatever its size (one
    per prompt and choice), so the queue may pass ``max_waiting`` by one request's choices."""
    max_prompt_tokens: int | None = None
    max_n: int = 64
    max_waiting: int = 256

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_n", "max_waiting"):
            value = getattr(self, name)
            if not (value is None and name == "max_prompt_tokens") and not (type(value) is int and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_n > MAX_CHOICES:
            raise ValueError(f"max_n must be at most {MAX_CHOICES} (the choices one request may ask for), "
                             f"got {self.max_n}")


def create_app(llm: LLM | Frontend, served_model_name: str | None = None,
               engine: AsyncEngine | ProcessEngine | None = None, *, api_key: str | None = None,
               limits: Limits | None = None, shutdown_grace_s: float = 5.0) -> FastAPI:
    """An app serving ``llm`` under ``served_model_name`` (default: the model folder's name).

    ``engine``: default an :class:`AsyncEngine` (the engine loop in a thread of this process) over ``llm``;
    ``yaie serve`` passes a :class:`ProcessEngine` (the loop in a process of its own) and a
    :class:`Frontend` as ``llm``. The engine starts with the app (its lifespan) unless started already,
    and stops with it; ``app.state.engine`` is the engine.

    ``api_key``: when set, every request but ``/health`` and ``/metrics`` needs ``Authorization: Bearer
    <api_key>`` (401 otherwise; :class:`Gate`). ``limits``: :class:`Limits` (default ``Limits()``).
    ``shutdown_grace_s``: how long :meth:`Lifecycle.drain` lets the requests in flight run;
    ``app.state.lifecycle`` is the :class:`Lifecycle`."""
    served = served_model_name or llm.model_dir.name
    engine = engine if engine is not None else AsyncEngine(llm)
    limits = limits if limits is not None else Limits()
    lifecycle = Lifecycle(shutdown_grace_s)
    created = int(time.time())
    context = llm.config.max_position_embeddings
    by_rows = has_rows(llm.config)     # a constant-size state per sequence: only the context bounds it
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
    app.state.limits = limits
    app.state.lifecycle = lifecycle
    app.add_middleware(Gate, lifecycle=lifecycle, api_key=api_key)

    # ------------------------------------------------------------------ errors, as OpenAI gives them
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        headers = getattr(err, "headers", None)
        if err.status_code == 405:         # a known path, another method: Starlette names the allowed ones
            allowed = (headers or {}).get("Allow", "")
            message = f"method not allowed: {request.method} {request.url.path} (allowed: {allowed})"
            kind, code = "invalid_request_error", "method_not_allowed"
        elif err.status_code == 404:
            message, kind, code = f"no such endpoint: {request.method} {request.url.path}", "not_found_error", \
                "not_found_error"
        else:
            message, kind, code = str(err.detail), "invalid_request_error", "invalid_request_error"
        return JSONResponse(APIError(message, code=code, status=err.status_code, type=kind).body(),
                            status_code=err.status_code, headers=headers)

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
        if lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, lifecycle), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        parsed = parse_completion(body, served, llm.default_sampling_params())
        check_n(parsed)
        text_size = sum(len(p) for p in parsed.prompts if isinstance(p, str))
        prompt_ids = await off_loop(lambda: [checked_prompt(llm, p, "prompt") for p in parsed.prompts], text_size)
        return await generate(request, parsed, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        parsed, messages = parse_chat(body, served, llm.default_sampling_params())
        check_n(parsed)
        text_size = sum(len(m["content"]) for m in messages)
        prompt_ids = [await off_loop(lambda: checked_prompt(llm, render_chat(llm, messages), "messages"), text_size)]
        return await generate(request, parsed, prompt_ids, chat=True)

    def check_n(parsed: Parsed) -> None:
        if parsed.n > limits.max_n:
            raise APIError(f"'n' may be at most {limits.max_n} on this server, got {parsed.n}", "n",
                           "invalid_value")

    def check_admission(prompt_ids: list[list[int]], chat: bool) -> None:
        """The operator's limits on a checked request: 400 for a prompt over ``max_prompt_tokens``, 429
        while ``max_waiting`` engine requests wait (:class:`Limits`)."""
        longest = max(map(len, prompt_ids))
        if limits.max_prompt_tokens is not None and longest > limits.max_prompt_tokens:
            raise APIError(f"the prompt has {longest} tokens; this server takes at most {limits.max_prompt_tokens}",
                           "messages" if chat else "prompt", "prompt_too_long")
        waiting = engine.stats.waiting + engine.stats.swapped + lifecycle.submitting
        if waiting >= limits.max_waiting:
            lifecycle.refused_busy += 1
            raise APIError(f"the server is busy: {waiting} requests are waiting for the engine (it queues at most "
                           f"{limits.max_waiting}); retry in {RETRY_AFTER_S} s", None, "server_busy", status=429,
                           type="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def generate(request: Request, parsed: Parsed, prompt_ids: list[list[int]], chat: bool):
        check_admission(prompt_ids, chat)
        params = parsed.params
        if params.max_tokens == UNLIMITED:     # chat without max_tokens: up to the context, or what the cache holds
            cache_tokens = context if by_rows else engine.stats.blocks_total * llm.settings.block_size
            params = dataclasses.replace(params, max_tokens=max(1, cache_tokens + 1 - max(map(len, prompt_ids))))
        items = [(ids, dataclasses.replace(params, n=parsed.n).choice(j)) for ids in prompt_ids for j in range(parsed.n)]
        lifecycle.submitting += len(items)
        try:
            group = await engine.submit(items, parsed.logprobs)
        except ValueError as err:          # a request that could never fit in the KV cache, even alone
            if by_rows:                    # (a row holds any length: the engine's own check of the prompt)
                raise APIError(str(err), "messages" if chat else "prompt", "invalid_value") from None
            raise cache_too_small(prompt_ids, params, engine.stats.blocks_total * llm.settings.block_size, context,
                                  "messages" if chat else "prompt") from None
        except RuntimeError as err:        # shutting down
            raise APIError(str(err), None, "unavailable", status=503, type="server_error") from None
        finally:
            lifecycle.submitting -= len(items)
        reply = Reply(served, chat, len(items), sum(map(len, prompt_ids)), parsed.include_usage,
                      token_texts if parsed.logprobs is not None else None)
        if parsed.stream:
            return StreamingResponse(reply.sse(batches(request, group, lifecycle)), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        async for batch in batches(request, group, lifecycle):
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
        if isinstance(prompt, str) and prompt:    # an empty string gets to_token_ids' own message
            prompt = encode(llm.tokenizer, prompt)
        return to_token_ids(prompt, llm.tokenizer, llm.config)[1]
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
    return tokenizer.encode_without_the_gil(text, add_special_tokens)


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


async def batches(request: Request, group: RequestGroup, lifecycle: "Lifecycle"):
    """The group's events, in lists (:meth:`RequestGroup.batches`); stops early, aborting the group, when the
    client disconnects. When the server ends the request (:meth:`Lifecycle.drain`, past the grace period)
    it raises :func:`shutdown_error`, and the group is aborted."""
    gone = asyncio.Event()
    ended = False
    finished = 0           # requests of the group that finished (or failed)

    def end():
        nonlocal ended
        ended = True
        group.queue.put_nowait(None)              # wake the reader below

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                group.abort()
                group.queue.put_nowait(None)      # wake the reader below
                return

    watcher = asyncio.create_task(watch())
    lifecycle.enders.add(end)
    try:
        if lifecycle.ending:                      # the server ended its requests before this one got here
            raise shutdown_error(lifecycle)
        async for batch in group.batches():
            if gone.is_set():
                return
            if ended:
                break
            finished += sum(event.finish_reason is not None or event.error is not None for event in batch)
            yield batch
        if finished < len(group.items) and not gone.is_set():
            raise shutdown_error(lifecycle)
    finally:
        lifecycle.enders.discard(end)
        watcher.cancel()
        group.abort()                             # nothing left to abort when the group finished


def shutdown_error(lifecycle: "Lifecycle") -> APIError:
    """What a request still running at the end of the grace period gets: a 503, or this error as a
    stream's last event."""
    why = ("its grace period was cut short" if lifecycle.cut else
           f"it did not finish within its grace period ({lifecycle.grace_s:g} s)")
    return APIError(f"the server is shutting down and ended this request: {why}", None, "unavailable", status=503,
                    type="server_error")


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
        """OpenAI's ``logprobs`` of a choice's tokens ``entries`` (``EngineCore.take_logprobs``), or None when
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
        when a client has several choices or the server fell behind. An engine error, or the server ending
        the request (shutdown, :func:`shutdown_error`), ends the stream with an ``error`` event instead."""
        if self.chat:                                 # OpenAI's first chunk of a choice names the role
            yield "".join(self._chunk([self._choice(i, None, None, role=True)]) for i in range(len(self.texts)))
        try:
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
        except APIError as err:                       # raised by batches(): the server ended the request
            yield "data: " + json.dumps(err.body()) + "\n\n"
            return
        end = [self._chunk([], self.usage())] if self.include_usage else []
        yield "".join(end + ["data: [DONE]\n\n"])


# ---------------------------------------------------------------------------- the key, admission, shutdown
class Lifecycle:
    """The requests one app is serving, for its limits and its graceful shutdown. Used on the event loop's
    thread only.

    ``in_flight``: requests past :class:`Gate` whose response has not ended (from reading the request to
    writing its last byte). ``submitting``: engine requests (one per prompt and choice) handed to
    ``engine.submit`` that the engine has not taken yet. ``draining``: new requests get 503 (set by
    :meth:`drain`). ``ending``: the grace period is over, the server ends what still runs. ``enders``: one
    callback per running generation (:func:`batches`) that ends it."""

    def __init__(self, grace_s: float = 5.0):
        if not grace_s >= 0:
            raise ValueError(f"the shutdown grace period must be >= 0 seconds, got {grace_s!r}")
        self.grace_s = grace_s
        self.in_flight = 0
        self.submitting = 0
        self.refused_busy = 0          # 429s given (metrics)
        self.draining = False
        self.ending = False
        self.enders: set = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    def cut_short(self) -> None:
        """End the grace period now (a second SIGTERM or Ctrl-C)."""
        self._cut.set()

    @property
    def cut(self) -> bool:
        """Whether the grace period was cut short."""
        return self._cut.is_set()

    async def drain(self) -> None:
        """The graceful shutdown, before the server stops: new requests get 503 (``/health`` too); the
        requests in flight get up to ``grace_s`` to finish (less if :meth:`cut_short`); then the generations
        still running are ended (a stream gets an ``error`` event and closes, a whole request a 503, and
        their engine requests are aborted), and their responses get up to :data:`END_WAIT_S` to go out.
        Returns when nothing is in flight or that time is up."""
        self.draining = True
        if self.in_flight:
            say(f"shutting down: {self.in_flight} request(s) in flight get up to {self.grace_s:g} s to finish "
                "(signal again to end them now); new requests get 503")
            await _first(self._idle.wait(), self._cut.wait(), timeout=self.grace_s)
        if self.in_flight:
            when = "the grace period was cut short" if self.cut else "the grace period is over"
            say(f"ending {len(self.enders)} generation(s) still running: {when}")
            self.ending = True
            for end in list(self.enders):
                end()
            await _first(self._idle.wait(), timeout=END_WAIT_S)


async def _first(*waits, timeout: float) -> None:
    """Wait until the first of ``waits`` (coroutines) is done, or ``timeout`` seconds; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def say(message: str) -> None:
    print(f"yaie serve: {message}", file=sys.stderr, flush=True)


class Gate:
    """ASGI middleware in front of every endpoint (pure ASGI: a stream passes through untouched).

    Every path but :data:`OPEN_PATHS` (``/health``, ``/metrics``): with an API key set, a request without
    ``Authorization: Bearer <key>`` gets 401 (the key compared in constant time: SHA-256 digests through
    ``hmac.compare_digest``, so neither the content nor the length of the key leaks through timing); while
    the server drains, a 503; else it is counted in flight (:class:`Lifecycle`) until its response ends."""

    def __init__(self, app, lifecycle: Lifecycle, api_key: str | None = None):
        self.app, self.lifecycle = app, lifecycle
        self.key_digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()

    def authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    hashlib.sha256(token.strip()).digest(), self.key_digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        lifecycle = self.lifecycle
        if self.key_digest is not None and not self.authorized(scope):
            missing = not any(name == b"authorization" for name, _ in scope["headers"])
            message = ("this server needs an API key: send the header 'Authorization: Bearer <key>'" if missing
                       else "the API key is not this server's (the header is 'Authorization: Bearer <key>')")
            error = APIError(message, None, "invalid_api_key", status=401)
            return await JSONResponse(error.body(), 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if lifecycle.draining:
            error = APIError("the server is shutting down and takes no new requests", None, "unavailable",
                             status=503, type="server_error")
            return await JSONResponse(error.body(), 503, {"Connection": "close"})(scope, receive, send)
        lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not lifecycle.ending:
                raise
            # uvicorn cancels what is left after the grace period and END_WAIT_S: a response the server has
            # already ended, whose client stopped reading. Nothing to report (uvicorn would log a traceback).
        finally:
            lifecycle.leave()


class Server(uvicorn.Server):
    """uvicorn's server with the app's graceful shutdown (``yaie serve``): the first SIGTERM or SIGINT runs
    :meth:`Lifecycle.drain` (the server keeps listening meanwhile, so new requests get a 503, not a refused
    connection), then the server stops as uvicorn stops; a second signal ends the grace period at once, a
    third stops without waiting. ``run()`` returns normally after a signal (the process exits with 0).

    ``config.timeout_graceful_shutdown`` bounds uvicorn's own wait after the drain (connections whose
    client stopped reading); the engine stops with the app's lifespan."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.signals = 0
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        # A signal handler: only flags here; the loop acts on them at its next tick (0.1 s).
        self.signals += 1
        if self.should_exit or self.signals >= 3:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())
        if self.signals >= 2:
            self.lifecycle.cut_short()
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self.lifecycle.drain()
        finally:
            self.should_exit = True


# ---------------------------------------------------------------------------- metrics
def prometheus_text(engine: AsyncEngine, lifecycle: Lifecycle | None = None) -> str:
    """The engine's counters in Prometheus' text format (one ``# HELP``, ``# TYPE`` and value each), and the
    server's (``lifecycle``) when given."""
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
    if lifecycle is not None:
        rows += [
            ("yaie_server_requests_in_flight", "gauge", "HTTP requests being answered (health and metrics aside)",
             lifecycle.in_flight),
            ("yaie_server_requests_refused_busy_total", "counter", "generation requests refused with 429 (too "
             "many waiting: --max-waiting)", lifecycle.refused_busy),
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
