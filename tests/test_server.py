"""The OpenAI-compatible server, through the real ``openai`` client against a live uvicorn on 127.0.0.1.

One server (the bundled model, a KV cache smaller than 32 requests need, so they preempt each other) runs
in a thread for the whole module; the answers are compared with ``LLM.generate`` on an engine of its own
with the same seeds. Every client loop is bounded (timeouts), and the server is shut down at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from tests.helpers import fail_once
from yaie import ops
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.model.testing import fresh_seed, single_thread
import yaie.server.app as server_app
from yaie.server import create_app
from yaie.server.app import parse_prometheus

BLOCK_SIZE, NUM_BLOCKS = 16, 24          # 384 tokens: less than one full context (512) and than 32 requests need
MODEL = DEFAULT_MODEL.name
NAMES = ["Tom", "Lucy", "Finn", "Rosa", "Mia", "Sam", "Ben", "Ella"]
KINDS = ["dog", "cat", "bird", "fox"]
STREAMS = 32


class LiveServer:
    """uvicorn serving ``app`` on a free loopback port, in a thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not shut down in 15 s"


@pytest.fixture(scope="module")
def live():
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        ops.reset_auto_fallback()
        llm = LLM(DEFAULT_MODEL, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
        with LiveServer(create_app(llm)) as server:
            yield server
        ops.reset_auto_fallback()


@pytest.fixture(scope="module")
def reference():
    """An engine of its own, same cache settings, for the answers ``LLM.generate`` gives."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YAIE_SOLUTIONS", "all")
        return LLM(DEFAULT_MODEL, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=30, max_retries=0) as c:
        yield c


def metrics(live) -> dict[str, float]:
    return parse_prometheus(httpx.get(live.url + "/metrics", timeout=10).text)


def wait_idle(live, seconds: float = 10.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(live)
        if m["yaie_requests_running"] == m["yaie_requests_waiting"] == m["yaie_requests_swapped"] == 0:
            return m
        assert time.monotonic() < deadline, f"the engine is still busy after {seconds} s: {m}"
        time.sleep(0.05)


def defaults(reference, **overrides) -> SamplingParams:
    """What the server samples with: the model's defaults (generation_config.json: top_p 0.95), then the
    request's fields, as ``LLM.default_sampling_params`` makes them."""
    return reference.default_sampling_params(**overrides)


def generate(reference, prompts, params):
    with single_thread():
        return reference.generate(prompts, params)


# ----------------------------------------------------------------------------- the plain endpoints
def test_models_health_and_metrics(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(live.url + "/health", timeout=10).json() == {"status": "ok"}
    m = metrics(live)
    assert m["yaie_kv_cache_blocks_total"] == NUM_BLOCKS
    for name in ("yaie_requests_running", "yaie_requests_waiting", "yaie_kv_cache_usage",
                 "yaie_generation_tokens_per_second"):
        assert name in m, name


# ----------------------------------------------------------------------------- completions
def test_completion_equals_generate(client, reference):
    seed = fresh_seed()
    prompt = "Once upon a time, there was a little fox named"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.95,
                                    seed=seed, extra_body={"top_k": 50})
    want = generate(reference, prompt, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50,
                                                      seed=seed))[0]
    assert got.choices[0].text == want.text, f"seed={seed}"
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")


def test_completion_stream_equals_whole(client):
    seed = fresh_seed()
    kwargs = dict(model=MODEL, prompt="Lily was afraid of the dark.", max_tokens=16, temperature=0.8, seed=seed)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text, f"seed={seed}"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_n_and_token_prompts(client, reference):
    seed = fresh_seed()
    prompts = [[0, 340, 557, 15], [0, 301, 25, 17]]
    got = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=40, temperature=0.8, seed=seed,
                                    stop=["."])
    assert len(got.choices) == 4
    for choice in got.choices:
        p, j = divmod(choice.index, 2)
        want = generate(reference, [prompts[p]], defaults(reference, max_tokens=40, temperature=0.8, seed=seed + j,
                                                          stop=["."]))[0]
        assert choice.text == want.text and "." not in choice.text, f"seed={seed} choice {choice.index}"
        assert choice.finish_reason == want.outputs[0].finish_reason


