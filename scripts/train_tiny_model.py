"""Train the bundled tiny model (yaie/assets/tiny-stories/) from nothing: corpus, tokenizer, weights.

    python scripts/train_tiny_model.py --out DIR [--steps 3000] [--device cuda]

Steps, all seeded:

1. the corpus: 120,000 template stories (``scripts/make_corpus.py``, seed 0); the held-out set is
   drawn with seed 1, so no held-out story is a training story except by chance;
2. a byte-level BPE tokenizer (``tokenizers``), 1024 entries at most, with ``<s>`` (prepended by the
   tokenizer) and ``</s>`` (ends every story; the engine stops on it);
3. a Llama-architecture model, written here in plain PyTorch (6 layers, hidden 256, rotate-half RoPE,
   RMSNorm, grouped-query attention with 8 query heads and 2 KV heads, SwiGLU MLP, tied embeddings;
   4.2M parameters), trained with AdamW on packed 256-token windows;
4. export in the Hugging Face format (``config.json``, ``model.safetensors`` in bfloat16,
   ``tokenizer.json``, ``generation_config.json``) plus ``train_log.json`` (losses, time, device).

The held-out loss printed at the end is computed exactly as ``tests/test_engine_bundled.py`` does
(the first 48 held-out stories, bfloat16 weights, float32 math), which checks it stays under a bound.

Where and how long: the committed model was trained with the defaults on one NVIDIA H200 (PyTorch 2.11,
lent GPU, 2026-11-21, via ``scripts/gpu_engine_run.sh``): 5.2 s for corpus and tokenizer, 88.5 s for
6000 steps, 98 s for the whole script; held-out loss 0.1621 on the test's 48 stories (0.1646 on 500).
The log is ``yaie/assets/tiny-stories/train_log.json`` (and ``train_output.txt``, the printed output).
On a CPU it is far slower (about 0.35 s per step at ``--batch 8`` on a busy 2-core machine; the
default batch is 128), so train on a GPU.
Bitwise-identical weights need the same GPU and software (cuBLAS may pick other kernels elsewhere); the
corpus and the tokenizer are identical everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # the repository (solutions/), for --attention telescoping
from make_corpus import make_stories  # noqa: E402

BOS, EOS = "<s>", "</s>"
HELD_OUT_SEED = 1
HELD_OUT_TEST_STORIES = 48

BASED_LAYERS = [0, 2, 4]    # --attention based: these layers are Based linear attention, the others windowed
MODEL_CONFIG = dict(
    hidden_size=256, intermediate_size=640, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=True,
)


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(stories: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stories, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Encoding a prompt prepends <s>, as Llama tokenizers do; the engine and HF see the same ids.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return tok


def encode_stories(tok, stories: list[str]) -> list[list[int]]:
    """Each story as ``<s> story </s>`` token ids."""
    eos_id = tok.token_to_id(EOS)
    return [enc.ids + [eos_id] for enc in tok.encode_batch(stories)]


# ----------------------------------------------------------------------------- model (training only)
def rope_tables(seq_len: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: both halves use frequency i
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, c: dict, index: int = 0):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.n_heads, self.n_kv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        self.telescoping = c.get("telescoping_capacity")   # --attention telescoping (lesson 07)
        # --attention based (lesson 08): Based linear attention in c["based_layers"], a sliding window elsewhere
        self.based = index in c.get("based_layers", [])
        self.window = c.get("sliding_window") if c.get("based_layers") and not self.based else None
        self.input_layernorm = nn.RMSNorm(h, eps=c["rms_norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c["rms_norm_eps"])
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        if self.based:   # q, k of based_feature_dim per head; one value head per query head
            self.feat = c["based_feature_dim"]
            self.q_proj = nn.Linear(h, self.n_heads * self.feat, bias=False)
            self.k_proj = nn.Linear(h, self.n_heads * self.feat, bias=False)
            self.v_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(h, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        if self.based:
            x = x + self.o_proj(self.based_attention(y).transpose(1, 2).reshape(b, t, -1))
            y = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        q = self.q_proj(y).view(b, t, self.n_heads, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.n_kv, self.d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = self.n_heads // self.n_kv
        if self.telescoping:   # every position attends to its telescoping cache (lesson 07's kernels on a GPU)
            from solutions.kernels.telescoping import telescoping_attention
            # RoPE's float32 tables promote q and k under autocast; the kernels take one dtype (v's: bf16 there).
            q, k = q.to(v.dtype), k.to(v.dtype)
            att = telescoping_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.telescoping,
                                        use_kernels=q.is_cuda).transpose(1, 2)
        elif self.window:   # exact attention over the last `window` tokens
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            pos = torch.arange(t, device=x.device)
            seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


    def based_attention(self, y):
        """Based linear attention in the quadratic form (differentiable; float32): w = 1 + s + s^2/2,
        s = q.k / sqrt(feature_dim), j <= i, normalised by the sum of the weights. [b, heads, t, d]."""
        b, t, _ = y.shape
        q = self.q_proj(y).view(b, t, self.n_heads, self.feat).transpose(1, 2).float()
        k = self.k_proj(y).view(b, t, self.n_heads, self.feat).transpose(1, 2).float()
        v = self.v_proj(y).view(b, t, self.n_heads, self.d).transpose(1, 2).float()
        with torch.autocast(y.device.type, enabled=False):   # sums of many positive weights: float32
            s = q @ k.transpose(-1, -2) / math.sqrt(self.feat)
            w = (1 + s + 0.5 * s * s).tril()
            out = (w @ v) / w.sum(-1, keepdim=True)
        return out.to(y.dtype)


class TinyLlama(nn.Module):
    def __init__(self, c: dict, vocab_size: int):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(vocab_size, c["hidden_size"])
        self.layers = nn.ModuleList(Block(c, n) for n in range(c["num_hidden_layers"]))
        self.norm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c["num_hidden_layers"]) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(ids.shape[1], self.c["head_dim"], self.c["rope_theta"], ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.embed_tokens.weight.T  # tied output head

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under the Hugging Face Llama names, bfloat16 (``lm_head`` omitted: it is tied)."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            for name in ("input_layernorm", "post_attention_layernorm"):
                out[pre + name + ".weight"] = getattr(layer, name).weight
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[pre + "self_attn." + name + ".weight"] = getattr(layer, name).weight
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[pre + "mlp." + name + ".weight"] = getattr(layer, name).weight
        return {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in out.items()}


# ----------------------------------------------------------------------------- training
def packed_windows(seqs: list[list[int]], window: int) -> torch.Tensor:
    """All stories end to end, cut into rows of ``window + 1`` tokens (inputs and shifted targets)."""
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    rows = flat.numel() // (window + 1)
    return flat[: rows * (window + 1)].view(rows, window + 1)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


@torch.no_grad()
def held_out_loss(model: TinyLlama, seqs: list[list[int]], device) -> float:
    """Mean next-token loss over the held-out stories, one story at a time, float32 math."""
    total, count = 0.0, 0
    for s in seqs:
        ids = torch.tensor(s, device=device)[None]
        logits = model(ids[:, :-1]).float()
        total += F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


def train(args) -> None:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stories = make_stories(args.stories, seed=args.seed)
    held_out = make_stories(max(args.held_out, HELD_OUT_TEST_STORIES), seed=HELD_OUT_SEED)
    tok = train_tokenizer(stories, args.vocab)
    vocab = -(-tok.get_vocab_size() // 64) * 64  # round the embedding up to a multiple of 64
    train_rows = packed_windows(encode_stories(tok, stories), args.window)
    held_seqs = encode_stories(tok, held_out)
    t_data = time.time() - t0
    print(f"data: {len(stories)} stories, {train_rows.numel()} tokens, tokenizer {tok.get_vocab_size()} "
          f"entries (embedding {vocab}), {t_data:.1f}s", flush=True)

    config = dict(MODEL_CONFIG)
    if args.attention == "telescoping":   # constant-size caches: the engine may generate far past the window
        config.update(telescoping_capacity=args.capacity, max_position_embeddings=32768)
    if args.attention == "based":   # constant-size state and window: the engine may generate far past the window
        config.update(based_layers=BASED_LAYERS, based_feature_dim=16, sliding_window=args.based_window,
                      max_position_embeddings=32768)
    model = TinyLlama(config, vocab).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    t1 = time.time()
    for step in range(args.steps):
        batch = train_rows[torch.randint(len(train_rows), (args.batch,), generator=gen)].to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            losses.append((step, round(loss.item(), 4)))
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t1:.1f}s", flush=True)
    t_train = time.time() - t1

    # Evaluate what is shipped: bfloat16 weights, float32 math.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.float().eval()
    loss_test_set = held_out_loss(model, held_seqs[:HELD_OUT_TEST_STORIES], device)
    loss_all = held_out_loss(model, held_seqs, device)
    print(f"held-out loss: {loss_test_set:.4f} (first {HELD_OUT_TEST_STORIES} stories, as the test), "
          f"{loss_all:.4f} ({len(held_seqs)} stories)", flush=True)
    save(model, tok, vocab, out, dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        args=vars(args), parameters=n_params, data_seconds=round(t_data, 1), train_seconds=round(t_train, 1),
        total_seconds=round(time.time() - t0, 1), losses=losses,
        held_out_loss_test_set=round(loss_test_set, 4), held_out_loss_all=round(loss_all, 4)))
    check_with_transformers(model, out, held_seqs[0], device)
    sample(model, tok, device)


@torch.no_grad()
def check_with_transformers(model: TinyLlama, out: Path, ids: list[int], device) -> None:
    """The exported files, loaded by Hugging Face transformers, must give this model's logits."""
    if model.c.get("telescoping_capacity") or model.c.get("based_layers"):
        print("telescoping or Based attention: transformers has no such layer; export check skipped")
        return
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: export check skipped")
        return
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to(device).eval()
    x = torch.tensor(ids, device=device)[None]
    diff = (hf(x).logits.float() - model(x).float()).abs().max().item()
    print(f"export check: max |logits(transformers) - logits(training model)| = {diff:.2e}", flush=True)
    if diff > 1e-2:
        raise SystemExit("the exported checkpoint does not reproduce the training model")


