"""The server for a class: the API key, the operator's limits, 405s, and the graceful shutdown on SIGTERM.

One app (the bundled model on the CPU, one request running at a time so that others wait) runs in a thread
on a free loopback port with a key and tight limits, and is driven with the real ``openai`` client and with
raw HTTP; each refusal is made while another client's request runs, which must finish with every token it
asked for. Then ``python -m yaie.server`` as an instructor starts it (the engine in a process of its own, the
key from ``YAIE_API_KEY``) gets a SIGTERM with two streams in flight: the short one finishes, the long one
ends with an error event the client reads, new requests get 503, and the process exits within the grace
period and a margin, with no traceback and no process left behind.
"""

from __future__ import annotations

import asyncio
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

from tests.test_server import LiveServer, child_pids, running
from yaie import ops
from yaie.engine import DEFAULT_MODEL, LLM
from yaie.model.testing import single_thread
from yaie.server import create_app
from yaie.server.app import RETRY_AFTER_S, Lifecycle, Limits, parse_prometheus, shutdown_error
from yaie.server.cli import build_parser, check_api_key, exposure_warning, main

MODEL = DEFAULT_MODEL.name
KEY = "class-key-7f3a"
LIMITS = Limits(max_prompt_tokens=24, max_n=4, max_waiting=1)
PROMPT = "Once upon a time, there was a little fox named"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
COUNTED = {"stream": True, "stream_options": {"include_usage": True}, **GREEDY}    # a stream that ends with usage


@pytest.fixture(scope="module")
def live():
    """The app with ``KEY`` and ``LIMITS``; one request runs at a time (``max_num_seqs=1``), the next waits."""
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        ops.reset_auto_fallback()
        llm = LLM(DEFAULT_MODEL, device="cpu", max_num_seqs=1)
        with LiveServer(create_app(llm, api_key=KEY, limits=LIMITS)) as server:
            yield server
        ops.reset_auto_fallback()


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=30, max_retries=0)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


def wait_for(url: str, name: str, value: float, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while metrics(url)[name] != value:
        assert time.monotonic() < deadline, f"{name} did not reach {value} in {seconds} s: {metrics(url)}"
        time.sleep(0.02)


def read_stream(stream) -> tuple[str, int | None, str | None]:
    """A completions stream read to its end: (text, completion_tokens from its usage chunk if it asked for
    one, the last finish_reason)."""
    text, tokens, finish = "", None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, finish


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    return error


# ----------------------------------------------------------------------------- the API key
def test_the_key_is_needed_and_taken(live):
    with client(live.url) as c:
        assert [m.id for m in c.models.list().data] == [MODEL]
        got = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY)
        assert got.usage.completion_tokens == 4
        text, _, finish = read_stream(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                                           **GREEDY))
        assert text == got.choices[0].text and finish == "length"
    with client(live.url, key="not-the-key") as c:
        with pytest.raises(openai.AuthenticationError) as err:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    url = live.url + "/v1/completions"
    for headers in ({}, auth("class-key-7f3b"), auth(KEY + "x"), {"Authorization": "Bearer"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(url, json=body, headers=headers, timeout=10)
        error = assert_openai_error(response, 401, "invalid_api_key")
        assert error["type"] == "invalid_request_error" and response.headers["WWW-Authenticate"] == "Bearer"
        assert ("needs an API key" in error["message"]) == (not headers), error
    assert httpx.post(url, json=body, headers={"Authorization": f"bearer  {KEY}"}, timeout=10).status_code == 200
    # Every other path needs it too (an unknown one gives nothing away); /health and /metrics do not.
    assert_openai_error(httpx.get(live.url + "/v1/nowhere", timeout=10), 401, "invalid_api_key")
    assert httpx.get(live.url + "/v1/nowhere", headers=auth(), timeout=10).status_code == 404
    assert httpx.get(live.url + "/health", timeout=10).json() == {"status": "ok"}
    assert metrics(live.url)["yaie_requests_running"] == 0


# ----------------------------------------------------------------------------- the limits
def test_too_long_a_prompt_and_too_many_choices_get_400_and_disturb_nothing(live):
    with client(live.url) as c:
        running = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, **COUNTED)
        wait_for(live.url, "yaie_requests_running", 1)
        long_prompt = " ".join(["and the fox ran"] * 10)          # more than 24 tokens, far less than the context
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
        assert err.value.code == "prompt_too_long" and "at most 24" in err.value.message
        assert err.value.param == "prompt"
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
        assert err.value.code == "prompt_too_long" and err.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=5)
        assert err.value.param == "n" and "at most 4" in err.value.message
        response = httpx.post(live.url + "/v1/chat/completions", headers=auth(), timeout=10, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5})
        assert assert_openai_error(response, 400, "invalid_value")["param"] == "n"
        text, tokens, finish = read_stream(running)
        assert finish == "length" and tokens == 40, (text, tokens)
        alone = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, **GREEDY)
        assert text == alone.choices[0].text and alone.usage.completion_tokens == 40
        got = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=4, **GREEDY)   # the limit itself
        assert len(got.choices) == 4 and got.usage.completion_tokens == 8