def test_greedy_with_ignore_eos_runs_to_max_tokens(client, reference):
    got = client.completions.create(model=MODEL, prompt="The end.", max_tokens=30, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = generate(reference, "The end.", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 30


# ----------------------------------------------------------------------------- chat
def test_chat_whole_and_streamed(client, reference):
    seed = fresh_seed()
    messages = [{"role": "user", "content": "One day, there was a small dog named Finn."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.8,
                                           seed=seed)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    # The bundled model has no chat template: the messages' texts are the prompt, one per line.
    want = generate(reference, messages[0]["content"], defaults(reference, max_tokens=16, temperature=0.8,
                                                                seed=seed))[0]
    assert whole.choices[0].message.content == want.text, f"seed={seed}"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.8,
                                                 seed=seed, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


# ----------------------------------------------------------------------------- the engine loop, step by step
def test_step_engine_looks_ahead_with_arrivals_and_aborts(reference_lessons, monkeypatch):
    """The server's engine launches the next greedy decode step before reading this one's tokens, as
    ``LLM.generate`` does (CUDA graphs' fixed-buffer steps, run eagerly here): requests that arrive, leave
    and end meanwhile get exactly ``LLM.generate``'s tokens, a request asking for logprobs gets them
    (looking ahead pauses for it), and every block comes back."""
    from yaie.engine.core import EngineCore as Engine
    from yaie.engine.cuda_graphs import SCRATCH_SEQ
    prompts = [f"One day, {name} the {kind} went to the park." for name, kind in zip(NAMES, KINDS * 2)][:5]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 9, 28, 12, 6)]
    params[1] = SamplingParams(max_tokens=20, temperature=0, stop=[" the"])
    plain = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256)
    want = plain.generate(prompts, params)
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256)
    llm.settings.cuda_graphs = True
    llm.settings.graph_capture = False
    ahead = []
    real = Engine._look_ahead
    monkeypatch.setattr(Engine, "_look_ahead", lambda self, *a: ahead.append(real(self, *a)) or ahead[-1])
    engine = llm.open_core()
    ids = [llm.tokenizer.encode(p) for p in prompts]
    requests, events, scored = {}, [], []
    for i in range(3):
        requests[i] = engine.add(ids[i], params[i])
    aborted_at = None
    for step in range(60):
        if step == 6:                   # arrives while a looked-ahead step runs
            assert engine._pending is not None, "no looked-ahead step in flight"
            requests[3] = engine.add(ids[3], params[3])
        if step >= 8 and aborted_at is None and engine._pending is not None:
            assert engine.abort(requests[2].request_id)         # leaves while a looked-ahead step runs
            aborted_at = step
        if step == 12:                  # wants logprobs: looking ahead pauses while it runs
            requests[4] = engine.add(ids[4], params[4], logprobs=2)
        if not engine.has_unfinished():
            break
        events += engine.step()
        if 4 in requests:
            scored += engine.take_logprobs(requests[4].request_id) or []
    events += engine.flush()
    scored += engine.take_logprobs(requests[4].request_id) or []
    texts = {i: "".join(event.text for event in events if event.request is request) for i, request in requests.items()}
    for i in (0, 1, 3, 4):
        assert requests[i].output_ids == want[i].token_ids, f"request {i}"
        assert texts[i] == want[i].text, f"request {i}"
    assert aborted_at is not None and len(requests[2].output_ids) < len(want[2].token_ids)
    assert [token for token, _, _ in scored] == want[4].token_ids
    assert sum(a is not None for a in ahead) >= 5, f"decode steps looked ahead: {ahead}"
    engine.close()
    scheduler = engine.scheduler
    cached = scheduler.prefix_cache.tree.num_evictable_blocks
    assert set(scheduler.manager.seq_ids()) == {SCRATCH_SEQ}
    assert scheduler.manager.num_free_blocks + cached == scheduler.usable_blocks
    assert engine.requests == {} and engine.logprobs == {}


