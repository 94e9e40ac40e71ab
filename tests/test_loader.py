"""Checkpoint loading: sharded checkpoints, and errors that name the file and the problem."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from yaie.engine import LLM, SamplingParams
from yaie.model import ModelLoadError, load_config
from yaie.model.loader import load_weights
from yaie.model.testing import fresh_seed, save_random_model, write_tokenizer

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("reference_lessons")


@pytest.fixture
def model_dir(tmp_path):
    save_random_model("llama", tmp_path, seed=fresh_seed())
    return tmp_path


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads(tmp_path):
    seed = fresh_seed()
    hf = save_random_model("qwen2", tmp_path / "one", seed=seed)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    write_tokenizer(tmp_path / "sharded", hf.config.vocab_size)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file() and len(shards) > 2, shards
    cfg = load_config(tmp_path / "one")
    whole = load_weights(tmp_path / "one", cfg)
    parts = load_weights(tmp_path / "sharded", cfg)
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    ids = [1] + torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert LLM(tmp_path / "sharded", device="cpu").generate([ids], params)[0].token_ids == \
        LLM(tmp_path / "one", device="cpu").generate([ids], params)[0].token_ids


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        LLM(model_dir, device="cpu")


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        LLM(tmp_path / "nowhere", device="cpu")


def test_unsupported_architecture(model_dir):
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture GPT2LMHeadModel"):
        LLM(model_dir, device="cpu")


def test_unsupported_rope_scaling(model_dir):
    edit_config(model_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        LLM(model_dir, device="cpu")


def test_shape_mismatch(model_dir):
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
                                             r"has shape \[128, 64\] but config\.json implies \[96, 64\]"):
        LLM(model_dir, device="cpu")


def test_missing_tensor(model_dir):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"):
        LLM(model_dir, device="cpu")


def test_untied_model_without_lm_head(model_dir):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head.weight' is missing .*tie_word_embeddings is false"):
        LLM(model_dir, device="cpu")


def test_missing_weights_and_missing_shard(model_dir, tmp_path):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        LLM(model_dir, device="cpu")
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"model-00001-of-00002\.safetensors: shard listed in "
                                             r"model\.safetensors\.index\.json .* is missing"):
        LLM(model_dir, device="cpu")


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is missing"):
        LLM(model_dir, device="cpu")


def test_chat_template_and_generation_config(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w3{% endif %}"}))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 5], "do_sample": True, "temperature": 0.7, "top_k": 20}))
    llm = LLM(model_dir, device="cpu")
    assert llm.eos_token_ids == [2, 5]
    params = llm.default_sampling_params(max_tokens=3)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, 3)
    out = llm.chat([{"role": "user", "content": "w7 w8"}], SamplingParams(max_tokens=4, temperature=0))
    assert out.prompt == "<s>w7 w8 w3"
    assert out.prompt_token_ids == [1, 7, 8, 3]
