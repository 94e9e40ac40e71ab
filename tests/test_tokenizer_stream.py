"""Incremental detokenisation (``StreamDecoder``): decoding each new token in a short window of context must
give the text of decoding everything at every token, for the bundled byte-level BPE tokenizer (characters
split across tokens, held back while incomplete) and the word-level one of the benchmarks (words joined
with spaces, punctuation cleanup), on random id streams that include special tokens."""

import random

import pytest

from yaie.engine import DEFAULT_MODEL
from yaie.model.testing import fresh_seed, write_tokenizer
from yaie.model.tokenizer import StreamDecoder, Tokenizer


def whole_text_decoding(tokenizer, ids):
    """The naive reference: decode all ids so far at every token; keep the last text not ending in U+FFFD."""
    text = ""
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n])
        if not full.endswith("\ufffd"):
            text = full
    return text


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_windowed_decoding_equals_whole_text_decoding(tmp_path, kind):
    if kind == "word-level":
        write_tokenizer(tmp_path, 2000)
        tokenizer = Tokenizer(tmp_path)
    else:
        tokenizer = Tokenizer(DEFAULT_MODEL)
    seed = fresh_seed()
    rng = random.Random(seed)
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 50))]
        decoder = StreamDecoder(tokenizer)
        pieces = [decoder.push(t) for t in ids]
        want = whole_text_decoding(tokenizer, ids)
        assert decoder.text == want == "".join(pieces), f"seed {seed} (YAIE_SEED={seed}), ids {ids}"