def graph_engine_llm() -> LLM:
    """An engine whose decode-only steps go through the CUDA-graph runner's fixed buffers (run eagerly on
    the CPU), so the server's engine sees what it sees on a GPU: decode steps apart from prefill steps."""
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256)
    llm.settings.cuda_graphs = True
    llm.settings.graph_capture = False
    return llm


def test_admission_window_gives_a_burst_one_prefill_step(reference_lessons):
    """Requests arriving 20 ms apart at an idle engine are held back until the burst is over and prefilled
    in one step; one cancelled while held never reaches the scheduler (counted as aborted); the texts are
    LLM.generate's and every block comes back. (Admitted at the next step instead, the first would run
    alone: at least two steps with prompts.)"""
    from yaie.engine.async_engine import AsyncEngine
    prompts = [f"One day, {name} the {kind} went to the park." for name, kind in zip(NAMES, KINDS)]
    params = [SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True) for i in range(4)]
    llm = graph_engine_llm()
    want = llm.generate(prompts, params)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    with pytest.raises(ValueError, match="admission window"):
        AsyncEngine(llm, window_s=-1.0)
    engine = AsyncEngine(llm, warm_up=False, window_s=10.0, gap_s=0.3)
    engine.start()
    try:
        async def one(i):
            await asyncio.sleep(0.02 * i)
            group = await engine.submit([(ids[i], params[i])])
            return "".join([event.text async for event in group.events()])

        async def cancelled():
            task = asyncio.create_task(engine.submit([(ids[0], params[0])]))
            await asyncio.sleep(0.05)
            assert not task.done(), "taken in before the burst was over"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        async def burst():
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4)), cancelled()), 60)

        texts = asyncio.run(burst())[:4]
        assert texts == [w.text for w in want]
        core, stats = engine.core, engine.stats
        assert core.prefill_steps == 1, f"{core.prefill_steps} steps fed prompts"
        assert stats.requests_finished == 4 and stats.requests_aborted == 1
        assert stats.prompt_tokens == sum(map(len, ids)) and core.requests == {}
    finally:
        engine.shutdown()
    cached = core.scheduler.prefix_cache.tree.num_evictable_blocks
    assert core.scheduler.num_free_blocks + cached == core.scheduler.usable_blocks


def test_admission_window_rules(reference_lessons):
    """When held arrivals go in (``AsyncEngine._admission_wait``): idle, once none has come for gap_s, or
    as long as a step with prompts takes while clients that just finished have not come back; beside
    running decodes, that step's cost shared out over running and held requests; at once when the prompts
    fill the step's budget or the next step launches eagerly anyway."""
    from yaie.engine.async_engine import AsyncEngine
    llm = graph_engine_llm()
    engine = AsyncEngine(llm, warm_up=False, window_s=1.0, gap_s=0.1)
    engine.core = llm.open_core()
    prompt = llm.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    class Group:            # what the window reads of a group: its items
        def __init__(self, count=1, length=len(prompt)):
            self.items = [(prompt[:1] * length, params)] * count

    def wait_after(groups, *, owed=0, step_s=None):
        engine._held, engine._held_tokens, engine._prefill_step_s = [], 0, step_s
        engine._owed.clear()
        engine._owed.extend([time.monotonic()] * owed)
        engine._hold(groups)
        return engine._admission_wait()

    assert engine._admission_wait() is None                                   # nothing held
    assert 0.05 < wait_after([Group()]) <= 0.1                                # idle: the gap
    engine._last_held_at -= 0.2
    assert engine._admission_wait() == 0
    assert 0.05 < wait_after([Group()], owed=1) <= 0.1                        # the one awaited came
    assert 0.9 < wait_after([Group()], owed=2) <= 1.0                         # one more awaited: the window
    assert 0.25 < wait_after([Group()], owed=2, step_s=0.2) <= 0.3            # ... or 1.5 prefill steps
    assert wait_after([Group(length=llm.settings.max_num_batched_tokens)]) == 0        # fills the step
    for _ in range(6):                                                        # 6 running, decoding
        engine.core.add(prompt, params)
    engine.core.step()
    assert not engine.core.next_step_is_eager()
    assert 0.2 < wait_after([Group(2)], step_s=0.2) <= 0.3 * 6 / 8            # 1.5 steps, times 6 / (6 + 2)
    assert 0.05 < wait_after([Group(6)], step_s=0.2) <= 0.3 * 6 / 12
    engine.core.add(prompt, params)                                           # waits: the next step prefills
    assert engine.core.next_step_is_eager() and wait_after([Group()], step_s=0.2) == 0
    engine.core.close()


