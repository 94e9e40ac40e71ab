"""Serving Based models (lesson 08) in the engine: every sequence of a ``generate`` call decodes in the same
steps (:class:`yaie.model.based_rows.BasedRows`, through the engine core's row runner).

The reference is a float64 forward over the whole sequence written here from the weights: the Based
layers in the quadratic form, the window layers as exact softmax attention over the last ``window`` tokens
(RoPE computed from ``rope_theta``). A tiny random Based model (window 24: rings of three 8-token pages)
is saved once per module; prompts end before, at and past the window.
"""

from __future__ import annotations

import json

import pytest
import torch

from yaie.model.testing import fresh_seed

WINDOW = 24
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64,
              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, based_layers=[0, 2],
              based_feature_dim=16, sliding_window=WINDOW)
LENGTHS = (1, WINDOW - 1, WINDOW, WINDOW + 1, 3 * WINDOW + 5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Based model: config.json, weights of the shapes the loader expects, a word-level tokenizer."""
    from safetensors.torch import save_file

    from yaie.model.config import ModelConfig
    from yaie.model.loader import expected_shapes
    from yaie.model.testing import write_tokenizer

    path = tmp_path_factory.mktemp("tiny-based-random")
    (path / "config.json").write_text(json.dumps(CONFIG))
    gen = torch.Generator().manual_seed(8)
    weights = {}
    for name, shape in expected_shapes(ModelConfig.from_dict(CONFIG)).items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:          # wide weights spread the logits, so greedy choices are not near-ties
            weights[name] = 0.2 * torch.randn(shape, generator=gen)
    save_file(weights, str(path / "model.safetensors"))
    write_tokenizer(path, CONFIG["vocab_size"])
    return path


@pytest.fixture
def llm(model_dir, reference_lessons):
    from yaie.engine import LLM

    return LLM(model_dir, device="cpu")


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


# ---------------------------------------------------------------- the float64 reference

def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` of one forward over the whole sequence, in float64."""
    cfg = model.config
    n, d = len(ids), cfg.head_dim
    eps = cfg.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    def rope(x):                              # [n, heads, d], rotate-half layout
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + half * sin

    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    x = model.embed[torch.tensor(ids)].double()
    for layer_no, layer in enumerate(model.layers):
        h = norm(x, layer.input_norm)
        qkv = h @ layer.qkv.double().T
        heads = cfg.num_heads
        if layer_no in cfg.based_layers:      # 1 + s + s^2/2 over j <= i, normalised
            f = cfg.based_feature_dim
            q, k, v = qkv.split([heads * f, heads * f, heads * d], -1)
            q, k, v = (t.reshape(n, heads, -1).transpose(0, 1) for t in (q, k, v))
            s = q @ k.transpose(-1, -2) / f ** 0.5
            w = (1 + s + s * s / 2) * (j <= i)
            out = (w @ v) / w.sum(-1, keepdim=True)
        else:                                 # softmax over i - window < j <= i
            kv_heads = cfg.num_kv_heads
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
            q, k = rope(q.reshape(n, heads, d)), rope(k.reshape(n, kv_heads, d))
            v = v.reshape(n, kv_heads, d)
            group = heads // kv_heads
            q, k, v = q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0), \
                v.transpose(0, 1).repeat_interleave(group, 0)
            scores = (q @ k.transpose(-1, -2)) / d ** 0.5
            scores = scores.masked_fill(~((j <= i) & (j > i - WINDOW)), float("-inf"))
            out = scores.softmax(-1) @ v
        x = x + out.transpose(0, 1).reshape(n, -1) @ layer.o.double().T
        gate, up = (norm(x, layer.post_attention_norm) @ layer.gate_up.double().T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.down.double().T
    return norm(x, model.final_norm) @ model.lm_head.double().T


def _assert_greedy_like_reference(model, prompt: list[int], tokens: list[int], where: str) -> None:
    """Each generated token is the reference's argmax after the tokens before it (a token whose logit is
    within 1e-4 of the best counts: a float32 near-tie)."""
    logits = reference_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
    for step, (row, token) in enumerate(zip(logits, tokens)):
        best = int(row.argmax())
        assert row[token] >= row[best] - 1e-4, (
            f"{where}: generated token {step} is {token} (reference logit {float(row[token]):.5f}) but the "
            f"float64 reference picks {best} ({float(row[best]):.5f})")


# ---------------------------------------------------------------- the batched state, step by step

@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-buffer-buckets"])
def test_batched_decode_logits_equal_the_float64_reference(llm, static):
    """Rows prefilled with prompts of different lengths (before, at and past the window), then decoded
    together: every row's logits equal the reference's at its position, through a row moving down after
    another one leaves (``move``). ``static``: the CUDA graphs' bucket-padded fixed-buffer steps, run eagerly."""
    from yaie.model.based_rows import BasedRows

    seed = fresh_seed()
    model = llm.model
    slots = BasedRows(model, 5, graphs=static, capture=False)
    prompts = _prompts(seed)
    seqs = [list(p) for p in prompts]
    for row, prompt in enumerate(prompts):
        got = slots.prefill(row, prompt)
        torch.testing.assert_close(got.double(), reference_logits(model, prompt)[-1:], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"seed={seed}, prefill of row {row} ({len(prompt)} tokens): {m}")
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(WINDOW + 6):           # every ring wraps at least once
        if step == 5:                        # row 1 ends: the last row moves into its place
            slots.move(len(seqs) - 1, 1)
            seqs[1] = seqs.pop()
        fed = torch.randint(3, CONFIG["vocab_size"], (len(seqs),), generator=gen).tolist()
        for seq, token in zip(seqs, fed):
            seq.append(token)
        got = slots.decode(fed, [len(s) - 1 for s in seqs])
        assert got.shape == (len(seqs), CONFIG["vocab_size"])
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(
                got[row].double(), reference_logits(model, seq)[-1], atol=1e-4, rtol=1e-4,
                msg=lambda m: f"seed={seed}, decode step {step}, row {row} (position {len(seq) - 1}): {m}")


def test_a_prompt_prefilled_into_a_row_that_was_bucket_padding(llm):
    """Three rows decode in the bucket of 4 (its fourth row padding: context 0, the scratch pages), then a new
    prompt is prefilled into that fourth row and all four decode together: every row keeps the reference's
    logits, so a padding row's steps leave nothing behind in the row a later prompt takes."""
    from yaie.model.based_rows import BasedRows

    seed = fresh_seed()
    model = llm.model
    slots = BasedRows(model, 4, graphs=True, capture=False)
    prompts = _prompts(seed, (WINDOW + 3, 5, 2 * WINDOW))
    late = _prompts(seed + 7, (WINDOW - 2,))[0]
    seqs = [list(p) for p in prompts]
    for row, prompt in enumerate(prompts):
        slots.prefill(row, prompt)
    gen = torch.Generator().manual_seed(seed + 1)

    def step(where: str) -> None:
        fed = torch.randint(3, CONFIG["vocab_size"], (len(seqs),), generator=gen).tolist()
        for seq, token in zip(seqs, fed):
            seq.append(token)
        got = slots.decode(fed, [len(s) - 1 for s in seqs])
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(
                got[row].double(), reference_logits(model, seq)[-1], atol=1e-4, rtol=1e-4,
                msg=lambda m: f"seed={seed}, {where}, row {row} (position {len(seq) - 1}): {m}")

    for i in range(4):
        step(f"three rows in the bucket of 4, step {i}")
    got = slots.prefill(3, late)
    torch.testing.assert_close(got.double(), reference_logits(model, late)[-1:], atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"seed={seed}, prefill into the former padding row: {m}")
    seqs.append(list(late))
    for i in range(WINDOW + 2):              # the late row's ring wraps too
        step(f"four rows, step {i}")


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-buffer-buckets"])
def test_decode_next_equals_decode_with_the_tokens_one_position_further(llm, static):
    """A looked-ahead step (``decode_next``: token ids from the device, positions advanced in the input
    buffer) gives the logits of ``decode`` with the same tokens from the host; after a ``move`` it is
    refused (the rows changed), and ``decode`` works again."""
    from yaie.model.based_rows import BasedRows

    seed = fresh_seed()
    prompts = _prompts(seed, (WINDOW - 1, 4, 2 * WINDOW + 3))
    ahead = BasedRows(llm.model, 3, graphs=static, capture=False)
    plain = BasedRows(llm.model, 3, graphs=static, capture=False)
    for slots in (ahead, plain):
        for row, prompt in enumerate(prompts):
            slots.prefill(row, prompt)
    with pytest.raises(ValueError, match="prefill or move"):
        ahead.decode_next(torch.tensor([5, 6, 7]))
    gen = torch.Generator().manual_seed(seed)
    positions = [len(p) for p in prompts]
    fed = torch.randint(3, CONFIG["vocab_size"], (3,), generator=gen)
    ahead.decode(fed.tolist(), positions)
    plain.decode(fed.tolist(), positions)
    for step in range(WINDOW + 2):             # the rings wrap
        fed = torch.randint(3, CONFIG["vocab_size"], (3,), generator=gen)
        positions = [p + 1 for p in positions]
        want = plain.decode(fed.tolist(), positions).clone()
        got = ahead.decode_next(fed.clone())
        torch.testing.assert_close(got, want, atol=0, rtol=0,
                                   msg=lambda m: f"seed={seed}, looked-ahead step {step}: {m}")
    with pytest.raises(ValueError, match="one token per row"):
        ahead.decode_next(torch.tensor([5, 6]))
    ahead.move(2, 0)
    with pytest.raises(ValueError, match="prefill or move"):
        ahead.decode_next(torch.tensor([5, 6]))
    plain.move(2, 0)
    fed, positions = [9, 10], [positions[2] + 1, positions[1] + 1]
    torch.testing.assert_close(ahead.decode(fed, positions), plain.decode(fed, positions), atol=0, rtol=0)


def test_based_cache_prefill_decode_and_continuation_equal_the_reference(llm):
    """One sequence's :class:`BasedCache`: a prompt, single tokens, then a block of several tokens (the
    continuation path) give the reference's logits at every position."""
    from yaie.model.based_rows import BasedCache

    seed = fresh_seed()
    model = llm.model
    ids = _prompts(seed, [3 * WINDOW])[0]
    cache = BasedCache(model.config, "cpu")
    cuts = [WINDOW - 3, WINDOW - 2, WINDOW - 1, 2 * WINDOW + 1, 3 * WINDOW]
    start, got = 0, []
    for end in cuts:
        hidden = model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), cache)
        got.append(model.logits(hidden))
        start = end
    assert len(cache) == len(ids)
    torch.testing.assert_close(torch.cat(got).double(), reference_logits(model, ids), atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"seed={seed}: {m}")