def test_a_full_queue_gets_429_with_retry_after_and_disturbs_nothing(live):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    with client(live.url) as c:
        before = metrics(live.url)["yaie_server_requests_refused_busy_total"]
        first = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=450, **COUNTED)
        wait_for(live.url, "yaie_requests_running", 1)
        second = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **COUNTED)
        wait_for(live.url, "yaie_requests_waiting", 1)       # one waits: the queue (max_waiting=1) is full
        response = httpx.post(live.url + "/v1/completions", json=body, headers=auth(), timeout=10)
        error = assert_openai_error(response, 429, "server_busy")
        assert response.headers["Retry-After"] == str(RETRY_AFTER_S) and "busy" in error["message"]
        with pytest.raises(openai.RateLimitError) as err:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert err.value.code == "server_busy"
        assert metrics(live.url)["yaie_server_requests_refused_busy_total"] == before + 2
        first_text, first_tokens, first_finish = read_stream(first)
        second_text, second_tokens, second_finish = read_stream(second)
        assert first_finish == second_finish == "length" and (first_tokens, second_tokens) == (450, 20)
        assert first_text.startswith(second_text) and len(second_text) > 20, (first_text[:80], second_text)
        wait_for(live.url, "yaie_requests_waiting", 0)
        assert httpx.post(live.url + "/v1/completions", json=body, headers=auth(), timeout=10).status_code == 200


# ----------------------------------------------------------------------------- 405
@pytest.mark.parametrize("method,path,allowed", [("GET", "/v1/completions", "POST"),
                                                 ("PUT", "/v1/chat/completions", "POST"),
                                                 ("POST", "/v1/models", "GET"),
                                                 ("DELETE", f"/v1/models/{MODEL}", "GET")])
def test_a_known_path_with_another_method_gets_405(live, method, path, allowed):
    response = httpx.request(method, live.url + path, headers=auth(), timeout=10)
    error = assert_openai_error(response, 405, "method_not_allowed")
    assert error["message"].startswith(f"method not allowed: {method} {path}"), error
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert allowed in response.headers["Allow"].split(", "), response.headers