# ----------------------------------------------------------------------------- logprobs
@pytest.fixture(scope="module")
def hf_model():
    """The bundled model through transformers: an independent computation of its log-probabilities."""
    transformers = pytest.importorskip("transformers")
    import torch
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()


def test_completion_logprobs_are_the_models(client, reference, hf_model):
    import torch
    prompt = "Once upon a time, there was a little fox named"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    want = generate(reference, prompt, defaults(reference, max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert got.choices[0].text == want.text
    ids, start = want.prompt_token_ids + want.token_ids, len(want.prompt_token_ids)
    with torch.no_grad(), single_thread():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)[start - 1:-1]        # row j: the distribution of token j
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for j, token in enumerate(want.token_ids):
        where = f"token {j} ({token})"
        assert lp.tokens[j] == reference.tokenizer.decode([token], skip_special_tokens=False), where
        assert lp.token_logprobs[j] == pytest.approx(expected[j, token].item(), abs=1e-3), where
        top = lp.top_logprobs[j]                 # greedy: the chosen token is the most likely, one of the 3
        assert len(top) == 3 and top[lp.tokens[j]] == lp.token_logprobs[j], (where, top)
        assert sorted(top.values(), reverse=True) == pytest.approx(expected[j].topk(3).values.tolist(), abs=1e-3)
    offsets = [sum(len(t) for t in lp.tokens[:j]) for j in range(8)]
    assert lp.text_offset == offsets


def test_logprobs_streamed_equal_whole_and_chat(client):
    seed = fresh_seed()
    kwargs = dict(model=MODEL, prompt="Lily was afraid of the dark.", max_tokens=10, temperature=0.8, seed=seed,
                  logprobs=2)
    whole = client.completions.create(**kwargs)
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens, f"seed={seed}"
    assert [t for p in parts for t in p.tokens] == lp.tokens, f"seed={seed}"
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [x for p in parts for x in p.text_offset] == lp.text_offset
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)

    messages = [{"role": "user", "content": "Tom had a red kite."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert item.bytes == list(item.token.encode()) and len(item.top_logprobs) == 2
        assert item.logprob == item.top_logprobs[0].logprob      # greedy: the most likely token
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [i.token for p in streamed for i in p.content] == [i.token for i in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_chat_without_max_tokens_is_bounded_by_the_cache(client):
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tom ran."}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == NUM_BLOCKS * BLOCK_SIZE + 1     # the last token is never cached


# ----------------------------------------------------------------------------- concurrency
def concurrent_streams(live, model: str, prompts: list, params: list[dict], timeout: float = 45) -> list:
    """Stream one completion per prompt, all at once (one asyncio client): ``[(text, finish_reason)]``."""
    async def one(client, prompt, kwargs):
        stream = await client.completions.create(model=model, prompt=prompt, stream=True, **kwargs)
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def all_streams():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", timeout=30, max_retries=0) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, k) for p, k in zip(prompts, params))),
                                          timeout=timeout)

    return asyncio.run(all_streams())


def test_concurrent_streams_equal_generate(live, reference):
    """32 streams at once through a cache that holds about 12 of them: all finish, each as LLM.generate."""
    base = fresh_seed()
    prompts = [f"One day, {NAMES[i % 8]} the {KINDS[i // 8]} went to the park." for i in range(STREAMS)]
    params = [defaults(reference, max_tokens=8, temperature=0.8, seed=base + i) for i in range(STREAMS)]
    want = generate(reference, prompts, params)
    before = metrics(live)

    got = concurrent_streams(live, MODEL, prompts, [dict(max_tokens=8, temperature=0.8, seed=base + i)
                                                    for i in range(STREAMS)])
    for i, ((text, finish), w) in enumerate(zip(got, want)):
        assert text == w.text, f"seed={base + i}: stream {i} differs from LLM.generate:\n{text!r}\n{w.text!r}"
        assert finish == w.outputs[0].finish_reason
    after = wait_idle(live)
    assert after["yaie_requests_finished_total"] - before["yaie_requests_finished_total"] == STREAMS
    assert after["yaie_preemptions_total"] > before["yaie_preemptions_total"], "the cache was never short"
    assert after["yaie_kv_cache_blocks_used"] == 0


# ----------------------------------------------------------------------------- clients that leave
def test_dropped_stream_frees_its_blocks(live, client):
    before = metrics(live)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].finish_reason is None
    assert metrics(live)["yaie_kv_cache_blocks_used"] > 0
    stream.close()                                       # the client hangs up mid-stream
    after = wait_idle(live, seconds=5)
    assert after["yaie_kv_cache_blocks_used"] == 0
    assert after["yaie_requests_aborted_total"] == before["yaie_requests_aborted_total"] + 1
    assert after["yaie_generation_tokens_total"] - before["yaie_generation_tokens_total"] < 300
    core = live.app.state.engine.core
    cached = core.scheduler.prefix_cache.tree.num_evictable_blocks     # earlier prompts, cached, unlocked
    assert core.requests == {} and core.scheduler.num_free_blocks + cached == core.scheduler.manager.num_blocks


def test_dropped_logprobs_stream_leaves_nothing_behind(live, client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, temperature=0,
                                       stream=True, logprobs=2, extra_body={"ignore_eos": True})
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].logprobs.token_logprobs
    stream.close()
    assert wait_idle(live, seconds=5)["yaie_kv_cache_blocks_used"] == 0
    core = live.app.state.engine.core
    assert core.requests == {} and core.logprobs == {}, core.logprobs


