"""Prompts checked and turned into token ids, before any work: a bad prompt fails alone, with a clear error."""

from __future__ import annotations

from numbers import Integral
from typing import Sequence


def _rule(config) -> str:
    return f"a prompt is a non-empty string or a non-empty list of token ids (ints in [0, {config.vocab_size}))"


def is_token_id(value) -> bool:
    """An int (Python's or numpy's), not a bool and not a float."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_token_ids(prompt_ids: Sequence[int], config) -> list[int]:
    """``prompt_ids`` as a list of ints, checked: ints in ``[0, vocab_size)``, at least one, and shorter than
    the context (``max_position_embeddings``). ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(prompt_ids, (list, tuple)) or not _all_token_ids(prompt_ids):
        shown = repr(prompt_ids) if len(repr(prompt_ids)) <= 60 else repr(prompt_ids)[:60] + "..."
        raise ValueError(f"{_rule(config)}; got {type(prompt_ids).__name__} {shown}")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError(f"the prompt is empty (no tokens); {_rule(config)}")
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must lie in [0, {config.vocab_size}), got {bad[:5]}")
    context = config.max_position_embeddings
    if len(ids) >= context:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {context} tokens "
                         "(max_position_embeddings); shorten it")
    return ids


def to_token_ids(prompt: str | Sequence[int], tokenizer, config) -> tuple[str | None, list[int]]:
    """``(text or None, checked token ids)`` of a prompt: a string is tokenized, a list of ids is checked."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"the prompt is an empty string; {_rule(config)}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:     # a lone surrogate such as "\ud800": no text to tokenize
            raise ValueError(f"the prompt is not valid Unicode text ({err.reason} at character {err.start}); "
                             f"{_rule(config)}") from None
        return prompt, check_token_ids(tokenizer.encode(prompt), config)
    return None, check_token_ids(prompt, config)


def _all_token_ids(values) -> bool:
    """Every value passes :func:`is_token_id`; plain Python ints (the usual case) are checked in one pass."""
    return set(map(type, values)) <= {int} or all(is_token_id(t) for t in values)