# ---------------------------------------------------------------- the engine

def test_batched_generate_equals_one_at_a_time_and_the_reference(llm):
    from yaie.engine import SamplingParams

    seed = fresh_seed()
    prompts = _prompts(seed)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone, f"seed={seed}"
    for prompt, tokens in zip(prompts, together):
        assert len(tokens) == 8
        _assert_greedy_like_reference(llm.model, prompt, tokens, f"seed={seed}, prompt of {len(prompt)} tokens")


def test_per_request_params_and_rows_freed_as_requests_end(model_dir, reference_lessons):
    """Greedy and seeded sampling side by side, different lengths and stop ids, more prompts than rows
    (``max_num_seqs=2``: later prompts wait for a row): each request gets the tokens it gets alone."""
    from yaie.engine import LLM, SamplingParams

    seed = fresh_seed()
    llm = LLM(model_dir, device="cpu", max_num_seqs=2)
    prompts = _prompts(seed, (5, WINDOW + 2, 1, 2 * WINDOW, 9))
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=seed, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.1, top_p=0.9, seed=seed + 1, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    stop = alone[4].token_ids[4]                       # request 4 stops at its fifth token
    params[4] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    together = llm.generate(prompts, params)
    for i, (got, want) in enumerate(zip(together, alone)):
        expected = want.token_ids if i != 4 else want.token_ids[:want.token_ids.index(stop)]
        assert got.token_ids == expected, f"seed={seed}, request {i}"
    assert [o.outputs[0].finish_reason for o in together] == ["length"] * 4 + ["stop"]
    assert llm.last_core.runner.capacity == 2