def save(model: TinyLlama, tok, vocab: int, out: Path, log: dict) -> None:
    from safetensors.torch import save_file

    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_act="silu",
                  attention_bias=False, mlp_bias=False, bos_token_id=bos, eos_token_id=eos,
                  torch_dtype="bfloat16", **model.c)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        dict(bos_token_id=bos, eos_token_id=eos, do_sample=True, temperature=0.8, top_p=0.95), indent=2) + "\n")
    save_file(model.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")


@torch.no_grad()
def sample(model: TinyLlama, tok, device, prompt: str = "Once upon a time, there was a little cat named") -> None:
    ids = torch.tensor(tok.encode(prompt).ids, device=device)[None]
    for _ in range(120):
        nxt = model(ids)[0, -1].argmax()
        if nxt.item() == tok.token_to_id(EOS):
            break
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    print("greedy sample:", tok.decode(ids[0].tolist()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stories", type=int, default=120_000)
    p.add_argument("--held-out", type=int, default=500)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=["full", "telescoping", "based"], default="full",
                   help="full causal attention, telescoping caches of --capacity entries (lesson 07), or "
                        "Based linear attention beside sliding-window layers of --based-window tokens (lesson 08)")
    p.add_argument("--based-window", type=int, default=64, help="window of the non-Based layers of a Based model")
    p.add_argument("--capacity", type=int, default=64, help="entries per telescoping cache")
    train(p.parse_args())


if __name__ == "__main__":
    main()