# ----------------------------------------------------------------------------- the options
def test_exposure_warning_and_key_checks():
    for host in ("0.0.0.0", "::", "192.168.1.20", "classroom.example.org"):
        warning = exposure_warning(host, None)
        assert warning and "without an API key" in warning and "YAIE_API_KEY" in warning, host
        assert exposure_warning(host, KEY) is None
    for host in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"):
        assert exposure_warning(host, None) is None, host
    assert check_api_key(KEY) is None
    for bad in ("", "two words", "tab\there", "clé"):
        assert check_api_key(bad), bad
    args = build_parser().parse_args([])
    assert (args.max_prompt_tokens, args.max_n, args.max_waiting, args.shutdown_grace) == (None, 64, 256, 5.0)
    assert build_parser().parse_args(["--timeout-graceful-shutdown", "2"]).shutdown_grace == 2.0
    for argv in (["--api-key", ""], ["--api-key", "a b"], ["--max-n", "0"], ["--max-n", "257"],
                 ["--max-waiting", "-1"], ["--max-prompt-tokens", "x"], ["--shutdown-grace", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
    for bad in (dict(max_n=0), dict(max_waiting=1.5), dict(max_prompt_tokens=0), dict(max_n=257)):
        with pytest.raises(ValueError):
            Limits(**bad)


def test_yaie_serve_warns_at_start_when_exposed_without_a_key(tmp_path, monkeypatch, capsys):
    """The warning comes before the model loads (here a folder that is no model: the start fails after it)."""
    no_model = str(tmp_path / "no-model")
    monkeypatch.delenv("YAIE_API_KEY", raising=False)
    assert main(["--host", "0.0.0.0", "--model", no_model]) == 1
    err = capsys.readouterr().err
    assert "WARNING: listening on 0.0.0.0 without an API key" in err and "no-model" in err, err
    for env, argv in (({"YAIE_API_KEY": KEY}, []), ({}, ["--api-key", KEY]), ({"YAIE_API_KEY": KEY}, ["--api-key", "x"])):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert main(["--host", "0.0.0.0", "--model", no_model, *argv]) == 1
        err = capsys.readouterr().err
        assert "WARNING" not in err and "no-model" in err and KEY not in err, err
    monkeypatch.setenv("YAIE_API_KEY", "with space")
    with pytest.raises(SystemExit) as exit_:
        main(["--model", no_model])
    assert exit_.value.code == 2


# ----------------------------------------------------------------------------- SIGTERM on yaie serve
GRACE_S = 4


def test_sigterm_drains_then_ends_the_streams_left_and_exits_cleanly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "yaie.server", "--port", str(port), "--shutdown-grace",
                             str(GRACE_S), "--threads", "1"], stderr=log, stdout=log,
                            env=dict(os.environ, YAIE_SOLUTIONS="all", YAIE_API_KEY=KEY))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"yaie serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, "yaie serve did not answer /health in 60 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401        # the key from YAIE_API_KEY
        whole = []            # a request answered whole, as long as the long stream: a 503 after the grace period
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "n": 4, "ignore_eos": True}
        waiter = threading.Thread(target=lambda: whole.append(httpx.post(url + "/v1/completions", json=body,
                                                                         headers=auth(), timeout=60)), daemon=True)
        with client(url) as c:
            # 32 choices of 400 tokens: far more than the grace period on a CPU (40 s on 2 busy cores).
            long = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, n=32, stream=True, **GREEDY)
            waiter.start()
            short = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **COUNTED)
            first = next(iter(short))
            engine = child_pids(proc.pid) if Path("/proc").is_dir() else []
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            deadline = signalled + 5                             # the signal is taken at the loop's next tick
            while httpx.get(url + "/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "/health still says ok 5 s after SIGTERM"
                time.sleep(0.05)
            with pytest.raises(openai.InternalServerError) as err:                 # no new requests
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert err.value.status_code == 503 and "shutting down" in err.value.message
            text, tokens, finish = read_stream(short)                             # finishes within the grace
            assert finish == "length" and tokens == 8, (first, text, tokens)
            with pytest.raises(openai.APIError, match="shutting down") as err:     # ended: an error event
                read_stream(long)
            assert err.value.body["code"] == "unavailable"
            waiter.join(15)
            assert whole and f"did not finish within its grace period ({GRACE_S} s)" in assert_openai_error(
                whole[0], 503, "unavailable")["message"]
        returncode = proc.wait(GRACE_S + 15)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log.seek(0)
    stderr = log.read()
    assert returncode == 0, stderr
    assert GRACE_S - 0.5 < took < GRACE_S + 10, (took, stderr)
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert "shutting down" in stderr and KEY not in stderr, stderr
    gone_by = time.monotonic() + 10          # a child may still be tearing down when the parent's exit returns
    for pid in engine:
        while running(pid) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not running(pid), f"process {pid} of the server outlived it by 10 s"


def test_drain_waits_for_the_requests_in_flight_and_a_second_signal_cuts_it_short():
    """:meth:`Lifecycle.drain` on its own: nothing in flight, it returns at once; a request that finishes
    within the grace period is not ended; one that does not is ended at once on ``cut_short`` (a second
    SIGTERM or Ctrl-C), however long the grace period."""
    async def scenario():
        quick = Lifecycle(grace_s=30)
        started = time.monotonic()
        await quick.drain()
        assert quick.draining and not quick.ending and time.monotonic() - started < 0.5

        patient = Lifecycle(grace_s=5)
        patient.enter()
        patient.enders.add(lambda: pytest.fail("a request that finished in the grace period was ended"))
        asyncio.get_running_loop().call_later(0.2, patient.leave)
        started = time.monotonic()
        await patient.drain()
        assert not patient.ending and 0.15 < time.monotonic() - started < 3

        cut = Lifecycle(grace_s=30)
        ended = []
        cut.enter()
        cut.enders.add(lambda: (ended.append(True), cut.leave()))
        asyncio.get_running_loop().call_later(0.2, cut.cut_short)
        started = time.monotonic()
        await cut.drain()
        assert cut.ending and ended == [True] and cut.in_flight == 0 and time.monotonic() - started < 3
        assert "cut short" in shutdown_error(cut).message and "30 s" in shutdown_error(Lifecycle(30)).message

    asyncio.run(scenario())