def _run_batched(llm, prompts, params, capacity: int, static: bool, look_ahead: bool,
                 capture: bool = False) -> tuple[dict, int]:
    """Run an engine core on rows of the test's own: ``{request id: (tokens, finish reason, text from the
    pieces)}`` and how many steps were looked ahead (``decode_next`` calls)."""
    from yaie.engine.core import EngineCore
    from yaie.engine.row_runner import RowRunner
    from yaie.engine.settings import EngineSettings

    settings = EngineSettings(max_num_seqs=capacity, cuda_graphs=static, graph_capture=capture)
    settings.resolve(llm.config, llm.model.dtype, llm.device, llm.num_parameters())
    runner = RowRunner(llm.model, settings, capacity)
    calls = {"decode_next": 0}
    decode_next = runner.rows.decode_next

    def counted(tokens):
        calls["decode_next"] += 1
        return decode_next(tokens)

    runner.rows.decode_next = counted
    core = EngineCore(runner, llm.tokenizer, llm.eos_token_ids)
    if not look_ahead:
        core._look_ahead = lambda pending: None
    requests = [core.add(ids, p) for ids, p in zip(prompts, params)]
    events = []
    while core.has_unfinished():
        events += core.step()
    events += core.flush()
    out = {}
    for request in requests:
        mine = [e for e in events if e.request is request]
        out[request.request_id] = (list(request.output_ids), mine[-1].finish_reason, "".join(e.text for e in mine))
    return out, calls["decode_next"]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-buffer-buckets"])