def test_dropped_plain_request_is_cancelled(live):
    before = metrics(live)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    after = wait_idle(live, seconds=5)
    assert after["yaie_requests_aborted_total"] == before["yaie_requests_aborted_total"] + 1
    assert after["yaie_kv_cache_blocks_used"] == 0


# ----------------------------------------------------------------------------- bad requests
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [3.5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [1]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5000]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(3, 603))}, 400, "prompt"),     # > the context
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 500}, 400, "max_tokens"),  # > the cache
    ("/v1/completions", {"model": MODEL, "prompt": list(range(3, 403))}, 400, "prompt"),     # > the cache, < context
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(), 400, "temperature"),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "top_p": NaN}' % MODEL.encode(), 400, "top_p"),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": Infinity}' % MODEL.encode(), 400,
     "temperature"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),   # nested too deep
    ("/v1/completions", b'{"model": "%s", "prompt": "hi \\ud800"}' % MODEL.encode(), 400, "prompt"),  # lone surrogate
    ("/v1/completions", b'{"model": "x\\udfff", "prompt": "hi"}', 400, "model"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
     % MODEL.encode(), 400, "messages[0].content"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 1}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": -3}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_an_openai_error(live, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(live.url + path, timeout=10, headers={"Content-Type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert isinstance(error["message"], str) and len(error["message"]) > 10 and error["code"]


def test_max_tokens_beyond_the_cache_says_what_fits(live, client):
    prompt = [0] + [340, 557, 15] * 100
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=500)
    allowed = NUM_BLOCKS * BLOCK_SIZE + 1 - len(prompt)
    assert f"max_tokens <= {allowed}" in err.value.message, err.value.message
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=allowed, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == allowed


