"""The OpenAI request bodies the server accepts, checked into engine terms, and its error bodies.

Every problem with a request becomes an :class:`APIError`, answered as the OpenAI API answers:
``{"error": {"message", "type", "param", "code"}}`` with status 400 (404 for an unknown model). The
checks name the parameter, the value and what it may be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from yaie.engine.sampling import SamplingParams

MAX_CHOICES = 256            # prompts x n in one request
MAX_STOP_STRINGS = 4         # as the OpenAI API
UNLIMITED = 2**31 - 1        # max_tokens left out (chat): the context or the cache stops the request
GREEDY_BELOW = 1e-5          # a temperature under this samples greedily: logits / 1e-38 overflow float32 to inf,
                             # the probabilities become NaN and the whole step (every client's request) fails
MAX_LOGPROBS = 5             # completions' 'logprobs', as the OpenAI API
MAX_TOP_LOGPROBS = 20        # chat's 'top_logprobs', as the OpenAI API
PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class APIError(Exception):
    """An error answered as the OpenAI API answers it: ``status`` with :meth:`body` as JSON, and ``headers``
    (e.g. ``Retry-After`` on a 429, ``Allow`` on a 405) on the response."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """A checked request: what to generate and how."""
    model: str
    prompts: list            # strings or lists of token ids (completions); one rendered chat (chat)
    params: SamplingParams   # the seed of choice i is seed + i (SamplingParams.choice)
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None = None   # None: none asked for; k: each token's log-probability and the k most likely


# --------------------------------------------------------------------------- field checks
def _is_int(value) -> bool:
    # type() first: the Integral check goes through the ABC machinery (~1 us), and a prompt of token ids
    # checks every id, in the server's one event loop.
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _get_int(body: dict, name: str, default, minimum: int | None = None, maximum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise APIError(f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise APIError(f"'{name}' must be {bounds}, got {value}", name, "invalid_value")
    return int(value)


def _get_number(body: dict, name: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise APIError(f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    if not math.isfinite(value):            # json.loads takes NaN and Infinity; NaN passes every comparison
        raise APIError(f"'{name}' must be a finite number, got {value}", name, "invalid_value")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise APIError(f"'{name}' must be in {interval}, got {value}", name, "invalid_value")
    return float(value)


def _get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be true or false, got {value!r}", name, "invalid_type")
    return value


def _get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(f"'stop' must be a string or a list of strings, got {stop!r}", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop", "invalid_value")
    if any(not s for s in stop):
        raise APIError("'stop' strings must not be empty", "stop", "invalid_value")
    return [_check_text(s, "stop") for s in stop]


def _check_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode. JSON may spell a lone UTF-16 surrogate (``"\\ud800"``) that Python
    parses into a string no tokenizer and no UTF-8 response can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(f"'{param}' is not valid Unicode: a lone surrogate {text[err.start]!r} at character "
                       f"{err.start} (a \\uD800-\\uDFFF escape without its pair)", param, "invalid_value") from None
    return text


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Parameters the engine cannot honour: a clear 400 instead of silently ignoring them."""
    if chat:
        if body.get("tools") or body.get("functions"):
            raise APIError("tools and function calling are not supported by this server", "tools",
                           "unsupported_parameter")
        fmt = body.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise APIError("only response_format {\"type\": \"text\"} is supported", "response_format",
                           "unsupported_parameter")
    else:
        if body.get("echo") not in (None, False):
            raise APIError("echo is not supported by this server", "echo", "unsupported_parameter")
        if body.get("suffix") not in (None, ""):
            raise APIError("suffix (insertion) is not supported by this server", "suffix", "unsupported_parameter")
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            raise APIError("best_of is not supported by this server (leave it out or equal to n)", "best_of",
                           "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise APIError(f"'{name}' is not supported by this server (only 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise APIError("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")


def check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        raise APIError("you must give 'model' (GET /v1/models lists it)", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise APIError(f"'model' must be a string, got {model!r}", "model", "invalid_type")
    _check_text(model, "model")
    if model != served:
        raise APIError(f"The model `{model}` does not exist; this server serves `{served}`", "model",
                       "model_not_found", status=404)
    return model


def sampling_params(body: dict, defaults: SamplingParams, max_tokens_default: int | None,
                    max_tokens_names: tuple[str, ...] = ("max_tokens",)) -> tuple[SamplingParams, int, bool, bool]:
    """The sampling fields shared by completions and chat: (params, n, stream, include_usage)."""
    max_tokens = max_tokens_default
    for name in max_tokens_names:
        max_tokens = _get_int(body, name, max_tokens, minimum=1)
    n = _get_int(body, "n", 1, minimum=1, maximum=MAX_CHOICES)
    stream = _get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(f"'stream_options' must be an object, got {options!r}", "stream_options", "invalid_type")
    if options and not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", "stream_options", "invalid_value")
    include_usage = _get_bool(options or {}, "include_usage", False)
    temperature = _get_number(body, "temperature", defaults.temperature, 0.0, 2.0)
    fields = dict(
        max_tokens=max_tokens if max_tokens is not None else UNLIMITED,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=_get_number(body, "top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        top_k=_get_int(body, "top_k", defaults.top_k, minimum=-1),
        seed=_get_int(body, "seed", None, minimum=-2**63, maximum=2**63 - 1 - MAX_CHOICES),
        stop=_get_stop(body),
        ignore_eos=_get_bool(body, "ignore_eos", False))
    try:
        params = SamplingParams(**fields)
    except ValueError as err:              # a rule of SamplingParams' own that the checks above missed
        raise APIError(str(err), None, "invalid_value") from None
    return params, n, stream, include_usage


def parse_completion(body: dict, served: str, defaults: SamplingParams) -> Parsed:
    model = check_model(body, served)
    _refuse_unsupported(body, chat=False)
    if "prompt" not in body:
        raise APIError("you must give 'prompt'", "prompt", "missing_required_parameter")
    prompts = completion_prompts(body["prompt"])
    params, n, stream, include_usage = sampling_params(body, defaults, max_tokens_default=16)
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} completions in one request",
                       "n", "invalid_value")
    logprobs = None if body.get("logprobs") is False else _get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    return Parsed(model, prompts, params, n, stream, include_usage, logprobs)


def completion_prompts(prompt: Any) -> list:
    """The OpenAI forms of ``prompt`` as a list of prompts (strings or lists of token ids)."""
    if isinstance(prompt, str):
        return [_check_text(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_check_text(p, "prompt") for p in prompt]
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    # (built only here: the repr of a prompt of megabytes is not free)
    raise APIError(f"'prompt' must be {PROMPT_FORMS}; got {_short(prompt)}", "prompt", "invalid_type")


def parse_chat(body: dict, served: str, defaults: SamplingParams) -> tuple[Parsed, list[dict]]:
    model = check_model(body, served)
    _refuse_unsupported(body, chat=True)
    messages = chat_messages(body.get("messages"))
    params, n, stream, include_usage = sampling_params(body, defaults, max_tokens_default=None,
                                                       max_tokens_names=("max_tokens", "max_completion_tokens"))
    top = _get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if not _get_bool(body, "logprobs", False):
        if top:
            raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        return Parsed(model, [], params, n, stream, include_usage), messages
    return Parsed(model, [], params, n, stream, include_usage, top or 0), messages


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: Any) -> list[dict]:
    """``[{"role", "content"}, ...]`` with text content (a string or a list of text parts) as plain strings."""
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects; got "
                       f"{_short(messages)}", "messages", "invalid_type")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(f"'{where}' must be an object with 'role' and 'content', got {_short(message)}",
                           where, "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role",
                           "invalid_value")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"'{where}.content': only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               "supported", f"{where}.content", "invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"'{where}.content' must be a string or a list of text parts, got {_short(content)}",
                           f"{where}.content", "invalid_type")
        out.append({"role": role, "content": _check_text(content, f"{where}.content")})
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