def test_look_ahead_gives_the_tokens_of_steps_read_one_at_a_time(llm, static, monkeypatch):
    """Greedy and seeded rows ending at different steps (by length, by a stop id, by a stop string; some
    while a looked-ahead step already runs with them, which is then dropped): the looked-ahead loop gives
    every request the tokens, finish reason and text of the loop that reads each step before the next,
    with all prompts in rows at once and with prompts waiting for a row."""
    from yaie.engine import SamplingParams
    from yaie.engine.launched_step import LaunchedStep as _Launched

    seed = fresh_seed()
    prompts = _prompts(seed, (5, WINDOW + 2, 1, 2 * WINDOW, 9, WINDOW))
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.9, top_k=20, seed=seed, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=1.1, top_p=0.9, seed=seed + 1, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=seed + 2, ignore_eos=True)]
    first, _ = _run_batched(llm, prompts, params, 6, static, look_ahead=False)
    # Request 4 stops at a stop id (its sixth token), request 5 at a stop string (its seventh token's word).
    stop_id = first[4][0][5]
    params[4] = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    params[5] = SamplingParams(max_tokens=16, temperature=0.8, seed=seed + 2, ignore_eos=True,
                               stop=[f"w{first[5][0][6]}"])
    dropped = []
    drop = _Launched.drop
    monkeypatch.setattr(_Launched, "drop", lambda self, r: dropped.append(r.request_id) or drop(self, r))
    for capacity in (6, 2):
        want, none = _run_batched(llm, prompts, params, capacity, static, look_ahead=False)
        got, ahead = _run_batched(llm, prompts, params, capacity, static, look_ahead=True)
        assert none == 0
        assert sorted(want) == list(range(len(prompts)))
        for i in range(len(prompts)):
            assert got[i] == want[i], (f"seed={seed}, {capacity} rows, request {i}: looked ahead got (tokens, finish, text) "
                                       f"{got[i]}, read step by step {want[i]}")
        assert want[4][1] == "stop" and want[5][1] == "stop", f"seed={seed}: {want[4][1:3]}, {want[5][1:3]}"
        assert ahead > 0, f"seed={seed}, {capacity} rows: no step was looked ahead"
    assert dropped, f"seed={seed}: no request ended while a looked-ahead step ran with it (the test misses that case)"


def test_memory_per_sequence_is_constant_and_as_computed(llm):
    from yaie.engine import SamplingParams

    cfg = llm.config
    sizes = []
    for prompt_len in (WINDOW + 1, 6 * WINDOW):
        ids = [3 + i % 90 for i in range(prompt_len)]
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        sizes.append(llm.state_bytes_per_sequence())
    states = len(cfg.based_layers) * cfg.num_heads * 273 * (cfg.head_dim + 1) * 4
    rings = (cfg.num_layers - len(cfg.based_layers)) * 2 * WINDOW * cfg.num_kv_heads * cfg.head_dim * 4
    assert sizes == [states + rings] * 2


def test_stream_and_a_kept_batch_of_rows(llm):
    """``stream`` yields the text ``generate`` gives; a second call reuses the rows of the first."""
    from yaie.engine import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = "w5 w6 w7 w8"
    text = "".join(llm.stream(prompt, params))
    runner = llm.last_core.runner
    assert text == llm.generate(prompt, params)[0].text
    assert llm.last_core.runner is runner and not runner.in_use


