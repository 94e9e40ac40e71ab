"""A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, plus the chat template.

Also reads, when present, ``tokenizer_config.json`` (special tokens, ``chat_template``) and
``chat_template.jinja``. :class:`StreamDecoder` turns generated ids into text piece by piece without
splitting a multi-byte character.
"""

from __future__ import annotations

import json
from pathlib import Path

from yaie.model.config import ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: tokenizer.json is missing (only tokenizers-library tokenizers are "
                                 "supported; save one with tokenizer.save_pretrained)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception with the parser's message
            raise ModelLoadError(f"{path}: cannot be read by the tokenizers library: {err}") from None
        self.settings = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template = self.settings.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _special_token(self, key: str) -> str | None:
        value = self.settings.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_without_the_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode`, letting go of Python's interpreter lock while the tokenizers library works (its
        ``encode`` holds it, its ``encode_batch`` does not): other threads run while a long text is encoded."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` of each id list, in one call: the tokenizers library decodes a batch on several
        threads, without Python's interpreter lock."""
        return self._tok.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's chat template (Jinja, as transformers does)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template (no chat_template in tokenizer_config.json "
                             "and no chat_template.jinja)")
        try:
            import jinja2
        except ImportError:
            raise ValueError("chat templates need the jinja2 package (pip install jinja2)") from None
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special_token("bos_token") or "", eos_token=self._special_token("eos_token") or "")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None


class StreamDecoder:
    """Incremental detokenisation: feed ids one at a time, get the new text each one completes.

    Decoding a token alone can be wrong (byte-level BPE splits characters across tokens; some
    tokenizers drop a leading space, or join words and punctuation), so each new token is decoded in a
    short window of the tokens before it, and what it adds to that window's text is the new text; text
    is held back while it ends in an incomplete character (U+FFFD). Decoding the whole text at every
    token instead costs O(length) per token: at batch 64, milliseconds of host time per engine step.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0     # ids[_prefix:_read] is the window of context, decoded already
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            if not after.startswith(before):      # the window decodes differently: decode it all, once
                return self._resync()
            return ""
        delta = after[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def _resync(self) -> str:
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        self._prefix = self._read = len(self.ids)
        return delta
