"""The engine against Hugging Face transformers, token for token (greedy) and logit for logit.

Models: the bundled tiny-stories model, and randomly initialised tiny Llama (untied), Llama 3 (rope
scaling, tied embeddings), Qwen2 (bias on q/k/v) and Mistral (sliding window 8, shorter than the
sequences) written with ``save_pretrained``. Weights and prompts are fresh random draws each run;
a failure prints the seed (replay with ``YAIE_SEED=...``).
"""

import pytest
import torch

from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.model.contiguous_cache import ContiguousKVCache
from yaie.model.testing import fresh_seed, hf_greedy, save_random_model, single_thread

transformers = pytest.importorskip("transformers")

BUNDLED_PROMPTS = [
    "Once upon a time, there was a little fox named",
    "One day, Tom and Mia went to the park. Tom had a blue kite",
    "Lily was afraid of the dark.",
]


pytestmark = pytest.mark.usefixtures("reference_lessons")



def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    cache = ContiguousKVCache.for_model(llm.config, len(ids), llm.model.dtype, llm.device)
    hidden = llm.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    return llm.model.logits(hidden)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral"])
def test_random_model_matches_transformers(kind, tmp_path):
    seed = fresh_seed()
    hf = save_random_model(kind, tmp_path, seed=seed)
    llm = LLM(tmp_path, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    ids = [1] + torch.randint(3, llm.config.vocab_size, (int(torch.randint(8, 30, (1,), generator=gen)),),
                              generator=gen).tolist()
    # Prefill logits: every position, float32, against transformers' forward.
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits[0].float()
    got = engine_logits(llm, ids)
    assert torch.allclose(got, ref_logits, atol=2e-4, rtol=1e-4), \
        f"{kind} seed={seed}: max logit difference {(got - ref_logits).abs().max():.2e}"
    # Greedy generation: identical token ids (the engine stops at </s> = 2, as transformers does).
    want = hf_greedy(hf, ids, 24, [2])
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.token_ids == want, f"{kind} seed={seed}: engine {out.token_ids} vs transformers {want}"
    if kind == "mistral":
        assert len(ids) + len(want) > 8, "the sequence must be longer than the sliding window"


def test_sliding_window_matters(tmp_path):
    """Guard for the Mistral case above: without the window, the logits past it would differ."""
    seed = fresh_seed()
    save_random_model("mistral", tmp_path, seed=seed)
    llm = LLM(tmp_path, device="cpu")
    ids = [1] + torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
    windowed = engine_logits(llm, ids)
    for layer in llm.model.layers:
        layer.sliding_window = None
    full = engine_logits(llm, ids)
    assert torch.allclose(windowed[:8], full[:8], atol=1e-5), f"seed={seed}"
    assert not torch.allclose(windowed[8:], full[8:], atol=1e-3), f"seed={seed}"


@pytest.fixture(scope="module")
def bundled_pair():
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        llm = LLM(DEFAULT_MODEL, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    return llm, hf


@pytest.mark.parametrize("prompt", BUNDLED_PROMPTS)
def test_bundled_model_matches_transformers(bundled_pair, prompt):
    llm, hf = bundled_pair
    ids = llm.tokenizer.encode(prompt)
    want = hf_greedy(hf, ids, 48, llm.eos_token_ids)
    out = llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == want, f"engine {out.token_ids}\ntransformers {want}"
    assert out.text == llm.tokenizer.decode(want)