def test_bad_input_gets_a_value_error_and_corrupts_nothing(llm):
    from yaie.engine import SamplingParams
    from yaie.model.based_rows import BasedRows

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = llm.generate([[5, 6, 7]], params)[0].token_ids
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5, 6, 7], [4] * CONFIG["max_position_embeddings"]], params)
    with pytest.raises(ValueError, match="capacity"):
        BasedRows(llm.model, 0)
    with pytest.raises(ValueError, match="CUDA"):
        BasedRows(llm.model, 2, graphs=True)
    slots = BasedRows(llm.model, 2, graphs=False)
    with pytest.raises(ValueError, match="rows"):
        slots.decode([5, 6, 7], [0, 0, 0])
    with pytest.raises(ValueError, match="row 2"):
        slots.prefill(2, [5, 6])
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == before


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_tokens_and_the_cpu_logits(model_dir, reference_lessons):
    """On CUDA (lessons 04, 06, 08 kernels): batched decode replayed from graphs gives the tokens of the
    eager steps and of one sequence at a time; the kernels' logits match the PyTorch path's."""
    from yaie.engine import LLM, SamplingParams
    from yaie.model.based_rows import BasedRows

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = fresh_seed()
    prompts = _prompts(seed, LENGTHS + (7, 40, 90))     # 8: every step runs a whole bucket, graphed or not
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    graphed = LLM(model_dir, device="cuda", dtype=torch.float32)
    eager = LLM(model_dir, device="cuda", dtype=torch.float32, cuda_graphs=False)
    together = [o.token_ids for o in graphed.generate(prompts, params)]
    assert graphed.last_core.runner.rows.graphs and graphed.last_core.runner.rows.failed is None
    assert together == [o.token_ids for o in eager.generate(prompts, params)], f"seed={seed}"
    assert together == [graphed.generate([p], params)[0].token_ids for p in prompts], f"seed={seed}"
    kernels = BasedRows(graphed.model, len(prompts), use_kernels=True, graphs=False)
    plain = BasedRows(graphed.model, len(prompts), use_kernels=False, graphs=False)
    for slots in (kernels, plain):
        for row, p in enumerate(prompts):
            slots.prefill(row, p)
    fed = [7] * len(prompts)
    for step in range(WINDOW + 3):
        positions = [len(p) + step for p in prompts]
        torch.testing.assert_close(kernels.decode(fed, positions), plain.decode(fed, positions), atol=2e-3,
                                   rtol=2e-3, msg=lambda m: f"seed={seed}, step {step}: {m}")



@pytest.mark.gpu
def test_bundled_model_in_bf16_graphs_give_the_eager_tokens(reference_lessons):
    """The bundled tiny Based model as served (bf16, CUDA graphs): 8 sequences decoding together pick the
    tokens of the same steps run eagerly."""
    from pathlib import Path

    from yaie.engine import LLM, SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = fresh_seed()
    model = Path(__file__).resolve().parents[1] / "yaie" / "assets" / "tiny-based"
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (1, 63, 64, 65, 200, 700, 2100, 5000)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    graphed = LLM(model, device="cuda")
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert graphed.last_core.runner.rows.graphs and graphed.last_core.runner.rows.failed is None
    want = [o.token_ids for o in LLM(model, device="cuda", cuda_graphs=False).generate(prompts, params)]
    assert got == want, f"seed={seed}"


@pytest.mark.gpu
def test_look_ahead_replayed_from_cuda_graphs_gives_the_tokens_of_steps_read_one_at_a_time(model_dir,
                                                                                            reference_lessons,
                                                                                            monkeypatch):
    """On CUDA, steps replayed from recorded graphs and launched before the last step's tokens are read:
    greedy and seeded rows ending at different steps (some while a looked-ahead step runs with them) get
    the tokens of the loop that reads every step first."""
    from yaie.engine import LLM, SamplingParams
    from yaie.engine.launched_step import LaunchedStep as _Launched

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = fresh_seed()
    llm = LLM(model_dir, device="cuda", dtype=torch.float32)
    prompts = _prompts(seed, LENGTHS + (7, 40, 90))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 20, 40)] + [
        SamplingParams(max_tokens=n, temperature=0.9, top_k=20, top_p=0.95, seed=seed + n, ignore_eos=True)
        for n in (5, 12, 30, 40)]
    want, none = _run_batched(llm, prompts, params, 8, True, look_ahead=False, capture=True)
    dropped = []
    drop = _Launched.drop
    monkeypatch.setattr(_Launched, "drop", lambda self, r: dropped.append(r.request_id) or drop(self, r))
    got, ahead = _run_batched(llm, prompts, params, 8, True, look_ahead=True, capture=True)
    assert none == 0 and ahead > 0
    assert dropped, f"seed={seed}: no request ended while a looked-ahead step ran with it (the test misses that case)"
    for i in range(len(prompts)):
        assert got[i] == want[i], f"seed={seed}, request {i}: looked ahead {got[i]}, read step by step {want[i]}"