def test_a_body_too_large_is_refused(live, monkeypatch):
    monkeypatch.setattr(server_app, "MAX_BODY_BYTES", 1000)
    body = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()

    def pieces():                          # no Content-Length: sent chunked
        yield from (body[i:i + 100] for i in range(0, len(body), 100))

    for content in (body, pieces()):
        response = httpx.post(live.url + "/v1/completions", content=content, timeout=10,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large"
    monkeypatch.undo()
    assert httpx.post(live.url + "/v1/completions", content=body, timeout=10).status_code == 400   # > context


def test_bad_requests_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=7)
    response = httpx.get(str(client.base_url) + "nowhere", timeout=10)
    assert response.status_code == 404 and "no such endpoint" in response.json()["error"]["message"]


def test_tiny_temperature_is_greedy_and_harms_no_other_request(live):
    """logits / 1e-40 overflow float32: NaN probabilities would fail the whole step, every client's request
    in it. The server samples such a temperature greedily, its limit."""
    def body(temperature, max_tokens):
        return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": temperature,
                "ignore_eos": True}

    async def both():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            other = asyncio.create_task(c.post("/v1/completions", json=body(0, 40)))
            await asyncio.sleep(0.1)
            return await c.post("/v1/completions", json=body(1e-40, 4)), await other

    tiny, other = asyncio.run(asyncio.wait_for(both(), timeout=45))
    assert tiny.status_code == 200 and other.status_code == 200, (tiny.text, other.text)
    greedy = httpx.post(live.url + "/v1/completions", json=body(0, 4), timeout=30).json()["choices"][0]["text"]
    assert tiny.json()["choices"][0]["text"] == greedy


def test_a_huge_prompt_does_not_stall_other_clients(live):
    """A prompt of megabytes takes the tokenizer a second or more; the other clients are answered meanwhile."""
    async def both():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            start = time.monotonic()
            huge = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": "hello world " * 200_000}))
            await asyncio.sleep(0.2)
            health = await c.get("/health")
            health_s = time.monotonic() - start
            huge_pending = not huge.done()          # still being tokenized when /health came back
            return health, health_s, huge_pending, await huge, time.monotonic() - start

    health, health_s, huge_pending, huge, huge_s = asyncio.run(asyncio.wait_for(both(), timeout=45))
    assert health.status_code == 200
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded", huge.text
    # Only a slow tokenization can stall anyone: when it took over a second, /health must have been answered
    # while it ran, well before the huge request's answer (a stalled server answers both at once). The bound
    # is relative to the tokenization's own time, so a loaded machine does not make it flaky.
    if huge_s > 1.0:
        assert huge_pending and huge_s - health_s > 0.25 * (huge_s - 0.2), \
            f"/health came back after {health_s:.2f} s, the huge prompt's answer after {huge_s:.2f} s"


def test_engine_failure_fails_its_requests_not_the_server(live, client, monkeypatch):
    runner = live.app.state.engine.core.runner
    monkeypatch.setattr(runner, "execute", fail_once(runner.execute, "a kernel fell over"))    # the loop's forward pass
    with pytest.raises(openai.InternalServerError, match="a kernel fell over"):
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert wait_idle(live)["yaie_kv_cache_blocks_used"] == 0
    assert client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4).choices[0].text


def test_server_survives(live, client):
    """Last: after everything above, the server answers and holds no blocks."""
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    assert client.completions.create(model=MODEL, prompt="The sun", max_tokens=4).usage.completion_tokens >= 1
    m = wait_idle(live)
    assert m["yaie_kv_cache_blocks_used"] == 0


