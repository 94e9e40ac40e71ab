"""Incremental detokenisation (``StreamDecoder``): decoding each new token in a short window of context must
give the text of decoding everything at every token, for the bundled byte-level BPE tokenizer (characters
split across tokens, held back while incomplete) and the word-level one of the benchmarks (words joined
with spaces, punctuation cleanup), on random id streams that include special tokens."""

import random

import pytest

from yaie.engine import DEFAULT_MODEL
from yaie.engine.output import OutputState, final_texts
from yaie.engine.sampling import SamplingParams
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


def make_tokenizer(tmp_path, kind: str) -> Tokenizer:
    """The bundled byte-level BPE tokenizer, or a word-level one of 2000 words written to ``tmp_path``."""
    if kind == "byte-level":
        return Tokenizer(DEFAULT_MODEL)
    write_tokenizer(tmp_path, 2000)
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_windowed_decoding_equals_whole_text_decoding(tmp_path, kind):
    tokenizer = make_tokenizer(tmp_path, kind)
    seed = fresh_seed()
    rng = random.Random(seed)
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 50))]
        decoder = StreamDecoder(tokenizer)
        pieces = [decoder.push(t) for t in ids]
        want = whole_text_decoding(tokenizer, ids)
        assert decoder.text == want == "".join(pieces), f"seed {seed} (YAIE_SEED={seed}), ids {ids}"


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_final_texts_decoded_in_one_batch_are_each_requests_text(tmp_path, kind):
    """``generate`` reads the texts of the requests that ended in one batch decode (``final_texts``): each text is
    the whole-text reference of its ids, whether the request decoded nothing before (one decode of all its ids),
    part of them piece by piece, or ended in an incomplete character; a stop string's cut is kept."""
    tokenizer = make_tokenizer(tmp_path, kind)
    seed = fresh_seed()
    rng = random.Random(seed)
    states, wanted = [], []
    for i in range(24):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 50))]
        state = OutputState(SamplingParams(max_tokens=64), tokenizer, [], streams=False)
        split = rng.randint(0, len(ids)) if i % 3 == 0 else 0      # every third: some ids decoded piece by piece
        state.pending.extend(ids[:split])
        state._decode()
        state.pending.extend(ids[split:])
        want = whole_text_decoding(tokenizer, ids)
        if i % 4 == 1 and want:
            state.end = rng.randrange(len(want))                      # a stop string began here
            want = want[:state.end]
        states.append(state)
        wanted.append(want)
    got = final_texts(states, tokenizer)
    for i, (g, w) in enumerate(zip(got, wanted)):
        assert g == w, f"seed {seed} (YAIE_SEED={seed}), request {i}: expected {w!r}, got {g!r}"
    assert [state.final_text for state in states] == wanted
