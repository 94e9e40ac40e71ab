"""Output processing: what happens to each sampled token, and what the user gets back.

:class:`OutputState` is one request's per-token bookkeeping: its sampling parameters and random key, its stop
ids and stop strings, and its text, decoded incrementally. The engine core calls :meth:`OutputState.accept`
for every sampled token (does the request end?) and :meth:`OutputState.piece` for the text that became
final; ``generate`` reads every request's final text once at the end instead (:func:`final_texts`).

:class:`CompletionOutput` and :class:`RequestOutput` are what ``LLM.generate`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from yaie.engine.request import Request
from yaie.engine.sampling import SamplingParams, noise_key
from yaie.model.tokenizer import StreamDecoder, Tokenizer


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


class OutputState:
    """One request's sampler and text: stop ids, stop strings (text is held back until it cannot start one).

    Args:
        params: the request's sampling parameters.
        tokenizer: decodes its tokens.
        eos_token_ids: the model's end-of-sequence ids (a stop unless ``params.ignore_eos``).
        streams: whether its text is wanted piece by piece (else only :attr:`final_text` is read).
    """

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, eos_token_ids: Iterable[int],
                 streams: bool = True):
        self.params = params
        self.streams = streams
        self.greedy = params.greedy        # read for every request at every step: found once
        self.key = 0 if self.greedy else noise_key(params.seed)    # its random stream (a seed drawn now if none)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.decoder = StreamDecoder(tokenizer)
        self.pending: list[int] = []       # accepted, not decoded yet
        self.emitted = 0
        self.end: int | None = None
        self.finish_reason: str | None = None

    def accept(self, request: Request, token: int) -> bool:
        """Take a sampled token and decide whether the request ends (``finish_reason``). The text is left
        for :meth:`piece` (decoded while the device runs the next step), except for a request with stop
        strings, whose end depends on its text. Returns whether the token joined the request's output (a
        stop id does not)."""
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return False
        request.output_ids.append(token)
        self.pending.append(token)
        if self.params.stop:
            self._decode()
            self.end = find_stop(self.decoder.text, self.params.stop, max(0, self.emitted - self.hold))
            if self.end is not None:
                self.finish_reason = "stop"
                return True
        if len(request.output_ids) >= request.max_new_tokens:
            self.finish_reason = "length"
        return True

    def piece(self) -> str:
        """The text that became final since the last call: all that is left once the request has ended, else
        all but the last characters that may start a stop string. ``""`` for a request that does not stream."""
        if not self.streams:
            return ""
        self._decode()
        if self.finish_reason is not None:
            text = self.final_text
            piece = text[self.emitted:]
            self.emitted = max(self.emitted, len(text))
            return piece
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

    @property
    def final_text(self) -> str:
        """The whole generated text, cut before a stop string."""
        return self._final_text(self.decoder.tokenizer.decode(self.pending) if self.decoded_at_once else None)

    @property
    def decoded_at_once(self) -> bool:
        """Whether the final text is one decode of all the tokens: nothing was decoded piece by piece
        (``generate`` reads the text only at the end)."""
        return bool(self.pending) and not self.decoder.ids

    def _final_text(self, whole: str | None) -> str:
        # ``whole``: the decode of all the tokens, when :attr:`decoded_at_once`. It is what the stream decoder's
        # pieces add up to, unless the text ends in an incomplete character (then the stream decoder holds it
        # back: decode as it does).
        if whole is not None and not whole.endswith("\ufffd"):
            return whole if self.end is None else whole[:self.end]
        self._decode()
        return self.decoder.text if self.end is None else self.decoder.text[:self.end]


def final_texts(states: list[OutputState], tokenizer: Tokenizer) -> list[str]:
    """:attr:`OutputState.final_text` of each of ``states`` (requests of one engine, decoded by ``tokenizer``),
    with the texts that are one decode of all their tokens decoded in a single batch call (the tokenizers library
    spreads it over threads): ``generate`` reads many requests' texts when they end together."""
    wholes = iter(tokenizer.decode_batch([state.pending for state in states if state.decoded_at_once]))
    return [state._final_text(next(wholes) if state.decoded_at_once else None) for state in states]


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]``, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
