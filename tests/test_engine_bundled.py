"""The bundled tiny-stories model: small, GQA, trained well (held-out loss bound), on topic."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.model.contiguous_cache import ContiguousKVCache
from yaie.model.testing import fresh_seed, single_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_corpus import make_stories

# Measured: 0.1621 by scripts/train_tiny_model.py on the GPU (train_log.json) and 0.1621 by this engine
# on the CPU, over the first 48 held-out stories (seed 1). The bound leaves 5% for other platforms' rounding.
HELD_OUT_STORIES = 48
HELD_OUT_LOSS_BOUND = 0.170


pytestmark = pytest.mark.usefixtures("reference_lessons")


@pytest.fixture(scope="module")
def llm():
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        return LLM(DEFAULT_MODEL, device="cpu")


def test_bundled_files_are_small_and_complete():
    names = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) <= 10 * 2**20


def test_bundled_model_uses_grouped_query_attention(llm):
    assert llm.config.model_type == "llama" and llm.config.num_kv_heads < llm.config.num_heads


def test_held_out_loss_under_bound(llm):
    total, count = 0.0, 0
    for story in make_stories(HELD_OUT_STORIES, seed=1):
        ids = llm.tokenizer.encode(story) + llm.eos_token_ids[:1]
        cache = ContiguousKVCache.for_model(llm.config, len(ids), llm.model.dtype, llm.device)
        hidden = llm.model.forward(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), cache)
        total += F.cross_entropy(llm.model.logits(hidden), torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    loss = total / count
    assert loss < HELD_OUT_LOSS_BOUND, f"held-out loss {loss:.4f} >= bound {HELD_OUT_LOSS_BOUND}"


def test_greedy_story_stays_on_topic(llm):
    prompt = "Once upon a time, there was a little cat named Mia. Mia had a red ball"
    text = llm.generate(prompt, SamplingParams(max_tokens=150, temperature=0))[0].text
    assert text.count("red ball") >= 2 and text.count("Mia") >= 2, text
    assert text.rstrip().endswith((".", "!", '"')), text  # the story ends (</s>) after a full sentence


def test_sampled_stories_keep_their_hero(llm):
    seed = fresh_seed()
    names = ["Tom", "Lucy", "Finn", "Rosa"]
    outs = llm.generate([f"One day, there was a small dog named {n}." for n in names],
                        SamplingParams(max_tokens=120, temperature=0.8, top_p=0.95, seed=seed))
    on_topic = sum(out.text.count(name) >= 2 for out, name in zip(outs, names))
    assert on_topic >= 3, f"seed={seed}: " + " | ".join(o.text for o in outs)
