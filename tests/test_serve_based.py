"""Serving the constant-state models, Based (lesson 08) and telescoping (lesson 07), behind ``yaie serve``.

Through the real ``openai`` client against a live server on 127.0.0.1 over the tiny Based model (two rows,
more requests than rows), and ``yaie serve`` in its own process: the answers equal ``LLM.generate``'s. The
engine core over these models (:class:`yaie.engine.row_runner.RowRunner`), step by step: ``tests/test_row_engine.py``.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.helpers import fail_once
from tests.test_server import (LiveServer, concurrent_streams, interrupt, metrics, start_server, wait_idle,
                               wait_until_healthy)
from tests.test_row_engine import BASED, PROMPTS, ROWS, generate, greedy, reference  # noqa: F401 (a fixture)
from yaie import ops
from yaie.engine import LLM, SamplingParams
from yaie.model.testing import fresh_seed, single_thread
from yaie.server import create_app
from yaie.server.app import parse_prometheus


# ----------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def live():
    """``yaie serve``'s app over the tiny Based model, two rows, in a thread on a free loopback port."""
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        ops.reset_auto_fallback()
        llm = LLM(BASED, device="cpu", max_num_seqs=ROWS)
        with LiveServer(create_app(llm)) as server:
            yield server
        ops.reset_auto_fallback()


def test_concurrent_streams_beyond_the_rows_equal_generate(live, reference):
    """Five streams at once, greedy and seeded, through two rows: all finish, each as ``LLM.generate``."""
    base = fresh_seed()
    temperatures = [0, 0.8, 0, 0.8, 0.8]
    server_params = [dict(max_tokens=10, temperature=t, seed=base + i) for i, t in enumerate(temperatures)]
    want = generate(reference["based"], PROMPTS,
                    [reference["based"].default_sampling_params(**p) for p in server_params])
    before = metrics(live)
    assert before["yaie_kv_cache_blocks_total"] == ROWS                 # a row per sequence

    got = concurrent_streams(live, BASED.name, PROMPTS, server_params)
    for i, ((text, finish), w) in enumerate(zip(got, want)):
        assert text == w.text, f"seed={base + i}: stream {i} differs from LLM.generate:\n{text!r}\n{w.text!r}"
        assert finish == w.outputs[0].finish_reason
    after = wait_idle(live)
    assert after["yaie_requests_finished_total"] - before["yaie_requests_finished_total"] == len(PROMPTS)
    assert after["yaie_kv_cache_blocks_used"] == 0


def test_dropped_stream_frees_its_row_and_the_others_go_on(live, reference):
    """A client leaves mid-stream while another streams beside it and a third waits for a row: the row is
    freed at once (the waiting one takes it), and the other two answer as ``LLM.generate``."""
    before = metrics(live)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = generate(reference["based"], PROMPTS[1:3], params)
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=30, max_retries=0) as client:
        dropped = client.completions.create(model=BASED.name, prompt=PROMPTS[0], max_tokens=2000, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        for _, chunk in zip(range(3), dropped):
            assert chunk.choices[0].finish_reason is None

        async def others():
            async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", timeout=30,
                                          max_retries=0) as c:
                calls = [c.completions.create(model=BASED.name, prompt=p, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True}) for p in PROMPTS[1:3]]
                return await asyncio.wait_for(asyncio.gather(*calls), timeout=45)

        async def both():
            task = asyncio.create_task(others())
            await asyncio.sleep(0.3)                     # they run (one in a row, one waiting) ...
            dropped.close()                              # ... when the first client hangs up
            return await task

        got = asyncio.run(both())
    assert [g.choices[0].text for g in got] == [w.text for w in want]
    after = wait_idle(live)
    assert after["yaie_requests_aborted_total"] == before["yaie_requests_aborted_total"] + 1
    assert after["yaie_kv_cache_blocks_used"] == 0
    assert after["yaie_generation_tokens_total"] - before["yaie_generation_tokens_total"] < 1000
    core = live.app.state.engine.core
    assert core.requests == {} and core.scheduler.running == [] and core.logprobs == {}


def test_logprobs_and_bad_requests(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=30, max_retries=0) as client:
        scored = client.completions.create(model=BASED.name, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                           logprobs=2, extra_body={"ignore_eos": True})
        lp = scored.choices[0].logprobs
        assert len(lp.token_logprobs) == scored.usage.completion_tokens == 5
        assert all(x <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(x)
                   for x, top in zip(lp.token_logprobs, lp.top_logprobs))
        config = live.app.state.llm.config
        context = config.max_position_embeddings
        for prompt, code in (([3] * context, "context_length_exceeded"), ([5, config.vocab_size], "invalid_value"),
                             ("", "invalid_value")):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=BASED.name, prompt=prompt, max_tokens=4)
            assert err.value.body["code"] == code
        chat = client.chat.completions.create(model=BASED.name, messages=[{"role": "user", "content": "Tom ran."}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens <= 4
    assert live.app.state.engine.alive


def test_engine_failure_fails_its_requests_and_the_rows_serve_on(live, reference, monkeypatch):
    """A step that fails (a prefill here) fails the requests in flight, not the server; their rows are
    freed, and the next requests answer as ``LLM.generate``."""
    rows = live.app.state.engine.core.runner.rows
    monkeypatch.setattr(rows, "prefill", fail_once(rows.prefill, "a kernel fell over"))
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=30, max_retries=0) as client:
        with pytest.raises(openai.InternalServerError, match="a kernel fell over"):
            client.completions.create(model=BASED.name, prompt=PROMPTS[0], max_tokens=4)
        assert wait_idle(live)["yaie_kv_cache_blocks_used"] == 0
        got = client.completions.create(model=BASED.name, prompt=PROMPTS[2], max_tokens=9, temperature=0)
    want = generate(reference["based"], PROMPTS[2], reference["based"].default_sampling_params(max_tokens=9,
                                                                                               temperature=0))
    assert got.choices[0].text == want[0].text


def test_yaie_serve_serves_the_based_model(reference):
    """``python -m yaie.server --model tiny-based`` as a user starts it (the engine in a process of its own)."""
    proc, url = start_server("--model", str(BASED), "--device", "cpu", "--max-num-seqs", str(ROWS),
                             "--log-level", "warning")
    try:
        wait_until_healthy(proc, url)
        seed = fresh_seed()
        with openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0) as client:
            got = client.completions.create(model=BASED.name, prompt=PROMPTS[1], max_tokens=12, temperature=0.8,
                                            seed=seed)
        want = generate(reference["based"], PROMPTS[1],
                        reference["based"].default_sampling_params(max_tokens=12, temperature=0.8, seed=seed))[0]
        assert got.choices[0].text == want.text, f"seed={seed}"
        m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
        assert m["yaie_kv_cache_blocks_total"] == ROWS and m["yaie_requests_finished_total"] == 1
    finally:
        returncode = interrupt(proc)
    assert returncode == 0