# ----------------------------------------------------------------------------- yaie serve: the engine in a process
def start_server(*options: str) -> tuple[subprocess.Popen, str]:
    """``python -m yaie.server`` on a free local port, as a user starts it (the engine in a child process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "yaie.server", "--port", str(port), "--block-size", str(BLOCK_SIZE),
                             "--num-blocks", str(NUM_BLOCKS), *options], env=dict(os.environ, YAIE_SOLUTIONS="all"))
    return proc, f"http://127.0.0.1:{port}"


def wait_until_healthy(proc: subprocess.Popen, url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, f"yaie serve exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"yaie serve did not answer /health in {seconds:.0f} s"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


def interrupt(proc: subprocess.Popen, seconds: float = 30) -> int:
    """Ctrl-C for a ``yaie serve`` process: its exit code (killed and raised after ``seconds``)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_yaie_serve_runs_the_engine_in_a_process_of_its_own(reference):
    """``python -m yaie.server`` as a user starts it: the engine loop in a child process, the same answers."""
    proc, url = start_server("--log-level", "warning")
    try:
        wait_until_healthy(proc, url)
        seed = fresh_seed()
        with openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0) as client:
            got = client.completions.create(model=MODEL, prompt="Tom had a red kite.", max_tokens=12,
                                            temperature=0.8, seed=seed)
            want = generate(reference, "Tom had a red kite.", defaults(reference, max_tokens=12, temperature=0.8,
                                                                       seed=seed))[0]
            assert got.choices[0].text == want.text, f"seed={seed}"
            stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            for _, chunk in zip(range(3), stream):
                assert chunk.choices[0].finish_reason is None
            stream.close()
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model=MODEL, prompt="", max_tokens=4)
            scored = client.completions.create(model=MODEL, prompt="Tom had a red kite.", max_tokens=4,
                                               temperature=0, logprobs=1)          # through the engine process
            lp = scored.choices[0].logprobs
            assert len(lp.token_logprobs) == scored.usage.completion_tokens > 0
            assert all(x <= 0 and len(top) == 1 for x, top in zip(lp.token_logprobs, lp.top_logprobs))
        deadline = time.monotonic() + 5
        while True:
            m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
            if m["yaie_requests_running"] == 0:
                break
            assert time.monotonic() < deadline, f"the dropped stream still runs: {m}"
            time.sleep(0.05)
        assert m["yaie_requests_aborted_total"] == 1 and m["yaie_kv_cache_blocks_used"] == 0
        assert m["yaie_requests_finished_total"] == 2
        if Path("/proc").is_dir():          # the engine process dies under the server: 503s that say so
            engine = [pid for pid in child_pids(proc.pid)
                      if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert len(engine) == 1, engine
            os.kill(engine[0], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "/health still says ok 10 s after the engine died"
                time.sleep(0.05)
            response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Tom", "max_tokens": 2},
                                  timeout=10)
            assert response.status_code == 503 and "engine process stopped" in response.json()["error"]["message"]
    finally:
        returncode = interrupt(proc)
    assert returncode == 0


def test_yaie_serve_exits_promptly_with_requests_in_flight():
    """Ctrl-C while a request has minutes of work left: it is cancelled after --timeout-graceful-shutdown,
    the engine process stops with the server, and the exit is clean."""
    proc, url = start_server("--log-level", "critical", "--timeout-graceful-shutdown", "1")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tom ran."}], "n": 64, "ignore_eos": True}
    try:
        wait_until_healthy(proc, url)
        # 64 choices of up to the whole cache each: minutes of work on a CPU.
        slow = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", json=body, timeout=60),
                                daemon=True)
        slow.start()
        deadline = time.monotonic() + 10
        while parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)["yaie_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        engine = child_pids(proc.pid) if Path("/proc").is_dir() else []
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(20)
        assert returncode == 0
        gone_by = time.monotonic() + 10       # a child may still be tearing down when the parent's exit returns
        for pid in engine:
            while running(pid) and time.monotonic() < gone_by:
                time.sleep(0.1)
            assert not running(pid), f"process {pid} of the server outlived it by 10 s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux: /proc/<pid>/stat)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:                      # gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- the Python API's prompts
@pytest.mark.parametrize("prompts", [[3.5], "", [""], [[]], [[1, 2.5]], [True], [None], None, 5, b"abc"],
                         ids=repr)
def test_malformed_prompts_raise_value_error(reference, prompts):
    with pytest.raises(ValueError, match="prompt"):
        reference.generate(prompts, SamplingParams(max_tokens=2))
